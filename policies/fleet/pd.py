"""P/D (prefill/decode split): arrivals no prefill replica would admit, the hand-offs a
prefill replica sends to the decode replica that promised them KV, and those promises' end.
"""

from __future__ import annotations

from numba import njit

from policies import engine
from policies.engine import K_COMPUTED, K_PREEMPTS
from policies.fleet.moves import _send
from policies.fleet.state import (
    FG_N_PROMISED,
    FI_NEED,
    FI_OWNER,
    FI_PROMISE,
    FL_HANDOFFS,
    FR_POOL,
    FR_PROMISED,
    I_INTERCONNECT,
)
from policies.kernel_state import DONE, PREEMPTS, RUNNING, STATUS


@njit(cache=True, nogil=True)
def _no_prefill_admits(fl, r):
    """P/D: whether every prefill replica, alive or not, would reject arrival r as
    EXCEEDS_CAPACITY (``engine.never_admits``), so that no decode KV is promised to it."""
    for j in range(fl.fr.shape[1]):
        if fl.fr[FR_POOL, j] == 0 and not engine.never_admits(fl.nodes[j][0], fl.nodes[j][1], fl.cfg, r):
            return False
    return True


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
