"""Routers: which replica of a fleet takes a request, as jitted functions over a summary.

Before each routing decision the fleet kernel writes one row per replica into a summary
matrix (f8[N, N_SUMMARY]; columns below, as the fleet contract defines them), then calls
``choose_replica``, which reads only that matrix, the request's own fields and the
router's tables (``RouterState``). A router returns a replica index, or -1 when no
replica may take the request (the fleet queues it). Ties go to the lowest index.

- ``round_robin``: the next eligible replica after the last one chosen (a pointer that
  walks the indices and skips replicas that are not eligible).
- ``least_outstanding``: fewest outstanding requests.
- ``least_kv``: highest Llumnix freeness (free - headroom - head demand) / max(1, running +
  waiting), in KV blocks per request.
- ``cache_aware``: SGLang's router. Its "approximate trees" are sets of prefix entries
  (the trace's dense prefix-block ids, ``policies.prefix_cache.prefix_layout``), one bit per
  replica in ``entry_owners``: a request's entries join the set of the replica it is routed
  to; a failed replica's set is emptied (``forget_replica``); nothing else expires. If
  max - min outstanding > router_balance_abs and max > min x router_balance_rel, the least
  outstanding replica; else, with match_j the leading entries of the request in j's set
  (best: the longest, ties fewer outstanding), the best when best x block_tokens / prompt
  > router_cache_threshold, otherwise the replica with the smallest set among those where
  the request's LoRA adapter loads fastest (adapter affinity: resident first, then in the
  host cache; every replica ties for a base-model request).
- ``unified``: highest score T_saved - router_queue_weight x T_queue - T_transfer - T_risk
  - T_adapter, the terms written by ``fill_unified_terms`` from the replica's own step-time
  tables and T_adapter the seconds loading the request's LoRA adapter would add there.
- ``consistent_hash``: the primary owner of the request's key on the ring of eligible
  replicas (``policies.hashring``), or its secondary when the primary's outstanding >
  hash_overflow_factor x mean outstanding + 1 (mean over eligible replicas). The ring is
  rebuilt whenever the eligible set differs from the one it was built for.
- ``vllm_dp``: vLLM 0.33's data-parallel load balancer (``DPLBAsyncMPClient.
  get_core_engine_for_request``, vllm/v1/engine/core_client.py:1766-1805), with one API
  client: scanning from a start index, score = max(in-flight, waiting + running), plus
  waiting x 6.0 x max(0, kv_cache_usage - 0.5) when waiting > 0; the first replica of
  the scan with the smallest score (strict <) wins; the start index then moves on by one.
  In-flight (this client's requests routed there and not finished) is OUTSTANDING;
  kv_cache_usage = 1 - FREE / CAPACITY, as ``BlockPool.get_usage``
  (vllm/v1/core/block_pool.py:921-932: idle cached blocks are in the free queue, so
  count as free). vLLM scores a coordinator snapshot refreshed every 100 ms and bumps
  the chosen engine's waiting count by one in between (core_client.py:1799); servetune
  reads the exact state, the routed request counted in the inbox. Ineligible replicas
  (down, other pool) are skipped, in the scan and by the start index, which moves to the
  first eligible index at or after it (vLLM drops a removed engine from its list).
- ``total_requests``: SGLang 0.5.23's DP controller (``DPBudget.dispatch``,
  sglang/srt/managers/data_parallel_controller.py:105-160, 912-925): the replica with
  the fewest running + waiting requests, the lowest index on ties.
- ``total_tokens``: the same controller's smallest (num_total_tokens, total_requests),
  the lowest index on ties. ``num_total_tokens`` is the scheduler's load report
  (sglang/srt/managers/scheduler_components/load_inquirer.py:141-147): KV tokens in use
  (capacity - available - evictable, pool_stats_observer.py:235-238) plus ``seqlen``
  (prompt + output so far) of every waiting request; here (CAPACITY - FREE) x block_size
  (SGLang's pool is page-granular, its pages servetune's blocks, and idle cached blocks
  are its evictable ones) + SEQ_TOKENS. The controller reads snapshots and adds 1
  request and the prompt's tokens to the chosen rank in between (:153-154); servetune
  reads the exact state instead (the inbox counts as waiting).

The cache-aware sets are indexed by dense entry id rather than by raw 64-bit hash: ids
are computed once per trace, so a set lookup is one array read, and the table can never
overflow (it has a slot for every distinct hash of the trace).

Per routing decision the fleet kernel: fills OUTSTANDING .. ALIVE and CAPACITY of every
row (ALIVE 0 for replicas that are down or outside the pool being routed to); for
``total_tokens``, fills SEQ_TOKENS; for ``unified``, fills
CACHED_TOKENS and calls ``fill_unified_terms`` for each eligible row; for ``cache_aware``
and ``unified``, fills T_ADAPTER; for
``consistent_hash``, computes ``ring_key``; then calls ``choose_replica``. When replica j
fails it calls ``forget_replica(state, j)``. P/D picks the decode replica with
``choose_decode``; migration ranks replicas by ``migration_freeness``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from costmodels.steptable import step_seconds
from policies import prefix_cache as pcm
from policies.config import KNOB_INDEX, MAX_REPLICAS, ROUTERS
from policies.hashring import build_ring, request_key, ring_lookup

# Summary columns (one row per replica, at routing time; KV in blocks of block_size tokens).
OUTSTANDING = 0  # running + waiting + requests delivered but not yet admitted (inbox)
RUNNING = 1
WAITING = 2  # including the inbox
FREE = 3  # free KV blocks, counting idle cached prefix blocks as free
HEADROOM = 4  # KV blocks kept free (kv_headroom)
HEAD_DEMAND = 5  # blocks(prompt + generated) of the first waiting request, 0 if none
QUEUED_TOKENS = 6  # sum over waiting + inbox of prompt + generated - computed tokens
CACHED_TOKENS = 7  # leading prompt tokens of the request being routed in this replica's prefix cache
ALIVE = 8  # 1 when the replica may take this request (up, and in the pool being routed to), else 0
T_SAVED = 9  # unified: lone-prefill seconds the cached prefix saves
T_QUEUE = 10  # unified: seconds to prefill the queued tokens in full chunks
T_TRANSFER = 11  # unified: seconds to move the request's computed KV here
T_RISK = 12  # unified: lone-prefill seconds scaled by the share of its KV need that does not fit
CAPACITY = 13  # KV blocks of the replica's pool
SEQ_TOKENS = 14  # total_tokens: sum over waiting + inbox of prompt + generated tokens (SGLang seqlen)
T_ADAPTER = 15  # cache_aware, unified: seconds loading the request's LoRA adapter would take here (0: resident)
N_SUMMARY = 16

(ROUND_ROBIN, LEAST_OUTSTANDING, LEAST_KV, CACHE_AWARE, UNIFIED, CONSISTENT_HASH, VLLM_DP, TOTAL_REQUESTS,
 TOTAL_TOKENS) = range(len(ROUTERS))

I_ROUTER = KNOB_INDEX["router"]
I_CACHE_THRESHOLD = KNOB_INDEX["router_cache_threshold"]
I_BALANCE_ABS = KNOB_INDEX["router_balance_abs"]
I_BALANCE_REL = KNOB_INDEX["router_balance_rel"]
I_QUEUE_WEIGHT = KNOB_INDEX["router_queue_weight"]
I_OVERFLOW = KNOB_INDEX["hash_overflow_factor"]
I_PREFIX_BLOCKS = KNOB_INDEX["hash_prefix_blocks"]
I_BY_TENANT = KNOB_INDEX["hash_by_tenant"]
I_INTERCONNECT = KNOB_INDEX["interconnect_gbps"]
I_BLOCK_SIZE = KNOB_INDEX["block_size"]
I_MAX_BATCHED = KNOB_INDEX["max_num_batched_tokens"]

_ONE = np.uint64(1)


class RouterState(NamedTuple):
    """The routers' own mutable tables; build with ``new_router_state``."""

    next_rr: np.ndarray  # i8[1], round_robin: the replica index to try next; vllm_dp: its scan start
    entry_owners: np.ndarray  # u8[U], cache_aware: bit j set when prefix entry e is in replica j's set
    set_size: np.ndarray  # i8[N], cache_aware: entries in each replica's set
    ring_points: np.ndarray  # u8[N * V], consistent_hash: sorted ring points ...
    ring_owners: np.ndarray  # i8[N * V], ... and the replica owning each
    ring_size: np.ndarray  # i8[1], points in use
    ring_members: np.ndarray  # b1[N], the eligible set the ring was built for


def new_router_state(n_replicas: int, n_entries: int, virtual_nodes: int) -> RouterState:
    """Empty tables for ``n_replicas`` replicas over a trace with ``n_entries`` distinct prefix
    hashes (``prefix_layout``), with a ring of ``virtual_nodes`` (hash_virtual_nodes) per replica.

    The cache-aware sets are one bit per replica: with ``router="cache_aware"`` the fleet
    must have at most 64 replicas (``policies.config.check_fleet`` refuses more).
    """
    if not 1 <= n_replicas <= MAX_REPLICAS or n_entries < 0 or virtual_nodes < 1:
        raise ValueError(f"need 1 <= n_replicas <= {MAX_REPLICAS}, n_entries >= 0 and virtual_nodes >= 1, "
                         f"got {n_replicas}, {n_entries}, {virtual_nodes}")
    return RouterState(
        next_rr=np.zeros(1, dtype=np.int64),
        entry_owners=np.zeros(n_entries, dtype=np.uint64),
        set_size=np.zeros(n_replicas, dtype=np.int64),
        ring_points=np.zeros(n_replicas * virtual_nodes, dtype=np.uint64),
        ring_owners=np.full(n_replicas * virtual_nodes, -1, dtype=np.int64),
        ring_size=np.zeros(1, dtype=np.int64),
        ring_members=np.zeros(n_replicas, dtype=np.bool_),
    )


# -- the decision ---------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def choose_replica(cfg, summary, state, entries, block_tokens, prompt_tokens, key):
    """The replica the configured router sends a request to, or -1 if none is eligible.

    ``cfg`` is the PolicyConfig vector; ``entries`` the request's prefix entry ids in prompt
    order (cache_aware); ``block_tokens`` the trace's tokens per hash block; ``key`` its ring
    key (consistent_hash, ``ring_key``; any value otherwise). Round robin advances its
    pointer and cache_aware adds the request's entries to the chosen replica's set.
    """
    router = int(cfg[I_ROUTER])
    if router == ROUND_ROBIN:
        return _round_robin(summary, state)
    if router == LEAST_OUTSTANDING:
        return least_outstanding(summary)
    if router == LEAST_KV:
        return _most_free(summary)
    if router == CACHE_AWARE:
        return _cache_aware(cfg, summary, state, entries, block_tokens, prompt_tokens)
    if router == UNIFIED:
        return _best_unified(summary, cfg[I_QUEUE_WEIGHT])
    if router == VLLM_DP:
        return _vllm_dp(summary, state)
    if router == TOTAL_REQUESTS:
        return _total_requests(summary)
    if router == TOTAL_TOKENS:
        return _total_tokens(summary, int(cfg[I_BLOCK_SIZE]))
    return _consistent_hash(cfg, summary, state, key)


@njit(cache=True, nogil=True)
def choose_decode(summary, promised, need_blocks):
    """P/D: the decode replica that promises ``need_blocks`` KV blocks, or -1 if none can.

    A replica can when promised + need <= free - headroom; among those, the highest
    freeness counting its promises, (free - headroom - head demand - promised) /
    max(1, running + waiting). ``promised`` holds blocks promised and not yet delivered.
    """
    best = -1
    best_free = 0.0
    for d in range(summary.shape[0]):
        if summary[d, ALIVE] <= 0:
            continue
        room = summary[d, FREE] - summary[d, HEADROOM]
        if promised[d] + need_blocks > room:
            continue
        free = (room - summary[d, HEAD_DEMAND] - promised[d]) / max(1.0, summary[d, RUNNING] + summary[d, WAITING])
        if best < 0 or free > best_free:
            best, best_free = d, free
    return best


# -- load measures --------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def kv_freeness(summary, j):
    """least_kv's (Llumnix dispatch) freeness: spare KV blocks per request on replica j."""
    spare = summary[j, FREE] - summary[j, HEADROOM] - summary[j, HEAD_DEMAND]
    return spare / max(1.0, summary[j, RUNNING] + summary[j, WAITING])


@njit(cache=True, nogil=True)
def migration_freeness(summary, j):
    """Migration's freeness: as ``kv_freeness`` but the queue counts as one request (Llumnix)."""
    spare = summary[j, FREE] - summary[j, HEADROOM] - summary[j, HEAD_DEMAND]
    return spare / max(1.0, summary[j, RUNNING] + (1.0 if summary[j, WAITING] > 0 else 0.0))


@njit(cache=True, nogil=True)
def least_outstanding(summary):
    """The eligible replica with the fewest outstanding requests, or -1."""
    best = -1
    for j in range(summary.shape[0]):
        if summary[j, ALIVE] > 0 and (best < 0 or summary[j, OUTSTANDING] < summary[best, OUTSTANDING]):
            best = j
    return best


@njit(cache=True, nogil=True)
def _round_robin(summary, state):
    n = summary.shape[0]
    start = state.next_rr[0]
    for step in range(n):
        j = (start + step) % n
        if summary[j, ALIVE] > 0:
            state.next_rr[0] = (j + 1) % n
            return j
    return -1


@njit(cache=True, nogil=True)
def _most_free(summary):
    best = -1
    best_free = 0.0
    for j in range(summary.shape[0]):
        if summary[j, ALIVE] > 0:
            free = kv_freeness(summary, j)
            if best < 0 or free > best_free:
                best, best_free = j, free
    return best


# -- the engines' own data-parallel balancers -----------------------------------------------
@njit(cache=True, nogil=True)
def kv_usage(summary, j):
    """vLLM's kv_cache_usage of replica j: 1 - free / total blocks (0 for an empty pool)."""
    if summary[j, CAPACITY] <= 0:
        return 0.0
    return 1.0 - summary[j, FREE] / summary[j, CAPACITY]


@njit(cache=True, nogil=True)
def _vllm_dp(summary, state):
    """vllm/v1/engine/core_client.py:1766-1805, one client (client_count 1, start index 0)."""
    n = summary.shape[0]
    start = -1
    for step in range(n):  # the first eligible index at or after the start index
        j = (state.next_rr[0] + step) % n
        if summary[j, ALIVE] > 0:
            start = j
            break
    if start < 0:
        return -1
    best = -1
    best_score = 0.0
    for step in range(n):
        j = (start + step) % n
        if summary[j, ALIVE] <= 0:
            continue
        waiting = summary[j, WAITING]
        score = max(summary[j, OUTSTANDING], waiting + summary[j, RUNNING])
        if waiting > 0:
            score += waiting * 6.0 * max(0.0, kv_usage(summary, j) - 0.5)
        if best < 0 or score < best_score:
            best, best_score = j, score
    state.next_rr[0] = (start + 1) % n
    return best


@njit(cache=True, nogil=True)
def _total_requests(summary):
    """SGLang DPBudget.dispatch TOTAL_REQUESTS: min running + waiting, first index on ties."""
    best = -1
    for j in range(summary.shape[0]):
        if summary[j, ALIVE] > 0 and (best < 0 or summary[j, RUNNING] + summary[j, WAITING]
                                      < summary[best, RUNNING] + summary[best, WAITING]):
            best = j
    return best


@njit(cache=True, nogil=True)
def total_tokens(summary, j, block_size):
    """SGLang's num_total_tokens of replica j: KV tokens in use + seqlen of its waiting requests."""
    return (summary[j, CAPACITY] - summary[j, FREE]) * block_size + summary[j, SEQ_TOKENS]


@njit(cache=True, nogil=True)
def _total_tokens(summary, block_size):
    """SGLang DPBudget.dispatch TOTAL_TOKENS: min (total tokens, total requests), first index on ties."""
    best = -1
    best_tokens = 0.0
    best_requests = 0.0
    for j in range(summary.shape[0]):
        if summary[j, ALIVE] <= 0:
            continue
        tokens = total_tokens(summary, j, block_size)
        requests = summary[j, RUNNING] + summary[j, WAITING]
        if best < 0 or tokens < best_tokens or (tokens == best_tokens and requests < best_requests):
            best, best_tokens, best_requests = j, tokens, requests
    return best


# -- cache_aware ----------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _cache_aware(cfg, summary, state, entries, block_tokens, prompt_tokens):
    low = np.inf
    high = -np.inf
    for j in range(summary.shape[0]):
        if summary[j, ALIVE] > 0:
            low = min(low, summary[j, OUTSTANDING])
            high = max(high, summary[j, OUTSTANDING])
    if high < low:
        return -1
    if high - low > cfg[I_BALANCE_ABS] and high > low * cfg[I_BALANCE_REL]:
        chosen = least_outstanding(summary)
    else:
        best = -1
        best_match = -1
        for j in range(summary.shape[0]):
            if summary[j, ALIVE] <= 0:
                continue
            m = matched_entries(state, entries, j)
            if m > best_match or (m == best_match and summary[j, OUTSTANDING] < summary[best, OUTSTANDING]):
                best, best_match = j, m
        rate = best_match * block_tokens / prompt_tokens if prompt_tokens > 0 else 0.0
        chosen = best if rate > cfg[I_CACHE_THRESHOLD] else _smallest_set(summary, state, _fastest_adapter(summary))
    remember(state, entries, chosen)
    return chosen


@njit(cache=True, nogil=True)
def matched_entries(state, entries, j):
    """Leading entries of a request (its prefix entry ids in order) in replica j's set."""
    bit = _ONE << np.uint64(j)
    k = 0
    while k < len(entries) and state.entry_owners[entries[k]] & bit:
        k += 1
    return k


@njit(cache=True, nogil=True)
def remember(state, entries, j):
    """Add a request's prefix entries to replica j's set."""
    bit = _ONE << np.uint64(j)
    for e in entries:
        if not state.entry_owners[e] & bit:
            state.entry_owners[e] |= bit
            state.set_size[j] += 1


@njit(cache=True, nogil=True)
def forget_replica(state, j):
    """Empty replica j's set (it failed: its cache is gone)."""
    if state.set_size[j] == 0:
        return
    keep = ~(_ONE << np.uint64(j))
    for e in range(len(state.entry_owners)):
        state.entry_owners[e] &= keep
    state.set_size[j] = 0


@njit(cache=True, nogil=True)
def _fastest_adapter(summary):
    """The shortest adapter load (T_ADAPTER) over the eligible replicas."""
    fastest = np.inf
    for j in range(summary.shape[0]):
        if summary[j, ALIVE] > 0:
            fastest = min(fastest, summary[j, T_ADAPTER])
    return fastest


@njit(cache=True, nogil=True)
def _smallest_set(summary, state, adapter_s):
    """The eligible replica with the smallest set among those whose adapter load takes
    ``adapter_s``."""
    best = -1
    for j in range(summary.shape[0]):
        if (summary[j, ALIVE] > 0 and summary[j, T_ADAPTER] <= adapter_s
                and (best < 0 or state.set_size[j] < state.set_size[best])):
            best = j
    return best


# -- unified --------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def lone_prefill_s(tables, new_tokens, context_tokens):
    """Seconds of a step prefilling ``new_tokens`` alone on top of ``context_tokens`` cached."""
    pairs = new_tokens * context_tokens + new_tokens * (new_tokens + 1) // 2
    seconds, _ = step_seconds(tables, new_tokens, 1, 0, 0, pairs)  # a routing estimate: range not flagged
    return seconds


@njit(cache=True, nogil=True)
def queue_wait_s(tables, queued_tokens, max_batched):
    """T_queue: the queued tokens prefilled in full chunks of ``max_batched`` tokens."""
    if queued_tokens <= 0:
        return 0.0
    return queued_tokens / max_batched * lone_prefill_s(tables, max_batched, 0)


@njit(cache=True, nogil=True)
def transfer_s(tokens, kv_bytes_per_token, interconnect_gbps):
    """T_transfer: seconds to move ``tokens`` of KV (per-GPU bytes, each GPU on its own link)."""
    return tokens * kv_bytes_per_token / (interconnect_gbps * 1e9)


@njit(cache=True, nogil=True)
def risk_s(prefill_s, need_blocks, available_blocks):
    """T_risk: ``prefill_s`` scaled by the share of the KV need that the replica cannot hold."""
    if need_blocks <= 0:
        return 0.0
    return prefill_s * max(0.0, need_blocks - available_blocks) / need_blocks


@njit(cache=True, nogil=True)
def fill_unified_terms(summary, j, tables, kv_bytes_per_token, cfg, prompt_tokens, max_out, moved_tokens):
    """Write replica j's unified terms from its row (FREE, HEADROOM, QUEUED_TOKENS, CACHED_TOKENS).

    ``tables``/``kv_bytes_per_token`` are replica j's; ``prompt_tokens`` the tokens the
    request would prefill there, ``max_out`` its output cap, ``moved_tokens`` its computed
    tokens whose KV must move to j (0 for a fresh request).
    """
    block_size = int(cfg[I_BLOCK_SIZE])
    cached = int(summary[j, CACHED_TOKENS])
    queued = int(summary[j, QUEUED_TOKENS])
    whole = lone_prefill_s(tables, prompt_tokens, 0)
    need = pcm.kv_blocks(prompt_tokens + max_out, block_size)
    available = summary[j, FREE] - summary[j, HEADROOM] - pcm.kv_blocks(queued, block_size)
    summary[j, T_SAVED] = whole - lone_prefill_s(tables, prompt_tokens - cached, cached)
    summary[j, T_QUEUE] = queue_wait_s(tables, queued, int(cfg[I_MAX_BATCHED]))
    summary[j, T_TRANSFER] = transfer_s(moved_tokens, kv_bytes_per_token, cfg[I_INTERCONNECT])
    summary[j, T_RISK] = risk_s(whole, need, available)


@njit(cache=True, nogil=True)
def unified_score(summary, j, queue_weight):
    return (summary[j, T_SAVED] - queue_weight * summary[j, T_QUEUE] - summary[j, T_TRANSFER] - summary[j, T_RISK]
            - summary[j, T_ADAPTER])


@njit(cache=True, nogil=True)
def _best_unified(summary, queue_weight):
    best = -1
    best_score = 0.0
    for j in range(summary.shape[0]):
        if summary[j, ALIVE] > 0:
            score = unified_score(summary, j, queue_weight)
            # equal scores (idle queues, nothing cached): the less loaded replica
            if (best < 0 or score > best_score
                    or (score == best_score and summary[j, OUTSTANDING] < summary[best, OUTSTANDING])):
                best, best_score = j, score
    return best


# -- consistent_hash ------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def ring_key(cfg, block_hashes, start, end, request, tenant):
    """The consistent-hash key of request ``request`` (its block hashes are ``block_hashes[start:end]``)."""
    return request_key(block_hashes, start, end, request, tenant, int(cfg[I_PREFIX_BLOCKS]), cfg[I_BY_TENANT] > 0)


@njit(cache=True, nogil=True)
def _consistent_hash(cfg, summary, state, key):
    _sync_ring(summary, state)
    primary, secondary = ring_lookup(state.ring_points, state.ring_owners, state.ring_size[0], key)
    if primary < 0:
        return -1
    total = 0.0
    count = 0
    for j in range(summary.shape[0]):
        if summary[j, ALIVE] > 0:
            total += summary[j, OUTSTANDING]
            count += 1
    if secondary >= 0 and summary[primary, OUTSTANDING] > cfg[I_OVERFLOW] * (total / count) + 1.0:
        return secondary
    return primary


@njit(cache=True, nogil=True)
def _sync_ring(summary, state):
    """Rebuild the ring when the eligible set changed since it was built."""
    members = state.ring_members
    virtual_nodes = len(state.ring_points) // len(members)  # as sized by new_router_state
    same = state.ring_size[0] > 0
    for j in range(summary.shape[0]):
        if (summary[j, ALIVE] > 0) != members[j]:
            same = False
            members[j] = summary[j, ALIVE] > 0
    if not same:
        state.ring_size[0] = build_ring(members, virtual_nodes, state.ring_points, state.ring_owners)
