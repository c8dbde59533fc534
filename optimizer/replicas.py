"""Several replicas behind a round-robin router, from single-replica simulations.

A fleet of R identical, independent replicas behind a round-robin router sends request
i (in arrival order) to replica i mod R, and no replica ever sees another's requests or
state. So the fleet is simulated exactly as R single-replica runs on the R sub-traces
(``split_round_robin``), and their SimResults are merged back onto the original request
order (``merge_replicas``). Smarter routers (least-loaded, prefix-affinity) couple the
replicas and need the engine's own fleet loop; they are not modelled here.

Merged fields:

- per-request arrays: each sub-result's values at its rows; ``replica`` is the replica
  index where the sub-result names one (a finished request), else -1;
- counters (steps, busy seconds, prefill tokens, out-of-range steps, swap-outs): sums;
- ``kv_capacity_blocks``: the fleet's total; ``kv_peak_blocks``: the sum of each
  replica's high-water mark (an upper bound on the fleet's simultaneous peak; under
  round robin replicas fill alike, so the two are close);
- ``end_s``: the last replica's end;
- series, merged by time: at every sample time of any replica, the sum over replicas of
  each one's latest sample (a replica holds its value between samples, as the timeline
  draws it, counts 0 before its first sample and after its run ended).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from policies.result import SimResult

#: The label outputs print wherever a multi-replica result appears.
ROUTING_LABEL = "round-robin routing, independent replicas"

_PER_REQUEST = ("state", "reject_reason", "first_token_s", "finish_s", "tokens_generated", "preemptions",
                "cached_prompt_tokens", "queue_s")
_SUMMED = ("steps", "busy_s", "prefill_tokens_computed", "out_of_range_steps", "swap_outs",
           "kv_capacity_blocks", "kv_peak_blocks")
_SERIES = ("series_kv_blocks", "series_running", "series_waiting")


def split_round_robin(n: int, replicas: int) -> list[np.ndarray]:
    """Rows of each replica: request i goes to replica i mod ``replicas`` (rows stay sorted)."""
    if not isinstance(replicas, int | np.integer) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    if replicas > n:
        raise ValueError(f"{replicas} replicas for {n} requests: round robin would leave "
                         f"{replicas - n} replica(s) without traffic")
    return [np.arange(r, n, replicas, dtype=np.int64) for r in range(replicas)]


def merge_replicas(results: Sequence[SimResult], rows: Sequence[np.ndarray], n: int) -> SimResult:
    """One SimResult over all ``n`` requests from per-replica results (see the module doc)."""
    if len(results) != len(rows) or not results:
        raise ValueError(f"need one result per replica, got {len(results)} results for {len(rows)} row sets")
    covered = np.zeros(n, dtype=np.int64)
    for r, (result, idx) in enumerate(zip(results, rows, strict=True)):
        if result.n != len(idx):
            raise ValueError(f"replica {r}: result has {result.n} requests but {len(idx)} rows were routed to it")
        np.add.at(covered, idx, 1)
    if not (covered == 1).all():
        raise ValueError(f"the replicas' rows must cover requests 0..{n - 1} exactly once")

    first = results[0]
    merged = {name: np.empty(n, dtype=getattr(first, name).dtype) for name in _PER_REQUEST}
    replica = np.empty(n, dtype=np.int32)
    for r, (result, idx) in enumerate(zip(results, rows, strict=True)):
        for name in _PER_REQUEST:
            merged[name][idx] = getattr(result, name)
        replica[idx] = np.where(result.replica >= 0, r, -1)
    counters = {name: sum(getattr(result, name) for result in results) for name in _SUMMED}
    ends = [result.end_s for result in results if not math.isnan(result.end_s)]
    return SimResult(**merged, replica=replica, **counters, **_merge_series(results),
                     end_s=max(ends) if ends else math.nan)


def _merge_series(results: Sequence[SimResult]) -> dict[str, np.ndarray]:
    times = np.unique(np.concatenate([np.asarray(result.series_t, dtype=np.float64) for result in results]))
    totals = {name: np.zeros(len(times), dtype=np.int64) for name in _SERIES}
    for result in results:
        latest = np.searchsorted(result.series_t, times, side="right") - 1
        live = (latest >= 0) & ~(times >= result.end_s)  # NaN end_s: the run never ended, hold
        for name in _SERIES:
            values = np.asarray(getattr(result, name), dtype=np.int64)
            totals[name] += np.where(live, values[np.maximum(latest, 0)], 0) if len(values) else 0
    return {"series_t": times, **totals}
