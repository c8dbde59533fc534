"""The sampler a study searches with, and what makes it cost time per trial.

TPE (multivariate, grouped for the conditional knobs, constant liar for a batch in flight)
is the default; ``random`` and ``nsga2`` are the alternatives a spec may name.

Optuna 5's TPE scores every candidate against every kernel of an integer knob (a discrete
distribution) through the normal log-CDF, which it evaluates one Python scalar at a time
(``np.frompyfunc`` over ``_truncnorm._log_ndtr_single``, an open upstream issue, optuna#5478).
At a few hundred trials that is most of a study's wall time, and it grows with every trial.
``scipy.special.log_ndtr`` is the same function vectorised (equal within 1e-12 absolute on
[-60, 60], and more accurate at the tails Optuna approximates); it is put in Optuna's place
once, before the first TPE sampler is built. The search is unchanged: the same seed asks the
same trials (``tests/optimizer/test_samplers.py``).
"""

from __future__ import annotations

import warnings

import optuna
from scipy.special import log_ndtr

from optimizer.search.spec import StudySpec


def make_sampler(spec: StudySpec, seed: int | None) -> optuna.samplers.BaseSampler:
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if spec.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(20, spec.batch_size))
    vectorise_tpe_log_ndtr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True,
                                          n_startup_trials=min(10, max(4, spec.trials // 10)))


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
