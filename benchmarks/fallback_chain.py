"""Fallback chain: which entry should stand in for a DeepSeek setup nobody measured.

``costmodels.calibration.match_entry`` keeps a setup's parallel path (plain TP, expert
parallel, attention DP) before its GPU: a held-out setup gets an entry of its own path
fitted on another GPU and model before an entry of its own family on the same GPU fitted
on another path. This scores that choice on the breadth runs: each DeepSeek setup (H200,
TRT-LLM) is replayed, as ``servetune validate`` replays it, with each entry of the other
DeepSeek setups (fitted on those setups' runs only, so never on the runs scored), beside
its leave-one-setup-out figure from ``benchmarks/fidelity.py --part breadth``, which used
the chain's entry, and with no entry at all (uncalibrated: the candidate every step of the
chain has). Reads ``benchmarks/results/fidelity_breadth.csv`` and
``fidelity_breadth_calibration.json`` (run ``fidelity.py --part breadth`` first). Then it
prints every tier of the chain as the bundled calibration's table states it (each tier's
held-out error, and the same runs' with no entry, from ``fidelity_unseen.py``): the table
the chain follows, since a tier no entry beats is skipped. Writes
``benchmarks/results/fallback_chain.md``.

    python benchmarks/fallback_chain.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fidelity_unseen import tier_table_lines  # noqa: E402

from costmodels import save_calibration  # noqa: E402
from costmodels.calibration import BUNDLED, load_tier_errors  # noqa: E402
from costmodels.runs import layout_label  # noqa: E402
from optimizer.cli.validate import predict_runs  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
RUN_COLUMNS = ["model", "gpu", "framework", "tp", "gemm_dtype", "kv_dtype", "batch_size", "isl", "osl", "ttft_ms",
               "tpot_ms", "client", "moe_ep_size", "attention_dp_size"]


def mape(pred: np.ndarray, measured: np.ndarray) -> float:
    return float(np.mean(np.abs(pred / measured - 1.0)) * 100.0)


def main() -> None:
    runs = pl.read_csv(RESULTS / "fidelity_breadth.csv").filter(pl.col("model").str.contains("DeepSeek"))
    entries = [e for e in json.loads((RESULTS / "fidelity_breadth_calibration.json").read_text())["entries"]
               if "DeepSeek" in e["model"]]
    lines = ["held-out setup              entry (fitted on)                      TTFT    TPOT",
             "-" * 78]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "entry.json"
        for layout, held in runs.group_by("layout", maintain_order=True):
            setup = f"{held['model'][0].split('/')[1]} {layout[0]}"
            measured_ttft, measured_tpot = held["ttft_ms"].to_numpy(), held["tpot_ms"].to_numpy()
            lines.append(f"{setup:27s}  {'chain (' + held['logo_match'][0] + ')':37s}  "
                         f"{mape(held['logo_ttft_ms'].to_numpy(), measured_ttft):5.1f}%  "
                         f"{mape(held['logo_tpot_ms'].to_numpy(), measured_tpot):5.1f}%")
            none = predict_runs(held.select(RUN_COLUMNS), calibration=False)
            lines.append(f"{'':27s}  {'no entry (uncalibrated)':37s}  "
                         f"{mape(none['pred_ttft_ms'].to_numpy(), measured_ttft):5.1f}%  "
                         f"{mape(none['pred_tpot_ms'].to_numpy(), measured_tpot):5.1f}%")
            for e in entries:
                fitted = [layout_label(dict(zip(("tp", "moe_ep_size", "attention_dp_size"), t, strict=True)))
                          for t in e["layouts"]]
                if layout[0] in fitted:
                    continue  # fitted on the runs it would score
                save_calibration([e], path)
                pred = predict_runs(held.select(RUN_COLUMNS), calibration=path)
                match = pred["calibration_match"][0]
                label = f"{e['model'].split('/')[1]} {', '.join(fitted)} ({match or 'not lent'})"
                figures = (f"{mape(pred['pred_ttft_ms'].to_numpy(), measured_ttft):5.1f}%  "
                           f"{mape(pred['pred_tpot_ms'].to_numpy(), measured_tpot):5.1f}%") if match else \
                    "another model's other path: the chain does not lend it"
                lines.append(f"{'':27s}  {label:37s}  {figures}")
    lines += ["", f"every tier of the chain, scored on held-out runs (the bundled calibration's table, written by "
              f"`python benchmarks/fidelity_unseen.py --install`; {BUNDLED.name}):"]
    stored = load_tier_errors(BUNDLED)
    lines += tier_table_lines(stored) if stored else ["  none stored: run fidelity_unseen.py --install"]
    text = "\n".join(lines)
    print(text)
    (RESULTS / "fallback_chain.md").write_text(
        "# Fallback chain: DeepSeek setups held out\n\nCommand: `python benchmarks/fallback_chain.py`\n\n"
        f"```\n{text}\n```\n")


if __name__ == "__main__":
    main()
