"""servetune's own target: every knob of PolicyConfig, including the policies no engine has.

Its recommendations are what-ifs ("what this traffic would gain if your engine had X"):
they are written to ``policy.toml`` only, never into an engine's file, and measured
against both engines' defaults. It starts from vLLM's behaviour, so a what-if change is
always a change from something an engine does.
"""

from __future__ import annotations

from typing import Any

from policies.config import KNOBS, LORA_KNOBS, MAX_REPLICAS, PolicyConfig
from policies.engines import sglang, vllm
from policies.engines.base import EngineContext, Target

#: Default search ranges. Knobs absent here: searched when a bool or a choice, fixed at the
#: base value when a number (a range over a knob's whole validity interval wastes trials).
SEARCH: dict[str, dict[str, Any]] = {
    "max_num_batched_tokens": {"low": 256, "high": 32768, "log": True},
    "max_num_seqs": {"low": 8, "high": 1024, "log": True},
    "long_prefill_token_threshold": {"low": 64, "high": 8192, "log": True, "off": True,
                                     "when": {"enable_chunked_prefill": [True]}},
    "max_prefill_tokens": {"low": 1024, "high": 65536, "log": True,
                           "when": {"schedule_mode": ["prefill_first"]}},
    "step_time_cap_ms": {"low": 20.0, "high": 2000.0, "log": True, "off": True},
    "kv_headroom": {"low": 0.0, "high": 0.3},
    "admission_quantile": {"low": 0.5, "high": 1.0, "when": {"admission_mode": ["predicted"]}},
    "schedule_conservativeness": {"low": 0.1, "high": 3.0, "log": True,
                                  "when": {"admission_mode": ["new_token_ratio"]}},
    # More memory only ever helps the simulated pool (the memory a step's activations need
    # beside it is checked, policies.workspace, but no other process shares the GPU) and
    # finer blocks are free without a model of attention kernels: both stay at the
    # deployment's value.
    "gpu_memory_utilization": {"search": False},
    "block_size": {"search": False},
    # Load shedding: these buy goodput by rejecting requests; open them deliberately, with
    # an explicit constraints.max_rejected_fraction.
    "max_preemptions": {"search": False},
    "max_queue_len": {"search": False},
    "max_wait_s": {"search": False},
    # Knobs that act only under another's value are asked only then (issue 16).
    "max_wait_action": {"when": {"max_wait_s": "on"}},
    "fairness_cost_unit": {"when": {"scheduling_policy": ["vtc"]}},
    "kv_high_water": {"search": False},
    "max_model_len": {"search": False},
    # Speculative decoding needs a drafter the deployment may not have: searched only when
    # the study declares one. Its draft cost is the drafter's.
    "speculative_mode": {"search": False},
    "speculative_draft_cost_mode": {"search": False},
    # Fleet: each router's thresholds only under that router. Migration's pause and the
    # interconnect are the hardware's, not scheduling choices.
    "router_cache_threshold": {"low": 0.05, "high": 0.95, "when": {"router": ["cache_aware"]}},
    "router_balance_abs": {"low": 1, "high": 1024, "log": True, "when": {"router": ["cache_aware"]}},
    "router_balance_rel": {"low": 1.0, "high": 4.0, "when": {"router": ["cache_aware"]}},
    "router_queue_weight": {"low": 0.1, "high": 10.0, "log": True, "when": {"router": ["unified"]}},
    "hash_virtual_nodes": {"low": 16, "high": 1024, "log": True, "when": {"router": ["consistent_hash"]}},
    "hash_prefix_blocks": {"low": 1, "high": 16, "log": True, "when": {"router": ["consistent_hash"]}},
    "hash_by_tenant": {"when": {"router": ["consistent_hash"]}},
    "hash_overflow_factor": {"low": 1.0, "high": 4.0, "when": {"router": ["consistent_hash"]}},
    "migration_threshold": {"low": 0.5, "high": 50.0, "log": True, "when": {"migration": [True]}},
    "migration_interval_s": {"low": 0.01, "high": 1.0, "log": True, "when": {"migration": [True]}},
    "migration_pause_ms": {"search": False},
    "interconnect_gbps": {"search": False},
    "prefill_replicas": {"low": 1, "high": MAX_REPLICAS - 1, "off": True},
    # LoRA: on (and its pool searched, lora_search_settings) only for a trace with adapters
    **{name: {"search": False} for name in ("enable_lora", *LORA_KNOBS)},
}


class ServeTune(Target):
    """Every knob, searched from vLLM's defaults; baselines are both engines' defaults."""

    @property
    def knobs(self) -> tuple[str, ...]:
        return tuple(k.name for k in KNOBS)

    def defaults(self, ctx: EngineContext) -> PolicyConfig:
        return vllm.ENGINE.defaults(ctx)

    def baselines(self, ctx: EngineContext) -> dict[str, PolicyConfig]:
        return {**vllm.ENGINE.baselines(ctx), **sglang.ENGINE.baselines(ctx)}

    def search_settings(self, ctx: EngineContext) -> dict[str, dict[str, Any]]:
        return {k: dict(v) for k, v in SEARCH.items()}

    def resolve(self, config: PolicyConfig, ctx: EngineContext) -> PolicyConfig:
        return config

    def violations(self, config: PolicyConfig, ctx: EngineContext) -> list[str]:
        # the what-if policies run on vLLM's memory sizing, so vLLM's start-up refusals are theirs
        return vllm.memory_violations(config, ctx)

    def lora_search_settings(self, adapters: int) -> dict[str, dict[str, Any]]:
        # both engines' pools: slots, host cache, eviction order and whether the base takes a slot
        return {**vllm.ENGINE.lora_search_settings(adapters), **sglang.ENGINE.lora_search_settings(adapters),
                "lora_base_slot": {}, "lora_preload": {}}


ENGINE = ServeTune(name="servetune", display="servetune (what-if)", version="native", what_if=True)
