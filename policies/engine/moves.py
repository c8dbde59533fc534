"""Requests moving between replicas (``policies.fleet``): the carried rows a request takes
along, withdrawing it from one replica, delivering it with its rows to the next, and the
P/D prefill replica's hand-off after the first token.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from policies.engine.codes import (
    ERROR_NOT_HELD,
    K_CACHED_FIRST,
    K_COMPUTED,
    K_FIRST_SCHED,
    K_FIRST_TOKEN,
    K_GENERATED,
    K_PREEMPTS,
    K_SPEC_HITS,
    K_SPEC_TRIALS,
    N_KF,
    N_KI,
)
from policies.engine.replica import deliver
from policies.engine.state import _vacate
from policies.engine.summary import inbox_pending
from policies.kernel_state import (
    CACHED_FIRST,
    COMPUTED,
    DELIVERED,
    ERROR,
    FIRST_SCHED,
    FIRST_TOKEN,
    GENERATED,
    HAND_OFF,
    INBOX_HEAD,
    L_DHEAP,
    L_INBOX,
    L_OUTBOX,
    N_DELIVERED,
    N_OUTBOX,
    NEXT_DELIVERY,
    NOT_ARRIVED,
    PREEMPTS,
    RUNNING,
    S_ARRIVAL,
    S_DEADLINE,
    SAMPLED_AT,
    SPEC_HITS,
    SPEC_TRIALS,
    STATUS,
    UNSORTED,
    WAITING,
)
from policies.waitqueue import heap_push


# -- requests moving between replicas (the fleet) ------------------------------------------
@njit(cache=True, nogil=True, _nrt=True)
def new_carried(n):
    """Empty carried rows for n requests: nothing computed, generated, scheduled or observed yet."""
    carried_f = np.full((N_KF, n), np.nan)
    carried_f[K_SPEC_HITS:K_SPEC_TRIALS + 1] = 0.0
    return np.zeros((N_KI, n), dtype=np.int64), carried_f


@njit(cache=True, nogil=True, _nrt=False)
def carry(rep, r, keep_kv, carried_i, carried_f):
    """Write what r takes from this replica to its next one: the tokens it generated (they
    were streamed), its counters, first times and sampler state, and its computed KV only
    with ``keep_kv``."""
    ri, rf = rep.ri, rep.rf
    carried_i[K_COMPUTED, r] = ri[COMPUTED, r] if keep_kv else 0
    carried_i[K_GENERATED, r] = ri[GENERATED, r]
    carried_i[K_PREEMPTS, r] = ri[PREEMPTS, r]
    carried_i[K_CACHED_FIRST, r] = ri[CACHED_FIRST, r]
    carried_f[K_FIRST_SCHED, r] = rf[FIRST_SCHED, r]
    carried_f[K_FIRST_TOKEN, r] = rf[FIRST_TOKEN, r]
    carried_f[K_SPEC_HITS, r] = rf[SPEC_HITS, r]
    carried_f[K_SPEC_TRIALS, r] = rf[SPEC_TRIALS, r]


@njit(cache=True, nogil=True, _nrt=False)
def withdraw(rep, st, r, keep_kv, carried_i, carried_f):
    """Take r (in the inbox, queued or running) off this replica and ``carry`` it: a failure
    drops its KV (``keep_kv`` False), a migration keeps it. Its blocks, prefix references,
    reservation, queue entry and quota usage are freed here (its cached prefix blocks stay
    cached). Returns the tokens whose KV was lost (to be computed again)."""
    ri = rep.ri
    if ri[STATUS, r] == NOT_ARRIVED:
        _leave_inbox(rep, r)
    else:
        _vacate(rep, st, r)
        ri[STATUS, r] = NOT_ARRIVED
    carry(rep, r, keep_kv, carried_i, carried_f)
    return 0 if keep_kv else ri[COMPUTED, r]


@njit(cache=True, nogil=True, _nrt=False)
def _leave_inbox(rep, r):
    g = rep.g
    inbox = rep.lists[L_INBOX]
    ring = inbox.shape[0] - 1
    p = g[INBOX_HEAD]
    while p < g[N_DELIVERED] and inbox[p % ring] != r:
        p += 1
    if p == g[N_DELIVERED]:  # r is not in the inbox: a caller's bug, reported instead of searched for ever
        g[ERROR] = ERROR_NOT_HELD
        return
    for q in range(p, g[N_DELIVERED] - 1):
        inbox[q % ring] = inbox[(q + 1) % ring]
    g[N_DELIVERED] -= 1
    if p == g[INBOX_HEAD]:
        empty = g[INBOX_HEAD] == g[N_DELIVERED]
        rep.gf[NEXT_DELIVERY] = np.inf if empty else rep.rf[DELIVERED, inbox[g[INBOX_HEAD] % ring]]


@njit(cache=True, nogil=True, _nrt=False)
def deliver_carried(rep, st, r, t, carried_i, carried_f):
    """``deliver`` r with what it carries from its last replica (``carry``; fresh rows for a
    new arrival). KV it carries is allocated when it is admitted, never recomputed."""
    ri, rf = rep.ri, rep.rf
    ri[COMPUTED, r] = carried_i[K_COMPUTED, r]
    ri[GENERATED, r] = carried_i[K_GENERATED, r]
    ri[SAMPLED_AT, r] = -1  # no step of this replica sampled it
    ri[PREEMPTS, r] = carried_i[K_PREEMPTS, r]
    ri[CACHED_FIRST, r] = carried_i[K_CACHED_FIRST, r]
    rf[FIRST_SCHED, r] = carried_f[K_FIRST_SCHED, r]
    rf[FIRST_TOKEN, r] = carried_f[K_FIRST_TOKEN, r]
    rf[SPEC_HITS, r] = carried_f[K_SPEC_HITS, r]
    rf[SPEC_TRIALS, r] = carried_f[K_SPEC_TRIALS, r]
    heap = rep.lists[L_DHEAP]
    if heap[0] + inbox_pending(rep) >= ri.shape[1]:
        _compact_deadlines(rep, st)
    g, inbox = rep.g, rep.lists[L_INBOX]
    if g[N_DELIVERED] > 0 and st.sf[S_ARRIVAL, r] < st.sf[S_ARRIVAL, inbox[(g[N_DELIVERED] - 1) % (inbox.shape[0] - 1)]]:
        g[UNSORTED] = 1
    deliver(rep, r, t)


@njit(cache=True, nogil=True, _nrt=True)
def _compact_deadlines(rep, st):
    """Rebuild the deadline heap from its live entries, once each: a request delivered
    here again leaves a stale entry behind, and the heap holds at most n."""
    heap = rep.lists[L_DHEAP]
    status = rep.ri[STATUS]
    entries = heap[1:heap[0] + 1].copy()
    kept = np.zeros(status.shape[0], dtype=np.bool_)
    heap[0] = 0
    for r in entries:
        if (status[r] == WAITING or status[r] == RUNNING) and not kept[r]:
            kept[r] = True
            heap_push(heap, st.sf[S_DEADLINE], st.sf[S_ARRIVAL], r)


@njit(cache=True, nogil=True, _nrt=False)
def hand_off_after_first_token(rep):
    """Make this a P/D prefill replica: a request leaves as soon as a step samples a token
    for it (unless it is done, or its deadline has passed), into ``handed_off``, and
    ``advance`` returns after each step that handed one off."""
    rep.g[HAND_OFF] = 1


@njit(cache=True, nogil=True, inline="always")
def handed_off(rep):
    """Requests handed off (at the end of the step that ended at ``clock``), not yet taken:
    ``carry`` each with its KV, then ``clear_handed_off``."""
    return rep.lists[L_OUTBOX, :rep.g[N_OUTBOX]]


@njit(cache=True, nogil=True, inline="always")
def clear_handed_off(rep):
    rep.g[N_OUTBOX] = 0
