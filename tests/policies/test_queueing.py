"""Queueing sanity: one request at a time with deterministic service is an M/D/1 queue."""

from __future__ import annotations

import numpy as np
import pytest

from policies.config import PolicyConfig
from policies.engine import simulate

from .conftest import cost_model, make_trace

SERVICE_S = 0.01  # every request is one step of pure overhead


@pytest.fixture(scope="module")
def md1():
    rho = 0.8
    rate = rho / SERVICE_S
    n = 60_000
    rng = np.random.default_rng(11)
    arrival = np.cumsum(rng.exponential(1.0 / rate, n))
    # output 1: the prefill step emits the only token, so each request is one step of SERVICE_S
    trace = make_trace(arrival, rng.integers(1, 50, n), np.ones(n, dtype=np.int64))
    cost = cost_model(100_000, per_token_s=0.0, per_seq_s=0.0, per_kv_token_s=0.0, per_pair_s=0.0,
                      overhead_s=SERVICE_S)
    config = PolicyConfig(max_num_seqs=1, gpu_memory_utilization=1.0)
    return rho, rate, trace, simulate(trace, cost, config, series_every_s=0.05)


def test_mean_wait_matches_md1_formula(md1):
    rho, rate, _, result = md1
    expected = rho * SERVICE_S / (2.0 * (1.0 - rho))  # Pollaczek-Khinchine with zero service variance
    assert np.all(result.state == 0)
    np.testing.assert_allclose(result.busy_s, result.steps * SERVICE_S)
    assert abs(result.queue_s.mean() / expected - 1.0) < 0.03


def test_littles_law_on_the_sampled_queue(md1):
    """Time-average waiting count (sampled by the engine) = arrival rate x mean wait in the queue.

    The engine sees an arrival at the next step boundary; by PASTA a fraction rho of
    arrivals land in a busy step and wait on average half of it before joining, so the
    engine's queue holds each request for ``queue_s - rho * D / 2`` on average.
    """
    rho, _, trace, result = md1
    span = result.end_s - trace.arrival_s[0]
    throughput = trace.n / span
    in_engine_queue = result.queue_s.mean() - rho * SERVICE_S / 2.0
    sampled = result.series_waiting.mean()
    assert abs(sampled / (throughput * in_engine_queue) - 1.0) < 0.05
