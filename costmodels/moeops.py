"""Fused-MoE layer latency from aiconfigurator's profiled ``moe_perf`` table.

One row is one call of a framework's fused-MoE kernel on one GPU (router top-k excluded,
expert GEMMs, activation and the scatter/gather of tokens included) for ``num_tokens``
tokens entering the layer, keyed by the expert shape (hidden, expert width, top-k,
experts), its split (``moe_tp`` x ``moe_ep``), the weight dtype and how the tokens were
spread over experts. Tokens routed to each expert, ``num_tokens x top_k / experts`` on
average, are the table's to know: it measured them. ``balanced`` spreads them evenly, the
``power_law_*`` distributions skew them as real routers do (the busiest expert sets the
time); servetune times ``DEFAULT_DISTRIBUTION`` unless asked.

No point is borrowed from another expert shape: a shape, split or dtype the table lacks
is a CostModelError naming what was measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costmodels.architecture import ModelArch
from costmodels.costmodel import CostModelError
from costmodels.layout import ParallelLayout
from costmodels.optables import MS

MOE_DTYPE_CODE = {"bf16": 0, "fp8": 1, "fp8_block": 2, "nvfp4": 3}
DISTRIBUTIONS = {"balanced": 0, "power_law_1.01": 1, "power_law_1.2": 2}
#: Routing skew timed unless asked: real routers load some experts more than others, and
#: under expert parallelism the busiest rank sets the step. aiconfigurator too times MoE
#: with a power-law skew by default (exponent 1.01 or 1.2 by model); on the breadth runs
#: this one fits TPOT with decode scales nearer 1 than balanced routing does
#: (``benchmarks/fidelity.py --part breadth --moe-distribution balanced`` for the other).
DEFAULT_DISTRIBUTION = "power_law_1.01"


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer as the table keys it."""

    hidden: int
    inter: int
    top_k: int
    experts: int
    moe_tp: int
    moe_ep: int
    dtype: str  # "bf16", "fp8" (per-tensor scales), "fp8_block" (128x128 scales) or "nvfp4"
    distribution: str = DEFAULT_DISTRIBUTION

    def describe(self) -> str:
        return (f"MoE hidden={self.hidden} expert width={self.inter} top-k={self.top_k} experts={self.experts} "
                f"moe_tp={self.moe_tp} moe_ep={self.moe_ep} {self.dtype} {self.distribution}")


def moe_shape(arch: ModelArch, layout: ParallelLayout, gemm_dtype: str,
              distribution: str = DEFAULT_DISTRIBUTION) -> MoEShape:
    """The table key of ``arch``'s MoE layers. fp8 means the checkpoint's own scheme where it
    has one (block scales for DeepSeek and Qwen FP8), else per-tensor scales."""
    if arch.moe is None:
        raise CostModelError(f"{arch.name} has no MoE layers")
    if distribution not in DISTRIBUTIONS:
        raise CostModelError(f"unknown MoE token distribution {distribution!r}; measured: {', '.join(DISTRIBUTIONS)}")
    dtype = gemm_dtype if gemm_dtype in ("bf16", "nvfp4") else (arch.quant if arch.quant in MOE_DTYPE_CODE else "fp8")
    m = arch.moe
    if m.num_experts % layout.moe_ep_size:
        raise CostModelError(f"{arch.name}: moe_ep_size={layout.moe_ep_size} does not divide its "
                             f"{m.num_experts} experts")
    return MoEShape(arch.hidden_size, m.expert_intermediate_size, m.top_k, m.num_experts, layout.moe_tp,
                    layout.moe_ep_size, dtype, distribution)


def moe_rows(ops, shape: MoEShape) -> tuple[np.ndarray, np.ndarray, str]:
    """(tokens, seconds) measured for ``shape``, ascending in tokens, and a note when fp8
    came from the other fp8 scheme (the only substitution made, and it is reported)."""
    t = ops.table("moe")
    same = ((t["hidden"] == shape.hidden) & (t["inter"] == shape.inter) & (t["topk"] == shape.top_k)
            & (t["experts"] == shape.experts))
    if not same.any():
        raise CostModelError(f"{ops.label}: no fused-MoE rows measured for hidden={shape.hidden}, expert width="
                             f"{shape.inter}, top-k={shape.top_k}, experts={shape.experts}")
    split = same & (t["tp"] == shape.moe_tp) & (t["ep"] == shape.moe_ep) & (t["dist"] == DISTRIBUTIONS[shape.distribution])
    note = ""
    fp8 = ("fp8_block", "fp8")
    candidates = [shape.dtype] + ([d for d in fp8 if d != shape.dtype] if shape.dtype in fp8 else [])
    for dtype in candidates:
        rows = split & (t["dtype"] == MOE_DTYPE_CODE[dtype])
        if rows.any():
            if dtype != shape.dtype:
                note = f"MoE {dtype} table for {shape.dtype} weights (no {shape.dtype} rows measured)"
            tokens = t["tokens"][rows].astype(np.float64)
            order = np.argsort(tokens)
            return tokens[order], t["latency"][rows][order].astype(np.float64) * MS, note
    names = {v: k for k, v in MOE_DTYPE_CODE.items()}
    measured = sorted({(names[int(d)], int(a), int(b)) for d, a, b in
                       zip(t["dtype"][same], t["tp"][same], t["ep"][same], strict=True)})
    raise CostModelError(f"{ops.label}: no fused-MoE rows for {shape.describe()}; measured (dtype, moe_tp, "
                         f"moe_ep): {measured}")


def moe_seconds(tokens: np.ndarray, measured_tokens: np.ndarray, measured_s: np.ndarray) -> np.ndarray:
    """One MoE layer at each entry of ``tokens``: log-linear in tokens between measured
    points (as the GEMMs), the first point below them, and past the last the last segment's
    slope continued (expert GEMMs are compute-bound there, so linear in tokens)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    inside = np.interp(np.log(np.maximum(tokens, 1.0)), np.log(measured_tokens), measured_s)
    slope = (measured_s[-1] - measured_s[-2]) / (measured_tokens[-1] - measured_tokens[-2])
    beyond = measured_s[-1] + max(slope, 0.0) * (tokens - measured_tokens[-1])
    return np.where(tokens > measured_tokens[-1], beyond, inside)
