"""``build``: a CostModel for a model on a GPU at a TP degree, from tables, roofline or a CSV.

Memory follows vLLM's sizing: the KV pool is ``gpu_memory_utilization x total`` minus the
weights, the activation peak of a profiling forward pass at ``max_num_batched_tokens``
(vllm/v1/worker/gpu_model_runner.py:524 and :6132), CUDA-graph memory (estimated and
subtracted by default since vLLM 0.21: gpu_worker.py:707-756) and NCCL/runtime buffers.
The CostModel keeps the activation peak per token, so the pool follows the budget a
config sets; with the constants below it reproduces the pools vLLM logged for
CodeLlama-34B on one 80 GB GPU at budgets 64 and 4096 within 2%
(tests/costmodels/test_memory.py).
"""

from __future__ import annotations

from pathlib import Path

from costmodels.architecture import ModelArch, load_model, normalize_dtype
from costmodels.compose import compose
from costmodels.costmodel import CostModel, CostModelError
from costmodels.gpus import GPUSpec, load_gpu
from costmodels.layout import ParallelLayout
from costmodels.linear import ACT_BYTES
from costmodels.lora import lora_cost
from costmodels.moeops import DEFAULT_DISTRIBUTION
from costmodels.optables import FRAMEWORKS, ProfiledOps, RooflineOps

PROFILE_LOGIT_SEQS = 256  # the profiling pass samples for max_num_seqs sequences (fp32 logits)
CUDA_GRAPH_BYTES = 0.5 * 2**30  # captured decode graphs, as vLLM reports for dense models
RUNTIME_BYTES = 0.5 * 2**30  # CUDA context and allocator slack outside PyTorch
SWAP_BYTES = 4 * 2**30  # vLLM's default swap_space per GPU
PCIE_EFFICIENCY = 0.8  # achievable share of PCIe bandwidth for pinned host copies
# Per-step time the op tables do not cover (scheduler, sampling, input prep, launch gaps),
# used when no calibration matches; calibrated values replace it (see calibration.py).
#: The GEMM (weight) dtypes with profiled tables (NVFP4 on B200 only) and the KV-cache dtypes.
GEMM_DTYPES = ("bf16", "fp8", "nvfp4")
KV_DTYPES = ("bf16", "fp8")
DEFAULT_OVERHEAD_S = {"vllm": 2.0e-3, "sglang": 1.5e-3, "trtllm": 1.0e-3}


def activation_bytes_per_token(arch: ModelArch, tp: int, moe_ep_size: int = 1) -> float:
    """Peak activation bytes per token of a forward pass, per GPU.

    The largest live set is in the MLP: the gate+up output and its activated half (split
    by TP) beside four hidden-sized tensors (residual, input, norm output, down output).
    vLLM's logged pools for CodeLlama-34B fall by 197 KB per extra profiled token; this
    gives 197.6 KB. In an MoE layer each token holds that for its top-k experts, each
    split ``tp / moe_ep_size`` ways; the larger of the dense and MoE layers sets the peak.
    """
    widths = [arch.intermediate_size // tp] if arch.moe is None or arch.moe.dense_layers else []
    if arch.moe is not None:
        widths.append(arch.moe.top_k * arch.moe.expert_intermediate_size // (tp // moe_ep_size))
    return float((4 * arch.hidden_size + 3 * max(widths)) * ACT_BYTES)


def fixed_reserve_bytes(arch: ModelArch, gpu: GPUSpec, tp: int) -> float:
    """Memory per GPU kept out of the KV pool whatever the token budget: sampler logits,
    CUDA graphs, CUDA context and NCCL buffers."""
    logits = PROFILE_LOGIT_SEQS * arch.vocab_size / tp * 4
    return logits + CUDA_GRAPH_BYTES + RUNTIME_BYTES + gpu.nccl_reserve(tp)


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
    moe_ep_size: int = 1,
    attention_dp_size: int = 1,
    moe_distribution: str = DEFAULT_DISTRIBUTION,
) -> CostModel:
    """The cost model of ``model`` on ``gpu`` x ``tp`` served by ``framework``.

    ``moe_ep_size`` and ``attention_dp_size`` lay the ``tp`` GPUs out for expert and
    attention data parallelism (``costmodels.layout``; 1 and 1 = plain TP); with attention
    DP the model describes one DP group. ``moe_distribution`` picks the fused-MoE table's
    routing skew ("balanced", "power_law_1.01", "power_law_1.2"; default
    ``moeops.DEFAULT_DISTRIBUTION``). MoE and MLA models need
    the profiled tables: there is no roofline of them, so a missing point is an error.

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
    layout = ParallelLayout(tp, moe_ep_size, attention_dp_size)
    if arch.moe is None and (moe_ep_size > 1 or attention_dp_size > 1):
        raise CostModelError(f"{arch.name} has no experts: moe_ep_size and attention_dp_size must be 1 (data "
                             f"parallelism of a dense model is replicas), got {moe_ep_size}, {attention_dp_size}")
    spec = load_gpu(gpu)
    gemm_dtype, kv_dtype = normalize_dtype(gemm_dtype), normalize_dtype(kv_dtype)
    if gemm_dtype not in GEMM_DTYPES or kv_dtype not in KV_DTYPES:
        raise CostModelError(f"gemm_dtype must be one of {', '.join(GEMM_DTYPES)} and kv_dtype one of "
                             f"{', '.join(KV_DTYPES)}, got {gemm_dtype}/{kv_dtype}")
    if gemm_dtype == "nvfp4" and arch.mla is not None:
        raise CostModelError(f"{arch.name}: NVFP4 latent-attention projections are not in the MLA tables "
                             "(they time bf16 and fp8_block only)")
    weight_dtype = gemm_dtype if gemm_dtype != "bf16" else arch.dtype
    weights = arch.weight_bytes(tp, weight_dtype, attention_dp_size)
    reserve = fixed_reserve_bytes(arch, spec, tp)
    if weights + reserve >= spec.memory_bytes:
        raise CostModelError(
            f"{arch.name} needs {weights / 2**30:.1f} GiB of weights + {reserve / 2**30:.1f} GiB reserve per GPU at "
            f"tp={tp}, more than {spec.name}'s {spec.memory_bytes / 2**30:.0f} GiB; use a larger tp")

    if sps_csv is not None:
        from costmodels.sps import read_step_csv

        tables, source, comm = read_step_csv(sps_csv), f"measured:{Path(sps_csv).name}", None
        lora = None  # a measured curve has no GEMMs to time the adapters' with
    else:
        ops, fallback = _op_source(spec, framework, gemm_dtype)
        tables_only = arch.moe is not None or arch.mla is not None
        if tables_only and ops.kind != "profiled":
            raise CostModelError(f"{arch.name} needs profiled MoE/MLA tables, which {spec.name}/{framework}/"
                                 f"{gemm_dtype} lacks: {fallback}")
        bandwidth, overhead = spec.hbm_bytes_per_s * spec.hbm_efficiency, DEFAULT_OVERHEAD_S[framework]
        options = dict(overhead_s=overhead, gemm_dtype=gemm_dtype, moe_distribution=moe_distribution)
        try:
            tables, comm = compose(arch, ops, layout, kv_dtype, bandwidth, **options)
        except CostModelError as exc:  # e.g. a head_dim or KV dtype the tables lack
            if ops.kind != "profiled" or tables_only:
                raise
            ops, fallback = RooflineOps(spec, gemm_dtype), str(exc)
            tables, comm = compose(arch, ops, layout, kv_dtype, bandwidth, **options)
        lora = lora_cost(arch, ops, layout, ops.token_axis()) if arch.moe is None and arch.mla is None else None
        source = ops.label + (f" ({fallback})" if fallback else "")
        if ops.notes:
            source += "; " + "; ".join(ops.notes)
    name = f"{arch.name}@{spec.name.removesuffix('_sxm')}{layout.label}/{framework}/{gemm_dtype}"
    cost = CostModel(
        name=name, tables=tables,
        kv_bytes_per_token=arch.kv_bytes_per_token(tp, kv_dtype, attention_dp_size),
        gpu_memory_bytes=float(spec.memory_bytes), weight_bytes=weights, reserved_bytes=reserve,
        activation_bytes_per_token=activation_bytes_per_token(arch, tp, moe_ep_size),
        swap_bytes_per_s=spec.pcie_bytes_per_s * PCIE_EFFICIENCY, swap_capacity_bytes=float(SWAP_BYTES),
        tp=tp, source=source, lora=lora, comm_s=comm,
        moe_distribution=moe_distribution if arch.moe is not None and sps_csv is None else None,
    )
    if sps_csv is None:
        from costmodels.calibration import apply_calibration

        cost = apply_calibration(cost, arch.name, spec.name, framework, gemm_dtype, calibration, kv_dtype,
                                 family=arch.family, layout=(moe_ep_size, attention_dp_size), kind=arch.kind)
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
