"""Routing in the fleet: the replicas' summary rows and the configured router's choice of
replica (the routers themselves are ``policies.routing``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from policies import engine
from policies import routing as rt
from policies.fleet.state import FR_ALIVE, FR_POOL
from policies.kernel_state import S_MAX_TOKENS, S_PROMPT, S_TENANT


@njit(cache=True, nogil=True)
def _fill_summary(fl, pool, heads, queued):
    """Routing summary rows of the alive replicas of ``pool`` (others: ALIVE 0); the head
    demand and queued tokens, which cost a scan, only when asked."""
    s, fr = fl.summary, fl.fr
    for j in range(fr.shape[1]):
        if fr[FR_ALIVE, j] == 0 or fr[FR_POOL, j] != pool:
            s[j, rt.ALIVE] = 0.0
            continue
        rep, st, _ = fl.nodes[j]
        s[j, rt.ALIVE] = 1.0
        s[j, rt.OUTSTANDING] = engine.outstanding(rep)
        s[j, rt.RUNNING] = engine.running(rep)
        s[j, rt.WAITING] = engine.waiting(rep)
        s[j, rt.FREE] = engine.free_blocks(rep)
        s[j, rt.HEADROOM] = engine.headroom_blocks(rep)
        s[j, rt.CAPACITY] = engine.capacity_blocks(rep)
        busy = heads and s[j, rt.WAITING] > 0  # no queue, no head
        s[j, rt.HEAD_DEMAND] = engine.head_demand_blocks(rep, st, fl.cfg) if busy else 0.0
        s[j, rt.QUEUED_TOKENS] = engine.queued_tokens(rep, st) if queued else 0.0


@njit(cache=True, nogil=True)
def _route(fl, r):
    """The replica of pool 0 the configured router sends request r to."""
    cfg, s = fl.cfg, fl.summary
    router = int(cfg[rt.I_ROUTER])
    _fill_summary(fl, 0, router == rt.LEAST_KV, router == rt.UNIFIED)
    st = fl.nodes[0][1]
    prompt = st.si[S_PROMPT, r]
    if router == rt.UNIFIED or router == rt.CACHE_AWARE:
        for j in range(s.shape[0]):
            if s[j, rt.ALIVE] > 0:
                s[j, rt.T_ADAPTER] = engine.adapter_load_s(fl.nodes[j][0], fl.nodes[j][1], r)
    if router == rt.UNIFIED:
        for j in range(s.shape[0]):
            if s[j, rt.ALIVE] > 0:
                rep, st_j, tables = fl.nodes[j]
                s[j, rt.CACHED_TOKENS] = engine.cached_tokens(rep, st_j, r)
                max_out = min(st.si[S_MAX_TOKENS, r], engine.max_len(rep) - prompt)
                rt.fill_unified_terms(s, j, tables, fl.kv_bytes[j], cfg, prompt, max_out, 0)
    elif router == rt.TOTAL_TOKENS:
        for j in range(s.shape[0]):
            if s[j, rt.ALIVE] > 0:
                rep, st_j, _ = fl.nodes[j]
                s[j, rt.SEQ_TOKENS] = engine.waiting_tokens(rep, st_j)
    start, end = st.offsets[r], st.offsets[r + 1]
    key = np.uint64(0)
    if router == rt.CONSISTENT_HASH:
        key = rt.ring_key(cfg, fl.block_hashes, start, end, r, st.si[S_TENANT, r])
    return rt.choose_replica(cfg, s, fl.router, st.entry[start:end], st.block_tokens, prompt, key)
