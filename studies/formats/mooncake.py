"""Mooncake JSONL (FAST'25 release): ``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids`` (remapped ids of 512-token prefix blocks; equal leading ids = shared prefix).

The released timestamps are rounded to ~3 s buckets, so many requests share one value.
Replaying them raw turns every bucket edge into a burst; ``spread`` places the requests of
a bucket across it instead:

- ``"uniform"`` (default): evenly spaced, ``t + j * width / m`` for the j-th of m;
  deterministic.
- ``"poisson"``: sorted uniform draws in ``[t, t + width)``, i.e. a Poisson process
  conditioned on the bucket's count; seeded by ``seed``.
- ``"raw"``: the file's timestamps as they are.

A bucket's width is the gap to the next distinct timestamp (the last bucket takes the
median gap), or ``bucket_s`` when given. Keys other than these four are not read; a warning
names them (with the key each may misspell).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl

from studies.formats._rows import constant_cap, drop_rows, read_jsonl
from studies.traces import Trace, TraceError

SCHEMA = {
    "timestamp": pl.Float64,
    "input_length": pl.Int64,
    "output_length": pl.Int64,
    "hash_ids": pl.List(pl.Int64),
}
SPREADS = ("uniform", "poisson", "raw")
BLOCK_TOKENS = 512


def read(path: Path, *, strict: bool = False, spread: str = "uniform", seed: int = 0,
         bucket_s: float | None = None, block_tokens: int = BLOCK_TOKENS,
         max_tokens: int | None = None, drop_zero_prompt: bool = False) -> Trace:
    if spread not in SPREADS:
        raise TraceError(f"option spread={spread!r}; expected one of {list(SPREADS)}")
    if bucket_s is not None and not (np.isfinite(bucket_s) and bucket_s > 0):
        raise TraceError(f"option bucket_s={bucket_s!r}; expected seconds > 0")
    meta = {"format": "mooncake", "spread": spread}
    rows = read_jsonl(path, SCHEMA, format="Mooncake")
    rows.require("timestamp", "input_length", "output_length")
    if drop_zero_prompt:
        prompt = rows.frame["input_length"].to_numpy()
        rows = drop_rows(rows, prompt == 0, "zero_prompt", meta)
    hint = "" if drop_zero_prompt else " (drop_zero_prompt=True drops rows with 0)"
    prompt = rows.tokens("input_length", minimum=1, hint=hint)
    columns = {
        "arrival_s": rows.times("timestamp", scale=1e-3),
        "prompt_tokens": prompt,
        "output_tokens": rows.tokens("output_length", minimum=0),
        "max_tokens": constant_cap(max_tokens, rows.n),
    }
    offsets, hashes = rows.block_lists("hash_ids", prompt, block_tokens)
    trace = rows.to_trace(columns, time_column="timestamp", strict=strict, meta=meta,
                          block_offsets=offsets, block_hashes=hashes, block_tokens=block_tokens)
    if spread == "raw":
        return trace
    arrival, width = spread_buckets(trace.arrival_s, spread, np.random.default_rng(seed), bucket_s)
    meta = {**trace.meta, "bucket_s": width, **({"seed": seed} if spread == "poisson" else {})}
    spread_trace = trace.replace(arrival_s=arrival, meta=meta)
    return spread_trace.take(np.argsort(arrival, kind="stable"))


def spread_buckets(arrival_s: np.ndarray, mode: str, rng: np.random.Generator,
                   bucket_s: float | None = None) -> tuple[np.ndarray, float]:
    """Spread runs of equal (sorted) times across their bucket; returns (times, median width)."""
    n = len(arrival_s)
    starts = np.flatnonzero(np.r_[True, np.diff(arrival_s) > 0])
    counts = np.diff(np.r_[starts, n])
    gaps = np.diff(arrival_s[starts])
    if bucket_s is not None:
        widths = np.full(len(starts), float(bucket_s))
    elif len(gaps) == 0:
        return arrival_s.copy(), 0.0  # one timestamp: no bucket width to spread over
    else:
        widths = np.r_[gaps, np.median(gaps)]
    bucket = np.repeat(np.arange(len(starts)), counts)
    if mode == "uniform":
        within = np.arange(n) - starts[bucket]
        offsets = within * (widths / counts)[bucket]
    else:
        draws = rng.random(n) * widths[bucket]
        offsets = draws[np.lexsort((draws, bucket))]  # sorted within each bucket
    return arrival_s + offsets, float(np.median(widths))


def write(trace: Trace, path: Path) -> Path:
    """Mooncake JSONL: arrival in ms to the microsecond, blocks of ``trace.block_tokens``
    (a replay tool must be told the size when it is not 512); tenants, SLO classes,
    priorities, deadlines and max_tokens are not part of the format and are not written."""
    timestamps = np.round(trace.arrival_s * 1000.0, 3)
    offsets, hashes = trace.block_offsets, trace.block_hashes.tolist()
    with open(path, "w") as handle:
        for i in range(trace.n):
            record = {
                "timestamp": float(timestamps[i]),
                "input_length": int(trace.prompt_tokens[i]),
                "output_length": int(trace.output_tokens[i]),
                "hash_ids": hashes[offsets[i]:offsets[i + 1]],
            }
            handle.write(json.dumps(record) + "\n")
    return path
