"""The end of a step: tokens advanced and sampled, finished requests ended (or handed off),
prompt blocks entered in the prefix cache, the predicted-admission calibration, and the
step's time booked into the counters and the sampled series.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from policies import fairness as fm
from policies import prefix_cache as pcm
from policies.engine.codes import (
    ADMIT_NTR,
    ADMIT_PREDICTED,
    I_ADMISSION,
    I_ASYNC,
    I_BLOCK_SIZE,
    I_COST_UNIT,
    I_QUANTILE,
    I_W_OUT,
    R_NONE,
    S_FINISHED,
)
from policies.engine.formation import _decay_ratio
from policies.engine.pipeline import _linger
from policies.engine.state import (
    _cache_prompt_blocks,
    _end_by_deadline,
    _end_request,
    _shares,
    _vacate,
)
from policies.kernel_state import (
    B_DECODES,
    B_PREFILL,
    B_TOKENS,
    BUSY,
    CACHING,
    COMPUTED,
    FIRST_TOKEN,
    G_HIST,
    G_STEP_HIST,
    GENERATED,
    HAND_OFF,
    KV_BYTES,
    L_BATCH,
    L_OUTBOX,
    MAX_OUT,
    MIN_CALIBRATION,
    N_BATCH,
    N_CALIBRATED,
    N_OUTBOX,
    N_RUN,
    N_SAMPLES,
    N_WAIT,
    NOT_ARRIVED,
    OUT_OF_RANGE,
    PC_REQ,
    PEAK_STEP,
    PEAK_STEP_S,
    PRED_BIN,
    PREFILL_TOKENS,
    S_DEADLINE,
    S_PROMPT,
    S_TENANT,
    SAMPLE_K,
    SAMPLED_AT,
    SCHED,
    SERIES_EVERY,
    SERIES_T0,
    STATUS,
    STEPS,
    TARGET,
    USED,
    VLLM_CACHE,
)
from policies.kernel_state import T as CLOCK
from policies.result import STEP_HIST_EDGES, STEP_HIST_MIN_S


@njit(cache=True, nogil=True, _nrt=False)
def _calibrate(ri, g, hist, cfg, r):
    """predicted mode: add a finished request's output/max_out ratio, refresh the quantile."""
    bins = hist.shape[0]
    max_out = ri[MAX_OUT, r]
    hist[(ri[GENERATED, r] * bins + max_out - 1) // max_out - 1] += 1
    g[N_CALIBRATED] += 1
    if g[N_CALIBRATED] < MIN_CALIBRATION:
        return
    need = cfg[I_QUANTILE] * g[N_CALIBRATED]
    cumulative = 0
    for b in range(bins):
        cumulative += hist[b]
        if cumulative >= need:
            g[PRED_BIN] = b
            return


@njit(cache=True, nogil=True, _nrt=False)
def _end_step(rep, st, cfg, t_end, dt):
    """Advance every scheduled request by its tokens: cache the prompt blocks it completed,
    charge its tenant for the step, then sample, finish or time out."""
    ri, rf, g, gf = rep.ri, rep.rf, rep.g, rep.gf
    batch = rep.lists[L_BATCH]
    prompt, tenant, deadline = st.si[S_PROMPT], st.si[S_TENANT], st.sf[S_DEADLINE]
    unit = int(cfg[I_COST_UNIT])
    block_size = int(cfg[I_BLOCK_SIZE])
    caching = g[CACHING] != 0
    cached_held = ri[PC_REQ + pcm.R_HELD]
    n_full = ri[PC_REQ + pcm.R_N_FULL]
    ledger = rep.ledger
    w_out = cfg[I_W_OUT]
    kv_bytes = gf[KV_BYTES]
    hand_off = g[HAND_OFF] != 0
    for i in range(g[N_BATCH]):
        r = batch[i]
        n = ri[SCHED, r]
        if n == 0:
            continue  # preempted after being scheduled
        ri[SCHED, r] = 0
        ri[COMPUTED, r] += n
        if caching and cached_held[r] < n_full[r] and not g[VLLM_CACHE]:  # vLLM caches them as scheduled
            _cache_prompt_blocks(rep, st, r, ri[COMPUTED, r], block_size)
        if unit != fm.TOKENS:
            fm.charge(_shares(rep), tenant[r], fm.step_cost(unit, n, g[B_TOKENS], dt, ri[COMPUTED, r], kv_bytes))
        if ri[COMPUTED, r] != prompt[r] + ri[GENERATED, r]:
            continue
        ri[GENERATED, r] += 1
        ri[SAMPLED_AT, r] = g[STEPS]
        if unit == fm.TOKENS:  # fm.charge, inlined: this runs for every token
            ledger[fm.TS_SERVICE, tenant[r]] += w_out
            ledger[fm.TS_COUNTER, tenant[r]] += w_out / ledger[fm.TS_WEIGHT, tenant[r]]
        if math.isnan(rf[FIRST_TOKEN, r]):
            rf[FIRST_TOKEN, r] = t_end
        if ri[GENERATED, r] < ri[TARGET, r]:
            if hand_off and not deadline[r] <= t_end:  # P/D: on to a decode replica (a late one expires here)
                _hand_off(rep, st, r)
            continue
        _end_done(rep, st, cfg, r, t_end)
    g[N_BATCH] = 0


@njit(cache=True, nogil=True, inline="always")
def _end_done(rep, st, cfg, r, t_end):
    """r sampled its last token in the step ending at t_end: it finishes, or times out if its
    deadline passed first; a finished one calibrates predicted admission."""
    if st.sf[S_DEADLINE, r] < t_end:
        _end_by_deadline(rep, st, r)
        return
    if cfg[I_ASYNC] != 0.0:
        _linger(rep, r, t_end)  # its seat and KV go once the next step is formed
    else:
        _end_request(rep, st, r, S_FINISHED, R_NONE, t_end)
    if int(cfg[I_ADMISSION]) == ADMIT_PREDICTED:
        _calibrate(rep.ri, rep.g, rep.g[G_HIST:G_STEP_HIST], cfg, r)


@njit(cache=True, nogil=True, _nrt=False)
def _sample_until(g, gf, series, t_stop):
    """Record the state at every series grid time before t_stop (state is constant until then)."""
    capacity = series.shape[0]
    while True:
        t_k = gf[SERIES_T0] + g[SAMPLE_K] * gf[SERIES_EVERY]
        if t_k >= t_stop:
            return
        m = g[N_SAMPLES]
        if m == capacity:  # keep every other sample and double the spacing
            for i in range(capacity // 2):
                for c in range(series.shape[1]):
                    series[i, c] = series[2 * i, c]
            g[N_SAMPLES] = capacity // 2
            gf[SERIES_EVERY] *= 2.0
            g[SAMPLE_K] = (g[SAMPLE_K] + 1) // 2
            continue
        series[m, 0] = t_k
        series[m, 1] = g[USED]
        series[m, 2] = g[N_RUN]
        series[m, 3] = g[N_WAIT]
        g[N_SAMPLES] = m + 1
        g[SAMPLE_K] += 1


@njit(cache=True, nogil=True, inline="always")
def _count_step(g, dt, near):
    """Count a step of dt seconds in the step-time histogram and return its bin: bin 0 below
    STEP_HIST_MIN_S, then STEP_HIST_PER_DECADE log-spaced bins per decade, the last one
    open-ended (``policies.result.step_time_bin``). Every step passes here, fast-forwarded or
    not. ``near`` (0: none), the bin of the step before, is tried first: a stretch's steps
    differ by a token of context each and mostly share a bin (an Azure replay 1.05x faster
    than searching the edges every step, ``benchmarks/engine_speed.py``)."""
    if 0 < near < STEP_HIST_EDGES.shape[0] and STEP_HIST_EDGES[near - 1] <= dt < STEP_HIST_EDGES[near]:
        k = near
    elif dt >= STEP_HIST_MIN_S:  # (not NaN)
        k = np.searchsorted(STEP_HIST_EDGES, dt, side="right")
    else:
        k = 0
    g[G_STEP_HIST + k] += 1
    return k


@njit(cache=True, nogil=True, inline="always")
def _book_stretch_step(g, gf, series, t, dt, used, t_sample, near):
    """One step of a fast-forwarded stretch, from t to t + dt with ``used`` KV blocks: its
    histogram bin (``near``: the step before's), and the series samples it passes; returns
    the next sample time and the step's bin."""
    k = _count_step(g, dt, near)
    if t + dt > t_sample:
        g[USED] = used
        _sample_until(g, gf, series, t + dt)
        t_sample = gf[SERIES_T0] + g[SAMPLE_K] * gf[SERIES_EVERY]
    return t_sample, k


@njit(cache=True, nogil=True, inline="always")
def _note_step_tokens(g, gf, tokens):
    """Keep the most tokens one step computed and when a step first computed that many (the
    step starting at the clock): the run's activation peak (``policies.workspace``)."""
    if tokens > g[PEAK_STEP]:
        g[PEAK_STEP] = tokens
        gf[PEAK_STEP_S] = gf[CLOCK]


@njit(cache=True, nogil=True, _nrt=False)
def _book_step(g, gf, series, cfg, dt, oor):
    """Book one formed step of dt seconds (copies included); return its end. The caller
    then runs ``_end_step`` and moves the clock."""
    _count_step(g, dt, 0)
    _note_step_tokens(g, gf, g[B_TOKENS])
    if oor:
        g[OUT_OF_RANGE] += 1
    t_end = gf[CLOCK] + dt
    if t_end > gf[SERIES_T0] + g[SAMPLE_K] * gf[SERIES_EVERY]:  # a series grid time passes
        _sample_until(g, gf, series, t_end)
    g[STEPS] += 1
    gf[BUSY] += dt
    g[PREFILL_TOKENS] += g[B_PREFILL]
    if g[B_DECODES] > 0 and int(cfg[I_ADMISSION]) == ADMIT_NTR:
        _decay_ratio(gf, cfg)
    return t_end


@njit(cache=True, nogil=True, _nrt=False)
def _hand_off(rep, st, r):
    g = rep.g
    _vacate(rep, st, r)
    rep.ri[STATUS, r] = NOT_ARRIVED
    rep.lists[L_OUTBOX, g[N_OUTBOX]] = r
    g[N_OUTBOX] += 1
