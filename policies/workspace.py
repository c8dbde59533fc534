"""Activation workspace: whether the steps a run formed fit the GPU memory left for them.

A step computing T tokens holds T x the model's peak activation bytes per token
(``CostModel.activation_bytes_per_token``) beside the weights, the KV pool and the fixed
reserves (CUDA graphs, sampler logits, runtime: ``CostModel.reserved_bytes``). The
simulator sizes the pool after a profiling pass at ``max_num_batched_tokens`` (vLLM's
rule; SGLang's static fraction is mapped onto it by ``policies.engines.sglang``), so the
memory a step's activations may use is that pass's plus the share of the GPU that
``gpu_memory_utilization`` leaves to nobody: ``room = max_num_batched_tokens + (1 -
utilization) x GPU memory / activation bytes per token`` tokens. For an SGLang file this
is exactly ``1 - mem-fraction-static`` less the fixed reserves.

A step within the token budget always fits. Only a step that computes more runs out:
under ``prefill_first`` (SGLang) every running request decodes together, up to
``max_num_seqs`` of them, whatever the chunk size. The kernel keeps the largest step a
run formed and when it first formed one that large (``SimResult.peak_step_tokens`` /
``peak_step_s``); a run whose largest step exceeds the room ran out of memory by then at
the latest. What the engine then does is its module's to say (``Target.out_of_memory``).
"""

from __future__ import annotations

import math

from costmodels.costmodel import CostModel
from policies.config import PolicyConfig


def room_tokens(cost_model: CostModel, config: PolicyConfig) -> float:
    """The most tokens one step may compute before its activations exceed the memory left
    beside weights, KV pool and fixed reserves (inf for a cost model without activations)."""
    per_token = cost_model.activation_bytes_per_token
    if per_token <= 0:
        return math.inf
    spare = (1.0 - config.gpu_memory_utilization) * cost_model.gpu_memory_bytes
    return float(config.max_num_batched_tokens + math.floor(spare / per_token))


def out_of_memory(peak_tokens: int, peak_s: float, cost_model: CostModel, config: PolicyConfig,
                  consequence: str) -> str | None:
    """Why a run whose largest step computed ``peak_tokens`` (first at ``peak_s``) ran out of
    activation memory, ending with the engine's ``consequence``; None when every step fit."""
    room = room_tokens(cost_model, config)
    if peak_tokens <= room:
        return None
    per_token = cost_model.activation_bytes_per_token
    return (f"runs out of GPU memory by t={peak_s:.6g} s: a {peak_tokens}-token step needs "
            f"{peak_tokens * per_token / 2**30:.2f} GiB of activations, but {room * per_token / 2**30:.2f} GiB "
            f"({int(room)} tokens) is left beside the weights, the KV pool and the fixed reserves at "
            f"gpu_memory_utilization={config.gpu_memory_utilization:g} and max_num_batched_tokens="
            f"{config.max_num_batched_tokens}; {consequence}")
