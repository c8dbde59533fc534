"""Capacity: the highest arrival rate a config serves with SLO attainment >= a target.

DistServe's capacity goodput: scale the trace's arrival rate by ``s`` (token lengths
unchanged) and find the largest ``s`` whose SLO attainment (good / offered) stays at or
above ``target``. The search doubles ``s`` from 1 until a probe fails (or halves it until
one passes), then bisects between the last pass and the first fail until the bracket is
within ``tolerance`` (relative). Attainment is assumed to fall with load; a non-monotone
curve still returns a rate that was measured to pass.

Several configs search in lockstep (``capacity_many``): at each round the probes that
share a rate scale run as one parallel ``simulate_many`` batch, which is every probe of
the doubling phase.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass

from policies.config import PolicyConfig


@dataclass(frozen=True)
class CapacityResult:
    rate_scale: float  # highest passing scale; 0 if even min_scale fails
    rps: float  # offered rate at that scale
    target: float
    bracketed: bool  # False when the doubling stopped at max_scale still passing
    probes: tuple[tuple[float, float, float], ...]  # (scale, attainment, weighted goodput)

    def to_dict(self) -> dict:
        return {"rate_scale": self.rate_scale, "rps": self.rps, "target": self.target,
                "bracketed": self.bracketed, "probes": [list(p) for p in self.probes]}


def _search(target: float, tolerance: float, max_scale: float, min_scale: float
            ) -> Generator[float, float, tuple[float, bool]]:
    """Yield rate scales to probe; receive their attainment; return (scale, bracketed)."""
    scale = 1.0
    if (yield scale) >= target:
        lo, hi = scale, None
        while hi is None:
            if scale * 2 > max_scale:
                return lo, False
            scale *= 2
            if (yield scale) >= target:
                lo = scale
            else:
                hi = scale
    else:
        lo, hi = None, scale
        while lo is None:
            scale /= 2
            if scale < min_scale:
                return 0.0, True
            if (yield scale) >= target:
                lo = scale
            else:
                hi = scale
    while hi - lo > tolerance * lo:
        mid = 0.5 * (lo + hi)
        if (yield mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo, True


def capacity_many(evaluator, configs: Sequence[PolicyConfig], target: float = 0.9, *, tolerance: float = 0.05,
                  max_scale: float = 1024.0, min_scale: float = 1.0 / 1024,
                  fleets: Sequence | None = None) -> list[CapacityResult]:
    """Capacity of each config on the evaluator's trace, probes batched across configs.

    ``fleets`` (one per config) runs each config on its own fleet; default, the evaluator's.
    """
    if not 0 < target <= 1:
        raise ValueError(f"target is an attainment fraction in (0, 1], got {target}")
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance is a relative bracket width in (0, 1), got {tolerance}")
    span = float(evaluator.trace.arrival_s[-1] - evaluator.trace.arrival_s[0])
    base_rps = (evaluator.trace.n - 1) / span if span > 0 else math.inf  # mean rate, as trace_stats
    searches = [_search(target, tolerance, max_scale, min_scale) for _ in configs]
    pending = {i: s.send(None) for i, s in enumerate(searches)}
    probes: list[list[tuple[float, float, float]]] = [[] for _ in configs]
    results: dict[int, CapacityResult] = {}
    while pending:
        by_scale: dict[float, list[int]] = {}
        for i, scale in pending.items():
            by_scale.setdefault(scale, []).append(i)
        for scale, members in by_scale.items():
            batch = [configs[i] for i in members]
            if fleets is None:
                reports = evaluator.reports(batch, rate_scale=scale)
            else:
                reports = evaluator.reports(batch, rate_scale=scale, fleets=[fleets[i] for i in members])
            for i, report in zip(members, reports, strict=True):
                attainment = 0.0 if math.isnan(report.slo_attainment) else report.slo_attainment
                probes[i].append((scale, attainment, report.weighted_goodput))
                try:
                    pending[i] = searches[i].send(attainment)
                except StopIteration as done:
                    found, bracketed = done.value
                    results[i] = CapacityResult(found, found * base_rps, target, bracketed, tuple(probes[i]))
                    del pending[i]
    return [results[i] for i in range(len(configs))]


def capacity(evaluator, config: PolicyConfig, target: float = 0.9, **options) -> CapacityResult:
    """Capacity of one config; see ``capacity_many`` for the options."""
    return capacity_many(evaluator, [config], target, **options)[0]
