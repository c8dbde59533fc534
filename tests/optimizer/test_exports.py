"""Exports: engine YAMLs use only flags the target release accepts, and everything round-trips."""

from __future__ import annotations

import math
import re
import stat
import tomllib

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from optimizer.exports import (
    Deployment,
    ExportError,
    TrafficShape,
    bench_script,
    engine_args,
    engine_yaml,
    goodput_bounds,
    knobs_from_engine_yaml,
    policy_toml,
    write_exports,
)
from policies.config import KNOBS, PolicyConfig
from policies.presets import preset
from studies.slo import SLOClass, SLOSet, parse_slo
from tests.optimizer.test_outputs_fixtures import make_trace

# Long flags `vllm serve` 0.33.0 accepts for the knobs servetune could export
# (serving-configs.md §1.2-1.3), checked independently of optimizer.exports.
VLLM_033_KEYS = frozenset({
    "model", "tensor-parallel-size", "data-parallel-size", "pipeline-parallel-size",
    "max-num-batched-tokens", "max-num-seqs", "max-num-active-seqs", "enable-chunked-prefill",
    "long-prefill-token-threshold", "long-prefill-token-threshold-adaptive", "scheduling-policy",
    "watermark", "scheduler-reserve-full-isl", "prefill-schedule-interval", "max-num-queued-reqs",
    "max-num-queued-tokens", "async-scheduling", "gpu-memory-utilization", "kv-cache-memory-bytes",
    "num-gpu-blocks-override", "block-size", "enable-prefix-caching", "prefix-caching-hash-algo",
    "speculative-config", "enable-expert-parallel", "max-model-len",
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
    "speculative-eagle-topk", "speculative-num-draft-tokens",
})

DEPLOY = Deployment("meta-llama/Llama-3.1-8B", tp=2, replicas=3, gpu="h100")


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


@settings(max_examples=60, deadline=None)
@given(configs)
def test_vllm_yaml_uses_only_accepted_keys_and_round_trips(config):
    text = engine_yaml(config, DEPLOY, "vllm")
    data = yaml.safe_load(text)
    assert set(data) <= VLLM_033_KEYS
    assert not set(data) & VLLM_REMOVED_KEYS
    assert all("_" not in key for key in data)
    assert data["model"] == DEPLOY.model
    assert (data["tensor-parallel-size"], data["data-parallel-size"]) == (2, 3)
    assert data["gpu-memory-utilization"] == config.gpu_memory_utilization  # always explicit
    carried = knobs_from_engine_yaml(text, "vllm")
    assert carried, "the vLLM file carries the batch knobs"
    for name, value in carried.items():
        assert value == getattr(config, name), name


@settings(max_examples=60, deadline=None)
@given(configs)
def test_sglang_yaml_uses_hyphenated_flags_and_round_trips(config):
    deploy = Deployment("m", reserved_fraction=0.02)
    if config.gpu_memory_utilization <= 0.02:
        with pytest.raises(ExportError, match="activation reserve"):
            engine_yaml(config, deploy, "sglang")
        return
    text = engine_yaml(config, deploy, "sglang")
    data = yaml.safe_load(text)
    assert set(data) <= SGLANG_0523_KEYS
    assert all(value is not False for value in data.values()), "SGLang ignores false store_true flags"
    carried = knobs_from_engine_yaml(text, "sglang", reserved_fraction=0.02)
    for name, value in carried.items():
        assert value == pytest.approx(getattr(config, name), abs=1e-6), name


@settings(max_examples=60, deadline=None)
@given(configs)
def test_policy_toml_round_trips_every_knob(config):
    text = policy_toml(config, note="trial 7")
    assert PolicyConfig.from_toml(text) == config
    assert set(tomllib.loads(text)["policy"]) == {k.name for k in KNOBS}


def test_policy_toml_marks_exactly_the_knobs_no_engine_exposes():
    text = policy_toml(PolicyConfig())
    lines = text.splitlines()
    for knob in KNOBS:
        comment = lines[lines.index(next(ln for ln in lines if ln.startswith(f"{knob.name} ="))) - 1]
        exposed = bool(knob.vllm or knob.sglang or knob.router)
        assert ("NOT EXPOSED" in comment) is not exposed, knob.name
        if knob.vllm:
            assert f"vllm --{knob.vllm}" in comment
        if knob.sglang:
            assert f"sglang --{knob.sglang}" in comment
    assert "NOT EXPOSED" in lines[lines.index('admission_mode = "none"') - 1]


def test_vllm_values_and_watermark_from_kv_headroom():
    config = PolicyConfig(max_num_batched_tokens=3072, max_num_seqs=96, long_prefill_token_threshold=512,
                          kv_headroom=0.04, gpu_memory_utilization=0.9, block_size=32)
    args = engine_args(config, DEPLOY, "vllm").args
    assert args["max-num-batched-tokens"] == 3072 and args["max-num-seqs"] == 96
    assert args["long-prefill-token-threshold"] == 512 and args["watermark"] == 0.04
    assert args["enable-chunked-prefill"] is True and args["block-size"] == 32
    assert args["scheduling-policy"] == "fcfs"
    # 0 = unlimited in servetune; the engine's unlimited is the flag left unset.
    assert "max-model-len" not in args and "max-num-queued-reqs" not in args


def test_vllm_header_lists_knobs_the_engine_cannot_carry():
    config = preset("vllm-default").replace(admission_mode="predicted", preemption_mode="swap")
    mapped = engine_args(config, DEPLOY, "vllm")
    assert set(mapped.not_carried) == {"admission_mode", "preemption_mode"}
    text = engine_yaml(config, DEPLOY, "vllm")
    assert re.search(r"^#\s+admission_mode = 'predicted'", text, re.M)
    assert not engine_args(preset("vllm-default"), DEPLOY, "vllm").not_carried, \
        "vLLM's own defaults need nothing beyond its flags"


def test_vllm_priority_policy_warns_about_opposite_priority_order():
    text = engine_yaml(PolicyConfig(scheduling_policy="priority"), DEPLOY, "vllm")
    assert yaml.safe_load(text)["scheduling-policy"] == "priority"
    assert "LOWER priority values first" in text


def test_sglang_expresses_off_switches_with_values_not_false():
    config = preset("sglang-default").replace(enable_chunked_prefill=False, scheduling_policy="priority")
    mapped = engine_args(config, Deployment("m"), "sglang")
    assert mapped.args["chunked-prefill-size"] == -1
    assert mapped.args["enable-priority-scheduling"] is True
    assert "enable_chunked_prefill" not in mapped.not_carried
    assert knobs_from_engine_yaml(engine_yaml(config, Deployment("m"), "sglang"), "sglang")[
        "enable_chunked_prefill"] is False


def test_sglang_mem_fraction_excludes_the_activation_reserve():
    config = PolicyConfig(gpu_memory_utilization=0.9)
    args = engine_args(config, Deployment("m", reserved_fraction=0.05), "sglang").args
    assert args["mem-fraction-static"] == pytest.approx(0.85)
    assert not engine_args(preset("sglang-default"), Deployment("m"), "sglang").not_carried


def test_bad_deployments_and_backends_are_named():
    with pytest.raises(ExportError, match="model"):
        Deployment("")
    with pytest.raises(ExportError, match="tp must be an integer >= 1"):
        Deployment("m", tp=0)
    with pytest.raises(ExportError, match="replicas"):
        Deployment("m", replicas=-1)
    with pytest.raises(ExportError, match="unknown backend 'trtllm'"):
        engine_yaml(PolicyConfig(), DEPLOY, "trtllm")
    with pytest.raises(ExportError, match="top-level mapping"):
        knobs_from_engine_yaml("- 1\n- 2\n", "vllm")


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


def test_bench_script_carries_goodput_rate_and_model():
    trace = make_trace(np.arange(50) * 0.25, prompts=np.full(50, 800), outputs=np.full(50, 120))
    slos = SLOSet((SLOClass("chat", ttft_ms=2000, tpot_ms=100), SLOClass("batch", ttft_ms=8000, e2el_ms=60000)))
    text = bench_script(DEPLOY, slos, TrafficShape.of(trace), seed=3, expected={"request_goodput": 3.5})
    assert text.startswith("#!/usr/bin/env bash")
    command = text[text.index("vllm bench serve"):].replace("\\\n", " ")
    assert "--goodput ttft:2000 tpot:100 e2el:60000" in command  # strictest bound per key
    assert "--request-rate 4 " in command and "--num-prompts 50" in command
    assert "--model meta-llama/Llama-3.1-8B" in command and "--seed 3" in command
    assert "--random-input-len 800" in command and "--random-output-len 120" in command
    assert "# simulated request_goodput: 3.5" in text
    assert "vllm serve --config vllm.yaml" in text
    assert goodput_bounds(parse_slo("tpot:50")) == {"tpot": 50.0}


def test_write_exports_writes_four_files_and_a_router_for_replicas(tmp_path):
    trace = make_trace(np.arange(10) * 1.0, prompts=np.full(10, 64), outputs=np.full(10, 8))
    single = write_exports(tmp_path / "one", PolicyConfig(), Deployment("m"), parse_slo("ttft:500"),
                           TrafficShape.of(trace))
    assert sorted(single) == ["bench.sh", "policy.toml", "sglang.yaml", "vllm.yaml"]
    paths = write_exports(tmp_path / "best", PolicyConfig(), DEPLOY, parse_slo("ttft:500"), TrafficShape.of(trace))
    assert sorted(paths) == ["bench.sh", "policy.toml", "router.yaml", "sglang.yaml", "vllm.yaml"]
    assert all(p.stat().st_size > 0 for p in paths.values())
    assert paths["bench.sh"].stat().st_mode & stat.S_IXUSR
    assert PolicyConfig.from_toml(paths["policy.toml"]) == PolicyConfig()
