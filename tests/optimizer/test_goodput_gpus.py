"""Goodput vs GPUs: TP and replicas as searched dimensions, cost models per TP, the front,
and the trial's own fleet in the exported engine configs."""

import json

import numpy as np
import optuna
import pytest

from optimizer.outputs.exports import engine_yaml
from optimizer.outputs.replay import deployment_of
from optimizer.outputs.runfolder import write_run_outputs
from optimizer.outputs.trials import fleet_front, recommend, trial_fleet
from optimizer.search.evaluate import Evaluator
from optimizer.search.space import Fleet, SpaceError, build_space, tp_degrees
from optimizer.search.spec import SpecError, load_spec
from optimizer.search.study import create_or_resume, enqueue_baselines, gains, run
from policies.engines import target
from tests.optimizer.tuning_helpers import make_trace, write_csv_trace

optuna.logging.set_verbosity(optuna.logging.WARNING)

MODEL = "meta-llama/Llama-3.1-8B"


def _spec(tmp_path, trace=None, **flags):
    values = dict(trace=write_csv_trace(tmp_path / "t.csv", trace if trace is not None else make_trace()),
                  model=MODEL, gpu="h100", slo="ttft:2000,tpot:100", run_dir=tmp_path / "run")
    values.update(flags)
    return load_spec(**values)


def test_tp_degrees_split_the_heads_and_fit_the_weights():
    assert tp_degrees(MODEL, "h100") == (1, 2, 4, 8)  # 32 heads, 8 KV heads: all divide
    assert tp_degrees("meta-llama/Llama-3.1-70B", "h100") == (2, 4, 8)  # 140 GB of weights fit from TP 2
    with pytest.raises(SpaceError, match="cannot list the TP degrees"):
        tp_degrees("no-such/model", "h100")


def test_goodput_gpus_searches_the_fleet_by_default_and_other_objectives_do_not(tmp_path):
    space = _spec(tmp_path, objective="goodput-gpus").search_space
    described = dict(space.describe())
    assert described["tp"] == "{1, 2, 4, 8}" and described["replicas"] == "[1, 8]"
    assert space.tp_choices == (1, 2, 4, 8) and space.base_fleet == Fleet(1, 1)
    plain = _spec(tmp_path, tp=2, replicas=3).search_space
    assert plain.fleet_params == () and plain.base_fleet == Fleet(2, 3) and plain.tp_choices == (2,)


def test_space_table_opens_and_fixes_fleet_dimensions():
    knobs = {"max_num_seqs": {"low": 8, "high": 64}}
    space = build_space({**knobs, "tp": [4, 1, 2], "replicas": {"low": 1, "high": 6}})
    assert [(p.name, p.kind, p.choices or (p.low, p.high)) for p in space.fleet_params] == \
        [("tp", "categorical", (1, 2, 4)), ("replicas", "int", (1, 6))]
    ranged = build_space({"tp": {"low": 2, "high": 4}}, tp_degrees=lambda: (1, 2, 4, 8))
    assert ranged.tp_choices == (2, 4)
    fixed = build_space({"tp": {"value": 4}, "replicas": {"search": False}}, fleet=Fleet(1, 3),
                        search_fleet=True, tp_degrees=lambda: (1, 2, 4, 8))
    assert fixed.fleet_params == () and fixed.base_fleet == Fleet(4, 3)
    for bad, message in (({"tp": [16]}, r"\[space.tp\]: tp must be an integer in \[1, 8\]"),
                         ({"tp": [2, 2]}, "without duplicates"),
                         ({"replicas": {"low": 4, "high": 2}}, "low 4 is above high 2"),
                         ({"replicas": {"low": 1}}, "give both low and high"),
                         ({"replicas": "many"}, "must be a list of values or a table"),
                         ({"tp": {"step": 2}}, "unknown key")):
        with pytest.raises(SpaceError, match=message):
            build_space(bad)


def test_a_tp_the_model_cannot_run_fails_when_the_study_starts(tmp_path):
    spec = _spec(tmp_path, space={"tp": [1, 3]})
    with pytest.raises(SpecError, match="tp=3: .*does not divide"):
        Evaluator(spec, trace=make_trace())


def test_trials_on_bigger_fleets_use_their_own_cost_model(tmp_path):
    spec = _spec(tmp_path, space={"tp": [1, 2]})
    evaluator = Evaluator(spec, trace=make_trace())
    assert evaluator.cost_model_at(1).tp == 1 and evaluator.cost_model_at(2).tp == 2
    # TP 2 halves the weights per GPU, so the KV pool more than doubles.
    assert evaluator.cost_model_at(2).kv_capacity_tokens(0.9) > 2 * evaluator.cost_model_at(1).kv_capacity_tokens(0.9)
    config = evaluator.baselines()["vllm-default"]
    _, one = evaluator.simulate(config)
    _, two = evaluator.simulate(config, fleet=Fleet(tp=2))
    assert one.kv_peak_fraction > two.kv_peak_fraction  # same traffic, a bigger pool


def _overloaded_trace(n=300):
    """40 req/s of ~2k-token prompts: one H100 is overloaded, a few GPUs are not."""
    rng = np.random.default_rng(0)
    trace = make_trace(n, gap_s=0.025)
    output = rng.integers(50, 400, n)
    return trace.replace(prompt_tokens=rng.integers(500, 4000, n), output_tokens=output, max_tokens=output.copy())


def test_goodput_gpus_study_finds_a_front_where_more_gpus_buy_more_goodput(tmp_path):
    trace = _overloaded_trace()
    spec = _spec(tmp_path, trace, objective="goodput-gpus", trials=16, batch_size=2, seed=1,
                 space={"others": "fixed", "tp": [1, 2], "replicas": {"low": 1, "high": 4}})
    evaluator = Evaluator(spec, trace=trace)
    study = create_or_resume(spec)
    enqueue_baselines(study, spec, evaluator.baselines())
    run(study, spec, evaluator)
    trials = study.get_trials()

    for t in trials[:2]:  # baselines run on the deployment's fleet
        assert t.user_attrs["baseline"] and (t.user_attrs["tp"], t.user_attrs["replicas"], t.values[1]) == (1, 1, 1)
    for t in trials:
        fleet = trial_fleet(t, spec)
        assert t.values[1] == t.user_attrs["gpus"] == fleet.gpus == fleet.tp * fleet.replicas
    points = fleet_front(trials)
    assert points[0].gain is None and all((p.gain > 0) == p.pareto for p in points[1:])
    front = [p for p in points if p.pareto]
    assert len({p.gpus for p in front}) > 1
    goodput = [p.weighted_goodput for p in front]
    assert goodput == sorted(goodput) and goodput[-1] > 2 * goodput[0]
    # Gains compare at no more GPUs than the baseline: only 1-GPU trials count.
    one_gpu = max(t.user_attrs["report"]["weighted_goodput"] for t in trials
                  if t.values and t.user_attrs["gpus"] == 1 and t.constraints["rejected_fraction"] <= 0)
    base = trials[0].user_attrs["report"]["weighted_goodput"]
    assert gains(study)["vllm-default"] == pytest.approx(one_gpu / base)

    best = recommend(trials, spec, ["maximize", "minimize"])
    fleet = trial_fleet(best, spec)
    assert best.user_attrs["report"]["slo_attainment"] >= spec.capacity_target
    assert all(p.slo_attainment < spec.capacity_target for p in front if p.gpus < fleet.gpus)
    text = engine_yaml(target("vllm"), evaluator.baselines()["vllm-default"], deployment_of(spec, fleet), spec.context)
    assert f"tensor-parallel-size: {fleet.tp}\n" in text and f"data-parallel-size: {fleet.replicas}\n" in text


@pytest.mark.parametrize(("engine", "parallel"), [("vllm", "tensor-parallel-size: 2\ndata-parallel-size: {}\n"),
                                                ("sglang", "tp-size: 2\ndp-size: {}\n")])
def test_run_outputs_export_the_recommended_fleet(tmp_path, engine, parallel):
    trace = _overloaded_trace(120)
    spec = _spec(tmp_path, trace, objective="goodput-gpus", trials=6, batch_size=2, seed=2, engine=engine,
                 space={"others": "fixed", "tp": [2], "replicas": {"low": 2, "high": 3}})
    evaluator = Evaluator(spec, trace=trace)
    study = create_or_resume(spec)
    enqueue_baselines(study, spec, evaluator.baselines())
    run(study, spec, evaluator)
    outputs = write_run_outputs(spec.run_dir, study, spec, evaluator)
    summary = outputs.summary
    fleet = summary["best"]["fleet"]
    assert fleet["tp"] == 2 and fleet["replicas"] in (2, 3)
    assert summary["baselines"][f"{engine}-default"]["fleet"] == {"tp": 1, "replicas": 1, "gpus": 1,
                                                                  "routing": "one replica, no routing"}
    # others = "fixed": the router stays the engine's own (vLLM's DP balancer, SGLang's round robin)
    router = {"vllm": "vllm_dp", "sglang": "round_robin"}[engine]
    assert summary["best"]["config"]["router"] == router and fleet["routing"] == f"{router} router"
    assert set(fleet["per_replica"]) == {str(j) for j in range(fleet["replicas"])}
    # the study's own engine file carries the fleet the sizing deploys (the fewest replicas of the
    # recommended TP meeting the target in a fleet simulation); no other engine's file is written
    text = (spec.run_dir / f"{engine}.yaml").read_text()
    deploy = summary["answer"]["deploy"]
    assert deploy["tp"] == 2 and deploy["replicas"] == summary["answer"]["sizing"]["recommended"]["deploy"]["replicas"]
    assert parallel.format(deploy["replicas"]) in text if deploy["replicas"] > 1 else parallel.split("\n")[0] in text
    assert not (spec.run_dir / {"vllm": "sglang.yaml", "sglang": "vllm.yaml"}[engine]).exists()
    review = (spec.run_dir / "capacity-review.md").read_text()
    assert f"x TP 2 = {fleet['gpus']} GPU(s), {router} router." in review and "## Fleet" in review
    assert f"{fleet['gpus']} ({fleet['replicas']} x TP 2) | 1 (1 x TP 1)" in review
    assert json.loads((spec.run_dir / "summary.json").read_text())["deployment"]["routing"] == f"{router} router"
