"""Async scheduling (``async_scheduling``): the engine forms step k+1 while step k runs.

vLLM 0.33 resolves ``async_scheduling`` to on when a config leaves it unset, and ``vllm
serve`` then runs ``EngineCore.step_with_batch_queue`` (v1/engine/core.py) with two batches
in flight: the scheduler forms the next batch as soon as the current one is launched,
before its outputs come back (v1/core/sched/async_scheduler.py counts a launched token as
an output placeholder). The engine's clock still forms each step at its start, after the
step before it ended; what the scheduler saw at the time it really formed it differs in
two ways only:

- *Arrivals*: it had seen the requests that arrived by the start of the step in flight
  (``PIPELINE_T``), not those that arrived while it ran: a request arriving during step k
  first runs in step k + 2.
- *Finished requests*: one whose last token was in flight still held its seat, its KV
  blocks and its place in the running list, and could be chosen as a preemption victim.
  Here such a request ends when its step ends (finish time, state, counts) but *lingers*
  on the running list with its KV until the next step is formed (``_linger``,
  ``_release_ghosts``). The scheduler skips it when its tokens in flight reach its
  ``max_tokens`` ("avoid scheduling an extra step", scheduler.py:801-814); one that
  stopped earlier (EOS) gets one more decode, computed and thrown away
  (``_decodes_past_stop``).

Everything else is the same: a running request's next chunk or decode is scheduled from
its placeholders, so decodes run without a gap, and a request preempted while a token was
in flight gets that token before it can run again. When the scheduler forms an empty batch
while one is in flight, the engine waits for that batch's outputs and forms at once again,
as the synchronous loop would (``replica._form_or_restart``). After an idle
spell the first step is formed at its start with what has arrived.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from policies import fairness as fm
from policies import prefix_cache as pcm
from policies.engine.codes import (
    I_ASYNC,
    I_BLOCK_SIZE,
    I_COST_UNIT,
    I_SCHEDULE_MODE,
    PREFILL_FIRST,
    R_NONE,
    S_FINISHED,
)
from policies.engine.state import _free_gpu, _is_decode, _leave_running
from policies.kernel_state import (
    COMPUTED,
    DONE,
    FINISH,
    FREE,
    GENERATED,
    GHOSTS,
    HELD,
    L_RUN,
    MAX_OUT,
    N_DONE,
    N_RUN,
    PC_REQ,
    PC_STATS,
    PIPELINE_T,
    QUOTAS,
    REASON,
    S_PROMPT,
    SAMPLED_AT,
    SCHED,
    STATE,
    STATUS,
    STEPS,
    TARGET,
    UNIT_TOKENS,
)
from policies.kernel_state import T as CLOCK


@njit(cache=True, nogil=True, inline="always")
def _visible_until(gf, cfg):
    """Arrivals the step formed at the clock takes: those due by this time."""
    if cfg[I_ASYNC] != 0.0 and not math.isnan(gf[PIPELINE_T]):
        return gf[PIPELINE_T]
    return gf[CLOCK]


@njit(cache=True, nogil=True, _nrt=False)
def _linger(rep, r, t_end):
    """r sampled its last token in the step ending at t_end: it ends (finished) but keeps
    its seat, KV and running-list place until the next step is formed."""
    ri, g = rep.ri, rep.g
    ri[STATUS, r] = DONE
    ri[STATE, r] = S_FINISHED
    ri[REASON, r] = R_NONE
    rep.rf[FINISH, r] = t_end
    g[N_DONE] += 1
    g[GHOSTS] += 1


@njit(cache=True, nogil=True, inline="always")
def _lingers(ri, prompt, r):
    """Whether ended r still holds its seat and KV for the step being formed (a released
    one has nothing left to compute)."""
    return ri[STATUS, r] == DONE and ri[STATE, r] == S_FINISHED and ri[COMPUTED, r] < prompt[r] + ri[GENERATED, r]


@njit(cache=True, nogil=True, inline="always")
def _decodes_past_stop(ri, prompt, r):
    """Whether lingering r is scheduled once more: it stopped short of its output cap (an
    EOS), which the scheduler cannot know before its output is in, so it gets a decode
    whose token is thrown away. vLLM 0.33 v1/core/sched/scheduler.py:801-814 and SGLang
    0.5.23 managers/scheduler.py:4444-4465 skip only a request whose token in flight
    reaches ``max_tokens``."""
    return _lingers(ri, prompt, r) and ri[TARGET, r] < ri[MAX_OUT, r]


@njit(cache=True, nogil=True, inline="always")
def _in_flight(ri, g, cfg, r):
    """Whether r's last token is in flight as this step is formed: sampled by the step just
    ended, whose outputs the scheduler has not seen (async scheduling only)."""
    return cfg[I_ASYNC] != 0.0 and ri[SAMPLED_AT, r] == g[STEPS]


@njit(cache=True, nogil=True, inline="always")
def _committed(ri, g, cfg, r):
    """The outputs the scheduler has of r as this step is formed (SGLang's
    ``len(output_ids)``, which lacks the token in flight: its admission reserve and its
    retraction order read it, managers/schedule_policy.py:673-680, schedule_batch.py:3540-3580)."""
    return ri[GENERATED, r] - (1 if _in_flight(ri, g, cfg, r) else 0)


@njit(cache=True, nogil=True, inline="always")
def _retraction_discards(cfg):
    """SGLang's overlap loop throws a retracted request's token in flight away (its result
    processors skip ``is_retracted`` requests: batch_result_processor.py:344-349,
    :1022-1027); vLLM's keeps it (scheduler.py:1825-1836). Prefill-first is SGLang's loop."""
    return cfg[I_ASYNC] != 0.0 and int(cfg[I_SCHEDULE_MODE]) == PREFILL_FIRST


@njit(cache=True, nogil=True, _nrt=False)
def _release_ghost(rep, st, r):
    """Free what ended r still holds: its seat, adapter, reservation and KV (a decode past
    its stop, if scheduled, is timed with its step but advances nothing)."""
    _leave_running(rep, st, r)
    _free_gpu(rep, st, r, True, False)
    rep.ri[SCHED, r] = 0
    rep.ri[COMPUTED, r] = st.si[S_PROMPT, r] + rep.ri[GENERATED, r]  # nothing left to schedule, should a
    rep.g[GHOSTS] -= 1  # formation's running loop (preempted it as it walked) come to it again


@njit(cache=True, nogil=True, _nrt=False)
def _release_ghosts(rep, st):
    """The step formed: the requests that lingered for it leave (their outputs are in)."""
    ri, g = rep.ri, rep.g
    run = rep.lists[L_RUN]
    i = 0
    while g[GHOSTS] > 0 and i < g[N_RUN]:  # in running order, as their outputs come in
        r = run[i]
        if ri[STATUS, r] == DONE:
            _release_ghost(rep, st, r)  # takes it off the list: run[i] is the next one
        else:
            i += 1


@njit(cache=True, nogil=True, _nrt=False)
def _ghosts_change_nothing(rep, st, cfg):
    """(blocks, decodes, KV tokens) the lingering requests add to the coming step if they
    can leave before a fast-forwarded stretch starts with it; blocks is -1 when they cannot.

    The coming step takes every running request's decode, and one more decode of each
    lingering request that stopped short of its output cap (``_decodes_past_stop``),
    computed and thrown away: the stretch's first step carries those (``_fast_forward``'s
    ``ghost_decodes`` and ``ghost_kv``) and the blocks they take at its formation, which
    leave with them, count in the KV peak. They can leave when nobody waits (no admission
    to hold back), every running request decodes (no prefill chunk whose long-prefill
    threshold counts them), the blocks fit without eviction (no preemption to choose a
    victim for) and tokens are the cost unit (a step's GPU time is shared by its tokens,
    the thrown-away ones too). The caller checked that nothing waits."""
    ri, g = rep.ri, rep.g
    prompt = st.si[S_PROMPT]
    run = rep.lists[L_RUN]
    block_size = int(cfg[I_BLOCK_SIZE])
    cached_held = ri[PC_REQ + pcm.R_HELD]
    if g[QUOTAS] != 0:
        return -1, 0, 0
    need = 0
    decodes = 0
    kv = 0
    for i in range(g[N_RUN]):
        r = run[i]
        if ri[STATUS, r] == DONE:
            if ri[TARGET, r] >= ri[MAX_OUT, r]:
                continue  # not scheduled: its token in flight reaches the cap
            if int(cfg[I_COST_UNIT]) != fm.TOKENS:
                return -1, 0, 0
            decodes += 1
            kv += ri[COMPUTED, r] + 1
        elif not _is_decode(ri, prompt, r, 1):
            return -1, 0, 0
        need += pcm.private_blocks(ri[COMPUTED, r] + 1, cached_held[r], g[UNIT_TOKENS], block_size) - ri[HELD, r]
    if need > g[FREE] - g[PC_STATS + pcm.S_EVICTABLE]:
        return -1, 0, 0
    return need, decodes, kv


@njit(cache=True, nogil=True, inline="always")
def _pipeline_formed(rep, st, t):
    """A step was formed at t: the requests that lingered for it leave, and the next
    formation sees the arrivals due by t."""
    if rep.g[GHOSTS] > 0:
        _release_ghosts(rep, st)
    rep.gf[PIPELINE_T] = t


@njit(cache=True, nogil=True, inline="always")
def drain_pipeline(rep, st):
    """Nothing is in flight: lingering requests leave and the next step is formed with
    everything that has arrived by its start (also when a replica stops: it fails, or the
    run ends)."""
    if rep.g[GHOSTS] > 0:
        _release_ghosts(rep, st)
    rep.gf[PIPELINE_T] = np.nan
