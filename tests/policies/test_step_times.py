"""The step-time histogram of the kernels against step times known in advance, and the
fleet's migration and hand-off counters."""

from __future__ import annotations

import numpy as np
import pytest

from policies.config import PolicyConfig
from policies.engine import simulate
from policies.fleet import simulate_fleet
from policies.result import (
    STEP_HIST_BINS,
    STEP_HIST_EDGES,
    STEP_HIST_MIN_S,
    STEP_HIST_REL_ERROR,
    State,
    step_time_bin,
    step_time_bin_values,
)
from studies.metrics import score
from studies.slo import SLOSet

from .conftest import cost_model, make_trace, poisson_trace

CONFIG = PolicyConfig(gpu_memory_utilization=1.0)
OVERHEAD_S = 0.004


def constant_cost():
    """Every step takes exactly OVERHEAD_S, whatever it computes."""
    return cost_model(20000, per_token_s=0.0, per_seq_s=0.0, per_kv_token_s=0.0, per_pair_s=0.0,
                      overhead_s=OVERHEAD_S)


def _close(value_ms: float, true_s: float) -> bool:
    return abs(value_ms / (true_s * 1e3) - 1.0) <= STEP_HIST_REL_ERROR + 1e-12


def test_bin_edges_round_as_the_bin_definition():
    """The kernels count a step by searching ``STEP_HIST_EDGES``: each edge opens its bin
    by ``step_time_bin``'s own rounding, and the float just below it lies in the bin before."""
    k = np.arange(1, STEP_HIST_BINS)
    assert STEP_HIST_EDGES[0] == STEP_HIST_MIN_S and np.all(np.diff(STEP_HIST_EDGES) > 0)
    assert [step_time_bin(e) for e in STEP_HIST_EDGES] == k.tolist()
    assert [step_time_bin(e) for e in np.nextafter(STEP_HIST_EDGES, 0.0)] == (k - 1).tolist()


@pytest.mark.parametrize("step_s", [STEP_HIST_EDGES[100], np.nextafter(STEP_HIST_EDGES[100], 0.0), 3e-6, 5e3])
def test_a_step_lands_in_the_bin_of_its_time(step_s):
    """A run whose every step takes exactly ``step_s``: all of them in ``step_time_bin(step_s)``
    (the underflow bin below the range, the overflow bin above it)."""
    trace = make_trace([0.0], [10], [20])
    cost = cost_model(20000, per_token_s=0.0, per_seq_s=0.0, per_kv_token_s=0.0, per_pair_s=0.0, overhead_s=step_s)
    hist = simulate(trace, cost, CONFIG).step_time_hist
    assert hist[step_time_bin(step_s)] == hist.sum() == 20


@pytest.mark.parametrize("fast_forward", ["0", "1"])
def test_constant_steps_fill_one_bin(monkeypatch, fast_forward):
    """Steps of one length, stepped one by one or fast-forwarded, all land in the bin
    holding it, and every percentile reads back within the stated error."""
    monkeypatch.setenv("SERVETUNE_ENGINE_FAST_FORWARD", fast_forward)
    trace = poisson_trace(200, rate=30.0, seed=5)
    result = simulate(trace, constant_cost(), CONFIG)
    hist = result.step_time_hist
    assert hist.shape == (STEP_HIST_BINS,) and hist.sum() == result.steps > 200
    (k,) = np.flatnonzero(hist)
    assert _close(step_time_bin_values()[k] * 1e3, OVERHEAD_S)
    rep = score(result, trace, SLOSet())
    assert rep.mean_step_ms == pytest.approx(OVERHEAD_S * 1e3)
    assert all(_close(v, OVERHEAD_S) for v in (rep.p50_step_ms, rep.p95_step_ms, rep.p99_step_ms))


def test_percentiles_match_known_step_times():
    """One request, a 1000-token prompt and 10 output tokens: one prefill step of 4 + 10 ms,
    then 9 decode steps of 4 + 0.01 ms (fast-forwarded). Nearest-rank percentiles of those
    ten times: p50 a decode, p95 and p99 the prefill."""
    trace = make_trace([0.0], [1000], [10])
    cost = cost_model(20000, per_token_s=1e-5, per_seq_s=0.0, per_kv_token_s=0.0, per_pair_s=0.0,
                      overhead_s=OVERHEAD_S)
    result = simulate(trace, cost, CONFIG)
    times = np.sort([OVERHEAD_S + 1000 * 1e-5] + [OVERHEAD_S + 1e-5] * 9)
    assert result.steps == 10 and result.busy_s == pytest.approx(times.sum())
    rep = score(result, trace, SLOSet())
    for q in (50, 95, 99):
        true = times[int(np.ceil(q / 100 * len(times))) - 1]
        assert _close(getattr(rep, f"p{q}_step_ms"), true), q


def test_fleet_sums_its_replicas_histograms():
    """Round robin over independent replicas: the fleet's histogram is the sum of each
    replica's run alone on its share (split and merge)."""
    trace = poisson_trace(150, rate=80.0, seed=6)
    cost = cost_model(3000)
    config = CONFIG.replace(router="round_robin")
    fleet = simulate_fleet(trace, cost, config, seed=2, replicas=3)
    alone = [simulate(trace.take(np.arange(j, trace.n, 3)), cost, config, seed=2) for j in range(3)]
    np.testing.assert_array_equal(fleet.step_time_hist, sum(a.step_time_hist for a in alone))
    assert fleet.step_time_hist.sum() == fleet.steps


def test_migrations_and_handoffs_are_counted():
    """Migration moves requests off a replica short of KV; every delivery beyond the
    arrivals is one. With P/D every delivery to the decode replica is a hand-off."""
    rng = np.random.default_rng(1)
    n = 80
    trace = make_trace(np.cumsum(rng.exponential(0.004, n)), rng.integers(20, 300, n), rng.integers(20, 200, n))
    config = PolicyConfig(gpu_memory_utilization=1.0, max_num_batched_tokens=256, block_size=16,
                          interconnect_gbps=1.0, migration=True)
    moved = simulate_fleet(trace, [cost_model(400), cost_model(2000), cost_model(2000)], config)
    assert np.all(moved.state == State.FINISHED)
    assert moved.migrations == moved.replica_routed.sum() - n >= 10 and moved.handoffs == 0
    assert score(moved, trace, SLOSet()).migrations == moved.migrations
    split = simulate_fleet(trace, cost_model(4000), PolicyConfig(gpu_memory_utilization=1.0, prefill_replicas=1),
                           replicas=2)
    assert split.handoffs == split.replica_routed[1] > 0 and split.migrations == 0
