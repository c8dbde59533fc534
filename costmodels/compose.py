"""Compose per-op latencies into the per-step grids of ``StepTables``.

One engine step at a ``ParallelLayout``, with T new tokens:

    token-linear ops of all layers (``costmodels.linear``)                  -> linear(T)
    + lm-head GEMM for the S sequences that sample                          -> head(S)
    + L x decode attention over the decode batch                            -> decode(B, KV)
    + L x prefill attention over the prefill chunks                         -> prefill(pairs)
    + per-step overhead (scheduler, sampling, launch gaps), then x scale.

Attention is read from the GQA attention tables, or for an MLA model from its attention-
module tables (``costmodels.mlaops``, composed from the module's parts where a framework
has no module table), which include the attention projections.

Measured tables are noisy by a few percent; each grid is made non-decreasing along every
axis (running maximum), so a step with more work never costs less.
"""

from __future__ import annotations

import numpy as np

from costmodels.architecture import ModelArch
from costmodels.layout import ParallelLayout
from costmodels.linear import linear_seconds
from costmodels.mlaops import mla_rows, mla_shape
from costmodels.moeops import DEFAULT_DISTRIBUTION, moe_shape
from costmodels.optables import AttentionShape
from costmodels.steptable import StepTables


def attention_shape(arch: ModelArch, tp: int, kv_dtype: str) -> AttentionShape:
    return AttentionShape(arch.num_heads // tp, arch.kv_heads_per_gpu(tp), arch.head_dim, kv_dtype)


def attention_rows(arch: ModelArch, ops, layout: ParallelLayout, gemm_dtype: str, kv_dtype: str,
                   hbm_bytes_per_s: float):
    """(decode rows, prefill rows) of one layer's attention: ``decode_rows`` and
    ``prefill_rows`` of the GQA tables, or the MLA module (measured or composed) for an MLA model."""
    if arch.mla is not None:
        return mla_rows(ops, mla_shape(arch, layout, gemm_dtype, kv_dtype), hbm_bytes_per_s)
    shape = attention_shape(arch, layout.attention_tp, kv_dtype)
    return ops.decode_rows(shape), ops.prefill_rows(shape)


def decode_grid(arch: ModelArch, rows: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(batch axis, total-KV axis, seconds[batch, kv], largest measured KV per batch).

    Each batch row is interpolated linearly in per-sequence context between measured
    points; below one token per sequence it holds the first point, past the last measured
    context it continues the last segment's slope (decode attention is bandwidth-bound,
    so linear in KV) and ``decode_kv_measured`` marks where that starts.
    """
    batch = np.array(sorted(rows))
    kv_axis = np.unique(np.concatenate([b * rows[b][0] for b in batch]))
    grid = np.empty((len(batch), len(kv_axis)))
    measured = np.empty(len(batch))
    for i, b in enumerate(batch):
        ctx, sec = rows[b]
        per_seq = kv_axis / b
        grid[i] = np.interp(per_seq, ctx, sec)
        past = per_seq > ctx[-1]
        slope = (sec[-1] - sec[-2]) / (ctx[-1] - ctx[-2])
        grid[i, past] = sec[-1] + max(slope, 0.0) * (per_seq[past] - ctx[-1])
        measured[i] = b * ctx[-1]
    grid = _monotone(_monotone(grid, 1), 0)
    return batch, kv_axis, arch.num_layers * grid, measured


def prefill_curve(arch: ModelArch, rows: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(attention pairs, seconds) for prefill attention of all layers.

    Single-prompt measurements give the curve; batches of the longest measured prompts
    extend it to more work than one prompt reaches.
    """
    batch, isl, sec = rows
    pairs = batch * isl * (isl + 1) / 2
    single = batch == 1
    order = np.argsort(pairs[single])
    p, s = list(pairs[single][order]), list(sec[single][order])
    for b in np.unique(batch[~single]):
        r = np.flatnonzero(batch == b)
        longest = r[np.argmax(isl[r])]
        if pairs[longest] > p[-1]:
            p.append(pairs[longest])
            s.append(sec[longest])
    p_arr, s_arr = np.array(p), np.array(s)
    keep = np.concatenate([[True], np.diff(p_arr) > 0])
    return p_arr[keep], arch.num_layers * _monotone(s_arr[keep], 0)


def compose(arch: ModelArch, ops, layout: ParallelLayout, kv_dtype: str, hbm_bytes_per_s: float,
            overhead_s: float, scale: float = 1.0, max_logit_seqs: int = 4096, gemm_dtype: str = "bf16",
            moe_distribution: str = DEFAULT_DISTRIBUTION) -> tuple[StepTables, np.ndarray]:
    """StepTables for ``arch`` at ``layout`` from an op source (profiled or roofline), and
    the communication seconds inside their ``linear_s`` at each ``linear_tokens`` point
    (``CostModel.comm_s``); ``moe_distribution`` is the fused-MoE table's routing skew
    (``costmodels.moeops``). Notes on what was read beyond or beside the tables go to
    ``ops.notes``."""
    tokens = ops.token_axis()
    moe = moe_shape(arch, layout, gemm_dtype, moe_distribution) if arch.moe is not None else None
    linear, comm, notes = linear_seconds(arch, ops, layout, tokens, hbm_bytes_per_s, moe)
    ops.notes.extend(notes)
    linear = _monotone(linear, 0)
    seqs = tokens[tokens <= max_logit_seqs]
    head = _monotone(ops.gemm(seqs, -(-arch.vocab_size // layout.attention_tp), arch.hidden_size), 0)
    decode_rows, prefill_rows = attention_rows(arch, ops, layout, gemm_dtype, kv_dtype, hbm_bytes_per_s)
    batch, kv_axis, decode, measured = decode_grid(arch, decode_rows)
    pairs, prefill = prefill_curve(arch, prefill_rows)
    return StepTables.from_grids(
        linear_tokens=tokens, linear_s=linear,
        head_seqs=seqs, head_s=head,
        decode_batch=batch, decode_kv=kv_axis, decode_s=decode, decode_kv_measured=measured,
        prefill_pairs=pairs, prefill_s=prefill,
        overhead_s=overhead_s, scale=scale,
    ), comm


def with_comm_scale(tables: StepTables, comm_s: np.ndarray | None, comm_scale: float) -> StepTables:
    """``tables`` with the communication inside ``linear_s`` (``comm_s``, from ``compose``)
    taken at ``comm_scale`` times its table time, the rest of every grid and scalar as it
    was; ``tables`` itself when there is nothing to rescale."""
    if comm_scale == 1.0 or comm_s is None or not comm_s.any():
        return tables
    grids = tables.grids() | {"linear_s": _monotone(tables.linear_s - (1.0 - comm_scale) * comm_s, 0)}
    return StepTables.from_grids(**grids, overhead_s=tables.overhead_s, scale=tables.scale,
                                 prefill_scale=tables.prefill_scale, decode_scale=tables.decode_scale,
                                 prefill_step_s=tables.prefill_step_s)


def _monotone(values: np.ndarray, axis: int) -> np.ndarray:
    return np.maximum.accumulate(values, axis=axis)
