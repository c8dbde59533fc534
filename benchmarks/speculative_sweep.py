"""Speculative decoding vs load: goodput and the chosen verify budget per policy.

Replays a window of the Azure conversation trace (``../shared``; a Poisson trace of the
same lengths when it is absent) at a sweep of arrival rates on Llama-3.1-8B / H100 (vLLM
defaults), with speculative decoding off, every fixed k from 1 to gamma, SmartSpec and
DSpark (with and without the lag). The drafter follows
``policies.speculative.DEFAULT_PROFILE`` (about 3.9 tokens per verify at gamma = 7) with
per-verify spread. Each drafted position costs a fraction of the target's decode step:
the sweep runs at every ``--draft-fractions`` value (default 0, a one-pass
semi-autoregressive drafter as DSpark's, and 0.05, closer to an autoregressive EAGLE
head). Prints, per rate, request goodput, the mean verify budget per decode (drafts
verified per request and step) and the mean accepted length; then, per draft cost and
rate, the best fixed k *in hindsight* (the k a team would pick for that one load) and
each adaptive policy's goodput against it and against fixed k = gamma; and writes
``speculative_sweep.png`` (goodput and verify budget vs load) and ``.json`` to
``benchmarks/results/``.

On this model decode attention, paid per sequence, dominates the step even at the largest
batches, so verifying stays fairly cheap and DSpark's budget shrinks from the full block
to about three drafts rather than to 0-1; ``tests/policies/test_speculative_engine.py``
shows the whole shape on a compute-bound model.

    python benchmarks/speculative_sweep.py [--quick] [--draft-fractions 0,0.05]
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
from optimizer.search.targets import engine_context  # noqa: E402
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
GAMMA = 7
FIXED = tuple(f"fixed k={k}" for k in range(1, GAMMA + 1))
ADAPTIVE = ("smartspec", "dspark", "dspark_lagged")
POLICIES = {  # label: (speculative_mode, num_speculative_tokens)
    "off": ("off", GAMMA),
    **{label: ("fixed", k) for k, label in enumerate(FIXED, start=1)},
    **{mode: (mode, GAMMA) for mode in ADAPTIVE},
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
    """Per rate: the best fixed k in hindsight, and each adaptive policy against it and
    against fixed k = gamma (the same block the adaptive policies draft)."""
    by = {(r["rate"], r["policy"]): r for r in data["rows"]}
    rates = sorted({r["rate"] for r in data["rows"]})
    print(f"draft cost {data['draft_fraction']:g} x decode step per drafted position:")
    for rate in rates:
        best = max(FIXED, key=lambda p: by[(rate, p)]["goodput"])
        best_goodput, block = by[(rate, best)]["goodput"], by[(rate, FIXED[-1])]["goodput"]
        parts = [f"{p} {_ratio(by[(rate, p)]['goodput'], best_goodput)} / {_ratio(by[(rate, p)]['goodput'], block)}"
                 for p in ADAPTIVE]
        print(f"  {rate:>3} req/s: best fixed {best} ({best_goodput:.2f} req/s, off "
              f"{_ratio(by[(rate, 'off')]['goodput'], best_goodput)}); vs best fixed / vs k={GAMMA}: " + ", ".join(parts))
    budgets = ", ".join(f"{rate}: {by[(rate, 'dspark')]['verify_budget']:.2f}" for rate in rates)
    print(f"  dspark verify budget (drafts per decode) by rate: {budgets}")


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 else "n/a"


def plot(sweeps: list[dict], path: Path) -> None:
    """Goodput and verify budget vs load, one row per draft cost; fixed k = 1, 4 and gamma
    stand for the fixed policies (every k is in the .json)."""
    shown = ("off", FIXED[0], FIXED[3], FIXED[-1], *ADAPTIVE)
    fig = Figure(figsize=(11, 4.2 * len(sweeps)))
    for row_axes, data in zip(fig.subplots(len(sweeps), 2, squeeze=False), sweeps, strict=True):
        ax_good, ax_budget = row_axes
        for i, policy in enumerate(shown):
            rows = [r for r in data["rows"] if r["policy"] == policy]
            rates = [r["rate"] for r in rows]
            ax_good.plot(rates, [r["goodput"] for r in rows], marker="o", color=f"C{i}", label=policy)
            if policy != "off":
                ax_budget.plot(rates, [r["verify_budget"] for r in rows], marker="o", color=f"C{i}", label=policy)
        cost = f"draft cost {data['draft_fraction']:g} x decode step per position"
        ax_good.set(xlabel="arrival rate (req/s)", ylabel="request goodput (req/s)",
                    title=f"goodput, SLO {data['slo']}, {cost}")
        ax_budget.set(xlabel="arrival rate (req/s)", ylabel="drafts verified per decode",
                      title=f"mean verify budget (gamma = {data['gamma']}), {cost}")
        for ax in (ax_good, ax_budget):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"Speculative decoding vs load: {sweeps[0]['model']} on {sweeps[0]['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter window and every other rate")
    parser.add_argument("--draft-fractions", default="0,0.05",
                        help="costs of one drafted position as fractions of the target's decode step, comma-separated")
    args = parser.parse_args()
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    sweeps = [run(args.quick, float(f)) for f in args.draft_fractions.split(",")]
    for data in sweeps:
        ratios(data)
    (out / "speculative_sweep.json").write_text(json.dumps(sweeps, indent=1, default=float))
    plot(sweeps, out / "speculative_sweep.png")
    print(f"wrote {out / 'speculative_sweep.png'} and .json")


if __name__ == "__main__":
    main()
