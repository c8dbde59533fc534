"""PolicyConfig: every scheduler knob the search may turn, validated on construction.

Names follow vLLM where vLLM has the knob; the rest are servetune's own. A config packs
into a flat float vector for the kernel (``to_vector``; indices in ``Knob.index``) and
round-trips through TOML. Categorical knobs are stored as strings and packed as their
position in ``choices``. The fleet knobs (``FLEET_KNOBS``) act only across replicas, whose
count is the caller's: ``check_fleet`` checks them against it.
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
    """Metadata for one PolicyConfig field: valid range or choices. Which engine flag carries
    it is the engine module's to say (``policies.engines``)."""

    name: str
    kind: type  # int, float, bool or str
    low: float | None = None  # inclusive
    high: float | None = None  # inclusive
    choices: tuple[str, ...] = ()
    router: str | None = None  # sglang-router 0.3.2 flag, when its router has the knob
    help: str = ""

    @property
    def index(self) -> int:
        return KNOB_INDEX[self.name]


SCHEDULING_POLICIES = ("fcfs", "priority", "edf", "sjf", "lpm", "vtc", "lof", "dfs_weight")  # append only: indices are encoded
SCHEDULE_MODES = ("decode_first", "prefill_first")
ADMISSION_MODES = ("none", "reservation", "predicted", "new_token_ratio")
PREEMPTION_MODES = ("recompute", "swap", "auto")
PREEMPTION_VICTIMS = ("newest", "lowest_priority", "fewest_output")
FAIRNESS_COST_UNITS = ("tokens", "gpu_time", "kv_byte_seconds")
MAX_WAIT_ACTIONS = ("reject", "admit_first")
SPECULATIVE_MODES = ("off", "fixed", "smartspec", "dspark", "dspark_lagged", "batch_schedule", "adaptive_verify",
                     "sps_table", "sps_cap_accept")  # append only: indices are encoded
DRAFT_COST_MODES = ("fraction", "mtp")
LORA_EVICTION_POLICIES = ("lru", "fifo")  # the indices are policies.adapters LRU, FIFO
ROUTERS = ("round_robin", "least_outstanding", "least_kv", "cache_aware", "unified", "consistent_hash",
           "vllm_dp", "total_requests", "total_tokens")  # append only: indices are encoded
#: Most replicas a fleet may have (optimizer.search.space.Fleet), and most the cache-aware router
#: tracks: its prefix sets are one bit per replica in a 64-bit mask.
MAX_REPLICAS = 1024
MAX_CACHE_AWARE_REPLICAS = 64

# fleet (issue 8): routing across data-parallel replicas, Llumnix migration, prefill/decode
# disaggregation. They act only with more than one replica; the replica count and TP are
# the caller's (optimizer.search.space.Fleet). No engine has them; sglang-router has a few.
_FLEET: tuple[Knob, ...] = (
    Knob("router", str, choices=ROUTERS, router="policy",
         help="which replica takes a request: round_robin; least_outstanding (fewest requests); least_kv "
              "(Llumnix freeness); cache_aware (SGLang router); unified (prefill saved - queue - transfer - "
              "KV risk); consistent_hash (prefix ring, overflow to the secondary); vllm_dp (vLLM's DP load "
              "balancer); total_requests / total_tokens (SGLang's DP controller --load-balance-method)"),
    Knob("router_cache_threshold", float, 0.0, 1.0, router="cache-threshold",
         help="cache_aware: route to the best prefix match when its share of the prompt exceeds this"),
    Knob("router_balance_abs", int, 0, 1 << 20, router="balance-abs-threshold",
         help="cache_aware: imbalanced (route to the least loaded) when max - min outstanding exceeds this ..."),
    Knob("router_balance_rel", float, 1.0, 1000.0, router="balance-rel-threshold",
         help="cache_aware: ... and max outstanding exceeds min x this"),
    Knob("router_queue_weight", float, 0.0, 100.0, help="unified: weight of the queueing-time term"),
    Knob("hash_virtual_nodes", int, 1, 4096, help="consistent_hash: ring points per replica"),
    Knob("hash_prefix_blocks", int, 1, 1024, help="consistent_hash: leading prompt block hashes in the key"),
    Knob("hash_by_tenant", bool, help="consistent_hash: the tenant (adapter) is part of the key"),
    Knob("hash_overflow_factor", float, 1.0, 100.0,
         help="consistent_hash: go to the secondary owner when the primary's outstanding requests "
              "exceed this x the mean + 1"),
    Knob("migration", bool, help="move a running request's KV off a replica short of KV (Llumnix)"),
    Knob("migration_threshold", float, 0.0, 1e6,
         help="migration: a replica is short below this freeness (decode steps of free KV)"),
    Knob("migration_interval_s", float, 0.001, 3600.0, help="migration: seconds between checks"),
    Knob("migration_pause_ms", float, 0.0, 1e5, help="migration: stall of a moved request besides the copy"),
    Knob("interconnect_gbps", float, 0.01, 1e5,
         help="GB/s per GPU between replicas: KV of migrations and prefill->decode handoffs"),
    Knob("prefill_replicas", int, 0, MAX_REPLICAS - 1,
         help="replicas that only prefill, handing KV to the rest, which only decode (0 = colocated)"),
)

KNOBS: tuple[Knob, ...] = (
    Knob("max_num_batched_tokens", int, 1, 1 << 20,
         help="token budget per step: prefill chunks + decode tokens"),
    Knob("max_num_seqs", int, 1, 1 << 16,
         help="most sequences running at once"),
    Knob("enable_chunked_prefill", bool,
         help="split prompts across steps to fit the token budget"),
    Knob("long_prefill_token_threshold", int, 0, 1 << 20,
         help="cap on one request's prefill tokens per step (0 = off)"),
    Knob("gpu_memory_utilization", float, 0.05, 1.0,
         help="fraction of GPU memory for weights, activations and KV"),
    Knob("block_size", int, 1, 256, help="KV block size in tokens"),
    Knob("scheduling_policy", str, choices=SCHEDULING_POLICIES,
         help="waiting-queue order"),
    Knob("schedule_mode", str, choices=SCHEDULE_MODES,
         help="decode_first: running requests first, then waiting (vLLM V1); "
              "prefill_first: a prefill batch runs alone when there is one (SGLang)"),
    Knob("async_scheduling", bool,
         help="form each step while the one before it runs (vLLM async scheduling): a request arriving "
              "during a step first runs two steps later, and a finished request frees its seat and KV one "
              "step late"),
    Knob("max_prefill_tokens", int, 1, 1 << 22,
         help="prefill_first: most prompt tokens one prefill batch takes"),
    Knob("step_time_cap_ms", float, 0.0, 1e6, help="longest step the scheduler forms, in ms (0 = off)"),
    # TensorRT-LLM's batch waiting (PyExecutor._waiting_requests): prompts wait beside running
    # requests so more of them share one step; both knobs on, or no wait.
    Knob("batch_wait_iters", int, 0, 1 << 20,
         help="steps new prompts may wait beside running requests for the batch to fill (0 = off; "
              "TRT-LLM batch_wait_timeout_iters)"),
    Knob("batch_wait_token_ratio", float, 0.0, 1.0,
         help="waiting prompts start once the step's tokens reach this share of the token budget "
              "(0 = off; TRT-LLM batch_wait_max_tokens_ratio)"),
    # TensorRT-LLM's attention-DP balancing (PyExecutor._balance_adp_requests, attention_dp_config
    # enable_balance): new prompts on ranks stepping together start when every rank has one.
    Knob("dp_balance_timeout_iters", int, 0, 1 << 20,
         help="attention DP: steps new prompts wait for every rank to have one (0 = off; TRT-LLM "
              "attention_dp_config timeout_iters with enable_balance)"),
    Knob("dp_balance_batching_iters", int, 0, 1 << 20,
         help="attention DP: steps prompts on every rank wait beside every rank's decodes (TRT-LLM "
              "attention_dp_config batching_wait_iters)"),
    Knob("kv_headroom", float, 0.0, 0.9, help="fraction of KV blocks kept free when admitting (vLLM watermark)"),
    Knob("admission_mode", str, choices=ADMISSION_MODES,
         help="none: admit while blocks allocate; reservation: reserve prompt + max_tokens; "
              "predicted: reserve a predicted output quantile; new_token_ratio: SGLang's adaptive ratio"),
    Knob("admission_quantile", float, 0.01, 1.0, help="predicted: output-length quantile reserved"),
    Knob("schedule_conservativeness", float, 0.01, 10.0,
         help="new_token_ratio: scales the initial ratio 0.7"),
    Knob("preemption_mode", str, choices=PREEMPTION_MODES,
         help="recompute: free KV and re-prefill; swap: copy KV to host; auto: the cheaper per victim"),
    Knob("preemption_victim", str, choices=PREEMPTION_VICTIMS,
         help="newest: most recently admitted (vLLM FCFS); lowest_priority; fewest_output (SGLang retract)"),
    Knob("max_preemptions", int, 0, 1 << 20, help="preemptions before a request is rejected (0 = unlimited)"),
    Knob("max_queue_len", int, 0, 1 << 30,
         help="waiting requests before arrivals are rejected (0 = unbounded)"),
    Knob("max_wait_s", float, 0.0, 1e9, help="longest wait before first schedule, then reject (0 = off)"),
    Knob("kv_high_water", float, 0.01, 1.0,
         help="reject arrivals while KV usage is at or above this fraction (1.0 = off)"),
    Knob("reject_unmeetable_deadline", bool,
         help="reject an arrival whose deadline passes before its prompt could finish alone"),
    Knob("max_model_len", int, 0, 1 << 24,
         help="longest prompt + output accepted (0 = whatever the KV pool holds)"),
    Knob("enable_prefix_caching", bool,
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
              "dspark_lagged (global top-K from confidences two steps back); the engines' own: batch_schedule "
              "(vLLM's k per batch size), adaptive_verify (vLLM's DSpark adaptive verification), sps_table "
              "(SGLang's DSPARK planner against its SPS table, compact verify), sps_cap_accept (the same "
              "planner capping acceptance over a full-block verify)"),
    Knob("num_speculative_tokens", int, 1, 16,
         help="draft length gamma: the k of fixed, the most drafts any request verifies otherwise"),
    Knob("speculative_batch_2", int, 0, 1 << 16,
         help="batch_schedule: the first batch size of the schedule's second range (0 = one range: k everywhere)"),
    Knob("speculative_k_2", int, 0, 16, help="batch_schedule: drafts of the second range"),
    Knob("speculative_batch_3", int, 0, 1 << 16,
         help="batch_schedule: the first batch size of the third range (0 = none)"),
    Knob("speculative_k_3", int, 0, 16, help="batch_schedule: drafts of the third range"),
    Knob("speculative_draft_cost_mode", str, choices=DRAFT_COST_MODES,
         help="fraction: a drafted position costs speculative_draft_cost x the target's decode step; "
              "mtp: it costs speculative_draft_cost ms (an MTP head)"),
    Knob("speculative_draft_cost", float, 0.0, 1000.0,
         help="cost of one drafted position, in the unit of speculative_draft_cost_mode"),
    # LoRA adapters (policies.adapters): the GPU slot pool, its host cache, the batch limit
    Knob("enable_lora", bool, help="serve LoRA adapters: their slots take GPU memory from the KV pool and their "
                                   "GEMMs add to each step"),
    Knob("max_loras", int, 1, 1 << 16,
         help="GPU adapter slots: most distinct adapters among running requests (vLLM max-loras, SGLang "
              "max-loras-per-batch)"),
    Knob("max_cpu_loras", int, 0, 1 << 20,
         help="adapters kept in host memory, LRU; others load from disk (0 = max_loras, vLLM's default)"),
    Knob("max_lora_rank", int, 1, 512, help="rank every adapter slot is sized and computed at"),
    Knob("lora_eviction_policy", str, choices=LORA_EVICTION_POLICIES,
         help="which idle adapter leaves a full GPU pool: lru (least recently used) or fifo (first loaded)"),
    Knob("lora_base_slot", bool, help="the base model counts as one of the max_loras adapters of a batch (SGLang)"),
    Knob("lora_preload", bool, help="every adapter sits in host memory from the start (SGLang loads --lora-paths "
                                    "at launch); else each is read from disk on first use (vLLM)"),
    *_FLEET,
)

KNOB_INDEX = {k.name: i for i, k in enumerate(KNOBS)}
KNOB_BY_NAME = {k.name: k for k in KNOBS}
N_KNOBS = len(KNOBS)
#: Knobs that only act across replicas: a single-replica run ignores them.
FLEET_KNOBS = tuple(k.name for k in _FLEET)
#: Speculative decoding's knobs: the drafter's, set from the study's declared drafter.
SPECULATIVE_KNOBS = ("speculative_mode", "num_speculative_tokens", "speculative_draft_cost_mode",
                     "speculative_draft_cost", "speculative_batch_2", "speculative_k_2", "speculative_batch_3",
                     "speculative_k_3")
#: The schedule of ``batch_schedule``: (first batch size, k) of its second and third ranges.
BATCH_SCHEDULE_KNOBS = ("speculative_batch_2", "speculative_k_2", "speculative_batch_3", "speculative_k_3")
#: The LoRA pool's knobs besides ``enable_lora``: they act only with it on.
LORA_KNOBS = ("max_loras", "max_cpu_loras", "max_lora_rank", "lora_eviction_policy", "lora_base_slot", "lora_preload")


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
    async_scheduling: bool = False
    max_prefill_tokens: int = 16384
    step_time_cap_ms: float = 0.0
    batch_wait_iters: int = 0
    batch_wait_token_ratio: float = 0.0
    dp_balance_timeout_iters: int = 0
    dp_balance_batching_iters: int = 0
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
    speculative_batch_2: int = 0
    speculative_k_2: int = 0
    speculative_batch_3: int = 0
    speculative_k_3: int = 0
    speculative_draft_cost_mode: str = "fraction"
    speculative_draft_cost: float = 0.05
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int = 0
    max_lora_rank: int = 16
    lora_eviction_policy: str = "lru"
    lora_base_slot: bool = False
    lora_preload: bool = False
    # fleet: defaults keep today's multi-replica behaviour (round robin, nothing moves)
    router: str = "round_robin"
    router_cache_threshold: float = 0.3
    router_balance_abs: int = 64
    router_balance_rel: float = 1.5
    router_queue_weight: float = 1.0
    hash_virtual_nodes: int = 160
    hash_prefix_blocks: int = 1
    hash_by_tenant: bool = False
    hash_overflow_factor: float = 1.25
    migration: bool = False
    migration_threshold: float = 3.0
    migration_interval_s: float = 0.05
    migration_pause_ms: float = 25.0
    interconnect_gbps: float = 50.0
    prefill_replicas: int = 0

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


def check_fleet(config: PolicyConfig, replicas: int, lockstep: int = 1) -> None:
    """Raise ConfigError when ``config``'s fleet knobs cannot run on ``replicas`` replicas
    (one replica ignores them: only the count is checked), ``lockstep`` of them to an
    attention-DP instance whose ranks step together."""
    if isinstance(replicas, bool) or not isinstance(replicas, int | np.integer) or not 1 <= replicas <= MAX_REPLICAS:
        raise ConfigError(f"replicas must be an integer in [1, {MAX_REPLICAS}], got {replicas!r}")
    if isinstance(lockstep, bool) or not isinstance(lockstep, int | np.integer) or lockstep < 1 or replicas % lockstep:
        raise ConfigError(f"lockstep must be a positive integer dividing replicas={replicas} (the attention-DP "
                          f"ranks of each instance), got {lockstep!r}")
    if lockstep > 1 and config.prefill_replicas:
        raise ConfigError(f"prefill_replicas={config.prefill_replicas} with attention-DP ranks stepping together "
                          f"(lockstep {lockstep}): a prefill/decode split of DP ranks is not modelled")
    if config.prefill_replicas >= replicas > 1:
        raise ConfigError(f"prefill_replicas={config.prefill_replicas} leaves no decode replica among "
                          f"{replicas}; give at most {replicas - 1}")
    if config.router == "cache_aware" and replicas > MAX_CACHE_AWARE_REPLICAS:
        raise ConfigError(f"router='cache_aware' tracks at most {MAX_CACHE_AWARE_REPLICAS} replicas, got {replicas}")


def active_fleet_knobs(config: PolicyConfig) -> tuple[str, ...]:
    """The fleet knobs that act under ``config`` on more than one replica: the router, the
    chosen router's own settings, migration's when it is on, P/D's split, and the
    interconnect when KV moves between replicas (migration or P/D)."""
    by_router = {
        "cache_aware": ("router_cache_threshold", "router_balance_abs", "router_balance_rel"),
        "unified": ("router_queue_weight",),
        "consistent_hash": ("hash_virtual_nodes", "hash_prefix_blocks", "hash_by_tenant", "hash_overflow_factor"),
    }
    names = ["router", *by_router.get(config.router, ())]
    if config.migration:
        names += ["migration", "migration_threshold", "migration_interval_s", "migration_pause_ms"]
    if config.prefill_replicas:
        names.append("prefill_replicas")
    if config.migration or config.prefill_replicas:
        names.append("interconnect_gbps")
    return tuple(names)


#: (knob, the condition on the config under which it acts): outside it the knob changes nothing.
_ACTS_WHEN: tuple[tuple[str, Any], ...] = (
    ("long_prefill_token_threshold", lambda c: c.enable_chunked_prefill),
    ("batch_wait_iters", lambda c: c.batch_wait_token_ratio > 0),
    ("batch_wait_token_ratio", lambda c: c.batch_wait_iters > 0),
    ("dp_balance_batching_iters", lambda c: c.dp_balance_timeout_iters > 0),
    ("max_prefill_tokens", lambda c: c.schedule_mode == "prefill_first"),
    ("admission_quantile", lambda c: c.admission_mode == "predicted"),
    ("schedule_conservativeness", lambda c: c.admission_mode == "new_token_ratio"),
    ("max_wait_action", lambda c: c.max_wait_s > 0),
    ("aging_rate", lambda c: c.scheduling_policy in ("priority", "sjf")),
    ("deadline_margin_ms", lambda c: c.scheduling_policy == "edf"),
    ("vtc_input_weight", lambda c: c.scheduling_policy == "vtc" and c.fairness_cost_unit == "tokens"),
    ("vtc_output_weight", lambda c: c.scheduling_policy == "vtc" and c.fairness_cost_unit == "tokens"),
    ("num_speculative_tokens", lambda c: c.speculative_mode != "off"),
    ("speculative_draft_cost_mode", lambda c: c.speculative_mode != "off"),
    ("speculative_draft_cost", lambda c: c.speculative_mode != "off"),
    *((name, lambda c: c.speculative_mode == "batch_schedule") for name in BATCH_SCHEDULE_KNOBS),
    *((name, lambda c: c.enable_lora) for name in LORA_KNOBS),
)


def inert_knobs(config: PolicyConfig, replicas: int = 1) -> frozenset[str]:
    """The knobs that change nothing under ``config`` (e.g. ``max_wait_action`` with no max
    wait; the fleet knobs on one replica): a report never lists them as a change."""
    inert = {name for name, acts in _ACTS_WHEN if not acts(config)}
    active_fleet = set(active_fleet_knobs(config)) if replicas > 1 else set()
    inert |= {name for name in FLEET_KNOBS if name not in active_fleet}
    return frozenset(inert)


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
    if isinstance(value, bool):  # float(True) is 1.0: a flag where a number belongs is a typo
        raise ConfigError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int past a float's range
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if math.isnan(number):
        raise ConfigError(f"{name} must be a number, got NaN")
    if not knob.low <= number <= knob.high:  # before int(): infinity has no integer
        raise ConfigError(f"{name} must be in [{knob.low:g}, {knob.high:g}], got {value!r}")
    if knob.kind is int:
        if number != int(number):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        number = int(number)
    return number


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)
