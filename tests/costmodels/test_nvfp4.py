"""NVFP4 weights on B200, from the nvfp4 GEMM and fused-MoE tables each framework measured."""

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from costmodels import CostModelError, build
from costmodels.architecture import load_model
from costmodels.optables import ProfiledOps
from costmodels.runs import kv_dtype_of
from optimizer.cli import app

LLAMA70 = "meta-llama/Llama-3.1-70B"
VERSIONS = {"vllm": "0.24.0", "sglang": "0.5.14", "trtllm": "1.3.0rc20"}


def measured_ms(aic_root, framework: str, m: int, n: int, k: int) -> float:
    """The median nvfp4 GEMM latency ``framework``'s collector measured on B200 at (m, n, k)."""
    raw = pl.read_parquet(aic_root / f"systems/data/b200_sxm/gemm/{framework}/{VERSIONS[framework]}/gemm_perf.parquet")
    return raw.filter((pl.col("gemm_dtype") == "nvfp4") & (pl.col("m") == m) & (pl.col("n") == n)
                      & (pl.col("k") == k))["latency"].median()


@pytest.mark.parametrize("framework", ["vllm", "sglang", "trtllm"])
def test_nvfp4_gemms_are_read_from_their_own_table(aic_root, framework):
    ops = ProfiledOps("b200_sxm", framework, "nvfp4")
    own = measured_ms(aic_root, framework, 64, 8192, 8192)
    if framework == "trtllm":  # untuned: the fastest kernel measured on the GPU (next test)
        own = min(own, *(measured_ms(aic_root, f, 64, 8192, 8192) for f in ("vllm", "sglang")))
    assert ops.gemm(np.array([64.0]), 8192, 8192)[0] * 1e3 == pytest.approx(own, rel=2e-3)
    # a long prompt's projection is faster in NVFP4 than in FP8 on every framework's kernels
    big = np.array([8192.0])
    assert ops.gemm(big, 8192, 8192)[0] < ProfiledOps("b200_sxm", framework, "fp8").gemm(big, 8192, 8192)[0]


def test_trtllms_untuned_nvfp4_table_is_read_as_the_fastest_kernel_measured_on_the_gpu(aic_root):
    # aiconfigurator times TRT-LLM's NVFP4 Linear outside its autotuner (the fallback tactic):
    # at decode sizes flat in n, and slower than FlashInfer's NVFP4 GEMM in vLLM's tables
    trt, vllm, sglang = (ProfiledOps("b200_sxm", f, "nvfp4") for f in ("trtllm", "vllm", "sglang"))
    decode = np.array([1.0, 8.0, 64.0])
    for n, k in ((1280, 8192), (8192, 8192), (57344, 8192)):
        fastest = np.minimum(vllm.gemm(decode, n, k), sglang.gemm(decode, n, k))
        assert (trt.gemm(decode, n, k) <= fastest * (1 + 1e-9)).all()
    assert measured_ms(aic_root, "trtllm", 64, 1024, 8192) > 1.3 * measured_ms(aic_root, "vllm", 64, 1024, 8192)
    assert trt.gemm(np.array([64.0]), 1024, 8192)[0] * 1e3 == pytest.approx(
        min(measured_ms(aic_root, f, 64, 1024, 8192) for f in VERSIONS), rel=2e-3)
    assert any("untuned fallback kernel" in note for note in trt.notes)
    # the other dtypes keep TRT-LLM's own tables, and the other frameworks theirs
    bf16 = pl.read_parquet(aic_root / "systems/data/b200_sxm/gemm/trtllm/1.3.0rc20/gemm_perf.parquet").filter(
        (pl.col("gemm_dtype") == "bfloat16") & (pl.col("m") == 64) & (pl.col("n") == 8192) & (pl.col("k") == 8192))
    assert ProfiledOps("b200_sxm", "trtllm", "bf16").gemm(np.array([64.0]), 8192, 8192)[0] * 1e3 == pytest.approx(
        bf16["latency"].median(), rel=2e-3)
    assert not vllm.notes and not sglang.notes


def test_nvfp4_weights_take_four_bits_and_a_scale_per_16():
    fp4 = build(LLAMA70, "b200", tp=4, framework="trtllm", gemm_dtype="nvfp4", kv_dtype="fp8")
    fp8 = build(LLAMA70, "b200", tp=4, framework="trtllm", gemm_dtype="fp8", kv_dtype="fp8")
    assert fp4.weight_bytes / fp8.weight_bytes == pytest.approx(0.5625)
    assert fp4.source.startswith("profiled:aiconfigurator/b200_sxm/trtllm")
    assert fp4.kv_capacity_tokens(0.9) > fp8.kv_capacity_tokens(0.9)  # the weights it frees hold KV


def test_nvfp4_moe_layers_read_the_nvfp4_rows_and_nothing_else():
    fp4 = build("Qwen/Qwen3-235B-A22B-FP8", "b200", tp=4, framework="trtllm", gemm_dtype="nvfp4", kv_dtype="fp8")
    assert "MoE" in fp4.source and "table for" not in fp4.source  # no substituted dtype


def test_nvfp4_where_no_table_or_kernel_has_it_is_an_error_naming_why():
    with pytest.raises(CostModelError, match="h100_sxm has no nvfp4 tensor cores"):
        build(LLAMA70, "h100", tp=4, framework="vllm", gemm_dtype="nvfp4")
    with pytest.raises(CostModelError, match="NVFP4 latent-attention projections are not in the MLA tables"):
        build("deepseek-ai/DeepSeek-V3", "b200", tp=8, framework="trtllm", gemm_dtype="nvfp4")
    assert load_model("deepseek-ai/DeepSeek-V3").mla is not None


def test_an_nvfp4_run_without_a_kv_column_is_taken_to_store_fp8_kv():
    assert [kv_dtype_of(d) for d in ("bf16", "fp8", "nvfp4")] == ["bf16", "fp8", "fp8"]
    assert kv_dtype_of("nvfp4", "bf16") == "bf16"  # what a run records wins


def test_simulate_takes_nvfp4(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"arrival_s": {i * 0.1}, "prompt_tokens": 512, "output_tokens": 32}}\n'
                             for i in range(20)))
    out = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--model", LLAMA70, "--gpu", "b200",
                                   "--tp", "4", "--dtype", "nvfp4", "--kv-dtype", "fp8", "--format", "json"])
    assert out.exit_code == 0, out.output
    assert '"weights": "nvfp4"' in out.output and '"finished": 20' in out.output
