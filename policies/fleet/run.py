"""The Python side of a fleet run: ``simulate_fleet`` and ``simulate_fleet_many`` (inputs
checked, the kernel's arguments and buffers built, configs run in parallel, a ``SimResult``
per config), ``warmup``, and the message of a stalled run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from costmodels.costmodel import CostModel
from policies import engine
from policies import fairness as fm
from policies import routing as rt
from policies import speculative as spm
from policies.config import PolicyConfig, check_fleet
from policies.engine import N_OF, N_OI, N_PREFIX, P_HIT_TOKENS, P_QUERY_TOKENS, SimulationStalled
from policies.failures import FailureSchedule
from policies.fleet.lists import typed_list
from policies.fleet.loop import fleet_kernel
from policies.fleet.state import (
    ERROR_ENGINE,
    ERROR_IN_FLIGHT,
    ERROR_NO_PROGRESS,
    ERROR_UNENDED,
    FL_ERROR,
    FL_HANDOFFS,
    FL_MIGRATIONS,
    N_FLEET,
    N_RQ,
    N_STALL,
    RQ_ENDED_ON,
    RQ_REPREFILL,
    RQ_REROUTES,
    S_FINISHED,
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
    FleetBuffers,
)
from policies.kernel_state import (
    C_CAP,
    C_ERROR,
    C_N_SAMPLES,
    C_PEAK,
    C_PEAK_STEP,
    F_AD_LOAD_S,
    F_BUSY,
    F_END,
    F_PEAK_STEP_S,
    N_COUNTS,
    N_FCOUNTS,
    SERIES_CAPACITY,
)
from policies.result import SimResult


def warmup(speculative: bool = True) -> None:
    """Compile (or load from cache) the fleet kernels on the engine's warm-up trace, two
    replicas, with migration, P/D and a failure exercised; ``speculative`` as in
    ``engine.warmup``."""
    trace, cost, configs = engine.warmup_inputs()
    fleets = [c.replace(router="least_kv", migration=True) for c in configs]
    fleets[1] = fleets[1].replace(prefill_replicas=1)
    simulate_fleet(trace, cost, fleets[0], replicas=2, failures=FailureSchedule.from_rows([(1, 0.01, 0.02)]))
    simulate_fleet_many(trace, cost, fleets if speculative else engine.without_speculation(fleets), replicas=2)


def simulate_fleet(trace, cost_models, config: PolicyConfig, seed: int = 0, *, replicas: int | None = None,
                   failures: FailureSchedule | None = None, acceptance: spm.AcceptanceModel | None = None,
                   sharing: fm.SharingSpec | None = None, progress_budget: tuple[int, int] | None = None,
                   lockstep: int = 1) -> SimResult:
    """Replay ``trace`` through a fleet of replicas running ``config``; deterministic for a seed.

    ``cost_models`` is one CostModel (every replica alike) or one per replica (their GPU,
    TP or model may differ); ``replicas`` is the fleet's size (default: the list's length,
    or 1). ``failures`` is a ``FailureSchedule`` of replica downtimes. ``acceptance`` and
    ``sharing`` as in ``engine.simulate``. Per-request fields cover the whole fleet
    (``replica``: where a finished request ended); counters are summed over replicas, the
    KV peak is the sum of each replica's peak, the series sums the replicas' samples, the
    step-time histogram sums every replica's (each incarnation's added in ``_retire``); the
    fleet fields (``reroutes`` ... ``replica_*``, ``migrations``, ``handoffs``) are filled.
    ``progress_budget`` (base, per) bounds the event loop's iterations by base + per *
    progress (default: ``engine.default_progress_budget`` of requests + failure events +
    replicas; each replica's engine keeps its own default guard); past it the run raises
    ``SimulationStalled`` instead of hanging. ``lockstep`` > 1: every ``lockstep``
    consecutive replicas are the attention-DP ranks of one instance and step together
    (``policies.engine.lockstep``); a failure window must then stop all of an instance's
    ranks (``FailureSchedule.per_rank``), and P/D is refused.
    """
    return simulate_fleet_many(trace, cost_models, [config], seed, replicas=replicas, failures=failures,
                               acceptance=acceptance, sharing=sharing, progress_budget=progress_budget,
                               lockstep=lockstep)[0]


def simulate_fleet_many(trace, cost_models, configs: Sequence[PolicyConfig], seed: int = 0, *,
                        replicas: int | None = None, failures: FailureSchedule | None = None,
                        acceptance: spm.AcceptanceModel | None = None, sharing: fm.SharingSpec | None = None,
                        progress_budget: tuple[int, int] | None = None, lockstep: int = 1) -> list[SimResult]:
    """``simulate_fleet`` for each config (each its own fleet), in parallel across cores;
    results in config order."""
    if not configs:
        return []
    costs = _replica_costs(cost_models, replicas)
    n_rep = len(costs)
    for config in configs:
        check_fleet(config, n_rep, lockstep)
    schedule = failures if failures is not None else FailureSchedule.empty()
    if not isinstance(schedule, FailureSchedule):
        raise TypeError(f"failures must be a policies.failures.FailureSchedule or None, got {type(failures).__name__}")
    schedule.check_replicas(n_rep)
    schedule.check_lockstep(lockstep)
    limits = [[engine.validate(trace, cost, config) for cost in costs] for config in configs]
    by_model: dict[int, engine.Statics] = {}
    for cost in costs:
        if id(cost) not in by_model:
            by_model[id(cost)] = engine.statics(trace, cost, configs, acceptance)
    n_entries = by_model[id(costs[0])].n_entries
    # built by cached kernels: typed.List's own methods would compile on each process's first run
    statics = typed_list([by_model[id(cost)] for cost in costs])
    tables = typed_list([cost.tables for cost in costs])
    kv_bytes = np.array([cost.kv_bytes_per_token for cost in costs], dtype=np.float64)
    swap_bw = np.array([cost.swap_bytes_per_s for cost in costs], dtype=np.float64)
    fail_t, fail_replica, fail_up = schedule.events()
    incarnations = n_rep + int(fail_up.sum())
    side = [engine.fairness_params(trace, config, sharing) for config in configs]
    n_tenants = len(side[0][0])
    cfgs = np.stack([config.to_vector() for config in configs])
    caps = np.array([[cap for cap, _ in row] for row in limits], dtype=np.int64)
    hosts = np.array([[host for _, host in row] for row in limits], dtype=np.int64)
    routers = [rt.new_router_state(n_rep, n_entries, config.hash_virtual_nodes) for config in configs]
    outs = [_buffers(trace.n, n_rep, n_tenants, incarnations) for _ in configs]
    # the identity-salted hashes, a fresh writable array (as engine.statics copies the offsets):
    # one kernel type whether the trace's columns are read-only (a loaded Trace) or not
    args = (statics, tables, trace.cache_block_hashes, kv_bytes, swap_bw,
            fail_t.astype(np.float64), fail_replica.astype(np.int64), fail_up.astype(np.bool_))
    every = engine.default_series_every(trace)
    fast_forward = engine.fast_forward_enabled() and lockstep == 1
    budget = engine.progress_bound(progress_budget, trace.n + len(fail_t) + n_rep)

    def replay(k: int) -> None:
        fleet_kernel(*args, cfgs[k], caps[k], hosts[k], seed, every, fast_forward, lockstep, side[k][0], side[k][1],
                     routers[k], outs[k], budget)

    engine.in_parallel(replay, len(configs))
    return [_fleet_result(trace, out, side[k][0][:, fm.T_WEIGHT], schedule) for k, out in enumerate(outs)]


def _replica_costs(cost_models, replicas: int | None) -> list[CostModel]:
    """One CostModel per replica, checked against ``replicas``."""
    if isinstance(cost_models, CostModel):
        count = 1 if replicas is None else replicas
        costs = [cost_models] * count if isinstance(count, int | np.integer) and count >= 1 else []
    else:
        costs = list(cost_models)
        bad = [k for k, cost in enumerate(costs) if not isinstance(cost, CostModel)]
        if bad:
            raise TypeError(f"cost_models[{bad[0]}] is a {type(costs[bad[0]]).__name__}, not a CostModel")
        if replicas is not None and replicas != len(costs):
            raise ValueError(f"replicas={replicas} but {len(costs)} cost models were given; give one per replica "
                             "or a single CostModel")
    if not costs:
        raise ValueError(f"a fleet needs at least one replica, got replicas={replicas!r} and "
                         f"{0 if isinstance(cost_models, CostModel) else len(cost_models)} cost models")
    return costs


def _buffers(n: int, n_rep: int, n_tenants: int, incarnations: int) -> FleetBuffers:
    return FleetBuffers(
        out_i=np.zeros((N_OI, n), dtype=np.int64), out_f=np.full((N_OF, n), np.nan), cached=np.zeros(n, dtype=np.int64),
        requests=np.zeros((N_RQ, n), dtype=np.int64), counts=np.zeros((n_rep, N_COUNTS), dtype=np.int64),
        fcounts=np.zeros((n_rep, N_FCOUNTS)), prefix=np.zeros((n_rep, N_PREFIX)),
        service=np.zeros((n_rep, n_tenants)), routed=np.zeros(n_rep, dtype=np.int64),
        series=np.zeros((incarnations, SERIES_CAPACITY, 4)), incarnations=np.full((incarnations, 2), -1, np.int64),
        ends=np.full(incarnations, np.nan), fleet=np.zeros(N_FLEET, dtype=np.int64), stall=np.full(N_STALL, np.nan),
    )


def _fleet_result(trace, out: FleetBuffers, weights: np.ndarray, schedule: FailureSchedule) -> SimResult:
    error = int(out.fleet[FL_ERROR])
    if error in (ERROR_NO_PROGRESS, ERROR_ENGINE):
        raise SimulationStalled(_stall_message(error, out.stall, trace.n, len(schedule)))
    if error:
        what = {ERROR_UNENDED: "a request never ended", ERROR_IN_FLIGHT: "a hand-off was left in flight"}[error]
        raise RuntimeError(f"fleet kernel: {what}; please report this trace and config")
    counts = out.counts.sum(axis=0)
    counts[C_ERROR] = out.counts[:, C_ERROR].max()
    counts[C_PEAK_STEP] = out.counts[:, C_PEAK_STEP].max()
    at_peak = out.counts[:, C_PEAK_STEP] == counts[C_PEAK_STEP]
    fcounts = np.zeros(N_FCOUNTS)
    fcounts[F_BUSY], fcounts[F_END] = out.fcounts[:, F_BUSY].sum(), out.fcounts[:, F_END].max()
    fcounts[F_PEAK_STEP_S] = out.fcounts[at_peak, F_PEAK_STEP_S].min() if counts[C_PEAK_STEP] > 0 else np.nan
    fcounts[F_AD_LOAD_S] = out.fcounts[:, F_AD_LOAD_S].sum()
    series = _merged_series(out)
    counts[C_N_SAMPLES] = len(series)
    result = engine.sim_result(trace, out.out_i, out.out_f, counts, fcounts, series, out.cached, out.service.sum(axis=0),
                            out.prefix.sum(axis=0), weights)
    return dataclasses.replace(
        result,
        replica=np.where(result.state == S_FINISHED, out.requests[RQ_ENDED_ON], -1).astype(np.int32),
        reroutes=out.requests[RQ_REROUTES].astype(np.int32),
        reprefill_tokens=out.requests[RQ_REPREFILL].copy(),
        failure_replica=schedule.replica.astype(np.int32),
        failure_down_s=schedule.t_down.copy(),
        failure_up_s=schedule.t_up.copy(),
        replica_routed=out.routed.copy(),
        replica_prefix_hit_tokens=out.prefix[:, P_HIT_TOKENS].astype(np.int64),
        replica_prefix_query_tokens=out.prefix[:, P_QUERY_TOKENS].astype(np.int64),
        replica_kv_peak_blocks=out.counts[:, C_PEAK].copy(),
        replica_kv_capacity_blocks=out.counts[:, C_CAP].copy(),
        migrations=int(out.fleet[FL_MIGRATIONS]),
        handoffs=int(out.fleet[FL_HANDOFFS]),
    )


def _stall_message(error: int, stall: np.ndarray, n: int, n_windows: int) -> str:
    s = stall
    j = int(s[ST_REPLICA])
    why = (f"replica {j}'s engine: {engine.ERROR_WHY[int(s[ST_ENGINE_ERROR])]}" if error == ERROR_ENGINE
           else f"the event loop passed its bound of iterations ({int(s[ST_ITERATIONS])})")
    state = (f"fleet queue {int(s[ST_Q_LEN])}, in flight {int(s[ST_N_FLIGHT])}, arrivals {int(s[ST_ARRIVALS])}/{n}, "
             f"failure events {int(s[ST_FAILURES])} (of {n_windows} windows)")
    if not math.isnan(s[ST_CLOCK]):
        state += (f"; replica clock {s[ST_CLOCK]:.6g} s, running {int(s[ST_RUNNING])}, waiting {int(s[ST_WAITING])}, "
                  f"outstanding {int(s[ST_OUTSTANDING])}")
    return (f"simulation made no progress at t={s[ST_T]:.6g} s, replica {j if j >= 0 else 'none'}, state: {state} "
            f"({why}); please report this trace, config and failure schedule")


def _merged_series(out: FleetBuffers) -> np.ndarray:
    """The fleet's series: at every sample time of any incarnation, the sum over
    incarnations of each one's latest sample (none before its first, none once it stopped)."""
    used = [k for k in range(len(out.incarnations)) if out.incarnations[k, 0] >= 0]
    parts = [out.series[k, :out.incarnations[k, 1]] for k in used]
    times = np.unique(np.concatenate([part[:, 0] for part in parts]))
    merged = np.zeros((len(times), 4))
    merged[:, 0] = times
    for k, part in zip(used, parts, strict=True):
        latest = np.searchsorted(part[:, 0], times, side="right") - 1
        live = (latest >= 0) & (times < out.ends[k])
        merged[:, 1:] += np.where(live[:, None], part[np.maximum(latest, 0), 1:], 0.0) if len(part) else 0.0
    return merged
