"""The fleet: replicas of the engine under one clock, with routers, failures, migration and P/D.

A fleet replays a trace through R replicas of ``policies.engine`` (each its own KV pool,
queue, prefix cache and cost model, so replicas may differ in GPU or TP), driven by one
event loop that follows the fleet contract of issue 8. The plain-Python reference
(``tests/policies/reference_fleet.py``) implements the same rules, and the kernel matches
it request by request:

* Events: arrivals (trace order), deliveries of requests moving between replicas
  (migration, P/D hand-off), failure downs and ups, migration ticks and, with P/D, the
  step ends of the replicas being watched. At the next event time t every alive replica
  runs the steps that start before t (``engine.advance``); then the events at t are
  processed: downs, ups, the fleet queue, deliveries, the migration tick, arrivals.
* The fleet queue (FIFO): an arrival, or a request a failure displaced, joins it; it is
  dispatched after the downs and ups, after the migration tick and at each arrival. The
  head is routed (``policies.routing``) to an alive replica (P/D: a prefill replica, once
  a decode replica promised it KV) and delivered there at t; with nowhere to go it waits,
  and ends at its deadline if that passes first, or FAILED when no replica comes back.
* Failures (``policies.failures``): at t_down the replica's requests, those in flight to
  it and, for a decode replica, those it promised KV lose their KV (generated tokens are
  kept: they were streamed) and rejoin the queue in trace order; they prefill again
  wherever they land. A step in flight at t_down completes (the engine commits a step
  when it starts it), so a request withdrawn from a replica whose clock is past t_down is
  not placed before that clock, and the FIFO queue waits for it. The replica returns
  empty at t_up.
* Migration (Llumnix, ``migration``): at each tick, per pool, replicas short of KV with a
  blocked queue head hand their newest running request, with its KV, to the freest
  replicas when moving it is quicker than the head has waited.
* P/D (``prefill_replicas`` P > 0): replicas 0..P-1 prefill, the rest decode. An arrival
  every prefill replica would reject EXCEEDS_CAPACITY (``engine.never_admits``) is
  rejected by the fleet at once, before it could hold a promise. A request leaves its
  prefill replica once it has sampled a token and reaches its decode replica with its KV
  after the transfer time. While P/D is on, each prefill replica's step end is an event,
  and so is each decode replica's while the queue holds requests. A promise that ends as
  those replicas start their steps at t, with requests queued, makes t an event again:
  its request may have been turned away on arrival by an idle prefill replica, which
  has no step end to come.

* Attention DP (``lockstep`` > 1): each run of ``lockstep`` consecutive replicas is one
  instance's ranks, advanced together (``engine.advance_group``: one clock, every step as
  long as the slowest rank's); the router places requests on ranks as on replicas, an
  instance's failure window stops all of its ranks, and P/D is refused.

The rules the contract leaves open are decided as the reference's docstring lists them.
Every replica runs with the run's seed: the only random draws (speculative verifies) are
keyed by (seed, request, token index), so a request draws the same outcomes wherever it
runs and a migrated one continues its own stream. One replica is exactly ``engine.simulate``.

State is structure-of-arrays: per request ``fi`` (owner, promise, destination in flight)
and the engine's carried rows (what a request takes from replica to replica), per replica
``fr``, run scalars ``fg``. Every array the loop touches is borrowed (``engine.borrowed``)
so the many small calls per event cost no reference counting.

Progress guard: every event of a correct run moves one of the run's progress counters
(arrivals and failure events taken, migration ticks, deliveries, steps of any replica),
so the event loop runs at most ``base + per * progress`` times (``progress_budget``, by
default ``engine.default_progress_budget`` of requests + failure events + replicas:
generous, derived from the trace); past that, or as soon as a replica's engine reports an
internal error (its own progress guard's among them), the run stops and ``simulate_fleet``
raises ``SimulationStalled`` naming the time, the replica and the fleet's state, instead
of hanging.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numba import njit, typed

from costmodels.costmodel import CostModel
from policies import engine
from policies import fairness as fm
from policies import routing as rt
from policies import speculative as spm
from policies.config import KNOB_INDEX, PolicyConfig, check_fleet
from policies.engine import (
    K_CACHED_FIRST,
    K_COMPUTED,
    K_FIRST_SCHED,
    K_FIRST_TOKEN,
    K_GENERATED,
    K_PREEMPTS,
    N_OF,
    N_OI,
    N_PREFIX,
    O_FINISH,
    O_FIRST_SCHED,
    O_FIRST_TOKEN,
    O_GENERATED,
    O_PREEMPTS,
    O_REASON,
    O_STATE,
    P_HIT_TOKENS,
    P_QUERY_TOKENS,
    SimulationStalled,
    borrowed,
)
from policies.failures import FailureSchedule
from policies.kernel_state import (
    C_CAP,
    C_ERROR,
    C_N_SAMPLES,
    C_PEAK,
    C_PEAK_STEP,
    C_STEPS,
    COMPUTED,
    DONE,
    ERROR,
    F_AD_LOAD_S,
    F_BUSY,
    F_END,
    F_PEAK_STEP_S,
    N_COUNTS,
    N_FCOUNTS,
    PREEMPTS,
    RUNNING,
    S_ARRIVAL,
    S_DEADLINE,
    S_MAX_TOKENS,
    S_PROMPT,
    S_TENANT,
    SERIES_CAPACITY,
    STATUS,
    STEPS,
)
from policies.result import Reject, SimResult, State

I_BLOCK_SIZE = KNOB_INDEX["block_size"]
I_MIGRATION = KNOB_INDEX["migration"]
I_MIGRATION_THRESHOLD = KNOB_INDEX["migration_threshold"]
I_MIGRATION_INTERVAL = KNOB_INDEX["migration_interval_s"]
I_MIGRATION_PAUSE = KNOB_INDEX["migration_pause_ms"]
I_INTERCONNECT = KNOB_INDEX["interconnect_gbps"]
I_PREFILL_REPLICAS = KNOB_INDEX["prefill_replicas"]

S_FINISHED = int(State.FINISHED)
S_REJECTED = int(State.REJECTED)
S_TIMED_OUT = int(State.TIMED_OUT)
S_CANCELLED = int(State.CANCELLED)
S_FAILED = int(State.FAILED)
R_NONE = int(Reject.NONE)
R_EXCEEDS = int(Reject.EXCEEDS_CAPACITY)

# fi rows: per request, i8[N_FI, n]
FI_OWNER = 0  # replica the request was last delivered to (-1: not arrived, queued, in flight, or it ended on
#              an incarnation that has since failed)
FI_PROMISE = 1  # P/D: decode replica that promised it KV (-1: none)
FI_NEED = 2  # P/D: blocks promised
FI_DEST = 3  # destination while in flight (-1: not in flight)
N_FI = 4

# fr rows: per replica, i8[N_FR, R]
FR_ALIVE = 0
FR_POOL = 1  # 0 prefill (or colocated), 1 decode
FR_PROMISED = 2  # P/D: blocks promised on this decode replica, not yet admitted there
FR_ROOM = 3  # capacity minus headroom, in blocks
FR_INCARNATION = 4  # index of its current incarnation (series buffers)
N_FR = 5

# fg slots: run scalars, i8[N_FG]
FG_NEXT_ARRIVAL = 0
FG_TICK = 1  # migration: index of the next tick
FG_Q_HEAD = 2  # fleet queue: a ring of n slots
FG_Q_LEN = 3
FG_N_FLIGHT = 4
FG_NEXT_FAILURE = 5  # next failure event (down or up)
FG_N_PROMISED = 6
FG_N_INCARNATIONS = 7
FG_PD = 8  # P/D on (1/0)
N_FG = 9

# scratch rows (migration): queue head, sources, destinations
SC_HEAD, SC_SOURCES, SC_TARGETS = 0, 1, 2
N_SCRATCH = 3

# Fleet outputs besides the engine's per-request rows.
RQ_REROUTES, RQ_REPREFILL, RQ_ENDED_ON = 0, 1, 2  # requests: i8[N_RQ, n]
N_RQ = 3
FL_MIGRATIONS, FL_HANDOFFS, FL_INCARNATIONS, FL_ERROR = 0, 1, 2, 3  # fleet: i8[N_FLEET]
N_FLEET = 4
#: Fleet error codes: a request never ended, a hand-off was left in flight, the event loop
#: made no progress (``_progress_budget`` exceeded), a replica's engine reported an error.
ERROR_UNENDED = 1
ERROR_IN_FLIGHT = 2
ERROR_NO_PROGRESS = 3
ERROR_ENGINE = 4
# stall slots: where a guard stopped the run, f8[N_STALL]
(ST_T, ST_REPLICA, ST_ITERATIONS, ST_Q_LEN, ST_N_FLIGHT, ST_ARRIVALS, ST_FAILURES, ST_CLOCK, ST_RUNNING, ST_WAITING,
 ST_OUTSTANDING, ST_ENGINE_ERROR) = range(12)
N_STALL = 12


class FleetBuffers(NamedTuple):
    """What one fleet run writes: the engine's per-request rows (over every replica and the
    fleet), fleet rows per request, figures per replica (summed over its incarnations:
    a replica back from a failure is a new incarnation) and each incarnation's series."""

    out_i: np.ndarray  # i8[N_OI, n]
    out_f: np.ndarray  # f8[N_OF, n]
    cached: np.ndarray  # i8[n]
    requests: np.ndarray  # i8[N_RQ, n]
    counts: np.ndarray  # i8[R, N_COUNTS]
    fcounts: np.ndarray  # f8[R, N_FCOUNTS]
    prefix: np.ndarray  # f8[R, N_PREFIX]
    service: np.ndarray  # f8[R, tenants]
    routed: np.ndarray  # i8[R], deliveries to each replica
    series: np.ndarray  # f8[I, SERIES_CAPACITY, 4], per incarnation
    incarnations: np.ndarray  # i8[I, 2]: replica, samples
    ends: np.ndarray  # f8[I]: clock when the incarnation stopped
    fleet: np.ndarray  # i8[N_FLEET]
    stall: np.ndarray  # f8[N_STALL]: where a progress guard stopped the run (NaN: it did not)


class Fleet(NamedTuple):
    """The loop's state (arrays borrowed; ``owners`` keeps the replicas alive)."""

    owners: typed.List  # Replica per replica (its current incarnation)
    nodes: typed.List  # (Replica, Statics, StepTables) per replica, borrowed views
    cfg: np.ndarray
    fi: np.ndarray
    carried_i: np.ndarray  # engine.K_* rows
    carried_f: np.ndarray
    fr: np.ndarray
    fg: np.ndarray
    queue: np.ndarray  # i8[n] ring
    queued_at: np.ndarray  # f8[n], by request
    ready_at: np.ndarray  # f8[n]: a request a failure displaced is placed no earlier (its last step's end)
    flight_t: np.ndarray  # f8[n], sorted by (time, request)
    flight_r: np.ndarray  # i8[n]
    promised: np.ndarray  # i8[n], requests holding a promise (FG_N_PROMISED of them)
    summary: np.ndarray  # f8[R, routing.N_SUMMARY]
    stepping: np.ndarray  # i8[R], replicas whose step ends are events
    scratch: np.ndarray  # i8[N_SCRATCH, R], migration's per-replica lists
    freeness: np.ndarray  # f8[R], migration's freeness
    router: rt.RouterState
    out: FleetBuffers
    block_hashes: np.ndarray
    caps: np.ndarray  # i8[R]
    hosts: np.ndarray
    kv_bytes: np.ndarray  # f8[R]
    swap_bw: np.ndarray
    tenant_params: np.ndarray
    class_params: np.ndarray
    fail_t: np.ndarray  # failure events in processing order (FailureSchedule.events)
    fail_replica: np.ndarray
    fail_up: np.ndarray
    t0: float
    seed: int
    series_every: float
    fast_forward: bool
    lockstep: int  # ranks per instance that step together (attention DP); 1: replicas step alone


# ======================================================================================
# the kernel
# ======================================================================================
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
        for k in range(n_stepping):
            _run(fl, fl.stepping[k], t, True)
        # a promise ended at t may unblock the queue, and no later event need come
        released = _release_promises(fl)
        t_next = t if released > 0 and fl.fg[FG_Q_LEN] > 0 else _next_event(fl, t, n_stepping)
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
def _new_fleet(statics, tables, block_hashes, kv_bytes, swap_bw, fail_t, fail_replica, fail_up, cfg, caps, hosts,
               seed, series_every, fast_forward, lockstep, tenant_params, class_params, router, out):
    n_rep = len(statics)
    n = statics[0].sf.shape[1]
    t0 = statics[0].sf[S_ARRIVAL, 0]
    prefill = int(cfg[I_PREFILL_REPLICAS])
    pd = n_rep > 1 and prefill > 0
    fr = np.zeros((N_FR, n_rep), dtype=np.int64)
    owners = typed.List()
    nodes = typed.List()
    for j in range(n_rep):
        rep = engine.new_replica(statics[j], cfg, caps[j], hosts[j], kv_bytes[j], swap_bw[j], seed,
                                 series_every, fast_forward, tenant_params, class_params, t0)
        if pd and j < prefill:
            engine.hand_off_after_first_token(rep)
        owners.append(rep)
        nodes.append((engine.borrow_replica(rep), engine.borrow_statics(statics[j]),
                      engine.borrow_tables(tables[j])))
        fr[FR_ALIVE, j] = 1
        fr[FR_POOL, j] = 1 if pd and j >= prefill else 0
        fr[FR_ROOM, j] = engine.capacity_blocks(rep) - engine.headroom_blocks(rep)
        fr[FR_INCARNATION, j] = j
    fg = np.zeros(N_FG, dtype=np.int64)
    fg[FG_TICK] = 1
    fg[FG_N_INCARNATIONS] = n_rep
    fg[FG_PD] = 1 if pd else 0
    carried_i, carried_f = engine.new_carried(n)
    out.out_i[O_STATE] = -1  # not ended yet
    out.requests[RQ_ENDED_ON] = -1
    return Fleet(owners, nodes, cfg, np.full((N_FI, n), -1, dtype=np.int64), carried_i, carried_f, fr, fg,
                 np.zeros(n, dtype=np.int64), np.zeros(n), np.full(n, -np.inf), np.zeros(n),
                 np.zeros(n, dtype=np.int64),
                 np.zeros(n, dtype=np.int64), np.zeros((n_rep, rt.N_SUMMARY)), np.zeros(n_rep, dtype=np.int64),
                 np.zeros((N_SCRATCH, n_rep), dtype=np.int64), np.zeros(n_rep), router, out, block_hashes, caps,
                 hosts, kv_bytes, swap_bw, tenant_params, class_params, fail_t, fail_replica, fail_up, t0, seed,
                 series_every, fast_forward, lockstep)


@njit(cache=True, nogil=True)
def _borrow_fleet(fl):
    """``fl`` with every array borrowed (the typed lists stay counted)."""
    out, router = fl.out, fl.router
    return Fleet(
        fl.owners, fl.nodes, borrowed(fl.cfg), borrowed(fl.fi), borrowed(fl.carried_i), borrowed(fl.carried_f),
        borrowed(fl.fr), borrowed(fl.fg), borrowed(fl.queue), borrowed(fl.queued_at), borrowed(fl.ready_at),
        borrowed(fl.flight_t),
        borrowed(fl.flight_r), borrowed(fl.promised), borrowed(fl.summary), borrowed(fl.stepping),
        borrowed(fl.scratch), borrowed(fl.freeness),
        rt.RouterState(borrowed(router.next_rr), borrowed(router.entry_owners), borrowed(router.set_size),
                       borrowed(router.ring_points), borrowed(router.ring_owners), borrowed(router.ring_size),
                       borrowed(router.ring_members)),
        FleetBuffers(borrowed(out.out_i), borrowed(out.out_f), borrowed(out.cached), borrowed(out.requests),
                     borrowed(out.counts), borrowed(out.fcounts), borrowed(out.prefix), borrowed(out.service),
                     borrowed(out.routed), borrowed(out.series), borrowed(out.incarnations), borrowed(out.ends),
                     borrowed(out.fleet), borrowed(out.stall)),
        borrowed(fl.block_hashes), borrowed(fl.caps), borrowed(fl.hosts), borrowed(fl.kv_bytes), borrowed(fl.swap_bw),
        borrowed(fl.tenant_params), borrowed(fl.class_params), borrowed(fl.fail_t), borrowed(fl.fail_replica),
        borrowed(fl.fail_up), fl.t0, fl.seed, fl.series_every, fl.fast_forward, fl.lockstep)


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


# -- the progress guard ---------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _progress(fl):
    """The run's progress counters summed: arrivals and failure events taken, migration
    ticks, deliveries and steps of every incarnation. Every event of a correct run
    moves one of them, so they bound the event loop's iterations."""
    fg, out = fl.fg, fl.out
    p = fg[FG_NEXT_ARRIVAL] + fg[FG_NEXT_FAILURE] + fg[FG_TICK]
    for j in range(fl.fr.shape[1]):
        p += out.routed[j] + out.counts[j, C_STEPS]  # counts: retired incarnations
        if fl.fr[FR_ALIVE, j]:
            p += fl.nodes[j][0].g[STEPS]
    return p


@njit(cache=True, nogil=True)
def _engine_error(fl, j):
    """Replica j's engine error code (its current incarnation's, or a retired one's)."""
    e = fl.out.counts[j, C_ERROR]
    if fl.fr[FR_ALIVE, j] and fl.nodes[j][0].g[ERROR] != 0:
        e = fl.nodes[j][0].g[ERROR]
    return e


@njit(cache=True, nogil=True)
def _replica_in_error(fl):
    """The first replica whose engine reported an internal error (-1: none)."""
    for j in range(fl.fr.shape[1]):
        if _engine_error(fl, j) != 0:
            return j
    return -1


@njit(cache=True, nogil=True)
def _laggard(fl):
    """The alive replica holding requests with the earliest clock (-1: none holds any)."""
    best = -1
    for j in range(fl.fr.shape[1]):
        if fl.fr[FR_ALIVE, j] and engine.outstanding(fl.nodes[j][0]) > 0:
            if best < 0 or engine.clock(fl.nodes[j][0]) < engine.clock(fl.nodes[best][0]):
                best = j
    return best


@njit(cache=True, nogil=True)
def _stall(fl, t, code, j, iterations, engine_error):
    """A guard stops the run at t: record the error and what the fleet and replica j looked like."""
    fg, s = fl.fg, fl.out.stall
    fl.out.fleet[FL_ERROR] = code
    s[ST_T] = t
    s[ST_REPLICA] = j
    s[ST_ITERATIONS] = iterations
    s[ST_Q_LEN] = fg[FG_Q_LEN]
    s[ST_N_FLIGHT] = fg[FG_N_FLIGHT]
    s[ST_ARRIVALS] = fg[FG_NEXT_ARRIVAL]
    s[ST_FAILURES] = fg[FG_NEXT_FAILURE]
    s[ST_ENGINE_ERROR] = engine_error
    if j >= 0 and fl.fr[FR_ALIVE, j]:
        rep = fl.nodes[j][0]
        s[ST_CLOCK] = engine.clock(rep)
        s[ST_RUNNING] = engine.running(rep)
        s[ST_WAITING] = engine.waiting(rep)
        s[ST_OUTSTANDING] = engine.outstanding(rep)


# -- the loop ---------------------------------------------------------------------------
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


# -- the fleet queue and routing ------------------------------------------------------------
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
            need = _blocks(prompt[r] + fl.carried_i[K_GENERATED, r] + 1, block_size)
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
def _no_prefill_admits(fl, r):
    """P/D: whether every prefill replica, alive or not, would reject arrival r as
    EXCEEDS_CAPACITY (``engine.never_admits``), so that no decode KV is promised to it."""
    for j in range(fl.fr.shape[1]):
        if fl.fr[FR_POOL, j] == 0 and not engine.never_admits(fl.nodes[j][0], fl.nodes[j][1], fl.cfg, r):
            return False
    return True


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


@njit(cache=True, nogil=True)
def _deliver(fl, r, j, t):
    fl.fi[FI_OWNER, r] = j
    rep, st, _ = fl.nodes[j]
    engine.deliver_carried(rep, st, r, t, fl.carried_i, fl.carried_f)
    fl.out.routed[j] += 1


# -- requests moving between replicas ---------------------------------------------------------
@njit(cache=True, nogil=True)
def _send(fl, r, j, t_arrive):
    """r left its replica (its carried rows are written) and reaches replica j at t_arrive."""
    fl.fi[FI_OWNER, r] = -1
    fl.fi[FI_DEST, r] = j
    k = fl.fg[FG_N_FLIGHT]
    while k > 0 and (fl.flight_t[k - 1] > t_arrive or (fl.flight_t[k - 1] == t_arrive and fl.flight_r[k - 1] > r)):
        fl.flight_t[k] = fl.flight_t[k - 1]
        fl.flight_r[k] = fl.flight_r[k - 1]
        k -= 1
    fl.flight_t[k] = t_arrive
    fl.flight_r[k] = r
    fl.fg[FG_N_FLIGHT] += 1


@njit(cache=True, nogil=True)
def _pop_flight(fl):
    return _remove_flight(fl, 0)


@njit(cache=True, nogil=True)
def _remove_flight(fl, k):
    r = fl.flight_r[k]
    m = fl.fg[FG_N_FLIGHT] - 1
    fl.flight_t[k:m] = fl.flight_t[k + 1:m + 1]
    fl.flight_r[k:m] = fl.flight_r[k + 1:m + 1]
    fl.fg[FG_N_FLIGHT] = m
    return r


@njit(cache=True, nogil=True)
def _send_handoffs(fl, j):
    """P/D: send what prefill replica j handed off in its last step to the decode replica
    that promised it KV; return how many."""
    rep = fl.nodes[j][0]
    handed = engine.handed_off(rep)
    if len(handed) == 0:
        return 0
    t_end = engine.clock(rep)
    bandwidth = fl.cfg[I_INTERCONNECT] * 1e9
    for r in handed:
        engine.carry(rep, r, True, fl.carried_i, fl.carried_f)
        kv = (fl.carried_i[K_COMPUTED, r] + 1) * fl.kv_bytes[j]
        _send(fl, r, fl.fi[FI_PROMISE, r], t_end + kv / bandwidth)
        fl.out.fleet[FL_HANDOFFS] += 1
    k = len(handed)
    engine.clear_handed_off(rep)
    return k


@njit(cache=True, nogil=True)
def _release_promises(fl):
    """P/D: a promise ends once its request is admitted on the decode replica (it started
    running there, or was preempted there since it arrived) or ended anywhere; returns how
    many ended."""
    fg, fi = fl.fg, fl.fi
    k = 0
    ended = 0
    while k < fg[FG_N_PROMISED]:
        r = fl.promised[k]
        o = fi[FI_OWNER, r]
        release = False
        if o >= 0:
            ri = fl.nodes[o][0].ri
            status = ri[STATUS, r]
            release = status == DONE or (o == fi[FI_PROMISE, r] and (
                status == RUNNING or ri[PREEMPTS, r] > fl.carried_i[K_PREEMPTS, r]))
        if release:
            _end_promise(fl, r)  # moves the last entry to slot k
            ended += 1
        else:
            k += 1
    return ended


@njit(cache=True, nogil=True)
def _end_promise(fl, r):
    fi, fg = fl.fi, fl.fg
    d = fi[FI_PROMISE, r]
    if d < 0:
        return
    fl.fr[FR_PROMISED, d] -= fi[FI_NEED, r]
    fi[FI_PROMISE, r] = -1
    fi[FI_NEED, r] = 0
    last = fg[FG_N_PROMISED] - 1
    for k in range(last + 1):
        if fl.promised[k] == r:
            fl.promised[k] = fl.promised[last]
            break
    fg[FG_N_PROMISED] = last


# -- failures ------------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _fail(fl, j, t):
    """Replica j stops: what it holds, what is on its way to it and (decode) what it
    promised KV to lose their KV and rejoin the queue in trace order; its cache is gone."""
    fi, fr = fl.fi, fl.fr
    rep_j = fl.nodes[j][0]
    decode = fr[FR_POOL, j] == 1
    for r in range(fi.shape[1]):
        o = fi[FI_OWNER, r]
        if o == j and rep_j.ri[STATUS, r] == DONE:
            # ended here: its outputs are written by _retire below; it must not stay owned by
            # j, or j's next incarnation (where r is NOT_ARRIVED) would take it for one in
            # its inbox at j's next failure (issue 18: a replica failing twice never ended)
            fi[FI_OWNER, r] = -1
            continue
        held = o == j
        if not (held or fi[FI_DEST, r] == j or (decode and fi[FI_PROMISE, r] == j)):
            continue
        fl.ready_at[r] = t
        if o >= 0:
            rep, st, _ = fl.nodes[o]
            lost = engine.withdraw(rep, st, r, False, fl.carried_i, fl.carried_f)
            # its replica's step in flight completes and streams: placed once it ends
            fl.ready_at[r] = max(t, engine.clock(rep))
        else:  # in flight
            for k in range(fl.fg[FG_N_FLIGHT]):
                if fl.flight_r[k] == r:
                    _remove_flight(fl, k)
                    break
            fi[FI_DEST, r] = -1
            lost = fl.carried_i[K_COMPUTED, r]
            fl.carried_i[K_COMPUTED, r] = 0
        fl.out.requests[RQ_REPREFILL, r] += lost
        fl.out.requests[RQ_REROUTES, r] += 1
        _end_promise(fl, r)
        fi[FI_OWNER, r] = -1
        _enqueue(fl, r, t)
    _retire(fl, j, t)
    fr[FR_ALIVE, j] = 0
    rt.forget_replica(fl.router, j)


@njit(cache=True, nogil=True)
def _recover(fl, j, t):
    """Replica j is back at t, empty: a new incarnation."""
    _, st, tables = fl.nodes[j]
    rep = engine.new_replica(st, fl.cfg, fl.caps[j], fl.hosts[j], fl.kv_bytes[j], fl.swap_bw[j], fl.seed,
                             fl.series_every, fl.fast_forward, fl.tenant_params, fl.class_params, t)
    if fl.fg[FG_PD] != 0 and fl.fr[FR_POOL, j] == 0:
        engine.hand_off_after_first_token(rep)
    fl.owners[j] = rep
    fl.nodes[j] = (engine.borrow_replica(rep), st, tables)
    fl.fr[FR_ALIVE, j] = 1
    fl.fr[FR_INCARNATION, j] = fl.fg[FG_N_INCARNATIONS]
    fl.fg[FG_N_INCARNATIONS] += 1


@njit(cache=True, nogil=True)
def _retire(fl, j, t_stop):
    """Write the outputs of replica j's current incarnation, which stops at ``t_stop`` (it
    failed, or the run ended): its ended requests, its figures (added to j's), its series."""
    out = fl.out
    rep = fl.nodes[j][0]
    inc = fl.fr[FR_INCARNATION, j]
    counts = np.zeros(N_COUNTS, dtype=np.int64)
    fcounts = np.zeros(N_FCOUNTS)
    prefix = np.zeros(N_PREFIX)
    service = np.zeros(out.service.shape[1])
    engine.drain_pipeline(rep, fl.nodes[j][1])  # requests that ended with its last step leave with it
    engine.write_outputs(rep, out.out_i, out.out_f, counts, fcounts, out.series[inc], out.cached, service, prefix)
    if counts[C_PEAK_STEP] > out.counts[j, C_PEAK_STEP]:  # an earlier incarnation's equal peak came first
        out.fcounts[j, F_PEAK_STEP_S] = fcounts[F_PEAK_STEP_S]
    for c in range(N_COUNTS):
        if c == C_CAP or c == C_PEAK or c == C_ERROR or c == C_PEAK_STEP:
            out.counts[j, c] = max(out.counts[j, c], counts[c])
        elif c != C_N_SAMPLES:
            out.counts[j, c] += counts[c]
    out.fcounts[j, F_BUSY] += fcounts[F_BUSY]
    out.fcounts[j, F_END] = max(out.fcounts[j, F_END], fcounts[F_END])
    out.fcounts[j, F_AD_LOAD_S] += fcounts[F_AD_LOAD_S]
    out.prefix[j] += prefix
    out.service[j] += service
    out.incarnations[inc, 0] = j
    out.incarnations[inc, 1] = counts[C_N_SAMPLES]
    out.ends[inc] = t_stop
    status = rep.ri[STATUS]
    for r in range(status.shape[0]):
        if status[r] == DONE:
            out.requests[RQ_ENDED_ON, r] = j


# -- ending in the fleet ---------------------------------------------------------------------
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


# -- migration -----------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _migrate(fl, t):
    """Llumnix at a tick, pool by pool: the replicas short of KV (freeness below the
    threshold, queue head blocked on KV), lowest freeness first, pair with the freest
    (freeness at or above it), highest first; each source sends its newest running
    request with its KV when moving it (pause + transfer) is quicker than its queue head
    has waited."""
    cfg, s = fl.cfg, fl.summary
    threshold = cfg[I_MIGRATION_THRESHOLD]
    arrival = fl.nodes[0][1].sf[S_ARRIVAL]
    heads, sources, targets = fl.scratch[SC_HEAD], fl.scratch[SC_SOURCES], fl.scratch[SC_TARGETS]
    freeness = fl.freeness
    for pool in range(2):
        if not _someone_waits(fl, pool):
            continue  # a source needs a queue head: most ticks end here, before any scan
        _fill_summary(fl, pool, True, False)
        n_src = 0
        n_dst = 0
        for j in range(s.shape[0]):
            if s[j, rt.ALIVE] <= 0:
                continue
            rep, st, _ = fl.nodes[j]
            heads[j] = engine.head_request(rep, st, cfg) if s[j, rt.WAITING] > 0 else -1
            freeness[j] = rt.migration_freeness(s, j)
            if freeness[j] >= threshold:
                targets[n_dst] = j
                n_dst += 1
            elif heads[j] >= 0 and s[j, rt.HEAD_DEMAND] > s[j, rt.FREE] - s[j, rt.HEADROOM]:
                sources[n_src] = j
                n_src += 1
        if n_src == 0 or n_dst == 0:
            continue
        by_freeness = sources[:n_src][np.argsort(freeness[sources[:n_src]], kind="mergesort")]
        by_room = targets[:n_dst][np.argsort(-freeness[targets[:n_dst]], kind="mergesort")]
        for k in range(min(n_src, n_dst)):
            src = by_freeness[k]
            rep, st, _ = fl.nodes[src]
            r = engine.newest_running(rep)
            if r < 0:
                continue
            move_s = (cfg[I_MIGRATION_PAUSE] * 1e-3
                      + rep.ri[COMPUTED, r] * fl.kv_bytes[src] / (cfg[I_INTERCONNECT] * 1e9))
            if move_s < t - arrival[heads[src]]:
                engine.withdraw(rep, st, r, True, fl.carried_i, fl.carried_f)
                _send(fl, r, by_room[k], t + move_s)
                fl.out.fleet[FL_MIGRATIONS] += 1


@njit(cache=True, nogil=True)
def _someone_waits(fl, pool):
    for j in range(fl.fr.shape[1]):
        if fl.fr[FR_ALIVE, j] and fl.fr[FR_POOL, j] == pool and engine.waiting(fl.nodes[j][0]) > 0:
            return True
    return False


@njit(cache=True, nogil=True, inline="always")
def _blocks(tokens, block_size):
    return (tokens + block_size - 1) // block_size


# ======================================================================================
# Python side
# ======================================================================================
def warmup(speculative: bool = True) -> None:
    """Compile (or load from cache) the fleet kernels on the engine's warm-up trace, two
    replicas, with migration, P/D and a failure exercised; ``speculative`` as in
    ``engine.warmup``."""
    trace, cost, configs = engine.warmup_inputs()
    fleets = [c.replace(router="least_kv", migration=True) for c in configs]
    fleets[1] = fleets[1].replace(prefill_replicas=1)
    simulate_fleet(trace, cost, fleets[0], replicas=2, failures=FailureSchedule.from_rows([(1, 0.01, 0.02)]))
    simulate_fleet_many(trace, cost, fleets if speculative else engine.without_speculation(fleets), replicas=2)


def simulate_fleet(trace, cost_models, config: PolicyConfig, seed: int = 0, *, replicas: int | None = None,
                   failures: FailureSchedule | None = None, acceptance: spm.AcceptanceModel | None = None,
                   sharing: fm.SharingSpec | None = None, progress_budget: tuple[int, int] | None = None,
                   lockstep: int = 1) -> SimResult:
    """Replay ``trace`` through a fleet of replicas running ``config``; deterministic for a seed.

    ``cost_models`` is one CostModel (every replica alike) or one per replica (their GPU,
    TP or model may differ); ``replicas`` is the fleet's size (default: the list's length,
    or 1). ``failures`` is a ``FailureSchedule`` of replica downtimes. ``acceptance`` and
    ``sharing`` as in ``engine.simulate``. Per-request fields cover the whole fleet
    (``replica``: where a finished request ended); counters are summed over replicas, the
    KV peak is the sum of each replica's peak, the series sums the replicas' samples, the
    step-time histogram sums every replica's (each incarnation's added in ``_retire``); the
    fleet fields (``reroutes`` ... ``replica_*``, ``migrations``, ``handoffs``) are filled.
    ``progress_budget`` (base, per) bounds the event loop's iterations by base + per *
    progress (default: ``engine.default_progress_budget`` of requests + failure events +
    replicas; each replica's engine keeps its own default guard); past it the run raises
    ``SimulationStalled`` instead of hanging. ``lockstep`` > 1: every ``lockstep``
    consecutive replicas are the attention-DP ranks of one instance and step together
    (``policies.engine.lockstep``); a failure window must then stop all of an instance's
    ranks (``FailureSchedule.per_rank``), and P/D is refused.
    """
    return simulate_fleet_many(trace, cost_models, [config], seed, replicas=replicas, failures=failures,
                               acceptance=acceptance, sharing=sharing, progress_budget=progress_budget,
                               lockstep=lockstep)[0]


def simulate_fleet_many(trace, cost_models, configs: Sequence[PolicyConfig], seed: int = 0, *,
                        replicas: int | None = None, failures: FailureSchedule | None = None,
                        acceptance: spm.AcceptanceModel | None = None, sharing: fm.SharingSpec | None = None,
                        progress_budget: tuple[int, int] | None = None, lockstep: int = 1) -> list[SimResult]:
    """``simulate_fleet`` for each config (each its own fleet), in parallel across cores;
    results in config order."""
    if not configs:
        return []
    costs = _replica_costs(cost_models, replicas)
    n_rep = len(costs)
    for config in configs:
        check_fleet(config, n_rep, lockstep)
    schedule = failures if failures is not None else FailureSchedule.empty()
    if not isinstance(schedule, FailureSchedule):
        raise TypeError(f"failures must be a policies.failures.FailureSchedule or None, got {type(failures).__name__}")
    schedule.check_replicas(n_rep)
    schedule.check_lockstep(lockstep)
    limits = [[engine.validate(trace, cost, config) for cost in costs] for config in configs]
    by_model: dict[int, engine.Statics] = {}
    for cost in costs:
        if id(cost) not in by_model:
            by_model[id(cost)] = engine.statics(trace, cost, configs, acceptance)
    statics = typed.List([by_model[id(cost)] for cost in costs])
    tables = typed.List([cost.tables for cost in costs])
    kv_bytes = np.array([cost.kv_bytes_per_token for cost in costs], dtype=np.float64)
    swap_bw = np.array([cost.swap_bytes_per_s for cost in costs], dtype=np.float64)
    fail_t, fail_replica, fail_up = schedule.events()
    incarnations = n_rep + int(fail_up.sum())
    side = [engine.fairness_params(trace, config, sharing) for config in configs]
    n_tenants = len(side[0][0])
    cfgs = np.stack([config.to_vector() for config in configs])
    caps = np.array([[cap for cap, _ in row] for row in limits], dtype=np.int64)
    hosts = np.array([[host for _, host in row] for row in limits], dtype=np.int64)
    routers = [rt.new_router_state(n_rep, statics[0].n_entries, config.hash_virtual_nodes) for config in configs]
    outs = [_buffers(trace.n, n_rep, n_tenants, incarnations) for _ in configs]
    # the identity-salted hashes, a fresh writable array (as engine.statics copies the offsets):
    # one kernel type whether the trace's columns are read-only (a loaded Trace) or not
    args = (statics, tables, trace.cache_block_hashes, kv_bytes, swap_bw,
            fail_t.astype(np.float64), fail_replica.astype(np.int64), fail_up.astype(np.bool_))
    every = engine.default_series_every(trace)
    fast_forward = engine.fast_forward_enabled() and lockstep == 1
    budget = engine.progress_bound(progress_budget, trace.n + len(fail_t) + n_rep)

    def replay(k: int) -> None:
        fleet_kernel(*args, cfgs[k], caps[k], hosts[k], seed, every, fast_forward, lockstep, side[k][0], side[k][1],
                     routers[k], outs[k], budget)

    engine.in_parallel(replay, len(configs))
    return [_fleet_result(trace, out, side[k][0][:, fm.T_WEIGHT], schedule) for k, out in enumerate(outs)]


def _replica_costs(cost_models, replicas: int | None) -> list[CostModel]:
    """One CostModel per replica, checked against ``replicas``."""
    if isinstance(cost_models, CostModel):
        count = 1 if replicas is None else replicas
        costs = [cost_models] * count if isinstance(count, int | np.integer) and count >= 1 else []
    else:
        costs = list(cost_models)
        bad = [k for k, cost in enumerate(costs) if not isinstance(cost, CostModel)]
        if bad:
            raise TypeError(f"cost_models[{bad[0]}] is a {type(costs[bad[0]]).__name__}, not a CostModel")
        if replicas is not None and replicas != len(costs):
            raise ValueError(f"replicas={replicas} but {len(costs)} cost models were given; give one per replica "
                             "or a single CostModel")
    if not costs:
        raise ValueError(f"a fleet needs at least one replica, got replicas={replicas!r} and "
                         f"{0 if isinstance(cost_models, CostModel) else len(cost_models)} cost models")
    return costs


def _buffers(n: int, n_rep: int, n_tenants: int, incarnations: int) -> FleetBuffers:
    return FleetBuffers(
        out_i=np.zeros((N_OI, n), dtype=np.int64), out_f=np.full((N_OF, n), np.nan), cached=np.zeros(n, dtype=np.int64),
        requests=np.zeros((N_RQ, n), dtype=np.int64), counts=np.zeros((n_rep, N_COUNTS), dtype=np.int64),
        fcounts=np.zeros((n_rep, N_FCOUNTS)), prefix=np.zeros((n_rep, N_PREFIX)),
        service=np.zeros((n_rep, n_tenants)), routed=np.zeros(n_rep, dtype=np.int64),
        series=np.zeros((incarnations, SERIES_CAPACITY, 4)), incarnations=np.full((incarnations, 2), -1, np.int64),
        ends=np.full(incarnations, np.nan), fleet=np.zeros(N_FLEET, dtype=np.int64), stall=np.full(N_STALL, np.nan),
    )


def _fleet_result(trace, out: FleetBuffers, weights: np.ndarray, schedule: FailureSchedule) -> SimResult:
    error = int(out.fleet[FL_ERROR])
    if error in (ERROR_NO_PROGRESS, ERROR_ENGINE):
        raise SimulationStalled(_stall_message(error, out.stall, trace.n, len(schedule)))
    if error:
        what = {ERROR_UNENDED: "a request never ended", ERROR_IN_FLIGHT: "a hand-off was left in flight"}[error]
        raise RuntimeError(f"fleet kernel: {what}; please report this trace and config")
    counts = out.counts.sum(axis=0)
    counts[C_ERROR] = out.counts[:, C_ERROR].max()
    counts[C_PEAK_STEP] = out.counts[:, C_PEAK_STEP].max()
    at_peak = out.counts[:, C_PEAK_STEP] == counts[C_PEAK_STEP]
    fcounts = np.zeros(N_FCOUNTS)
    fcounts[F_BUSY], fcounts[F_END] = out.fcounts[:, F_BUSY].sum(), out.fcounts[:, F_END].max()
    fcounts[F_PEAK_STEP_S] = out.fcounts[at_peak, F_PEAK_STEP_S].min() if counts[C_PEAK_STEP] > 0 else np.nan
    fcounts[F_AD_LOAD_S] = out.fcounts[:, F_AD_LOAD_S].sum()
    series = _merged_series(out)
    counts[C_N_SAMPLES] = len(series)
    result = engine.sim_result(trace, out.out_i, out.out_f, counts, fcounts, series, out.cached, out.service.sum(axis=0),
                            out.prefix.sum(axis=0), weights)
    return dataclasses.replace(
        result,
        replica=np.where(result.state == S_FINISHED, out.requests[RQ_ENDED_ON], -1).astype(np.int32),
        reroutes=out.requests[RQ_REROUTES].astype(np.int32),
        reprefill_tokens=out.requests[RQ_REPREFILL].copy(),
        failure_replica=schedule.replica.astype(np.int32),
        failure_down_s=schedule.t_down.copy(),
        failure_up_s=schedule.t_up.copy(),
        replica_routed=out.routed.copy(),
        replica_prefix_hit_tokens=out.prefix[:, P_HIT_TOKENS].astype(np.int64),
        replica_prefix_query_tokens=out.prefix[:, P_QUERY_TOKENS].astype(np.int64),
        replica_kv_peak_blocks=out.counts[:, C_PEAK].copy(),
        replica_kv_capacity_blocks=out.counts[:, C_CAP].copy(),
        migrations=int(out.fleet[FL_MIGRATIONS]),
        handoffs=int(out.fleet[FL_HANDOFFS]),
    )


def _stall_message(error: int, stall: np.ndarray, n: int, n_windows: int) -> str:
    s = stall
    j = int(s[ST_REPLICA])
    why = (f"replica {j}'s engine: {engine.ERROR_WHY[int(s[ST_ENGINE_ERROR])]}" if error == ERROR_ENGINE
           else f"the event loop passed its bound of iterations ({int(s[ST_ITERATIONS])})")
    state = (f"fleet queue {int(s[ST_Q_LEN])}, in flight {int(s[ST_N_FLIGHT])}, arrivals {int(s[ST_ARRIVALS])}/{n}, "
             f"failure events {int(s[ST_FAILURES])} (of {n_windows} windows)")
    if not math.isnan(s[ST_CLOCK]):
        state += (f"; replica clock {s[ST_CLOCK]:.6g} s, running {int(s[ST_RUNNING])}, waiting {int(s[ST_WAITING])}, "
                  f"outstanding {int(s[ST_OUTSTANDING])}")
    return (f"simulation made no progress at t={s[ST_T]:.6g} s, replica {j if j >= 0 else 'none'}, state: {state} "
            f"({why}); please report this trace, config and failure schedule")


def _merged_series(out: FleetBuffers) -> np.ndarray:
    """The fleet's series: at every sample time of any incarnation, the sum over
    incarnations of each one's latest sample (none before its first, none once it stopped)."""
    used = [k for k in range(len(out.incarnations)) if out.incarnations[k, 0] >= 0]
    parts = [out.series[k, :out.incarnations[k, 1]] for k in used]
    times = np.unique(np.concatenate([part[:, 0] for part in parts]))
    merged = np.zeros((len(times), 4))
    merged[:, 0] = times
    for k, part in zip(used, parts, strict=True):
        latest = np.searchsorted(part[:, 0], times, side="right") - 1
        live = (latest >= 0) & (times < out.ends[k])
        merged[:, 1:] += np.where(live[:, None], part[np.maximum(latest, 0), 1:], 0.0) if len(part) else 0.0
    return merged
