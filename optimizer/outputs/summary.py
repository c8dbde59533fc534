"""``summary.json``: the run folder's figures as data.

The recommendation and each baseline with their reports, capacity and fleet, the gains
over each baseline, what to lead with (``verdict``) and where the numbers came from
(``provenance``). A script reads this file instead of parsing the review.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

from optuna.trial import FrozenTrial

from optimizer.outputs.exports import TrafficShape
from optimizer.outputs.measure import Evaluated
from optimizer.outputs.review import Capacity, gain_ratio, routing_label
from optimizer.outputs.trials import as_float, baseline_name, fleet_front, is_feasible
from optimizer.robust.modelerror import model_error
from optimizer.search.space import Fleet
from optimizer.search.study import BOUNDS_ATTR
from policies.config import PolicyConfig

#: Report fields that say what failures cost (see studies.metrics).
FAILURE_FIGURES = ("failure_windows", "failure_affected", "reprefill_tokens", "goodput_during_failures",
                   "goodput_after_failures")
#: Report fields compared between the recommendation and each baseline, and their direction.
GAIN_METRICS = {"weighted_goodput": "maximize", "request_goodput": "maximize", "token_goodput": "maximize",
                "slo_attainment": "maximize", "p99_ttft_ms": "minimize", "p99_tpot_ms": "minimize"}
PACKAGES = ("servetune", "numpy", "numba", "optuna", "polars", "scipy", "matplotlib")


def gains(best: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per report metric: both values, the relative change, and whether the best is better."""
    out = {}
    for key, direction in GAIN_METRICS.items():
        mine, theirs = as_float(best.get(key)), as_float(baseline.get(key))
        change = gain_ratio(mine, theirs)
        better = None
        if math.isfinite(mine) and math.isfinite(theirs):
            better = mine > theirs if direction == "maximize" else mine < theirs
        out[key] = {"best": _finite(mine), "baseline": _finite(theirs), "change": change, "better": better}
    return out


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def provenance(spec, evaluator) -> dict[str, Any]:
    """Where the numbers came from: trace content, cost model, versions, seed, command line."""
    from optimizer.search.spec import file_sha256

    versions = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    cost_model = evaluator.cost_model
    return {
        "trace": {"path": str(spec.trace), "sha256": file_sha256(spec.trace), "requests": evaluator.trace.n,
                  "source": evaluator.trace.source, "format": spec.trace_format,
                  "rate_scale": spec.rate_scale, "target_rps": spec.target_rps},
        "cost_model": {"name": cost_model.name, "source": cost_model.source, "tp": cost_model.tp,
                       "calibration": residual(cost_model)},
        "versions": versions,
        "seed": spec.seed,
        "command": shlex.join(sys.argv),
        "storage": redact_url(spec.storage) if spec.storage else None,
        "written_utc": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def residual(cost_model) -> dict[str, Any]:
    """Which calibration a cost model used and the error it was measured to have
    (``model_error``): every gain is to be read against it."""
    used = dict(cost_model.calibration or {"file": None, "match": "none"})
    used.pop("tier_errors", None)  # the file's table; the setup's own figure is stated_error
    used["stated_error"] = model_error(cost_model).stated
    return used


def redact_url(url: str) -> str:
    """A storage URL without its password, safe to write into a summary."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def verdict(recommended: Evaluated, baselines: Sequence[Evaluated], target: float) -> dict[str, Any]:
    """What to lead with: a gain when some baseline meets the SLOs, else the capacity answer
    (the GPUs the recommendation needs to meet them), since a ratio over a baseline that
    serves nothing well says nothing a user can act on."""
    met = [b.name for b in baselines if as_float(b.report.get("slo_attainment")) >= target]
    cap = recommended.capacity
    if met or not baselines:
        return {"kind": "gain", "baselines_meeting_target": met}
    return {"kind": "capacity", "baselines_meeting_target": [], "target_attainment": target,
            "gpus_needed": cap.gpus_needed, "replicas_needed": cap.replicas_needed, "max_rps": cap.max_rps,
            "capped": cap.capped}


def _fleet_dict(fleet: Fleet, config: PolicyConfig, report: Mapping[str, Any]) -> dict[str, Any]:
    """The fleet a config ran on: GPUs, the router simulated, per-replica and failure figures."""
    layout = {k: v for k, v in fleet.to_dict().items() if k in ("tp", "replicas") or v > 1}  # EP / DP if any
    out: dict[str, Any] = {**layout, "gpus": fleet.gpus,
                           "routing": routing_label(config, fleet.schedulers)}
    if report.get("per_replica"):
        out["per_replica"] = report["per_replica"]
    if report.get("failure_windows"):
        out["failures"] = {k: report.get(k) for k in FAILURE_FIGURES}
    return out


def _capacity_dict(c: Capacity) -> dict[str, Any]:
    return {"rate_scale": c.max_rate_scale, "max_rps": c.max_rps, "capped": c.capped, "headroom": c.headroom,
            "replicas_simulated": c.replicas, "replicas_needed": c.replicas_needed, "gpus_needed": c.gpus_needed,
            "sizing": None if c.sized is None else c.sized.to_dict()}


def run_summary(study, spec, evaluator, best: FrozenTrial, names, dirs, recommended: Evaluated,
             baselines: Sequence[Evaluated], traffic: TrafficShape) -> dict[str, Any]:
    entries = {}
    for b in baselines:
        entry: dict[str, Any] = {"trial": b.trial.number if b.trial else None, "config": b.config.to_dict(),
                                 "fleet": _fleet_dict(b.fleet, b.config, b.report), "report": b.report, "capacity": _capacity_dict(b.capacity),
                                 "gains": gains(recommended.report, b.report)}
        if b.trial is not None:
            entry["values"] = dict(zip(names, b.trial.values, strict=True))
            entry["objective_gains"] = {
                n: {"best": mine, "baseline": theirs, "change": gain_ratio(mine, theirs),
                    "better": mine > theirs if d == "maximize" else mine < theirs}
                for n, mine, theirs, d in zip(names, best.values, b.trial.values, dirs, strict=True)}
        entries[b.name] = entry
    states = [t.state.name.lower() for t in study.get_trials(deepcopy=False)]
    return {
        "study": spec.study_name,
        "objective": spec.objective,
        "metric_names": names,
        "directions": dirs,
        "trials": {state: states.count(state) for state in sorted(set(states))},
        "best": {"trial": best.number, "baseline": baseline_name(best), "feasible": is_feasible(best),
                 "values": dict(zip(names, best.values, strict=True)), "constraints": dict(best.constraints),
                 "params": dict(best.params), "config": recommended.config.to_dict(),
                 "fleet": _fleet_dict(recommended.fleet, recommended.config, recommended.report),
                 "report": recommended.report,
                 "capacity": _capacity_dict(recommended.capacity)},
        "baselines": entries,
        "deployment": {"model": spec.model, "gpu": spec.gpu, "tp": spec.tp, "replicas": spec.replicas,
                       "framework": spec.framework,
                       "routing": routing_label(recommended.config, recommended.fleet.replicas),
                       "failures": None if spec.failures is None else spec.failures.to_dict()},
        "fleet_front": [dataclasses.asdict(p) for p in fleet_front(study.get_trials(deepcopy=False))],
        "slo": spec.slos.describe(),
        "bounds": study.user_attrs.get(BOUNDS_ATTR),  # what every trial was held to (objective.bounds)
        "capacity_target": spec.capacity_target,
        "traffic": {"requests": traffic.n_requests, "rate_rps": traffic.rate_rps, "burstiness": traffic.burstiness},
        "provenance": provenance(spec, evaluator),
    }
