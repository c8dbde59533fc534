"""TensorRT-LLM's per-tensor FP8 GEMM table is read with one activation-quantization pass,
as a served FP8 checkpoint runs it, not the dynamic quantization the collector timed."""

import numpy as np
import polars as pl
import pytest

from costmodels import build
from costmodels.gpus import load_gpu
from costmodels.optables import (
    MS,
    NARROW,
    QUANT_PASS_BYTES,
    ProfiledOps,
    one_pass_quantization,
    timed_quantization,
)


def _raw(ops: ProfiledOps, dtype: str) -> np.ndarray:
    return ops._z[f"gemm_{dtype}"].astype(np.float64) * MS


@pytest.mark.parametrize("gpu", ["h100_sxm", "h200_sxm", "b200_sxm"])
def test_the_timed_quantization_is_replaced_by_one_pass(gpu):
    ops = ProfiledOps(gpu, "trtllm", "fp8")
    ms, ns, ks, served = ops._grid("fp8")
    fp8, bf16 = _raw(ops, "fp8"), _raw(ops, "bf16")
    spec = load_gpu(gpu)
    i, j, k = int(np.searchsorted(ms, 4)), int(np.searchsorted(ns, 8192)), int(np.searchsorted(ks, 8192))
    timed = max(min(fp8[i, c, k] - bf16[i, c, k] for c in range(NARROW)), 0.0)
    one_pass = QUANT_PASS_BYTES * ms[i] * ks[k] / (spec.hbm_bytes_per_s * spec.hbm_efficiency)
    assert served[i, j, k] == pytest.approx(fp8[i, j, k] - timed + one_pass, rel=1e-12)
    assert 6e-6 < timed < 20e-6  # the collector's dynamic quantization at a decode batch
    assert np.all(served >= bf16[:, :1, :])  # never under the narrowest bf16 GEMM of its m and k


def test_a_spiked_narrow_cell_does_not_set_the_quantization():
    m, k = np.array([1.0, 16.0]), np.array([1024.0])
    bf16 = np.full((2, 4, 1), 4e-6)
    fp8 = np.full((2, 4, 1), 14e-6)
    fp8[1, 0, 0] = 42e-6  # one cell far above its neighbours, as H200's (16, 32, 1024)
    served = one_pass_quantization(fp8, bf16, m, k, hbm_bytes_per_s=1e12)
    pass_s = QUANT_PASS_BYTES * m * k[0] / 1e12
    assert served[:, 1:, 0] == pytest.approx(np.broadcast_to((4e-6 + pass_s)[:, None], (2, 3)))
    assert served[1, 0, 0] == pytest.approx(42e-6 - 10e-6 + pass_s[1])


@pytest.mark.parametrize("framework", ["vllm", "sglang"])
@pytest.mark.parametrize("gpu", ["h100_sxm", "h200_sxm", "b200_sxm"])
def test_vllm_and_sglang_fp8_tables_are_read_as_timed(framework, gpu):
    """Their collectors time one fused per-token quantization kernel with each GEMM, as the
    engines serve FP8: aiconfigurator collector/vllm/collect_gemm.py:107-113 builds
    Fp8Config(activation_scheme="dynamic"), which vLLM 0.24 runs per token with CUTLASS
    (vllm/model_executor/layers/quantization/fp8.py:313-320); collector/sglang/collect_gemm.py
    :280-281 times sgl_per_token_quant_fp8 then fp8_scaled_mm. One launch at decode sizes,
    against TRT-LLM's two passes."""
    ops = ProfiledOps(gpu, framework, "fp8")
    assert np.array_equal(ops._grid("fp8")[3], _raw(ops, "fp8"))
    assert ops.notes == []
    decode = ops._grid("fp8")[0] <= 16
    timed = timed_quantization(_raw(ops, "fp8"), _raw(ops, "bf16"))[decode]
    trtllm = ProfiledOps(gpu, "trtllm", "fp8")
    two_passes = timed_quantization(_raw(trtllm, "fp8"), _raw(trtllm, "bf16"))[decode]
    assert np.median(timed) < 5e-6
    assert np.median(two_passes) > 6e-6


def test_bf16_tables_are_untouched_and_the_source_says_so():
    ops = ProfiledOps("b200_sxm", "trtllm", "bf16")
    assert np.array_equal(ops._grid("bf16")[3], _raw(ops, "bf16"))
    cost = build("meta-llama/Llama-3.1-70B", "b200", tp=8, framework="trtllm", gemm_dtype="fp8", kv_dtype="fp8",
                 calibration=False)
    assert "one activation-quantization pass" in cost.source


def test_composed_gemms_fit_inside_the_measured_decode_step(aic_root):
    """Llama-3.1-70B FP8 on 8 B200s, TensorRT-LLM, 4 clients, 1k/1k: the measured TPOT is
    a whole decode step (attention, collectives, sampling and overheads included). Timed
    with their dynamic quantization the layers' token-linear part alone outlasted it."""
    runs = pl.read_csv(aic_root / "systems" / "silicon_breadth_dev.csv", infer_schema_length=10000)
    row = runs.filter((pl.col("system") == "b200_sxm") & (pl.col("gemm_quant_mode") == "fp8")
                      & (pl.col("tp_size") == 8) & (pl.col("batch_size") == 4)
                      & (pl.col("isl") == 1024) & (pl.col("osl") == 1024))
    assert row.height == 1
    measured_s = row["silicon_tpot_ms"][0] * 1e-3
    cost = build("meta-llama/Llama-3.1-70B", "b200", tp=8, framework="trtllm", gemm_dtype="fp8", kv_dtype="fp8",
                 calibration=False)
    linear = cost.tables.linear_s[int(np.searchsorted(cost.tables.linear_tokens, 4))]
    assert linear < 0.85 * measured_s
