"""Attention-DP ranks stepping together (``policies.engine.lockstep``): the jitted fleet
against the reference's ``advance_group``, what lockstep does to a rank's timing, and the
rules around it (P/D refused, failures by whole instance)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from costmodels.costmodel import CostModel
from costmodels.steptable import linear_step_seconds, linear_tables, step_seconds
from policies.config import ConfigError, PolicyConfig, check_fleet
from policies.failures import FailureError, FailureSchedule
from policies.fleet import simulate_fleet

from .conftest import cost_model, make_trace
from .reference_fleet import prefill_s, reference_fleet
from .test_fleet_reference import PER_REPLICA, PER_REQUEST, fleet_configs, fleet_traces


@st.composite
def lockstep_fleets(draw):
    """(trace, cost models, config, failures, ranks): 1-2 instances of 2-3 ranks, each
    instance's ranks alike, failures by whole instance."""
    trace = draw(fleet_traces())
    ranks, instances = draw(st.integers(2, 3)), draw(st.integers(1, 2))
    costs = []
    for _ in range(instances):
        cost = cost_model(draw(st.sampled_from([300, 800, 3000])), draw(st.sampled_from([0, 64])),
                          per_token_s=draw(st.sampled_from([2e-6, 8e-6])))
        costs += [cost] * ranks
    config = draw(fleet_configs(ranks * instances)).replace(
        prefill_replicas=0, dp_balance_timeout_iters=draw(st.sampled_from([0, 0, 1, 4])),
        dp_balance_batching_iters=draw(st.sampled_from([0, 2])))
    failures = None
    if draw(st.booleans()):
        down = draw(st.floats(0.0, float(trace.arrival_s[-1]) + 0.1))
        up = down + draw(st.sampled_from([0.005, 0.05, math.inf]))
        failures = FailureSchedule.from_rows([(draw(st.integers(0, instances - 1)), down, up)]).per_rank(ranks)
    return trace, costs, config, failures, ranks


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lockstep_fleets(), st.integers(0, 2**31))
def test_lockstep_fleet_equals_reference(fleet, seed):
    trace, costs, config, failures, ranks = fleet
    # the reference's lockstep group runs the synchronous loop only: async scheduling of
    # attention-DP ranks stepping together has no reference yet (closing note, stop 53)
    config = config.replace(async_scheduling=False)
    try:
        expected = reference_fleet(trace, costs, config, seed, failures, lockstep=ranks)
    except ConfigError:
        assume(False)
    assert all(left == (0, 0) for left in expected["leftover"]), f"reference leaked KV: {expected['leftover']}"
    got = simulate_fleet(trace, costs, config, seed=seed, failures=failures, lockstep=ranks)
    for name in PER_REQUEST + PER_REPLICA:
        np.testing.assert_array_equal(getattr(got, name), expected[name], err_msg=name)
    assert got.prefill_tokens_computed == expected["prefill_tokens_computed"]


#: steps cost 4 ms + 0.1 ms per token + 1 us per sampled sequence, nothing else
TABLES = linear_tables(per_token_s=1e-4, per_seq_s=1e-6, per_kv_token_s=0.0, per_pair_s=0.0)
PLAIN = PolicyConfig(gpu_memory_utilization=1.0, max_num_batched_tokens=4096, enable_chunked_prefill=False,
                     router="round_robin")


def _two_ranks():
    """A decodes on rank 0 from t = 0 (10-token prompt, 50 tokens); B's 2000-token prompt
    reaches rank 1 at t = 10 ms (round robin), one token."""
    trace = make_trace([0.0, 0.01], [10, 2000], [50, 1])
    return trace, CostModel.synthetic(kv_capacity_tokens=100_000, tables=TABLES)


def _group_step(*ranks):
    """The step of ranks stepping together, each (seconds, tokens, decodes) of its batch:
    the larger of their times beside the token-linear ops, plus those ops at the ranks'
    mean tokens (the MoE layers run over every rank's tokens)."""
    rest = max(seconds - linear_step_seconds(TABLES, tokens, decodes) for seconds, tokens, decodes in ranks)
    return rest + linear_step_seconds(TABLES, sum(r[1] for r in ranks) / 2, sum(r[2] for r in ranks) / 2)


def test_a_rank_decoding_waits_for_the_step_of_a_rank_prefilling():
    trace, cost = _two_ranks()
    alone = simulate_fleet(trace.take(np.array([0])), cost, PLAIN, replicas=2, lockstep=2)  # B never comes
    together = simulate_fleet(trace, cost, PLAIN, replicas=2, lockstep=2)
    assert list(together.replica) == [0, 1]
    decode, prefill = step_seconds(TABLES, 1, 1, 1, 0, 0)[0], prefill_s(TABLES, 2000, 0)
    idle = (0.0, 0, 0)
    decode_alone = _group_step((decode, 1, 1), idle)
    with_prompt = _group_step((decode, 1, 1), (prefill, 2000, 0))
    assert decode_alone < with_prompt < prefill
    # one of A's decode steps is the step with B's prompt in it: A ends that much later
    assert together.finish_s[0] - alone.finish_s[0] == pytest.approx(with_prompt - decode_alone, rel=1e-9)
    # B, arriving mid-step at the idle rank, starts at the group's next step boundary (A's)
    boundary = _group_step((prefill_s(TABLES, 10, 0), 10, 0), idle)
    while boundary < 0.01:
        boundary += decode_alone
    assert together.first_token_s[1] == pytest.approx(boundary + with_prompt, rel=1e-12)


def test_ranks_of_different_instances_do_not_wait_for_each_other():
    # round robin over 2 instances of 2 ranks: A and X on instance 0, B's long prompt on instance 1
    cost = CostModel.synthetic(kv_capacity_tokens=100_000, tables=TABLES)
    with_b = make_trace([0.0, 0.001, 0.01], [10, 10, 2000], [50, 1, 1])
    without_b = make_trace([0.0, 0.001], [10, 10], [50, 1])
    runs = [simulate_fleet(trace, cost, PLAIN, replicas=4, lockstep=2) for trace in (with_b, without_b)]
    assert list(runs[0].replica) == [0, 1, 2]
    assert runs[0].finish_s[0] == runs[1].finish_s[0]


def test_balancing_holds_a_prompt_until_every_rank_has_one_or_the_count_runs_out():
    # TensorRT-LLM's attention_dp_config enable_balance (PyExecutor._balance_adp_requests):
    # A and C decode 200 tokens on ranks 0 and 1 (round robin); B's prompt reaches rank 0 at 30 ms
    cost, plain = CostModel.synthetic(kv_capacity_tokens=100_000, tables=TABLES), PLAIN
    one = make_trace([0.0, 0.0, 0.03], [10, 10, 500], [200, 200, 5])
    free = simulate_fleet(one, cost, plain, replicas=2, lockstep=2)
    step = _group_step((step_seconds(TABLES, 1, 1, 1, 0, 0)[0], 1, 1), (step_seconds(TABLES, 1, 1, 1, 0, 0)[0], 1, 1))
    for timeout in (5, 40):
        held = simulate_fleet(one, cost, plain.replace(dp_balance_timeout_iters=timeout), replicas=2, lockstep=2)
        delay = held.first_token_s[2] - free.first_token_s[2]
        assert 0 < delay <= timeout * step * (1 + 1e-9)  # released by the count, within one round of it
    # a prompt on every rank starts at once; asked to, they first wait beside the decodes
    both = make_trace([0.0, 0.0, 0.03, 0.03], [10, 10, 500, 500], [200, 200, 5, 5])
    free = simulate_fleet(both, cost, plain, replicas=2, lockstep=2)
    balanced = simulate_fleet(both, cost, plain.replace(dp_balance_timeout_iters=40), replicas=2, lockstep=2)
    np.testing.assert_array_equal(balanced.first_token_s, free.first_token_s)
    batched = simulate_fleet(both, cost, plain.replace(dp_balance_timeout_iters=40, dp_balance_batching_iters=3),
                             replicas=2, lockstep=2)
    assert batched.first_token_s[2] == pytest.approx(free.first_token_s[2] + 3 * step, rel=1e-9)


def test_lockstep_refuses_pd_and_a_group_that_does_not_divide_the_fleet():
    with pytest.raises(ConfigError, match="prefill/decode split of DP ranks is not modelled"):
        check_fleet(PLAIN.replace(prefill_replicas=1), 4, 2)
    with pytest.raises(ConfigError, match="lockstep must be a positive integer dividing replicas=6"):
        check_fleet(PLAIN, 6, 4)
    check_fleet(PLAIN, 6, 3)


def test_an_instance_fails_with_all_of_its_ranks():
    plan = FailureSchedule.from_rows([(1, 5.0, 9.0)])
    assert plan.per_rank(4).rows() == [(4, 5.0, 9.0), (5, 5.0, 9.0), (6, 5.0, 9.0), (7, 5.0, 9.0)]
    plan.per_rank(4).check_lockstep(4)
    with pytest.raises(FailureError, match=r"replica 5 is a rank of the attention-DP instance of replicas 4..7.*"
                                           r"ranks \[4, 6, 7\] lack that window"):
        FailureSchedule.from_rows([(5, 5.0, 9.0)]).check_lockstep(4)
    trace, cost = _two_ranks()
    with pytest.raises(FailureError, match="fail together"):
        simulate_fleet(trace, cost, PLAIN, replicas=2, lockstep=2, failures=FailureSchedule.from_rows([(0, 0.001, 1)]))


_JIT_OFF_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    import numpy as np
    from tests.policies.conftest import cost_model, poisson_trace
    from policies.config import PolicyConfig
    from policies.failures import FailureSchedule
    from policies.fleet import simulate_fleet
    trace = poisson_trace(40, rate=100.0, seed=5)
    failures = FailureSchedule.from_rows([(0, 0.1, 0.2)]).per_rank(2)
    r = simulate_fleet(trace, cost_model(900), PolicyConfig(gpu_memory_utilization=1.0, router="least_kv"),
                       replicas=4, lockstep=2, failures=failures)
    print(json.dumps([r.state.tolist(), r.finish_s.tolist(), r.replica.tolist(), r.steps]))
""")


def test_lockstep_with_jit_disabled_agrees():
    root = str(Path(__file__).resolve().parents[2])
    runs = []
    for flag in ("1", "0"):
        done = subprocess.run([sys.executable, "-c", _JIT_OFF_SCRIPT.format(root=root)], capture_output=True,
                              text=True, timeout=600, check=True, env={**os.environ, "NUMBA_DISABLE_JIT": flag})
        runs.append(json.loads(done.stdout))
    assert runs[0] == runs[1]


def _group(trace, cost, config, ranks):
    """``ranks`` replicas of ``trace`` as one attention-DP instance: request r delivered to
    rank r mod ranks at its arrival; (replicas, their statics, nodes for
    ``engine.advance_group``). The nodes are borrowed views: keep the replicas and statics."""
    from numba import typed

    from policies import engine

    from .conftest import new_replica

    reps, statics, nodes = [], [], typed.List()
    for _ in range(ranks):
        rep, st, _ = new_replica(trace, cost, config)
        reps.append(rep)
        statics.append(st)
        nodes.append((engine.borrow_replica(rep), engine.borrow_statics(st), engine.borrow_tables(cost.tables)))
    for r in range(trace.n):
        engine.deliver(reps[r % ranks], r, float(trace.arrival_s[r]))
    return reps, statics, nodes


def test_a_group_advanced_in_pieces_ends_where_one_advance_does():
    # the fleet advances a group event by event: resumable as a lone replica's advance
    from policies import engine
    from policies.kernel_state import FINISH, FIRST_TOKEN

    trace = make_trace(np.cumsum(np.full(30, 0.01)), np.full(30, 300), np.full(30, 20))
    cost, cfg = CostModel.synthetic(kv_capacity_tokens=100_000, tables=TABLES), PLAIN.to_vector()
    whole, _whole_statics, whole_nodes = _group(trace, cost, PLAIN, 3)
    engine.advance_group(whole_nodes, 0, 3, cfg, np.inf, False)
    pieces, _piece_statics, piece_nodes = _group(trace, cost, PLAIN, 3)
    for t in np.arange(0.0, 1.0, 0.013):
        engine.advance_group(piece_nodes, 0, 3, cfg, t, False)
        assert len({engine.clock(rep) for rep in pieces}) == 1  # one clock
    engine.advance_group(piece_nodes, 0, 3, cfg, np.inf, False)
    assert all(engine.outstanding(rep) == 0 for rep in pieces)
    for piece, one in zip(pieces, whole, strict=True):  # every request ends at the same time
        np.testing.assert_array_equal(piece.rf[FINISH], one.rf[FINISH])
        np.testing.assert_array_equal(piece.rf[FIRST_TOKEN], one.rf[FIRST_TOKEN])


def test_the_groups_progress_guard_stops_a_run_past_its_bound():
    from policies import engine
    from policies.engine import ERROR_NO_PROGRESS
    from policies.engine.replica import bound_progress
    from policies.kernel_state import ERROR

    trace = make_trace(np.zeros(6), np.full(6, 300), np.full(6, 50))
    cost = CostModel.synthetic(kv_capacity_tokens=100_000, tables=TABLES)
    reps, _statics, nodes = _group(trace, cost, PLAIN, 2)
    for rep in reps:
        bound_progress(rep, np.array([1, 0]))
    engine.advance_group(nodes, 0, 2, PLAIN.to_vector(), np.inf, False)
    assert reps[0].g[ERROR] == ERROR_NO_PROGRESS and engine.outstanding(reps[0]) > 0
