"""SimResult: what one simulated run did to every request, plus run counters.

Every request ends in exactly one ``State``; a rejected one carries a ``Reject`` reason.
Times are seconds on the trace clock; NaN where the event never happened.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

#: Step-time histogram (``SimResult.step_time_hist``): log-spaced bins, STEP_HIST_PER_DECADE
#: per decade from STEP_HIST_MIN_S over STEP_HIST_DECADES decades, with an underflow bin
#: (0) below the range and an overflow bin (last) above it. Bin k in 1..STEP_HIST_BINS-2
#: holds times in [MIN * 10**((k-1)/PER_DECADE), MIN * 10**(k/PER_DECADE)).
STEP_HIST_MIN_S = 1e-5
STEP_HIST_PER_DECADE = 64
STEP_HIST_DECADES = 7
STEP_HIST_BINS = STEP_HIST_DECADES * STEP_HIST_PER_DECADE + 2


class State(IntEnum):
    FINISHED = 0
    REJECTED = 1
    TIMED_OUT = 2  # deadline passed after the first token: the client left mid-stream
    CANCELLED = 3  # deadline passed before the first token: the client left while waiting
    FAILED = 4  # lost to a worker failure with nowhere to go


class Reject(IntEnum):
    NONE = 0
    KV_HIGH_WATER = 1
    QUEUE_FULL = 2
    MAX_WAIT = 3
    DEADLINE_UNMEETABLE = 4
    EXCEEDS_CAPACITY = 5
    MAX_PREEMPTIONS = 6


@dataclass(frozen=True, eq=False)
class SimResult:
    """Per-request outcome arrays (length n) and run-level counters."""

    state: np.ndarray  # i1, State
    reject_reason: np.ndarray  # i1, Reject
    first_token_s: np.ndarray  # f8
    finish_s: np.ndarray  # f8, end time whatever the state (NaN if never ended)
    tokens_generated: np.ndarray  # i8
    preemptions: np.ndarray  # i4
    cached_prompt_tokens: np.ndarray  # i8, prompt tokens served from the prefix cache
    queue_s: np.ndarray  # f8, arrival to first scheduled (NaN if never scheduled)
    replica: np.ndarray  # i4, replica that finished the request (-1 if none)
    # run counters
    steps: int
    busy_s: float  # sum of step times
    prefill_tokens_computed: int  # including recompute after preemption
    out_of_range_steps: int  # steps whose time came from extrapolated tables
    kv_capacity_blocks: int
    kv_peak_blocks: int
    # sampled series (one row per sample): time, KV blocks used, running, waiting
    series_t: np.ndarray
    series_kv_blocks: np.ndarray
    series_running: np.ndarray
    series_waiting: np.ndarray
    # added after the first contract; defaults keep hand-built results valid
    swap_outs: int = 0  # preemptions that copied KV to host instead of recomputing
    end_s: float = float("nan")  # clock when the last request ended
    # sharing (issue 6): prefix cache and per-tenant charged service
    tenant_service: np.ndarray = field(default_factory=lambda: np.zeros(0))  # f8[tenants], fairness_cost_unit
    tenant_weight: np.ndarray = field(default_factory=lambda: np.zeros(0))  # f8[tenants], fair-share weights
    prefix_hit_tokens: int = 0  # prompt tokens served from the cache over every lookup (readmissions too)
    prefix_query_tokens: int = 0  # prompt tokens looked up
    prefill_time_saved_s: float = 0.0  # lone-prefill time of the cached tokens, summed over hits
    prefix_evictions: int = 0  # cached hash blocks evicted
    # speculative decoding (issue 7)
    spec_decodes: int = 0  # decode slots of steps that could speculate (request-steps)
    spec_verifies: int = 0  # of those, slots that verified at least one draft token
    spec_drafted_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # draft tokens accepted and kept (the rest were wasted)
    # step times (issue 16): steps per bin of the log-spaced histogram above, summed over
    # replicas; empty for a hand-built result
    step_time_hist: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # i8[STEP_HIST_BINS]
    # activation workspace (issue 16 part 2): the most tokens one step computed (the max over
    # replicas) and the start of the first step that computed that many (NaN: no step)
    peak_step_tokens: int = 0
    peak_step_s: float = float("nan")

    # LoRA adapters (issue 16 part 1): loads onto a GPU, those read from disk first, and the
    # seconds they added to steps (every request of such a step waited for them)
    adapter_loads: int = 0
    adapter_disk_loads: int = 0
    adapter_load_s: float = 0.0
    # fleet (issue 8); empty arrays for a single-replica run. Per request (length n): times
    # withdrawn from a failed replica and routed again; tokens whose KV a failure destroyed
    # and that were computed again.
    reroutes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # i4
    reprefill_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # i8
    # Per failure window of the schedule the run used (inf = never back up):
    failure_replica: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # i4
    failure_down_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # f8
    failure_up_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # f8
    # Per replica (length R): deliveries to it (arrivals, re-routes, migrations, handoffs),
    # prefix-cache lookups on it (as prefix_hit_tokens / prefix_query_tokens), KV high-water.
    replica_routed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    replica_prefix_hit_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    replica_prefix_query_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    replica_kv_peak_blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    replica_kv_capacity_blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    migrations: int = 0  # running requests moved with their KV to another replica (Llumnix)
    handoffs: int = 0  # P/D: requests sent from a prefill replica to a decode replica

    @property
    def n(self) -> int:
        return len(self.state)


def step_time_bin_values() -> np.ndarray:
    """One representative time (s) per histogram bin: the geometric middle of an inner bin,
    whose times are within a factor 10**(1/(2*STEP_HIST_PER_DECADE)) of it (1.8%); the
    range's lower end for the underflow bin and its upper end for the overflow bin."""
    k = np.arange(STEP_HIST_BINS, dtype=np.float64)
    values = STEP_HIST_MIN_S * 10.0 ** ((k - 0.5) / STEP_HIST_PER_DECADE)
    values[0] = STEP_HIST_MIN_S
    values[-1] = STEP_HIST_MIN_S * 10.0 ** STEP_HIST_DECADES
    return values


#: Relative error bound of a time read from an inner bin (see ``step_time_bin_values``).
STEP_HIST_REL_ERROR = 10.0 ** (1.0 / (2 * STEP_HIST_PER_DECADE)) - 1.0
STEP_HIST_LOG_MIN = math.log10(STEP_HIST_MIN_S)


def step_time_bin(dt: float) -> int:
    """The histogram bin of a step of dt seconds, by the definition above (the kernels
    count a step by ``STEP_HIST_EDGES``, which this defines)."""
    if not dt >= STEP_HIST_MIN_S:
        return 0
    return min(1 + int((math.log10(dt) - STEP_HIST_LOG_MIN) * STEP_HIST_PER_DECADE), STEP_HIST_BINS - 1)


def _bin_edges() -> np.ndarray:
    """The shortest step time of each bin from 1 on, exactly as ``step_time_bin`` rounds (a
    neighbour of the analytic edge when log10 rounds across it): a step's bin is the number
    of edges at or below its time, a search instead of a logarithm at every step."""
    edges = np.empty(STEP_HIST_BINS - 1)
    for k in range(1, STEP_HIST_BINS):
        x = STEP_HIST_MIN_S * 10.0 ** ((k - 1) / STEP_HIST_PER_DECADE)
        while step_time_bin(x) < k:
            x = math.nextafter(x, math.inf)
        while step_time_bin(math.nextafter(x, 0.0)) >= k:
            x = math.nextafter(x, 0.0)
        edges[k - 1] = x
    return edges


STEP_HIST_EDGES = _bin_edges()
