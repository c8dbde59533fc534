"""Shared pieces for the search tests: tiny traces, a fake engine and scorer.

The fake engine returns each config as its "result" and the fake scorer turns it into a
Report from a closed-form goodput, so the study's bookkeeping (budget, baselines,
constraints, pruning, resume) is tested in milliseconds without the kernel.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import numpy as np
import optuna

from costmodels.costmodel import CostModel
from costmodels.steptable import linear_tables
from studies.metrics import Report
from studies.traces import Trace, write_trace


def make_trace(n: int = 50, *, gap_s: float = 0.1, prompt: int = 100, output: int = 20) -> Trace:
    return Trace(
        arrival_s=np.arange(n) * gap_s, prompt_tokens=np.full(n, prompt), output_tokens=np.full(n, output),
        max_tokens=np.full(n, output), tenant=np.zeros(n, np.int32), priority=np.zeros(n, np.int32),
        slo_class=np.zeros(n, np.int32), deadline_s=np.full(n, np.nan),
        block_offsets=np.zeros(n + 1, np.int64), block_hashes=np.zeros(0, np.int64),
    )


def write_csv_trace(path: Path, trace: Trace | None = None) -> Path:
    return write_trace(trace if trace is not None else make_trace(), path)


def burst_trace(n: int = 200) -> Trace:
    """n identical requests at t=0: 10 prompt tokens, 100 output tokens."""
    return make_trace(n, gap_s=0.0, prompt=10, output=100)


def burst_cost_model() -> CostModel:
    """Step = 2 ms + 0.1 ms per token: a decode batch of S takes 2 + 0.1 S ms.

    With a TPOT bound of 7.05 ms on ``burst_trace``, max_num_seqs = 50 is the unique best:
    larger batches break TPOT, smaller ones need more waves.
    """
    tables = linear_tables(per_token_s=1e-4, per_seq_s=0.0, per_kv_token_s=0.0, per_pair_s=0.0, overhead_s=2e-3)
    return CostModel.synthetic(1_000_000, tables=tables)


def fake_report(goodput: float, **values) -> Report:
    data = {}
    for f in fields(Report):
        if f.name in values:
            data[f.name] = values[f.name]
        elif f.type in ("int",):
            data[f.name] = 0
        elif f.type.startswith("dict"):
            data[f.name] = {}
        elif f.type.startswith("list"):
            data[f.name] = []
        else:
            data[f.name] = 0.0
    derived = dict(weighted_goodput=goodput, request_goodput=goodput, token_goodput=goodput * 10,
                   slo_attainment=min(1.0, goodput / 100))
    data.update({k: v for k, v in derived.items() if k not in values})
    return Report(**data)


def fake_goodput(config) -> float:
    """Peaks at max_num_batched_tokens = 2048 and max_num_seqs = 128 (log scale)."""
    return 100.0 - 5 * (math.log2(config.max_num_batched_tokens) - 11) ** 2 \
        - 5 * (math.log2(config.max_num_seqs) - 7) ** 2


class FakeEngine:
    """Engine stand-in: the 'result' is the config itself; counts simulations."""

    def __init__(self, fail_on_call: int | None = None, error: type[BaseException] = KeyboardInterrupt):
        self.calls = 0
        self.simulated = []
        self.fail_on_call = fail_on_call
        self.error = error

    def simulate(self, trace, cost_model, config, seed=0):
        return self.simulate_many(trace, cost_model, [config], seed)[0]

    def simulate_many(self, trace, cost_model, configs, seed=0):
        self.calls += 1
        if self.fail_on_call is not None and self.calls >= self.fail_on_call:
            raise self.error()
        self.simulated.extend(configs)
        return list(configs)


def fake_score(result, trace, slos) -> Report:
    rejected = 0.5 if result.max_wait_s > 0 else 0.0
    return fake_report(fake_goodput(result), rejected_fraction=rejected, p99_ttft_ms=100.0,
                       preemption_rate=0.0)


def sampled(space, n=60, seed=0):
    """(config, params) of n random-sampler trials of ``space``."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out = []
    for _ in range(n):
        trial = study.ask()
        out.append((space.suggest(trial), dict(trial.params)))
        study.tell(trial, 0.0)
    return out
