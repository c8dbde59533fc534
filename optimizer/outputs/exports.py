"""Exports: the files a serving team deploys and checks, each for one target.

- ``vllm.yaml`` for ``vllm serve --config`` / ``sglang.yaml`` for ``sglang serve --config``:
  written by the engine's module (``policies.engines``) from a config of that engine's
  space, read back by the same module (``read_engine_file``), so the file simulates as the
  config it came from. Its header states the simulated figures of that file.
- ``policy.toml``: the native config with every knob: the what-if target's recommendation
  (servetune's own policies, which no engine runs).
- the bench replay that measures the file on hardware is ``optimizer.bench``'s.
- ``router.yaml`` (what-if fleets): the sglang-router 0.3.2 flags of the fleet's router.

Speculative decoding: the engines verify a fixed block of ``num_speculative_tokens``
drafts from the user's drafter, whose method and checkpoint come from the study's declared
drafter (``Deployment.drafter``); when it names none, the file carries a marked
``FILL-IN-...`` placeholder, which no engine accepts, and the header says what to fill in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from optimizer.search.drafter import CHECKPOINT_FREE_METHODS, Drafter
from policies.config import KNOB_BY_NAME, KNOBS, PolicyConfig, active_fleet_knobs
from policies.engines import ENGINES, EngineContext, EngineError, Target
from policies.engines import Deployment as EngineDeployment
from policies.engines import target as engine_target
from studies.slo import SLO_KEYS, SLOSet
from studies.traces import Trace

ROUTER_VERSION = "0.3.2"  # sglang-router
BACKENDS = ENGINES
FILL_IN = "FILL-IN-"  # prefix of a placeholder the user must replace; no engine accepts it
_ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "manual")


class ExportError(ValueError):
    """A deployment or export request that cannot be written, naming what is wrong."""


@dataclass(frozen=True)
class Deployment:
    """Where a config runs: the model, TP degree, data-parallel replicas, the GPU type, the
    speculative-decoding drafter the study declared (None: none named), and a MoE model's
    instance layout (``policies.engines.Deployment``: expert parallel, attention DP groups)."""

    model: str
    tp: int = 1
    replicas: int = 1
    gpu: str = "h100"
    drafter: Drafter | None = None
    moe_ep: int = 1
    attention_dp: int = 1

    def __post_init__(self) -> None:
        try:
            self.engine  # noqa: B018 (validates)
        except EngineError as exc:
            raise ExportError(str(exc)) from None

    @property
    def gpus(self) -> int:
        return self.tp * self.replicas

    @property
    def engine(self) -> EngineDeployment:
        def plain(value):
            return int(value) if isinstance(value, np.integer) else value

        return EngineDeployment(self.model, plain(self.tp), plain(self.replicas), plain(self.moe_ep),
                                plain(self.attention_dp))


@dataclass(frozen=True)
class RouterArgs:
    """sglang-router's flags for a fleet's router, and the acting fleet knobs it cannot carry (name -> why)."""

    args: dict[str, Any]
    not_carried: dict[str, str]


@dataclass(frozen=True)
class EngineFile:
    """An engine's file as a mapping, and the placeholders the user must fill in (key -> value)."""

    target: Target
    args: dict[str, Any]
    fill_in: dict[str, str]


def engine_args(target: Target, config: PolicyConfig, deployment: Deployment, ctx: EngineContext) -> EngineFile:
    """``config`` (of ``target``'s space) as the engine's flags; ExportError when the engine refuses it."""
    if target.what_if:
        raise ExportError("servetune's what-if policies are written to policy.toml, never into an engine's file")
    try:
        args = target.to_args(config, deployment.engine, ctx)
    except EngineError as exc:
        raise ExportError(str(exc)) from None
    fill_in: dict[str, str] = {}
    if config.speculative_mode != "off":
        drafter = deployment.drafter
        method = drafter.method if drafter else None
        names = {"method": method or f"{FILL_IN}drafter-method",
                 "model": (drafter.model if drafter else None) or (
                     None if method in CHECKPOINT_FREE_METHODS else f"{FILL_IN}draft-model"),
                 "sglang": (drafter.sglang if drafter else None) or f"{FILL_IN}speculative-algorithm"}
        try:
            flags = target.speculative_args(target.resolve(config, ctx), names)
        except EngineError as exc:
            raise ExportError(str(exc)) from None
        args.update(flags)
        fill_in = {key: value for key, value in _leaves(flags) if isinstance(value, str) and value.startswith(FILL_IN)}
    return EngineFile(target, args, fill_in)


def serve_command(target: Target, config: PolicyConfig, file_name: str) -> str:
    """The command that serves ``file_name``, with the environment ``config`` needs (``Target.serve_env``)."""
    env = "".join(f"{key}={value} " for key, value in target.serve_env(config).items())
    return f"{env}{target.name} serve --config {file_name}"


def _leaves(mapping: Mapping[str, Any], prefix: str = ""):
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def comment_lines(note: str) -> list[str]:
    """``note`` as a file header: each of its lines behind ``# ``."""
    return [f"# {line}" for line in note.splitlines() if line.strip()]


def engine_yaml(target: Target, config: PolicyConfig, deployment: Deployment, ctx: EngineContext, note: str = "",
                expected: Mapping[str, float] | None = None) -> str:
    """The file for ``<engine> serve --config``, with a header stating what it is and what it
    was simulated to deliver (``expected``: figures of this very file)."""
    mapped = engine_args(target, config, deployment, ctx)
    name = target.name
    header = [f"# {serve_command(target, target.resolve(config, ctx), f'{name}.yaml')}   ({target.display} "
              f"{target.version} flag names; command line > file > defaults)"]
    header += comment_lines(note)
    for key, value in (expected or {}).items():
        header.append(f"# simulated {key} of this file: {value:.6g}")
    if mapped.fill_in:
        header.append(f"# FILL IN before serving: {', '.join(mapped.fill_in)} name the drafter whose acceptance was "
                      "simulated; servetune does not guess it (declare method and model in the study's drafter).")
    if config.scheduling_policy == "priority" and name == "vllm":
        header.append("# scheduling-policy priority: vLLM serves LOWER priority values first; servetune "
                      "traces use larger = more urgent, so clients must send the negated priority.")
    body = yaml.safe_dump(mapped.args, sort_keys=False, default_flow_style=False)
    return "\n".join(header) + "\n" + body


def read_engine_file(target: Target, text: str, ctx: EngineContext, drafter: Drafter | None = None,
                     fleet_knobs: Mapping[str, Any] | None = None) -> PolicyConfig:
    """The config an engine file runs, as the simulator executes it: the inverse of ``engine_yaml``.

    ``drafter`` supplies the draft cost the file cannot hold; ``fleet_knobs`` the
    deployment's router and pools (the study's, not the file's).
    """
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ExportError(f"{target.name} config must be a top-level mapping, got {type(data).__name__}")
    try:
        config = target.from_args(data, ctx)
    except EngineError as exc:
        raise ExportError(str(exc)) from None
    extra = dict(fleet_knobs or {})
    if drafter is not None:
        extra.update(drafter.config_values())
    return target.resolve(config.replace(**extra), ctx) if extra else config


def router_args(config: PolicyConfig) -> RouterArgs:
    """The fleet's router as sglang-router flags, and the acting fleet knobs it cannot carry.

    sglang-router has round_robin and cache_aware (with its three thresholds, always written
    out: its defaults changed between releases); the other routers, migration and the P/D
    split are servetune's simulation only.
    """
    args: dict[str, Any] = {}
    not_carried: dict[str, str] = {}
    accepted = _ROUTER_POLICIES
    for name in active_fleet_knobs(config):
        flag, value = KNOB_BY_NAME[name].router, getattr(config, name)
        if flag == "policy" and value not in accepted:
            not_carried[name] = f"sglang-router's --policy accepts only {list(accepted)}; simulated only"
        elif flag is not None:
            args[flag] = value
        else:
            not_carried[name] = "no engine or sglang-router flag; simulated only"
    return RouterArgs(args, not_carried)


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
    header += comment_lines(note)
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


def policy_toml(config: PolicyConfig, note: str = "", *, what_if: bool = False) -> str:
    """Every knob of the native config, each with what it does and which engine flags carry it.

    Reads back with ``PolicyConfig.from_toml``; the comments change nothing.
    """
    values = dict(line.split(" = ", 1) for line in config.to_toml().splitlines()[1:])
    carried = {name: [f"{t.name} --{f.key}" for t in map(engine_target, ENGINES) for f in t.flags if f.knob == name]
               for name in values}
    lines = ["# servetune policy: every scheduler knob, as simulated. Load it with",
             "# `servetune simulate --config policy.toml` or PolicyConfig.from_toml."]
    if what_if:
        lines += ["# WHAT-IF: knobs marked NOT IN ANY ENGINE are servetune's own policies; no engine runs this file.",
                  "# Its gain is what this traffic would gain if your engine had them."]
    lines += comment_lines(note)
    lines.append("[policy]")
    for knob in KNOBS:
        flags = carried[knob.name] + ([f"sglang-router --{knob.router}"] if knob.router else [])
        where = "; ".join(flags) if flags else "NOT IN ANY ENGINE (simulated only)"
        lines.append(f"# {knob.help} [{where}]")
        lines.append(f"{knob.name} = {values[knob.name]}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class TrafficShape:
    """A trace's load in a few figures, for the capacity review and ``summary.json``."""

    n_requests: int
    rate_rps: float
    burstiness: float  # gamma shape of inter-arrival gaps: 1 = Poisson, < 1 burstier
    mean_prompt_tokens: int
    mean_output_tokens: int
    range_ratio: float  # uniform length spread around the means that matches the prompt spread

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
    """The strictest bound of each key over the classes (the latency plots draw them)."""
    bounds = {}
    for key in SLO_KEYS:
        given = [getattr(c, f"{key}_ms") for c in slos.classes if getattr(c, f"{key}_ms") is not None]
        if given:
            bounds[key] = min(given)
    if not bounds:
        raise ExportError("no SLO bound (ttft, tpot or e2el) is set")
    return bounds


def write_exports(directory: str | Path, target: Target, config: PolicyConfig, deployment: Deployment,
                  ctx: EngineContext, *, note: str = "", expected: Mapping[str, float] | None = None,
                  tables=None) -> dict[str, Path]:
    """Write the target's files: an engine's ``<engine>.yaml`` and the files it points at
    (SGLang's ``sps.json``, from the step-time ``tables``); the what-if target's
    ``policy.toml`` (and ``router.yaml`` for a fleet). Returns their paths by name."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if target.what_if:
        texts = {"policy.toml": policy_toml(config, note, what_if=True)}
        if deployment.replicas > 1:
            texts["router.yaml"] = router_yaml(config, deployment, note)
    else:
        texts = {f"{target.name}.yaml": engine_yaml(target, config, deployment, ctx, note, expected)}
        try:
            texts.update(target.side_files(target.resolve(config, ctx), tables))
        except EngineError as exc:
            raise ExportError(str(exc)) from None
    paths = {}
    for name, text in texts.items():
        path = directory / name
        path.write_text(text)
        paths[name] = path
    return paths
