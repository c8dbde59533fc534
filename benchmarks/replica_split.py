"""Replicas: how to run the R single-replica simulations of a round-robin fleet.

The evaluator splits the trace round robin and simulates each replica's share on its
own. This script times three ways of running K configs x R replicas on the Azure 2023
conversation trace (rate scaled by R so each replica sees the trace's own rate) when
../shared is present, else on the bundled Mooncake sample:

- sequential: ``simulate`` per (config, replica), one after the other (the baseline);
- per replica: ``simulate_many`` over the K configs (prange), replica after replica;
- threads: ``simulate`` per (config, replica) in a thread pool of one thread per core
  (the kernel releases the GIL).

``optimizer.evaluate`` runs replicas "per replica", the fastest here on 2 cores.

    python benchmarks/replica_split.py [--replicas 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from costmodels import build
from optimizer.replicas import split_round_robin
from optimizer.spec import default_batch_size
from policies.engine import simulate, simulate_many, warmup
from policies.presets import preset
from studies.traces import load_trace
from studies.transforms import scale_rate

SHARED = Path(os.environ.get("SERVETUNE_SHARED", Path(__file__).resolve().parents[1] / ".." / "shared"))
AZURE = SHARED / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"
SAMPLE = Path(__file__).resolve().parents[1] / "studies" / "data" / "mooncake_conversation_300s.parquet"


def best_of(repeats: int, fn, *args) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def sequential(parts, cost_model, configs) -> None:
    for config in configs:
        for r, part in enumerate(parts):
            simulate(part, cost_model, config, seed=r)


def per_replica(parts, cost_model, configs) -> None:
    for r, part in enumerate(parts):
        simulate_many(part, cost_model, configs, seed=r)


def threaded(parts, cost_model, configs) -> None:
    jobs = [(config, r) for config in configs for r in range(len(parts))]
    with ThreadPoolExecutor(min(default_batch_size(), len(jobs))) as pool:
        list(pool.map(lambda job: simulate(parts[job[1]], cost_model, job[0], seed=job[1]), jobs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warmup()
    path = AZURE if AZURE.exists() else SAMPLE
    trace = scale_rate(load_trace(path), factor=float(args.replicas))
    parts = [trace.take(rows) for rows in split_round_robin(trace.n, args.replicas)]
    cost_model = build("meta-llama/Llama-3.1-8B", "h100")
    print(f"trace {path.name}: {trace.n} requests x{args.replicas} rate, {args.replicas} replicas, "
          f"{default_batch_size()} threads, best of {args.repeats}")
    for names in (["vllm-default"], ["vllm-default", "sglang-default"]):
        configs = [preset(name, "h100") for name in names]
        base = best_of(args.repeats, sequential, parts, cost_model, configs)
        print(f"K={len(configs)} configs: sequential {base:.3f} s (baseline)")
        for name, fn in (("per replica simulate_many", per_replica), ("thread pool", threaded)):
            seconds = best_of(args.repeats, fn, parts, cost_model, configs)
            print(f"  {name}: {seconds:.3f} s, {base / seconds:.2f}x the baseline")


if __name__ == "__main__":
    main()
