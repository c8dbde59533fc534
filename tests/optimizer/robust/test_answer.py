"""The answer a study prints and writes, end to end on the real engine and cost model:
below the knee it keeps the defaults and says so; past it, the file changes only the knobs
that carry a gain that holds, and the GPUs are the fleet simulation's."""

from __future__ import annotations

import dataclasses
import math

import optuna
import pytest
import yaml

from optimizer.outputs.exports import read_engine_file
from optimizer.outputs.runfolder import write_run_outputs
from optimizer.robust.choice import NOISE
from optimizer.robust.fleetsize import probe
from optimizer.search.evaluate import Evaluator
from optimizer.search.spec import load_spec
from optimizer.search.study import create_or_resume, enqueue_baselines, run
from policies.engines import target
from studies.synthetic import Gamma, LogNormal, Tenant, generate
from studies.traces import write_trace

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _study(tmp_path, name, trace, slo):
    path = write_trace(trace, tmp_path / f"{name}.parquet")
    spec = load_spec(trace=path, model="meta-llama/Llama-3.1-8B", gpu="h100", slo=slo, run_dir=tmp_path / name,
                     engine="vllm", framework="vllm", trials=12, batch_size=2, seed=1, study_name=name, holdout=0.25)
    evaluator = Evaluator(spec)
    study = create_or_resume(spec)
    enqueue_baselines(study, spec, evaluator.baselines())
    run(study, spec, evaluator)
    return spec, evaluator, write_run_outputs(spec.run_dir, study, spec, evaluator).summary


@pytest.fixture(scope="module")
def light(tmp_path_factory):
    """Chat at 2 req/s on one H100: every config meets the SLOs, so every config ties."""
    trace = generate(Gamma(rate=2, cv=1), duration_s=200, seed=3,
                     tenants=[Tenant("chat", prompt=LogNormal(800, 0.5), output=LogNormal(100, 0.5))])
    return _study(tmp_path_factory.mktemp("light"), "light", trace, "ttft:2000,tpot:100")


@pytest.fixture(scope="module")
def bursty(tmp_path_factory):
    """Code completion in bursts (gamma cv 4) at 16 req/s: vLLM's defaults are past their knee."""
    trace = generate(Gamma(rate=16, cv=4), duration_s=60, seed=3,
                     tenants=[Tenant("code", prompt=LogNormal(1500, 0.6), output=LogNormal(40, 0.8))])
    return _study(tmp_path_factory.mktemp("bursty"), "bursty", trace, "ttft:1000,tpot:50")


def test_below_the_knee_the_defaults_are_kept_and_said_why(light):
    spec, evaluator, summary = light
    answer = summary["answer"]
    assert answer["keep_defaults"] is True and answer["knobs_changed"] == []
    assert "within the 3% noise" in answer["reason"]
    # and why: the defaults already meet the SLOs, so no file had anything to add
    served = evaluator.reports([evaluator.baselines()["vllm-default"]], 1.0, fleets=[spec.fleet])[0].slo_attainment
    assert served >= 0.99
    assert f"the defaults serve {served:.1%} of the tuning part's requests within the SLOs" in answer["reason"]
    assert answer["gain"] == {"point": 1.0, "low": 1.0, "high": 1.0}
    text = (spec.run_dir / "vllm.yaml").read_text()
    assert "# Keep vllm-default:" in text
    # the file written is the engine's defaults, read back as vLLM runs it
    defaults = evaluator.baselines()["vllm-default"]
    assert read_engine_file(target("vllm"), text, spec.context) == defaults
    assert summary["best"]["config"] == defaults.to_dict()
    sized = answer["sizing"]["recommended"]
    assert sized["deploy"]["replicas"] == 1 and sized["deploy"]["attainment"] >= spec.capacity_target


def test_past_the_knee_the_file_changes_only_the_knobs_that_carry_a_gain_that_holds(bursty):
    spec, evaluator, summary = bursty
    answer = summary["answer"]
    assert answer["keep_defaults"] is False and answer["knobs_changed"]
    chosen = answer["candidates"][answer["chosen"]]
    assert chosen["worst"] >= 1 - NOISE and chosen["typical"] >= 1 + NOISE
    # every candidate ranked above it by typical gain lost somewhere by more than the noise
    for label, g in answer["candidates"].items():
        if g["typical"] > chosen["typical"]:
            assert g["worst"] < 1 - NOISE, label
    # the file differs from the defaults in exactly the knobs it names, each worth more than the noise
    args = yaml.safe_load((spec.run_dir / "vllm.yaml").read_text())
    config = read_engine_file(target("vllm"), (spec.run_dir / "vllm.yaml").read_text(), spec.context)
    defaults = evaluator.baselines()["vllm-default"]
    differ = {k for k in target("vllm").knobs if getattr(config, k) != getattr(defaults, k)}
    assert differ == {k["knob"] for k in answer["knobs_changed"]}
    for k in answer["knobs_changed"]:
        assert args[k["flag"]] == k["value"]
        assert k["removal_cost"] > NOISE or math.isnan(k["removal_cost"])  # nan: vLLM refuses the file without it
    # the gain is the file's, its range holds the point and every condition it was scored under
    gain = answer["gain"]
    assert gain["low"] <= gain["point"] <= gain["high"] and gain["low"] >= 1 - NOISE
    assert len(answer["conditions"]) == 9 + 4  # 3 folds x 3 rates, 4 corners of the model's error
    assert gain["low"] == pytest.approx(min(chosen["worst"], gain["point"])) or answer["knobs_changed"]


def test_gpus_needed_are_the_fewest_replicas_whose_simulated_fleet_meets_the_target(bursty):
    spec, evaluator, summary = bursty
    sizing = summary["answer"]["sizing"]["recommended"]
    config = read_engine_file(target("vllm"), (spec.run_dir / "vllm.yaml").read_text(), spec.context)
    parts = {"tuning": evaluator, "holdout": evaluator.on(evaluator.holdout_trace)}
    for part, ev in parts.items():
        n = sizing[part]["replicas"]
        assert probe(ev, config, spec.fleet, n)[0] >= spec.capacity_target
        if n > 1:
            assert probe(ev, config, spec.fleet, n - 1)[0] < spec.capacity_target, part
    deploy = sizing["deploy"]["replicas"]
    assert deploy == max(sizing["tuning"]["replicas"], sizing["holdout"]["replicas"])
    assert sizing["replicas"]["low"] <= deploy <= sizing["replicas"]["high"]
    # the file carries the count vLLM runs as data-parallel replicas, and its header says so
    text = (spec.run_dir / "vllm.yaml").read_text()
    assert yaml.safe_load(text).get("data-parallel-size", 1) == deploy
    assert f"# GPUs: {deploy} = {deploy} replica(s) x 1 GPU(s)" in text
    bench = (spec.run_dir / "bench-vllm.sh").read_text()
    assert f"({deploy} replica(s) x TP 1 on h100)" in bench
    # the review and the plots use the same figures
    review = (spec.run_dir / "capacity-review.md").read_text()
    assert "## What to deploy" in review and f"{deploy * 1} ({deploy} x TP 1)" in review
    assert (spec.run_dir / "plots" / "gpus.png").read_bytes()[:4] == b"\x89PNG"


def test_the_defaults_gpus_are_sized_the_same_way(bursty):
    spec, evaluator, summary = bursty
    default = summary["answer"]["sizing"]["vllm-default"]
    config = evaluator.baselines()["vllm-default"]
    n = default["tuning"]["replicas"]
    assert probe(evaluator, config, spec.fleet, n)[0] >= spec.capacity_target
    assert n == 1 or probe(evaluator, config, dataclasses.replace(spec.fleet), n - 1)[0] < spec.capacity_target
