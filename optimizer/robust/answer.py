"""The answer of one study: which file to deploy on how many replicas, and every figure with
its range.

``robust_answer`` takes the search's best candidates (each already the exported file read
back, ``optimizer.outputs.replay.file_replay``) and the engine's defaults, and:

1. scores them, and the defaults, under every condition: the traffic variants of the
   tuning part (``variants``) and the whole tuning part with its step times at each corner
   of the cost model's error (``modelerror``);
2. chooses the candidate whose gain holds under every condition, or keeps the defaults
   (``choice.choose``): a file that wins on the traffic but loses once the step times are
   as far off as the model's measured error is not a gain that holds;
3. puts back at the default every knob that does not carry the gain (``choice.minimal``);
4. sizes the fleet of the file and of each default by simulation (``fleetsize``) on the
   tuning part and on the held-out part; the larger count sizes the deployment (the held-
   out part is the most recent traffic, never seen by the search or the choice);
5. gives the gain, the goodput and the GPUs as a point (the tuning part at its rate) and a
   range: the spread over the conditions (goodput: those at the traffic's own rate).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from optimizer.robust.choice import (
    NOISE,
    Gains,
    KnobChange,
    choose,
    gains_over,
    minimal,
    ratio,
)
from optimizer.robust.fleetsize import FleetSize, fleet_size
from optimizer.robust.modelerror import ModelError, model_error, scaled_builder
from optimizer.robust.variants import Variant, variants

#: Trials of the search scored on the variants: the best this many by the first objective.
CANDIDATES = 8


@dataclass(frozen=True)
class Candidate:
    """A config the search found, as its exported file runs it, on its fleet."""

    label: str
    config: Any  # PolicyConfig
    fleet: Any  # optimizer.search.space.Fleet
    trial: Any = None  # FrozenTrial


@dataclass(frozen=True)
class Range:
    """A figure's point (the tuning part at its rate) and the range it moves in."""

    point: float
    low: float
    high: float

    @classmethod
    def of(cls, point: float, spread: Sequence[float]) -> Range:
        known = [v for v in (point, *spread) if not math.isnan(v)]
        return cls(point, min(known, default=math.nan), max(known, default=math.nan))

    def to_dict(self) -> dict[str, float]:
        return {"point": self.point, "low": self.low, "high": self.high}

    def describe(self, fmt: Callable[[float], str]) -> str:
        if fmt(self.low) == fmt(self.high):
            return fmt(self.point)
        return f"{fmt(self.point)} ({fmt(self.low)}-{fmt(self.high)})"


@dataclass(frozen=True)
class Sizing:
    """The fewest replicas meeting the target: on the tuning part, the held-out part and,
    for the recommendation, each fold and the cost model's slow and fast corners."""

    tuning: FleetSize
    holdout: FleetSize | None = None
    spread: tuple[tuple[str, FleetSize], ...] = ()

    @property
    def deploy(self) -> FleetSize:
        """The count to deploy: the larger of the tuning and held-out parts' (out of reach wins)."""
        parts = [s for s in (self.tuning, self.holdout) if s is not None]
        return max(parts, key=lambda s: math.inf if s.replicas is None else s.replicas)

    @property
    def sized_on(self) -> str:
        return "held-out part" if self.deploy is self.holdout and self.holdout is not self.tuning else "tuning part"

    @property
    def replicas(self) -> Range:
        """Replicas to deploy and their range (inf: out of reach)."""
        counts = [_count(s) for s in (self.tuning, self.holdout) if s is not None]
        counts += [_count(s) for _, s in self.spread]
        return Range(_count(self.deploy), min(counts), max(counts))

    def to_dict(self) -> dict[str, Any]:
        return {"deploy": self.deploy.to_dict(), "sized_on": self.sized_on, "replicas": self.replicas.to_dict(),
                "gpus": {k: v * self.deploy.gpus_per_replica for k, v in self.replicas.to_dict().items()},
                "tuning": self.tuning.to_dict(), "holdout": None if self.holdout is None else self.holdout.to_dict(),
                "spread": {name: s.to_dict() for name, s in self.spread}}


def _count(size: FleetSize) -> float:
    return math.inf if size.replicas is None else float(size.replicas)


@dataclass(frozen=True)
class Answer:
    """What to deploy and how sure the figures are."""

    keep_defaults: bool
    reason: str
    label: str  # the chosen candidate's label, or the default's name
    config: Any  # PolicyConfig, as the file runs it (after the minimal-knob pass)
    fleet: Any
    trial: Any  # the chosen candidate's trial (None when the defaults are kept)
    reference: str  # the default the gains are over
    knobs: tuple[KnobChange, ...]
    candidates: tuple[tuple[str, Gains], ...]
    conditions: tuple[str, ...]  # what the gains were scored under, in order
    gain: Range
    goodput: Range
    model_error: ModelError
    sizing: Mapping[str, Sizing]  # "recommended" and each default's name
    noise: float = NOISE

    def knobs_text(self, display: str) -> str:
        if self.keep_defaults:
            return f"no knob changed: {display}'s defaults"
        if not self.knobs:
            return "no knob changed"
        return (f"{len(self.knobs)} knob{'s' if len(self.knobs) > 1 else ''} changed: "
                + ", ".join(k.describe() for k in self.knobs))

    def to_dict(self) -> dict[str, Any]:
        return {"keep_defaults": self.keep_defaults, "reason": self.reason, "chosen": self.label,
                "trial": None if self.trial is None else self.trial.number, "reference_default": self.reference,
                "noise": self.noise, "knobs_changed": [k.to_dict() for k in self.knobs],
                "gain": self.gain.to_dict(), "weighted_goodput": self.goodput.to_dict(),
                "model_error": self.model_error.to_dict(), "conditions": list(self.conditions),
                "candidates": {label: g.to_dict() for label, g in self.candidates},
                "sizing": {name: s.to_dict() for name, s in self.sizing.items()}}


@dataclass(frozen=True)
class Condition:
    """One condition a config is scored on: a traffic variant, or the whole tuning part with
    the step times at a corner of the cost model's error."""

    name: str
    evaluator: Any
    rate_scale: float = 1.0


class Conditions:
    """Weighted goodput of configs under every condition (traffic variants, then error corners)."""

    def __init__(self, evaluator, chosen: Sequence[Variant], error: ModelError):
        on: dict[int, Any] = {}
        for v in chosen:
            if v.fold.index not in on:
                on[v.fold.index] = evaluator if v.fold.of == 1 else evaluator.on(v.fold.trace)
        self.folds = {v.fold.index: (v.fold.name, on[v.fold.index]) for v in chosen}
        self.corners = [Condition(f"step times: prefill x{p:.2f}, decode x{d:.2f}",
                                  evaluator.on(evaluator.trace, cost_model_for=scaled_builder(evaluator.cost_model_at,
                                                                                              p, d)))
                        for p, d in error.corners()]
        self.all = [Condition(v.name, on[v.fold.index], v.rate_scale) for v in chosen] + self.corners

    def goodput(self, configs: Sequence, fleets: Sequence) -> np.ndarray:
        """configs x conditions."""
        out = np.empty((len(configs), len(self.all)))
        for j, c in enumerate(self.all):
            reports = c.evaluator.reports(list(configs), c.rate_scale, fleets=list(fleets))
            out[:, j] = [_goodput(r) for r in reports]
        return out

    def at_trace_rate(self) -> list[int]:
        """Columns whose traffic runs at its own rate (folds at x1 and every corner)."""
        return [j for j, c in enumerate(self.all) if c.rate_scale == 1.0]


def _goodput(report) -> float:
    value = report.weighted_goodput
    return 0.0 if value is None or math.isnan(value) else float(value)


def robust_answer(spec, evaluator, candidates: Sequence[Candidate], defaults: Mapping[str, Any], *,
                  as_file: Callable[[Any, Any], Any], flag_of: Callable[[str], str], knobs: Sequence[str],
                  noise: float = NOISE) -> Answer:
    """See the module docstring. ``defaults``: name -> config (on the study's fleet);
    ``as_file(config, fleet)``: the config as the target's file runs it (raises when the
    target refuses it); ``knobs``: the target's knobs a file may change."""
    error = model_error(evaluator.cost_model)
    conditions = Conditions(evaluator, variants(evaluator.trace), error)
    names = list(defaults)
    base = [spec.fleet] * len(names)
    base_rows = conditions.goodput(list(defaults.values()), base)
    reference_row = base_rows.max(axis=0)  # the better default under each condition
    # of several defaults (the what-if target's), the one kept is chosen as a candidate is:
    # the best worst case against the better default, then the best typical one
    held = gains_over(base_rows, reference_row)
    ref_name = names[max(range(len(names)), key=lambda i: (held[i].worst, held[i].typical, -i))]
    ref_config = defaults[ref_name]

    rows = (conditions.goodput([c.config for c in candidates], [c.fleet for c in candidates]) if candidates
            else np.empty((0, len(conditions.all))))
    gains = gains_over(rows, reference_row)
    decision = choose(gains, noise)
    label, trial, config, fleet, kept = ref_name, None, ref_config, spec.fleet, ()
    if decision.chosen is not None:
        pick = candidates[decision.chosen]

        def score(configs: list) -> list[Gains]:
            return gains_over(conditions.goodput(configs, [pick.fleet] * len(configs)), reference_row)

        def revert(cfg, knob: str):
            try:
                return as_file(cfg.replace(**{knob: getattr(ref_config, knob)}), pick.fleet)
            except ValueError:  # the target refuses it (ConfigError, ExportError)
                return None

        config, changes = minimal(pick.config, ref_config, knobs, score, revert, flag_of, noise)
        label, trial, fleet, kept = pick.label, pick.trial, pick.fleet, tuple(changes)
    keep = trial is None

    # the figures of what is recommended (the defaults themselves when kept)
    point = evaluator.reports([config, *defaults.values()], 1.0, fleets=[fleet, *base])
    mine, theirs = _goodput(point[0]), max(_goodput(r) for r in point[1:])
    row = conditions.goodput([config], [fleet])[0]
    spread = [] if keep else [ratio(float(v), float(r)) for v, r in zip(row, reference_row, strict=True)]
    gain = Range.of(1.0 if keep else ratio(mine, theirs), spread)
    goodput = Range.of(mine, [float(row[j]) for j in conditions.at_trace_rate()])
    sizing = _sizing(spec, evaluator, conditions, error, config, fleet, defaults, keep)
    reason = decision.reason
    if keep and math.isfinite(point[0].slo_attainment):
        # how much any file could have added: little when the defaults already meet the SLOs
        reason += f"; the defaults serve {point[0].slo_attainment:.1%} of the tuning part's requests within the SLOs"
    return Answer(keep, reason, label, config, fleet, trial, ref_name, kept,
                  tuple((c.label, g) for c, g in zip(candidates, gains, strict=True)),
                  tuple(c.name for c in conditions.all), gain, goodput, error, sizing, noise)


def _sizing(spec, evaluator, conditions: Conditions, error: ModelError, config, fleet,
            defaults: Mapping[str, Any], keep: bool) -> dict[str, Sizing]:
    """Fleet sizes of the recommendation (with its spread) and of each default."""
    target = spec.capacity_target
    held = None if evaluator.holdout_trace is None else evaluator.on(evaluator.holdout_trace)

    def sized(cfg, fl, spread: bool) -> Sizing:
        tuning = fleet_size(evaluator, cfg, fl, target)
        start = tuning.replicas or 1
        holdout = None if held is None else fleet_size(held, cfg, fl, target, start=start)
        extra: list[tuple[str, FleetSize]] = []
        if spread:
            if len(conditions.folds) > 1:
                extra += [(name, fleet_size(ev, cfg, fl, target, start=start))
                          for _, (name, ev) in sorted(conditions.folds.items())]
            corners = error.corners()
            for which, pick in (("slow", max), ("fast", min)):  # both steps longer / both shorter
                i = pick(range(len(corners)), key=lambda k: sum(corners[k]))
                extra.append((f"cost model {which} corner", fleet_size(conditions.corners[i].evaluator, cfg, fl,
                                                                       target, start=start)))
        return Sizing(tuning, holdout, tuple(extra))

    out = {"recommended": sized(config, fleet, True)}
    for name, cfg in defaults.items():
        same = keep and cfg == config and fleet == spec.fleet
        out[name] = out["recommended"] if same else sized(cfg, spec.fleet, False)
    return out
