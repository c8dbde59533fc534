"""Search quality: what the tuner finds per trial and per second of search.

``--part grid`` (the default): the exhaustive grid's best vs what the tuner finds after 50,
100, 300 trials. A small space (max_num_batched_tokens x max_num_seqs x long_prefill_token_threshold, 384
points) on the Azure conversation trace at its knee (first ``--window`` s, rate x4.5),
Llama-3.1-8B on one H100, SLO ttft:1000,tpot:50. Every grid point is simulated; then the
tuner (TPE, as ``servetune tune`` configures it, over exactly the grid's values, without
enqueued baselines) and, as the baseline measured in the same run, random search each run
300 trials for several seeds. Prints the best feasible weighted goodput found within the
first 50, 100 and 300 trials as a share of the grid optimum, and its rank in the grid.
Falls back to a synthetic chat workload when ../shared is absent.

``--part samplers``: the study as ``servetune tune`` runs it (the README's flags, the whole
search space, the defaults enqueued) on the README's sample at x0.3 and on the whole Azure
2023 conversation trace, for each sampler and loop choice, ``--seeds`` seeds, each stopped
after ``--seconds`` of search. Prints the best feasible weighted goodput found after N trials
and after T seconds, as a share of the best any run found on that workload; the choices are
today's default (TPE with a bounded history past 525 trials, the next batch asked while one
simulates), the loop before (TPE over the whole history, one batch at a time) and random
search, the seeds of every choice interleaved.

    python benchmarks/search_quality.py [--quick] [--seeds 3]
    python benchmarks/search_quality.py --part samplers [--seconds 75] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402
from tuner_speed import WORKLOADS as SPEED_WORKLOADS  # noqa: E402

from costmodels import build  # noqa: E402
from optimizer.search import objective as objectives  # noqa: E402
from optimizer.search.evaluate import Evaluator  # noqa: E402
from optimizer.search.samplers import make_sampler  # noqa: E402
from optimizer.search.spec import StudySpec, load_spec  # noqa: E402
from optimizer.search.study import enqueue_baselines, run  # noqa: E402
from policies.engine import warmup  # noqa: E402
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
    parser.add_argument("--part", choices=("grid", "samplers"), default="grid")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--window", type=float, default=600.0, help="seconds of the trace to use (grid)")
    parser.add_argument("--quick", action="store_true", help="grid: 300 s window, 2 seeds")
    parser.add_argument("--seconds", type=float, default=75.0, help="search time per run (samplers)")
    parser.add_argument("--workloads", default="sample,azure-x3", help="samplers: comma-separated, of " + ", ".join(WORKLOADS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.part == "samplers":
        samplers_part(args)
        return
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


# -- samplers: the tune study per second of search -------------------------------------------
CHOICES = {  # label: (sampler, next batch asked while one simulates)
    "tpe, overlapped (default)": ("tpe", True),
    "tpe-full, one batch at a time (before)": ("tpe-full", False),
    "random, overlapped": ("random", True),
}
#: (trace, rate scale): the README's sample, and Azure conversation past its knee (issue 44's x3)
WORKLOADS = {"sample": SPEED_WORKLOADS["sample"], "azure-x3": (SPEED_WORKLOADS["azure"][0], 3.0)}
AFTER_TRIALS = (100, 300, 1000)
AFTER_SECONDS = (15, 30, 60)


def search(workload: str, label: str, seed: int, seconds: float, folder: Path) -> list[tuple[float, int, float]]:
    """(seconds, trials told, best feasible weighted goodput so far) after every trial."""
    trace, rate_scale = WORKLOADS[workload]
    sampler, overlap = CHOICES[label]
    spec = load_spec(trace=trace, model="meta-llama/Llama-3.1-8B", gpu="h100", slo="ttft:2000,tpot:100",
                     rate_scale=rate_scale, trials=100_000, run_dir=folder, engine="vllm", seed=seed, sampler=sampler)
    evaluator = Evaluator(spec)
    study = optuna.create_study(directions=["maximize"], sampler=make_sampler(spec, seed))
    enqueue_baselines(study, spec, evaluator.baselines())
    path: list[tuple[float, int, float]] = []
    best = -np.inf
    start = time.perf_counter()

    def on_trial(frozen, stats) -> None:
        nonlocal best
        if frozen.state == optuna.trial.TrialState.COMPLETE and objectives.is_feasible(frozen):
            best = max(best, frozen.values[0])
        path.append((time.perf_counter() - start, stats.told, best))

    run(study, spec, evaluator, on_trial=on_trial, stop=lambda: time.perf_counter() - start >= seconds,
        overlap=overlap)
    return path


def at(path, *, trials: int | None = None, seconds: float | None = None) -> float:
    """Best so far after ``trials`` trials or ``seconds`` of search (nan: the run never got there)."""
    reached = [best for t, n, best in path if (trials is not None and n <= trials) or
               (seconds is not None and t <= seconds)]
    if trials is not None and path[-1][1] < trials or seconds is not None and path[-1][0] < seconds:
        return float("nan")
    return reached[-1] if reached else -np.inf


def samplers_part(args) -> None:
    warmup()
    lines, data = [], {}
    for workload in args.workloads.split(","):
        if not WORKLOADS[workload][0].is_file():
            print(f"{workload}: not found, skipped")
            continue
        runs = {}
        for seed in range(args.seeds):
            for label in CHOICES:  # interleaved, so a slower spell of the machine hits every choice
                with tempfile.TemporaryDirectory() as tmp:
                    runs[label, seed] = search(workload, label, seed, args.seconds, Path(tmp))
                path = runs[label, seed]
                print(f"  {workload} {label} seed {seed}: {path[-1][1]} trials in {path[-1][0]:.0f} s, "
                      f"best {path[-1][2]:.4f}", flush=True)
        top = max(p[-1][2] for p in runs.values())
        head = ([f"after {n} trials" for n in AFTER_TRIALS] + [f"after {s} s" for s in AFTER_SECONDS])
        lines += [f"\n{workload} ({WORKLOADS[workload][0].name}" + (f" x{WORKLOADS[workload][1]:g}" if
                  WORKLOADS[workload][1] else "") + f"): best found by any run {top:.4f}; mean over {args.seeds} "
                  "seeds of the best found, as a share of it (trials per second in the last column)\n",
                  "| choice | " + " | ".join(head) + " | trials/s |", "|---|" + "---|" * (len(head) + 1)]
        for label in CHOICES:
            paths = [runs[label, seed] for seed in range(args.seeds)]
            cells = [np.mean([at(p, trials=n) for p in paths]) for n in AFTER_TRIALS] + \
                    [np.mean([at(p, seconds=s) for p in paths]) for s in AFTER_SECONDS]
            rate = np.mean([p[-1][1] / p[-1][0] for p in paths])
            lines.append(f"| {label} | " + " | ".join("-" if np.isnan(c) else f"{c / top:.2%}" for c in cells)
                         + f" | {rate:.1f} |")
        data[workload] = {"top": top, "runs": {f"{label} / seed {seed}": p[::max(1, len(p) // 400)]
                                               for (label, seed), p in runs.items()}}
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    header = (f"# Search quality per second: sampler and loop choices\n\nCommand: `python benchmarks/"
              f"search_quality.py --part samplers --seconds {args.seconds:g} --seeds {args.seeds}`\n\n"
              "The study `servetune tune` runs (vLLM, the README's model, GPU and SLOs, defaults enqueued), "
              f"each run stopped after {args.seconds:g} s of search; '-': no run of the choice got that far.\n")
    (args.out / "search_quality_samplers.md").write_text(header + table + "\n")
    (args.out / "search_quality_samplers.json").write_text(json.dumps(data) + "\n")


if __name__ == "__main__":
    main()
