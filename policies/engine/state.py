"""The replica's state as the kernels see it: ``Statics`` (read-only trace columns) and
``Replica`` (every mutable array), views of them without reference counts
(``borrowed``), the prefix cache, queue, ledger and adapter pool as views of their
arrays, and the small helpers every phase uses to end, vacate or requeue a request.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from costmodels.steptable import StepTables
from policies import adapters as adm
from policies import fairness as fm
from policies import prefix_cache as pcm
from policies import queues as qm
from policies.engine.codes import I_AGING, I_POLICY, R_NONE, S_CANCELLED, S_TIMED_OUT
from policies.kernel_state import (
    AD_BASE,
    AD_BYTES,
    AD_COLUMNS,
    AD_DISK_BW,
    AD_DISK_LOADS,
    AD_LOAD_S,
    AD_LOADS,
    AD_POOL_ROW,
    AD_STATE,
    CACHING,
    COMPUTED,
    DONE,
    ENTRY_BLOCKS,
    FINISH,
    FIRST_TOKEN,
    FL_KEYS,
    FREE,
    GENERATED,
    HELD,
    HOST,
    HOST_FREE,
    KV_BLOCK_SIZE,
    L_BATCH,
    L_QUEUE,
    L_RUN,
    LORA,
    MAX_OUT,
    N_BATCH,
    N_DONE,
    N_RUN,
    N_WAIT,
    PC_REQ,
    PC_STATS,
    PER_ENTRY,
    QUEUE_SEQ,
    QUOTAS,
    REASON,
    RESERVED,
    RESERVED_TOTAL,
    RUNNING,
    S_ADAPTER,
    S_ARRIVAL,
    S_CLASS,
    S_DEADLINE,
    S_JOB,
    S_LANE,
    S_PRIORITY,
    S_PROMPT,
    S_TENANT,
    SCHED,
    STATE,
    STATUS,
    SWAP_BW,
    SWAP_S,
    UNIT_TOKENS,
    USED,
    VLLM_CACHE,
    WAITING,
)


def borrowed(a):
    """The array itself; in jitted code a view of it without a reference count, valid
    while its owner lives (the caller keeps the owner: see the ``policies.engine`` docstring)."""
    return a


@intrinsic
def _borrow(typingctx, a):
    if not isinstance(a, types.Array):
        return None

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, args[0])
        view = context.make_array(signature.return_type)(context, builder)
        for name in ("nitems", "itemsize", "data", "shape", "strides"):
            setattr(view, name, getattr(src, name))
        view.meminfo = cgutils.get_null_value(view.meminfo.type)
        view.parent = cgutils.get_null_value(view.parent.type)
        return view._getvalue()

    return a(a), codegen


@overload(borrowed)
def _borrowed_jit(a):
    return lambda a: _borrow(a)


class SpecInputs(NamedTuple):
    """The drafter's acceptance profile as the speculative planner reads it."""

    profiles: np.ndarray  # f8[P, gamma], conditional acceptance per position
    spread: float
    bias: float


class Statics(NamedTuple):
    """Read-only inputs of every replica: trace columns (rows of ``policies.kernel_state``)
    and the prefix-cache, lane and speculative layouts. ``S_MIN_SERVICE``/``S_JOB`` come
    from a cost model's tables, so replicas with other tables need their own ``sf``.
    ``spec`` is None when no config of the run speculates: its type then tells Numba to
    compile the kernels without the speculative planner (a fifth of a cold compile)."""

    si: np.ndarray  # i8[N_SI, n]
    sf: np.ndarray  # f8[N_SF, n]
    offsets: np.ndarray  # i8[n + 1], CSR prefix blocks of each prompt
    entry: np.ndarray  # i8[blocks], dense prefix-cache entry of each trace block
    lane_tenant: np.ndarray  # i8[lanes]
    spec: SpecInputs | None
    n_entries: int
    block_tokens: int
    lora: np.ndarray  # f8[ranks + 2, tokens + 1]: row 0 the LORA_* parameters, then LoRACost.grid


class Replica(NamedTuple):
    """One replica's whole mutable state: a few arrays in the layouts of
    ``policies.kernel_state``; the prefix cache, waiting queue and tenant ledger are
    views of them (``_cache``, ``_queue``, ``_shares``)."""

    ri: np.ndarray  # i8[N_RI, n], per-request integers
    rf: np.ndarray  # f8[N_RF, n], per-request floats
    g: np.ndarray  # i8[N_G + CALIBRATION_BINS + block_size], run-wide integers
    gf: np.ndarray  # f8[N_GF], run-wide floats
    lists: np.ndarray  # i8[N_LISTS (+ N_SPEC_I), n + 1], index lists and queue slots
    fl: np.ndarray  # f8[N_FL (+ 1), n], queue keys (and SmartSpec's estimates)
    entries: np.ndarray  # i8[pcm.N_ENTRY_ROWS, entries], prefix-cache entries
    units: np.ndarray  # i8[2, slots], the prefix cache's table of split units (vLLM's rules)
    lanes: np.ndarray  # i8[qm.N_LANE_ROWS, lanes], waiting-queue lanes
    ledger: np.ndarray  # f8[fm.N_TENANT_ROWS + fm.N_CLASS_ROWS, max(tenants, classes)]
    series: np.ndarray  # f8[SERIES_CAPACITY, 4]: (t, KV blocks used, running, waiting)
    surv: np.ndarray  # f8[m, gamma], speculative survival per slot (m = n when speculating, else 0)


@njit(cache=True, nogil=True, _nrt=True)
def borrow_replica(rep):
    """``rep`` with every array borrowed (valid while ``rep`` lives)."""
    return Replica(borrowed(rep.ri), borrowed(rep.rf), borrowed(rep.g), borrowed(rep.gf), borrowed(rep.lists),
                   borrowed(rep.fl), borrowed(rep.entries), borrowed(rep.units), borrowed(rep.lanes),
                   borrowed(rep.ledger), borrowed(rep.series), borrowed(rep.surv))


@njit(cache=True, nogil=True, inline="always")
def _cache(rep, st):
    """The replica's prefix cache (``policies.prefix_cache``), as views of its arrays."""
    g = rep.g
    return pcm.PrefixCache(st.entry, rep.ri[PC_REQ:PC_REQ + pcm.N_REQ_ROWS], rep.entries,
                           g[PC_STATS:PC_STATS + pcm.N_STATS], rep.units, g[UNIT_TOKENS], g[ENTRY_BLOCKS],
                           g[KV_BLOCK_SIZE], st.n_entries, g[PER_ENTRY], g[VLLM_CACHE])


@njit(cache=True, nogil=True, inline="always")
def _queue(rep, st):
    """The replica's waiting queue (``policies.queues``), as views of its arrays."""
    return qm.WaitQueue(rep.fl[FL_KEYS:FL_KEYS + 2], rep.lists[L_QUEUE:L_QUEUE + 2], st.si[S_LANE], rep.lanes)


@njit(cache=True, nogil=True, inline="always")
def _shares(rep):
    """The replica's tenant ledger and class usage (``policies.fairness``), as views."""
    return fm.Shares(rep.ledger[:fm.N_TENANT_ROWS], rep.ledger[fm.N_TENANT_ROWS:])


@njit(cache=True, nogil=True, inline="always")
def _pool(rep):
    """The replica's adapter pool (``policies.adapters``): rows of lists after the others
    (allocated only with LoRA, so a replica without it carries no extra array)."""
    row = rep.g[AD_POOL_ROW]
    return rep.lists[row:row + adm.N_ROWS, :rep.g[AD_COLUMNS]]


@njit(cache=True, nogil=True, inline="always")
def _adapter_state(rep):
    """The replica's adapter pool state (``policies.adapters``), a view of its slots in g."""
    return rep.g[AD_STATE:AD_STATE + adm.N_STATE]


@njit(cache=True, nogil=True, inline="always")
def _pool_column(rep, st, r):
    """r's column in the adapter pool: its adapter's, the base column if the base model takes
    a slot, else -1 (outside the pool)."""
    a = st.si[S_ADAPTER, r]
    return a if a >= 0 else rep.g[AD_BASE]


@njit(cache=True, nogil=True, _nrt=False)
def _adapter_start(rep, st, r):
    """r starts running: its adapter joins the pool's running set, loaded if it is not on the
    GPU; the copy's seconds go to the step being formed (the engines load before the forward
    pass: vllm/v1/worker/gpu_model_runner.py:2243, srt/lora/lora_manager.py prepare_lora_batch)."""
    a = _pool_column(rep, st, r)
    if a < 0:
        return
    kind = adm.acquire(_pool(rep), _adapter_state(rep), a)
    if kind != adm.RESIDENT and a != rep.g[AD_BASE]:  # the base model's slot holds no weights
        g, gf = rep.g, rep.gf
        g[AD_LOADS] += 1
        if kind == adm.FROM_DISK:
            g[AD_DISK_LOADS] += 1
        seconds = adm.load_seconds(kind, gf[AD_BYTES], gf[SWAP_BW], gf[AD_DISK_BW])
        gf[SWAP_S] += seconds
        gf[AD_LOAD_S] += seconds


@njit(cache=True, nogil=True, inline="always")
def _adapter_stop(rep, st, r):
    """Running r stops running here (ended, preempted, moved): its adapter may be evicted."""
    if rep.g[LORA] != 0:
        a = _pool_column(rep, st, r)
        if a >= 0:
            adm.release(_pool(rep), _adapter_state(rep), a)


@njit(cache=True, nogil=True, _nrt=False)
def _adapter_tokens(rep, st):
    """Tokens of the batch being formed whose request runs an adapter (the LoRA GEMMs' m)."""
    total = 0
    batch = rep.lists[L_BATCH]
    for i in range(rep.g[N_BATCH]):
        r = batch[i]
        if st.si[S_ADAPTER, r] >= 0:
            total += rep.ri[SCHED, r]
    return total


@njit(cache=True, nogil=True, _nrt=True)
def borrow_statics(st):
    """``st`` with every array borrowed (valid while ``st`` lives)."""
    return Statics(borrowed(st.si), borrowed(st.sf), borrowed(st.offsets), borrowed(st.entry),
                   borrowed(st.lane_tenant), _borrow_spec(st.spec), st.n_entries, st.block_tokens,
                   borrowed(st.lora))


@njit(cache=True, nogil=True, _nrt=True)
def _borrow_spec(spec):
    if spec is None:  # pruned by type
        return None
    return SpecInputs(borrowed(spec.profiles), spec.spread, spec.bias)


@njit(cache=True, nogil=True, inline="always")
def borrow_tables(tables):
    """Step-time ``tables`` with their data borrowed (valid while ``tables`` lives)."""
    return StepTables(borrowed(tables.data), tables.overhead_s, tables.scale, tables.prefill_scale,
                      tables.decode_scale, tables.prefill_step_s)


@njit(cache=True, nogil=True, inline="always")
def _is_decode(ri, prompt, r, n):
    """One token that catches up a request already generating: a decode, not a prefill."""
    generated = ri[GENERATED, r]
    return n == 1 and generated >= 1 and ri[COMPUTED, r] == prompt[r] + generated - 1


@njit(cache=True, nogil=True, inline="always")
def _copy_running(order, run, k):
    """``order[:k] = run[:k]``, element by element: a slice assignment allocates a temporary
    (the two might overlap), which the step loop's kernels, compiled without NRT, cannot."""
    for i in range(k):
        order[i] = run[i]


@njit(cache=True, nogil=True, _nrt=False)
def _run_remove(run, g, r):
    k = g[N_RUN]
    i = 0
    while run[i] != r:
        i += 1
    for j in range(i, k - 1):
        run[j] = run[j + 1]
    g[N_RUN] = k - 1


@njit(cache=True, nogil=True, inline="always")
def _free_gpu(rep, st, r, drop_refs, in_flight):
    """Free r's own blocks; with drop_refs also its prefix-cache references (idle units
    stay cached but count as free: evictable on demand, as vLLM's free queue). With own
    runs (vLLM), the full blocks r computed past the units it holds stay cached too, ahead
    of those units in eviction order (vLLM frees a request's blocks tail first);
    ``in_flight``: r's last token was sampled by the step in flight (async scheduling)."""
    ri, g = rep.ri, rep.g
    held = ri[HELD, r]
    if drop_refs and g[VLLM_CACHE]:
        tail = _tail_full_blocks(ri, st, r, g[KV_BLOCK_SIZE], g[UNIT_TOKENS], in_flight)
        pcm.keep_tail(_cache(rep, st), st.offsets, r, tail)
    g[FREE] += held
    g[USED] -= held
    ri[HELD, r] = 0
    if g[QUOTAS]:
        fm.hold_kv(_shares(rep), st.si[S_TENANT, r], st.si[S_CLASS, r], -held)
    if drop_refs and g[CACHING] and ri[PC_REQ + pcm.R_HELD, r] > 0:
        copies = ri[PC_REQ + pcm.R_COPIES, r]
        if copies > 0 and g[QUOTAS]:
            fm.hold_kv(_shares(rep), st.si[S_TENANT, r], st.si[S_CLASS, r], -copies)
        idle = pcm.release(_cache(rep, st), st.offsets, r)  # its copies too
        g[FREE] += idle
        g[USED] -= idle


@njit(cache=True, nogil=True, inline="always")
def _cache_prompt_blocks(rep, st, r, ctx, block_size):
    """Turn the full prompt hash blocks r holds by ``ctx`` tokens into cache entries it
    references; blocks another request cached first are deduplicated and freed, or (vLLM)
    kept as r's copies until it lets go."""
    ri, g = rep.ri, rep.g
    copies = ri[PC_REQ + pcm.R_COPIES, r]
    freed = pcm.insert(_cache(rep, st), st.offsets, r, ctx)
    before = ri[HELD, r] - (ri[PC_REQ + pcm.R_COPIES, r] - copies)
    ri[HELD, r] = pcm.private_blocks(ctx, ri[PC_REQ + pcm.R_HELD, r], g[UNIT_TOKENS], block_size)
    if g[QUOTAS]:
        fm.hold_kv(_shares(rep), st.si[S_TENANT, r], st.si[S_CLASS, r], ri[HELD, r] - before)
    g[FREE] += freed
    g[USED] -= freed


@njit(cache=True, nogil=True, inline="always")
def _tail_full_blocks(ri, st, r, block_size, unit_tokens, in_flight):
    """Full KV blocks of r's known tokens it has computed past the prefix units it holds.

    vLLM caches a block when it schedules it, if the block's tokens are known by then
    (vllm/v1/core/kv_cache_manager.py:616-625, block_pool.py ``cache_full_blocks``): when r
    decoded in the step in flight (async), the token that step computed was still a
    placeholder at its scheduling, so the block it completes was never cached."""
    known = min(ri[COMPUTED, r], st.si[S_PROMPT, r] + ri[GENERATED, r])
    if in_flight and ri[COMPUTED, r] > st.si[S_PROMPT, r]:
        known -= 1
    prefix = ri[PC_REQ + pcm.R_HELD, r] * unit_tokens // block_size
    return min(max(0, known // block_size - prefix), ri[HELD, r])


@njit(cache=True, nogil=True, inline="always")
def _cover_reservation(ri, g, r):
    """A running request's reservation never falls below what it holds (predicted mode)."""
    extra = ri[HELD, r] - ri[RESERVED, r]
    if extra > 0:
        ri[RESERVED, r] += extra
        g[RESERVED_TOTAL] += extra


@njit(cache=True, nogil=True, inline="always")
def _release_reservation(ri, g, r):
    g[RESERVED_TOTAL] -= ri[RESERVED, r]
    ri[RESERVED, r] = 0


@njit(cache=True, nogil=True, inline="always")  # inlined: callers pass constant state/reason pairs
def _end_request(rep, st, r, state, reason, t_end):
    """Final state for r; frees everything it holds. A second call is a no-op."""
    ri = rep.ri
    if ri[STATUS, r] == DONE:
        return
    _vacate(rep, st, r)
    ri[STATUS, r] = DONE
    ri[STATE, r] = state
    ri[REASON, r] = reason
    rep.rf[FINISH, r] = t_end


@njit(cache=True, nogil=True, inline="always")
def _leave_running(rep, st, r):
    """Take r off the running list: its seat, adapter and reservation (not its KV)."""
    _run_remove(rep.lists[L_RUN], rep.g, r)
    _adapter_stop(rep, st, r)
    _release_reservation(rep.ri, rep.g, r)


@njit(cache=True, nogil=True, _nrt=False)
def _vacate(rep, st, r):
    """Free everything admitted r holds here and take it off the running list or the
    queue; the replica is done with it (it ended, or left for another replica)."""
    ri, g = rep.ri, rep.g
    status = ri[STATUS, r]
    if status == RUNNING:
        _leave_running(rep, st, r)
    elif status == WAITING:
        g[N_WAIT] -= 1
        qm.remove(_queue(rep, st), r)
        fm.dequeue(_shares(rep), st.si[S_TENANT, r])
    _free_gpu(rep, st, r, True, False)
    g[HOST_FREE] += ri[HOST, r]
    ri[HOST, r] = 0
    g[N_DONE] += 1


@njit(cache=True, nogil=True, _nrt=False)
def _end_by_deadline(rep, st, r):
    """The client left at its deadline: TIMED_OUT if it had seen a token by then, else
    CANCELLED with no token delivered (one produced after it left reached nobody)."""
    deadline = st.sf[S_DEADLINE, r]
    state = S_TIMED_OUT if rep.rf[FIRST_TOKEN, r] <= deadline else S_CANCELLED
    _end_request(rep, st, r, state, R_NONE, deadline)
    if state == S_CANCELLED:
        rep.rf[FIRST_TOKEN, r] = np.nan
        rep.ri[GENERATED, r] = 0


@njit(cache=True, nogil=True, inline="always")  # inlined: callers pass a constant in_front
def _push_waiting(rep, st, cfg, r, in_front):
    """Queue r under the configured order (``policies.queues``); FCFS-like orders keep
    push order with preempted requests first; its tenant may become backlogged (VTC)."""
    g = rep.g
    g[QUEUE_SEQ] += 1
    seq = -g[QUEUE_SEQ] if in_front else g[QUEUE_SEQ]
    sf = st.sf
    k1, k2 = qm.order_keys(int(cfg[I_POLICY]), seq, sf[S_ARRIVAL, r], st.si[S_PRIORITY, r], sf[S_DEADLINE, r],
                           sf[S_JOB, r], cfg[I_AGING], rep.ri[MAX_OUT, r])
    rep.ri[STATUS, r] = WAITING
    g[N_WAIT] += 1
    qm.push(_queue(rep, st), r, k1, k2)
    fm.enqueue(_shares(rep), st.si[S_TENANT, r])
