"""Evaluator: a study's trace, cost models and SLOs, loaded once, and configs scored on them.

Trials call ``reports(configs, fleets=...)``: the configs not seen before are simulated
(one ``simulate_many`` per fleet, which runs them in parallel with ``prange``), each
scored into a Report. Results are cached by the config's vector, the fleet and the rate
scale, so a config the sampler proposes twice is simulated once. Reports are kept for
every config; SimResults (per-request arrays, megabytes on a large trace) only for the
most recent ``keep_results`` ones.

A fleet is ``replicas`` engines of TP ``tp`` (``optimizer.space.Fleet``; the spec's by
default). Its cost model is built once per TP. More than one replica is simulated as
round-robin routing to independent replicas (``optimizer.replicas``): the trace is split
by arrival order, each replica's share runs as its own single-replica simulation (replica
r with seed ``seed + r``), and the results merge onto the original request order.
Replicas run one after another, each a ``simulate_many`` over the batch's configs: on 2
cores that measured faster than a thread pool over (config, replica) runs
(``benchmarks/replica_split.py``).

The engine, scorer and cost-model builder are injectable (any object with
``simulate``/``simulate_many``, and ``validate`` optionally; any ``score(result, trace,
slos)``; any ``tp -> CostModel``), so the search logic is testable without the real
kernel or profiles.
"""

from __future__ import annotations

import importlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from costmodels.costmodel import CostModelError
from optimizer.replicas import merge_replicas, split_round_robin
from optimizer.space import Fleet, infeasibility
from optimizer.spec import SpecError, StudySpec
from policies.config import ConfigError, PolicyConfig
from policies.presets import PRESETS, preset


class Evaluator:
    """Simulate and score configs for one study; ``engine_seconds`` is time spent doing so."""

    def __init__(self, spec: StudySpec, *, trace=None, cost_model=None,
                 cost_model_for: Callable[[int], Any] | None = None, engine: Any = None,
                 scorer: Callable | None = None, keep_results: int = 32) -> None:
        self.spec = spec
        self.slos = spec.slos
        self.fleet = spec.fleet
        self.trace = trace if trace is not None else load_study_trace(spec)
        self._build = cost_model_for if cost_model_for is not None else (lambda tp: build_cost_model(spec, tp))
        self._cost_models: dict[int, Any] = {} if cost_model is None else {self.fleet.tp: cost_model}
        for tp in spec.search_space.tp_choices:  # a TP the model cannot run fails now, not mid-study
            self.cost_model_at(tp)
        self.cost_model = self.cost_model_at(self.fleet.tp)
        self.engine = engine if engine is not None else importlib.import_module("policies.engine")
        self.scorer = scorer if scorer is not None else importlib.import_module("studies.metrics").score
        self.keep_results = keep_results
        self.engine_seconds = 0.0
        self.simulations = 0
        self._reports: dict[bytes, Any] = {}
        self._results: OrderedDict[bytes, Any] = OrderedDict()
        self._scaled: dict[float, Any] = {1.0: self.trace}
        self._splits: dict[tuple[float, int], tuple[list[np.ndarray], list[Any]]] = {}
        self._request_tokens = np.asarray(self.trace.prompt_tokens) + np.asarray(self.trace.max_tokens)

    # -- configs -------------------------------------------------------------------------
    def baselines(self) -> dict[str, PolicyConfig]:
        """The engines' own defaults for the spec's GPU: every result's point of comparison."""
        return {name: preset(name, self.spec.gpu) for name in PRESETS}

    def cost_model_at(self, tp: int):
        """The cost model of the study's model and GPU at TP ``tp`` (built once)."""
        if tp not in self._cost_models:
            try:
                self._cost_models[tp] = self._build(tp)
            except CostModelError as exc:
                raise SpecError(f"tp={tp}: {exc}") from None
        return self._cost_models[tp]

    def infeasibility(self, config: PolicyConfig, fleet: Fleet | None = None) -> str | None:
        """Why ``config`` cannot serve this trace on ``fleet`` (pruned before simulating), or None."""
        fleet = fleet or self.fleet
        if fleet.replicas > self.trace.n:
            return f"replicas={fleet.replicas} exceeds the trace's {self.trace.n} requests"
        cost_model = self.cost_model_at(fleet.tp)
        reason = infeasibility(config, cost_model, self._request_tokens, self.trace.prompt_tokens)
        if reason is None and hasattr(self.engine, "validate"):
            try:
                self.engine.validate(self.trace, cost_model, config)
            except ConfigError as exc:
                reason = str(exc)
        return reason

    # -- simulation ----------------------------------------------------------------------
    def trace_at(self, rate_scale: float = 1.0):
        """The study trace with its arrival rate multiplied by ``rate_scale`` (cached)."""
        if not rate_scale > 0:
            raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
        if rate_scale not in self._scaled:
            from studies.transforms import scale_rate

            self._scaled[rate_scale] = scale_rate(self.trace, factor=rate_scale)
        return self._scaled[rate_scale]

    def simulate(self, config: PolicyConfig, rate_scale: float = 1.0, fleet: Fleet | None = None):
        """(SimResult, Report) for one config at a rate scale."""
        return self.simulate_batch([config], rate_scale, None if fleet is None else [fleet])[0]

    def simulate_batch(self, configs: Sequence[PolicyConfig], rate_scale: float = 1.0,
                       fleets: Sequence[Fleet] | None = None) -> list[tuple]:
        """(SimResult, Report) per config (on its fleet), simulating the ones not cached."""
        pairs = self._pairs(configs, fleets)
        keys = [self._key(c, f, rate_scale) for c, f in pairs]
        self._run([pair for pair, k in zip(pairs, keys, strict=True) if k not in self._results], rate_scale)
        out = [(self._results[k], self._reports[k]) for k in keys]
        for k in keys:
            self._results.move_to_end(k)
        self._trim(len(keys))
        return out

    def reports(self, configs: Sequence[PolicyConfig], rate_scale: float = 1.0,
                fleets: Sequence[Fleet] | None = None) -> list:
        """Report per config (on its fleet); only configs never scored before are simulated."""
        pairs = self._pairs(configs, fleets)
        keys = [self._key(c, f, rate_scale) for c, f in pairs]
        self._run([pair for pair, k in zip(pairs, keys, strict=True) if k not in self._reports], rate_scale)
        self._trim(0)
        return [self._reports[k] for k in keys]

    def _pairs(self, configs, fleets) -> list[tuple[PolicyConfig, Fleet]]:
        if fleets is None:
            return [(c, self.fleet) for c in configs]
        if len(fleets) != len(configs):
            raise ValueError(f"{len(fleets)} fleets for {len(configs)} configs; give one per config or none")
        return list(zip(configs, fleets, strict=True))

    def _run(self, pairs: Sequence[tuple[PolicyConfig, Fleet]], rate_scale: float) -> None:
        unique = {self._key(c, f, rate_scale): (c, f) for c, f in pairs}
        if not unique:
            return
        trace = self.trace_at(rate_scale)
        start = time.perf_counter()
        by_fleet: dict[Fleet, list[bytes]] = {}
        for key, (_, fleet) in unique.items():
            by_fleet.setdefault(fleet, []).append(key)
        for fleet, keys in by_fleet.items():
            results = self._simulate_fleet(trace, rate_scale, fleet, [unique[k][0] for k in keys])
            for key, result in zip(keys, results, strict=True):
                self._reports[key] = self.scorer(result, trace, self.slos)
                self._results[key] = result
                self._results.move_to_end(key)
        self.engine_seconds += time.perf_counter() - start
        self.simulations += len(unique)

    def _simulate_fleet(self, trace, rate_scale: float, fleet: Fleet, configs: list[PolicyConfig]) -> list:
        cost_model, seed = self.cost_model_at(fleet.tp), self.spec.seed
        if fleet.replicas == 1:
            if len(configs) == 1:
                return [self.engine.simulate(trace, cost_model, configs[0], seed=seed)]
            return self.engine.simulate_many(trace, cost_model, configs, seed=seed)
        rows, parts = self._split(trace, rate_scale, fleet.replicas)
        per_replica = [self.engine.simulate_many(part, cost_model, configs, seed=seed + r)
                       for r, part in enumerate(parts)]
        return [merge_replicas([runs[k] for runs in per_replica], rows, trace.n) for k in range(len(configs))]

    def _split(self, trace, rate_scale: float, replicas: int):
        """Each replica's rows and sub-trace under round robin (cached per rate and replicas)."""
        key = (rate_scale, replicas)
        if key not in self._splits:
            rows = split_round_robin(trace.n, replicas)
            self._splits[key] = rows, [trace.take(r) for r in rows]
        return self._splits[key]

    def _trim(self, protect: int) -> None:
        """Drop the oldest SimResults beyond ``keep_results`` (never the newest ``protect``)."""
        while len(self._results) > max(self.keep_results, protect):
            self._results.popitem(last=False)

    @staticmethod
    def _key(config: PolicyConfig, fleet: Fleet, rate_scale: float) -> bytes:
        return config.to_vector().tobytes() + np.array([rate_scale, fleet.tp, fleet.replicas]).tobytes()


def load_study_trace(spec: StudySpec):
    """The spec's trace file, loaded and rate-transformed as the spec says."""
    from studies.traces import load_trace

    trace = load_trace(spec.trace, format=spec.trace_format, **dict(spec.trace_options))
    if spec.rate_scale is not None or spec.target_rps is not None:
        from studies.transforms import scale_rate

        trace = scale_rate(trace, factor=spec.rate_scale, target_rps=spec.target_rps)
    return trace


def build_cost_model(spec: StudySpec, tp: int):
    """The spec's model on its GPU and framework at TP ``tp``."""
    from costmodels import build

    return build(spec.model, spec.gpu, tp=tp, framework=spec.framework)
