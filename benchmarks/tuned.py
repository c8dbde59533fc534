"""One study run in process as `servetune tune` runs it, for the benchmarks that score its outputs.

Each engine's study is timed with that engine's profiled op tables (the what-if target with
vLLM's), searched with the CLI's sampler, and its run folder written by
``optimizer.outputs.runfolder.write_run_outputs``: the summary is what `tune` prints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from optimizer.outputs.runfolder import write_run_outputs
from optimizer.search.evaluate import Evaluator
from optimizer.search.objective import objective_for
from optimizer.search.samplers import make_sampler
from optimizer.search.spec import StudySpec
from optimizer.search.study import enqueue_baselines, run

MODEL, GPU = "meta-llama/Llama-3.1-8B", "h100"


@dataclass(frozen=True)
class Tuned:
    spec: StudySpec
    evaluator: Evaluator
    study: optuna.Study
    summary: dict[str, Any]
    seconds: float  # search and outputs


def tune(trace_path: Path, name: str, engine: str, slos, *, trials: int, seed: int, holdout: float,
         run_dir: Path) -> Tuned:
    """``engine``'s study of the trace file at ``trace_path`` (its last ``holdout`` held out)."""
    spec = StudySpec(trace=trace_path, model=MODEL, gpu=GPU, slos=slos, trials=trials, seed=seed, batch_size=2,
                     engine=engine, holdout=holdout, framework=engine if engine != "servetune" else "vllm",
                     study_name=name, run_dir=run_dir)
    evaluator = Evaluator(spec)
    study = optuna.create_study(directions=list(objective_for(spec).directions), sampler=make_sampler(spec, seed))
    enqueue_baselines(study, spec, evaluator.baselines())
    start = time.perf_counter()
    run(study, spec, evaluator)
    summary = write_run_outputs(spec.run_dir, study, spec, evaluator).summary
    return Tuned(spec, evaluator, study, summary, time.perf_counter() - start)
