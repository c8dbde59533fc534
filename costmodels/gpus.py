"""GPU specs: memory, HBM bandwidth, tensor-core FLOPs, NVLink and PCIe bandwidth.

Built-in specs come from aiconfigurator's system YAMLs (``data/gpus.json``). A user adds a
GPU with ``register_gpu`` or by passing the path of a YAML/JSON file in that same layout
(or aiconfigurator's own system YAML); such a GPU has no op tables, so its step time
comes from the roofline model.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from costmodels.costmodel import CostModelError

SPECS_FILE = Path(__file__).resolve().parent / "data" / "gpus.json"


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model; bandwidths in bytes/s per GPU, one direction."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float
    nvlink_bytes_per_s: float
    pcie_bytes_per_s: float
    fp8_flops: float = 0.0
    fp4_flops: float = 0.0  # NVFP4 tensor cores (Blackwell)
    hbm_efficiency: float = 0.8  # achievable fraction of peak HBM bandwidth
    gpus_per_node: int = 8
    nccl_bytes: dict[str, float] = field(default_factory=dict)  # NCCL buffers by TP degree
    tables: str | None = None  # op-table prefix in data/, None = roofline only

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "hbm_bytes_per_s", "bf16_flops", "nvlink_bytes_per_s", "pcie_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise CostModelError(f"GPU {self.name}: {name} must be positive, got {getattr(self, name)!r}")

    def flops(self, gemm_dtype: str) -> float:
        """Peak dense tensor FLOP/s at a GEMM dtype; CostModelError if the GPU lacks it."""
        value = {"fp8": self.fp8_flops, "nvfp4": self.fp4_flops}.get(gemm_dtype, self.bf16_flops)
        if not value > 0:
            raise CostModelError(f"GPU {self.name} has no {gemm_dtype} tensor cores")
        return value

    def nccl_reserve(self, tp: int) -> float:
        return float(self.nccl_bytes.get(str(tp), 0.0) if tp > 1 else 0.0)


def _builtin() -> dict[str, GPUSpec]:
    raw = json.loads(SPECS_FILE.read_text())
    return {key: GPUSpec(name=key, tables=key, **spec) for key, spec in raw.items()}


_REGISTRY: dict[str, GPUSpec] = _builtin()
_BUILTIN = tuple(_REGISTRY.values())


def builtin_gpus() -> tuple[GPUSpec, ...]:
    """The GPUs servetune ships op tables for."""
    return _BUILTIN


def register_gpu(spec: GPUSpec) -> None:
    """Make ``spec`` resolvable by name (lower case, ``-sxm``/``_sxm`` optional)."""
    _REGISTRY[_key(spec.name)] = spec


def _key(name: str) -> str:
    key = name.lower().replace("-", "_").replace(" ", "_")
    return key if key.endswith("_sxm") or key.endswith("_pcie") else key + "_sxm"


def _from_file(path: Path) -> GPUSpec:
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise CostModelError(f"GPU spec {path}: not valid YAML/JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CostModelError(f"GPU spec {path}: expected a mapping")
    if "gpu" in raw:  # aiconfigurator system YAML layout
        g, node = raw["gpu"], raw.get("node", {})
        raw = {"memory_bytes": g.get("mem_capacity"), "hbm_bytes_per_s": g.get("mem_bw"),
               "bf16_flops": g.get("bfloat16_tc_flops"), "fp8_flops": g.get("fp8_tc_flops", 0.0),
               "fp4_flops": g.get("fp4_tc_flops", 0.0),
               "hbm_efficiency": g.get("mem_bw_empirical_scaling_factor", 0.8),
               "nvlink_bytes_per_s": node.get("intra_node_bw"), "pcie_bytes_per_s": node.get("pcie_bw")}
    raw.setdefault("name", path.stem)
    try:
        return GPUSpec(**raw)
    except TypeError as exc:
        raise CostModelError(f"GPU spec {path}: {exc}") from exc


def load_gpu(gpu: str | Path) -> GPUSpec:
    """A registered GPU by name ("h100", "H100-SXM", ...) or a spec file path."""
    path = Path(gpu)
    if path.suffix in (".yaml", ".yml", ".json"):
        if not path.is_file():
            raise CostModelError(f"GPU spec file {path} does not exist")
        return _from_file(path)
    spec = _REGISTRY.get(_key(str(gpu)))
    if spec is None:
        names = [k.removesuffix("_sxm") for k in _REGISTRY]
        near = difflib.get_close_matches(str(gpu).lower().removesuffix("_sxm").removesuffix("-sxm"), names, n=1,
                                         cutoff=0.5)
        hint = f"did you mean {near[0]}? " if near else ""
        raise CostModelError(f"unknown GPU {gpu!r}; {hint}valid: {', '.join(names)} (or a GPU spec YAML/JSON path)")
    return spec
