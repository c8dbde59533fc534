"""How far off is an attention kernel read from a substitute, where the real one was measured?

When a GPU's framework never measured an attention kernel, ``ProfiledOps.kernel`` reads it
from a substitute: the same kernel at the other KV dtype on that GPU, as measured, or the
framework's kernel on the GPU nearest in HBM bandwidth with its work scaled
(``other_gpu_rows``). This script scores each rule, and the candidates it was chosen over, on
every table measured both ways: it hides the measured kernel, predicts it from the
substitute and compares them point by point (same heads, KV heads, batch and length).

Rules and candidates, per kernel (``gen`` decode, ``ctx`` prefill):

- ``same chip``: the same kernel on the other GPU of the same chip (H100 for H200 and back),
  work scaled (the first rule);
- ``other dtype``: the other KV dtype's kernel on this GPU by ``other_dtype_rows``: decode at
  the same byte count (an FP8 KV at context 2L as the bf16 KV at L), prefill as measured (the
  second);
- ``as measured`` (decode only): the other KV dtype's decode kernel read as measured (the
  candidate it was chosen over);
- ``other chip``: the same kernel on the nearest GPU of another chip, work scaled (the third);
- ``roofline``: what a missing kernel was read from before (``RooflineOps``).

Prints the median and 90th-percentile absolute error per kernel and rule, then per rule over
the kernels where the rules it is ranked against also apply (the order's evidence).

    python benchmarks/attention_substitutes.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodels.gpus import builtin_gpus  # noqa: E402
from costmodels.optables import (  # noqa: E402
    DATA_DIR,
    AttentionShape,
    RooflineOps,
    kernel_rows,
    other_dtype_rows,
    other_gpu_rows,
)

PREFIXES = ("gen", "ctx")
RULES = ("same chip", "other dtype", "as measured", "other chip", "roofline")
FRAMEWORKS = ("vllm", "sglang", "trtllm")


def _tables(gpu, framework: str) -> dict[str, np.ndarray] | None:
    path = DATA_DIR / f"{gpu.tables}_{framework}.npz"
    if not path.is_file():
        return None
    with np.load(path) as z:
        return {k: z[k] for k in z.files if k.startswith(("gen_", "ctx_"))}


def _keyed(rows: dict[str, np.ndarray]) -> dict[tuple[int, int, int, int], float]:
    keys = zip(*(rows[k].tolist() for k in ("heads", "kv_heads", "batch", "length")), strict=True)
    return {tuple(int(v) for v in k): float(s) for k, s in zip(keys, rows["seconds"], strict=True)}


def errors(predicted: dict, measured: dict) -> np.ndarray:
    """|predicted / measured - 1| over the points both hold."""
    common = sorted(set(predicted) & set(measured))
    return np.array([abs(predicted[k] / measured[k] - 1.0) for k in common])


def at(rows: dict[str, np.ndarray], want: dict) -> dict:
    """``rows`` read at each wanted point, linearly in length within its (heads, kv heads, batch)."""
    out = {}
    for heads, kvh, b, length in want:
        sel = (rows["heads"] == heads) & (rows["kv_heads"] == kvh) & (rows["batch"] == b)
        if sel.sum() >= 2:
            order = np.argsort(rows["length"][sel])
            out[(heads, kvh, b, length)] = float(np.interp(length, rows["length"][sel][order],
                                                           rows["seconds"][sel][order]))
    return out


def roofline(gpu, prefix: str, head_dim: int, kv_dtype: str, want: dict) -> dict:
    """The roofline's time at each wanted point (decode rows by batch; prefill per prompt x batch)."""
    ops, out = RooflineOps(gpu, "bf16"), {}
    for heads, kvh, b, length in want:
        shape = AttentionShape(heads, kvh, head_dim, kv_dtype)
        if prefix == "gen":
            ctx, sec = ops.decode_rows(shape)[1.0]
            per_seq = np.interp(length + 1, ctx, sec) - ops.launch_s
            out[(heads, kvh, b, length)] = b * per_seq + ops.launch_s
        else:
            _, isl, sec = ops.prefill_rows(shape)
            out[(heads, kvh, b, length)] = b * (np.interp(length, isl, sec) - ops.launch_s) + ops.launch_s
    return out


def score() -> dict[str, list[tuple[str, np.ndarray]]]:
    """rule -> [(where, errors)] over every kernel measured both ways."""
    gpus = [g for g in builtin_gpus() if g.tables]
    out: dict[str, list[tuple[str, np.ndarray]]] = {rule: [] for rule in RULES}
    for framework in FRAMEWORKS:
        tables = {g.name: _tables(g, framework) for g in gpus}
        for gpu in gpus:
            z = tables[gpu.name]
            if z is None:
                continue
            nearest = sorted((g for g in gpus if g.name != gpu.name and tables[g.name] is not None),
                             key=lambda g: abs(np.log(g.hbm_bytes_per_s / gpu.hbm_bytes_per_s)))
            for prefix in PREFIXES:
                for head_dim in (64, 128, 256):
                    for kv_dtype, other in (("fp8", "bf16"), ("bf16", "fp8")):
                        measured = kernel_rows(z, prefix, head_dim, kv_dtype)
                        if measured is None:
                            continue
                        want = _keyed(measured)
                        where = f"{gpu.name.removesuffix('_sxm')} {framework} {prefix} hd{head_dim} {kv_dtype}"
                        sub = kernel_rows(z, prefix, head_dim, other)
                        if sub is not None:
                            read = other_dtype_rows(sub, prefix, other, kv_dtype)
                            out["other dtype"].append((where, errors(at(read, want), want)))
                            if prefix == "gen":
                                out["as measured"].append((where, errors(_keyed(sub), want)))
                        for g in nearest[:1]:
                            far = kernel_rows(tables[g.name], prefix, head_dim, kv_dtype)
                            if far is not None:
                                moved, _ = other_gpu_rows(far, prefix, g, gpu)
                                rule = "same chip" if g.bf16_flops == gpu.bf16_flops else "other chip"
                                out[rule].append((where, errors(_keyed(moved), want)))
                        out["roofline"].append((where, errors(roofline(gpu, prefix, head_dim, kv_dtype, want),
                                                              want)))
    return out


def _pct(values: np.ndarray, q: float) -> str:
    return f"{100 * np.quantile(values, q):.0f}%" if values.size else "-"


def main() -> int:
    results = score()
    print("| rule | kernel | points | median error | p90 error |")
    print("|---|---|---|---|---|")
    for rule, cases in results.items():
        for where, e in cases:
            print(f"| {rule} | {where} | {e.size} | {_pct(e, 0.5)} | {_pct(e, 0.9)} |")
    print()
    print("Paired: each rule against the next on the kernels both apply to (median / p90 error).\n")
    print("| kernel | rule | against | kernels | rule | against |")
    print("|---|---|---|---|---|---|")
    pairs = [("same chip", "other dtype"), ("other dtype", "other chip"), ("other dtype", "as measured"),
             ("other chip", "roofline"), ("other dtype", "roofline")]
    for prefix in PREFIXES:
        for rule, against in pairs:
            a = {w: e for w, e in results[rule] if f" {prefix} " in w}
            b = {w: e for w, e in results[against] if f" {prefix} " in w}
            both = sorted(set(a) & set(b))
            if both:
                ea, eb = (np.concatenate([d[w] for w in both]) for d in (a, b))
                print(f"| {prefix} | {rule} | {against} | {len(both)} | {_pct(ea, 0.5)} / {_pct(ea, 0.9)} | "
                      f"{_pct(eb, 0.5)} / {_pct(eb, 0.9)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
