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

Calibration against measured runs also separates the two regimes a step mixes:
``decode_scale`` multiplies what the step's decode tokens cost on their own (the token-
linear ops at the decode count, lm-head, decode attention: bandwidth-bound work) and
``prefill_scale`` what the other new tokens add to it (the token-linear ops' increment
over the decode count, prefill attention: compute-bound work). Both default to 1, when
the split changes nothing:

    step = scale * (decode_scale * decode part + prefill_scale * prefill part + overhead_s)

Separable grids keep each axis dense where the profiles are measured, which a single
3-D grid over (tokens, sequences, KV) could not do at the same size.

A lookup past the last grid point (or past ``decode_kv_measured``) extrapolates linearly
and reports it, so the caller can flag the run; nothing extrapolates silently. Builders
make every grid non-decreasing along each axis.

The engine looks a step up hundreds of thousands of times per replay, so the lookup is
built for speed (``benchmarks/steptime_lookup.py``):

- no search: each axis carries a bucket index (``axis_index``) that maps a value to its
  grid segment in O(1), and each curve its segment slopes, so grid points come back
  exactly as stored;
- one array: ``StepTables.from_grids`` packs every grid, slope and index into
  ``StepTables.data``, because Numba reference-counts every array of a tuple it passes
  around (an atomic update each, at every call that does not prune them), which cost
  more than all the arithmetic. The grids read back as properties of their old names.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, types
from numba.extending import intrinsic, overload

MAX_BUCKET_BITS = 8  # at most 2**8 buckets per octave ...
MAX_BUCKETS = 4096  # ... and per axis, so an index stays a few KiB

# StepTables.data opens with the offset of each block:
LINEAR, HEAD, BATCH, KV, PREFILL, DECODE = range(6)
_HEADER = 6
# An axis block holds [points n, buckets, bucket bits, first bucket key], the n axis
# points, the inverse widths of their segments (n, last 0) and the bucket index; a curve's
# block (every axis but KV; BATCH's curve is decode_kv_measured) then holds its n values
# and n slopes (the last repeats the last segment's, for extrapolation). DECODE is
# decode_s, row-major.
_N, _BUCKETS, _BITS, _FIRST, _AXIS = range(5)
_CURVES = {LINEAR: ("linear_tokens", "linear_s"), HEAD: ("head_seqs", "head_s"),
           BATCH: ("decode_batch", "decode_kv_measured"), KV: ("decode_kv", None),
           PREFILL: ("prefill_pairs", "prefill_s")}
GRIDS = ("linear_tokens", "linear_s", "head_seqs", "head_s", "decode_batch", "decode_kv", "decode_s",
         "decode_kv_measured", "prefill_pairs", "prefill_s")


class StepTables(NamedTuple):
    """Dense grids for one (model, GPU, TP, framework), packed; all times in seconds.

    Build with ``StepTables.from_grids``; read the grids through the properties
    (``linear_tokens``, ``decode_s``, ...). ``_replace(overhead_s=..., scale=..., prefill_scale=...,
    decode_scale=..., prefill_step_s=...)`` is
    safe; never edit ``data`` in place (the indexes would go stale). It stays writeable
    so that its Numba type, and so every compiled kernel, survives pickling unchanged.
    """

    data: np.ndarray  # f8, every grid with its lookup index (layout above)
    overhead_s: float
    scale: float
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    #: fixed seconds a step with prompt tokens adds (fitted by calibration): a decode-only
    #: step replays a CUDA graph, while TRT-LLM, for one, runs context and mixed iterations
    #: eagerly unless its piecewise prefill graphs are on, paying the launches
    prefill_step_s: float = 0.0

    @classmethod
    def from_grids(cls, *, linear_tokens, linear_s, head_seqs, head_s, decode_batch, decode_kv, decode_s,
                   decode_kv_measured, prefill_pairs, prefill_s, overhead_s, scale, prefill_scale=1.0,
                   decode_scale=1.0, prefill_step_s=0.0) -> StepTables:
        """Pack the grids (axes ascending, grids finite and >= 0) with their lookup indexes.

        ValueError naming the grid if one breaks the rules.
        """
        g = {name: np.ascontiguousarray(value, dtype=np.float64) for name, value in zip(GRIDS, (
            linear_tokens, linear_s, head_seqs, head_s, decode_batch, decode_kv, decode_s, decode_kv_measured,
            prefill_pairs, prefill_s), strict=True)}
        _check_grids(g, overhead_s, scale)
        if not (prefill_scale > 0 and decode_scale > 0):
            raise ValueError("prefill_scale and decode_scale must be > 0")
        if not (np.isfinite(prefill_step_s) and prefill_step_s >= 0):
            raise ValueError(f"prefill_step_s must be finite and >= 0, got {prefill_step_s}")
        blocks = [_block(g[axis], None if values is None else g[values]) for axis, values in _CURVES.values()]
        blocks.append(g["decode_s"].ravel())
        starts = _HEADER + np.cumsum([0] + [len(b) for b in blocks[:-1]])
        data = np.concatenate([starts.astype(np.float64), *blocks])
        return cls(data, float(overhead_s), float(scale), float(prefill_scale), float(decode_scale),
                   float(prefill_step_s))

    def grids(self) -> dict[str, np.ndarray]:
        """The grids by name, as views of ``data``."""
        return {name: getattr(self, name) for name in GRIDS}

    def _points(self, block: int) -> tuple[int, int, int]:
        at = int(self.data[block])
        return at, int(self.data[at + _N]), int(self.data[at + _BUCKETS])

    def _axis(self, block: int) -> np.ndarray:
        at, n, _ = self._points(block)
        return self.data[at + _AXIS:at + _AXIS + n]

    def _values(self, block: int) -> np.ndarray:
        at, n, buckets = self._points(block)
        values = at + _AXIS + 2 * n + buckets
        return self.data[values:values + n]

    linear_tokens = property(lambda self: self._axis(LINEAR), doc="f8[a], ascending: new tokens in the step")
    linear_s = property(lambda self: self._values(LINEAR), doc="f8[a]: token-linear seconds")
    head_seqs = property(lambda self: self._axis(HEAD), doc="f8[b], ascending: sequences sampling a token")
    head_s = property(lambda self: self._values(HEAD), doc="f8[b]: lm-head seconds")
    decode_batch = property(lambda self: self._axis(BATCH), doc="f8[c], ascending: decode sequences")
    decode_kv = property(lambda self: self._axis(KV), doc="f8[d], ascending: total KV tokens decode reads")
    decode_kv_measured = property(lambda self: self._values(BATCH), doc="f8[c]: largest profiled KV per row")
    prefill_pairs = property(lambda self: self._axis(PREFILL), doc="f8[e], ascending: attention pairs")
    prefill_s = property(lambda self: self._values(PREFILL), doc="f8[e]: prefill attention seconds")

    @property
    def decode_s(self) -> np.ndarray:
        """f8[c, d]: decode attention seconds over (decode_batch, decode_kv)."""
        at, rows, cols = int(self.data[DECODE]), len(self.decode_batch), len(self.decode_kv)
        return self.data[at:at + rows * cols].reshape(rows, cols)


def validate_tables(t: StepTables) -> None:
    """Raise ValueError unless ``t.data`` is exactly what ``from_grids`` packs from its grids."""
    if not (isinstance(t.data, np.ndarray) and t.data.dtype == np.float64 and t.data.ndim == 1):
        raise ValueError("StepTables.data must be a 1-D float64 array; build tables with StepTables.from_grids")
    try:
        repacked = StepTables.from_grids(**t.grids(), overhead_s=t.overhead_s, scale=t.scale,
                                         prefill_scale=t.prefill_scale, decode_scale=t.decode_scale,
                                         prefill_step_s=t.prefill_step_s)
    except (IndexError, ValueError, OverflowError) as exc:
        raise ValueError(f"StepTables.data is not a packed table ({exc}); build tables with "
                         "StepTables.from_grids") from exc
    if not np.array_equal(repacked.data, t.data):
        raise ValueError("StepTables.data does not match its own grids; build tables with StepTables.from_grids")


def _check_grids(g: dict, overhead_s: float, scale: float) -> None:
    for axis, values in _CURVES.values():
        _check_axis(axis, g[axis])
        if values is not None and g[values].shape != g[axis].shape:
            raise ValueError(f"{values} has shape {g[values].shape}; its axis {axis} has {g[axis].shape}")
    if g["decode_s"].shape != (len(g["decode_batch"]), len(g["decode_kv"])):
        raise ValueError(f"decode_s has shape {g['decode_s'].shape}; expected (batch, kv)")
    for name in ("linear_s", "head_s", "decode_s", "prefill_s"):
        grid = g[name]
        if not np.all(np.isfinite(grid)) or np.any(grid < 0):
            raise ValueError(f"{name} must be finite and non-negative")
    if not (overhead_s >= 0 and scale > 0):
        raise ValueError("overhead_s must be >= 0 and scale > 0")


def _check_axis(name: str, axis: np.ndarray) -> None:
    if axis.ndim != 1 or len(axis) < 2 or np.any(np.diff(axis) <= 0):
        raise ValueError(f"{name} must be a strictly ascending axis of at least 2 points")
    if not (axis[0] >= 0 and np.isfinite(axis[-1])):
        raise ValueError(f"{name} counts work: its points must be finite and >= 0, got {axis[0]!r} .. {axis[-1]!r}")
    with np.errstate(over="ignore", divide="ignore"):
        tight = np.flatnonzero(~np.isfinite(1.0 / np.diff(axis)))
    if len(tight):
        raise ValueError(f"{name}: points {axis[tight[0]]!r} and {axis[tight[0] + 1]!r} are too close to interpolate")


def _block(axis: np.ndarray, values: np.ndarray | None) -> np.ndarray:
    bits, first, starts = axis_index(axis)
    parts = [np.array([len(axis), len(starts), bits, first], dtype=np.float64), axis,
             np.append(1.0 / np.diff(axis), 0.0), starts.astype(np.float64)]
    if values is not None:
        slopes = np.diff(values) / np.diff(axis)
        parts += [values, np.append(slopes, slopes[-1])]
    return np.concatenate(parts)


def float_bits(x: float) -> int:
    """The IEEE-754 bits of float64 x as an int64 (in Python; jitted code bit-casts)."""
    return int(np.float64(x).view(np.int64))


@intrinsic
def _bitcast_to_int64(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.int64))

    return types.int64(types.float64), codegen


@overload(float_bits)
def _float_bits_jit(x):
    return lambda x: _bitcast_to_int64(float(x))


@njit(cache=True, nogil=True, _nrt=False)
def bucket_key(x, bits):
    """Bucket of x: 2**bits equal-width buckets per octave, all of x < 1 in the first.

    The float's exponent and top mantissa bits, so nondecreasing in x (a bucket is a
    range), exact, a shift to compute, and aligned with the powers of two that profiled
    grids favour.
    """
    return float_bits(max(float(x), 1.0)) >> (52 - bits)


@njit(cache=True, _nrt=True)
def _bucket_keys(axis, bits):
    keys = np.empty(axis.shape[0], dtype=np.int64)
    for k in range(axis.shape[0]):
        keys[k] = bucket_key(axis[k], bits)
    return keys


def axis_index(axis: np.ndarray) -> tuple[int, int, np.ndarray]:
    """Bucket index of an ascending axis: ``(bits, first_key, starts)``.

    ``starts[k]`` is the segment holding the lowest value of bucket ``first_key + k``
    (values below the first bucket use bucket 0). A lookup starts there and steps over
    the grid points inside the bucket, so the resolution is the smallest that leaves at
    most one point inside any bucket (within ``MAX_BUCKET_BITS`` and ``MAX_BUCKETS``;
    any axis still works, a dense one with a few more steps).
    """
    n = len(axis)
    best = None
    for bits in range(MAX_BUCKET_BITS + 1):
        keys = _bucket_keys(axis, bits)
        # one octave below the second point: the only point it leaves out is axis[0]
        first = int(max(keys[0], keys[1] - (1 << bits)))
        buckets = np.arange(first, keys[-1] + 2)  # and the bucket after the last, for its lowest value
        if len(buckets) > MAX_BUCKETS and best is not None:
            break
        lowest = (buckets << (52 - bits)).view(np.float64)  # inverts bucket_key
        lowest[0] = axis[0]  # bucket 0 also takes every value below it
        starts = np.clip(np.searchsorted(axis, lowest[:-1], side="right") - 1, 0, n - 2)
        best = bits, first, starts
        ends = np.searchsorted(axis, lowest[1:], side="left") - 1  # segment of each bucket's highest value
        if np.all(ends - starts <= 1):
            break
    return best


@njit(cache=True, nogil=True, inline="always")
def _locate(d, block, x):
    """(i, x, past) for x on a block's axis: axis[i] <= x < axis[i+1] (n-1 from the last
    point on), x raised to the first point, and whether x lies past the last point."""
    at = int(d[block])
    n = int(d[at + _N])
    axis = at + _AXIS
    last = d[axis + n - 1]
    x = max(x, d[axis])
    inside = min(x, last)
    key = bucket_key(inside, int(d[at + _BITS])) - int(d[at + _FIRST])
    i = int(d[axis + 2 * n + min(max(key, 0), int(d[at + _BUCKETS]) - 1)])  # bounded even for NaN
    i += inside >= d[axis + i + 1]  # without a branch: most buckets hold at most one point
    while i < n - 1 and inside >= d[axis + i + 1]:  # dense axes only
        i += 1
    return i, x, x > last


@njit(cache=True, nogil=True, inline="always")
def _curve_at(d, block, i, x):
    """A block's curve at x in segment i (past the last point: the last slope continues)."""
    at = int(d[block])
    n = int(d[at + _N])
    values = at + _AXIS + 2 * n + int(d[at + _BUCKETS])
    return d[values + i] + d[values + n + i] * (x - d[at + _AXIS + i])


@njit(cache=True, nogil=True, inline="always")
def _curve(d, block, x):
    """A block's curve at x (below the first point: the first value) and whether x lay past the end."""
    i, x, past = _locate(d, block, x)
    return _curve_at(d, block, i, x), past


@njit(cache=True, nogil=True, inline="always")
def _cell(d, block, i, x):
    """Grid cell of segment i (the last cell from the last point on) and x's weight in it."""
    at = int(d[block])
    n = int(d[at + _N])
    i = min(i, n - 2)
    return i, (x - d[at + _AXIS + i]) * d[at + _AXIS + n + i]


@njit(cache=True, nogil=True, inline="always")
def _decode(d, n_decode, kv_tokens):
    """Decode attention (bilinear in decode_s) and whether it left the profiled range."""
    i, batch, batch_past = _locate(d, BATCH, n_decode)
    measured_kv = _curve_at(d, BATCH, i, batch)
    i, u = _cell(d, BATCH, i, batch)
    j, kv, kv_past = _locate(d, KV, kv_tokens)
    j, v = _cell(d, KV, j, kv)
    cols = int(d[int(d[KV]) + _N])
    low = int(d[DECODE]) + i * cols + j
    high = low + cols
    at_low = d[low] + v * (d[low + 1] - d[low])
    at_high = d[high] + v * (d[high + 1] - d[high])
    return at_low + u * (at_high - at_low), batch_past or kv_past or kv_tokens > measured_kv


@njit(cache=True, nogil=True, inline="always")
def step_seconds(t, n_tokens, n_logit_seqs, n_decode, kv_decode_tokens, prefill_pairs):
    """Seconds for one engine step, and whether any part left the profiled range.

    n_tokens: new tokens computed in the step (all kinds); n_logit_seqs: sequences that
    sample a token; n_decode and kv_decode_tokens: decode sequences and the KV tokens
    their attention reads in total; prefill_pairs: prefill attention work (see module).
    The token-linear ops at ``n_decode`` tokens are the decode part, their increment up
    to ``n_tokens`` the prefill part (module docstring).

    Any mix of int and float arguments runs one compiled body (``_step_seconds``): every
    lookup reads them as floats anyway, and each extra signature costs seconds to compile.
    """
    return _step_seconds(t, float(n_tokens), float(n_logit_seqs), float(n_decode), float(kv_decode_tokens),
                         float(prefill_pairs))


@njit(cache=True, nogil=True, _nrt=False)
def _step_seconds(t, n_tokens, n_logit_seqs, n_decode, kv_decode_tokens, prefill_pairs):
    """``step_seconds`` on float arguments."""
    if n_tokens <= 0:
        return 0.0, False
    d = t.data
    decode_part, prefill_part, out = _linear_parts(t, n_tokens, n_decode)
    # additions below in the order decode_run_step uses
    if n_logit_seqs > 0:
        part, past = _curve(d, HEAD, n_logit_seqs)
        decode_part += part
        out = out or past
    if n_decode > 0:
        part, past = _decode(d, n_decode, kv_decode_tokens)
        decode_part += part
        out = out or past
    if prefill_pairs > 0:
        part, past = _curve(d, PREFILL, prefill_pairs)
        prefill_part += part
        out = out or past
    eager = t.prefill_step_s if prefill_pairs > 0 else 0.0  # prompt chunks, not verified drafts
    return t.scale * (t.decode_scale * decode_part + t.prefill_scale * prefill_part + t.overhead_s + eager), out


@njit(cache=True, nogil=True, inline="always")
def _linear_parts(t, n_tokens, n_decode):
    """The token-linear curve at ``n_tokens`` split into its decode part (the curve at
    ``n_decode``) and the prefill increment, unscaled, and whether it left the range."""
    total, out = _curve(t.data, LINEAR, n_tokens)
    split = t.prefill_scale != t.decode_scale  # equal scales need no second lookup
    if n_decode >= n_tokens or not split:
        return total, 0.0, out
    if n_decode > 0:
        decode_part = _curve(t.data, LINEAR, n_decode)[0]
        return decode_part, total - decode_part, out
    return 0.0, total, out


@njit(cache=True, nogil=True, _nrt=False)
def linear_step_seconds(t, n_tokens, n_decode):
    """The token-linear part of ``step_seconds`` (GEMMs, MoE layers, collectives), scaled
    as there, for ``n_tokens`` new tokens of which ``n_decode`` decode (floats allowed: an
    attention-DP instance reads it at its groups' mean, ``policies.engine.lockstep``)."""
    if n_tokens <= 0:
        return 0.0
    decode_part, prefill_part, _ = _linear_parts(t, float(n_tokens), float(n_decode))
    return t.scale * (t.decode_scale * decode_part + t.prefill_scale * prefill_part)


@njit(cache=True, nogil=True, _nrt=False)
def decode_run_base(t, n_seqs):
    """For a run of pure-decode steps of ``n_seqs`` (>= 1) sequences, the parts of
    ``step_seconds(t, n, n, n, kv, 0)`` that do not depend on kv: (token-linear plus
    lm-head seconds, whether they or the batch axis left the profiled range, the decode
    grid row, the weight within it, the largest KV profiled at this batch)."""
    d = t.data
    total, out = _curve(d, LINEAR, n_seqs)
    part, past = _curve(d, HEAD, n_seqs)
    i, batch, batch_past = _locate(d, BATCH, n_seqs)
    measured_kv = _curve_at(d, BATCH, i, batch)
    i, u = _cell(d, BATCH, i, batch)
    row = int(d[DECODE]) + i * int(d[int(d[KV]) + _N])
    return total + part, out or past or batch_past, row, u, measured_kv


@njit(cache=True, nogil=True, inline="always")
def decode_run_step(t, base, kv_decode_tokens):
    """``step_seconds(t, n, n, n, kv, 0)`` from ``base = decode_run_base(t, n)``, bit for
    bit: one KV-axis lookup per step."""
    d = t.data
    lh, out, row, u, measured_kv = base
    j, kv, kv_past = _locate(d, KV, kv_decode_tokens)
    j, v = _cell(d, KV, j, kv)
    low = row + j
    high = low + int(d[int(d[KV]) + _N])
    at_low = d[low] + v * (d[low + 1] - d[low])
    at_high = d[high] + v * (d[high + 1] - d[high])
    part = at_low + u * (at_high - at_low)
    return t.scale * (t.decode_scale * (lh + part) + t.overhead_s), out or kv_past or kv_decode_tokens > measured_kv


@njit(cache=True, nogil=True, inline="always")
def _tile_start(d, axis, values, n, i):
    """Whether grid point i opens a tile: one token past the point before it, the curve
    rising over that token at least as much as across the tile behind it on average (a
    jump, as profiled GEMM tables bracket each tile edge: ..., 64, 65, 80, ...)."""
    if not (0 < i < n - 1 and d[axis + i] - d[axis + i - 1] == 1.0 and d[axis + i + 1] - d[axis + i] > 1.0):
        return False
    jump = d[values + i] - d[values + i - 1]
    return jump > 0.0 and jump * (d[axis + i + 1] - d[axis + i - 1]) >= d[values + i + 1] - d[values + i - 1]


@njit(cache=True, nogil=True, inline="always")
def _curve_at_tile_ends(d, block, x):
    """A block's curve at x, interpolated between tile ends: on either side of a point
    that opens a tile, the chord from the tile end before it to the grid point after it
    (never above the curve, by the definition of a tile start)."""
    i, x, past = _locate(d, block, x)
    at = int(d[block])
    n = int(d[at + _N])
    axis = at + _AXIS
    values = axis + 2 * n + int(d[at + _BUCKETS])
    lo, hi = i, i + 1
    if _tile_start(d, axis, values, n, i):
        lo = i - 1
    elif _tile_start(d, axis, values, n, i + 1):
        hi = i + 2
    if past or (lo == i and hi == i + 1):
        return _curve_at(d, block, i, x)
    w = (x - d[axis + lo]) / (d[axis + hi] - d[axis + lo])
    return d[values + lo] + w * (d[values + hi] - d[values + lo])


@njit(cache=True, nogil=True, _nrt=False)
def step_seconds_at_tile_ends(t, n_tokens, n_logit_seqs, n_decode, kv_decode_tokens, prefill_pairs):
    """``step_seconds`` with the token and logit curves read between GEMM tile ends.

    Profiled tables are a staircase in tokens: flat inside a tile, a jump where the next
    one opens. Read between tile ends, every token pays its share of the tile it falls
    in: a curve without the jumps, never above the table, equal to it at each tile end
    and wherever the table has no tile edges. For planners that add tokens one at a time
    and stop at the first that does not pay (a speculative verify budget).
    """
    seconds, out = step_seconds(t, n_tokens, n_logit_seqs, n_decode, kv_decode_tokens, prefill_pairs)
    if n_tokens <= 0:
        return seconds, out
    d = t.data
    linear_scale = t.prefill_scale if n_tokens > n_decode else t.decode_scale  # the tokens the step adds
    shift = linear_scale * (_curve_at_tile_ends(d, LINEAR, n_tokens) - _curve(d, LINEAR, n_tokens)[0])
    if n_logit_seqs > 0:
        shift += t.decode_scale * (_curve_at_tile_ends(d, HEAD, n_logit_seqs) - _curve(d, HEAD, n_logit_seqs)[0])
    return seconds + t.scale * shift, out


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
    return StepTables.from_grids(
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
        overhead_s=overhead_s,
        scale=1.0,
    )
