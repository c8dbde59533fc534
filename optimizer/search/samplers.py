"""The sampler a study searches with, and what makes it cost time per trial.

TPE (multivariate, grouped for the conditional knobs, constant liar for a batch in flight)
is the default; ``random`` and ``nsga2`` are the alternatives a spec may name.

Optuna's TPE rebuilds its densities from every finished trial on each ask, so an ask at
trial 1,000 costs about seven times one at trial 100, more than the engine's replay of a
short trace. ``tpe`` therefore builds them from a bounded history once a study has more than
``KEEP_BEST + KEEP_LATEST + KEEP_SPREAD`` (525) finished trials: the 25 best feasible ones
(TPE's good set, which never holds more than 25 with one objective), the latest 300 and 200
spread evenly over the older ones (so the bad set still covers what the search tried early),
with the good set's size taken from the whole history as Optuna's would be. Up to there it
asks exactly what Optuna's TPE asks; past it an ask costs the same at trial 5,000 as at 525.
``tpe-full`` is Optuna's TPE over the whole history. ``benchmarks/search_quality.py --part
samplers`` compares them by the best goodput found per second of search.
"""

from __future__ import annotations

import bisect
import math
import warnings
from collections.abc import Container, Sequence

import numpy as np
import optuna
from optuna.samplers._tpe.sampler import default_gamma, default_gamma_multiobjective
from optuna.study import StudyDirection
from optuna.study._multi_objective import _fast_non_domination_rank
from optuna.trial import FrozenTrial, TrialState
from scipy.special import log_ndtr

from optimizer.search.spec import StudySpec

KEEP_BEST = 25
KEEP_LATEST = 300
KEEP_SPREAD = 200


def make_sampler(spec: StudySpec, seed: int | None) -> optuna.samplers.BaseSampler:
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if spec.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(20, spec.batch_size))
    vectorise_tpe_log_ndtr()
    options = {"seed": seed, "multivariate": True, "group": True, "constant_liar": True,
               "n_startup_trials": min(10, max(4, spec.trials // 10))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if spec.sampler == "tpe-full":
            return optuna.samplers.TPESampler(**options)
        return BoundedHistoryTPESampler(keep_best=KEEP_BEST, keep_latest=KEEP_LATEST, keep_spread=KEEP_SPREAD,
                                        **options)


class BoundedHistoryTPESampler(optuna.samplers.TPESampler):
    """TPE whose densities come from a bounded history (``BoundedHistory``).

    Every entry point TPE reads the study through gets a view of it cut to that history;
    the trials TPE records into (``before_trial``, ``after_trial``) are the study's own.
    With one objective the good set's size comes from every finished trial, as Optuna's
    TPE sizes it (at most 25, all among the kept best); with several, from the view.
    """

    def __init__(self, *, keep_best: int, keep_latest: int, keep_spread: int = 0, **tpe_options) -> None:
        super().__init__(**tpe_options)
        self._history = BoundedHistory(keep_best, keep_latest, keep_spread)
        self._objectives = 1
        # Optuna deprecates the ``gamma`` argument (4.9) but still reads the attribute; an
        # Optuna without it sizes the good set from the view, which only makes it smaller
        self._gamma = self._good_set_size

    def _good_set_size(self, n: int) -> int:
        if self._objectives > 1:
            return default_gamma_multiobjective(n)
        return default_gamma(max(n, self._history.finished))

    def _view(self, study: optuna.Study) -> _StudyView:
        self._objectives = len(study.directions)
        return _StudyView(study, self._history)

    def infer_relative_search_space(self, study, trial):
        return super().infer_relative_search_space(self._view(study), trial)

    def sample_relative(self, study, trial, search_space):
        return super().sample_relative(self._view(study), trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return super().sample_independent(self._view(study), trial, param_name, param_distribution)


class BoundedHistory:
    """Which finished trials a bounded-history sampler sees: the ``keep_best`` best feasible
    complete ones (by value; by non-domination rank, then the first value, with several
    objectives), the ``keep_latest`` latest and ``keep_spread`` spread evenly over the older
    ones, in trial order; trials still running or waiting are always seen (the constant liar
    counts them). With no more finished trials than the three bounds together, every trial
    is seen.

    Finished trials never change, so each is ranked once, when first seen; a call then costs
    one pass over the list it is given, with no per-trial Python work beyond a set lookup.
    """

    def __init__(self, keep_best: int, keep_latest: int, keep_spread: int = 0) -> None:
        self.keep_best, self.keep_latest, self.keep_spread = keep_best, keep_latest, keep_spread
        self._finished: list[int] = []  # numbers of the finished trials seen, sorted
        self._seen: set[int] = set()
        self._ranked: list[tuple[tuple[float, ...], int]] = []  # (loss, number) of the feasible ones
        self._kept: set[int] = set()
        self._dirty = False

    @property
    def finished(self) -> int:
        """Finished (complete or pruned) trials seen so far."""
        return len(self._finished)

    def select(self, study: optuna.Study, trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
        self._see(study, trials)
        if len(self._finished) <= self.keep_best + self.keep_latest + self.keep_spread:
            return list(trials)
        kept = self._kept_numbers(study)
        return [t for t in trials if t.number in kept or t.state is _RUNNING or t.state is _WAITING]

    def _see(self, study: optuna.Study, trials: Sequence[FrozenTrial]) -> None:
        seen = len(self._finished)
        for t in trials:
            if (t.state is _COMPLETE or t.state is _PRUNED) and t.number not in self._seen:
                self._seen.add(t.number)
                bisect.insort(self._finished, t.number)
                loss = _loss(study, t)
                if loss is not None:
                    bisect.insort(self._ranked, (loss, t.number))
        self._dirty |= len(self._finished) != seen

    def _kept_numbers(self, study: optuna.Study) -> set[int]:
        if self._dirty:
            best = [n for _, n in self._ranked[:self.keep_best]]
            if len(study.directions) > 1 and len(self._ranked) > self.keep_best:
                losses = np.array([loss for loss, _ in self._ranked])
                order = np.lexsort((losses[:, 0], _fast_non_domination_rank(losses)))  # the last key sorts first
                best = [self._ranked[i][1] for i in order[:self.keep_best]]
            cut = len(self._finished) - self.keep_latest
            older, latest = self._finished[:cut], self._finished[cut:]
            spread = [older[i] for i in np.linspace(0, len(older) - 1, min(self.keep_spread, len(older))).astype(int)]
            self._kept = set(latest) | set(best) | set(spread)
            self._dirty = False
        return self._kept


def _loss(study: optuna.Study, trial: FrozenTrial) -> tuple[float, ...] | None:
    """The trial's values to minimise, or None where it cannot be among the best."""
    if trial.state is not _COMPLETE or any(c > 0 for c in trial.constraints.values()):
        return None
    if trial.values is None or any(math.isnan(v) for v in trial.values):
        return None
    return tuple(v if d == StudyDirection.MINIMIZE else -v for v, d in zip(trial.values, study.directions, strict=True))


_COMPLETE, _PRUNED, _RUNNING, _WAITING = TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING


class _StudyView:
    """A study whose trial lists are cut to what a ``BoundedHistory`` keeps; everything else
    (directions, storage, the ids TPE checks) is the study's own."""

    def __init__(self, study: optuna.Study, history: BoundedHistory) -> None:
        self._study, self._history = study, history

    def __getattr__(self, name: str):
        return getattr(self._study, name)

    def _get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None,
                    use_cache: bool = False) -> list[FrozenTrial]:
        trials = self._study._get_trials(deepcopy=deepcopy, states=states, use_cache=use_cache)
        return self._history.select(self._study, trials)

    def get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        return self._get_trials(deepcopy=deepcopy, states=states)

    @property
    def trials(self) -> list[FrozenTrial]:
        return self.get_trials()


def vectorise_tpe_log_ndtr() -> bool:
    """Put ``scipy.special.log_ndtr`` in place of TPE's scalar-loop log-CDF; whether it is there.

    An Optuna without that private function (a later release may have moved or fixed it)
    is left as it is: its TPE is then only slower, never different.
    """
    from optuna.samplers._tpe import _truncnorm

    if not callable(getattr(_truncnorm, "_log_ndtr", None)):
        return False
    _truncnorm._log_ndtr = log_ndtr
    return True
