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
* Batch waiting (TensorRT-LLM, ``batch_wait_iters`` and ``batch_wait_token_ratio`` both
  set): when running requests took tokens, waiting requests start only if those tokens
  plus the waiting ones' left to compute (at most the budget left) reach the ratio of the
  budget, or they have been held ``batch_wait_iters`` steps; each hold counts one, a start
  restarts the count.
* Attention-DP balancing (TensorRT-LLM, ``dp_balance_timeout_iters`` > 0; ranks stepping
  together only, ``policies.engine.lockstep``): no rank starts waiting requests while
  some rank has none, for at most that many steps, nor, while every rank runs requests,
  before ``dp_balance_batching_iters`` steps with a prompt on every rank.
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
* Async scheduling (``async_scheduling``: vLLM's async loop, SGLang's overlap schedule;
  ``policies.engine.pipeline``): a step is formed as the one before it starts, so it sees
  the arrivals due by that start, and a request whose last token that step samples stays
  on the running list with its seat and KV (a victim like any other) until the next step
  is formed; it decodes once more, in vain, if it stopped short of ``max_out`` (EOS). A
  formation that comes up empty while a step ran is redone at once with everything seen.
  Under ``prefill_first`` (SGLang) a retracted request's token in flight is discarded,
  admission and the retraction order count outputs without it, and a decode short of KV
  while length-finishers linger waits for their KV.

Sharing (issue 6; state in ``Replica.pc``/``wq``/``sh``, rules in
``policies.prefix_cache``, ``policies.queues`` and ``policies.fairness``):

* Prefix caching (``enable_prefix_caching``): a request new to the GPU (or recomputed)
  takes references on the leading cached units of its prompt and starts computing after
  them (at most ``prompt - 1`` tokens are skipped); the attention over the cached context
  is still paid. The full units a step computes become shared: whole prompt hash blocks
  (SGLang), or each 16-token KV block of them (vLLM's rules, ``VLLM_CACHE``: not
  ``prefill_first``; ``policies.prefix_cache`` keeps a hash block one node while its blocks
  agree). ``free`` counts idle cached units as available (as vLLM's free queue); they are
  evicted LRU, a KV block at a time, only when an allocation needs their blocks. Any end or
  preemption drops a request's references; a request holding some is recomputed, never
  swapped. By vLLM's rules a block is cached when the step that computes it is formed, so
  a request started later in that step, or while its computer is still at the hash block,
  hits it; a lookup hits at most ``(tokens - 1) // block_size`` blocks; a block a request
  computes while another holds it stays its own copy until it lets go; and a request
  letting go leaves the full blocks it computed past its prefix cached (its own run),
  where its readmission finds them, generated tokens included.
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
nothing waits (``_fast_forward_chunk``: one step-time lookup per step). Under async
scheduling a stretch may start with the step formed beside requests that stopped on EOS:
their thrown-away decode rides its first step (``pipeline._ghosts_change_nothing``). The
result is bit-identical to stepping one by one.

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
  starting at t; ``advance_group(nodes, first, count, cfg, t_limit, through)``: the ranks
  of one attention-DP instance advanced in lockstep (``policies.engine.lockstep``: every
  step as long as the slowest rank's); ``head_request``, ``newest_running``, ``capacity_blocks``, ``max_len``.

Progress guard: ``advance``'s loop counts its iterations over every call and, once they
pass base + per * progress (``_progress``: steps, deliveries taken, requests ended,
calls; (base, per) by default ``default_progress_budget(n)``, ``bound_progress`` sets
it), stops the replica with ``ERROR_NO_PROGRESS``. A replica in error runs no more; the
Python side raises ``SimulationStalled`` naming the time and the replica's state.

``simulate_kernel`` is new_replica, deliver every request, ``advance(inf)``,
``write_outputs``. Kernels compile without Numba's reference counting (``_nrt=False``;
those that allocate, e.g. ``new_replica``, say ``_nrt=True``): every array a step touches
is owned by the caller for the whole call, and with counting on, Numba wraps each array a
kernel or inlined helper takes in calls to its (non-inlinable) incref and decref, inside
the hot loops too, which took more than half of a replay (``benchmarks/engine_speed.py``).
Such a kernel cannot allocate or return an array (Numba refuses to compile it), and callees
inherit the setting unless they state it, so every kernel here states it
(``tests/policies/test_kernel_refcounts.py``). Kernels with counting on (the fleet's)
pass *borrowed* views (``borrowed``), which carry no reference count.

Modules, in the order a step meets them: ``codes`` (the constants the kernels compile
with), ``state`` (``Statics``, ``Replica``, borrowed views, small helpers), ``events``,
``batch``, ``pipeline`` (async scheduling), ``preemption``, ``admission``, ``formation`` (one step's batch), ``verify``
(speculative budgets), ``step_end``, ``fast_forward``, ``replica`` (the resumable loop),
``lockstep`` (attention-DP ranks on one clock), ``summary`` (the router's view), ``moves`` (the fleet's hand-overs), ``capacity``, ``run``
(``simulate``, ``simulate_many``) and ``warmup``. This package re-exports the interface
the rest of servetune uses.
"""

from policies.engine.capacity import (
    validate,
)
from policies.engine.codes import (
    ERROR_NO_PROGRESS,
    ERROR_NOT_HELD,
    ERROR_STALLED,
    ERROR_WHY,
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
)
from policies.engine.lockstep import advance_group
from policies.engine.moves import (
    carry,
    clear_handed_off,
    deliver_carried,
    hand_off_after_first_token,
    handed_off,
    new_carried,
    withdraw,
)
from policies.engine.pipeline import drain_pipeline
from policies.engine.replica import (
    advance,
    advance_through,
    default_progress_budget,
    deliver,
    new_replica,
    write_outputs,
)
from policies.engine.run import (
    default_series_every,
    fairness_params,
    fast_forward_enabled,
    in_parallel,
    output_buffers,
    progress_bound,
    sim_result,
    simulate,
    simulate_kernel,
    simulate_many,
    statics,
)
from policies.engine.state import (
    Replica,
    SpecInputs,
    Statics,
    borrow_replica,
    borrow_statics,
    borrow_tables,
    borrowed,
)
from policies.engine.summary import (
    adapter_load_s,
    cached_tokens,
    capacity_blocks,
    clock,
    free_blocks,
    head_demand_blocks,
    head_request,
    headroom_blocks,
    max_len,
    never_admits,
    newest_running,
    outstanding,
    queued_tokens,
    running,
    stays_unqueued,
    waiting,
    waiting_tokens,
)
from policies.engine.warmup import (
    warmup,
    warmup_inputs,
    without_speculation,
)

__all__ = [
    "ERROR_NOT_HELD",
    "ERROR_NO_PROGRESS",
    "ERROR_STALLED",
    "ERROR_WHY",
    "K_CACHED_FIRST",
    "K_COMPUTED",
    "K_FIRST_SCHED",
    "K_FIRST_TOKEN",
    "K_GENERATED",
    "K_PREEMPTS",
    "N_OF",
    "N_OI",
    "N_PREFIX",
    "O_FINISH",
    "O_FIRST_SCHED",
    "O_FIRST_TOKEN",
    "O_GENERATED",
    "O_PREEMPTS",
    "O_REASON",
    "O_STATE",
    "P_HIT_TOKENS",
    "P_QUERY_TOKENS",
    "Replica",
    "SimulationStalled",
    "SpecInputs",
    "Statics",
    "adapter_load_s",
    "advance",
    "advance_group",
    "advance_through",
    "borrow_replica",
    "borrow_statics",
    "borrow_tables",
    "borrowed",
    "cached_tokens",
    "capacity_blocks",
    "carry",
    "clear_handed_off",
    "clock",
    "default_progress_budget",
    "default_series_every",
    "deliver",
    "deliver_carried",
    "drain_pipeline",
    "fairness_params",
    "fast_forward_enabled",
    "free_blocks",
    "hand_off_after_first_token",
    "handed_off",
    "head_demand_blocks",
    "head_request",
    "headroom_blocks",
    "in_parallel",
    "max_len",
    "never_admits",
    "new_carried",
    "new_replica",
    "newest_running",
    "output_buffers",
    "outstanding",
    "progress_bound",
    "queued_tokens",
    "running",
    "sim_result",
    "simulate",
    "simulate_kernel",
    "simulate_many",
    "statics",
    "stays_unqueued",
    "validate",
    "waiting",
    "waiting_tokens",
    "warmup",
    "warmup_inputs",
    "withdraw",
    "without_speculation",
    "write_outputs",
]
