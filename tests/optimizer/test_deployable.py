"""Deployable recommendations: every figure is the exported file's, read back and simulated.

A study searches one target's space (vLLM, SGLang, or servetune's what-ifs); its run folder
holds that target's file, and the recommendation's report in summary.json, the console and
the bench replay is of that very file.
"""

from __future__ import annotations

import json
import math

import optuna
import pytest

from optimizer.outputs.exports import read_engine_file
from optimizer.outputs.runfolder import write_run_outputs
from optimizer.search.evaluate import Evaluator, split_holdout
from optimizer.search.spec import load_spec
from optimizer.search.study import create_or_resume, enqueue_baselines, run
from optimizer.search.targets import context_of
from policies.config import PolicyConfig
from policies.engines import target
from tests.optimizer.tuning_helpers import burst_cost_model, make_trace, write_csv_trace

optuna.logging.set_verbosity(optuna.logging.WARNING)

TPOT_BOUND = "ttft:60000,tpot:7.05"  # with burst_cost_model: at most 50 decodes per step


def _burst():
    """burst_trace's 200 requests, arriving over 0.2 s (a bench command needs a spread)."""
    return make_trace(200, gap_s=0.001, prompt=10, output=100)


def _tuned(tmp_path, engine: str, trials: int = 24, space=None, holdout: float = 0.0, trace=None):
    trace = trace if trace is not None else _burst()
    cost_model = burst_cost_model()
    spec = load_spec(trace=write_csv_trace(tmp_path / "burst.csv", trace), model="synthetic", gpu="h100",
                     slo=TPOT_BOUND, trials=trials, batch_size=2, run_dir=tmp_path / engine, engine=engine,
                     space=space or {}, holdout=holdout, context=context_of(cost_model, "h100", context_len=0))
    evaluator = Evaluator(spec, trace=trace, cost_model=cost_model)
    study = create_or_resume(spec)
    enqueue_baselines(study, spec, evaluator.baselines())
    run(study, spec, evaluator)
    return spec, evaluator, study, write_run_outputs(spec.run_dir, study, spec, evaluator)


@pytest.mark.parametrize("engine", ["vllm", "sglang", "servetune"])
def test_reported_figures_are_the_exported_files_replay(tmp_path, engine):
    spec, evaluator, _, out = _tuned(tmp_path, engine)
    name = "policy.toml" if engine == "servetune" else f"{engine}.yaml"
    text = (spec.run_dir / name).read_text()
    if engine == "servetune":
        config = PolicyConfig.from_toml(text)
    else:
        config = read_engine_file(target(engine), text, spec.context)
    _, report = evaluator.simulate(config)
    summary = json.loads((spec.run_dir / "summary.json").read_text())
    assert summary["best"]["report"]["weighted_goodput"] == pytest.approx(report.weighted_goodput, rel=1e-12)
    assert out.summary["recommendation"]["file"] == name
    for base, entry in summary["baselines"].items():
        theirs = entry["report"]["weighted_goodput"]
        _, base_report = evaluator.simulate(evaluator.baselines()[base])
        assert theirs == pytest.approx(base_report.weighted_goodput, rel=1e-12)
    if engine != "servetune":
        # the bench script and the file's header state the replayed figures, not another policy's
        bench = (spec.run_dir / f"bench-{engine}.sh").read_text()
        assert f"request_goodput {report.request_goodput:.4g}" in bench
        assert f"simulated request_goodput of this file: {report.request_goodput:.6g}" in text
        assert not (spec.run_dir / "policy.toml").exists()
    else:
        assert "WHAT-IF" in text and not (spec.run_dir / "vllm.yaml").exists()


def test_vllm_search_finds_the_token_budget_under_the_tpot_bound(tmp_path):
    # 200 decodes and a step of 2 + 0.1 * tokens ms: TPOT <= 7.05 ms allows 50 decodes a step.
    # vLLM has no per-step time cap, but its token budget is one: min(budget, max-num-seqs)
    # = 50 is the optimum, and vLLM requires budget >= max-num-seqs.
    space = {"max_num_batched_tokens": {"low": 16, "high": 4096, "log": True}}
    spec, evaluator, _, out = _tuned(tmp_path, "vllm", trials=48, space=space)
    best = out.summary["best"]["config"]
    optimum = target("vllm").resolve(evaluator.baselines()["vllm-default"].replace(
        max_num_batched_tokens=50, max_num_seqs=50), spec.context)
    _, known = evaluator.simulate(optimum)
    assert best["max_num_batched_tokens"] >= best["max_num_seqs"]  # vllm/config/scheduler.py:331
    assert out.summary["best"]["report"]["weighted_goodput"] >= 0.95 * known.weighted_goodput
    assert out.summary["best"]["report"]["weighted_goodput"] > 2 * out.summary["baselines"]["vllm-default"]["report"][
        "weighted_goodput"]


def test_engine_trials_that_break_its_rules_are_pruned_before_simulating(tmp_path):
    space = {"max_num_batched_tokens": {"low": 16, "high": 64, "log": True}}
    _, _, study, _ = _tuned(tmp_path, "vllm", trials=16, space=space)
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned and all("vllm/config/scheduler.py:331" in t.user_attrs["pruned"] for t in pruned)
    for t in study.trials:
        if t.state == optuna.trial.TrialState.COMPLETE and "baseline" not in t.user_attrs:
            assert t.user_attrs["config"]["max_num_batched_tokens"] >= t.user_attrs["config"]["max_num_seqs"]


def test_holdout_scores_the_recommendation_on_the_window_end(tmp_path):
    trace = make_trace(200, gap_s=0.01, prompt=10, output=100)
    tuned, held = split_holdout(trace, 0.25)
    assert tuned.n + held.n == trace.n and 0.0 <= held.arrival_s[0] < 0.01  # rebased at the split
    assert tuned.arrival_s[-1] < trace.arrival_s[tuned.n]
    _, evaluator, _, out = _tuned(tmp_path, "vllm", trials=8, holdout=0.25, trace=trace)
    assert evaluator.trace.n == tuned.n
    check = out.summary["generalisation"]
    assert check["requests"] == held.n and set(check["scales"]) == {"x0.8", "x1", "x1.2"}
    for figures in check["scales"].values():
        assert all(math.isfinite(g) for g in figures["gain"].values())


def test_no_baseline_meeting_the_slos_leads_with_capacity(tmp_path):
    # every request arrives at once and TPOT must be under 2.2 ms: no default gets near it
    _, _, _, out = _tuned(tmp_path, "vllm", trials=6, space={"max_num_seqs": {"value": 1024}})
    verdict = out.summary["verdict"]
    attained = out.summary["baselines"]["vllm-default"]["report"]["slo_attainment"]
    assert attained < 0.9
    assert verdict["kind"] == "capacity" and verdict["baselines_meeting_target"] == []
