"""Boundary events: arrivals admitted or rejected with their reason, client deadlines and
``max_wait_s``.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from costmodels.steptable import step_seconds
from policies import prefix_cache as pcm
from policies import queues as qm
from policies.engine.batch import _need_blocks
from policies.engine.codes import (
    ADMIT_FIRST,
    ADMIT_NTR,
    ADMIT_PREDICTED,
    ADMIT_RESERVATION,
    I_ADMISSION,
    I_BLOCK_SIZE,
    I_HIGH_WATER,
    I_MAX_QUEUE,
    I_MAX_WAIT,
    I_UNMEETABLE,
    I_WAIT_ACTION,
    R_DEADLINE,
    R_EXCEEDS,
    R_KV_HIGH_WATER,
    R_MAX_WAIT,
    R_NONE,
    R_QUEUE_FULL,
    S_REJECTED,
)
from policies.engine.state import (
    _cache,
    _end_by_deadline,
    _end_request,
    _push_waiting,
    _queue,
)
from policies.kernel_state import (
    CAP,
    DELIVERED,
    FIRST_SCHED,
    HEADROOM,
    INBOX_HEAD,
    L_DHEAP,
    L_INBOX,
    MAX_LEN,
    MAX_OUT,
    N_DELIVERED,
    N_WAIT,
    NEXT_DELIVERY,
    RUNNING,
    S_ARRIVAL,
    S_DEADLINE,
    S_MAX_TOKENS,
    S_OUTPUT,
    S_PROMPT,
    STATUS,
    TARGET,
    UNSORTED,
    USED,
    WAIT_SCAN,
    WAITING,
)
from policies.waitqueue import heap_first_live, heap_pop, heap_push


@njit(cache=True, nogil=True, _nrt=False)
def _exceeds_capacity(ri, g, pc, cfg, r, p, max_out):
    """Whether r (prompt p, up to max_out tokens out) could never run here, not even alone:
    the arrival rule EXCEEDS_CAPACITY, whatever the replica's state."""
    block_size = int(cfg[I_BLOCK_SIZE])
    if p >= g[MAX_LEN]:
        return True
    limit = g[CAP] - g[HEADROOM]
    mode = int(cfg[I_ADMISSION])
    # the mode's need when the engine is empty, at the worst point of this request's life
    if _need_blocks(ri, pc, r, p + max_out - 1, 0, 0, block_size) > limit:
        return True
    if (mode == ADMIT_RESERVATION or mode == ADMIT_PREDICTED) and pcm.kv_blocks(p + max_out, block_size) > limit:
        return True
    return mode == ADMIT_NTR and p + max_out >= limit * block_size


@njit(cache=True, nogil=True, inline="always")
def _max_out(g, si, r):
    """Most tokens r may generate here: its max_tokens, within max_model_len."""
    return min(si[S_MAX_TOKENS, r], g[MAX_LEN] - si[S_PROMPT, r])


@njit(cache=True, nogil=True, _nrt=False)
def _arrival_reject(ri, g, pc, tables, prompt, deadline, cfg, r, t):
    """Reason to turn r away on arrival, or R_NONE."""
    p = prompt[r]
    if _exceeds_capacity(ri, g, pc, cfg, r, p, ri[MAX_OUT, r]):
        return R_EXCEEDS
    if cfg[I_UNMEETABLE] != 0.0 and not math.isnan(deadline[r]):
        alone_s, _ = step_seconds(tables, p, 1, 0, 0, p * (p + 1) // 2)
        if t + alone_s > deadline[r]:
            return R_DEADLINE
    max_queue = int(cfg[I_MAX_QUEUE])
    if max_queue > 0 and g[N_WAIT] >= max_queue:
        return R_QUEUE_FULL
    high_water = cfg[I_HIGH_WATER]
    if high_water < 1.0 and g[USED] >= high_water * g[CAP]:
        return R_KV_HIGH_WATER
    return R_NONE


@njit(cache=True, nogil=True, inline="always")
def _next_delivery(rep):
    """Time of the next delivered request not yet admitted or rejected (inf if none)."""
    return rep.gf[NEXT_DELIVERY]


@njit(cache=True, nogil=True, _nrt=False)
def _arrive(rep, st, tables, cfg, t):
    """Admit to the queue (or reject) every delivered request due by boundary t."""
    ri, rf, g = rep.ri, rep.rf, rep.g
    si = st.si
    inbox = rep.lists[L_INBOX]
    ring = inbox.shape[0] - 1
    prompt, deadline = si[S_PROMPT], st.sf[S_DEADLINE]
    while g[INBOX_HEAD] < g[N_DELIVERED]:
        r = inbox[g[INBOX_HEAD] % ring]
        if rf[DELIVERED, r] > t:
            rep.gf[NEXT_DELIVERY] = rf[DELIVERED, r]
            break
        g[INBOX_HEAD] += 1
        rep.gf[NEXT_DELIVERY] = np.inf
        max_out = _max_out(g, si, r)
        ri[MAX_OUT, r] = max_out
        ri[TARGET, r] = max(1, min(si[S_OUTPUT, r], max_out))
        reason = _arrival_reject(ri, g, _cache(rep, st), tables, prompt, deadline, cfg, r, t)
        if reason != R_NONE:
            _end_request(rep, st, r, S_REJECTED, reason, t)
            continue
        _push_waiting(rep, st, cfg, r, False)
        if not math.isnan(deadline[r]):
            heap_push(rep.lists[L_DHEAP], deadline, st.sf[S_ARRIVAL], r)  # arrival breaks no tie: r does


@njit(cache=True, nogil=True, _nrt=False)
def _next_deadline(rep, st):
    r = heap_first_live(rep.lists[L_DHEAP], st.sf[S_DEADLINE], st.sf[S_ARRIVAL], rep.ri[STATUS], WAITING, RUNNING)
    return np.inf if r < 0 else st.sf[S_DEADLINE, r]


@njit(cache=True, nogil=True, _nrt=False)
def _expire(rep, st, cfg, t):
    """End requests whose deadline has passed; past max_wait_s a never-scheduled request is
    rejected or moved to the front of the queue, per ``max_wait_action``."""
    while _next_deadline(rep, st) <= t:
        r = heap_pop(rep.lists[L_DHEAP], st.sf[S_DEADLINE], st.sf[S_ARRIVAL])
        _end_by_deadline(rep, st, r)
    max_wait = cfg[I_MAX_WAIT]
    if max_wait > 0.0:
        g = rep.g
        inbox = rep.lists[L_INBOX]
        ring = inbox.shape[0] - 1
        arrival = st.sf[S_ARRIVAL]
        admit_first = int(cfg[I_WAIT_ACTION]) == ADMIT_FIRST
        p = g[WAIT_SCAN]  # every request delivered before position p has waited past max_wait
        scan = p
        while scan < g[INBOX_HEAD]:
            r = inbox[scan % ring]
            scan += 1
            if not t - arrival[r] > max_wait:
                if g[UNSORTED] == 0:
                    break
                continue  # out of arrival order: a later position may hold an older request
            if rep.ri[STATUS, r] == WAITING and math.isnan(rep.rf[FIRST_SCHED, r]):
                if admit_first:
                    qm.promote(_queue(rep, st), r)
                else:
                    _end_request(rep, st, r, S_REJECTED, R_MAX_WAIT, t)
            if p == scan - 1:
                p = scan
        g[WAIT_SCAN] = p
