"""SGLang 0.5.23 (`sglang serve --config sglang.yaml`): defaults, flags, rules, semantics.

SGLang's scheduler runs a prefill batch alone whenever it can form one (prefill first),
admits a prompt while its tokens plus ``new_token_ratio`` x the running requests' future
outputs fit the KV pool (the ratio starts at 0.7 x ``schedule-conservativeness`` and
decays), chunks at most one prompt at a time at ``chunked-prefill-size``, and when decode
runs out of KV retracts the request with the fewest outputs (with priority scheduling,
the least urgent). Its radix cache (prefix caching) is on unless ``disable-radix-cache``:
a prefix enters it once computed, a duplicate is freed at once, and a retracted request's KV
is freed without being cached (managers/schedule_batch.py:2388-2389), unlike vLLM's blocks.
Its overlap schedule (managers/scheduler.py:2061-2134 ``event_loop_overlap``; on unless
``disable-overlap-schedule``, arg_groups/fields/schedule.py:193-199) forms each batch while
the one before runs: a request arriving during a step first runs two steps later, and one
finishing frees its KV and seat a step late (``policies.engine.pipeline``, shared with
vLLM's async scheduling). Where SGLang's loop differs from vLLM's: a retracted request's
token in flight is thrown away, its admission reserve and retraction order read the outputs
it has seen (one fewer under a step in flight), and a decode short of KV while requests
ending by length are in flight waits a step rather than retract. None of the conditions
that turn overlap off (pipeline parallelism, diffusion LLMs, CPU or MPS speculative
decoding, server_args overrides.py:478-486, :1623-1628, :1718-1727) is a setup servetune
models.

``mem-fraction-static`` counts weights and the KV pool only, so the simulator runs it as
``gpu_memory_utilization = mem-fraction-static + the activation reserve`` (the cost
model's sizing) and the export subtracts the reserve again.

Parallel layouts (``Deployment``; rules in ``SGLang.layout_violations``): ``tp-size`` is
an instance's GPUs; ``attn-dp-size`` splits its attention into that many data-parallel
groups, one scheduler and KV pool each, while the MoE layers span all ``tp-size`` GPUs
(srt/arg_groups/fields/parallel.py:81-90; the deprecated ``--enable-dp-attention
--dp-size N`` resolves to it: arg_groups/parallel_hook.py:39-61); ``ep-size`` splits the
experts (the expert width is split ``tp-size / ep-size`` ways: srt/runtime_context.py:154);
``dp-size`` counts independent replicas. The data-parallel controller dispatches requests
over all ``dp-size x attn-dp-size`` schedulers by ``load-balance-method``
(managers/data_parallel_controller.py:123-224; runtime_context.py num_dp_ranks). A config's
knobs are per scheduler; under attention DP SGLang divides three of its flags by the group
count or scales them, which the file undoes (``_PER_RANK``).

Out of memory: SGLang reserves ``1 - mem-fraction-static`` of the GPU for everything but
weights and KV (mem_cache/kv_cache_configurator.py:2990-3038: the pool is the memory
free after the weights less ``(1 - mem_fraction_static) x total``), and nothing at
run time keeps a step within it: a prefill step holds at most ``chunked-prefill-size``
tokens, but a decode step runs every running request, up to ``max-running-requests``,
whatever the chunk. A step whose activations exceed the reserve raises CUDA's
out-of-memory error in the scheduler's event loop; ``run_scheduler_process`` catches it
and sends SIGQUIT to the server (srt/managers/scheduler.py:6370-6373), whose handler kills
the whole process tree (srt/entrypoints/engine.py:1976-1982, and after start-up
srt/managers/tokenizer_manager.py:4072-4081): every request in flight fails and the server
is gone. servetune models it so (``policies.workspace``): a run whose largest step
exceeds the reserve is an out-of-memory run, and a searched trial is pruned with the step,
the memory and the time. A file whose static fraction leaves less than one full chunk's
activations is refused when read (``decode``): its pool cannot be simulated.

Speculative decoding: an EAGLE-family drafter verifies a chain of ``speculative-num-steps``
drafts; DSPARK (``speculative-dspark-block-size`` k, one step of top-1 forced:
arg_groups/speculative_hook.py:757-839) verifies the whole block under
``SGLANG_RAGGED_VERIFY_MODE=static`` (``fixed``), or, under ``compact``, the budget its
planner picks against ``speculative-dspark-sps-table-path`` over confidences two steps old,
then the globally most likely drafts (srt/speculative/dspark_components/dspark_planner.py:
867-904, kernels/ops/speculative/dspark/dspark_schedule.py:53-131; ``sps_table``). The mode
is an environment variable, so the file's header and ``bench.sh`` carry it (``serve_env``),
and servetune writes the table (``sps_table``) beside the file. Without a table SGLang's
planner verifies everything: that is ``fixed``. ``cap-accept`` (``sps_cap_accept``) plans
the same budget but verifies the whole block and only caps the accepted run at the planned
length (dspark_worker_v2.py:1103, 1151-1175, dspark_accept.py:163-166): static's compute
with fewer tokens kept, so it is simulated but not searched. A file read back runs the mode
``SGLANG_RAGGED_VERIFY_MODE`` names in servetune's environment, as the server would; unset,
a file with a table runs as compact, the mode servetune's serve command sets. Compact's padding of
the verify tokens to a CUDA-graph tier (srt/speculative/ragged_verify.py:146-165) is not
modelled. Any drafter resets an unset ``max-running-requests`` to 48.

Source references are to the installed SGLang 0.5.23 package (``site-packages/sglang``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from costmodels.costmodel import CostModelError
from policies import speculative as spm
from policies.config import DRAFT_COST_MODES, PolicyConfig
from policies.engines.base import Deployment, EngineContext, EngineError, Flag, Target, int_arg

VERSION = "0.5.23"
#: max-running-requests of a speculative server whose file leaves it unset (arg_groups/speculative_hook.py:
#: 438-445 for EAGLE-family and DFlash drafters, :852-860 for DSPARK)
SPECULATIVE_MAX_RUNNING_REQUESTS = 48
#: the SPS table written beside sglang.yaml for DSPARK's planner
SPS_TABLE_FILE = "sps.json"
#: SGLANG_RAGGED_VERIFY_MODE's values (srt/speculative/ragged_verify.py:13-27) and the mode each runs
RAGGED_VERIFY_MODES = {"static": "fixed", "cap-accept": "sps_cap_accept", "compact": "sps_table"}
PLANNED_MODES = ("sps_table", "sps_cap_accept")  # the modes that read the SPS table
RAGGED_VERIFY_ENV = "SGLANG_RAGGED_VERIFY_MODE"

#: srt/arg_groups/memory_hook.py:89-180: (below MiB, chunked_prefill_size, decode CUDA-graph
#: max batch at TP < 4, at TP >= 4), by the GPU memory CUDA reports.
_MEMORY_TIERS = ((20 * 1024, 2048, 8, 8), (35 * 1024, 4096, 48, 160), (60 * 1024, 4096, 32, 160),
                 (90 * 1024, 8192, 256, 512), (160 * 1024, 8192, 256, 512), (float("inf"), 16384, 512, 512))
#: Memory CUDA reports for each GPU (MiB), which SGLang's rules read (engine-check of 0.5.23).
_REPORTED_MIB = {"a100": 81920, "h100": 81559, "h200": 143771, "b200": 183359}
MAX_PREFILL_TOKENS = 16384  # srt/arg_groups/fields/schedule.py:71-81
PAGE_SIZE = 1  # srt/arg_groups/overrides.py:1341-1363 (CUDA)
SCHEDULE_CONSERVATIVENESS = 1.0  # srt/arg_groups/fields/schedule.py:139-142
#: srt/arg_groups/fields/schedule.py:90-100 accepts more (priority among them, which the
#: scheduler then refuses: schedule_policy.py:324-344); these are the ones simulated.
SCHEDULE_POLICIES = {"fcfs": "fcfs", "lpm": "lpm", "lof": "lof", "priority": "priority", "dfs_weight": "dfs-weight"}  # priority: see to_args
#: retraction-policy (fields/schedule.py:126-138) -> the retracted request
RETRACTION_POLICIES = {"fewest_output": "length", "lowest_priority": "priority"}
#: --load-balance-method across dp-size replicas (managers/data_parallel_controller.py:105-160,
#: 880-925); "auto" resolves to round_robin outside P/D (arg_groups/serving_hook.py:217-236)
LOAD_BALANCE_METHODS = {"round_robin": "round_robin", "total_requests": "total_requests",
                        "total_tokens": "total_tokens"}
#: LoRA (srt/arg_groups/fields/lora.py:34-74): max-loras-per-batch 8 by default and counting the
#: base model (:66-69), LRU or FIFO eviction from the GPU pool (:70-74). Adapters are loaded
#: into host memory before they serve (--lora-paths at launch, or the load API), so none
#: is read from disk on a request. Without --lora-paths SGLang needs --max-lora-rank and
#: --lora-target-modules (srt/arg_groups/lora_hook.py:151-154); ``max-loaded-loras`` is not
#: written: with no --lora-paths its check takes ``len(None)`` (lora_hook.py:162).
MAX_LORAS_PER_BATCH = 8
LORA_EVICTION_POLICIES = {"lru": "lru", "fifo": "fifo"}
LORA_TARGET_MODULES = "lora-target-modules"


class SGLang(Target):
    """SGLang's scheduler (srt/managers/scheduler.py)."""

    deployment_keys = ("model-path", "tp-size", "dp-size")
    layout_keys = ("ep-size", "attn-dp-size")
    oom_consequence = ("SGLang's scheduler sends SIGQUIT on the CUDA out-of-memory error and the server kills its "
                       "process tree: every request in flight fails [srt/managers/scheduler.py:6370-6373, "
                       "srt/entrypoints/engine.py:1976-1982]")

    def deployment_args(self, deployment: Deployment) -> dict[str, Any]:
        args = super().deployment_args(deployment)
        if deployment.attention_dp > 1:
            args["attn-dp-size"] = deployment.attention_dp
        if deployment.moe_ep > 1:
            args["ep-size"] = deployment.moe_ep
        return args

    def deployment_from_args(self, args, ctx: EngineContext) -> Deployment:
        plain = super().deployment_from_args(args, ctx)
        return Deployment(plain.model, plain.tp, plain.replicas, moe_ep=int_arg(args, "ep-size"),
                          attention_dp=int_arg(args, "attn-dp-size"))

    def attention_dp_replicas(self, ctx: EngineContext) -> bool:
        return False  # srt/arg_groups/parallel_hook.py:287-292 (layout_violations)

    def layout_violations(self, deployment: Deployment, ctx: EngineContext) -> list[str]:
        broken = super().layout_violations(deployment, ctx)
        if deployment.attention_dp > 1 and deployment.replicas > 1:
            broken.append(f"--dp-size {deployment.replicas} with --attn-dp-size {deployment.attention_dp}: "
                          "data-parallel replicas combined with attention data parallelism are not supported "
                          "[srt/arg_groups/parallel_hook.py:287-292]")
        return broken

    # srt/server_args.py: --quantization fp8; --kv-cache-dtype takes fp8_e4m3 / fp8_e5m2
    dtype_keys = {"dtype": ("quantization", "fp8"), "kv_dtype": ("kv-cache-dtype", "fp8_e4m3")}

    def defaults(self, ctx: EngineContext) -> PolicyConfig:
        chunk = _tier(ctx)[1]
        utilization = mem_fraction_static(ctx, chunk) + ctx.reserve_share(chunk)
        return PolicyConfig(
            max_num_batched_tokens=chunk,
            max_num_seqs=max_running_requests(ctx, utilization, chunk),
            enable_chunked_prefill=True, long_prefill_token_threshold=0,
            gpu_memory_utilization=round(min(utilization, 1.0), 6), block_size=PAGE_SIZE,
            scheduling_policy="fcfs", schedule_mode="prefill_first", async_scheduling=True,
            max_prefill_tokens=MAX_PREFILL_TOKENS,
            kv_headroom=0.0, admission_mode="new_token_ratio", schedule_conservativeness=SCHEDULE_CONSERVATIVENESS,
            preemption_mode="recompute", preemption_victim="fewest_output", enable_prefix_caching=True,
            max_model_len=ctx.context_len, max_loras=MAX_LORAS_PER_BATCH, lora_base_slot=True, lora_preload=True,
        )

    def implied(self, config: PolicyConfig, ctx: EngineContext) -> dict[str, Any]:
        implied = {**super().implied(config, ctx), "migration": False, "prefill_replicas": 0}
        pool = _pool_tokens(ctx, config.gpu_memory_utilization, config.max_num_batched_tokens)
        if pool:
            # mem_cache/kv_cache_configurator.py:3127-3129: a requested cap is cut to the KV pool / 2
            implied["max_num_seqs"] = min(config.max_num_seqs, max(1, pool // 2))
        return implied

    speculative_keys = ("speculative-algorithm", "speculative-draft-model-path", "speculative-num-steps",
                        "speculative-eagle-topk", "speculative-num-draft-tokens", "speculative-dspark-block-size",
                        "speculative-dspark-sps-table-path")
    speculative_modes = ("fixed", *PLANNED_MODES)

    def speculative_search_modes(self, drafter, replicas: int = 1) -> tuple[str, ...]:
        return ("fixed", "sps_table") if drafter.get("sglang") == "DSPARK" else ("fixed",)

    def speculative_args(self, config: PolicyConfig, drafter) -> dict[str, Any]:
        k = config.num_speculative_tokens
        flags: dict[str, Any] = {"speculative-algorithm": drafter["sglang"]}
        if drafter.get("model") is not None:
            flags["speculative-draft-model-path"] = drafter["model"]
        if drafter["sglang"] == "DSPARK":
            # one step of top-1 with k + 1 verified tokens is forced (arg_groups/speculative_hook.py:757-839)
            flags["speculative-dspark-block-size"] = k
            if config.speculative_mode in PLANNED_MODES:
                flags["speculative-dspark-sps-table-path"] = SPS_TABLE_FILE
            return flags
        if config.speculative_mode in PLANNED_MODES:
            raise EngineError(f"an SPS table drives DSPARK's planner only; the drafter is {drafter['sglang']!r}")
        # a chain of k drafts: k steps of one candidate each, k + 1 tokens verified with the root
        return {**flags, "speculative-num-steps": k, "speculative-eagle-topk": 1, "speculative-num-draft-tokens": k + 1}

    def speculative_values(self, args) -> dict[str, Any]:
        algorithm = args.get("speculative-algorithm")
        if algorithm is None:
            return {}
        values: dict[str, Any] = {"speculative_mode": "fixed"}
        if "max-running-requests" not in args:  # any drafter: arg_groups/speculative_hook.py:438-445, :852-860
            values["max_num_seqs"] = SPECULATIVE_MAX_RUNNING_REQUESTS
        if str(algorithm).upper() == "DSPARK":
            k = args.get("speculative-dspark-block-size")
            if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
                raise EngineError("servetune needs DSPARK's block size as a positive speculative-dspark-block-size "
                                  f"(got {k!r}); SGLang otherwise reads it from the draft checkpoint "
                                  "[arg_groups/speculative_hook.py:791-839]")
            drafts = args.get("speculative-num-draft-tokens")
            if drafts is not None and drafts != k + 1:
                raise EngineError(f"DSpark speculative_num_draft_tokens must equal gamma + 1 (= {k + 1}), got "
                                  f"{drafts!r} [arg_groups/speculative_hook.py:824-839]")
            values["num_speculative_tokens"] = k
            # the table feeds the planner unless the mode is static (a no-op then: speculative_hook.py:878-883)
            if args.get("speculative-dspark-sps-table-path"):
                values["speculative_mode"] = ragged_verify_mode()
            return values
        k, topk, drafts = (args.get(key) for key in ("speculative-num-steps", "speculative-eagle-topk",
                                                     "speculative-num-draft-tokens"))
        if not isinstance(k, int) or topk != 1 or drafts != k + 1:
            raise EngineError("servetune simulates a chain of drafts: speculative-num-steps k, speculative-eagle-topk "
                              f"1 and speculative-num-draft-tokens k + 1; got {k!r}, topk {topk!r}, draft tokens "
                              f"{drafts!r}")
        values["num_speculative_tokens"] = k
        return values

    def with_drafter(self, config: PolicyConfig) -> PolicyConfig:
        return config.replace(max_num_seqs=SPECULATIVE_MAX_RUNNING_REQUESTS)

    def side_files(self, config: PolicyConfig, tables) -> dict[str, str]:
        if config.speculative_mode not in PLANNED_MODES:
            return {}
        if tables is None:
            raise EngineError(f"{SPS_TABLE_FILE} is written from the study's step-time tables; none were given")
        return {SPS_TABLE_FILE: json.dumps(sps_table(tables, config), indent=1) + "\n"}

    def serve_env(self, config: PolicyConfig) -> dict[str, str]:
        # the DSPARK planner's mode is an environment variable (srt/environ.py:1572)
        if config.speculative_mode not in PLANNED_MODES:
            return {}
        return {RAGGED_VERIFY_ENV: next(env for env, mode in RAGGED_VERIFY_MODES.items()
                                        if mode == config.speculative_mode)}

    def violations(self, config: PolicyConfig, ctx: EngineContext) -> list[str]:
        broken = []
        if config.max_num_batched_tokens % config.block_size:
            broken.append(f"chunked-prefill-size ({config.max_num_batched_tokens}) must be divisible by page-size "
                          f"({config.block_size}) [srt/server_args.py check_server_args]")
        if config.preemption_victim == "lowest_priority" and config.scheduling_policy != "priority":
            broken.append("--retraction-policy priority requires --enable-priority-scheduling "
                          "[srt/arg_groups/validation_hook.py:303-304]")
        if ctx.kv_tokens is not None and not _pool_tokens(ctx, config.gpu_memory_utilization,
                                                          config.max_num_batched_tokens):
            static = config.gpu_memory_utilization - ctx.reserve_share(config.max_num_batched_tokens)
            broken.append(f"mem-fraction-static {static:.3f} leaves "
                          "no GPU memory for the KV cache [mem_cache/kv_cache_configurator.py: Loaded weights leave "
                          "no GPU memory for the KV cache]")
        if not config.enable_chunked_prefill:
            broken.append("chunked-prefill-size -1 (chunking off) is not simulated for SGLang")
        if config.max_model_len and ctx.context_len and config.max_model_len > ctx.context_len:
            broken.append(f"context-length {config.max_model_len} exceeds the model's max_position_embeddings "
                          f"{ctx.context_len} [srt/configs/model_config.py]")
        return broken

    def lora_search_settings(self, adapters: int) -> dict[str, dict[str, Any]]:
        # the base model takes a slot too, hence adapters + 1
        return {"max_loras": {"low": 1, "high": max(2, min(adapters + 1, 64)), "log": True},
                "lora_eviction_policy": {"choices": list(LORA_EVICTION_POLICIES)}}

    def encode(self, flag: Flag, config: PolicyConfig, ctx: EngineContext) -> Any:
        if flag.knob == "gpu_memory_utilization":
            reserve = ctx.reserve_share(config.max_num_batched_tokens)
            static = round(config.gpu_memory_utilization - reserve, 6)
            if static <= 0:
                raise EngineError(f"gpu_memory_utilization={config.gpu_memory_utilization} leaves no weights or KV "
                                  f"memory after the {reserve:.3f} activation reserve")
            return static
        return super().encode(flag, config, ctx)

    def decode(self, flag: Flag, value: Any, ctx: EngineContext, args: Mapping[str, Any]) -> Any:
        if flag.knob == "gpu_memory_utilization":
            # the simulated pool subtracts the activation reserve at the step budget; SGLang's doesn't
            chunk = max(int(args.get("chunked-prefill-size", _tier(ctx)[1])), 0)
            static, reserve = float(value), ctx.reserve_share(chunk)
            total = round(static + reserve, 6)
            if total > 1.0:  # SGLang starts (the static pool fits) and runs out of memory at run time
                raise EngineError(
                    f"mem-fraction-static {static:g} leaves {1 - static:.3f} of GPU memory besides "
                    f"weights and KV, but a {chunk}-token chunk's activations, CUDA graphs and runtime need "
                    f"{reserve:.3f}: SGLang would run out of memory at the first full chunk; "
                    "lower mem-fraction-static or chunked-prefill-size")
            return total
        return super().decode(flag, value, ctx, args)

    # Priority scheduling is `enable-priority-scheduling` over the fcfs order (higher values
    # first, as in servetune's traces: schedule_policy.py:206, 526-536). Its preemption of a
    # running request by a waiting one more than 10 levels more urgent is not simulated, so
    # the file turns it off (`disable-priority-preemption`) to run as simulated.
    _PRIORITY_KEYS = {"enable-priority-scheduling": True, "disable-priority-preemption": True}

    def to_args(self, config: PolicyConfig, deployment: Deployment, ctx: EngineContext) -> dict[str, Any]:
        args = super().to_args(config, deployment, ctx)
        if deployment.replicas * deployment.attention_dp == 1:
            args.pop("load-balance-method", None)  # routes nothing to one scheduler
        args.update(_per_rank(args, deployment.attention_dp, inverse=True))
        if args.get("schedule-policy") == "priority":  # not a valid policy at run time: fcfs + the flags
            args["schedule-policy"] = "fcfs"
            args.update(self._PRIORITY_KEYS)
        if args.get("enable-lora"):
            args[LORA_TARGET_MODULES] = ["all"]  # adapters come through the load API: no paths to infer from
        return args

    def from_args(self, args: Mapping[str, Any], ctx: EngineContext) -> PolicyConfig:
        args = dict(args)
        modules = args.pop(LORA_TARGET_MODULES, None)
        if modules is not None and modules != ["all"]:
            raise EngineError(f"{LORA_TARGET_MODULES} {modules!r}: servetune costs adapters on every projection "
                              "(costmodels.lora); write ['all']")
        flags = {key: args.pop(key, False) for key in self._PRIORITY_KEYS}
        priority = flags["enable-priority-scheduling"] is True
        if priority and flags["disable-priority-preemption"] is not True:
            raise EngineError("priority scheduling is simulated without priority preemption: the file needs "
                              "disable-priority-preemption: true beside enable-priority-scheduling: true")
        if priority and args.get("schedule-policy", "fcfs") != "fcfs":
            raise EngineError("servetune simulates priority scheduling over the fcfs order only "
                              "(SGLang also allows lof: srt/arg_groups/validation_hook.py:281-286)")
        if priority:
            args["schedule-policy"] = "priority"  # read back as servetune's priority order
        groups = int_arg(args, "attn-dp-size")
        if groups > 1:  # the engine's defaults of the flags it then resolves per rank
            args.setdefault("chunked-prefill-size", _tier(ctx)[1])
            args.setdefault("schedule-conservativeness", SCHEDULE_CONSERVATIVENESS)
        args.update(_per_rank(args, groups, inverse=False))
        return super().from_args(args, ctx)


#: Flags SGLang resolves per scheduler under attention DP of d groups, as (divide by d,
#: scale): chunked-prefill-size // d (arg_groups/parallel_hook.py:327-333), max-running-
#: requests // d (mem_cache/kv_cache_configurator.py:3128), schedule-conservativeness x 0.3
#: (parallel_hook.py:316-321). The knobs are per scheduler; the file holds the flag values.
_PER_RANK = {"chunked-prefill-size": (True, 1.0), "max-running-requests": (True, 1.0),
             "schedule-conservativeness": (False, 0.3)}


def _per_rank(args: Mapping[str, Any], groups: int, inverse: bool) -> dict[str, Any]:
    """``args``' per-rank flags as one scheduler runs them (``inverse``: as the file writes them)."""
    if groups <= 1:
        return {}
    out = {}
    for key, (divided, scale) in _PER_RANK.items():
        if key not in args:
            continue
        value = args[key]
        if divided:
            out[key] = value * groups if inverse else value // groups
        else:
            out[key] = round(value / scale if inverse else value * scale, 6)
    return out


def _pool_tokens(ctx: EngineContext, utilization: float, chunk: int) -> int:
    """The KV pool in tokens, 0 when the memory fraction leaves none (or nothing sizes it)."""
    if ctx.kv_tokens is None:
        return 0
    try:
        return max(0, ctx.kv_pool_tokens(utilization, chunk))
    except CostModelError:
        return 0


def _reported_mib(ctx: EngineContext) -> float:
    key = ctx.gpu.lower().split("_")[0].split("-")[0]
    return _REPORTED_MIB.get(key, ctx.gpu_memory_gib * 1024)


def _tier(ctx: EngineContext) -> tuple[float, int, int, int]:
    mib = _reported_mib(ctx)
    return next(t for t in _MEMORY_TIERS if mib < t[0])


def mem_fraction_static(ctx: EngineContext, chunk: int) -> float:
    """SGLang's default static memory fraction (srt/arg_groups/memory_hook.py:281-327):
    GPU memory less 512 MiB, 1.5 MiB per activation token, TP/8 GiB and 2 MiB per decode
    CUDA-graph batch, at least 10 GiB on GPUs over 60 GiB."""
    mib = _reported_mib(ctx)
    _, _, graph_small, graph_large = _tier(ctx)
    graph_bs = graph_small if ctx.tp < 4 else graph_large
    reserved = 512 + max(chunk, 2048) * 1.5 + ctx.tp / 8 * 1024 + graph_bs * 2
    if mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((mib - reserved) / mib, 3)


def max_running_requests(ctx: EngineContext, utilization: float, chunk: int) -> int:
    """The request cap SGLang derives from its KV pool when the flag is unset
    (mem_cache/kv_cache_configurator.py:3119-3132):
    ``min(clamp(tokens / context_len * 512, 2048, 4096), tokens // 2)``.
    """
    if ctx.context_len <= 0:  # a synthetic model: no context to size by, the clamp's floor
        return 2048
    tokens = _pool_tokens(ctx, utilization, chunk)
    if not tokens:
        return 2048
    pool = min(max(int(tokens / ctx.context_len * 512), 2048), 4096)
    return max(1, min(tokens // 2, pool))


ENGINE = SGLang(
    name="sglang", display="SGLang", version=VERSION,
    flags=(
        Flag("chunked-prefill-size", "max_num_batched_tokens", search={"low": 256, "high": 32768, "log": True},
             help="most prompt tokens one step computes; one prompt is chunked at a time"),
        Flag("max-running-requests", "max_num_seqs", search={"low": 8, "high": 4096, "log": True},
             help="most requests running at once (default: from the KV pool)"),
        Flag("max-prefill-tokens", "max_prefill_tokens", search={"low": 1024, "high": 65536, "log": True},
             help="most prompt tokens one prefill batch admits"),
        Flag("mem-fraction-static", "gpu_memory_utilization", help="GPU memory share of weights and KV"),
        Flag("page-size", "block_size", help="tokens per KV page"),
        Flag("schedule-policy", "scheduling_policy", values=SCHEDULE_POLICIES,
             search={"choices": ["fcfs", "lpm", "lof", "priority", "dfs_weight"]},
             help="waiting order: fcfs, lpm (longest cached prefix first; fcfs past 128 waiting), lof (largest "
                  "max_tokens first: the client's cap, never the true length), or "
                  "priority (enable-priority-scheduling over fcfs; higher values first)"),
        Flag("retraction-policy", "preemption_victim", values=RETRACTION_POLICIES, unset="fewest_output",
             search={"choices": ["fewest_output", "lowest_priority"], "when": {"scheduling_policy": ["priority"]}},
             help="which request decode retracts when KV runs out: length (fewest outputs) or priority"),
        Flag("schedule-conservativeness", "schedule_conservativeness",
             search={"low": 0.1, "high": 3.0, "log": True},
             help="scales the new-token ratio that admission reserves for running requests"),
        # not searched, as vLLM's async-scheduling (policies.engines.vllm)
        Flag("disable-overlap-schedule", "async_scheduling", kind="store_true", invert=True,
             help="turn the overlap schedule off: each batch formed after the one before has finished, not "
                  "while it runs"),
        Flag("disable-radix-cache", "enable_prefix_caching", kind="store_true", invert=True, search={},
             help="turn the radix (prefix) cache off"),
        Flag("context-length", "max_model_len", unset=0, help="longest prompt + output"),
        Flag("enable-lora", "enable_lora", kind="store_true", help="serve LoRA adapters"),
        Flag("max-loras-per-batch", "max_loras",
             help="GPU adapter slots: most distinct adapters of a batch, the base model counted"),
        Flag("lora-eviction-policy", "lora_eviction_policy", values=LORA_EVICTION_POLICIES,
             help="which idle adapter leaves a full GPU pool: lru or fifo"),
        Flag("max-lora-rank", "max_lora_rank", help="rank every adapter slot is sized for"),
        Flag("load-balance-method", "router", values=LOAD_BALANCE_METHODS,
             search={"choices": list(LOAD_BALANCE_METHODS)},
             help="which dp-size replica takes a request: round_robin, total_requests (fewest running + "
                  "waiting), total_tokens (fewest tokens)"),
    ),
)


def ragged_verify_mode() -> str:
    """The ``speculative_mode`` a DSPARK file with an SPS table runs: the one
    ``SGLANG_RAGGED_VERIFY_MODE`` names in this environment, compact when it is unset."""
    raw = os.environ.get(RAGGED_VERIFY_ENV, "compact")
    if raw not in RAGGED_VERIFY_MODES:
        raise EngineError(f"invalid {RAGGED_VERIFY_ENV}={raw!r}; expected one of "
                          f"{', '.join(map(repr, RAGGED_VERIFY_MODES))} [srt/speculative/ragged_verify.py:13-27]")
    return RAGGED_VERIFY_MODES[raw]


def sps_table(tables, config: PolicyConfig) -> dict[str, Any]:
    """SGLang's ``SpsCostTable`` JSON for DSPARK's planner under ``config``, from the step-time
    model: steps per second at the request counts SGLang's profiler probes up to
    ``max-running-requests`` (``policies.speculative.sps_probe_counts``), each a decode step
    of that many requests verifying ``num_speculative_tokens`` + 1 tokens at
    ``SPS_TABLE_CONTEXT`` KV tokens, drafting included. Keys and rules of
    srt/speculative/dspark_components/dspark_sps.py:14-36 (probes strictly increasing
    integers, as many rates, ``max_batch_tokens`` at least the last probe); the simulator's
    ``sps_table`` mode reads the same figures (``policies.speculative.sps_table_seconds``)."""
    gamma, most = config.num_speculative_tokens, config.max_num_seqs
    draft_mode = DRAFT_COST_MODES.index(config.speculative_draft_cost_mode)
    counts = spm.sps_probe_counts(most)
    rates = [1.0 / spm.sps_table_seconds(tables, p, gamma, spm.SPS_TABLE_CONTEXT, draft_mode,
                                         config.speculative_draft_cost) for p in counts]
    return {"sample_batch_tokens": [p * (gamma + 1) for p in counts], "sample_steps_per_sec": rates,
            "max_batch_tokens": most * (gamma + 1)}
