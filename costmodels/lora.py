"""LoRA adapters on the hardware: their GPU bytes, how fast they load, and the extra GEMMs
they add to a step.

An adapter of rank r puts, on every layer and every target module (in -> out), a shrink
``x @ A`` (tokens x in x r) and an expand ``(x A) @ B`` (tokens x r x out) beside the base
GEMM. The target modules are the dense projections q/k/v, o, gate/up and down: what vLLM
wraps when the adapter names no subset (vllm/config/lora.py ``target_modules``: "If None,
all supported LoRA modules are used"). Sharding follows vLLM's default (not fully
sharded) layers: a column-parallel module (qkv, gate/up) keeps A whole and splits B's
output by TP, a row-parallel one (o, down) splits A's input and keeps B whole.

The GEMMs are timed from the op source's GEMM tables (``ops.gemm(m, n, k)``, profiled or
roofline) at each rank of ``RANKS``; the punica / SGMV kernels the engines run are not
cuBLAS GEMMs, so this is the cost of the same shapes, not of those kernels (at small
rank a GEMM below the profiled n or k reads the smallest measured shape: a launch-bound
over-estimate rather than an extrapolation). Engines pad every GPU slot to
``max_lora_rank`` (vLLM's stacked buffers, lora/model_manager.py; SGLang's memory pool,
lora/mem_pool.py:139-158), so both the slot bytes and the GEMMs are at that rank.

Loading: host -> GPU at the cost model's host-link bandwidth (``swap_bytes_per_s``: PCIe
at its efficiency), and from disk first when the host cache lacks it, at
``DISK_BYTES_PER_S``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from costmodels.costmodel import CostModelError

#: Disk -> host read of adapter weights (safetensors): 2 GB/s, a single datacenter NVMe
#: SSD's sustained sequential read with a cold page cache (PCIe 4 drives read 3-7 GB/s,
#: network volumes less); the one constant of adapter loading the GPU yaml does not give.
DISK_BYTES_PER_S = 2e9
#: Ranks the GEMM grid is timed at: vLLM's ``max_lora_rank`` choices (vllm/config/lora.py:27).
RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_BYTES = 2  # adapters run in the base model's bf16 (lora_dtype "auto")


@dataclass(frozen=True)
class LoRACost:
    """What adapters cost on one GPU of an engine instance.

    ``bytes_per_rank``: GPU bytes of one adapter per unit of rank (every layer and target
    module, A and B, as sharded on one GPU). ``tokens`` x ``ranks`` -> ``seconds``: the
    shrink and expand GEMMs of every layer for a step of that many adapter tokens.
    """

    bytes_per_rank: float
    tokens: np.ndarray
    ranks: np.ndarray
    seconds: np.ndarray  # f8[len(ranks), len(tokens)]
    disk_bytes_per_s: float = DISK_BYTES_PER_S
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.bytes_per_rank > 0 or not self.disk_bytes_per_s > 0:
            raise CostModelError(f"LoRA cost needs bytes_per_rank > 0 and disk_bytes_per_s > 0, got "
                                 f"{self.bytes_per_rank}, {self.disk_bytes_per_s}")
        seconds = np.asarray(self.seconds, dtype=np.float64)
        if seconds.shape != (len(self.ranks), len(self.tokens)) or not np.all(np.isfinite(seconds) & (seconds >= 0)):
            raise CostModelError(f"LoRA seconds must be a finite, non-negative {len(self.ranks)} x "
                                 f"{len(self.tokens)} grid, got shape {seconds.shape}")
        for name in ("tokens", "ranks"):
            axis = np.asarray(getattr(self, name), dtype=np.float64)
            if len(axis) < 2 or np.any(np.diff(axis) <= 0):
                raise CostModelError(f"LoRA {name} axis must have >= 2 ascending points, got {axis}")

    def adapter_bytes(self, rank: int) -> float:
        """GPU bytes of one adapter slot at ``rank``."""
        return self.bytes_per_rank * rank

    def grid(self) -> np.ndarray:
        """f8[len(ranks) + 1, len(tokens) + 1] for the kernel (``policies.adapters.step_seconds``):
        row 0 the token axis, column 0 the rank axis, the seconds inside."""
        out = np.zeros((len(self.ranks) + 1, len(self.tokens) + 1))
        out[0, 1:] = self.tokens
        out[1:, 0] = self.ranks
        out[1:, 1:] = self.seconds
        return out

    @classmethod
    def linear(cls, bytes_per_rank: float, seconds_per_token_rank: float,
               disk_bytes_per_s: float = DISK_BYTES_PER_S) -> LoRACost:
        """A cost exactly linear in tokens x rank: for tests and what-ifs."""
        tokens = np.array([0.0, 1.0, float(1 << 20)])
        ranks = np.array(RANKS, dtype=np.float64)
        return cls(bytes_per_rank, tokens, ranks, seconds_per_token_rank * np.outer(ranks, tokens),
                   disk_bytes_per_s, source="linear")


def lora_cost(arch, ops, layout, tokens: np.ndarray) -> LoRACost:
    """The LoRA cost of ``arch`` at ``layout`` from an op source's GEMMs, over ``tokens``."""
    if arch.mla is not None or arch.moe is not None:
        raise CostModelError(f"{arch.name}: LoRA is costed for dense attention and MLP layers only")
    h, tp = arch.hidden_size, layout.tp
    q, kv, width = arch.q_size, arch.kv_size, arch.intermediate_size
    # (input, output) as each GPU holds them: column-parallel splits the output, row-parallel the input
    modules = ((h, (q + 2 * kv) // tp), (q // tp, h), (h, (2 if arch.gated_mlp else 1) * width // tp),
               (width // tp, h))
    bytes_per_rank = arch.num_layers * LORA_BYTES * sum(i + o for i, o in modules)
    tokens = np.asarray(tokens, dtype=np.float64)
    seconds = np.array([arch.num_layers * sum(ops.gemm(tokens, r, i) + ops.gemm(tokens, o, r) for i, o in modules)
                        for r in RANKS])
    return LoRACost(float(bytes_per_rank), tokens, np.array(RANKS, dtype=np.float64), seconds,
                    source=getattr(ops, "label", ""))
