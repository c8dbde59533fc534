"""FP8 GEMMs per framework: the activation quantization each table timed, and what is served.

Prints, per framework and GPU, the quantization aiconfigurator's collector timed with each
FP8 GEMM (the FP8-over-bf16 excess at the narrowest GEMMs, ``costmodels.optables``) at decode
sizes and at a large one, beside one served quantization pass at the large one. The
collectors' source decides how each table is read (``optables.DYNAMIC_QUANT_TABLES``):

- TRT-LLM (``collector/trtllm/collect_gemm.py``) builds each Linear without an input scale,
  so the table times a per-call dynamic per-tensor quantization: a max-reduction pass and a
  cast pass (6-13 us at decode sizes). A served FP8 checkpoint has static input scales: one
  pass. Read with ``one_pass_quantization``.
- vLLM (``collector/vllm/collect_gemm.py``: ``Fp8Config(activation_scheme="dynamic")``, which
  vLLM 0.24 runs per token with CUTLASS, ``fp8.py`` 313-320) and SGLang (its collector times
  ``sgl_per_token_quant_fp8`` then ``fp8_scaled_mm``) time one fused per-token quantization
  kernel: what both engines serve for dynamic checkpoints and online ``--quantization fp8``,
  and no more than their one static pass costs. Read as timed: their median excess at decode
  sizes is a few us, one launch (TRT-LLM's is two passes); where it is larger (the widest k)
  it is the FP8 GEMM kernel's own time, not quantization.

And for Llama-3.1-70B FP8 on 8 B200s at 4 clients, 1k/1k, the
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
from costmodels.gpus import load_gpu  # noqa: E402

GPUS = ("h100_sxm", "h200_sxm", "b200_sxm")
DECODE_M = 16  # decode-sized batches: m <= 16
LARGE = (16384, 8192)  # (m, k) of a long prompt's projection


def timed_quantization(gpu: str, framework: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(m axis, k axis, seconds[m, k]) of the quantization the table timed."""
    ops = optables.ProfiledOps(gpu, framework, "bf16")
    ms, _, ks, _ = ops._grid("bf16")
    fp8 = ops._z["gemm_fp8"].astype(np.float64) * optables.MS
    bf16 = ops._z["gemm_bf16"].astype(np.float64) * optables.MS
    return ms, ks, optables.timed_quantization(fp8, bf16)


def one_pass_us(gpu: str, m: int, k: int) -> float:
    """One served quantization pass over an m x k activation at HBM speed, in us."""
    spec = load_gpu(gpu)
    return optables.QUANT_PASS_BYTES * m * k / (spec.hbm_bytes_per_s * spec.hbm_efficiency) * 1e6


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
    lines = ["framework GPU        read as      timed quantization at m <= 16, min / median / max over k (us)   "
             "at 16384 x 8192 (us)   one pass there (us)"]
    for framework in ("trtllm", "vllm", "sglang"):
        read = "one pass" if framework in optables.DYNAMIC_QUANT_TABLES else "timed"
        for gpu in GPUS:
            ms, ks, q = timed_quantization(gpu, framework)
            small = q[ms <= DECODE_M]
            big = q[int(np.searchsorted(ms, LARGE[0])), int(np.searchsorted(ks, LARGE[1]))]
            lines.append(f"{framework:<9} {gpu:<10} {read:<12} {small.min() * 1e6:6.1f} / "
                         f"{np.median(small) * 1e6:5.1f} / {small.max() * 1e6:5.1f}{'':40}{big * 1e6:8.1f}"
                         f"{'':15}{one_pass_us(gpu, *LARGE):6.1f}")
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
    out.write_text(f"# FP8 GEMMs: the quantization each framework's table timed, and how it is read\n\nCommand: "
                   f"`python benchmarks/fp8_quantization.py`\n\n```\n{text}\n```\n")


if __name__ == "__main__":
    main()
