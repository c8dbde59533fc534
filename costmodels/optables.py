"""Per-op latency on one GPU: measured tables (aiconfigurator) or a roofline estimate.

Both sources answer the same four questions, per layer and in seconds: a GEMM of shape
(m, n, k), decode attention for a batch at a context length, prefill (context) attention
for a batch of fresh prompts, and an all-reduce of a number of bf16 elements. The step-time
composer (``costmodels.compose``) does not care which source it talks to. The profiled
tables also answer NCCL collectives and hand their fused-MoE and MLA rows to
``costmodels.moeops`` and ``costmodels.mlaops``; the roofline has no model of those.

A head layout the attention tables lack is read from the nearest measured one at the
batch with as many (sequence, head) units (``borrow_layout``), else its launch floor is
kept and the work above it scaled by the KV-head (decode) or query-head (prefill) ratio
(``scale_work``). An attention kernel the framework never measured on this GPU at all (SGLang
has no FP8-KV context attention on any GPU; A100 has head_dim 128 only) is read from its
nearest measured substitute (``ProfiledOps.kernel``), never from the roofline unsaid; the
cost model's source names the substitution.

TensorRT-LLM's per-tensor FP8 GEMM table is read with its activation quantization as the
engine serves it (``one_pass_quantization``), not as the collector timed it.

Profiled GEMMs are interpolated log-linearly in m (latency is flat at small m, then
linear) and linearly in n and k, which the grid lacks for e.g. Llama's 14336/28672; a GEMM
wider than the grid is costed as side-by-side GEMMs of the widest measured n.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from costmodels.costmodel import CostModelError
from costmodels.gpus import GPUSpec, builtin_gpus, load_gpu

DATA_DIR = Path(__file__).resolve().parent / "data"
FRAMEWORKS = ("vllm", "sglang", "trtllm")
KV_DTYPE_CODE = {"bf16": 0, "fp8": 1}
MS = 1e-3
#: Frameworks whose per-tensor FP8 GEMM table times more activation quantization than the
#: engine serves with: aiconfigurator's TensorRT-LLM collector (collector/trtllm/
#: collect_gemm.py) loads each Linear without an input scale, and the table's FP8-over-bf16
#: excess at the narrowest GEMMs (6-13 us at decode sizes, about two passes over the
#: activations at large m x k) is that per-call quantization. A served FP8 checkpoint
#: carries static input scales (a block-scaled one finds each group's scale inside its
#: cast): one pass. The vLLM and SGLang collectors time one fused per-token quantization
#: kernel, as both engines serve FP8 (no more than their static pass costs): read as timed
#: (``benchmarks/fp8_quantization.py`` has the sources and the tables' excess per framework).
DYNAMIC_QUANT_TABLES = frozenset({"trtllm"})
#: (framework, dtype) GEMM tables timed with an untuned fallback kernel, read as the fastest
#: kernel for that dtype measured on the same GPU (the cell-wise min with the other
#: frameworks' tables). aiconfigurator's TensorRT-LLM collector times the NVFP4 Linear
#: outside TRT-LLM's autotuner, so ``nvfp4_gemm`` runs its fallback tactic; the served engine
#: autotunes at start-up. The table shows it: flat in m and n and linear in k at decode sizes,
#: slower than TRT-LLM's own bf16 GEMM below n ~ 6k, and 1.47x / 1.71x vLLM's and SGLang's
#: FlashInfer NVFP4 tables on the same B200 (``benchmarks/nvfp4_tables.py``).
UNTUNED_TABLES = frozenset({("trtllm", "nvfp4")})
#: Bytes one quantization pass moves per activation element: read bf16, write fp8.
QUANT_PASS_BYTES = 3.0
#: The GEMM grid's narrowest n columns (32, 64, 128): little GEMM work at any m.
NARROW = 3

# Default axes where no table dictates one (roofline): dense at small sizes, then x1.5 steps.
TOKEN_AXIS = np.unique(np.concatenate([np.arange(1, 17), np.round(2 ** np.arange(4, 15.01, 0.5))])).astype(np.float64)
BATCH_AXIS = 2.0 ** np.arange(0, 12)
CTX_AXIS = 2.0 ** np.arange(0, 18)
ISL_AXIS = np.unique(np.round(2 ** np.arange(0, 14.01, 0.5)))


@dataclass(frozen=True)
class AttentionShape:
    """Attention heads on one GPU (after TP) and the KV-cache dtype."""

    heads: int
    kv_heads: int
    head_dim: int
    kv_dtype: str = "bf16"


class ProfiledOps:
    """Latencies interpolated from the distilled aiconfigurator tables for one GPU and framework."""

    kind = "profiled"

    def __init__(self, tables: str, framework: str, gemm_dtype: str, data_dir: Path = DATA_DIR):
        if framework not in FRAMEWORKS:
            raise CostModelError(f"unknown framework {framework!r}; valid: {', '.join(FRAMEWORKS)}")
        path = data_dir / f"{tables}_{framework}.npz"
        if not path.is_file():
            raise CostModelError(f"no op tables for {tables}/{framework} ({path} missing)")
        with np.load(path) as z:
            self._z = {key: z[key] for key in z.files}
        self.meta = json.loads(str(self._z["meta"]))
        self._dir = data_dir
        self._tables = tables
        self._grids: dict[str, tuple[np.ndarray, ...]] = {}
        self.gemm_dtype = gemm_dtype
        self.notes: list[str] = []
        self._m = self._grid(gemm_dtype)[0]
        if gemm_dtype == "fp8" and framework in DYNAMIC_QUANT_TABLES:
            self.notes.append("fp8 GEMMs with one activation-quantization pass (the table's dynamic one taken out)")

    @property
    def label(self) -> str:
        return f"profiled:aiconfigurator/{self.meta['gpu']}/{self.meta['framework']}-{self.meta['version']}"

    def token_axis(self) -> np.ndarray:
        return self._m.copy()

    def _grid(self, dtype: str) -> tuple[np.ndarray, ...]:
        """(m, n, k axes, seconds[m, n, k]) of the ``dtype`` GEMM table. bf16 and fp8 share the
        ``gemm_{m,n,k}`` axes; a table measured on other axes (fp8_block starts at 128) has its own."""
        if dtype not in self._grids:
            z = self._z
            if f"gemm_{dtype}" not in z:
                have = [k.removeprefix("gemm_") for k in z if k.startswith("gemm_") and z[k].ndim == 3]
                raise CostModelError(f"{self.meta['gpu']}/{self.meta['framework']}: no {dtype} GEMM table; "
                                     f"measured: {', '.join(have)}")
            axes = [z.get(f"gemm_{dtype}_{a}", z[f"gemm_{a}"]).astype(np.float64) for a in "mnk"]
            grid = z[f"gemm_{dtype}"].astype(np.float64) * MS
            if dtype == "fp8" and self.meta["framework"] in DYNAMIC_QUANT_TABLES:
                gpu = load_gpu(self.meta["gpu"])
                grid = one_pass_quantization(grid, z["gemm_bf16"].astype(np.float64) * MS, axes[0], axes[2],
                                             gpu.hbm_bytes_per_s * gpu.hbm_efficiency)
            if (self.meta["framework"], dtype) in UNTUNED_TABLES:
                grid = self._fastest_measured(dtype, *axes, grid)
            self._grids[dtype] = (*axes, grid)
        return self._grids[dtype]

    def _fastest_measured(self, dtype: str, ms: np.ndarray, ns: np.ndarray, ks: np.ndarray,
                          grid: np.ndarray) -> np.ndarray:
        """``grid`` cell by cell no slower than the other frameworks' ``dtype`` GEMMs on this
        GPU (``UNTUNED_TABLES``), each read at these axes; a framework without one lends none."""
        fastest = grid.copy()
        for other in FRAMEWORKS:
            path = self._dir / f"{self._tables}_{other}.npz"
            if other == self.meta["framework"] or not path.is_file():
                continue
            ops = ProfiledOps(self._tables, other, "bf16", self._dir)
            if f"gemm_{dtype}" not in ops._z:
                continue
            for j, n in enumerate(ns):
                for i, k in enumerate(ks):
                    fastest[:, j, i] = np.minimum(fastest[:, j, i], ops.gemm(ms, int(n), int(k), dtype))
        self.notes.append(f"{dtype} GEMMs as the fastest measured on this GPU ({self.meta['framework']}'s table "
                          "times an untuned fallback kernel)")
        return fastest

    def gemm(self, m: np.ndarray, n: int, k: int, dtype: str | None = None) -> np.ndarray:
        """Seconds for GEMMs (m x k) @ (k x n), vectorised over m, at ``dtype`` (default: the
        ``gemm_dtype`` these ops were built for). Taller than the grid: linear in m (stacked
        GEMMs of the tallest measured m, compute-bound by then)."""
        m = np.asarray(m, dtype=np.float64)
        ms, ns, ks, g = self._grid(dtype or self.gemm_dtype)
        pieces = int(np.ceil(n / ns[-1]))
        n_piece = n / pieces
        if k > ks[-1]:
            raise CostModelError(f"GEMM k={k} exceeds the profiled maximum {int(ks[-1])}")
        # bilinear in (n, k) on each measured m, then log-linear in m
        jn = _bracket(ns, n_piece)
        jk = _bracket(ks, k)
        wn = max(n_piece - ns[jn], 0.0) / (ns[jn + 1] - ns[jn])
        wk = max(k - ks[jk], 0.0) / (ks[jk + 1] - ks[jk])
        along_m = ((1 - wn) * (1 - wk) * g[:, jn, jk] + wn * (1 - wk) * g[:, jn + 1, jk]
                   + (1 - wn) * wk * g[:, jn, jk + 1] + wn * wk * g[:, jn + 1, jk + 1])
        inside = np.interp(np.log(np.maximum(m, 1.0)), np.log(ms), along_m)
        return pieces * np.where(m > ms[-1], along_m[-1] * m / ms[-1], inside)

    def has_table(self, prefix: str) -> bool:
        """Whether the framework's tables for this GPU hold ``<prefix>_*`` columns."""
        return any(k.startswith(prefix + "_") for k in self._z)

    def kernel(self, prefix: str, head_dim: int, kv_dtype: str) -> tuple[dict[str, np.ndarray], str]:
        """The measured rows of one attention kernel (``kernel_rows``) and, when this GPU's
        framework never measured it, how they were substituted ("" when measured).

        In the order that was nearest where the real kernel was measured
        (``benchmarks/attention_substitutes.py``): this framework's kernel on a GPU of the
        same chip (equal bf16 FLOPs: H100 and H200), by ``other_gpu_rows``; the same kernel at
        the other KV dtype on this GPU, by ``other_dtype_rows``; then the kernel on the other
        chip nearest in HBM bandwidth. Else a CostModelError naming what is missing."""
        rows = kernel_rows(self._z, prefix, head_dim, kv_dtype)
        if rows is not None:
            return rows, ""
        here = load_gpu(self.meta["gpu"])
        neighbours = self._neighbours
        same_chip = [(spec, z) for spec, z in neighbours if spec.bf16_flops == here.bf16_flops]
        moved = self._from_other_gpu(same_chip, here, prefix, head_dim, kv_dtype)
        if moved is not None:
            return moved
        other = "bf16" if kv_dtype == "fp8" else "fp8"
        rows = kernel_rows(self._z, prefix, head_dim, other)
        if rows is not None:
            how = "at its byte count" if prefix == "gen" else "as measured"
            return (other_dtype_rows(rows, prefix, other, kv_dtype),
                    f"{prefix} attention with {kv_dtype} KV read from the measured {other}-KV kernel {how} (unmeasured)")
        moved = self._from_other_gpu(neighbours, here, prefix, head_dim, kv_dtype)
        if moved is not None:
            return moved
        raise CostModelError(f"{self.label}: no {prefix} attention measured for head_dim={head_dim} at any KV dtype "
                             f"here, nor at kv_dtype={kv_dtype} on another GPU of {self.meta['framework']}")

    @staticmethod
    def _from_other_gpu(neighbours, here: GPUSpec, prefix: str, head_dim: int,
                        kv_dtype: str) -> tuple[dict[str, np.ndarray], str] | None:
        """The kernel from the first of ``neighbours`` that measured it, carried to ``here``."""
        for spec, z in neighbours:
            rows = kernel_rows(z, prefix, head_dim, kv_dtype)
            if rows is not None:
                rows, factor = other_gpu_rows(rows, prefix, spec, here)
                by = "HBM bandwidth" if prefix == "gen" else "bf16 FLOPs"
                return rows, (f"{prefix} attention (head_dim={head_dim}, {kv_dtype} KV) from {spec.name}'s measured "
                              f"kernel, its work scaled x{factor:.2f} by {by} (unmeasured here)")
        return None

    @functools.cached_property
    def _neighbours(self) -> list[tuple[GPUSpec, dict[str, np.ndarray]]]:
        """(spec, attention tables) of this framework on the other GPUs with tables, nearest in
        HBM bandwidth first; read once, whichever kernels are substituted."""
        here, out = load_gpu(self.meta["gpu"]), []
        for spec in builtin_gpus():
            path = self._dir / f"{spec.tables}_{self.meta['framework']}.npz"
            if spec.tables != here.tables and path.is_file():
                with np.load(path) as z:
                    out.append((spec, {k: z[k] for k in z.files if k.startswith(("gen_", "ctx_"))}))
        return sorted(out, key=lambda sz: abs(np.log(sz[0].hbm_bytes_per_s / here.hbm_bytes_per_s)))

    def _attention_rows(self, prefix: str, shape: AttentionShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(batch, length, seconds) rows for the shape: the kernel's (``kernel``), an unmeasured
        head layout carried from the nearest measured one by ``borrow_layout``."""
        rows, substituted = self.kernel(prefix, shape.head_dim, shape.kv_dtype)
        if substituted:
            self.notes.append(substituted)
        heads, kvh = rows["heads"], rows["kv_heads"]
        pairs = sorted(set(zip(heads.tolist(), kvh.tolist(), strict=True)))
        # nearest measured (heads, kv_heads): same group size first, then closest in log size
        def distance(p: tuple[int, int]) -> tuple[bool, float]:
            return (p[0] * shape.kv_heads != p[1] * shape.heads,
                    abs(np.log(p[0] / shape.heads)) + abs(np.log(p[1] / shape.kv_heads)))
        best = min(pairs, key=distance)
        sel = (heads == best[0]) & (kvh == best[1])
        batch, length = rows["batch"][sel].astype(np.float64), rows["length"][sel].astype(np.float64)
        sec = rows["seconds"][sel]
        if best != (shape.heads, shape.kv_heads):
            # decode work reads KV (scales with kv heads); prefill work computes per query head
            want, have = (shape.kv_heads, best[1]) if prefix == "gen" else (shape.heads, best[0])
            floor, ratio = sec.min(), want / have
            sec, read = borrow_layout(batch, length, sec, want, have)
            note = f"{prefix} attention from measured {best[0]}/{best[1]} heads"
            rest = f"work scaled x{ratio:.2f} over its {floor * 1e6:.1f} us launch floor"
            if not read.any():
                note += f": {rest}"
            else:
                note += f" at {ratio:g}x the batch ({read.sum()} of {read.size} points"
                note += ")" if read.all() else f"; the rest {rest})"
            self.notes.append(note)
        return batch, length, sec

    def decode_rows(self, shape: AttentionShape) -> dict[float, tuple[np.ndarray, np.ndarray]]:
        """batch -> (KV tokens read per sequence, seconds) as measured, ascending in context."""
        batch, step, sec = self._attention_rows("gen", shape)
        out = {}
        for b in np.unique(batch):
            r = batch == b
            order = np.argsort(step[r])
            out[float(b)] = (step[r][order] + 1.0, sec[r][order])  # step = tokens already cached
        return out

    def prefill_rows(self, shape: AttentionShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(batch, prompt length, seconds) of measured context attention."""
        batch, isl, sec = self._attention_rows("ctx", shape)
        return batch, isl, sec

    def table(self, prefix: str) -> dict[str, np.ndarray]:
        """The distilled columns ``<prefix>_*`` by their short names; CostModelError if the
        framework's tables for this GPU hold none (e.g. no fused-MoE table on A100)."""
        cut = len(prefix) + 1
        cols = {k[cut:]: v for k, v in self._z.items() if k.startswith(prefix + "_")}
        if not cols:
            raise CostModelError(f"{self.label}: no {prefix} table measured for this GPU and framework")
        return cols

    def allreduce(self, elements: np.ndarray, tp: int) -> np.ndarray:
        """Seconds for an all-reduce of ``elements`` bf16 values across ``tp`` GPUs."""
        return self._message_curve("ar", "all-reduce", elements, tp)

    def collective(self, op: str, elements: np.ndarray, gpus: int) -> np.ndarray:
        """Seconds for an NCCL ``op`` (all_gather, reduce_scatter, alltoall) of ``elements``
        half-precision values across ``gpus`` GPUs."""
        return self._message_curve(f"nccl_{op}", f"NCCL {op}", elements, gpus)

    def _message_curve(self, prefix: str, what: str, elements: np.ndarray, gpus: int) -> np.ndarray:
        """Log-log interpolation in message size; past the largest message, linear in size
        (bandwidth-bound)."""
        t = self.table(prefix)
        r = t["gpus"] == gpus
        if not r.any():
            raise CostModelError(f"{self.label}: no {what} measured for {gpus} GPUs; measured: "
                                 f"{sorted(set(t['gpus'].tolist()))}")
        size = t["elements"][r].astype(np.float64)
        sec = t["latency"][r].astype(np.float64) * MS
        x = np.log(np.maximum(np.asarray(elements, dtype=np.float64), size[0]))
        inside = np.interp(x, np.log(size), sec)
        beyond = sec[-1] * np.exp(x - np.log(size[-1]))
        return np.where(x > np.log(size[-1]), beyond, inside)


class RooflineOps:
    """Latencies from peak FLOPs and bandwidth with fixed efficiencies: for GPUs without tables."""

    kind = "roofline"
    launch_s = 3e-6  # per-kernel latency floor
    gemm_efficiency = 0.7  # achievable fraction of peak tensor FLOPs
    attention_efficiency = 0.5  # flash attention reaches about half of peak
    allreduce_latency_s = 10e-6

    def __init__(self, gpu: GPUSpec, gemm_dtype: str):
        self.gpu = gpu
        self.gemm_dtype = gemm_dtype
        self._flops = gpu.flops(gemm_dtype)
        self._weight_bytes = 1 if gemm_dtype == "fp8" else 2
        self._bw = gpu.hbm_bytes_per_s * gpu.hbm_efficiency
        self.notes: list[str] = []

    @property
    def label(self) -> str:
        return f"roofline:{self.gpu.name}/{self.gemm_dtype}"

    def token_axis(self) -> np.ndarray:
        return TOKEN_AXIS.copy()

    def gemm(self, m: np.ndarray, n: int, k: int) -> np.ndarray:
        m = np.asarray(m, dtype=np.float64)
        compute = 2.0 * m * n * k / (self._flops * self.gemm_efficiency)
        traffic = (n * k * self._weight_bytes + 2.0 * m * (n + k)) / self._bw
        return np.maximum(compute, traffic) + self.launch_s

    def decode_rows(self, shape: AttentionShape) -> dict[float, tuple[np.ndarray, np.ndarray]]:
        kv_bytes = 2 * shape.kv_heads * shape.head_dim * (1 if shape.kv_dtype == "fp8" else 2)
        return {float(b): (CTX_AXIS.copy(), b * CTX_AXIS * kv_bytes / self._bw + self.launch_s) for b in BATCH_AXIS}

    def prefill_rows(self, shape: AttentionShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pairs = ISL_AXIS * (ISL_AXIS + 1) / 2
        flops = 4.0 * pairs * shape.heads * shape.head_dim
        sec = flops / (self.gpu.bf16_flops * self.attention_efficiency) + self.launch_s
        return np.ones_like(ISL_AXIS), ISL_AXIS.copy(), sec

    def allreduce(self, elements: np.ndarray, tp: int) -> np.ndarray:
        nbytes = 2.0 * np.asarray(elements, dtype=np.float64)
        return 2.0 * (tp - 1) / tp * nbytes / self.gpu.nvlink_bytes_per_s + self.allreduce_latency_s

    def collective(self, op: str, elements: np.ndarray, gpus: int) -> np.ndarray:
        """All-gather, reduce-scatter or all-to-all: each moves (gpus-1)/gpus of the buffer once."""
        nbytes = 2.0 * np.asarray(elements, dtype=np.float64)
        return (gpus - 1) / gpus * nbytes / self.gpu.nvlink_bytes_per_s + self.allreduce_latency_s


def timed_quantization(fp8: np.ndarray, bf16: np.ndarray) -> np.ndarray:
    """Seconds [m, k] of the activation quantization an FP8 GEMM grid timed: its least
    excess over the bf16 grid across the ``NARROW`` columns (``one_pass_quantization``)."""
    return np.maximum((fp8[:, :NARROW, :] - bf16[:, :NARROW, :]).min(axis=1), 0.0)


def one_pass_quantization(fp8: np.ndarray, bf16: np.ndarray, m: np.ndarray, k: np.ndarray,
                          hbm_bytes_per_s: float) -> np.ndarray:
    """An FP8 GEMM grid [m, n, k] timed with a per-call activation quantization, as
    served with one quantization pass (``DYNAMIC_QUANT_TABLES``).

    The timed quantization is the FP8 time less the bf16 time at the narrowest n: both GEMMs
    sit at their launch floor there, so what differs is the quantization, a cost of m and k
    alone. It is the least difference over the ``NARROW`` columns, since a lone cell can
    spike (H200's m=16, n=32, k=1024 reads 42 us, its neighbours 13). The served pass moves
    ``QUANT_PASS_BYTES`` per element at HBM speed. No GEMM is taken below the narrowest bf16
    GEMM of its m and k, a launch floor the table's noise could cross. On Llama-3.1-70B FP8
    on 8 B200s at batch 4 the token-linear part of a step read as timed (7.1 ms) outlasts
    the whole measured step (5.4 ms); as served it is 4.1 ms
    (``benchmarks/fp8_quantization.py``)."""
    timed = timed_quantization(fp8, bf16)
    served = QUANT_PASS_BYTES * m[:, None] * k[None, :] / hbm_bytes_per_s
    return np.maximum(fp8 - timed[:, None, :], bf16[:, :1, :]) + served[:, None, :]


def kernel_rows(z: dict[str, np.ndarray], prefix: str, head_dim: int, kv_dtype: str) -> dict[str, np.ndarray] | None:
    """The rows of one measured attention kernel (``prefix`` "gen" decode, "ctx" prefill) at a
    head_dim and KV dtype: heads, kv_heads, batch, length and seconds; None if unmeasured."""
    if f"{prefix}_head_dim" not in z or kv_dtype not in KV_DTYPE_CODE:
        return None
    sel = (z[f"{prefix}_head_dim"] == head_dim) & (z[f"{prefix}_kv_dtype"] == KV_DTYPE_CODE[kv_dtype])
    if not sel.any():
        return None
    rows = {k: z[f"{prefix}_{k}"][sel] for k in ("heads", "kv_heads", "batch", "length")}
    return rows | {"seconds": z[f"{prefix}_latency"][sel].astype(np.float64) * MS}


def other_dtype_rows(rows: dict[str, np.ndarray], prefix: str, measured_kv: str,
                     wanted_kv: str) -> dict[str, np.ndarray]:
    """A kernel's rows measured at one KV dtype read for another. Decode streams the cache, so
    it is read at the same byte count: an FP8 KV at context 2L as the bf16 KV at L. Prefill
    computes on the fresh K/V and is read as measured. On the 54 decode kernels measured at
    both dtypes, the byte count is as near as reading them as measured at the median (19% vs
    18% error) and nearer at the 90th percentile (51% vs 60%): ``benchmarks/attention_substitutes.py``."""
    if prefix != "gen":
        return rows
    per_token = {"bf16": 2.0, "fp8": 1.0}
    return rows | {"length": rows["length"] * per_token[measured_kv] / per_token[wanted_kv]}


def other_gpu_rows(rows: dict[str, np.ndarray], prefix: str, measured_on: GPUSpec,
                   wanted_on: GPUSpec) -> tuple[dict[str, np.ndarray], float]:
    """A kernel's rows measured on one GPU carried to another, and the factor used: the work
    above the launch floor (``scale_work``) scaled by the HBM bandwidth ratio for decode (it
    streams the KV cache) and by the bf16 FLOPs ratio for prefill (it is compute-bound)."""
    if prefix == "gen":
        factor = measured_on.hbm_bytes_per_s / wanted_on.hbm_bytes_per_s
    else:
        factor = measured_on.bf16_flops / wanted_on.bf16_flops
    return rows | {"seconds": scale_work(rows["seconds"], factor)}, factor


def borrow_layout(batch: np.ndarray, length: np.ndarray, sec: np.ndarray, heads: int,
                  measured_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Attention times for ``heads`` read from a layout measured with ``measured_heads`` (KV heads
    for decode, query heads for prefill), and which points the batch-equivalent rule gave.

    With r = heads / measured_heads, b sequences of the wanted layout move the same KV bytes
    (or FLOPs) as r*b sequences of the measured one, give the kernel as many (sequence, head)
    units to split across the GPU, so the same split-KV and tile choices, and pay one launch:
    t(b, s) = measured(r*b, s). Exact where r*b is a measured batch, else linear in batch
    between the measured batches around it at that length. It needs r or 1/r whole and r*b
    within the batches measured at s; other points fall back to ``scale_work``. On held-out
    tables: median error 0.6-5 % (decode), 1-15 % (prefill), against 4-18 % for ``scale_work``.
    """
    ratio = heads / measured_heads
    out, read = scale_work(sec, ratio), np.zeros(len(sec), dtype=bool)
    if heads % measured_heads and measured_heads % heads:
        return out, read
    for s in np.unique(length):
        at = np.flatnonzero(length == s)
        b = batch[at]
        order = np.argsort(b)
        ok = (ratio * b >= b.min()) & (ratio * b <= b.max())
        out[at[ok]] = np.interp(ratio * b[ok], b[order], sec[at][order])
        read[at[ok]] = True
    return out, read


def scale_work(sec: np.ndarray, factor: float) -> np.ndarray:
    """Attention times of one measured head layout, carried to a layout with ``factor`` x its work
    (the fallback of ``borrow_layout``).

    A call costs a launch floor plus work. The floor is the table's fastest call (batch 1,
    shortest length): launch and fixed cost, next to no work. Everything above it (KV
    reads for decode, FLOPs for prefill, per-sequence Q and output traffic) grows with the
    heads and is scaled; one floor for the table, not per batch row, since a large batch
    at a short context is per-sequence work too. Scaling the whole time multiplied the
    launch cost as well (an MHA model timed from 8-KV-head decode tables paid it 4 times).
    Affine with a positive slope, so measured orderings, and monotone grids, survive.
    """
    floor = sec.min()
    return floor + factor * (sec - floor)


def _bracket(axis: np.ndarray, x: float) -> int:
    """Index i with axis[i] <= x <= axis[i+1], clamped to the grid (x below the grid uses the first cell)."""
    return int(min(max(np.searchsorted(axis, x) - 1, 0), len(axis) - 2))
