"""Tuner speed: trials per second, and the share of wall time in Optuna vs the engine.

Runs a study of N trials (journal storage in a temporary folder, batch = cores) on the
Azure 2023 conversation trace when ../shared is present (else a synthetic trace), then,
as the baseline measured in the same run, simulates the same configs with the engine
alone. The ratio says what the search loop costs on top of simulating.

    python benchmarks/tuner_speed.py [--trials 100] [--trace FILE] [--batch-size K]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import optuna

from optimizer.search.evaluate import Evaluator
from optimizer.search.spec import load_spec
from optimizer.search.study import create_or_resume, enqueue_baselines, run
from policies.config import PolicyConfig
from policies.engine import simulate_many, warmup

SHARED = Path(os.environ.get("SERVETUNE_SHARED", Path(__file__).resolve().parents[1] / ".." / "shared"))
AZURE = SHARED / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"


def synthetic_trace(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    n = 5000
    path = folder / "synthetic.csv"
    rows = zip(np.cumsum(rng.exponential(0.15, n)), rng.integers(50, 4000, n), rng.integers(5, 600, n), strict=True)
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{a:.4f},{p},{o}\n" for a, p, o in rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warmup()
    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace or (AZURE if AZURE.exists() else synthetic_trace(Path(tmp)))
        spec = load_spec(trace=trace, model="meta-llama/Llama-3.1-8B", gpu="h100", slo="ttft:2000,tpot:100",
                         trials=args.trials, batch_size=args.batch_size, run_dir=Path(tmp) / "run")
        evaluator = Evaluator(spec)
        study = create_or_resume(spec)
        enqueue_baselines(study, spec, evaluator.baselines())
        stats = run(study, spec, evaluator)

        configs = [PolicyConfig.from_mapping(t.user_attrs["config"]) for t in study.get_trials()
                   if "report" in t.user_attrs]
        start = time.perf_counter()
        for i in range(0, len(configs), spec.batch_size):
            simulate_many(evaluator.trace, evaluator.cost_model, configs[i:i + spec.batch_size], seed=spec.seed)
        engine_only = time.perf_counter() - start

    print(f"trace: {trace.name}, {evaluator.trace.n} requests; {stats.told} trials "
          f"({stats.pruned} pruned, {evaluator.simulations} simulated), batch {spec.batch_size}")
    print(f"tuner: {stats.wall_s:.2f} s, {stats.trials_per_s:.2f} trials/s")
    print(f"  engine (simulate + score) {stats.engine_s:.2f} s = {100 * stats.engine_s / stats.wall_s:.0f}%")
    print(f"  Optuna (ask, suggest, tell) {stats.optuna_s:.2f} s = {100 * stats.optuna_s / stats.wall_s:.0f}%")
    print(f"  other {stats.other_s:.2f} s = {100 * stats.other_s / stats.wall_s:.0f}%")
    print(f"baseline, engine alone on the same {len(configs)} configs: {engine_only:.2f} s, "
          f"{len(configs) / engine_only:.2f} configs/s")
    print(f"ratio tuner wall / engine alone: {stats.wall_s / engine_only:.2f}x")


if __name__ == "__main__":
    main()
