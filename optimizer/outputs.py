"""The run folder a finished (or interrupted) study leaves behind.

``write_run_outputs(run_dir, study, spec, evaluator)`` writes, for the recommended trial:
the engine configs and bench command (``optimizer.exports``), ``summary.json`` (objective
values, gains over each baseline, the report, provenance), ``trials.parquet`` (every
trial, built with polars from ``study.trials``), the plots (``optimizer.plots``) and the
capacity review (``optimizer.review``). It only reads the study; running it again
regenerates the same files.

The pieces below it work on plain data (trials, PolicyConfig, Report dicts) so they can
be tested and reused without a study.
"""

from __future__ import annotations

import json
import math
import platform
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import polars as pl
from optuna.trial import FrozenTrial, TrialState

from optimizer import plots
from optimizer.exports import Deployment, TrafficShape, write_exports
from optimizer.review import (
    Capacity,
    ConfigFigures,
    LoadSignals,
    ReviewInputs,
    diagnose,
    gain_ratio,
    write_review,
)
from policies.config import PolicyConfig
from policies.result import State
from studies.metrics import request_latencies

#: Report fields compared between the recommendation and each baseline, and their direction.
GAIN_METRICS = {"weighted_goodput": "maximize", "request_goodput": "maximize", "token_goodput": "maximize",
                "slo_attainment": "maximize", "p99_ttft_ms": "minimize", "p99_tpot_ms": "minimize"}
SWEEP_POINTS = 9
PACKAGES = ("servetune", "numpy", "numba", "optuna", "polars", "scipy", "matplotlib")


class OutputError(ValueError):
    """A study that cannot be summarised yet (no completed trial, unknown trial number)."""


@dataclass(frozen=True)
class RunOutputs:
    """The files written (name -> path) and the summary that went into summary.json."""

    files: dict[str, Path]
    summary: dict[str, Any]


# -- reading trials -----------------------------------------------------------------------------


def directions(study: optuna.Study) -> list[str]:
    return [d.name.lower() for d in study.directions]


def metric_names(study: optuna.Study) -> list[str]:
    names = study.metric_names
    if names:
        return list(names)
    return ["value"] if len(study.directions) == 1 else [f"objective_{i}" for i in range(len(study.directions))]


def is_feasible(trial: FrozenTrial) -> bool:
    """Every constraint met (Optuna's convention: a value <= 0 is feasible)."""
    return all(v <= 0 for v in trial.constraints.values())


def baseline_name(trial: FrozenTrial) -> str | None:
    return trial.user_attrs.get("baseline")


def trial_report(trial: FrozenTrial) -> dict[str, Any] | None:
    """The Report dict the objective stored on the trial, if any."""
    report = trial.user_attrs.get("report")
    return report if isinstance(report, dict) else None


def select_best(trials: Sequence[FrozenTrial], dirs: Sequence[str]) -> FrozenTrial:
    """The recommendation: the best first objective among feasible completed trials.

    With several objectives, the Pareto-optimal feasible trial with the best first
    objective (goodput in every mode). When no trial is feasible, the best of all.
    """
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.values is not None]
    if not complete:
        raise OutputError("the study has no completed trial yet; run `servetune tune` first")
    pool = [t for t in complete if is_feasible(t)] or complete
    if len(dirs) > 1:
        xy = np.array([t.values[:2] for t in pool], dtype=np.float64)
        front = plots.pareto_mask(xy, (dirs[0], dirs[1]))
        pool = [t for t, keep in zip(pool, front, strict=True) if keep] or pool
    sign = 1.0 if dirs[0] == "maximize" else -1.0
    return max(pool, key=lambda t: (sign * t.values[0], -t.number))


def baseline_trials(trials: Sequence[FrozenTrial]) -> dict[str, FrozenTrial]:
    """The first completed trial of each baseline, by name."""
    found: dict[str, FrozenTrial] = {}
    for t in trials:
        name = baseline_name(t)
        if name and name not in found and t.state == TrialState.COMPLETE:
            found[name] = t
    return found


def trial_config(trial: FrozenTrial, spec, baselines: Mapping[str, PolicyConfig]) -> PolicyConfig:
    """The full config a trial ran: stored on it, a baseline by name, or rebuilt from its params."""
    stored = trial.user_attrs.get("config")
    if isinstance(stored, dict):
        return PolicyConfig.from_mapping(stored)
    name = baseline_name(trial)
    if name is not None:
        if name not in baselines:
            raise OutputError(f"trial {trial.number} is baseline {name!r}, which this study does not define")
        return baselines[name]
    return spec.search_space.suggest(optuna.trial.FixedTrial(trial.params, trial.number))


def find_trial(trials: Sequence[FrozenTrial], number: int) -> FrozenTrial:
    for t in trials:
        if t.number == number:
            if t.state != TrialState.COMPLETE:
                raise OutputError(f"trial {number} is {t.state.name.lower()}, not complete")
            return t
    raise OutputError(f"no trial {number} in this study (trials 0..{len(trials) - 1})")


# -- trials.parquet -----------------------------------------------------------------------------


def trials_frame(trials: Sequence[FrozenTrial], names: Sequence[str]) -> pl.DataFrame:
    """One row per trial: values by metric name, params, constraints, the report's scalars.

    Column prefixes follow Optuna's ``trials_dataframe``: ``params_``, ``user_attrs_``,
    plus ``constraints_`` and ``report_``; nested report parts are JSON strings.
    """
    rows = []
    for t in trials:
        row: dict[str, Any] = {
            "number": t.number,
            "state": t.state.name,
            "baseline": baseline_name(t),
            "feasible": is_feasible(t) if t.state == TrialState.COMPLETE else None,
            "datetime_start": t.datetime_start,
            "datetime_complete": t.datetime_complete,
            "duration_s": t.duration.total_seconds() if t.duration is not None else None,
        }
        for i, name in enumerate(names):
            row[f"values_{name}"] = t.values[i] if t.values is not None else None
        row.update({f"params_{k}": v for k, v in t.params.items()})
        row.update({f"constraints_{k}": v for k, v in t.constraints.items()})
        for key, value in t.user_attrs.items():
            if key == "report" and isinstance(value, dict):
                row.update({f"report_{k}": _cell(v) for k, v in value.items()})
            elif key not in ("baseline",):
                row[f"user_attrs_{key}"] = _cell(value)
        rows.append(row)
    columns: dict[str, list[Any]] = {}
    for i, row in enumerate(rows):
        for key, value in row.items():
            columns.setdefault(key, [None] * len(rows))[i] = value
    return pl.DataFrame({k: pl.Series(k, v, strict=False) for k, v in columns.items()})


def _cell(value: Any) -> Any:
    """A parquet-friendly scalar: nested values as JSON text."""
    if isinstance(value, dict | list | tuple):
        return json.dumps(_json_safe(value), sort_keys=True)
    return value


# -- summary.json -------------------------------------------------------------------------------


def gains(best: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per report metric: both values, the relative change, and whether the best is better."""
    out = {}
    for key, direction in GAIN_METRICS.items():
        mine, theirs = _num(best.get(key)), _num(baseline.get(key))
        change = gain_ratio(mine, theirs)
        better = None
        if math.isfinite(mine) and math.isfinite(theirs):
            better = mine > theirs if direction == "maximize" else mine < theirs
        out[key] = {"best": _finite(mine), "baseline": _finite(theirs), "change": change, "better": better}
    return out


def provenance(spec, evaluator) -> dict[str, Any]:
    """Where the numbers came from: trace content, cost model, versions, seed, command line."""
    from optimizer.spec import file_sha256

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
        "cost_model": {"name": cost_model.name, "source": cost_model.source, "tp": cost_model.tp},
        "versions": versions,
        "seed": spec.seed,
        "command": shlex.join(sys.argv),
        "storage": redact_url(spec.storage) if spec.storage else None,
        "written_utc": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def redact_url(url: str) -> str:
    """A storage URL without its password, safe to write into a summary."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


# -- rate sweep and capacity --------------------------------------------------------------------


def sweep_scales(capacities: Sequence[float]) -> np.ndarray:
    """Rate scales that bracket every config's capacity, plus the trace's own rate (1.0)."""
    known = [c for c in capacities if math.isfinite(c) and c > 0]
    low = min(known, default=1.0) * 0.25
    high = max(max(known, default=1.0) * 2.0, 1.5)
    return np.unique(np.round(np.concatenate([np.geomspace(low, high, SWEEP_POINTS), [1.0]]), 6))


def capacity_from_curve(scales: np.ndarray, attainment: np.ndarray, target: float) -> tuple[float, bool]:
    """Highest scale with attainment >= target, interpolated at the crossing; (scale, capped).

    0.0 when even the lowest scale misses the target; capped when the highest meets it.
    """
    order = np.argsort(scales)
    scales, attainment = np.asarray(scales)[order], np.nan_to_num(np.asarray(attainment)[order])
    ok = attainment >= target
    if not ok[0]:
        return 0.0, False
    first_miss = np.flatnonzero(~ok)
    if not len(first_miss):
        return float(scales[-1]), True
    j = first_miss[0]
    a0, a1 = attainment[j - 1], attainment[j]
    t = (a0 - target) / (a0 - a1) if a0 != a1 else 0.0
    return float(scales[j - 1] + t * (scales[j] - scales[j - 1])), False


def rate_curve(evaluator, config: PolicyConfig, scales: np.ndarray, trace_rps: float) -> plots.RateCurve:
    attainment, goodput = [], []
    for scale in scales:
        _, report = evaluator.simulate(config, rate_scale=float(scale))
        attainment.append(_num(report.slo_attainment))
        goodput.append(_num(report.weighted_goodput))
    return plots.RateCurve(np.asarray(scales) * trace_rps, np.array(attainment), np.array(goodput))


def latency_samples(result, trace) -> dict[str, np.ndarray]:
    """TTFT and TPOT (ms) of finished requests; TPOT only where more than one token came out."""
    lat = request_latencies(result, trace)
    finished = result.state == State.FINISHED
    return {"ttft": lat["ttft"][finished], "tpot": lat["tpot"][finished & (result.tokens_generated > 1)]}


# -- the entry point ----------------------------------------------------------------------------


def write_run_outputs(run_dir, study, spec, evaluator) -> RunOutputs:
    """Write every run-folder output for the study's recommended trial; return paths and summary."""
    run_dir = Path(run_dir)
    plot_dir = run_dir / "plots"
    trials = study.get_trials(deepcopy=False)
    dirs, names = directions(study), metric_names(study)
    best = select_best(trials, dirs)
    presets = evaluator.baselines()
    best_config = trial_config(best, spec, presets)
    found = baseline_trials(trials)
    configs = {f"best (trial {best.number})": best_config, **presets}
    runs = {name: evaluator.simulate(config) for name, config in configs.items()}
    reports = {name: report.to_dict() for name, (_, report) in runs.items()}
    best_name = next(iter(configs))

    deployment = deployment_of(spec, evaluator)
    traffic = TrafficShape.of(evaluator.trace)
    target = spec.capacity_target
    capacities = {name: _capacity(evaluator, config, target) for name, config in configs.items()}
    scales = sweep_scales([c for c, _ in capacities.values()])
    curves = {name: rate_curve(evaluator, config, scales, traffic.rate_rps) for name, config in configs.items()}

    files: dict[str, Path] = {}
    best_report = reports[best_name]
    note = f"servetune study {spec.study_name}, trial {best.number}"
    expected = {k: best_report[k] for k in ("request_goodput", "slo_attainment", "p99_ttft_ms", "p99_tpot_ms")
                if best_report.get(k) is not None}
    files.update(write_exports(run_dir, best_config, deployment, spec.slos, traffic, seed=spec.seed, note=note,
                               expected=expected))

    files.update(_write_plots(plot_dir, study, trials, dirs, names, found, reports, curves, runs, evaluator, spec,
                              traffic.rate_rps))
    figures = []
    for name, config in configs.items():
        scale, capped = capacities[name]
        result, _ = runs[name]
        figures.append(ConfigFigures(
            name, config, reports[name], Capacity(scale, traffic.rate_rps, deployment, capped),
            diagnose(LoadSignals.of(result, reports[name], spec.replicas)),
            trial=best.number if name == best_name else (found[name].number if name in found else None)))
    review = ReviewInputs(
        title=f"Capacity review: {spec.study_name}",
        deployment=deployment, slos=spec.slos, target_attainment=target,
        trace_description=(f"{spec.trace.name}, {evaluator.trace.n} requests at {traffic.rate_rps:.3g} req/s "
                           f"(burstiness {traffic.burstiness:.2g}, mean {traffic.mean_prompt_tokens} prompt / "
                           f"{traffic.mean_output_tokens} output tokens)"),
        best=figures[0], baselines=figures[1:],
        objectives=tuple(zip(names, best.values, dirs, strict=True)),
        plots={caption: str(path.relative_to(run_dir)) for caption, path in files.items()
               if path.suffix == ".png" and path.parent == plot_dir},
        notes=_notes(best, reports[best_name]),
    )
    md, page = write_review(run_dir, review)
    files["capacity-review.md"], files["capacity-review.html"] = md, page

    summary = _summary(study, spec, evaluator, best, best_config, found, reports, best_name, dirs, names,
                       {name: capacities[name] for name in configs}, traffic)
    files["summary.json"] = run_dir / "summary.json"
    files["summary.json"].write_text(json.dumps(_json_safe(summary), indent=2) + "\n")
    files["trials.parquet"] = run_dir / "trials.parquet"
    trials_frame(trials, names).write_parquet(files["trials.parquet"])
    return RunOutputs(files, summary)


def deployment_of(spec, evaluator) -> Deployment:
    cost_model = evaluator.cost_model
    reserved = cost_model.reserved_bytes / cost_model.gpu_memory_bytes if cost_model.gpu_memory_bytes else 0.0
    return Deployment(spec.model, tp=spec.tp, replicas=spec.replicas, gpu=spec.gpu, reserved_fraction=reserved)


def _capacity(evaluator, config: PolicyConfig, target: float) -> tuple[float, bool]:
    from optimizer.capacity import max_rate_scale

    found = max_rate_scale(evaluator, config, target)
    return float(found.scale), bool(found.capped)


def _write_plots(plot_dir: Path, study, trials, dirs, names, found, reports, curves, runs, evaluator, spec,
                 trace_rps) -> dict[str, Path]:
    files: dict[str, Path] = {}

    def save(caption: str, fig, stem: str) -> None:
        png, svg = plots.save_figure(fig, plot_dir / stem)
        files[caption] = png
        files[f"{caption} (SVG)"] = svg

    points, axis_names, axis_dirs = _pareto_points(trials, dirs, names)
    save("Pareto front", plots.pareto_figure(points, axis_names, axis_dirs), "pareto")
    save("SLO attainment and goodput vs arrival rate",
         plots.rate_sweep_figure(curves, spec.capacity_target, trace_rps), "rate-sweep")
    samples = {name: latency_samples(result, evaluator.trace) for name, (result, _) in runs.items()}
    strictest = {k: min((getattr(c, f"{k}_ms") for c in spec.slos.classes if getattr(c, f"{k}_ms") is not None),
                        default=None) for k in ("ttft", "tpot")}
    save("TTFT and TPOT CDFs", plots.latency_cdf_figure(samples, strictest), "latency-cdf")
    importances = plots.param_importances(study, target=lambda t: t.values[0])
    if importances:
        save("Parameter importances", plots.importance_figure(importances), "importance")
    return files


def _pareto_points(trials, dirs, names) -> tuple[list[plots.TrialPoint], tuple[str, str], tuple[str, str]]:
    """Two objectives when the study has them; else goodput against p99 TTFT from the reports."""
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.values is not None]
    if len(dirs) > 1:
        points = [plots.TrialPoint(t.number, t.values[0], t.values[1], is_feasible(t), baseline_name(t))
                  for t in complete]
        return points, (names[0], names[1]), (dirs[0], dirs[1])
    points = []
    for t in complete:
        report = trial_report(t) or {}
        points.append(plots.TrialPoint(t.number, t.values[0], _num(report.get("p99_ttft_ms")), is_feasible(t),
                                       baseline_name(t)))
    return points, (names[0], "p99 TTFT (ms)"), (dirs[0], "minimize")


def _notes(best: FrozenTrial, report: Mapping[str, Any]) -> list[str]:
    notes = []
    if not is_feasible(best):
        violated = ", ".join(k for k, v in best.constraints.items() if v > 0)
        notes.append(f"No trial met every constraint; trial {best.number} is the best of all and violates {violated}.")
    if report.get("out_of_range_steps"):
        notes.append(f"{report['out_of_range_steps']} simulated steps fell outside the profiled step-time tables; "
                     "their timing is extrapolated and less certain.")
    return notes


def _summary(study, spec, evaluator, best, best_config, found, reports, best_name, dirs, names, capacities,
             traffic) -> dict[str, Any]:
    best_report = reports[best_name]
    baselines = {}
    for name, report in reports.items():
        if name == best_name:
            continue
        trial = found.get(name)
        entry: dict[str, Any] = {"trial": trial.number if trial else None,
                                 "config": evaluator.baselines()[name].to_dict(), "report": report,
                                 "gains": gains(best_report, report)}
        if trial is not None:
            entry["values"] = dict(zip(names, trial.values, strict=True))
            entry["objective_gains"] = {
                n: {"best": b, "baseline": v, "change": gain_ratio(b, v),
                    "better": b > v if d == "maximize" else b < v}
                for n, b, v, d in zip(names, best.values, trial.values, dirs, strict=True)}
        entry["capacity_rate_scale"], entry["capacity_capped"] = capacities[name]
        baselines[name] = entry
    states = [t.state.name.lower() for t in study.get_trials(deepcopy=False)]
    scale, capped = capacities[best_name]
    return {
        "study": spec.study_name,
        "objective": spec.objective,
        "metric_names": names,
        "directions": dirs,
        "trials": {state: states.count(state) for state in sorted(set(states))},
        "best": {"trial": best.number, "feasible": is_feasible(best), "values": dict(zip(names, best.values, strict=True)),
                 "constraints": dict(best.constraints), "params": dict(best.params), "config": best_config.to_dict(),
                 "report": best_report, "capacity_rate_scale": scale, "capacity_capped": capped},
        "baselines": baselines,
        "deployment": {"model": spec.model, "gpu": spec.gpu, "tp": spec.tp, "replicas": spec.replicas,
                       "framework": spec.framework},
        "slo": spec.slos.describe(),
        "capacity_target": spec.capacity_target,
        "traffic": {"requests": traffic.n_requests, "rate_rps": traffic.rate_rps, "burstiness": traffic.burstiness},
        "provenance": provenance(spec, evaluator),
    }


# -- helpers ------------------------------------------------------------------------------------


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value
