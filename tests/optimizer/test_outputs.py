"""Run-folder outputs: choosing the recommendation, gains, trials.parquet, capacity from a sweep."""

from __future__ import annotations

import json
import math

import numpy as np
import optuna
import polars as pl
import pytest

from optimizer.outputs import (
    OutputError,
    baseline_trials,
    capacity_from_curve,
    find_trial,
    gains,
    redact_url,
    select_best,
    sweep_scales,
    trial_config,
    trials_frame,
)
from policies.config import PolicyConfig
from policies.presets import preset


def _study(directions, rows) -> optuna.Study:
    """A study whose trials carry the given (values, constraints, user_attrs)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=directions)
    for values, constraints, attrs in rows:
        trial = study.ask()
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        for key, value in constraints.items():
            trial.set_constraint(key, value)
        study.tell(trial, values)
    return study


def test_best_single_objective_is_the_best_feasible_trial():
    study = _study(["maximize"], [
        ([5.0], {"rejected": -0.1}, {"baseline": "vllm-default"}),
        ([9.0], {"rejected": 0.2}, {}),  # best value but rejects too much
        ([7.0], {"rejected": -0.01}, {}),
        ([7.0], {"rejected": -0.5}, {}),  # tie: the earlier trial wins
    ])
    assert select_best(study.trials, ["maximize"]).number == 2
    infeasible = _study(["maximize"], [([1.0], {"c": 1.0}, {}), ([2.0], {"c": 3.0}, {})])
    assert select_best(infeasible.trials, ["maximize"]).number == 1  # none feasible: best of all
    with pytest.raises(OutputError, match="no completed trial"):
        select_best([], ["maximize"])


def test_best_multi_objective_is_on_the_pareto_front_with_most_goodput():
    study = _study(["maximize", "minimize"], [
        ([5.0, 2.0], {}, {}),
        ([8.0, 4.0], {}, {}),
        ([8.0, 3.0], {}, {}),  # dominates trial 1
        ([9.0, 9.0], {"c": 0.5}, {}),  # infeasible
    ])
    assert select_best(study.trials, ["maximize", "minimize"]).number == 2


def test_baselines_found_by_user_attr_and_trials_by_number():
    study = _study(["maximize"], [
        ([1.0], {}, {"baseline": "vllm-default"}),
        ([2.0], {}, {"baseline": "sglang-default"}),
        ([3.0], {}, {}),
    ])
    found = baseline_trials(study.trials)
    assert {k: t.number for k, t in found.items()} == {"vllm-default": 0, "sglang-default": 1}
    assert find_trial(study.trials, 2).number == 2
    with pytest.raises(OutputError, match="no trial 7 in this study"):
        find_trial(study.trials, 7)


def test_trial_config_prefers_the_stored_config_then_the_baseline():
    cfg = PolicyConfig(max_num_seqs=64)
    study = _study(["maximize"], [([1.0], {}, {"config": cfg.to_dict()}),
                                  ([1.0], {}, {"baseline": "vllm-default"}),
                                  ([1.0], {}, {"baseline": "mystery"})])
    presets = {"vllm-default": preset("vllm-default")}
    assert trial_config(study.trials[0], None, presets) == cfg
    assert trial_config(study.trials[1], None, presets) == preset("vllm-default")
    with pytest.raises(OutputError, match="baseline 'mystery'"):
        trial_config(study.trials[2], None, presets)


def test_gains_compare_in_each_metrics_direction():
    best = {"weighted_goodput": 6.0, "request_goodput": 5.0, "token_goodput": 100.0, "slo_attainment": 0.9,
            "p99_ttft_ms": 800.0, "p99_tpot_ms": None}
    base = {"weighted_goodput": 4.0, "request_goodput": 0.0, "token_goodput": 120.0, "slo_attainment": 0.6,
            "p99_ttft_ms": 1000.0, "p99_tpot_ms": 50.0}
    g = gains(best, base)
    assert g["weighted_goodput"] == {"best": 6.0, "baseline": 4.0, "change": pytest.approx(0.5), "better": True}
    assert g["request_goodput"]["change"] is None and g["request_goodput"]["better"] is True
    assert g["token_goodput"]["better"] is False
    assert g["p99_ttft_ms"]["better"] is True and g["p99_ttft_ms"]["change"] == pytest.approx(-0.2)
    assert g["p99_tpot_ms"] == {"best": None, "baseline": 50.0, "change": None, "better": None}


def test_trials_frame_has_values_params_constraints_and_report_columns(tmp_path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["maximize", "minimize"])
    with pytest.warns(optuna.exceptions.ExperimentalWarning):
        study.set_metric_names(["weighted_goodput", "p99_ttft_ms"])
    study.enqueue_trial({"max_num_seqs": 1024, "scheduling_policy": "fcfs"}, user_attrs={"baseline": "vllm-default"})

    def objective(trial):
        seqs = trial.suggest_int("max_num_seqs", 8, 1024, log=True)
        trial.suggest_categorical("scheduling_policy", ["fcfs", "priority"])
        trial.set_constraint("rejected_fraction", seqs / 1024 - 0.5)
        trial.set_user_attr("report", {"weighted_goodput": seqs / 100, "p99_ttft_ms": float("nan"),
                                       "reject_reasons": {"queue_full": 3}})
        return seqs / 100, 1000.0 / seqs

    study.optimize(objective, n_trials=5)
    study.ask()  # a running trial: no values yet
    frame = trials_frame(study.trials, ["weighted_goodput", "p99_ttft_ms"])
    assert frame.height == 6
    assert frame["number"].to_list() == list(range(6))
    assert frame["state"].to_list() == ["COMPLETE"] * 5 + ["RUNNING"]
    assert frame["baseline"].to_list()[:2] == ["vllm-default", None]
    assert frame["params_max_num_seqs"][0] == 1024 and frame["params_scheduling_policy"][0] == "fcfs"
    assert frame["feasible"][0] is False and frame["feasible"][5] is None
    assert frame["constraints_rejected_fraction"][0] == pytest.approx(0.5)
    assert frame["values_weighted_goodput"][0] == pytest.approx(10.24)
    assert frame["values_p99_ttft_ms"][5] is None
    assert json.loads(frame["report_reject_reasons"][0]) == {"queue_full": 3}
    assert frame["report_p99_ttft_ms"].null_count() + frame["report_p99_ttft_ms"].is_nan().sum() == 6
    path = tmp_path / "trials.parquet"
    frame.write_parquet(path)
    assert pl.read_parquet(path).equals(frame)


def test_capacity_from_a_sweep_interpolates_the_crossing():
    scales = np.array([0.5, 1.0, 2.0, 4.0])
    assert capacity_from_curve(scales, np.array([1.0, 0.95, 0.85, 0.2]), 0.9) == (pytest.approx(1.5), False)
    assert capacity_from_curve(scales, np.array([1.0, 1.0, 0.99, 0.95]), 0.9) == (4.0, True)
    assert capacity_from_curve(scales, np.array([0.5, 0.4, 0.1, 0.0]), 0.9) == (0.0, False)
    assert capacity_from_curve(scales[::-1], np.array([0.2, 0.85, 0.95, 1.0]), 0.9)[0] == pytest.approx(1.5)
    # NaN attainment (nothing scored) counts as a miss.
    assert capacity_from_curve(scales, np.array([1.0, np.nan, 0.9, 0.9]), 0.9) == (pytest.approx(0.55), False)


def test_sweep_scales_bracket_every_capacity_and_include_the_trace_rate():
    scales = sweep_scales([0.4, 3.0, math.nan])
    assert scales[0] == pytest.approx(0.1) and scales[-1] == pytest.approx(6.0)
    assert 1.0 in scales and np.all(np.diff(scales) > 0)
    assert sweep_scales([])[-1] == pytest.approx(2.0)


def test_storage_passwords_never_reach_the_summary():
    assert redact_url("postgresql+psycopg2://tuner:s3cr%40t@db:5432/st") == "postgresql+psycopg2://tuner:***@db:5432/st"
    assert redact_url("sqlite:///x.db") == "sqlite:///x.db"
