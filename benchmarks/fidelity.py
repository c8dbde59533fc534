"""Fidelity: the engine against measured closed-loop H100 runs (mean TTFT and TPOT per run).

Replays every row of ``silicon_dense_h100.csv`` (or ``--runs``, any CSV in that format)
through the engine as a closed loop (``optimizer.closedloop``: ``batch_size`` clients,
``--waves`` requests each, wave 0 dropped) with the calibrated cost model and the
framework's scheduler defaults, the same path as ``servetune validate``. Prints MAPE per
(model, framework) and overall, the worst rows and the fixed-point iteration counts, and
writes ``fidelity.md``, ``fidelity.csv`` and ``fidelity_scatter.png`` to ``--out``. As the
baseline measured in the same run it also prints the steady-state formula's MAPE that
``costmodels.calibration`` fits (``benchmarks/costmodel_fidelity.py``), on the same rows.

    python benchmarks/fidelity.py [--runs FILE.csv] [--waves 4] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodels import calibrate, load_runs  # noqa: E402
from costmodels.distil import aic_root, shared_dir  # noqa: E402
from optimizer.cli.validate import format_report, mape_table, predict_runs, scatter_figure  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=None, help="runs CSV (default: ../shared silicon_dense_h100.csv)")
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="every 4th row")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    path = args.runs or aic_root(shared_dir()) / "systems" / "silicon_dense_h100.csv"
    if not path.is_file():
        sys.exit(f"measured runs not found at {path}; set SERVETUNE_SHARED or pass --runs")
    runs = load_runs(path)
    if args.quick:
        runs = runs.gather_every(4)
    t0 = time.perf_counter()
    pred = predict_runs(runs, waves=args.waves)
    wall = time.perf_counter() - t0
    report = format_report(pred, worst=8)
    command = f"python benchmarks/fidelity.py{' --quick' if args.quick else ''}"
    formula = ["", "baseline, the calibration's steady-state formula on the same rows (no queueing):",
               f"{'model':26} {'framework':13} {'TTFT MAPE':>9}  {'TPOT MAPE':>9}"]
    for e in calibrate(runs):
        if e["model"] != "*":
            formula.append(f"{e['model']:26} {e['framework'] + '/' + e['gemm_dtype']:13} "
                           f"{e['ttft_mape_after']:8.1f}%  {e['tpot_mape_after']:8.1f}%")
    text = (f"{len(runs)} runs from {path.name}, {args.waves} requests per client, simulated in {wall:.1f} s\n\n"
            + report + "\n" + "\n".join(formula))
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fidelity.md").write_text(f"# Fidelity\n\nCommand: `{command}`\n\n```\n{text}\n```\n")
    pred.write_csv(args.out / "fidelity.csv")
    scatter_figure(pred).savefig(args.out / "fidelity_scatter.png", dpi=110)
    overall = mape_table(pred).row(-1, named=True)
    print(f"\noverall: TTFT MAPE {overall['ttft_mape']:.1f}%, TPOT MAPE {overall['tpot_mape']:.1f}%; "
          f"wrote {args.out / 'fidelity.md'}, fidelity.csv, fidelity_scatter.png")


if __name__ == "__main__":
    main()
