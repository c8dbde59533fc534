"""LoRA knobs in the engines' spaces and files: searched only for a trace with adapters,
written only with LoRA on, read back exactly, refused where the engine refuses them."""

from __future__ import annotations

import pytest

from optimizer.search.space import build_space
from optimizer.search.targets import engine_context
from policies.config import LORA_KNOBS
from policies.engines import sglang, vllm
from policies.engines.base import Deployment, EngineError
from tests.optimizer.tuning_helpers import sampled

LLAMA = "meta-llama/Llama-3.1-8B"
LORA_ALL = {"enable_lora", *LORA_KNOBS}


@pytest.fixture(scope="module")
def ctx():
    return engine_context(LLAMA, "h100")


@pytest.mark.parametrize("engine", [vllm.ENGINE, sglang.ENGINE], ids=["vllm", "sglang"])
def test_a_base_model_trace_searches_no_lora_knob(engine, ctx):
    space = build_space(base=engine.defaults(ctx), target=engine, context=ctx)
    assert not LORA_ALL & set(space.names)
    assert not space.base.enable_lora


@pytest.mark.parametrize("engine, searched", [(vllm.ENGINE, {"max_loras", "max_cpu_loras"}),
                                              (sglang.ENGINE, {"max_loras", "lora_eviction_policy"})],
                         ids=["vllm", "sglang"])
def test_a_trace_with_adapters_turns_lora_on_and_searches_the_pool(engine, searched, ctx):
    space = build_space(base=engine.defaults(ctx), target=engine, context=ctx, adapters=12)
    assert LORA_ALL & set(space.names) == searched
    configs = [config for config, _ in sampled(space)]
    assert all(config.enable_lora for config in configs)
    assert len({config.max_loras for config in configs}) > 1
    assert max(config.max_loras for config in configs) <= 13  # at most one slot per adapter (+ the base)


def test_the_what_if_target_searches_both_engines_pool_rules_only_with_adapters():
    assert not LORA_ALL & set(build_space().names)
    names = set(build_space(adapters=4).names)
    assert {"max_loras", "max_cpu_loras", "lora_eviction_policy", "lora_base_slot", "lora_preload"} <= names


def test_vllm_file_carries_the_lora_flags_and_reads_back(ctx):
    config = vllm.ENGINE.defaults(ctx).replace(enable_lora=True, max_loras=4, max_cpu_loras=16, max_lora_rank=32)
    args = vllm.ENGINE.to_args(config, Deployment(LLAMA), ctx)
    assert {k: args[k] for k in args if "lora" in k} == {"enable-lora": True, "max-loras": 4, "max-lora-rank": 32,
                                                          "max-cpu-loras": 16}
    back = vllm.ENGINE.from_args(args, ctx)
    assert back == vllm.ENGINE.resolve(config, ctx) and not back.lora_base_slot and not back.lora_preload
    plain = vllm.ENGINE.to_args(vllm.ENGINE.defaults(ctx).replace(max_loras=7), Deployment(LLAMA), ctx)
    assert not [k for k in plain if "lora" in k]  # without LoRA the pool's flags are left out


def test_sglang_file_names_every_target_module_and_counts_the_base_model(ctx):
    config = sglang.ENGINE.defaults(ctx).replace(enable_lora=True, max_loras=3, lora_eviction_policy="fifo")
    args = sglang.ENGINE.to_args(config, Deployment(LLAMA), ctx)
    assert {k: args[k] for k in args if "lora" in k} == {
        "enable-lora": True, "max-loras-per-batch": 3, "lora-eviction-policy": "fifo", "max-lora-rank": 16,
        "lora-target-modules": ["all"]}
    back = sglang.ENGINE.from_args(args, ctx)
    assert back == sglang.ENGINE.resolve(config, ctx)
    assert back.lora_base_slot and back.lora_preload and sglang.ENGINE.defaults(ctx).max_loras == 8
    with pytest.raises(EngineError, match="lora-target-modules"):
        sglang.ENGINE.from_args({**args, "lora-target-modules": ["q_proj"]}, ctx)


def test_vllm_refuses_a_rank_it_has_no_choice_for_and_a_host_cache_below_the_slots(ctx):
    base = vllm.ENGINE.defaults(ctx).replace(enable_lora=True)
    with pytest.raises(EngineError, match=r"max-lora-rank 24 .*vllm/config/lora.py:27"):
        vllm.ENGINE.check(base.replace(max_lora_rank=24), ctx)
    with pytest.raises(EngineError, match=r"max_cpu_loras \(2\) must be >= max_loras \(4\)"):
        vllm.ENGINE.check(base.replace(max_loras=4, max_cpu_loras=2), ctx)
