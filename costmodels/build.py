"""``build``: a CostModel for a model on a GPU at a TP degree, from tables, roofline or a CSV.

Memory follows vLLM's sizing: the KV pool is ``gpu_memory_utilization x total`` minus the
weights, the activation peak of a profiling forward pass, CUDA-graph memory and
NCCL/runtime buffers. The reserves used here (documented on each constant) match what
vLLM logs for dense models at its default 8192-token profiling batch.
"""

from __future__ import annotations

from pathlib import Path

from costmodels.architecture import ModelArch, load_model, normalize_dtype
from costmodels.compose import ACT_BYTES, compose
from costmodels.costmodel import CostModel, CostModelError
from costmodels.gpus import GPUSpec, load_gpu
from costmodels.optables import FRAMEWORKS, ProfiledOps, RooflineOps

PROFILE_TOKENS = 8192  # vLLM's profiling forward pass runs at max_num_batched_tokens
PROFILE_LOGIT_SEQS = 256  # ... and samples for max_num_seqs sequences (fp32 logits)
CUDA_GRAPH_BYTES = 0.5 * 2**30  # captured decode graphs, as vLLM reports for dense models
RUNTIME_BYTES = 0.5 * 2**30  # CUDA context and allocator slack outside PyTorch
SWAP_BYTES = 4 * 2**30  # vLLM's default swap_space per GPU
PCIE_EFFICIENCY = 0.8  # achievable share of PCIe bandwidth for pinned host copies
# Per-step time the op tables do not cover (scheduler, sampling, input prep, launch gaps),
# used when no calibration matches; calibrated values replace it (see calibration.py).
DEFAULT_OVERHEAD_S = {"vllm": 2.0e-3, "sglang": 1.5e-3, "trtllm": 1.0e-3}


def activation_peak_bytes(arch: ModelArch, tp: int, tokens: int = PROFILE_TOKENS) -> float:
    """Peak activation bytes of one forward pass at ``tokens`` tokens, per GPU.

    The largest live set is the MLP: hidden in/out, the gate+up output and the activated
    half, plus QKV; then fp32 logits for the sampled sequences.
    """
    inter, qkv = arch.intermediate_size // tp, (arch.q_size + 2 * arch.kv_size) // tp
    mlp_live = tokens * (2 * arch.hidden_size + 3 * inter + qkv) * ACT_BYTES
    logits = PROFILE_LOGIT_SEQS * arch.vocab_size / tp * 4
    return float(mlp_live + logits)


def memory_reserve_bytes(arch: ModelArch, gpu: GPUSpec, tp: int) -> float:
    return activation_peak_bytes(arch, tp) + CUDA_GRAPH_BYTES + RUNTIME_BYTES + gpu.nccl_reserve(tp)


def build(
    model: str,
    gpu: str,
    tp: int = 1,
    framework: str = "vllm",
    gemm_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    model_config: str | Path | None = None,
    calibration: str | Path | bool | None = None,
    sps_csv: str | Path | None = None,
) -> CostModel:
    """The cost model of ``model`` on ``gpu`` x ``tp`` served by ``framework``.

    Step time comes from, in order of precedence: a user-measured step-time CSV
    (``sps_csv``), the profiled op tables for the GPU and framework, or the roofline
    model when the GPU or dtype has no tables (``source`` says which). ``calibration``
    (a file from ``servetune cost calibrate``) replaces overhead and scale; without it
    the bundled calibration for the combination is used when one exists; ``False``
    keeps the uncalibrated tables.
    """
    if framework not in FRAMEWORKS:
        raise CostModelError(f"unknown framework {framework!r}; valid: {', '.join(FRAMEWORKS)}")
    arch = load_model(model, model_config)
    arch.check_tp(tp)
    spec = load_gpu(gpu)
    gemm_dtype, kv_dtype = normalize_dtype(gemm_dtype), normalize_dtype(kv_dtype)
    if gemm_dtype not in ("bf16", "fp8") or kv_dtype not in ("bf16", "fp8"):
        raise CostModelError(f"gemm_dtype and kv_dtype must be bf16 or fp8, got {gemm_dtype}/{kv_dtype}")
    weight_dtype = "fp8" if gemm_dtype == "fp8" else arch.dtype
    weights = arch.weight_bytes(tp, weight_dtype)
    reserve = memory_reserve_bytes(arch, spec, tp)
    if weights + reserve >= spec.memory_bytes:
        raise CostModelError(
            f"{arch.name} needs {weights / 2**30:.1f} GiB of weights + {reserve / 2**30:.1f} GiB reserve per GPU at "
            f"tp={tp}, more than {spec.name}'s {spec.memory_bytes / 2**30:.0f} GiB; use a larger tp")

    if sps_csv is not None:
        from costmodels.sps import read_step_csv

        tables, source = read_step_csv(sps_csv), f"measured:{Path(sps_csv).name}"
    else:
        ops, fallback = _op_source(spec, framework, gemm_dtype)
        bandwidth, overhead = spec.hbm_bytes_per_s * spec.hbm_efficiency, DEFAULT_OVERHEAD_S[framework]
        try:
            tables = compose(arch, ops, tp, kv_dtype, bandwidth, overhead_s=overhead)
        except CostModelError as exc:  # e.g. a head_dim or KV dtype the tables lack
            if ops.kind != "profiled":
                raise
            ops, fallback = RooflineOps(spec, gemm_dtype), str(exc)
            tables = compose(arch, ops, tp, kv_dtype, bandwidth, overhead_s=overhead)
        source = ops.label + (f" ({fallback})" if fallback else "")
        if ops.notes:
            source += "; " + "; ".join(ops.notes)
    name = f"{arch.name}@{spec.name.removesuffix('_sxm')}x{tp}/{framework}/{gemm_dtype}"
    cost = CostModel(
        name=name, tables=tables,
        kv_bytes_per_token=arch.kv_bytes_per_token(tp, kv_dtype),
        gpu_memory_bytes=float(spec.memory_bytes), weight_bytes=weights, reserved_bytes=reserve,
        swap_bytes_per_s=spec.pcie_bytes_per_s * PCIE_EFFICIENCY, swap_capacity_bytes=float(SWAP_BYTES),
        tp=tp, source=source,
    )
    if sps_csv is None:
        from costmodels.calibration import apply_calibration

        cost = apply_calibration(cost, arch.name, spec.name, framework, gemm_dtype, calibration, kv_dtype)
    elif calibration not in (None, False):
        raise CostModelError("calibration applies to table-based models; a measured sps_csv is used as is")
    return cost


def _op_source(spec: GPUSpec, framework: str, gemm_dtype: str) -> tuple[ProfiledOps | RooflineOps, str]:
    """Profiled tables when the GPU has them at this dtype, else the labelled roofline."""
    if spec.tables is None:
        return RooflineOps(spec, gemm_dtype), f"no op tables for {spec.name}"
    try:
        return ProfiledOps(spec.tables, framework, gemm_dtype), ""
    except CostModelError as exc:
        return RooflineOps(spec, gemm_dtype), str(exc)
