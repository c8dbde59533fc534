"""Attention DP in lockstep against independent groups: what the lockstep model changes.

An attention-DP instance runs one scheduler per group; the engines step the groups
together (``policies.engine.lockstep``). This replays the Azure conversation trace through
vLLM's defaults on MoE models laid out with expert parallelism and 1, 2, 4 or 8 attention
groups, each DP layout twice: groups stepping together (what servetune simulates) and
groups stepping alone (what it simulated before), and prints the latency and goodput
figures and the lockstep / independent ratio of p50 TPOT (and writes them to
``benchmarks/results/dp_lockstep.md``). Both runs share the trace, cost model and config,
so the difference is the lockstep alone. No measured DP run of vLLM or SGLang is
available, so this measures the model's change, not its accuracy.

    python benchmarks/dp_lockstep.py [--minutes 5] [--scales 1,2]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodels import build  # noqa: E402
from optimizer.search.targets import engine_context  # noqa: E402
from policies.engine import simulate  # noqa: E402
from policies.engines import target  # noqa: E402
from policies.fleet import simulate_fleet  # noqa: E402
from studies.metrics import score  # noqa: E402
from studies.slo import parse_slo  # noqa: E402
from studies.traces import load_trace  # noqa: E402
from studies.transforms import scale_rate, window  # noqa: E402

SHARED = Path(os.environ.get("SERVETUNE_SHARED", ROOT / ".." / "shared"))
TRACE = "traces/azure2023/AzureLLMInferenceTrace_conv.csv"
SLO = "ttft:2000,tpot:100"
CASES = (  # model, GPU, GPUs per instance, weights, KV cache (issue 17's two "done shows" models)
    ("Qwen/Qwen3-30B-A3B", "h100", 8, "bf16", "bf16"),
    ("deepseek-ai/DeepSeek-V3", "h200", 8, "fp8", "fp8"),
)


def run(trace, cost, config, dp: int, lockstep: bool):
    if dp == 1:
        return simulate(trace, cost, config)
    return simulate_fleet(trace, cost, config, replicas=dp, lockstep=dp if lockstep else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="trace window replayed (from its start)")
    parser.add_argument("--scales", default="1,2", help="arrival-rate multipliers")
    args = parser.parse_args()
    slos = parse_slo(SLO)
    base = window(load_trace(SHARED / TRACE), 0.0, args.minutes * 60.0)
    lines = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"{TRACE}, first {args.minutes:g} min ({base.n} requests), vLLM defaults, expert parallel, SLO {SLO}")
    header = (f"{'model':26} {'x':>3} {'dp':>2} {'groups':11} {'p50 TTFT':>9} {'p99 TTFT':>9} {'p50 TPOT':>9} "
              f"{'p90 TPOT':>9} {'attain':>7} {'goodput':>8} {'TPOT lock/indep':>15}")
    for model, gpu, tp, dtype, kv_dtype in CASES:
        ctx = engine_context(model, gpu, tp, "vllm", dtype=dtype, kv_dtype=kv_dtype)
        config = target("vllm").defaults(ctx)
        say(f"\n{model} on {tp} x {gpu} ({dtype} weights, {kv_dtype} KV), block size {config.block_size}")
        say(header)
        for scale in (float(s) for s in args.scales.split(",")):
            trace = scale_rate(base, factor=scale)
            for dp in (1, 2, 4, 8):
                cost = build(model, gpu, tp, "vllm", dtype, kv_dtype, moe_ep_size=tp, attention_dp_size=dp)
                independent = None
                for lockstep in ((False,) if dp == 1 else (False, True)):
                    r = score(run(trace, cost, config, dp, lockstep), trace, slos)
                    ratio = "" if not lockstep else f"{r.p50_tpot_ms / independent.p50_tpot_ms:15.2f}"
                    mode = "-" if dp == 1 else ("lockstep" if lockstep else "independent")
                    say(f"{model:26} {scale:3g} {dp:2d} {mode:11} {r.p50_ttft_ms:9.0f} {r.p99_ttft_ms:9.0f} "
                        f"{r.p50_tpot_ms:9.1f} {r.p90_tpot_ms:9.1f} {r.slo_attainment:7.1%} "
                        f"{r.request_goodput:8.2f} {ratio:>15}")
                    independent = r
    text = "\n".join(lines)
    (ROOT / "benchmarks" / "results" / "dp_lockstep.md").write_text(
        f"# Attention DP: lockstep against independent groups\n\nCommand: `python benchmarks/dp_lockstep.py`"
        f"\n\n```\n{text}\n```\n")


if __name__ == "__main__":
    main()
