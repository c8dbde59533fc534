"""The TPE sampler with scipy's vectorised log-CDF searches exactly as Optuna's own."""

from types import SimpleNamespace

import numpy as np
import optuna
import pytest
from optuna.samplers._tpe import _truncnorm

from optimizer.search.samplers import make_sampler, vectorise_tpe_log_ndtr

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
