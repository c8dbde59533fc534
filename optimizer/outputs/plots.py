"""Plots for a run folder: Pareto front, rate sweep, latency CDFs, parameter importances.

Each ``*_figure`` function takes plain data (arrays, mappings) and returns a matplotlib
``Figure`` built without pyplot, so nothing depends on a display or global state;
``save_figure`` writes it as PNG and SVG. ``param_importances`` is the one piece that reads
an Optuna study.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import optuna
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

FORMATS = ("png", "svg")
_BASELINE_MARKERS = ("*", "P", "X", "D")
_CURVE_STYLES = ("-", "--", ":", "-.")


def save_figure(fig: Figure, out_base: str | Path) -> list[Path]:
    """Write ``out_base.png`` and ``out_base.svg``; return the paths."""
    out_base = Path(out_base)
    out_base.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in FORMATS:
        path = out_base.with_suffix(f".{fmt}")
        fig.savefig(path, format=fmt, dpi=120, bbox_inches="tight", metadata=_no_date(fmt))
        paths.append(path)
    return paths


def _no_date(fmt: str) -> dict:
    # Keep files byte-stable across runs: no creation date in the metadata.
    return {"Date": None} if fmt == "svg" else {}


# -- Pareto front -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrialPoint:
    """One trial in objective space: two values, whether it met the constraints, its baseline name."""

    number: int
    x: float
    y: float
    feasible: bool = True
    baseline: str | None = None


def pareto_mask(xy: np.ndarray, directions: tuple[str, str]) -> np.ndarray:
    """True for points no other point dominates (at least as good on both, better on one)."""
    xy = np.asarray(xy, dtype=np.float64).reshape(-1, 2)
    signs = np.array([1.0 if d == "maximize" else -1.0 for d in directions])
    score = xy * signs  # larger is better on both axes now
    mask = np.zeros(len(xy), dtype=bool)
    finite = np.flatnonzero(np.isfinite(score).all(axis=1))
    # Sweep from the best x down: a point is on the front if its y beats every better-x point.
    order = finite[np.lexsort((-score[finite, 1], -score[finite, 0]))]
    best_y = -math.inf
    prev = None
    for i in order:
        x, y = score[i]
        if y > best_y or (prev is not None and (x, y) == prev):
            mask[i] = True
            best_y = max(best_y, y)
            prev = (x, y)
    return mask


def pareto_figure(points: Sequence[TrialPoint], names: tuple[str, str],
                  directions: tuple[str, str]) -> Figure:
    """Trials in the plane of two objectives; the feasible Pareto front joined; baselines starred."""
    fig = Figure(figsize=(6.4, 4.8))
    ax = fig.add_subplot()
    feasible = [p for p in points if p.feasible and np.isfinite([p.x, p.y]).all()]
    infeasible = [p for p in points if not p.feasible and np.isfinite([p.x, p.y]).all()]
    if infeasible:
        ax.scatter([p.x for p in infeasible], [p.y for p in infeasible], marker="x", color="0.6",
                   label="infeasible trials", zorder=1)
    if feasible:
        xy = np.array([(p.x, p.y) for p in feasible])
        ax.scatter(xy[:, 0], xy[:, 1], s=14, color="tab:blue", alpha=0.6, label="feasible trials", zorder=2)
        front = xy[pareto_mask(xy, directions)]
        front = front[np.argsort(front[:, 0])]
        ax.plot(front[:, 0], front[:, 1], "o-", color="tab:red", label="Pareto front", zorder=3)
    for i, p in enumerate(q for q in points if q.baseline):
        ax.scatter([p.x], [p.y], s=160, marker=_BASELINE_MARKERS[i % len(_BASELINE_MARKERS)],
                   edgecolor="black", color="gold", label=f"baseline: {p.baseline}", zorder=4)
    ax.set_xlabel(names[0])
    ax.set_ylabel(names[1])
    arrows = {"maximize": "higher is better", "minimize": "lower is better"}
    ax.set_title(f"{names[1]} vs {names[0]} ({arrows[directions[0]]} / {arrows[directions[1]]})", fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return fig


# -- rate sweep ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RateCurve:
    """One config across a sweep of arrival rates (the trace's rate scaled)."""

    offered_rps: np.ndarray
    slo_attainment: np.ndarray
    goodput: np.ndarray  # weighted goodput, per second

    def __post_init__(self) -> None:
        sizes = {len(self.offered_rps), len(self.slo_attainment), len(self.goodput)}
        if len(sizes) != 1:
            raise ValueError(f"rate curve arrays differ in length: {sorted(sizes)}")


def rate_sweep_figure(curves: Mapping[str, RateCurve], target: float, current_rps: float | None = None) -> Figure:
    """SLO attainment (with the target) and goodput against the offered arrival rate."""
    series = {}
    for name, curve in curves.items():
        order = np.argsort(curve.offered_rps)
        series[name] = (curve.offered_rps[order], curve.slo_attainment[order], curve.goodput[order])
    return _attainment_and_goodput(series, target, "arrival rate (req/s)", "arrival rate", marker_size=3,
                                   mark=None if current_rps is None else (current_rps, "trace rate"))


def gpus_figure(curves: Mapping[str, Sequence[tuple[int, float, float]]], target: float,
                gpus_per_replica: int = 1) -> Figure:
    """SLO attainment (with the target) and goodput against GPUs, from fleet simulations at
    the trace's rate: (replicas, attainment, goodput) points per config."""
    series = {}
    for name, points in curves.items():
        pts = sorted(points)
        series[name] = ([n * gpus_per_replica for n, _, _ in pts], [a for _, a, _ in pts], [g for _, _, g in pts])
    fig = _attainment_and_goodput(series, target, "GPUs (simulated fleet, engine's router)", "GPUs at the trace rate",
                                  marker_size=4)
    for ax in fig.axes:  # whole GPUs only
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def _attainment_and_goodput(series: Mapping[str, tuple], target: float, xlabel: str, against: str, *,
                            marker_size: int, mark: tuple[float, str] | None = None) -> Figure:
    """Two panels, SLO attainment (with the target line) and goodput, over one x axis;
    ``series``: name -> (x, attainment, goodput); ``mark``: (x, label) of a dotted line."""
    fig = Figure(figsize=(10, 4.2))
    ax_att, ax_good = fig.subplots(1, 2)
    for i, (name, (x, attainment, goodput)) in enumerate(series.items()):
        style = _CURVE_STYLES[i % len(_CURVE_STYLES)]
        ax_att.plot(x, attainment, style, marker="o", ms=marker_size, label=name)
        ax_good.plot(x, goodput, style, marker="o", ms=marker_size, label=name)
    ax_att.axhline(target, color="black", lw=0.8, label=f"target {target:.0%}")
    for ax in (ax_att, ax_good):
        if mark is not None:
            ax.axvline(mark[0], color="0.5", lw=0.8, ls=":", label=mark[1])
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_att.set_ylabel("SLO attainment")
    ax_att.set_ylim(-0.02, 1.02)
    ax_good.set_ylabel("weighted goodput (/s)")
    ax_att.set_title(f"SLO attainment vs {against}", fontsize=9)
    ax_good.set_title(f"goodput vs {against}", fontsize=9)
    return fig


# -- latency CDFs -------------------------------------------------------------------------------


def latency_cdf_figure(samples: Mapping[str, Mapping[str, np.ndarray]],
                       bounds_ms: Mapping[str, float | None]) -> Figure:
    """Empirical CDFs of TTFT and TPOT (ms) per config, with the SLO bound as a vertical line."""
    fig = Figure(figsize=(10, 4.2))
    for metric, ax in zip(("ttft", "tpot"), fig.subplots(1, 2), strict=True):
        lowest, highest = math.inf, 0.0
        for i, (name, metrics) in enumerate(samples.items()):
            values = np.asarray(metrics[metric], dtype=np.float64)
            values = np.sort(values[np.isfinite(values)])
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values),
                        _CURVE_STYLES[i % len(_CURVE_STYLES)], where="post", label=name)
                lowest, highest = min(lowest, values[0]), max(highest, values[-1])
        bound = bounds_ms.get(metric)
        if bound is not None and math.isfinite(bound):
            ax.axvline(bound, color="black", lw=0.8, label=f"SLO {bound:g} ms")
        if 0 < lowest and highest / lowest >= 50:  # latencies spanning decades read better on a log axis
            ax.set_xscale("log")
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of finished requests")
        ax.set_title(f"{metric.upper()} CDF", fontsize=9)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return fig


# -- parameter importances ----------------------------------------------------------------------


def param_importances(study: optuna.Study,
                      target: Callable[[optuna.trial.FrozenTrial], float] | None = None) -> dict[str, float]:
    """Optuna's importances (PED-ANOVA by default in Optuna 5) of the searched knobs.

    ``target`` picks one value per trial; needed for multi-objective studies. Returns an
    empty mapping when the study has too few completed trials or nothing varied.
    """
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    varied = {name for t in complete for name in t.params
              if len({repr(u.params.get(name)) for u in complete}) > 1}
    if len(complete) < 2 or not varied:
        return {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # experimental-API and small-sample warnings
        try:
            return dict(optuna.importance.get_param_importances(study, target=target))
        except (RuntimeError, ValueError):
            return {}


def importance_figure(importances: Mapping[str, float]) -> Figure:
    """Horizontal bars, most important knob on top."""
    fig = Figure(figsize=(6.4, 0.5 + 0.35 * max(len(importances), 1)))
    ax = fig.add_subplot()
    items = sorted(importances.items(), key=lambda kv: kv[1])
    ax.barh([k for k, _ in items], [v for _, v in items], color="tab:blue")
    ax.set_xlabel("importance (PED-ANOVA, normalised)")
    ax.set_title("which knobs moved the objective", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    return fig
