"""Multi-head latent attention latency from aiconfigurator's MLA attention-module tables.

A module row times the whole attention block of one DeepSeek layer on one GPU: the
query/latent down- and up-projections, rotary embedding, latent attention over the cache
and the output projection, for ``num_heads`` heads on the GPU (128 / attention TP), keyed
by the GEMM dtype (bf16 or fp8 block scales) and the KV-cache dtype. The generation table
(``step`` = the context length, measured at powers of two, where the GQA tables' ``step``
counts the tokens cached before the new one, 2^k - 1) answers decode attention, the context table (``isl``)
prefill; so for an MLA model the projections are in those two grids, not in the
token-linear curve. The prefill curve is keyed by attention pairs, so a chunk on top of
a cached prefix pays its projections as a longer fresh prompt would (an overstatement
that grows with the prefix; exact for fresh prompts). vLLM and TRT-LLM ship module tables; SGLang does not, which is a
CostModelError, not a borrowed table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costmodels.architecture import ModelArch
from costmodels.costmodel import CostModelError
from costmodels.layout import ParallelLayout
from costmodels.optables import KV_DTYPE_CODE, MS

GEMM_DTYPE_CODE = {"bf16": 0, "fp8_block": 2}


@dataclass(frozen=True)
class MLAShape:
    heads: int  # per GPU
    kv_dtype: str
    gemm_dtype: str  # "bf16" or "fp8_block"


def mla_shape(arch: ModelArch, layout: ParallelLayout, gemm_dtype: str, kv_dtype: str) -> MLAShape:
    """fp8 GEMMs are the block-scaled ones: the only fp8 the MLA tables measured."""
    return MLAShape(arch.num_heads // layout.attention_tp, kv_dtype, "bf16" if gemm_dtype == "bf16" else "fp8_block")


def _rows(ops, prefix: str, shape: MLAShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = ops.table(f"mla_{prefix}")
    rows = ((t["heads"] == shape.heads) & (t["kv_dtype"] == KV_DTYPE_CODE[shape.kv_dtype])
            & (t["gemm_dtype"] == GEMM_DTYPE_CODE[shape.gemm_dtype]))
    if not rows.any():
        raise CostModelError(f"{ops.label}: no MLA {prefix} module measured for {shape.heads} heads per GPU, "
                             f"{shape.gemm_dtype} GEMMs, {shape.kv_dtype} KV; measured heads: "
                             f"{sorted(set(t['heads'].tolist()))}")
    return (t["batch"][rows].astype(np.float64), t["length"][rows].astype(np.float64),
            t["latency"][rows].astype(np.float64) * MS)


def mla_decode_rows(ops, shape: MLAShape) -> dict[float, tuple[np.ndarray, np.ndarray]]:
    """batch -> (KV tokens read per sequence, seconds), the layout of ``decode_rows``."""
    batch, step, sec = _rows(ops, "gen", shape)
    out = {}
    for b in np.unique(batch):
        r = batch == b
        order = np.argsort(step[r])
        out[float(b)] = (step[r][order], sec[r][order])  # module step: the context length (2^k)
    return out


def mla_prefill_rows(ops, shape: MLAShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(batch, prompt length, seconds), the layout of ``prefill_rows``."""
    return _rows(ops, "ctx", shape)
