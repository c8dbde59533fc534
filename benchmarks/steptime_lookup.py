"""Cost of one step-time lookup in ns: the bucket-indexed lookup against the binary-search one.

The baseline is the lookup servetune used before (a NamedTuple of 10 grid arrays, a
binary search per axis, a division per segment, branches around the optional parts),
kept below verbatim and measured in the same run on the same grids and inputs. Two input streams: independent random steps (every branch and every cache
line unpredictable) and a random walk that changes the batch a little each step, as
consecutive engine steps do.

    python benchmarks/steptime_lookup.py
"""

import time
from functools import partial
from typing import NamedTuple

import numpy as np
from numba import njit

from costmodels import build, step_seconds

N = 1_000_000
REPEATS = 5


class OldStepTables(NamedTuple):
    linear_tokens: np.ndarray
    linear_s: np.ndarray
    head_seqs: np.ndarray
    head_s: np.ndarray
    decode_batch: np.ndarray
    decode_kv: np.ndarray
    decode_s: np.ndarray
    decode_kv_measured: np.ndarray
    prefill_pairs: np.ndarray
    prefill_s: np.ndarray
    overhead_s: float
    scale: float


@njit(cache=True, nogil=True)
def _old_interp1(axis, values, x):
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
def _old_interp2(ax0, ax1, grid, x0, x1):
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
def old_step_seconds(t, n_tokens, n_logit_seqs, n_decode, kv_decode_tokens, prefill_pairs):
    if n_tokens <= 0:
        return 0.0, False
    total, out = _old_interp1(t.linear_tokens, t.linear_s, n_tokens)
    if n_logit_seqs > 0:
        part, o = _old_interp1(t.head_seqs, t.head_s, n_logit_seqs)
        total += part
        out = out or o
    if n_decode > 0:
        part, o = _old_interp2(t.decode_batch, t.decode_kv, t.decode_s, n_decode, kv_decode_tokens)
        limit, _ = _old_interp1(t.decode_batch, t.decode_kv_measured, n_decode)
        total += part
        out = out or o or kv_decode_tokens > limit
    if prefill_pairs > 0:
        part, o = _old_interp1(t.prefill_pairs, t.prefill_s, prefill_pairs)
        total += part
        out = out or o
    return t.scale * (total + t.overhead_s), out


@njit(cache=True, nogil=True)
def _lookup_loop(lookup, t, tokens, seqs, kv, pairs):
    """Sum ``lookup`` over the inputs; Numba specialises it per lookup, a direct call."""
    total = 0.0
    flagged = 0
    for i in range(tokens.shape[0]):
        s, out = lookup(t, tokens[i], seqs[i], seqs[i], kv[i], pairs[i])
        total += s
        flagged += out
    return total, flagged


@njit(cache=True, nogil=True)
def _empty_loop(t, tokens, seqs, kv, pairs):
    """The loop without a lookup: what both loops pay for reading the inputs."""
    total = 0.0
    flagged = 0
    for i in range(tokens.shape[0]):
        total += tokens[i] + seqs[i] + kv[i] + pairs[i] * t.scale
        flagged += tokens[i] > 8192.0
    return total, flagged


def random_steps(rng):
    """Independent steps: up to 256 decodes plus up to 2048 prefill tokens."""
    seqs = rng.integers(1, 256, N)
    tokens = seqs + rng.integers(0, 2048, N)
    kv = (seqs * rng.uniform(100, 2000, N)).astype(np.int64)
    pairs = rng.integers(0, 2_000_000, N)
    return tokens, seqs, kv, pairs


def walking_steps(rng):
    """Consecutive steps of one replica: the batch drifts by a few sequences per step."""
    seqs = np.clip(64 + np.cumsum(rng.integers(-2, 3, N)), 1, 512)
    chunk = np.where(rng.random(N) < 0.3, rng.integers(1, 2048, N), 0)
    kv = seqs * np.clip(1000 + np.cumsum(rng.integers(-20, 21, N)), 10, 30000)
    return seqs + chunk, seqs, kv, chunk * (chunk + 1) // 2


def ns_per_call(loop, t, inputs) -> tuple[float, int]:
    loop(t, *(x[:10] for x in inputs))  # compile
    best = np.inf
    for _ in range(REPEATS):
        start = time.perf_counter()
        _, flagged = loop(t, *inputs)
        best = min(best, time.perf_counter() - start)
    return best / N * 1e9, int(flagged)


def main() -> None:
    t = build("meta-llama/Llama-3.1-8B", "h100").tables
    old_tables = OldStepTables(**{k: v.copy() for k, v in t.grids().items()}, overhead_s=t.overhead_s,
                               scale=t.scale)
    rng = np.random.default_rng(0)
    print(f"Llama-3.1-8B on H100, {N:,} lookups, best of {REPEATS}; ns per call inside a jitted loop")
    print(f"{'input stream':<16}{'loop only':>10}{'old':>10}{'new':>10}{'old/new':>9}   flagged old/new")
    for name, inputs in (("random steps", random_steps(rng)), ("walking steps", walking_steps(rng))):
        empty, _ = ns_per_call(_empty_loop, t, inputs)
        old, old_flagged = ns_per_call(partial(_lookup_loop, old_step_seconds), old_tables, inputs)
        new, new_flagged = ns_per_call(partial(_lookup_loop, step_seconds), t, inputs)
        print(f"{name:<16}{empty:>10.1f}{old:>10.1f}{new:>10.1f}{old / new:>9.2f}   {old_flagged}/{new_flagged}")
    step_seconds(t, 100, 64, 64, 64_000, 0)  # compile for Python's int arguments
    start = time.perf_counter()
    for i in range(10_000):
        step_seconds(t, 100 + i, 64, 64, 64_000 + i, 0)
    print(f"step_seconds called from Python: {(time.perf_counter() - start) / 10_000 * 1e9:.0f} ns/call "
          "(dispatch overhead; keep lookups inside jitted code)")


if __name__ == "__main__":
    main()
