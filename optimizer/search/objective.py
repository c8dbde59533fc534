"""What a trial is worth: objective values and feasibility constraints from its Report.

Objective modes (``StudySpec.objective``):

- ``goodput``: maximise weighted goodput (sum of SLO-class weights of good requests per s);
- ``goodput-gpus``: that, and minimise GPUs (replicas x TP, both searched: see
  ``optimizer.search.space``);
- ``goodput-ttft``: that, and minimise p99 TTFT;
- ``goodput-cost``: that, and minimise $ per million good output tokens
  (GPUs x $/GPU-hour / good output tokens per hour);
- ``capacity``: maximise the highest arrival rate at which SLO attainment stays at or above
  the target (DistServe's capacity goodput; see ``optimizer.search.capacity``).

Constraints go through ``trial.set_constraint`` (<= 0 is feasible), so samplers steer
away from infeasible regions and ``study.best_trials`` returns feasible trials only:
rejected fraction (by default capped at the least-rejecting baseline's plus a small
slack, see ``Constraints``), p99 TTFT (by default a multiple of the loosest TTFT SLO or
the best baseline's tail, whichever is larger: ``bounds``), optional p99 TPOT/E2E
bounds and preemption rate.

Every trial stores ``config`` (the full PolicyConfig), ``report`` (``Report.to_dict()``),
its fleet (``tp``, ``replicas``) and ``gpus`` in its user_attrs; baselines also carry
``baseline`` (the preset name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from optimizer.search.space import Fleet
from optimizer.search.spec import Constraints, StudySpec
from policies.config import PolicyConfig


@dataclass(frozen=True)
class Objective:
    mode: str
    metrics: tuple[str, ...]
    directions: tuple[str, ...]

    @property
    def multi(self) -> bool:
        return len(self.metrics) > 1


OBJECTIVES = {
    "goodput": Objective("goodput", ("weighted_goodput",), ("maximize",)),
    "goodput-gpus": Objective("goodput-gpus", ("weighted_goodput", "gpus"), ("maximize", "minimize")),
    "goodput-ttft": Objective("goodput-ttft", ("weighted_goodput", "p99_ttft_ms"), ("maximize", "minimize")),
    "goodput-cost": Objective("goodput-cost", ("weighted_goodput", "usd_per_mtok"), ("maximize", "minimize")),
    "capacity": Objective("capacity", ("capacity_rps",), ("maximize",)),
}


def objective_for(spec: StudySpec) -> Objective:
    return OBJECTIVES[spec.objective]


def usd_per_million_tokens(token_goodput: float, gpus: int, usd_per_gpu_hour: float) -> float:
    """$ per million good output tokens; inf when nothing good comes out."""
    if not token_goodput > 0:
        return math.inf
    return gpus * usd_per_gpu_hour / 3600.0 / token_goodput * 1e6


def metric_values(report, spec: StudySpec, gpus: int, capacity_rps: float | None = None) -> dict[str, float]:
    """Every metric an objective mode can ask for, NaN mapped to the worst value."""
    p99_ttft = report.p99_ttft_ms
    return {
        "weighted_goodput": float(report.weighted_goodput),
        "gpus": float(gpus),
        "p99_ttft_ms": math.inf if p99_ttft is None or math.isnan(p99_ttft) else float(p99_ttft),
        "usd_per_mtok": usd_per_million_tokens(report.token_goodput, gpus, spec.usd_per_gpu_hour),
        "capacity_rps": float(capacity_rps) if capacity_rps is not None else math.nan,
    }


@dataclass(frozen=True)
class Bounds:
    """A study's resolved bounds: the rejected fraction and the p99 TTFT (None: unbounded)
    every trial must keep, fixed once from the baselines (``bounds``)."""

    rejected_fraction: float
    p99_ttft_ms: float | None = None

    def to_dict(self) -> dict[str, float | None]:
        return {"rejected_fraction": self.rejected_fraction, "p99_ttft_ms": self.p99_ttft_ms}


def bounds(constraints: Constraints, slos, baseline_reports) -> Bounds:
    """The study's bounds from its constraints, its SLOs and the baselines' reports.

    Rejected fraction: absolute if set, else the least-rejecting baseline's plus the slack.
    p99 TTFT: absolute if set, else ``ttft_tail_factor`` times the larger of the loosest
    TTFT SLO and the best baseline's p99 TTFT, so that no recommendation buys goodput by
    starving a tail of requests (a request given up on costs goodput nothing) far past
    both what the SLOs ask and what the defaults deliver.
    """
    reports = list(baseline_reports)
    if constraints.max_rejected_fraction is not None:
        rejected = constraints.max_rejected_fraction
    else:
        fractions = [_fraction(r.rejected_fraction) for r in reports]
        rejected = min(1.0, min(fractions, default=0.0) + constraints.rejected_slack)
    return Bounds(rejected, _ttft_bound(constraints, slos, reports))


def _ttft_bound(constraints: Constraints, slos, reports) -> float | None:
    if constraints.p99_ttft_ms is not None:
        return constraints.p99_ttft_ms
    if not constraints.ttft_tail_factor:
        return None
    tails = [float(r.p99_ttft_ms) for r in reports if not _missing(r.p99_ttft_ms)]
    loosest = max((c.ttft_ms for c in slos.classes if c.ttft_ms is not None), default=None)
    floors = [v for v in (min(tails, default=None), loosest) if v is not None]
    return constraints.ttft_tail_factor * max(floors) if floors else None


def constraint_values(report, constraints: Constraints, limits: Bounds) -> dict[str, float]:
    """Constraint name -> value (<= 0 feasible); a missing latency counts as violated."""
    values = {"rejected_fraction": _fraction(report.rejected_fraction) - limits.rejected_fraction}
    for metric in ("ttft", "tpot", "e2el"):
        bound = limits.p99_ttft_ms if metric == "ttft" else getattr(constraints, f"p99_{metric}_ms")
        if bound is not None:
            measured = getattr(report, f"p99_{metric}_ms")
            values[f"p99_{metric}_ms"] = math.inf if _missing(measured) else measured - bound
    if constraints.max_preemption_rate is not None:
        rate = report.preemption_rate
        values["preemption_rate"] = (0.0 if _missing(rate) else rate) - constraints.max_preemption_rate
    return values


def record(trial, spec: StudySpec, config: PolicyConfig, report, limits: Bounds, *,
           fleet: Fleet | None = None, capacity=None) -> list[float]:
    """Store the trial's evidence and constraints; return its objective values.

    ``fleet`` is where the trial ran (the spec's when None).
    """
    objective = objective_for(spec)
    fleet = fleet or spec.fleet
    gpus = fleet.gpus
    trial.set_user_attr("config", config.to_dict())
    trial.set_user_attr("report", report.to_dict())
    for name, value in fleet.to_dict().items():
        trial.set_user_attr(name, value)
    trial.set_user_attr("gpus", gpus)
    capacity_rps = None
    if capacity is not None:
        trial.set_user_attr("capacity", capacity.to_dict())
        capacity_rps = capacity.rps
    for name, value in constraint_values(report, spec.constraints, limits).items():
        trial.set_constraint(name, value)
    metrics = metric_values(report, spec, gpus, capacity_rps)
    return [metrics[m] for m in objective.metrics]


def is_feasible(frozen_trial) -> bool:
    """Every constraint met; a trial with none recorded (pruned, failed) is not feasible."""
    constraints = frozen_trial.constraints
    return bool(constraints) and all(v <= 0 for v in constraints.values())


def _fraction(value) -> float:
    return 0.0 if _missing(value) else float(value)


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))
