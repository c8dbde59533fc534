"""vLLM 0.33.0 (`vllm serve --config vllm.yaml`): its defaults, flags, rules and semantics.

The V1 engine's scheduler is one loop: running requests first, then waiting ones, under a
token budget (``max-num-batched-tokens``) and a sequence cap (``max-num-seqs``), prompts
chunked to fit; a KV allocation that fails preempts the newest running request (under
``scheduling-policy priority``, the least urgent one) and recomputes it later. There is
no KV watermark, no admission rule beyond "its blocks allocate" and no swap in V1, so
those servetune knobs sit at ``none`` / 0 / ``recompute`` for every vLLM config. ``vllm
serve`` runs that loop asynchronously (``async-scheduling``, on unless the file says
``no-async-scheduling``): each step is formed while the one before it runs
(``policies.engine.pipeline``).

Prefix caching (``enable-prefix-caching``, on unless the file says no) follows vLLM's block
cache (``policies.prefix_cache``; the engine's ``VLLM_CACHE`` rules, which every config that is
not prefill-first runs): a block is cached when the step computing it is scheduled
(v1/core/kv_cache_manager.py ``allocate_slots`` -> ``cache_blocks``), so a request scheduled
later in that step hits it; a freed block keeps its hash until it is reused, blocks are
evicted one at a time from the free queue's head and a request's are freed tail first
(v1/core/block_pool.py ``free_blocks``, ``_maybe_evict_cached_block``), so a request
preempted for recompute finds its own blocks again, generated tokens included
(kv_cache_manager.py:616-625); a block two requests compute is kept twice
(``BlockHashToBlockMap``); a lookup hits at most ``(tokens - 1) // block_size`` blocks.

Parallel layouts (``Deployment``; rules in ``VLLM.layout_violations``): the data-parallel
ranks of a dense model are independent engines behind one API server (replicas:
v1/engine/core.py:1550-1552); those of a MoE model run as ``DPEngineCoreProc`` (core.py:
1546-1549), which steps every rank together, idle ones on a dummy batch (core.py:2495-2507),
while the expert layers span all ``tensor-parallel-size x data-parallel-size`` GPUs
(model_executor/layers/fused_moe/config.py:1198-1230). servetune models that as attention
data parallelism within one instance: ``attention_dp = data-parallel-size``, the instance's
``tp`` = TP x DP, each rank one scheduler with its own ``max-num-seqs``, token budget and
KV pool (the scheduler config is per engine core). ``enable-expert-parallel`` makes the
expert-parallel size TP x DP (fused_moe/config.py:1228-1230: ``ep_size = tp_size`` after
flattening), so ``moe_ep`` is 1 or the instance's ``tp``.

Memory: at start-up vLLM runs a dummy forward pass of ``max-num-batched-tokens`` tokens
(v1/worker/gpu_model_runner.py:6072-6133, called from v1/worker/gpu_worker.py:700) and
sizes the KV pool from what ``gpu-memory-utilization`` leaves after the weights, that
pass's activation peak and CUDA graphs (gpu_worker.py:753-757; the cost model's sizing).
A budget or a utilisation that leaves no KV memory, or too little for one
``max-model-len`` request, makes vLLM raise at start-up (``memory_violations``): such a
config is refused, and a searched trial pruned with vLLM's error. At run time no step
computes more than the budget (v1/core/sched/scheduler.py:719: ``token_budget =
self.max_num_scheduled_tokens``), which the profile covered, so vLLM never runs out of
activation memory; running out of KV blocks preempts (recompute), as above.

Speculative decoding (``speculative-config``, the study's drafter): ``num_speculative_tokens``
drafts per decode (``fixed``); ``num_speculative_tokens_per_batch_size``, where the
scheduler picks k from the requests it scheduled in a step, prefills included, for the
drafts proposed after it and verified in the next step (v1/core/sched/scheduler.py:
1709-1714, v1/core/sched/output.py:313-316; ``batch_schedule``; the rules in
``batch_schedule_knobs``); DSpark's ``enable_adaptive_verification``, where the scheduler
still charges every decode its k drafts and the worker keeps the budget best for its
warm-up cost tables over confidences one drafting round old, then admits the globally
most likely drafts (v1/worker/gpu/spec_decode/adaptive_verification.py:46-72, 305-373;
``adaptive_verify``). vLLM drops the schedule under data parallelism (config/vllm.py:
1110-1127), so a file deploying replicas refuses it. KV lookahead slots for the largest k
are not held in the simulation, only the verified drafts' slots.

Source references are to the installed vLLM 0.33.0 package (``site-packages/vllm``).
"""

from __future__ import annotations

import re
from typing import Any

from costmodels.costmodel import CostModelError
from policies.config import PolicyConfig
from policies.engines.base import Deployment, EngineContext, EngineError, Flag, Target, int_arg

VERSION = "0.33.0"

#: ``EngineArgs.get_batch_defaults`` for the OpenAI API server (vllm/engine/arg_utils.py:2973-3005):
#: (GiB at least, tokens, seqs); A100s take the last tier whatever their memory.
_BATCH_TIERS = ((160.0, 16384, 1024), (70.0, 8192, 1024), (0.0, 2048, 256))
GPU_MEMORY_UTILIZATION = 0.92  # what `vllm serve` resolves on an H100 (engine-check of 0.33.0)
BLOCK_SIZE = 16  # CUDA default block size (vllm/platforms/cuda.py check_and_update_config)
#: The MLA attention backend vLLM 0.33 takes on a GPU generation (compute capability major)
#: with or without an FP8 KV cache, and the KV block sizes it takes: the first backend of
#: platforms/cuda.py:96-155 that takes the KV dtype. Without --block-size the block is that
#: backend's preferred (v1/attention/backend.py:155-163: 16 if taken, else its smallest;
#: platforms/interface.py:771-779); a --block-size it does not take drops vLLM to a lower
#: backend (platforms/cuda.py:489-507 warns; TRITON_MLA at worst), which the MLA op tables do
#: not time. Ampere runs TRITON_MLA whatever the block, so it has no entry.
MLA_BACKENDS = {
    (9, False): ("FLASH_ATTN_MLA", (16, 32, 64, 128)),  # v1/attention/backends/mla/flashattn_mla.py:49-50
    (9, True): ("FLASHMLA", (64,)),  # flashmla.py:57-58 (FLASH_ATTN_MLA takes no FP8 KV: flashattn_mla.py:42-46)
    (10, False): ("FLASHINFER_MLA", (32, 64)),  # flashinfer_mla.py:204-205
    (10, True): ("FLASHINFER_MLA", (32, 64)),
}
#: compute capability major by GPU name prefix
_SM_MAJOR = {"a100": 8, "h100": 9, "h200": 9, "b200": 10}
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)  # vllm/config/cache.py BlockSize literal

#: Async scheduling (a ``vllm serve`` config leaving ``async-scheduling`` unset resolves it on,
#: vllm/config/vllm.py:1685-1719; ``policies.engine.pipeline``) is off with these speculative
#: methods: they run on the V1 model runner (config/vllm.py:3066-3068), which cannot overlap
#: them (vllm.py:1651-1663). Pipeline parallelism would too; servetune models none.
SYNC_ONLY_SPECULATIVE_METHODS = ("suffix", "custom_class")
#: The first release whose unset ``async-scheduling`` resolves on (v0.14.0 release notes,
#: "Async scheduling is now enabled by default", vllm#27614); servers before it ran the
#: synchronous loop unless told otherwise, as the measured runs of ``fidelity.py`` did.
ASYNC_DEFAULT_SINCE = (0, 14)


def async_by_default(version: str | None) -> bool:
    """Whether a vLLM server of ``version`` (e.g. "0.12.0"; None: the pinned one) ran the
    async loop with its defaults."""
    if version is None:
        return True
    digits = re.findall(r"\d+", version)
    if len(digits) < 2:
        raise ValueError(f"vLLM version {version!r}: expected MAJOR.MINOR[.PATCH]")
    return (int(digits[0]), int(digits[1])) >= ASYNC_DEFAULT_SINCE

SCHEDULING_POLICIES = {"fcfs": "fcfs", "priority": "priority"}  # vllm/config/scheduler.py SchedulerPolicy
#: LoRA (vllm/config/lora.py:27-45, flags vllm/engine/arg_utils.py:1609-1624): max_lora_rank's
#: choices; max_loras defaults to 1, max_cpu_loras to max_loras. One LRU policy for both caches
#: (lora/model_manager.py:1441-1457), the base model takes no slot (the scheduler counts
#: only ``lora_int_id > 0``, v1/core/sched/scheduler.py:1042-1046), and adapters load
#: from disk on their first request (lora/worker_manager.py:288-313).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VLLM(Target):
    """vLLM's V1 engine."""

    layout_keys = ("enable-expert-parallel",)

    def deployment_args(self, deployment: Deployment) -> dict[str, Any]:
        dp = deployment.attention_dp
        args: dict[str, Any] = {"model": deployment.model, "tensor-parallel-size": deployment.tp // dp}
        if dp > 1 or deployment.replicas > 1:
            args["data-parallel-size"] = dp * deployment.replicas
        if deployment.moe_ep > 1:
            args["enable-expert-parallel"] = True
        return args

    def deployment_from_args(self, args, ctx: EngineContext) -> Deployment:
        tp, dp = int_arg(args, "tensor-parallel-size"), int_arg(args, "data-parallel-size")
        expert_parallel = args.get("enable-expert-parallel", False)
        if not isinstance(expert_parallel, bool):
            raise EngineError(f"--enable-expert-parallel must be true or false, got {expert_parallel!r}")
        model = str(args.get("model", ""))
        if not ctx.moe:  # independent ranks (v1/engine/core.py:1550-1552): replicas
            return Deployment(model, tp, dp, moe_ep=tp if expert_parallel else 1)
        return Deployment(model, tp * dp, 1, moe_ep=tp * dp if expert_parallel else 1, attention_dp=dp)

    def layout_violations(self, deployment: Deployment, ctx: EngineContext) -> list[str]:
        broken = super().layout_violations(deployment, ctx)
        if ctx.moe and deployment.replicas > 1:
            broken.append(f"{deployment.replicas} replicas of a MoE model: vLLM steps a MoE model's data-parallel "
                          "ranks together as one instance [vllm/v1/engine/core.py:1546-1549, DPEngineCoreProc], so "
                          "one file deploys one instance; its ranks are attention_dp")
        if deployment.moe_ep not in (1, deployment.tp):
            broken.append(f"expert parallel {deployment.moe_ep} of {deployment.tp} GPUs: enable-expert-parallel "
                          "splits the experts over all TP x DP GPUs [vllm/model_executor/layers/fused_moe/config.py:"
                          "1228-1230]")
        return broken

    def replicas_per_file(self, ctx: EngineContext) -> int | None:
        return 1 if ctx.moe else None

    def defaults(self, ctx: EngineContext) -> PolicyConfig:
        tiers = _BATCH_TIERS[-1:] if _is_a100(ctx.gpu) else _BATCH_TIERS
        tokens, seqs = next((t, s) for gib, t, s in tiers if ctx.gpu_memory_gib >= gib)
        return PolicyConfig(
            max_num_batched_tokens=tokens, max_num_seqs=seqs, enable_chunked_prefill=True,
            long_prefill_token_threshold=0, gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
            block_size=_default_block_size(ctx),
            scheduling_policy="fcfs", schedule_mode="decode_first", async_scheduling=True, kv_headroom=0.0,
            admission_mode="none",
            preemption_mode="recompute", preemption_victim="newest", enable_prefix_caching=True,
            max_model_len=ctx.context_len, router="vllm_dp",
        )

    def implied(self, config: PolicyConfig, ctx: EngineContext) -> dict[str, Any]:
        # Scheduler._preempt_request picks max(running, key=(priority, arrival)) under
        # priority scheduling (the least urgent), the last scheduled request under FCFS.
        victim = "lowest_priority" if config.scheduling_policy == "priority" else "newest"
        # data-parallel replicas sit behind the API server's own load balancer
        # (vllm/v1/engine/core_client.py:1766-1805); nothing migrates, every replica prefills
        return {**super().implied(config, ctx), "preemption_victim": victim, "router": "vllm_dp",
                "migration": False, "prefill_replicas": 0}

    speculative_keys = ("speculative-config",)
    speculative_modes = ("fixed", "batch_schedule", "adaptive_verify")
    # fp8 weights quantized online (model_executor/model_loader/weight_utils.py:356-359: plain
    # "fp8" is deprecated for that); fp8 KV: config/cache.py CacheDType
    dtype_keys = {"dtype": ("quantization", "fp8_per_tensor"), "kv_dtype": ("kv-cache-dtype", "fp8")}

    def speculative_search_modes(self, drafter, replicas: int = 1) -> tuple[str, ...]:
        # adaptive verification reads a DSpark draft's confidence head (vllm/config/speculative.py:585-587:
        # "Currently only supported for method=dspark"); replicas drop the schedule (config_layout_violations)
        return ("fixed", *(("batch_schedule",) if replicas == 1 else ()),
                *(("adaptive_verify",) if drafter.get("method") == "dspark" else ()))

    def speculative_args(self, config: PolicyConfig, drafter) -> dict[str, Any]:
        # vllm/config/speculative.py SpeculativeConfig: method, model, num_speculative_tokens (the largest k,
        # which sizes the KV lookahead: config/vllm.py:626-652), the per-batch-size schedule (:524), adaptive
        # verification (:585-587)
        spec: dict[str, Any] = {"method": drafter["method"]}
        if drafter.get("model") is not None:
            spec["model"] = drafter["model"]
        spec["num_speculative_tokens"] = config.num_speculative_tokens
        if config.speculative_mode == "batch_schedule":
            spec["num_speculative_tokens_per_batch_size"] = batch_schedule_ranges(config)
        elif config.speculative_mode == "adaptive_verify":
            if drafter["method"] != "dspark":
                raise EngineError(f"adaptive verification is simulated for a DSpark drafter (method dspark), not "
                                  f"{drafter['method']!r} [vllm/config/speculative.py:585-587]")
            spec["enable_adaptive_verification"] = True
        return {"speculative-config": spec}

    def speculative_values(self, args) -> dict[str, Any]:
        spec = args.get("speculative-config")
        if spec is None:
            return {}
        k = spec.get("num_speculative_tokens") if isinstance(spec, dict) else None
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise EngineError(f"speculative-config must be a mapping with num_speculative_tokens > 0, got {spec!r} "
                              "[vllm/config/speculative.py:413]")
        values: dict[str, Any] = {"speculative_mode": "fixed", "num_speculative_tokens": k}
        schedule = spec.get("num_speculative_tokens_per_batch_size")
        adaptive = spec.get("enable_adaptive_verification", False)
        if not isinstance(adaptive, bool):
            raise EngineError(f"enable_adaptive_verification must be true or false, got {adaptive!r}")
        if schedule is not None and adaptive:
            raise EngineError("servetune simulates a per-batch-size schedule or adaptive verification, not both")
        if schedule:  # an empty list is static k (v1/core/sched/scheduler.py:324)
            values.update(speculative_mode="batch_schedule", **batch_schedule_knobs(schedule, k))
        if adaptive:
            if spec.get("method") != "dspark":
                raise EngineError("servetune simulates adaptive verification for method dspark only "
                                  "[vllm/config/speculative.py:585-587]")
            values["speculative_mode"] = "adaptive_verify"
        return values

    def config_layout_violations(self, config: PolicyConfig, deployment: Deployment) -> list[str]:
        if config.speculative_mode == "batch_schedule" and deployment.replicas * deployment.attention_dp > 1:
            return ["vLLM drops num_speculative_tokens_per_batch_size under data parallelism and runs the static k "
                    "[vllm/config/vllm.py:1110-1127]: run the replicas as separate `vllm serve` instances"]
        return []

    def from_args(self, args, ctx: EngineContext) -> PolicyConfig:
        config = super().from_args(args, ctx)
        spec = args.get("speculative-config")
        method = spec.get("method") if isinstance(spec, dict) else None
        if method in SYNC_ONLY_SPECULATIVE_METHODS:
            if args.get("async-scheduling") is True:
                raise EngineError(f"Async scheduling is not supported by the V1 model runner with {method}-based "
                                  "speculative decoding [vllm/config/vllm.py:1668-1678]")
            config = config.replace(async_scheduling=False)  # resolved off, with a warning (vllm.py:1711-1717)
        return config

    def violations(self, config: PolicyConfig, ctx: EngineContext) -> list[str]:
        broken = []
        tokens, seqs, max_len = config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len
        # vllm/config/scheduler.py SchedulerConfig.verify_max_model_len
        if not config.enable_chunked_prefill and max_len and tokens < max_len:
            broken.append(f"without chunked prefill max-num-batched-tokens ({tokens}) must be >= max-model-len "
                          f"({max_len}) [vllm/config/scheduler.py:318]")
        if tokens < seqs:
            broken.append(f"max-num-batched-tokens ({tokens}) must be >= max-num-seqs ({seqs}) "
                          "[vllm/config/scheduler.py:331]")
        if max_len and config.long_prefill_token_threshold > max_len:
            broken.append(f"long-prefill-token-threshold ({config.long_prefill_token_threshold}) cannot be greater "
                          f"than max-model-len ({max_len}) [vllm/config/scheduler.py:355]")
        if config.block_size not in BLOCK_SIZES:
            broken.append(f"block-size {config.block_size} is not one of {list(BLOCK_SIZES)} "
                          "[vllm/config/cache.py BlockSize]")
        mla = mla_backend(ctx)
        if mla is not None and config.block_size not in mla[1]:
            broken.append(f"block-size {config.block_size} precludes {mla[0]} for this MLA model with a {ctx.kv_dtype} "
                          f"KV cache on {ctx.gpu}: vLLM falls back to a slower attention backend the op tables do "
                          f"not time; give one of {list(mla[1])} [vllm/platforms/cuda.py:489-507]")
        if max_len and ctx.context_len and max_len > ctx.context_len:
            broken.append(f"max-model-len {max_len} exceeds the model's max_position_embeddings {ctx.context_len} "
                          "[vllm/config/model.py: User-specified max_model_len is greater than the derived]")
        if config.speculative_mode == "batch_schedule":
            broken += schedule_violations(config)
        if config.speculative_mode == "adaptive_verify" and config.enable_lora:
            broken.append("Adaptive verification is not currently compatible with LoRA [vllm/config/vllm.py:3158-3163]")
        if config.enable_lora:
            if config.max_lora_rank not in LORA_RANKS:
                broken.append(f"max-lora-rank {config.max_lora_rank} is not one of {list(LORA_RANKS)} "
                              "[vllm/config/lora.py:27 MaxLoRARanks]")
            if 0 < config.max_cpu_loras < config.max_loras:
                broken.append(f"max_cpu_loras ({config.max_cpu_loras}) must be >= max_loras ({config.max_loras}) "
                              "[vllm/config/lora.py:123-127]")
        return broken + memory_violations(config, ctx)

    def lora_search_settings(self, adapters: int) -> dict[str, dict[str, Any]]:
        # the slots bound the batch's distinct adapters and take KV memory; the host cache spares
        # disk reads (0 = as many as max_loras). The rank is the adapters', not a choice.
        top = max(2, min(adapters, 64))
        return {"max_loras": {"low": 1, "high": top, "log": True},
                "max_cpu_loras": {"low": 1, "high": max(2, adapters), "log": True, "off": True}}


def batch_schedule_ranges(config: PolicyConfig) -> list[list[int]]:
    """``num_speculative_tokens_per_batch_size`` of a ``batch_schedule`` config: inclusive
    (first, last batch size, k) ranges from 1, the last open to ``max-num-seqs``."""
    starts = [1] + [b for b in (config.speculative_batch_2, config.speculative_batch_3) if b > 0]
    ks = [config.num_speculative_tokens, config.speculative_k_2, config.speculative_k_3][:len(starts)]
    ends = [b - 1 for b in starts[1:]] + [max(config.max_num_seqs, starts[-1])]
    return [[start, end, k] for start, end, k in zip(starts, ends, ks, strict=True)]


def batch_schedule_knobs(schedule: Any, largest: int) -> dict[str, int]:
    """The ``batch_schedule`` knobs of a file's ``num_speculative_tokens_per_batch_size``, read by
    vLLM's rules (v1/spec_decode/dynamic/utils.py:7-74): 3-item (start, end, k) entries,
    positive, start <= end, k >= 0, sorted by start, not overlapping, the first from 1; a
    gap takes the range before it and k above ``largest`` is cut to it (:105-146).
    EngineError for what vLLM refuses, or for more than three runs of one k."""
    where = "[vllm/v1/spec_decode/dynamic/utils.py:7-74]"
    if not isinstance(schedule, list):
        raise EngineError(f"num_speculative_tokens_per_batch_size must be a list of [start, end, k], got "
                          f"{schedule!r} {where}")
    entries = []
    for entry in schedule:
        if not isinstance(entry, list | tuple) or len(entry) != 3 or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in entry):
            raise EngineError(f"each num_speculative_tokens_per_batch_size entry must be [start, end, k] integers, "
                              f"got {entry!r} {where}")
        start, end, k = entry
        if start <= 0 or end <= 0 or start > end or k < 0:
            raise EngineError(f"batch-size range {list(entry)} must have 0 < start <= end and k >= 0 {where}")
        entries.append((start, end, k))
    entries.sort()
    if entries[0][0] != 1:
        raise EngineError(f"the first batch-size range must start at 1, got {entries[0][0]} {where}")
    runs: list[tuple[int, int]] = []  # (first batch size, k), merging equal neighbours
    for i, (start, end, k) in enumerate(entries):
        if i and start <= entries[i - 1][1]:
            raise EngineError(f"batch-size ranges must be non-overlapping and sorted: {list(entries[i - 1])} and "
                              f"{[start, end, k]} {where}")
        if not runs or runs[-1][1] != min(k, largest):
            runs.append((start, min(k, largest)))
    if len(runs) > 3:
        raise EngineError(f"servetune simulates a schedule of at most 3 ranges of one k; this one has {len(runs)}")
    if runs[0][1] != largest:
        raise EngineError(f"servetune simulates schedules whose first range verifies num_speculative_tokens "
                          f"({largest}); this one verifies {runs[0][1]} there: lower num_speculative_tokens")
    knobs = {"speculative_batch_2": 0, "speculative_k_2": 0, "speculative_batch_3": 0, "speculative_k_3": 0}
    for n, (start, k) in enumerate(runs[1:], start=2):
        knobs[f"speculative_batch_{n}"], knobs[f"speculative_k_{n}"] = start, k
    return knobs


def schedule_violations(config: PolicyConfig) -> list[str]:
    """What vLLM refuses in a ``batch_schedule`` config's ranges (v1/spec_decode/dynamic/utils.py:43-72)."""
    b2, b3 = config.speculative_batch_2, config.speculative_batch_3
    if b2 == 1:
        return ["speculative_batch_2 1 leaves the range from batch size 1 empty: the first range must start at 1 "
                "and end at or after it [vllm/v1/spec_decode/dynamic/utils.py:47-51, 67-72]"]
    if b3 and not b2 < b3:
        return [f"speculative_batch_3 ({b3}) must follow speculative_batch_2 ({b2}): batch-size ranges must be "
                "non-overlapping and sorted [vllm/v1/spec_decode/dynamic/utils.py:61-65]"]
    return []


def memory_violations(config: PolicyConfig, ctx: EngineContext) -> list[str]:
    """vLLM's start-up memory refusals of ``config`` (none when ``ctx`` cannot size the
    pool): the KV pool left after the profiling pass at ``max-num-batched-tokens``
    (``ctx.kv_pool_tokens``) is empty, or shorter than one ``max-model-len`` request
    (vllm/v1/core/kv_cache_planning.py:50-84, ``_check_enough_kv_cache_memory``)."""
    if ctx.kv_tokens is None:
        return []
    tokens, max_len = config.max_num_batched_tokens, config.max_model_len
    try:
        pool = ctx.kv_pool_tokens(config.gpu_memory_utilization, tokens)
    except CostModelError as exc:
        pool, why = 0, str(exc)
    else:
        why = f"the pool holds {pool} tokens"
    if pool <= 0:
        return [f"No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                f"[vllm/v1/core/kv_cache_planning.py:56-64]: at gpu-memory-utilization "
                f"{config.gpu_memory_utilization} the profiling pass of max-num-batched-tokens {tokens} "
                f"[vllm/v1/worker/gpu_worker.py:700-757] leaves none ({why})"]
    if max_len and max_len > pool:
        return [f"To serve at least one request with the model's max seq len ({max_len}), its KV cache is "
                f"needed, which is larger than the available KV cache memory ({pool} tokens after the profiling "
                f"pass of max-num-batched-tokens {tokens}). Try increasing `gpu_memory_utilization` or decreasing "
                "`max_model_len` [vllm/v1/core/kv_cache_planning.py:66-84]"]
    return []


def mla_backend(ctx: EngineContext) -> tuple[str, tuple[int, ...]] | None:
    """(backend, block sizes it takes) of ``MLA_BACKENDS`` for an MLA model on ``ctx.gpu``;
    None for another attention or a GPU without an entry."""
    major = next((m for prefix, m in _SM_MAJOR.items() if ctx.gpu.lower().startswith(prefix)), None)
    return MLA_BACKENDS.get((major, ctx.kv_dtype == "fp8")) if ctx.mla else None


def _default_block_size(ctx: EngineContext) -> int:
    """vLLM's block size when the file sets none: its attention backend's preferred."""
    mla = mla_backend(ctx)
    return BLOCK_SIZE if mla is None or BLOCK_SIZE in mla[1] else min(mla[1])


def _is_a100(gpu: str) -> bool:
    return gpu.lower().startswith("a100")


ENGINE = VLLM(
    name="vllm", display="vLLM", version=VERSION,
    flags=(
        Flag("max-num-batched-tokens", "max_num_batched_tokens",
             search={"low": 256, "high": 32768, "log": True},
             help="token budget per step: prefill chunks + decode tokens"),
        Flag("max-num-seqs", "max_num_seqs", search={"low": 8, "high": 1024, "log": True},
             help="most requests running at once"),
        Flag("enable-chunked-prefill", "enable_chunked_prefill", kind="bool_optional",
             help="split prompts across steps; off needs max-num-batched-tokens >= max-model-len"),
        Flag("long-prefill-token-threshold", "long_prefill_token_threshold",
             search={"low": 64, "high": 8192, "log": True, "off": True},
             help="most prompt tokens one request computes per step (0 = off)"),
        Flag("gpu-memory-utilization", "gpu_memory_utilization", help="GPU memory share of the engine"),
        Flag("block-size", "block_size", help="tokens per KV block"),
        Flag("scheduling-policy", "scheduling_policy", values=SCHEDULING_POLICIES,
             search={"choices": ["fcfs", "priority"]},
             help="waiting order: fcfs, or priority (vLLM serves LOWER values first: clients send -priority)"),
        Flag("enable-prefix-caching", "enable_prefix_caching", kind="bool_optional", search={},
             help="reuse the KV of shared prompt prefixes"),
        # not searched: the loop it turns off hides the CPU's scheduling time between steps, which
        # the step-time model does not separate out, so "off" would look free when it is not
        Flag("async-scheduling", "async_scheduling", kind="bool_optional", unset=True,
             help="form each step while the one before runs (on unless the file says no-async-scheduling): "
                  "arrivals wait a step longer, finished requests free their seat and KV a step late"),
        Flag("max-model-len", "max_model_len", unset=0,
             help="longest prompt + output; longer prompts are refused"),
        Flag("enable-lora", "enable_lora", kind="store_true",
             help="serve LoRA adapters (name them with --lora-modules NAME=PATH beside this file)"),
        Flag("max-loras", "max_loras", help="GPU adapter slots: most distinct adapters among running requests"),
        Flag("max-lora-rank", "max_lora_rank", help="rank every slot is sized for"),
        Flag("max-cpu-loras", "max_cpu_loras", unset=0, help="adapters cached in host memory (LRU)"),
    ),
)
