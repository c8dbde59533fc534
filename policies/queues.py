"""Waiting-queue orders as jitted pure functions over a preallocated indexed heap.

The waiting queue is split into *lanes*, each an indexed binary min-heap on a static key
``(key1, key2, request)``; a request sits in one lane (``lane_of``), fixed per trace. One
lane serves the plain orders; per-tenant lanes (VTC, tenant quotas) and per-class lanes
(class budgets) let the scheduler skip a whole tenant or class that is at its limit in
O(1) instead of popping its requests one by one. ``pick`` compares the lane heads.

Orders (``scheduling_policy``; codes are the knob's choice indices):
- ``fcfs``: enqueue order; ``seq`` grows on arrival and shrinks on preemption, so a
  preempted request goes back to the front (vLLM ``prepend_request``).
- ``priority``: larger ``trace.priority`` first, then arrival (vLLM's heap, with the
  project's larger-is-more-urgent convention). Ageing: effective priority rises by
  ``aging_rate`` per second waited, ``p + r*(now - arrival)``; the order between two
  waiting requests does not depend on ``now``, so the static key ``-p + r*arrival`` is
  exact and the heap stays valid as time passes.
- ``edf``: earliest absolute deadline first; requests without one follow, by arrival.
  Requests whose deadline is already unmeetable are rejected (``deadline_unmeetable``,
  SCORPIO-style margin) by the engine when they reach the head.
- ``sjf``: shortest predicted job first (``job_s``, the engine's estimate from prompt
  and ``max_tokens``; never the true output length); ageing as for priority.
- ``lpm``: longest cached prefix first, ties by enqueue order; past ``LPM_FCFS_ABOVE``
  waiting requests it falls back to FCFS, as SGLang does.
- ``vtc``: the lane of the backlogged tenant with the smallest virtual counter, FIFO
  within a tenant (``policies.fairness`` keeps the counters).
- ``lof``: longest output first, SGLang 0.5.23's ``lof``
  (sglang/srt/managers/schedule_policy.py:504-519, ``_sort_by_longest_output``): the
  largest output cap first, ties in enqueue order (a stable sort of the queue). The cap
  is ``max_new_tokens`` as SGLang's scheduler clamps it (``init_req_max_new_tokens``,
  sglang/srt/managers/scheduler.py:2693-2716: at most max_req_len - prompt), i.e. the
  engine's ``max_out = min(max_tokens, max_len - prompt)``; never the true output
  length. SGLang's priority-first variant (``enable_priority_scheduling``, off by
  default) is not modelled.
- ``dfs_weight``: SGLang 0.5.23's ``dfs-weight`` (a cache-aware policy): the tree is the
  prefix cache's hash-block chains (a hash names its whole prefix); each waiting request
  sits at the deepest cached block of its chain (``prefix_cache.match``'s entries, the
  node SGLang's ``match_prefix`` leaves in ``req.last_node``, schedule_policy.py:346-356,
  mem_cache/common.py:221-259: the key is not capped at prompt - 1), the root if none;
  a node's weight counts the waiting requests in its subtree. Order (``dfs_rekey``, the
  twin of ``_dfs_weight_order``, mem_cache/base_prefix_cache.py:347-387, called by
  ``_sort_by_dfs_weight``, schedule_policy.py:496-502): depth first from the root,
  children by descending weight, ties in the order the parent gained them (a stable
  sort of ``node.children``, an insertion-ordered dict: here the entry's creation stamp
  ``E_BORN``), and a node's own requests *after* its subtrees (post-order: the deepest
  match first, unmatched requests last), among themselves in queue order. SGLang sorts
  its queue in place once per scheduling round (``calc_priority``, schedule_policy.py:213-246;
  scheduler.py:4129); the engine calls
  ``dfs_rekey`` at the start of each admission round, which writes each waiting
  request's position into its key1, so the order stays fixed through the round (as
  SGLang admits down its sorted list), and "queue order" within a node is the previous
  round's order, arrivals since after it (key1 0 > any position), preempted ones
  before those (key2 < 0). No FCFS fallback past 128 waiting (SGLang applies it to lpm
  and hrrn only, schedule_policy.py:304-315); with the prefix cache off the engine
  never re-keys and the order is fcfs (``_validate_and_adjust_policy``, :324-338). A
  promoted request (admit first) keeps key1 ``FRONT``, ahead of the order. Re-keying
  happens only in a round that may admit (SGLang returns before ``calc_priority`` when
  the batch is full, scheduler.py:4120-4133).

A key is fixed when a request is pushed; ``promote`` re-keys one to the very front
(hard max wait with "admit first").
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from costmodels.steptable import step_seconds
from policies import prefix_cache

FCFS, PRIORITY, EDF, SJF, LPM, VTC, LOF, DFS_WEIGHT = 0, 1, 2, 3, 4, 5, 6, 7
QUEUE_ORDERS = ("fcfs", "priority", "edf", "sjf", "lpm", "vtc", "lof", "dfs_weight")
LPM_FCFS_ABOVE = 128  # SGLang: cache-aware orders fall back to FCFS past this many waiting
FRONT = -np.inf  # key1 of a promoted request


# rows of WaitQueue.keys and WaitQueue.slots (per heap slot / per request) and lanes (per lane)
K1, K2 = 0, 1  # keys[K*, slot]: the static heap key of the request in that slot
SLOT_REQ = 0  # slots[SLOT_REQ, slot]: request in the slot, -1 if empty
POS = 1  # slots[POS, request]: its slot, -1 if not queued
L_BASE, L_SIZE, L_TENANT, L_BLOCKED = 0, 1, 2, 3  # lanes[L_*, lane]; L_BLOCKED: 1 = skip this round
N_LANE_ROWS = 4


class WaitQueue(NamedTuple):
    """Lanes of indexed heaps in field-major matrices (few arrays keep kernel calls cheap).
    Heap slots of lane l are ``[lanes[L_BASE, l], + lanes[L_SIZE, l])``."""

    keys: np.ndarray  # f8[2, n]
    slots: np.ndarray  # i8[2, n]
    lane_of: np.ndarray  # i8[n], read-only
    lanes: np.ndarray  # i8[N_LANE_ROWS, L]

    # Python-side views by name (tests, inspection)
    pos = property(lambda self: self.slots[POS])
    total = property(lambda self: np.array([self.lanes[L_SIZE].sum()]))


def new_wait_queue(lane_of: np.ndarray, lane_tenant: np.ndarray) -> WaitQueue:
    """An empty queue; each lane gets room for every request mapped to it."""
    lane_of = np.ascontiguousarray(lane_of, dtype=np.int64)
    lane_tenant = np.ascontiguousarray(lane_tenant, dtype=np.int64)
    if len(lane_of) and (lane_of.min() < 0 or lane_of.max() >= len(lane_tenant)):
        raise ValueError(f"lane_of must index {len(lane_tenant)} lanes")
    return empty_wait_queue(lane_of, lane_tenant)


@njit(cache=True, nogil=True, _nrt=True)
def empty_wait_queue(lane_of, lane_tenant):
    q = WaitQueue(np.empty((2, lane_of.shape[0])), np.empty((2, lane_of.shape[0]), dtype=np.int64), lane_of,
                  np.empty((N_LANE_ROWS, lane_tenant.shape[0]), dtype=np.int64))
    clear(q, lane_tenant)
    return q


@njit(cache=True, nogil=True, _nrt=True)
def clear(q, lane_tenant):
    """Empty the queue in place; each lane gets room for every request mapped to it."""
    q.keys[:] = 0.0
    q.slots[:] = -1
    lanes = q.lanes
    lanes[:] = 0
    base = lanes[L_BASE]
    n_lanes = lanes.shape[1]
    for i in range(q.lane_of.shape[0]):
        if q.lane_of[i] + 1 < n_lanes:
            base[q.lane_of[i] + 1] += 1
    for lane in range(1, n_lanes):
        base[lane] += base[lane - 1]
    lanes[L_TENANT] = lane_tenant


@njit(cache=True, nogil=True, _nrt=False)
def queued(q):
    """Requests queued over all lanes."""
    return q.lanes[L_SIZE].sum()


def lanes(tenant: np.ndarray, slo_class: np.ndarray, n_tenants: int, n_classes: int,
          by_tenant: bool, by_class: bool) -> tuple[np.ndarray, np.ndarray]:
    """Lane of each request and tenant of each lane: (tenant, class) pairs as asked."""
    t = np.asarray(tenant, dtype=np.int64) if by_tenant else np.zeros(len(tenant), dtype=np.int64)
    c = np.asarray(slo_class, dtype=np.int64) if by_class else np.zeros(len(tenant), dtype=np.int64)
    nt = n_tenants if by_tenant else 1
    nc = n_classes if by_class else 1
    lane_tenant = np.repeat(np.arange(nt, dtype=np.int64), nc)
    return t * nc + c, lane_tenant


# -- keys ----------------------------------------------------------------------------------
@njit(cache=True, nogil=True, _nrt=False)
def order_keys(order, seq, arrival, priority, deadline, job_s, aging_rate, max_out=0):
    """Static heap key (key1, key2) of a request under a queue order; smaller goes first.
    ``max_out``: the request's output cap (lof only)."""
    if order == LOF:
        return -float(max_out), float(seq)  # SGLang sorts by -max_new_tokens, stable
    if order == PRIORITY:
        return -priority + aging_rate * arrival, arrival
    if order == EDF:
        return (np.inf, arrival) if np.isnan(deadline) else (deadline, arrival)
    if order == SJF:
        return job_s + aging_rate * arrival, arrival
    return 0.0, float(seq)  # fcfs, lpm, vtc and dfs_weight (until ``dfs_rekey``): enqueue order


@njit(cache=True, nogil=True, _nrt=False)
def deadline_unmeetable(now, deadline, min_service_s, margin_s):
    """True when even an immediate, uncontended run would finish past the deadline."""
    return not np.isnan(deadline) and now + min_service_s + margin_s > deadline


@njit(cache=True, _nrt=True)
def service_estimates(tables, prompt_tokens, max_tokens):
    """Per request: a lower bound on its completion time, and its predicted job length.

    The bound is one unchunked prefill step of the whole prompt alone (it yields the
    first token; the true output length is unknown, so no decode is counted). The job
    adds ``max_tokens - 1`` lone decode steps over the prompt's context: the scheduler
    knows the cap, never the true output length.
    """
    n = prompt_tokens.shape[0]
    min_service_s = np.empty(n)
    job_s = np.empty(n)
    for i in range(n):
        p = prompt_tokens[i]
        prefill = step_seconds(tables, p, 1, 0, 0, p * (p + 1) / 2.0)[0]
        decode = step_seconds(tables, 1, 1, 1, p, 0.0)[0]
        min_service_s[i] = prefill
        job_s[i] = prefill + (max_tokens[i] - 1) * decode
    return min_service_s, job_s


# -- heap ------------------------------------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def _before(q, a, b):
    k = q.keys
    if k[K1, a] != k[K1, b]:
        return k[K1, a] < k[K1, b]
    if k[K2, a] != k[K2, b]:
        return k[K2, a] < k[K2, b]
    return q.slots[SLOT_REQ, a] < q.slots[SLOT_REQ, b]


@njit(cache=True, nogil=True, inline="always")
def _swap(q, a, b):
    k = q.keys
    sl = q.slots
    k1, k2, r = k[K1, a], k[K2, a], sl[SLOT_REQ, a]
    k[K1, a], k[K2, a], sl[SLOT_REQ, a] = k[K1, b], k[K2, b], sl[SLOT_REQ, b]
    k[K1, b], k[K2, b], sl[SLOT_REQ, b] = k1, k2, r
    sl[POS, sl[SLOT_REQ, a]] = a
    sl[POS, sl[SLOT_REQ, b]] = b


@njit(cache=True, nogil=True, _nrt=False)
def _sift_up(q, base, s):
    while s > base:
        parent = base + (s - base - 1) // 2
        if not _before(q, s, parent):
            break
        _swap(q, s, parent)
        s = parent


@njit(cache=True, nogil=True, _nrt=False)
def _sift_down(q, base, size, s):
    while True:
        child = base + 2 * (s - base) + 1
        if child >= base + size:
            break
        if child + 1 < base + size and _before(q, child + 1, child):
            child += 1
        if not _before(q, child, s):
            break
        _swap(q, s, child)
        s = child


@njit(cache=True, nogil=True, _nrt=False)
def push(q, i, key1, key2):
    """Queue request i (not already queued) with its key."""
    lane = q.lane_of[i]
    base = q.lanes[L_BASE, lane]
    s = base + q.lanes[L_SIZE, lane]
    q.keys[K1, s], q.keys[K2, s], q.slots[SLOT_REQ, s] = key1, key2, i
    q.slots[POS, i] = s
    q.lanes[L_SIZE, lane] += 1
    _sift_up(q, base, s)


@njit(cache=True, nogil=True, _nrt=False)
def remove(q, i):
    """Take request i out of the queue (admitted, rejected, cancelled); no-op if absent."""
    s = q.slots[POS, i]
    if s < 0:
        return
    lane = q.lane_of[i]
    base = q.lanes[L_BASE, lane]
    last = base + q.lanes[L_SIZE, lane] - 1
    if s != last:
        _swap(q, s, last)
    q.slots[POS, i] = -1
    q.slots[SLOT_REQ, last] = -1
    q.lanes[L_SIZE, lane] -= 1
    if s != last:
        _sift_down(q, base, q.lanes[L_SIZE, lane], s)
        _sift_up(q, base, s)


@njit(cache=True, nogil=True, _nrt=False)
def promote(q, i):
    """Move a queued request ahead of every unpromoted one (hard max wait, admit first)."""
    key2 = q.keys[K2, q.slots[POS, i]]
    remove(q, i)
    push(q, i, FRONT, key2)


@njit(cache=True, nogil=True, inline="always")
def top(q, lane):
    """Head request of a lane, -1 if empty."""
    if q.lanes[L_SIZE, lane] == 0:
        return -1
    return q.slots[SLOT_REQ, q.lanes[L_BASE, lane]]


@njit(cache=True, nogil=True, _nrt=False)
def _lpm_head(q, lane, pc, block_offsets, prompt_tokens):
    """Lane member with the longest cached prefix (ties: heap order); and its tokens."""
    best = -1
    best_tokens = -1
    base = q.lanes[L_BASE, lane]
    for s in range(base, base + q.lanes[L_SIZE, lane]):
        r = q.slots[SLOT_REQ, s]
        tokens = prefix_cache.match(pc, block_offsets, prompt_tokens, r, prompt_tokens[r])[1]
        if best < 0 or tokens > best_tokens or (tokens == best_tokens and _before(q, s, best)):
            best, best_tokens = s, tokens
    return q.slots[SLOT_REQ, best], best_tokens


@njit(cache=True, nogil=True, _nrt=False)
def pick(q, order, lane_blocked, vtc_counter, pc, block_offsets, prompt_tokens):
    """Request to try next under ``order``, skipping blocked lanes; -1 if none.

    Compares lane heads by (VTC counter of the lane's tenant,) key1, key2, request; under
    LPM with at most LPM_FCFS_ABOVE waiting, by longest cached prefix first.
    """
    lanes = q.lanes
    cache_aware = order == LPM and queued(q) <= LPM_FCFS_ABOVE
    best = -1
    best_counter = 0.0
    best_tokens = 0
    for lane in range(lanes.shape[1]):
        if lanes[L_SIZE, lane] == 0 or lane_blocked[lane]:
            continue
        tokens = 0
        if cache_aware:
            i, tokens = _lpm_head(q, lane, pc, block_offsets, prompt_tokens)
        else:
            i = q.slots[SLOT_REQ, lanes[L_BASE, lane]]
        counter = vtc_counter[lanes[L_TENANT, lane]] if order == VTC else 0.0
        if best >= 0:
            if counter != best_counter:
                if counter > best_counter:
                    continue
            elif tokens != best_tokens:
                if tokens < best_tokens:
                    continue
            elif not _before(q, q.slots[POS, i], q.slots[POS, best]):
                continue
        best, best_counter, best_tokens = i, counter, tokens
    return best


@njit(cache=True, nogil=True, _nrt=True)
def dfs_rekey(q, pc, block_offsets, prompt_tokens):
    """Rewrite every queued request's key1 to its position in SGLang's dfs-weight order
    (``position - queued``, so all precede key1 0, the key of later arrivals), keeping
    key2, and rebuild the lane heaps; a promoted request (key1 ``FRONT``, hard max wait
    with admit first) keeps its key, ahead of the order. See the module docstring.

    As a sort: request r's matched chain e_0..e_{k-1} becomes the sequence of
    (-weight(e_j), born(e_j)) then a terminator (0, 0) that follows any node (weights are
    at least 1); sequences compare lexicographically, ties (the same node) by the
    current key (key1, key2, request). Stable LSD passes, least significant key first.
    """
    n = queued(q)
    if n == 0:
        return
    lanes = q.lanes
    reqs = np.empty(n, dtype=np.int64)
    slot = np.empty(n, dtype=np.int64)
    depth = np.empty(n, dtype=np.int64)
    m = 0
    dmax = 0
    wait = pc.tab[prefix_cache.E_WAIT]
    born = pc.tab[prefix_cache.E_BORN]
    for lane in range(lanes.shape[1]):
        base = lanes[L_BASE, lane]
        for s in range(base, base + lanes[L_SIZE, lane]):
            r = q.slots[SLOT_REQ, s]
            # the tree's nodes are whole hash blocks (a radix node per block), whatever the cache's unit
            k = prefix_cache.match(pc, block_offsets, prompt_tokens, r, prompt_tokens[r])[0] // pc.per_entry
            reqs[m], slot[m], depth[m] = r, s, k
            dmax = max(dmax, k)
            for j in range(k):
                wait[pc.entry[block_offsets[r] + j]] += 1
            m += 1
    idx = np.argsort(reqs, kind="mergesort")
    col = np.empty(n)
    for i in range(n):
        col[i] = q.keys[K2, slot[idx[i]]]
    idx = idx[np.argsort(col, kind="mergesort")]
    for i in range(n):
        col[i] = q.keys[K1, slot[idx[i]]]
    idx = idx[np.argsort(col, kind="mergesort")]
    icol = np.empty(n, dtype=np.int64)
    for j in range(dmax - 1, -1, -1):
        for row in (prefix_cache.E_BORN, prefix_cache.E_WAIT):
            for i in range(n):
                a = idx[i]
                if j < depth[a]:
                    e = pc.entry[block_offsets[reqs[a]] + j]
                    icol[i] = born[e] if row == prefix_cache.E_BORN else -wait[e]
                else:
                    icol[i] = 0  # the terminator (j == depth) and what follows it
            idx = idx[np.argsort(icol, kind="mergesort")]
    for i in range(n):
        r = reqs[i]
        for j in range(depth[i]):
            wait[pc.entry[block_offsets[r] + j]] = 0
    for p in range(n):
        if q.keys[K1, slot[idx[p]]] != FRONT:  # a promoted request stays ahead of every other
            q.keys[K1, slot[idx[p]]] = float(p - n)
    for lane in range(lanes.shape[1]):
        base = lanes[L_BASE, lane]
        size = lanes[L_SIZE, lane]
        for s in range(base + size // 2 - 1, base - 1, -1):
            _sift_down(q, base, size, s)
