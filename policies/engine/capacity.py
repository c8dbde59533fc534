"""The KV a config gets (``validate``): GPU and host blocks on a cost model, with every limit
the config must respect checked.
"""

from __future__ import annotations

from costmodels.costmodel import CostModel, CostModelError
from policies.config import ConfigError, PolicyConfig


def validate(trace, cost_model: CostModel, config: PolicyConfig) -> tuple[int, int]:
    """Check that ``config`` can run on ``cost_model``; return (GPU, host) KV blocks.

    Raises ConfigError naming the knob and the limit; requests that could never fit are
    not an error here but are rejected one by one as EXCEEDS_CAPACITY.
    """
    if trace.n == 0:
        raise ValueError("the trace has no requests; nothing to simulate")
    bs = config.block_size
    lora_bytes = _lora_gpu_bytes(trace, cost_model, config)
    try:
        # the pool is sized after a profiling pass at the step budget (vLLM's rule), and after
        # the adapter slots took their memory
        budget = cost_model.kv_budget_bytes(config.gpu_memory_utilization, config.max_num_batched_tokens)
        cap = int((budget - lora_bytes) // (cost_model.kv_bytes_per_token * bs))
    except CostModelError as exc:
        raise ConfigError(f"gpu_memory_utilization={config.gpu_memory_utilization}: {exc}") from None
    if cap < 1:
        tokens = max(0, int((budget - lora_bytes) // cost_model.kv_bytes_per_token))
        raise ConfigError(
            f"KV capacity of {cost_model.name} at gpu_memory_utilization={config.gpu_memory_utilization} "
            f"is {tokens} tokens{f' after {lora_bytes / 2**30:.2f} GiB of adapter slots' if lora_bytes else ''}, "
            f"less than one block of block_size={bs}"
        )
    if config.max_num_batched_tokens < bs:
        raise ConfigError(
            f"max_num_batched_tokens={config.max_num_batched_tokens} is smaller than one KV block "
            f"(block_size={bs})"
        )
    headroom = int(config.kv_headroom * cap)
    if headroom >= cap:
        raise ConfigError(f"kv_headroom={config.kv_headroom} keeps {headroom} of {cap} KV blocks free: nothing admits")
    if config.max_model_len > cap * bs:
        raise ConfigError(
            f"max_model_len={config.max_model_len} needs more KV than the {cap * bs} tokens "
            f"({cap} blocks) available at gpu_memory_utilization={config.gpu_memory_utilization}"
        )
    if not config.enable_chunked_prefill and config.max_model_len > config.max_num_batched_tokens:
        raise ConfigError(
            f"without chunked prefill max_num_batched_tokens={config.max_num_batched_tokens} must be "
            f">= max_model_len={config.max_model_len} (as vLLM requires)"
        )
    return cap, cost_model.swap_capacity_blocks(bs)


def _lora_gpu_bytes(trace, cost_model: CostModel, config: PolicyConfig) -> float:
    """GPU bytes the adapter slots take before the KV pool is sized (0 without LoRA): both
    engines allocate ``max_loras`` slots at ``max_lora_rank`` when the model loads
    (vllm/v1/worker/gpu_model_runner.py:5006 ``load_lora_model``, before the profiling pass
    sizes the KV cache; srt/model_executor/model_runner.py:733, "before the KV cache is
    sized"). Refuses a trace that asks for adapters with LoRA off, LoRA on a cost model
    that cannot cost it, and a host cache smaller than the GPU pool."""
    if not config.enable_lora:
        if trace.has_adapters:
            names = [name for name in trace.adapter_names if name][:3]
            raise ConfigError(f"the trace asks for LoRA adapters ({', '.join(names)}, ...) but enable_lora is off "
                              "(an engine without LoRA refuses those requests): set enable_lora = true "
                              "(--set enable_lora=true, or enable-lora in the engine file)")
        return 0.0
    if cost_model.lora is None:
        raise ConfigError(f"enable_lora: the cost model {cost_model.name} has no LoRA cost (a measured step CSV, "
                          "or an MoE/MLA model); build it from op tables of a dense model")
    if 0 < config.max_cpu_loras < config.max_loras:
        raise ConfigError(f"max_cpu_loras={config.max_cpu_loras} must be >= max_loras={config.max_loras} "
                          "(every adapter on the GPU is also in the host cache)")
    return config.max_loras * cost_model.lora.adapter_bytes(config.max_lora_rank)
