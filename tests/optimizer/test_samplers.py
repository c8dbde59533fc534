"""The study's TPE: scipy's vectorised log-CDF searches exactly as Optuna's own, and a bounded
history asks as Optuna's TPE does until the bound, then sees only the best and the latest trials."""

from types import SimpleNamespace

import numpy as np
import optuna
import pytest
from optuna.samplers._tpe import _truncnorm

from optimizer.search.samplers import (
    BoundedHistory,
    BoundedHistoryTPESampler,
    make_sampler,
    vectorise_tpe_log_ndtr,
)

OPTUNA_LOG_NDTR = np.frompyfunc(_truncnorm._log_ndtr_single, 1, 1)


def test_the_vectorised_log_cdf_is_optunas_within_rounding():
    x = np.concatenate([np.linspace(-60.0, 60.0, 24_001), [-1e3, -20.0, -6.0, 0.0, 6.0, 1e3]])
    assert vectorise_tpe_log_ndtr()
    ours = _truncnorm._log_ndtr(x)
    theirs = OPTUNA_LOG_NDTR(x).astype(float)
    assert ours.dtype == np.float64 and np.isfinite(ours).all()
    np.testing.assert_allclose(ours, theirs, rtol=1e-7, atol=1e-11)


def _asked(seed: int, n: int) -> list[dict]:
    """Params a grouped, multivariate, constant-liar TPE asks on integer knobs with a gate."""
    spec = SimpleNamespace(sampler="tpe", trials=n, batch_size=2)  # what make_sampler reads of a StudySpec
    study = optuna.create_study(direction="maximize", sampler=make_sampler(spec, seed))
    for _ in range(n):
        trial = study.ask()
        budget = trial.suggest_int("budget", 256, 16384, log=True)
        seqs = trial.suggest_int("seqs", 1, 1024)
        value = -abs(budget - 3000) / 3000 - abs(seqs - 300) / 300
        if trial.suggest_categorical("gate", [False, True]):
            value += trial.suggest_int("threshold", 64, 8192) / 8192
        study.tell(trial, value)
    return [t.params for t in study.trials]


def test_the_search_asks_the_same_trials_with_the_vectorised_log_cdf(monkeypatch):
    patched = _asked(seed=3, n=60)
    monkeypatch.setattr(_truncnorm, "_log_ndtr", lambda a: OPTUNA_LOG_NDTR(a).astype(float))
    monkeypatch.setattr("optimizer.search.samplers.vectorise_tpe_log_ndtr", lambda: False)
    assert _asked(seed=3, n=60) == patched


def test_an_optuna_without_the_scalar_log_cdf_is_left_alone(monkeypatch):
    monkeypatch.delattr(_truncnorm, "_log_ndtr")
    assert not vectorise_tpe_log_ndtr()
    assert not hasattr(_truncnorm, "_log_ndtr")


@pytest.fixture(autouse=True)
def _restore_optunas_function(monkeypatch):
    monkeypatch.setattr(_truncnorm, "_log_ndtr", _truncnorm._log_ndtr)


def _objective(trial) -> float:
    budget = trial.suggest_int("budget", 256, 16384, log=True)
    seqs = trial.suggest_int("seqs", 1, 1024)
    value = -abs(budget - 3000) / 3000 - abs(seqs - 300) / 300
    if trial.suggest_categorical("gate", [False, True]):
        value += trial.suggest_int("threshold", 64, 8192) / 8192
    return value


def _tpe(bounded: bool, seed: int = 5):
    options = dict(seed=seed, multivariate=True, group=True, constant_liar=True, n_startup_trials=5)
    if bounded:
        return BoundedHistoryTPESampler(keep_best=4, keep_latest=6, keep_spread=2, **options)
    return optuna.samplers.TPESampler(**options)


def test_a_bounded_history_asks_what_optunas_tpe_asks_until_the_bound():
    asked = {}
    for bounded in (True, False):
        study = optuna.create_study(direction="maximize", sampler=_tpe(bounded))
        study.optimize(_objective, n_trials=20)
        asked[bounded] = [t.params for t in study.trials]
    assert asked[True][:13] == asked[False][:13]  # 12 finished = 4 best + 6 latest + 2 spread: the whole history
    assert asked[True] != asked[False]


def test_tpe_past_the_bound_sees_the_best_the_latest_and_a_spread(monkeypatch):
    from optuna.samplers._tpe import sampler as tpe

    seen, good = [], []
    split = tpe._split_trials

    def recording(study, trials, n_below):
        seen.append(sorted(t.number for t in trials))
        good.append(n_below)
        return split(study, trials, n_below)

    monkeypatch.setattr(tpe, "_split_trials", recording)
    study = optuna.create_study(direction="maximize", sampler=_tpe(bounded=True))
    study.optimize(_objective, n_trials=60)
    assert max(len(numbers) for numbers in seen) == 12  # flat: never more than the bound
    finished = study.trials[:59]  # what the last ask saw (its own trial excluded)
    best = sorted(finished, key=lambda t: t.value, reverse=True)[:4]
    assert set(seen[-1]) == {t.number for t in best} | set(range(53, 59)) | {0, 52}  # 0-52 spread by 2
    assert good[-1] == 6  # the good set sized from all 59 finished trials, as Optuna's TPE: ceil(5.9)


def _history(study, rows):
    """Finished trials (values, feasible) added to ``study`` in order; then one running."""
    for values, feasible in rows:
        trial = study.ask()
        trial.set_constraint("c", -1.0 if feasible else 1.0)
        study.tell(trial, values)
    study.ask()
    return study.get_trials(deepcopy=False)


def test_the_best_are_feasible_complete_trials_ranked_as_tpe_ranks_them():
    single = optuna.create_study(direction="minimize")
    rows = [([v], v != 0.0) for v in (5.0, 0.0, 3.0, 1.0, 4.0, 9.0, 8.0, 7.0)]  # 0.0 breaks a constraint
    kept = BoundedHistory(keep_best=2, keep_latest=3).select(single, _history(single, rows))
    assert [t.number for t in kept] == [2, 3, 5, 6, 7, 8]  # best 3.0 and 1.0, latest 5-7, the running trial 8
    assert kept[-1].state == optuna.trial.TrialState.RUNNING

    pareto = optuna.create_study(directions=["maximize", "minimize"])
    rows = [([1.0, 1.0], True), ([3.0, 5.0], True), ([2.0, 9.0], True), ([0.5, 0.1], True),
            ([9.0, 9.0], False), ([0.0, 0.0], True), ([0.0, 0.0], True)]
    kept = BoundedHistory(keep_best=3, keep_latest=2).select(pareto, _history(pareto, rows))
    # the first front is 0, 1 and 3 (2 is dominated by 1; 4 is infeasible); 5 and 6 are the latest
    assert [t.number for t in kept] == [0, 1, 3, 5, 6, 7]
