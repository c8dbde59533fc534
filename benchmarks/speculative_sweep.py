"""Speculative decoding vs load: goodput and the chosen verify budget per policy.

Replays a window of the Azure conversation trace (``../shared``; a Poisson trace of the
same lengths when it is absent) at a sweep of arrival rates on Llama-3.1-8B / H100 (vLLM
defaults), with speculative decoding off, fixed k, SmartSpec and DSpark (with and
without the lag). The drafter follows ``policies.speculative.DEFAULT_PROFILE`` (about 3.9
tokens per verify at gamma = 7) with per-verify spread; each drafted position costs
``--draft-fraction`` of the target's decode step (default 0: a one-pass, semi-autoregressive
drafter as DSpark's; 0.05 is closer to an autoregressive EAGLE head). Prints, per rate,
request goodput, the mean verify budget per decode (drafts verified per request and step)
and the mean accepted length, then the ratios of every policy to fixed k = gamma at the
lowest and highest load and DSpark's budget by rate, and writes ``speculative_sweep.png``
(goodput and verify budget vs load) and ``.json`` to ``benchmarks/results/``.

On this model decode attention, paid per sequence, dominates the step even at the largest
batches, so verifying stays fairly cheap and DSpark's budget shrinks from the full block
to about three drafts rather than to 0-1; ``tests/policies/test_speculative_engine.py``
shows the whole shape on a compute-bound model.

    python benchmarks/speculative_sweep.py [--quick] [--draft-fraction 0.05]
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

from matplotlib.figure import Figure  # noqa: E402

from costmodels import build  # noqa: E402
from optimizer.targets import engine_context  # noqa: E402
from policies.engine import simulate_many  # noqa: E402
from policies.engines import preset  # noqa: E402
from policies.speculative import AcceptanceModel  # noqa: E402
from studies.metrics import score  # noqa: E402
from studies.slo import parse_slo  # noqa: E402
from studies.traces import Trace, load_trace  # noqa: E402
from studies.transforms import scale_rate, window  # noqa: E402

SHARED = Path(os.environ.get("SERVETUNE_SHARED", ROOT / ".." / "shared"))
TRACE = "traces/azure2023/AzureLLMInferenceTrace_conv.csv"
MODEL, GPU = "meta-llama/Llama-3.1-8B", "h100"
SLO = "ttft:2000,tpot:40"
RATES = (2, 8, 16, 20, 24, 28, 32, 36, 40)
GAMMA, FIXED_K = 7, 4
POLICIES = {  # label: (speculative_mode, num_speculative_tokens)
    "off": ("off", GAMMA),
    f"fixed k={FIXED_K}": ("fixed", FIXED_K),
    f"fixed k={GAMMA}": ("fixed", GAMMA),
    "smartspec": ("smartspec", GAMMA),
    "dspark": ("dspark", GAMMA),
    "dspark_lagged": ("dspark_lagged", GAMMA),
}


def base_trace(seconds: float) -> Trace:
    path = SHARED / TRACE
    if path.exists():
        return window(load_trace(path, "azure"), 0.0, seconds)
    print(f"({path} not found: using a Poisson trace with Azure-conversation-like lengths)")
    from studies.synthetic import LogNormal, Poisson, Tenant, generate

    tenant = Tenant(prompt=LogNormal(1150, 1.0), output=LogNormal(210, 1.0))
    return generate(Poisson(5.0), duration_s=seconds, tenants=[tenant], seed=0)


def run(quick: bool, draft_fraction: float) -> dict:
    cost = build(MODEL, GPU)
    slos = parse_slo(SLO)
    trace0 = base_trace(120.0 if quick else 300.0)
    base = preset("vllm-default", engine_context(MODEL, GPU)).replace(speculative_draft_cost_mode="fraction",
                                               speculative_draft_cost=draft_fraction)
    configs = [base.replace(speculative_mode=mode, num_speculative_tokens=k) for mode, k in POLICIES.values()]
    acceptance = AcceptanceModel(spread=0.3)
    rates = RATES[::2] if quick else RATES
    rows = []
    for rate in rates:
        trace = scale_rate(trace0, target_rps=rate)
        t0 = time.perf_counter()
        results = simulate_many(trace, cost, configs, seed=0, acceptance=acceptance)
        wall = time.perf_counter() - t0
        for label, result in zip(POLICIES, results, strict=True):
            report = score(result, trace, slos)
            rows.append(dict(rate=rate, policy=label, goodput=report.request_goodput,
                             attainment=report.slo_attainment, verify_budget=report.mean_verify_budget,
                             accepted_length=report.mean_accepted_length, wasted=report.verify_tokens_wasted,
                             tokens_per_step=report.tokens_per_step, p90_tpot_ms=report.p90_tpot_ms))
        print(f"rate {rate:>4} req/s  ({trace.n} requests, {len(configs)} configs in {wall:.1f} s)")
        for row in rows[-len(configs):]:
            print(f"   {row['policy']:<14} goodput {row['goodput']:7.2f} req/s  attainment {row['attainment']:.3f}  "
                  f"verify budget {row['verify_budget']:5.2f}  accepted length {row['accepted_length']:5.2f}  "
                  f"tokens/step {row['tokens_per_step']:7.1f}  p90 TPOT {row['p90_tpot_ms']:6.1f} ms")
    return dict(model=MODEL, gpu=GPU, slo=SLO, gamma=GAMMA, draft_fraction=draft_fraction, rows=rows)


def ratios(data: dict) -> None:
    by = {(r["rate"], r["policy"]): r for r in data["rows"]}
    rates = sorted({r["rate"] for r in data["rows"]})
    fixed = f"fixed k={GAMMA}"  # the same block as the adaptive policies
    for rate in (rates[0], rates[-1]):
        base = by[(rate, fixed)]["goodput"]
        parts = [f"{p} {by[(rate, p)]['goodput'] / base:.2f}x" for p in POLICIES if p != fixed and base > 0]
        print(f"goodput vs {fixed} at {rate} req/s: " + ", ".join(parts))
    budgets = ", ".join(f"{rate}: {by[(rate, 'dspark')]['verify_budget']:.2f}" for rate in rates)
    print(f"dspark verify budget (drafts per decode) by rate: {budgets}")


def plot(data: dict, path: Path) -> None:
    fig = Figure(figsize=(11, 4.2))
    ax_good, ax_budget = fig.subplots(1, 2)
    for i, policy in enumerate(POLICIES):
        rows = [r for r in data["rows"] if r["policy"] == policy]
        rates = [r["rate"] for r in rows]
        ax_good.plot(rates, [r["goodput"] for r in rows], marker="o", color=f"C{i}", label=policy)
        if policy != "off":
            ax_budget.plot(rates, [r["verify_budget"] for r in rows], marker="o", color=f"C{i}", label=policy)
    ax_good.set(xlabel="arrival rate (req/s)", ylabel="request goodput (req/s)",
                title=f"goodput, SLO {data['slo']}")
    ax_budget.set(xlabel="arrival rate (req/s)", ylabel="drafts verified per decode",
                  title=f"mean verify budget (gamma = {data['gamma']})")
    for ax in (ax_good, ax_budget):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Speculative decoding vs load: {data['model']} on {data['gpu']}, "
                 f"draft cost {data['draft_fraction']:g} x decode step per position")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter window and every other rate")
    parser.add_argument("--draft-fraction", type=float, default=0.0,
                        help="cost of one drafted position as a fraction of the target's decode step")
    args = parser.parse_args()
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    data = run(args.quick, args.draft_fraction)
    ratios(data)
    (out / "speculative_sweep.json").write_text(json.dumps(data, indent=1, default=float))
    plot(data, out / "speculative_sweep.png")
    print(f"wrote {out / 'speculative_sweep.png'} and .json")


if __name__ == "__main__":
    main()
