"""Run-folder outputs: choosing the recommendation, gains, trials.parquet, capacity from a sweep."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import optuna
import polars as pl
import pytest

from optimizer.outputs.frame import trials_frame
from optimizer.outputs.measure import sweep_scales
from optimizer.outputs.runfolder import write_run_outputs
from optimizer.outputs.summary import gains, redact_url
from optimizer.outputs.trials import (
    OutputError,
    baseline_trials,
    find_trial,
    select_best,
    trial_config,
)
from policies.config import KNOBS, PolicyConfig
from policies.engines import EngineContext
from policies.engines import preset as engine_preset

H100 = EngineContext("h100", 80.0)


def preset(name: str) -> PolicyConfig:
    return engine_preset(name, H100)


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


def test_sweep_scales_bracket_every_capacity_and_include_the_trace_rate():
    scales = sweep_scales([0.4, 3.0, math.nan, 0.0])
    assert scales[0] == pytest.approx(0.1) and scales[-1] == pytest.approx(6.0)
    assert 1.0 in scales and np.all(np.diff(scales) > 0)
    geometric = scales[scales != 1.0]
    assert np.allclose(geometric[1:] / geometric[:-1], geometric[1] / geometric[0], rtol=1e-4)
    assert sweep_scales([])[0] == pytest.approx(0.125) and sweep_scales([])[-1] == pytest.approx(2.0)


def test_storage_passwords_never_reach_the_summary():
    assert redact_url("postgresql+psycopg2://tuner:s3cr%40t@db:5432/st") == "postgresql+psycopg2://tuner:***@db:5432/st"
    assert redact_url("sqlite:///x.db") == "sqlite:///x.db"


# -- the whole run folder, on the real engine and a small synthetic trace -----------------------


def _run(tmp_path, objective: str):
    from costmodels.costmodel import CostModel
    from optimizer.search.evaluate import Evaluator
    from optimizer.search.objective import Bounds, record
    from optimizer.search.spec import load_spec
    from optimizer.search.targets import context_of
    from tests.optimizer.test_outputs_fixtures import make_trace

    rng = np.random.default_rng(7)
    n = 400
    trace = make_trace(np.cumsum(rng.exponential(0.04, n)), rng.integers(100, 1500, n), rng.integers(2, 120, n))
    trace_file = tmp_path / "trace.csv"
    trace_file.write_text("stand-in bytes for the provenance hash\n")
    cost_model = CostModel.synthetic(60_000)
    # a model of unknown context (max_model_len 0: whatever the pool holds): Llama's 131072 would not
    # fit this synthetic pool, and this hand-rolled objective does not prune as the study does
    spec = load_spec(trace=trace_file, model="meta-llama/Llama-3.1-8B", gpu="h100", slo="ttft:300,tpot:40",
                     objective=objective, study_name="outputs-test", run_dir=tmp_path / "run", seed=3,
                     context=context_of(cost_model, "h100", context_len=0))
    evaluator = Evaluator(spec, trace=trace, cost_model=cost_model)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["maximize", "minimize"] if objective != "goodput" else ["maximize"],
                                sampler=optuna.samplers.RandomSampler(seed=0))
    baselines = evaluator.baselines()
    for name in baselines:
        study.enqueue_trial({}, user_attrs={"baseline": name})

    def objective_fn(trial):
        name = trial.user_attrs.get("baseline")
        config = baselines[name] if name else spec.search_space.suggest(trial)
        (report,) = evaluator.reports([config])
        return record(trial, spec, config, report, Bounds(rejected_fraction=0.01))

    study.optimize(objective_fn, n_trials=14)
    return write_run_outputs(spec.run_dir, study, spec, evaluator), study, spec


def test_write_run_outputs_fills_the_run_folder(tmp_path):
    outputs, study, spec = _run(tmp_path, "goodput")
    run = spec.run_dir
    for name in ("policy.toml", "summary.json", "trials.parquet", "capacity-review.md", "capacity-review.html"):
        assert (run / name).stat().st_size > 0, name
    # a what-if study (the default target) writes servetune's policy only, never an engine's file
    assert not any((run / name).exists() for name in ("vllm.yaml", "sglang.yaml", "bench-vllm.sh", "trace.jsonl"))
    for stem in ("pareto", "rate-sweep", "latency-cdf", "importance"):
        assert (run / "plots" / f"{stem}.png").read_bytes()[:4] == b"\x89PNG", stem
        assert "<svg" in (run / "plots" / f"{stem}.svg").read_text(), stem

    summary = json.loads((run / "summary.json").read_text())
    answer = summary["answer"]
    # the recommendation is the robust choice (a candidate, or the better default kept), not the in-sample best
    best = next(t for t in study.trials if t.number == summary["best"]["trial"])
    if answer["keep_defaults"]:
        assert best.user_attrs["baseline"] == answer["reference_default"] and answer["knobs_changed"] == []
    else:
        assert best.number == answer["trial"] and "baseline" not in best.user_attrs
    assert summary["best"]["values"]["value"] == pytest.approx(best.values[0])
    # policy.toml differs from the default it is measured against in the knobs named, and no other
    reference = PolicyConfig.from_mapping(summary["baselines"][answer["reference_default"]]["config"])
    chosen = PolicyConfig.from_mapping(summary["best"]["config"])
    assert {k.name for k in KNOBS if getattr(chosen, k.name) != getattr(reference, k.name)} == \
        {k["knob"] for k in answer["knobs_changed"]}
    assert summary["recommendation"]["file"] == "policy.toml" and summary["recommendation"]["what_if"] is True
    assert set(summary["baselines"]) == {"vllm-default", "sglang-default"}
    vllm = summary["baselines"]["vllm-default"]
    assert vllm["trial"] == 0
    mine, theirs = summary["best"]["report"]["weighted_goodput"], vllm["report"]["weighted_goodput"]
    assert vllm["gains"]["weighted_goodput"]["best"] == pytest.approx(mine)
    assert vllm["gains"]["weighted_goodput"]["baseline"] == pytest.approx(theirs)
    assert mine >= theirs  # the baselines are trials too, so the best is at least as good
    prov = summary["provenance"]
    assert prov["trace"]["sha256"] == hashlib.sha256((tmp_path / "trace.csv").read_bytes()).hexdigest()
    assert prov["cost_model"]["name"] == "synthetic-60000tok" and prov["seed"] == 3
    assert prov["versions"]["optuna"] == optuna.__version__
    # which calibration the figures rest on, and its error: the one tune's bands take (a synthetic model has no entry)
    stated = prov["cost_model"]["calibration"]["stated_error"]
    assert stated.startswith("uncalibrated (no calibration entry)") and stated == answer["model_error"]["stated"]
    cap = summary["best"]["capacity"]  # GPUs from the fleet sizing, not from the rate capacity
    assert cap["rate_scale"] > 0 and cap["gpus_needed"] == cap["sizing"]["deploy"]["gpus"]
    assert cap["sizing"]["deploy"]["attainment"] >= 0.9

    assert PolicyConfig.from_toml(run / "policy.toml") == PolicyConfig.from_mapping(summary["best"]["config"])
    frame = pl.read_parquet(run / "trials.parquet")
    assert frame.height == 14 and frame["baseline"].to_list()[:2] == ["vllm-default", "sglang-default"]
    review = (run / "capacity-review.md").read_text()
    label = "policy.toml (defaults kept)" if answer["keep_defaults"] else f"policy.toml (trial {best.number})"
    assert label in review and "![Pareto front](plots/pareto.png)" in review
    assert "## What to deploy" in review and "![SLO attainment and goodput vs GPUs](plots/gpus.png)" in review
    assert "GPU(s)" in review and "## What limits the best config" in review
    assert "Cost model: no calibration; its error: uncalibrated" in review
    assert outputs.files["summary.json"] == run / "summary.json"


def test_write_run_outputs_plots_both_objectives_of_a_multi_objective_study(tmp_path):
    outputs, study, spec = _run(tmp_path, "goodput-ttft")
    summary = outputs.summary
    assert summary["directions"] == ["maximize", "minimize"]
    assert set(summary["best"]["values"]) == set(summary["metric_names"]) and len(summary["metric_names"]) == 2
    assert "objective_gains" in summary["baselines"]["vllm-default"]
    svg = (spec.run_dir / "plots" / "pareto.svg").read_text()
    assert "Pareto front" in svg and "baseline: vllm-default" in svg
