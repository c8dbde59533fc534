"""CostModel: everything the engine needs to know about the hardware, in one value.

One CostModel describes one engine instance (a model on a GPU type at a TP degree): how
much KV cache fits for a memory budget, how fast KV can be swapped to host memory, and how
long a step takes (``tables``, looked up by ``costmodels.steptable.step_seconds``).
Memory figures are per GPU; KV capacity in tokens is the same on every GPU of the TP group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from costmodels.steptable import StepTables, linear_tables, validate_tables

if TYPE_CHECKING:
    from costmodels.lora import LoRACost


class CostModelError(ValueError):
    """A cost model that cannot be built: unknown model or GPU, impossible budget, bad CSV."""


def read_json_file(path: str | Path, what: str):
    """Parse a JSON file, or raise CostModelError naming ``what`` the file was meant to be."""
    path = Path(path)
    if not path.is_file():
        raise CostModelError(f"{what} {path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CostModelError(f"{what} {path}: not valid JSON ({exc})") from exc


@dataclass(frozen=True)
class CostModel:
    """Hardware truth for one engine instance; build it with ``costmodels.build``."""

    name: str
    tables: StepTables
    kv_bytes_per_token: int  # per GPU, all layers, K and V
    gpu_memory_bytes: float  # per GPU
    weight_bytes: float  # per GPU
    reserved_bytes: float  # CUDA graphs, sampler logits, CUDA context, NCCL, per GPU
    swap_bytes_per_s: float  # host <-> GPU KV copy bandwidth, per GPU
    swap_capacity_bytes: float  # host memory for swapped KV, per GPU
    tp: int = 1
    source: str = "linear"  # e.g. "profiled:aiconfigurator/vllm-0.24.0", "roofline", "measured:FILE"
    #: the calibration entry applied (``costmodels.calibration.apply_calibration``): file,
    #: match level, fitted values, stated error; None for a model no calibration touched
    calibration: dict | None = field(default=None, compare=False)
    #: peak activation bytes per token of the engine's profiling forward pass, per GPU:
    #: vLLM profiles at ``max_num_batched_tokens`` and keeps that peak out of the KV pool
    activation_bytes_per_token: float = 0.0
    #: what LoRA adapters cost on this instance (``costmodels.lora``); None where it cannot
    #: be costed (a measured step CSV, MoE or MLA layers): LoRA is then refused
    lora: LoRACost | None = field(default=None, compare=False)
    #: the fused-MoE table's routing skew the step times were read at
    #: (``costmodels.moeops.DISTRIBUTIONS``); None for a model without MoE layers
    moe_distribution: str | None = None
    #: the communication seconds inside ``tables.linear_s`` at each ``linear_tokens`` point
    #: as the op tables time it (``costmodels.compose``), which a calibration's ``comm_scale``
    #: rescales; None where the step times have no such part (a measured step CSV)
    comm_s: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        validate_tables(self.tables)
        if self.kv_bytes_per_token <= 0:
            raise CostModelError(f"kv_bytes_per_token must be positive, got {self.kv_bytes_per_token}")
        if self.swap_bytes_per_s <= 0:
            raise CostModelError(f"swap_bytes_per_s must be positive, got {self.swap_bytes_per_s}")

    def reserve_bytes(self, profile_tokens: int) -> float:
        """Memory per GPU kept out of the KV pool when the profiling pass runs ``profile_tokens``."""
        return self.reserved_bytes + self.activation_bytes_per_token * max(0, profile_tokens)

    def kv_budget_bytes(self, gpu_memory_utilization: float, profile_tokens: int = 0) -> float:
        """KV bytes per GPU left after weights and reserves, as vLLM sizes its pool
        (vllm/v1/worker/gpu_worker.py determine_available_memory: ``requested_memory`` less
        weights, the profiled activation peak at ``profile_tokens`` and CUDA-graph memory)."""
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise CostModelError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        reserve = self.reserve_bytes(profile_tokens)
        budget = gpu_memory_utilization * self.gpu_memory_bytes - self.weight_bytes - reserve
        if budget <= 0:
            raise CostModelError(
                f"{self.name}: gpu_memory_utilization={gpu_memory_utilization} leaves no KV memory "
                f"({gpu_memory_utilization * self.gpu_memory_bytes / 2**30:.1f} GiB < weights "
                f"{self.weight_bytes / 2**30:.1f} GiB + reserve {reserve / 2**30:.1f} GiB at a "
                f"{profile_tokens}-token profiling pass)"
            )
        return budget

    def kv_capacity_tokens(self, gpu_memory_utilization: float, profile_tokens: int = 0) -> int:
        return int(self.kv_budget_bytes(gpu_memory_utilization, profile_tokens) // self.kv_bytes_per_token)

    def kv_capacity_blocks(self, gpu_memory_utilization: float, block_size: int, profile_tokens: int = 0) -> int:
        if block_size <= 0:
            raise CostModelError(f"block_size must be positive, got {block_size}")
        return self.kv_capacity_tokens(gpu_memory_utilization, profile_tokens) // block_size

    def kv_blocks_for_bytes(self, kv_bytes: float, block_size: int) -> int:
        """KV blocks that fit an explicit per-GPU KV byte budget."""
        if not kv_bytes > 0 or block_size <= 0:
            raise CostModelError(f"need kv_bytes > 0 and block_size > 0, got {kv_bytes}, {block_size}")
        return int(kv_bytes // (self.kv_bytes_per_token * block_size))

    def swap_capacity_blocks(self, block_size: int) -> int:
        return int(self.swap_capacity_bytes // (self.kv_bytes_per_token * block_size))

    @classmethod
    def synthetic(
        cls,
        kv_capacity_tokens: int,
        tables: StepTables | None = None,
        kv_bytes_per_token: int = 131_072,
        swap_bytes_per_s: float = 25e9,
        swap_capacity_tokens: int = 0,
        lora: LoRACost | None = None,
    ) -> CostModel:
        """A cost model with an exact KV capacity at gpu_memory_utilization=1.0: for tests."""
        return cls(
            name=f"synthetic-{kv_capacity_tokens}tok",
            tables=tables if tables is not None else linear_tables(),
            kv_bytes_per_token=kv_bytes_per_token,
            gpu_memory_bytes=float(kv_capacity_tokens * kv_bytes_per_token),
            weight_bytes=0.0,
            reserved_bytes=0.0,
            swap_bytes_per_s=swap_bytes_per_s,
            swap_capacity_bytes=float(swap_capacity_tokens * kv_bytes_per_token),
            source="linear",
            lora=lora,
        )
