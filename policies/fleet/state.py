"""The fleet run's state layout: the ``fi`` (per request), ``fr`` (per replica) and ``fg``
(run scalars) rows and slots, the outputs (``FleetBuffers``), the loop's state (``Fleet``),
its allocation (``_new_fleet``) and borrowed view (``_borrow_fleet``). Every other fleet
module reads these, so this one imports none of them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, typed

from policies import engine
from policies import routing as rt
from policies.config import KNOB_INDEX
from policies.engine import O_STATE, borrowed
from policies.kernel_state import S_ARRIVAL
from policies.result import Reject, State

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
