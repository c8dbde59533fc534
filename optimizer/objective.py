"""What a trial is worth: objective values and feasibility constraints from its Report.

Objective modes (``StudySpec.objective``):

- ``goodput``: maximise weighted goodput (sum of SLO-class weights of good requests per s);
- ``goodput-gpus``: that, and minimise GPUs (replicas x TP, both searched: see
  ``optimizer.space``);
- ``goodput-ttft``: that, and minimise p99 TTFT;
- ``goodput-cost``: that, and minimise $ per million good output tokens
  (GPUs x $/GPU-hour / good output tokens per hour);
- ``capacity``: maximise the highest arrival rate at which SLO attainment stays at or above
  the target (DistServe's capacity goodput; see ``optimizer.capacity``).

Constraints go through ``trial.set_constraint`` (<= 0 is feasible), so samplers steer
away from infeasible regions and ``study.best_trials`` returns feasible trials only:
rejected fraction (by default capped at the least-rejecting baseline's plus a small
slack, see ``Constraints``), optional p99 TTFT/TPOT/E2E bounds and preemption rate.

Every trial stores ``config`` (the full PolicyConfig), ``report`` (``Report.to_dict()``),
its fleet (``tp``, ``replicas``) and ``gpus`` in its user_attrs; baselines also carry
``baseline`` (the preset name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from optimizer.space import Fleet
from optimizer.spec import Constraints, StudySpec
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


def rejected_cap(constraints: Constraints, baseline_reports) -> float:
    """The rejected-fraction bound: absolute if set, else least-rejecting baseline + slack."""
    if constraints.max_rejected_fraction is not None:
        return constraints.max_rejected_fraction
    fractions = [_fraction(r.rejected_fraction) for r in baseline_reports]
    return min(1.0, min(fractions, default=0.0) + constraints.rejected_slack)


def constraint_values(report, constraints: Constraints, cap: float) -> dict[str, float]:
    """Constraint name -> value (<= 0 feasible); a missing latency counts as violated."""
    values = {"rejected_fraction": _fraction(report.rejected_fraction) - cap}
    for metric in ("ttft", "tpot", "e2el"):
        bound = getattr(constraints, f"p99_{metric}_ms")
        if bound is not None:
            measured = getattr(report, f"p99_{metric}_ms")
            values[f"p99_{metric}_ms"] = math.inf if _missing(measured) else measured - bound
    if constraints.max_preemption_rate is not None:
        rate = report.preemption_rate
        values["preemption_rate"] = (0.0 if _missing(rate) else rate) - constraints.max_preemption_rate
    return values


def record(trial, spec: StudySpec, config: PolicyConfig, report, cap: float, *,
           fleet: Fleet | None = None, capacity=None) -> list[float]:
    """Store the trial's evidence and constraints; return its objective values.

    ``fleet`` is where the trial ran (the spec's when None).
    """
    objective = objective_for(spec)
    fleet = fleet or spec.fleet
    gpus = fleet.gpus
    trial.set_user_attr("config", config.to_dict())
    trial.set_user_attr("report", report.to_dict())
    trial.set_user_attr("tp", fleet.tp)
    trial.set_user_attr("replicas", fleet.replicas)
    trial.set_user_attr("gpus", gpus)
    capacity_rps = None
    if capacity is not None:
        trial.set_user_attr("capacity", capacity.to_dict())
        capacity_rps = capacity.rps
    for name, value in constraint_values(report, spec.constraints, cap).items():
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
