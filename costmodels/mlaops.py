"""Multi-head latent attention latency: aiconfigurator's MLA attention-module tables, or the
module composed from its measured parts where a framework has no module table (SGLang).

A module row times the whole attention block of one DeepSeek layer on one GPU: the
query/latent down- and up-projections, rotary embedding, latent attention over the cache
and the output projection, for ``num_heads`` heads on the GPU (128 / attention TP), keyed
by the GEMM dtype (bf16 or fp8 block scales) and the KV-cache dtype. The generation table
(``step`` = the context length, measured at powers of two, where the GQA tables' ``step``
counts the tokens cached before the new one, 2^k - 1) answers decode attention, the context table (``isl``)
prefill; so for an MLA model the projections are in those two grids, not in the
token-linear curve. The prefill curve is keyed by attention pairs, so a chunk on top of
a cached prefix pays its projections as a longer fresh prompt would (an overstatement
that grows with the prefix; exact for fresh prompts). vLLM and TRT-LLM ship module tables.

SGLang ships the parts instead, and ``composed_rows`` sums them at the module's grid:
the latent-attention kernel alone (``mla_kernel_*``: its ``step`` counts cached tokens,
2^k - 1, as the GQA tables do), the projection GEMMs of the layer at the module's GEMM
dtype (the fused q_a + kv_a_proj_with_mqa, q_b_proj or q_proj, kv_b_proj in prefill only,
o_proj), decode's absorbed-weight bmms (q_nope x W_UK before the kernel, x W_UV after)
and, HBM-bound, the elementwise work between them (``_elementwise``). The bmms are the
bf16 ones: SGLang dequantises DeepSeek's 128 x 128 block-fp8 W_UK / W_UV to bf16 at load
(deepseek_v2.py ``post_load_weights``), and TRT-LLM's fp8 module rows agree with the bf16
bmm rows (median decode error -1 %) where its fp8 bmm rows overstate them (+7 %).
Composed against TRT-LLM's own module tables on H100 and H200 (the one framework that
ships both) the sum is within the bounds ``tests/costmodels/test_mla_compose.py`` measures.
A framework with neither is a CostModelError naming both, not a borrowed table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costmodels.architecture import ModelArch
from costmodels.blocks import MLASpec
from costmodels.costmodel import CostModelError
from costmodels.layout import ParallelLayout
from costmodels.linear import ACT_BYTES
from costmodels.optables import KV_DTYPE_CODE, MS

GEMM_DTYPE_CODE = {"bf16": 0, "fp8_block": 2}
BMM_OPS = {"pre": 0, "post": 1}
PARTS = ("mla_kernel_gen", "mla_kernel_ctx", "mla_bmm")  # besides the GEMM table of the module's dtype
COMPOSED_NOTE = "MLA module composed from attention-kernel, bmm and {gemm} GEMM tables (no module table)"


@dataclass(frozen=True)
class MLAShape:
    heads: int  # per GPU
    kv_dtype: str
    gemm_dtype: str  # "bf16" or "fp8_block"
    hidden: int
    dims: MLASpec


def mla_shape(arch: ModelArch, layout: ParallelLayout, gemm_dtype: str, kv_dtype: str) -> MLAShape:
    """fp8 GEMMs are the block-scaled ones: the only fp8 the MLA tables measured."""
    return MLAShape(arch.num_heads // layout.attention_tp, kv_dtype, "bf16" if gemm_dtype == "bf16" else "fp8_block",
                    arch.hidden_size, arch.mla)


def _rows(ops, table: str, shape: MLAShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(batch, length, seconds) of ``table`` at the shape's heads and KV dtype (and GEMM
    dtype, for a module table)."""
    t = ops.table(table)
    rows = (t["heads"] == shape.heads) & (t["kv_dtype"] == KV_DTYPE_CODE[shape.kv_dtype])
    key = f"{shape.heads} heads per GPU, {shape.kv_dtype} KV"
    if "gemm_dtype" in t:
        rows &= t["gemm_dtype"] == GEMM_DTYPE_CODE[shape.gemm_dtype]
        key += f", {shape.gemm_dtype} GEMMs"
    if not rows.any():
        raise CostModelError(f"{ops.label}: no {table} rows measured for {key}; measured heads: "
                             f"{sorted(set(t['heads'].tolist()))}")
    return (t["batch"][rows].astype(np.float64), t["length"][rows].astype(np.float64),
            t["latency"][rows].astype(np.float64) * MS)


def _by_batch(batch: np.ndarray, ctx: np.ndarray, sec: np.ndarray) -> dict[float, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for b in np.unique(batch):
        r = batch == b
        order = np.argsort(ctx[r])
        out[float(b)] = (ctx[r][order], sec[r][order])
    return out


def module_rows(ops, shape: MLAShape) -> tuple[dict, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(decode rows, prefill rows) of the module tables: batch -> (context length, seconds),
    the layout of ``decode_rows`` (module step: the context length, 2^k), and (batch,
    prompt length, seconds), the layout of ``prefill_rows``."""
    return _by_batch(*_rows(ops, "mla_gen", shape)), _rows(ops, "mla_ctx", shape)


def _elementwise(m: MLASpec, heads: int, absorbed: bool) -> int:
    """Elements read plus written per token by the module's non-GEMM, non-attention work.

    Both paths: the two latent RMSNorms, RoPE of the shared key and the latent's write to the
    cache; per head RoPE of the query. Decode (absorbed) also assembles each head's query
    [q_nope W_UK, q_pe] and hands the kernel's output on to the bmm and o_proj; prefill
    builds each head's key [k_nope, k_pe] from kv_b_proj's output.
    """
    rope, latent = m.qk_rope_head_dim, m.cache_width
    shared = 2 * (m.q_lora_rank + m.kv_lora_rank) + 2 * rope + 2 * latent
    per_head = 2 * rope + (2 * latent + 2 * m.v_head_dim if absorbed else 2 * m.qk_nope_head_dim + m.qk_nope_head_dim + rope)
    return shared + heads * per_head


def _projections(ops, shape: MLAShape, tokens: np.ndarray, absorbed: bool) -> np.ndarray:
    """Seconds of the layer's projection GEMMs for ``tokens`` tokens (kv_b_proj only when
    not absorbed: decode folds it into the bmms)."""
    m, h, heads, dt = shape.dims, shape.hidden, shape.heads, shape.gemm_dtype
    qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank:  # q_a_proj fused with kv_a_proj_with_mqa, then q_b_proj
        sec = ops.gemm(tokens, m.q_lora_rank + m.cache_width, h, dt) + ops.gemm(tokens, heads * qk_head, m.q_lora_rank, dt)
    else:
        sec = ops.gemm(tokens, heads * qk_head, h, dt) + ops.gemm(tokens, m.cache_width, h, dt)
    if not absorbed:
        sec = sec + ops.gemm(tokens, heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, dt)
    return sec + ops.gemm(tokens, h, heads * m.v_head_dim, dt)


def _bmms(ops, heads: int, tokens: np.ndarray) -> np.ndarray:
    """Seconds of the two absorbed-weight bmms, each log-linear in tokens between measured points."""
    t = ops.table("mla_bmm")
    sec = np.zeros_like(tokens)
    for op, code in BMM_OPS.items():
        r = (t["op"] == code) & (t["heads"] == heads)
        if not r.any():
            raise CostModelError(f"{ops.label}: no MLA {op}-attention bmm measured for {heads} heads per GPU; "
                                 f"measured heads: {sorted(set(t['heads'].tolist()))}")
        order = np.argsort(t["tokens"][r])
        x, y = np.log(t["tokens"][r][order].astype(np.float64)), t["latency"][r][order].astype(np.float64) * MS
        sec = sec + np.interp(np.log(tokens), x, y)
    return sec


def composed_rows(ops, shape: MLAShape, hbm_bytes_per_s: float) -> tuple[dict, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``module_rows`` composed from the parts (module docstring), on the kernel tables' grid."""
    batch, step, attention = _rows(ops, "mla_kernel_gen", shape)
    around = (_projections(ops, shape, batch, absorbed=True) + _bmms(ops, shape.heads, batch)
              + batch * ACT_BYTES * _elementwise(shape.dims, shape.heads, True) / hbm_bytes_per_s)
    decode = _by_batch(batch, step + 1.0, attention + around)  # kernel step: tokens already cached
    batch, isl, attention = _rows(ops, "mla_kernel_ctx", shape)
    tokens = batch * isl
    around = (_projections(ops, shape, tokens, absorbed=False)
              + tokens * ACT_BYTES * _elementwise(shape.dims, shape.heads, False) / hbm_bytes_per_s)
    return decode, (batch, isl, attention + around)


def mla_rows(ops, shape: MLAShape, hbm_bytes_per_s: float) -> tuple[dict, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(decode rows, prefill rows) of one layer's MLA module: the module tables where the
    framework measured them, else composed from the parts (noted in ``ops.notes``)."""
    if ops.has_table("mla_gen"):
        return module_rows(ops, shape)
    missing = [p for p in PARTS if not ops.has_table(p)]  # a missing GEMM dtype: ops.gemm names it
    if missing:
        raise CostModelError(f"{ops.label}: no MLA attention-module table (mla_gen, mla_ctx) measured for this GPU "
                             f"and framework, nor all its parts to compose one: missing {', '.join(missing)}")
    ops.notes.append(COMPOSED_NOTE.format(gemm=shape.gemm_dtype))
    return composed_rows(ops, shape, hbm_bytes_per_s)
