"""Issue 18: a replica that fails more than once, and the progress guards.

A request that ended on a replica kept that replica as its owner; once the replica came
back (a new, empty incarnation, where the request is NOT_ARRIVED) its next failure took
the request for one in its inbox and searched the inbox for it for ever. These runs end,
every request in exactly one final state, and the kernel agrees with the reference.
The guards: a fleet whose event loop, or a replica whose engine loop, passes its
iteration bound, or whose engine reports an internal error, stops with
``SimulationStalled`` instead of hanging; the default bounds leave correct runs alone.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from policies import engine
from policies.config import ROUTERS, ConfigError, PolicyConfig
from policies.failures import FailureSchedule
from policies.fleet import SimulationStalled, simulate_fleet
from policies.kernel_state import ADVANCES, ERROR, INBOX_HEAD, ITERATIONS, N_DONE, STEPS
from policies.result import State

from .conftest import cost_model, make_trace, new_replica, poisson_trace
from .reference_fleet import reference_fleet
from .test_fleet_reference import PER_REPLICA, PER_REQUEST
from .test_replica import CONFIGS

FINAL = {int(s) for s in State}


def assert_each_request_ends_once(result, n):
    """Every request has exactly one final state; a finished one ended on one replica, at
    one time; any other has no replica."""
    state = np.asarray(result.state)
    assert state.shape == (n,)
    assert set(np.unique(state).tolist()) <= FINAL
    finished = state == int(State.FINISHED)
    assert np.all(result.replica[finished] >= 0)
    assert np.all(result.replica[~finished] == -1)
    assert np.all(np.isfinite(result.finish_s))


def assert_kernel_equals_reference(trace, costs, config, failures, seed=0):
    try:
        expected = reference_fleet(trace, costs, config, seed, failures)
    except ConfigError:
        assume(False)
    assert all(left == (0, 0) for left in expected["leftover"]), f"reference leaked KV: {expected['leftover']}"
    got = simulate_fleet(trace, costs, config, seed=seed, failures=failures)
    for name in PER_REQUEST + PER_REPLICA:
        np.testing.assert_array_equal(getattr(got, name), expected[name], err_msg=name)
    assert_each_request_ends_once(got, trace.n)
    return got


BUSY = PolicyConfig(gpu_memory_utilization=1.0, max_num_batched_tokens=256, block_size=16)


@pytest.mark.parametrize("knobs", [{}, {"router": "least_kv", "migration": True, "interconnect_gbps": 1.0},
                                   {"prefill_replicas": 1}], ids=["colocated", "migration", "pd"])
@pytest.mark.parametrize("rows", [
    [(0, 1.0, 2.0), (0, 3.0, 4.0)],  # issue 18's smallest case: one replica failing twice
    [(0, 0.5, 1.0), (0, 2.0, 2.5), (0, 4.0, 4.5)],  # three times
    [(0, 0.5, 1.5), (1, 1.0, 2.0), (0, 2.5, 3.0), (1, 2.8, math.inf)],  # both, overlapping, one never back
], ids=["twice", "three-times", "both-overlapping"])
def test_a_replica_failing_again_after_coming_back_finishes(rows, knobs):
    trace = poisson_trace(120, rate=30.0, seed=1)
    failures = FailureSchedule.from_rows(rows)
    got = assert_kernel_equals_reference(trace, [cost_model(), cost_model()], BUSY.replace(**knobs), failures)
    if not knobs.get("prefill_replicas"):  # (replica 0 prefills fast under P/D and may hold nothing)
        assert got.reroutes.sum() > 0  # the failures hit requests


def test_requests_ended_before_a_failure_keep_their_outcome():
    """What ended on replica 0's first incarnation is not re-routed by its second failure."""
    trace = poisson_trace(120, rate=30.0, seed=1)
    failures = FailureSchedule.from_rows([(0, 1.0, 2.0), (0, 3.0, 4.0)])
    once = simulate_fleet(trace, cost_model(), BUSY, replicas=2, failures=FailureSchedule.from_rows([(0, 1.0, 2.0)]))
    twice = simulate_fleet(trace, cost_model(), BUSY, replicas=2, failures=failures)
    ended_early = np.asarray(once.finish_s) < 1.0
    assert ended_early.any()
    for name in ("state", "finish_s", "replica", "tokens_generated"):
        np.testing.assert_array_equal(getattr(twice, name)[ended_early], getattr(once, name)[ended_early])
    assert np.all(twice.reroutes[ended_early] == 0)


@st.composite
def overloaded_fleets(draw):
    """2-4 replicas with small KV under a burst of requests, each replica failing up to
    three times (windows of different replicas overlap freely), some never back."""
    n = draw(st.integers(4, 40))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.001, 0.003, 0.01]), min_size=n, max_size=n))
    arrival = np.cumsum(gaps)
    prompt = draw(st.lists(st.integers(1, 200), min_size=n, max_size=n))
    output = draw(st.lists(st.integers(0, 150), min_size=n, max_size=n))
    patience = draw(st.lists(st.one_of(st.none(), st.none(), st.floats(0.01, 1.0)), min_size=n, max_size=n))
    deadline = [a + d if d is not None else math.nan for a, d in zip(arrival, patience, strict=True)]
    trace = make_trace(arrival, prompt, output, deadline=deadline)
    replicas = draw(st.integers(2, 4))
    costs = [cost_model(draw(st.sampled_from([400, 800, 3000])), per_token_s=draw(st.sampled_from([2e-6, 2e-5])))
             for _ in range(replicas)]
    span = float(arrival[-1]) + 0.3
    rows = []
    for j in range(replicas):
        t = 0.0
        for _ in range(draw(st.integers(0, 3))):
            down = t + draw(st.floats(0.0, span / 2))
            up = down + draw(st.sampled_from([0.002, 0.02, 0.1, 0.4, math.inf]))
            rows.append((j, down, up))
            if not math.isfinite(up):
                break
            t = up + draw(st.sampled_from([1e-6, 0.005, 0.05]))  # windows of one replica never touch
    config = BUSY.replace(
        max_num_batched_tokens=draw(st.sampled_from([32, 256])),
        max_num_seqs=draw(st.sampled_from([2, 64])),
        enable_chunked_prefill=draw(st.booleans()),
        block_size=draw(st.sampled_from([4, 16])),
        preemption_mode=draw(st.sampled_from(["recompute", "swap"])),
        router=draw(st.sampled_from(ROUTERS)),
        migration=draw(st.booleans()),
        migration_interval_s=0.01,
        interconnect_gbps=draw(st.sampled_from([0.1, 50.0])),
        prefill_replicas=draw(st.sampled_from([0, 0, *range(1, replicas)])),
    )
    return trace, costs, config, FailureSchedule.from_rows(rows) if rows else None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(overloaded_fleets(), st.integers(0, 2**31))
def test_repeated_and_overlapping_failures_under_overload_always_end(fleet, seed):
    trace, costs, config, failures = fleet
    assert_kernel_equals_reference(trace, costs, config, failures, seed)


def test_the_guard_stops_a_run_past_its_iteration_bound():
    trace = poisson_trace(60, rate=30.0, seed=2)
    failures = FailureSchedule.from_rows([(0, 0.5, 1.0), (0, 1.5, 2.0)])
    with pytest.raises(SimulationStalled, match=r"simulation made no progress at t=[0-9.e+-]+ s, replica \S+, "
                                                r"state: fleet queue \d+, in flight \d+, arrivals \d+/60.*"
                                                r"\(the event loop passed its bound of iterations \(2\)\)"):
        simulate_fleet(trace, cost_model(), BUSY, replicas=2, failures=failures, progress_budget=(1, 0))
    assert issubclass(SimulationStalled, RuntimeError)


@pytest.mark.parametrize("many", [False, True], ids=["simulate", "simulate_many"])
def test_the_engine_guard_stops_a_single_replica_run_past_its_iteration_bound(many):
    trace = poisson_trace(60, rate=30.0, seed=2)
    pattern = (r"simulation made no progress at t=[0-9.e+-]+ s, replica 0, state: running \d+, queued \d+, "
               r"not yet admitted \d+, ended \d+/60, steps \d+ \(its loop passed its bound of iterations; "
               r"2 iterations\)")
    with pytest.raises(SimulationStalled, match=pattern):
        if many:
            engine.simulate_many(trace, cost_model(), [BUSY, BUSY.replace(max_num_seqs=4)], progress_budget=(1, 0))
        else:
            engine.simulate(trace, cost_model(), BUSY, progress_budget=(1, 0))


@pytest.mark.parametrize("budget", [(-1, 4), (1024, 2.5), (True, 4)])
def test_a_progress_budget_that_is_not_two_counts_is_refused(budget):
    trace = poisson_trace(5, rate=10.0, seed=0)
    with pytest.raises(ValueError, match="progress_budget"):
        engine.simulate(trace, cost_model(), BUSY, progress_budget=budget)
    with pytest.raises(ValueError, match="progress_budget"):
        simulate_fleet(trace, cost_model(), BUSY, replicas=2, progress_budget=budget)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_correct_replica_iterates_at_most_twice_per_unit_of_progress(name):
    """Run whole and driven in pieces as a fleet drives it (an advance every 5 ms and at
    each arrival), under overload: the engine loop iterates at most twice per unit of
    progress (steps, deliveries taken, requests ended, calls), as the guard's default
    per = 4 assumes with a 2x margin."""
    trace = poisson_trace(300, rate=400.0, seed=3, prompt=(50, 800), output=(20, 400))
    cost, config = cost_model(2000, host_tokens=800), CONFIGS[name]
    cfg = config.to_vector()
    for pieces in (False, True):
        rep, statics, _ = new_replica(trace, cost, config)
        r = 0
        times = np.union1d(np.arange(trace.arrival_s[0], trace.arrival_s[-1], 0.005), trace.arrival_s)
        for t_event in times if pieces else trace.arrival_s[:1]:
            engine.advance(rep, statics, cost.tables, cfg, t_event)
            while r < trace.n and (not pieces or trace.arrival_s[r] == t_event):
                engine.deliver(rep, r, trace.arrival_s[r])
                r += 1
        engine.advance(rep, statics, cost.tables, cfg, np.inf)
        g = rep.g
        assert g[ERROR] == 0 and engine.outstanding(rep) == 0
        assert g[ITERATIONS] <= 2 * (g[STEPS] + g[INBOX_HEAD] + g[N_DONE] + g[ADVANCES]), f"pieces={pieces}"


def test_the_default_bound_leaves_a_long_overloaded_replay_alone():
    """Far more work than the replicas can do, long queues, preemptions, migration ticks
    and failures: the guard never fires on a correct run."""
    trace = poisson_trace(1500, rate=400.0, seed=3, prompt=(50, 800), output=(20, 400))
    failures = FailureSchedule.from_rows([(0, 0.5, 1.0), (0, 2.0, 2.5), (1, 1.0, 1.2), (0, 3.0, 3.5)])
    config = BUSY.replace(router="least_kv", migration=True, migration_interval_s=0.001)
    result = simulate_fleet(trace, cost_model(2000), config, replicas=2, failures=failures)
    assert_each_request_ends_once(result, trace.n)
    assert result.preemptions.sum() > 0 and result.reroutes.sum() > 0


def test_withdrawing_a_request_the_replica_does_not_hold_is_an_error_not_a_hang():
    trace = poisson_trace(5, rate=10.0, seed=0)
    rep, st_, _ = new_replica(trace, cost_model(), BUSY)
    carried_i, carried_f = engine.new_carried(trace.n)
    engine.withdraw(rep, st_, 0, False, carried_i, carried_f)
    assert rep.g[ERROR] == engine.ERROR_NOT_HELD


@pytest.mark.parametrize("simulator", [simulate_fleet, reference_fleet], ids=["kernel", "reference"])
def test_a_request_withdrawn_from_a_step_in_flight_fails_after_the_token_it_streamed(simulator):
    """P/D: a prefill step starts before the only decode replica fails for good and ends
    after; the token it samples reaches the client, so the request, which can go nowhere,
    FAILS no earlier than that token (found by the fleet property test: it ended at the
    failure, before it)."""
    prompt = [1] * 11 + [56, 76, 116, 124, 48]
    blocks = [1] * 11 + [2, 3, 4, 4, 2]
    trace = make_trace([0.0] * 16, prompt, [0, 0, 0, 2] + [0] * 12, max_tokens=[1, 1, 1, 2] + [1] * 12,
                       hashes=[[10000 + 10 * i + b for b in range(k)] for i, k in enumerate(blocks)], block_tokens=32)
    config = PolicyConfig(max_num_batched_tokens=32, max_num_seqs=2, enable_chunked_prefill=False,
                          gpu_memory_utilization=1.0, block_size=4, enable_prefix_caching=False, router="round_robin",
                          interconnect_gbps=0.1, prefill_replicas=2)
    failures = FailureSchedule.from_rows([(2, 0.00390625, math.inf)])
    result = simulator(trace, [cost_model(300)] * 3, config, failures=failures)
    get = (lambda k: result[k]) if isinstance(result, dict) else (lambda k: getattr(result, k))
    first, finish, state = np.asarray(get("first_token_s")), np.asarray(get("finish_s")), np.asarray(get("state"))
    assert state[3] == State.FAILED and first[3] > failures.t_down[0], "the case: its token came after the failure"
    streamed = ~np.isnan(first)
    assert np.all(first[streamed] <= finish[streamed])
