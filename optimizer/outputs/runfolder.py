"""The run folder a finished (or interrupted) study leaves behind.

``write_run_outputs(run_dir, study, spec, evaluator)`` writes, for the recommended trial:
the engine configs and bench command (``optimizer.outputs.exports``), ``summary.json`` (objective
values, gains over each baseline, the report, provenance), ``trials.parquet`` (every
trial, built with polars from ``study.trials``), the plots (``optimizer.outputs.plots``) and the
capacity review (``optimizer.outputs.review``). It only reads the study; running it again
regenerates the same files.

The outputs are swapped in whole, so a kill while writing never leaves a file of the new
recommendation beside a summary of the old one: each run writes a new generation folder
``RUN_DIR/.outputs/gen-<pid>-*``, then points the link ``RUN_DIR/.outputs/current`` at it
in one rename. Every output name in the run folder (``summary.json``, ``vllm.yaml``,
``plots``, ...) is a link through ``.outputs/current``, so readers, and scripts that
``scp -r`` or ``cd`` into the folder, see one generation or the other, never a mix. The
study's storage and ``study.json`` and anything else in the folder are left where they are;
a failed write removes its generation, and a later write removes those of dead processes.

The pieces below it work on plain data (trials, PolicyConfig, Report dicts) so they can
be tested and reused without a study.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import polars as pl
from optuna.trial import FrozenTrial, TrialState

from optimizer.outputs import plots
from optimizer.outputs.exports import (
    Deployment,
    TrafficShape,
    engine_yaml,
    goodput_bounds,
    policy_toml,
    read_engine_file,
    write_exports,
)
from optimizer.outputs.review import (
    Capacity,
    ConfigFigures,
    Diagnosis,
    FleetPoint,
    LoadSignals,
    ReviewInputs,
    diagnose,
    gain_ratio,
    routing_label,
    write_review,
)
from optimizer.robust.answer import CANDIDATES, Candidate, robust_answer
from optimizer.robust.choice import ratio
from optimizer.robust.deploy import answer_lines, deployed_fleet, flag_name
from optimizer.robust.fleetsize import MAX_SIZED_REPLICAS, fleet_curve
from optimizer.robust.modelerror import model_error
from optimizer.search.capacity import capacity_many
from optimizer.search.space import Fleet, fleet_of
from optimizer.search.study import BOUNDS_ATTR
from policies.config import FLEET_KNOBS, PolicyConfig
from policies.result import State
from studies.metrics import json_safe, request_latencies

#: Report fields that say what failures cost (see studies.metrics).
FAILURE_FIGURES = ("failure_windows", "failure_affected", "reprefill_tokens", "goodput_during_failures",
                   "goodput_after_failures")
#: Report fields compared between the recommendation and each baseline, and their direction.
GAIN_METRICS = {"weighted_goodput": "maximize", "request_goodput": "maximize", "token_goodput": "maximize",
                "slo_attainment": "maximize", "p99_ttft_ms": "minimize", "p99_tpot_ms": "minimize"}
PACKAGES = ("servetune", "numpy", "numba", "optuna", "polars", "scipy", "matplotlib")
#: The run folder's output generations, and the link to the one its output names show.
OUTPUTS, CURRENT = ".outputs", "current"


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


def select_best(trials: Sequence[FrozenTrial], dirs: Sequence[str], *,
                fewest_gpus_at: float | None = None) -> FrozenTrial:
    """The recommendation: the best first objective among feasible completed trials.

    With several objectives, the Pareto-optimal feasible trial with the best first
    objective (goodput in every mode). When no trial is feasible, the best of all.
    ``fewest_gpus_at`` (an SLO-attainment target, for studies that search the fleet)
    picks instead the Pareto-optimal trial with the fewest GPUs that meets the target,
    the most goodput among equals; when none meets it, the rule above applies.
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
    if fewest_gpus_at is not None:
        meeting = [t for t in pool if _num((trial_report(t) or {}).get("slo_attainment")) >= fewest_gpus_at]
        if meeting:
            return min(meeting, key=lambda t: (t.user_attrs.get("gpus", 0), -sign * t.values[0], t.number))
    return max(pool, key=lambda t: (sign * t.values[0], -t.number))


def recommend(trials: Sequence[FrozenTrial], spec, dirs: Sequence[str]) -> FrozenTrial:
    """The study's recommended trial: ``select_best``, fewest GPUs at the target for goodput-gpus."""
    target = spec.capacity_target if spec.objective == "goodput-gpus" else None
    return select_best(trials, dirs, fewest_gpus_at=target)


def candidates(trials: Sequence[FrozenTrial], spec, dirs: Sequence[str], target,
               presets: Mapping[str, PolicyConfig], limit: int = CANDIDATES) -> list[Candidate]:
    """The search's best ``limit`` feasible trials (``recommend``'s pick first, then by the
    first objective), each as its exported file runs it; baselines and trials whose file
    runs as an earlier one's are left out."""
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.values is not None and is_feasible(t)
                and baseline_name(t) is None]
    if not complete:
        return []
    sign = 1.0 if dirs[0] == "maximize" else -1.0
    first = recommend(trials, spec, dirs)
    ranked = sorted(complete, key=lambda t: (t.number != first.number, -sign * t.values[0], t.number))
    out: list[Candidate] = []
    seen: set[bytes] = set()
    for t in ranked:
        if len(out) == limit:
            break
        fleet = trial_fleet(t, spec)
        try:
            config = file_replay(spec, target, trial_config(t, spec, presets), fleet).config
        except ValueError:  # a file the target refuses is no candidate (ExportError, ConfigError)
            continue
        key = config.to_vector().tobytes() + str(fleet).encode()
        if key not in seen:
            seen.add(key)
            out.append(Candidate(f"trial {t.number}", config, fleet, t))
    return out


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


def trial_fleet(trial: FrozenTrial, spec) -> Fleet:
    """The fleet a trial ran on: stored on it, else its searched params, else the spec's."""
    values = spec.fleet.to_dict()
    for name in values:
        stored = trial.user_attrs.get(name)
        if stored is not None:
            values[name] = int(stored)
    if not any(name in trial.user_attrs for name in values):  # never run: its searched params
        return fleet_of(trial.params, spec.fleet)
    return Fleet(**values)


def fleet_front(trials: Sequence[FrozenTrial]) -> list[FleetPoint]:
    """The feasible trial with the most goodput at each GPU count, fewest GPUs first.

    Empty unless the feasible trials span more than one GPU count (a fleet search).
    """
    best: dict[int, FrozenTrial] = {}
    for t in trials:
        report = trial_report(t)
        if t.state != TrialState.COMPLETE or report is None or not is_feasible(t) or "gpus" not in t.user_attrs:
            continue
        gpus = int(t.user_attrs["gpus"])
        if gpus not in best or _goodput(t) > _goodput(best[gpus]):
            best[gpus] = t
    if len(best) < 2:
        return []
    points, top = [], -math.inf
    for gpus in sorted(best):
        t = best[gpus]
        report = trial_report(t)
        router = (t.user_attrs.get("config") or {}).get("router", "round_robin")
        points.append(FleetPoint(gpus, int(t.user_attrs.get("tp", 1)), int(t.user_attrs.get("replicas", 1)),
                                 _goodput(t), _num(report.get("slo_attainment")), t.number,
                                 pareto=_goodput(t) > top, gain=gain_ratio(_goodput(t), top), router=router))
        top = max(top, _goodput(t))
    return points


def _goodput(t: FrozenTrial) -> float:
    return _num((trial_report(t) or {}).get("weighted_goodput"))


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
        return json.dumps(json_safe(value), sort_keys=True)
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


# -- rate sweep and capacity --------------------------------------------------------------------


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
            attainment[name].append(_num(report.slo_attainment))
            goodput[name].append(_num(report.weighted_goodput))
    return {name: plots.RateCurve(np.asarray(scales) * trace_rps, np.array(attainment[name]), np.array(goodput[name]))
            for name in configs}


def latency_samples(result, trace) -> dict[str, np.ndarray]:
    """TTFT and TPOT (ms) of finished requests; TPOT only where more than one token came out."""
    lat = request_latencies(result, trace)
    finished = result.state == State.FINISHED
    return {"ttft": lat["ttft"][finished], "tpot": lat["tpot"][finished & (result.tokens_generated > 1)]}


# -- the entry point ----------------------------------------------------------------------------


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


@dataclass(frozen=True)
class FileReplay:
    """The recommendation as deployed: the file written for the target, read back as the
    engine runs it, and that config's simulation. Every figure servetune reports for a
    recommendation is this replay's, never the searched trial's."""

    name: str  # the file: vllm.yaml, sglang.yaml or policy.toml
    text: str
    config: PolicyConfig


def file_replay(spec, target, config: PolicyConfig, fleet: Fleet, note: str = "",
                expected: Mapping[str, float] | None = None) -> FileReplay:
    """Write ``config`` as the study's ``target`` writes it and read it back (``optimizer.outputs.exports``)."""
    ctx = spec.context
    if target.what_if:
        text = policy_toml(config, note, what_if=True)
        return FileReplay("policy.toml", text, PolicyConfig.from_toml(text))
    deployment = deployment_of(spec, fleet)
    text = engine_yaml(target, config, deployment, ctx, note, expected)
    replayed = read_engine_file(target, text, ctx, drafter=spec.speculative,
                                fleet_knobs={k: getattr(config, k) for k in FLEET_KNOBS})
    return FileReplay(f"{target.name}.yaml", text, replayed)


def write_run_outputs(run_dir, study, spec, evaluator) -> RunOutputs:
    """Write every run-folder output for the study's recommended trial; return paths and summary.

    The recommended figures are those of the exported file read back and simulated
    (``file_replay``); the run also scores that file and the baselines on the held-out end
    of the trace and at +-20% of its rate (``generalisation``). A folder that cannot be
    written (read-only, a full disk) is an OutputError naming it; the previous outputs stay.
    """
    run_dir = Path(run_dir)
    try:
        with staged_outputs(run_dir) as out:
            outputs = _write_outputs(out, study, spec, evaluator)
    except OSError as exc:
        where = exc.filename or run_dir
        raise OutputError(f"cannot write the outputs to {where}: {exc.strerror or exc}; the study's trials are "
                          "kept and the previous outputs stay; free the disk or fix the folder's permissions, then "
                          f"run `servetune report {run_dir}`") from None
    return RunOutputs({k: run_dir / path.relative_to(out) for k, path in outputs.files.items()}, outputs.summary)


def _write_outputs(out: Path, study, spec, evaluator) -> RunOutputs:
    """``write_run_outputs`` into the folder ``out``."""
    trials = study.get_trials(deepcopy=False)
    dirs, names = directions(study), metric_names(study)
    presets = evaluator.baselines()
    found = baseline_trials(trials)
    answer = robust_answer(spec, evaluator, candidates(trials, spec, dirs, evaluator.target, presets), presets,
                           as_file=lambda config, fleet: file_replay(spec, evaluator.target, config, fleet).config,
                           flag_of=lambda knob: flag_name(evaluator.target, knob), knobs=evaluator.target.knobs)
    best = answer.trial or found.get(answer.reference) or recommend(trials, spec, dirs)
    note = f"servetune study {spec.study_name}, trial {best.number}" + (
        "" if answer.trial is not None else f" ({answer.reference} kept)")
    replay = file_replay(spec, evaluator.target, answer.config, answer.fleet)
    label = replay.name + (f" (trial {best.number})" if answer.trial is not None else " (defaults kept)")
    configs = {label: replay.config, **presets}
    fleets = [answer.fleet, *[spec.fleet] * len(presets)]  # baselines: the deployment's fleet
    trial_of = {label: answer.trial, **{name: found.get(name) for name in presets}}
    sizing = {label: answer.sizing["recommended"], **{name: answer.sizing[name] for name in presets}}

    traffic = TrafficShape.of(evaluator.trace)
    found_capacity = capacity_many(evaluator, list(configs.values()), spec.capacity_target, fleets=fleets)
    curves = rate_curves(evaluator, configs, sweep_scales([c.rate_scale for c in found_capacity]), traffic.rate_rps,
                         fleets)
    evaluated = []
    runs = evaluator.simulate_batch(list(configs.values()), fleets=fleets)
    for (name, config), fleet, (result, report), cap in zip(configs.items(), fleets, runs, found_capacity,
                                                            strict=True):
        capacity = Capacity(cap.rate_scale, traffic.rate_rps, fleet.replicas, fleet.tp, capped=not cap.bracketed,
                            sized=sizing[name])
        # What limits a config shows where it saturates: at its capacity, not at a light trace rate.
        limit_scale = cap.rate_scale if cap.rate_scale > 0 else 1.0
        at_limit, limit_report = evaluator.simulate(config, rate_scale=limit_scale, fleet=fleet)
        diagnosis = diagnose(LoadSignals.of(at_limit, limit_report.to_dict()))
        evaluated.append(Evaluated(name, config, fleet, trial_of[name], result, report.to_dict(), curves[name],
                                   capacity, diagnosis, limit_scale * traffic.rate_rps))
    recommended, baselines = evaluated[0], evaluated[1:]

    # the file deploys the sized fleet where the engine carries it; its header states that fleet's figures
    deploy_fleet, carried = deployed_fleet(spec, evaluator, answer)
    deployment = deployment_of(spec, recommended.fleet)  # what the review's figures ran on
    files: dict[str, Path] = {}
    deployed = (recommended.report if deploy_fleet == recommended.fleet else
                evaluator.reports([replay.config], fleets=[deploy_fleet])[0].to_dict())
    expected = {k: deployed[k] for k in ("request_goodput", "slo_attainment", "p99_ttft_ms", "p99_tpot_ms")
                if deployed.get(k) is not None}
    lines = answer_lines(answer, evaluator.target, spec, carried)  # the header, review and summary say the same
    header = "\n".join([note, *lines])
    files.update(write_exports(out, evaluator.target, replay.config, deployment_of(spec, deploy_fleet), spec.context,
                               note=header, expected=expected))
    if not evaluator.target.what_if:
        files.update(write_bench_replay(out, spec, evaluator, replay, deploy_fleet, expected))
    generalisation = generalisation_check(spec, evaluator, {e.name: e.config for e in evaluated},
                                          [e.fleet for e in evaluated])
    plot_files = _write_plots(out / "plots", study, trials, dirs, names, evaluated, evaluator.trace, spec,
                              traffic.rate_rps, gpu_curves(evaluator, evaluated))
    files.update(plot_files)
    review = ReviewInputs(
        title=f"Capacity review: {spec.study_name}",
        deployment=deployment, slos=spec.slos, target_attainment=spec.capacity_target,
        trace_description=(f"{spec.trace.name}, {evaluator.trace.n} requests at {traffic.rate_rps:.3g} req/s "
                           f"(burstiness {traffic.burstiness:.2g}, mean {traffic.mean_prompt_tokens} prompt / "
                           f"{traffic.mean_output_tokens} output tokens)"),
        best=_figures(recommended), baselines=[_figures(e) for e in baselines],
        objectives=tuple(zip(names, best.values, dirs, strict=True)),
        plots={caption: str(path.relative_to(out)) for caption, path in plot_files.items()
               if path.suffix == ".png"},
        notes=_notes(best, recommended, evaluated, spec, evaluator.target, generalisation,
                     residual(evaluator.cost_model)),
        fleet_front=fleet_front(trials),
        failures=None if spec.failures is None else spec.failures.describe(),
        answer=lines,
    )
    files["capacity-review.md"], files["capacity-review.html"] = write_review(out, review)

    summary = _summary(study, spec, evaluator, best, names, dirs, recommended, baselines, traffic)
    summary["recommendation"] = {"engine": evaluator.target.name, "version": evaluator.target.version,
                                 "what_if": evaluator.target.what_if, "file": replay.name,
                                 "figures_are": "the exported file, read back and simulated"}
    summary["generalisation"] = generalisation
    summary["answer"] = {**answer.to_dict(), "lines": lines,
                         "deploy": {**deploy_fleet.to_dict(), "gpus": deploy_fleet.gpus,
                                    "replicas_in_file": carried, "report": deployed}}
    summary["verdict"] = verdict(recommended, baselines, spec.capacity_target)
    if evaluator.target.what_if:
        summary["oracle_upper_bound"] = oracle_bound(spec, evaluator, {e.name: e.config for e in evaluated},
                                                     [e.fleet for e in evaluated])
    files["summary.json"] = out / "summary.json"
    files["summary.json"].write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    files["trials.parquet"] = out / "trials.parquet"
    trials_frame(trials, names).write_parquet(files["trials.parquet"])
    return RunOutputs(files, summary)


@contextmanager
def staged_outputs(run_dir: Path) -> Iterator[Path]:
    """A new generation folder to write the outputs into: swapped in whole when the body
    returns, removed when it raises (see the module docstring)."""
    home = run_dir / OUTPUTS
    home.mkdir(parents=True, exist_ok=True)
    gen = Path(tempfile.mkdtemp(prefix=f"gen-{os.getpid()}-", dir=home))
    gen.chmod(0o755)  # mkdtemp's 0700 would hide the outputs from other users
    try:
        yield gen
    except BaseException:
        shutil.rmtree(gen, ignore_errors=True)
        raise
    _swap_in(run_dir, gen)


def _swap_in(run_dir: Path, gen: Path) -> None:
    """Link each of ``gen``'s names from the run folder, then make ``gen`` current in one rename."""
    from optimizer.search.study import alive

    names = {p.name for p in gen.iterdir()}
    for name in sorted(names):
        link, target = run_dir / name, f"{OUTPUTS}/{CURRENT}/{name}"
        if link.is_symlink() and os.readlink(link) == target:
            continue
        if link.is_dir() and not link.is_symlink():  # a folder written before generations (plots)
            shutil.rmtree(link)
        _replace_link(link, target)
    _replace_link(gen.parent / CURRENT, gen.name)
    for link in run_dir.iterdir():  # outputs the new generation has not, or links a kill left half made
        if link.is_symlink() and os.readlink(link).startswith(f"{OUTPUTS}/") and link.name not in names:
            link.unlink()
    for old in gen.parent.glob("gen-*"):
        pid = old.name.split("-")[1]
        if old != gen and not (pid.isdigit() and int(pid) != os.getpid() and alive(int(pid))):
            shutil.rmtree(old, ignore_errors=True)


def _replace_link(link: Path, target: str) -> None:
    """Make ``link`` point at ``target`` in one rename (readers see the old or the new)."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def write_bench_replay(run_dir: Path, spec, evaluator, replay: FileReplay, fleet: Fleet,
                       expected: Mapping[str, float]) -> dict[str, Path]:
    """The bench replay of the exported file (``optimizer.bench.scripts``): the whole study
    trace as a timed replay sends it, and that file simulated on exactly that."""
    from optimizer.bench.results import RequestTimes
    from optimizer.bench.scripts import write_bench
    from studies.replay import as_replayed

    replayed = as_replayed(evaluator.full_trace)
    result = evaluator.simulate_on(replayed, replay.config, fleet)
    name = evaluator.target.name
    deployment = {"model": spec.model, "gpu": spec.gpu, **fleet.to_dict(), "framework": spec.framework}
    return write_bench(run_dir, engine=name, config_file=replay.name, server=f"{name} serve --config {replay.name}",
                       deployment=deployment, trace=replayed, slos=spec.slos,
                       simulated=RequestTimes.simulated(result, replayed), study=spec.study_name,
                       study_figures=expected, fleet_knobs={k: getattr(replay.config, k) for k in FLEET_KNOBS})


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
        goodput = {n: _num(r.weighted_goodput) for n, r in zip(names, reports, strict=True)}
        mine = goodput[names[0]]
        out["scales"][f"x{scale:g}"] = {
            "weighted_goodput": goodput,
            "slo_attainment": {n: _num(r.slo_attainment) for n, r in zip(names, reports, strict=True)},
            "gain": {n: ratio(mine, goodput[n]) for n in names[1:]}}
    return out


def oracle_bound(spec, evaluator, configs: Mapping[str, PolicyConfig], fleets: Sequence[Fleet]) -> dict[str, Any]:
    """The same configs with every request's true output length known to SJF (the
    ``oracle`` predictor): an upper bound on what any length predictor could add, never a
    recommendation's figure."""
    from studies.lengths import Predictor

    oracle = evaluator.on(Predictor.parse("oracle").apply(evaluator.trace, seed=spec.seed))
    reports = oracle.reports(list(configs.values()), fleets=list(fleets))
    goodput = {n: _num(r.weighted_goodput) for n, r in zip(configs, reports, strict=True)}
    names = list(configs)
    return {"label": "upper bound: SJF told each request's true output length (no scheduler knows it)",
            "weighted_goodput": goodput,
            "gain": {n: ratio(goodput[names[0]], _num(evaluator.reports([configs[n]], fleets=[f])[0].weighted_goodput))
                     for n, f in zip(names[1:], list(fleets)[1:], strict=True)}}


def verdict(recommended: Evaluated, baselines: Sequence[Evaluated], target: float) -> dict[str, Any]:
    """What to lead with: a gain when some baseline meets the SLOs, else the capacity answer
    (the GPUs the recommendation needs to meet them), since a ratio over a baseline that
    serves nothing well says nothing a user can act on."""
    met = [b.name for b in baselines if _num(b.report.get("slo_attainment")) >= target]
    cap = recommended.capacity
    if met or not baselines:
        return {"kind": "gain", "baselines_meeting_target": met}
    return {"kind": "capacity", "baselines_meeting_target": [], "target_attainment": target,
            "gpus_needed": cap.gpus_needed, "replicas_needed": cap.replicas_needed, "max_rps": cap.max_rps,
            "capped": cap.capped}


def deployment_of(spec, fleet: Fleet | None = None) -> Deployment:
    """Where a config runs: the spec's model and GPU on ``fleet`` (default: the spec's)."""
    fleet = fleet or spec.fleet
    return Deployment(spec.model, tp=fleet.tp, replicas=fleet.replicas, gpu=spec.gpu, drafter=spec.speculative,
                      moe_ep=fleet.moe_ep, attention_dp=fleet.attention_dp)


def _figures(e: Evaluated) -> ConfigFigures:
    return ConfigFigures(e.name, e.config, e.report, e.capacity, e.diagnosis,
                         trial=e.trial.number if e.trial else None, diagnosed_at_rps=e.diagnosed_at_rps)


def gpu_curves(evaluator, evaluated: Sequence[Evaluated]) -> dict[str, list[tuple[int, float, float]]]:
    """Attainment and goodput of each config's fleet at every replica count up to one past the
    largest count sized (the GPUs plot; the sizing's own runs, cached, and those between)."""
    counts = [e.capacity.replicas_needed for e in evaluated if e.capacity.replicas_needed is not None]
    highest = min(max(counts, default=1) + 1, MAX_SIZED_REPLICAS)
    return {e.name: fleet_curve(evaluator, e.config, e.fleet, highest) for e in evaluated}


def _write_plots(plot_dir: Path, study, trials, dirs, names, evaluated: Sequence[Evaluated], trace, spec,
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
    points = [plots.TrialPoint(t.number, t.values[0], _num((trial_report(t) or {}).get("p99_ttft_ms")),
                               is_feasible(t), baseline_name(t)) for t in complete]
    return points, (names[0], "p99 TTFT (ms)"), (dirs[0], "minimize")


#: What stands behind a gain on an attention-DP layout: the groups' lockstep is simulated
#: (``policies.engine.lockstep``), but no measured run of the engines' DP checks it.
ATTENTION_DP_CAVEAT = ("Attention DP is simulated as groups stepping together, each step as long as the slowest "
                       "group's, its MoE layers over every group's tokens; no measured vLLM or SGLang DP run has "
                       "checked this (the only measured DP runs are six of TensorRT-LLM's, whose calibration ends "
                       "a term on its limit): measure a DP layout with the bench script before relying on its "
                       "gain.")


def _notes(best: FrozenTrial, recommended: Evaluated, evaluated: Sequence[Evaluated], spec, target,
           generalisation: Mapping[str, Any] | None = None, calibration: Mapping[str, Any] | None = None) -> list[str]:
    notes = []
    if target.what_if:
        notes.append("WHAT-IF: this recommendation uses servetune's own policies, which no engine runs; its gain is "
                     "what this traffic would gain if your engine had them (policy.toml only).")
    else:
        notes.append(f"Every figure of the recommendation is the exported {target.name}.yaml, read back as "
                     f"{target.display} {target.version} runs it and simulated.")
    if generalisation is not None:
        at = generalisation["scales"].get("x1", {}).get("gain", {})
        notes.append(f"Held out: tuned on the first {1 - spec.holdout:.0%} of the trace window; on the last "
                     f"{spec.holdout:.0%} ({generalisation['requests']} requests) the gain is "
                     + ", ".join(f"{g:.2f}x over {n}" if math.isfinite(g) else f"unbounded over {n}"
                                 for n, g in at.items()) + ".")
    if calibration is not None:
        which = ("no calibration" if calibration.get("file") is None else
                 f"calibration {calibration['file']} ({calibration['match']} entry, fitted on "
                 + ", ".join(calibration.get("models") or [calibration.get("model", "?")]) + ")")
        notes.append(f"Cost model: {which}; its error: {calibration['stated_error']}. Read every gain against it.")
    if not is_feasible(best):
        violated = ", ".join(k for k, v in best.constraints.items() if v > 0)
        notes.append(f"No trial met every constraint; trial {best.number} is the best of all and violates {violated}.")
    if spec.objective == "goodput-gpus":
        notes.append(f"Goodput vs GPUs: the recommendation is the fewest GPUs on the Pareto front that keep SLO "
                     f"attainment >= {spec.capacity_target:.0%} (the most goodput if none does).")
    if recommended.fleet != spec.fleet:
        notes.append(f"The recommendation runs on {recommended.fleet.describe()}; the baselines on the "
                     f"deployment's {spec.fleet.describe()}.")
    if any(e.fleet.schedulers > 1 for e in evaluated):
        notes.append("Replicas are simulated as one fleet under one clock, each request routed by the config's "
                     "router as it arrives: "
                     + "; ".join(f"{e.name}: {routing_label(e.config, e.fleet.schedulers)}" for e in evaluated)
                     + ". The fleet's KV high-water is the sum of the replicas' peaks.")
    if any(e.fleet.attention_dp > 1 for e in evaluated):
        notes.append(ATTENTION_DP_CAVEAT)
    if spec.failures is not None:
        notes.append(f"Every simulation ran with the study's failures ({spec.failures.describe()}), compressed "
                     "with the trace at other arrival rates.")
    out_of_range = recommended.report.get("out_of_range_steps")
    if out_of_range:
        notes.append(f"{out_of_range} simulated steps fell outside the profiled step-time tables; "
                     "their timing is extrapolated and less certain.")
    return notes


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


def _summary(study, spec, evaluator, best: FrozenTrial, names, dirs, recommended: Evaluated,
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


# -- helpers ------------------------------------------------------------------------------------


def _num(value: Any) -> float:
    return math.nan if value is None else float(value)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


# -- reading a run folder back ------------------------------------------------------------------


def target_folders(run_dir: str | Path) -> list[Path]:
    """The run folders below a study folder (``runs/<study>/<target>``), or the folder itself
    when it is one; empty when neither."""
    from optimizer.search.study import MANIFEST

    run_dir = Path(run_dir)
    if (run_dir / MANIFEST).is_file():
        return [run_dir]
    return sorted(p.parent for p in run_dir.glob(f"*/{MANIFEST}")) if run_dir.is_dir() else []


def target_folder(run_dir: str | Path, target: str | None) -> Path:
    """The run folder of ``target`` in a study folder (or ``run_dir`` itself when it is a run
    folder); OutputError naming the targets found when it is ambiguous or missing."""
    run_dir = Path(run_dir)
    found = target_folders(run_dir)
    if found == [run_dir]:
        return run_dir
    names = [p.name for p in found]
    if target is not None and target in names:
        return run_dir / target
    if target is None and len(found) == 1:
        return found[0]
    if not found:
        return run_dir  # open_run names what is missing
    raise OutputError(f"{run_dir} holds the studies of {names}; pass --backend NAME or one of "
                      + ", ".join(str(p) for p in found))


def open_run(run_dir: str | Path, storage: str | None = None):
    """(spec, study) of a run folder, from its ``study.json`` manifest and its storage.

    ``storage`` (or ``SERVETUNE_STORAGE``) is needed when the study lives in a database:
    the manifest keeps its URL without the password. Works from any working directory
    (``stored_paths``).
    """
    import os

    from optimizer.search.spec import spec_from_dict
    from optimizer.search.study import JOURNAL, MANIFEST, open_storage

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise OutputError(f"run folder {run_dir} does not exist")
    manifest_path = run_dir / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise OutputError(f"{run_dir} has no {MANIFEST}: not a servetune run folder") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise OutputError(f"{manifest_path} is unreadable ({exc})") from None
    stored = manifest.get("storage") or JOURNAL
    url = storage or os.environ.get("SERVETUNE_STORAGE")
    if url is None:
        if "***" in stored:
            raise OutputError(f"study {manifest.get('study_name')!r} lives in {stored}; pass --storage with the "
                              "full URL (or set SERVETUNE_STORAGE)")
        url = stored if "://" in stored else str(run_dir / stored)
        if "://" not in url and not Path(url).is_file():
            raise OutputError(f"run folder {run_dir} has no study storage {url}")
    stored_spec = manifest.get("spec", {})
    spec = spec_from_dict(stored_spec, storage=url, run_dir=run_dir, **stored_paths(stored_spec, run_dir))
    try:
        study = optuna.load_study(study_name=spec.study_name, storage=open_storage(spec))
    except KeyError:
        raise OutputError(f"no study {spec.study_name!r} in {redact_url(url)}") from None
    return spec, study


def stored_paths(stored: Mapping[str, Any], run_dir: Path) -> dict[str, Path]:
    """The trace, calibration and model-config paths of a manifest's spec, made absolute.

    Manifests store them absolute; older ones as given to ``tune``, relative to where it
    ran: the folder from which the stored ``run_dir`` leads to ``run_dir`` (else the
    current one).
    """
    given = {"trace": (stored.get("trace") or {}).get("path"),
             **{k: (stored.get("deployment") or {}).get(k) for k in ("calibration", "model_config")}}
    relative = Path((stored.get("study") or {}).get("run_dir") or "")
    here = run_dir.resolve()
    origin = Path.cwd()
    if relative.parts and not relative.is_absolute() and here.parts[-len(relative.parts):] == relative.parts:
        origin = here.parents[len(relative.parts) - 1]
    return {k: origin / v for k, v in given.items() if isinstance(v, str)}
