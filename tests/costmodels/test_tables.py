"""The bundled tables against the raw aiconfigurator parquet (skips without ../shared)."""

import numpy as np
import polars as pl
import pytest

from costmodels.distil import current_versions
from costmodels.optables import AttentionShape, ProfiledOps


def test_distilled_versions_follow_query_versions(aic_root):
    versions = current_versions(aic_root)
    assert versions["h100_sxm", "vllm"] == "0.24.0" and versions["a100_sxm", "vllm"] == "0.14.0"
    ops = ProfiledOps("a100_sxm", "vllm", "bf16")
    assert ops.meta["version"] == "0.14.0"


@pytest.mark.parametrize("gpu, fw, ver", [("h100_sxm", "vllm", "0.24.0"), ("a100_sxm", "trtllm", "1.0.0")])
def test_gemm_interpolation_reproduces_measured_points(aic_root, gpu, fw, ver):
    raw = pl.read_parquet(aic_root / "systems" / "data" / gpu / "gemm" / fw / ver / "gemm_perf.parquet")
    raw = raw.filter(pl.col("gemm_dtype") == "bfloat16", pl.col("kernel_source") != "trt_flow_")
    ops = ProfiledOps(gpu, fw, "bf16")
    sample = raw.sample(200, seed=1)
    for m, n, k, ms in sample.select(["m", "n", "k", "latency"]).iter_rows():
        assert ops.gemm(np.array([m]), n, k)[0] * 1e3 == pytest.approx(ms, rel=2e-3)


def test_gemm_interpolates_linearly_in_n_between_grid_points():
    ops = ProfiledOps("h100_sxm", "vllm", "bf16")
    m = np.array([4096.0])
    lo, hi = ops.gemm(m, 4096, 12288)[0], ops.gemm(m, 4096, 16384)[0]
    assert ops.gemm(m, 4096, 14336)[0] == pytest.approx((lo + hi) / 2)
    # wider than the grid: side-by-side GEMMs
    assert ops.gemm(m, 131072, 4096)[0] == pytest.approx(2 * ops.gemm(m, 65536, 4096)[0])


def test_gemm_taller_than_the_grid_is_linear_in_m_and_each_dtype_reads_its_own_grid(aic_root):
    ops = ProfiledOps("h200_sxm", "sglang", "fp8")
    top = np.array([32768.0])  # the tallest m measured
    assert ops.gemm(2 * top, 4096, 4096)[0] == pytest.approx(2 * ops.gemm(top, 4096, 4096)[0])
    raw = pl.read_parquet(aic_root / "systems/data/h200_sxm/gemm/sglang/0.5.14/gemm_perf.parquet")
    for dtype, raw_dtype in (("fp8_block", "fp8_block"), ("bf16", "bfloat16"), (None, "fp8")):
        point = raw.filter((pl.col("gemm_dtype") == raw_dtype) & (pl.col("m") == 64) & (pl.col("n") == 2048)
                           & (pl.col("k") == 7168))["latency"].median()
        assert ops.gemm(np.array([64.0]), 2048, 7168, dtype)[0] * 1e3 == pytest.approx(point, rel=2e-3)


def test_decode_attention_matches_raw_table(aic_root):
    raw = pl.read_parquet(aic_root / "systems/data/h100_sxm/attention/vllm/0.24.0/generation_attention_perf.parquet")
    raw = raw.filter(pl.col("kernel_source") == "vllm_flash_attn_fa3", pl.col("num_heads") == 32,
                     pl.col("num_key_value_heads") == 8, pl.col("head_dim") == 128,
                     pl.col("kv_cache_dtype") == "bfloat16", pl.col("window_size") == 0, pl.col("batch_size") == 64)
    ctx, sec = ProfiledOps("h100_sxm", "vllm", "bf16").decode_rows(AttentionShape(32, 8, 128))[64.0]
    expected = raw.sort("step")
    np.testing.assert_allclose(ctx, expected["step"].to_numpy() + 1)
    np.testing.assert_allclose(sec * 1e3, expected["latency"].to_numpy(), rtol=2e-3)


def test_unmeasured_head_shape_is_borrowed_and_noted():
    ops = ProfiledOps("h100_sxm", "vllm", "bf16")
    gqa = ops.decode_rows(AttentionShape(32, 8, 128))
    assert not ops.notes
    # vLLM decode tables stop at 8 KV heads: batch 8 of 16 KV heads reads the KV of batch 16 of 8,
    # measured up to 32k tokens; the 64k point keeps the launch floor and doubles the work above it
    doubled = ops.decode_rows(AttentionShape(64, 16, 128))[8.0][1]
    floor = min(sec.min() for _, sec in gqa.values())
    np.testing.assert_allclose(doubled[:-1], gqa[16.0][1])
    np.testing.assert_allclose(doubled[-1], floor + 2 * (gqa[8.0][1][-1] - floor))
    assert "at 2x the batch" in ops.notes[0] and "the rest work scaled x2.00" in ops.notes[0]


def test_bundled_data_is_small():
    from costmodels.distil import DATA_DIR

    total = sum(f.stat().st_size for f in DATA_DIR.rglob("*") if f.is_file())
    # 2.49 MiB, then 3 x 65 KiB for SGLang's MLA parts (its block-fp8 GEMM grid, 53 KiB of it),
    # then 2.86 MiB with B200's NVFP4 GEMM grids and fused-MoE rows (3 frameworks)
    assert total < 3.0 * 2**20
