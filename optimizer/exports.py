"""Exports: one PolicyConfig as files a serving team deploys and checks.

- ``vllm.yaml`` for ``vllm serve --config`` (vLLM 0.33 long flag names, never removed flags),
- ``sglang.yaml`` for ``sglang serve --config`` (SGLang 0.5.23 hyphenated flag names),
- ``policy.toml``, the native config with every knob, marking those no engine exposes yet,
- ``bench.sh``, the ``vllm bench serve --goodput`` command that checks the result on hardware,
- ``router.yaml`` (more than one replica): the sglang-router 0.3.2 flags of the fleet's
  router. Neither engine routes between replicas the way servetune's routers do (vLLM has
  no router at all); sglang-router carries ``round_robin`` and ``cache_aware`` with its
  thresholds, and reads no config file, so the file's header gives the launch command.

Speculative decoding: the engines verify a fixed block of ``num_speculative_tokens`` drafts
(vLLM ``speculative-config: {method, model, num_speculative_tokens}``; SGLang
``speculative-algorithm`` and the triple ``speculative-num-steps`` / ``-eagle-topk`` /
``-num-draft-tokens``, a chain of k drafts). The drafter is the user's: its method and
checkpoint come from the study's declared drafter (``Deployment.drafter``); when it names
none, the files carry a marked ``FILL-IN-...`` placeholder, which no engine accepts, and
the header says what to fill in. Per-step verify budgets (smartspec, dspark,
dspark_lagged) are servetune's only, listed in the header among the knobs not carried.

Which engine flag carries which knob comes only from ``policies.config.KNOBS``. A knob the
target engine has no flag for is left out of its YAML; when the config asks for something
the engine does not do natively, the YAML header says so, so nobody mistakes the file for
the whole simulated policy.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from optimizer.drafter import Drafter
from policies.config import FLEET_KNOBS, KNOB_BY_NAME, KNOBS, PolicyConfig, active_fleet_knobs
from policies.presets import preset
from studies.slo import SLO_KEYS, SLOSet
from studies.traces import Trace

VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}
DISPLAY_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
BACKENDS = tuple(VERSIONS)
ROUTER_VERSION = "0.3.2"  # sglang-router

# Deployment keys: model, tensor parallel, data-parallel replicas.
_DEPLOYMENT_FLAGS = {
    "vllm": ("model", "tensor-parallel-size", "data-parallel-size"),
    "sglang": ("model-path", "tp-size", "dp-size"),
}
# Enumerated flags: the values each engine accepts; anything else cannot be exported.
_ACCEPTED_VALUES = {
    ("vllm", "scheduling-policy"): ("fcfs", "priority"),
    ("sglang", "schedule-policy"): ("lpm", "random", "fcfs", "dfs-weight", "lof", "priority",
                                    "routing-key", "hrrn", "shortest-prefill-first"),
    ("sglang-router", "policy"): ("random", "round_robin", "cache_aware", "power_of_two", "manual"),
}
# Speculative knobs, mapped by _speculative_args: the draft length sits inside vLLM's
# speculative-config; the draft cost is the drafter's, not an engine flag.
SPECULATIVE_KNOBS = ("speculative_mode", "num_speculative_tokens", "speculative_draft_cost_mode",
                     "speculative_draft_cost")
FILL_IN = "FILL-IN-"  # prefix of a placeholder the user must replace; no engine accepts it
# servetune uses 0 for "no limit" where the engine's no-limit is leaving the flag unset.
_UNSET_WHEN_ZERO = frozenset({"max-model-len", "context-length", "max-num-queued-reqs", "max-queued-requests"})


class ExportError(ValueError):
    """A deployment or export request that cannot be written, naming what is wrong."""


@dataclass(frozen=True)
class Deployment:
    """Where a config runs: the model, TP degree, data-parallel replicas, and the GPU type.

    ``reserved_fraction`` is the share of GPU memory the cost model keeps for activations
    and CUDA graphs. vLLM's ``gpu-memory-utilization`` includes it, SGLang's
    ``mem-fraction-static`` counts weights and KV only, so the SGLang export subtracts it.
    ``drafter`` is the speculative-decoding drafter the study declared (None: none named).
    """

    model: str
    tp: int = 1
    replicas: int = 1
    gpu: str = "h100"
    reserved_fraction: float = 0.0
    drafter: Drafter | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ExportError(f"deployment model must be a non-empty name, got {self.model!r}")
        for name in ("tp", "replicas"):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or value < 1:
                raise ExportError(f"deployment {name} must be an integer >= 1, got {value!r}")
        if not 0.0 <= self.reserved_fraction < 1.0:
            raise ExportError(f"deployment reserved_fraction must be in [0, 1), got {self.reserved_fraction!r}")

    @property
    def gpus(self) -> int:
        return self.tp * self.replicas


@dataclass(frozen=True)
class EngineArgs:
    """The flag mapping for one engine, the knobs it could not carry (name -> why), and the
    placeholders the user must fill in (flag -> what)."""

    backend: str
    args: dict[str, Any]
    not_carried: dict[str, str] = field(default_factory=dict)
    fill_in: dict[str, str] = field(default_factory=dict)


def _check_backend(backend: str) -> None:
    if backend not in VERSIONS:
        raise ExportError(f"unknown backend {backend!r}; valid: {list(BACKENDS)}")


def engine_args(config: PolicyConfig, deployment: Deployment, backend: str) -> EngineArgs:
    """Map a config onto one engine's flags (hyphenated long names, values typed for YAML)."""
    _check_backend(backend)
    native = preset(f"{backend}-default", deployment.gpu)
    model_key, tp_key, dp_key = _DEPLOYMENT_FLAGS[backend]
    args: dict[str, Any] = {model_key: deployment.model, tp_key: deployment.tp, dp_key: deployment.replicas}
    not_carried: dict[str, str] = {}
    routed = router_args(config) if deployment.replicas > 1 else None
    for knob in KNOBS:
        flag = getattr(knob, backend)
        value = getattr(config, knob.name)
        if knob.name in SPECULATIVE_KNOBS:
            continue
        if knob.name in FLEET_KNOBS:
            if routed is not None and knob.name in active_fleet_knobs(config) and value != getattr(native, knob.name):
                not_carried[knob.name] = (f"{value!r}: sglang-router --{knob.router}, in router.yaml"
                                          if knob.name not in routed.not_carried
                                          else f"{value!r}: {routed.not_carried[knob.name]}")
            continue
        if flag is None:
            if value != getattr(native, knob.name):
                not_carried[knob.name] = (f"{value!r}: {DISPLAY_NAMES[backend]} has no flag; it behaves as "
                                          f"{getattr(native, knob.name)!r}")
            continue
        if flag in _UNSET_WHEN_ZERO and value == 0:
            continue
        accepted = _ACCEPTED_VALUES.get((backend, flag))
        if accepted is not None and value not in accepted:
            not_carried[knob.name] = f"{value!r}: --{flag} accepts only {list(accepted)}"
            continue
        if knob.kind is bool and backend == "sglang":
            # SGLang drops `false` store_true flags silently; "off" needs the disable-* flag.
            if value != flag.startswith("disable-"):
                args[flag] = True
            continue
        args[flag] = value
    if backend == "sglang":
        _sglang_encodings(config, args, not_carried, deployment.reserved_fraction)
    fill_in = _speculative_args(config, deployment.drafter, backend, args, not_carried)
    return EngineArgs(backend, args, not_carried, fill_in)


def _sglang_encodings(config: PolicyConfig, args: dict[str, Any], not_carried: dict[str, str],
                      reserved_fraction: float) -> None:
    """Knobs SGLang expresses through another flag's value rather than a flag of their own."""
    if "mem-fraction-static" in args:
        static = round(args["mem-fraction-static"] - reserved_fraction, 6)
        if static <= 0:
            raise ExportError(f"gpu_memory_utilization={config.gpu_memory_utilization} leaves no weights or KV "
                              f"memory after the {reserved_fraction:.3f} activation reserve")
        args["mem-fraction-static"] = static
    if not config.enable_chunked_prefill:
        args["chunked-prefill-size"] = -1
        not_carried.pop("enable_chunked_prefill", None)
    if args.get("schedule-policy") == "priority":
        args["enable-priority-scheduling"] = True


def _speculative_args(config: PolicyConfig, drafter: Drafter | None, backend: str, args: dict[str, Any],
                      not_carried: dict[str, str]) -> dict[str, str]:
    """Speculative decoding as the engine's flags: a fixed block of num_speculative_tokens
    drafts from the declared drafter. Returns the placeholders to fill in (flag -> value)."""
    if config.speculative_mode == "off":
        return {}
    k = config.num_speculative_tokens
    if config.speculative_mode != "fixed":
        not_carried["speculative_mode"] = (f"{config.speculative_mode!r}: {DISPLAY_NAMES[backend]} has no per-step "
                                           f"verify budget; it verifies all {k} drafts every step (as 'fixed')")
    # no drafter declared: its checkpoint is unknown too; a declared one without a model needs none
    model = drafter.model if drafter is not None else f"{FILL_IN}draft-model"
    if backend == "vllm":
        spec = {"method": (drafter.method if drafter is not None else None) or f"{FILL_IN}drafter-method"}
        if model is not None:
            spec["model"] = model
        args["speculative-config"] = {**spec, "num_speculative_tokens": k}
        return {f"speculative-config.{key}": value for key, value in spec.items() if value.startswith(FILL_IN)}
    flags = {"speculative-algorithm": (drafter.sglang if drafter is not None else None)
             or f"{FILL_IN}speculative-algorithm"}
    if model is not None:
        flags["speculative-draft-model-path"] = model
    args.update(flags)
    # a chain of k drafts: k steps of one candidate each, k + 1 tokens verified with the root
    args.update({"speculative-num-steps": k, "speculative-eagle-topk": 1, "speculative-num-draft-tokens": k + 1})
    return {flag: value for flag, value in flags.items() if value.startswith(FILL_IN)}


def engine_yaml(config: PolicyConfig, deployment: Deployment, backend: str, note: str = "") -> str:
    """The YAML file for ``<backend> serve --config``, with a header saying what it leaves out."""
    mapped = engine_args(config, deployment, backend)
    engine = DISPLAY_NAMES[backend]
    header = [f"# {backend} serve --config {backend}.yaml   ({engine} {VERSIONS[backend]} flag names; "
              "command line > file > defaults)"]
    if note:
        header.append(f"# {note}")
    if mapped.not_carried:
        header.append(f"# Simulated knobs this file cannot carry ({engine} keeps its own behaviour):")
        header += [f"#   {name} = {why}" for name, why in mapped.not_carried.items()]
    if mapped.fill_in:
        header.append(f"# FILL IN before serving: {', '.join(mapped.fill_in)} name the drafter whose acceptance was "
                      "simulated; servetune does not guess it (declare method and model in the study's drafter).")
    if deployment.replicas > 1:
        lacks = "vLLM has no request router" if backend == "vllm" else "not a flag of SGLang serve"
        header.append(f"# Routing across the {deployment.replicas} replicas ({lacks}): router.yaml holds the "
                      f"sglang-router flags for router = {config.router!r}.")
    if config.scheduling_policy == "priority":
        if backend == "vllm":
            header.append("# scheduling-policy priority: vLLM serves LOWER priority values first; servetune "
                          "traces use larger = more urgent, so clients must send the negated priority.")
        else:
            header.append("# schedule-policy priority: SGLang serves higher priority values first, as servetune does.")
    body = yaml.safe_dump(mapped.args, sort_keys=False, default_flow_style=False)
    return "\n".join(header) + "\n" + body


def knobs_from_engine_yaml(text: str, backend: str, reserved_fraction: float = 0.0) -> dict[str, Any]:
    """Read an engine YAML back into the knob values it carries: the inverse of ``engine_yaml``."""
    _check_backend(backend)
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ExportError(f"{backend} config must be a top-level mapping, got {type(data).__name__}")
    knobs: dict[str, Any] = {}
    for knob in KNOBS:
        flag = getattr(knob, backend)
        if flag is None or knob.name in SPECULATIVE_KNOBS:
            continue
        if knob.kind is bool and backend == "sglang":
            knobs[knob.name] = bool(data.get(flag, False)) != flag.startswith("disable-")
        elif flag in data:
            knobs[knob.name] = data[flag]
        elif flag in _UNSET_WHEN_ZERO:
            knobs[knob.name] = 0
    if backend == "sglang" and "gpu_memory_utilization" in knobs:
        knobs["gpu_memory_utilization"] = round(knobs["gpu_memory_utilization"] + reserved_fraction, 6)
    if backend == "sglang" and data.get("chunked-prefill-size") == -1:
        knobs["enable_chunked_prefill"] = False
        del knobs["max_num_batched_tokens"]
    speculative = data.get("speculative-config", {}) if backend == "vllm" else {
        "num_speculative_tokens": data.get("speculative-num-steps")}
    if not isinstance(speculative, dict):
        raise ExportError(f"speculative-config must be a mapping with num_speculative_tokens, got {speculative!r}")
    if speculative.get("num_speculative_tokens") is not None:
        knobs["num_speculative_tokens"] = speculative["num_speculative_tokens"]
    return knobs


def router_args(config: PolicyConfig) -> EngineArgs:
    """The fleet's router as sglang-router flags, and the acting fleet knobs it cannot carry.

    sglang-router has round_robin and cache_aware (with its three thresholds, always written
    out: its defaults changed between releases); the other routers, migration and the P/D
    split are servetune's simulation only.
    """
    args: dict[str, Any] = {}
    not_carried: dict[str, str] = {}
    accepted = _ACCEPTED_VALUES[("sglang-router", "policy")]
    for name in active_fleet_knobs(config):
        flag, value = KNOB_BY_NAME[name].router, getattr(config, name)
        if flag == "policy" and value not in accepted:
            not_carried[name] = f"sglang-router's --policy accepts only {list(accepted)}; simulated only"
        elif flag is not None:
            args[flag] = value
        else:
            not_carried[name] = "no engine or sglang-router flag; simulated only"
    return EngineArgs("sglang-router", args, not_carried)


def router_yaml(config: PolicyConfig, deployment: Deployment, note: str = "") -> str:
    """router.yaml: sglang-router flags as keys, with a header giving the launch command."""
    mapped = router_args(config)
    flags = " ".join(f"--{key} {value}" for key, value in mapped.args.items())
    workers = " ".join(f"URL{i + 1}" for i in range(min(deployment.replicas, 3))) + (
        " ..." if deployment.replicas > 3 else "")
    header = [f"# sglang-router {ROUTER_VERSION} flags for routing across {deployment.replicas} replicas "
              f"(servetune router = {config.router!r}).",
              "# sglang-router reads no config file: pass each key as --key value, e.g.",
              f"#   python -m sglang_router.launch_router --worker-urls {workers} {flags}".rstrip()]
    if "policy" not in mapped.args:
        header.append("# No sglang-router policy matches: launched so, it routes by its default (cache_aware), "
                      "which is not what was simulated.")
    if note:
        header.append(f"# {note}")
    if mapped.not_carried:
        header.append("# Simulated fleet knobs sglang-router cannot carry:")
        header += [f"#   {name} = {getattr(config, name)!r}: {why}" for name, why in mapped.not_carried.items()]
    body = yaml.safe_dump(mapped.args, sort_keys=False, default_flow_style=False) if mapped.args else ""
    return "\n".join(header) + "\n" + body


def knobs_from_router_yaml(text: str) -> dict[str, Any]:
    """Read router.yaml back into the knob values it carries: the inverse of ``router_yaml``."""
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ExportError(f"router config must be a top-level mapping, got {type(data).__name__}")
    by_flag = {k.router: k.name for k in KNOBS if k.router}
    unknown = sorted(set(data) - set(by_flag))
    if unknown:
        raise ExportError(f"router config has unknown flag(s) {unknown}; servetune reads {sorted(by_flag)}")
    return {by_flag[flag]: value for flag, value in data.items()}


def policy_toml(config: PolicyConfig, note: str = "") -> str:
    """Every knob of the native config, each with what it does and which engine flags carry it.

    Reads back with ``PolicyConfig.from_toml``; the comments change nothing.
    """
    values = dict(line.split(" = ", 1) for line in config.to_toml().splitlines()[1:])
    lines = ["# servetune policy: every scheduler knob, as simulated. Load it with",
             "# `servetune simulate --config policy.toml` or PolicyConfig.from_toml.",
             "# Knobs marked NOT EXPOSED have no vLLM {vllm}, SGLang {sglang} or sglang-router {router} flag yet.".format(
                 **VERSIONS, router=ROUTER_VERSION)]
    if note:
        lines.append(f"# {note}")
    lines.append("[policy]")
    for knob in KNOBS:
        flags = [f"{b} --{getattr(knob, b)}" for b in BACKENDS if getattr(knob, b)]
        flags += [f"sglang-router --{knob.router}"] if knob.router else []
        where = "; ".join(flags) if flags else "NOT EXPOSED by any engine yet (simulated only)"
        lines.append(f"# {knob.help} [{where}]")
        lines.append(f"{knob.name} = {values[knob.name]}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class TrafficShape:
    """What ``vllm bench serve`` needs to replay a trace's load with its random dataset."""

    n_requests: int
    rate_rps: float
    burstiness: float  # gamma shape of inter-arrival gaps: 1 = Poisson, < 1 burstier
    mean_prompt_tokens: int
    mean_output_tokens: int
    range_ratio: float  # uniform length spread around the means, matching the prompt spread

    @classmethod
    def of(cls, trace: Trace) -> TrafficShape:
        if trace.n < 2:
            raise ExportError(f"a bench command needs a trace of at least 2 requests, got {trace.n}")
        span = float(trace.arrival_s[-1] - trace.arrival_s[0])
        if span <= 0:
            raise ExportError("a bench command needs arrivals spread over time; every request arrives at once")
        gaps = np.diff(trace.arrival_s)
        variance = float(np.var(gaps))
        mean_gap = float(np.mean(gaps))
        prompts = trace.prompt_tokens.astype(np.float64)
        # Uniform on [m(1-r), m(1+r)] has standard deviation m r / sqrt(3).
        spread = math.sqrt(3.0) * float(np.std(prompts)) / float(np.mean(prompts))
        return cls(
            n_requests=trace.n,
            rate_rps=(trace.n - 1) / span,
            burstiness=mean_gap**2 / variance if variance > 0 else math.inf,
            mean_prompt_tokens=max(1, round(float(np.mean(prompts)))),
            mean_output_tokens=max(1, round(float(np.mean(trace.output_tokens)))),
            range_ratio=min(0.99, spread),
        )


def goodput_bounds(slos: SLOSet) -> dict[str, float]:
    """One ``--goodput`` bound per key: the strictest over the classes (vLLM bench has one set)."""
    bounds = {}
    for key in SLO_KEYS:
        given = [getattr(c, f"{key}_ms") for c in slos.classes if getattr(c, f"{key}_ms") is not None]
        if given:
            bounds[key] = min(given)
    if not bounds:
        raise ExportError("a bench command needs at least one SLO bound (ttft, tpot or e2el)")
    return bounds


def bench_script(deployment: Deployment, slos: SLOSet, traffic: TrafficShape, *, seed: int = 0,
                 expected: dict[str, float] | None = None) -> str:
    """A bash script running ``vllm bench serve --goodput`` against a server started from vllm.yaml.

    The random dataset reproduces the trace's request count, mean rate, burstiness and mean
    lengths, not its exact arrivals; ``expected`` (simulated figures) is printed for comparison.
    """
    bounds = goodput_bounds(slos)
    goodput = " ".join(f"{k}:{v:g}" for k, v in bounds.items())
    burstiness = "" if math.isinf(traffic.burstiness) else f" --burstiness {traffic.burstiness:.4g}"
    command = [
        "vllm bench serve --backend vllm --host \"$HOST\" --port \"$PORT\"",
        f"--model {shlex.quote(deployment.model)}",
        f"--dataset-name random --random-input-len {traffic.mean_prompt_tokens} "
        f"--random-output-len {traffic.mean_output_tokens} --random-range-ratio {traffic.range_ratio:.3f} --ignore-eos",
        f"--num-prompts {traffic.n_requests} --request-rate {traffic.rate_rps:.6g}{burstiness} --seed {seed}",
        f"--goodput {goodput}",
        "--percentile-metrics ttft,tpot,e2el --metric-percentiles 50,90,99",
        "--save-result --result-dir \"$RESULT_DIR\" --result-filename bench-result.json",
    ]
    lines = [
        "#!/usr/bin/env bash",
        "# Check the tuned config on real hardware:",
        f"#   1. start the server:  vllm serve --config vllm.yaml   ({deployment.replicas} replica(s) x TP {deployment.tp}"
        f" = {deployment.gpus} {deployment.gpu} GPU(s))",
        "#   2. run this script; compare \"Request goodput (req/s):\" with the simulated figures below.",
    ]
    if len(slos.classes) > 1:
        lines.append("# vLLM bench takes one SLO set: the strictest bound of each key over the SLO classes.")
    for key, value in (expected or {}).items():
        lines.append(f"# simulated {key}: {value:.6g}")
    lines += ["set -euo pipefail", 'HOST="${HOST:-127.0.0.1}"', 'PORT="${PORT:-8000}"',
              'RESULT_DIR="${RESULT_DIR:-.}"', " \\\n  ".join(command)]
    return "\n".join(lines) + "\n"


def write_exports(directory: str | Path, config: PolicyConfig, deployment: Deployment, slos: SLOSet,
                  traffic: TrafficShape, *, seed: int = 0, note: str = "",
                  expected: dict[str, float] | None = None) -> dict[str, Path]:
    """Write vllm.yaml, sglang.yaml, policy.toml, bench.sh and, for more than one replica,
    router.yaml; return their paths by name."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    texts = {f"{b}.yaml": engine_yaml(config, deployment, b, note) for b in BACKENDS}
    if deployment.replicas > 1:
        texts["router.yaml"] = router_yaml(config, deployment, note)
    texts["policy.toml"] = policy_toml(config, note)
    texts["bench.sh"] = bench_script(deployment, slos, traffic, seed=seed, expected=expected)
    paths = {}
    for name, text in texts.items():
        path = directory / name
        path.write_text(text)
        paths[name] = path
    paths["bench.sh"].chmod(0o755)
    return paths
