"""GPUs needed: the fewest replicas whose simulated fleet meets the SLO-attainment target.

One replica's capacity scaled by the load is not the answer: replicas pool a bursty load
(a fleet of N serves more than N times one replica's burst) and the engine's router
spreads it unevenly. So the count is searched with the fleet kernel itself: the config runs
as N replicas behind its own router (vLLM's data-parallel balancer, SGLang's
``load-balance-method``, or a what-if router) on the whole trace at its rate, and the
smallest N with SLO attainment >= target is taken. N doubles from ``start`` (or halves)
until the target is bracketed, then bisects; attainment is taken to rise with N, and a
count is only ever reported after a run at that count met the target.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from policies.failures import FailureError

#: The most replicas a sizing run simulates; beyond it the target is reported out of reach.
MAX_SIZED_REPLICAS = 64


@dataclass(frozen=True)
class FleetSize:
    """The fewest replicas meeting ``target`` on one trace (None: more than ``max_replicas``)."""

    replicas: int | None
    gpus_per_replica: int
    target: float
    max_replicas: int
    probes: tuple[tuple[int, float, float], ...]  # (replicas, attainment, weighted goodput), by replicas

    @property
    def gpus(self) -> int | None:
        return None if self.replicas is None else self.replicas * self.gpus_per_replica

    @property
    def attainment(self) -> float | None:
        """SLO attainment at the count found."""
        return next((a for n, a, _ in self.probes if n == self.replicas), None)

    def to_dict(self) -> dict:
        return {"replicas": self.replicas, "gpus": self.gpus, "gpus_per_replica": self.gpus_per_replica,
                "target": self.target, "attainment": self.attainment, "max_replicas": self.max_replicas,
                "probes": [list(p) for p in self.probes]}


def fleet_size(evaluator, config, fleet, target: float, *, start: int = 1,
               max_replicas: int = MAX_SIZED_REPLICAS) -> FleetSize:
    """The fewest replicas of ``fleet``'s layout running ``config`` on ``evaluator``'s trace
    (at its rate) whose SLO attainment reaches ``target``."""
    seen: dict[int, tuple[float, float]] = {}

    def meets(n: int) -> bool:
        if n not in seen:
            seen[n] = probe(evaluator, config, fleet, n)
        return seen[n][0] >= target

    n = min(max(1, start), max_replicas)
    if meets(n):
        lo, hi = 0, n  # 0 replicas never meet it
        while hi > 1 and lo == 0:
            if meets(hi // 2):
                hi //= 2
            else:
                lo = hi // 2
    else:
        lo, hi = n, None
        while hi is None:
            if lo >= max_replicas:
                return _size(None, fleet, target, max_replicas, seen)
            m = min(2 * lo, max_replicas)
            if meets(m):
                hi = m
            else:
                lo = m
    while hi - lo > 1:  # lo fails (or is 0), hi meets
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return _size(hi, fleet, target, max_replicas, seen)


def probe(evaluator, config, fleet, replicas: int) -> tuple[float, float]:
    """(SLO attainment, weighted goodput) of ``config`` on ``replicas`` replicas of ``fleet``'s
    layout; (0, 0) for a count the study's failure plan cannot run (it names a replica the
    fleet lacks), which therefore never meets the target."""
    try:
        report = evaluator.reports([config], 1.0, fleets=[dataclasses.replace(fleet, replicas=replicas)])[0]
    except FailureError:
        return 0.0, 0.0
    attainment = 0.0 if math.isnan(report.slo_attainment) else float(report.slo_attainment)
    goodput = 0.0 if math.isnan(report.weighted_goodput) else float(report.weighted_goodput)
    return attainment, goodput


def fleet_curve(evaluator, config, fleet, highest: int) -> list[tuple[int, float, float]]:
    """(replicas, attainment, goodput) at every count from 1 to ``highest`` (the GPUs plot)."""
    return [(n, *probe(evaluator, config, fleet, n)) for n in range(1, highest + 1)]


def _size(replicas, fleet, target, max_replicas, seen) -> FleetSize:
    probes = tuple((n, a, g) for n, (a, g) in sorted(seen.items()))
    return FleetSize(replicas, fleet.tp, target, max_replicas, probes)
