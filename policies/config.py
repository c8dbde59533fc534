"""PolicyConfig: every scheduler knob the search may turn, validated on construction.

Names follow vLLM where vLLM has the knob; the rest are servetune's own. A config packs
into a flat float vector for the kernel (``to_vector``; indices in ``Knob.index``) and
round-trips through TOML. Categorical knobs are stored as strings and packed as their
position in ``choices``.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np


class ConfigError(ValueError):
    """A knob value that the engine cannot run, naming the knob and what is valid."""


@dataclass(frozen=True)
class Knob:
    """Metadata for one PolicyConfig field: valid range or choices, and engine names."""

    name: str
    kind: type  # int, float, bool or str
    low: float | None = None  # inclusive
    high: float | None = None  # inclusive
    choices: tuple[str, ...] = ()
    vllm: str | None = None  # vLLM 0.33 flag, when vLLM has the knob
    sglang: str | None = None  # SGLang 0.5.23 flag, when SGLang has the knob
    help: str = ""

    @property
    def index(self) -> int:
        return KNOB_INDEX[self.name]


SCHEDULING_POLICIES = ("fcfs", "priority", "edf", "sjf", "lpm", "vtc")
SCHEDULE_MODES = ("decode_first", "prefill_first")
ADMISSION_MODES = ("none", "reservation", "predicted", "new_token_ratio")
PREEMPTION_MODES = ("recompute", "swap", "auto")
PREEMPTION_VICTIMS = ("newest", "lowest_priority", "fewest_output")
FAIRNESS_COST_UNITS = ("tokens", "gpu_time", "kv_byte_seconds")
MAX_WAIT_ACTIONS = ("reject", "admit_first")
SPECULATIVE_MODES = ("off", "fixed", "smartspec", "dspark", "dspark_lagged")
DRAFT_COST_MODES = ("fraction", "mtp")

KNOBS: tuple[Knob, ...] = (
    Knob("max_num_batched_tokens", int, 1, 1 << 20, vllm="max-num-batched-tokens", sglang="chunked-prefill-size",
         help="token budget per step: prefill chunks + decode tokens"),
    Knob("max_num_seqs", int, 1, 1 << 16, vllm="max-num-seqs", sglang="max-running-requests",
         help="most sequences running at once"),
    Knob("enable_chunked_prefill", bool, vllm="enable-chunked-prefill",
         help="split prompts across steps to fit the token budget"),
    Knob("long_prefill_token_threshold", int, 0, 1 << 20, vllm="long-prefill-token-threshold",
         help="cap on one request's prefill tokens per step (0 = off)"),
    Knob("gpu_memory_utilization", float, 0.05, 1.0, vllm="gpu-memory-utilization", sglang="mem-fraction-static",
         help="fraction of GPU memory for weights, activations and KV"),
    Knob("block_size", int, 1, 256, vllm="block-size", sglang="page-size", help="KV block size in tokens"),
    Knob("scheduling_policy", str, choices=SCHEDULING_POLICIES, vllm="scheduling-policy", sglang="schedule-policy",
         help="waiting-queue order"),
    Knob("schedule_mode", str, choices=SCHEDULE_MODES,
         help="decode_first: running requests first, then waiting (vLLM V1); "
              "prefill_first: a prefill batch runs alone when there is one (SGLang)"),
    Knob("max_prefill_tokens", int, 1, 1 << 22, sglang="max-prefill-tokens",
         help="prefill_first: most prompt tokens one prefill batch takes"),
    Knob("step_time_cap_ms", float, 0.0, 1e6, help="longest step the scheduler forms, in ms (0 = off)"),
    Knob("kv_headroom", float, 0.0, 0.9, vllm="watermark", help="fraction of KV blocks kept free when admitting (vLLM watermark)"),
    Knob("admission_mode", str, choices=ADMISSION_MODES,
         help="none: admit while blocks allocate; reservation: reserve prompt + max_tokens; "
              "predicted: reserve a predicted output quantile; new_token_ratio: SGLang's adaptive ratio"),
    Knob("admission_quantile", float, 0.01, 1.0, help="predicted: output-length quantile reserved"),
    Knob("schedule_conservativeness", float, 0.01, 10.0, sglang="schedule-conservativeness",
         help="new_token_ratio: scales the initial ratio 0.7"),
    Knob("preemption_mode", str, choices=PREEMPTION_MODES,
         help="recompute: free KV and re-prefill; swap: copy KV to host; auto: the cheaper per victim"),
    Knob("preemption_victim", str, choices=PREEMPTION_VICTIMS,
         help="newest: most recently admitted (vLLM FCFS); lowest_priority; fewest_output (SGLang retract)"),
    Knob("max_preemptions", int, 0, 1 << 20, help="preemptions before a request is rejected (0 = unlimited)"),
    Knob("max_queue_len", int, 0, 1 << 30, vllm="max-num-queued-reqs", sglang="max-queued-requests",
         help="waiting requests before arrivals are rejected (0 = unbounded)"),
    Knob("max_wait_s", float, 0.0, 1e9, help="longest wait before first schedule, then reject (0 = off)"),
    Knob("kv_high_water", float, 0.01, 1.0,
         help="reject arrivals while KV usage is at or above this fraction (1.0 = off)"),
    Knob("reject_unmeetable_deadline", bool,
         help="reject an arrival whose deadline passes before its prompt could finish alone"),
    Knob("max_model_len", int, 0, 1 << 24, vllm="max-model-len", sglang="context-length",
         help="longest prompt + output accepted (0 = whatever the KV pool holds)"),
    Knob("enable_prefix_caching", bool, vllm="enable-prefix-caching",
         help="reuse the KV of shared prompt prefixes (the trace's prefix hashes); "
              "SGLang's disable-radix-cache is the inverse"),
    Knob("fairness_cost_unit", str, choices=FAIRNESS_COST_UNITS,
         help="service charged per tenant (vtc order, audit): tokens = w_in * prompt tokens computed "
              "+ w_out * output tokens; gpu_time = step time split by tokens; kv_byte_seconds"),
    Knob("vtc_input_weight", float, 0.0, 100.0, help="tokens unit: service per prompt token computed (VTC w_p)"),
    Knob("vtc_output_weight", float, 0.0, 100.0, help="tokens unit: service per output token (VTC w_q)"),
    Knob("aging_rate", float, 0.0, 1e6,
         help="priority: levels gained per second waited; sjf: predicted seconds forgiven per second waited"),
    Knob("max_wait_action", str, choices=MAX_WAIT_ACTIONS,
         help="past max_wait_s a never-scheduled request is rejected (MAX_WAIT) or admitted first"),
    Knob("deadline_margin_ms", float, 0.0, 1e6,
         help="edf: reject a request at the head if now + its lone prefill + margin passes its deadline"),
    Knob("tenant_kv_quota", float, 0.01, 1.0,
         help="largest share of KV blocks one tenant's running requests may hold when admitting (1 = off)"),
    Knob("tenant_token_quota", float, 0.01, 1.0,
         help="largest share of a step's token budget one tenant's prefills may use (1 = off)"),
    # speculative decoding (policies.speculative); the drafter's acceptance profile is a
    # side array (AcceptanceModel), not a knob. vLLM carries the draft length inside
    # --speculative-config {"num_speculative_tokens": k}, SGLang as --speculative-num-steps.
    Knob("speculative_mode", str, choices=SPECULATIVE_MODES,
         help="verify budget per step: off; fixed (every decode verifies num_speculative_tokens drafts); "
              "smartspec (one k per batch); dspark (per-request prefixes with the early stop); "
              "dspark_lagged (global top-K from confidences two steps back)"),
    Knob("num_speculative_tokens", int, 1, 16,
         help="draft length gamma: the k of fixed, the most drafts any request verifies otherwise"),
    Knob("speculative_draft_cost_mode", str, choices=DRAFT_COST_MODES,
         help="fraction: a drafted position costs speculative_draft_cost x the target's decode step; "
              "mtp: it costs speculative_draft_cost ms (an MTP head)"),
    Knob("speculative_draft_cost", float, 0.0, 1000.0,
         help="cost of one drafted position, in the unit of speculative_draft_cost_mode"),
)

KNOB_INDEX = {k.name: i for i, k in enumerate(KNOBS)}
KNOB_BY_NAME = {k.name: k for k in KNOBS}
N_KNOBS = len(KNOBS)


@dataclass(frozen=True)
class PolicyConfig:
    """One candidate scheduler configuration. Defaults are vLLM 0.33 `serve` on an H100."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    gpu_memory_utilization: float = 0.92
    block_size: int = 16
    scheduling_policy: str = "fcfs"
    schedule_mode: str = "decode_first"
    max_prefill_tokens: int = 16384
    step_time_cap_ms: float = 0.0
    kv_headroom: float = 0.0
    admission_mode: str = "none"
    admission_quantile: float = 0.9
    schedule_conservativeness: float = 1.0
    preemption_mode: str = "recompute"
    preemption_victim: str = "newest"
    max_preemptions: int = 0
    max_queue_len: int = 0
    max_wait_s: float = 0.0
    kv_high_water: float = 1.0
    reject_unmeetable_deadline: bool = False
    max_model_len: int = 0
    enable_prefix_caching: bool = True
    fairness_cost_unit: str = "tokens"
    vtc_input_weight: float = 1.0
    vtc_output_weight: float = 2.0
    aging_rate: float = 0.0
    max_wait_action: str = "reject"
    deadline_margin_ms: float = 50.0
    tenant_kv_quota: float = 1.0
    tenant_token_quota: float = 1.0
    speculative_mode: str = "off"
    num_speculative_tokens: int = 4
    speculative_draft_cost_mode: str = "fraction"
    speculative_draft_cost: float = 0.05

    def __post_init__(self) -> None:
        for f in fields(self):
            knob = KNOB_BY_NAME[f.name]
            value = getattr(self, f.name)
            object.__setattr__(self, f.name, _coerce(knob, value))

    # -- packing -------------------------------------------------------------------------
    def to_vector(self) -> np.ndarray:
        """Flat f8 vector for the kernel; categorical knobs as their choice index."""
        vec = np.empty(N_KNOBS, dtype=np.float64)
        for knob in KNOBS:
            value = getattr(self, knob.name)
            vec[knob.index] = knob.choices.index(value) if knob.choices else float(value)
        return vec

    @classmethod
    def from_vector(cls, vec: np.ndarray) -> PolicyConfig:
        values = {}
        for knob in KNOBS:
            x = vec[knob.index]
            values[knob.name] = knob.choices[int(x)] if knob.choices else x
        return cls(**values)

    def replace(self, **changes: Any) -> PolicyConfig:
        unknown = set(changes) - set(KNOB_BY_NAME)
        if unknown:
            raise ConfigError(f"unknown knob(s) {sorted(unknown)}; known: {sorted(KNOB_BY_NAME)}")
        return PolicyConfig(**{**asdict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- TOML ----------------------------------------------------------------------------
    def to_toml(self) -> str:
        lines = ["[policy]"]
        for knob in KNOBS:
            lines.append(f"{knob.name} = {_toml_value(getattr(self, knob.name))}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml(cls, text_or_path: str | Path) -> PolicyConfig:
        """Read a config from TOML text or a file; keys may sit at top level or under [policy]."""
        text = Path(text_or_path).read_text() if isinstance(text_or_path, Path) else text_or_path
        data = tomllib.loads(text)
        data = data.get("policy", data)
        return cls.from_mapping(data)

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> PolicyConfig:
        unknown = set(data) - set(KNOB_BY_NAME)
        if unknown:
            raise ConfigError(f"unknown knob(s) {sorted(unknown)}; known: {sorted(KNOB_BY_NAME)}")
        return cls(**data)


def _coerce(knob: Knob, value: Any) -> Any:
    name = knob.name
    if knob.kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int | float | np.integer | np.floating) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if knob.kind is str:
        if value not in knob.choices:
            raise ConfigError(f"{name} must be one of {list(knob.choices)}, got {value!r}")
        return str(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if math.isnan(number):
        raise ConfigError(f"{name} must be a number, got NaN")
    if knob.kind is int:
        if number != int(number):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        number = int(number)
    if not knob.low <= number <= knob.high:
        raise ConfigError(f"{name} must be in [{knob.low:g}, {knob.high:g}], got {value!r}")
    return number


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)
