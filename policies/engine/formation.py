"""Forming one step: running requests first, then waiting ones (``decode_first``, vLLM V1),
or a prefill-only step when there is prefill work (``prefill_first``, SGLang); SGLang's
new-token ratio, retracted on preemption and decayed step by step.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from policies import fairness as fm
from policies import prefix_cache as pcm
from policies.engine.admission import _admit_waiting, _long_prefill_threshold
from policies.engine.batch import _fit_step_cap, _need_blocks, _schedule, _schedule_shared
from policies.engine.codes import (
    ADMIT_NTR,
    I_ADMISSION,
    I_BATCH_WAIT_ITERS,
    I_BATCH_WAIT_RATIO,
    I_BLOCK_SIZE,
    I_CONSERVATIVENESS,
    I_MAX_BATCHED,
    I_SCHEDULE_MODE,
    I_STEP_CAP_MS,
    PREFILL_FIRST,
)
from policies.engine.pipeline import _decodes_past_stop, _lingers
from policies.engine.preemption import _schedule_running
from policies.engine.state import _cache, _copy_running, _is_decode, _shares
from policies.engine.summary import _queued_sum
from policies.kernel_state import (
    B_TOKENS,
    BATCH_WAITED,
    BUDGET,
    COMPUTED,
    DP_HOLD,
    FREE,
    GENERATED,
    GHOSTS,
    HELD,
    L_BATCH,
    L_ORDER,
    L_RUN,
    MAX_OUT,
    N_RUN,
    N_WAIT,
    NTR_DECAY_STEPS,
    NTR_INIT,
    NTR_MIN_FACTOR,
    NTR_RETRACT_STEPS,
    PC_REQ,
    PC_STATS,
    PREEMPTED_NOW,
    QUOTAS,
    RATIO,
    RUNNING,
    S_PROMPT,
    STATUS,
    TARGET,
    UNIT_TOKENS,
)


@njit(cache=True, nogil=True, _nrt=False)
def _form_batch(rep, st, tables, cfg):
    """Fill the batch for the step starting now (the rules are in the ``policies.engine`` docstring)."""
    ri, g, gf = rep.ri, rep.g, rep.gf
    pc = _cache(rep, st)
    run, order, batch = rep.lists[L_RUN], rep.lists[L_ORDER], rep.lists[L_BATCH]
    prompt = st.si[S_PROMPT]
    prefill_first = int(cfg[I_SCHEDULE_MODE]) == PREFILL_FIRST
    threshold = _long_prefill_threshold(g, cfg)  # counted once, before anything is scheduled (vLLM)
    block_size = int(cfg[I_BLOCK_SIZE])
    g[BUDGET] = int(cfg[I_MAX_BATCHED])
    if g[QUOTAS]:
        fm.new_step(_shares(rep))
    # decodes take the plain path: sharing state is touched only when it matters
    cached_held = ri[PC_REQ + pcm.R_HELD]
    unit_tokens = g[UNIT_TOKENS]
    plain_decodes = g[QUOTAS] == 0
    k = g[N_RUN]
    _copy_running(order, run, k)  # preemption edits `run` while we walk it
    for i in range(k):
        if g[BUDGET] <= 0:
            break
        r = order[i]
        if ri[STATUS, r] != RUNNING and not _decodes_past_stop(ri, prompt, r):
            continue
        n = prompt[r] + ri[GENERATED, r] - ri[COMPUTED, r]
        if prefill_first and _is_decode(ri, prompt, r, n):
            continue  # decodes wait for a step without prefill work
        if 0 < threshold < n:
            n = threshold
        n = min(n, g[BUDGET])
        if cfg[I_STEP_CAP_MS] > 0.0:
            n = _fit_step_cap(ri, g, gf, tables, prompt, cfg, r, n, np.bool_(True))  # one signature with _admit_waiting's
        if n == 0:
            continue
        if plain_decodes and _is_decode(ri, prompt, r, n):
            blocks = pcm.private_blocks(ri[COMPUTED, r] + 1, cached_held[r], unit_tokens, block_size) - ri[HELD, r]
            if blocks <= g[FREE] - g[PC_STATS + pcm.S_EVICTABLE]:
                _schedule(ri, g, batch, prompt, r, n, blocks)
                continue
        if _need_blocks(ri, pc, r, ri[COMPUTED, r] + n, cached_held[r], 0, block_size) <= g[FREE]:
            _schedule_shared(rep, st, cfg, r, n)
        else:
            _schedule_running(rep, st, tables, cfg, r, n)
    if g[PREEMPTED_NOW] == 0 and g[N_WAIT] > 0 and g[DP_HOLD] == 0 and _batch_wait_over(rep, st, cfg):
        _admit_waiting(rep, st, tables, cfg, prefill_first, threshold)
    if prefill_first and g[B_TOKENS] == 0:
        k = g[N_RUN]
        _copy_running(order, run, k)
        if g[GHOSTS] > 0 and _waits_for_finishing(rep, st, cfg, k):
            k = 0
        for i in range(k):
            r = order[i]
            if ri[STATUS, r] == RUNNING or _decodes_past_stop(ri, prompt, r):
                _schedule_running(rep, st, tables, cfg, r, np.int64(1))  # one signature with the call above
    if g[PREEMPTED_NOW] != 0 and int(cfg[I_ADMISSION]) == ADMIT_NTR:
        _retract_ratio(ri, g, gf, run, cfg)


@njit(cache=True, nogil=True, _nrt=False)
def _waits_for_finishing(rep, st, cfg, k):
    """SGLang's overlap loop, its decode short of KV while requests that end by length are in
    flight: it decodes nobody this step rather than retract, since their KV is freed once
    their step's outputs are in (managers/scheduler.py:4469-4474)."""
    ri, g = rep.ri, rep.g
    pc = _cache(rep, st)
    prompt, order = st.si[S_PROMPT], rep.lists[L_ORDER]
    block_size = int(cfg[I_BLOCK_SIZE])
    cached_held = ri[PC_REQ + pcm.R_HELD]
    finishing = False
    need = 0
    for i in range(k):
        r = order[i]
        if _lingers(ri, prompt, r):
            finishing = finishing or ri[TARGET, r] == ri[MAX_OUT, r]
            if ri[TARGET, r] == ri[MAX_OUT, r]:
                continue
        elif ri[STATUS, r] != RUNNING:
            continue
        need += _need_blocks(ri, pc, r, ri[COMPUTED, r] + 1, cached_held[r], 0, block_size)
    return finishing and need > g[FREE]


@njit(cache=True, nogil=True, _nrt=False)
def _batch_wait_over(rep, st, cfg):
    """Whether waiting requests may start this step under TensorRT-LLM's batch waiting
    (``PyExecutor._waiting_requests``): beside running requests that took tokens, they
    wait until the step would reach ``batch_wait_token_ratio`` of the token budget with
    them, or they have waited ``batch_wait_iters`` steps; the count restarts once they
    start. Off unless both knobs are set, as there."""
    g = rep.g
    if not _batch_waits(cfg) or g[B_TOKENS] == 0:
        return True
    if g[BATCH_WAITED] >= cfg[I_BATCH_WAIT_ITERS] or (
            g[B_TOKENS] + min(_queued_sum(rep, st, True), g[BUDGET]) >= cfg[I_BATCH_WAIT_RATIO] * cfg[I_MAX_BATCHED]):
        g[BATCH_WAITED] = 0
        return True
    g[BATCH_WAITED] += 1
    return False


@njit(cache=True, nogil=True, inline="always")
def _batch_waits(cfg):
    return cfg[I_BATCH_WAIT_ITERS] > 0 and cfg[I_BATCH_WAIT_RATIO] > 0.0


@njit(cache=True, nogil=True, _nrt=False)
def _ntr_init(cfg):
    return min(NTR_INIT * cfg[I_CONSERVATIVENESS], 1.0)


@njit(cache=True, nogil=True, _nrt=False)
def _retract_ratio(ri, g, gf, run, cfg):
    """SGLang after a retraction: ratio from the decoded share of what is left running."""
    k = g[N_RUN]
    if k == 0:
        gf[RATIO] = _ntr_init(cfg)
        return
    decoded = 0
    max_new = 0
    for i in range(k):
        r = run[i]
        decoded += ri[GENERATED, r]
        max_new += ri[MAX_OUT, r]
    gf[RATIO] = min(1.0, (decoded + NTR_RETRACT_STEPS * k) / max_new)


@njit(cache=True, nogil=True, _nrt=False)
def _decay_ratio(gf, cfg):
    init = _ntr_init(cfg)
    low = NTR_MIN_FACTOR * init
    gf[RATIO] = max(gf[RATIO] - (init - low) / NTR_DECAY_STEPS, low)
