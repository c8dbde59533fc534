"""Migration (Llumnix) at a tick: replicas short of KV send their newest running request,
with its KV, to the freest replicas.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from policies import engine
from policies import routing as rt
from policies.fleet.moves import _send
from policies.fleet.routing import _fill_summary
from policies.fleet.state import (
    FL_MIGRATIONS,
    FR_ALIVE,
    FR_POOL,
    I_INTERCONNECT,
    I_MIGRATION_PAUSE,
    I_MIGRATION_THRESHOLD,
    SC_HEAD,
    SC_SOURCES,
    SC_TARGETS,
)
from policies.kernel_state import COMPUTED, S_ARRIVAL


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
