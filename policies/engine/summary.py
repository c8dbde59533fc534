"""The router's view of a replica (``policies.routing``'s summary): clock, counts, free and
headroom KV, the waiting head's demand, queued tokens, a request's cached tokens and
adapter load, and whether a request could ever be admitted here.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from policies import adapters as adm
from policies import fairness as fm
from policies import prefix_cache as pcm
from policies import queues as qm
from policies import speculative as spm
from policies.engine.codes import I_BLOCK_SIZE, I_POLICY, I_SPEC_MODE
from policies.engine.events import _exceeds_capacity, _max_out
from policies.engine.state import _cache, _pool, _queue
from policies.kernel_state import (
    AD_BYTES,
    AD_DISK_BW,
    CACHING,
    CAP,
    COMPUTED,
    FREE,
    GENERATED,
    HEADROOM,
    HELD,
    INBOX_HEAD,
    L_INBOX,
    L_RUN,
    LORA,
    MAX_LEN,
    N_DELIVERED,
    N_RUN,
    N_WAIT,
    PC_REQ,
    PER_ENTRY,
    RUNNING,
    S_ADAPTER,
    S_PROMPT,
    STATUS,
    SWAP_BW,
    TARGET,
)
from policies.kernel_state import T as CLOCK


# -- the router's view of a replica (``policies.routing`` summary) ------------------------
@njit(cache=True, nogil=True, inline="always")
def clock(rep):
    """The replica's next step boundary."""
    return rep.gf[CLOCK]


@njit(cache=True, nogil=True, inline="always")
def inbox_pending(rep):
    """Delivered requests not yet admitted or rejected."""
    return rep.g[N_DELIVERED] - rep.g[INBOX_HEAD]


@njit(cache=True, nogil=True, inline="always")
def running(rep):
    return rep.g[N_RUN]


@njit(cache=True, nogil=True, inline="always")
def waiting(rep):
    """Queued requests, inbox included."""
    return rep.g[N_WAIT] + inbox_pending(rep)


@njit(cache=True, nogil=True, inline="always")
def outstanding(rep):
    """Requests running, queued or in the inbox."""
    return rep.g[N_RUN] + waiting(rep)


@njit(cache=True, nogil=True, inline="always")
def free_blocks(rep):
    """Free GPU KV blocks; idle cached prefix blocks count as free (evictable on demand)."""
    return rep.g[FREE]


@njit(cache=True, nogil=True, inline="always")
def headroom_blocks(rep):
    return rep.g[HEADROOM]


@njit(cache=True, nogil=True, _nrt=True)
def head_request(rep, st, cfg):
    """The request the scheduler would try next: the queue head under the configured
    order, else the first inbox request; -1 if none."""
    r = qm.pick(_queue(rep, st), int(cfg[I_POLICY]), np.zeros(rep.lanes.shape[1], dtype=np.int64),
                rep.ledger[fm.TS_COUNTER], _cache(rep, st), st.offsets, st.si[S_PROMPT])
    if r < 0 and inbox_pending(rep) > 0:
        inbox = rep.lists[L_INBOX]
        r = inbox[rep.g[INBOX_HEAD] % (inbox.shape[0] - 1)]
    return r


@njit(cache=True, nogil=True, _nrt=False)
def head_demand_blocks(rep, st, cfg):
    """KV blocks of prompt + generated tokens of ``head_request``; 0 if none."""
    r = head_request(rep, st, cfg)
    if r < 0:
        return 0
    return pcm.kv_blocks(st.si[S_PROMPT, r] + rep.ri[GENERATED, r], int(cfg[I_BLOCK_SIZE]))


@njit(cache=True, nogil=True, _nrt=False)
def queued_tokens(rep, st):
    """Tokens still to compute before the first token of every queued and inbox request:
    prompt + generated - computed."""
    return _waiting_sum(rep, st, True)


@njit(cache=True, nogil=True, _nrt=False)
def waiting_tokens(rep, st):
    """prompt + generated tokens of every queued and inbox request (SGLang's ``seqlen``
    summed over its waiting queue in the load report)."""
    return _waiting_sum(rep, st, False)


@njit(cache=True, nogil=True, _nrt=False)
def _queued_sum(rep, st, less_computed):
    """prompt + generated tokens of every queued request, less those computed if asked."""
    ri, wq = rep.ri, _queue(rep, st)
    prompt = st.si[S_PROMPT]
    total = 0
    for lane in range(wq.lanes.shape[1]):
        base = wq.lanes[qm.L_BASE, lane]
        for s in range(base, base + wq.lanes[qm.L_SIZE, lane]):
            r = wq.slots[qm.SLOT_REQ, s]
            total += prompt[r] + ri[GENERATED, r] - (ri[COMPUTED, r] if less_computed else 0)
    return total


@njit(cache=True, nogil=True, _nrt=False)
def _waiting_sum(rep, st, less_computed):
    ri, g = rep.ri, rep.g
    prompt = st.si[S_PROMPT]
    total = _queued_sum(rep, st, less_computed)
    inbox = rep.lists[L_INBOX]
    ring = inbox.shape[0] - 1
    for p in range(g[INBOX_HEAD], g[N_DELIVERED]):
        r = inbox[p % ring]
        total += prompt[r] + ri[GENERATED, r] - (ri[COMPUTED, r] if less_computed else 0)
    return total


@njit(cache=True, nogil=True, _nrt=False)
def cached_tokens(rep, st, r):
    """Leading prompt tokens of request r found in this replica's prefix cache."""
    if rep.g[CACHING] == 0:
        return 0
    return pcm.match(_cache(rep, st), st.offsets, st.si[S_PROMPT], r, st.si[S_PROMPT, r])[1]


@njit(cache=True, nogil=True, _nrt=False)
def adapter_load_s(rep, st, r):
    """Seconds loading request r's LoRA adapter would add on this replica: 0 when it is on
    the GPU (or r runs the base model, or LoRA is off), the host copy when it is in the host
    cache, the disk read and the copy otherwise (the router's adapter affinity)."""
    g = rep.g
    a = st.si[S_ADAPTER, r] if g[LORA] != 0 else -1
    if a < 0:
        return 0.0
    pool = _pool(rep)
    kind = adm.RESIDENT if pool[adm.GPU, a] >= 0 else adm.FROM_HOST if pool[adm.HOST, a] >= 0 else adm.FROM_DISK
    return adm.load_seconds(kind, rep.gf[AD_BYTES], rep.gf[SWAP_BW], rep.gf[AD_DISK_BW])


@njit(cache=True, nogil=True, inline="always")
def newest_running(rep):
    """The running request admitted last (-1 if none runs); one that has ended and only
    lingers for the next step's formation (async scheduling) is not running."""
    run, status = rep.lists[L_RUN], rep.ri[STATUS]
    for i in range(rep.g[N_RUN] - 1, -1, -1):
        if status[run[i]] == RUNNING:
            return run[i]
    return -1


@njit(cache=True, nogil=True, _nrt=False)
def stays_unqueued(rep, st, cfg):
    """Whether nothing waits here and nothing will until the next delivery: all the KV its
    running requests can still take (whole prompt and output, full prompt hash blocks
    counted again as whole cache entries) fits in free KV, so no preemption can queue
    one. Free KV minus that demand never falls as the replica runs, so the answer holds
    at any later time. A speculative run qualifies only when idle (verify tokens take KV
    beyond that demand)."""
    ri, g = rep.ri, rep.g
    if waiting(rep) > 0:
        return False
    if g[N_RUN] == 0:
        return True
    if int(cfg[I_SPEC_MODE]) != spm.MODE_OFF:
        return False
    run = rep.lists[L_RUN]
    prompt = st.si[S_PROMPT]
    block_size = int(cfg[I_BLOCK_SIZE])
    demand = 0
    for i in range(g[N_RUN]):
        r = run[i]
        entries = ri[PC_REQ + pcm.R_N_FULL, r] // g[PER_ENTRY]  # R_N_FULL counts cache units
        demand += pcm.kv_blocks(prompt[r] + ri[TARGET, r], block_size) + entries - ri[HELD, r]
    return demand <= g[FREE]


@njit(cache=True, nogil=True, inline="always")
def capacity_blocks(rep):
    return rep.g[CAP]


@njit(cache=True, nogil=True, inline="always")
def max_len(rep):
    """Longest prompt + output a request may reach here (``max_model_len``)."""
    return rep.g[MAX_LEN]


@njit(cache=True, nogil=True, _nrt=False)
def never_admits(rep, st, cfg, r):
    """Whether request r, never delivered here, would be rejected EXCEEDS_CAPACITY on
    arrival whatever this replica's state (P/D: the fleet turns it away before a decode
    replica promises it KV)."""
    g = rep.g
    return _exceeds_capacity(rep.ri, g, _cache(rep, st), cfg, r, st.si[S_PROMPT, r], _max_out(g, st.si, r))
