"""The scenario matrix: named, seeded workloads with their SLOs, as plain data.

A scenario is a mapping (the same shape as a TOML table, so ``load_scenarios(path)``
reads user-written ones)::

    [longlong]
    about = "4k prompts, 1k outputs: KV-bound decode"
    seed = 4
    slo = {default = {ttft = 3000, tpot = 50}}
    [longlong.workload]
    duration_s = 120
    arrivals = {kind = "poisson", rate = 3}
    tenants = [{name = "rag", prompt = {mean = 4096, cv = 0.5}, output = {mean = 1024, cv = 0.5}}]
    [longlong.policies.reservation]      # extra policies besides the standard four
    base = "vllm-default"
    set = {admission_mode = "reservation"}

``workload`` either has ``arrivals`` and ``duration_s``, or ``phases``: a list of
``{name, duration_s, arrivals}`` run back to back (load steps such as overload then
recovery); each phase becomes a tenant named after it, so the report's tenant table is
a per-phase table. ``requires`` lists PolicyConfig knobs a scenario needs; a runner
reports the scenario as pending while the engine lacks one. Turning a scenario into a
trace (``build_trace``) is pure and seeded: the same mapping gives the same trace.

A scenario may run on a fleet: ``replicas`` (default 1), the ``router`` its standard
policies sit behind (default round robin; extra policies may set their own), and
``failures``, a table as a study spec's ``[failures]`` (``windows = ["1@40:80"]``, or
``mtbf_s`` and ``repair_s``; seeded by the scenario's seed)::

    [failover]
    replicas = 4
    router = "least_outstanding"
    failures = {windows = ["1@40:80"]}

A scenario may declare a drafter, ``speculative``: a table of the keys of a study's
``[speculative]`` table (``optimizer.search.drafter``: acceptance profile, draft cost,
longest draft). The standard policies run without it; a policy that sets a
``speculative_mode`` other than off runs with it, at the drafter's longest draft unless it
sets ``num_speculative_tokens``, and the tuned policy searches its verify budgets::

    [spec-chat.speculative]
    method = "dspark"
    acceptance = [0.73, 0.73, 0.73, 0.73, 0.73, 0.73, 0.73]
    draft_cost = 0.04
    [spec-chat.policies.adaptive]
    base = "vllm-default"
    set = {speculative_mode = "adaptive_verify"}

Only the shape is checked here; the runner parses the failures
(``optimizer.search.failplan``) and the drafter and names the scenario when they are wrong.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from studies.slo import SLOSet, slo_from_mapping
from studies.synthetic import (
    Adapters,
    Diurnal,
    Gamma,
    LogNormal,
    OnOff,
    OutputEstimate,
    Poisson,
    SharedPrefix,
    Tenant,
    generate,
)
from studies.traces import Trace, TraceError
from studies.transforms import concat_as_tenants

ARRIVALS = {"poisson": Poisson, "gamma": Gamma, "onoff": OnOff, "diurnal": Diurnal}
SCENARIO_KEYS = {"about", "seed", "slo", "workload", "policies", "requires", "pending", "replicas", "router",
                 "failures", "speculative"}
FAILURE_KEYS = {"windows", "mtbf_s", "repair_s"}
TENANT_PARTS = {"prompt": LogNormal, "output": LogNormal, "prefix": SharedPrefix, "estimate": OutputEstimate,
                "adapters": Adapters}

CHAT = {"name": "chat", "prompt": {"mean": 1024, "cv": 1.0, "high": 16384}, "output": {"mean": 256, "cv": 1.0, "high": 2048}}
CHAT_SLO = {"default": {"ttft": 1000, "tpot": 50}}
LONG_SLO = {"default": {"ttft": 3000, "tpot": 50}}


def _lengths(prompt: int, output: int) -> dict:
    return {"name": "default", "prompt": {"mean": prompt, "cv": 0.5}, "output": {"mean": output, "cv": 0.5}}


def _example_drafter(name: str) -> dict[str, Any]:
    """The drafter of ``studies/examples/drafters/<name>.toml`` (its sources are in the file)."""
    with (Path(__file__).parent / "examples" / "drafters" / f"{name}.toml").open("rb") as f:
        return tomllib.load(f)


def _speculative(drafter: str, about: str, seed: int) -> dict[str, Any]:
    """Chat just past the knee, TPOT 40 ms, with ``drafter``: its engines' verify budgets."""
    data = _example_drafter(drafter)
    gamma = data["max_draft_tokens"]
    policies = {f"vllm k={k}": {"base": "vllm-default", "set": {"speculative_mode": "fixed", "num_speculative_tokens": k}}
                for k in (2, gamma)}
    policies["vllm schedule"] = {"base": "vllm-default", "set": {  # k = gamma below 16, 2 to 63, then 1
        "speculative_mode": "batch_schedule", "speculative_batch_2": 16, "speculative_k_2": 2,
        "speculative_batch_3": 64, "speculative_k_3": 1}}
    if data["method"] == "dspark":  # adaptive verification and the DSPARK planner read its confidence head
        policies["vllm adaptive"] = {"base": "vllm-default", "set": {"speculative_mode": "adaptive_verify"}}
        policies |= {f"sglang DSPARK {mode}": {"base": "sglang-default", "set": {"speculative_mode": knob}}
                     for mode, knob in (("static", "fixed"), ("compact", "sps_table"), ("cap-accept", "sps_cap_accept"))}
    return {"about": about, "seed": seed, "slo": {"default": {"ttft": 2000, "tpot": 40}}, "speculative": data,
            "workload": _poisson(24, 120, CHAT), "policies": policies}


def _poisson(rate: float, duration_s: float = 120.0, *tenants: dict) -> dict:
    return {"duration_s": duration_s, "arrivals": {"kind": "poisson", "rate": rate}, "tenants": list(tenants)}


#: Built-in scenarios (Llama-3.1-8B on one H100: rates are set around its saturation knee).
SCENARIOS: dict[str, dict[str, Any]] = {
    # -- prompt x output lengths ---------------------------------------------------------
    "short-short": {"about": "256-token prompts, 64-token answers (classification, short chat)", "seed": 1,
                    "slo": {"default": {"ttft": 500, "tpot": 50}}, "workload": _poisson(120, 60, _lengths(256, 64))},
    "short-long": {"about": "256-token prompts, 1k-token answers (generation): decode- and KV-bound", "seed": 2,
                   "slo": CHAT_SLO, "workload": _poisson(14, 120, _lengths(256, 1024))},
    "long-short": {"about": "4k-token prompts, 64-token answers (RAG, summarising): prefill-bound", "seed": 3,
                   "slo": LONG_SLO, "workload": _poisson(7, 120, _lengths(4096, 64))},
    "long-long": {"about": "4k-token prompts, 1k-token answers: prefill and KV both tight", "seed": 4,
                  "slo": LONG_SLO, "workload": _poisson(3, 180, _lengths(4096, 1024))},
    # -- arrival shapes (same chat mix) ----------------------------------------------------
    "steady": {"about": "chat mix, Poisson arrivals just below the knee", "seed": 5, "slo": CHAT_SLO,
               "workload": _poisson(20, 120, CHAT)},
    "bursty": {"about": "chat mix at the same mean rate in bursts (gamma gaps, cv 4)", "seed": 5, "slo": CHAT_SLO,
               "workload": {"duration_s": 120, "arrivals": {"kind": "gamma", "rate": 20, "cv": 4}, "tenants": [CHAT]}},
    "hotspot-shift": {"about": "chat mix on 8 shared 2k-token system prompts; 80% of traffic hits one that moves "
                               "every 20 s", "seed": 6, "slo": CHAT_SLO,
                      "workload": _poisson(20, 120, {**CHAT, "prefix": {"groups": 8, "prefix_tokens": 2048,
                                                                        "hot_share": 0.8, "hot_shift_s": 20}}),
                      "policies": {"vllm+lpm": {"base": "vllm-default",
                                                "set": {"enable_prefix_caching": True, "scheduling_policy": "lpm"}}}},
    "prefix-cold-hot": {"about": "half the chat traffic reuses 4 hot 2k-token system prompts, half spreads over 5,000 "
                                 "cold ones no KV pool holds: cold misses evict hot prefixes; cache off and on",
                        "seed": 13, "slo": CHAT_SLO, "requires": ["enable_prefix_caching"],
                        "workload": _poisson(20, 120,
                                             {**CHAT, "name": "hot", "prefix": {"groups": 4, "prefix_tokens": 2048}},
                                             {**CHAT, "name": "cold", "prefix": {"groups": 5000, "prefix_tokens": 2048}}),
                        "policies": {"vllm-cold": {"base": "vllm-default", "set": {"enable_prefix_caching": False}},
                                     "vllm-hot": {"base": "vllm-default", "set": {"enable_prefix_caching": True}}}},
    # -- LoRA adapters (design validation item 3) -------------------------------------------
    "adapter-cold-hot": {"about": "chat mix over 64 LoRA adapters of Zipf(1.1) popularity; at 60 s the ranking "
                                  "rotates by half, so the hot adapters turn cold and cold ones turn hot: GPU slots "
                                  "bound each batch's distinct adapters, the host cache spares disk reads",
                         "seed": 14, "slo": CHAT_SLO, "requires": ["enable_lora", "max_loras", "max_cpu_loras"],
                         "workload": _poisson(16, 120, {**CHAT, "adapters": {"count": 64, "zipf": 1.1,
                                                                              "shift_s": 60}}),
                         "policies": {"vllm-4-slots": {"base": "vllm-default", "set": {"max_loras": 4}},
                                      "vllm-16-slots": {"base": "vllm-default",
                                                        "set": {"max_loras": 16, "max_cpu_loras": 64}}}},
    # -- tenants ---------------------------------------------------------------------------
    "multi-tenant": {
        "about": "interactive tenant (priority 1, weight 3 SLO, 20 s patience) beside a batch tenant with long "
                 "answers (weight 1)", "seed": 7,
        "slo": {"interactive": {"ttft": 1000, "tpot": 50, "weight": 3}, "batch": {"ttft": 20000, "tpot": 100, "weight": 1}},
        "workload": _poisson(16, 120,
                             {**CHAT, "name": "interactive", "weight": 2, "priority": 1, "slo_class": "interactive",
                              "deadline_s": 20},
                             {"name": "batch", "weight": 1, "slo_class": "batch",
                              "prompt": {"mean": 2048, "cv": 0.5}, "output": {"mean": 768, "cv": 0.5}}),
        "policies": {"priority": {"base": "vllm-default", "set": {"scheduling_policy": "priority"}},
                     "priority+max-wait": {"base": "vllm-default",
                                           "set": {"scheduling_policy": "priority", "max_wait_s": 5.0}},
                     "edf": {"base": "vllm-default", "set": {"scheduling_policy": "edf"}},
                     "vtc": {"base": "vllm-default", "set": {"scheduling_policy": "vtc"}},
                     "kv-quota-0.6": {"base": "vllm-default", "set": {"tenant_kv_quota": 0.6}}}},
    # -- output-length estimates -------------------------------------------------------------
    "under-estimate": {"about": "clients set max_tokens to half the true answer: answers are cut short", "seed": 8,
                       "slo": CHAT_SLO, "workload": _poisson(24, 120, {**CHAT, "estimate": {"bias": 0.5, "cv": 0.3}}),
                       "policies": {"reservation": {"base": "vllm-default", "set": {"admission_mode": "reservation"}}}},
    "over-estimate": {"about": "clients set max_tokens to 4x the true answer: reservations over-book KV", "seed": 8,
                      "slo": CHAT_SLO, "workload": _poisson(24, 120, {**CHAT, "estimate": {"bias": 4.0, "cv": 0.3}}),
                      "policies": {"reservation": {"base": "vllm-default", "set": {"admission_mode": "reservation"}},
                                   "predicted-p90": {"base": "vllm-default",
                                                     "set": {"admission_mode": "predicted", "admission_quantile": 0.9}}}},
    # -- memory pressure ----------------------------------------------------------------------
    "preemption-storm": {
        "about": "long, heavy-tailed answers (1.5k mean, cv 1.5) fill the KV pool: recompute preemptions pile up",
        "seed": 9, "slo": CHAT_SLO,
        "workload": _poisson(10, 120, {"name": "default", "prompt": {"mean": 2048, "cv": 1.0, "high": 16384},
                                       "output": {"mean": 1536, "cv": 1.5, "high": 8192}}),
        "policies": {"kv-high-water-0.9": {"base": "vllm-default", "set": {"kv_high_water": 0.9}},
                     "headroom-0.1": {"base": "vllm-default", "set": {"kv_headroom": 0.1}}}},
    "optimistic-admission": {
        "about": "chat traffic beside a report tenant (1 req/s) whose 8k-token answers no client caps and "
                 "run past what admission expects (SGLang clips a request's future at 4,096 tokens and scales it "
                 "by a decayed ratio, vLLM admits on the prompt alone, a quantile calibrated on finished answers "
                 "learns the short ones): the KV pool overfills and ends in preemption and retraction storms",
        "seed": 14, "slo": CHAT_SLO,
        "workload": _poisson(16, 120, {**CHAT, "weight": 15},
                             {"name": "report", "weight": 1, "prompt": {"mean": 1024, "cv": 0.5},
                              "output": {"mean": 8192, "cv": 0.3, "high": 32768}}),
        "policies": {"predicted-p90": {"base": "vllm-default",
                                       "set": {"admission_mode": "predicted", "admission_quantile": 0.9}},
                     "sglang-conservative-3": {"base": "sglang-default", "set": {"schedule_conservativeness": 3.0}}}},
    # -- load levels (chat mix) -----------------------------------------------------------------
    "low-load": {"about": "chat mix at 8 req/s, well below the knee", "seed": 10, "slo": CHAT_SLO,
                 "workload": _poisson(8, 120, CHAT)},
    "saturation": {"about": "chat mix at 28 req/s, at the knee", "seed": 10, "slo": CHAT_SLO,
                   "workload": _poisson(28, 120, CHAT)},
    "overload": {"about": "chat mix at 45 req/s, past the knee", "seed": 10, "slo": CHAT_SLO,
                 "workload": _poisson(45, 90, CHAT),
                 "policies": {"max-wait-1s": {"base": "vllm-default", "set": {"max_wait_s": 1.0}}}},
    "recovery": {"about": "60 s at 45 req/s, then 120 s at 8 req/s: how fast the backlog drains", "seed": 11,
                 "slo": CHAT_SLO,
                 "workload": {"tenants": [CHAT], "phases": [
                     {"name": "overload", "duration_s": 60, "arrivals": {"kind": "poisson", "rate": 45}},
                     {"name": "after", "duration_s": 120, "arrivals": {"kind": "poisson", "rate": 8}}]},
                 "policies": {"max-wait-1s": {"base": "vllm-default", "set": {"max_wait_s": 1.0}}}},
    # -- fleet ---------------------------------------------------------------------------------
    "worker-failure": {
        "about": "4 replicas serve the chat mix on 8 shared 2k-token system prompts at 130 req/s (the reference row "
                 "is the healthy fleet); replica 1 dies at 40 s and is back, empty, at 80 s: its requests are "
                 "re-routed and prefilled again while 3 replicas carry ~43 req/s each", "seed": 12,
        "slo": CHAT_SLO, "replicas": 4, "router": "round_robin", "failures": {"windows": ["1@40:80"]},
        "workload": _poisson(130, 120, {**CHAT, "prefix": {"groups": 8, "prefix_tokens": 2048, "zipf": 1.0}}),
        "policies": {f"vllm+{router}": {"base": "vllm-default", "set": {"router": router}}
                     for router in ("least_outstanding", "least_kv", "cache_aware", "unified", "consistent_hash")}},
    # -- speculative decoding (studies/examples/drafters: acceptance and draft cost with sources) ---------
    "spec-dspark": _speculative("dspark", "chat mix at 24 req/s, TPOT 40 ms, with a DSpark drafter (flat 0.73 "
                                "acceptance, draft cost 0.04 step per position, block 7): fixed blocks, vLLM's "
                                "per-batch-size schedule and adaptive verification, SGLang's DSPARK planner modes", 14),
    "spec-eagle3": _speculative("eagle3", "the same chat load with an EAGLE-3 drafter (acceptance falling after "
                                "position 5, draft cost 0.05, chain of 5): fixed k and vLLM's per-batch-size schedule", 15),
}


class ScenarioError(ValueError):
    """A scenario mapping that cannot be built, naming the scenario and the key."""


def check_scenario(name: str, data: Mapping[str, Any]) -> None:
    """Raise ScenarioError for unknown keys or a workload without arrivals."""
    unknown = sorted(set(data) - SCENARIO_KEYS)
    if unknown:
        raise ScenarioError(f"scenario {name!r}: unknown key(s) {unknown}; valid: {sorted(SCENARIO_KEYS)}")
    workload = data.get("workload")
    if not isinstance(workload, Mapping):
        raise ScenarioError(f"scenario {name!r}: needs a [workload] table")
    if ("phases" in workload) == ("arrivals" in workload):
        raise ScenarioError(f"scenario {name!r}: workload needs either arrivals + duration_s or phases")
    for policy, body in dict(data.get("policies", {})).items():
        if not isinstance(body, Mapping) or set(body) - {"base", "set"}:
            raise ScenarioError(f"scenario {name!r}: policy {policy!r} must be {{base = PRESET, set = {{KNOB = VALUE}}}}")
    replicas = data.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ScenarioError(f"scenario {name!r}: replicas must be an integer >= 1, got {replicas!r}")
    if not isinstance(data.get("router", ""), str):
        raise ScenarioError(f"scenario {name!r}: router must be a router name, got {data['router']!r}")
    if not isinstance(data.get("speculative", {}), Mapping):
        raise ScenarioError(f"scenario {name!r}: speculative must be a table of drafter keys, got "
                            f"{data['speculative']!r}")
    failures = data.get("failures", {})
    if not isinstance(failures, Mapping) or set(failures) - FAILURE_KEYS:
        raise ScenarioError(f"scenario {name!r}: failures must be a table of {sorted(FAILURE_KEYS)}, got {failures!r}")


def load_scenarios(path: str | Path) -> dict[str, dict[str, Any]]:
    """Scenarios from a TOML file, one top-level table per scenario."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ScenarioError(f"{path}: cannot read scenarios ({exc})") from None
    for name, body in data.items():
        if not isinstance(body, Mapping):
            raise ScenarioError(f"{path}: {name!r} must be a table")
        check_scenario(name, body)
    return data


def scenario_slos(name: str, data: Mapping[str, Any]) -> SLOSet:
    try:
        return slo_from_mapping(dict(data["slo"]))
    except (KeyError, ValueError) as exc:
        raise ScenarioError(f"scenario {name!r}: slo: {exc}") from None


def build_trace(name: str, data: Mapping[str, Any]) -> Trace:
    """The scenario's trace: seeded, so the same mapping always gives the same requests."""
    check_scenario(name, data)
    workload, seed = data["workload"], int(data.get("seed", 0))
    try:
        tenants = [_tenant(t) for t in workload["tenants"]]
        if "arrivals" in workload:
            return generate(_arrivals(workload["arrivals"]), duration_s=float(workload["duration_s"]),
                            tenants=tenants, seed=seed)
        return _phases(workload["phases"], tenants, seed)
    except (KeyError, TypeError, ValueError) as exc:
        raise ScenarioError(f"scenario {name!r}: workload: {exc!r}") from None


def _arrivals(spec: Mapping[str, Any]):
    params = dict(spec)
    kind = params.pop("kind", None)
    if kind not in ARRIVALS:
        raise TraceError(f"arrivals kind {kind!r}; valid: {sorted(ARRIVALS)}")
    return ARRIVALS[kind](**params)


def _tenant(spec: Mapping[str, Any]) -> Tenant:
    params = dict(spec)
    for key, cls in TENANT_PARTS.items():
        if key in params:
            params[key] = cls(**params[key])
    return Tenant(**params)


def _phases(phases: list[Mapping[str, Any]], tenants: list[Tenant], seed: int) -> Trace:
    """Each phase generated on its own seed and shifted to start where the previous ended."""
    parts, start = [], 0.0
    for k, phase in enumerate(phases):
        part = generate(_arrivals(phase["arrivals"]), duration_s=float(phase["duration_s"]), tenants=tenants,
                        seed=seed * 1000 + k)
        shift = np.full(part.n, start)
        parts.append((phase["name"], part.replace(arrival_s=part.arrival_s + shift, deadline_s=part.deadline_s + shift)))
        start += float(phase["duration_s"])
    return concat_as_tenants(parts)
