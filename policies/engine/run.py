"""The Python side of a replay: ``statics`` from a trace and a cost model, ``simulate`` (one
config) and ``simulate_many`` (configs on threads), the kernel they call and the
``SimResult`` they build from its buffers.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numba
import numpy as np
from numba import njit

from costmodels.costmodel import CostModel
from policies import fairness as fm
from policies import prefix_cache as pcm
from policies import queues as qm
from policies import speculative as spm
from policies.config import PolicyConfig
from policies.engine.capacity import validate
from policies.engine.codes import (
    ERROR_WHY,
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
    P_EVICTIONS,
    P_HIT_TOKENS,
    P_QUERY_TOKENS,
    P_SAVED_S,
    S_FINISHED,
    SimulationStalled,
)
from policies.engine.replica import (
    advance,
    bound_progress,
    default_progress_budget,
    deliver,
    new_replica,
    write_outputs,
)
from policies.engine.state import SpecInputs, Statics
from policies.kernel_state import (
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
    F_AD_LOAD_S,
    F_BUSY,
    F_END,
    F_PEAK_STEP_S,
    LORA_ADAPTERS,
    LORA_BYTES_PER_RANK,
    LORA_DISK_BW,
    N_COUNTS,
    N_FCOUNTS,
    N_SF,
    N_SI,
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
    SERIES_CAPACITY,
)
from policies.result import STEP_HIST_BINS, SimResult


@njit(cache=True, nogil=True, _nrt=True)
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
    for r in range(arrival.shape[0]):
        deliver(rep, r, arrival[r])
    advance(rep, st, tables, cfg, np.inf)
    write_outputs(rep, out_i, out_f, out_counts, out_fcounts, series, out_cached, out_service, out_prefix)


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


def fairness_params(trace, config: PolicyConfig, sharing: fm.SharingSpec | None):
    """(tenant_params, class_params) of ``config``'s sharing rules for the kernels
    (``policies.fairness.side_params``)."""
    return fm.side_params(trace.tenant_names, trace.slo_class_names, sharing,
                          kv_quota=config.tenant_kv_quota, token_quota=config.tenant_token_quota)


def sim_result(trace, out_i, out_f, counts, fcounts, series, cached, service, prefix, weights) -> SimResult:
    """The ``SimResult`` of one replay's output buffers (``write_outputs``); a kernel error
    raises ``SimulationStalled``, KV still held at the end a RuntimeError."""
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


def output_buffers(m: int, n: int, n_tenants: int):
    """Zeroed output buffers of m replays of n requests, in ``write_outputs``' order."""
    return (np.zeros((m, N_OI, n), dtype=np.int64), np.zeros((m, N_OF, n)),
            np.zeros((m, N_COUNTS), dtype=np.int64), np.zeros((m, N_FCOUNTS)),
            np.zeros((m, SERIES_CAPACITY, 4)), np.zeros((m, n), dtype=np.int64),
            np.zeros((m, n_tenants)), np.zeros((m, N_PREFIX)))


def fast_forward_enabled() -> bool:
    """Whether replicas fast-forward stretches: SERVETUNE_ENGINE_FAST_FORWARD=0 steps one
    by one (benchmarks compare the two)."""
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
    tenant_params, class_params = fairness_params(trace, config, sharing)
    bufs = output_buffers(1, trace.n, len(tenant_params))
    simulate_kernel(statics(trace, cost_model, [config], acceptance), cost_model.tables, config.to_vector(), cap,
                    host, cost_model.kv_bytes_per_token, cost_model.swap_bytes_per_s, seed, every,
                    fast_forward_enabled(), tenant_params, class_params, *(b[0] for b in bufs), budget)
    return sim_result(trace, *(b[0] for b in bufs), tenant_params[:, fm.T_WEIGHT])


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
    side = [fairness_params(trace, c, sharing) for c in configs]
    tenant_params = np.stack([t for t, _ in side])
    class_params = np.stack([c for _, c in side])
    bufs = output_buffers(m, trace.n, tenant_params.shape[1])
    st, fast_forward = statics(trace, cost_model, configs, acceptance), fast_forward_enabled()

    def replay(k: int) -> None:
        simulate_kernel(st, cost_model.tables, cfgs[k], caps[k], hosts[k], cost_model.kv_bytes_per_token,
                        cost_model.swap_bytes_per_s, seed, every[k], fast_forward, tenant_params[k], class_params[k],
                        *(b[k] for b in bufs), budget)

    in_parallel(replay, m)
    return [sim_result(trace, *(b[k] for b in bufs), tenant_params[k, :, fm.T_WEIGHT]) for k in range(m)]


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
