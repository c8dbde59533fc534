"""The fleet's event loop (``fleet_kernel``): the next event, the replicas advanced to it, the
events at it in the contract's order (``policies.fleet``) and the run's end.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from policies import engine
from policies.engine import O_STATE
from policies.fleet.failures import _fail, _recover, _retire
from policies.fleet.guard import _engine_error, _laggard, _progress, _replica_in_error, _stall
from policies.fleet.migration import _migrate
from policies.fleet.moves import _deliver, _pop_flight
from policies.fleet.pd import _no_prefill_admits, _release_promises, _send_handoffs
from policies.fleet.queue import _close_queue, _dispatch, _end_in_fleet, _enqueue
from policies.fleet.state import (
    ERROR_ENGINE,
    ERROR_IN_FLIGHT,
    ERROR_NO_PROGRESS,
    ERROR_UNENDED,
    FG_N_FLIGHT,
    FG_N_INCARNATIONS,
    FG_NEXT_ARRIVAL,
    FG_NEXT_FAILURE,
    FG_PD,
    FG_Q_HEAD,
    FG_Q_LEN,
    FG_TICK,
    FI_DEST,
    FL_ERROR,
    FL_INCARNATIONS,
    FR_ALIVE,
    FR_POOL,
    I_MIGRATION,
    I_MIGRATION_INTERVAL,
    R_EXCEEDS,
    S_REJECTED,
    _borrow_fleet,
    _new_fleet,
)
from policies.kernel_state import S_ARRIVAL


@njit(cache=True, nogil=True)
def fleet_kernel(statics, tables, block_hashes, kv_bytes, swap_bw, fail_t, fail_replica, fail_up, cfg, caps, hosts,
                 seed, series_every, fast_forward, lockstep, tenant_params, class_params, router, out, budget):
    """One replay of the trace through a fleet of R = len(statics) replicas running ``cfg``.

    ``statics``/``tables``: each replica's ``engine.Statics`` and step-time tables;
    ``kv_bytes``/``swap_bw``/``caps``/``hosts``: each replica's KV bytes per token, host
    copy bandwidth and GPU/host KV blocks; ``fail_*``: the failure events in processing
    order (``FailureSchedule.events``); ``lockstep``: replicas j with the same j // lockstep
    are the ranks of one attention-DP instance, advanced together (``engine.advance_group``);
    ``router``: an empty ``routing.RouterState``;
    ``out``: ``FleetBuffers``, filled; ``budget``: i8[2] (base, per), the event loop runs
    at most base + per * progress times (``_progress``). The rest as in ``engine.new_replica``.
    """
    owned = _new_fleet(statics, tables, block_hashes, kv_bytes, swap_bw, fail_t, fail_replica, fail_up, cfg, caps,
                       hosts, seed, series_every, fast_forward, lockstep, tenant_params, class_params, router, out)
    fl = _borrow_fleet(owned)  # owned outlives it
    n_rep = fl.fr.shape[1]
    t = fl.t0
    iterations = 0
    while True:
        iterations += 1
        if iterations > budget[0] + budget[1] * _progress(fl):
            _stall(fl, t, ERROR_NO_PROGRESS, _laggard(fl), iterations, 0)
            break
        n_stepping = _watch_steps(fl)
        let_go = False
        for k in range(n_stepping):
            let_go |= _run_lets_go(fl, fl.stepping[k], t)
        # a promise ended at t, or a decode replica let go of requests that lingered past their
        # last step (async scheduling), may unblock the queue, and no later event need come
        released = _release_promises(fl)
        t_next = t if (released > 0 or let_go) and fl.fg[FG_Q_LEN] > 0 else _next_event(fl, t, n_stepping)
        if t_next == np.inf:
            break
        t = t_next
        if _reads_every_replica(fl, t):
            for j in range(n_rep):
                if fl.fr[FR_ALIVE, j]:
                    _run(fl, j, t, False)
            _release_promises(fl)
        _events_at(fl, t)
        j = _replica_in_error(fl)
        if j >= 0:
            _stall(fl, t, ERROR_ENGINE, j, iterations, _engine_error(fl, j))
            break
    _finish(owned, iterations)


@njit(cache=True, nogil=True)
def _finish(fl, iterations):
    """After the last event (``iterations`` of the event loop): run every alive replica to
    its end, end what is still queued, write every replica's outputs and flag a request
    that did not end. After a progress guard stopped the run, or once a replica's engine
    reports an error on its way to the end, nothing more is run (the run is an error)."""
    if fl.out.fleet[FL_ERROR] != 0:
        return
    n_rep = fl.fr.shape[1]
    for j in range(n_rep):
        if fl.fr[FR_ALIVE, j]:
            _run(fl, j, np.inf, False)
    j = _replica_in_error(fl)
    if j >= 0:
        _stall(fl, engine.clock(fl.nodes[j][0]), ERROR_ENGINE, j, iterations, _engine_error(fl, j))
        return
    _release_promises(fl)
    _close_queue(fl)
    for j in range(n_rep):
        if fl.fr[FR_ALIVE, j]:
            _retire(fl, j, engine.clock(fl.nodes[j][0]))
    out = fl.out
    out.fleet[FL_INCARNATIONS] = fl.fg[FG_N_INCARNATIONS]
    if fl.fg[FG_N_FLIGHT] > 0:
        out.fleet[FL_ERROR] = ERROR_IN_FLIGHT
    elif np.any(out.out_i[O_STATE] < 0):
        out.fleet[FL_ERROR] = ERROR_UNENDED


@njit(cache=True, nogil=True)
def _run_lets_go(fl, j, t):
    """Run stepping replica j through t; whether it is a decode replica that freed KV at t
    itself, forming no step (requests that ended with its last step left it)."""
    rep = fl.nodes[j][0]
    free = engine.free_blocks(rep)
    _run(fl, j, t, True)
    return fl.fr[FR_POOL, j] == 1 and engine.clock(rep) == t and engine.free_blocks(rep) > free


@njit(cache=True, nogil=True)
def _watch_steps(fl):
    """P/D: list the replicas whose step ends are events now (alive prefill replicas, and
    decode replicas while the fleet queue holds requests); return how many."""
    if fl.fg[FG_PD] == 0:
        return 0
    fr = fl.fr
    k = 0
    for j in range(fr.shape[1]):
        if fr[FR_ALIVE, j] and (fr[FR_POOL, j] == 0 or fl.fg[FG_Q_LEN] > 0):
            fl.stepping[k] = j
            k += 1
    return k


@njit(cache=True, nogil=True)
def _run(fl, j, t_limit, through):
    """Advance replica j to ``t_limit`` (``through``: also the step starting at it), sending
    what a prefill replica hands off on its way; an attention-DP rank advances with the
    other ranks of its instance."""
    if fl.lockstep > 1:  # no P/D with lockstep (check_fleet): nothing to hand off
        engine.advance_group(fl.nodes, j - j % fl.lockstep, fl.lockstep, fl.cfg, t_limit, through)
        return
    rep, st, tables = fl.nodes[j]
    while True:
        if through:
            engine.advance_through(rep, st, tables, fl.cfg, t_limit)
        else:
            engine.advance(rep, st, tables, fl.cfg, t_limit)
        if fl.fr[FR_POOL, j] != 0 or fl.fg[FG_PD] == 0 or _send_handoffs(fl, j) == 0:
            return


@njit(cache=True, nogil=True)
def _next_event(fl, t, n_stepping):
    """The earliest external event after t (inf: none left)."""
    fg = fl.fg
    t_next = np.inf
    arrival = fl.nodes[0][1].sf[S_ARRIVAL]
    if fg[FG_NEXT_ARRIVAL] < arrival.shape[0]:
        t_next = arrival[fg[FG_NEXT_ARRIVAL]]
    if fg[FG_N_FLIGHT] > 0:
        t_next = min(t_next, fl.flight_t[0])
    if fg[FG_Q_LEN] > 0 and fl.ready_at[fl.queue[fg[FG_Q_HEAD]]] > t:
        t_next = min(t_next, fl.ready_at[fl.queue[fg[FG_Q_HEAD]]])
    if fg[FG_NEXT_FAILURE] < fl.fail_t.shape[0]:
        t_next = min(t_next, fl.fail_t[fg[FG_NEXT_FAILURE]])
    if fl.cfg[I_MIGRATION] != 0.0:
        while fl.t0 + fg[FG_TICK] * fl.cfg[I_MIGRATION_INTERVAL] <= t:
            fg[FG_TICK] += 1
        if _tick_may_act(fl):
            t_next = min(t_next, fl.t0 + fg[FG_TICK] * fl.cfg[I_MIGRATION_INTERVAL])
    for k in range(n_stepping):
        c = engine.clock(fl.nodes[fl.stepping[k]][0])
        if c > t:
            t_next = min(t_next, c)
    return t_next


@njit(cache=True, nogil=True)
def _reads_every_replica(fl, t):
    """Whether the events at t read replicas' state at t: routing (an arrival, or a queue
    to dispatch), promises (P/D dispatch), a failure or a migration tick. Otherwise they
    are P/D step ends, whose replicas are already at t, and deliveries, which only fill
    an inbox; the other replicas may lag, since a replica advanced later in one go ends
    exactly where one advanced event by event would (``engine.advance`` is resumable).

    A migration tick needs them only if some replica may have a queue at t: one is
    delivered something at t, or one may hold a queue (``engine.stays_unqueued`` at its
    own, earlier clock is enough). Otherwise no replica is a source and the tick does
    nothing."""
    fg = fl.fg
    if fg[FG_Q_LEN] > 0:
        return True
    arrival = fl.nodes[0][1].sf[S_ARRIVAL]
    if fg[FG_NEXT_ARRIVAL] < arrival.shape[0] and arrival[fg[FG_NEXT_ARRIVAL]] == t:
        return True
    if fg[FG_NEXT_FAILURE] < fl.fail_t.shape[0] and fl.fail_t[fg[FG_NEXT_FAILURE]] == t:
        return True
    if fl.cfg[I_MIGRATION] == 0.0 or t != fl.t0 + fg[FG_TICK] * fl.cfg[I_MIGRATION_INTERVAL]:
        return False
    return (fg[FG_N_FLIGHT] > 0 and fl.flight_t[0] == t) or _may_queue(fl)


@njit(cache=True, nogil=True)
def _tick_may_act(fl):
    """Whether the next migration tick is an event. The contract makes it one while some
    alive replica holds a request; a tick with the fleet queue empty and no replica able
    to hold a queue by then does nothing, so those are skipped (with the queue holding
    requests every replica is at the current time, so ``outstanding`` is exact)."""
    if fl.fg[FG_Q_LEN] > 0:
        for j in range(fl.fr.shape[1]):
            if fl.fr[FR_ALIVE, j] and engine.outstanding(fl.nodes[j][0]) > 0:
                return True
        return False
    return _may_queue(fl)


@njit(cache=True, nogil=True)
def _may_queue(fl):
    """Whether some alive replica may hold a queue now or before its next delivery."""
    for j in range(fl.fr.shape[1]):
        rep, st, _ = fl.nodes[j]
        if fl.fr[FR_ALIVE, j] and not engine.stays_unqueued(rep, st, fl.cfg):
            return True
    return False


@njit(cache=True, nogil=True)
def _events_at(fl, t):
    """Every event at t, in the contract's order."""
    fg, fail_t = fl.fg, fl.fail_t
    while fg[FG_NEXT_FAILURE] < fail_t.shape[0] and fail_t[fg[FG_NEXT_FAILURE]] == t:
        k = fg[FG_NEXT_FAILURE]
        fg[FG_NEXT_FAILURE] += 1
        if fl.fail_up[k]:
            _recover(fl, fl.fail_replica[k], t)
        else:
            _fail(fl, fl.fail_replica[k], t)
    _dispatch(fl, t)
    while fg[FG_N_FLIGHT] > 0 and fl.flight_t[0] == t:
        r = _pop_flight(fl)
        _deliver(fl, r, fl.fi[FI_DEST, r], t)
        fl.fi[FI_DEST, r] = -1
    interval = fl.cfg[I_MIGRATION_INTERVAL]
    if fl.cfg[I_MIGRATION] != 0.0 and t == fl.t0 + fg[FG_TICK] * interval:
        fg[FG_TICK] += 1
        _migrate(fl, t)
    _dispatch(fl, t)
    arrival = fl.nodes[0][1].sf[S_ARRIVAL]
    while fg[FG_NEXT_ARRIVAL] < arrival.shape[0] and arrival[fg[FG_NEXT_ARRIVAL]] == t:
        r = fg[FG_NEXT_ARRIVAL]
        fg[FG_NEXT_ARRIVAL] += 1
        if fg[FG_PD] != 0 and _no_prefill_admits(fl, r):
            _end_in_fleet(fl, r, S_REJECTED, R_EXCEEDS, t)
        else:
            _enqueue(fl, r, t)
        _dispatch(fl, t)
