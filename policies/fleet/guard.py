"""The fleet's progress guard: the run's progress counters, the replicas' engine errors and
the record (``FleetBuffers.stall``) of where a guard stopped the run.
"""

from __future__ import annotations

from numba import njit

from policies import engine
from policies.fleet.state import (
    FG_N_FLIGHT,
    FG_NEXT_ARRIVAL,
    FG_NEXT_FAILURE,
    FG_Q_LEN,
    FG_TICK,
    FL_ERROR,
    FR_ALIVE,
    ST_ARRIVALS,
    ST_CLOCK,
    ST_ENGINE_ERROR,
    ST_FAILURES,
    ST_ITERATIONS,
    ST_N_FLIGHT,
    ST_OUTSTANDING,
    ST_Q_LEN,
    ST_REPLICA,
    ST_RUNNING,
    ST_T,
    ST_WAITING,
)
from policies.kernel_state import C_ERROR, C_STEPS, ERROR, STEPS


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
