"""SJF orders by the scheduler's output estimate, never by the true output length.

Without a predictor the scheduler knows only the caps; when every client leaves the cap
to the engine (context less the prompt) and prompts are equal, all jobs look alike and
SJF is FCFS. Only the oracle (an upper bound, never a default) lets it pick short jobs.
"""

from __future__ import annotations

import numpy as np
import pytest

from policies.config import PolicyConfig
from policies.engine import simulate
from studies.lengths import Predictor, with_client_caps
from studies.metrics import score
from studies.slo import parse_slo
from studies.traces import Trace

from .conftest import cost_model, make_trace
from .test_engine_reference import PER_REQUEST, assert_matches_reference

CONTEXT = 4096
BURSTS, LONG, SHORT = 10, 4, 8


def convoy_trace() -> Trace:
    """Bursts of 4 long (2000-token) answers then 8 short (8-token) ones, equal prompts, no
    caps in the "file": a convoy FCFS cannot avoid on a 4-sequence replica."""
    per = LONG + SHORT
    arrival = (np.arange(BURSTS)[:, None] * 15.0 + np.arange(per)[None, :] * 1e-3).ravel()
    output = np.tile(np.r_[np.full(LONG, 2000), np.full(SHORT, 8)], BURSTS)
    return Trace.from_columns(arrival, np.full(len(arrival), 100), output)


def test_sjf_gains_only_from_an_oracle_not_from_equal_caps():
    capped = with_client_caps(convoy_trace(), context_len=CONTEXT)
    assert np.all(capped.max_tokens == CONTEXT - 100)
    cost, slo = cost_model(kv_tokens=1 << 16), parse_slo("ttft:1000")

    def run(policy, predictor):
        trace = Predictor.parse(predictor).apply(capped, seed=0)
        result = simulate(trace, cost, PolicyConfig(scheduling_policy=policy, max_num_seqs=4, max_model_len=CONTEXT))
        return result, score(result, trace, slo)

    fcfs, fcfs_report = run("fcfs", "cap")
    blind, blind_report = run("sjf", "cap")
    oracle, oracle_report = run("sjf", "oracle")
    # equal caps: SJF has nothing to order by and replays FCFS exactly
    for name in PER_REQUEST:
        np.testing.assert_array_equal(getattr(blind, name), getattr(fcfs, name), err_msg=name)
    assert blind_report.request_goodput == pytest.approx(fcfs_report.request_goodput, rel=0.01)
    # FCFS: only the long heads of each burst start in time; the shorts wait behind them
    assert fcfs_report.n_good == BURSTS * LONG
    # the oracle serves the shorts first, and the longs still start within the SLO
    assert oracle_report.n_good == BURSTS * (LONG + SHORT)
    assert oracle_report.request_goodput > 2.5 * fcfs_report.request_goodput
    assert oracle_report.p90_ttft_ms < 1000 < fcfs_report.p90_ttft_ms


def test_kernel_equals_reference_when_estimates_differ_from_caps():
    rng = np.random.default_rng(2)
    n = 60
    output = rng.integers(1, 300, n)
    trace = make_trace(np.cumsum(rng.exponential(0.01, n)), rng.integers(20, 300, n), output,
                       max_tokens=output + rng.integers(0, 200, n))
    for predictor in ("cap", "noisy:0.8", "oracle"):
        shaped = Predictor.parse(predictor).apply(trace, seed=4)
        for variant in (dict(), dict(enable_prefix_caching=True, aging_rate=0.5), dict(admission_mode="reservation")):
            config = PolicyConfig(gpu_memory_utilization=1.0, block_size=4, max_num_batched_tokens=256,
                                  max_num_seqs=8, scheduling_policy="sjf", **variant)
            assert_matches_reference(shaped, cost_model(4000), config)
