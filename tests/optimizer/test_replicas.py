"""Replicas behind a round-robin router: the split, the exact merge, and the fleet's equivalence
to independent single replicas each at its share of the rate."""

import math

import numpy as np
import pytest

from costmodels.costmodel import CostModel
from costmodels.steptable import linear_tables
from optimizer.evaluate import Evaluator
from optimizer.replicas import merge_replicas, split_round_robin
from optimizer.space import Fleet
from optimizer.spec import load_spec
from policies import engine
from policies.config import PolicyConfig
from policies.result import SimResult, State
from tests.optimizer.tuning_helpers import make_trace, write_csv_trace


def test_split_sends_request_i_to_replica_i_mod_r():
    rows = split_round_robin(7, 3)
    assert [r.tolist() for r in rows] == [[0, 3, 6], [1, 4], [2, 5]]
    assert [r.tolist() for r in split_round_robin(4, 1)] == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="without traffic"):
        split_round_robin(2, 3)
    with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
        split_round_robin(5, 0)


def _fake_result(rng, n: int, *, t0: float, end_s: float, peak: int, cap: int) -> SimResult:
    state = rng.choice([State.FINISHED, State.REJECTED, State.TIMED_OUT], n).astype(np.int8)
    finished = state == State.FINISHED
    m = 4
    return SimResult(
        state=state, reject_reason=np.where(finished, 0, 2).astype(np.int8),
        first_token_s=rng.random(n), finish_s=rng.random(n) + 1, tokens_generated=rng.integers(1, 50, n),
        preemptions=rng.integers(0, 3, n).astype(np.int32), cached_prompt_tokens=rng.integers(0, 9, n),
        queue_s=rng.random(n), replica=np.where(finished, 0, -1).astype(np.int32),
        steps=int(rng.integers(10, 99)), busy_s=float(rng.random()), prefill_tokens_computed=int(rng.integers(99)),
        out_of_range_steps=int(rng.integers(5)), kv_capacity_blocks=cap, kv_peak_blocks=peak,
        series_t=t0 + np.arange(m, dtype=np.float64), series_kv_blocks=rng.integers(0, cap, m),
        series_running=rng.integers(0, 9, m), series_waiting=rng.integers(0, 9, m),
        swap_outs=int(rng.integers(5)), end_s=end_s,
    )


def test_merge_puts_every_replica_back_at_its_rows_and_totals_the_fleet():
    rng = np.random.default_rng(3)
    n = 11
    rows = split_round_robin(n, 3)
    subs = [_fake_result(rng, len(r), t0=0.5 * k, end_s=3.2 + k, peak=10 + k, cap=100) for k, r in enumerate(rows)]
    merged = merge_replicas(subs, rows, n)

    for k, (sub, idx) in enumerate(zip(subs, rows, strict=True)):
        for name in ("state", "reject_reason", "first_token_s", "finish_s", "tokens_generated", "preemptions",
                     "cached_prompt_tokens", "queue_s"):
            np.testing.assert_array_equal(getattr(merged, name)[idx], getattr(sub, name), err_msg=name)
            assert getattr(merged, name).dtype == getattr(sub, name).dtype
        np.testing.assert_array_equal(merged.replica[idx], np.where(sub.state == State.FINISHED, k, -1))
    for name in ("steps", "busy_s", "prefill_tokens_computed", "out_of_range_steps", "swap_outs"):
        assert getattr(merged, name) == pytest.approx(sum(getattr(s, name) for s in subs)), name
    assert merged.kv_capacity_blocks == 300 and merged.kv_peak_blocks == 10 + 11 + 12
    assert merged.end_s == 5.2

    # Series: union of sample times; each replica holds its last sample, 0 before its first
    # and after its end.
    np.testing.assert_array_equal(merged.series_t, np.unique(np.concatenate([s.series_t for s in subs])))
    for i, t in enumerate(merged.series_t):
        expected = 0
        for s in subs:
            latest = np.flatnonzero(s.series_t <= t)
            if len(latest) and t < s.end_s:
                expected += s.series_kv_blocks[latest[-1]]
        assert merged.series_kv_blocks[i] == expected, t


def test_merge_refuses_rows_that_do_not_cover_each_request_once():
    rng = np.random.default_rng(0)
    subs = [_fake_result(rng, 2, t0=0, end_s=1, peak=1, cap=5) for _ in range(2)]
    with pytest.raises(ValueError, match="exactly once"):
        merge_replicas(subs, [np.array([0, 1]), np.array([1, 2])], 4)
    with pytest.raises(ValueError, match="replica 1: result has 2 requests but 3 rows"):
        merge_replicas(subs, [np.array([0, 1]), np.array([2, 3, 4])], 5)
    with pytest.raises(ValueError, match="one result per replica"):
        merge_replicas(subs, [np.array([0, 1])], 2)


def _one_replica_trace(n=60, gap_s=0.05):
    rng = np.random.default_rng(11)
    trace = make_trace(n, gap_s=gap_s)
    output = rng.integers(5, 60, n)
    return trace.replace(prompt_tokens=rng.integers(20, 400, n), output_tokens=output, max_tokens=output + 10)


def _interleaved(base, replicas: int):
    """Request i*R + r is base request i, arriving r*gap/R later: R x the base rate."""
    gap = float(base.arrival_s[1] - base.arrival_s[0])
    order = np.repeat(np.arange(base.n), replicas)
    shift = np.tile(np.arange(replicas) * gap / replicas, base.n)
    fleet = base.take(order)
    return fleet.replace(arrival_s=fleet.arrival_s + shift)


def _cost_model():
    # 1 ms + 0.05 ms per token: a 60-request stream at 20 req/s queues on one replica.
    tables = linear_tables(per_token_s=5e-5, per_seq_s=0.0, per_kv_token_s=0.0, per_pair_s=0.0, overhead_s=1e-3)
    return CostModel.synthetic(20_000, tables=tables)


def test_r_replicas_at_r_times_the_rate_each_behave_like_one_replica_at_the_base_rate(tmp_path):
    replicas = 3
    base = _one_replica_trace()
    fleet_trace = _interleaved(base, replicas)
    config = PolicyConfig(max_num_batched_tokens=512, max_num_seqs=8, gpu_memory_utilization=1.0)
    spec = load_spec(trace=write_csv_trace(tmp_path / "t.csv", fleet_trace), model="synthetic", gpu="h100",
                     slo="ttft:20,tpot:2", replicas=replicas, run_dir=tmp_path / "run", seed=4)
    evaluator = Evaluator(spec, trace=fleet_trace, cost_model=_cost_model())
    result, report = evaluator.simulate(config)

    alone = [engine.simulate(base, _cost_model(), config, seed=4 + r) for r in range(replicas)]
    for r, rows in enumerate(split_round_robin(fleet_trace.n, replicas)):
        arrival = fleet_trace.arrival_s[rows]
        np.testing.assert_array_equal(result.state[rows], alone[r].state)
        np.testing.assert_array_equal(result.tokens_generated[rows], alone[r].tokens_generated)
        for name in ("first_token_s", "finish_s"):
            np.testing.assert_allclose(getattr(result, name)[rows] - arrival,
                                       getattr(alone[r], name) - base.arrival_s, atol=1e-9, err_msg=name)
        assert set(result.replica[rows]) <= {r, -1}
    alone_report = evaluator.scorer(alone[0], base, spec.slos)
    assert report.slo_attainment == alone_report.slo_attainment
    assert 0 < report.slo_attainment < 1  # the load is real: some requests miss
    assert result.kv_capacity_blocks == replicas * alone[0].kv_capacity_blocks

    # The same traffic on one replica is worse: the fleet's replicas really share the load.
    single, single_report = evaluator.simulate(config, fleet=Fleet(replicas=1))
    assert single_report.slo_attainment < report.slo_attainment
    assert set(single.replica) <= {0, -1}


def test_fleets_are_cached_apart_and_extra_replicas_are_pruned(tmp_path):
    trace = _one_replica_trace(n=30)
    spec = load_spec(trace=write_csv_trace(tmp_path / "t.csv", trace), model="synthetic", gpu="h100",
                     slo="ttft:150", run_dir=tmp_path / "run")
    evaluator = Evaluator(spec, trace=trace, cost_model=_cost_model())
    config = PolicyConfig(gpu_memory_utilization=1.0)
    one, two = evaluator.reports([config, config], fleets=[Fleet(replicas=1), Fleet(replicas=2)])
    assert evaluator.simulations == 2 and one is not two
    evaluator.reports([config], fleets=[Fleet(replicas=2)])
    assert evaluator.simulations == 2
    assert "exceeds the trace's 30 requests" in evaluator.infeasibility(config, Fleet(replicas=31))
    assert evaluator.infeasibility(config, Fleet(replicas=30)) is None
    assert math.isfinite(two.weighted_goodput)
