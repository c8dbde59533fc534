"""Compose per-op latencies into the per-step grids of ``StepTables``.

One engine step of a dense decoder at tensor-parallel degree TP, with T new tokens:

    L x [ QKV GEMM + O GEMM + gate/up GEMM + down GEMM      (m = T, shapes split by TP)
          + 2 all-reduces of T x hidden (TP > 1)
          + norms, RoPE, activation, residuals (HBM-bound, roofline) ]    -> linear(T)
    + lm-head GEMM for the S sequences that sample                          -> head(S)
    + L x decode attention over the decode batch                            -> decode(B, KV)
    + L x prefill attention over the prefill chunks                         -> prefill(pairs)
    + per-step overhead (scheduler, sampling, launch gaps), then x scale.

Measured tables are noisy by a few percent; each grid is made non-decreasing along every
axis (running maximum), so a step with more work never costs less.
"""

from __future__ import annotations

import numpy as np

from costmodels.architecture import ModelArch
from costmodels.optables import AttentionShape
from costmodels.steptable import StepTables

ACT_BYTES = 2  # activations stay bf16 whatever the GEMM dtype


def attention_shape(arch: ModelArch, tp: int, kv_dtype: str) -> AttentionShape:
    return AttentionShape(arch.num_heads // tp, arch.num_kv_heads // tp, arch.head_dim, kv_dtype)


def linear_seconds(arch: ModelArch, ops, tp: int, tokens: np.ndarray, hbm_bytes_per_s: float) -> np.ndarray:
    """Token-linear time of all layers for each entry of ``tokens``."""
    h, inter = arch.hidden_size, arch.intermediate_size // tp
    q, kv = arch.q_size // tp, arch.kv_size // tp
    per_layer = (ops.gemm(tokens, q + 2 * kv, h) + ops.gemm(tokens, h, q)
                 + ops.gemm(tokens, (2 if arch.gated_mlp else 1) * inter, h) + ops.gemm(tokens, h, inter))
    if tp > 1:
        per_layer = per_layer + 2 * ops.allreduce(tokens * h, tp)
    # two norms (read+write), two residual adds (2 reads+write), activation, RoPE on q and k
    elementwise = ACT_BYTES * (4 * h + 6 * h + 3 * inter + 2 * (q + kv))
    per_layer = per_layer + tokens * elementwise / hbm_bytes_per_s
    return arch.num_layers * per_layer


def decode_grid(arch: ModelArch, ops, shape: AttentionShape) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(batch axis, total-KV axis, seconds[batch, kv], largest measured KV per batch).

    Each batch row is interpolated linearly in per-sequence context between measured
    points; below one token per sequence it holds the first point, past the last measured
    context it continues the last segment's slope (decode attention is bandwidth-bound,
    so linear in KV) and ``decode_kv_measured`` marks where that starts.
    """
    rows = ops.decode_rows(shape)
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


def prefill_curve(arch: ModelArch, ops, shape: AttentionShape) -> tuple[np.ndarray, np.ndarray]:
    """(attention pairs, seconds) for prefill attention of all layers.

    Single-prompt measurements give the curve; batches of the longest measured prompts
    extend it to more work than one prompt reaches.
    """
    batch, isl, sec = ops.prefill_rows(shape)
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


def compose(arch: ModelArch, ops, tp: int, kv_dtype: str, hbm_bytes_per_s: float,
            overhead_s: float, scale: float = 1.0, max_logit_seqs: int = 4096) -> StepTables:
    """StepTables for ``arch`` at ``tp`` from an op source (profiled or roofline)."""
    tokens = ops.token_axis()
    linear = _monotone(linear_seconds(arch, ops, tp, tokens, hbm_bytes_per_s), 0)
    seqs = tokens[tokens <= max_logit_seqs]
    head = _monotone(ops.gemm(seqs, -(-arch.vocab_size // tp), arch.hidden_size), 0)
    shape = attention_shape(arch, tp, kv_dtype)
    batch, kv_axis, decode, measured = decode_grid(arch, ops, shape)
    pairs, prefill = prefill_curve(arch, ops, shape)
    return StepTables.from_grids(
        linear_tokens=tokens, linear_s=linear,
        head_seqs=seqs, head_s=head,
        decode_batch=batch, decode_kv=kv_axis, decode_s=decode, decode_kv_measured=measured,
        prefill_pairs=pairs, prefill_s=prefill,
        overhead_s=overhead_s, scale=scale,
    )


def _monotone(values: np.ndarray, axis: int) -> np.ndarray:
    return np.maximum.accumulate(values, axis=axis)
