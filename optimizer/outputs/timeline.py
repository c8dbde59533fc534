"""Timeline plot of one simulated run: KV usage, running batch and waiting queue over time.

Drawn from the SimResult's sampled series on matplotlib's Agg canvas directly, without
pyplot, so plotting never touches the caller's global backend or needs a display.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from policies.result import SimResult


def timeline_figure(result: SimResult, title: str = "") -> Figure:
    """Three stacked panels sharing the time axis; each series is a step (held until the next sample)."""
    t = np.asarray(result.series_t, dtype=np.float64)
    series = (result.series_kv_blocks, result.series_running, result.series_waiting)
    for name, values in zip(("series_kv_blocks", "series_running", "series_waiting"), series, strict=True):
        if len(values) != len(t):
            raise ValueError(f"SimResult.{name} has {len(values)} samples but series_t has {len(t)}")

    capacity = result.kv_capacity_blocks
    kv_percent = 100.0 * np.asarray(result.series_kv_blocks, dtype=np.float64) / max(capacity, 1)
    panels = (
        (kv_percent, f"KV in use (% of {capacity:,} blocks)", "tab:purple"),
        (result.series_running, "running requests", "tab:blue"),
        (result.series_waiting, "waiting requests", "tab:orange"),
    )
    fig = Figure(figsize=(10, 7), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, (values, label, colour) in zip(axes, panels, strict=True):
        ax.plot(t, values, drawstyle="steps-post", color=colour, linewidth=1.0)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if not len(t):
            ax.text(0.5, 0.5, "no samples", transform=ax.transAxes, ha="center", va="center")
    axes[0].axhline(100.0, color="black", linestyle="--", linewidth=0.8)
    axes[0].set_ylim(0, 105)
    for ax, counts in zip(axes[1:], series[1:], strict=True):  # whole requests, from zero
        ax.set_ylim(0, max(1.0, 1.05 * float(np.max(counts, initial=0))))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel("time on the trace clock (s)")
    if title:
        fig.suptitle(title)
    return fig


def save_timeline(result: SimResult, path: str | Path, title: str = "") -> Path:
    """Write the timeline to ``path`` (format from the suffix, e.g. .png or .svg)."""
    path = Path(path)
    timeline_figure(result, title).savefig(path, dpi=120)
    return path
