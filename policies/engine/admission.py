"""Admission of waiting requests: vLLM's watermark and each ``admission_mode``'s rule, the
long-prefill threshold and first chunk, the free KV a blocked head needs to start, and the
waiting loop that starts requests in queue order under every budget.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from costmodels.steptable import step_seconds
from policies import adapters as adm
from policies import fairness as fm
from policies import prefix_cache as pcm
from policies import queues as qm
from policies.engine.batch import _fit_step_cap, _need_blocks, _schedule_shared
from policies.engine.codes import (
    ADMIT_NTR,
    ADMIT_PREDICTED,
    ADMIT_RESERVATION,
    DFS_WEIGHT,
    EDF,
    I_ADMISSION,
    I_BLOCK_SIZE,
    I_CHUNKED,
    I_DEADLINE_MARGIN,
    I_LONG_PREFILL,
    I_MAX_BATCHED,
    I_MAX_PREFILL,
    I_MAX_SEQS,
    I_POLICY,
    I_SCHEDULE_MODE,
    I_STEP_CAP_MS,
    NEVER,
    PREFILL_FIRST,
    R_DEADLINE,
    S_REJECTED,
)
from policies.engine.pipeline import _committed
from policies.engine.state import (
    _adapter_start,
    _adapter_state,
    _cache,
    _end_request,
    _pool,
    _pool_column,
    _queue,
    _shares,
)
from policies.kernel_state import (
    AD_SKIP_ROW,
    B_PREFILL,
    B_TOKENS,
    BUDGET,
    CACHED_FIRST,
    CACHING,
    CALIBRATION_BINS,
    CAP,
    COMPUTED,
    FIRST_SCHED,
    FREE,
    GENERATED,
    HEADROOM,
    HELD,
    HOST,
    HOST_FREE,
    KV_BLOCK_SIZE,
    KV_BYTES,
    L_RUN,
    LORA,
    MAX_OUT,
    N_RUN,
    N_WAIT,
    NTR_CLIP,
    NTR_REM,
    PC_REQ,
    PEAK,
    PRED_BIN,
    PREFIX_HIT,
    PREFIX_QUERY,
    PREFIX_SAVED_S,
    QUOTAS,
    RATIO,
    RESERVED,
    RESERVED_TOTAL,
    RUNNING,
    S_CLASS,
    S_DEADLINE,
    S_MIN_SERVICE,
    S_PROMPT,
    S_TENANT,
    STATUS,
    SWAP_BW,
    SWAP_S,
    USED,
    VLLM_CACHE,
)
from policies.kernel_state import T as CLOCK


@njit(cache=True, nogil=True, _nrt=False)
def _predicted_out(g, hist_bins, max_out):
    """predicted mode: output tokens to reserve, from the calibrated ratio quantile."""
    b = g[PRED_BIN]
    if b < 0:
        return max_out
    return ((b + 1) * max_out + hist_bins - 1) // hist_bins


@njit(cache=True, nogil=True, _nrt=False)
def _reservation_blocks(ri, g, prompt, cfg, r):
    block_size = int(cfg[I_BLOCK_SIZE])
    max_out = ri[MAX_OUT, r]
    if int(cfg[I_ADMISSION]) == ADMIT_PREDICTED:
        out = _predicted_out(g, CALIBRATION_BINS, max_out)
        return max(pcm.kv_blocks(prompt[r] + out, block_size), pcm.kv_blocks(prompt[r] + ri[GENERATED, r], block_size))
    return pcm.kv_blocks(prompt[r] + max_out, block_size)


@njit(cache=True, nogil=True, inline="always")
def _watermark_free(ri, g, pc, prompt, cfg, r, held, idle_blocks):
    """Free blocks waiting r needs to start: its whole prompt past its cached prefix, plus
    the headroom."""
    return _need_blocks(ri, pc, r, prompt[r] + ri[GENERATED, r], held, idle_blocks, int(cfg[I_BLOCK_SIZE])) + g[HEADROOM]


@njit(cache=True, nogil=True, _nrt=False)
def _admissible(ri, g, gf, pc, prompt, cfg, r, held, idle_blocks):
    """Whether waiting r may start now: watermark over its whole prompt (past its cached
    prefix), then the mode's rule (``_rule_admits``)."""
    if g[FREE] < _watermark_free(ri, g, pc, prompt, cfg, r, held, idle_blocks):
        return False
    return _rule_admits(ri, g, gf, prompt, cfg, r)


@njit(cache=True, nogil=True, _nrt=False)
def _rule_admits(ri, g, gf, prompt, cfg, r):
    """The admission mode's rule for waiting r (reservations, or new_token_ratio's
    running budget, which an admitted request draws down)."""
    generated = ri[GENERATED, r]
    mode = int(cfg[I_ADMISSION])
    if mode == ADMIT_RESERVATION or mode == ADMIT_PREDICTED:
        return g[RESERVED_TOTAL] + _reservation_blocks(ri, g, prompt, cfg, r) <= g[CAP] - g[HEADROOM]
    if mode == ADMIT_NTR:
        total = prompt[r] + generated - ri[COMPUTED, r] + min(ri[MAX_OUT, r] - generated, NTR_CLIP)
        if total >= gf[NTR_REM]:
            return False
        gf[NTR_REM] -= total
    return True


@njit(cache=True, nogil=True, inline="always")
def _long_prefill_threshold(g, cfg):
    """The long-prefill threshold of the step being formed: off (0) unless more than one
    request is running or waiting as the step's formation starts. vLLM 0.33,
    vllm/v1/core/sched/scheduler.py:754-763: ``num_running, num_waiting =
    self.get_request_counts()`` (len(running), len(waiting) + len(kv_holding_waiting))
    at the start of ``schedule()``, threshold ``if num_eligible_reqs > 1 else 0``: a
    lone request has nobody to starve. (``long_prefill_token_threshold_adaptive``,
    scheduler.py:764-768, defaults to False in vllm/config/scheduler.py:86 and is not
    modelled.) Arrivals due at this boundary are already queued, as vLLM's
    ``add_request`` queues them before ``schedule()``."""
    return int(cfg[I_LONG_PREFILL]) if g[N_RUN] + g[N_WAIT] > 1 else 0


@njit(cache=True, nogil=True, inline="always")
def _first_chunk(ri, prompt, cfg, r, computed, budget, rem_input, prefill_started, threshold):
    """Tokens waiting r would compute in this step, ``computed`` of them done (cached or
    kept): its rest up to the step's long-prefill threshold (``_long_prefill_threshold``)
    and the token budget; 0 when it cannot start here (a prefill-first step already
    holds prefill and r exceeds the prefill budget left, or prefill is unchunked and r
    exceeds the token budget)."""
    n = prompt[r] + ri[GENERATED, r] - computed
    if 0 < threshold < n:
        n = threshold
    if (prefill_started and n > rem_input) or (cfg[I_CHUNKED] == 0.0 and n > budget):
        return 0
    return min(n, budget)


@njit(cache=True, nogil=True, _nrt=False)
def _head_start_free(rep, st, cfg):
    """The fewest free KV blocks at which the coming step, every running request decoding,
    would start the waiting head (``_admit_waiting``'s first pick); ``NEVER`` when it
    could not start it however much KV were free (a budget is used up, or the admission
    rule refuses).

    Only under ``_stuck_modes``: then nothing else this decision reads changes over a
    decode stretch (static queue keys, no quota, clock or ratio rule, reservations only
    grow) while free KV only shrinks, so a stretch whose free KV stays below this never
    starts anyone. A decode-first step decides after its decodes took their blocks and
    tokens, a prefill-first step before (its decodes wait for a step without prefill).
    """
    ri, g = rep.ri, rep.g
    prefill_first = int(cfg[I_SCHEDULE_MODE]) == PREFILL_FIRST
    budget = int(cfg[I_MAX_BATCHED]) - (0 if prefill_first else g[N_RUN])
    if g[N_RUN] >= int(cfg[I_MAX_SEQS]) or budget <= 0:
        return NEVER
    pc, wq = _cache(rep, st), _queue(rep, st)
    prompt = st.si[S_PROMPT]
    r = qm.pick(wq, int(cfg[I_POLICY]), wq.lanes[qm.L_BLOCKED], _shares(rep).tenants[fm.TS_COUNTER], pc, st.offsets,
                prompt)
    held, computed, idle = ri[PC_REQ + pcm.R_HELD, r], ri[COMPUTED, r], 0
    if g[CACHING] and computed == 0 and ri[HOST, r] == 0:
        held, computed, idle, _ = _lookup(ri, g, pc, st.offsets, prompt, r)
    # nothing arrives or ends before the coming step: its threshold is the one of now
    threshold = _long_prefill_threshold(g, cfg)
    if (_first_chunk(ri, prompt, cfg, r, computed, budget, 0, False, threshold) == 0
            or not _rule_admits(ri, g, rep.gf, prompt, cfg, r)):
        return NEVER
    return _watermark_free(ri, g, pc, prompt, cfg, r, held, idle)


@njit(cache=True, nogil=True, _nrt=False)
def _start(rep, st, cfg, r):
    """Move waiting r (just popped) to running: swap its KV back in, take its reservation."""
    ri, rf, g, gf = rep.ri, rep.rf, rep.g, rep.gf
    g[N_WAIT] -= 1
    ri[STATUS, r] = RUNNING
    rep.lists[L_RUN, g[N_RUN]] = r
    g[N_RUN] += 1
    if math.isnan(rf[FIRST_SCHED, r]):
        rf[FIRST_SCHED, r] = gf[CLOCK]
    if g[LORA] != 0:
        _adapter_start(rep, st, r)
    host = ri[HOST, r]
    if host > 0:
        gf[SWAP_S] += host * int(cfg[I_BLOCK_SIZE]) * gf[KV_BYTES] / gf[SWAP_BW]
        g[HOST_FREE] += host
        ri[HOST, r] = 0
    mode = int(cfg[I_ADMISSION])
    if mode == ADMIT_RESERVATION or mode == ADMIT_PREDICTED:
        ri[RESERVED, r] = _reservation_blocks(ri, g, st.si[S_PROMPT], cfg, r)
        g[RESERVED_TOTAL] += ri[RESERVED, r]


@njit(cache=True, nogil=True, _nrt=False)
def _running_future(ri, g, run, cfg):
    """new_token_ratio: sum over running requests of their clipped remaining output, from
    the outputs the scheduler has (``pipeline._committed``: under overlap, a token in
    flight is not counted yet, and a request ending with it still reserves)."""
    total = 0
    for i in range(g[N_RUN]):
        r = run[i]
        total += min(ri[MAX_OUT, r] - _committed(ri, g, cfg, r), NTR_CLIP)
    return total


@njit(cache=True, nogil=True, _nrt=False)
def _admit_waiting(rep, st, tables, cfg, prefill_first, threshold):
    """Start waiting requests in queue order until a budget or the admission rule stops
    (``threshold``: the step's long-prefill threshold, fixed as its formation began).

    A request new to the GPU first looks up the prefix cache; its cached tokens are not
    computed. Under EDF a never-scheduled head whose deadline is already unmeetable is
    rejected; with quotas, a head over its tenant's quota or its class's budget blocks its
    lane for this round and the next lane's head is tried. With LoRA, a request whose
    adapter would be one distinct adapter too many is skipped and keeps its place
    (``policies.adapters``): the next in order is tried.
    """
    ri, rf, g, gf = rep.ri, rep.rf, rep.g, rep.gf
    pc, wq, sh = _cache(rep, st), _queue(rep, st), _shares(rep)
    si, sf = st.si, st.sf
    prompt, offsets = si[S_PROMPT], st.offsets
    block_size = int(cfg[I_BLOCK_SIZE])
    chunked = cfg[I_CHUNKED] != 0.0
    max_seqs = int(cfg[I_MAX_SEQS])
    order = int(cfg[I_POLICY])
    rem_input = int(cfg[I_MAX_PREFILL]) - g[B_PREFILL]
    caching = g[CACHING] != 0
    quotas = g[QUOTAS] != 0
    lane_blocked = wq.lanes[qm.L_BLOCKED]
    if int(cfg[I_ADMISSION]) == ADMIT_NTR:
        gf[NTR_REM] = (g[FREE] - g[HEADROOM]) * block_size - gf[RATIO] * _running_future(ri, g, rep.lists[L_RUN], cfg)
    if quotas:
        lane_blocked[:] = 0
    if order == DFS_WEIGHT and caching and g[N_RUN] < max_seqs and g[BUDGET] > 0:
        qm.dfs_rekey(wq, pc, offsets, prompt)  # SGLang sorts once per round that may admit (calc_priority)
    lora = g[LORA] != 0
    skipped = np.int64(0)  # not a literal 0: Numba would compile _skip and _unskip for it too
    while g[N_RUN] < max_seqs and g[BUDGET] > 0:
        r = qm.pick(wq, order, lane_blocked, sh.tenants[fm.TS_COUNTER], pc, offsets, prompt)
        if r < 0:
            break
        if (order == EDF and math.isnan(rf[FIRST_SCHED, r])
                and qm.deadline_unmeetable(gf[CLOCK], sf[S_DEADLINE, r], sf[S_MIN_SERVICE, r],
                                           cfg[I_DEADLINE_MARGIN] * 1e-3)):
            _end_request(rep, st, r, S_REJECTED, R_DEADLINE, gf[CLOCK])
            continue
        if lora and not adm.can_join(_pool(rep), _adapter_state(rep), _pool_column(rep, st, r)):
            _skip(rep, wq, r, skipped)
            skipped += 1
            continue
        held = ri[PC_REQ + pcm.R_HELD, r]
        cached = 0
        idle = 0
        take = 0
        lookup = caching and ri[COMPUTED, r] == 0 and ri[HOST, r] == 0
        if lookup:
            held, cached, idle, take = _lookup(ri, g, pc, offsets, prompt, r)
            ri[COMPUTED, r] = cached  # provisional: the step-cap and NTR checks see the cache
        n = _first_chunk(ri, prompt, cfg, r, ri[COMPUTED, r], g[BUDGET], rem_input, prefill_first and g[B_TOKENS] > 0,
                         threshold)
        if n > 0 and cfg[I_STEP_CAP_MS] > 0.0:
            n = _fit_step_cap(ri, g, gf, tables, prompt, cfg, r, n, chunked)
        if n > 0 and quotas:
            first = _need_blocks(ri, pc, r, ri[COMPUTED, r] + n, held, idle, block_size)
            if fm.admission_check(sh, si[S_TENANT, r], si[S_CLASS, r], first, n, g[FREE] - first, g[CAP],
                                  int(cfg[I_MAX_BATCHED]), g[N_RUN]) != fm.ADMIT:
                ri[COMPUTED, r] = 0 if lookup else ri[COMPUTED, r]
                lane_blocked[wq.lane_of[r]] = 1
                continue
        if n == 0 or not _admissible(ri, g, gf, pc, prompt, cfg, r, held, idle):
            if lookup:
                ri[COMPUTED, r] = 0
            break
        qm.remove(wq, r)
        fm.dequeue(sh, si[S_TENANT, r])
        if lookup:
            _take_cached_prefix(rep, st, tables, r, held, cached, idle, take, n)
        _start(rep, st, cfg, r)
        _schedule_shared(rep, st, cfg, r, n)
        rem_input -= n
    if skipped > 0:
        _unskip(rep, wq, skipped)


@njit(cache=True, nogil=True, _nrt=False)
def _skip(rep, wq, r, k):
    """Take queued r out of this round's picks, keeping its queue key (``_unskip``)."""
    slot, row = wq.slots[qm.POS, r], rep.g[AD_SKIP_ROW]
    rep.fl[row, k] = r
    rep.fl[row + 1, k] = wq.keys[qm.K1, slot]
    rep.fl[row + 2, k] = wq.keys[qm.K2, slot]
    qm.remove(wq, r)


@njit(cache=True, nogil=True, _nrt=False)
def _unskip(rep, wq, k):
    """Put the k requests skipped this round back under their own keys: each keeps its place."""
    row = rep.g[AD_SKIP_ROW]
    for i in range(k):
        qm.push(wq, int(rep.fl[row, i]), rep.fl[row + 1, i], rep.fl[row + 2, i])


@njit(cache=True, nogil=True, _nrt=False)
def _lookup(ri, g, pc, offsets, prompt, r):
    """What waiting r finds in the prefix cache: (units cached, cached tokens, idle blocks of
    those units, blocks it takes as its own: the head of the next entry, left by eviction
    (SGLang), or its own run (vLLM)).

    With own runs (vLLM) the lookup spans the request's generated tokens too and hits whole
    KV blocks, at most ``(tokens - 1) // block_size`` of them, so at least one token is
    computed (vllm/v1/core/kv_cache_manager.py ``get_computed_blocks``: ``max_cache_hit_length``).
    Its own blocks follow its prefix, so they count only when every prefix unit is cached.
    """
    held, cached, idle = pcm.match(pc, offsets, prompt, r, prompt[r] + ri[GENERATED, r])
    block_size = g[KV_BLOCK_SIZE]
    take = pcm.partial_blocks(pc, offsets, r, held)
    prefix = held * pc.unit_tokens
    if not g[VLLM_CACHE]:
        return held, min(prefix + take * block_size, prompt[r] - 1), idle, take
    if held == pc.req[pcm.R_N_FULL, r]:
        take = pcm.own_blocks(pc, r)
    cap = (prompt[r] + ri[GENERATED, r] - 1) // block_size
    take = max(0, min(take, cap - prefix // block_size))
    return held, min(prefix // block_size + take, cap) * block_size, idle, take


@njit(cache=True, nogil=True, _nrt=False)
def _take_cached_prefix(rep, st, tables, r, held, cached, idle_blocks, take, n):
    """Reference r's cached prefix (its idle entries stop being evictable), take out of the
    cache what it hits past it (a partly evicted entry, or its own run: ``_lookup``) as ``take``
    blocks of its own, and count the lookup: tokens hit and looked up, and the lone-prefill
    time the hit saved this chunk."""
    g, gf = rep.g, rep.gf
    pc = _cache(rep, st)
    if held > 0:
        idle_blocks = pcm.acquire(pc, st.offsets, r, held)
    pcm.take_partial(pc, st.offsets, r, held)
    if g[VLLM_CACHE]:
        pcm.take_own(pc, r)
    if take > 0:
        rep.ri[HELD, r] += take
        if g[QUOTAS]:
            fm.hold_kv(_shares(rep), st.si[S_TENANT, r], st.si[S_CLASS, r], take)
    if idle_blocks + take > 0:
        g[FREE] -= idle_blocks + take
        g[USED] += idle_blocks + take
        if g[USED] > g[PEAK]:
            g[PEAK] = g[USED]
    gf[PREFIX_HIT] += cached
    gf[PREFIX_QUERY] += st.si[S_PROMPT, r]
    if math.isnan(rep.rf[FIRST_SCHED, r]):
        rep.ri[CACHED_FIRST, r] = cached
    if cached > 0:
        full = cached + n
        without, _ = step_seconds(tables, full, 0, 0, 0, full * (full + 1) // 2)
        with_cache, _ = step_seconds(tables, n, 0, 0, 0, n * cached + n * (n + 1) // 2)
        gf[PREFIX_SAVED_S] += without - with_cache
