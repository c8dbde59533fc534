"""Load curves: goodput and SLO attainment vs offered load, per policy, on both real traces.

Each trace is replayed at a sweep of rate scales (``studies.transforms.scale_rate``: time
compressed, token lengths unchanged) under FIFO without batching, vLLM defaults, SGLang
defaults, vLLM defaults with admission control (``max_wait_s`` = the TTFT bound: a
request that has waited that long can no longer meet its SLO, so it is turned away
instead of delaying everyone behind it) and a policy tuned at the knee (the first scale
where vLLM defaults meet fewer than 90% of SLOs). Writes ``load_curves.md``/``.json`` and
one PNG per trace to ``--out``; the markdown marks the knee and what happens past it.

    python benchmarks/load_curves.py [--quick] [--trials 30]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from scenarios import tune  # noqa: E402

from costmodels import build  # noqa: E402
from optimizer.search.targets import engine_context  # noqa: E402
from policies.engine import simulate_many  # noqa: E402
from policies.engines import preset  # noqa: E402
from studies.metrics import score  # noqa: E402
from studies.slo import parse_slo  # noqa: E402
from studies.traces import load_trace  # noqa: E402
from studies.transforms import scale_rate, window  # noqa: E402

SHARED = Path(os.environ.get("SERVETUNE_SHARED", ROOT / ".." / "shared"))
MODEL, GPU = "meta-llama/Llama-3.1-8B", "h100"
TRACES = {  # label: (file, format, SLO, rate scales)
    "azure-conv": ("traces/azure2023/AzureLLMInferenceTrace_conv.csv", "azure", "ttft:1000,tpot:50",
                   (0.5, 1, 2, 3, 4, 4.5, 5, 6, 8)),
    "mooncake-conversation": ("traces/mooncake/conversation_trace.jsonl", "mooncake", "ttft:5000,tpot:100",
                              (0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0, 1.5)),
}
KNEE_ATTAINMENT = 0.9


def policies(ttft_ms: float) -> dict:
    vllm = preset("vllm-default", engine_context(MODEL, GPU))
    return {"fifo-no-batching": vllm.replace(max_num_seqs=1), "vllm-default": vllm,
            "sglang-default": preset("sglang-default", engine_context(MODEL, GPU)),
            "vllm+max-wait": vllm.replace(max_wait_s=ttft_ms / 1e3)}


def sweep(trace, cost, slos, configs: dict, scales) -> dict[str, list[dict]]:
    """Per policy, one row per scale: offered rate and the report's load and goodput figures."""
    rows = {name: [] for name in configs}
    for s in scales:
        scaled = scale_rate(trace, factor=s)
        rate = (scaled.n - 1) / (scaled.arrival_s[-1] - scaled.arrival_s[0])
        for name, result in zip(configs, simulate_many(scaled, cost, list(configs.values())), strict=True):
            r = score(result, scaled, slos)
            rows[name].append({"scale": s, "offered_rps": rate, "request_goodput": r.request_goodput,
                               "slo_attainment": r.slo_attainment, "rejected_fraction": r.rejected_fraction,
                               "p99_ttft_ms": r.p99_ttft_ms, "p50_tpot_ms": r.p50_tpot_ms,
                               "preemptions": r.preemptions})
    return rows


def knee(rows: list[dict]) -> int:
    """Index of the first scale where attainment falls below KNEE_ATTAINMENT (last if never)."""
    return next((i for i, r in enumerate(rows) if r["slo_attainment"] < KNEE_ATTAINMENT), len(rows) - 1)


def figure(label: str, rows: dict[str, list[dict]], knee_rps: float) -> Figure:
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    for ax, key, title in zip(fig.subplots(1, 2), ("request_goodput", "slo_attainment"),
                              ("goodput (req/s meeting every SLO)", "SLO attainment"), strict=True):
        for name, series in rows.items():
            ax.plot([r["offered_rps"] for r in series], [r[key] for r in series], marker="o", ms=3, label=name)
        ax.axvline(knee_rps, color="grey", ls=":", label="vLLM-default knee")
        ax.set(xlabel="offered load (req/s)", title=f"{label}: {title}")
        ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def markdown(label: str, rows: dict[str, list[dict]], knee_i: int, tuned_at: float | None) -> str:
    scales = [r["scale"] for r in next(iter(rows.values()))]
    rates = [r["offered_rps"] for r in next(iter(rows.values()))]
    lines = [f"### {label}", "", f"Knee of vLLM defaults: x{scales[knee_i]:g} ({rates[knee_i]:.1f} req/s offered)"
             + (f"; tuned at x{tuned_at:g}." if tuned_at else "."), "",
             "Goodput in req/s (SLO attainment, rejected share):", "",
             "| policy | " + " | ".join(f"x{s:g} ({r:.1f}/s)" for s, r in zip(scales, rates, strict=True)) + " |",
             "|---|" + "---|" * len(scales)]
    for name, series in rows.items():
        cells = [f"{r['request_goodput']:.2f} ({r['slo_attainment']:.0%}, {r['rejected_fraction']:.0%})" for r in series]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="first 600 s of each trace, 10 tuning trials")
    parser.add_argument("--trials", type=int, default=30, help="tuning budget at the knee (0 = no tuned policy)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if not SHARED.is_dir():
        sys.exit(f"shared traces not found at {SHARED}; set SERVETUNE_SHARED")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trials = 10 if args.quick else args.trials
    cost = build(MODEL, GPU)
    args.out.mkdir(parents=True, exist_ok=True)
    command = f"python benchmarks/load_curves.py{' --quick' if args.quick else ''}"
    sections = [f"# Load curves\n\n{cost.name} ({cost.source}); command: `{command}`\n"]
    data = {}
    for label, (rel, fmt, slo, scales) in TRACES.items():
        t0 = time.perf_counter()
        trace = load_trace(SHARED / rel, fmt)
        if args.quick:
            trace = window(trace, 0.0, 600.0)
        slos = parse_slo(slo)
        configs = policies(slos.classes[0].ttft_ms)
        rows = sweep(trace, cost, slos, configs, scales)
        k = knee(rows["vllm-default"])
        tuned_at = None
        if trials > 0:
            tuned_at = scales[k]
            config, info = tune(label, scale_rate(trace, factor=tuned_at), cost, slos, trials, 0)
            rows.update(sweep(trace, cost, slos, {"tuned": config}, scales))
            data[f"{label}/tuning"] = info | {"rate_scale": tuned_at}
        data[label] = {"requests": trace.n, "slo": slo, "rows": rows}
        sections.append(markdown(label, rows, k, tuned_at))
        png = args.out / f"load_curve_{label}.png"
        figure(label, rows, rows["vllm-default"][k]["offered_rps"]).savefig(png, dpi=110)
        sections[-1] += f"\n![{label}]({png.name})\n"
        print(sections[-1], f"({trace.n} requests, {time.perf_counter() - t0:.1f} s)\n", flush=True)
    (args.out / "load_curves.md").write_text("\n".join(sections))
    (args.out / "load_curves.json").write_text(json.dumps(data, indent=1, default=float) + "\n")
    print(f"wrote {args.out / 'load_curves.md'}")


if __name__ == "__main__":
    main()
