"""Search quality: the exhaustive grid's best vs what the tuner finds after 50, 100, 300 trials.

A small space (max_num_batched_tokens x max_num_seqs x long_prefill_token_threshold, 384
points) on the Azure conversation trace at its knee (first ``--window`` s, rate x4.5),
Llama-3.1-8B on one H100, SLO ttft:1000,tpot:50. Every grid point is simulated; then the
tuner (TPE, as ``servetune tune`` configures it, over exactly the grid's values, without
enqueued baselines) and, as the baseline measured in the same run, random search each run
300 trials for several seeds. Prints the best feasible weighted goodput found within the
first 50, 100 and 300 trials as a share of the grid optimum, and its rank in the grid.
Falls back to a synthetic chat workload when ../shared is absent.

    python benchmarks/search_quality.py [--quick] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402

from costmodels import build  # noqa: E402
from optimizer.search import objective as objectives  # noqa: E402
from optimizer.search.evaluate import Evaluator  # noqa: E402
from optimizer.search.samplers import make_sampler  # noqa: E402
from optimizer.search.spec import StudySpec  # noqa: E402
from optimizer.search.study import run  # noqa: E402
from studies.slo import parse_slo  # noqa: E402
from studies.traces import load_trace  # noqa: E402
from studies.transforms import scale_rate, window  # noqa: E402

SHARED = Path(os.environ.get("SERVETUNE_SHARED", ROOT / ".." / "shared"))
AZURE = SHARED / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"
GRID = {
    "max_num_batched_tokens": [256, 512, 1024, 2048, 4096, 8192, 16384, 32768],
    "max_num_seqs": [8, 16, 32, 64, 128, 256, 512, 1024],
    "long_prefill_token_threshold": [0, 256, 512, 1024, 2048, 4096],
}
BUDGETS = (50, 100, 300)


def workload(window_s: float):
    if AZURE.is_file():
        trace = window(load_trace(AZURE, "azure"), 0.0, window_s)
        return scale_rate(trace, factor=4.5), f"azure-conv first {window_s:g} s, rate x4.5"
    from studies.scenarios import SCENARIOS, build_trace

    return build_trace("saturation", SCENARIOS["saturation"]), "synthetic 'saturation' scenario (no ../shared)"


def make_spec(trials: int, seed: int, sampler: str) -> StudySpec:
    space = {"others": "fixed", **{k: {"choices": v} for k, v in GRID.items()}}
    return StudySpec(trace=Path("search-quality"), model="meta-llama/Llama-3.1-8B", gpu="h100",
                     slos=parse_slo("ttft:1000,tpot:50"), trials=trials, seed=seed, sampler=sampler, space=space,
                     batch_size=2)


def grid_values(evaluator: Evaluator, spec: StudySpec, limits: objectives.Bounds) -> np.ndarray:
    """Weighted goodput of every grid point (-inf where infeasible, as the study judges it), in
    itertools order."""
    base = spec.search_space.base
    configs = [base.replace(max_num_batched_tokens=b, max_num_seqs=s, long_prefill_token_threshold=t)
               for b in GRID["max_num_batched_tokens"] for s in GRID["max_num_seqs"]
               for t in GRID["long_prefill_token_threshold"]]
    values = []
    for i in range(0, len(configs), 16):
        for c, r in zip(configs[i:i + 16], evaluator.reports(configs[i:i + 16]), strict=True):
            feasible = evaluator.infeasibility(c) is None and all(
                v <= 0 for v in objectives.constraint_values(r, spec.constraints, limits).values())
            values.append(r.weighted_goodput if feasible else -np.inf)
    return np.array(values)


def best_within(study: optuna.Study, budget: int) -> float:
    values = [t.values[0] for t in study.get_trials(deepcopy=False) if t.number < budget
              and t.state == optuna.trial.TrialState.COMPLETE and objectives.is_feasible(t)]
    return max(values, default=-np.inf)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--window", type=float, default=600.0, help="seconds of the trace to use")
    parser.add_argument("--quick", action="store_true", help="300 s window, 2 seeds")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    seeds = 2 if args.quick else args.seeds
    trace, label = workload(300.0 if args.quick else args.window)
    cost = build("meta-llama/Llama-3.1-8B", "h100")
    spec = make_spec(max(BUDGETS), 0, "tpe")
    evaluator = Evaluator(spec, trace=trace, cost_model=cost, keep_results=0)
    limits = objectives.bounds(spec.constraints, spec.slos, evaluator.reports(list(evaluator.baselines().values())))
    t0 = time.perf_counter()
    grid = grid_values(evaluator, spec, limits)
    grid_s = time.perf_counter() - t0
    best = grid.max()
    ranked = np.sort(grid)[::-1]
    print(f"workload: {label}, {trace.n} requests; {cost.name}; SLO ttft:1000,tpot:50")
    print(f"grid: {len(grid)} points ({np.isfinite(grid).sum()} feasible) simulated in {grid_s:.1f} s; "
          f"best weighted goodput {best:.3f} req/s; median point {np.median(grid[np.isfinite(grid)]):.3f}")
    rows = []
    for sampler in ("tpe", "random"):
        for seed in range(seeds):
            s = make_spec(max(BUDGETS), seed, sampler)
            study = optuna.create_study(direction="maximize", sampler=make_sampler(s, seed))
            t0 = time.perf_counter()
            run(study, s, evaluator)
            found = {b: best_within(study, b) for b in BUDGETS}
            rows.append({"sampler": sampler, "seed": seed, "wall_s": time.perf_counter() - t0, **{
                str(b): {"best": v, "of_grid_best": v / best, "grid_rank": int(np.sum(ranked > v)) + 1}
                for b, v in found.items()}})
    lines = ["| sampler | seed | " + " | ".join(f"after {b}: % of grid best (rank)" for b in BUDGETS) + " |",
             "|---|---|" + "---|" * len(BUDGETS)]
    for r in rows:
        lines.append(f"| {r['sampler']} | {r['seed']} | " + " | ".join(
            f"{r[str(b)]['of_grid_best']:.1%} ({r[str(b)]['grid_rank']})" for b in BUDGETS) + " |")
    for sampler in ("tpe", "random"):
        mine = [r for r in rows if r["sampler"] == sampler]
        lines.append(f"| {sampler} mean | - | " + " | ".join(
            f"{np.mean([r[str(b)]['of_grid_best'] for r in mine]):.1%}" for b in BUDGETS) + " |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    header = (f"# Search quality\n\nCommand: `python benchmarks/search_quality.py{' --quick' if args.quick else ''}`\n\n"
              f"Workload: {label}, {trace.n} requests; {cost.name}; SLO ttft:1000,tpot:50. Grid: "
              f"{' x '.join(f'{k} {v}' for k, v in GRID.items())} = {len(grid)} points, "
              f"{np.isfinite(grid).sum()} feasible; best {best:.3f} req/s, median {np.median(grid[np.isfinite(grid)]):.3f}.\n")
    (args.out / "search_quality.md").write_text(header + "\n" + table + "\n")
    (args.out / "search_quality.json").write_text(json.dumps({"workload": label, "grid_best": best, "rows": rows},
                                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
