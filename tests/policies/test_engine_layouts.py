"""Parallel layouts of a MoE model in each engine's file: the flags that spell expert and
attention data parallelism, their exact inverse, and each engine's rules (with the engine
source line that states it; the files below passed engine-check of vLLM 0.33.0 and SGLang
0.5.23 on a faked 8-GPU H100 node)."""

from dataclasses import replace

import pytest

from policies.config import PolicyConfig
from policies.engines import Deployment, EngineContext, EngineError, target

MOE = EngineContext(gpu="h100", gpu_memory_gib=79.6, context_len=40960, moe=True)
DENSE = EngineContext(gpu="h100", gpu_memory_gib=79.6, context_len=131072)
MODEL = "Qwen/Qwen3-30B-A3B"


def _layout(args, *keys):
    return {k: args[k] for k in keys if k in args}


@pytest.mark.parametrize(("deployment", "flags"), [
    # vLLM: tensor-parallel-size is per DP rank; the instance's tp is TP x DP
    (Deployment(MODEL, 8, 1, moe_ep=8, attention_dp=8),
     {"tensor-parallel-size": 1, "data-parallel-size": 8, "enable-expert-parallel": True}),
    (Deployment(MODEL, 8, 1, moe_ep=1, attention_dp=2), {"tensor-parallel-size": 4, "data-parallel-size": 2}),
    (Deployment(MODEL, 2, 1, moe_ep=2), {"tensor-parallel-size": 2, "enable-expert-parallel": True}),
])
def test_vllm_spells_a_moe_layout_as_tp_per_rank_dp_ranks_and_expert_parallel(deployment, flags):
    engine = target("vllm")
    args = engine.to_args(engine.defaults(MOE), deployment, MOE)
    assert _layout(args, "tensor-parallel-size", "data-parallel-size", "enable-expert-parallel") == flags
    assert engine.deployment_from_args(args, MOE) == deployment
    assert engine.from_args(args, MOE) == engine.defaults(MOE)  # per-rank knobs: vLLM's scheduler config


def test_vllm_data_parallel_of_a_dense_model_stays_replicas():
    engine = target("vllm")
    dense = Deployment("meta-llama/Llama-3.1-8B", 2, 3)
    args = engine.to_args(engine.defaults(DENSE), dense, DENSE)
    assert _layout(args, "tensor-parallel-size", "data-parallel-size") == {"tensor-parallel-size": 2,
                                                                          "data-parallel-size": 3}
    # v1/engine/core.py:1550-1552: the DP ranks of a dense model are independent: replicas
    assert engine.deployment_from_args(args, DENSE) == dense


def test_vllm_rules_for_moe_layouts():
    engine = target("vllm")
    # v1/engine/core.py:1546-1549 (DPEngineCoreProc): a MoE model's DP ranks are one instance
    broken = engine.layout_violations(Deployment(MODEL, 4, 2, moe_ep=4), MOE)
    assert len(broken) == 1 and "core.py:1546-1549" in broken[0]
    assert engine.replicas_per_file(MOE) == 1 and engine.replicas_per_file(DENSE) is None
    # fused_moe/config.py:1228-1230: enable-expert-parallel splits the experts over TP x DP GPUs
    broken = engine.layout_violations(Deployment(MODEL, 8, 1, moe_ep=4), MOE)
    assert len(broken) == 1 and "fused_moe/config.py:1228-1230" in broken[0]
    with pytest.raises(EngineError, match="refuses this layout"):
        engine.to_args(engine.defaults(MOE), Deployment(MODEL, 8, 1, moe_ep=4), MOE)
    assert engine.layout_violations(Deployment(MODEL, 8, 1, moe_ep=8, attention_dp=4), MOE) == []


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_a_dense_model_has_no_expert_or_attention_data_parallelism(name):
    engine = target(name)
    for layout in (dict(moe_ep=2), dict(attention_dp=2)):
        broken = engine.layout_violations(Deployment("meta-llama/Llama-3.1-8B", 2, 1, **layout), DENSE)
        assert len(broken) == 1 and "has no experts" in broken[0]
    assert engine.layout_violations(Deployment("meta-llama/Llama-3.1-8B", 2, 4), DENSE) == []


def test_sglang_spells_a_moe_layout_as_attn_dp_and_ep_size():
    engine = target("sglang")
    base = engine.defaults(MOE)
    for deployment, flags in (
            (Deployment(MODEL, 8, 1, moe_ep=8, attention_dp=8), {"tp-size": 8, "attn-dp-size": 8, "ep-size": 8}),
            (Deployment(MODEL, 4, 2, moe_ep=4), {"tp-size": 4, "dp-size": 2, "ep-size": 4}),
            (Deployment(MODEL, 8, 1, moe_ep=2), {"tp-size": 8, "ep-size": 2})):
        args = engine.to_args(base, deployment, MOE)
        assert _layout(args, "tp-size", "dp-size", "attn-dp-size", "ep-size") == flags
        assert engine.deployment_from_args(args, MOE) == deployment
        assert engine.from_args(args, MOE) == base


def test_sglang_per_rank_flags_are_written_as_sglang_divides_them_under_attention_dp():
    engine = target("sglang")
    config = engine.defaults(MOE).replace(max_num_batched_tokens=2048, max_num_seqs=64,
                                          schedule_conservativeness=0.3)
    args = engine.to_args(config, Deployment(MODEL, 8, 1, attention_dp=4), MOE)
    # arg_groups/parallel_hook.py:327-333 divides chunked-prefill-size by attn-dp-size;
    # kv_cache_configurator.py:3128 max-running-requests; parallel_hook.py:316-321 scales
    # schedule-conservativeness by 0.3: the file holds what makes each rank run the knobs
    assert (args["chunked-prefill-size"], args["max-running-requests"], args["schedule-conservativeness"]) == \
        (8192, 256, 1.0)
    assert engine.from_args(args, MOE) == config
    # without attention DP the file holds the knobs as they are
    plain = engine.to_args(config, Deployment(MODEL, 8, 1), MOE)
    assert (plain["chunked-prefill-size"], plain["max-running-requests"]) == (2048, 64)
    # a hand-written file that leaves them out runs SGLang's defaults per rank
    read = engine.from_args({"model-path": MODEL, "tp-size": 8, "attn-dp-size": 4}, MOE)
    assert read.max_num_batched_tokens == engine.defaults(MOE).max_num_batched_tokens // 4
    assert read.schedule_conservativeness == pytest.approx(0.3)


def test_sglang_rules_for_moe_layouts():
    engine = target("sglang")
    # arg_groups/parallel_hook.py:287-292: dp-size replicas with attn-dp-size are refused
    broken = engine.layout_violations(Deployment(MODEL, 4, 2, attention_dp=2), MOE)
    assert len(broken) == 1 and "parallel_hook.py:287-292" in broken[0]
    assert engine.replicas_per_file(MOE) is None
    # one scheduler routes nothing: the balance method is only written for several
    config = engine.defaults(MOE)
    assert "load-balance-method" not in engine.to_args(config, Deployment(MODEL, 8, 1, moe_ep=8), MOE)
    assert engine.to_args(config, Deployment(MODEL, 8, 1, attention_dp=2), MOE)["load-balance-method"] == \
        "round_robin"


def test_a_layout_that_does_not_divide_the_instance_is_refused_with_its_numbers():
    with pytest.raises(EngineError, match="moe_ep=3 must divide tp=8"):
        Deployment(MODEL, 8, 1, moe_ep=3)
    with pytest.raises(EngineError, match="attention_dp=4 must divide tp=2"):
        Deployment(MODEL, 2, 1, attention_dp=4)
    with pytest.raises(EngineError, match="--attn-dp-size must be an integer"):
        target("sglang").deployment_from_args({"model-path": MODEL, "tp-size": 8, "attn-dp-size": "2"}, MOE)


def test_files_read_back_refuse_unknown_layout_keys():
    with pytest.raises(EngineError, match="does not simulate"):
        target("vllm").from_args({"model": MODEL, "ep-size": 8}, MOE)
    assert isinstance(target("sglang").from_args({"model-path": MODEL, "ep-size": 8}, MOE), PolicyConfig)


MLA_FP8 = EngineContext(gpu="h200", gpu_memory_gib=139.8, context_len=163840, moe=True, mla=True, kv_dtype="fp8")


def test_vllm_blocks_an_mla_model_as_its_attention_backend_takes_them():
    # vLLM 0.33 with no --block-size (engine-check, the backend selector on a faked Hopper):
    # DeepSeek-V3 with an FP8 KV cache takes FLASHMLA, blocks of 64 only
    # (v1/attention/backends/mla/flashmla.py:57-58; FLASH_ATTN_MLA takes no FP8 KV,
    # flashattn_mla.py:42-46); with a BF16 KV cache FLASH_ATTN_MLA, the default 16; Blackwell's
    # FLASHINFER_MLA takes 32 or 64 (flashinfer_mla.py:204-205), preferred the smallest
    # (v1/attention/backend.py:155-163)
    engine = target("vllm")
    assert engine.defaults(MLA_FP8).block_size == 64
    assert engine.defaults(replace(MLA_FP8, kv_dtype="bf16")).block_size == 16
    assert engine.defaults(replace(MLA_FP8, gpu="b200")).block_size == 32
    assert engine.defaults(replace(MLA_FP8, mla=False)).block_size == 16
    args = engine.to_args(engine.defaults(MLA_FP8), Deployment("deepseek-ai/DeepSeek-V3", 8, 1, moe_ep=8,
                                                               attention_dp=8), MLA_FP8)
    assert args["block-size"] == 64 and args["kv-cache-dtype"] == "fp8"
    # --block-size 16 there precludes FLASHMLA: vLLM runs TRITON_MLA (platforms/cuda.py:489-507)
    broken = engine.violations(engine.defaults(MLA_FP8).replace(block_size=16), MLA_FP8)
    assert len(broken) == 1 and "precludes FLASHMLA" in broken[0] and "give one of [64]" in broken[0]
    assert engine.violations(engine.defaults(replace(MLA_FP8, kv_dtype="bf16")).replace(block_size=32),
                             replace(MLA_FP8, kv_dtype="bf16")) == []


def test_a_models_context_says_whether_its_attention_is_mla():
    from optimizer.search.targets import engine_context

    assert engine_context("deepseek-ai/DeepSeek-V3", "h200", 8, dtype="fp8", kv_dtype="fp8").mla
    assert not engine_context(MODEL, "h100").mla
