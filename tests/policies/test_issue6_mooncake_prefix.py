"""Prefix cache on the real Mooncake conversation trace: hits match the trace's reuse."""

import os
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from policies import prefix_cache as pcm

SHARED = Path(os.environ.get("SERVETUNE_SHARED", Path(__file__).resolve().parents[2] / ".." / "shared"))
MOONCAKE = SHARED / "traces" / "mooncake" / "conversation_trace.jsonl"
BLOCK_TOKENS = 512  # Mooncake hash blocks


@pytest.fixture(scope="module")
def mooncake():
    if not MOONCAKE.exists():
        pytest.skip(f"Mooncake trace not found at {MOONCAKE} (set SERVETUNE_SHARED)")
    df = pl.read_ndjson(MOONCAKE, schema={"input_length": pl.Int64, "hash_ids": pl.List(pl.Int64)})
    lengths = df["hash_ids"].list.len().to_numpy()
    offsets = np.zeros(len(df) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    hashes = df["hash_ids"].explode().to_numpy().astype(np.int64)
    return offsets, hashes, df["input_length"].to_numpy().astype(np.int64)


def test_unbounded_cache_hits_every_repeated_leading_block(mooncake):
    offsets, hashes, prompts = mooncake
    pc = pcm.new_prefix_cache(offsets, hashes, prompts, BLOCK_TOKENS, 16)
    hit = np.zeros(len(prompts), dtype=np.int64)
    for i in range(len(prompts)):
        k, hit[i], _ = pcm.match(pc, offsets, prompts, i, prompts[i])
        pcm.acquire(pc, offsets, i, k)
        pcm.insert(pc, offsets, i, prompts[i])
        pcm.release(pc, offsets, i)

    seen: set[int] = set()
    expected = np.zeros(len(prompts), dtype=np.int64)
    for i in range(len(prompts)):
        full = hashes[offsets[i] : offsets[i + 1]][: prompts[i] // BLOCK_TOKENS].tolist()
        k = 0
        while k < len(full) and full[k] in seen:
            k += 1
        expected[i] = min(k * BLOCK_TOKENS, prompts[i] - 1)
        seen.update(full)
    np.testing.assert_array_equal(hit, expected)
    # README: 36.6% of the 288,500 blocks repeat an earlier one; only partial tails are lost
    assert 0.33 < hit.sum() / (len(hashes) * BLOCK_TOKENS) < 0.37
    blocks = len(seen) * pc.unit_blocks
    assert pc.stats[pcm.S_CACHED] == blocks and pc.stats[pcm.S_EVICTABLE] == blocks
