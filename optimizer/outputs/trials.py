"""Reading a study's trials: which one the run folder recommends, and what each ran.

The recommendation (``recommend``), the candidates the robust answer weighs
(``candidates``), the baselines, the config and fleet a trial ran, and the front of goodput
against GPUs. They work on plain ``FrozenTrial`` lists, so ``tune``'s table, ``export`` and
the run folder pick the same trial without a study object.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.outputs import plots
from optimizer.outputs.replay import file_replay
from optimizer.outputs.review import FleetPoint, gain_ratio
from optimizer.robust.answer import CANDIDATES, Candidate
from optimizer.search.space import Fleet, fleet_of
from policies.config import PolicyConfig


class OutputError(ValueError):
    """A study that cannot be summarised yet (no completed trial, unknown trial number)."""


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
        meeting = [t for t in pool if as_float((trial_report(t) or {}).get("slo_attainment")) >= fewest_gpus_at]
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
                                 _goodput(t), as_float(report.get("slo_attainment")), t.number,
                                 pareto=_goodput(t) > top, gain=gain_ratio(_goodput(t), top), router=router))
        top = max(top, _goodput(t))
    return points


def _goodput(t: FrozenTrial) -> float:
    return as_float((trial_report(t) or {}).get("weighted_goodput"))


def find_trial(trials: Sequence[FrozenTrial], number: int) -> FrozenTrial:
    for t in trials:
        if t.number == number:
            if t.state != TrialState.COMPLETE:
                raise OutputError(f"trial {number} is {t.state.name.lower()}, not complete")
            return t
    raise OutputError(f"no trial {number} in this study (trials 0..{len(trials) - 1})")


def as_float(value: Any) -> float:
    """A report value as a float: None (how JSON keeps a NaN) is NaN."""
    return math.nan if value is None else float(value)
