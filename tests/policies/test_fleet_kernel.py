"""The fleet kernel's own pieces: moving a request between replicas (withdraw, carried
delivery, P/D hand-off, stepping through an event), the fleet's identities with the single
engine and the round-robin split, parallel runs, heterogeneous replicas, P/D transfer
time and bad input. Kernel against reference on every path: test_fleet_reference.py."""

import dataclasses
import math

import numpy as np
import pytest

from costmodels.steptable import step_seconds
from policies import engine
from policies.config import ConfigError, PolicyConfig
from policies.failures import FailureError, FailureSchedule
from policies.fleet import simulate_fleet, simulate_fleet_many
from policies.kernel_state import (
    C_PREFILL_TOKENS,
    C_SPEC_ACCEPTED,
    C_USED_END,
    COMPUTED,
    GENERATED,
    L_DHEAP,
    SPEC_HITS,
    SPEC_TRIALS,
    USED,
)
from policies.result import Reject, State
from policies.speculative import AcceptanceModel

from .conftest import cost_model, make_trace, new_replica, poisson_trace

CONFIG = PolicyConfig(gpu_memory_utilization=1.0, max_num_batched_tokens=256, block_size=16)
PER_REQUEST = ("state", "reject_reason", "first_token_s", "finish_s", "tokens_generated", "preemptions",
               "cached_prompt_tokens", "queue_s")


def _replica(trace, cost, config=CONFIG, seed=0):
    return new_replica(trace, cost, config, seed)


def _outputs(trace, rep, weights):
    bufs = engine.output_buffers(1, trace.n, len(weights))
    engine.write_outputs(rep, *(b[0] for b in bufs))
    counts = bufs[2][0]
    return bufs[0][0], bufs[1][0], counts


# -- moving a request between replicas -------------------------------------------------------
@pytest.mark.parametrize("keep_kv", [True, False])
def test_a_withdrawn_request_finishes_on_the_next_replica_with_or_without_its_kv(keep_kv):
    """Request 0 decodes on A until 0.2 s, then moves to B: A is left empty, and B computes
    no prefill when the KV comes along (migration), or the prompt and every streamed token
    when it was lost (failure). The tokens already streamed are never generated twice."""
    trace = make_trace([0.0], [300], [400])
    cost, cfg = cost_model(8000), CONFIG.to_vector()
    a, st, weights = _replica(trace, cost)
    b, _, _ = _replica(trace, cost)
    engine.deliver(a, 0, 0.0)
    engine.advance(a, st, cost.tables, cfg, 0.2)
    computed, generated = a.ri[COMPUTED, 0], a.ri[GENERATED, 0]
    assert 1 < generated < 400 and computed == 300 + generated - 1
    carried_i, carried_f = engine.new_carried(trace.n)
    lost = engine.withdraw(a, st, 0, keep_kv, carried_i, carried_f)
    assert lost == (0 if keep_kv else computed)
    assert (engine.outstanding(a), engine.free_blocks(a)) == (0, engine.capacity_blocks(a))
    assert carried_i[engine.K_GENERATED, 0] == generated
    assert carried_i[engine.K_COMPUTED, 0] == (computed if keep_kv else 0)
    engine.deliver_carried(b, st, 0, engine.clock(a), carried_i, carried_f)
    engine.advance(b, st, cost.tables, cfg, np.inf)
    out_i, out_f, counts = _outputs(trace, b, weights)
    assert out_i[engine.O_STATE, 0] == State.FINISHED and out_i[engine.O_GENERATED, 0] == 400
    assert out_f[engine.O_FIRST_TOKEN, 0] < 0.2 < out_f[engine.O_FINISH, 0], "first token kept from A"
    assert counts[C_PREFILL_TOKENS] == (0 if keep_kv else 300 + generated)
    a_i, _, a_counts = _outputs(trace, a, weights)
    assert a_i[engine.O_STATE, 0] == 0 and a_counts[C_USED_END] == 0, "A reports nothing for it and holds no KV"


@pytest.mark.parametrize("mode", ["fixed", "smartspec"])
def test_a_migrated_request_continues_its_token_count_and_sampler_state(mode):
    """A speculating request moved mid-decode takes its whole state or nothing: on B its
    token count goes on from A's, and so does its sampler: the SmartSpec acceptance counts
    arrive as A left them, and (fixed k) B draws the same verify outcomes for the same
    token indices, so A and B together accept exactly the drafts a run left on A accepts."""
    trace = make_trace([0.0], [300], [400])
    cost = cost_model(8000)
    config = CONFIG.replace(speculative_mode=mode, num_speculative_tokens=3)
    cfg, acceptance = config.to_vector(), AcceptanceModel([0.8, 0.6, 0.4], spread=0.3)
    alone, st, weights = new_replica(trace, cost, config, 7, acceptance)
    engine.deliver(alone, 0, 0.0)
    engine.advance(alone, st, cost.tables, cfg, np.inf)
    a, _, _ = new_replica(trace, cost, config, 7, acceptance)
    b, _, _ = new_replica(trace, cost, config, 7, acceptance)
    engine.deliver(a, 0, 0.0)
    engine.advance(a, st, cost.tables, cfg, 0.2)
    generated, hits, trials = a.ri[GENERATED, 0], a.rf[SPEC_HITS, 0], a.rf[SPEC_TRIALS, 0]
    assert 1 < generated < 400
    assert mode == "fixed" or trials > 0, "SmartSpec has observed verifies on A"
    carried_i, carried_f = engine.new_carried(trace.n)
    engine.withdraw(a, st, 0, True, carried_i, carried_f)
    engine.deliver_carried(b, st, 0, engine.clock(a), carried_i, carried_f)
    assert (b.ri[GENERATED, 0], b.rf[SPEC_HITS, 0], b.rf[SPEC_TRIALS, 0]) == (generated, hits, trials)
    engine.advance(b, st, cost.tables, cfg, np.inf)
    b_i, _, b_counts = _outputs(trace, b, weights)
    _, _, a_counts = _outputs(trace, a, weights)
    _, _, alone_counts = _outputs(trace, alone, weights)
    assert b_i[engine.O_STATE, 0] == State.FINISHED and b_i[engine.O_GENERATED, 0] == 400
    assert b_counts[C_PREFILL_TOKENS] == 0, "its KV came along: nothing computed twice"
    if mode == "fixed":
        assert a_counts[C_SPEC_ACCEPTED] + b_counts[C_SPEC_ACCEPTED] == alone_counts[C_SPEC_ACCEPTED] > 0


def test_withdrawing_from_the_inbox_keeps_the_other_deliveries():
    trace = make_trace([0.0, 0.0, 0.0], [40, 40, 40], [3, 3, 3])
    cost, cfg = cost_model(), CONFIG.to_vector()
    rep, st, weights = _replica(trace, cost)
    for r, t in ((0, 0.5), (1, 0.6), (2, 0.7)):
        engine.deliver(rep, r, t)
    carried_i, carried_f = engine.new_carried(trace.n)
    engine.withdraw(rep, st, 0, False, carried_i, carried_f)  # the inbox head
    engine.withdraw(rep, st, 2, False, carried_i, carried_f)  # the tail
    assert engine.waiting(rep) == 1
    engine.advance(rep, st, cost.tables, cfg, np.inf)
    out_i, out_f, _ = _outputs(trace, rep, weights)
    assert list(out_i[engine.O_STATE]) == [0, State.FINISHED, 0] and out_f[engine.O_FIRST_SCHED, 1] == 0.6


def test_a_prefill_replica_hands_off_after_the_first_token_and_keeps_the_prefix_cached():
    config = CONFIG.replace(enable_prefix_caching=True)
    hashes = [[7, 8, 9], [7, 8, 10]]
    trace = make_trace([0.0, 0.0], [96, 96], [20, 1], hashes=hashes, block_tokens=32)
    cost, cfg = cost_model(), config.to_vector()
    rep, st, weights = _replica(trace, cost, config)
    engine.hand_off_after_first_token(rep)
    engine.deliver(rep, 0, 0.0)
    engine.advance(rep, st, cost.tables, cfg, np.inf)
    assert list(engine.handed_off(rep)) == [0], "it left after its first token"
    assert engine.outstanding(rep) == 0 and rep.g[USED] == 0, "it holds nothing here"
    carried_i, carried_f = engine.new_carried(trace.n)
    engine.carry(rep, 0, True, carried_i, carried_f)
    assert carried_i[engine.K_COMPUTED, 0] == 96 and carried_i[engine.K_GENERATED, 0] == 1
    assert carried_f[engine.K_FIRST_TOKEN, 0] == engine.clock(rep), "handed off at the end of that step"
    engine.clear_handed_off(rep)
    assert engine.cached_tokens(rep, st, 1) == 64, "its full prompt blocks stay cached for the next one"
    engine.deliver(rep, 1, engine.clock(rep))
    engine.advance(rep, st, cost.tables, cfg, np.inf)
    out_i, _, _ = _outputs(trace, rep, weights)
    assert out_i[engine.O_STATE, 1] == State.FINISHED and len(engine.handed_off(rep)) == 0, "one token: done here"


@pytest.mark.parametrize("caching", [False, True])
def test_a_replica_that_stays_unqueued_never_queues_before_its_next_delivery(caching):
    """``engine.stays_unqueued`` lets migration ticks skip replicas: once it holds, no
    step until the next delivery may leave a request waiting (no preemption). Checked
    step boundary by step boundary on KV-starved replicas, where it must also say no."""
    config = CONFIG.replace(enable_prefix_caching=caching)
    said = {True: 0, False: 0}
    for seed in range(12):
        rng = np.random.default_rng(seed)
        n = 30
        prompt = rng.integers(20, 300, n)
        hashes = [[int(h) for h in rng.integers(0, 4, size=-(-p // 32))] for p in prompt]
        trace = make_trace(np.sort(rng.uniform(0.0, 0.05, n)), prompt, rng.integers(10, 200, n), hashes=hashes,
                           block_tokens=32)
        cost = cost_model(int(rng.integers(600, 4000)))
        rep, st, _ = _replica(trace, cost, config)
        cfg = config.to_vector()
        first = int(rng.integers(1, n))
        for r in range(first):
            engine.deliver(rep, r, trace.arrival_s[r])
        t = float(trace.arrival_s[first - 1])
        quiet = False
        while engine.outstanding(rep) > 0 and t < 60.0:
            engine.advance(rep, st, cost.tables, cfg, t)
            if not quiet:
                quiet = engine.stays_unqueued(rep, st, cfg)
                said[quiet] += 1
            else:
                assert engine.waiting(rep) == 0, f"seed {seed}: queued at {t} after stays_unqueued"
            t += 0.002
    assert said[True] > 0 and said[False] > said[True], said


def test_advance_through_runs_the_step_that_starts_at_the_limit():
    trace = make_trace([0.0], [100], [5])
    cost, cfg = cost_model(), CONFIG.to_vector()
    rep, st, _ = _replica(trace, cost)
    engine.deliver(rep, 0, 0.0)
    engine.advance(rep, st, cost.tables, cfg, 0.0)
    assert engine.clock(rep) == 0.0 and engine.running(rep) == 0, "a step starting at the limit waits"
    engine.advance_through(rep, st, cost.tables, cfg, 0.0)
    assert engine.clock(rep) > 0.0 and engine.running(rep) == 1, "exactly that step ran"
    first_end = engine.clock(rep)
    engine.advance_through(rep, st, cost.tables, cfg, 0.0)
    assert engine.clock(rep) == first_end


# -- the fleet ------------------------------------------------------------------------------
def _trace(n=150, seed=4):
    base = poisson_trace(n, rate=120.0, seed=seed)
    rng = np.random.default_rng(seed)
    hashes = [[int(rng.integers(0, 3)), 100 + i] for i in range(n)]
    deadline = base.arrival_s + np.where(np.arange(n) % 5 == 0, 0.8, np.nan)
    return make_trace(base.arrival_s, base.prompt_tokens, base.output_tokens, deadline=deadline, hashes=hashes,
                      block_tokens=32)


CONFIGS = {
    "vllm": CONFIG,
    "sglang-cache": CONFIG.replace(schedule_mode="prefill_first", admission_mode="new_token_ratio",
                                   enable_prefix_caching=True),
    "swap-edf": CONFIG.replace(preemption_mode="swap", scheduling_policy="edf", admission_mode="predicted"),
    "speculative": CONFIG.replace(speculative_mode="dspark", num_speculative_tokens=4),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_replica_is_the_engine_field_for_field(name):
    trace, cost, config = _trace(), cost_model(2500, 600), CONFIGS[name]
    fleet = simulate_fleet(trace, cost, config, seed=9)
    single = engine.simulate(trace, cost, config, seed=9)
    for field in dataclasses.fields(single):
        if field.name in ("reroutes", "reprefill_tokens") or field.name.startswith(("replica_", "failure_")):
            continue
        np.testing.assert_array_equal(getattr(fleet, field.name), getattr(single, field.name), err_msg=field.name)
    assert list(fleet.replica_routed) == [trace.n] and fleet.reroutes.sum() == 0


def test_a_request_draws_the_same_verify_outcomes_on_any_replica():
    """Replica 0 is down from the start, so replica 1 serves the whole trace: speculating,
    it runs exactly as the lone engine on the run's seed (the draws belong to the request,
    not to the replica it lands on)."""
    trace, cost, config = _trace(), cost_model(2500, 600), CONFIGS["speculative"]
    down = FailureSchedule.from_rows([(0, 0.0, math.inf)])
    fleet = simulate_fleet(trace, cost, config, seed=9, replicas=2, failures=down)
    single = engine.simulate(trace, cost, config, seed=9)
    assert fleet.spec_accepted_tokens == single.spec_accepted_tokens > 0
    for name_ in PER_REQUEST:
        np.testing.assert_array_equal(getattr(fleet, name_), getattr(single, name_), err_msg=name_)


@pytest.mark.parametrize("name", ["vllm", "sglang-cache"])
def test_round_robin_over_independent_replicas_is_the_split_and_merge(name):
    """Request i goes to replica i mod R, which runs it exactly as a lone engine running its
    share of the trace with the same seed."""
    trace, cost, config, replicas = _trace(), cost_model(1500), CONFIGS[name], 3
    fleet = simulate_fleet(trace, cost, config, seed=2, replicas=replicas)
    totals = dict.fromkeys(("steps", "busy_s", "prefill_tokens_computed", "kv_capacity_blocks", "kv_peak_blocks"), 0)
    for j in range(replicas):
        rows = np.arange(j, trace.n, replicas)
        alone = engine.simulate(trace.take(rows), cost, config, seed=2)
        for counter in totals:
            totals[counter] += getattr(alone, counter)
        for name_ in PER_REQUEST:
            np.testing.assert_array_equal(getattr(fleet, name_)[rows], getattr(alone, name_), err_msg=name_)
        np.testing.assert_array_equal(fleet.replica[rows], np.where(alone.replica >= 0, j, -1))
        assert fleet.replica_kv_peak_blocks[j] == alone.kv_peak_blocks
        assert fleet.replica_prefix_hit_tokens[j] == alone.prefix_hit_tokens
    assert list(fleet.replica_routed) == [50, 50, 50]
    assert {counter: getattr(fleet, counter) for counter in totals} == pytest.approx(totals, rel=1e-12)


def test_many_configs_in_parallel_equal_one_at_a_time():
    trace, costs = _trace(80), [cost_model(1500), cost_model(900), cost_model(3000)]
    failures = FailureSchedule.from_rows([(1, 0.1, 0.3)])
    configs = [CONFIG.replace(router="least_kv"), CONFIG.replace(router="unified", migration=True),
               CONFIG.replace(router="cache_aware", prefill_replicas=1, enable_prefix_caching=True)]
    together = simulate_fleet_many(trace, costs, configs, seed=5, failures=failures)
    for config, result in zip(configs, together, strict=True):
        alone = simulate_fleet(trace, costs, config, seed=5, failures=failures)
        for name in (*PER_REQUEST, "replica", "reroutes", "reprefill_tokens", "replica_routed", "series_kv_blocks"):
            np.testing.assert_array_equal(getattr(result, name), getattr(alone, name), err_msg=name)
    assert together[0].reroutes.sum() > 0


def test_heterogeneous_replicas_keep_their_own_capacity_and_limits():
    """Round robin over a large and a small replica: only the prompts routed to the small
    one that it could never hold are rejected, and each reports its own capacity."""
    trace = make_trace(np.arange(6) * 0.01, [1000, 1000, 100, 1000, 100, 100], [10] * 6)
    costs = [cost_model(8000), cost_model(512)]
    result = simulate_fleet(trace, costs, CONFIG)
    assert list(result.replica_kv_capacity_blocks) == [500, 32]
    rejected = result.state == State.REJECTED
    assert list(np.flatnonzero(rejected)) == [1, 3]
    assert np.all(result.reject_reason[rejected] == Reject.EXCEEDS_CAPACITY)
    assert list(result.replica[~rejected]) == [0, 0, 0, 1]


def test_pd_hand_off_pays_the_kv_transfer_before_decoding():
    """A two-token request: its first token on the prefill replica, then (prompt + 1) tokens
    of KV cross the interconnect, then one decode step on the idle decode replica."""
    prompt, gbps = 400, 0.5
    trace = make_trace([0.0], [prompt], [2])
    cost = cost_model(4000)
    config = CONFIG.replace(prefill_replicas=1, interconnect_gbps=gbps)
    result = simulate_fleet(trace, [cost, cost], config)
    transfer_s = (prompt + 1) * cost.kv_bytes_per_token / (gbps * 1e9)
    decode_s, _ = step_seconds(cost.tables, 1, 1, 1, prompt + 1, 0)
    assert result.replica[0] == 1 and result.tokens_generated[0] == 2
    assert result.finish_s[0] == pytest.approx(result.first_token_s[0] + transfer_s + decode_s, rel=1e-12)
    assert result.prefill_tokens_computed == prompt, "the decode replica computes no prefill"


def test_a_replica_back_from_a_failure_counts_both_lives():
    trace = _trace(120)
    failures = FailureSchedule.from_rows([(0, 0.3, 0.6)])
    result = simulate_fleet(trace, cost_model(1500), CONFIG.replace(router="least_outstanding"), replicas=2,
                            failures=failures)
    finished = result.state == State.FINISHED
    before = finished & (result.finish_s < 0.3) & (result.replica == 0)
    after = finished & (result.finish_s > 0.6) & (result.replica == 0)
    assert before.any() and after.any(), "replica 0 finished requests in both incarnations"
    assert result.replica_routed.sum() == trace.n + result.reroutes.sum()
    down = (result.series_t > 0.3) & (result.series_t < 0.6)
    assert np.all(result.series_kv_blocks[down] <= result.replica_kv_peak_blocks[1]), "only replica 1 holds KV"
    assert list(result.failure_replica) == [0] and list(result.failure_up_s) == [0.6]


def test_bad_fleets_are_refused_with_the_reason():
    trace, cost = _trace(20), cost_model()
    with pytest.raises(ValueError, match="replicas=3 but 2 cost models"):
        simulate_fleet(trace, [cost, cost], CONFIG, replicas=3)
    with pytest.raises(TypeError, match=r"cost_models\[1\] is a str"):
        simulate_fleet(trace, [cost, "h100"], CONFIG)
    with pytest.raises(ValueError, match="at least one replica"):
        simulate_fleet(trace, [], CONFIG)
    with pytest.raises(ConfigError, match="prefill_replicas=2 leaves no decode replica"):
        simulate_fleet(trace, cost, CONFIG.replace(prefill_replicas=2), replicas=2)
    with pytest.raises(FailureError, match="replica 4 does not exist"):
        simulate_fleet(trace, cost, CONFIG, replicas=2, failures=FailureSchedule.from_rows([(4, 0.1, math.inf)]))
    with pytest.raises(TypeError, match="FailureSchedule"):
        simulate_fleet(trace, cost, CONFIG, replicas=2, failures=[(0, 0.1, 0.2)])


def test_a_request_rerouted_behind_younger_ones_still_leaves_at_its_max_wait():
    """Replica 0 fails at 0.1 s: its queued request 2 (arrived 0.01 s) lands on replica 1
    behind request 3 (arrived 0.05 s). It is rejected at the first step boundary after its
    own 0.3 s of waiting, not after request 3's."""
    trace = make_trace([0.0, 0.001, 0.01, 0.05], [50, 50, 50, 50], [2000, 2000, 5, 5])
    costs = [cost_model(4000), cost_model(4000)]
    config = PolicyConfig(gpu_memory_utilization=1.0, max_num_seqs=1, max_wait_s=0.3)
    result = simulate_fleet(trace, costs, config, failures=FailureSchedule.from_rows([(0, 0.1, math.inf)]))
    assert list(result.reject_reason[2:]) == [Reject.MAX_WAIT, Reject.MAX_WAIT]
    assert list(result.reroutes) == [1, 0, 1, 0]
    assert 0.31 < result.finish_s[2] < result.finish_s[3] - 0.03, "request 2 left on its own clock"


def test_a_request_delivered_to_the_same_replica_again_and_again_keeps_one_deadline():
    """Migrated back and forth: every return leaves a stale deadline entry behind, which
    must never overflow the heap (n slots); the deadline still ends it."""
    trace = make_trace([0.0, 0.0], [400, 40], [300, 3], deadline=[0.5, np.nan])
    cost, cfg = cost_model(), CONFIG.to_vector()
    rep, st, weights = _replica(trace, cost)
    carried_i, carried_f = engine.new_carried(trace.n)
    t = 0.0
    for _ in range(6):
        engine.deliver_carried(rep, st, 0, t, carried_i, carried_f)
        t += 0.05
        engine.advance(rep, st, cost.tables, cfg, t)
        assert rep.lists[L_DHEAP, 0] <= trace.n
        engine.withdraw(rep, st, 0, True, carried_i, carried_f)
    assert carried_i[engine.K_GENERATED, 0] > 0, "it made progress between moves"
    engine.deliver_carried(rep, st, 0, t, carried_i, carried_f)
    engine.advance(rep, st, cost.tables, cfg, np.inf)
    out_i, out_f, _ = _outputs(trace, rep, weights)
    assert out_i[engine.O_STATE, 0] == State.TIMED_OUT and out_f[engine.O_FINISH, 0] == 0.5
