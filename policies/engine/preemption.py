"""Preemption: which running request gives way (``preemption_victim``), when it could come
back (``_return_wait_s``, for ``auto``'s swap-or-recompute choice), and the running loop
that schedules each running request, preempting until its blocks fit.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from costmodels.steptable import step_seconds
from policies import fairness as fm
from policies import prefix_cache as pcm
from policies.engine.batch import _batch_account, _charge_prefill, _need_blocks, _schedule_shared
from policies.engine.codes import (
    I_BLOCK_SIZE,
    I_MAX_PREEMPTIONS,
    I_PREEMPTION,
    I_VICTIM,
    PREEMPT_RECOMPUTE,
    PREEMPT_SWAP,
    R_MAX_PREEMPTIONS,
    S_REJECTED,
    VICTIM_LOWEST_PRIORITY,
    VICTIM_NEWEST,
)
from policies.engine.pipeline import _committed, _in_flight, _release_ghost, _retraction_discards
from policies.engine.state import (
    _cache,
    _end_request,
    _free_gpu,
    _leave_running,
    _push_waiting,
    _shares,
)
from policies.kernel_state import (
    BUDGET,
    COMPUTED,
    DONE,
    FIRST_TOKEN,
    FREE,
    GENERATED,
    HELD,
    HOST,
    HOST_FREE,
    KV_BYTES,
    L_RUN,
    MAX_OUT,
    N_RUN,
    PC_REQ,
    PREEMPTED_NOW,
    PREEMPTS,
    QUOTAS,
    S_ARRIVAL,
    S_CLASS,
    S_DEADLINE,
    S_PRIORITY,
    S_PROMPT,
    S_TENANT,
    SAMPLED_AT,
    SCHED,
    STATUS,
    SWAP_BW,
    SWAP_OUTS,
    SWAP_S,
    UNIT_TOKENS,
    USED,
)
from policies.kernel_state import T as CLOCK


@njit(cache=True, nogil=True, _nrt=False)
def _pick_victim(ri, g, run, prompt, priority, arrival, cfg):
    k = g[N_RUN]
    mode = int(cfg[I_VICTIM])
    if mode == VICTIM_NEWEST:
        return run[k - 1]
    best = run[0]
    for i in range(1, k):
        r = run[i]
        if mode == VICTIM_LOWEST_PRIORITY:
            # least urgent, then the latest arrival; of equal keys the first in running order
            # (vLLM 0.33 v1/core/sched/scheduler.py:933-936: max(running, key=(priority, arrival_time)))
            worse = priority[r] < priority[best] or (priority[r] == priority[best] and arrival[r] > arrival[best])
        else:
            # fewest outputs, then the longest prompt (SGLang's retract order), then latest
            gr = _committed(ri, g, cfg, r)
            gb = _committed(ri, g, cfg, best)
            worse = gr < gb or (gr == gb and (prompt[r] > prompt[best] or (prompt[r] == prompt[best] and r > best)))
        if worse:
            best = r
    return best


@njit(cache=True, nogil=True, _nrt=False)
def _return_wait_s(ri, g, run, tables, v, need):
    """Expected seconds until the running batch (less victim v) frees ``need`` KV blocks,
    the victim's to come back: each running request is expected to free its blocks over
    the decode steps left to its output cap (what the scheduler knows; never its true
    length), so the batch frees sum(held / steps left) blocks a step, each step as long as
    one decode step of the batch now. inf when nothing runs to free them."""
    rate = 0.0
    k = 0
    kv = 0
    for i in range(g[N_RUN]):
        r = run[i]
        if r == v:
            continue
        k += 1
        kv += ri[COMPUTED, r]
        rate += ri[HELD, r] / max(1, ri[MAX_OUT, r] - ri[GENERATED, r])
    if rate <= 0.0:
        return np.inf
    dt, _ = step_seconds(tables, k, k, k, kv, 0)
    return need / rate * dt


@njit(cache=True, nogil=True, _nrt=False)
def _preempt(rep, st, tables, cfg, v):
    """Take v off the GPU: swap its KV out or drop it for recompute, and requeue it.

    Only private KV is swapped: a victim referencing prefix-cache entries is recomputed
    (it drops them and looks the cache up again when readmitted, where its prefix likely
    still is), so a swapped-out request never pins GPU blocks and a request that fits an
    empty GPU always runs once nothing else does.
    """
    ri, g, gf = rep.ri, rep.g, rep.gf
    prompt = st.si[S_PROMPT]
    held_units = ri[PC_REQ + pcm.R_HELD]
    block_size = int(cfg[I_BLOCK_SIZE])
    g[PREEMPTED_NOW] = 1
    n = ri[SCHED, v]
    if n > 0:  # already in this step's batch: give its tokens and new blocks back
        _batch_account(ri, g, prompt, v, n, -1)
        _charge_prefill(rep, st, cfg, v, n, -1)
        if g[QUOTAS]:
            fm.use_tokens(_shares(rep), st.si[S_TENANT, v], st.si[S_CLASS, v], -n)
        g[BUDGET] += n
        ri[SCHED, v] = 0
        keep = pcm.private_blocks(ri[COMPUTED, v], held_units[v], g[UNIT_TOKENS], block_size)
        extra = ri[HELD, v] - keep
        g[FREE] += extra
        g[USED] -= extra
        ri[HELD, v] = keep
        if g[QUOTAS]:
            fm.hold_kv(_shares(rep), st.si[S_TENANT, v], st.si[S_CLASS, v], -extra)
    if ri[STATUS, v] == DONE:  # ended, its last token in flight (async scheduling): only its KV goes
        ri[PREEMPTS, v] += 1
        _release_ghost(rep, st, v)
        return
    limit = int(cfg[I_MAX_PREEMPTIONS])
    if limit > 0 and ri[PREEMPTS, v] >= limit:
        _end_request(rep, st, v, S_REJECTED, R_MAX_PREEMPTIONS, gf[CLOCK])
        return
    ri[PREEMPTS, v] += 1
    held = ri[HELD, v]
    mode = int(cfg[I_PREEMPTION])
    swap = False
    if mode != PREEMPT_RECOMPUTE and held > 0 and g[HOST_FREE] >= held and held_units[v] == 0:
        copy_s = held * block_size * gf[KV_BYTES] / gf[SWAP_BW]
        if mode == PREEMPT_SWAP:
            swap = True
        else:
            c = ri[COMPUTED, v]
            recompute_s, _ = step_seconds(tables, c, 1, 0, 0, c * (c + 1) // 2)
            swap = 2.0 * copy_s < recompute_s
            deadline = st.sf[S_DEADLINE, v]
            if swap and not math.isnan(deadline):
                # a request whose client leaves before it can return never pays the copy back
                # in nor the re-prefill: the copy out would be spent for nothing
                swap = gf[CLOCK] + copy_s + _return_wait_s(ri, g, rep.lists[L_RUN], tables, v, held) < deadline
        if swap:
            g[HOST_FREE] -= held
            ri[HOST, v] = held
            gf[SWAP_S] += copy_s
            g[SWAP_OUTS] += 1
    # before its progress is reset: vLLM keeps the blocks it computed
    _free_gpu(rep, st, v, not swap, _in_flight(ri, g, cfg, v))
    if not swap:
        ri[COMPUTED, v] = 0
        if _retraction_discards(cfg) and _in_flight(ri, g, cfg, v):
            ri[GENERATED, v] -= 1  # its token in flight is thrown away: never streamed, sampled again
            ri[SAMPLED_AT, v] = -1
            if ri[GENERATED, v] == 0:
                rep.rf[FIRST_TOKEN, v] = np.nan
    _leave_running(rep, st, v)
    _push_waiting(rep, st, cfg, v, True)


@njit(cache=True, nogil=True, _nrt=False)
def _schedule_running(rep, st, tables, cfg, r, n):
    """Schedule n tokens of running r, preempting victims until its blocks fit."""
    ri, g = rep.ri, rep.g
    pc = _cache(rep, st)
    block_size = int(cfg[I_BLOCK_SIZE])
    while _need_blocks(ri, pc, r, ri[COMPUTED, r] + n, ri[PC_REQ + pcm.R_HELD, r], 0, block_size) > g[FREE]:
        v = _pick_victim(ri, g, rep.lists[L_RUN], st.si[S_PROMPT], st.si[S_PRIORITY], st.sf[S_ARRIVAL], cfg)
        _preempt(rep, st, tables, cfg, v)
        if v == r:
            return
    _schedule_shared(rep, st, cfg, r, n)
