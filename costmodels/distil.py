"""Regenerate the bundled op tables in ``costmodels/data/`` from ``../shared/profiles``.

The raw aiconfigurator tables (24 MB of parquet) hold every dtype, head shape and kernel
variant NVIDIA measured; servetune needs only what its built-in models use, at the
table version ``systems/query_versions.yaml`` marks current. This keeps, per (GPU,
framework): the GEMM grid for bf16 and fp8 (dense [m, n, k] array, the few unmeasured
cells filled by interpolation in log m), decode and context attention for head dims 64,
128 and 256 without sliding window, the framework's all-reduce, NCCL all-gather /
reduce-scatter / all-to-all (expert and attention data parallelism), the fused-MoE rows
of the built-in MoE models' expert shapes, and the MLA attention-module rows (DeepSeek), or
where a framework measured only the module's parts (SGLang) the parts (``mla_part_rows``).
Latencies are stored as float16 milliseconds (0.05 % rounding, far below run-to-run noise). It also writes the
GPU specs, the model configs, and ``calibration.json`` fitted to the measured H100 runs.
Run:

    python -m costmodels.distil [--shared PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import yaml

from costmodels.architecture import ModelArch
from costmodels.mlaops import BMM_OPS
from costmodels.moeops import DISTRIBUTIONS as MOE_DISTRIBUTIONS

DATA_DIR = Path(__file__).resolve().parent / "data"
GPUS = ("a100_sxm", "h100_sxm", "h200_sxm", "b200_sxm")
FRAMEWORKS = ("vllm", "sglang", "trtllm")
GEMM_DTYPES = {"bf16": "bfloat16", "fp8": "fp8", "nvfp4": "nvfp4"}
#: GEMM tables measured on other axes than bf16's keep their own (``gemm_<dtype>_{m,n,k}``).
OWN_AXES = ("nvfp4",)
KV_DTYPES = {"bfloat16": 0, "fp8": 1}
HEAD_DIMS = (64, 128, 256)
# One kernel per (GPU, framework): what the framework runs by default on that GPU.
# Blackwell has no FlashAttention-3: vLLM runs FlashInfer's TRT-LLM kernels, SGLang trtllm_mha.
ATTENTION_KERNELS = {"vllm": ("vllm_flash_attn_fa3", "vllm_flash_attn", "vllm_flashinfer_trtllmprefill",
                              "vllm_flashinfer_trtllmdecode"),
                     "sglang": ("fa3", "flash_attention", "trtllm_mha"), "trtllm": ("torch_flow",)}
ALLREDUCE_KERNELS = {"vllm": "vLLM_custom_graph", "sglang": "SGLang_CustomAllReduce_graph", "trtllm": "TRTLLM"}
NCCL_OPS = ("all_gather", "reduce_scatter", "alltoall")
MAX_GPUS = 16
MOE_DTYPES = {"bfloat16": 0, "fp8": 1, "fp8_block": 2, "nvfp4": 3}
MLA_GEMM_DTYPES = {"bfloat16": 0, "fp8_block": 2}
# Preference between MLA kernels measured equally often. vLLM on Hopper: FlashAttention-MLA
# for a bf16 KV cache, FlashMLA for fp8 (FA-MLA has none); Blackwell FlashInfer-MLA; TRT-LLM one.
MLA_KERNELS = ("FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "default")
GEMM_KERNELS = {("vllm", "fp8"): "CutlassFP8ScaledMMLinearKernel", ("sglang", "fp8"): "sglang_sgl_kernel_fp8_scaled_mm"}


def shared_dir() -> Path:
    """``$SERVETUNE_SHARED`` or the repository's sibling ``shared/``."""
    env = os.environ.get("SERVETUNE_SHARED")
    return Path(env) if env else Path(__file__).resolve().parents[1] / ".." / "shared"


def aic_root(shared: Path) -> Path:
    return shared / "profiles" / "aiconfigurator" / "aiconfigurator_core"


def current_versions(root: Path) -> dict[tuple[str, str], str]:
    """(gpu, framework) -> table version marked "current" in query_versions.yaml."""
    spec = yaml.safe_load((root / "systems" / "query_versions.yaml").read_text())
    out = {}
    for gpu in GPUS:
        for fw in FRAMEWORKS:
            slot = spec.get("overrides", {}).get(gpu, {}).get(fw) or spec["defaults"][fw]
            out[gpu, fw] = slot["current"]
    return out


def _pick_kernel(df: pl.DataFrame, preferred: tuple[str, ...], what: str) -> pl.DataFrame:
    present = set(df["kernel_source"].unique().to_list())
    for kernel in preferred:
        if kernel in present:
            return df.filter(pl.col("kernel_source") == kernel)
    raise ValueError(f"{what}: none of the kernels {preferred} in {sorted(present)}")


def gemm_grid(df: pl.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Dense latency[m, n, k] in ms, unmeasured cells filled.

    A cell missing at some m is interpolated along log m; a (n, k) pair never measured
    (A100 lacks 65536 x 65536) is scaled from the next smaller k, as a GEMM that large is
    linear in k.
    """
    m = np.sort(df["m"].unique().to_numpy())
    n = np.sort(df["n"].unique().to_numpy())
    k = np.sort(df["k"].unique().to_numpy())
    grid = np.full((len(m), len(n), len(k)), np.nan)
    grid[np.searchsorted(m, df["m"].to_numpy()), np.searchsorted(n, df["n"].to_numpy()),
         np.searchsorted(k, df["k"].to_numpy())] = df["latency"].to_numpy()
    logm = np.log(m)
    for j in range(len(n)):
        for i in range(len(k)):
            col = grid[:, j, i]
            ok = np.isfinite(col)
            if ok.any() and not ok.all():
                col[~ok] = np.interp(logm[~ok], logm[ok], col[ok])
    for j, i in zip(*np.nonzero(np.isnan(grid).all(axis=0)), strict=True):
        grid[:, j, i] = grid[:, j, i - 1] * k[i] / k[i - 1]
    return m, n, k, grid.astype(np.float16)


def attention_rows(df: pl.DataFrame, length_col: str) -> dict[str, np.ndarray]:
    """Flat rows (heads, kv_heads, head_dim, kv dtype code, batch, length, latency ms)."""
    df = df.filter(pl.col("head_dim").is_in(HEAD_DIMS) & (pl.col("attn_dtype") == "bfloat16")
                   & pl.col("kv_cache_dtype").is_in(list(KV_DTYPES)))
    if "window_size" in df.columns:
        df = df.filter(pl.col("window_size") == 0)
    df = df.group_by(["num_heads", "num_key_value_heads", "head_dim", "kv_cache_dtype", "batch_size", length_col]
                     ).agg(pl.col("latency").median())
    df = df.sort(["head_dim", "kv_cache_dtype", "num_heads", "num_key_value_heads", "batch_size", length_col])
    return {
        "heads": df["num_heads"].to_numpy().astype(np.int16),
        "kv_heads": df["num_key_value_heads"].to_numpy().astype(np.int16),
        "head_dim": df["head_dim"].to_numpy().astype(np.int16),
        "kv_dtype": df["kv_cache_dtype"].replace_strict(KV_DTYPES).to_numpy().astype(np.int8),
        "batch": df["batch_size"].to_numpy().astype(np.int32),
        "length": df[length_col].to_numpy().astype(np.int32),
        "latency": df["latency"].to_numpy().astype(np.float16),
    }


def nccl_rows(path: Path) -> dict[str, np.ndarray]:
    """NCCL collectives on half-precision buffers: ``nccl_<op>_{gpus,elements,latency}``."""
    df = pl.read_parquet(path).filter(pl.col("nccl_dtype") == "half")
    out = {}
    for op in NCCL_OPS:
        rows = df.filter(pl.col("op_name") == op).sort(["num_gpus", "message_size"])
        out[f"nccl_{op}_gpus"] = rows["num_gpus"].to_numpy().astype(np.int16)
        out[f"nccl_{op}_elements"] = rows["message_size"].to_numpy().astype(np.int64)
        out[f"nccl_{op}_latency"] = rows["latency"].to_numpy().astype(np.float32)
    return out


def model_configs(root: Path) -> list[Path]:
    """The HF config.json copies in the profiles (not the separate quantization configs)."""
    return sorted(p for p in (root / "model_configs").glob("*_config.json") if not p.name.endswith("_quant_config.json"))


def moe_shapes(root: Path) -> set[tuple[int, int, int, int]]:
    """(hidden, expert intermediate, top-k, experts) of every MoE model config in the profiles."""
    shapes = set()
    for cfg in model_configs(root):
        arch = ModelArch.from_hf_config(cfg)
        if arch.moe is not None:
            moe = arch.moe
            shapes.add((arch.hidden_size, moe.expert_intermediate_size, moe.top_k, moe.num_experts))
    return shapes


def moe_rows(path: Path, shapes: set[tuple[int, int, int, int]]) -> dict[str, np.ndarray]:
    """Fused-MoE rows (``moe_*``) of the given expert shapes at the dtypes servetune times, on
    at most ``MAX_GPUS`` GPUs (the largest TP servetune builds).

    Where a framework measured two kernels at one point (vLLM's Triton and FlashInfer fp8
    paths split the TP/EP layouts between them), the median is kept, as for attention.
    """
    keys = ["hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size", "moe_ep_size", "moe_dtype",
            "distribution", "num_tokens"]
    df = pl.read_parquet(path).filter(pl.col("moe_dtype").is_in(list(MOE_DTYPES))
                                      & pl.col("distribution").is_in(list(MOE_DISTRIBUTIONS))
                                      & (pl.col("moe_tp_size") * pl.col("moe_ep_size") <= MAX_GPUS))
    df = df.filter(pl.struct(["hidden_size", "inter_size", "topk", "num_experts"]).map_elements(
        lambda r: (r["hidden_size"], r["inter_size"], r["topk"], r["num_experts"]) in shapes, return_dtype=pl.Boolean))
    df = df.group_by(keys).agg(pl.col("latency").median()).sort(keys)
    return {
        "moe_hidden": df["hidden_size"].to_numpy().astype(np.int32),
        "moe_inter": df["inter_size"].to_numpy().astype(np.int32),
        "moe_topk": df["topk"].to_numpy().astype(np.int16),
        "moe_experts": df["num_experts"].to_numpy().astype(np.int16),
        "moe_tp": df["moe_tp_size"].to_numpy().astype(np.int16),
        "moe_ep": df["moe_ep_size"].to_numpy().astype(np.int16),
        "moe_dtype": df["moe_dtype"].replace_strict(MOE_DTYPES).to_numpy().astype(np.int8),
        "moe_dist": df["distribution"].replace_strict(MOE_DISTRIBUTIONS).to_numpy().astype(np.int8),
        "moe_tokens": df["num_tokens"].to_numpy().astype(np.int32),
        "moe_latency": df["latency"].to_numpy().astype(np.float16),
    }


def mla_rows(df: pl.DataFrame, length_col: str) -> dict[str, np.ndarray]:
    """MLA attention-module rows: (heads per GPU, KV dtype code, GEMM dtype code, batch, length,
    latency ms), one kernel per (KV dtype, GEMM dtype): the one measured to the longest
    length, then at the most points (vLLM's FlashMLA context rows stop at 128 tokens, its
    FlashAttention prefill rows at 32768), ties broken by ``MLA_KERNELS``."""
    df = df.filter((pl.col("mla_dtype") == "bfloat16") & pl.col("gemm_type").is_in(list(MLA_GEMM_DTYPES))
                   & pl.col("kv_cache_dtype").is_in(list(KV_DTYPES)))
    parts = []
    for _, group in df.group_by(["kv_cache_dtype", "gemm_type"]):
        reach = {k: (g[length_col].max(), g.height) for (k,), g in group.group_by(["kernel_source"])}
        kernel = max(reach, key=lambda k: (reach[k], -MLA_KERNELS.index(k) if k in MLA_KERNELS else -len(MLA_KERNELS)))
        parts.append(group.filter(pl.col("kernel_source") == kernel))
    df = pl.concat(parts).group_by(["num_heads", "kv_cache_dtype", "gemm_type", "batch_size", length_col]).agg(
        pl.col("latency").median()).sort(["kv_cache_dtype", "gemm_type", "num_heads", "batch_size", length_col])
    return {
        "heads": df["num_heads"].to_numpy().astype(np.int16),
        "kv_dtype": df["kv_cache_dtype"].replace_strict(KV_DTYPES).to_numpy().astype(np.int8),
        "gemm_dtype": df["gemm_type"].replace_strict(MLA_GEMM_DTYPES).to_numpy().astype(np.int8),
        "batch": df["batch_size"].to_numpy().astype(np.int32),
        "length": df[length_col].to_numpy().astype(np.int32),
        "latency": df["latency"].to_numpy().astype(np.float16),
    }


def _one_kernel(df: pl.DataFrame, what: str) -> pl.DataFrame:
    kernels = df["kernel_source"].unique().to_list()
    if len(kernels) != 1:
        raise ValueError(f"{what}: expected one kernel, measured {sorted(kernels)}")
    return df


def mla_part_rows(base: Path, fw: str, version: str) -> dict[str, np.ndarray]:
    """What ``costmodels.mlaops`` composes an MLA attention module from, where the framework
    measured the parts but not the module (SGLang): the latent-attention kernel alone
    (``mla_kernel_{gen,ctx}_*``: heads per GPU, KV dtype code, batch, step / isl as measured,
    latency ms), the absorbed-weight batched matmuls of decode (``mla_bmm_*``: op 0 = pre,
    1 = post, heads, tokens; bf16, what both engines run, see mlaops) and the block-scaled
    fp8 GEMM grid (``gemm_fp8_block`` on its own ``gemm_fp8_block_{m,n,k}`` axes) the
    projections of an fp8 checkpoint run. {} if any part is missing."""
    mla, bmm = base / "mla" / fw / version, base / "mla_bmm" / fw / version / "mla_bmm_perf.parquet"
    kernels = {"gen": (mla / "generation_mla_perf.parquet", "step"), "ctx": (mla / "context_mla_perf.parquet", "isl")}
    gemm = base / "gemm" / fw / version / "gemm_perf.parquet"
    if not (bmm.is_file() and all(path.is_file() for path, _ in kernels.values())):
        return {}
    out: dict[str, np.ndarray] = {}
    for name, (path, length_col) in kernels.items():
        df = _one_kernel(pl.read_parquet(path), f"{path}").filter(
            (pl.col("mla_dtype") == "bfloat16") & pl.col("kv_cache_dtype").is_in(list(KV_DTYPES)))
        keys = ["kv_cache_dtype", "num_heads", "batch_size", length_col]
        df = df.group_by(keys).agg(pl.col("latency").median()).sort(keys)
        out |= {f"mla_kernel_{name}_heads": df["num_heads"].to_numpy().astype(np.int16),
                f"mla_kernel_{name}_kv_dtype": df["kv_cache_dtype"].replace_strict(KV_DTYPES).to_numpy().astype(np.int8),
                f"mla_kernel_{name}_batch": df["batch_size"].to_numpy().astype(np.int32),
                f"mla_kernel_{name}_length": df[length_col].to_numpy().astype(np.int32),
                f"mla_kernel_{name}_latency": df["latency"].to_numpy().astype(np.float16)}
    df = pl.read_parquet(bmm).filter(pl.col("bmm_dtype") == "bfloat16")
    df = _one_kernel(df, f"{bmm}").group_by(["op_name", "num_heads", "num_tokens"]).agg(
        pl.col("latency").median()).sort(["op_name", "num_heads", "num_tokens"])
    codes = {f"mla_gen_{op}": code for op, code in BMM_OPS.items()}
    out |= {"mla_bmm_op": df["op_name"].replace_strict(codes).to_numpy().astype(np.int8),
            "mla_bmm_heads": df["num_heads"].to_numpy().astype(np.int16),
            "mla_bmm_tokens": df["num_tokens"].to_numpy().astype(np.int32),
            "mla_bmm_latency": df["latency"].to_numpy().astype(np.float16)}
    rows = pl.read_parquet(gemm).filter(pl.col("gemm_dtype") == "fp8_block")
    m, n, k, grid = gemm_grid(_one_kernel(rows, f"{gemm} fp8_block"))
    out |= {"gemm_fp8_block_m": m, "gemm_fp8_block_n": n, "gemm_fp8_block_k": k, "gemm_fp8_block": grid}
    return out


def distil_one(root: Path, gpu: str, fw: str, version: str) -> dict[str, np.ndarray]:
    base = root / "systems" / "data" / gpu
    out: dict[str, np.ndarray] = {}
    gemm = pl.read_parquet(base / "gemm" / fw / version / "gemm_perf.parquet")
    for short, raw in GEMM_DTYPES.items():
        rows = gemm.filter(pl.col("gemm_dtype") == raw)
        if rows.is_empty():
            continue
        if (fw, short) in GEMM_KERNELS:
            rows = _pick_kernel(rows, (GEMM_KERNELS[fw, short],), f"{gpu}/{fw} gemm {short}")
        m, n, k, grid = gemm_grid(rows)
        axes = f"gemm_{short}_" if short in OWN_AXES else "gemm_"
        out[axes + "m"], out[axes + "n"], out[axes + "k"] = m, n, k
        out[f"gemm_{short}"] = grid
    attn = base / "attention" / fw / version
    for name, fname, length_col in (("gen", "generation_attention_perf", "step"),
                                    ("ctx", "context_attention_perf", "isl")):
        df = _pick_kernel(pl.read_parquet(attn / f"{fname}.parquet"), ATTENTION_KERNELS[fw], f"{gpu}/{fw} {name}")
        for key, arr in attention_rows(df, length_col).items():
            out[f"{name}_{key}"] = arr
    ar = pl.read_parquet(base / "comm" / fw / version / "custom_allreduce_perf.parquet")
    ar = ar.filter(pl.col("kernel_source") == ALLREDUCE_KERNELS[fw]).sort(["num_gpus", "message_size"])
    out["ar_gpus"] = ar["num_gpus"].to_numpy().astype(np.int16)
    out["ar_elements"] = ar["message_size"].to_numpy().astype(np.int64)
    out["ar_latency"] = ar["latency"].to_numpy().astype(np.float32)
    nccl = sorted((base / "comm" / "nccl").glob("*/nccl_perf.parquet"))
    out.update(nccl_rows(nccl[-1]))
    moe = base / "moe" / fw / version / "moe_perf.parquet"
    if moe.is_file():
        out.update(moe_rows(moe, moe_shapes(root)))
    mla = base / "mla" / fw / version
    for name, length_col in (("gen", "step"), ("ctx", "isl")):
        module = mla / f"mla_{'generation' if name == 'gen' else 'context'}_module_perf.parquet"
        if module.is_file():
            for key, arr in mla_rows(pl.read_parquet(module), length_col).items():
                out[f"mla_{name}_{key}"] = arr
    if "mla_gen_heads" not in out:  # the module tables are preferred where measured
        out.update(mla_part_rows(base, fw, version))
    meta = {"gpu": gpu, "framework": fw, "version": version, "device": gemm["device"][0],
            "source": "aiconfigurator-core 0.12.0 (Apache-2.0, NVIDIA)"}
    out["meta"] = np.array(json.dumps(meta))
    return out


def gpu_specs(root: Path) -> dict[str, dict]:
    """GPU specs from the system YAMLs, in SI units."""
    specs = {}
    for gpu in GPUS:
        y = yaml.safe_load((root / "systems" / f"{gpu}.yaml").read_text())
        g, node = y["gpu"], y["node"]
        specs[gpu] = {
            "memory_bytes": g["mem_capacity"],
            "hbm_bytes_per_s": g["mem_bw"],
            "hbm_efficiency": g["mem_bw_empirical_scaling_factor"],
            "bf16_flops": g["bfloat16_tc_flops"],
            "fp8_flops": g.get("fp8_tc_flops", 0),
            "fp4_flops": g.get("fp4_tc_flops", 0),
            "nvlink_bytes_per_s": node["intra_node_bw"],
            "pcie_bytes_per_s": node["pcie_bw"],
            "gpus_per_node": node["num_gpus_per_node"],
            "nccl_bytes": {str(k): v for k, v in y["misc"]["nccl_mem"].items()},
        }
    return specs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=Path, default=shared_dir())
    parser.add_argument("--out", type=Path, default=DATA_DIR)
    args = parser.parse_args(argv)
    root = aic_root(args.shared)
    if not root.is_dir():
        raise SystemExit(f"profiles not found at {root}; pass --shared or set SERVETUNE_SHARED")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "models").mkdir(exist_ok=True)
    for (gpu, fw), version in current_versions(root).items():
        np.savez_compressed(args.out / f"{gpu}_{fw}.npz", **distil_one(root, gpu, fw, version))
    (args.out / "gpus.json").write_text(json.dumps(gpu_specs(root), indent=1) + "\n")
    for cfg in model_configs(root):
        shutil.copyfile(cfg, args.out / "models" / cfg.name)
    shutil.copyfile(args.shared / "profiles" / "aiconfigurator" / "LICENSE", args.out / "LICENSE-aiconfigurator")
    if args.out == DATA_DIR:  # calibrate against the bundled tables just written
        from costmodels.calibration import BUNDLED, calibrate, save_calibration
        from costmodels.runs import load_runs

        save_calibration(calibrate(load_runs(root / "systems" / "silicon_dense_h100.csv")), BUNDLED)
    for f in sorted(args.out.rglob("*")):
        if f.is_file():
            print(f"{f.relative_to(args.out)}: {f.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
