"""PolicyConfig: validation, packing and TOML round trips; presets match the engines' defaults."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodels.costmodel import CostModelError
from costmodels.gpus import load_gpu
from optimizer.search.targets import engine_context
from policies.config import KNOBS, ConfigError, PolicyConfig
from policies.engines import EngineContext, preset


def _ctx(gpu: str) -> EngineContext:
    """A context of ``gpu`` without a model (no context length, no KV sizing)."""
    return EngineContext(gpu, load_gpu(gpu).memory_bytes / 2**30)


def vllm_default(gpu: str = "h100") -> PolicyConfig:
    return preset("vllm-default", _ctx(gpu))


def sglang_default(gpu: str = "h100") -> PolicyConfig:
    return preset("sglang-default", _ctx(gpu))


def _knob_value(knob):
    if knob.kind is bool:
        return st.booleans()
    if knob.kind is str:
        return st.sampled_from(knob.choices)
    if knob.kind is int:
        return st.integers(int(knob.low), int(min(knob.high, 1 << 20)))
    return st.floats(knob.low, knob.high, allow_nan=False)


configs = st.fixed_dictionaries({k.name: _knob_value(k) for k in KNOBS}).map(lambda d: PolicyConfig(**d))


@settings(max_examples=60, deadline=None)
@given(configs)
def test_vector_and_toml_round_trip(config):
    assert PolicyConfig.from_vector(config.to_vector()) == config
    assert PolicyConfig.from_toml(config.to_toml()) == config


@pytest.mark.parametrize(
    "change, message",
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be in"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
        ({"gpu_memory_utilization": math.nan}, "NaN"),
        ({"block_size": 2.5}, "must be an integer"),
        ({"admission_mode": "magic"}, "admission_mode must be one of"),
        ({"enable_chunked_prefill": "yes"}, "true or false"),
        ({"no_such_knob": 1}, "unknown knob"),
    ],
)
def test_invalid_values_name_the_knob(change, message):
    with pytest.raises(ConfigError, match=message):
        PolicyConfig().replace(**change)


def test_toml_with_unknown_key_is_refused():
    with pytest.raises(ConfigError, match="unknown knob"):
        PolicyConfig.from_toml("[policy]\nmax_num_seq = 4\n")


def test_vllm_defaults_follow_gpu_memory():
    assert (vllm_default("h100").max_num_batched_tokens, vllm_default("h100").max_num_seqs) == (8192, 1024)
    assert (vllm_default("h200").max_num_batched_tokens, vllm_default("h200").max_num_seqs) == (8192, 1024)
    # vLLM excludes A100 from the large-GPU defaults.
    assert (vllm_default("a100").max_num_batched_tokens, vllm_default("a100").max_num_seqs) == (2048, 256)
    assert vllm_default().gpu_memory_utilization == 0.92 and vllm_default().schedule_mode == "decode_first"


def test_sglang_defaults_are_prefill_first_with_ratio_admission():
    cfg = sglang_default("h100")
    assert cfg.schedule_mode == "prefill_first"
    assert cfg.admission_mode == "new_token_ratio"
    assert (cfg.max_num_batched_tokens, cfg.max_prefill_tokens, cfg.block_size) == (8192, 16384, 1)


def test_unknown_preset_and_gpu_are_named():
    with pytest.raises(ConfigError, match="unknown preset 'vllm'"):
        preset("vllm", _ctx("h100"))
    with pytest.raises(CostModelError, match="unknown GPU 'v100'"):
        engine_context("meta-llama/Llama-3.1-8B", "v100")


def test_both_engines_cache_prefixes_by_default():
    # vLLM V1 enables automatic prefix caching and SGLang its radix cache unless told not to.
    assert vllm_default("h100").enable_prefix_caching and sglang_default("h100").enable_prefix_caching
