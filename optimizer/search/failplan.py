"""A study's failure plan: which replicas of the fleet fail when, in every simulation of it.

Declared one of two ways, as CLI flags or the spec's ``[failures]`` table:

- explicit windows: ``--fail 2@600:900,0@100:200`` or ``windows = ["2@600:900"]``
  (replica @ down : up seconds; ``inf`` = never back; see ``policies.failures``);
- random failures: ``--mtbf 3600 --repair 300`` or ``mtbf_s = 3600, repair_s = 300``: each
  replica stays up for exponential times of mean ``mtbf_s`` and down ``repair_s`` after
  each failure, over the trace's span, seeded by the study's seed
  (``policies.failures.random_failures``; replica j draws from its own stream, so a fleet
  of R replicas fails as the first R of a larger one).

Times are on the study trace's clock (after the spec's rate transform). When the
evaluator replays the trace at another rate scale (capacity search, rate curves), the
windows are compressed around the first arrival exactly as the arrivals are
(``studies.transforms.scale_rate``), so a failure hits the same requests at every rate.
Explicit windows naming a replica a trial's fleet lacks make that trial infeasible,
with the replica named; they are never dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.failures import FailureError, FailureSchedule, random_failures

_KEYS = ("windows", "mtbf_s", "repair_s")


@dataclass(frozen=True)
class FailurePlan:
    """Explicit ``windows``, or random failures from ``mtbf_s`` and ``repair_s``; validated."""

    windows: FailureSchedule | None = None
    mtbf_s: float | None = None
    repair_s: float | None = None

    def __post_init__(self) -> None:
        random = (self.mtbf_s, self.repair_s)
        if self.windows is not None and any(v is not None for v in random):
            raise FailureError("failures: give explicit windows (--fail) or random failures (--mtbf, --repair), "
                               "not both")
        if self.windows is None:
            if any(v is None for v in random):
                raise FailureError("failures: random failures need both an MTBF and a repair time "
                                   "(--mtbf S --repair S, or mtbf_s and repair_s)")
            for name, value in zip(("mtbf_s", "repair_s"), random, strict=True):
                if isinstance(value, bool) or not isinstance(value, int | float) or not (
                        math.isfinite(value) and value > 0):
                    raise FailureError(f"failures: {name} must be a number of seconds > 0, got {value!r}")
        elif not len(self.windows):
            raise FailureError("failures: the window list is empty; give at least one, e.g. 2@600:900")

    @classmethod
    def from_flags(cls, fail: str | None = None, mtbf_s: float | None = None,
                   repair_s: float | None = None) -> FailurePlan | None:
        """The plan the CLI flags declare, or None when none of them is given."""
        if fail is None and mtbf_s is None and repair_s is None:
            return None
        return cls(None if fail is None else FailureSchedule.parse(fail), mtbf_s, repair_s)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "[failures]") -> FailurePlan:
        """A ``[failures]`` table: ``windows`` (as ``policies.failures`` reads them), or
        ``mtbf_s`` and ``repair_s``."""
        if not isinstance(data, Mapping):
            raise FailureError(f"{where} must be a table, got {data!r}")
        unknown = sorted(set(data) - set(_KEYS))
        if unknown:
            raise FailureError(f"{where}: unknown key(s) {unknown}; valid: {list(_KEYS)}")
        windows = None
        if "windows" in data:
            windows = FailureSchedule.from_mapping({"windows": data["windows"]}, where)
        return cls(windows, data.get("mtbf_s"), data.get("repair_s"))

    def to_dict(self) -> dict[str, Any]:
        """The ``[failures]`` table that ``from_mapping`` reads back."""
        if self.windows is not None:
            return {"windows": self.windows.describe().split(",")}
        return {"mtbf_s": self.mtbf_s, "repair_s": self.repair_s}

    def describe(self) -> str:
        if self.windows is not None:
            return f"replica@down:up seconds {self.windows.describe()}"
        return f"random failures, MTBF {self.mtbf_s:g} s, repair {self.repair_s:g} s per replica"

    @property
    def highest_replica(self) -> int:
        """The highest replica index the explicit windows name (-1 for random failures)."""
        return int(self.windows.replica.max()) if self.windows is not None else -1

    def schedule(self, replicas: int, arrival_s: np.ndarray, seed: int) -> FailureSchedule:
        """The windows a fleet of ``replicas`` runs with on a trace of these arrival times.

        Raises FailureError when an explicit window names a replica the fleet lacks.
        """
        if self.windows is not None:
            self.windows.check_replicas(replicas)
            return self.windows
        start = float(arrival_s[0]) if len(arrival_s) else 0.0
        span = float(arrival_s[-1]) - start if len(arrival_s) else 0.0
        if not span > 0:
            return FailureSchedule.empty()
        drawn = random_failures(replicas, span, self.mtbf_s, self.repair_s, seed=seed)
        return FailureSchedule(drawn.replica, drawn.t_down + start, drawn.t_up + start)


def compressed(schedule: FailureSchedule, t0: float, factor: float) -> FailureSchedule:
    """``schedule`` on a trace whose rate was multiplied by ``factor`` around its first
    arrival ``t0``; times before ``t0`` precede every request and stay as they are."""
    if factor == 1.0 or not len(schedule):
        return schedule

    def at(t: np.ndarray) -> np.ndarray:
        return np.where(t < t0, t, t0 + (t - t0) / factor)

    return FailureSchedule(schedule.replica, at(schedule.t_down), at(schedule.t_up))
