"""Exports: engine YAMLs use only flags the target release accepts, carry only what the engine
runs, and read back as the config they were written from."""

from __future__ import annotations

import math
import tomllib

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from optimizer.outputs.exports import (
    Deployment,
    ExportError,
    TrafficShape,
    engine_args,
    engine_yaml,
    goodput_bounds,
    policy_toml,
    read_engine_file,
    write_exports,
)
from optimizer.search.targets import engine_context
from policies.config import FLEET_KNOBS, KNOBS, SPECULATIVE_KNOBS, PolicyConfig, inert_knobs
from policies.engines import ENGINES, EngineContext, preset, target
from policies.engines.vllm import BLOCK_SIZES
from studies.slo import SLOClass, SLOSet, parse_slo
from tests.optimizer.test_outputs_fixtures import make_trace

# Long flags `vllm serve` 0.33.0 accepts for the knobs servetune could export
# (serving-configs.md §1.2-1.3), checked independently of optimizer.outputs.exports.
VLLM_033_KEYS = frozenset({
    "model", "tensor-parallel-size", "data-parallel-size", "pipeline-parallel-size",
    "max-num-batched-tokens", "max-num-seqs", "max-num-active-seqs", "enable-chunked-prefill",
    "long-prefill-token-threshold", "long-prefill-token-threshold-adaptive", "scheduling-policy",
    "watermark", "scheduler-reserve-full-isl", "prefill-schedule-interval", "max-num-queued-reqs",
    "max-num-queued-tokens", "async-scheduling", "gpu-memory-utilization", "kv-cache-memory-bytes",
    "num-gpu-blocks-override", "block-size", "enable-prefix-caching", "prefix-caching-hash-algo",
    "speculative-config", "enable-expert-parallel", "max-model-len",
    # LoRA (vllm/engine/arg_utils.py:1609-1624)
    "enable-lora", "max-loras", "max-lora-rank", "max-cpu-loras",
    # BooleanOptionalAction's negative spellings (vllm/utils/argparse_utils.py)
    "no-enable-chunked-prefill", "no-enable-prefix-caching", "no-async-scheduling",
})
VLLM_REMOVED_KEYS = frozenset({"max-num-partial-prefills", "max-long-partial-prefills", "preemption-mode",
                               "kv-cache-memory"})
# SGLang 0.5.23 flags (serving-configs.md §2.2-2.3).
SGLANG_0523_KEYS = frozenset({
    "model-path", "tp-size", "dp-size", "attn-dp-size", "chunked-prefill-size", "max-prefill-tokens",
    "prefill-max-requests", "max-running-requests", "max-queued-requests", "max-total-tokens",
    "mem-fraction-static", "page-size", "schedule-policy", "enable-priority-scheduling",
    "schedule-low-priority-values-first", "priority-scheduling-preemption-threshold",
    "disable-priority-preemption", "retraction-policy", "schedule-conservativeness", "disable-radix-cache",
    "radix-eviction-policy", "disable-overlap-schedule", "num-continuous-decode-steps", "context-length",
    "load-balance-method", "speculative-algorithm", "speculative-draft-model-path", "speculative-num-steps",
    "speculative-eagle-topk", "speculative-num-draft-tokens", "speculative-dspark-block-size",
    "speculative-dspark-sps-table-path",  # srt/arg_groups/fields/spec.py:78-89
    # LoRA (srt/arg_groups/fields/lora.py:34-74)
    "enable-lora", "max-loras-per-batch", "lora-eviction-policy", "max-lora-rank", "lora-target-modules",
})

LLAMA = "meta-llama/Llama-3.1-8B"
DEPLOY = Deployment(LLAMA, tp=2, replicas=3, gpu="h100")
#: Llama-3.1-8B on H100s at TP 2 (context 131072, the cost model's KV pool and reserve)
CTX = engine_context(LLAMA, "h100", tp=2, replicas=3)
VLLM, SGLANG = target("vllm"), target("sglang")


def _knob_value(knob):
    if knob.kind is bool:
        return st.booleans()
    if knob.kind is str:
        return st.sampled_from(knob.choices)
    high = min(knob.high, 1 << 20)
    if knob.kind is int:
        return st.integers(int(knob.low), int(high))
    return st.floats(knob.low, high, allow_nan=False, allow_infinity=False)


configs = st.fixed_dictionaries({k.name: _knob_value(k) for k in KNOBS}).map(lambda d: PolicyConfig(**d))


@st.composite
def engine_leaning(draw, engine):
    """A what-if config (every knob arbitrary) whose flag knobs often hold values the engine
    accepts, so that both the refused and the written branches are exercised."""
    # a utilization that leaves no KV memory is test_a_utilization_without_kv_memory_is_refused's
    config = draw(configs).replace(gpu_memory_utilization=draw(st.floats(0.3, 1.0)))
    if not draw(st.booleans()):
        return config
    changes = {"max_model_len": draw(st.sampled_from([0, 4096, 131072])),
               "long_prefill_token_threshold": draw(st.sampled_from([0, 512, 4096]))}
    if engine is VLLM:
        changes["block_size"] = draw(st.sampled_from(BLOCK_SIZES))
        changes["scheduling_policy"] = draw(st.sampled_from(["fcfs", "priority"]))
    else:
        changes["block_size"] = draw(st.sampled_from([1, 16, 64]))
        changes["max_num_batched_tokens"] = changes["block_size"] * draw(st.integers(16, 512))
        changes["scheduling_policy"] = draw(st.sampled_from(["fcfs", "lpm", "priority"]))
        changes["preemption_victim"] = draw(st.sampled_from(["fewest_output", "lowest_priority"]))
        changes["router"] = draw(st.sampled_from(["round_robin", "total_requests", "total_tokens"]))
        changes["enable_chunked_prefill"] = True
    changes["max_num_seqs"] = min(config.max_num_seqs, changes.get("max_num_batched_tokens",
                                                                   config.max_num_batched_tokens))
    return config.replace(**changes)


def _flag_keys(engine):
    return {k for f in engine.flags for k in f.keys()} | set(engine.deployment_keys) | set(engine.speculative_keys)


def _check_export(engine, config, accepted):
    """Either the engine refuses its projection of ``config`` (no file), or the file holds
    only flags the release accepts and reads back as that projection."""
    runs = engine.resolve(config, CTX)
    try:
        text = engine_yaml(engine, config, DEPLOY, CTX)
    except ExportError:
        outside = [f.knob for f in engine.flags if f.values is not None and getattr(runs, f.knob) not in f.values
                   and getattr(runs, f.knob) != f.unset]
        # the engines' own verify budgets need a named drafter of their kind (DSpark), and vLLM's
        # batch schedule a single replica (DEPLOY has 3): test_engine_speculative has those rules
        own_budget = runs.speculative_mode in {*VLLM.speculative_modes, *SGLANG.speculative_modes} - {"fixed"}
        assert engine.violations(runs, CTX) or outside or own_budget or (
            engine is SGLANG and runs.gpu_memory_utilization <= CTX.reserve_share(runs.max_num_batched_tokens)), \
            "refused without a rule"
        return None
    data = yaml.safe_load(text)
    assert set(data) <= accepted
    assert set(data) <= _flag_keys(engine) | {"enable-priority-scheduling", "disable-priority-preemption",
                                              "lora-target-modules"}, \
        "an engine file never carries a knob the engine has no flag for"
    assert all("_" not in key for key in data)
    assert all(value is not False for value in data.values()), "false flags are dropped by the engines' loaders"
    fleet = {k: getattr(runs, k) for k in FLEET_KNOBS}  # the deployment's, not the file's
    back = read_engine_file(engine, text, CTX, fleet_knobs=fleet)
    inert = inert_knobs(runs, DEPLOY.replicas)  # e.g. the draft length with speculation off
    for knob in KNOBS:
        if knob.name in SPECULATIVE_KNOBS[2:] or knob.name in inert:  # the draft cost is the drafter's
            continue
        assert getattr(back, knob.name) == pytest.approx(getattr(runs, knob.name), abs=1e-6), knob.name
    return data


@settings(max_examples=80, deadline=None)
@given(engine_leaning(VLLM))
def test_vllm_yaml_uses_only_accepted_keys_and_round_trips(config):
    data = _check_export(VLLM, config, VLLM_033_KEYS)
    if data is None:
        return
    assert not set(data) & VLLM_REMOVED_KEYS
    assert data["model"] == DEPLOY.model
    assert (data["tensor-parallel-size"], data["data-parallel-size"]) == (2, 3)
    assert data["gpu-memory-utilization"] == config.gpu_memory_utilization  # always explicit


@settings(max_examples=80, deadline=None)
@given(engine_leaning(SGLANG))
def test_sglang_yaml_uses_hyphenated_flags_and_round_trips(config):
    data = _check_export(SGLANG, config, SGLANG_0523_KEYS)
    if data is None:
        return
    assert (data["model-path"], data["tp-size"], data["dp-size"]) == (DEPLOY.model, 2, 3)
    # the simulated utilisation also covers the activation reserve at the file's own step budget
    reserve = CTX.reserve_share(data["chunked-prefill-size"])
    assert data["mem-fraction-static"] == pytest.approx(config.gpu_memory_utilization - reserve, abs=1e-6)


@pytest.mark.parametrize("name", ENGINES)
def test_a_utilization_without_kv_memory_is_refused(name):
    # 0.0625 x 80 GiB holds less than Llama-3.1-8B's weights at TP 2: the engine refuses to start
    config = preset(f"{name}-default", CTX).replace(gpu_memory_utilization=0.0625)
    with pytest.raises(ExportError):
        engine_yaml(target(name), config, DEPLOY, CTX)


@pytest.mark.parametrize("name", ENGINES)
def test_an_engines_baseline_is_what_its_file_runs(name):
    # a baseline is compared with files read back (target.resolve): it must be one too
    engine = target(name)
    defaults = preset(f"{name}-default", CTX)
    assert engine.resolve(defaults, CTX) == defaults
    assert read_engine_file(engine, engine_yaml(engine, defaults, DEPLOY, CTX), CTX) == defaults


def test_the_sglang_mem_fraction_must_leave_room_after_the_reserve():
    ctx = EngineContext("h100", 80.0, reserved_fraction=0.06)
    config = preset("sglang-default", ctx).replace(gpu_memory_utilization=0.06)
    with pytest.raises(ExportError, match="activation reserve"):
        engine_yaml(SGLANG, config, Deployment("m"), ctx)


@settings(max_examples=60, deadline=None)
@given(configs)
def test_policy_toml_round_trips_every_knob(config):
    text = policy_toml(config, note="trial 7")
    assert PolicyConfig.from_toml(text) == config
    assert set(tomllib.loads(text)["policy"]) == {k.name for k in KNOBS}


def test_policy_toml_marks_exactly_the_knobs_no_engine_exposes():
    text = policy_toml(PolicyConfig(), what_if=True)
    lines = text.splitlines()
    flags = {name: [f for f in target(name).flags] for name in ENGINES}
    for knob in KNOBS:
        comment = lines[lines.index(next(ln for ln in lines if ln.startswith(f"{knob.name} ="))) - 1]
        carriers = [(name, f.key) for name in ENGINES for f in flags[name] if f.knob == knob.name]
        exposed = bool(carriers or knob.router)
        assert ("NOT IN ANY ENGINE" in comment) is not exposed, knob.name
        for name, key in carriers:
            assert f"{name} --{key}" in comment, knob.name
    assert "NOT IN ANY ENGINE" in lines[lines.index('admission_mode = "none"') - 1]
    assert "WHAT-IF" in text and "WHAT-IF" not in policy_toml(PolicyConfig())


def test_vllm_values_are_its_flags():
    config = preset("vllm-default", CTX).replace(max_num_batched_tokens=3072, max_num_seqs=96,
                                                 long_prefill_token_threshold=512, gpu_memory_utilization=0.9,
                                                 block_size=32, max_model_len=0)
    args = engine_args(VLLM, config, DEPLOY, CTX).args
    assert args["max-num-batched-tokens"] == 3072 and args["max-num-seqs"] == 96
    assert args["long-prefill-token-threshold"] == 512 and args["gpu-memory-utilization"] == 0.9
    assert args["enable-chunked-prefill"] is True and args["block-size"] == 32
    assert args["scheduling-policy"] == "fcfs"
    # 0 = unlimited in servetune; the engine's unlimited is the flag left unset.
    assert "max-model-len" not in args and "max-num-queued-reqs" not in args
    # vLLM's own default is the model's context, written as such
    assert engine_args(VLLM, preset("vllm-default", CTX), DEPLOY, CTX).args["max-model-len"] == 131072


def test_a_vllm_file_carries_only_what_vllm_runs():
    # vLLM V1 has no KV watermark, admission rule or swap: a config asking for them is
    # projected onto vLLM's behaviour, and the file reads back as that projection
    wish = preset("vllm-default", CTX).replace(admission_mode="predicted", preemption_mode="swap", kv_headroom=0.04)
    text = engine_yaml(VLLM, wish, DEPLOY, CTX)
    data = yaml.safe_load(text)
    assert "watermark" not in data and "preemption-mode" not in data
    assert "admission" not in text and "not carried" not in text.lower()
    back = read_engine_file(VLLM, text, CTX)
    assert (back.admission_mode, back.preemption_mode, back.kv_headroom) == ("none", "recompute", 0.0)
    assert back == VLLM.resolve(wish, CTX) == VLLM.resolve(preset("vllm-default", CTX), CTX)


def test_vllm_priority_policy_warns_about_opposite_priority_order():
    text = engine_yaml(VLLM, preset("vllm-default", CTX).replace(scheduling_policy="priority"), DEPLOY, CTX)
    assert yaml.safe_load(text)["scheduling-policy"] == "priority"
    assert "LOWER priority values first" in text


def test_sglang_priority_is_fcfs_with_priority_scheduling_and_no_preemption():
    config = preset("sglang-default", CTX).replace(scheduling_policy="priority")
    args = engine_args(SGLANG, config, Deployment("m"), CTX).args
    assert args["schedule-policy"] == "fcfs"
    assert args["enable-priority-scheduling"] is True and args["disable-priority-preemption"] is True
    text = engine_yaml(SGLANG, config, Deployment("m"), CTX)
    assert read_engine_file(SGLANG, text, CTX).scheduling_policy == "priority"
    assert "LOWER priority values first" not in text  # SGLang serves higher values first, as servetune's traces
    # chunking off (chunked-prefill-size -1) is not in servetune's SGLang space: a config asking
    # for it is projected onto what SGLang runs, chunked prefill, and the file says nothing else
    unchunked = engine_args(SGLANG, config.replace(enable_chunked_prefill=False), Deployment("m"), CTX).args
    assert unchunked == args and unchunked["chunked-prefill-size"] > 0
    assert SGLANG.resolve(config.replace(enable_chunked_prefill=False), CTX).enable_chunked_prefill


def test_sglang_mem_fraction_excludes_the_activation_reserve():
    ctx = EngineContext("h100", 80.0, reserved_fraction=0.05)
    config = preset("sglang-default", ctx).replace(gpu_memory_utilization=0.9)
    args = engine_args(SGLANG, config, Deployment("m"), ctx).args
    assert args["mem-fraction-static"] == pytest.approx(0.85)
    assert read_engine_file(SGLANG, yaml.safe_dump(args), ctx).gpu_memory_utilization == pytest.approx(0.9)


def test_an_sglang_file_that_would_run_out_of_memory_at_run_time_is_refused_with_why():
    """mem-fraction-static sizes weights + KV only; what is left must hold a full chunk's
    activations, or SGLang dies of OOM on the first one (issue 16: out-of-memory)."""
    ctx = EngineContext("h100", 80.0, reserved_fraction=0.05, activation_fraction_per_token=1e-5)
    args = {**engine_args(SGLANG, preset("sglang-default", ctx), Deployment("m"), ctx).args,
            "chunked-prefill-size": 8192, "mem-fraction-static": 0.9}
    assert ctx.reserve_share(8192) == pytest.approx(0.13192)  # more than the 0.1 left
    with pytest.raises(ExportError, match=r"mem-fraction-static 0.9 leaves 0.100 of GPU memory .* 8192-token "
                                          r"chunk's activations, CUDA graphs and runtime need 0.132: SGLang would "
                                          r"run out of memory at the first full chunk"):
        read_engine_file(SGLANG, yaml.safe_dump(args), ctx)
    fits = read_engine_file(SGLANG, yaml.safe_dump({**args, "chunked-prefill-size": 2048}), ctx)
    assert fits.gpu_memory_utilization == pytest.approx(0.9 + 0.05 + 2048e-5)


def test_bad_deployments_and_backends_are_named():
    with pytest.raises(ExportError, match="model"):
        Deployment("")
    with pytest.raises(ExportError, match="tp must be an integer >= 1"):
        Deployment("m", tp=0)
    with pytest.raises(ExportError, match="replicas"):
        Deployment("m", replicas=-1)
    with pytest.raises(ValueError, match="unknown engine 'trtllm'"):
        target("trtllm")
    with pytest.raises(ExportError, match="policy.toml"):
        engine_yaml(target("servetune"), PolicyConfig(), DEPLOY, CTX)
    with pytest.raises(ExportError, match="top-level mapping"):
        read_engine_file(VLLM, "- 1\n- 2\n", CTX)


def test_traffic_shape_matches_the_trace():
    gaps = np.full(99, 0.5)
    trace = make_trace(np.concatenate([[0.0], np.cumsum(gaps)]), prompts=np.full(100, 1000),
                       outputs=np.full(100, 200))
    shape = TrafficShape.of(trace)
    assert shape.n_requests == 100
    assert shape.rate_rps == pytest.approx(2.0)
    assert math.isinf(shape.burstiness)  # perfectly regular gaps
    assert (shape.mean_prompt_tokens, shape.mean_output_tokens, shape.range_ratio) == (1000, 200, 0.0)
    rng = np.random.default_rng(1)
    poisson = make_trace(np.cumsum(rng.exponential(0.1, 20000)), prompts=np.full(20000, 10),
                         outputs=np.full(20000, 10))
    assert TrafficShape.of(poisson).burstiness == pytest.approx(1.0, rel=0.05)
    with pytest.raises(ExportError, match="at least 2 requests"):
        TrafficShape.of(make_trace([0.0], prompts=[10], outputs=[10]))


def test_goodput_bounds_are_the_strictest_per_key():
    slos = SLOSet((SLOClass("chat", ttft_ms=2000, tpot_ms=100), SLOClass("batch", ttft_ms=8000, e2el_ms=60000)))
    assert goodput_bounds(slos) == {"ttft": 2000.0, "tpot": 100.0, "e2el": 60000.0}
    assert goodput_bounds(parse_slo("tpot:50")) == {"tpot": 50.0}


def test_write_exports_writes_only_the_targets_files(tmp_path):
    for name in ENGINES:
        config = preset(f"{name}-default", CTX)
        paths = write_exports(tmp_path / name, target(name), config, DEPLOY, CTX, expected={"request_goodput": 1.5})
        assert sorted(paths) == [f"{name}.yaml"]
        assert "simulated request_goodput of this file: 1.5" in paths[f"{name}.yaml"].read_text()
        assert read_engine_file(target(name), paths[f"{name}.yaml"].read_text(), CTX) == target(name).resolve(
            config, CTX)
    single = write_exports(tmp_path / "one", target("servetune"), PolicyConfig(), Deployment("m"), CTX)
    assert sorted(single) == ["policy.toml"]
    paths = write_exports(tmp_path / "best", target("servetune"), PolicyConfig(), DEPLOY, CTX)
    assert sorted(paths) == ["policy.toml", "router.yaml"]
    assert all(p.stat().st_size > 0 for p in paths.values())
    assert PolicyConfig.from_toml(paths["policy.toml"]) == PolicyConfig()
