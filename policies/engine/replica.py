"""A resumable replica: ``new_replica`` (every buffer preallocated), ``deliver``, ``advance``
(the step loop: boundary events, a stretch or one formed step, its time, its end) under a
progress guard, and ``write_outputs``.
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
from policies import speculative as spm
from policies.engine.admission import _head_start_free
from policies.engine.codes import (
    ERROR_NO_PROGRESS,
    ERROR_STALLED,
    I_ASYNC,
    I_BLOCK_SIZE,
    I_CHUNKED,
    I_HEADROOM,
    I_LORA,
    I_LORA_BASE_SLOT,
    I_LORA_POLICY,
    I_LORA_PRELOAD,
    I_LORA_RANK,
    I_MAX_BATCHED,
    I_MAX_CPU_LORAS,
    I_MAX_LORAS,
    I_MAX_MODEL_LEN,
    I_MAX_WAIT,
    I_POLICY,
    I_PREFIX_CACHING,
    I_SCHEDULE_MODE,
    I_SPEC_GAMMA,
    I_SPEC_MODE,
    N_SPEC_I,
    NEVER,
    O_FINISH,
    O_FIRST_SCHED,
    O_FIRST_TOKEN,
    O_GENERATED,
    O_PREEMPTS,
    O_REASON,
    O_STATE,
    P_EVICTIONS,
    P_HIT_TOKENS,
    P_QUERY_TOKENS,
    P_SAVED_S,
    PREFILL_FIRST,
    VTC,
)
from policies.engine.events import _arrive, _expire, _next_deadline, _next_delivery
from policies.engine.fast_forward import (
    _chunk_modes,
    _end_fast_forward,
    _fast_forward,
    _fast_forward_chunk,
    _settle_fast_forward,
    _stretch_opens,
    _stuck_modes,
)
from policies.engine.formation import _form_batch, _ntr_init
from policies.engine.pipeline import (
    _ghosts_change_nothing,
    _pipeline_formed,
    _release_ghosts,
    _visible_until,
    drain_pipeline,
)
from policies.engine.state import (
    Replica,
    _adapter_state,
    _adapter_tokens,
    _cache,
    _is_decode,
    _pool,
    _queue,
    _shares,
)
from policies.engine.step_end import _book_step, _end_step, _sample_until
from policies.engine.verify import _plan_verify, _settle_verify
from policies.kernel_state import (
    AD_BASE,
    AD_BYTES,
    AD_COLUMNS,
    AD_DISK_BW,
    AD_DISK_LOADS,
    AD_LOAD_S,
    AD_LOADS,
    AD_POOL_ROW,
    AD_SKIP_ROW,
    ADVANCES,
    B_DECODES,
    B_KV_DECODE,
    B_LOGITS,
    B_PAIRS,
    B_PREFILL,
    B_TOKENS,
    BUSY,
    C_AD_DISK_LOADS,
    C_AD_LOADS,
    C_CAP,
    C_ENDED_END,
    C_ERROR,
    C_HOST_USED_END,
    C_ITERATIONS,
    C_N_SAMPLES,
    C_OUT_OF_RANGE,
    C_PEAK,
    C_PEAK_STEP,
    C_PREFILL_TOKENS,
    C_RESERVED_END,
    C_RUNNING_END,
    C_SPEC_ACCEPTED,
    C_SPEC_DECODES,
    C_SPEC_DRAFTED,
    C_SPEC_VERIFIES,
    C_STEP_HIST,
    C_STEPS,
    C_SWAP_OUTS,
    C_USED_END,
    C_WAITING_END,
    CACHED_FIRST,
    CACHING,
    CAP,
    DELIVERED,
    DONE,
    DRAFT_S,
    ENTRY_BLOCKS,
    ERROR,
    F_AD_LOAD_S,
    F_BUSY,
    F_END,
    F_PEAK_STEP_S,
    FAST_FORWARD,
    FINISH,
    FIRST_SCHED,
    FIRST_TOKEN,
    FREE,
    G_RESIDUES,
    G_STEP_HIST,
    GENERATED,
    GHOSTS,
    HAND_OFF,
    HEADROOM,
    HOST_CAP,
    HOST_FREE,
    INBOX_HEAD,
    ITERATIONS,
    KV_BLOCK_SIZE,
    KV_BYTES,
    L_DHEAP,
    L_INBOX,
    L_RUN,
    LEFT_WAITING,
    LORA,
    LORA_ADAPTERS,
    LORA_BYTES_PER_RANK,
    LORA_DISK_BW,
    MAX_LEN,
    N_BATCH,
    N_DELIVERED,
    N_DONE,
    N_FL,
    N_GF,
    N_LISTS,
    N_OUTBOX,
    N_RF,
    N_RI,
    N_RUN,
    N_SAMPLES,
    N_WAIT,
    NEXT_DELIVERY,
    NOT_ARRIVED,
    OUT_OF_RANGE,
    PC_REQ,
    PC_STATS,
    PEAK,
    PEAK_STEP,
    PEAK_STEP_S,
    PER_ENTRY,
    PIPELINE_T,
    PRED_BIN,
    PREEMPTED_NOW,
    PREEMPTS,
    PREFILL_TOKENS,
    PREFIX_HIT,
    PREFIX_QUERY,
    PREFIX_SAVED_S,
    PROGRESS_BASE,
    PROGRESS_PER,
    QUOTAS,
    RATIO,
    REASON,
    RESERVED_TOTAL,
    RNG_COUNTER,
    RNG_SEED,
    S_N_FULL,
    S_PROMPT,
    S_TENANT,
    SAMPLED_AT,
    SERIES_CAPACITY,
    SERIES_EVERY,
    SERIES_T0,
    SPEC_ACCEPTED,
    SPEC_DECODES,
    SPEC_DRAFTED,
    SPEC_HITS,
    SPEC_LAG,
    SPEC_SLOTS,
    SPEC_TRIALS,
    SPEC_VERIFIES,
    STATE,
    STATUS,
    STEPS,
    STUCK_MODES,
    SWAP_BW,
    SWAP_OUTS,
    SWAP_S,
    UNIT_TOKENS,
    USED,
    VLLM_CACHE,
)
from policies.kernel_state import T as CLOCK
from policies.result import STEP_HIST_BINS


@njit(cache=True, nogil=True, _nrt=True)
def new_replica(st, cfg, cap_blocks, host_blocks, kv_bytes, swap_bw, seed, series_every, fast_forward,
                tenant_params, class_params, t0):
    """A replica with nothing delivered, clock ``t0``, every buffer sized for the trace.

    ``cap_blocks``/``host_blocks``: GPU and host KV blocks (``validate``); ``kv_bytes``:
    KV bytes per token; ``swap_bw``: host copy bytes per second; ``seed``: the RNG seed
    of stochastic features; ``series_every``: spacing of the sampled series;
    ``tenant_params``/``class_params``: ``policies.fairness.side_params`` for ``cfg``. Its
    progress guard has the default bound for the trace (``bound_progress`` changes it).
    """
    n = st.sf.shape[1]
    block_size = int(cfg[I_BLOCK_SIZE])
    ri = np.zeros((N_RI, n), dtype=np.int64)
    ri[STATUS] = NOT_ARRIVED
    ri[SAMPLED_AT] = -1
    g = np.zeros(G_RESIDUES + block_size, dtype=np.int64)
    gf = np.zeros(N_GF)
    g[CAP] = cap_blocks
    g[HEADROOM] = int(cfg[I_HEADROOM] * cap_blocks)
    g[FREE] = cap_blocks
    g[HOST_FREE] = host_blocks
    g[HOST_CAP] = host_blocks
    g[PRED_BIN] = -1
    g[RNG_SEED] = seed
    g[RNG_COUNTER] = 0
    max_len = int(cfg[I_MAX_MODEL_LEN])
    g[MAX_LEN] = max_len if max_len > 0 else cap_blocks * block_size
    if cfg[I_CHUNKED] == 0.0:
        g[MAX_LEN] = min(g[MAX_LEN], int(cfg[I_MAX_BATCHED]))
    gf[RATIO] = _ntr_init(cfg)
    gf[CLOCK] = t0
    gf[SERIES_T0] = t0
    gf[SERIES_EVERY] = series_every
    gf[KV_BYTES] = kv_bytes
    gf[SWAP_BW] = swap_bw
    gf[NEXT_DELIVERY] = np.inf
    gf[PEAK_STEP_S] = np.nan
    gf[PIPELINE_T] = np.nan
    caching = cfg[I_PREFIX_CACHING] != 0.0
    g[KV_BLOCK_SIZE] = block_size
    quotas = (np.any(tenant_params[:, fm.T_KV_QUOTA] < 1.0) or np.any(tenant_params[:, fm.T_TOKEN_QUOTA] < 1.0)
              or np.any(class_params[:, fm.C_HEADROOM] > 0.0) or np.any(class_params[:, fm.C_KV_SHARE] < 1.0)
              or np.any(class_params[:, fm.C_TOKEN_SHARE] < 1.0))
    g[CACHING] = 1 if caching else 0
    # vLLM hashes every full block, generated tokens too; SGLang's retraction frees the KV
    # without caching it (srt/managers/schedule_batch.py:2388-2389)
    g[VLLM_CACHE] = 1 if (caching and int(cfg[I_SCHEDULE_MODE]) != PREFILL_FIRST
                        and st.block_tokens % block_size == 0) else 0
    g[UNIT_TOKENS], g[ENTRY_BLOCKS], g[PER_ENTRY] = pcm.unit_shape(st.block_tokens, block_size, g[VLLM_CACHE] != 0)
    g[QUOTAS] = 1 if quotas else 0
    g[STUCK_MODES] = 1 if _stuck_modes(cfg, quotas) else 0
    g[FAST_FORWARD] = 1 if fast_forward else 0
    g[PROGRESS_BASE], g[PROGRESS_PER] = default_progress_budget(n)
    speculating = int(cfg[I_SPEC_MODE]) != spm.MODE_OFF  # its rows are allocated only when on
    lora = cfg[I_LORA] != 0.0  # so are the adapter pool's (lists) and the skipped requests' (fl)
    g[AD_POOL_ROW] = N_LISTS + (N_SPEC_I if speculating else 0)
    g[AD_SKIP_ROW] = N_FL + (1 if speculating else 0)
    lists = np.zeros((g[AD_POOL_ROW] + (adm.N_ROWS if lora else 0), n + 1), dtype=np.int64)
    fl = np.zeros((g[AD_SKIP_ROW] + (3 if lora else 0), n))
    pool = int(cap_blocks) if g[VLLM_CACHE] else 0  # a live copy or split unit holds a KV block at least
    entries = np.empty((pcm.N_ENTRY_ROWS, st.n_entries + n + pool if caching else 0), dtype=np.int64)
    lanes = np.empty((qm.N_LANE_ROWS, st.lane_tenant.shape[0]), dtype=np.int64)
    ledger = np.empty((fm.N_TENANT_ROWS + fm.N_CLASS_ROWS, max(tenant_params.shape[0], class_params.shape[0])))
    rf = np.full((N_RF, n), np.nan)
    rf[SPEC_HITS] = 0.0
    rf[SPEC_TRIALS] = 0.0
    base_slot = lora and cfg[I_LORA_BASE_SLOT] != 0.0
    adapters = int(st.lora[0, LORA_ADAPTERS])
    g[AD_COLUMNS] = adapters + (1 if base_slot else 0) if lora else 0  # at most n + 1: adapters in use
    rep = Replica(ri, rf, g, gf, lists, fl, entries, pcm.new_unit_table(pool), lanes, ledger,
                  np.zeros((SERIES_CAPACITY, 4)), np.zeros((n if speculating else 0, int(cfg[I_SPEC_GAMMA]))))
    g[LORA] = 1 if lora else 0
    g[AD_BASE] = adapters if base_slot else -1
    if lora:
        gf[AD_BYTES] = st.lora[0, LORA_BYTES_PER_RANK] * cfg[I_LORA_RANK]
        gf[AD_DISK_BW] = st.lora[0, LORA_DISK_BW]
        slots = int(cfg[I_MAX_LORAS])
        host = int(cfg[I_MAX_CPU_LORAS])
        host = (host if host > 0 else slots) + (1 if base_slot else 0)  # the base column needs no host entry
        preload = cfg[I_LORA_PRELOAD] != 0.0
        adm.clear(_pool(rep), _adapter_state(rep), slots, max(host, g[AD_COLUMNS]) if preload else host,
                  int(cfg[I_LORA_POLICY]), preload)
    pcm.clear(_cache(rep, st), st.si[S_N_FULL] if caching else np.zeros(n, dtype=np.int64))
    qm.clear(_queue(rep, st), st.lane_tenant)
    fm.clear(_shares(rep), tenant_params, class_params)
    return rep


@njit(cache=True, nogil=True, _nrt=False)
def default_progress_budget(units):
    """The default (base, per) of a progress guard: a loop may iterate base + per *
    progress times, for a run with ``units`` units of work known up front (requests, and
    for a fleet failure events and replicas). A correct run iterates at most about twice
    per unit of progress (``_progress``); the bound is generous, and cheap to reach when a
    loop spins. Callable from Python too."""
    return 16 * units + 1024, 4


@njit(cache=True, nogil=True, _nrt=False)
def bound_progress(rep, budget):
    """Bound the replica's progress guard by ``budget``: i8[2] (base, per)."""
    rep.g[PROGRESS_BASE] = budget[0]
    rep.g[PROGRESS_PER] = budget[1]


@njit(cache=True, nogil=True, inline="always")
def _progress(g):
    """The replica's progress counters summed: steps taken, deliveries admitted or
    rejected, requests ended and calls of ``advance``. Every iteration of ``advance``'s
    loop moves one, or is followed by one that does (an idle jump by an arrival, a step
    that only preempted by a step), but the idle jump to a call's limit."""
    return g[STEPS] + g[INBOX_HEAD] + g[N_DONE] + g[ADVANCES]


@njit(cache=True, nogil=True, _nrt=False)
def deliver(rep, r, t):
    """Request r reaches the replica's inbox at time t (times never decrease)."""
    g = rep.g
    inbox = rep.lists[L_INBOX]
    ring = inbox.shape[0] - 1
    tail = g[N_DELIVERED]
    if tail - g[INBOX_HEAD] >= ring:
        raise ValueError("deliver: the inbox already holds every request")
    if tail > 0 and t < rep.rf[DELIVERED, inbox[(tail - 1) % ring]]:
        raise ValueError("deliver: delivery times must not decrease")
    inbox[tail % ring] = r
    rep.rf[DELIVERED, r] = t
    if tail == g[INBOX_HEAD]:
        rep.gf[NEXT_DELIVERY] = t
    g[N_DELIVERED] = tail + 1


@njit(cache=True, nogil=True, _nrt=False)
def advance(rep, st, tables, cfg, t_limit):
    """Run the steps that start before ``t_limit`` (see the ``policies.engine`` docstring)."""
    _advance(rep, st, tables, cfg, t_limit, False)


@njit(cache=True, nogil=True, _nrt=False)
def advance_through(rep, st, tables, cfg, t):
    """``advance`` that also runs the step starting at ``t`` (the fleet watching a
    replica's step ends calls it at t = the replica's clock)."""
    _advance(rep, st, tables, cfg, t, True)


@njit(cache=True, nogil=True, _nrt=False)
def _advance(rep, st, tables, cfg, t_limit, through):
    """``advance`` (``through``: steps starting at ``t_limit`` too).
    Helpers are called only when they have work."""
    ri, g, gf, series = rep.ri, rep.g, rep.gf, rep.series
    dheap, run = rep.lists[L_DHEAP], rep.lists[L_RUN]
    cached_held, unit_tokens = ri[PC_REQ + pcm.R_HELD], g[UNIT_TOKENS]
    prompt = st.si[S_PROMPT]
    speculating = int(cfg[I_SPEC_MODE]) != spm.MODE_OFF
    # every speculative step draws its own outcomes; VTC keeps exact counters step by step
    # (nor LoRA: stretches time steps without the adapters' GEMMs)
    fast_forward = g[FAST_FORWARD] != 0 and not speculating and int(cfg[I_POLICY]) != VTC and g[LORA] == 0
    hand_off = g[HAND_OFF] != 0
    chunk_stretches = fast_forward and _chunk_modes(cfg, g[QUOTAS] != 0, hand_off)
    if g[ERROR] != 0:
        return  # a replica in error runs no more: its state is not to be trusted
    g[ADVANCES] += 1
    while g[N_DONE] < g[N_DELIVERED] or g[GHOSTS] > 0:  # lingering requests may still decode once
        t = gf[CLOCK]
        if t > t_limit or (t == t_limit and not through):
            break
        g[ITERATIONS] += 1
        if g[ITERATIONS] > g[PROGRESS_BASE] + g[PROGRESS_PER] * _progress(g):
            g[ERROR] = ERROR_NO_PROGRESS  # the loop spins: stop, reported instead of hanging
            return
        seen = _visible_until(gf, cfg)
        if _next_delivery(rep) <= seen:
            _arrive(rep, st, tables, cfg, seen)
        if dheap[0] > 0 or cfg[I_MAX_WAIT] > 0.0:
            _expire(rep, st, cfg, t)
        if g[N_DONE] == g[N_DELIVERED] and g[GHOSTS] == 0:
            break
        if g[N_RUN] == 0 and g[N_WAIT] == 0:  # idle: jump to the next delivery (or the limit)
            if not math.isnan(gf[PIPELINE_T]):
                gf[PIPELINE_T] = np.nan  # nothing in flight: what has arrived by now is seen now
                continue
            _idle_until(g, gf, series, cfg, min(_next_delivery(rep), t_limit))
            continue
        # under async scheduling a delivery is seen a step late, and requests that ended with the
        # last step leave at once when they cannot change the step (``_ghosts_change_nothing``)
        lagged = cfg[I_ASYNC] != 0.0
        next_event = t_limit if lagged else min(_next_delivery(rep), t_limit)
        seen_delivery = _next_delivery(rep) if lagged else np.inf
        next_deadline = _next_deadline(rep, st) if fast_forward and dheap[0] > 0 else np.inf  # stretches only
        ghost_decodes, ghost_kv = 0, 0
        if fast_forward and g[GHOSTS] > 0 and g[N_WAIT] == 0:
            need, ghost_decodes, ghost_kv = _ghosts_change_nothing(rep, st, cfg)
            # a thrown-away decode must run in some step: they leave only if a stretch carries it
            live = g[N_RUN] - g[GHOSTS]
            if need >= 0 and (ghost_decodes == 0 or (live > 0 and _stretch_opens(
                    g, gf, cfg, live + ghost_decodes, next_event, next_deadline, seen_delivery))):
                g[PEAK] = max(g[PEAK], g[USED] + need)  # the step's blocks come while they still hold theirs
                _release_ghosts(rep, st)
            else:
                ghost_decodes, ghost_kv = 0, 0
        # with requests waiting, a stretch is tried only while the queue stays backed up (an
        # arrival to a queue the last step emptied almost always starts at once) and the
        # newest running request decodes (else no stretch starts)
        if fast_forward and (g[N_WAIT] == 0 or (g[STUCK_MODES] != 0 and g[LEFT_WAITING] > 0 and g[N_RUN] > 0
                                                  and _is_decode(ri, prompt, run[g[N_RUN] - 1], 1))):
            start_free = _head_start_free(rep, st, cfg) if g[N_WAIT] > 0 else NEVER
            evictable = g[PC_STATS + pcm.S_EVICTABLE]
            j, sum_dt, sum_j_dt, finished, evict = _fast_forward(ri, g, gf, series, run, cached_held, prompt, tables,
                                                                 cfg, unit_tokens, next_event, next_deadline,
                                                                 g[FREE] - evictable, evictable, start_free,
                                                                 seen_delivery, ghost_decodes, ghost_kv)
            if evict > 0:
                pcm.evict(_cache(rep, st), evict)
            if j > 0:
                _settle_fast_forward(ri, g, gf, run, g[N_RUN], cached_held, st.si, rep.ledger, cfg, unit_tokens, j,
                                     sum_dt, sum_j_dt)
                if finished:
                    _end_fast_forward(rep, st, cfg)
                continue
        if chunk_stretches and g[N_RUN] > 0:
            truly_free = g[FREE] - g[PC_STATS + pcm.S_EVICTABLE]
            j, finished = _fast_forward_chunk(ri, g, gf, series, run, cached_held, prompt, rep.ledger, st.si[S_TENANT],
                                              tables, cfg, unit_tokens, next_event, next_deadline, truly_free,
                                              seen_delivery)
            if j > 0:
                _settle_fast_forward(ri, g, gf, run, g[N_RUN] - 1, cached_held, st.si, rep.ledger, cfg, unit_tokens,
                                     j, 0.0, 0.0)
                if finished:
                    _end_fast_forward(rep, st, cfg)
                continue
        dt, oor = _form_or_restart(rep, st, tables, cfg, speculating)
        if dt < 0.0:
            if g[PREEMPTED_NOW] != 0 or g[N_RUN] + g[N_WAIT] == 0:
                continue  # the step only preempted or rejected (edf); admission resumes at once
            g[ERROR] = ERROR_STALLED
            return
        _commit_step(rep, st, cfg, dt, oor)
        if hand_off and g[N_OUTBOX] > 0:
            break  # the fleet sends what this step handed off before time moves on
    if gf[CLOCK] < t_limit and t_limit < np.inf and g[N_RUN] + g[N_WAIT] == 0 and _next_delivery(rep) >= t_limit:
        _idle_until(g, gf, series, cfg, t_limit)


@njit(cache=True, nogil=True, _nrt=False)
def _form_or_restart(rep, st, tables, cfg, speculating):
    """``_form_step`` under async scheduling (``policies.engine.pipeline``): a batch formed
    empty while one was in flight makes the engine wait for that one's outputs and form
    again at once, with what has arrived by now; a formed step releases the requests that
    lingered for it and is the one in flight when the next is formed."""
    dt, oor = _form_step(rep, st, tables, cfg, speculating)
    if cfg[I_ASYNC] == 0.0:
        return dt, oor
    t = rep.gf[CLOCK]
    if dt < 0.0 and not math.isnan(rep.gf[PIPELINE_T]):
        drain_pipeline(rep, st)
        if _next_delivery(rep) <= t:
            _arrive(rep, st, tables, cfg, t)
        if rep.lists[L_DHEAP][0] > 0 or cfg[I_MAX_WAIT] > 0.0:
            _expire(rep, st, cfg, t)
        dt, oor = _form_step(rep, st, tables, cfg, speculating)
    if dt < 0.0:
        drain_pipeline(rep, st)
    else:
        _pipeline_formed(rep, st, t)
    return dt, oor


@njit(cache=True, nogil=True, _nrt=False)
def _form_step(rep, st, tables, cfg, speculating):
    """Form the step starting at the clock and time it: (its seconds, copies included;
    whether the tables were read beyond their range), or (-1, False) when it holds no
    tokens (``N_BATCH`` is then 0). Speculative outcomes are settled here."""
    g, gf = rep.g, rep.gf
    g[PREEMPTED_NOW] = 0
    gf[SWAP_S] = 0.0
    g[B_TOKENS] = 0
    g[B_LOGITS] = 0
    g[B_DECODES] = 0
    g[B_KV_DECODE] = 0
    g[B_PAIRS] = 0
    g[B_PREFILL] = 0
    _form_batch(rep, st, tables, cfg)
    g[LEFT_WAITING] = g[N_WAIT]
    if g[B_TOKENS] == 0:
        g[N_BATCH] = 0
        return -1.0, False
    if speculating and g[B_DECODES] > 0:
        gf[DRAFT_S] = 0.0
        _plan_verify(rep, st, tables, cfg, st.spec)
    if speculating and int(cfg[I_SPEC_MODE]) == spm.MODE_BATCH_SCHEDULE:
        g[SPEC_LAG] = g[N_BATCH]  # sets the k of the drafts proposed after this step
    dt, oor = step_seconds(tables, g[B_TOKENS], g[B_LOGITS], g[B_DECODES], g[B_KV_DECODE], g[B_PAIRS])
    if g[LORA] != 0:
        dt += adm.step_seconds(st.lora[1:], cfg[I_LORA_RANK], _adapter_tokens(rep, st))
    if speculating and g[SPEC_SLOTS] > 0:
        dt += gf[DRAFT_S]
        _settle_verify(rep, st, cfg, st.spec)
    return dt + gf[SWAP_S], oor


@njit(cache=True, nogil=True, _nrt=False)
def _commit_step(rep, st, cfg, dt, oor):
    """End the formed step after ``dt`` seconds and move the clock there."""
    g, gf = rep.g, rep.gf
    t_end = _book_step(g, gf, rep.series, cfg, dt, oor)
    _end_step(rep, st, cfg, t_end, dt)
    gf[CLOCK] = t_end


@njit(cache=True, nogil=True, _nrt=False)
def _idle_until(g, gf, series, cfg, t):
    """Nothing runs or waits: sample the idle state and move the clock to t."""
    _sample_until(g, gf, series, t)
    gf[RATIO] = _ntr_init(cfg)
    gf[CLOCK] = t
    gf[PIPELINE_T] = np.nan


@njit(cache=True, nogil=True, _nrt=True)
def write_outputs(rep, out_i, out_f, out_counts, out_fcounts, series, out_cached, out_service, out_prefix):
    """Per-request outputs of the requests that ended on this replica, and its counters.

    out_i[4, n]: state, reject reason, tokens generated, preemptions; out_f[3, n]: first
    token, finish, first scheduled; out_counts / out_fcounts: run counters (C_*, F_*; the
    step-time histogram at C_STEP_HIST);
    series[SERIES_CAPACITY, 4]: (t, KV blocks used, running, waiting); out_cached[n]:
    cached prompt tokens at first schedule; out_service[T]: service charged per tenant;
    out_prefix[N_PREFIX]: prefix-cache figures (P_*).
    """
    ri, rf, g, gf = rep.ri, rep.rf, rep.g, rep.gf
    for r in range(ri.shape[1]):
        if ri[STATUS, r] != DONE:
            continue
        out_i[O_STATE, r] = ri[STATE, r]
        out_i[O_REASON, r] = ri[REASON, r]
        out_i[O_GENERATED, r] = ri[GENERATED, r]
        out_i[O_PREEMPTS, r] = ri[PREEMPTS, r]
        out_f[O_FIRST_TOKEN, r] = rf[FIRST_TOKEN, r]
        out_f[O_FINISH, r] = rf[FINISH, r]
        out_f[O_FIRST_SCHED, r] = rf[FIRST_SCHED, r]
        out_cached[r] = ri[CACHED_FIRST, r]
    out_counts[C_STEPS] = g[STEPS]
    out_counts[C_OUT_OF_RANGE] = g[OUT_OF_RANGE]
    out_counts[C_PREFILL_TOKENS] = g[PREFILL_TOKENS]
    out_counts[C_CAP] = g[CAP]
    out_counts[C_PEAK] = g[PEAK]
    out_counts[C_SWAP_OUTS] = g[SWAP_OUTS]
    out_counts[C_N_SAMPLES] = g[N_SAMPLES]
    out_counts[C_USED_END] = g[USED]
    out_counts[C_RESERVED_END] = g[RESERVED_TOTAL]
    out_counts[C_HOST_USED_END] = g[HOST_CAP] - g[HOST_FREE]
    out_counts[C_ERROR] = g[ERROR]
    out_counts[C_ITERATIONS] = g[ITERATIONS]
    out_counts[C_RUNNING_END] = g[N_RUN]
    out_counts[C_WAITING_END] = g[N_WAIT]
    out_counts[C_ENDED_END] = g[N_DONE]
    out_counts[C_SPEC_DECODES] = g[SPEC_DECODES]
    out_counts[C_SPEC_VERIFIES] = g[SPEC_VERIFIES]
    out_counts[C_SPEC_DRAFTED] = g[SPEC_DRAFTED]
    out_counts[C_SPEC_ACCEPTED] = g[SPEC_ACCEPTED]
    out_counts[C_PEAK_STEP] = g[PEAK_STEP]
    out_counts[C_AD_LOADS] = g[AD_LOADS]
    out_counts[C_AD_DISK_LOADS] = g[AD_DISK_LOADS]
    out_counts[C_STEP_HIST:C_STEP_HIST + STEP_HIST_BINS] = g[G_STEP_HIST:G_STEP_HIST + STEP_HIST_BINS]
    out_fcounts[F_BUSY] = gf[BUSY]
    out_fcounts[F_END] = gf[CLOCK]
    out_fcounts[F_PEAK_STEP_S] = gf[PEAK_STEP_S]
    out_fcounts[F_AD_LOAD_S] = gf[AD_LOAD_S]
    series[:] = rep.series
    out_service[:] = rep.ledger[fm.TS_SERVICE, :out_service.shape[0]]
    out_prefix[P_HIT_TOKENS] = gf[PREFIX_HIT]
    out_prefix[P_QUERY_TOKENS] = gf[PREFIX_QUERY]
    out_prefix[P_SAVED_S] = gf[PREFIX_SAVED_S]
    out_prefix[P_EVICTIONS] = g[PC_STATS + pcm.S_EVICTIONS]
