"""Evaluator: a study's trace, cost model and SLOs, loaded once, and configs scored on them.

Trials call ``reports(configs)``: one ``simulate_many`` over the configs not seen before
(the engine runs them in parallel with ``prange``), each scored into a Report. Results
are cached by the config's vector and the rate scale, so a config the sampler proposes
twice is simulated once. Reports are kept for every config; SimResults (per-request
arrays, megabytes on a large trace) only for the most recent ``keep_results`` ones.

The engine and scorer are injectable (any object with ``simulate``/``simulate_many``,
and ``validate`` optionally; any ``score(result, trace, slos)``), so the search logic is
testable without the real kernel.
"""

from __future__ import annotations

import importlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from optimizer.space import infeasibility
from optimizer.spec import SpecError, StudySpec
from policies.config import KNOB_BY_NAME, ConfigError, PolicyConfig
from policies.presets import PRESETS, preset


class Evaluator:
    """Simulate and score configs for one study; ``engine_seconds`` is time spent doing so."""

    def __init__(self, spec: StudySpec, *, trace=None, cost_model=None, engine: Any = None,
                 scorer: Callable | None = None, keep_results: int = 32) -> None:
        if spec.replicas > 1 and "replicas" not in KNOB_BY_NAME:
            raise SpecError(f"replicas = {spec.replicas}: the engine simulates one replica so far; tune one "
                            f"replica on its share of the traffic instead (--rate-scale {1 / spec.replicas:g})")
        self.spec = spec
        self.slos = spec.slos
        self.trace = trace if trace is not None else load_study_trace(spec)
        self.cost_model = cost_model if cost_model is not None else _build_cost_model(spec)
        self.engine = engine if engine is not None else importlib.import_module("policies.engine")
        self.scorer = scorer if scorer is not None else importlib.import_module("studies.metrics").score
        self.keep_results = keep_results
        self.engine_seconds = 0.0
        self.simulations = 0
        self._reports: dict[bytes, Any] = {}
        self._results: OrderedDict[bytes, Any] = OrderedDict()
        self._scaled: dict[float, Any] = {1.0: self.trace}
        self._request_tokens = np.asarray(self.trace.prompt_tokens) + np.asarray(self.trace.max_tokens)

    # -- configs -------------------------------------------------------------------------
    def baselines(self) -> dict[str, PolicyConfig]:
        """The engines' own defaults for the spec's GPU: every result's point of comparison."""
        return {name: preset(name, self.spec.gpu) for name in PRESETS}

    def infeasibility(self, config: PolicyConfig) -> str | None:
        """Why ``config`` cannot serve this trace (pruned before simulating), or None."""
        reason = infeasibility(config, self.cost_model, self._request_tokens, self.trace.prompt_tokens)
        if reason is None and hasattr(self.engine, "validate"):
            try:
                self.engine.validate(self.trace, self.cost_model, config)
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

    def simulate(self, config: PolicyConfig, rate_scale: float = 1.0):
        """(SimResult, Report) for one config at a rate scale."""
        return self.simulate_batch([config], rate_scale)[0]

    def simulate_batch(self, configs: Sequence[PolicyConfig], rate_scale: float = 1.0) -> list[tuple]:
        """(SimResult, Report) per config, simulating the ones not cached in one parallel call."""
        keys = [self._key(c, rate_scale) for c in configs]
        self._run([c for c, k in zip(configs, keys, strict=True) if k not in self._results], rate_scale)
        out = [(self._results[k], self._reports[k]) for k in keys]
        for k in keys:
            self._results.move_to_end(k)
        self._trim(len(keys))
        return out

    def reports(self, configs: Sequence[PolicyConfig], rate_scale: float = 1.0) -> list:
        """Report per config; only configs never scored before are simulated."""
        keys = [self._key(c, rate_scale) for c in configs]
        self._run([c for c, k in zip(configs, keys, strict=True) if k not in self._reports], rate_scale)
        self._trim(0)
        return [self._reports[k] for k in keys]

    def _run(self, configs: Sequence[PolicyConfig], rate_scale: float) -> None:
        unique = list({self._key(c, rate_scale): c for c in configs}.items())
        if not unique:
            return
        trace = self.trace_at(rate_scale)
        start = time.perf_counter()
        if len(unique) == 1:
            results = [self.engine.simulate(trace, self.cost_model, unique[0][1], seed=self.spec.seed)]
        else:
            results = self.engine.simulate_many(trace, self.cost_model, [c for _, c in unique], seed=self.spec.seed)
        for (key, _), result in zip(unique, results, strict=True):
            self._reports[key] = self.scorer(result, trace, self.slos)
            self._results[key] = result
            self._results.move_to_end(key)
        self.engine_seconds += time.perf_counter() - start
        self.simulations += len(unique)

    def _trim(self, protect: int) -> None:
        """Drop the oldest SimResults beyond ``keep_results`` (never the newest ``protect``)."""
        while len(self._results) > max(self.keep_results, protect):
            self._results.popitem(last=False)

    @staticmethod
    def _key(config: PolicyConfig, rate_scale: float) -> bytes:
        return config.to_vector().tobytes() + np.float64(rate_scale).tobytes()


def load_study_trace(spec: StudySpec):
    """The spec's trace file, loaded and rate-transformed as the spec says."""
    from studies.traces import load_trace

    trace = load_trace(spec.trace, format=spec.trace_format, **dict(spec.trace_options))
    if spec.rate_scale is not None or spec.target_rps is not None:
        from studies.transforms import scale_rate

        trace = scale_rate(trace, factor=spec.rate_scale, target_rps=spec.target_rps)
    return trace


def _build_cost_model(spec: StudySpec):
    from costmodels import build

    return build(spec.model, spec.gpu, tp=spec.tp, framework=spec.framework)
