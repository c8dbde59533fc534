"""Step-time tables and the jitted lookup the engine calls every step.

A step's time is the sum of separable parts, each a dense grid built once per
(model, GPU, TP, framework) and interpolated piecewise-linearly:

- ``linear``: every token-linear op of all layers (QKV, O-proj, MLP, all-reduce) vs the
  number of new tokens in the step (prefill chunks + decode tokens + verify tokens);
- ``head``: lm-head and sampling vs the number of sequences that produce logits;
- ``decode``: decode attention of all layers vs (decode sequences, total KV tokens their
  attention reads); total rather than mean KV keeps the step monotone in each input (more
  sequences over the same KV never cost less), and ``decode_kv_measured`` holds, per batch
  row, the largest total KV actually profiled (the tables stop near 0.5M tokens);
- ``prefill``: prefill attention of all layers vs attention work, the number of
  (query, key) pairs ``sum_r chunk_r * (cached_r + (chunk_r + 1) / 2)``, so a chunk on top
  of a cached prefix pays attention over the whole context;
- ``overhead_s``: fixed per-step time (scheduler, launch, norms), and ``scale``.

Separable grids keep each axis dense where the profiles are measured, which a single
3-D grid over (tokens, sequences, KV) could not do at the same size.

A lookup past the last grid point (or past ``decode_kv_measured``) extrapolates linearly
and reports it, so the caller can flag the run; nothing extrapolates silently. Builders
make every grid non-decreasing along each axis.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit


class StepTables(NamedTuple):
    """Dense grids for one (model, GPU, TP, framework); all times in seconds."""

    linear_tokens: np.ndarray  # f8[a], ascending
    linear_s: np.ndarray  # f8[a]
    head_seqs: np.ndarray  # f8[b], ascending
    head_s: np.ndarray  # f8[b]
    decode_batch: np.ndarray  # f8[c], ascending
    decode_kv: np.ndarray  # f8[d], ascending, total KV tokens read by all decode sequences
    decode_s: np.ndarray  # f8[c, d]
    decode_kv_measured: np.ndarray  # f8[c], largest profiled total KV per batch row
    prefill_pairs: np.ndarray  # f8[e], ascending
    prefill_s: np.ndarray  # f8[e]
    overhead_s: float
    scale: float


def validate_tables(t: StepTables) -> None:
    """Raise ValueError unless every axis is ascending and every grid is finite and >= 0."""
    axes = {
        "linear_tokens": (t.linear_tokens, t.linear_s),
        "head_seqs": (t.head_seqs, t.head_s),
        "prefill_pairs": (t.prefill_pairs, t.prefill_s),
    }
    for name, (axis, values) in axes.items():
        _check_axis(name, axis)
        if values.shape != axis.shape:
            raise ValueError(f"{name}: grid has shape {values.shape}, axis {axis.shape}")
    _check_axis("decode_batch", t.decode_batch)
    _check_axis("decode_kv", t.decode_kv)
    if t.decode_s.shape != (len(t.decode_batch), len(t.decode_kv)):
        raise ValueError(f"decode_s has shape {t.decode_s.shape}; expected (batch, kv)")
    if t.decode_kv_measured.shape != t.decode_batch.shape:
        raise ValueError("decode_kv_measured must have one entry per decode_batch row")
    for name in ("linear_s", "head_s", "decode_s", "prefill_s"):
        grid = getattr(t, name)
        if not np.all(np.isfinite(grid)) or np.any(grid < 0):
            raise ValueError(f"{name} must be finite and non-negative")
    if not (t.overhead_s >= 0 and t.scale > 0):
        raise ValueError("overhead_s must be >= 0 and scale > 0")


def _check_axis(name: str, axis: np.ndarray) -> None:
    if axis.ndim != 1 or len(axis) < 2 or np.any(np.diff(axis) <= 0):
        raise ValueError(f"{name} must be a strictly ascending axis of at least 2 points")


@njit(cache=True, nogil=True)
def interp1(axis, values, x):
    """Piecewise-linear value at x and whether x lay past the last point (extrapolated).

    Below the first point the first value holds: every part costs at least its
    smallest measured launch.
    """
    n = axis.shape[0]
    if x <= axis[0]:
        return values[0], False
    if x > axis[n - 1]:
        slope = (values[n - 1] - values[n - 2]) / (axis[n - 1] - axis[n - 2])
        return values[n - 1] + slope * (x - axis[n - 1]), True
    hi = np.searchsorted(axis, x)
    lo = hi - 1
    w = (x - axis[lo]) / (axis[hi] - axis[lo])
    return values[lo] + w * (values[hi] - values[lo]), False


@njit(cache=True, nogil=True)
def interp2(ax0, ax1, grid, x0, x1):
    """Bilinear value on grid[ax0, ax1] at (x0, x1), extrapolating linearly past the end."""
    n0 = ax0.shape[0]
    n1 = ax1.shape[0]
    i = min(max(np.searchsorted(ax0, x0), 1), n0 - 1)
    j = min(max(np.searchsorted(ax1, x1), 1), n1 - 1)
    out = x0 > ax0[n0 - 1] or x1 > ax1[n1 - 1]
    u = (max(x0, ax0[0]) - ax0[i - 1]) / (ax0[i] - ax0[i - 1])
    v = (max(x1, ax1[0]) - ax1[j - 1]) / (ax1[j] - ax1[j - 1])
    top = grid[i - 1, j - 1] + v * (grid[i - 1, j] - grid[i - 1, j - 1])
    bottom = grid[i, j - 1] + v * (grid[i, j] - grid[i, j - 1])
    return top + u * (bottom - top), out


@njit(cache=True, nogil=True)
def step_seconds(t, n_tokens, n_logit_seqs, n_decode, kv_decode_tokens, prefill_pairs):
    """Seconds for one engine step, and whether any part left the profiled range.

    n_tokens: new tokens computed in the step (all kinds); n_logit_seqs: sequences that
    sample a token; n_decode and kv_decode_tokens: decode sequences and the KV tokens
    their attention reads in total; prefill_pairs: prefill attention work (see module).
    """
    if n_tokens <= 0:
        return 0.0, False
    total, out = interp1(t.linear_tokens, t.linear_s, n_tokens)
    if n_logit_seqs > 0:
        part, o = interp1(t.head_seqs, t.head_s, n_logit_seqs)
        total += part
        out = out or o
    if n_decode > 0:
        part, o = interp2(t.decode_batch, t.decode_kv, t.decode_s, n_decode, kv_decode_tokens)
        limit, _ = interp1(t.decode_batch, t.decode_kv_measured, n_decode)
        total += part
        out = out or o or kv_decode_tokens > limit
    if prefill_pairs > 0:
        part, o = interp1(t.prefill_pairs, t.prefill_s, prefill_pairs)
        total += part
        out = out or o
    return t.scale * (total + t.overhead_s), out


def linear_tables(
    per_token_s: float = 2e-6,
    per_seq_s: float = 1e-6,
    per_kv_token_s: float = 2e-9,
    per_pair_s: float = 1e-10,
    overhead_s: float = 0.004,
    max_tokens: float = 1 << 20,
    max_seqs: float = 1 << 14,
    max_kv: float = 1 << 30,
    max_pairs: float = 1 << 42,
) -> StepTables:
    """An exactly linear step-time model: for tests and as a labelled placeholder.

    Step time = overhead + per_token * tokens + per_seq * logit seqs
    + per_kv_token * KV read by decode + per_pair * prefill attention pairs.
    """
    f = np.float64
    tok = np.array([0.0, max_tokens], dtype=f)
    seqs = np.array([0.0, max_seqs], dtype=f)
    batch = np.array([0.0, max_seqs], dtype=f)
    kv = np.array([0.0, max_kv], dtype=f)
    decode = np.outer(np.ones_like(batch), kv) * per_kv_token_s
    pairs = np.array([0.0, max_pairs], dtype=f)
    return StepTables(
        linear_tokens=tok,
        linear_s=tok * per_token_s,
        head_seqs=seqs,
        head_s=seqs * per_seq_s,
        decode_batch=batch,
        decode_kv=kv,
        decode_s=decode,
        decode_kv_measured=np.full(2, max_kv),
        prefill_pairs=pairs,
        prefill_s=pairs * per_pair_s,
        overhead_s=float(overhead_s),
        scale=1.0,
    )
