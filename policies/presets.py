"""Engine defaults as PolicyConfigs: the baselines every recommendation is measured against.

vLLM 0.33 `vllm serve` resolves its batch defaults by GPU (``EngineArgs.get_batch_defaults``):
8192 tokens / 1024 sequences on >= 70 GiB GPUs other than A100, else 2048 / 256; chunked
prefill and prefix caching on, FCFS, recompute preemption of the newest request, no
watermark.
SGLang 0.5.23 runs prefill first, admits by ``new_token_ratio`` (conservativeness 1.0),
caps a prefill batch at 16384 tokens and chunks at 8192 on 60-160 GiB GPUs (4096 below,
16384 above), pages of 1 token, keeps its radix (prefix) cache on, and retracts the request
with the fewest outputs.
"""

from __future__ import annotations

from policies.config import ConfigError, PolicyConfig

# GPU memory in GiB and whether vLLM treats it as an A100 (its defaults exclude A100).
GPU_MEMORY_GIB = {"a100": (80.0, True), "h100": (80.0, False), "h200": (141.0, False)}

PRESETS = ("vllm-default", "sglang-default")


def vllm_default(gpu: str = "h100") -> PolicyConfig:
    mem_gib, is_a100 = _gpu(gpu)
    if mem_gib >= 160:
        tokens, seqs = 16384, 1024
    elif mem_gib >= 70 and not is_a100:
        tokens, seqs = 8192, 1024
    else:
        tokens, seqs = 2048, 256
    return PolicyConfig(max_num_batched_tokens=tokens, max_num_seqs=seqs)


def sglang_default(gpu: str = "h100") -> PolicyConfig:
    mem_gib, _ = _gpu(gpu)
    if mem_gib < 60:
        chunk = 4096
    elif mem_gib < 160:
        chunk = 8192
    else:
        chunk = 16384
    return PolicyConfig(
        max_num_batched_tokens=chunk,
        max_num_seqs=1024,
        gpu_memory_utilization=0.85,
        block_size=1,
        schedule_mode="prefill_first",
        max_prefill_tokens=16384,
        admission_mode="new_token_ratio",
        schedule_conservativeness=1.0,
        preemption_victim="fewest_output",
    )


def preset(name: str, gpu: str = "h100") -> PolicyConfig:
    """The named preset for a GPU; raises ConfigError naming the valid presets."""
    if name == "vllm-default":
        return vllm_default(gpu)
    if name == "sglang-default":
        return sglang_default(gpu)
    raise ConfigError(f"unknown preset {name!r}; valid: {list(PRESETS)}")


def _gpu(gpu: str) -> tuple[float, bool]:
    key = gpu.lower().replace("-sxm", "").replace("_sxm", "")
    if key not in GPU_MEMORY_GIB:
        raise ConfigError(f"unknown GPU {gpu!r} for presets; valid: {sorted(GPU_MEMORY_GIB)}")
    return GPU_MEMORY_GIB[key]
