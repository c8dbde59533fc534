"""Requests moving to a replica: delivery, and the in-flight list (by arrival time, then
request) of those on their way after a migration or a P/D hand-off.
"""

from __future__ import annotations

from numba import njit

from policies import engine
from policies.fleet.state import FG_N_FLIGHT, FI_DEST, FI_OWNER


@njit(cache=True, nogil=True)
def _deliver(fl, r, j, t):
    fl.fi[FI_OWNER, r] = j
    rep, st, _ = fl.nodes[j]
    engine.deliver_carried(rep, st, r, t, fl.carried_i, fl.carried_f)
    fl.out.routed[j] += 1


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
