"""The engine: replay a trace through one replica's iteration-level scheduler.

One replica advances from step boundary to step boundary. At each boundary it admits
arrivals (or rejects them with a reason), ends requests whose client gave up, forms the
next batch under every budget at once (token budget, ``max_num_seqs``, free KV blocks
minus the headroom watermark, optional step-time cap), takes the step's length from the
cost model's tables, and at the step's end advances tokens, KV and states. When nothing
can run it jumps to the next arrival.

The rules (the plain-Python reference in ``tests/policies/reference.py`` follows them
one by one, and the kernel must match it exactly):

* Tokens (vLLM V1): a request computes tokens until ``computed == prompt + generated``;
  the step that catches up samples one token (the first one ends the prefill, and
  ``first_token_s`` is that step's end). It finishes after ``min(output_tokens, max_out)``
  tokens (at least one), ``max_out = min(max_tokens, max_len - prompt)``.
* ``decode_first`` (vLLM V1): running requests in admission order, each catching up by
  ``min(remaining, long_prefill_token_threshold, budget)`` tokens, allocating blocks and
  preempting victims until the allocation fits (if the victim is the request itself, it
  is not scheduled); then, unless this step preempted, waiting requests in queue order
  while the budget, ``max_num_seqs`` and the admission rule allow (without chunked
  prefill a prompt that does not fit the remaining budget waits). The threshold (in
  either mode) applies only when running + waiting > 1 as the step's formation starts
  (vLLM 0.33: a lone request takes the whole budget; ``_long_prefill_threshold``).
* ``prefill_first`` (SGLang): continuing prefill chunks and new prompts (bounded by the
  chunk budget and ``max_prefill_tokens``) form a prefill-only step; when there is none,
  every running request decodes.
* Admission of a waiting request needs ``free - blocks(prompt + generated) >= headroom``
  (vLLM's watermark over the whole prompt) and, per mode: ``reservation``, reserved +
  blocks(prompt + max_out) <= capacity - headroom (``policies.reservation``);
  ``predicted``, the same with the output length at a quantile of finished requests'
  output/max_out ratios (max_out until calibrated); ``new_token_ratio``, SGLang's
  ``extend + min(max_out - generated, 4096) < available - ratio * running future``.
* Preemption frees the victim's GPU blocks and puts it back in the waiting queue (first
  in line under FCFS); ``recompute`` resets ``computed`` to 0 (generated tokens are kept
  and re-prefilled), ``swap`` copies the blocks to host memory while it has room, ``auto``
  swaps when the copy out and back is cheaper than the re-prefill and the request can
  return before its deadline: the expected wait until the running batch frees its blocks
  (``_return_wait_s``) delays a swapped and a recomputed request alike, but a client that
  leaves during it never pays the copy back in nor the re-prefill, so its copy out would
  be spent for nothing. Copies add to the step time. Past ``max_preemptions`` the victim
  is rejected instead.
* A request whose deadline passes ends TIMED_OUT if its first token came by the
  deadline, else CANCELLED, at the deadline; everything it held is freed.

Sharing (issue 6; state in ``Replica.pc``/``wq``/``sh``, rules in
``policies.prefix_cache``, ``policies.queues`` and ``policies.fairness``):

* Prefix caching (``enable_prefix_caching``): a request new to the GPU (or recomputed)
  takes references on the leading cached hash blocks of its prompt and starts computing
  after them (at most ``prompt - 1`` tokens are skipped); the attention over the cached
  context is still paid. The full prompt hash blocks a step computes become shared
  entries. ``free`` counts idle cached entries as available (as vLLM's free queue); they
  are evicted LRU only when an allocation needs their blocks. Any end or preemption
  drops a request's references; a request holding some is recomputed, never swapped.
* Waiting order (``scheduling_policy``): fcfs, priority (with ``aging_rate``), edf
  (a never-scheduled head whose deadline is lost even alone, with ``deadline_margin_ms``,
  is rejected DEADLINE_UNMEETABLE), sjf, lpm, vtc, lof (SGLang: largest ``max_out``
  first), dfs_weight (SGLang's dfs-weight over the cached hash chains, fixed per
  admission round by ``qm.dfs_rekey``; fcfs with caching off); queue lanes are (tenant,
  class) pairs.
  Past ``max_wait_s`` a never-scheduled request is rejected or, with ``max_wait_action =
  admit_first``, moved ahead of every other.
* Quotas (tenant KV / token quotas, class budgets; ``policies.fairness``): a head over
  its tenant's or class's limit blocks its lane for the round; the next lane is tried.
* Every tenant is charged its service in ``fairness_cost_unit`` (prompt tokens as they
  are scheduled, outputs as generated, or per step for GPU time and KV byte-seconds);
  ``SimResult.tenant_service`` is the audit, VTC orders by the weighted, lifted counter.
  VTC runs step by step (no fast-forward) so its counters match the reference exactly.

Pure-decode stretches (no arrival or deadline due, blocks enough, and nothing waiting or
a waiting head that could not start at the stretch's first step, so stays blocked as
decodes only take KV: ``_head_start_free``) are fast-forwarded up to and including the
step in which the first requests finish: one decode-attention lookup per step,
per-request arrays touched once at the end. Likewise stretches where the newest running request computes prompt chunks of one
size next to the same decodes, while the chunk takes the rest of the token budget or
nothing waits (``_fast_forward_chunk``: one step-time lookup per step). The result is
bit-identical to stepping one by one.

A resumable replica (the interface a fleet drives; requests are indexed globally, in
trace order, and every per-request array is sized n):

* ``Statics``: the read-only trace columns (``statics`` builds it for a trace and a
  cost model); ``Replica``: one replica's whole mutable state, a few arrays in the
  layouts of ``policies.kernel_state``, ``prefix_cache``, ``queues`` and ``fairness``.
* ``new_replica(st, cfg, cap_blocks, host_blocks, kv_bytes, swap_bw, seed, series_every,
  fast_forward, tenant_params, class_params, t0)``: every buffer preallocated, clock t0.
* ``deliver(rep, r, t)``: request r reaches the replica's inbox at time t
  (non-decreasing over calls); it is admitted or rejected at the first step boundary at
  or after t, exactly as an arrival. Queue keys, TTFT and deadlines keep using the trace
  arrival. A replica run alone gets every request at its trace arrival.
* ``advance(rep, st, tables, cfg, t_limit)``: run steps that START before ``t_limit`` (a
  started step completes, so the clock may end past it); fast-forward never starts a
  stretch past ``t_limit`` or the next delivery. Returns once every delivered request has
  ended or the clock is at or past ``t_limit``; an idle replica with nothing delivered
  before a finite ``t_limit`` moves its clock there.
* Router summary: ``clock``, ``outstanding``, ``running``, ``waiting`` (inbox included),
  ``free_blocks`` (idle cached blocks count as free), ``headroom_blocks``,
  ``head_demand_blocks``, ``queued_tokens``, ``waiting_tokens``, ``cached_tokens(rep, st, r)``.
* ``write_outputs``: per-request outputs of the requests that ended on this replica, and
  its counters.

Requests moving between replicas (``policies.fleet``); what a request takes along is its
carried rows (``new_carried``, ``carry``: tokens generated, preemptions, first times, the
sampler's state and, with its KV, computed tokens):

* ``withdraw(rep, st, r, keep_kv, carried_i, carried_f)``: take r off the replica (inbox,
  queue or running), freeing its blocks, prefix references, reservation, queue entry and
  quota usage; a failure drops its KV (computed 0, returns the tokens lost), a
  migration keeps it. ``deliver_carried``: deliver r with its carried rows; KV it
  carries is allocated at admission, never recomputed.
* ``hand_off_after_first_token(rep)`` (P/D prefill replica): a request leaves as soon as
  a step samples a token for it, into ``handed_off(rep)`` (``clear_handed_off`` once
  taken); ``advance`` returns after such a step, so its clock is the hand-off time.
* ``advance_through(rep, st, tables, cfg, t)``: ``advance`` that also runs the step
  starting at t; ``head_request``, ``newest_running``, ``capacity_blocks``, ``max_len``.

Progress guard: ``advance``'s loop counts its iterations over every call and, once they
pass base + per * progress (``_progress``: steps, deliveries taken, requests ended,
calls; (base, per) by default ``default_progress_budget(n)``, ``bound_progress`` sets
it), stops the replica with ``ERROR_NO_PROGRESS``. A replica in error runs no more; the
Python side raises ``SimulationStalled`` naming the time and the replica's state.

``simulate_kernel`` is new_replica, deliver every request, ``advance(inf)``,
``write_outputs``. Inside ``advance`` every array is *borrowed* (``borrowed``): Numba
reference-counts each array argument of every non-inlined call with an atomic add, which
cost more than the simulation itself; a borrowed view carries no reference count, and
the caller's ``Replica`` keeps the memory alive for the whole call.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numba
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from costmodels.costmodel import CostModel, CostModelError
from costmodels.steptable import StepTables, decode_run_base, decode_run_step, step_seconds
from policies import adapters as adm
from policies import fairness as fm
from policies import prefix_cache as pcm
from policies import queues as qm
from policies import speculative as spm
from policies.config import (
    ADMISSION_MODES,
    FAIRNESS_COST_UNITS,
    KNOB_INDEX,
    MAX_WAIT_ACTIONS,
    PREEMPTION_MODES,
    PREEMPTION_VICTIMS,
    SCHEDULE_MODES,
    SCHEDULING_POLICIES,
    ConfigError,
    PolicyConfig,
)
from policies.kernel_state import (
    AD_BASE,
    AD_BYTES,
    AD_COLUMNS,
    AD_DISK_BW,
    AD_DISK_LOADS,
    AD_LOAD_S,
    AD_LOADS,
    AD_POOL_ROW,
    AD_SKIP_ROW,
    AD_STATE,
    ADVANCES,
    B_DECODES,
    B_KV_DECODE,
    B_LOGITS,
    B_PAIRS,
    B_PREFILL,
    B_TOKENS,
    BUDGET,
    BUSY,
    C_AD_DISK_LOADS,
    C_AD_LOADS,
    C_CAP,
    C_ENDED_END,
    C_ERROR,
    C_HOST_USED_END,
    C_ITERATIONS,
    C_N_SAMPLES,
    C_OUT_OF_RANGE,
    C_PEAK,
    C_PEAK_STEP,
    C_PREFILL_TOKENS,
    C_RESERVED_END,
    C_RUNNING_END,
    C_SPEC_ACCEPTED,
    C_SPEC_DECODES,
    C_SPEC_DRAFTED,
    C_SPEC_VERIFIES,
    C_STEP_HIST,
    C_STEPS,
    C_SWAP_OUTS,
    C_USED_END,
    C_WAITING_END,
    CACHED_FIRST,
    CACHING,
    CALIBRATION_BINS,
    CAP,
    COMPUTED,
    DELIVERED,
    DONE,
    DRAFT_S,
    ENTRY_BLOCKS,
    ERROR,
    F_AD_LOAD_S,
    F_BUSY,
    F_END,
    F_PEAK_STEP_S,
    FAST_FORWARD,
    FINISH,
    FIRST_SCHED,
    FIRST_TOKEN,
    FL_ALPHA,
    FL_KEYS,
    FREE,
    G_HIST,
    G_RESIDUES,
    G_STEP_HIST,
    GENERATED,
    HAND_OFF,
    HEADROOM,
    HELD,
    HOST,
    HOST_CAP,
    HOST_FREE,
    INBOX_HEAD,
    ITERATIONS,
    KV_BLOCK_SIZE,
    KV_BYTES,
    L_BATCH,
    L_DHEAP,
    L_INBOX,
    L_ORDER,
    L_OUTBOX,
    L_QUEUE,
    L_RUN,
    L_SPEC,
    LEFT_WAITING,
    LORA,
    LORA_ADAPTERS,
    LORA_BYTES_PER_RANK,
    LORA_DISK_BW,
    MAX_LEN,
    MAX_OUT,
    MIN_CALIBRATION,
    N_BATCH,
    N_CALIBRATED,
    N_COUNTS,
    N_DELIVERED,
    N_DONE,
    N_FCOUNTS,
    N_FL,
    N_GF,
    N_LISTS,
    N_OUTBOX,
    N_RF,
    N_RI,
    N_RUN,
    N_SAMPLES,
    N_SF,
    N_SI,
    N_WAIT,
    NEXT_DELIVERY,
    NOT_ARRIVED,
    NTR_CLIP,
    NTR_DECAY_STEPS,
    NTR_INIT,
    NTR_MIN_FACTOR,
    NTR_REM,
    NTR_RETRACT_STEPS,
    OUT_OF_RANGE,
    PC_REQ,
    PC_STATS,
    PEAK,
    PEAK_STEP,
    PEAK_STEP_S,
    PRED_BIN,
    PREEMPTED_NOW,
    PREEMPTS,
    PREFILL_TOKENS,
    PREFIX_HIT,
    PREFIX_QUERY,
    PREFIX_SAVED_S,
    PROGRESS_BASE,
    PROGRESS_PER,
    QUEUE_SEQ,
    QUOTAS,
    RATIO,
    REASON,
    RESERVED,
    RESERVED_TOTAL,
    RNG_COUNTER,
    RNG_SEED,
    RUNNING,
    S_ADAPTER,
    S_ARRIVAL,
    S_CLASS,
    S_DEADLINE,
    S_JOB,
    S_LANE,
    S_MAX_TOKENS,
    S_MIN_SERVICE,
    S_N_FULL,
    S_OUTPUT,
    S_PRIORITY,
    S_PROMPT,
    S_SPEC_ROW,
    S_TENANT,
    SAMPLE_K,
    SCHED,
    SERIES_CAPACITY,
    SERIES_EVERY,
    SERIES_T0,
    SPEC_ACCEPTED,
    SPEC_DECODES,
    SPEC_DRAFTED,
    SPEC_EST,
    SPEC_HITS,
    SPEC_LAG,
    SPEC_SLOTS,
    SPEC_TRIALS,
    SPEC_VERIFIES,
    STATE,
    STATUS,
    STEPS,
    STUCK_MODES,
    SWAP_BW,
    SWAP_OUTS,
    SWAP_S,
    TARGET,
    UNSORTED,
    USED,
    WAIT_SCAN,
    WAITING,
)
from policies.kernel_state import T as CLOCK
from policies.result import (
    STEP_HIST_BINS,
    STEP_HIST_LOG_MIN,
    STEP_HIST_MIN_S,
    STEP_HIST_PER_DECADE,
    Reject,
    SimResult,
    State,
)
from policies.waitqueue import heap_first_live, heap_pop, heap_push

# Knob positions in the config vector (frozen into the kernel as constants).
I_MAX_BATCHED = KNOB_INDEX["max_num_batched_tokens"]
I_MAX_SEQS = KNOB_INDEX["max_num_seqs"]
I_CHUNKED = KNOB_INDEX["enable_chunked_prefill"]
I_LONG_PREFILL = KNOB_INDEX["long_prefill_token_threshold"]
I_BLOCK_SIZE = KNOB_INDEX["block_size"]
I_POLICY = KNOB_INDEX["scheduling_policy"]
I_SCHEDULE_MODE = KNOB_INDEX["schedule_mode"]
I_MAX_PREFILL = KNOB_INDEX["max_prefill_tokens"]
I_STEP_CAP_MS = KNOB_INDEX["step_time_cap_ms"]
I_HEADROOM = KNOB_INDEX["kv_headroom"]
I_ADMISSION = KNOB_INDEX["admission_mode"]
I_QUANTILE = KNOB_INDEX["admission_quantile"]
I_CONSERVATIVENESS = KNOB_INDEX["schedule_conservativeness"]
I_PREEMPTION = KNOB_INDEX["preemption_mode"]
I_VICTIM = KNOB_INDEX["preemption_victim"]
I_MAX_PREEMPTIONS = KNOB_INDEX["max_preemptions"]
I_MAX_QUEUE = KNOB_INDEX["max_queue_len"]
I_MAX_WAIT = KNOB_INDEX["max_wait_s"]
I_HIGH_WATER = KNOB_INDEX["kv_high_water"]
I_UNMEETABLE = KNOB_INDEX["reject_unmeetable_deadline"]
I_MAX_MODEL_LEN = KNOB_INDEX["max_model_len"]
I_PREFIX_CACHING = KNOB_INDEX["enable_prefix_caching"]
I_COST_UNIT = KNOB_INDEX["fairness_cost_unit"]
I_W_IN = KNOB_INDEX["vtc_input_weight"]
I_W_OUT = KNOB_INDEX["vtc_output_weight"]
I_AGING = KNOB_INDEX["aging_rate"]
I_WAIT_ACTION = KNOB_INDEX["max_wait_action"]
I_DEADLINE_MARGIN = KNOB_INDEX["deadline_margin_ms"]
I_SPEC_MODE = KNOB_INDEX["speculative_mode"]
I_SPEC_GAMMA = KNOB_INDEX["num_speculative_tokens"]
I_DRAFT_MODE = KNOB_INDEX["speculative_draft_cost_mode"]
I_DRAFT_COST = KNOB_INDEX["speculative_draft_cost"]
I_LORA = KNOB_INDEX["enable_lora"]
I_MAX_LORAS = KNOB_INDEX["max_loras"]
I_MAX_CPU_LORAS = KNOB_INDEX["max_cpu_loras"]
I_LORA_RANK = KNOB_INDEX["max_lora_rank"]
I_LORA_POLICY = KNOB_INDEX["lora_eviction_policy"]
I_LORA_BASE_SLOT = KNOB_INDEX["lora_base_slot"]
I_LORA_PRELOAD = KNOB_INDEX["lora_preload"]

assert SCHEDULING_POLICIES == qm.QUEUE_ORDERS and FAIRNESS_COST_UNITS == fm.FAIRNESS_COST_UNITS
EDF = SCHEDULING_POLICIES.index("edf")
VTC = SCHEDULING_POLICIES.index("vtc")
LPM = SCHEDULING_POLICIES.index("lpm")
DFS_WEIGHT = SCHEDULING_POLICIES.index("dfs_weight")
ADMIT_FIRST = MAX_WAIT_ACTIONS.index("admit_first")
PREFILL_FIRST = SCHEDULE_MODES.index("prefill_first")
ADMIT_NONE = ADMISSION_MODES.index("none")
ADMIT_RESERVATION = ADMISSION_MODES.index("reservation")
ADMIT_PREDICTED = ADMISSION_MODES.index("predicted")
ADMIT_NTR = ADMISSION_MODES.index("new_token_ratio")
NEVER = np.iinfo(np.int64).max  # ``_head_start_free`` of a head no amount of free KV would start
PREEMPT_RECOMPUTE = PREEMPTION_MODES.index("recompute")
PREEMPT_SWAP = PREEMPTION_MODES.index("swap")
VICTIM_NEWEST = PREEMPTION_VICTIMS.index("newest")
VICTIM_LOWEST_PRIORITY = PREEMPTION_VICTIMS.index("lowest_priority")

S_FINISHED = int(State.FINISHED)
S_REJECTED = int(State.REJECTED)
S_TIMED_OUT = int(State.TIMED_OUT)
S_CANCELLED = int(State.CANCELLED)
R_NONE = int(Reject.NONE)
R_KV_HIGH_WATER = int(Reject.KV_HIGH_WATER)
R_QUEUE_FULL = int(Reject.QUEUE_FULL)
R_MAX_WAIT = int(Reject.MAX_WAIT)
R_DEADLINE = int(Reject.DEADLINE_UNMEETABLE)
R_EXCEEDS = int(Reject.EXCEEDS_CAPACITY)
R_MAX_PREEMPTIONS = int(Reject.MAX_PREEMPTIONS)

#: Kernel error codes: a step formed no work although requests were waiting or running;
#: ``withdraw`` was asked for a request the replica does not hold; ``advance``'s loop
#: passed its progress bound (``_progress``).
ERROR_STALLED = 1
ERROR_NOT_HELD = 2
ERROR_NO_PROGRESS = 3
#: What each error code means, for the error the Python side raises.
ERROR_WHY = {ERROR_STALLED: "a step formed no work although requests were waiting or running",
             ERROR_NOT_HELD: "asked to withdraw a request it does not hold",
             ERROR_NO_PROGRESS: "its loop passed its bound of iterations"}


class SimulationStalled(RuntimeError):
    """A kernel stopped a run that made no progress (an internal error: please report the
    trace, config and failure schedule)."""


# Per-request output rows (out_i, out_f) copied from the kernel's state.
O_STATE, O_REASON, O_GENERATED, O_PREEMPTS = 0, 1, 2, 3
O_FIRST_TOKEN, O_FINISH, O_FIRST_SCHED = 0, 1, 2
N_OI, N_OF = 4, 3
# Prefix-cache run figures (out_prefix): lookups' hit and query tokens, prefill time saved.
P_HIT_TOKENS, P_QUERY_TOKENS, P_SAVED_S, P_EVICTIONS = 0, 1, 2, 3
N_PREFIX = 4
# What a request takes from one replica to the next (``carry``): rows of carried_i / carried_f.
K_COMPUTED, K_GENERATED, K_PREEMPTS, K_CACHED_FIRST = 0, 1, 2, 3
# The sampler's state goes too: SmartSpec's acceptance counts, and (by construction) the
# draws, keyed by (run seed, request, token index) wherever the request runs.
K_FIRST_SCHED, K_FIRST_TOKEN, K_SPEC_HITS, K_SPEC_TRIALS = 0, 1, 2, 3
N_KI, N_KF = 4, 4

# Speculative per-slot rows, after L_SPEC in ``lists`` (allocated only when speculating).
SP_REQS, SP_TOK, SP_LIM, SP_SLACK, SP_ELL, SP_ACCEPTED, SP_SCRATCH, SP_HEAP = range(8)
N_SPEC_I = 8


# ======================================================================================
# borrowed arrays: no reference counting inside the kernel
# ======================================================================================
def borrowed(a):
    """The array itself; in jitted code a view of it without a reference count, valid
    while its owner lives (the caller keeps the owner: see the module docstring)."""
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
    lanes: np.ndarray  # i8[qm.N_LANE_ROWS, lanes], waiting-queue lanes
    ledger: np.ndarray  # f8[fm.N_TENANT_ROWS + fm.N_CLASS_ROWS, max(tenants, classes)]
    series: np.ndarray  # f8[SERIES_CAPACITY, 4]: (t, KV blocks used, running, waiting)
    surv: np.ndarray  # f8[m, gamma], speculative survival per slot (m = n when speculating, else 0)


@njit(cache=True, nogil=True)
def _borrow_replica(rep):
    return Replica(borrowed(rep.ri), borrowed(rep.rf), borrowed(rep.g), borrowed(rep.gf), borrowed(rep.lists),
                   borrowed(rep.fl), borrowed(rep.entries), borrowed(rep.lanes), borrowed(rep.ledger),
                   borrowed(rep.series), borrowed(rep.surv))


@njit(cache=True, nogil=True, inline="always")
def _cache(rep, st):
    """The replica's prefix cache (``policies.prefix_cache``), as views of its arrays."""
    g = rep.g
    return pcm.PrefixCache(st.entry, rep.ri[PC_REQ:PC_REQ + pcm.N_REQ_ROWS], rep.entries,
                           g[PC_STATS:PC_STATS + pcm.N_STATS], st.block_tokens, g[ENTRY_BLOCKS], g[KV_BLOCK_SIZE])


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


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
def _adapter_tokens(rep, st):
    """Tokens of the batch being formed whose request runs an adapter (the LoRA GEMMs' m)."""
    total = 0
    batch = rep.lists[L_BATCH]
    for i in range(rep.g[N_BATCH]):
        r = batch[i]
        if st.si[S_ADAPTER, r] >= 0:
            total += rep.ri[SCHED, r]
    return total


@njit(cache=True, nogil=True)
def _borrow_statics(st):
    return Statics(borrowed(st.si), borrowed(st.sf), borrowed(st.offsets), borrowed(st.entry),
                   borrowed(st.lane_tenant), _borrow_spec(st.spec), st.n_entries, st.block_tokens,
                   borrowed(st.lora))


@njit(cache=True, nogil=True)
def _borrow_spec(spec):
    if spec is None:  # pruned by type
        return None
    return SpecInputs(borrowed(spec.profiles), spec.spread, spec.bias)


@njit(cache=True, nogil=True, inline="always")
def _borrow_tables(tables):
    return StepTables(borrowed(tables.data), tables.overhead_s, tables.scale, tables.prefill_scale,
                      tables.decode_scale)


# ======================================================================================
# small state helpers
# ======================================================================================
@njit(cache=True, nogil=True, inline="always")
def _blocks(tokens, block_size):
    return (tokens + block_size - 1) // block_size


@njit(cache=True, nogil=True, inline="always")
def _is_decode(ri, prompt, r, n):
    """One token that catches up a request already generating: a decode, not a prefill."""
    generated = ri[GENERATED, r]
    return n == 1 and generated >= 1 and ri[COMPUTED, r] == prompt[r] + generated - 1


@njit(cache=True, nogil=True)
def _run_remove(run, g, r):
    k = g[N_RUN]
    i = 0
    while run[i] != r:
        i += 1
    for j in range(i, k - 1):
        run[j] = run[j + 1]
    g[N_RUN] = k - 1


@njit(cache=True, nogil=True, inline="always")
def _free_gpu(rep, st, r, drop_refs):
    """Free r's own blocks; with drop_refs also its prefix-cache references (idle entries
    stay cached but count as free: evictable on demand, as vLLM's free queue)."""
    ri, g = rep.ri, rep.g
    held = ri[HELD, r]
    g[FREE] += held
    g[USED] -= held
    ri[HELD, r] = 0
    if g[QUOTAS]:
        fm.hold_kv(_shares(rep), st.si[S_TENANT, r], st.si[S_CLASS, r], -held)
    if drop_refs and g[CACHING] and ri[PC_REQ + pcm.R_HELD, r] > 0:
        idle = pcm.release(_cache(rep, st), st.offsets, r)
        g[FREE] += idle
        g[USED] -= idle


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


@njit(cache=True, nogil=True)
def _vacate(rep, st, r):
    """Free everything admitted r holds here and take it off the running list or the
    queue; the replica is done with it (it ended, or left for another replica)."""
    ri, g = rep.ri, rep.g
    status = ri[STATUS, r]
    if status == RUNNING:
        _run_remove(rep.lists[L_RUN], g, r)
        _adapter_stop(rep, st, r)
        _release_reservation(ri, g, r)
    elif status == WAITING:
        g[N_WAIT] -= 1
        qm.remove(_queue(rep, st), r)
        fm.dequeue(_shares(rep), st.si[S_TENANT, r])
    _free_gpu(rep, st, r, True)
    g[HOST_FREE] += ri[HOST, r]
    ri[HOST, r] = 0
    g[N_DONE] += 1


@njit(cache=True, nogil=True)
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


# ======================================================================================
# the batch being formed
# ======================================================================================
@njit(cache=True, nogil=True, inline="always")
def _batch_account(ri, g, prompt, r, n, sign):
    """Add (sign=1) or remove (sign=-1) n tokens of r from the step-time aggregates."""
    c = ri[COMPUTED, r]
    g[B_TOKENS] += sign * n
    if c + n == prompt[r] + ri[GENERATED, r]:
        g[B_LOGITS] += sign
    if _is_decode(ri, prompt, r, n):
        g[B_DECODES] += sign
        g[B_KV_DECODE] += sign * (c + 1)
    else:
        g[B_PAIRS] += sign * (n * c + n * (n + 1) // 2)
        g[B_PREFILL] += sign * n


@njit(cache=True, nogil=True, inline="always")
def _need_blocks(ri, pc, r, ctx, held, idle_blocks, block_size):
    """Blocks r must add to hold ``ctx`` computed tokens while referencing ``held`` cached
    entries (``idle_blocks`` of them not yet acquired). Full prompt hash blocks it completes
    count whole (``policies.prefix_cache``); without caching this is
    ``ceil(ctx / block_size) - blocks held``."""
    h_after = max(held, min(pc.req[pcm.R_N_FULL, r], ctx // pc.block_tokens))
    return (pcm.private_blocks(ctx, h_after, pc.block_tokens, block_size)
            + pc.entry_blocks * (h_after - held) + idle_blocks - ri[HELD, r])


@njit(cache=True, nogil=True, inline="always")
def _charge_prefill(rep, st, cfg, r, n, sign):
    """Tokens unit: charge (sign=1) or refund (-1) the prompt tokens of a scheduled chunk."""
    if int(cfg[I_COST_UNIT]) == fm.TOKENS and not _is_decode(rep.ri, st.si[S_PROMPT], r, n):
        fm.charge(_shares(rep), st.si[S_TENANT, r], sign * cfg[I_W_IN] * n)


@njit(cache=True, nogil=True, inline="always")
def _schedule(ri, g, batch, prompt, r, n, blocks):
    """Put n tokens of r in the batch with ``blocks`` new blocks (the caller checked they
    fit and made room in the prefix cache)."""
    g[FREE] -= blocks
    g[USED] += blocks
    ri[HELD, r] += blocks
    if g[USED] > g[PEAK]:
        g[PEAK] = g[USED]
    _cover_reservation(ri, g, r)
    _batch_account(ri, g, prompt, r, n, 1)
    ri[SCHED, r] = n
    batch[g[N_BATCH]] = r
    g[N_BATCH] += 1
    g[BUDGET] -= n


@njit(cache=True, nogil=True)
def _schedule_shared(rep, st, cfg, r, n):
    """``_schedule`` with the sharing side: blocks past the cached prefix (evicting idle
    cached prefixes to make room), the tenant's usage and its prompt-token charge."""
    ri, g = rep.ri, rep.g
    pc = _cache(rep, st)
    blocks = _need_blocks(ri, pc, r, ri[COMPUTED, r] + n, ri[PC_REQ + pcm.R_HELD, r], 0, int(cfg[I_BLOCK_SIZE]))
    if g[CACHING]:
        short = blocks - (g[FREE] - g[PC_STATS + pcm.S_EVICTABLE] * g[ENTRY_BLOCKS])
        if short > 0:
            pcm.evict(pc, short)
    if g[QUOTAS]:
        sh = _shares(rep)
        fm.hold_kv(sh, st.si[S_TENANT, r], st.si[S_CLASS, r], blocks)
        fm.use_tokens(sh, st.si[S_TENANT, r], st.si[S_CLASS, r], n)
    _charge_prefill(rep, st, cfg, r, n, 1)
    _schedule(ri, g, rep.lists[L_BATCH], st.si[S_PROMPT], r, n, blocks)


@njit(cache=True, nogil=True)
def _fits_cap(ri, g, gf, tables, prompt, cap_s, r, n):
    _batch_account(ri, g, prompt, r, n, 1)
    seconds, _ = step_seconds(tables, g[B_TOKENS], g[B_LOGITS], g[B_DECODES], g[B_KV_DECODE], g[B_PAIRS])
    _batch_account(ri, g, prompt, r, n, -1)
    return seconds + gf[SWAP_S] <= cap_s


@njit(cache=True, nogil=True)
def _fit_step_cap(ri, g, gf, tables, prompt, cfg, r, n, may_split):
    """Tokens of r the step-time cap allows (0 = none); decodes are never held back.

    With splitting, the largest chunk that keeps the step under the cap (binary search);
    an empty batch always takes at least one token (or the whole prompt), so the engine
    progresses under any cap.
    """
    cap_s = cfg[I_STEP_CAP_MS] * 1e-3
    if cap_s <= 0.0 or _is_decode(ri, prompt, r, n):
        return n
    if may_split:
        lo = 0
        hi = n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _fits_cap(ri, g, gf, tables, prompt, cap_s, r, mid):
                lo = mid
            else:
                hi = mid - 1
        allowed = lo
    else:
        allowed = n if _fits_cap(ri, g, gf, tables, prompt, cap_s, r, n) else 0
    if allowed == 0 and g[B_TOKENS] == 0:
        allowed = 1 if may_split else n
    return allowed


# ======================================================================================
# preemption
# ======================================================================================
@njit(cache=True, nogil=True)
def _pick_victim(ri, g, run, prompt, priority, cfg):
    k = g[N_RUN]
    mode = int(cfg[I_VICTIM])
    if mode == VICTIM_NEWEST:
        return run[k - 1]
    best = run[0]
    for i in range(1, k):
        r = run[i]
        if mode == VICTIM_LOWEST_PRIORITY:
            # least urgent first, then the latest arrival (vLLM's priority victim)
            worse = priority[r] < priority[best] or (priority[r] == priority[best] and r > best)
        else:
            # fewest outputs, then the longest prompt (SGLang's retract order), then latest
            gr = ri[GENERATED, r]
            gb = ri[GENERATED, best]
            worse = gr < gb or (gr == gb and (prompt[r] > prompt[best] or (prompt[r] == prompt[best] and r > best)))
        if worse:
            best = r
    return best


@njit(cache=True, nogil=True)
def _return_wait_s(ri, g, run, tables, v, need):
    """Expected seconds until the running batch (less victim v) frees ``need`` KV blocks,
    the victim's to come back: each running request is expected to free its blocks over
    the decode steps left to its output cap (what the scheduler knows; never its true
    length), so the batch frees sum(held / steps left) blocks a step, each step as long as
    one decode step of the batch now. inf when nothing runs to free them."""
    rate = 0.0
    k = 0
    kv = 0
    for i in range(g[N_RUN]):
        r = run[i]
        if r == v:
            continue
        k += 1
        kv += ri[COMPUTED, r]
        rate += ri[HELD, r] / max(1, ri[MAX_OUT, r] - ri[GENERATED, r])
    if rate <= 0.0:
        return np.inf
    dt, _ = step_seconds(tables, k, k, k, kv, 0)
    return need / rate * dt


@njit(cache=True, nogil=True)
def _preempt(rep, st, tables, cfg, v):
    """Take v off the GPU: swap its KV out or drop it for recompute, and requeue it.

    Only private KV is swapped: a victim referencing prefix-cache entries is recomputed
    (it drops them and looks the cache up again when readmitted, where its prefix likely
    still is), so a swapped-out request never pins GPU blocks and a request that fits an
    empty GPU always runs once nothing else does.
    """
    ri, g, gf = rep.ri, rep.g, rep.gf
    prompt = st.si[S_PROMPT]
    held_entries = ri[PC_REQ + pcm.R_HELD]
    block_size = int(cfg[I_BLOCK_SIZE])
    g[PREEMPTED_NOW] = 1
    n = ri[SCHED, v]
    if n > 0:  # already in this step's batch: give its tokens and new blocks back
        _batch_account(ri, g, prompt, v, n, -1)
        _charge_prefill(rep, st, cfg, v, n, -1)
        if g[QUOTAS]:
            fm.use_tokens(_shares(rep), st.si[S_TENANT, v], st.si[S_CLASS, v], -n)
        g[BUDGET] += n
        ri[SCHED, v] = 0
        keep = pcm.private_blocks(ri[COMPUTED, v], held_entries[v], st.block_tokens, block_size)
        extra = ri[HELD, v] - keep
        g[FREE] += extra
        g[USED] -= extra
        ri[HELD, v] = keep
        if g[QUOTAS]:
            fm.hold_kv(_shares(rep), st.si[S_TENANT, v], st.si[S_CLASS, v], -extra)
    limit = int(cfg[I_MAX_PREEMPTIONS])
    if limit > 0 and ri[PREEMPTS, v] >= limit:
        _end_request(rep, st, v, S_REJECTED, R_MAX_PREEMPTIONS, gf[CLOCK])
        return
    ri[PREEMPTS, v] += 1
    held = ri[HELD, v]
    mode = int(cfg[I_PREEMPTION])
    swap = False
    if mode != PREEMPT_RECOMPUTE and held > 0 and g[HOST_FREE] >= held and held_entries[v] == 0:
        copy_s = held * block_size * gf[KV_BYTES] / gf[SWAP_BW]
        if mode == PREEMPT_SWAP:
            swap = True
        else:
            c = ri[COMPUTED, v]
            recompute_s, _ = step_seconds(tables, c, 1, 0, 0, c * (c + 1) // 2)
            swap = 2.0 * copy_s < recompute_s
            deadline = st.sf[S_DEADLINE, v]
            if swap and not math.isnan(deadline):
                # a request whose client leaves before it can return never pays the copy back
                # in nor the re-prefill: the copy out would be spent for nothing
                swap = gf[CLOCK] + copy_s + _return_wait_s(ri, g, rep.lists[L_RUN], tables, v, held) < deadline
        if swap:
            g[HOST_FREE] -= held
            ri[HOST, v] = held
            gf[SWAP_S] += copy_s
            g[SWAP_OUTS] += 1
    if not swap:
        ri[COMPUTED, v] = 0
    _free_gpu(rep, st, v, not swap)
    _run_remove(rep.lists[L_RUN], g, v)
    _adapter_stop(rep, st, v)
    _release_reservation(ri, g, v)
    _push_waiting(rep, st, cfg, v, True)


@njit(cache=True, nogil=True)
def _schedule_running(rep, st, tables, cfg, r, n):
    """Schedule n tokens of running r, preempting victims until its blocks fit."""
    ri, g = rep.ri, rep.g
    pc = _cache(rep, st)
    block_size = int(cfg[I_BLOCK_SIZE])
    while _need_blocks(ri, pc, r, ri[COMPUTED, r] + n, ri[PC_REQ + pcm.R_HELD, r], 0, block_size) > g[FREE]:
        v = _pick_victim(ri, g, rep.lists[L_RUN], st.si[S_PROMPT], st.si[S_PRIORITY], cfg)
        _preempt(rep, st, tables, cfg, v)
        if v == r:
            return
    _schedule_shared(rep, st, cfg, r, n)


# ======================================================================================
# admission
# ======================================================================================
@njit(cache=True, nogil=True)
def _predicted_out(g, hist_bins, max_out):
    """predicted mode: output tokens to reserve, from the calibrated ratio quantile."""
    b = g[PRED_BIN]
    if b < 0:
        return max_out
    return ((b + 1) * max_out + hist_bins - 1) // hist_bins


@njit(cache=True, nogil=True)
def _reservation_blocks(ri, g, prompt, cfg, r):
    block_size = int(cfg[I_BLOCK_SIZE])
    max_out = ri[MAX_OUT, r]
    if int(cfg[I_ADMISSION]) == ADMIT_PREDICTED:
        out = _predicted_out(g, CALIBRATION_BINS, max_out)
        return max(_blocks(prompt[r] + out, block_size), _blocks(prompt[r] + ri[GENERATED, r], block_size))
    return _blocks(prompt[r] + max_out, block_size)


@njit(cache=True, nogil=True, inline="always")
def _watermark_free(ri, g, pc, prompt, cfg, r, held, idle_blocks):
    """Free blocks waiting r needs to start: its whole prompt past its cached prefix, plus
    the headroom."""
    return _need_blocks(ri, pc, r, prompt[r] + ri[GENERATED, r], held, idle_blocks, int(cfg[I_BLOCK_SIZE])) + g[HEADROOM]


@njit(cache=True, nogil=True)
def _admissible(ri, g, gf, pc, prompt, cfg, r, held, idle_blocks):
    """Whether waiting r may start now: watermark over its whole prompt (past its cached
    prefix), then the mode's rule (``_rule_admits``)."""
    if g[FREE] < _watermark_free(ri, g, pc, prompt, cfg, r, held, idle_blocks):
        return False
    return _rule_admits(ri, g, gf, prompt, cfg, r)


@njit(cache=True, nogil=True)
def _rule_admits(ri, g, gf, prompt, cfg, r):
    """The admission mode's rule for waiting r (reservations, or new_token_ratio's
    running budget, which an admitted request draws down)."""
    generated = ri[GENERATED, r]
    mode = int(cfg[I_ADMISSION])
    if mode == ADMIT_RESERVATION or mode == ADMIT_PREDICTED:
        return g[RESERVED_TOTAL] + _reservation_blocks(ri, g, prompt, cfg, r) <= g[CAP] - g[HEADROOM]
    if mode == ADMIT_NTR:
        total = prompt[r] + generated - ri[COMPUTED, r] + min(ri[MAX_OUT, r] - generated, NTR_CLIP)
        if total >= gf[NTR_REM]:
            return False
        gf[NTR_REM] -= total
    return True


@njit(cache=True, nogil=True, inline="always")
def _long_prefill_threshold(g, cfg):
    """The long-prefill threshold of the step being formed: off (0) unless more than one
    request is running or waiting as the step's formation starts. vLLM 0.33,
    vllm/v1/core/sched/scheduler.py:754-763: ``num_running, num_waiting =
    self.get_request_counts()`` (len(running), len(waiting) + len(kv_holding_waiting))
    at the start of ``schedule()``, threshold ``if num_eligible_reqs > 1 else 0``: a
    lone request has nobody to starve. (``long_prefill_token_threshold_adaptive``,
    scheduler.py:764-768, defaults to False in vllm/config/scheduler.py:86 and is not
    modelled.) Arrivals due at this boundary are already queued, as vLLM's
    ``add_request`` queues them before ``schedule()``."""
    return int(cfg[I_LONG_PREFILL]) if g[N_RUN] + g[N_WAIT] > 1 else 0


@njit(cache=True, nogil=True, inline="always")
def _first_chunk(ri, prompt, cfg, r, computed, budget, rem_input, prefill_started, threshold):
    """Tokens waiting r would compute in this step, ``computed`` of them done (cached or
    kept): its rest up to the step's long-prefill threshold (``_long_prefill_threshold``)
    and the token budget; 0 when it cannot start here (a prefill-first step already
    holds prefill and r exceeds the prefill budget left, or prefill is unchunked and r
    exceeds the token budget)."""
    n = prompt[r] + ri[GENERATED, r] - computed
    if 0 < threshold < n:
        n = threshold
    if (prefill_started and n > rem_input) or (cfg[I_CHUNKED] == 0.0 and n > budget):
        return 0
    return min(n, budget)


@njit(cache=True, nogil=True)
def _head_start_free(rep, st, cfg):
    """The fewest free KV blocks at which the coming step, every running request decoding,
    would start the waiting head (``_admit_waiting``'s first pick); ``NEVER`` when it
    could not start it however much KV were free (a budget is used up, or the admission
    rule refuses).

    Only under ``_stuck_modes``: then nothing else this decision reads changes over a
    decode stretch (static queue keys, no quota, clock or ratio rule, reservations only
    grow) while free KV only shrinks, so a stretch whose free KV stays below this never
    starts anyone. A decode-first step decides after its decodes took their blocks and
    tokens, a prefill-first step before (its decodes wait for a step without prefill).
    """
    ri, g = rep.ri, rep.g
    prefill_first = int(cfg[I_SCHEDULE_MODE]) == PREFILL_FIRST
    budget = int(cfg[I_MAX_BATCHED]) - (0 if prefill_first else g[N_RUN])
    if g[N_RUN] >= int(cfg[I_MAX_SEQS]) or budget <= 0:
        return NEVER
    pc, wq = _cache(rep, st), _queue(rep, st)
    prompt = st.si[S_PROMPT]
    r = qm.pick(wq, int(cfg[I_POLICY]), wq.lanes[qm.L_BLOCKED], _shares(rep).tenants[fm.TS_COUNTER], pc, st.offsets,
                prompt)
    held, computed, idle = ri[PC_REQ + pcm.R_HELD, r], ri[COMPUTED, r], 0
    if g[CACHING] and computed == 0 and ri[HOST, r] == 0:
        held, computed, idle = pcm.match(pc, st.offsets, prompt, r)
        idle *= g[ENTRY_BLOCKS]
    # nothing arrives or ends before the coming step: its threshold is the one of now
    threshold = _long_prefill_threshold(g, cfg)
    if (_first_chunk(ri, prompt, cfg, r, computed, budget, 0, False, threshold) == 0
            or not _rule_admits(ri, g, rep.gf, prompt, cfg, r)):
        return NEVER
    return _watermark_free(ri, g, pc, prompt, cfg, r, held, idle)


@njit(cache=True, nogil=True)
def _start(rep, st, cfg, r):
    """Move waiting r (just popped) to running: swap its KV back in, take its reservation."""
    ri, rf, g, gf = rep.ri, rep.rf, rep.g, rep.gf
    g[N_WAIT] -= 1
    ri[STATUS, r] = RUNNING
    rep.lists[L_RUN, g[N_RUN]] = r
    g[N_RUN] += 1
    if math.isnan(rf[FIRST_SCHED, r]):
        rf[FIRST_SCHED, r] = gf[CLOCK]
    if g[LORA] != 0:
        _adapter_start(rep, st, r)
    host = ri[HOST, r]
    if host > 0:
        gf[SWAP_S] += host * int(cfg[I_BLOCK_SIZE]) * gf[KV_BYTES] / gf[SWAP_BW]
        g[HOST_FREE] += host
        ri[HOST, r] = 0
    mode = int(cfg[I_ADMISSION])
    if mode == ADMIT_RESERVATION or mode == ADMIT_PREDICTED:
        ri[RESERVED, r] = _reservation_blocks(ri, g, st.si[S_PROMPT], cfg, r)
        g[RESERVED_TOTAL] += ri[RESERVED, r]


@njit(cache=True, nogil=True)
def _running_future(ri, g, run):
    """new_token_ratio: sum over running requests of their clipped remaining output."""
    total = 0
    for i in range(g[N_RUN]):
        r = run[i]
        total += min(ri[MAX_OUT, r] - ri[GENERATED, r], NTR_CLIP)
    return total


@njit(cache=True, nogil=True)
def _admit_waiting(rep, st, tables, cfg, prefill_first, threshold):
    """Start waiting requests in queue order until a budget or the admission rule stops
    (``threshold``: the step's long-prefill threshold, fixed as its formation began).

    A request new to the GPU first looks up the prefix cache; its cached tokens are not
    computed. Under EDF a never-scheduled head whose deadline is already unmeetable is
    rejected; with quotas, a head over its tenant's quota or its class's budget blocks its
    lane for this round and the next lane's head is tried. With LoRA, a request whose
    adapter would be one distinct adapter too many is skipped and keeps its place
    (``policies.adapters``): the next in order is tried.
    """
    ri, rf, g, gf = rep.ri, rep.rf, rep.g, rep.gf
    pc, wq, sh = _cache(rep, st), _queue(rep, st), _shares(rep)
    si, sf = st.si, st.sf
    prompt, offsets = si[S_PROMPT], st.offsets
    block_size = int(cfg[I_BLOCK_SIZE])
    chunked = cfg[I_CHUNKED] != 0.0
    max_seqs = int(cfg[I_MAX_SEQS])
    order = int(cfg[I_POLICY])
    rem_input = int(cfg[I_MAX_PREFILL]) - g[B_PREFILL]
    caching = g[CACHING] != 0
    quotas = g[QUOTAS] != 0
    lane_blocked = wq.lanes[qm.L_BLOCKED]
    if int(cfg[I_ADMISSION]) == ADMIT_NTR:
        gf[NTR_REM] = (g[FREE] - g[HEADROOM]) * block_size - gf[RATIO] * _running_future(ri, g, rep.lists[L_RUN])
    if quotas:
        lane_blocked[:] = 0
    if order == DFS_WEIGHT and caching and g[N_RUN] < max_seqs and g[BUDGET] > 0:
        qm.dfs_rekey(wq, pc, offsets, prompt)  # SGLang sorts once per round that may admit (calc_priority)
    lora = g[LORA] != 0
    skipped = np.int64(0)  # not a literal 0: Numba would compile _skip and _unskip for it too
    while g[N_RUN] < max_seqs and g[BUDGET] > 0:
        r = qm.pick(wq, order, lane_blocked, sh.tenants[fm.TS_COUNTER], pc, offsets, prompt)
        if r < 0:
            break
        if (order == EDF and math.isnan(rf[FIRST_SCHED, r])
                and qm.deadline_unmeetable(gf[CLOCK], sf[S_DEADLINE, r], sf[S_MIN_SERVICE, r],
                                           cfg[I_DEADLINE_MARGIN] * 1e-3)):
            _end_request(rep, st, r, S_REJECTED, R_DEADLINE, gf[CLOCK])
            continue
        if lora and not adm.can_join(_pool(rep), _adapter_state(rep), _pool_column(rep, st, r)):
            _skip(rep, wq, r, skipped)
            skipped += 1
            continue
        held = ri[PC_REQ + pcm.R_HELD, r]
        cached = 0
        idle = 0
        lookup = caching and ri[COMPUTED, r] == 0 and ri[HOST, r] == 0
        if lookup:
            held, cached, idle = pcm.match(pc, offsets, prompt, r)
            idle *= g[ENTRY_BLOCKS]
            ri[COMPUTED, r] = cached  # provisional: the step-cap and NTR checks see the cache
        n = _first_chunk(ri, prompt, cfg, r, ri[COMPUTED, r], g[BUDGET], rem_input, prefill_first and g[B_TOKENS] > 0,
                         threshold)
        if n > 0 and cfg[I_STEP_CAP_MS] > 0.0:
            n = _fit_step_cap(ri, g, gf, tables, prompt, cfg, r, n, chunked)
        if n > 0 and quotas:
            first = _need_blocks(ri, pc, r, ri[COMPUTED, r] + n, held, idle, block_size)
            if fm.admission_check(sh, si[S_TENANT, r], si[S_CLASS, r], first, n, g[FREE] - first, g[CAP],
                                  int(cfg[I_MAX_BATCHED]), g[N_RUN]) != fm.ADMIT:
                ri[COMPUTED, r] = 0 if lookup else ri[COMPUTED, r]
                lane_blocked[wq.lane_of[r]] = 1
                continue
        if n == 0 or not _admissible(ri, g, gf, pc, prompt, cfg, r, held, idle):
            if lookup:
                ri[COMPUTED, r] = 0
            break
        qm.remove(wq, r)
        fm.dequeue(sh, si[S_TENANT, r])
        if lookup:
            _take_cached_prefix(rep, st, tables, r, held, cached, idle, n)
        _start(rep, st, cfg, r)
        _schedule_shared(rep, st, cfg, r, n)
        rem_input -= n
    if skipped > 0:
        _unskip(rep, wq, skipped)


@njit(cache=True, nogil=True)
def _skip(rep, wq, r, k):
    """Take queued r out of this round's picks, keeping its queue key (``_unskip``)."""
    slot, row = wq.slots[qm.POS, r], rep.g[AD_SKIP_ROW]
    rep.fl[row, k] = r
    rep.fl[row + 1, k] = wq.keys[qm.K1, slot]
    rep.fl[row + 2, k] = wq.keys[qm.K2, slot]
    qm.remove(wq, r)


@njit(cache=True, nogil=True)
def _unskip(rep, wq, k):
    """Put the k requests skipped this round back under their own keys: each keeps its place."""
    row = rep.g[AD_SKIP_ROW]
    for i in range(k):
        qm.push(wq, int(rep.fl[row, i]), rep.fl[row + 1, i], rep.fl[row + 2, i])


@njit(cache=True, nogil=True)
def _take_cached_prefix(rep, st, tables, r, held, cached, idle_blocks, n):
    """Reference r's cached prefix (its idle entries stop being evictable) and count the
    lookup: tokens hit and looked up, and the lone-prefill time the hit saved this chunk."""
    g, gf = rep.g, rep.gf
    if held > 0:
        pcm.acquire(_cache(rep, st), st.offsets, r, held)
        g[FREE] -= idle_blocks
        g[USED] += idle_blocks
        if g[USED] > g[PEAK]:
            g[PEAK] = g[USED]
    gf[PREFIX_HIT] += cached
    gf[PREFIX_QUERY] += st.si[S_PROMPT, r]
    if math.isnan(rep.rf[FIRST_SCHED, r]):
        rep.ri[CACHED_FIRST, r] = cached
    if cached > 0:
        full = cached + n
        without, _ = step_seconds(tables, full, 0, 0, 0, full * (full + 1) // 2)
        with_cache, _ = step_seconds(tables, n, 0, 0, 0, n * cached + n * (n + 1) // 2)
        gf[PREFIX_SAVED_S] += without - with_cache


# ======================================================================================
# forming one step
# ======================================================================================
@njit(cache=True, nogil=True)
def _form_batch(rep, st, tables, cfg):
    """Fill the batch for the step starting now (see the module docstring for the rules)."""
    ri, g, gf = rep.ri, rep.g, rep.gf
    pc = _cache(rep, st)
    run, order, batch = rep.lists[L_RUN], rep.lists[L_ORDER], rep.lists[L_BATCH]
    prompt = st.si[S_PROMPT]
    prefill_first = int(cfg[I_SCHEDULE_MODE]) == PREFILL_FIRST
    threshold = _long_prefill_threshold(g, cfg)  # counted once, before anything is scheduled (vLLM)
    block_size = int(cfg[I_BLOCK_SIZE])
    g[BUDGET] = int(cfg[I_MAX_BATCHED])
    if g[QUOTAS]:
        fm.new_step(_shares(rep))
    # decodes take the plain path: sharing state is touched only when it matters
    cached_held = ri[PC_REQ + pcm.R_HELD]
    hash_tokens = st.block_tokens
    plain_decodes = g[QUOTAS] == 0
    k = g[N_RUN]
    order[:k] = run[:k]  # preemption edits `run` while we walk it
    for i in range(k):
        if g[BUDGET] <= 0:
            break
        r = order[i]
        if ri[STATUS, r] != RUNNING:
            continue
        n = prompt[r] + ri[GENERATED, r] - ri[COMPUTED, r]
        if prefill_first and _is_decode(ri, prompt, r, n):
            continue  # decodes wait for a step without prefill work
        if 0 < threshold < n:
            n = threshold
        n = min(n, g[BUDGET])
        if cfg[I_STEP_CAP_MS] > 0.0:
            n = _fit_step_cap(ri, g, gf, tables, prompt, cfg, r, n, np.bool_(True))  # one signature with _admit_waiting's
        if n == 0:
            continue
        if plain_decodes and _is_decode(ri, prompt, r, n):
            blocks = pcm.private_blocks(ri[COMPUTED, r] + 1, cached_held[r], hash_tokens, block_size) - ri[HELD, r]
            if blocks <= g[FREE] - g[PC_STATS + pcm.S_EVICTABLE] * g[ENTRY_BLOCKS]:
                _schedule(ri, g, batch, prompt, r, n, blocks)
                continue
        if _need_blocks(ri, pc, r, ri[COMPUTED, r] + n, cached_held[r], 0, block_size) <= g[FREE]:
            _schedule_shared(rep, st, cfg, r, n)
        else:
            _schedule_running(rep, st, tables, cfg, r, n)
    if g[PREEMPTED_NOW] == 0 and g[N_WAIT] > 0:
        _admit_waiting(rep, st, tables, cfg, prefill_first, threshold)
    if prefill_first and g[B_TOKENS] == 0:
        k = g[N_RUN]
        order[:k] = run[:k]
        for i in range(k):
            r = order[i]
            if ri[STATUS, r] == RUNNING:
                _schedule_running(rep, st, tables, cfg, r, np.int64(1))  # one signature with the call above
    if g[PREEMPTED_NOW] != 0 and int(cfg[I_ADMISSION]) == ADMIT_NTR:
        _retract_ratio(ri, g, gf, run, cfg)


@njit(cache=True, nogil=True)
def _ntr_init(cfg):
    return min(NTR_INIT * cfg[I_CONSERVATIVENESS], 1.0)


@njit(cache=True, nogil=True)
def _retract_ratio(ri, g, gf, run, cfg):
    """SGLang after a retraction: ratio from the decoded share of what is left running."""
    k = g[N_RUN]
    if k == 0:
        gf[RATIO] = _ntr_init(cfg)
        return
    decoded = 0
    max_new = 0
    for i in range(k):
        r = run[i]
        decoded += ri[GENERATED, r]
        max_new += ri[MAX_OUT, r]
    gf[RATIO] = min(1.0, (decoded + NTR_RETRACT_STEPS * k) / max_new)


@njit(cache=True, nogil=True)
def _decay_ratio(gf, cfg):
    init = _ntr_init(cfg)
    low = NTR_MIN_FACTOR * init
    gf[RATIO] = max(gf[RATIO] - (init - low) / NTR_DECAY_STEPS, low)


# ======================================================================================
# speculative decoding: verify budgets after the batch is formed, outcomes at its end
# ======================================================================================
@njit(cache=True, nogil=True)
def _plan_verify(rep, st, tables, cfg, spec):
    """Give the batch's decodes their verify budgets (``policies.speculative``) from the
    token budget and KV the formed batch left, taking blocks for the draft tokens.
    ``spec``: ``st.spec``; None compiles to nothing."""
    if spec is None:  # pruned by type: the planner is not compiled for runs that never speculate
        return
    ri, g, gf, lists = rep.ri, rep.g, rep.gf, rep.lists
    batch = lists[L_BATCH]
    prompt = st.si[S_PROMPT]
    held_entries = ri[PC_REQ + pcm.R_HELD]
    reqs, tok, lim = lists[L_SPEC + SP_REQS], lists[L_SPEC + SP_TOK], lists[L_SPEC + SP_LIM]
    slack, ell = lists[L_SPEC + SP_SLACK], lists[L_SPEC + SP_ELL]
    mode = int(cfg[I_SPEC_MODE])
    gamma = int(cfg[I_SPEC_GAMMA])
    block_size = int(cfg[I_BLOCK_SIZE])
    hash_tokens = st.block_tokens
    n_req = np.int64(0)  # not a literal 0: Numba would compile the speculative planners for it too
    for i in range(g[N_BATCH]):
        r = batch[i]
        if ri[SCHED, r] == 1 and _is_decode(ri, prompt, r, 1):
            reqs[n_req] = r
            tok[n_req] = ri[GENERATED, r]
            lim[n_req] = max(0, min(gamma, ri[MAX_OUT, r] - ri[GENERATED, r] - 1))
            slack[n_req] = held_entries[r] * hash_tokens + ri[HELD, r] * block_size - ri[COMPUTED, r] - 1
            n_req += 1
    g[SPEC_SLOTS] = n_req
    if n_req == 0:
        return
    surv, alpha = rep.surv, rep.fl[FL_ALPHA]
    if mode == spm.MODE_DSPARK or mode == spm.MODE_DSPARK_LAGGED:
        spm.draft_confidences(reqs, tok, n_req, spec.profiles, st.si[S_SPEC_ROW], g[RNG_SEED], spec.spread,
                              spec.bias, gamma, surv)
    elif mode == spm.MODE_SMARTSPEC:
        spm.acceptance_estimate(rep.rf[SPEC_HITS], rep.rf[SPEC_TRIALS], gf[SPEC_EST:SPEC_EST + 2], reqs, n_req, alpha)
    draft_pp = spm.draft_seconds_per_position(tables, int(cfg[I_DRAFT_MODE]), cfg[I_DRAFT_COST], n_req,
                                              g[B_KV_DECODE])
    free_blocks = max(0, g[FREE] - g[PC_STATS + pcm.S_EVICTABLE] * g[ENTRY_BLOCKS])
    lag = SPEC_LAG + g[STEPS] % 2  # written two steps ago, rewritten now
    x, _, positions, k_now = spm.verify_budgets(
        mode, gamma, n_req, surv, alpha, lim, tables, g[B_TOKENS], g[B_LOGITS], g[B_DECODES],
        g[B_KV_DECODE], g[B_PAIRS], draft_pp, g[BUDGET], slack, free_blocks, block_size, g[lag], ell,
        lists[L_SPEC + SP_HEAP], lists[L_SPEC + SP_SCRATCH])
    g[lag] = k_now
    for k in range(n_req):
        m = ell[k]
        if m == 0:
            continue
        r = reqs[k]
        take = pcm.private_blocks(ri[COMPUTED, r] + 1 + m, held_entries[r], hash_tokens, block_size) - ri[HELD, r]
        g[FREE] -= take
        g[USED] += take
        ri[HELD, r] += take
        if g[QUOTAS]:
            fm.hold_kv(_shares(rep), st.si[S_TENANT, r], st.si[S_CLASS, r], take)
        g[SPEC_VERIFIES] += 1
    if g[USED] > g[PEAK]:
        g[PEAK] = g[USED]
    g[BUDGET] -= x
    g[B_TOKENS] += x
    g[B_LOGITS] += x
    g[B_KV_DECODE] += x
    gf[DRAFT_S] = positions * draft_pp
    g[SPEC_DECODES] += n_req
    g[SPEC_DRAFTED] += x


@njit(cache=True, nogil=True)
def _settle_verify(rep, st, cfg, spec):
    """Sample the verifies and keep the accepted drafts: each request advances by them on
    top of its own token (up to its output length), and the rejected drafts' KV is freed.
    ``spec`` as in ``_plan_verify``."""
    if spec is None:  # pruned by type
        return
    ri, g, lists = rep.ri, rep.g, rep.lists
    reqs, tok = lists[L_SPEC + SP_REQS], lists[L_SPEC + SP_TOK]
    ell, accepted = lists[L_SPEC + SP_ELL], lists[L_SPEC + SP_ACCEPTED]
    n_req = g[SPEC_SLOTS]
    spm.sample_verify(reqs, tok, ell, n_req, spec.profiles, st.si[S_SPEC_ROW], g[RNG_SEED], spec.spread, accepted)
    if int(cfg[I_SPEC_MODE]) == spm.MODE_SMARTSPEC:
        spm.observe_acceptance(rep.rf[SPEC_HITS], rep.rf[SPEC_TRIALS], rep.gf[SPEC_EST:SPEC_EST + 2], reqs, ell,
                               accepted, n_req)
    block_size = int(cfg[I_BLOCK_SIZE])
    tokens_unit = int(cfg[I_COST_UNIT]) == fm.TOKENS
    for k in range(n_req):
        if ell[k] == 0:
            continue
        r = reqs[k]
        kept = min(accepted[k], ri[TARGET, r] - ri[GENERATED, r] - 1)
        ri[GENERATED, r] += kept
        ri[SCHED, r] += kept
        g[SPEC_ACCEPTED] += kept
        extra = ri[HELD, r] - pcm.private_blocks(ri[COMPUTED, r] + 1 + kept, ri[PC_REQ + pcm.R_HELD, r],
                                                 st.block_tokens, block_size)
        g[FREE] += extra
        g[USED] -= extra
        ri[HELD, r] -= extra
        if g[QUOTAS]:
            fm.hold_kv(_shares(rep), st.si[S_TENANT, r], st.si[S_CLASS, r], -extra)
        _cover_reservation(ri, g, r)
        if tokens_unit and kept > 0:
            fm.charge(_shares(rep), st.si[S_TENANT, r], cfg[I_W_OUT] * kept)
    g[SPEC_SLOTS] = 0


# ======================================================================================
# boundary events: arrivals, deadlines, max wait
# ======================================================================================
@njit(cache=True, nogil=True)
def _exceeds_capacity(ri, g, pc, cfg, r, p, max_out):
    """Whether r (prompt p, up to max_out tokens out) could never run here, not even alone:
    the arrival rule EXCEEDS_CAPACITY, whatever the replica's state."""
    block_size = int(cfg[I_BLOCK_SIZE])
    if p >= g[MAX_LEN]:
        return True
    limit = g[CAP] - g[HEADROOM]
    mode = int(cfg[I_ADMISSION])
    # the mode's need when the engine is empty, at the worst point of this request's life
    if _need_blocks(ri, pc, r, p + max_out - 1, 0, 0, block_size) > limit:
        return True
    if (mode == ADMIT_RESERVATION or mode == ADMIT_PREDICTED) and _blocks(p + max_out, block_size) > limit:
        return True
    return mode == ADMIT_NTR and p + max_out >= limit * block_size


@njit(cache=True, nogil=True, inline="always")
def _max_out(g, si, r):
    """Most tokens r may generate here: its max_tokens, within max_model_len."""
    return min(si[S_MAX_TOKENS, r], g[MAX_LEN] - si[S_PROMPT, r])


@njit(cache=True, nogil=True)
def _arrival_reject(ri, g, pc, tables, prompt, deadline, cfg, r, t):
    """Reason to turn r away on arrival, or R_NONE."""
    p = prompt[r]
    if _exceeds_capacity(ri, g, pc, cfg, r, p, ri[MAX_OUT, r]):
        return R_EXCEEDS
    if cfg[I_UNMEETABLE] != 0.0 and not math.isnan(deadline[r]):
        alone_s, _ = step_seconds(tables, p, 1, 0, 0, p * (p + 1) // 2)
        if t + alone_s > deadline[r]:
            return R_DEADLINE
    max_queue = int(cfg[I_MAX_QUEUE])
    if max_queue > 0 and g[N_WAIT] >= max_queue:
        return R_QUEUE_FULL
    high_water = cfg[I_HIGH_WATER]
    if high_water < 1.0 and g[USED] >= high_water * g[CAP]:
        return R_KV_HIGH_WATER
    return R_NONE


@njit(cache=True, nogil=True, inline="always")
def _next_delivery(rep):
    """Time of the next delivered request not yet admitted or rejected (inf if none)."""
    return rep.gf[NEXT_DELIVERY]


@njit(cache=True, nogil=True)
def _arrive(rep, st, tables, cfg, t):
    """Admit to the queue (or reject) every delivered request due by boundary t."""
    ri, rf, g = rep.ri, rep.rf, rep.g
    si = st.si
    inbox = rep.lists[L_INBOX]
    ring = inbox.shape[0] - 1
    prompt, deadline = si[S_PROMPT], st.sf[S_DEADLINE]
    while g[INBOX_HEAD] < g[N_DELIVERED]:
        r = inbox[g[INBOX_HEAD] % ring]
        if rf[DELIVERED, r] > t:
            rep.gf[NEXT_DELIVERY] = rf[DELIVERED, r]
            break
        g[INBOX_HEAD] += 1
        rep.gf[NEXT_DELIVERY] = np.inf
        max_out = _max_out(g, si, r)
        ri[MAX_OUT, r] = max_out
        ri[TARGET, r] = max(1, min(si[S_OUTPUT, r], max_out))
        reason = _arrival_reject(ri, g, _cache(rep, st), tables, prompt, deadline, cfg, r, t)
        if reason != R_NONE:
            _end_request(rep, st, r, S_REJECTED, reason, t)
            continue
        _push_waiting(rep, st, cfg, r, False)
        if not math.isnan(deadline[r]):
            heap_push(rep.lists[L_DHEAP], deadline, st.sf[S_ARRIVAL], r)  # arrival breaks no tie: r does


@njit(cache=True, nogil=True)
def _next_deadline(rep, st):
    r = heap_first_live(rep.lists[L_DHEAP], st.sf[S_DEADLINE], st.sf[S_ARRIVAL], rep.ri[STATUS], WAITING, RUNNING)
    return np.inf if r < 0 else st.sf[S_DEADLINE, r]


@njit(cache=True, nogil=True)
def _expire(rep, st, cfg, t):
    """End requests whose deadline has passed; past max_wait_s a never-scheduled request is
    rejected or moved to the front of the queue, per ``max_wait_action``."""
    while _next_deadline(rep, st) <= t:
        r = heap_pop(rep.lists[L_DHEAP], st.sf[S_DEADLINE], st.sf[S_ARRIVAL])
        _end_by_deadline(rep, st, r)
    max_wait = cfg[I_MAX_WAIT]
    if max_wait > 0.0:
        g = rep.g
        inbox = rep.lists[L_INBOX]
        ring = inbox.shape[0] - 1
        arrival = st.sf[S_ARRIVAL]
        admit_first = int(cfg[I_WAIT_ACTION]) == ADMIT_FIRST
        p = g[WAIT_SCAN]  # every request delivered before position p has waited past max_wait
        scan = p
        while scan < g[INBOX_HEAD]:
            r = inbox[scan % ring]
            scan += 1
            if not t - arrival[r] > max_wait:
                if g[UNSORTED] == 0:
                    break
                continue  # out of arrival order: a later position may hold an older request
            if rep.ri[STATUS, r] == WAITING and math.isnan(rep.rf[FIRST_SCHED, r]):
                if admit_first:
                    qm.promote(_queue(rep, st), r)
                else:
                    _end_request(rep, st, r, S_REJECTED, R_MAX_WAIT, t)
            if p == scan - 1:
                p = scan
        g[WAIT_SCAN] = p


# ======================================================================================
# end of a step
# ======================================================================================
@njit(cache=True, nogil=True)
def _calibrate(ri, g, hist, cfg, r):
    """predicted mode: add a finished request's output/max_out ratio, refresh the quantile."""
    bins = hist.shape[0]
    max_out = ri[MAX_OUT, r]
    hist[(ri[GENERATED, r] * bins + max_out - 1) // max_out - 1] += 1
    g[N_CALIBRATED] += 1
    if g[N_CALIBRATED] < MIN_CALIBRATION:
        return
    need = cfg[I_QUANTILE] * g[N_CALIBRATED]
    cumulative = 0
    for b in range(bins):
        cumulative += hist[b]
        if cumulative >= need:
            g[PRED_BIN] = b
            return


@njit(cache=True, nogil=True)
def _end_step(rep, st, cfg, t_end, dt):
    """Advance every scheduled request by its tokens: cache the prompt blocks it completed,
    charge its tenant for the step, then sample, finish or time out."""
    ri, rf, g, gf = rep.ri, rep.rf, rep.g, rep.gf
    batch = rep.lists[L_BATCH]
    prompt, tenant, deadline = st.si[S_PROMPT], st.si[S_TENANT], st.sf[S_DEADLINE]
    unit = int(cfg[I_COST_UNIT])
    block_size = int(cfg[I_BLOCK_SIZE])
    caching = g[CACHING] != 0
    cached_held = ri[PC_REQ + pcm.R_HELD]
    n_full = ri[PC_REQ + pcm.R_N_FULL]
    ledger = rep.ledger
    w_out = cfg[I_W_OUT]
    kv_bytes = gf[KV_BYTES]
    hand_off = g[HAND_OFF] != 0
    for i in range(g[N_BATCH]):
        r = batch[i]
        n = ri[SCHED, r]
        if n == 0:
            continue  # preempted after being scheduled
        ri[SCHED, r] = 0
        ri[COMPUTED, r] += n
        if caching and cached_held[r] < n_full[r]:
            _cache_prompt_blocks(rep, st, r, block_size)
        if unit != fm.TOKENS:
            fm.charge(_shares(rep), tenant[r], fm.step_cost(unit, n, g[B_TOKENS], dt, ri[COMPUTED, r], kv_bytes))
        if ri[COMPUTED, r] != prompt[r] + ri[GENERATED, r]:
            continue
        ri[GENERATED, r] += 1
        if unit == fm.TOKENS:  # fm.charge, inlined: this runs for every token
            ledger[fm.TS_SERVICE, tenant[r]] += w_out
            ledger[fm.TS_COUNTER, tenant[r]] += w_out / ledger[fm.TS_WEIGHT, tenant[r]]
        if math.isnan(rf[FIRST_TOKEN, r]):
            rf[FIRST_TOKEN, r] = t_end
        if ri[GENERATED, r] < ri[TARGET, r]:
            if hand_off and not deadline[r] <= t_end:  # P/D: on to a decode replica (a late one expires here)
                _hand_off(rep, st, r)
            continue
        if deadline[r] < t_end:
            _end_by_deadline(rep, st, r)
        else:
            _end_request(rep, st, r, S_FINISHED, R_NONE, t_end)
            if int(cfg[I_ADMISSION]) == ADMIT_PREDICTED:
                _calibrate(ri, g, g[G_HIST:G_STEP_HIST], cfg, r)
    g[N_BATCH] = 0


@njit(cache=True, nogil=True, inline="always")
def _cache_prompt_blocks(rep, st, r, block_size):
    """Turn the full prompt hash blocks r has computed into cache entries it references;
    blocks another request cached first are deduplicated and freed."""
    ri, g = rep.ri, rep.g
    freed = pcm.insert(_cache(rep, st), st.offsets, r, ri[COMPUTED, r])
    before = ri[HELD, r]
    ri[HELD, r] = pcm.private_blocks(ri[COMPUTED, r], ri[PC_REQ + pcm.R_HELD, r], st.block_tokens, block_size)
    if g[QUOTAS]:
        fm.hold_kv(_shares(rep), st.si[S_TENANT, r], st.si[S_CLASS, r], ri[HELD, r] - before)
    g[FREE] += freed
    g[USED] -= freed


@njit(cache=True, nogil=True)
def _sample_until(g, gf, series, t_stop):
    """Record the state at every series grid time before t_stop (state is constant until then)."""
    capacity = series.shape[0]
    while True:
        t_k = gf[SERIES_T0] + g[SAMPLE_K] * gf[SERIES_EVERY]
        if t_k >= t_stop:
            return
        m = g[N_SAMPLES]
        if m == capacity:  # keep every other sample and double the spacing
            for i in range(capacity // 2):
                series[i, :] = series[2 * i, :]
            g[N_SAMPLES] = capacity // 2
            gf[SERIES_EVERY] *= 2.0
            g[SAMPLE_K] = (g[SAMPLE_K] + 1) // 2
            continue
        series[m, 0] = t_k
        series[m, 1] = g[USED]
        series[m, 2] = g[N_RUN]
        series[m, 3] = g[N_WAIT]
        g[N_SAMPLES] = m + 1
        g[SAMPLE_K] += 1


@njit(cache=True, nogil=True, inline="always")
def _count_step(g, dt):
    """Count a step of dt seconds in the step-time histogram: bin 0 below STEP_HIST_MIN_S,
    then STEP_HIST_PER_DECADE log-spaced bins per decade, the last one open-ended
    (``policies.result``). Every step passes here, fast-forwarded or not."""
    k = 0
    if dt >= STEP_HIST_MIN_S:
        k = min(1 + int((math.log10(dt) - STEP_HIST_LOG_MIN) * STEP_HIST_PER_DECADE), STEP_HIST_BINS - 1)
    g[G_STEP_HIST + k] += 1


@njit(cache=True, nogil=True, inline="always")
def _note_step_tokens(g, gf, tokens):
    """Keep the most tokens one step computed and when a step first computed that many (the
    step starting at the clock): the run's activation peak (``policies.workspace``)."""
    if tokens > g[PEAK_STEP]:
        g[PEAK_STEP] = tokens
        gf[PEAK_STEP_S] = gf[CLOCK]


@njit(cache=True, nogil=True)
def _book_step(g, gf, series, cfg, dt_compute, oor):
    """Book one formed step of dt_compute (+ copies) seconds; return its end and length.
    The caller then runs ``_end_step`` and moves the clock."""
    dt = dt_compute + gf[SWAP_S]
    _count_step(g, dt)
    _note_step_tokens(g, gf, g[B_TOKENS])
    if oor:
        g[OUT_OF_RANGE] += 1
    t_end = gf[CLOCK] + dt
    if t_end > gf[SERIES_T0] + g[SAMPLE_K] * gf[SERIES_EVERY]:  # a series grid time passes
        _sample_until(g, gf, series, t_end)
    g[STEPS] += 1
    gf[BUSY] += dt
    g[PREFILL_TOKENS] += g[B_PREFILL]
    if g[B_DECODES] > 0 and int(cfg[I_ADMISSION]) == ADMIT_NTR:
        _decay_ratio(gf, cfg)
    return t_end, dt


# ======================================================================================
# fast-forward over pure-decode stretches
# ======================================================================================
@njit(cache=True, nogil=True)
def _decode_layout(ri, run, k, cached_held, prompt, hash_tokens, residues):
    """For the first k running requests, all decoding: fill ``residues`` (a histogram of
    positions modulo the block size: which step allocates whose next block) and return
    the KV tokens their next decode reads and the steps until the first one finishes
    (0 when one of them is not decoding)."""
    if not _is_decode(ri, prompt, run[k - 1], 1):
        return 0, 0  # the newest is the likeliest to be still in its prefill
    block_size = residues.shape[0]
    residues[:] = 0
    kv = 0
    run_len = np.iinfo(np.int64).max
    for i in range(k):
        r = run[i]
        c = ri[COMPUTED, r]
        if not _is_decode(ri, prompt, r, 1):
            return 0, 0
        residues[(c - cached_held[r] * hash_tokens) % block_size] += 1
        kv += c + 1
        run_len = min(run_len, ri[TARGET, r] - ri[GENERATED, r])
    return kv, run_len


@njit(cache=True, nogil=True)
def _fast_forward(ri, g, gf, series, run, cached_held, prompt, tables, cfg, hash_tokens, next_event, next_deadline,
                  truly_free, start_free):
    """Run consecutive all-decode steps that the step-by-step loop would form identically.

    Applies while every running request is decoding, no delivery, deadline or limit
    (``next_event``) is due at a boundary, the new blocks fit (``truly_free``: free
    without evicting cached prefixes) and free KV stays below ``start_free``, the level
    at which a waiting request would start (``_head_start_free``; ``NEVER`` if none
    waits). The stretch ends at the latest with the step in which the first requests
    reach their last token (``_end_fast_forward`` ends them). Each step costs one
    decode-attention lookup (the token-linear and lm-head parts are the same for the
    whole stretch); blocks come from a histogram of positions modulo the block size.
    Decode blocks never complete a prompt hash block, so the prefix cache only matters
    through ``truly_free``; ``_settle_fast_forward`` applies the per-request effects.
    Takes only the arrays it reads (each argument costs at every call). Returns the steps
    taken, their summed seconds, the sum of step index times seconds (KV byte-seconds)
    and whether the last step finished requests.
    """
    k = g[N_RUN]
    prefill_first = int(cfg[I_SCHEDULE_MODE]) == PREFILL_FIRST
    if k == 0 or (not prefill_first and k > int(cfg[I_MAX_BATCHED])):
        return 0, 0.0, 0.0, False
    decode_blocks = 0 if prefill_first else k  # at most, before the layout says
    if next_event <= gf[CLOCK] or next_deadline <= gf[CLOCK] or g[FREE] - decode_blocks >= start_free:
        return 0, 0.0, 0.0, False
    block_size = int(cfg[I_BLOCK_SIZE])
    residues = g[G_RESIDUES:G_RESIDUES + block_size]
    kv, run_len = _decode_layout(ri, run, k, cached_held, prompt, hash_tokens, residues)
    if run_len == 0:
        return 0, 0.0, 0.0, False
    if not prefill_first:
        decode_blocks = residues[0]
    if g[FREE] - decode_blocks >= start_free:
        return 0, 0.0, 0.0, False  # free KV only shrinks: checking the first step is enough
    base = decode_run_base(tables, k)
    ntr = int(cfg[I_ADMISSION]) == ADMIT_NTR
    t = gf[CLOCK]
    busy = gf[BUSY]
    free = g[FREE]
    used = g[USED]
    peak = g[PEAK]
    out_of_range = 0
    t_sample = gf[SERIES_T0] + g[SAMPLE_K] * gf[SERIES_EVERY]  # next series grid time
    j = 0
    slot = 0  # residue whose requests start a block at step j: -j modulo the block size
    sum_dt = 0.0
    sum_j_dt = 0.0  # for KV byte-seconds: context grows by one token per step
    while j < run_len and next_event > t and next_deadline > t:
        need = residues[slot]
        if need > truly_free:
            break
        truly_free -= need
        free -= need
        used += need
        peak = max(peak, used)
        dt, oor = decode_run_step(tables, base, kv)
        _count_step(g, dt)
        if oor:
            out_of_range += 1
        if t + dt > t_sample:
            g[USED] = used
            _sample_until(g, gf, series, t + dt)
            t_sample = gf[SERIES_T0] + g[SAMPLE_K] * gf[SERIES_EVERY]
        t = t + dt
        busy += dt
        if ntr:
            _decay_ratio(gf, cfg)
        kv += k
        sum_dt += dt
        sum_j_dt += j * dt
        j += 1
        slot = slot - 1 if slot > 0 else block_size - 1
    if j > 0:
        _note_step_tokens(g, gf, k)  # every step of the stretch decodes the k running requests
    g[FREE] = free
    g[USED] = used
    g[PEAK] = peak
    g[STEPS] += j
    g[OUT_OF_RANGE] += out_of_range
    gf[BUSY] = busy
    gf[CLOCK] = t
    return j, sum_dt, sum_j_dt, j == run_len


@njit(cache=True, nogil=True)
def _fast_forward_chunk(ri, g, gf, series, run, cached_held, prompt, ledger, tenant, tables, cfg, hash_tokens,
                        next_event, next_deadline, truly_free):
    """Run consecutive steps of the same shape: every running request but the newest
    decodes, the newest computes a prompt chunk of a fixed size that does not finish its
    prefill (chunked prefill of a long prompt next to the same decodes).

    The step-by-step loop forms these steps identically while nothing is due (as
    ``_fast_forward``), the new blocks fit without eviction and no waiting request can
    start: none waits, or the decodes and the chunk take the whole token budget. Each
    step is one ``step_seconds`` lookup; the chunk's blocks, tokens and prompt-token
    charge are applied here, the decodes' by ``_settle_fast_forward`` (first k - 1
    running). The caller checked the modes (``_chunk_modes``). Returns the steps taken
    and whether the last one finished requests (``_end_fast_forward`` ends them).
    """
    k = g[N_RUN]
    d = k - 1  # decodes, scheduled before the chunk
    budget = int(cfg[I_MAX_BATCHED])
    if k == 0 or d >= budget or next_event <= gf[CLOCK] or next_deadline <= gf[CLOCK]:
        return 0, False
    p = run[d]
    total = prompt[p] + ri[GENERATED, p]
    computed = ri[COMPUTED, p]
    chunk = budget - d
    # running and waiting stay as they are over the stretch (nothing arrives, starts or
    # ends before its last step), so every step has the threshold of the first
    threshold = _long_prefill_threshold(g, cfg)
    if 0 < threshold < chunk:
        chunk = threshold
    if computed + chunk >= total or cached_held[p] < ri[PC_REQ + pcm.R_N_FULL, p]:
        return 0, False  # the chunk would finish the prefill, or complete prompt hash blocks
    if g[N_WAIT] > 0 and d + chunk < budget:
        return 0, False  # a waiting request could start with the budget left
    block_size = int(cfg[I_BLOCK_SIZE])
    residues = g[G_RESIDUES:G_RESIDUES + block_size]
    run_len = np.iinfo(np.int64).max
    kv = 0
    if d > 0:
        kv, run_len = _decode_layout(ri, run, d, cached_held, prompt, hash_tokens, residues)
        if run_len == 0:
            return 0, False
    held_entries = cached_held[p]
    held = ri[HELD, p]
    cost = cfg[I_W_IN] * chunk  # the chunk's prompt tokens, charged to its tenant as scheduled
    t = gf[CLOCK]
    busy = gf[BUSY]
    free = g[FREE]
    used = g[USED]
    peak = g[PEAK]
    out_of_range = 0
    t_sample = gf[SERIES_T0] + g[SAMPLE_K] * gf[SERIES_EVERY]
    j = 0
    slot = 0  # as in ``_fast_forward``
    while j < run_len and computed + chunk < total and next_event > t and next_deadline > t:
        held_after = pcm.private_blocks(computed + chunk, held_entries, hash_tokens, block_size)
        need = held_after - held
        if d > 0:
            need += residues[slot]
        if need > truly_free:
            break
        truly_free -= need
        free -= need
        used += need
        peak = max(peak, used)
        held = held_after
        ledger[fm.TS_SERVICE, tenant[p]] += cost
        ledger[fm.TS_COUNTER, tenant[p]] += cost / ledger[fm.TS_WEIGHT, tenant[p]]
        pairs = chunk * computed + chunk * (chunk + 1) // 2
        dt, oor = step_seconds(tables, d + chunk, d, d, kv, pairs)
        _count_step(g, dt)
        if oor:
            out_of_range += 1
        if t + dt > t_sample:
            g[USED] = used
            _sample_until(g, gf, series, t + dt)
            t_sample = gf[SERIES_T0] + g[SAMPLE_K] * gf[SERIES_EVERY]
        t = t + dt
        busy += dt
        kv += d
        computed += chunk
        j += 1
        slot = slot - 1 if slot > 0 else block_size - 1
    if j == 0:
        return 0, False
    ri[COMPUTED, p] = computed
    ri[HELD, p] = held
    _cover_reservation(ri, g, p)
    g[FREE] = free
    g[USED] = used
    g[PEAK] = peak
    g[STEPS] += j
    g[PREFILL_TOKENS] += j * chunk
    g[OUT_OF_RANGE] += out_of_range
    _note_step_tokens(g, gf, d + chunk)
    gf[BUSY] = busy
    gf[CLOCK] = t
    return j, j == run_len


@njit(cache=True, nogil=True)
def _chunk_modes(cfg, quotas, hand_off):
    """Modes under which ``_fast_forward_chunk`` applies: decode-first scheduling, no
    step-time cap, quota or max wait (its expiries need every boundary), admission by
    free KV or reservation, prompt tokens as the cost unit (charged per scheduled chunk,
    not per step) and no P/D hand-off."""
    mode = int(cfg[I_ADMISSION])
    return (int(cfg[I_SCHEDULE_MODE]) != PREFILL_FIRST and cfg[I_STEP_CAP_MS] <= 0.0 and not quotas
            and cfg[I_MAX_WAIT] <= 0.0 and mode != ADMIT_NTR and int(cfg[I_COST_UNIT]) == fm.TOKENS
            and not hand_off)


@njit(cache=True, nogil=True)
def _end_fast_forward(rep, st, cfg):
    """End the requests that reached their last token in a stretch's final step, in
    batch (admission) order, as ``_end_step`` would."""
    ri, g = rep.ri, rep.g
    run, order = rep.lists[L_RUN], rep.lists[L_ORDER]
    deadline = st.sf[S_DEADLINE]
    t_end = rep.gf[CLOCK]
    k = g[N_RUN]
    order[:k] = run[:k]  # ending edits `run`
    for i in range(k):
        r = order[i]
        if ri[GENERATED, r] < ri[TARGET, r]:
            continue
        if deadline[r] < t_end:
            _end_by_deadline(rep, st, r)
        else:
            _end_request(rep, st, r, S_FINISHED, R_NONE, t_end)
            if int(cfg[I_ADMISSION]) == ADMIT_PREDICTED:
                _calibrate(ri, g, g[G_HIST:G_STEP_HIST], cfg, r)


@njit(cache=True, nogil=True)
def _settle_fast_forward(ri, g, gf, run, k, cached_held, si, ledger, cfg, hash_tokens, j, sum_dt, sum_j_dt):
    """Apply j fast-forwarded decode steps to the first k running requests: tokens,
    blocks, reservations and their tenants' usage and charge."""
    tenant = si[S_TENANT]
    block_size = int(cfg[I_BLOCK_SIZE])
    unit = int(cfg[I_COST_UNIT])
    quotas = g[QUOTAS] != 0
    kv_bytes = gf[KV_BYTES]
    for i in range(k):
        r = run[i]
        c = ri[COMPUTED, r]
        ri[COMPUTED, r] += j
        ri[GENERATED, r] += j
        before = ri[HELD, r]
        ri[HELD, r] = pcm.private_blocks(ri[COMPUTED, r], cached_held[r], hash_tokens, block_size)
        if quotas:
            fm.hold_kv(fm.Shares(ledger[:fm.N_TENANT_ROWS], ledger[fm.N_TENANT_ROWS:]), tenant[r], si[S_CLASS, r],
                       ri[HELD, r] - before)
        _cover_reservation(ri, g, r)
        if unit == fm.TOKENS:
            cost = cfg[I_W_OUT] * j
        elif unit == fm.GPU_TIME:
            cost = sum_dt / k
        else:
            cost = kv_bytes * ((c + 1) * sum_dt + sum_j_dt)
        ledger[fm.TS_SERVICE, tenant[r]] += cost  # fm.charge, inlined
        ledger[fm.TS_COUNTER, tenant[r]] += cost / ledger[fm.TS_WEIGHT, tenant[r]]


@njit(cache=True, nogil=True)
def _stuck_modes(cfg, quotas):
    """Modes under which a blocked waiting head stays blocked while decodes only grow:
    admission by free KV or reservation (new_token_ratio decays, so it may unblock), no
    step-time cap, quota or max wait, and a static queue order (EDF rejects by the clock,
    VTC reorders by counters, LPM and DFS_WEIGHT by cached prefixes, which decodes may
    evict)."""
    mode = int(cfg[I_ADMISSION])
    order = int(cfg[I_POLICY])
    return (mode != ADMIT_NTR and cfg[I_STEP_CAP_MS] <= 0.0 and not quotas and cfg[I_MAX_WAIT] <= 0.0
            and order != EDF and order != VTC
            and not ((order == LPM or order == DFS_WEIGHT) and cfg[I_PREFIX_CACHING] != 0.0))


# ======================================================================================
# the replica: create, deliver, advance, inspect, report
# ======================================================================================
@njit(cache=True, nogil=True)
def new_replica(st, cfg, cap_blocks, host_blocks, kv_bytes, swap_bw, seed, series_every, fast_forward,
                tenant_params, class_params, t0):
    """A replica with nothing delivered, clock ``t0``, every buffer sized for the trace.

    ``cap_blocks``/``host_blocks``: GPU and host KV blocks (``validate``); ``kv_bytes``:
    KV bytes per token; ``swap_bw``: host copy bytes per second; ``seed``: the RNG seed
    of stochastic features; ``series_every``: spacing of the sampled series;
    ``tenant_params``/``class_params``: ``policies.fairness.side_params`` for ``cfg``. Its
    progress guard has the default bound for the trace (``bound_progress`` changes it).
    """
    n = st.sf.shape[1]
    block_size = int(cfg[I_BLOCK_SIZE])
    ri = np.zeros((N_RI, n), dtype=np.int64)
    ri[STATUS] = NOT_ARRIVED
    g = np.zeros(G_RESIDUES + block_size, dtype=np.int64)
    gf = np.zeros(N_GF)
    g[CAP] = cap_blocks
    g[HEADROOM] = int(cfg[I_HEADROOM] * cap_blocks)
    g[FREE] = cap_blocks
    g[HOST_FREE] = host_blocks
    g[HOST_CAP] = host_blocks
    g[PRED_BIN] = -1
    g[RNG_SEED] = seed
    g[RNG_COUNTER] = 0
    max_len = int(cfg[I_MAX_MODEL_LEN])
    g[MAX_LEN] = max_len if max_len > 0 else cap_blocks * block_size
    if cfg[I_CHUNKED] == 0.0:
        g[MAX_LEN] = min(g[MAX_LEN], int(cfg[I_MAX_BATCHED]))
    gf[RATIO] = _ntr_init(cfg)
    gf[CLOCK] = t0
    gf[SERIES_T0] = t0
    gf[SERIES_EVERY] = series_every
    gf[KV_BYTES] = kv_bytes
    gf[SWAP_BW] = swap_bw
    gf[NEXT_DELIVERY] = np.inf
    gf[PEAK_STEP_S] = np.nan
    caching = cfg[I_PREFIX_CACHING] != 0.0
    g[KV_BLOCK_SIZE] = block_size
    g[ENTRY_BLOCKS] = _blocks(st.block_tokens, block_size)
    quotas = (np.any(tenant_params[:, fm.T_KV_QUOTA] < 1.0) or np.any(tenant_params[:, fm.T_TOKEN_QUOTA] < 1.0)
              or np.any(class_params[:, fm.C_HEADROOM] > 0.0) or np.any(class_params[:, fm.C_KV_SHARE] < 1.0)
              or np.any(class_params[:, fm.C_TOKEN_SHARE] < 1.0))
    g[CACHING] = 1 if caching else 0
    g[QUOTAS] = 1 if quotas else 0
    g[STUCK_MODES] = 1 if _stuck_modes(cfg, quotas) else 0
    g[FAST_FORWARD] = 1 if fast_forward else 0
    g[PROGRESS_BASE], g[PROGRESS_PER] = default_progress_budget(n)
    speculating = int(cfg[I_SPEC_MODE]) != spm.MODE_OFF  # its rows are allocated only when on
    lora = cfg[I_LORA] != 0.0  # so are the adapter pool's (lists) and the skipped requests' (fl)
    g[AD_POOL_ROW] = N_LISTS + (N_SPEC_I if speculating else 0)
    g[AD_SKIP_ROW] = N_FL + (1 if speculating else 0)
    lists = np.zeros((g[AD_POOL_ROW] + (adm.N_ROWS if lora else 0), n + 1), dtype=np.int64)
    fl = np.zeros((g[AD_SKIP_ROW] + (3 if lora else 0), n))
    entries = np.empty((pcm.N_ENTRY_ROWS, st.n_entries if caching else 0), dtype=np.int64)
    lanes = np.empty((qm.N_LANE_ROWS, st.lane_tenant.shape[0]), dtype=np.int64)
    ledger = np.empty((fm.N_TENANT_ROWS + fm.N_CLASS_ROWS, max(tenant_params.shape[0], class_params.shape[0])))
    rf = np.full((N_RF, n), np.nan)
    rf[SPEC_HITS] = 0.0
    rf[SPEC_TRIALS] = 0.0
    base_slot = lora and cfg[I_LORA_BASE_SLOT] != 0.0
    adapters = int(st.lora[0, LORA_ADAPTERS])
    g[AD_COLUMNS] = adapters + (1 if base_slot else 0) if lora else 0  # at most n + 1: adapters in use
    rep = Replica(ri, rf, g, gf, lists, fl, entries, lanes, ledger, np.zeros((SERIES_CAPACITY, 4)),
                  np.zeros((n if speculating else 0, int(cfg[I_SPEC_GAMMA]))))
    g[LORA] = 1 if lora else 0
    g[AD_BASE] = adapters if base_slot else -1
    if lora:
        gf[AD_BYTES] = st.lora[0, LORA_BYTES_PER_RANK] * cfg[I_LORA_RANK]
        gf[AD_DISK_BW] = st.lora[0, LORA_DISK_BW]
        slots = int(cfg[I_MAX_LORAS])
        host = int(cfg[I_MAX_CPU_LORAS])
        host = (host if host > 0 else slots) + (1 if base_slot else 0)  # the base column needs no host entry
        preload = cfg[I_LORA_PRELOAD] != 0.0
        adm.clear(_pool(rep), _adapter_state(rep), slots, max(host, g[AD_COLUMNS]) if preload else host,
                  int(cfg[I_LORA_POLICY]), preload)
    pcm.clear(_cache(rep, st), st.si[S_N_FULL] if caching else np.zeros(n, dtype=np.int64))
    qm.clear(_queue(rep, st), st.lane_tenant)
    fm.clear(_shares(rep), tenant_params, class_params)
    return rep


@njit(cache=True, nogil=True)
def default_progress_budget(units):
    """The default (base, per) of a progress guard: a loop may iterate base + per *
    progress times, for a run with ``units`` units of work known up front (requests, and
    for a fleet failure events and replicas). A correct run iterates at most about twice
    per unit of progress (``_progress``); the bound is generous, and cheap to reach when a
    loop spins. Callable from Python too."""
    return 16 * units + 1024, 4


@njit(cache=True, nogil=True)
def bound_progress(rep, budget):
    """Bound the replica's progress guard by ``budget``: i8[2] (base, per)."""
    rep.g[PROGRESS_BASE] = budget[0]
    rep.g[PROGRESS_PER] = budget[1]


@njit(cache=True, nogil=True, inline="always")
def _progress(g):
    """The replica's progress counters summed: steps taken, deliveries admitted or
    rejected, requests ended and calls of ``advance``. Every iteration of ``advance``'s
    loop moves one, or is followed by one that does (an idle jump by an arrival, a step
    that only preempted by a step), but the idle jump to a call's limit."""
    return g[STEPS] + g[INBOX_HEAD] + g[N_DONE] + g[ADVANCES]


@njit(cache=True, nogil=True)
def deliver(rep, r, t):
    """Request r reaches the replica's inbox at time t (times never decrease)."""
    g = rep.g
    inbox = rep.lists[L_INBOX]
    ring = inbox.shape[0] - 1
    tail = g[N_DELIVERED]
    if tail - g[INBOX_HEAD] >= ring:
        raise ValueError("deliver: the inbox already holds every request")
    if tail > 0 and t < rep.rf[DELIVERED, inbox[(tail - 1) % ring]]:
        raise ValueError("deliver: delivery times must not decrease")
    inbox[tail % ring] = r
    rep.rf[DELIVERED, r] = t
    if tail == g[INBOX_HEAD]:
        rep.gf[NEXT_DELIVERY] = t
    g[N_DELIVERED] = tail + 1


@njit(cache=True, nogil=True)
def advance(rep, st, tables, cfg, t_limit):
    """Run the steps that start before ``t_limit`` (see the module docstring)."""
    _advance(_borrow_replica(rep), _borrow_statics(st), _borrow_tables(tables), borrowed(cfg), t_limit, False)


@njit(cache=True, nogil=True)
def advance_through(rep, st, tables, cfg, t):
    """``advance`` that also runs the step starting at ``t`` (the fleet watching a
    replica's step ends calls it at t = the replica's clock)."""
    _advance(_borrow_replica(rep), _borrow_statics(st), _borrow_tables(tables), borrowed(cfg), t, True)


@njit(cache=True, nogil=True)
def _advance(rep, st, tables, cfg, t_limit, through):
    """``advance`` on borrowed arrays (``through``: steps starting at ``t_limit`` too).
    Helpers are called only when they have work."""
    ri, g, gf, series = rep.ri, rep.g, rep.gf, rep.series
    dheap, run = rep.lists[L_DHEAP], rep.lists[L_RUN]
    cached_held, hash_tokens = ri[PC_REQ + pcm.R_HELD], st.block_tokens
    prompt = st.si[S_PROMPT]
    speculating = int(cfg[I_SPEC_MODE]) != spm.MODE_OFF
    # every speculative step draws its own outcomes; VTC keeps exact counters step by step
    # (nor LoRA: stretches time steps without the adapters' GEMMs)
    fast_forward = g[FAST_FORWARD] != 0 and not speculating and int(cfg[I_POLICY]) != VTC and g[LORA] == 0
    hand_off = g[HAND_OFF] != 0
    chunk_stretches = fast_forward and _chunk_modes(cfg, g[QUOTAS] != 0, hand_off)
    if g[ERROR] != 0:
        return  # a replica in error runs no more: its state is not to be trusted
    g[ADVANCES] += 1
    while g[N_DONE] < g[N_DELIVERED]:
        t = gf[CLOCK]
        if t > t_limit or (t == t_limit and not through):
            break
        g[ITERATIONS] += 1
        if g[ITERATIONS] > g[PROGRESS_BASE] + g[PROGRESS_PER] * _progress(g):
            g[ERROR] = ERROR_NO_PROGRESS  # the loop spins: stop, reported instead of hanging
            return
        if _next_delivery(rep) <= t:
            _arrive(rep, st, tables, cfg, t)
        if dheap[0] > 0 or cfg[I_MAX_WAIT] > 0.0:
            _expire(rep, st, cfg, t)
        if g[N_DONE] == g[N_DELIVERED]:
            break
        if g[N_RUN] == 0 and g[N_WAIT] == 0:  # idle: jump to the next delivery (or the limit)
            _idle_until(g, gf, series, cfg, min(_next_delivery(rep), t_limit))
            continue
        # with requests waiting, a stretch is tried only while the queue stays backed up (an
        # arrival to a queue the last step emptied almost always starts at once) and the
        # newest running request decodes (else no stretch starts)
        if fast_forward and (g[N_WAIT] == 0 or (g[STUCK_MODES] != 0 and g[LEFT_WAITING] > 0 and g[N_RUN] > 0
                                                  and _is_decode(ri, prompt, run[g[N_RUN] - 1], 1))):
            start_free = _head_start_free(rep, st, cfg) if g[N_WAIT] > 0 else NEVER
            next_deadline = _next_deadline(rep, st) if dheap[0] > 0 else np.inf
            truly_free = g[FREE] - g[PC_STATS + pcm.S_EVICTABLE] * g[ENTRY_BLOCKS]
            j, sum_dt, sum_j_dt, finished = _fast_forward(ri, g, gf, series, run, cached_held, prompt, tables, cfg,
                                                          hash_tokens, min(_next_delivery(rep), t_limit), next_deadline,
                                                          truly_free, start_free)
            if j > 0:
                _settle_fast_forward(ri, g, gf, run, g[N_RUN], cached_held, st.si, rep.ledger, cfg, hash_tokens, j,
                                     sum_dt, sum_j_dt)
                if finished:
                    _end_fast_forward(rep, st, cfg)
                continue
        if chunk_stretches and g[N_RUN] > 0:
            next_deadline = _next_deadline(rep, st) if dheap[0] > 0 else np.inf
            truly_free = g[FREE] - g[PC_STATS + pcm.S_EVICTABLE] * g[ENTRY_BLOCKS]
            j, finished = _fast_forward_chunk(ri, g, gf, series, run, cached_held, prompt, rep.ledger, st.si[S_TENANT],
                                              tables, cfg, hash_tokens, min(_next_delivery(rep), t_limit),
                                              next_deadline, truly_free)
            if j > 0:
                _settle_fast_forward(ri, g, gf, run, g[N_RUN] - 1, cached_held, st.si, rep.ledger, cfg, hash_tokens,
                                     j, 0.0, 0.0)
                if finished:
                    _end_fast_forward(rep, st, cfg)
                continue
        g[PREEMPTED_NOW] = 0
        gf[SWAP_S] = 0.0
        g[B_TOKENS] = 0
        g[B_LOGITS] = 0
        g[B_DECODES] = 0
        g[B_KV_DECODE] = 0
        g[B_PAIRS] = 0
        g[B_PREFILL] = 0
        _form_batch(rep, st, tables, cfg)
        g[LEFT_WAITING] = g[N_WAIT]
        if g[B_TOKENS] == 0:
            g[N_BATCH] = 0
            if g[PREEMPTED_NOW] != 0 or g[N_RUN] + g[N_WAIT] == 0:
                continue  # the step only preempted or rejected (edf); admission resumes at once
            g[ERROR] = ERROR_STALLED
            return
        if speculating and g[B_DECODES] > 0:
            gf[DRAFT_S] = 0.0
            _plan_verify(rep, st, tables, cfg, st.spec)
        dt, oor = step_seconds(tables, g[B_TOKENS], g[B_LOGITS], g[B_DECODES], g[B_KV_DECODE], g[B_PAIRS])
        if g[LORA] != 0:
            dt += adm.step_seconds(st.lora[1:], cfg[I_LORA_RANK], _adapter_tokens(rep, st))
        if speculating and g[SPEC_SLOTS] > 0:
            dt += gf[DRAFT_S]
            _settle_verify(rep, st, cfg, st.spec)
        t_end, dt = _book_step(g, gf, series, cfg, dt, oor)
        _end_step(rep, st, cfg, t_end, dt)
        gf[CLOCK] = t_end
        if hand_off and g[N_OUTBOX] > 0:
            break  # the fleet sends what this step handed off before time moves on
    if gf[CLOCK] < t_limit and t_limit < np.inf and g[N_RUN] + g[N_WAIT] == 0 and _next_delivery(rep) >= t_limit:
        _idle_until(g, gf, series, cfg, t_limit)


@njit(cache=True, nogil=True)
def _idle_until(g, gf, series, cfg, t):
    """Nothing runs or waits: sample the idle state and move the clock to t."""
    _sample_until(g, gf, series, t)
    gf[RATIO] = _ntr_init(cfg)
    gf[CLOCK] = t


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


@njit(cache=True, nogil=True)
def head_request(rep, st, cfg):
    """The request the scheduler would try next: the queue head under the configured
    order, else the first inbox request; -1 if none."""
    r = qm.pick(_queue(rep, st), int(cfg[I_POLICY]), np.zeros(rep.lanes.shape[1], dtype=np.int64),
                rep.ledger[fm.TS_COUNTER], _cache(rep, st), st.offsets, st.si[S_PROMPT])
    if r < 0 and inbox_pending(rep) > 0:
        inbox = rep.lists[L_INBOX]
        r = inbox[rep.g[INBOX_HEAD] % (inbox.shape[0] - 1)]
    return r


@njit(cache=True, nogil=True)
def head_demand_blocks(rep, st, cfg):
    """KV blocks of prompt + generated tokens of ``head_request``; 0 if none."""
    r = head_request(rep, st, cfg)
    if r < 0:
        return 0
    return _blocks(st.si[S_PROMPT, r] + rep.ri[GENERATED, r], int(cfg[I_BLOCK_SIZE]))


@njit(cache=True, nogil=True)
def queued_tokens(rep, st):
    """Tokens still to compute before the first token of every queued and inbox request:
    prompt + generated - computed."""
    return _waiting_sum(rep, st, True)


@njit(cache=True, nogil=True)
def waiting_tokens(rep, st):
    """prompt + generated tokens of every queued and inbox request (SGLang's ``seqlen``
    summed over its waiting queue in the load report)."""
    return _waiting_sum(rep, st, False)


@njit(cache=True, nogil=True)
def _waiting_sum(rep, st, less_computed):
    ri, g, wq = rep.ri, rep.g, _queue(rep, st)
    prompt = st.si[S_PROMPT]
    total = 0
    for lane in range(wq.lanes.shape[1]):
        base = wq.lanes[qm.L_BASE, lane]
        for s in range(base, base + wq.lanes[qm.L_SIZE, lane]):
            r = wq.slots[qm.SLOT_REQ, s]
            total += prompt[r] + ri[GENERATED, r] - (ri[COMPUTED, r] if less_computed else 0)
    inbox = rep.lists[L_INBOX]
    ring = inbox.shape[0] - 1
    for p in range(g[INBOX_HEAD], g[N_DELIVERED]):
        r = inbox[p % ring]
        total += prompt[r] + ri[GENERATED, r] - (ri[COMPUTED, r] if less_computed else 0)
    return total


@njit(cache=True, nogil=True)
def cached_tokens(rep, st, r):
    """Leading prompt tokens of request r found in this replica's prefix cache."""
    if rep.g[CACHING] == 0:
        return 0
    return pcm.match(_cache(rep, st), st.offsets, st.si[S_PROMPT], r)[1]


@njit(cache=True, nogil=True)
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
    """The running request admitted last (-1 if none runs)."""
    g = rep.g
    return rep.lists[L_RUN, g[N_RUN] - 1] if g[N_RUN] > 0 else -1


@njit(cache=True, nogil=True)
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
        demand += _blocks(prompt[r] + ri[TARGET, r], block_size) + ri[PC_REQ + pcm.R_N_FULL, r] - ri[HELD, r]
    return demand <= g[FREE]


@njit(cache=True, nogil=True, inline="always")
def capacity_blocks(rep):
    return rep.g[CAP]


@njit(cache=True, nogil=True, inline="always")
def max_len(rep):
    """Longest prompt + output a request may reach here (``max_model_len``)."""
    return rep.g[MAX_LEN]


@njit(cache=True, nogil=True)
def never_admits(rep, st, cfg, r):
    """Whether request r, never delivered here, would be rejected EXCEEDS_CAPACITY on
    arrival whatever this replica's state (P/D: the fleet turns it away before a decode
    replica promises it KV)."""
    g = rep.g
    return _exceeds_capacity(rep.ri, g, _cache(rep, st), cfg, r, st.si[S_PROMPT, r], _max_out(g, st.si, r))


# -- requests moving between replicas (the fleet) ------------------------------------------
@njit(cache=True, nogil=True)
def new_carried(n):
    """Empty carried rows for n requests: nothing computed, generated, scheduled or observed yet."""
    carried_f = np.full((N_KF, n), np.nan)
    carried_f[K_SPEC_HITS:K_SPEC_TRIALS + 1] = 0.0
    return np.zeros((N_KI, n), dtype=np.int64), carried_f


@njit(cache=True, nogil=True)
def carry(rep, r, keep_kv, carried_i, carried_f):
    """Write what r takes from this replica to its next one: the tokens it generated (they
    were streamed), its counters, first times and sampler state, and its computed KV only
    with ``keep_kv``."""
    ri, rf = rep.ri, rep.rf
    carried_i[K_COMPUTED, r] = ri[COMPUTED, r] if keep_kv else 0
    carried_i[K_GENERATED, r] = ri[GENERATED, r]
    carried_i[K_PREEMPTS, r] = ri[PREEMPTS, r]
    carried_i[K_CACHED_FIRST, r] = ri[CACHED_FIRST, r]
    carried_f[K_FIRST_SCHED, r] = rf[FIRST_SCHED, r]
    carried_f[K_FIRST_TOKEN, r] = rf[FIRST_TOKEN, r]
    carried_f[K_SPEC_HITS, r] = rf[SPEC_HITS, r]
    carried_f[K_SPEC_TRIALS, r] = rf[SPEC_TRIALS, r]


@njit(cache=True, nogil=True)
def withdraw(rep, st, r, keep_kv, carried_i, carried_f):
    """Take r (in the inbox, queued or running) off this replica and ``carry`` it: a failure
    drops its KV (``keep_kv`` False), a migration keeps it. Its blocks, prefix references,
    reservation, queue entry and quota usage are freed here (its cached prefix blocks stay
    cached). Returns the tokens whose KV was lost (to be computed again)."""
    ri = rep.ri
    if ri[STATUS, r] == NOT_ARRIVED:
        _leave_inbox(rep, r)
    else:
        _vacate(rep, st, r)
        ri[STATUS, r] = NOT_ARRIVED
    carry(rep, r, keep_kv, carried_i, carried_f)
    return 0 if keep_kv else ri[COMPUTED, r]


@njit(cache=True, nogil=True)
def _leave_inbox(rep, r):
    g = rep.g
    inbox = rep.lists[L_INBOX]
    ring = inbox.shape[0] - 1
    p = g[INBOX_HEAD]
    while p < g[N_DELIVERED] and inbox[p % ring] != r:
        p += 1
    if p == g[N_DELIVERED]:  # r is not in the inbox: a caller's bug, reported instead of searched for ever
        g[ERROR] = ERROR_NOT_HELD
        return
    for q in range(p, g[N_DELIVERED] - 1):
        inbox[q % ring] = inbox[(q + 1) % ring]
    g[N_DELIVERED] -= 1
    if p == g[INBOX_HEAD]:
        empty = g[INBOX_HEAD] == g[N_DELIVERED]
        rep.gf[NEXT_DELIVERY] = np.inf if empty else rep.rf[DELIVERED, inbox[g[INBOX_HEAD] % ring]]


@njit(cache=True, nogil=True)
def deliver_carried(rep, st, r, t, carried_i, carried_f):
    """``deliver`` r with what it carries from its last replica (``carry``; fresh rows for a
    new arrival). KV it carries is allocated when it is admitted, never recomputed."""
    ri, rf = rep.ri, rep.rf
    ri[COMPUTED, r] = carried_i[K_COMPUTED, r]
    ri[GENERATED, r] = carried_i[K_GENERATED, r]
    ri[PREEMPTS, r] = carried_i[K_PREEMPTS, r]
    ri[CACHED_FIRST, r] = carried_i[K_CACHED_FIRST, r]
    rf[FIRST_SCHED, r] = carried_f[K_FIRST_SCHED, r]
    rf[FIRST_TOKEN, r] = carried_f[K_FIRST_TOKEN, r]
    rf[SPEC_HITS, r] = carried_f[K_SPEC_HITS, r]
    rf[SPEC_TRIALS, r] = carried_f[K_SPEC_TRIALS, r]
    heap = rep.lists[L_DHEAP]
    if heap[0] + inbox_pending(rep) >= ri.shape[1]:
        _compact_deadlines(rep, st)
    g, inbox = rep.g, rep.lists[L_INBOX]
    if g[N_DELIVERED] > 0 and st.sf[S_ARRIVAL, r] < st.sf[S_ARRIVAL, inbox[(g[N_DELIVERED] - 1) % (inbox.shape[0] - 1)]]:
        g[UNSORTED] = 1
    deliver(rep, r, t)


@njit(cache=True, nogil=True)
def _compact_deadlines(rep, st):
    """Rebuild the deadline heap from its live entries, once each: a request delivered
    here again leaves a stale entry behind, and the heap holds at most n."""
    heap = rep.lists[L_DHEAP]
    status = rep.ri[STATUS]
    entries = heap[1:heap[0] + 1].copy()
    kept = np.zeros(status.shape[0], dtype=np.bool_)
    heap[0] = 0
    for r in entries:
        if (status[r] == WAITING or status[r] == RUNNING) and not kept[r]:
            kept[r] = True
            heap_push(heap, st.sf[S_DEADLINE], st.sf[S_ARRIVAL], r)


@njit(cache=True, nogil=True)
def hand_off_after_first_token(rep):
    """Make this a P/D prefill replica: a request leaves as soon as a step samples a token
    for it (unless it is done, or its deadline has passed), into ``handed_off``, and
    ``advance`` returns after each step that handed one off."""
    rep.g[HAND_OFF] = 1


@njit(cache=True, nogil=True)
def _hand_off(rep, st, r):
    g = rep.g
    _vacate(rep, st, r)
    rep.ri[STATUS, r] = NOT_ARRIVED
    rep.lists[L_OUTBOX, g[N_OUTBOX]] = r
    g[N_OUTBOX] += 1


@njit(cache=True, nogil=True, inline="always")
def handed_off(rep):
    """Requests handed off (at the end of the step that ended at ``clock``), not yet taken:
    ``carry`` each with its KV, then ``clear_handed_off``."""
    return rep.lists[L_OUTBOX, :rep.g[N_OUTBOX]]


@njit(cache=True, nogil=True, inline="always")
def clear_handed_off(rep):
    rep.g[N_OUTBOX] = 0


@njit(cache=True, nogil=True)
def write_outputs(rep, out_i, out_f, out_counts, out_fcounts, series, out_cached, out_service, out_prefix):
    """Per-request outputs of the requests that ended on this replica, and its counters.

    out_i[4, n]: state, reject reason, tokens generated, preemptions; out_f[3, n]: first
    token, finish, first scheduled; out_counts / out_fcounts: run counters (C_*, F_*; the
    step-time histogram at C_STEP_HIST);
    series[SERIES_CAPACITY, 4]: (t, KV blocks used, running, waiting); out_cached[n]:
    cached prompt tokens at first schedule; out_service[T]: service charged per tenant;
    out_prefix[N_PREFIX]: prefix-cache figures (P_*).
    """
    ri, rf, g, gf = rep.ri, rep.rf, rep.g, rep.gf
    for r in range(ri.shape[1]):
        if ri[STATUS, r] != DONE:
            continue
        out_i[O_STATE, r] = ri[STATE, r]
        out_i[O_REASON, r] = ri[REASON, r]
        out_i[O_GENERATED, r] = ri[GENERATED, r]
        out_i[O_PREEMPTS, r] = ri[PREEMPTS, r]
        out_f[O_FIRST_TOKEN, r] = rf[FIRST_TOKEN, r]
        out_f[O_FINISH, r] = rf[FINISH, r]
        out_f[O_FIRST_SCHED, r] = rf[FIRST_SCHED, r]
        out_cached[r] = ri[CACHED_FIRST, r]
    out_counts[C_STEPS] = g[STEPS]
    out_counts[C_OUT_OF_RANGE] = g[OUT_OF_RANGE]
    out_counts[C_PREFILL_TOKENS] = g[PREFILL_TOKENS]
    out_counts[C_CAP] = g[CAP]
    out_counts[C_PEAK] = g[PEAK]
    out_counts[C_SWAP_OUTS] = g[SWAP_OUTS]
    out_counts[C_N_SAMPLES] = g[N_SAMPLES]
    out_counts[C_USED_END] = g[USED]
    out_counts[C_RESERVED_END] = g[RESERVED_TOTAL]
    out_counts[C_HOST_USED_END] = g[HOST_CAP] - g[HOST_FREE]
    out_counts[C_ERROR] = g[ERROR]
    out_counts[C_ITERATIONS] = g[ITERATIONS]
    out_counts[C_RUNNING_END] = g[N_RUN]
    out_counts[C_WAITING_END] = g[N_WAIT]
    out_counts[C_ENDED_END] = g[N_DONE]
    out_counts[C_SPEC_DECODES] = g[SPEC_DECODES]
    out_counts[C_SPEC_VERIFIES] = g[SPEC_VERIFIES]
    out_counts[C_SPEC_DRAFTED] = g[SPEC_DRAFTED]
    out_counts[C_SPEC_ACCEPTED] = g[SPEC_ACCEPTED]
    out_counts[C_PEAK_STEP] = g[PEAK_STEP]
    out_counts[C_AD_LOADS] = g[AD_LOADS]
    out_counts[C_AD_DISK_LOADS] = g[AD_DISK_LOADS]
    out_counts[C_STEP_HIST:C_STEP_HIST + STEP_HIST_BINS] = g[G_STEP_HIST:G_STEP_HIST + STEP_HIST_BINS]
    out_fcounts[F_BUSY] = gf[BUSY]
    out_fcounts[F_END] = gf[CLOCK]
    out_fcounts[F_PEAK_STEP_S] = gf[PEAK_STEP_S]
    out_fcounts[F_AD_LOAD_S] = gf[AD_LOAD_S]
    series[:] = rep.series
    out_service[:] = rep.ledger[fm.TS_SERVICE, :out_service.shape[0]]
    out_prefix[P_HIT_TOKENS] = gf[PREFIX_HIT]
    out_prefix[P_QUERY_TOKENS] = gf[PREFIX_QUERY]
    out_prefix[P_SAVED_S] = gf[PREFIX_SAVED_S]
    out_prefix[P_EVICTIONS] = g[PC_STATS + pcm.S_EVICTIONS]


# ======================================================================================
# the kernels
# ======================================================================================
@njit(cache=True, nogil=True)
def simulate_kernel(st, tables, cfg, cap_blocks, host_blocks, kv_bytes, swap_bw, seed, series_every, fast_forward,
                    tenant_params, class_params, out_i, out_f, out_counts, out_fcounts, series, out_cached,
                    out_service, out_prefix, budget):
    """One replay of the trace under config vector ``cfg`` on one replica: every request
    delivered at its arrival, advanced to the end; fills the ``out_*`` buffers
    (``write_outputs``). ``st`` is ``statics``; ``budget``: the progress guard's (base,
    per) (``bound_progress``); the rest as in ``new_replica``."""
    arrival = st.sf[S_ARRIVAL]
    rep = new_replica(st, cfg, cap_blocks, host_blocks, kv_bytes, swap_bw, seed, series_every, fast_forward,
                      tenant_params, class_params, arrival[0])
    bound_progress(rep, budget)
    inbox = _borrow_replica(rep)  # rep outlives it
    for r in range(arrival.shape[0]):
        deliver(inbox, r, arrival[r])
    advance(rep, st, tables, cfg, np.inf)
    write_outputs(rep, out_i, out_f, out_counts, out_fcounts, series, out_cached, out_service, out_prefix)


# ======================================================================================
# Python side
# ======================================================================================
def validate(trace, cost_model: CostModel, config: PolicyConfig) -> tuple[int, int]:
    """Check that ``config`` can run on ``cost_model``; return (GPU, host) KV blocks.

    Raises ConfigError naming the knob and the limit; requests that could never fit are
    not an error here but are rejected one by one as EXCEEDS_CAPACITY.
    """
    if trace.n == 0:
        raise ValueError("the trace has no requests; nothing to simulate")
    bs = config.block_size
    lora_bytes = _lora_gpu_bytes(trace, cost_model, config)
    try:
        # the pool is sized after a profiling pass at the step budget (vLLM's rule), and after
        # the adapter slots took their memory
        budget = cost_model.kv_budget_bytes(config.gpu_memory_utilization, config.max_num_batched_tokens)
        cap = int((budget - lora_bytes) // (cost_model.kv_bytes_per_token * bs))
    except CostModelError as exc:
        raise ConfigError(f"gpu_memory_utilization={config.gpu_memory_utilization}: {exc}") from None
    if cap < 1:
        tokens = max(0, int((budget - lora_bytes) // cost_model.kv_bytes_per_token))
        raise ConfigError(
            f"KV capacity of {cost_model.name} at gpu_memory_utilization={config.gpu_memory_utilization} "
            f"is {tokens} tokens{f' after {lora_bytes / 2**30:.2f} GiB of adapter slots' if lora_bytes else ''}, "
            f"less than one block of block_size={bs}"
        )
    if config.max_num_batched_tokens < bs:
        raise ConfigError(
            f"max_num_batched_tokens={config.max_num_batched_tokens} is smaller than one KV block "
            f"(block_size={bs})"
        )
    headroom = int(config.kv_headroom * cap)
    if headroom >= cap:
        raise ConfigError(f"kv_headroom={config.kv_headroom} keeps {headroom} of {cap} KV blocks free: nothing admits")
    if config.max_model_len > cap * bs:
        raise ConfigError(
            f"max_model_len={config.max_model_len} needs more KV than the {cap * bs} tokens "
            f"({cap} blocks) available at gpu_memory_utilization={config.gpu_memory_utilization}"
        )
    if not config.enable_chunked_prefill and config.max_model_len > config.max_num_batched_tokens:
        raise ConfigError(
            f"without chunked prefill max_num_batched_tokens={config.max_num_batched_tokens} must be "
            f">= max_model_len={config.max_model_len} (as vLLM requires)"
        )
    return cap, cost_model.swap_capacity_blocks(bs)


def _lora_gpu_bytes(trace, cost_model: CostModel, config: PolicyConfig) -> float:
    """GPU bytes the adapter slots take before the KV pool is sized (0 without LoRA): both
    engines allocate ``max_loras`` slots at ``max_lora_rank`` when the model loads
    (vllm/v1/worker/gpu_model_runner.py:5006 ``load_lora_model``, before the profiling pass
    sizes the KV cache; srt/model_executor/model_runner.py:733, "before the KV cache is
    sized"). Refuses a trace that asks for adapters with LoRA off, LoRA on a cost model
    that cannot cost it, and a host cache smaller than the GPU pool."""
    if not config.enable_lora:
        if trace.has_adapters:
            names = [name for name in trace.adapter_names if name][:3]
            raise ConfigError(f"the trace asks for LoRA adapters ({', '.join(names)}, ...) but enable_lora is off "
                              "(an engine without LoRA refuses those requests): set enable_lora = true "
                              "(--set enable_lora=true, or enable-lora in the engine file)")
        return 0.0
    if cost_model.lora is None:
        raise ConfigError(f"enable_lora: the cost model {cost_model.name} has no LoRA cost (a measured step CSV, "
                          "or an MoE/MLA model); build it from op tables of a dense model")
    if 0 < config.max_cpu_loras < config.max_loras:
        raise ConfigError(f"max_cpu_loras={config.max_cpu_loras} must be >= max_loras={config.max_loras} "
                          "(every adapter on the GPU is also in the host cache)")
    return config.max_loras * cost_model.lora.adapter_bytes(config.max_lora_rank)


def default_series_every(trace) -> float:
    """About 500 samples over the trace's arrival span."""
    span = float(trace.arrival_s[-1] - trace.arrival_s[0])
    return max(span, 1e-3) / 500.0


class SharingInputs(NamedTuple):
    """Per-trace arrays the sharing policies read (the same for every config)."""

    tenant: np.ndarray  # i8[n]
    klass: np.ndarray  # i8[n]
    offsets: np.ndarray  # i8[n + 1]
    entry: np.ndarray  # i8[blocks], dense prefix-cache entry of each trace block
    n_full: np.ndarray  # i8[n], full (cacheable) hash blocks per prompt
    n_entries: int
    block_tokens: int
    lane_of: np.ndarray  # i8[n], queue lane: (tenant, class)
    lane_tenant: np.ndarray  # i8[lanes]
    min_service_s: np.ndarray  # f8[n]
    job_s: np.ndarray  # f8[n]
    adapter: np.ndarray  # i8[n], adapter pool column (policies.adapters), -1 = the base model
    n_adapters: int


def sharing_inputs(trace, cost_model: CostModel) -> SharingInputs:
    """Prefix-cache layout, queue lanes and service estimates for one trace and cost model.

    Kept per trace (weakly) and cost model: a search replays the same pair thousands of
    times, and sorting the prefix hashes costs more than a short replay. Traces are
    immutable (read-only columns, ``replace`` makes a new one), so the entry stays valid.
    """
    held = _SHARING_CACHE.setdefault(trace, [])
    for model_ref, inputs in held:
        if model_ref() is cost_model:
            return inputs
    inputs = _sharing_inputs(trace, cost_model)
    held[:] = [(ref, kept) for ref, kept in held if ref() is not None] + [(weakref.ref(cost_model), inputs)]
    return inputs


_SHARING_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _sharing_inputs(trace, cost_model: CostModel) -> SharingInputs:
    # keyed by identity: a block computed under another adapter or model version is other KV
    entry, n_full, n_entries = pcm.prefix_layout(trace.block_offsets, trace.cache_block_hashes,
                                                 trace.prompt_tokens, trace.block_tokens)
    n_tenants, n_classes = len(trace.tenant_names), len(trace.slo_class_names)
    lane_of, lane_tenant = qm.lanes(trace.tenant, trace.slo_class, n_tenants, n_classes, True, True)
    min_service_s, job_s = qm.service_estimates(cost_model.tables, trace.prompt_tokens, trace.output_estimate)
    # pool columns: the adapters requests ask for, in name order; the base model (name "") outside
    used = np.zeros(len(trace.adapter_names), dtype=bool)
    used[trace.adapter] = True
    used &= np.array([name != "" for name in trace.adapter_names])  # "": studies.traces.BASE
    column = np.where(used, np.cumsum(used) - 1, -1).astype(np.int64)
    return SharingInputs(
        tenant=trace.tenant.astype(np.int64), klass=trace.slo_class.astype(np.int64),
        # a writable copy: the kernels' types must not depend on whether the trace's columns are
        # read-only (a loaded Trace) or not (an unpickled one), or each gets its own compile
        offsets=np.array(trace.block_offsets, dtype=np.int64), entry=entry, n_full=n_full,
        n_entries=int(n_entries), block_tokens=int(trace.block_tokens), lane_of=lane_of,
        lane_tenant=lane_tenant, min_service_s=min_service_s, job_s=job_s,
        adapter=column[trace.adapter], n_adapters=int(column.max(initial=-1)) + 1,
    )


def statics(trace, cost_model: CostModel, configs: Sequence[PolicyConfig],
            acceptance: spm.AcceptanceModel | None = None) -> Statics:
    """The read-only replica inputs for a trace, a cost model (service estimates) and the
    configs to run (the widest speculative draft among them)."""
    sin = sharing_inputs(trace, cost_model)
    profiles, rows, spread, bias = _spec_inputs(trace, configs, acceptance)
    si = np.empty((N_SI, trace.n), dtype=np.int64)
    for row, column in ((S_PROMPT, trace.prompt_tokens), (S_OUTPUT, trace.output_tokens),
                        (S_MAX_TOKENS, trace.max_tokens), (S_PRIORITY, trace.priority), (S_TENANT, sin.tenant),
                        (S_CLASS, sin.klass), (S_LANE, sin.lane_of), (S_N_FULL, sin.n_full), (S_SPEC_ROW, rows),
                        (S_ADAPTER, sin.adapter)):
        si[row] = column
    sf = np.empty((N_SF, trace.n))
    for row, column in ((S_ARRIVAL, trace.arrival_s), (S_DEADLINE, trace.deadline_s),
                        (S_MIN_SERVICE, sin.min_service_s), (S_JOB, sin.job_s)):
        sf[row] = column
    cost = cost_model.lora
    grid = cost.grid() if cost is not None else np.zeros((2, 3))
    lora = np.zeros((grid.shape[0] + 1, grid.shape[1]))
    lora[1:] = grid
    lora[0, LORA_BYTES_PER_RANK] = cost.bytes_per_rank if cost is not None else 0.0
    lora[0, LORA_DISK_BW] = cost.disk_bytes_per_s if cost is not None else 1.0
    lora[0, LORA_ADAPTERS] = sin.n_adapters
    spec = SpecInputs(profiles, spread, bias) if any(c.speculative_mode != "off" for c in configs) else None
    return Statics(si, sf, sin.offsets, sin.entry, sin.lane_tenant, spec, sin.n_entries, sin.block_tokens, lora)


def _spec_inputs(trace, configs: Sequence[PolicyConfig], acceptance: spm.AcceptanceModel | None):
    """(profiles, rows, spread, bias) for the kernel: the acceptance model's side arrays,
    as wide as the longest draft among the configs (the default model when none is given)."""
    model = acceptance if acceptance is not None else spm.AcceptanceModel()
    gamma = max(c.num_speculative_tokens for c in configs)
    profiles, rows = model.arrays(trace, gamma)
    return profiles, rows, float(model.spread), float(model.bias)


def _side_params(trace, config: PolicyConfig, sharing: fm.SharingSpec | None):
    return fm.side_params(trace.tenant_names, trace.slo_class_names, sharing,
                          kv_quota=config.tenant_kv_quota, token_quota=config.tenant_token_quota)


def _result(trace, out_i, out_f, counts, fcounts, series, cached, service, prefix, weights) -> SimResult:
    if counts[C_ERROR] != 0:
        raise SimulationStalled(_stall_message(trace.n, counts, fcounts))
    leftover = (int(counts[C_USED_END]), int(counts[C_RESERVED_END]), int(counts[C_HOST_USED_END]))
    if leftover != (0, 0, 0):
        raise RuntimeError(f"engine leaked KV at the end (GPU, reserved, host blocks) = {leftover}")
    state = out_i[O_STATE].astype(np.int8)
    first_sched = out_f[O_FIRST_SCHED]
    m = int(counts[C_N_SAMPLES])
    return SimResult(
        state=state,
        reject_reason=out_i[O_REASON].astype(np.int8),
        first_token_s=out_f[O_FIRST_TOKEN].copy(),
        finish_s=out_f[O_FINISH].copy(),
        tokens_generated=out_i[O_GENERATED].copy(),
        preemptions=out_i[O_PREEMPTS].astype(np.int32),
        cached_prompt_tokens=cached.copy(),
        queue_s=first_sched - trace.arrival_s,
        replica=np.where(state == S_FINISHED, 0, -1).astype(np.int32),
        steps=int(counts[C_STEPS]),
        busy_s=float(fcounts[F_BUSY]),
        prefill_tokens_computed=int(counts[C_PREFILL_TOKENS]),
        out_of_range_steps=int(counts[C_OUT_OF_RANGE]),
        kv_capacity_blocks=int(counts[C_CAP]),
        kv_peak_blocks=int(counts[C_PEAK]),
        series_t=series[:m, 0].copy(),
        series_kv_blocks=series[:m, 1].astype(np.int64),
        series_running=series[:m, 2].astype(np.int64),
        series_waiting=series[:m, 3].astype(np.int64),
        swap_outs=int(counts[C_SWAP_OUTS]),
        end_s=float(fcounts[F_END]),
        tenant_service=service.copy(),
        tenant_weight=weights.copy(),
        prefix_hit_tokens=int(prefix[P_HIT_TOKENS]),
        prefix_query_tokens=int(prefix[P_QUERY_TOKENS]),
        prefill_time_saved_s=float(prefix[P_SAVED_S]),
        prefix_evictions=int(prefix[P_EVICTIONS]),
        spec_decodes=int(counts[C_SPEC_DECODES]),
        spec_verifies=int(counts[C_SPEC_VERIFIES]),
        spec_drafted_tokens=int(counts[C_SPEC_DRAFTED]),
        spec_accepted_tokens=int(counts[C_SPEC_ACCEPTED]),
        step_time_hist=counts[C_STEP_HIST:C_STEP_HIST + STEP_HIST_BINS].copy(),
        peak_step_tokens=int(counts[C_PEAK_STEP]),
        peak_step_s=float(fcounts[F_PEAK_STEP_S]),
        adapter_loads=int(counts[C_AD_LOADS]),
        adapter_disk_loads=int(counts[C_AD_DISK_LOADS]),
        adapter_load_s=float(fcounts[F_AD_LOAD_S]),
    )


def _stall_message(n: int, counts: np.ndarray, fcounts: np.ndarray) -> str:
    """Where a replica run alone stopped on an error: its clock, what it held, why."""
    running_, queued, ended = (int(counts[c]) for c in (C_RUNNING_END, C_WAITING_END, C_ENDED_END))
    return (f"simulation made no progress at t={fcounts[F_END]:.6g} s, replica 0, state: running {running_}, "
            f"queued {queued}, not yet admitted {n - running_ - queued - ended}, ended {ended}/{n}, "
            f"steps {int(counts[C_STEPS])} ({ERROR_WHY[int(counts[C_ERROR])]}; {int(counts[C_ITERATIONS])} "
            "iterations); please report this trace and config")


def progress_bound(budget: tuple[int, int] | None, units: int) -> np.ndarray:
    """A progress guard's (base, per) as the kernels take it: ``budget``, or by default
    ``default_progress_budget(units)``."""
    base, per = default_progress_budget(units) if budget is None else budget
    for name, value in (("base", base), ("per", per)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise ValueError(f"progress_budget {name} must be an integer >= 0, got {value!r}")
    return np.array([base, per], dtype=np.int64)


def _buffers(m: int, n: int, n_tenants: int):
    return (np.zeros((m, N_OI, n), dtype=np.int64), np.zeros((m, N_OF, n)),
            np.zeros((m, N_COUNTS), dtype=np.int64), np.zeros((m, N_FCOUNTS)),
            np.zeros((m, SERIES_CAPACITY, 4)), np.zeros((m, n), dtype=np.int64),
            np.zeros((m, n_tenants)), np.zeros((m, N_PREFIX)))


def _fast_forward_enabled() -> bool:
    # SERVETUNE_ENGINE_FAST_FORWARD=0 steps one by one (benchmarks compare the two).
    return os.environ.get("SERVETUNE_ENGINE_FAST_FORWARD", "1") != "0"


def simulate(trace, cost_model: CostModel, config: PolicyConfig, seed: int = 0, *,
             series_every_s: float | None = None, sharing: fm.SharingSpec | None = None,
             acceptance: spm.AcceptanceModel | None = None,
             progress_budget: tuple[int, int] | None = None) -> SimResult:
    """Replay ``trace`` through one replica running ``config``; deterministic for a seed.

    ``series_every_s`` is the spacing of the sampled KV/running/waiting series (default:
    about 500 samples over the arrival span); on very long runs it doubles as needed to
    stay within ``SERIES_CAPACITY`` samples. ``sharing`` gives per-tenant weights and
    quotas and per-class budgets by name (``policies.fairness.SharingSpec``); ``acceptance``
    is the drafter's acceptance profile when ``config.speculative_mode`` is not off
    (``policies.speculative.AcceptanceModel``; default: its default profile).
    ``progress_budget`` (base, per) bounds the engine loop's iterations by base + per *
    progress (default: ``default_progress_budget(trace.n)``); past it the run raises
    ``SimulationStalled`` instead of hanging.
    """
    cap, host = validate(trace, cost_model, config)
    budget = progress_bound(progress_budget, trace.n)
    every = default_series_every(trace) if series_every_s is None else float(series_every_s)
    if not every > 0:
        raise ValueError(f"series_every_s must be > 0, got {series_every_s}")
    tenant_params, class_params = _side_params(trace, config, sharing)
    bufs = _buffers(1, trace.n, len(tenant_params))
    simulate_kernel(statics(trace, cost_model, [config], acceptance), cost_model.tables, config.to_vector(), cap,
                    host, cost_model.kv_bytes_per_token, cost_model.swap_bytes_per_s, seed, every,
                    _fast_forward_enabled(), tenant_params, class_params, *(b[0] for b in bufs), budget)
    return _result(trace, *(b[0] for b in bufs), tenant_params[:, fm.T_WEIGHT])


def simulate_many(trace, cost_model: CostModel, configs: Sequence[PolicyConfig], seed: int = 0, *,
                  sharing: fm.SharingSpec | None = None, acceptance: spm.AcceptanceModel | None = None,
                  progress_budget: tuple[int, int] | None = None) -> list[SimResult]:
    """``simulate`` for each config, in parallel across cores; results in config order."""
    if not configs:
        return []
    budget = progress_bound(progress_budget, trace.n)
    limits = [validate(trace, cost_model, c) for c in configs]
    m = len(configs)
    cfgs = np.stack([c.to_vector() for c in configs])
    caps = np.array([cap for cap, _ in limits], dtype=np.int64)
    hosts = np.array([host for _, host in limits], dtype=np.int64)
    every = np.full(m, default_series_every(trace))
    side = [_side_params(trace, c, sharing) for c in configs]
    tenant_params = np.stack([t for t, _ in side])
    class_params = np.stack([c for _, c in side])
    bufs = _buffers(m, trace.n, tenant_params.shape[1])
    st, fast_forward = statics(trace, cost_model, configs, acceptance), _fast_forward_enabled()

    def replay(k: int) -> None:
        simulate_kernel(st, cost_model.tables, cfgs[k], caps[k], hosts[k], cost_model.kv_bytes_per_token,
                        cost_model.swap_bytes_per_s, seed, every[k], fast_forward, tenant_params[k], class_params[k],
                        *(b[k] for b in bufs), budget)

    in_parallel(replay, m)
    return [_result(trace, *(b[k] for b in bufs), tenant_params[k, :, fm.T_WEIGHT]) for k in range(m)]


def in_parallel(run: Callable[[int], None], m: int) -> None:
    """``run(k)`` for k < m on up to Numba's thread count of threads, for kernels that
    release the GIL (``nogil``): the same parallelism as a ``prange`` kernel over the
    configs, without compiling a second kernel around the first (about 20 s cold)."""
    workers = min(m, numba.get_num_threads())
    if workers <= 1:
        for k in range(m):
            run(k)
        return
    with ThreadPoolExecutor(workers) as pool:
        for _ in pool.map(run, range(m)):  # re-raises a replay's error here
            pass


def warmup(speculative: bool = True) -> None:
    """Compile (or load from cache) every kernel on a tiny trace, with every mode exercised,
    through the entry points a study calls, so a real run compiles nothing more.
    ``speculative=False``: only for runs where no config speculates (``Statics.spec``)."""
    trace, cost, configs = warmup_inputs()
    simulate(trace, cost, configs[0])
    simulate_many(trace, cost, configs if speculative else without_speculation(configs))


def without_speculation(configs: Sequence[PolicyConfig]) -> list[PolicyConfig]:
    """The configs that never speculate: a batch of them compiles without the planner."""
    return [c for c in configs if c.speculative_mode == "off"]


def warmup_inputs():
    """A tiny trace, a synthetic cost model and configs that exercise every mode, for
    warm-up (the fleet's too). The trace has the fields, dtypes and read-only columns of a
    loaded ``studies.traces.Trace``, so the kernels compile for exactly the types a real
    run passes (policies does not import studies)."""
    n = 8
    output = np.array([5, 1, 9, 4, 2, 7, 3, 6], dtype=np.int64)
    trace = _WarmupTrace(np.linspace(0.0, 0.05, n), np.array([40, 3, 70, 5, 33, 64, 9, 12], dtype=np.int64), output)
    cost = CostModel.synthetic(kv_capacity_tokens=256, swap_capacity_tokens=256)
    base = PolicyConfig(max_num_batched_tokens=64, max_num_seqs=4, gpu_memory_utilization=1.0)
    configs = [base, base.replace(schedule_mode="prefill_first", admission_mode="new_token_ratio"),
               base.replace(enable_prefix_caching=True, scheduling_policy="vtc", speculative_mode="dspark")]
    return trace, cost, configs


class _WarmupTrace:
    """The trace fields the engine reads, typed and frozen as ``studies.traces.Trace`` has them."""

    def __init__(self, arrival, prompt, output):
        n = self.n = len(arrival)
        columns = {"arrival_s": arrival, "prompt_tokens": prompt, "output_tokens": output, "max_tokens": output.copy(),
                   "output_estimate": output.copy(), "max_tokens_source": np.ones(n, dtype=np.int8),
                   "tenant": np.zeros(n, dtype=np.int32), "priority": np.zeros(n, dtype=np.int32),
                   "slo_class": np.zeros(n, dtype=np.int32), "deadline_s": np.full(n, np.nan),
                   "block_offsets": np.arange(n + 1, dtype=np.int64),  # one shared 32-token block each
                   "block_hashes": np.zeros(n, dtype=np.int64), "adapter": np.zeros(n, dtype=np.int32)}
        for name, values in columns.items():
            values = np.ascontiguousarray(values)
            values.flags.writeable = False
            setattr(self, name, values)
        self.block_tokens = 32
        self.tenant_names = ("default",)
        self.slo_class_names = ("default",)
        self.adapter_names = ("",)  # the base model only
        self.has_adapters = False
        self.cache_block_hashes = np.array(self.block_hashes)
