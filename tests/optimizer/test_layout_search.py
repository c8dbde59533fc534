"""A MoE model's instance layout (expert parallel, attention data parallel) as searched fleet
dimensions: only for MoE models, per engine, simulated as one scheduler per attention
group on that layout's cost model, and exported in the engine's own flags."""

from types import SimpleNamespace

import numpy as np
import optuna
import pytest
import yaml

from costmodels.layout import ParallelLayout
from optimizer.outputs.replay import deployment_of
from optimizer.outputs.runfolder import ATTENTION_DP_CAVEAT, write_run_outputs
from optimizer.outputs.trials import trial_fleet
from optimizer.search.evaluate import Evaluator
from optimizer.search.space import Fleet, SpaceError, build_space, fleet_of
from optimizer.search.spec import load_spec
from optimizer.search.study import create_or_resume, enqueue_baselines, run
from optimizer.search.targets import engine_context
from policies.config import PolicyConfig
from policies.engines import target
from tests.optimizer.test_fleet_tuning import RecordingFleet
from tests.optimizer.tuning_helpers import burst_cost_model, fake_score, make_trace, write_csv_trace

optuna.logging.set_verbosity(optuna.logging.WARNING)

MOE, DENSE = "Qwen/Qwen3-30B-A3B", "meta-llama/Llama-3.1-8B"


def _space(model, engine, overrides=None, fleet=None, **options):
    fleet = fleet or Fleet(8, 1)
    ctx = engine_context(model, "h100", 1, engine)
    return build_space(overrides, target(engine).defaults(ctx), fleet, target=target(engine), context=ctx, **options)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_only_a_moe_model_searches_its_layout(engine):
    dense = dict(_space(DENSE, engine).describe())
    assert "attention_dp" not in dense and "expert_parallel" not in dense
    with pytest.raises(SpaceError, match="only a MoE model has expert or attention data parallelism"):
        _space(DENSE, engine, {"attention_dp": [1, 2]})
    moe = dict(_space(MOE, engine).describe())
    assert moe["attention_dp"].startswith("{1, 2, 4, 8}") and moe["expert_parallel"] == "{False, True}"
    assert dict(_space(MOE, engine, fleet=Fleet(2, 1)).describe())["attention_dp"].startswith("{1, 2}")


def test_layout_params_map_onto_the_trials_tp():
    base = Fleet(8, 1)
    assert fleet_of({"tp": 4, "attention_dp": 8, "expert_parallel": True}, base) == Fleet(4, 1, 4, 4)
    assert fleet_of({"tp": 2, "attention_dp": 1, "expert_parallel": False}, base) == Fleet(2, 1, 1, 1)
    assert fleet_of({}, Fleet(8, 1, 2, 1)) == Fleet(8, 1, 2, 1)  # nothing searched: the base layout kept
    fleet = Fleet(8, 1, 8, 4)
    assert (fleet.gpus, fleet.schedulers, fleet.layout) == (8, 4, ParallelLayout(8, 8, 4))
    with pytest.raises(SpaceError, match="attention_dp=4 must divide tp=2"):
        Fleet(2, 1, 1, 4)
    with pytest.raises(SpaceError, match="8192 schedulers, more than the simulator's 1024"):
        Fleet(8, 1024, 1, 8)


def test_a_study_fixes_or_narrows_the_layout():
    fixed = _space(MOE, "sglang", {"attention_dp": {"value": 4}, "expert_parallel": {"value": True}})
    assert fixed.fleet_params == () and fixed.base_fleet == Fleet(8, 1, 8, 4)
    narrowed = _space(MOE, "sglang", {"attention_dp": [1, 8], "expert_parallel": {"search": False}})
    assert [(p.name, p.choices) for p in narrowed.fleet_params] == [("attention_dp", (1, 8))]
    for bad, message in (({"attention_dp": [3]}, r"choices \[3\] must be distinct values of \[1, 2, 4, 8\]"),
                         ({"attention_dp": {"value": 16}}, "value 16 is not one of"),
                         ({"expert_parallel": {"low": 0}}, "must be a list of values or a table")):
        with pytest.raises(SpaceError, match=message):
            _space(MOE, "sglang", bad)


def test_vllm_deploys_one_instance_of_a_moe_model_per_file():
    # vLLM steps a MoE model's data-parallel ranks together (v1/engine/core.py:1546-1549):
    # its data parallelism is attention_dp, so goodput-gpus does not search replicas
    space = _space(MOE, "vllm", fleet=Fleet(1, 1), search_fleet=True, tp_degrees=lambda: (1, 2, 4, 8))
    described = dict(space.describe())
    assert described["replicas"] == "fixed = 1" and described["tp"] == "{1, 2, 4, 8}"
    assert "[1, 8]" in dict(_space(MOE, "sglang", fleet=Fleet(1, 1), search_fleet=True,
                                   tp_degrees=lambda: (1, 2, 4, 8)).describe())["replicas"]
    with pytest.raises(SpaceError, match="at most 1 replica"):
        _space(MOE, "vllm", fleet=Fleet(4, 2))


def test_sglang_searches_attention_dp_only_on_one_replica():
    # arg_groups/parallel_hook.py:287-292 refuses dp-size replicas beside attn-dp-size: a
    # trial of several replicas is not asked for attention DP (no trial pruned for it)
    space = _space(MOE, "sglang", fleet=Fleet(1, 1), search_fleet=True, tp_degrees=lambda: (1, 2, 4, 8))
    assert dict(space.describe())["attention_dp"] == "{1, 2, 4, 8} when replicas = 1"
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    fleets = []
    for _ in range(80):
        trial = study.ask()
        fleets.append(space.suggest_fleet(trial))
        assert ("attention_dp" in trial.params) == (fleets[-1].replicas == 1)
        study.tell(trial, 0.0)
    assert all(f.attention_dp == 1 for f in fleets if f.replicas > 1)
    assert any(f.attention_dp > 1 for f in fleets) and any(f.replicas > 1 for f in fleets)
    assert space.params_for(PolicyConfig(), Fleet(4, 2, 4, 1)).keys() >= {"tp", "replicas", "expert_parallel"}
    assert "attention_dp" not in space.params_for(PolicyConfig(), Fleet(4, 2, 4, 1))
    assert "when replicas" not in dict(_space(MOE, "vllm").describe())["attention_dp"]


def test_an_attention_dp_layout_runs_one_scheduler_per_group_on_its_own_cost_model(tmp_path):
    built = []

    def cost_model_for(layout):
        built.append(layout)
        return burst_cost_model()

    spec = load_spec(trace=write_csv_trace(tmp_path / "t.csv"), model=MOE, gpu="h100", slo="ttft:500", tp=8,
                     engine="sglang", seed=3)
    fleet = RecordingFleet()
    evaluator = Evaluator(spec, trace=make_trace(50), cost_model_for=cost_model_for, engine=fleet,
                          fleet_engine=fleet, scorer=fake_score)
    config = PolicyConfig(max_num_seqs=16)
    evaluator.reports([config, config, config], fleets=[Fleet(8, 1), Fleet(8, 1, 8, 4), Fleet(8, 1, 8, 1)])
    assert built == [8, ParallelLayout(8, 8, 4), ParallelLayout(8, 8, 1)]  # the plain TP keyed by its degree
    assert [call[0] for call in fleet.fleet_calls] == [4]  # 4 schedulers behind the DP controller
    assert fleet.lockstep == [4]  # ... stepping together
    assert fleet.calls == 2  # the plain and the EP-only instance: one scheduler each
    # SGLang refuses dp-size replicas beside attention DP: pruned before simulating
    assert "parallel_hook.py:287-292" in evaluator.infeasibility(config, Fleet(4, 2, 1, 2))


def test_an_attention_dp_instance_fails_with_all_of_its_groups(tmp_path):
    spec = load_spec(trace=write_csv_trace(tmp_path / "t.csv"), model=MOE, gpu="h100", slo="ttft:500", tp=8,
                     engine="sglang", seed=3, fail="0@1:3")
    fleet = RecordingFleet()
    evaluator = Evaluator(spec, trace=make_trace(50), cost_model_for=lambda layout: burst_cost_model(),
                          engine=fleet, fleet_engine=fleet, scorer=fake_score)
    evaluator.reports([PolicyConfig(max_num_seqs=16)], fleets=[Fleet(8, 1, 8, 4)])
    # the plan names instances; the window stops every scheduler of instance 0, and they step together
    assert fleet.fleet_calls[0][:2] == (4, [(k, 1.0, 3.0) for k in range(4)]) and fleet.lockstep == [4]
    assert "prefill/decode split of DP ranks is not modelled" in evaluator.infeasibility(
        PolicyConfig(prefill_replicas=1), Fleet(8, 1, 8, 4))


def test_a_layout_study_exports_the_recommended_layout_in_the_engines_flags(tmp_path):
    """Qwen3-30B-A3B on SGLang, TP 2 or 4 per instance: the real cost models of each layout."""
    trace = make_trace(60, gap_s=0.05, prompt=400, output=40)
    spec = load_spec(trace=write_csv_trace(tmp_path / "t.csv", trace), model=MOE, gpu="h100",
                     slo="ttft:2000,tpot:100", run_dir=tmp_path / "run", objective="goodput-gpus", engine="sglang",
                     trials=8, batch_size=4, seed=4, space={"others": "fixed", "tp": [2, 4], "replicas": {"value": 1}})
    evaluator = Evaluator(spec, trace=trace)
    study = create_or_resume(spec)
    enqueue_baselines(study, spec, evaluator.baselines())
    run(study, spec, evaluator)
    trials = [t for t in study.get_trials() if "tp" in t.user_attrs]
    fleets = {trial_fleet(t, spec) for t in trials}
    assert any(f.attention_dp > 1 for f in fleets) and any(f.moe_ep > 1 for f in fleets)
    for t in trials:
        assert Fleet(**{k: t.user_attrs[k] for k in ("tp", "replicas", "moe_ep", "attention_dp")}) == \
            trial_fleet(t, spec)
    # a layout changes the KV pool each scheduler holds: attention DP replicates the attention
    # weights per group, and each group caches only its own requests' KV
    plain, grouped = evaluator.cost_model_of(Fleet(4, 1)), evaluator.cost_model_of(Fleet(4, 1, 4, 4))
    assert grouped.weight_bytes > plain.weight_bytes
    assert grouped.kv_bytes_per_token == 4 * plain.kv_bytes_per_token

    outputs = write_run_outputs(spec.run_dir, study, spec, evaluator)
    best = outputs.summary["best"]["fleet"]
    recommended = Fleet(best["tp"], best["replicas"], best.get("moe_ep", 1), best.get("attention_dp", 1))
    args = yaml.safe_load((spec.run_dir / "sglang.yaml").read_text())
    engine = target("sglang")
    assert engine.deployment_from_args(args, spec.context) == deployment_of(spec, recommended).engine
    assert engine.layout_violations(deployment_of(spec, recommended).engine, spec.context) == []
    review = (spec.run_dir / "capacity-review.md").read_text()
    stated = [f"expert parallel {recommended.moe_ep}", f"attention DP groups {recommended.attention_dp}"]
    assert [s in review for s in stated] == [recommended.moe_ep > 1, recommended.attention_dp > 1]
    # what the simulator leaves out of a DP layout's figures is said wherever one was simulated
    assert (ATTENTION_DP_CAVEAT in review) == any(f.attention_dp > 1 for f in (recommended, spec.fleet))
    # `servetune export` of the recommended trial writes tune's file, key for key
    from optimizer.cli.export import _export

    assert yaml.safe_load(_export(spec.run_dir, None, None, None)) == args


def test_a_per_group_knob_settles_after_one_reading_of_the_file():
    # SGLang scales schedule-conservativeness by 0.3 per attention-DP group
    # (parallel_hook.py:316-321): the file holds value / 0.3 to 6 places, so a searched value
    # reads back rounded; written again from what was read, the file reads back the same
    from optimizer.outputs.exports import engine_yaml, read_engine_file

    engine, ctx = target("sglang"), engine_context(MOE, "h100", 8, "sglang")
    deployment = deployment_of(SimpleNamespace(model=MOE, gpu="h100", speculative=None), Fleet(8, 1, 8, 4))
    searched = engine.defaults(ctx).replace(schedule_conservativeness=1.7927387901108942)
    first = read_engine_file(engine, engine_yaml(engine, searched, deployment, ctx), ctx)
    second = read_engine_file(engine, engine_yaml(engine, first, deployment, ctx), ctx)
    assert first.schedule_conservativeness != searched.schedule_conservativeness
    assert second == first


def test_simulate_runs_a_layout_file_on_its_layout_with_its_groups_in_lockstep(tmp_path):
    from costmodels import build
    from optimizer.cli.simulate import ConfigError, _engine_file, _simulate
    from policies.fleet import simulate_fleet
    from studies.traces import load_trace

    ctx = engine_context(MOE, "h100", 8, "sglang")
    path = tmp_path / "sglang.yaml"
    path.write_text(f"model-path: {MOE}\ntp-size: 8\nattn-dp-size: 4\nep-size: 8\n")
    config, layout, _ = _engine_file(path, ctx)
    assert layout == ParallelLayout(8, 8, 4)
    trace_file = write_csv_trace(tmp_path / "t.csv", make_trace(40, gap_s=0.02, prompt=600, output=30))
    run = _simulate(trace_file, None, MOE, "h100", 8, "sglang", path, None, [], None, None, 1.0, 0, "json")
    assert run["layout"] == {"moe_ep": 8, "attention_dp": 4}
    cost = build(MOE, "h100", tp=8, framework="sglang", moe_ep_size=8, attention_dp_size=4)
    expected = simulate_fleet(load_trace(trace_file), cost, config, replicas=4, lockstep=4)
    np.testing.assert_array_equal(run["result"].finish_s, expected.finish_s)
    with pytest.raises(ConfigError, match="lays out 8 GPUs per instance, but --tp is 4; pass --tp 8"):
        _simulate(trace_file, None, MOE, "h100", 4, "sglang", path, None, [], None, None, 1.0, 0, "json")
    path.write_text(f"model-path: {MOE}\ntp-size: 8\n")
    plain, layout, _ = _engine_file(path, ctx)  # the same file without attention DP: read as it runs
    assert layout == ParallelLayout(8) and plain.max_num_batched_tokens == target("sglang").defaults(ctx).max_num_batched_tokens


@pytest.mark.parametrize("dp", [1, 4])
def test_the_review_and_tune_state_the_dp_caveat_exactly_when_a_dp_layout_ran(dp):
    import io

    from rich.console import Console

    from optimizer.cli.tune import _print_file_gains
    from optimizer.outputs.runfolder import _notes

    fleet, plain = Fleet(8, 1, 8, dp), Fleet(8, 1)
    spec = SimpleNamespace(objective="goodput", fleet=plain, failures=None)
    target = SimpleNamespace(what_if=False, name="sglang", display="SGLang", version="0.5.23")
    best = SimpleNamespace(constraints={}, number=3)
    recommended = SimpleNamespace(fleet=fleet, name="sglang.yaml", config=PolicyConfig(), report={})
    default = SimpleNamespace(fleet=plain, name="sglang-default", config=PolicyConfig(), report={})
    notes = _notes(best, recommended, [recommended, default], spec, target)
    assert (ATTENTION_DP_CAVEAT in notes) == (dp > 1)
    out = io.StringIO()
    summary = {"recommendation": {"what_if": False, "file": "sglang.yaml", "engine": "sglang"},
               "best": {"report": {"weighted_goodput": 2.0}, "fleet": fleet.to_dict()},
               "verdict": {"kind": "gain"}, "baselines": {"sglang-default": {"report": {"weighted_goodput": 1.0}}},
               "answer": {"lines": ["Deploy sglang.yaml: 1 knob changed: chunked-prefill-size 2048"]}}
    _print_file_gains(Console(file=out, width=400), summary)
    assert ("Attention DP is simulated as groups stepping together" in out.getvalue()) == (dp > 1)
    assert out.getvalue().startswith("Deploy sglang.yaml: 1 knob changed")  # what to deploy leads
