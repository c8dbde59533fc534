"""Evaluator: a study's trace, cost models and SLOs, loaded once, and configs scored on them.

Trials call ``reports(configs, fleets=...)``: the configs not seen before are simulated
(one ``simulate_many`` per fleet, which runs them in parallel on threads), each
scored into a Report. Results are cached by the config's vector, the fleet and the rate
scale, so a config the sampler proposes twice is simulated once. Reports are kept for
every config; SimResults (per-request arrays, megabytes on a large trace) only for the
most recent ``keep_results`` ones.

A fleet is ``replicas`` engines of TP ``tp`` (``optimizer.search.space.Fleet``; the spec's by
default), each laid out for expert and attention data parallelism when the model is MoE.
Its cost model is built once per layout (``costmodels.layout.ParallelLayout``); an
attention-DP instance runs as ``attention_dp`` schedulers on the cost model of one group
(which times the MoE layer at ``attention_dp`` times the group's tokens), stepping together
(``policies.engine.lockstep``: each step as long as the slowest group's), so the
simulator runs ``Fleet.schedulers`` replicas. One scheduler runs the single-replica engine
(``policies.engine``); more than one, or any failure plan, runs the fleet kernel
(``policies.fleet``: the config's router, migration and prefill/decode split under one
clock, every replica on the run's seed), one ``simulate_fleet_many`` per fleet over the
batch's configs. The study's failure plan (``optimizer.search.failplan``) becomes a schedule per
(rate scale, replicas), compressed with the trace; the cache key holds that schedule, so
runs under different failures never share an entry.

The engines, scorer and cost-model builder are injectable (``engine``: any object with
``simulate``/``simulate_many``, and ``validate`` optionally; ``fleet_engine``: any with
``simulate_fleet_many``; any ``score(result, trace, slos)``; any ``tp -> CostModel``, called with the
``ParallelLayout`` instead for an EP / attention-DP layout), so the search logic is
testable without the real kernels or profiles.
"""

from __future__ import annotations

import importlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from costmodels.costmodel import CostModelError
from optimizer.search.failplan import compressed
from optimizer.search.space import Fleet, infeasibility
from optimizer.search.spec import SpecError, StudySpec
from policies.config import ConfigError, PolicyConfig, check_fleet
from policies.engines import target as engine_target
from policies.failures import FailureError, FailureSchedule
from policies.workspace import out_of_memory


class Evaluator:
    """Simulate and score configs for one study; ``engine_seconds`` is time spent doing so."""

    def __init__(self, spec: StudySpec, *, trace=None, cost_model=None,
                 cost_model_for: Callable[[int], Any] | None = None, engine: Any = None,
                 fleet_engine: Any = None, scorer: Callable | None = None, keep_results: int = 32) -> None:
        self.spec = spec
        self.slos = spec.slos
        self.fleet = spec.fleet
        loaded = trace if trace is not None else load_study_trace(spec)
        #: the whole study trace (the traffic a bench replays)
        self.full_trace = loaded
        #: the tuning window, and the held-out end of the trace scored after the search (None: no holdout)
        self.trace, self.holdout_trace = split_holdout(loaded, spec.holdout)
        self.target = engine_target(spec.engine)
        self._build = cost_model_for if cost_model_for is not None else (lambda tp: build_cost_model(spec, tp))
        self._cost_models: dict[Any, Any] = {} if cost_model is None else {self.fleet.tp: cost_model}
        for tp in spec.search_space.tp_choices:  # a TP the model cannot run fails now, not mid-study
            self.cost_model_at(tp)
        self.cost_model = self.cost_model_of(self.fleet)
        self.engine = engine if engine is not None else importlib.import_module("policies.engine")
        self._fleet_engine = fleet_engine
        self.scorer = scorer if scorer is not None else importlib.import_module("studies.metrics").score
        self.keep_results = keep_results
        self.engine_seconds = 0.0
        self.simulations = 0
        self._reports: dict[bytes, Any] = {}
        self._results: OrderedDict[bytes, Any] = OrderedDict()
        self._scaled: dict[float, Any] = {1.0: self.trace}
        self._schedules: dict[tuple[float, int], FailureSchedule | None] = {}
        # the most KV each request will hold (prompt + the output it will generate, within
        # its cap): pruning asks whether the trace's requests can fit, not a scheduling question.
        # A request longer than the model's context is refused by every config (the engine
        # rejects it, counted, as `simulate` does), so it never makes a config infeasible.
        tokens = np.asarray(self.trace.prompt_tokens) + np.minimum(
            np.asarray(self.trace.max_tokens), np.maximum(np.asarray(self.trace.output_tokens), 1))
        context = spec.context.context_len if spec.context is not None else 0
        servable = tokens <= context if context > 0 else np.ones(len(tokens), dtype=bool)
        if self.trace.n and not servable.any():
            prompts_fit = np.asarray(self.trace.prompt_tokens) < context
            remedy = ("cap the outputs (--max-tokens) or drop the longest requests" if prompts_fit.any() else
                      "their prompts alone fill it: drop them, or tune a model with a longer context")
            raise SpecError(f"every request of the trace ({self.trace.n}) needs more than the model's {context:,}-token "
                            f"context (prompt + output): no config can serve any of them; {remedy}")
        self._request_tokens = tokens[servable]
        self._prompt_tokens = np.asarray(self.trace.prompt_tokens)[servable]

    def on(self, trace, *, cost_model_for: Callable[[Any], Any] | None = None) -> Evaluator:
        """An evaluator of the same study on another ``trace`` (all of it scored: no holdout),
        sharing this one's cost models unless ``cost_model_for`` builds others."""
        return Evaluator(self.spec.replace(holdout=0.0, context=self.spec.context), trace=trace,
                         cost_model_for=cost_model_for or self.cost_model_at, engine=self.engine,
                         fleet_engine=self._fleet_engine, scorer=self.scorer, keep_results=self.keep_results)

    # -- configs -------------------------------------------------------------------------
    def baselines(self) -> dict[str, PolicyConfig]:
        """The target's baselines (an engine's own defaults for the spec's GPU and model;
        both engines' for the what-if target), behind the deployment's router and pools
        when the spec fixes them, with LoRA on for a trace that asks for adapters (an engine
        without it refuses those requests): every result's point of comparison."""
        fixed = {**self.spec.deployment_knobs, **({"enable_lora": True} if self.spec.search_space.base.enable_lora
                                                  else {})}
        presets = {name: config.replace(**fixed) for name, config in self.target.baselines(self.spec.context).items()}
        drafter = self.spec.speculative
        if drafter is None or self.target.what_if:
            return presets
        # with a drafter, also the defaults verifying its whole draft at every step (the usual fixed k)
        k = drafter.max_draft_tokens
        return {**presets, **{f"{name}+drafter-k{k}": self.target.with_drafter(config.replace(
            **drafter.config_values(), speculative_mode="fixed", num_speculative_tokens=k))
            for name, config in presets.items()}}

    def cost_model_at(self, tp: int):
        """The cost model of the study's model and GPU at TP ``tp`` (built once)."""
        return self._cost_model(tp, f"tp={tp}")

    def cost_model_of(self, fleet: Fleet):
        """The cost model of one scheduler of ``fleet``: its TP's, or its layout's (built once)."""
        if fleet.moe_ep == 1 and fleet.attention_dp == 1:
            return self.cost_model_at(fleet.tp)
        return self._cost_model(fleet.layout, f"layout {fleet.layout.label}")

    def _cost_model(self, key, where: str):
        """``self._build(key)`` once per key (a TP degree or a ParallelLayout)."""
        if key not in self._cost_models:
            try:
                self._cost_models[key] = self._build(key)
            except CostModelError as exc:
                raise SpecError(f"{where}: {exc}") from None
        return self._cost_models[key]

    def infeasibility(self, config: PolicyConfig, fleet: Fleet | None = None) -> str | None:
        """Why ``config`` cannot serve this trace on ``fleet`` (pruned before simulating), or None."""
        fleet = fleet or self.fleet
        broken = self.target.violations(config, self.spec.context)
        if not self.target.what_if:
            broken += self.target.layout_violations(self.deployment(fleet), self.spec.context)
        if broken:
            return f"{self.target.display} {self.target.version} refuses it: " + "; ".join(broken)
        try:
            cost_model = self.cost_model_of(fleet)
        except SpecError as exc:  # a layout whose weights do not fit, say: this fleet only
            if fleet.moe_ep == 1 and fleet.attention_dp == 1:
                raise
            return str(exc)
        reason = infeasibility(config, cost_model, self._request_tokens, self._prompt_tokens)
        if reason is not None:
            return reason
        try:
            check_fleet(config, fleet.schedulers, fleet.attention_dp)
            self.failures_at(1.0, fleet)
            if hasattr(self.engine, "validate"):
                self.engine.validate(self.trace, cost_model, config)
        except (ConfigError, FailureError) as exc:
            return str(exc)
        return None

    def deployment(self, fleet: Fleet):
        """``fleet`` as the engine deployment of the study's model (``policies.engines.Deployment``)."""
        from policies.engines import Deployment

        return Deployment(self.spec.model, fleet.tp, fleet.replicas, fleet.moe_ep, fleet.attention_dp)

    def out_of_memory(self, config: PolicyConfig, fleet: Fleet | None = None) -> str | None:
        """Why ``config``'s run at the trace rate (already scored) ran out of activation
        memory, as the target engine fails (``policies.workspace``), or None."""
        fleet = fleet or self.fleet
        report = self._reports[self._key(config, fleet, 1.0)]
        return out_of_memory(report.peak_step_tokens, report.peak_step_s, self.cost_model_at(fleet.tp), config,
                             self.target.oom_consequence)

    def failures_at(self, rate_scale: float, fleet: Fleet) -> FailureSchedule | None:
        """The failure windows ``fleet`` runs with at ``rate_scale``, per scheduler (None:
        the study declares no failures): the plan's are per instance, and an attention-DP
        instance's window stops all of its ranks. Raises FailureError for a replica the
        fleet lacks."""
        plan = self.spec.failures
        if plan is None:
            return None
        key = (rate_scale, fleet.replicas, fleet.attention_dp)
        if key not in self._schedules:
            schedule = plan.schedule(fleet.replicas, np.asarray(self.trace.arrival_s), self.spec.seed)
            t0 = float(self.trace.arrival_s[0]) if self.trace.n else 0.0
            self._schedules[key] = compressed(schedule, t0, rate_scale).per_rank(fleet.attention_dp)
        return self._schedules[key]

    @property
    def fleet_engine(self):
        """The multi-replica engine (imported on first use: one-replica studies never need it)."""
        if self._fleet_engine is None:
            self._fleet_engine = importlib.import_module("policies.fleet")
        return self._fleet_engine

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

    def simulate_on(self, trace, config: PolicyConfig, fleet: Fleet | None = None):
        """SimResult of one config on another trace (the traffic a bench replays): not
        cached, and without the study's failure plan, which no replay reproduces."""
        fleet = fleet or self.fleet
        cost_model, seed = self.cost_model_of(fleet), self.spec.seed
        options = {} if self.spec.speculative is None else {"acceptance": self.spec.speculative.acceptance}
        if fleet.schedulers == 1:
            return self.engine.simulate(trace, cost_model, config, seed=seed, **options)
        return self.fleet_engine.simulate_fleet_many(trace, cost_model, [config], seed=seed, replicas=fleet.schedulers,
                                                     failures=None, lockstep=fleet.attention_dp, **options)[0]

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
        cost_model, seed = self.cost_model_of(fleet), self.spec.seed
        # the declared drafter's acceptance profile (an engine without speculation needs none)
        options = {} if self.spec.speculative is None else {"acceptance": self.spec.speculative.acceptance}
        failures = self.failures_at(rate_scale, fleet)
        if fleet.schedulers == 1 and failures is None:
            if len(configs) == 1:
                return [self.engine.simulate(trace, cost_model, configs[0], seed=seed, **options)]
            return self.engine.simulate_many(trace, cost_model, configs, seed=seed, **options)
        return self.fleet_engine.simulate_fleet_many(trace, cost_model, configs, seed=seed, replicas=fleet.schedulers,
                                                     failures=failures, lockstep=fleet.attention_dp, **options)

    def _trim(self, protect: int) -> None:
        """Drop the oldest SimResults beyond ``keep_results`` (never the newest ``protect``)."""
        while len(self._results) > max(self.keep_results, protect):
            self._results.popitem(last=False)

    def _key(self, config: PolicyConfig, fleet: Fleet, rate_scale: float) -> bytes:
        key = config.to_vector().tobytes() + np.array([rate_scale, fleet.tp, fleet.replicas, fleet.moe_ep,
                                                       fleet.attention_dp]).tobytes()
        failures = self.failures_at(rate_scale, fleet)
        if failures is not None:
            key += b"failures" + b"".join(np.asarray(c).tobytes()
                                         for c in (failures.replica, failures.t_down, failures.t_up))
        return key


def load_study_trace(spec: StudySpec):
    """The spec's trace file, loaded and rate-transformed as the spec says, with the caps a
    client sends where the file has none and the output estimate the spec's predictor gives."""
    from studies.traces import load_trace

    trace = load_trace(spec.trace, format=spec.trace_format, **dict(spec.trace_options))
    if spec.rate_scale is not None or spec.target_rps is not None:
        from studies.transforms import scale_rate

        trace = scale_rate(trace, factor=spec.rate_scale, target_rps=spec.target_rps)
    return client_view(trace, spec)


def client_view(trace, spec: StudySpec):
    """``trace`` as the scheduler sees it: the clients' caps and the predictor's estimates."""
    from studies.lengths import Predictor, with_client_caps

    trace = with_client_caps(trace, max_tokens=spec.max_tokens, context_len=spec.context.context_len)
    return Predictor.parse(spec.predictor).apply(trace, seed=spec.seed)


def split_holdout(trace, holdout: float):
    """(tuning part, held-out part): the last ``holdout`` share of the arrival window is kept
    for scoring the recommendation on traffic it was not tuned on (None when 0)."""
    if holdout <= 0 or trace.n < 2:
        return trace, None
    from studies.transforms import window

    t0, t1 = float(trace.arrival_s[0]), float(trace.arrival_s[-1])
    if not t1 > t0:  # every request at one instant: no later part to hold out
        return trace, None
    split = t0 + (1.0 - holdout) * (t1 - t0)
    return window(trace, t0, split, rebase=False), window(trace, split, None, rebase=True)


def build_cost_model(spec: StudySpec, tp):
    """The spec's model on its GPU and framework at TP ``tp`` (an int or a ``ParallelLayout``)."""
    from costmodels import build
    from costmodels.layout import ParallelLayout

    layout = tp if isinstance(tp, ParallelLayout) else ParallelLayout(tp)
    return build(spec.model, spec.gpu, tp=layout.tp, framework=spec.framework, calibration=spec.calibration,
                 model_config=spec.model_config, gemm_dtype=spec.dtype, kv_dtype=spec.kv_cache_dtype,
                 moe_ep_size=layout.moe_ep_size, attention_dp_size=layout.attention_dp_size)
