"""The run folder's ``plots/``: which figures it holds and what each is drawn from.

``optimizer.outputs.plots`` draws a figure from plain arrays; this module picks the
trials, curves and latency samples of a run for each one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from optuna.trial import TrialState

from optimizer.outputs import plots
from optimizer.outputs.exports import goodput_bounds
from optimizer.outputs.measure import Evaluated
from optimizer.outputs.trials import as_float, baseline_name, is_feasible, trial_report
from policies.result import State
from studies.metrics import request_latencies


def write_plots(plot_dir: Path, study, trials, dirs, names, evaluated: Sequence[Evaluated], trace, spec,
                 trace_rps: float, gpus: Mapping[str, Sequence[tuple[int, float, float]]]) -> dict[str, Path]:
    """Every plot as PNG and SVG; returns caption -> path (PNG under the caption itself)."""
    files: dict[str, Path] = {}

    def save(caption: str, fig, stem: str) -> None:
        png, svg = plots.save_figure(fig, plot_dir / stem)
        files[caption], files[f"{caption} (SVG)"] = png, svg

    points, axis_names, axis_dirs = _pareto_points(trials, dirs, names)
    save("Pareto front", plots.pareto_figure(points, axis_names, axis_dirs), "pareto")
    save("SLO attainment and goodput vs arrival rate",
         plots.rate_sweep_figure({e.name: e.curve for e in evaluated}, spec.capacity_target, trace_rps), "rate-sweep")
    save("SLO attainment and goodput vs GPUs", plots.gpus_figure(gpus, spec.capacity_target,
                                                                 evaluated[0].fleet.tp), "gpus")
    bounds = goodput_bounds(spec.slos)
    save("TTFT and TPOT CDFs", plots.latency_cdf_figure(
        {e.name: latency_samples(e.result, trace) for e in evaluated}, bounds), "latency-cdf")
    importances = plots.param_importances(study, target=lambda t: t.values[0])
    if importances:
        save("Parameter importances", plots.importance_figure(importances), "importance")
    return files


def _pareto_points(trials, dirs, names) -> tuple[list[plots.TrialPoint], tuple[str, str], tuple[str, str]]:
    """Two objectives when the study has them; else goodput against p99 TTFT from the reports.

    GPUs go on the x axis (goodput vs GPUs reads as a capacity curve).
    """
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.values is not None]
    if len(dirs) > 1 and names[1] == "gpus":
        points = [plots.TrialPoint(t.number, t.values[1], t.values[0], is_feasible(t), baseline_name(t))
                  for t in complete]
        return points, (names[1], names[0]), (dirs[1], dirs[0])
    if len(dirs) > 1:
        points = [plots.TrialPoint(t.number, t.values[0], t.values[1], is_feasible(t), baseline_name(t))
                  for t in complete]
        return points, (names[0], names[1]), (dirs[0], dirs[1])
    points = [plots.TrialPoint(t.number, t.values[0], as_float((trial_report(t) or {}).get("p99_ttft_ms")),
                               is_feasible(t), baseline_name(t)) for t in complete]
    return points, (names[0], "p99 TTFT (ms)"), (dirs[0], "minimize")


def latency_samples(result, trace) -> dict[str, np.ndarray]:
    """TTFT and TPOT (ms) of finished requests; TPOT only where more than one token came out."""
    lat = request_latencies(result, trace)
    finished = result.state == State.FINISHED
    return {"ttft": lat["ttft"][finished], "tpot": lat["tpot"][finished & (result.tokens_generated > 1)]}
