"""Speed table: simulated requests per second per core, ms per full-trace replay, trials per second.

All figures come from one run on this machine, with the timing helpers of
``engine_speed.py`` (best of ``--repeats`` after warm-up) and the study loop that
``tuner_speed.py`` measures:

- one replay per trace on one core (``simulate``, vLLM defaults at the recorded rate);
- eight configs at once (``simulate_many``, in parallel over configs), as requests per second
  per core, and its ratio to eight single-core replays one after another (the baseline);
- a ``--trials``-trial tuning study on the Azure trace: trials per second, and the share
  of its wall time spent in the engine.

    python benchmarks/speed_table.py [--quick] [--trials 100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402
from engine_speed import SHARED, TRACES, best_of  # noqa: E402

from costmodels import build  # noqa: E402
from optimizer.search.evaluate import Evaluator  # noqa: E402
from optimizer.search.spec import load_spec  # noqa: E402
from optimizer.search.study import create_or_resume, enqueue_baselines, run  # noqa: E402
from optimizer.search.targets import engine_context  # noqa: E402
from policies import engine  # noqa: E402
from policies.engines import preset  # noqa: E402
from studies.traces import load_trace  # noqa: E402

MODEL, GPU = "meta-llama/Llama-3.1-8B", "h100"


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="30 trials, 2 repeats")
    args = parser.parse_args()
    if not SHARED.is_dir():
        sys.exit(f"shared traces not found at {SHARED}; set SERVETUNE_SHARED")
    trials, repeats = (30, 2) if args.quick else (args.trials, args.repeats)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    engine.warmup()
    cost = build(MODEL, GPU)
    config = preset("vllm-default", engine_context(MODEL, GPU))
    n_cores = cores()
    print(f"{cost.name}; vllm-default; {n_cores} cores; command: `python benchmarks/speed_table.py"
          f"{' --quick' if args.quick else ''}`\n")
    print("| measurement | requests | wall | simulated req/s per core | ms per replay |")
    print("|---|---|---|---|---|")
    for label, (rel, fmt) in TRACES.items():
        trace = load_trace(SHARED / rel, fmt)
        engine.simulate(trace, cost, config)
        seconds, _ = best_of(lambda t=trace: engine.simulate(t, cost, config), repeats)
        print(f"| {label}, 1 replay, 1 core | {trace.n:,} | {seconds * 1e3:.1f} ms | {trace.n / seconds:,.0f} "
              f"| {seconds * 1e3:.1f} |")
        configs = [config.replace(max_num_batched_tokens=b, max_num_seqs=s)
                   for b in (2048, 4096, 8192, 16384) for s in (256, 1024)]
        many_s, _ = best_of(lambda t=trace, c=configs: engine.simulate_many(t, cost, c), max(1, repeats // 2))
        one_s, _ = best_of(lambda t=trace, c=configs: [engine.simulate(t, cost, x) for x in c], 1)
        print(f"| {label}, 8 configs, simulate_many on {n_cores} cores | {8 * trace.n:,} | {many_s * 1e3:.0f} ms "
              f"| {8 * trace.n / many_s / n_cores:,.0f} | {many_s * 1e3 / 8:.1f} (per config) |")
        print(f"| {label}, 8 configs one by one (baseline) | {8 * trace.n:,} | {one_s * 1e3:.0f} ms "
              f"| {8 * trace.n / one_s:,.0f} | {one_s * 1e3 / 8:.1f} |")
        print(f"| ratio, simulate_many / one by one | | {one_s / many_s:.2f}x faster | | |")

    with tempfile.TemporaryDirectory() as tmp:
        azure = SHARED / TRACES["azure-conv"][0]
        spec = load_spec(trace=azure, model=MODEL, gpu=GPU, slo="ttft:2000,tpot:100", trials=trials,
                         run_dir=Path(tmp) / "run")
        evaluator = Evaluator(spec)
        study = create_or_resume(spec)
        enqueue_baselines(study, spec, evaluator.baselines())
        t0 = time.perf_counter()
        stats = run(study, spec, evaluator)
        wall = time.perf_counter() - t0
    print(f"\n| tuning study, azure-conv ({evaluator.trace.n:,} requests), batch {spec.batch_size} | trials | wall "
          f"| trials/s | engine share |\n|---|---|---|---|---|")
    print(f"| TPE, journal storage | {stats.told} ({stats.pruned} pruned) | {wall:.1f} s | {stats.trials_per_s:.2f} "
          f"| {stats.engine_s / stats.wall_s:.0%} |")


if __name__ == "__main__":
    main()
