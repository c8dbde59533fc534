"""The traffic variants a candidate is scored on before it is recommended.

The search sees one window of one trace; fresh traffic of the same workload differs in
which bursts it holds and in how busy it is. A variant is a contiguous fold of the tuning
window (its time window cut into ``folds`` equal parts, each rebased to start at 0) at a
rate scale around the trace's (x0.8, x1, x1.2 by default). A fold too small to say
anything (fewer than ``MIN_FOLD_REQUESTS`` requests) is not cut: fewer folds are used.
"""

from __future__ import annotations

from dataclasses import dataclass

from studies.traces import Trace
from studies.transforms import window

#: Folds of the tuning window and the rate scales each is scored at.
FOLDS = 3
RATE_SCALES = (0.8, 1.0, 1.2)
#: A fold with fewer requests is too small to tell configs apart: fewer folds are cut.
MIN_FOLD_REQUESTS = 50


@dataclass(frozen=True)
class Fold:
    """One contiguous part of the tuning window, rebased to start at 0."""

    index: int
    of: int
    trace: Trace

    @property
    def name(self) -> str:
        return f"fold {self.index + 1}/{self.of}"


@dataclass(frozen=True)
class Variant:
    """A fold at a rate scale: one traffic condition a candidate's gain is measured on."""

    fold: Fold
    rate_scale: float

    @property
    def name(self) -> str:
        return f"{self.fold.name} x{self.rate_scale:g}"


def folds(trace: Trace, count: int = FOLDS, min_requests: int = MIN_FOLD_REQUESTS) -> list[Fold]:
    """``trace``'s arrival window cut into ``count`` equal parts (fewer when a part would
    hold fewer than ``min_requests``; the whole trace as one fold at worst)."""
    t0, t1 = (float(trace.arrival_s[0]), float(trace.arrival_s[-1])) if trace.n else (0.0, 0.0)
    if trace.n < 2 or not t1 > t0:  # nothing to cut: one request, or all at one instant
        return [Fold(0, 1, trace)]
    for k in range(max(1, count), 1, -1):
        edges = [t0 + (t1 - t0) * i / k for i in range(k + 1)]
        edges[-1] = None  # the last fold keeps the last arrival
        parts = []
        for i in range(k):
            start, end = edges[i], edges[i + 1]
            inside = ((trace.arrival_s >= start) & (trace.arrival_s < (end if end is not None else float("inf"))))
            if int(inside.sum()) < min_requests:
                break
            parts.append(window(trace, start, end, rebase=True))
        if len(parts) == k:
            return [Fold(i, k, part) for i, part in enumerate(parts)]
    return [Fold(0, 1, trace)]


def variants(trace: Trace, count: int = FOLDS, scales: tuple[float, ...] = RATE_SCALES) -> list[Variant]:
    """Every fold of ``trace`` at every rate scale."""
    return [Variant(fold, scale) for fold in folds(trace, count) for scale in scales]
