"""The engines' own verify budgets vs load, tuned on one window and scored on another.

Llama-3.1-8B on one H100, the Azure 2023 conversation trace (``../shared``), and the three
example drafters of ``studies/examples/`` (their acceptance profiles, draft costs and
longest drafts gamma, with their sources in the files): DSpark (gamma 7), EAGLE-3
(gamma 5) and Llama-3.2-1B as a draft model (gamma 5, the costliest per drafted position).
The trace's first 5 minutes tune, later windows score (never looked at while tuning); each
window is replayed at a sweep of arrival rates. Per load it prints request
goodput (SLO ttft 2000 ms, tpot 40 ms) of:

* vLLM's defaults without speculation, and at every fixed k (``num_speculative_tokens``);
* vLLM's per-batch-size schedule (``num_speculative_tokens_per_batch_size``), picked from a
  grid of 2-3 range schedules (below);
* for the DSpark drafter: vLLM's adaptive verification (``enable_adaptive_verification``,
  k = gamma), and SGLang's DSPARK with the SPS table servetune writes
  (``SGLANG_RAGGED_VERIFY_MODE=compact``), with it under ``cap-accept`` (the planner's
  budget caps acceptance over a whole-block verify) and without a table (every request
  verifies the block: static), all at SGLang's speculative default of 48 running requests.

Scored on two held-out windows, minutes 20-25 and 40-45: the schedule against the best
single fixed k (one k for all loads, picked on the tuning window) and against the best
fixed k per load in hindsight. Two schedules: the one with the best mean goodput over the
tuning window's loads, and the one ``tune``'s robust choice would take over the single k,
those loads as its traffic variants (none when no schedule's gain holds and clears the
noise: then the single k stays). The robust pick and the second window were added after
the first window's result had been seen.

First it prints what servetune leaves out of compact mode: SGLang runs the verify on the
smallest captured CUDA-graph token tier at or above the planned tokens (``GRAPH_TIERS``,
read from SGLang's defaults for a block of 7 and 48 requests; the reading is in
``docs/speculative.md``); the step-time model's cost of that padding, over every request
count and planned length.

    python benchmarks/engine_speculative.py [--quick] [--drafters NAME ...] [--trace azure|mooncake]

``--trace mooncake`` runs the same on Mooncake's conversation trace (prompts of 12k tokens
on average, so fewer requests fit and each verify reads a long KV) at 0.25-1.5 req/s,
written to ``engine_speculative-mooncake.json``; its setup was chosen before it was run.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from costmodels import build  # noqa: E402
from costmodels.steptable import step_seconds  # noqa: E402
from optimizer.robust.choice import choose, gains_over  # noqa: E402
from optimizer.search.drafter import load_drafter  # noqa: E402
from optimizer.search.targets import engine_context  # noqa: E402
from policies.engine import simulate_many  # noqa: E402
from policies.engines import target  # noqa: E402
from studies.metrics import score  # noqa: E402
from studies.slo import parse_slo  # noqa: E402
from studies.traces import load_trace  # noqa: E402
from studies.transforms import scale_rate, window  # noqa: E402

SHARED = Path(os.environ.get("SERVETUNE_SHARED", ROOT / ".." / "shared"))
#: name -> (file under ../shared, its format, the arrival rates swept: from light to past the knee)
TRACES = {"azure": ("traces/azure2023/AzureLLMInferenceTrace_conv.csv", "azure", (4, 12, 20, 28, 36, 44)),
          "mooncake": ("traces/mooncake/conversation_trace.jsonl", "mooncake", (0.25, 0.5, 0.75, 1.0, 1.25, 1.5))}
MODEL, GPU, SLO = "meta-llama/Llama-3.1-8B", "h100", "ttft:2000,tpot:40"
DRAFTERS = ("dspark", "eagle3", "draft_model")  # studies/examples/drafters/<name>.toml
#: seconds of the trace: tuned on the first window, scored on the others (the second
#: was added with the robust pick, after the first had been seen)
TUNE, SCORES = (0.0, 300.0), ((1200.0, 1500.0), (2400.0, 2700.0))
#: SGLang 0.5.23's verify token tiers for DSPARK block 7 at 48 running requests: 8 x the
#: captured batch sizes (model_executor/decode_cuda_graph_runner.py:388-406, 699-702)
GRAPH_TIERS = (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256, 320, 352,
               384)


def padding_cost(cost, gamma: int = 7, most: int = 48, context: int = 1024) -> tuple[float, float]:
    """(mean, worst) step time at the padded tier over the planned one, over R = 1..most
    requests and every planned length R..R(gamma + 1), at ``context`` KV tokens each."""
    ratios = []
    for requests in range(1, most + 1):
        for tokens in range(requests, requests * (gamma + 1) + 1):
            tier = GRAPH_TIERS[bisect.bisect_left(GRAPH_TIERS, tokens)]
            seconds = [step_seconds(cost.tables, n, n, requests, requests * context + n, 0)[0] for n in (tokens, tier)]
            ratios.append(seconds[1] / seconds[0])
    return sum(ratios) / len(ratios), max(ratios)


def schedules(gamma: int) -> list[tuple[int, int, int, int]]:
    """(batch_2, k_2, batch_3, k_3): two ranges, or three with the third four times later."""
    grid = []
    for b2, k2 in itertools.product((4, 8, 16, 32, 64), range(1, gamma)):
        grid.append((b2, k2, 0, 0))
        grid += [(b2, k2, 4 * b2, k3) for k3 in range(k2)]
    return grid


def configs(ctx, drafter) -> dict[str, object]:
    gamma = drafter.max_draft_tokens
    vllm = target("vllm").defaults(ctx).replace(**drafter.config_values())
    out = {"vllm off": vllm}
    out |= {f"vllm k={k}": vllm.replace(speculative_mode="fixed", num_speculative_tokens=k) for k in range(1, gamma + 1)}
    out |= {f"vllm schedule {s}": vllm.replace(speculative_mode="batch_schedule", num_speculative_tokens=gamma,
                                               speculative_batch_2=s[0], speculative_k_2=s[1],
                                               speculative_batch_3=s[2], speculative_k_3=s[3])
            for s in schedules(gamma)}
    if drafter.method == "dspark":
        sglang = target("sglang")
        sgl = sglang.with_drafter(sglang.defaults(ctx)).replace(**drafter.config_values(),
                                                                 num_speculative_tokens=gamma)
        out["vllm adaptive"] = vllm.replace(speculative_mode="adaptive_verify", num_speculative_tokens=gamma)
        out["sglang DSPARK table"] = sgl.replace(speculative_mode="sps_table")
        out["sglang DSPARK no table"] = sgl.replace(speculative_mode="fixed")
        out["sglang DSPARK cap-accept"] = sgl.replace(speculative_mode="sps_cap_accept")
    return out


def goodputs(trace0, cost, named, drafter, rates) -> dict[tuple[int, str], float]:
    slos = parse_slo(SLO)
    acceptance = drafter.acceptance
    out = {}
    for rate in rates:
        trace = scale_rate(trace0, target_rps=rate)
        t0 = time.perf_counter()
        results = simulate_many(trace, cost, list(named.values()), seed=0, acceptance=acceptance)
        for name, result in zip(named, results, strict=True):
            out[(rate, name)] = score(result, trace, slos).request_goodput
        print(f"    {rate:>3} req/s: {trace.n} requests, {len(named)} configs in {time.perf_counter() - t0:.1f} s",
              flush=True)
    return out


def robust_pick(g, schedules, single, rates) -> str | None:
    """The schedule ``tune``'s robust choice would take over the single fixed k, the tuning
    window's loads as the traffic variants (``optimizer.robust.choice``): among the ones no
    load puts more than the noise below it, the highest typical gain, if that clears the
    noise; else None."""
    gains = gains_over(np.array([[g[(r, n)] for r in rates] for n in schedules]),
                       np.array([g[(r, single)] for r in rates]))
    decision = choose(gains)
    return None if decision.chosen is None else schedules[decision.chosen]


def held_row(h, rate, fixed, single, picks, others) -> dict:
    hind = max(fixed, key=lambda n: h[(rate, n)])
    row = {"rate": rate, "off": h[(rate, "vllm off")], "single_fixed": h[(rate, single)], "hindsight": hind,
           "hindsight_goodput": h[(rate, hind)], **{rule: h[(rate, pick)] for rule, pick in picks.items()},
           **{n: h[(rate, n)] for n in others}}
    extra = "".join(f"  {n} {row[n]:6.2f}" for n in others)
    scheduled = "".join(f"  schedule by {rule} {row[rule]:6.2f} ({_x(row[rule], row['single_fixed'])})" for rule in picks)
    print(f"    {rate:>3} req/s  off {row['off']:6.2f}  {single} {row['single_fixed']:6.2f}  best in hindsight {hind} "
          f"{row['hindsight_goodput']:6.2f}{scheduled}{extra}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every other rate")
    parser.add_argument("--drafters", nargs="+", choices=DRAFTERS, default=DRAFTERS, help="drafters to run")
    parser.add_argument("--trace", choices=sorted(TRACES), default="azure",
                        help="mooncake: long prompts (mean 12k tokens), where a verify reads more KV per request")
    args = parser.parse_args()
    path, fmt, rates = TRACES[args.trace]
    rates = rates[::2] if args.quick else rates
    ctx = engine_context(MODEL, GPU)
    cost = build(MODEL, GPU)
    pad_mean, pad_worst = padding_cost(cost)
    print(f"compact's padding to SGLang's graph tiers (not simulated): step time x{pad_mean:.3f} on average, "
          f"x{pad_worst:.3f} at worst", flush=True)
    full = load_trace(SHARED / path, fmt)
    tune = window(full, *TUNE)
    report = {"padding_step_time": {"mean": pad_mean, "worst": pad_worst}}
    for label in args.drafters:
        drafter = load_drafter(ROOT / "studies" / "examples" / "drafters" / f"{label}.toml")
        named = configs(ctx, drafter)
        gamma = drafter.max_draft_tokens
        fixed = [f"vllm k={k}" for k in range(1, gamma + 1)]
        sched = [n for n in named if n.startswith("vllm schedule")]
        others = [n for n in ("vllm adaptive", "sglang DSPARK table", "sglang DSPARK no table",
                              "sglang DSPARK cap-accept") if n in named]
        print(f"drafter {label} {drafter.acceptance.default} (gamma {gamma}, draft cost {drafter.draft_cost}): "
              f"tuning window {TUNE[0]:.0f}-{TUNE[1]:.0f} s", flush=True)
        g = goodputs(tune, cost, named, drafter, rates)
        mean = {n: sum(g[(r, n)] for r in rates) / len(rates) for n in named}
        single = max(fixed, key=mean.get)
        picks = {"best mean": max(sched, key=mean.get), "robust": robust_pick(g, sched, single, rates)}
        print(f"  best single fixed: {single}; schedule by best mean: {picks['best mean']}; by the robust choice: "
              f"{picks['robust'] or 'none holds (keeps the single k)'}")
        picks = {rule: pick or single for rule, pick in picks.items()}
        report[label] = {"single_fixed": single, "schedules": picks, "windows": {}}
        for span in SCORES:
            print(f"  scored on {span[0]:.0f}-{span[1]:.0f} s (held out):", flush=True)
            h = goodputs(window(full, *span), cost,
                         {n: named[n] for n in dict.fromkeys(["vllm off", *fixed, *picks.values(), *others])},
                         drafter, rates)
            rows = [held_row(h, r, fixed, single, picks, others) for r in rates]
            for rule in picks:
                below = [r["rate"] for r in rows if r[rule] < r["single_fixed"] * 0.995]
                above = [r["rate"] for r in rows if r[rule] > r["single_fixed"] * 1.005]
                print(f"  schedule by {rule} below the single fixed k (by > 0.5%) at: {below or 'no load'}; above it "
                      f"at: {above or 'no load'}")
            report[label]["windows"][f"{span[0]:.0f}-{span[1]:.0f}"] = rows
    out = ROOT / "benchmarks" / "results" / ("engine_speculative.json" if args.trace == "azure" else
                                             f"engine_speculative-{args.trace}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


def _x(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 else "n/a"


if __name__ == "__main__":
    main()
