"""Fast-forward over pure-decode and same-chunk stretches (the rules are in the
``policies.engine`` docstring): one step-time lookup per step, per-request arrays touched
once at the end, bit-identical to stepping one by one.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from costmodels.steptable import decode_run_base, decode_run_step, step_seconds
from policies import fairness as fm
from policies import prefix_cache as pcm
from policies.engine.admission import _long_prefill_threshold
from policies.engine.codes import (
    ADMIT_NTR,
    DFS_WEIGHT,
    EDF,
    I_ADMISSION,
    I_BLOCK_SIZE,
    I_COST_UNIT,
    I_MAX_BATCHED,
    I_MAX_WAIT,
    I_POLICY,
    I_PREFIX_CACHING,
    I_SCHEDULE_MODE,
    I_STEP_CAP_MS,
    I_W_IN,
    I_W_OUT,
    LPM,
    PREFILL_FIRST,
    VTC,
)
from policies.engine.formation import _batch_waits, _decay_ratio
from policies.engine.pipeline import _visible_until
from policies.engine.state import _copy_running, _cover_reservation, _is_decode
from policies.engine.step_end import _book_stretch_step, _end_done, _note_step_tokens
from policies.kernel_state import (
    BUSY,
    COMPUTED,
    FREE,
    G_RESIDUES,
    GENERATED,
    HELD,
    KV_BYTES,
    L_ORDER,
    L_RUN,
    N_RUN,
    N_WAIT,
    OUT_OF_RANGE,
    PC_REQ,
    PEAK,
    PIPELINE_T,
    PREFILL_TOKENS,
    QUOTAS,
    S_CLASS,
    S_TENANT,
    SAMPLE_K,
    SAMPLED_AT,
    SERIES_EVERY,
    SERIES_T0,
    STEPS,
    TARGET,
    USED,
)
from policies.kernel_state import T as CLOCK


@njit(cache=True, nogil=True, _nrt=False)
def _decode_layout(ri, run, k, cached_held, prompt, unit_tokens, residues):
    """For the first k running requests, all decoding: fill ``residues`` (a histogram of
    positions modulo the block size: which step allocates whose next block) and return
    the KV tokens their next decode reads and the steps until the first one finishes
    (0 when one of them is not decoding)."""
    if not _is_decode(ri, prompt, run[k - 1], 1):
        return 0, 0  # the newest is the likeliest to be still in its prefill
    block_size = residues.shape[0]
    residues[:] = 0
    kv = 0
    run_len = np.iinfo(np.int64).max
    for i in range(k):
        r = run[i]
        c = ri[COMPUTED, r]
        if not _is_decode(ri, prompt, r, 1):
            return 0, 0
        residues[(c - cached_held[r] * unit_tokens) % block_size] += 1
        kv += c + 1
        run_len = min(run_len, ri[TARGET, r] - ri[GENERATED, r])
    return kv, run_len


@njit(cache=True, nogil=True, inline="always")
def _stretch_opens(g, gf, cfg, k, next_event, next_deadline, seen_delivery):
    """Whether a decode stretch whose first step decodes k requests may start at the clock:
    they fit the token budget (decode-first) and no delivery, deadline or limit is due at
    this boundary (``_fast_forward``)."""
    if k == 0 or (int(cfg[I_SCHEDULE_MODE]) != PREFILL_FIRST and k > int(cfg[I_MAX_BATCHED])):
        return False
    t = gf[CLOCK]
    return next_event > t and next_deadline > t and seen_delivery > _visible_until(gf, cfg)


@njit(cache=True, nogil=True, _nrt=False)
def _fast_forward(ri, g, gf, series, run, cached_held, prompt, tables, cfg, unit_tokens, next_event, next_deadline,
                  truly_free, evictable, start_free, seen_delivery, ghost_decodes, ghost_kv):
    """Run consecutive all-decode steps that the step-by-step loop would form identically.

    Applies while every running request is decoding, no delivery, deadline or limit
    (``next_event``) is due at a boundary, the new blocks fit (``truly_free``: free
    without evicting cached prefixes, then ``evictable`` blocks of idle cached ones, which
    the step-by-step loop evicts as its decodes need them; eviction takes single blocks
    from the LRU head, so the caller evicts the stretch's total at once with the same
    result) and free KV stays below ``start_free``, the level
    at which a waiting request would start (``_head_start_free``; ``NEVER`` if none
    waits). The stretch ends at the latest with the step in which the first requests
    reach their last token (``_end_fast_forward`` ends them). Each step costs one
    decode-attention lookup (the token-linear and lm-head parts are the same for the
    whole stretch); blocks come from a histogram of positions modulo the block size.
    Decode blocks never complete a prompt hash block, so the prefix cache only matters
    through ``truly_free`` and ``evictable``; ``_settle_fast_forward`` applies the
    per-request effects.
    Takes only the arrays it reads (each argument costs at every call). Under async
    scheduling the next delivery is ``seen_delivery`` instead (``next_event`` is the limit
    alone): a step's formation sees it only once the step before started at or after it
    (``pipeline._visible_until``). The first step also carries ``ghost_decodes`` thrown-away
    decodes reading ``ghost_kv`` KV tokens (requests that lingered for it and left as it was
    formed: ``pipeline._ghosts_change_nothing``; the caller checked ``_stretch_opens`` for
    it). Returns the steps taken, their summed seconds, the sum of step index times seconds
    (KV byte-seconds), whether the last step finished requests and the cached blocks to evict.
    """
    k = g[N_RUN]
    prefill_first = int(cfg[I_SCHEDULE_MODE]) == PREFILL_FIRST
    decode_blocks = 0 if prefill_first else k  # at most, before the layout says
    if (not _stretch_opens(g, gf, cfg, k, next_event, next_deadline, seen_delivery)
            or g[FREE] - decode_blocks >= start_free):
        return 0, 0.0, 0.0, False, 0
    seen = _visible_until(gf, cfg)
    block_size = int(cfg[I_BLOCK_SIZE])
    residues = g[G_RESIDUES:G_RESIDUES + block_size]
    kv, run_len = _decode_layout(ri, run, k, cached_held, prompt, unit_tokens, residues)
    if run_len == 0:
        return 0, 0.0, 0.0, False, 0
    if not prefill_first:
        decode_blocks = residues[0]
    if g[FREE] - decode_blocks >= start_free:
        return 0, 0.0, 0.0, False, 0  # free KV only shrinks: checking the first step is enough
    base = decode_run_base(tables, k)
    ntr = int(cfg[I_ADMISSION]) == ADMIT_NTR
    t = gf[CLOCK]
    busy = gf[BUSY]
    free = g[FREE]
    used = g[USED]
    peak = g[PEAK]
    out_of_range = 0
    t_sample = gf[SERIES_T0] + g[SAMPLE_K] * gf[SERIES_EVERY]  # next series grid time
    j = 0
    t_last = t
    slot = 0  # residue whose requests start a block at step j: -j modulo the block size
    sum_dt = 0.0
    sum_j_dt = 0.0  # for KV byte-seconds: context grows by one token per step
    evicted = 0
    near = 0  # the last step's histogram bin
    while j < run_len and next_event > t and next_deadline > t and seen_delivery > seen:
        need = residues[slot]
        short = need - truly_free
        if short > 0:
            if short > evictable:
                break
            evictable -= short
            evicted += short
            truly_free += short
        truly_free -= need
        free -= need
        used += need
        peak = max(peak, used)
        if j == 0 and ghost_decodes > 0:
            n = k + ghost_decodes
            dt, oor = step_seconds(tables, n, n, n, kv + ghost_kv, 0)
        else:
            dt, oor = decode_run_step(tables, base, kv)
        t_sample, near = _book_stretch_step(g, gf, series, t, dt, used, t_sample, near)
        if oor:
            out_of_range += 1
        t_last = t
        seen = t
        t = t + dt
        busy += dt
        if ntr:
            _decay_ratio(gf, cfg)
        kv += k
        sum_dt += dt
        sum_j_dt += j * dt
        j += 1
        slot = slot - 1 if slot > 0 else block_size - 1
    if j > 0:
        _note_step_tokens(g, gf, k + ghost_decodes)  # every step decodes the k running requests, the first more
        gf[PIPELINE_T] = t_last  # the step in flight when the next is formed (async scheduling)
    g[FREE] = free
    g[USED] = used
    g[PEAK] = peak
    g[STEPS] += j
    g[OUT_OF_RANGE] += out_of_range
    gf[BUSY] = busy
    gf[CLOCK] = t
    return j, sum_dt, sum_j_dt, j == run_len, evicted


@njit(cache=True, nogil=True, _nrt=False)
def _fast_forward_chunk(ri, g, gf, series, run, cached_held, prompt, ledger, tenant, tables, cfg, unit_tokens,
                        next_event, next_deadline, truly_free, seen_delivery):
    """Run consecutive steps of the same shape: every running request but the newest
    decodes, the newest computes a prompt chunk of a fixed size that does not finish its
    prefill (chunked prefill of a long prompt next to the same decodes).

    The step-by-step loop forms these steps identically while nothing is due (as
    ``_fast_forward``), the new blocks fit without eviction and no waiting request can
    start: none waits, or the decodes and the chunk take the whole token budget. Each
    step is one ``step_seconds`` lookup; the chunk's blocks, tokens and prompt-token
    charge are applied here, the decodes' by ``_settle_fast_forward`` (first k - 1
    running). The caller checked the modes (``_chunk_modes``). ``seen_delivery`` as in
    ``_fast_forward``. Returns the steps taken and whether the last one finished requests
    (``_end_fast_forward`` ends them).
    """
    k = g[N_RUN]
    d = k - 1  # decodes, scheduled before the chunk
    budget = int(cfg[I_MAX_BATCHED])
    seen = _visible_until(gf, cfg)
    if k == 0 or d >= budget or next_event <= gf[CLOCK] or next_deadline <= gf[CLOCK] or seen_delivery <= seen:
        return 0, False
    p = run[d]
    total = prompt[p] + ri[GENERATED, p]
    computed = ri[COMPUTED, p]
    chunk = budget - d
    # running and waiting stay as they are over the stretch (nothing arrives, starts or
    # ends before its last step), so every step has the threshold of the first
    threshold = _long_prefill_threshold(g, cfg)
    if 0 < threshold < chunk:
        chunk = threshold
    if computed + chunk >= total or cached_held[p] < ri[PC_REQ + pcm.R_N_FULL, p]:
        return 0, False  # the chunk would finish the prefill, or complete prompt hash blocks
    if g[N_WAIT] > 0 and d + chunk < budget:
        return 0, False  # a waiting request could start with the budget left
    block_size = int(cfg[I_BLOCK_SIZE])
    residues = g[G_RESIDUES:G_RESIDUES + block_size]
    run_len = np.iinfo(np.int64).max
    kv = 0
    if d > 0:
        kv, run_len = _decode_layout(ri, run, d, cached_held, prompt, unit_tokens, residues)
        if run_len == 0:
            return 0, False
    held_units = cached_held[p]
    held = ri[HELD, p]
    cost = cfg[I_W_IN] * chunk  # the chunk's prompt tokens, charged to its tenant as scheduled
    t = gf[CLOCK]
    busy = gf[BUSY]
    free = g[FREE]
    used = g[USED]
    peak = g[PEAK]
    out_of_range = 0
    t_sample = gf[SERIES_T0] + g[SAMPLE_K] * gf[SERIES_EVERY]
    j = 0
    t_last = t
    slot = 0  # as in ``_fast_forward``
    near = 0
    while j < run_len and computed + chunk < total and next_event > t and next_deadline > t and seen_delivery > seen:
        held_after = pcm.private_blocks(computed + chunk, held_units, unit_tokens, block_size)
        need = held_after - held
        if d > 0:
            need += residues[slot]
        if need > truly_free:
            break
        truly_free -= need
        free -= need
        used += need
        peak = max(peak, used)
        held = held_after
        ledger[fm.TS_SERVICE, tenant[p]] += cost
        ledger[fm.TS_COUNTER, tenant[p]] += cost / ledger[fm.TS_WEIGHT, tenant[p]]
        pairs = chunk * computed + chunk * (chunk + 1) // 2
        dt, oor = step_seconds(tables, d + chunk, d, d, kv, pairs)
        t_sample, near = _book_stretch_step(g, gf, series, t, dt, used, t_sample, near)
        if oor:
            out_of_range += 1
        t_last = t
        seen = t
        t = t + dt
        busy += dt
        kv += d
        computed += chunk
        j += 1
        slot = slot - 1 if slot > 0 else block_size - 1
    if j == 0:
        return 0, False
    ri[COMPUTED, p] = computed
    ri[HELD, p] = held
    _cover_reservation(ri, g, p)
    g[FREE] = free
    g[USED] = used
    g[PEAK] = peak
    g[STEPS] += j
    g[PREFILL_TOKENS] += j * chunk
    g[OUT_OF_RANGE] += out_of_range
    _note_step_tokens(g, gf, d + chunk)
    gf[PIPELINE_T] = t_last
    gf[BUSY] = busy
    gf[CLOCK] = t
    return j, j == run_len


@njit(cache=True, nogil=True, _nrt=False)
def _chunk_modes(cfg, quotas, hand_off):
    """Modes under which ``_fast_forward_chunk`` applies: decode-first scheduling, no
    step-time cap, quota or max wait (its expiries need every boundary), no batch wait
    (its count moves at every boundary), admission by free KV or reservation, prompt tokens
    as the cost unit (charged per scheduled chunk, not per step) and no P/D hand-off."""
    mode = int(cfg[I_ADMISSION])
    return (int(cfg[I_SCHEDULE_MODE]) != PREFILL_FIRST and cfg[I_STEP_CAP_MS] <= 0.0 and not quotas
            and cfg[I_MAX_WAIT] <= 0.0 and not _batch_waits(cfg) and mode != ADMIT_NTR
            and int(cfg[I_COST_UNIT]) == fm.TOKENS and not hand_off)


@njit(cache=True, nogil=True, _nrt=False)
def _end_fast_forward(rep, st, cfg):
    """End the requests that reached their last token in a stretch's final step, in
    batch (admission) order, as ``_end_step`` would."""
    ri, g = rep.ri, rep.g
    run, order = rep.lists[L_RUN], rep.lists[L_ORDER]
    t_end = rep.gf[CLOCK]
    k = g[N_RUN]
    _copy_running(order, run, k)  # ending edits `run`
    for i in range(k):
        r = order[i]
        if ri[GENERATED, r] < ri[TARGET, r]:
            continue
        _end_done(rep, st, cfg, r, t_end)


@njit(cache=True, nogil=True, _nrt=False)
def _settle_fast_forward(ri, g, gf, run, k, cached_held, si, ledger, cfg, unit_tokens, j, sum_dt, sum_j_dt):
    """Apply j fast-forwarded decode steps to the first k running requests: tokens,
    blocks, reservations and their tenants' usage and charge."""
    tenant = si[S_TENANT]
    block_size = int(cfg[I_BLOCK_SIZE])
    unit = int(cfg[I_COST_UNIT])
    quotas = g[QUOTAS] != 0
    kv_bytes = gf[KV_BYTES]
    for i in range(k):
        r = run[i]
        c = ri[COMPUTED, r]
        ri[COMPUTED, r] += j
        ri[GENERATED, r] += j
        ri[SAMPLED_AT, r] = g[STEPS]
        before = ri[HELD, r]
        ri[HELD, r] = pcm.private_blocks(ri[COMPUTED, r], cached_held[r], unit_tokens, block_size)
        if quotas:
            fm.hold_kv(fm.Shares(ledger[:fm.N_TENANT_ROWS], ledger[fm.N_TENANT_ROWS:]), tenant[r], si[S_CLASS, r],
                       ri[HELD, r] - before)
        _cover_reservation(ri, g, r)
        if unit == fm.TOKENS:
            cost = cfg[I_W_OUT] * j
        elif unit == fm.GPU_TIME:
            cost = sum_dt / k
        else:
            cost = kv_bytes * ((c + 1) * sum_dt + sum_j_dt)
        ledger[fm.TS_SERVICE, tenant[r]] += cost  # fm.charge, inlined
        ledger[fm.TS_COUNTER, tenant[r]] += cost / ledger[fm.TS_WEIGHT, tenant[r]]


@njit(cache=True, nogil=True, _nrt=False)
def _stuck_modes(cfg, quotas):
    """Modes under which a blocked waiting head stays blocked while decodes only grow:
    admission by free KV or reservation (new_token_ratio decays, so it may unblock), no
    step-time cap, quota, max wait or batch wait, and a static queue order (EDF rejects by the clock,
    VTC reorders by counters, LPM and DFS_WEIGHT by cached prefixes, which decodes may
    evict)."""
    mode = int(cfg[I_ADMISSION])
    order = int(cfg[I_POLICY])
    return (mode != ADMIT_NTR and cfg[I_STEP_CAP_MS] <= 0.0 and not quotas and cfg[I_MAX_WAIT] <= 0.0
            and not _batch_waits(cfg)
            and order != EDF and order != VTC
            and not ((order == LPM or order == DFS_WEIGHT) and cfg[I_PREFIX_CACHING] != 0.0))
