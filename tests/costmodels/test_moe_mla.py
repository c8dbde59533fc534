"""MoE and MLA models: memory against hand-computed values, step time against the table
lookups it is composed of, and the errors for what the tables cannot time."""

import json

import numpy as np
import polars as pl
import pytest

from costmodels import CostModelError, build, load_gpu, load_model, step_seconds
from costmodels.architecture import ModelArch
from costmodels.build import CUDA_GRAPH_BYTES, RUNTIME_BYTES
from costmodels.compose import attention_shape
from costmodels.layout import ParallelLayout
from costmodels.linear import mlp_comm_seconds
from costmodels.moeops import DEFAULT_DISTRIBUTION
from costmodels.optables import ProfiledOps

GIB = 2**30
H100_BANDWIDTH = 3.35e12 * 0.8
# DeepSeek-V3 config.json: 61 layers, hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64,
# nope 128, v 128; first 3 layers dense (18432), then 256 experts of 2048 + 1 shared, vocab 129280
DSV3_ATTENTION = (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256
                  + 128 * 128 * 7168 + 2 * 7168)
DSV3_MLP = 3 * 3 * 7168 * 18432 + 58 * (256 * 3 * 7168 * 2048 + 3 * 7168 * 2048 + 7168 * 256)
DSV3_PARAMS = 61 * DSV3_ATTENTION + DSV3_MLP + 2 * 129280 * 7168 + 7168
# Qwen3-30B-A3B config.json: 48 layers, hidden 2048, 32 q / 4 KV heads of 128, 128 experts of
# 768, top-8, vocab 151936, untied
QWEN_ATTENTION = 2048 * (4096 + 2 * 512) + 4096 * 2048 + 2 * 2048
QWEN_PARAMS = 48 * (QWEN_ATTENTION + 128 * 3 * 2048 * 768 + 2048 * 128) + 2 * 151936 * 2048 + 2048


def test_mla_kv_bytes_per_token_is_the_latent_on_every_gpu():
    arch = load_model("deepseek-ai/DeepSeek-V3")
    for tp in (1, 8):  # vLLM holds the whole latent on each TP rank
        assert arch.kv_bytes_per_token(tp, "bf16") == 61 * (512 + 64) * 2 == 70_272
        assert arch.kv_bytes_per_token(tp, "fp8") == 61 * (512 + 64) == 35_136


def test_mla_moe_weights_and_kv_capacity_by_hand():
    arch = load_model("deepseek-ai/DeepSeek-V3")
    assert arch.num_params() == DSV3_PARAMS
    assert DSV3_PARAMS / 1e9 == pytest.approx(671, rel=0.002)  # DeepSeek's stated size without the MTP layer
    cost = build("deepseek-ai/DeepSeek-V3", "h200", tp=8, gemm_dtype="fp8", kv_dtype="fp8", calibration=False)
    assert cost.weight_bytes == pytest.approx(DSV3_PARAMS / 8)  # all experts resident, fp8, split 8 ways
    reserve = 256 * 129280 / 8 * 4 + CUDA_GRAPH_BYTES + RUNTIME_BYTES + 411_041_792
    activation = (4 * 7168 + 3 * 18432 // 8) * 2  # the dense layers' MLP is the widest live set
    assert cost.reserved_bytes == pytest.approx(reserve)
    assert cost.activation_bytes_per_token == activation
    budget = 0.9 * 151_397_597_184 - DSV3_PARAMS / 8 - reserve - 8192 * activation
    assert cost.kv_capacity_tokens(0.9, 8192) == int(budget // 35_136)


def test_gqa_moe_kv_bytes_and_capacity_by_hand():
    arch = load_model("Qwen/Qwen3-30B-A3B")
    assert arch.kv_bytes_per_token(1, "bf16") == 2 * 48 * 4 * 128 * 2 == 98_304
    assert arch.kv_bytes_per_token(2, "bf16") == 49_152
    assert arch.kv_bytes_per_token(1, "fp8") == 49_152
    assert arch.kv_bytes_per_token(8, "bf16") == 2 * 48 * 1 * 128 * 2  # 4 KV heads replicated over 8 GPUs
    assert arch.num_params() == QWEN_PARAMS
    assert QWEN_PARAMS / 1e9 == pytest.approx(30.5, rel=0.01)
    cost = build("Qwen/Qwen3-30B-A3B", "h100", calibration=False)
    reserve = 256 * 151936 * 4 + CUDA_GRAPH_BYTES + RUNTIME_BYTES
    activation = (4 * 2048 + 3 * 8 * 768) * 2  # each token's top-8 experts
    budget = 0.9 * 80 * GIB - QWEN_PARAMS * 2 - reserve - 8192 * activation
    assert cost.kv_capacity_tokens(0.9, 8192) == int(budget // 98_304)


def test_expert_parallel_keeps_weights_and_attention_dp_replicates_attention():
    arch = load_model("Qwen/Qwen3-235B-A22B")
    attention = arch.num_layers * arch.attention_params()
    plain = arch.weight_bytes(8, "fp8")
    assert plain == pytest.approx(arch.num_params() / 8)
    assert arch.weight_bytes(8, "fp8", attention_dp_size=8) == pytest.approx(plain + attention * 7 / 8)
    assert arch.kv_bytes_per_token(8, "fp8", attention_dp_size=8) == 2 * 94 * 4 * 128


def _decode_envelope(rows: dict, batch: int, kv_tokens: float) -> float:
    """Decode attention as the grid keeps it: the most any batch up to ``batch`` costs over at
    most ``kv_tokens`` in total (more sequences over the same KV never cost less), read at
    measured points (per-sequence contexts kv_tokens / b are measured powers of two)."""
    return max(float(s[ctx <= kv_tokens / b].max()) for b, (ctx, s) in rows.items() if b <= batch)


def _moe_ms(aic_root, tokens, distribution):
    """Qwen3-30B-A3B's fused MoE on H100/vLLM, bf16, one GPU, read from the raw table."""
    df = pl.read_parquet(aic_root / "systems/data/h100_sxm/moe/vllm/0.24.0/moe_perf.parquet").filter(
        (pl.col("hidden_size") == 2048) & (pl.col("inter_size") == 768) & (pl.col("topk") == 8)
        & (pl.col("num_experts") == 128) & (pl.col("moe_tp_size") == 1) & (pl.col("moe_ep_size") == 1)
        & (pl.col("moe_dtype") == "bfloat16") & (pl.col("distribution") == distribution)
        & (pl.col("num_tokens") == tokens))
    return float(df["latency"].median())


@pytest.mark.parametrize("distribution", [None, "balanced"])
def test_moe_step_time_is_the_composed_table_lookups(aic_root, distribution):
    """At the default routing skew (None: ``DEFAULT_DISTRIBUTION``) and at balanced routing,
    which is still there to ask for, the step reads that skew's rows of the MoE table."""
    skew = {} if distribution is None else {"moe_distribution": distribution}
    cost = build("Qwen/Qwen3-30B-A3B", "h100", calibration=False, **skew)
    read = distribution or DEFAULT_DISTRIBUTION
    assert cost.moe_distribution == read and f"MoE routing {read}" in cost.source
    ops = ProfiledOps("h100_sxm", "vllm", "bf16")
    b, ctx = 64, 1024
    per_layer = (ops.gemm(b, 4096 + 2 * 512, 2048) + ops.gemm(b, 2048, 4096)  # QKV, O
                 + float(np.float16(_moe_ms(aic_root, b, read))) * 1e-3 + ops.gemm(b, 128, 2048))  # experts, router
    elementwise = b * 2 * (10 * 2048 + 2 * (4096 + 512)) / H100_BANDWIDTH
    linear = 48 * per_layer + 48 * elementwise
    head = ops.gemm(b, 151936, 2048)
    rows = ops.decode_rows(attention_shape(load_model("Qwen/Qwen3-30B-A3B"), 1, "bf16"))
    decode = 48 * _decode_envelope(rows, b, b * ctx)
    expected = linear + head + decode + cost.tables.overhead_s
    seconds, out = step_seconds(cost.tables, b, b, b, b * ctx, 0.0)
    assert not out
    assert seconds == pytest.approx(float(expected), rel=1e-6)
    assert _moe_ms(aic_root, b, "balanced") != _moe_ms(aic_root, b, DEFAULT_DISTRIBUTION)  # the case is not vacuous


def test_default_routing_skew_loads_the_busiest_expert_parallel_rank():
    """Qwen3-235B-FP8 with EP 8 on H100/TRT-LLM: at prefill-sized steps the skewed routing's
    busiest rank costs more than balanced routing, the reason it is the default."""
    def token_linear_s(distribution, tokens):  # every layer's token-linear ops, the MoE among them
        kw = dict(tp=8, framework="trtllm", gemm_dtype="fp8", kv_dtype="fp8", moe_ep_size=8, calibration=False)
        t = build("Qwen/Qwen3-235B-A22B-FP8", "h100", moe_distribution=distribution, **kw).tables
        return float(np.interp(tokens, t.linear_tokens, t.linear_s))
    assert DEFAULT_DISTRIBUTION == "power_law_1.01"
    assert token_linear_s(DEFAULT_DISTRIBUTION, 4096) > 1.2 * token_linear_s("balanced", 4096)


def test_mla_decode_is_the_attention_module_table(aic_root):
    cost = build("deepseek-ai/DeepSeek-V3", "h200", tp=8, gemm_dtype="fp8", kv_dtype="fp8", calibration=False)
    df = pl.read_parquet(aic_root / "systems/data/h200_sxm/mla/vllm/0.24.0/mla_generation_module_perf.parquet")
    df = df.filter((pl.col("num_heads") == 16) & (pl.col("kv_cache_dtype") == "fp8")
                   & (pl.col("gemm_type") == "fp8_block") & (pl.col("kernel_source") == "FLASHMLA"))
    rows = {float(b): (g["step"].to_numpy().astype(float), g["latency"].to_numpy().astype(np.float16).astype(float) * 1e-3)
            for (b,), g in df.group_by(["batch_size"])}
    t = cost.tables._replace(overhead_s=0.0)
    with_attention = step_seconds(t, 64, 64, 64, 64 * 1024.0, 0.0)[0]
    without = step_seconds(t, 64, 64, 0, 0.0, 0.0)[0]  # the same tokens and logits, no attention
    assert with_attention - without == pytest.approx(61 * _decode_envelope(rows, 64, 64 * 1024.0), rel=1e-6)


def test_fp8_moe_reads_the_checkpoint_scheme_and_says_when_it_substitutes():
    cost = build("Qwen/Qwen3-30B-A3B", "h100", framework="sglang", gemm_dtype="fp8", calibration=False)
    assert "MoE fp8_block table for fp8 weights" in cost.source  # SGLang measured block scales only


def test_missing_table_points_fail_naming_what_was_measured():
    with pytest.raises(CostModelError, match="no fused-MoE rows measured for hidden=2880"):
        build("openai/gpt-oss-20b", "h100", calibration=False)  # its MoE table is mxfp4 only
    with pytest.raises(CostModelError, match=r"moe_tp=2 moe_ep=4 bf16.*measured \(dtype, moe_tp, moe_ep\)"):
        build("Qwen/Qwen3-30B-A3B", "h100", tp=8, moe_ep_size=4, calibration=False)  # no mixed TP x EP rows
    with pytest.raises(CostModelError, match="a100_sxm.*no moe table measured"):
        build("Qwen/Qwen3-30B-A3B", "a100", calibration=False)


def test_unknown_architecture_fails_naming_the_field(tmp_path):
    dense = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
             "vocab_size": 100}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dense | {"index_topk": 2048}))
    with pytest.raises(CostModelError, match="index_topk"):
        ModelArch.from_hf_config(path)
    path.write_text(json.dumps(dense | {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "v_head_dim": 128}))
    with pytest.raises(CostModelError, match="latent attention .*needs qk_rope_head_dim"):
        ModelArch.from_hf_config(path)


def test_moe_blocks_from_config():
    ds = load_model("deepseek-ai/DeepSeek-V3").moe
    assert (ds.num_experts, ds.top_k, ds.expert_intermediate_size, ds.shared_experts, ds.dense_layers) == (
        256, 8, 2048, 1, (0, 1, 2))
    mixtral = load_model("mistralai/Mixtral-8x7B-v0.1").moe
    assert (mixtral.num_experts, mixtral.top_k, mixtral.expert_intermediate_size) == (8, 2, 14336)
    oss = load_model("openai/gpt-oss-20b")
    assert oss.window.window == 128 and oss.window.sliding_layers == tuple(range(0, 24, 2)) and oss.window.sinks
    assert load_model("Qwen/Qwen3-30B-A3B-FP8").quant == "fp8_block"


def test_b200_spec_from_its_system_yaml():
    gpu = load_gpu("b200")
    assert gpu.memory_bytes == 193_273_528_320 and gpu.hbm_bytes_per_s == 7.7e12
    assert gpu.bf16_flops == 2.25e15 and gpu.fp8_flops == 4.5e15 and gpu.nvlink_bytes_per_s == 9e11
    cost = build("meta-llama/Llama-3.1-70B", "b200", calibration=False)
    assert cost.source.startswith("profiled:aiconfigurator/b200_sxm/vllm-0.24.0")
    # decode at batch 1 reads every weight once: no faster than HBM allows
    assert step_seconds(cost.tables, 1, 1, 1, 1024.0, 0.0)[0] > cost.weight_bytes / 7.7e12


def test_parallel_layouts_pay_their_collectives():
    arch, ops = load_model("Qwen/Qwen3-235B-A22B-FP8"), ProfiledOps("h100_sxm", "trtllm", "fp8")
    t, h = np.array([64.0]), 4096
    assert mlp_comm_seconds(ops, arch, ParallelLayout(8, 8, 1), t, routed=True) == ops.allreduce(t * h, 8)
    gathered = 8 * t * h  # each of 8 DP groups brings its 64 tokens
    assert mlp_comm_seconds(ops, arch, ParallelLayout(8, 1, 8), t, routed=True) == (
        ops.collective("all_gather", gathered, 8) + ops.collective("reduce_scatter", gathered, 8))
    assert mlp_comm_seconds(ops, arch, ParallelLayout(8, 8, 8), t, routed=True) == 2 * ops.collective("alltoall", t * 8 * h, 8)
    with pytest.raises(CostModelError, match="has no experts"):
        build("meta-llama/Llama-3.1-8B", "h100", tp=2, attention_dp_size=2)
    with pytest.raises(CostModelError, match="moe_ep_size=3 must divide tp=8"):
        ParallelLayout(8, 3)
