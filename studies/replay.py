"""The study's traffic as a benchmark client replays it against a real server.

``vllm bench serve --dataset-name timed_trace``, AIPerf's ``mooncake_trace`` and
SGLang's ``bench_serving --dataset-name mooncake`` all replay a Mooncake-layout JSONL.
What they send differs from the study trace in three ways, and ``as_replayed`` makes the
trace say so, so that its simulation is the simulation of the run they make:

- time starts at the first request (the tools sleep until each ``timestamp``, counted
  from when they start);
- every prompt is built from its block ids, so a prompt needs one id per block: blocks
  the trace does not list get fresh ids no other request shares (vLLM builds a 0-token
  prompt from a row without ids);
- outputs run to their exact length (``ignore_eos``; at least one token) and the client
  sends that length as ``max_tokens``, so the server knows each request's output length,
  as no production client lets it;
- no request carries a priority, a ``cache_salt`` or gives up at a deadline: the tools
  send none of them, so the replayed requests share every cached prefix.
  Tenants and SLO classes stay, for scoring.

SGLang's replay ignores ``input_length``: it writes 128 ``hi`` tokens per block id
(sglang/benchmark/datasets/mooncake.py, ``get_mooncake_request_over_time``, SGLang
0.5.23) and applies the chat template. ``write_sglang_mooncake`` therefore gives each
full block ceil(block_tokens / 129) ids, derived from the block's own id so shared
prefixes stay shared, and the last block as many as the whole prompt still needs; the
prompt lengths SGLang reports then land within about one id's tokens of the trace's
(plus under 1% on long prompts, where 4 ids a block hold 516 tokens for 512).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from studies.traces import CAP_GIVEN, DEFAULT_PRIORITY, ESTIMATE_IS_CAP, Trace

#: tokens one SGLang mooncake id becomes: 128 ``hi`` plus the id's digits (one token for
#: each group of three in Llama-3's tokenizer)
SGLANG_TOKENS_PER_ID = 129


def complete_blocks(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, hashes): every request's listed blocks, then fresh unshared ids up to
    ceil(prompt / block_tokens) blocks."""
    need = -(-trace.prompt_tokens // trace.block_tokens)
    have = trace.block_counts
    offsets = np.zeros(trace.n + 1, dtype=np.int64)
    np.cumsum(need, out=offsets[1:])
    hashes = np.empty(offsets[-1], dtype=np.int64)
    fresh = int(trace.block_hashes.max(initial=-1)) + 1
    for i in range(trace.n):
        listed = trace.block_hashes[trace.block_offsets[i]:trace.block_offsets[i + 1]]
        start = offsets[i]
        hashes[start:start + have[i]] = listed
        missing = need[i] - have[i]
        hashes[start + have[i]:offsets[i + 1]] = np.arange(fresh, fresh + missing)
        fresh += missing
    return offsets, hashes


def as_replayed(trace: Trace) -> Trace:
    """``trace`` as a timed replay sends it (module docstring): time from the first
    request, a block id for every block, and each output's length sent as its cap."""
    if trace.n == 0:
        return trace
    offsets, hashes = complete_blocks(trace)
    exact = np.maximum(trace.output_tokens, 1)
    return trace.replace(
        arrival_s=trace.arrival_s - trace.arrival_s[0], deadline_s=np.full(trace.n, np.nan),
        priority=np.full(trace.n, DEFAULT_PRIORITY, dtype=np.int32),
        block_offsets=offsets, block_hashes=hashes, output_tokens=exact, max_tokens=exact, max_tokens_source=np.full(trace.n, CAP_GIVEN, dtype=np.int8),
        output_estimate=exact, output_estimator=ESTIMATE_IS_CAP,
        cache_salt=np.zeros(trace.n, dtype=np.int32), cache_salt_names=("",),
        meta={**trace.meta, "replayed": True})


def sglang_ids(trace: Trace, i: int) -> list[int]:
    """SGLang mooncake ids for request ``i`` of a replayed trace (``as_replayed``)."""
    blocks = trace.block_hashes[trace.block_offsets[i]:trace.block_offsets[i + 1]]
    per_block = -(-trace.block_tokens // SGLANG_TOKENS_PER_ID)
    # the last block takes what the whole prompt still needs (none, if its full blocks cover it)
    last = max(0, round(int(trace.prompt_tokens[i]) / SGLANG_TOKENS_PER_ID) - per_block * (len(blocks) - 1))
    ids = []
    for j, block in enumerate(blocks):
        count = per_block if j < len(blocks) - 1 else last
        ids.extend(int(block) * per_block + k for k in range(count))
    return ids


def write_sglang_mooncake(trace: Trace, path: Path) -> Path:
    """The replayed trace in the layout SGLang's mooncake replay reads (module docstring)."""
    with open(path, "w") as handle:
        for i in range(trace.n):
            record = {"timestamp": round(float(trace.arrival_s[i]) * 1000.0, 3),
                      "input_length": int(trace.prompt_tokens[i]),
                      "output_length": int(trace.output_tokens[i]),
                      "hash_ids": sglang_ids(trace, i)}
            handle.write(json.dumps(record) + "\n")
    return path


def with_prompts(trace: Trace, prompt_tokens: np.ndarray) -> Trace:
    """``trace`` with other prompt lengths (those a client reports it sent): each block
    list cut to the new length, or extended with fresh ids."""
    prompt_tokens = np.asarray(prompt_tokens, dtype=np.int64)
    keep = np.minimum(trace.block_counts, -(-prompt_tokens // trace.block_tokens))
    rows = np.repeat(np.arange(trace.n), trace.block_counts)
    within = np.arange(len(trace.block_hashes)) - trace.block_offsets[rows]
    kept = within < keep[rows]
    offsets = np.zeros(trace.n + 1, dtype=np.int64)
    np.cumsum(keep, out=offsets[1:])
    cut = trace.replace(prompt_tokens=prompt_tokens, block_offsets=offsets, block_hashes=trace.block_hashes[kept])
    offsets, hashes = complete_blocks(cut)
    return cut.replace(block_offsets=offsets, block_hashes=hashes)
