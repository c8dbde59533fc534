"""TRT-LLM's FP8 GEMMs: the activation quantization the table timed, and what one pass leaves.

Prints, per GPU, the quantization aiconfigurator's TRT-LLM collector timed with each FP8
GEMM (the FP8-over-bf16 excess at the narrowest GEMMs, ``costmodels.optables``) at decode
sizes and at a large one, and for Llama-3.1-70B FP8 on 8 B200s at 4 clients, 1k/1k, the
layers' token-linear time (GEMMs, collectives, elementwise) read as collected and as served
beside the measured decode step of that run (``silicon_breadth_dev.csv``), which includes
everything else too. Writes ``benchmarks/results/fp8_quantization.md``.

    python benchmarks/fp8_quantization.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodels import build, optables  # noqa: E402
from costmodels.distil import aic_root, shared_dir  # noqa: E402

GPUS = ("h100_sxm", "h200_sxm", "b200_sxm")
DECODE_M = 16  # decode-sized batches: m <= 16
LARGE = (16384, 8192)  # (m, k) of a long prompt's projection


def timed_quantization(gpu: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(m axis, k axis, seconds[m, k]) of the quantization the table timed."""
    ops = optables.ProfiledOps(gpu, "trtllm", "fp8")
    ms, _, ks, _ = ops._grid("fp8")
    fp8 = ops._z["gemm_fp8"].astype(np.float64) * optables.MS
    bf16 = ops._z["gemm_bf16"].astype(np.float64) * optables.MS
    return ms, ks, optables.timed_quantization(fp8, bf16)


def linear_ms(tokens: int, served: bool) -> float:
    """Llama-3.1-70B FP8 on 8 B200s, TRT-LLM: the token-linear seconds of one step, in ms."""
    saved = optables.DYNAMIC_QUANT_TABLES
    optables.DYNAMIC_QUANT_TABLES = saved if served else frozenset()
    try:
        cost = build("meta-llama/Llama-3.1-70B", "b200", tp=8, framework="trtllm", gemm_dtype="fp8",
                     kv_dtype="fp8", calibration=False)
    finally:
        optables.DYNAMIC_QUANT_TABLES = saved
    t = cost.tables
    return float(np.interp(tokens, t.linear_tokens, t.linear_s)) * 1e3


def main() -> None:
    lines = ["GPU        timed quantization at m <= 16 (us)   at m x k = 16384 x 8192 (us)"]
    for gpu in GPUS:
        ms, ks, q = timed_quantization(gpu)
        small = q[ms <= DECODE_M]
        big = q[int(np.searchsorted(ms, LARGE[0])), int(np.searchsorted(ks, LARGE[1]))]
        lines.append(f"{gpu:<10} {small.min() * 1e6:6.1f} - {small.max() * 1e6:5.1f}"
                     f"{'':22}{big * 1e6:8.1f}")
    runs = pl.read_csv(aic_root(shared_dir()) / "systems" / "silicon_breadth_dev.csv", infer_schema_length=10000)
    row = runs.filter((pl.col("system") == "b200_sxm") & (pl.col("gemm_quant_mode") == "fp8") & (pl.col("tp_size") == 8)
                      & (pl.col("batch_size") == 4) & (pl.col("isl") == 1024) & (pl.col("osl") == 1024))
    measured = float(row["silicon_tpot_ms"][0])
    collected, served = linear_ms(4, served=False), linear_ms(4, served=True)
    lines += ["", "Llama-3.1-70B FP8, 8 x B200, TRT-LLM, 4 clients, 1k/1k:",
              f"  token-linear part of a decode step, GEMMs as collected: {collected:.2f} ms",
              f"  token-linear part of a decode step, GEMMs as served:    {served:.2f} ms",
              f"  measured TPOT (the whole step):                         {measured:.2f} ms"]
    text = "\n".join(lines)
    print(text)
    out = ROOT / "benchmarks" / "results" / "fp8_quantization.md"
    out.write_text(f"# TRT-LLM FP8 GEMMs: timed vs served quantization\n\nCommand: "
                   f"`python benchmarks/fp8_quantization.py`\n\n```\n{text}\n```\n")


if __name__ == "__main__":
    main()
