"""The resumable replica (``policies.engine`` replica interface): driving it in pieces
(deliveries as time passes, advances to limits) gives exactly the single-run result, an
idle replica's clock moves to the limit, and the router summary counts what it holds."""

import numpy as np
import pytest

from policies import engine
from policies.config import PolicyConfig

from .conftest import cost_model, make_trace, new_replica, poisson_trace

CONFIGS = {
    "vllm": PolicyConfig(gpu_memory_utilization=1.0, max_num_batched_tokens=256),
    "sglang-swap": PolicyConfig(gpu_memory_utilization=1.0, schedule_mode="prefill_first",
                                admission_mode="new_token_ratio", preemption_mode="swap", block_size=1),
    "edf-max-wait": PolicyConfig(gpu_memory_utilization=1.0, scheduling_policy="edf", max_wait_s=0.4,
                                 admission_mode="predicted"),
}




def _result(trace, rep, weights):
    bufs = engine.output_buffers(1, trace.n, len(weights))
    engine.write_outputs(rep, *(b[0] for b in bufs))
    return engine.sim_result(trace, *(b[0] for b in bufs), weights)


def _same(a, b):
    for name in ("state", "reject_reason", "first_token_s", "finish_s", "tokens_generated", "preemptions",
                 "cached_prompt_tokens", "series_t", "series_kv_blocks", "series_running", "series_waiting"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert (a.steps, a.busy_s, a.kv_peak_blocks, a.swap_outs, a.end_s) == (b.steps, b.busy_s, b.kv_peak_blocks,
                                                                          b.swap_outs, b.end_s)


def _trace():
    base = poisson_trace(120, rate=60.0, seed=3)
    deadline = base.arrival_s + np.where(np.arange(base.n) % 4 == 0, 0.6, np.nan)
    return base.replace(deadline_s=deadline)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_delivering_at_each_arrival_and_advancing_in_pieces_equals_one_run(name):
    """The fleet's loop on one replica: advance to each event (every arrival, and ticks
    every 50 ms that split steps and fast-forward stretches), then deliver what arrives."""
    trace, cost, config = _trace(), cost_model(3000, host_tokens=800), CONFIGS[name]
    whole = engine.simulate(trace, cost, config)
    rep, st, weights = new_replica(trace, cost, config)
    cfg = config.to_vector()
    ticks = np.arange(trace.arrival_s[0], trace.arrival_s[-1], 0.05)
    r = 0
    for t_event in np.union1d(ticks, trace.arrival_s):
        engine.advance(rep, st, cost.tables, cfg, t_event)
        assert engine.clock(rep) >= t_event, "an advance ends at or past its limit"
        while r < trace.n and trace.arrival_s[r] == t_event:
            engine.deliver(rep, r, t_event)
            r += 1
    engine.advance(rep, st, cost.tables, cfg, np.inf)
    _same(_result(trace, rep, weights), whole)


def test_an_idle_replica_moves_its_clock_to_the_limit():
    trace = make_trace([0.0, 5.0], [40, 40], [3, 3])
    cost, config = cost_model(), CONFIGS["vllm"]
    rep, st, _ = new_replica(trace, cost, config)
    engine.deliver(rep, 0, 0.0)
    engine.advance(rep, st, cost.tables, config.to_vector(), 1.0)
    assert engine.outstanding(rep) == 0 and engine.clock(rep) == 1.0
    engine.deliver(rep, 1, 5.0)
    engine.advance(rep, st, cost.tables, config.to_vector(), 3.0)
    assert engine.clock(rep) == 3.0 and engine.waiting(rep) == 1, "delivered for later: still in the inbox"


def test_summary_counts_inbox_queue_and_running_requests():
    n = 6
    trace = make_trace(np.zeros(n), [100] * n, [50] * n)
    cost = cost_model(kv_tokens=400)
    config = PolicyConfig(gpu_memory_utilization=1.0, max_num_batched_tokens=64, block_size=16)
    rep, st, _ = new_replica(trace, cost, config)
    cfg = config.to_vector()
    for r in range(n):
        engine.deliver(rep, r, 0.0)
    assert (engine.outstanding(rep), engine.running(rep), engine.waiting(rep)) == (n, 0, n)
    assert engine.queued_tokens(rep, st) == 100 * n
    assert engine.head_demand_blocks(rep, st, cfg) == 7  # ceil(100 / 16)
    assert engine.free_blocks(rep) == 25 and engine.headroom_blocks(rep) == 0
    engine.advance(rep, st, cost.tables, cfg, 1e-9)  # exactly one step: 64 tokens of request 0
    assert (engine.running(rep), engine.waiting(rep)) == (1, n - 1)
    assert engine.queued_tokens(rep, st) == 100 * (n - 1)
    assert engine.free_blocks(rep) == 25 - 4
    assert engine.cached_tokens(rep, st, 1) == 0, "no prefix hashes: nothing cached"


def test_deliveries_must_not_go_back_in_time():
    trace = make_trace([0.0, 1.0], [10, 10], [2, 2])
    rep, _, _ = new_replica(trace, cost_model(), CONFIGS["vllm"])
    engine.deliver(rep, 1, 1.0)
    with pytest.raises(ValueError, match="must not decrease"):
        engine.deliver(rep, 0, 0.5)
