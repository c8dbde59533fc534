"""Replica failures (the schedule itself is ``policies.failures``): a replica going down sends
what it held back to the fleet queue, one coming back is a new incarnation, and
``_retire`` writes an incarnation's outputs (at its failure or the run's end).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from policies import engine
from policies import routing as rt
from policies.engine import K_COMPUTED, N_PREFIX
from policies.fleet.moves import _remove_flight
from policies.fleet.pd import _end_promise
from policies.fleet.queue import _enqueue
from policies.fleet.state import (
    FG_N_FLIGHT,
    FG_N_INCARNATIONS,
    FG_PD,
    FI_DEST,
    FI_OWNER,
    FI_PROMISE,
    FR_ALIVE,
    FR_INCARNATION,
    FR_POOL,
    RQ_ENDED_ON,
    RQ_REPREFILL,
    RQ_REROUTES,
)
from policies.kernel_state import (
    C_CAP,
    C_ERROR,
    C_N_SAMPLES,
    C_PEAK,
    C_PEAK_STEP,
    DONE,
    F_AD_LOAD_S,
    F_BUSY,
    F_END,
    F_PEAK_STEP_S,
    N_COUNTS,
    N_FCOUNTS,
    STATUS,
)


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
