"""The runs behind a run folder's figures, beyond the search's own.

Each config the outputs describe (the recommendation and the baselines) is kept as an
``Evaluated`` with its run at the trace rate, its capacity and its curve over arrival rates;
``gpu_curves`` sweeps replica counts, and the held-out check and the oracle bound score the
same configs on other traffic. The plots, the review and ``summary.json`` are drawn from
these, so they live apart from any one of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from optuna.trial import FrozenTrial

from optimizer.outputs import plots
from optimizer.outputs.review import Capacity, Diagnosis
from optimizer.outputs.trials import as_float
from optimizer.robust.choice import ratio
from optimizer.robust.fleetsize import MAX_SIZED_REPLICAS, fleet_curve
from optimizer.search.space import Fleet
from policies.config import PolicyConfig


@dataclass(frozen=True)
class Evaluated:
    """One config the outputs describe: the recommendation or a baseline, run at the trace rate."""

    name: str
    config: PolicyConfig
    fleet: Fleet
    trial: FrozenTrial | None
    result: Any  # SimResult
    report: dict[str, Any]
    curve: plots.RateCurve
    capacity: Capacity
    diagnosis: Diagnosis
    diagnosed_at_rps: float


def sweep_scales(capacities: Sequence[float], per_doubling: int = 2) -> np.ndarray:
    """Rate scales from a quarter of the lowest capacity to twice the highest, with 1.0.

    Geometric, ``per_doubling`` points per factor of 2, so every curve's fall is visible.
    """
    known = [c for c in capacities if math.isfinite(c) and c > 0]
    low = min(min(known, default=0.5), 1.0) / 4
    high = max(max(known, default=1.0), 1.0) * 2
    steps = max(1, round(math.log2(high / low) * per_doubling))
    return np.unique(np.round(np.concatenate([np.geomspace(low, high, steps + 1), [1.0]]), 6))


def rate_curves(evaluator, configs: Mapping[str, PolicyConfig], scales: np.ndarray,
                trace_rps: float, fleets: Sequence[Fleet] | None = None) -> dict[str, plots.RateCurve]:
    """SLO attainment and weighted goodput of each config (on its fleet) at each rate scale."""
    attainment = {name: [] for name in configs}
    goodput = {name: [] for name in configs}
    for scale in scales:
        reports = evaluator.reports(list(configs.values()), float(scale), fleets=fleets)
        for name, report in zip(configs, reports, strict=True):
            attainment[name].append(as_float(report.slo_attainment))
            goodput[name].append(as_float(report.weighted_goodput))
    return {name: plots.RateCurve(np.asarray(scales) * trace_rps, np.array(attainment[name]), np.array(goodput[name]))
            for name in configs}


def gpu_curves(evaluator, evaluated: Sequence[Evaluated]) -> dict[str, list[tuple[int, float, float]]]:
    """Attainment and goodput of each config's fleet at every replica count up to one past the
    largest count sized (the GPUs plot; the sizing's own runs, cached, and those between)."""
    counts = [e.capacity.replicas_needed for e in evaluated if e.capacity.replicas_needed is not None]
    highest = min(max(counts, default=1) + 1, MAX_SIZED_REPLICAS)
    return {e.name: fleet_curve(evaluator, e.config, e.fleet, highest) for e in evaluated}


#: Rate scales of the held-out traffic the generalisation check scores, besides its own rate.
HOLDOUT_SCALES = (0.8, 1.0, 1.2)


def generalisation_check(spec, evaluator, configs: Mapping[str, PolicyConfig],
                         fleets: Sequence[Fleet]) -> dict[str, Any] | None:
    """Weighted goodput of the recommendation (first of ``configs``) and the baselines on the
    held-out end of the trace, at its rate and +-20%, with the gain over each baseline."""
    trace = evaluator.holdout_trace
    if trace is None:
        return None
    held = evaluator.on(trace)
    names = list(configs)
    out: dict[str, Any] = {"requests": trace.n, "share": spec.holdout, "scales": {}}
    for scale in HOLDOUT_SCALES:
        reports = held.reports(list(configs.values()), scale, fleets=list(fleets))
        goodput = {n: as_float(r.weighted_goodput) for n, r in zip(names, reports, strict=True)}
        mine = goodput[names[0]]
        out["scales"][f"x{scale:g}"] = {
            "weighted_goodput": goodput,
            "slo_attainment": {n: as_float(r.slo_attainment) for n, r in zip(names, reports, strict=True)},
            "gain": {n: ratio(mine, goodput[n]) for n in names[1:]}}
    return out


def oracle_bound(spec, evaluator, configs: Mapping[str, PolicyConfig], fleets: Sequence[Fleet]) -> dict[str, Any]:
    """The same configs with every request's true output length known to SJF (the
    ``oracle`` predictor): an upper bound on what any length predictor could add, never a
    recommendation's figure."""
    from studies.lengths import Predictor

    oracle = evaluator.on(Predictor.parse("oracle").apply(evaluator.trace, seed=spec.seed))
    reports = oracle.reports(list(configs.values()), fleets=list(fleets))
    goodput = {n: as_float(r.weighted_goodput) for n, r in zip(configs, reports, strict=True)}
    names = list(configs)
    return {"label": "upper bound: SJF told each request's true output length (no scheduler knows it)",
            "weighted_goodput": goodput,
            "gain": {n: ratio(goodput[names[0]], as_float(evaluator.reports([configs[n]], fleets=[f])[0].weighted_goodput))
                     for n, f in zip(names[1:], list(fleets)[1:], strict=True)}}
