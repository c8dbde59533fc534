"""StudySpec: the whole question a tuning run answers, from a TOML file and/or CLI flags.

A study is a trace (and its rate transform), a deployment (model, GPU, TP, replicas,
framework), SLO classes, an objective mode, constraints, a search space, a trial budget
and a seed; optionally a speculative-decoding drafter (``optimizer.search.drafter``: the spec's
``[speculative]`` table, or ``--speculative drafter.toml``), which opens the verify-budget
knobs to the search and whose acceptance profile every simulation then uses; and
optionally a failure plan (``optimizer.search.failplan``: the ``[failures]`` table, or ``--fail``,
``--mtbf`` and ``--repair``), which every simulation of the fleet then runs through.
``--router NAME`` and ``--prefill-replicas P`` fix those fleet knobs (``[space.router]
value = NAME``), and the baselines run with them too: they describe the deployment's router
and pools, not an engine default.
``load_spec(path, **flags)`` reads a TOML file (see ``studies/examples/*.toml``) and lets
CLI flags override it; with no file, the flags ``trace``, ``model``, ``gpu`` and ``slo``
are enough and everything else has a default.

The spec's ``fingerprint`` covers everything that changes trial results (trace bytes,
transforms, deployment, SLOs, objective, constraints, space, seed) and nothing that does
not (trial budget, batch size, storage, run folder), so rerunning the same command
continues the same study, and a changed question is refused rather than mixed in.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from costmodels.build import GEMM_DTYPES
from costmodels.build import KV_DTYPES as COST_KV_DTYPES
from optimizer.search.drafter import DRAFTER_LABELS, Drafter, drafter_from_mapping, load_drafter
from optimizer.search.failplan import FailurePlan
from optimizer.search.space import Fleet, SearchSpace, build_space, tp_degrees
from optimizer.search.targets import engine_context
from policies.engines import ENGINES, TARGETS, EngineContext
from policies.engines import target as engine_target
from studies.lengths import Predictor
from studies.names import unknown_names
from studies.slo import SLOSet, parse_slo, slo_from_mapping
from studies.tomlfile import read_toml
from studies.traces import MAX_TOKENS, TraceError


class SpecError(ValueError):
    """An inconsistent or incomplete study spec, naming the field and what is valid."""


#: Objective modes: name -> (metric names, directions). See optimizer.search.objective.
OBJECTIVE_MODES = ("goodput", "goodput-gpus", "goodput-ttft", "goodput-cost", "capacity")
SAMPLERS = ("tpe", "tpe-full", "nsga2", "random")
DTYPES = GEMM_DTYPES  # weights (fp8, nvfp4: the GEMMs too)
KV_DTYPES = ("auto", *COST_KV_DTYPES)
#: On-demand $/GPU-hour used by the cost objective when the spec gives none (indicative).
GPU_HOUR_USD = {"a100": 2.0, "h100": 3.0, "h200": 3.8}
#: Fleet knobs a flag fixes for the whole study (baselines included): the deployment's own.
FIXED_FLEET_FLAGS = ("router", "prefill_replicas")


def default_batch_size() -> int:
    """One simulation per core: the engine runs a batch in parallel over configs."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


@dataclass(frozen=True)
class Constraints:
    """Feasibility bounds every trial must meet (Optuna constraints, <= 0 is feasible).

    ``max_rejected_fraction`` None (the default) means *auto*: the least-rejecting
    baseline's rejected fraction plus ``rejected_slack``. A default scheduler rejects
    only requests that can never fit, so this stops the search from buying goodput by
    turning away traffic the deployment could serve; an absolute cap replaces it.

    ``p99_ttft_ms`` None (the default) is auto too: ``ttft_tail_factor`` times the larger
    of the loosest TTFT SLO and the best baseline's p99 TTFT, so that the search cannot
    buy goodput by starving a tail (a shortest-job-first order can leave long requests
    waiting minutes); an absolute bound replaces it, ``ttft_tail_factor = 0`` drops it.
    """

    max_rejected_fraction: float | None = None
    rejected_slack: float = 0.01
    p99_ttft_ms: float | None = None
    ttft_tail_factor: float = 2.0
    p99_tpot_ms: float | None = None
    p99_e2el_ms: float | None = None
    max_preemption_rate: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise SpecError(f"constraints.{f.name} must be a number >= 0, got {value!r}")
        if 0 < self.ttft_tail_factor < 1:
            raise SpecError(f"constraints.ttft_tail_factor is 0 (off) or >= 1 (a tail no better than the "
                            f"baselines' can always be kept), got {self.ttft_tail_factor}")
        if self.max_rejected_fraction is not None and self.max_rejected_fraction > 1:
            raise SpecError(f"constraints.max_rejected_fraction is a fraction in [0, 1], got {self.max_rejected_fraction}")


@dataclass(frozen=True)
class StudySpec:
    """Everything one study needs; validated on construction."""

    trace: Path
    model: str
    gpu: str
    slos: SLOSet
    trace_format: str | None = None
    trace_options: Mapping[str, Any] = field(default_factory=dict)
    rate_scale: float | None = None  # multiply the trace's arrival rate
    target_rps: float | None = None  # or scale it to this mean rate
    tp: int = 1
    replicas: int = 1
    framework: str = "vllm"
    objective: str = "goodput"
    constraints: Constraints = field(default_factory=Constraints)
    space: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    trials: int = 100
    batch_size: int = field(default_factory=default_batch_size)
    seed: int = 0
    sampler: str = "tpe"
    study_name: str = ""
    storage: str | None = None
    run_dir: Path | None = None
    capacity_target: float = 0.9
    gpu_hour_usd: float | None = None
    speculative: Drafter | None = None  # or a drafter TOML path, or its keys
    failures: FailurePlan | None = None  # or a [failures] table
    engine: str = "servetune"  # the target: vllm, sglang, or servetune's what-if policies
    max_tokens: int | None = None  # the cap clients send where the trace has none (None: context - prompt)
    predictor: str = "cap"  # the output-length estimate SJF orders by: cap, noisy:SIGMA, oracle
    holdout: float = 0.0  # share of the window, at its end, kept out of tuning and scored after it
    calibration: Path | None = None  # a calibration file (`servetune calibrate`); None: the bundled one
    model_config: Path | None = None  # a HuggingFace config.json for a model servetune does not ship
    dtype: str = "bf16"  # weights: bf16, fp8 or nvfp4 (B200)
    kv_dtype: str = "auto"  # KV cache: auto (the weights' activation dtype, bf16), bf16 or fp8
    #: the GPU and model the engine resolves its defaults for (built from model and GPU if None)
    context: EngineContext | None = field(default=None, compare=False, repr=False)
    #: distinct LoRA adapters the trace asks for, which opens the adapter-pool knobs (None:
    #: counted from the trace file; only the native format carries adapters)
    adapters: int | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "trace", Path(self.trace))
        for name in ("calibration", "model_config"):
            if getattr(self, name) is not None:
                set_(self, name, Path(getattr(self, name)))
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype (weights) must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise SpecError(f"kv_dtype must be one of {list(KV_DTYPES)}, got {self.kv_dtype!r}")
        set_(self, "constraints", _constraints(self.constraints))
        set_(self, "space", {k: dict(v) if isinstance(v, Mapping) else v for k, v in dict(self.space).items()})
        for name in ("model", "gpu"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise SpecError(f"{name} is required (e.g. --{name} {'meta-llama/Llama-3.1-8B' if name == 'model' else 'h100'})")
        if self.objective not in OBJECTIVE_MODES:
            raise SpecError(f"objective {self.objective!r} is unknown; valid: {list(OBJECTIVE_MODES)}")
        if not self.slos.has_bounds:
            raise SpecError(f"objective {self.objective!r} counts requests that meet an SLO, but no SLO bound is set; "
                            "give --slo ttft:2000,tpot:100 or [slo.NAME] tables")
        if self.sampler not in SAMPLERS:
            raise SpecError(f"sampler {self.sampler!r} is unknown; valid: {list(SAMPLERS)}")
        for name in ("tp", "replicas", "trials", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise SpecError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.rate_scale is not None and self.target_rps is not None:
            raise SpecError("give trace rate_scale or target_rps, not both")
        for name in ("rate_scale", "target_rps", "gpu_hour_usd"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and math.isfinite(value) and value > 0):
                raise SpecError(f"{name} must be a number > 0, got {value!r}")
        if not (_is_number(self.capacity_target) and 0 < self.capacity_target <= 1):
            raise SpecError(f"capacity_target is an SLO-attainment fraction in (0, 1], got {self.capacity_target!r}")
        if self.engine not in TARGETS:
            raise SpecError(f"engine {self.engine!r} is unknown; valid: {list(TARGETS)}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or not 1 <= self.max_tokens <= MAX_TOKENS):
            raise SpecError(f"max_tokens must be an integer in [1, {MAX_TOKENS}], got {self.max_tokens!r}")
        if not (_is_number(self.holdout) and 0.0 <= self.holdout < 1.0):
            raise SpecError(f"holdout is a share of the trace window in [0, 1), got {self.holdout!r}")
        if not isinstance(self.trace_options, Mapping):
            raise SpecError(f"trace options must be a table of reader options, got {self.trace_options!r}")
        try:
            Predictor.parse(self.predictor)
        except TraceError as exc:
            raise SpecError(str(exc)) from None
        drafter = _drafter(self.speculative)
        set_(self, "speculative", drafter)
        if self.context is None:
            try:
                set_(self, "context", engine_context(
                    self.model, self.gpu, self.tp, self.framework, self.replicas,
                    None if self.model_config is None else str(self.model_config), self.dtype, self.kv_cache_dtype))
            except ValueError as exc:
                raise SpecError(f"deployment: {exc}") from None
        target = engine_target(self.engine)
        base = target.defaults(self.context)
        set_(self, "search_space", build_space(
            self.space, base if drafter is None else base.replace(**drafter.config_values()),
            Fleet(self.tp, self.replicas), search_fleet=self.objective == "goodput-gpus",
            tp_degrees=lambda: tp_degrees(self.model, self.gpu, self.framework, self.model_config, self.dtype),
            drafter_tokens=None if drafter is None else drafter.max_draft_tokens,
            speculative_modes=None if drafter is None else target.speculative_search_modes(drafter.names,
                                                                                            self.replicas),
            target=target, context=self.context, adapters=self._adapters()))
        _check_block_sizes(self.search_space, self.engine, self.context)
        if drafter is None and ("speculative_mode" in self.search_space.names
                                or self.search_space.base.speculative_mode != "off"):
            raise SpecError("speculative_mode needs a drafter whose acceptance the simulation can use: declare "
                            "it with --speculative DRAFTER.toml or a [speculative] table (see optimizer.search.drafter)")
        set_(self, "failures", _failures(self.failures, self.search_space))
        if not self.study_name:
            name = default_study_name(self.trace, self.model, self.gpu)
            # positional digits: a name takes no exponent's '+' (1e+06)
            if self.rate_scale is not None:
                name += f"-x{np.format_float_positional(self.rate_scale, trim='-')}"
            elif self.target_rps is not None:
                name += f"-{np.format_float_positional(self.target_rps, trim='-')}rps"
            set_(self, "study_name", name)
        if not isinstance(self.study_name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.study_name):
            raise SpecError(f"study name {self.study_name!r} may use letters, digits, '.', '_' and '-' only")
        set_(self, "run_dir", Path(self.run_dir) if self.run_dir is not None else Path("runs") / self.study_name)

    search_space: SearchSpace = field(init=False, repr=False, compare=False)

    def _adapters(self) -> int:
        """``adapters``, or the count in the trace file (a native file that exists; other
        formats have no adapter column)."""
        if self.adapters is not None:
            return self.adapters
        from studies import formats
        from studies.traces import TraceError, load_trace

        try:
            if not self.trace.is_file() or (self.trace_format or formats.detect(self.trace)) != "native":
                return 0
            trace = load_trace(self.trace, format="native", **dict(self.trace_options))
        except TraceError:
            return 0  # not counted here: the evaluator loads the file and reports what is wrong with it
        return sum(1 for name in set(trace.adapter_labels) if name)

    @property
    def kv_cache_dtype(self) -> str:
        """The KV dtype simulated: ``auto`` is the activations' (bf16, with fp8 weights too)."""
        return "bf16" if self.kv_dtype == "auto" else self.kv_dtype

    @property
    def gpus(self) -> int:
        return self.fleet.gpus

    @property
    def fleet(self) -> Fleet:
        """The deployment's TP and replicas: the baselines' fleet, and every trial's unless searched."""
        return self.search_space.base_fleet

    @property
    def deployment_knobs(self) -> dict[str, Any]:
        """The fleet knobs the study fixes (``FIXED_FLEET_FLAGS`` given a ``value``): the
        deployment's router and pools, which the baselines run with too."""
        return {k: getattr(self.search_space.base, k) for k in FIXED_FLEET_FLAGS
                if isinstance(self.space.get(k), Mapping) and "value" in self.space[k]}

    @property
    def usd_per_gpu_hour(self) -> float:
        if self.gpu_hour_usd is not None:
            return self.gpu_hour_usd
        return GPU_HOUR_USD.get(self.gpu.lower().replace("-sxm", ""), 3.0)

    def replace(self, **changes: Any) -> StudySpec:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The spec as TOML-shaped sections (None = unset); ``spec_from_dict`` reads it back."""
        return {
            "study": {"name": self.study_name, "trials": self.trials, "batch_size": self.batch_size,
                      "seed": self.seed, "sampler": self.sampler, "storage": self.storage,
                      "run_dir": str(self.run_dir), "engine": self.engine, "holdout": self.holdout},
            "trace": {"path": str(self.trace), "format": self.trace_format, "options": dict(self.trace_options),
                      "rate_scale": self.rate_scale, "target_rps": self.target_rps,
                      "max_tokens": self.max_tokens, "predictor": self.predictor},
            "deployment": {"model": self.model, "gpu": self.gpu, "tp": self.tp, "replicas": self.replicas,
                           "framework": self.framework, "gpu_hour_usd": self.gpu_hour_usd,
                           # only when given, so studies on the defaults keep their fingerprint
                           **({} if self.calibration is None else {"calibration": str(self.calibration)}),
                           **({} if self.model_config is None else {"model_config": str(self.model_config)}),
                           **({} if self.dtype == "bf16" else {"dtype": self.dtype}),
                           **({} if self.kv_dtype == "auto" else {"kv_dtype": self.kv_dtype})},
            "slo": {c.name: {k: v for k, v in (("ttft", c.ttft_ms), ("tpot", c.tpot_ms), ("e2el", c.e2el_ms),
                                               ("weight", c.weight)) if v is not None}
                    for c in self.slos.classes},
            "objective": {"mode": self.objective, "capacity_target": self.capacity_target},
            "constraints": asdict(self.constraints),
            "space": {k: dict(v) if isinstance(v, Mapping) else v for k, v in self.space.items()},
            # only when declared, so studies without a drafter keep their fingerprint
            **({} if self.speculative is None else {"speculative": self.speculative.to_dict()}),
            **({} if self.failures is None else {"failures": self.failures.to_dict()}),
        }

    def fingerprint(self) -> str:
        """Hash of everything that changes results; the files by content, not by path."""
        data = self.to_dict()
        data["trace"] = {**data["trace"], "path": None, "sha256": file_sha256(self.trace)}
        for key in ("calibration", "model_config"):
            if key in data["deployment"] and Path(data["deployment"][key]).is_file():
                data["deployment"][key] = file_sha256(data["deployment"][key])
        data["study"] = {"seed": self.seed, "engine": self.engine, "holdout": self.holdout}
        if "speculative" in data:  # the drafter's engine names only label the exports
            data["speculative"] = {k: v for k, v in data["speculative"].items() if k not in DRAFTER_LABELS}
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def block_size_refusals(block_size: int, budget: int, context: EngineContext,
                        engines: tuple[str, ...] = ENGINES) -> str | None:
    """Why none of ``engines`` starts with KV blocks of ``block_size`` tokens (vLLM takes a
    fixed set; SGLang's page size must divide the chunked-prefill budget), each engine's
    rule named; None when one of them does. Each engine judges it at its defaults with the
    config's token budget ``budget``, so only the rules the block size breaks count."""
    refusals = {}
    for name in engines:
        engine = engine_target(name)
        base = engine.defaults(context).replace(max_num_batched_tokens=budget)
        others = set(engine.violations(base, context))
        broken = [v for v in engine.violations(base.replace(block_size=block_size), context) if v not in others]
        if not broken:
            return None
        refusals[engine.display] = "; ".join(broken)
    reasons = " | ".join(f"{who}: {why}" for who, why in refusals.items())
    return f"block_size={block_size}: refused by {' and '.join(refusals)} ({reasons})"


def _check_block_sizes(space: SearchSpace, engine: str, context: EngineContext) -> None:
    """Refuse a fixed block size, or a choice of one, that the target engine (any engine,
    for servetune's own policies) does not start with: every trial with it would be refused
    or describe no deployment. A searched range is left to the trials, which are pruned."""
    param = next((p for p in space.params if p.name == "block_size"), None)
    if param is None:
        sizes = (space.base.block_size,)
    elif param.kind == "categorical":
        sizes = param.choices
    else:
        return
    engines = (engine,) if engine in ENGINES else ENGINES
    for size in sizes:
        refused = block_size_refusals(int(size), space.base.max_num_batched_tokens, context, engines)
        if refused:
            raise SpecError(f"[space.block_size]: {refused}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as exc:
        raise SpecError(f"trace {path}: cannot read ({exc.strerror})") from None
    return digest.hexdigest()


def default_study_name(trace: Path, model: str, gpu: str) -> str:
    """``<trace stem>-<model short name>-<gpu>``: readable, and the same for the same command.

    A rate transform appends ``-x<scale>`` or ``-<rps>rps``; other changes to the question
    under the same name are refused with a message naming what differs.
    """
    raw = f"{Path(trace).stem}-{model.rstrip('/').split('/')[-1]}-{gpu}".lower()
    return re.sub(r"[^a-z0-9._-]+", "-", raw).strip("-.")


def load_spec(path: str | Path | None = None, **flags: Any) -> StudySpec:
    """Build a spec from a TOML file (optional) with CLI flags on top (None = not given).

    Flags: every StudySpec field name, plus ``slo`` (a ``ttft:2000,tpot:100`` string),
    ``slo_file`` (a TOML of ``[slo.NAME]`` tables), ``fail`` / ``mtbf_s`` / ``repair_s``
    (a failure plan replacing the file's) and ``router`` / ``prefill_replicas`` (fix those
    knobs in the space). Relative paths in the file resolve against the file's folder.
    """
    values: dict[str, Any] = {}
    if path is not None:
        values = _from_toml(Path(path))
    given = {k: v for k, v in flags.items() if v is not None}
    slo_text, slo_file = given.pop("slo", None), given.pop("slo_file", None)
    if slo_text is not None and slo_file is not None:
        raise SpecError("give --slo or --slo-file, not both")
    if slo_text is not None:
        values["slos"] = _parse(parse_slo, slo_text)
    elif slo_file is not None:
        from studies.slo import load_slo_toml

        values["slos"] = _parse(load_slo_toml, slo_file)
    plan = _parse(lambda kw: FailurePlan.from_flags(**kw),
                  {k: given.pop(k, None) for k in ("fail", "mtbf_s", "repair_s")})
    if plan is not None:
        values["failures"] = plan
    fixed = {k: {"value": given.pop(k)} for k in FIXED_FLEET_FLAGS if k in given}
    if fixed:
        values["space"] = {**values.get("space", {}), **fixed}
    known = {f.name for f in fields(StudySpec) if f.init}
    unknown = sorted(set(given) - known)
    if unknown:
        raise SpecError(unknown_names("spec field", unknown, sorted(known), "known"))
    values.update(given)
    where = f"{path}: " if path is not None else ""
    missing = [name for name in ("trace", "model", "gpu", "slos") if name not in values]
    if missing:
        flags_ = {"trace": "--trace FILE", "model": "--model M", "gpu": "--gpu G", "slos": "--slo ttft:2000,tpot:100"}
        raise SpecError(f"{where}missing {', '.join(flags_[m] for m in missing)}")
    try:
        return StudySpec(**values)
    except SpecError as exc:
        raise SpecError(f"{where}{exc}") from None
    except ValueError as exc:  # SpaceError, SLOError, ConfigError
        raise SpecError(f"{where}{exc}") from None


_SECTIONS = {
    "study": {"name": "study_name", "trials": "trials", "batch_size": "batch_size", "seed": "seed",
              "sampler": "sampler", "storage": "storage", "run_dir": "run_dir", "engine": "engine",
              "holdout": "holdout"},
    "trace": {"path": "trace", "format": "trace_format", "options": "trace_options",
              "rate_scale": "rate_scale", "target_rps": "target_rps", "max_tokens": "max_tokens",
              "predictor": "predictor"},
    "deployment": {"model": "model", "gpu": "gpu", "tp": "tp", "replicas": "replicas",
                   "framework": "framework", "gpu_hour_usd": "gpu_hour_usd", "calibration": "calibration",
                   "model_config": "model_config", "dtype": "dtype", "kv_dtype": "kv_dtype"},
    "objective": {"mode": "objective", "capacity_target": "capacity_target"},
}


def _from_toml(path: Path) -> dict[str, Any]:
    return _from_mapping(read_toml(path, SpecError), path.parent, path)


def spec_from_dict(data: Mapping[str, Any], **flags: Any) -> StudySpec:
    """Rebuild a spec from ``StudySpec.to_dict()`` (as stored in a study), flags on top."""
    values = _from_mapping(data, Path.cwd(), "stored spec")
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        return StudySpec(**values)
    except ValueError as exc:
        raise SpecError(f"stored spec: {exc}") from None


def _from_mapping(data: Mapping[str, Any], base_dir: Path, where) -> dict[str, Any]:
    allowed = {*_SECTIONS, "slo", "constraints", "space", "speculative", "failures"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise SpecError(f"{where}: {unknown_names('section', unknown, sorted(allowed))}")
    values: dict[str, Any] = {}
    for section, keys in _SECTIONS.items():
        body = data.get(section, {})
        if not isinstance(body, Mapping):
            raise SpecError(f"{where}: [{section}] must be a table")
        bad = sorted(set(body) - set(keys))
        if bad:
            raise SpecError(f"{where}: [{section}] has {unknown_names('key', bad, sorted(keys))}")
        values.update({keys[k]: v for k, v in body.items() if v is not None})
    for key in ("trace", "run_dir", "calibration", "model_config"):
        if key in values:
            if not isinstance(values[key], str | Path):
                raise SpecError(f"{where}: {key} must be a path (a string), got {values[key]!r}")
            values[key] = Path(values[key]) if Path(values[key]).is_absolute() else base_dir / values[key]
    slo = data.get("slo")
    if isinstance(slo, str):
        values["slos"] = _parse(parse_slo, slo, where)
    elif isinstance(slo, Mapping):
        values["slos"] = _parse(slo_from_mapping, dict(slo), where)
    elif slo is not None:
        raise SpecError(f"{where}: slo must be a string such as \"ttft:2000,tpot:100\" or [slo.NAME] tables")
    if "constraints" in data:
        values["constraints"] = {k: v for k, v in data["constraints"].items() if v is not None} \
            if isinstance(data["constraints"], Mapping) else data["constraints"]
    if "space" in data:
        values["space"] = data["space"]
    speculative = data.get("speculative")
    if isinstance(speculative, str):  # a drafter file beside the spec
        values["speculative"] = Path(speculative) if Path(speculative).is_absolute() else base_dir / speculative
    elif speculative is not None:
        values["speculative"] = _parse(drafter_from_mapping, speculative, where)
    if "failures" in data:
        values["failures"] = _parse(FailurePlan.from_mapping, data["failures"], where)
    return values


def _parse(parser, value, where: Path | None = None):
    try:
        return parser(value)
    except (ValueError, OSError) as exc:
        raise SpecError(f"{where}: {exc}" if where else str(exc)) from None


def _drafter(value: Any) -> Drafter | None:
    if value is None or isinstance(value, Drafter):
        return value
    if isinstance(value, str | Path):
        return load_drafter(value)
    return drafter_from_mapping(value)


def _failures(value: Any, space: SearchSpace) -> FailurePlan | None:
    """The failure plan, checked against the most replicas a trial of ``space`` may have."""
    if value is not None and not isinstance(value, FailurePlan):
        value = _parse(FailurePlan.from_mapping, value)
    if value is None:
        return None
    replicas = max((max(p.choices) if p.choices else int(p.high) for p in space.fleet_params
                    if p.name == "replicas"), default=space.base_fleet.replicas)
    if value.highest_replica >= replicas:
        raise SpecError(f"[failures]: a window names replica {value.highest_replica}, but the deployment has "
                        f"at most {replicas} replica(s) (0..{replicas - 1}); set --replicas")
    return value


def _constraints(value: Any) -> Constraints:
    if isinstance(value, Constraints):
        return value
    if not isinstance(value, Mapping):
        raise SpecError(f"[constraints] must be a table, got {value!r}")
    valid = {f.name for f in fields(Constraints)}
    bad = sorted(set(value) - valid)
    if bad:
        raise SpecError(f"[constraints] has {unknown_names('key', bad, sorted(valid))}")
    return Constraints(**value)
