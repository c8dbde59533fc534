"""The search space: which PolicyConfig knobs a study turns, over what ranges, and when.

The space belongs to a target (``policies.engines``): an engine's space holds only the
knobs the engine has flags for, with the ranges its module declares, and every sampled
config is projected onto what the engine runs (``Target.resolve``); servetune's what-if
target holds every knob in ``policies.config.KNOBS``, either searched or fixed: with the
range in ``policies.engines.servetune.SEARCH`` unless the study overrides it; a knob
added later to KNOBS is searched automatically when it is a bool or a choice, and fixed
at the base config's value when it is a number without a default range (a range over the
knob's whole validity interval would waste the budget). Overrides per knob, from a
study's ``[space.KNOB]`` table:

- ``low``/``high``/``log``: a numeric range; ``choices``: a categorical list;
- ``value``: fix the knob; ``search = false``: fix it at the base config's value;
- ``off = true``: 0 (the knob's "off" value) is a choice besides ``[low, high]``; the
  search first picks on/off (parameter ``KNOB:on``), then the value;
- ``when = {PARENT = [values]}``: suggest the knob only when PARENT took one of values
  (otherwise it keeps its base value), as Optuna's define-by-run conditional spaces do;
  ``when = {PARENT = "on"}`` for a numeric PARENT: only when it is not 0 (its off value).

A top-level ``others = "fixed"`` in ``[space]`` fixes every knob the table does not name,
so a study can search a few knobs only (``others = "default"`` is the default).

Besides the knobs, the space holds the trial's ``Fleet``: TP degree and replicas (GPUs =
replicas x TP). They stay at the deployment's values unless searched: by default when
the objective is ``goodput-gpus`` (TP over the degrees valid for the model, replicas
from 1 to ``DEFAULT_MAX_REPLICAS``), or when ``[space]`` names them: ``tp = [1, 2, 4]`` (a list is
short for ``choices``), ``tp = {low = 1, high = 4}`` (the valid degrees in that range),
``replicas = {low = 1, high = 8}``; ``value`` and ``search = false`` fix them as for
knobs. ``others`` does not touch them.

A MoE model's fleet also has an instance layout (``Fleet.moe_ep``, ``Fleet.attention_dp``),
searched by default whatever the objective, since it changes step time and KV pools but
not the GPU count: ``attention_dp`` (attention data-parallel groups per instance, over the
TP degrees up to the highest TP searched, capped at each trial's TP) and
``expert_parallel`` (experts split over all of an instance's GPUs, or not); ``[space]``
fixes them with ``value`` / ``search = false`` or narrows ``choices``. A dense model has
neither. Each engine refuses the layouts it cannot run (``Target.layout_violations``:
pruned trials) and caps the replicas one file deploys (``Target.replicas_per_file``:
vLLM's data-parallel ranks of a MoE model are one instance, its attention DP).

Fleet knobs (``policies.config.FLEET_KNOBS``: router and its thresholds, hash ring, migration,
prefill/decode split) are searched only in trials whose fleet has more than one replica;
one replica keeps the base values, which it ignores. ``prefill_replicas`` is searched from
0 (colocated, its off value) or up to the trial's replicas - 1 (one decode replica at least).

Speculative decoding is searched only when the study declares a drafter
(``optimizer.search.drafter``), whose acceptance profile every speculative figure depends on:
``build_space(..., drafter_tokens=N)`` then searches ``speculative_mode`` over every
verify-budget policy and, unless it is off, ``num_speculative_tokens`` from 1 to N (the
longest draft the drafter proposes). The draft cost is the drafter's and stays fixed.

``infeasibility`` prunes configs that cannot serve the trace by construction before any
simulation runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from policies.config import (
    FLEET_KNOBS,
    KNOB_BY_NAME,
    KNOBS,
    MAX_REPLICAS,
    SPECULATIVE_KNOBS,
    PolicyConfig,
)
from policies.engines import EngineContext, Target


class SpaceError(ValueError):
    """A search-space override that cannot be searched, naming the knob and what is valid."""


#: Knobs whose range is capped at the trial's replicas - 1.
_BELOW_REPLICAS = frozenset({"prefill_replicas"})

_OVERRIDE_KEYS = {"low", "high", "log", "choices", "value", "search", "off", "when"}

#: TP degrees a fleet may use (a node of 8 GPUs), and the fleet's default search ranges.
TP_DEGREES = (1, 2, 4, 8)
#: Replicas searched by default: 1 to this many (or the deployment's replicas, if more).
DEFAULT_MAX_REPLICAS = 8
_FLEET_KEYS = {"low", "high", "log", "choices", "value", "search"}


@dataclass(frozen=True)
class Fleet:
    """The GPUs a config runs on: ``replicas`` engine instances of ``tp`` GPUs each.

    Within an instance of a MoE model, ``attention_dp`` data-parallel attention groups (one
    scheduler and KV pool each, ``tp / attention_dp`` GPUs apiece) share expert layers
    split ``moe_ep`` ways (``costmodels.layout.ParallelLayout``); the simulator runs
    ``schedulers`` = replicas x attention_dp of them behind the fleet's router.
    """

    tp: int = 1
    replicas: int = 1
    moe_ep: int = 1
    attention_dp: int = 1

    def __post_init__(self) -> None:
        for name, high in (("tp", max(TP_DEGREES)), ("replicas", MAX_REPLICAS), ("moe_ep", max(TP_DEGREES)),
                           ("attention_dp", max(TP_DEGREES))):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 1 <= value <= high:
                raise SpaceError(f"{name} must be an integer in [1, {high}], got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in ("moe_ep", "attention_dp"):
            if self.tp % getattr(self, name):
                raise SpaceError(f"{name}={getattr(self, name)} must divide tp={self.tp}")
        if self.schedulers > MAX_REPLICAS:
            raise SpaceError(f"{self.replicas} replicas x attention_dp {self.attention_dp} = {self.schedulers} "
                             f"schedulers, more than the simulator's {MAX_REPLICAS}")

    @property
    def gpus(self) -> int:
        return self.tp * self.replicas

    def to_dict(self) -> dict[str, int]:
        """The fleet's fields (a trial's user_attrs; ``Fleet(**d)`` reads them back)."""
        return {name: getattr(self, name) for name in ("tp", "replicas", "moe_ep", "attention_dp")}

    @property
    def schedulers(self) -> int:
        """Schedulers (each with its own batch and KV pool) the simulator runs."""
        return self.replicas * self.attention_dp

    @property
    def layout(self):
        """One instance's ``costmodels.layout.ParallelLayout``."""
        from costmodels.layout import ParallelLayout

        return ParallelLayout(self.tp, self.moe_ep, self.attention_dp)

    def describe(self) -> str:
        layout = "".join(f", {label} {v}" for label, v in (("EP", self.moe_ep), ("attention DP", self.attention_dp))
                         if v > 1)
        return f"{self.replicas} x TP {self.tp}{layout} = {self.gpus} GPU(s)"


#: Fleet dimensions of a MoE model's instance layout, searched besides tp and replicas.
LAYOUT_PARAMS = ("attention_dp", "expert_parallel")


@dataclass(frozen=True)
class Param:
    """One searched knob: a numeric range (optionally with an "off" value 0) or choices."""

    name: str
    kind: str  # "int", "float" or "categorical"
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple = ()
    off: bool = False
    when: tuple[tuple[str, tuple | str], ...] = ()  # (parent, allowed values or ON)
    fleet: bool = False  # searched only when the trial's fleet has more than one replica
    below_replicas: bool = False  # high capped at the trial's replicas - 1
    one_replica: bool = False  # a fleet param searched only when the trial runs one replica

    @property
    def gate(self) -> str:
        return f"{self.name}:on"

    def active(self, values: Mapping[str, Any], replicas: int = 1) -> bool:
        """Whether a trial with these knob values, on ``replicas`` replicas, asks for this param."""
        if self.fleet and replicas <= 1:
            return False
        if self.below_replicas and replicas - 1 < self.low:
            return False
        return all(_met(values[parent], allowed) for parent, allowed in self.when)

    def within(self, replicas: int) -> Param:
        """This param on a fleet of ``replicas``: a replica-bounded range capped at replicas - 1."""
        if self.below_replicas and self.high > replicas - 1:
            return replace(self, high=replicas - 1)
        return self

    def suggest(self, trial) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.off and not trial.suggest_categorical(self.gate, [False, True]):
            return 0
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.name, float(self.low), float(self.high), log=self.log)

    def params_for(self, value: Any) -> dict[str, Any]:
        """Optuna params that reproduce ``value``; empty when the space cannot express it."""
        if self.kind == "categorical":
            return {self.name: value} if value in self.choices else {}
        if self.off and value == 0:
            return {self.gate: False}
        if self.low <= value <= self.high:
            return {self.gate: True, self.name: value} if self.off else {self.name: value}
        return {}

    def describe(self) -> str:
        if self.kind == "categorical":
            text = "{" + ", ".join(map(str, self.choices)) + "}"
        else:
            text = f"[{self.low:g}, {self.high:g}]" + (" log" if self.log else "")
            text += " or 0 (off)" if self.off else ""
        if self.below_replicas:
            text += " (high at most replicas - 1)"
        for parent, allowed in self.when:
            text += f" when {parent} != 0" if allowed == ON else f" when {parent} in {list(allowed)}"
        if self.fleet:
            text += " when replicas > 1"
        if self.one_replica:
            text += " when replicas = 1"
        return text


@dataclass(frozen=True)
class SearchSpace:
    """Searched params (parents before children) and the base config the rest keep.

    ``fleet_params`` are the searched fleet dimensions (``tp``, ``replicas``); the others
    keep ``base_fleet``'s value.
    """

    params: tuple[Param, ...]
    base: PolicyConfig
    fleet_params: tuple[Param, ...] = ()
    base_fleet: Fleet = Fleet()
    #: the target engine's projection of a sampled config onto what it runs (coupled
    #: knobs implied, the rest at the engine's behaviour); None: the config as sampled
    resolve: Callable[[PolicyConfig], PolicyConfig] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def fixed(self) -> dict[str, Any]:
        searched = set(self.names)
        return {k.name: getattr(self.base, k.name) for k in KNOBS if k.name not in searched}

    def suggest(self, trial) -> PolicyConfig:
        """Ask the trial for every active param and build the config.

        Fleet knobs depend on the trial's replicas, so the fleet is asked first; Optuna
        answers a param the same way however often a trial asks, so ``suggest_fleet``
        afterwards returns the same fleet.
        """
        replicas = self.suggest_fleet(trial).schedulers
        values = self.base.to_dict()
        for p in self.params:
            if p.active(values, replicas):
                values[p.name] = p.within(replicas).suggest(trial)
        config = PolicyConfig(**values)
        return config if self.resolve is None else self.resolve(config)

    def suggest_fleet(self, trial) -> Fleet:
        """Ask the trial for the searched fleet dimensions; the rest keep the base fleet."""
        values: dict[str, Any] = {}
        for p in self.fleet_params:  # tp and replicas come first
            if not (p.one_replica and values.get("replicas", self.base_fleet.replicas) > 1):
                values[p.name] = p.suggest(trial)
        return fleet_of(values, self.base_fleet)

    @property
    def tp_choices(self) -> tuple[int, ...]:
        """Every TP degree a trial of this space may run at."""
        tp = next((p for p in self.fleet_params if p.name == "tp"), None)
        return tp.choices if tp is not None else (self.base_fleet.tp,)

    def params_for(self, config: PolicyConfig, fleet: Fleet | None = None) -> dict[str, Any]:
        """The params a trial of ``config`` (on ``fleet``) records: the ones the space can express.

        Used for baselines: enqueued with these params, the sampler learns from them
        where the space holds their values, and records nothing false where it does not.
        """
        return {k: v for p, value in self._expressible(config, fleet) for k, v in p.params_for(value).items()}

    def record(self, trial, config: PolicyConfig, fleet: Fleet | None = None) -> None:
        """Store ``config``'s expressible params on a trial enqueued with ``params_for``."""
        for p, _ in self._expressible(config, fleet):
            p.suggest(trial)  # returns the enqueued value

    def _expressible(self, config: PolicyConfig, fleet: Fleet | None) -> list[tuple[Param, Any]]:
        values = config.to_dict()
        fleet = fleet or self.base_fleet
        schedulers = fleet.schedulers
        pairs = [(p.within(schedulers), values[p.name]) for p in self.params if p.active(values, schedulers)]
        pairs += [(p, fleet_param_value(fleet, p.name)) for p in self.fleet_params
                  if not (p.one_replica and fleet.replicas > 1)]
        return [(p, value) for p, value in pairs if p.params_for(value)]

    def describe(self) -> list[tuple[str, str]]:
        """(knob, what the search does with it) for every knob, in KNOBS order."""
        by_name = {p.name: p for p in (*self.params, *self.fleet_params)}
        fleet_names = ("tp", "replicas", *(n for n in LAYOUT_PARAMS if n in by_name))
        fixed = {**self.fixed, **{n: fleet_param_value(self.base_fleet, n) for n in fleet_names}}
        return [(name, by_name[name].describe() if name in by_name else f"fixed = {fixed[name]!r}")
                for name in (*(k.name for k in KNOBS), *fleet_names)]


def fleet_param_value(fleet: Fleet, name: str) -> Any:
    """The value of fleet param ``name`` (``tp``, ``replicas`` or a ``LAYOUT_PARAMS`` one) on ``fleet``."""
    if name == "expert_parallel":
        return fleet.moe_ep > 1
    return getattr(fleet, name)


def fleet_of(values: Mapping[str, Any], base: Fleet) -> Fleet:
    """The fleet of a trial's fleet params (``base``'s values for the rest).

    ``expert_parallel`` splits the experts over all of an instance's GPUs; an
    ``attention_dp`` above the trial's TP takes all of it (one GPU per group): the choices
    are the same for every TP, as Optuna's are, and the TP degrees are powers of 2.
    """
    tp, replicas = int(values.get("tp", base.tp)), int(values.get("replicas", base.replicas))
    attention_dp = min(int(values.get("attention_dp", base.attention_dp)), tp)
    expert_parallel = values.get("expert_parallel", base.moe_ep > 1)
    moe_ep = tp if expert_parallel else 1
    if "tp" not in values and "expert_parallel" not in values:
        moe_ep = base.moe_ep
    return Fleet(tp, replicas, moe_ep, attention_dp)


#: servetune's own verify budgets, searched by the what-if target
WHAT_IF_SPECULATIVE_MODES = ("off", "fixed", "smartspec", "dspark", "dspark_lagged")


def speculative_searched(space: SearchSpace) -> tuple[str, ...]:
    """The verify-budget knobs ``space`` searches (a declared drafter's): a file may change
    them like its engine's flags."""
    return tuple(k for k in SPECULATIVE_KNOBS if k in space.names)


def speculative_defaults(drafter_tokens: int,
                         modes: Sequence[str] = WHAT_IF_SPECULATIVE_MODES) -> dict[str, dict[str, Any]]:
    """Default search of the verify-budget knobs for a drafter proposing up to ``drafter_tokens``
    drafts, over ``modes`` (an engine's: ``Target.speculative_search_modes``). vLLM's batch
    schedule searches two or three ranges, a k each (free, not forced to fall with the batch)."""
    settings = {"speculative_mode": {"choices": list(modes)},
                "num_speculative_tokens": {"low": 1, "high": drafter_tokens,
                                           "when": {"speculative_mode": [m for m in modes if m != "off"]}}}
    if "batch_schedule" in modes:
        when = {"speculative_mode": ["batch_schedule"]}
        settings.update({"speculative_batch_2": {"low": 2, "high": 256, "log": True, "when": when},
                         "speculative_k_2": {"low": 0, "high": drafter_tokens, "when": when},
                         "speculative_batch_3": {"low": 3, "high": 512, "log": True, "off": True, "when": when},
                         "speculative_k_3": {"low": 0, "high": drafter_tokens, "when": when}})
    return settings


#: Where a searched per-batch-size schedule starts (``speculative_starts``): the drafter's whole
#: block below 32 running requests, half of it from 32 and one less from 128 (the shape of the
#: best-mean schedule ``benchmarks/engine_speculative.py`` finds for both example drafters).
SCHEDULE_START_BATCHES = (32, 128)


def speculative_starts(space: SearchSpace, baselines: Mapping[str, PolicyConfig]) -> dict[str, PolicyConfig]:
    """One config per verify budget ``space`` searches besides off and fixed, from each
    baseline that runs the drafter at a fixed k: enqueued after the baselines, so the sampler
    has seen every mode once at a sensible point before it chooses between them. Without them
    TPE settles the categorical mode on its first draws (on Azure conv at 18 req/s it sampled
    the schedule 3 times in 150 trials, each with poor ranges)."""
    mode = next((p for p in space.params if p.name == "speculative_mode"), None)
    if mode is None:
        return {}
    starts = {}
    for name, config in baselines.items():
        if config.speculative_mode != "fixed":
            continue
        gamma = config.num_speculative_tokens
        for budget in mode.choices:
            if budget in ("off", "fixed"):
                continue
            start = config.replace(speculative_mode=budget)
            if budget == "batch_schedule":
                k_2 = max(1, gamma // 2)
                start = start.replace(speculative_batch_2=SCHEDULE_START_BATCHES[0], speculative_k_2=k_2,
                                      speculative_batch_3=SCHEDULE_START_BATCHES[1], speculative_k_3=k_2 - 1)
            starts[f"{name} {budget}"] = start
    return starts


def build_space(overrides: Mapping[str, Any] | None = None, base: PolicyConfig | None = None,
                fleet: Fleet | None = None, *, search_fleet: bool = False,
                tp_degrees: Callable[[], Sequence[int]] | None = None,
                drafter_tokens: int | None = None, speculative_modes: Sequence[str] | None = None,
                target: Target | None = None,
                context: EngineContext | None = None, adapters: int = 0) -> SearchSpace:
    """The target's default space with a study's per-knob overrides; raises SpaceError on bad ones.

    ``target`` (default: servetune's what-if target) decides which knobs exist to search
    and their default ranges; an engine target searches only the knobs it has flags for,
    keeps every other knob at its own behaviour (``target.resolve`` on each sampled
    config) and refuses an override of a knob it cannot carry. ``context`` is the GPU and
    model the engine resolves its defaults for.

    ``fleet`` is the deployment's TP and replicas; ``search_fleet`` searches both by
    default (the goodput-gpus objective). ``tp_degrees`` lists the TP degrees valid for
    the model; it is called only when TP is searched without explicit choices.
    ``drafter_tokens``: the declared drafter's longest draft, which opens the speculative
    knobs (None: no drafter, they keep the base values). ``adapters``: the distinct LoRA
    adapters the trace asks for; with some, LoRA is on and the target's adapter-pool knobs
    are searched (``Target.lora_search_settings``); with none they are not.
    """
    overrides = dict(overrides or {})
    others = overrides.pop("others", "default")
    if others not in ("default", "fixed"):
        raise SpaceError(f'[space] others must be "default" or "fixed", got {others!r}')
    fleet = fleet or Fleet()
    from policies.engines import target as target_named

    target = target or target_named("servetune")
    moe = context is not None and context.moe
    fleet_overrides = {k: overrides.pop(k) for k in ("tp", "replicas", *LAYOUT_PARAMS) if k in overrides}
    if not moe and set(fleet_overrides) & set(LAYOUT_PARAMS):
        raise SpaceError(f"[space] names {sorted(set(fleet_overrides) & set(LAYOUT_PARAMS))}: only a MoE model has "
                         "expert or attention data parallelism (a dense model's data parallelism is replicas)")
    per_file = None if context is None else target.replicas_per_file(context)
    if per_file is not None:
        if fleet.replicas > per_file:
            raise SpaceError(f"{target.display} deploys at most {per_file} replica(s) of this model per file, got "
                             f"{fleet.replicas}: its data-parallel ranks are attention_dp within one instance")
        fleet_overrides.setdefault("replicas", {"value": fleet.replicas})
    fleet_params, fleet = _fleet_params(fleet_overrides, fleet, search_fleet, tp_degrees, moe,
                                        None if context is None else target.attention_dp_replicas(context))
    unknown = sorted(set(overrides) - set(KNOB_BY_NAME))
    if unknown:
        raise SpaceError(f"[space] has unknown knob(s) {unknown}; known: {sorted(KNOB_BY_NAME)}")
    carried = set(target.knobs) | (set(SPECULATIVE_KNOBS) if drafter_tokens is not None else set())
    foreign = sorted(k for k in overrides if k not in carried and (k not in FLEET_KNOBS or not target.what_if))
    if foreign:
        raise SpaceError(f"[space] names {foreign}, which {target.display} {target.version} has no flag for; "
                         "search servetune's own policies with --what-if (engine servetune)")
    base_values = (base or PolicyConfig()).to_dict()
    defaults = target.search_settings(context)
    if adapters:
        base_values["enable_lora"] = True
        defaults.update(target.lora_search_settings(adapters))
    if drafter_tokens is not None:
        defaults.update(speculative_defaults(drafter_tokens, WHAT_IF_SPECULATIVE_MODES if target.what_if
                                             else ("off", *(speculative_modes or ("fixed",)))))
    params = []
    for knob in KNOBS:
        settings = dict(defaults.get(knob.name, {}))
        if others == "fixed" and knob.name not in overrides:
            continue
        if not target.what_if and knob.name not in defaults and knob.name not in overrides:
            continue  # an engine searches only the knobs its module opens
        override = overrides.get(knob.name, {})
        if not isinstance(override, Mapping):
            raise SpaceError(f"[space.{knob.name}] must be a table such as {{low = 1, high = 8}}, got {override!r}")
        bad_keys = sorted(set(override) - _OVERRIDE_KEYS)
        if bad_keys:
            raise SpaceError(f"[space.{knob.name}] has unknown key(s) {bad_keys}; valid: {sorted(_OVERRIDE_KEYS)}")
        if override:
            settings.pop("search", None)  # any override opens a knob fixed by default
        settings.update(override)
        if "value" in settings:
            base_values[knob.name] = _valid_value(knob, settings["value"], "value")
            continue
        if settings.get("search", True) is False:
            continue
        param = _param(knob, settings)
        if param is not None:
            params.append(param)
    try:
        base_config = PolicyConfig(**base_values)
    except ValueError as exc:
        raise SpaceError(f"[space] fixed values do not form a valid config: {exc}") from None
    ordered = _parents_first(params)
    if not ordered and not fleet_params:
        raise SpaceError("the search space is empty: every knob is fixed; give at least one knob a range or choices")
    resolve = None if target.what_if else (lambda config: target.resolve(config, context))
    if resolve is not None:
        base_config = resolve(base_config)
        broken = target.domain_violations(base_config)
        if broken:
            raise SpaceError(f"[space] fixed values {target.display} cannot run: " + "; ".join(broken))
    return SearchSpace(tuple(ordered), base_config, fleet_params, fleet, resolve)


def _fleet_params(overrides: dict[str, Any], fleet: Fleet, search: bool,
                  tp_degrees: Callable[[], Sequence[int]] | None, moe: bool = False,
                  dp_replicas: bool | None = True) -> tuple[tuple[Param, ...], Fleet]:
    """The searched fleet dimensions, and the fleet the unsearched ones keep (``dp_replicas``:
    whether attention DP runs beside several replicas; otherwise searched on one only)."""
    params = []
    values = {"tp": fleet.tp, "replicas": fleet.replicas}
    for name in ("tp", "replicas"):
        where = f"[space.{name}]"
        override = overrides.get(name, {})
        if isinstance(override, list | tuple):
            override = {"choices": list(override)}
        if not isinstance(override, Mapping):
            raise SpaceError(f"{where} must be a list of values or a table such as {{low = 1, high = 8}}, "
                             f"got {override!r}")
        bad_keys = sorted(set(override) - _FLEET_KEYS)
        if bad_keys:
            raise SpaceError(f"{where} has unknown key(s) {bad_keys}; valid: {sorted(_FLEET_KEYS)}")
        if "value" in override:
            values[name] = _fleet_value(name, override["value"], where)
            continue
        if override.get("search", bool(override) or search) is False:
            continue
        defaults = {"low": 1, "high": max(DEFAULT_MAX_REPLICAS, fleet.replicas)} if name == "replicas" else {}
        settings = {**defaults, **override}
        if "low" in override or "high" in override:
            if "low" not in override or "high" not in override:
                raise SpaceError(f"{where}: give both low and high")
            low, high = (_fleet_value(name, override[k], where) for k in ("low", "high"))
            if low > high:
                raise SpaceError(f"{where}: low {low} is above high {high}")
        if "choices" in settings:
            choices = tuple(_fleet_value(name, c, where) for c in settings["choices"])
            if not choices or len(set(choices)) != len(choices):
                raise SpaceError(f"{where}: choices {list(choices)} must be non-empty and without duplicates")
            params.append(Param(name, "categorical", choices=tuple(sorted(choices))))
        elif name == "tp":
            if tp_degrees is None:
                raise SpaceError(f"{where}: give the TP degrees to search, e.g. tp = [1, 2, 4]")
            low, high = settings.get("low", 1), settings.get("high", max(TP_DEGREES))
            degrees = tuple(d for d in tp_degrees() if low <= d <= high)
            if not degrees:
                raise SpaceError(f"{where}: no TP degree valid for the model lies in [{low}, {high}]; "
                                 f"valid: {list(tp_degrees())}")
            params.append(Param(name, "categorical", choices=degrees))
        else:
            params.append(Param(name, "int", settings["low"], settings["high"], bool(settings.get("log", False))))
    base = Fleet(values["tp"], values["replicas"], fleet.moe_ep if values["tp"] == fleet.tp else 1,
                 min(fleet.attention_dp, values["tp"]))
    highest_tp = max([values["tp"], *(c for p in params if p.name == "tp" for c in p.choices)])
    if moe and highest_tp > 1:  # one GPU has nothing to split
        layout, base = _layout_params(overrides, base, highest_tp)
        params += [replace(p, one_replica=p.name == "attention_dp" and dp_replicas is False) for p in layout]
    return tuple(params), base


def _layout_params(overrides: Mapping[str, Any], fleet: Fleet, highest_tp: int) -> tuple[list[Param], Fleet]:
    """A MoE model's layout params, searched unless fixed: ``attention_dp`` over the TP degrees
    up to the highest TP searched, ``expert_parallel`` on or off; and the fleet they fix."""
    params, fixed = [], {}
    defaults = {"attention_dp": tuple(d for d in TP_DEGREES if d <= highest_tp), "expert_parallel": (False, True)}
    for name, choices in defaults.items():
        where = f"[space.{name}]"
        override = overrides.get(name, {})
        if isinstance(override, list | tuple):
            override = {"choices": list(override)}
        if not isinstance(override, Mapping) or set(override) - {"choices", "value", "search"}:
            raise SpaceError(f"{where} must be a list of values or a table with choices, value or search = false, "
                             f"got {override!r}")
        if "value" in override:
            fixed[name] = override["value"]
            continue
        if override.get("search", True) is False:
            continue
        picked = tuple(override.get("choices", choices))
        if not picked or any(c not in choices for c in picked) or len(set(picked)) != len(picked):
            raise SpaceError(f"{where}: choices {list(picked)} must be distinct values of {list(choices)}")
        params.append(Param(name, "categorical", choices=picked))
    for name, value in fixed.items():
        if value not in defaults[name]:
            raise SpaceError(f"[space.{name}] value {value!r} is not one of {list(defaults[name])}")
    try:
        return params, fleet_of(fixed, fleet)
    except SpaceError as exc:
        raise SpaceError(f"[space] layout: {exc}") from None


def _fleet_value(name: str, value: Any, where: str) -> int:
    try:
        return getattr(Fleet(**{name: value}), name)
    except SpaceError as exc:
        raise SpaceError(f"{where}: {exc}") from None


@lru_cache(maxsize=32)
def tp_degrees(model: str, gpu: str, framework: str = "vllm", model_config=None, dtype: str = "bf16"
               ) -> tuple[int, ...]:
    """TP degrees in ``TP_DEGREES`` that split the model's heads evenly and fit its weights on ``gpu``."""
    from costmodels import build
    from costmodels.architecture import load_model
    from costmodels.costmodel import CostModelError

    try:
        load_model(model, model_config)
    except CostModelError as exc:
        raise SpaceError(f"[space.tp]: cannot list the TP degrees of {model!r} ({exc}); "
                         "give them, e.g. tp = [1, 2, 4]") from None
    valid = []
    for tp in TP_DEGREES:
        try:
            build(model, gpu, tp=tp, framework=framework, model_config=model_config, gemm_dtype=dtype)
        except CostModelError:
            continue
        valid.append(tp)
    if not valid:
        raise SpaceError(f"[space.tp]: {model} fits {gpu} at none of TP {list(TP_DEGREES)}")
    return tuple(valid)


def _param(knob, settings: dict[str, Any]) -> Param | None:
    where = f"[space.{knob.name}]"
    when = _when(where, settings.get("when", {}))
    fleet = knob.name in FLEET_KNOBS
    if "choices" in settings and knob.name in _BELOW_REPLICAS:
        raise SpaceError(f"{where}: give a range (low, high), not choices; its high is capped at each trial's "
                         "replicas - 1")
    if "choices" in settings:
        choices = tuple(_valid_value(knob, c, "choices") for c in settings["choices"])
        if not choices:
            raise SpaceError(f"{where}: choices is empty; give at least one value")
        if len(set(choices)) != len(choices):
            raise SpaceError(f"{where}: choices {list(choices)} has duplicates")
        return Param(knob.name, "categorical", choices=choices, when=when, fleet=fleet)
    if knob.kind is bool:
        return Param(knob.name, "categorical", choices=(False, True), when=when, fleet=fleet)
    if knob.kind is str:
        return Param(knob.name, "categorical", choices=knob.choices, when=when, fleet=fleet)
    if "low" not in settings or "high" not in settings:
        if "low" in settings or "high" in settings:
            raise SpaceError(f"{where}: give both low and high")
        return None  # a number with no default range: fixed at the base value
    low = _valid_value(knob, settings["low"], "low")
    high = _valid_value(knob, settings["high"], "high")
    if low > high:
        raise SpaceError(f"{where}: low {low!r} is above high {high!r}")
    log = bool(settings.get("log", False))
    if log and low <= 0:
        raise SpaceError(f"{where}: a log range needs low > 0, got {low!r} (use off = true for a 0 = off knob)")
    off = bool(settings.get("off", False))
    if off and not knob.low <= 0 <= knob.high:
        raise SpaceError(f"{where}: off = true needs 0 to be a valid value; valid range [{knob.low:g}, {knob.high:g}]")
    return Param(knob.name, "int" if knob.kind is int else "float", low, high, log, off=off, when=when, fleet=fleet,
                 below_replicas=knob.name in _BELOW_REPLICAS)


def _valid_value(knob, value: Any, what: str) -> Any:
    try:
        return getattr(PolicyConfig().replace(**{knob.name: value}), knob.name)
    except ValueError as exc:
        raise SpaceError(f"[space.{knob.name}] {what}: {exc}") from None


#: ``when`` of a numeric parent that must be on (not 0), rather than one of listed values
ON = "on"


def _met(value: Any, allowed: tuple | str) -> bool:
    return value != 0 if allowed == ON else value in allowed


def _when(where: str, when: Any) -> tuple[tuple[str, tuple | str], ...]:
    if not isinstance(when, Mapping):
        raise SpaceError(f"{where}: when must be a table {{PARENT = [values]}}, got {when!r}")
    out = []
    for parent, allowed in when.items():
        if parent not in KNOB_BY_NAME:
            raise SpaceError(f"{where}: when names unknown knob {parent!r}")
        if allowed == ON:
            if KNOB_BY_NAME[parent].kind not in (int, float) or not KNOB_BY_NAME[parent].low <= 0:
                raise SpaceError(f'{where}: when {parent} = "on" needs a number knob whose 0 means off')
            out.append((parent, ON))
            continue
        allowed = allowed if isinstance(allowed, list | tuple) else [allowed]
        out.append((parent, tuple(_valid_value(KNOB_BY_NAME[parent], a, "when") for a in allowed)))
    return tuple(out)


def _parents_first(params: list[Param]) -> list[Param]:
    """Order params so each comes after the knobs its ``when`` reads (KNOBS order otherwise)."""
    by_name = {p.name: p for p in params}
    ordered: list[Param] = []
    visiting: set[str] = set()

    def visit(p: Param) -> None:
        if p in ordered:
            return
        if p.name in visiting:
            raise SpaceError(f"[space.{p.name}] when conditions form a cycle")
        visiting.add(p.name)
        for parent, _ in p.when:
            if parent in by_name:
                visit(by_name[parent])
        visiting.discard(p.name)
        ordered.append(p)

    for p in params:
        visit(p)
    return ordered


def infeasibility(config: PolicyConfig, cost_model, request_tokens: np.ndarray, prompt_tokens: np.ndarray) -> str | None:
    """Why ``config`` cannot serve the trace by construction, or None if it might.

    ``request_tokens`` is prompt + max_tokens per request. A config is pruned when its KV
    pool holds not even the smallest request, or when a knob (KV headroom, max_model_len,
    chunked prefill off) turns away requests the hardware could hold: such a config only
    wins goodput by refusing traffic, which the study would reject anyway.
    """
    from costmodels.costmodel import CostModelError

    try:
        blocks = cost_model.kv_capacity_blocks(config.gpu_memory_utilization, config.block_size,
                                               config.max_num_batched_tokens)
    except CostModelError as exc:
        return str(exc)
    capacity = blocks * config.block_size
    smallest, largest = int(request_tokens.min()), int(request_tokens.max())
    if capacity < smallest:
        return f"KV holds {capacity} tokens; the smallest request needs {smallest}"
    holdable = min(largest, capacity)
    usable = math.floor(blocks * (1.0 - config.kv_headroom)) * config.block_size
    if usable < holdable:
        return (f"kv_headroom={config.kv_headroom:g} leaves {usable} of {capacity} KV tokens; "
                f"a request of {holdable} tokens fits the hardware but never this config")
    if 0 < config.max_model_len < holdable:
        return f"max_model_len={config.max_model_len} rejects requests of up to {holdable} tokens the KV holds"
    longest_prompt = int(prompt_tokens.max())
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < longest_prompt:
        return (f"without chunked prefill a {longest_prompt}-token prompt never fits "
                f"max_num_batched_tokens={config.max_num_batched_tokens}")
    return None
