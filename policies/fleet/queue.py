"""The fleet queue: the FIFO ring of requests waiting for a replica, its dispatch (with P/D, a
decode replica's promise first), and the requests that end in it (their deadline passed,
rejected, or no replica comes back).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from policies import prefix_cache as pcm
from policies import routing as rt
from policies.engine import (
    K_CACHED_FIRST,
    K_FIRST_SCHED,
    K_FIRST_TOKEN,
    K_GENERATED,
    K_PREEMPTS,
    O_FINISH,
    O_FIRST_SCHED,
    O_FIRST_TOKEN,
    O_GENERATED,
    O_PREEMPTS,
    O_REASON,
    O_STATE,
)
from policies.fleet.moves import _deliver
from policies.fleet.routing import _fill_summary, _route
from policies.fleet.state import (
    FG_N_PROMISED,
    FG_PD,
    FG_Q_HEAD,
    FG_Q_LEN,
    FI_NEED,
    FI_PROMISE,
    FR_ALIVE,
    FR_POOL,
    FR_PROMISED,
    FR_ROOM,
    I_BLOCK_SIZE,
    R_EXCEEDS,
    R_NONE,
    RQ_ENDED_ON,
    S_CANCELLED,
    S_FAILED,
    S_REJECTED,
    S_TIMED_OUT,
)
from policies.kernel_state import S_DEADLINE, S_PROMPT


@njit(cache=True, nogil=True)
def _enqueue(fl, r, t):
    fg = fl.fg
    n = fl.queue.shape[0]
    fl.queue[(fg[FG_Q_HEAD] + fg[FG_Q_LEN]) % n] = r
    fg[FG_Q_LEN] += 1
    fl.queued_at[r] = t


@njit(cache=True, nogil=True)
def _dequeue(fl):
    fg = fl.fg
    r = fl.queue[fg[FG_Q_HEAD]]
    fg[FG_Q_HEAD] = (fg[FG_Q_HEAD] + 1) % fl.queue.shape[0]
    fg[FG_Q_LEN] -= 1
    return r


@njit(cache=True, nogil=True)
def _dispatch(fl, t):
    """Place queued requests, head first, while they can be placed; those whose deadline
    passed while they waited end at it first."""
    fg = fl.fg
    if fg[FG_Q_LEN] == 0:
        return
    _drop_expired(fl, t)
    pd = fg[FG_PD] != 0
    prompt = fl.nodes[0][1].si[S_PROMPT]
    block_size = int(fl.cfg[I_BLOCK_SIZE])
    while fg[FG_Q_LEN] > 0:
        r = fl.queue[fg[FG_Q_HEAD]]
        if not _any_alive(fl, 0) or fl.ready_at[r] > t:
            return
        if pd:
            need = pcm.kv_blocks(prompt[r] + fl.carried_i[K_GENERATED, r] + 1, block_size)
            if need > _largest_room(fl, 1):  # no decode replica could ever hold it
                _dequeue(fl)
                _end_in_fleet(fl, r, S_REJECTED, R_EXCEEDS, t)
                continue
            _fill_summary(fl, 1, True, False)
            d = rt.choose_decode(fl.summary, fl.fr[FR_PROMISED], need)
            if d < 0:
                return
            fl.fi[FI_PROMISE, r] = d
            fl.fi[FI_NEED, r] = need
            fl.fr[FR_PROMISED, d] += need
            fl.promised[fg[FG_N_PROMISED]] = r
            fg[FG_N_PROMISED] += 1
        _dequeue(fl)
        _deliver(fl, r, _route(fl, r), t)


@njit(cache=True, nogil=True)
def _drop_expired(fl, t):
    """End the queued requests whose deadline is before t, keeping the others in order."""
    fg = fl.fg
    n = fl.queue.shape[0]
    deadline = fl.nodes[0][1].sf[S_DEADLINE]
    head = fg[FG_Q_HEAD]
    kept = 0
    for k in range(fg[FG_Q_LEN]):
        r = fl.queue[(head + k) % n]
        if deadline[r] < t:
            _end_by_deadline_in_fleet(fl, r)
        else:
            fl.queue[(head + kept) % n] = r
            kept += 1
    fg[FG_Q_LEN] = kept


@njit(cache=True, nogil=True)
def _any_alive(fl, pool):
    for j in range(fl.fr.shape[1]):
        if fl.fr[FR_ALIVE, j] and fl.fr[FR_POOL, j] == pool:
            return True
    return False


@njit(cache=True, nogil=True)
def _largest_room(fl, pool):
    room = -1
    for j in range(fl.fr.shape[1]):
        if fl.fr[FR_POOL, j] == pool:
            room = max(room, fl.fr[FR_ROOM, j])
    return room


@njit(cache=True, nogil=True)
def _end_in_fleet(fl, r, state, reason, t_end):
    """r ends outside every replica (in the fleet queue), with what it carried."""
    out, ki, kf = fl.out, fl.carried_i, fl.carried_f
    out.out_i[O_STATE, r] = state
    out.out_i[O_REASON, r] = reason
    out.out_i[O_GENERATED, r] = ki[K_GENERATED, r]
    out.out_i[O_PREEMPTS, r] = ki[K_PREEMPTS, r]
    out.out_f[O_FIRST_TOKEN, r] = kf[K_FIRST_TOKEN, r]
    out.out_f[O_FINISH, r] = t_end
    out.out_f[O_FIRST_SCHED, r] = kf[K_FIRST_SCHED, r]
    out.cached[r] = ki[K_CACHED_FIRST, r]
    out.requests[RQ_ENDED_ON, r] = -1


@njit(cache=True, nogil=True)
def _end_by_deadline_in_fleet(fl, r):
    deadline = fl.nodes[0][1].sf[S_DEADLINE, r]
    state = S_TIMED_OUT if fl.carried_f[K_FIRST_TOKEN, r] <= deadline else S_CANCELLED
    _end_in_fleet(fl, r, state, R_NONE, deadline)
    if state == S_CANCELLED:  # as on a replica: nothing reached the client
        fl.out.out_f[O_FIRST_TOKEN, r] = np.nan
        fl.out.out_i[O_GENERATED, r] = 0


@njit(cache=True, nogil=True)
def _close_queue(fl):
    """No replica will come back for what is still queued: it ends at its deadline, or
    FAILED when it was last queued (or at its first token, if that came later)."""
    deadline = fl.nodes[0][1].sf[S_DEADLINE]
    while fl.fg[FG_Q_LEN] > 0:
        r = _dequeue(fl)
        if math.isnan(deadline[r]):
            # when last queued, or at the token it streamed if later: a failure withdrew it
            # from a step still in flight on another replica, whose token reached the client
            first = fl.carried_f[K_FIRST_TOKEN, r]
            t_end = fl.queued_at[r] if math.isnan(first) else max(fl.queued_at[r], first)
            _end_in_fleet(fl, r, S_FAILED, R_NONE, t_end)
        else:
            _end_by_deadline_in_fleet(fl, r)
