"""Fleet speed (issue 8): an 8-replica fleet replay of the full Mooncake conversation trace.

Prints, per router, ms per fleet replay (best of ``--repeats`` after warm-up) and its
ratio to the baseline measured in the same run: one replica replaying the same trace
(``policies.engine.simulate``). Target: every router under 8x. Also times the fleet with
migration, with prefill/decode disaggregation and with a replica failing, and one fleet
per router in parallel (``simulate_fleet_many``). The vLLM default preset (prefix caching
on), Llama-3.1-8B on H100; ``--rate-scale`` multiplies the arrival rate (8 replicas see
the trace's load split 8 ways at x1).

    python benchmarks/fleet_speed.py [--replicas 8] [--rate-scale 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_speed import best_of  # noqa: E402

from costmodels import build  # noqa: E402
from optimizer.search.targets import engine_context  # noqa: E402
from policies import engine  # noqa: E402
from policies.config import ROUTERS  # noqa: E402
from policies.engines import preset  # noqa: E402
from policies.failures import FailureSchedule  # noqa: E402
from policies.fleet import simulate_fleet, simulate_fleet_many  # noqa: E402
from studies.traces import load_trace  # noqa: E402
from studies.transforms import scale_rate  # noqa: E402

SHARED = Path(os.environ.get("SERVETUNE_SHARED", ROOT / ".." / "shared"))
MOONCAKE = SHARED / "traces" / "mooncake" / "conversation_trace.jsonl"


def describe(result, trace) -> str:
    finished = result.state == 0
    ttft = (result.first_token_s - trace.arrival_s)[finished]
    hit = result.prefix_hit_tokens / max(result.prefix_query_tokens, 1)
    return (f"{finished.mean():6.1%} finished, mean TTFT {ttft.mean() * 1e3:8.1f} ms, "
            f"prefix hit {hit:5.1%}, {result.steps:,} steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--rate-scale", type=float, default=1.0, help="arrival-rate multiplier (1 = as recorded)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not MOONCAKE.exists():
        sys.exit(f"Mooncake trace not found at {MOONCAKE}; set SERVETUNE_SHARED")

    cost = build("meta-llama/Llama-3.1-8B", "h100")
    config = preset("vllm-default", engine_context("meta-llama/Llama-3.1-8B", "h100"))
    trace = load_trace(MOONCAKE, "mooncake")
    if args.rate_scale != 1.0:
        trace = scale_rate(trace, factor=args.rate_scale)
    fleet = [cost] * args.replicas
    t0 = time.perf_counter()
    engine.simulate(trace, cost, config)
    simulate_fleet(trace, fleet, config)
    print(f"{trace.n} requests over {trace.arrival_s[-1] - trace.arrival_s[0]:.0f} s (rate x{args.rate_scale:g}); "
          f"{cost.name}; preset vllm-default; {args.replicas} replicas; compile/warm-up "
          f"{time.perf_counter() - t0:.1f} s")
    single_s, single = best_of(lambda: engine.simulate(trace, cost, config), args.repeats)
    print(f"baseline, one replica      : {single_s * 1e3:8.1f} ms/replay   {describe(single, trace)}")
    span = float(trace.arrival_s[-1] - trace.arrival_s[0])
    variants = [(router, config.replace(router=router), None) for router in ROUTERS]
    variants += [
        ("least_kv + migration", config.replace(router="least_kv", migration=True), None),
        (f"P/D 2+{args.replicas - 2}, cache_aware", config.replace(router="cache_aware", prefill_replicas=2), None),
        ("least_outstanding, 1 fails", config.replace(router="least_outstanding"),
         FailureSchedule.from_rows([(1, span / 3, 2 * span / 3)])),
    ]
    worst = 0.0
    for label, variant, failures in variants:
        simulate_fleet(trace, fleet, variant, failures=failures)
        fleet_s, result = best_of(lambda v=variant, f=failures: simulate_fleet(trace, fleet, v, failures=f),
                                  args.repeats)
        ratio = fleet_s / single_s
        if failures is None and variant.prefill_replicas == 0 and not variant.migration:
            worst = max(worst, ratio)
        print(f"{label:27s}: {fleet_s * 1e3:8.1f} ms/replay {ratio:5.2f}x   {describe(result, trace)}")
    print(f"worst router: {worst:.2f}x the single replica (target < 8x)")
    configs = [config.replace(router=router) for router in ROUTERS]
    simulate_fleet_many(trace, fleet, configs)
    many_s, _ = best_of(lambda: simulate_fleet_many(trace, fleet, configs), 1)
    one_s, _ = best_of(lambda: [simulate_fleet(trace, fleet, c) for c in configs], 1)
    print(f"simulate_fleet_many, one fleet per router: {many_s * 1e3:.1f} ms "
          f"({one_s * 1e3:.1f} ms one by one, {one_s / many_s:.2f}x on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
