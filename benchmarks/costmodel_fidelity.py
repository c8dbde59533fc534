"""TPOT and TTFT MAPE against measured H100 runs, per (model, framework), before and after calibration.

Reads ``silicon_dense_h100.csv`` from ../shared (or $SERVETUNE_SHARED). Also shows what a
pure decode-step TPOT model (no prompts interleaved) reaches after its own fit, as the
baseline the steady-state model is compared with.

    python benchmarks/costmodel_fidelity.py
"""

import sys

import numpy as np

from costmodels import build, calibrate, load_runs
from costmodels.calibration import fit, mape, predict
from costmodels.distil import aic_root, shared_dir
from costmodels.runs import kv_dtype_of
from costmodels.steptable import step_seconds


def pure_decode_mape(runs) -> dict:
    out = {}
    for (model, fw, dtype), group in runs.group_by(["model", "framework", "gemm_dtype"], maintain_order=True):
        table_s, measured = [], []
        for (tp,), g in group.group_by(["tp"]):
            t = build(model, "h100", tp=int(tp), framework=fw, gemm_dtype=dtype, kv_dtype=kv_dtype_of(dtype),
                      calibration=False).tables._replace(overhead_s=0.0, scale=1.0)
            for b, s, o, tpot in g.select(["batch_size", "isl", "osl", "tpot_ms"]).iter_rows():
                table_s.append(step_seconds(t, b, b, b, b * (s + o / 2), 0.0)[0])
                measured.append(tpot / 1e3)
        table_s, measured = np.array(table_s), np.array(measured)
        overhead, scale = fit(table_s, measured, 1e-3)
        out[model, fw, dtype] = mape(predict(table_s, overhead, scale), measured)
    return out


def main() -> None:
    path = aic_root(shared_dir()) / "systems" / "silicon_dense_h100.csv"
    if not path.is_file():
        sys.exit(f"measured runs not found at {path}; set SERVETUNE_SHARED")
    runs = load_runs(path)
    baseline = pure_decode_mape(runs)
    print(f"{'model':26} {'framework':10} {'runs':>4}  {'TPOT before':>11} {'after':>6}  "
          f"{'TTFT before':>11} {'after':>6}  {'pure-decode TPOT after':>22}")
    for e in calibrate(runs):
        if e["model"] == "*":
            continue
        key = (e["model"], e["framework"], e["gemm_dtype"])
        print(f"{e['model']:26} {e['framework'] + '/' + e['gemm_dtype']:10} {e['n_runs']:4d}  "
              f"{e['tpot_mape_before']:10.1f}% {e['tpot_mape_after']:5.1f}%  "
              f"{e['ttft_mape_before']:10.1f}% {e['ttft_mape_after']:5.1f}%  {baseline[key]:21.1f}%")


if __name__ == "__main__":
    main()
