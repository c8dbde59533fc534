"""Tuner speed: where a study's wall time goes, per hundred trials, today's loop against the old one.

For each workload (the README's sample at x0.3; the whole Azure 2023 conversation trace when
../shared has it) a vLLM study of ``--trials`` trials runs on a journal in a temporary folder,
timed in parts: the engine (simulate + score), the sampler (TPE's ask: relative and
independent sampling, with the storage reads it makes) and the storage (journal appends and
reads outside the sampler). Rows are cumulative at every hundred trials, so growth with the
study's size shows. Today's loop asks the next batch while one simulates, so the engine's
share and the sampler's overlap: "engine" is the share of wall time the engine was busy, and
the shares can sum to more than 100%.

Each study runs twice in the same process: with the loop as ``servetune tune`` runs it, and
with the loop before issue 49 (Optuna's TPE over the whole history with its scalar log-CDF,
one journal append per record, one batch at a time), the baseline measured in the same run.
Then the engine alone replays the same configs, so the ratio tuner wall / engine alone says
what the search loop costs on top of simulating.

    python benchmarks/tuner_speed.py [--trials 1000] [--workloads sample,azure]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import optuna  # noqa: E402
from optuna.samplers._tpe import _truncnorm  # noqa: E402

from optimizer.search import samplers  # noqa: E402
from optimizer.search.evaluate import Evaluator  # noqa: E402
from optimizer.search.ownership import OwnedJournalStorage  # noqa: E402
from optimizer.search.spec import load_spec  # noqa: E402
from optimizer.search.study import create_or_resume, enqueue_baselines, run  # noqa: E402
from policies.config import PolicyConfig  # noqa: E402
from policies.engine import simulate_many, warmup  # noqa: E402

SHARED = Path(os.environ.get("SERVETUNE_SHARED", ROOT / ".." / "shared"))
WORKLOADS = {
    "sample": (ROOT / "studies" / "data" / "mooncake_conversation_300s.parquet", 0.3),
    "azure": (SHARED / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv", None),
}
OPTUNA_LOG_NDTR = np.frompyfunc(_truncnorm._log_ndtr_single, 1, 1)
SAMPLER_CALLS = ("infer_relative_search_space", "sample_relative", "sample_independent")


@dataclass
class Clock:
    """Seconds spent in the sampler and in the journal (outside the sampler)."""

    sampler: float = 0.0
    storage: float = 0.0
    _in_sampler: bool = False

    def sampler_call(self, fn):
        def timed(*args, **kwargs):
            self._in_sampler, start = True, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sampler += time.perf_counter() - start
                self._in_sampler = False
        return timed

    def storage_call(self, fn):
        def timed(*args, **kwargs):
            if self._in_sampler:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.storage += time.perf_counter() - start
        return timed


@dataclass
class Row:
    trials: int
    wall: float
    engine: float
    sampler: float
    storage: float


@dataclass
class Outcome:
    rows: list[Row] = field(default_factory=list)
    configs: list[PolicyConfig] = field(default_factory=list)
    best: float = 0.0


@contextlib.contextmanager
def old_loop():
    """The loop before issue 49, with ``study(before=True)``: Optuna's own scalar log-CDF, one append per
    journal record (and TPE over the whole history, one batch at a time)."""
    saved_log_ndtr, saved_one_append = _truncnorm._log_ndtr, OwnedJournalStorage.one_append
    _truncnorm._log_ndtr = lambda a: OPTUNA_LOG_NDTR(a).astype(float)
    samplers_vectorise, samplers.vectorise_tpe_log_ndtr = samplers.vectorise_tpe_log_ndtr, lambda: False
    OwnedJournalStorage.one_append = lambda self: contextlib.nullcontext()
    try:
        yield
    finally:
        _truncnorm._log_ndtr, OwnedJournalStorage.one_append = saved_log_ndtr, saved_one_append
        samplers.vectorise_tpe_log_ndtr = samplers_vectorise


def study(trace: Path, rate_scale: float | None, trials: int, folder: Path,
          *, before: bool = False) -> tuple[Outcome, Evaluator]:
    spec = load_spec(trace=trace, model="meta-llama/Llama-3.1-8B", gpu="h100", slo="ttft:2000,tpot:100",
                     rate_scale=rate_scale, trials=trials, run_dir=folder, engine="vllm",
                     sampler="tpe-full" if before else "tpe")
    evaluator = Evaluator(spec)
    opened = create_or_resume(spec)
    enqueue_baselines(opened, spec, evaluator.baselines())
    clock = Clock()
    for name in SAMPLER_CALLS:
        setattr(opened.sampler, name, clock.sampler_call(getattr(opened.sampler, name)))
    backend = opened._storage._backend
    backend.append_logs = clock.storage_call(backend.append_logs)
    backend.read_logs = clock.storage_call(backend.read_logs)
    outcome = Outcome()
    start, engine_start = time.perf_counter(), evaluator.engine_seconds

    def on_trial(_frozen, stats) -> None:
        if stats.told % 100 == 0 or stats.told == trials:
            outcome.rows.append(Row(stats.told, time.perf_counter() - start, evaluator.engine_seconds - engine_start,
                                    clock.sampler, clock.storage))

    run(opened, spec, evaluator, on_trial=on_trial, overlap=not before)
    done = [t for t in opened.get_trials() if "report" in t.user_attrs]
    outcome.configs = [PolicyConfig.from_mapping(t.user_attrs["config"]) for t in done]
    outcome.best = max(float(t.user_attrs["report"].get("weighted_goodput") or 0.0) for t in done)
    return outcome, evaluator


def engine_alone(evaluator: Evaluator, configs: list[PolicyConfig]) -> float:
    start = time.perf_counter()
    for i in range(0, len(configs), evaluator.spec.batch_size):
        simulate_many(evaluator.trace, evaluator.cost_model, configs[i:i + evaluator.spec.batch_size],
                      seed=evaluator.spec.seed)
    return time.perf_counter() - start


def show(label: str, outcome: Outcome, alone: float) -> None:
    print(f"  {label}: best weighted goodput {outcome.best:.4f}; engine alone on its {len(outcome.configs)} "
          f"configs {alone:.1f} s; tuner wall / engine alone {outcome.rows[-1].wall / alone:.2f}x")
    print("    trials |  wall s | trials/s | engine | sampler | storage | last 100: s/trial, sampler ms/trial")
    previous = Row(0, 0.0, 0.0, 0.0, 0.0)
    for r in outcome.rows:
        n = r.trials - previous.trials
        print(f"    {r.trials:6d} | {r.wall:7.1f} | {r.trials / r.wall:8.2f} | {100 * r.engine / r.wall:5.0f}% | "
              f"{100 * r.sampler / r.wall:6.0f}% | {100 * r.storage / r.wall:6.0f}% | "
              f"{(r.wall - previous.wall) / n:.3f}, {1000 * (r.sampler - previous.sampler) / n:.1f}")
        previous = r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--workloads", default="sample,azure", help="comma-separated: " + ", ".join(WORKLOADS))
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warmup()
    for name in args.workloads.split(","):
        trace, rate_scale = WORKLOADS[name]
        if not trace.is_file():
            print(f"{name}: {trace} not found, skipped")
            continue
        print(f"{name}: {trace.name}" + (f" x{rate_scale:g}" if rate_scale else "") + f", {args.trials} trials")
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            results["today"] = study(trace, rate_scale, args.trials, Path(tmp) / "today")
            with old_loop():
                results["before issue 49"] = study(trace, rate_scale, args.trials, Path(tmp) / "old", before=True)
        for label, (outcome, evaluator) in results.items():
            show(label, outcome, engine_alone(evaluator, outcome.configs))
        today, old = results["today"][0].rows[-1], results["before issue 49"][0].rows[-1]
        print(f"  wall, before / today: {old.wall / today.wall:.2f}x")


if __name__ == "__main__":
    main()
