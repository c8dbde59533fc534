"""How one engine instance spreads a model over its GPUs: tensor, expert and attention data
parallelism.

``tp`` GPUs serve one instance. Attention runs as ``attention_dp_size`` data-parallel
groups of ``tp / attention_dp_size`` tensor-parallel GPUs, each group with its own batch
and KV cache (SGLang ``--enable-dp-attention``, vLLM ``--data-parallel-size`` with
``--enable-expert-parallel``, TRT-LLM ``enable_attention_dp``); the MoE layers run over all
``tp`` GPUs, experts split ``moe_ep_size`` ways and each expert's width ``tp / moe_ep_size``
ways. The defaults (1, 1) are plain tensor parallelism, what every engine does unless told.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodels.costmodel import CostModelError


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    moe_ep_size: int = 1
    attention_dp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "moe_ep_size", "attention_dp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CostModelError(f"{name} must be a positive integer, got {value!r}")
        for name in ("moe_ep_size", "attention_dp_size"):
            if self.tp % getattr(self, name):
                raise CostModelError(f"{name}={getattr(self, name)} must divide tp={self.tp}")

    @property
    def attention_tp(self) -> int:
        """GPUs that split one attention group's heads."""
        return self.tp // self.attention_dp_size

    @property
    def moe_tp(self) -> int:
        """GPUs that split each expert's width."""
        return self.tp // self.moe_ep_size

    @property
    def label(self) -> str:
        parts = [f"x{self.tp}"]
        if self.moe_ep_size > 1:
            parts.append(f"ep{self.moe_ep_size}")
        if self.attention_dp_size > 1:
            parts.append(f"dp{self.attention_dp_size}")
        return "".join(parts)
