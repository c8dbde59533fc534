"""NVFP4 GEMMs on B200: TRT-LLM's table against the other collectors' on the same GPU.

The breadth runs' largest TPOT error left under the harsher fidelity protocols is
Llama-3.1-70B NVFP4 on B200 with no calibration entry: every run over-predicted by a fixed
excess per step. This prints the evidence that TRT-LLM's NVFP4 GEMM table is where it comes
from (issue 45; ``costmodels.optables.UNTUNED_TABLES`` now reads it as the fastest NVFP4 kernel
measured on the GPU, see ``docs/fidelity.md``; the tables below are as collected):

- per weight dtype, the median ratio of TRT-LLM's table to vLLM's and SGLang's on the cells
  the three share (n and k from 1024 to 16384, the shapes of real layers), at decode sizes
  (m <= 128) and at prompt sizes (m >= 2048); TRT-LLM's FP8 read as served
  (``optables.one_pass_quantization``). bf16 (cuBLAS in all three) is the control;
- TRT-LLM's NVFP4 time at decode sizes per k, over every m <= 128 and n <= 12288: flat in m
  and n, linear in k, the shape of one untuned kernel walking all of K, not of a GEMM
  streaming its weights;
- last, TRT-LLM's NVFP4 table as servetune reads it now, against the same two.

Writes ``benchmarks/results/nvfp4_tables.md``.

    python benchmarks/nvfp4_tables.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodels.optables import MS, UNTUNED_TABLES, ProfiledOps  # noqa: E402

GPU = "b200_sxm"
LAYER_SHAPES = (1024, 16384)  # n and k of real layers
DECODE_M, PROMPT_M = 128, 2048


def collected(ops: ProfiledOps, dtype: str) -> tuple[np.ndarray, ...]:
    """``ops``' (m, n, k, seconds) grid as the collector timed it: an ``UNTUNED_TABLES`` one
    before servetune reads it as the fastest kernel measured, any other as it is read."""
    m, n, k, g = ops._grid(dtype)
    if (ops.meta["framework"], dtype) in UNTUNED_TABLES:
        g = ops._z[f"gemm_{dtype}"].astype(np.float64) * MS
    return m, n, k, g


def shared_cells(ours: ProfiledOps, theirs: ProfiledOps, dtype: str, rows, read=collected) -> np.ndarray:
    """Ratio ours / theirs on the (m, n, k) cells both tables measured, m chosen by ``rows``
    (ours as ``read`` gives it)."""
    (m1, n1, k1, g1), (m2, n2, k2, g2) = read(ours, dtype), theirs._grid(dtype)
    m = [x for x in m1 if x in m2 and rows(x)]
    n = [x for x in n1 if x in n2 and LAYER_SHAPES[0] <= x <= LAYER_SHAPES[1]]
    k = [x for x in k1 if x in k2 and LAYER_SHAPES[0] <= x <= LAYER_SHAPES[1]]

    def cut(ms, ns, ks, g):
        return g[np.ix_([list(ms).index(x) for x in m], [list(ns).index(x) for x in n],
                        [list(ks).index(x) for x in k])]

    return cut(m1, n1, k1, g1) / cut(m2, n2, k2, g2)


def main() -> None:
    lines = ["median TRT-LLM / other over the cells both measured (p10, p90; cells):"]
    for dtype in ("bf16", "fp8", "nvfp4"):
        trtllm = ProfiledOps(GPU, "trtllm", dtype)
        for other in ("vllm", "sglang"):
            theirs = ProfiledOps(GPU, other, dtype)
            for label, rows in ((f"m <= {DECODE_M}", lambda x: x <= DECODE_M),
                                (f"m >= {PROMPT_M}", lambda x: x >= PROMPT_M)):
                r = shared_cells(trtllm, theirs, dtype, rows)
                lines.append(f"  {dtype:5} trtllm / {other:6} {label:9} {np.median(r):5.2f}  "
                             f"({np.percentile(r, 10):.2f}, {np.percentile(r, 90):.2f}; {r.size})")
    m, n, k, g = collected(ProfiledOps(GPU, "trtllm", "nvfp4"), "nvfp4")
    decode = [i for i, x in enumerate(m) if x <= DECODE_M]
    narrow = [i for i, x in enumerate(n) if x <= 12288]
    lines += ["", f"TRT-LLM NVFP4 at m <= {DECODE_M}, n <= 12288: time per k over every (m, n), us:"]
    for kk in (1024, 2048, 4096, 8192, 16384):
        cell = g[np.ix_(decode, narrow, [list(k).index(kk)])] * 1e6
        lines.append(f"  k = {kk:5}: mean {cell.mean():5.1f}  (min {cell.min():5.1f}, max {cell.max():5.1f})")
    lines += ["", "TRT-LLM NVFP4 as servetune reads it (the fastest kernel measured on the GPU), same cells:"]
    trtllm = ProfiledOps(GPU, "trtllm", "nvfp4")
    for other in ("vllm", "sglang"):
        r = shared_cells(trtllm, ProfiledOps(GPU, other, "nvfp4"), "nvfp4", lambda x: x <= DECODE_M,
                         read=lambda ops, dtype: ops._grid(dtype))
        lines.append(f"  nvfp4 trtllm / {other:6} m <= {DECODE_M:<4} {np.median(r):5.2f}  "
                     f"({np.percentile(r, 10):.2f}, {np.percentile(r, 90):.2f}; {r.size})")
    text = "\n".join(lines)
    print(text)
    out = ROOT / "benchmarks" / "results" / "nvfp4_tables.md"
    out.write_text(f"# NVFP4 GEMM tables on B200\n\nCommand: `python benchmarks/nvfp4_tables.py`\n\n```\n{text}\n```\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
