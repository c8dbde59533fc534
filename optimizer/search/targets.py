"""The engine context a study's targets resolve their defaults for, built from its model and GPU.

``engine_context`` reads the model's context length and the GPU's memory, and sizes the
KV pool with the study's cost model on first use (only SGLang's defaults need it).
"""

from __future__ import annotations

from functools import lru_cache

from costmodels.costmodel import CostModelError
from policies.engines import EngineContext


@lru_cache(maxsize=64)
def engine_context(model: str, gpu: str, tp: int = 1, framework: str = "vllm", replicas: int = 1,
                   model_config: str | None = None, dtype: str = "bf16", kv_dtype: str = "bf16") -> EngineContext:
    """The context of ``model`` on ``gpu`` at TP ``tp``.

    A model servetune cannot load has context length 0 here; its cost model fails to
    build later with the reason, so no study runs on it.
    """
    from costmodels.architecture import load_model
    from costmodels.gpus import load_gpu

    gpu_spec = load_gpu(gpu)
    try:
        arch = load_model(model, model_config)
        context_len, moe, mla, quant = arch.context_len, arch.moe is not None, arch.mla is not None, arch.quant
    except CostModelError:
        context_len, moe, mla, quant = 0, False, False, ""
    cost_model = _lazy_cost_model(model, gpu, tp, framework, model_config, dtype, kv_dtype)
    shares = _reserve_shares(cost_model()) if context_len else {}
    return EngineContext(gpu=gpu, gpu_memory_gib=gpu_spec.memory_bytes / 2**30, context_len=context_len,
                         kv_tokens=lambda utilization, tokens: cost_model().kv_capacity_tokens(utilization, tokens),
                         tp=tp, replicas=replicas, dtype=dtype, kv_dtype=kv_dtype, moe=moe, mla=mla,
                         weight_quant=quant, **shares)


def context_of(cost_model, gpu: str, context_len: int, tp: int = 1, replicas: int = 1) -> EngineContext:
    """The context of an explicit cost model (tests, or a model given by its config file)."""
    from costmodels.gpus import load_gpu

    return EngineContext(gpu=gpu, gpu_memory_gib=load_gpu(gpu).memory_bytes / 2**30, context_len=context_len,
                         kv_tokens=cost_model.kv_capacity_tokens, tp=tp, replicas=replicas,
                         **_reserve_shares(cost_model))


def _reserve_shares(cost_model) -> dict[str, float]:
    """The cost model's reserves as shares of GPU memory (EngineContext's fields)."""
    total = cost_model.gpu_memory_bytes
    if not total:
        return {}
    return {"reserved_fraction": cost_model.reserved_bytes / total,
            "activation_fraction_per_token": cost_model.activation_bytes_per_token / total}


def _lazy_cost_model(model: str, gpu: str, tp: int, framework: str, model_config: str | None, dtype: str,
                     kv_dtype: str):
    @lru_cache(maxsize=1)
    def build():
        from costmodels import build as build_cost_model

        return build_cost_model(model, gpu, tp=tp, framework=framework, model_config=model_config,
                                gemm_dtype=dtype, kv_dtype=kv_dtype)

    return build
