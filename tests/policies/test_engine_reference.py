"""The kernel against the plain-Python reference: equal per-request results, every mode."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from policies.config import (
    ADMISSION_MODES,
    DRAFT_COST_MODES,
    FAIRNESS_COST_UNITS,
    MAX_WAIT_ACTIONS,
    PREEMPTION_MODES,
    PREEMPTION_VICTIMS,
    SCHEDULE_MODES,
    SCHEDULING_POLICIES,
    SPECULATIVE_MODES,
    ConfigError,
    PolicyConfig,
)
from policies.engine import simulate
from policies.result import Reject, State
from policies.speculative import AcceptanceModel

from .conftest import cost_model, make_trace
from .reference import reference_simulate

PER_REQUEST = ("state", "reject_reason", "first_token_s", "finish_s", "tokens_generated", "preemptions", "queue_s",
               "cached_prompt_tokens")
SPEC_COUNTERS = ("spec_decodes", "spec_verifies", "spec_drafted_tokens", "spec_accepted_tokens")
COUNTERS = SPEC_COUNTERS + ("steps", "busy_s", "prefill_tokens_computed", "out_of_range_steps", "kv_peak_blocks", "swap_outs", "end_s",
            "peak_step_tokens", "peak_step_s",
            "prefix_hit_tokens", "prefix_query_tokens", "prefix_evictions")


@st.composite
def traces(draw):
    n = draw(st.integers(1, 30))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.0, 0.001, 0.004, 0.02, 0.3]), min_size=n, max_size=n))
    arrival = np.cumsum(gaps)
    prompt = draw(st.lists(st.integers(1, 150), min_size=n, max_size=n))
    output = draw(st.lists(st.integers(0, 80), min_size=n, max_size=n))
    max_tokens = [max(1, o + draw(st.integers(-10, 30))) for o in output]
    priority = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    deadline = [a + d if d is not None else np.nan
                for a, d in zip(arrival, draw(st.lists(st.one_of(st.none(), st.none(), st.floats(0.0, 1.0)),
                                                       min_size=n, max_size=n)), strict=True)]
    # tenants, classes and shared prefixes (32-token hash blocks branching off 2 roots)
    n_tenants, n_classes = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    tenant = draw(st.lists(st.integers(0, n_tenants - 1), min_size=n, max_size=n))
    slo_class = draw(st.lists(st.integers(0, n_classes - 1), min_size=n, max_size=n))
    hashes = []
    for p in prompt:
        root, shared = draw(st.integers(0, 1)), draw(st.integers(0, 4))
        blocks = -(-p // BLOCK_TOKENS)
        hashes.append([root * 100 + j if j < shared else 10_000 + len(hashes) * 10 + j for j in range(blocks)])
    return make_trace(arrival, prompt, output, max_tokens, priority, deadline, tenant=tenant, slo_class=slo_class,
                      hashes=hashes, block_tokens=BLOCK_TOKENS, n_tenants=n_tenants, n_classes=n_classes)


BLOCK_TOKENS = 32


@st.composite
def configs(draw):
    return PolicyConfig(
        max_num_batched_tokens=draw(st.sampled_from([16, 64, 256, 1024])),
        max_num_seqs=draw(st.sampled_from([1, 4, 16, 64])),
        enable_chunked_prefill=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 24, 100])),
        gpu_memory_utilization=1.0,
        block_size=draw(st.sampled_from([1, 4, 16])),
        scheduling_policy=draw(st.sampled_from(SCHEDULING_POLICIES)),
        schedule_mode=draw(st.sampled_from(SCHEDULE_MODES)),
        async_scheduling=draw(st.booleans()),
        max_prefill_tokens=draw(st.sampled_from([32, 256, 16384])),
        step_time_cap_ms=draw(st.sampled_from([0.0, 0.0, 4.3, 6.0])),
        batch_wait_iters=draw(st.sampled_from([0, 0, 2, 20])),
        batch_wait_token_ratio=draw(st.sampled_from([0.0, 0.5, 0.9])),
        kv_headroom=draw(st.sampled_from([0.0, 0.0, 0.1, 0.3])),
        admission_mode=draw(st.sampled_from(ADMISSION_MODES)),
        admission_quantile=draw(st.sampled_from([0.5, 0.9, 1.0])),
        schedule_conservativeness=draw(st.sampled_from([0.3, 1.0, 2.0])),
        preemption_mode=draw(st.sampled_from(PREEMPTION_MODES)),
        preemption_victim=draw(st.sampled_from(PREEMPTION_VICTIMS)),
        max_preemptions=draw(st.sampled_from([0, 0, 1, 3])),
        max_queue_len=draw(st.sampled_from([0, 0, 3])),
        max_wait_s=draw(st.sampled_from([0.0, 0.0, 0.05])),
        kv_high_water=draw(st.sampled_from([1.0, 1.0, 0.6])),
        reject_unmeetable_deadline=draw(st.sampled_from([False, False, True])),
        max_model_len=draw(st.sampled_from([0, 0, 0, 200])),
        enable_prefix_caching=draw(st.booleans()),
        fairness_cost_unit=draw(st.sampled_from(FAIRNESS_COST_UNITS)),
        vtc_input_weight=draw(st.sampled_from([1.0, 0.5])),
        vtc_output_weight=draw(st.sampled_from([2.0, 1.0])),
        aging_rate=draw(st.sampled_from([0.0, 0.0, 20.0])),
        max_wait_action=draw(st.sampled_from(MAX_WAIT_ACTIONS)),
        deadline_margin_ms=draw(st.sampled_from([0.0, 50.0])),
        tenant_kv_quota=draw(st.sampled_from([1.0, 1.0, 0.5])),
        tenant_token_quota=draw(st.sampled_from([1.0, 1.0, 0.4])),
    )


def assert_matches_reference(trace, cost, config, acceptance=None, seed=0):
    try:
        expected = reference_simulate(trace, cost, config, acceptance=acceptance, seed=seed)
    except ConfigError:
        assume(False)
    got = simulate(trace, cost, config, seed, acceptance=acceptance)
    for name in PER_REQUEST:
        np.testing.assert_array_equal(getattr(got, name), expected[name], err_msg=name)
    for name in COUNTERS:
        np.testing.assert_equal(getattr(got, name), expected[name], err_msg=name)  # NaN peak_step_s: no step
    # summed in another order when decode stretches are fast-forwarded
    np.testing.assert_allclose(got.tenant_service, expected["tenant_service"], rtol=1e-9, err_msg="tenant_service")
    assert got.prefill_time_saved_s == pytest.approx(expected["prefill_time_saved_s"], rel=1e-12, abs=1e-15)
    assert expected["leftover"] == (0, 0), "reference leaked KV or reservations"
    return got


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), configs(), st.sampled_from([250, 400, 800, 3000]), st.sampled_from([0, 64, 4096]))
def test_kernel_equals_reference(trace, config, kv_tokens, host_tokens):
    got = assert_matches_reference(trace, cost_model(kv_tokens, host_tokens), config)
    for state in np.unique(got.state):
        event(f"state {State(state).name}")
    for reason in np.unique(got.reject_reason):
        event(f"reject {Reject(reason).name}")
    event(f"preempted: {got.preemptions.sum() > 0}, swapped: {got.swap_outs > 0}")
    event(f"order {config.scheduling_policy}, prefix hits: {got.prefix_hit_tokens > 0}, "
          f"evictions: {got.prefix_evictions > 0}")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), configs(), st.sampled_from([250, 400, 800, 3000]), st.sampled_from(SPECULATIVE_MODES[1:]),
       st.integers(1, 6), st.sampled_from(DRAFT_COST_MODES), st.sampled_from([0.0, 0.1, 2.0]),
       st.sampled_from([0.0, 0.5]), st.sampled_from([-0.3, 0.0, 0.4]), st.integers(0, 2**31),
       st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 9), st.integers(0, 6)))
def test_kernel_equals_reference_with_speculation(trace, config, kv_tokens, mode, gamma, draft_mode, draft_cost,
                                                  spread, bias, seed, schedule):
    batch_2, k_2, batch_3, k_3 = schedule  # batch_schedule's ranges (vLLM's rules are not the kernel's)
    config = config.replace(speculative_mode=mode, num_speculative_tokens=gamma,
                            speculative_draft_cost_mode=draft_mode, speculative_draft_cost=draft_cost,
                            speculative_batch_2=batch_2, speculative_k_2=k_2, speculative_batch_3=batch_3,
                            speculative_k_3=k_3)
    acceptance = AcceptanceModel(default=[0.9, 0.75, 0.5, 0.5, 0.3, 0.2][:gamma], spread=spread, bias=bias)
    got = assert_matches_reference(trace, cost_model(kv_tokens, 64), config, acceptance, seed)
    assert got.spec_accepted_tokens <= got.spec_drafted_tokens
    event(f"verified: {got.spec_drafted_tokens > 0}, accepted: {got.spec_accepted_tokens > 0}, "
          f"preempted: {got.preemptions.sum() > 0}")


@pytest.mark.parametrize("schedule_mode", SCHEDULE_MODES)
@pytest.mark.parametrize("preemption_mode", PREEMPTION_MODES)
@pytest.mark.parametrize("victim", PREEMPTION_VICTIMS)
def test_preemption_heavy_runs_match(schedule_mode, preemption_mode, victim):
    """Overcommitted KV: every preemption mode and victim order, against the reference."""
    rng = np.random.default_rng(3)
    n = 40
    trace = make_trace(np.cumsum(rng.exponential(0.005, n)), rng.integers(10, 120, n), rng.integers(20, 150, n),
                       priority=rng.integers(0, 3, n))
    config = PolicyConfig(gpu_memory_utilization=1.0, block_size=4, schedule_mode=schedule_mode,
                          preemption_mode=preemption_mode, preemption_victim=victim, max_num_batched_tokens=256)
    got = assert_matches_reference(trace, cost_model(600, host_tokens=300, per_pair_s=1e-7), config)
    assert got.preemptions.sum() > 0
    assert (got.swap_outs > 0) == (preemption_mode != "recompute")


@pytest.mark.parametrize("fast_forward", ["0", "1"])
def test_fast_forward_is_bit_identical(monkeypatch, fast_forward):
    """Long decode stretches (fast-forwarded by default) match the step-by-step reference."""
    monkeypatch.setenv("SERVETUNE_ENGINE_FAST_FORWARD", fast_forward)
    rng = np.random.default_rng(7)
    n = 60
    arrival = np.cumsum(rng.exponential(0.3, n))
    trace = make_trace(arrival, rng.integers(1, 200, n), rng.integers(1, 300, n))
    for config in (PolicyConfig(gpu_memory_utilization=1.0, block_size=4),
                   PolicyConfig(gpu_memory_utilization=1.0, schedule_mode="prefill_first",
                                admission_mode="new_token_ratio", block_size=1)):
        got = assert_matches_reference(trace, cost_model(2000), config)
        assert got.steps > 1000


@pytest.mark.parametrize("fast_forward", ["0", "1"])
@pytest.mark.parametrize("variant", [dict(), dict(schedule_mode="prefill_first", admission_mode="new_token_ratio"),
                                     dict(enable_prefix_caching=True), dict(block_size=1)])
def test_async_eos_finishers_decode_past_their_stop_inside_a_stretch(monkeypatch, fast_forward, variant):
    """Async scheduling, requests stopping on EOS before their cap: each finisher lingers
    and decodes once more, thrown away, in the step formed beside its last one. A
    fast-forwarded stretch starts with that step (``pipeline._ghosts_change_nothing``)
    instead of forming it; the results match the step-by-step reference, also when the
    only requests left running are finishers (then the step is formed)."""
    monkeypatch.setenv("SERVETUNE_ENGINE_FAST_FORWARD", fast_forward)
    rng = np.random.default_rng(13)
    n = 50
    prompt = rng.integers(1, 200, n)
    output = rng.integers(1, 300, n)
    hashes = [[int(h) for h in rng.integers(0, 4, size=-(-p // BLOCK_TOKENS))] for p in prompt]
    trace = make_trace(np.cumsum(rng.exponential(0.2, n)), prompt, output, output + rng.integers(1, 50, n),
                       hashes=hashes, block_tokens=BLOCK_TOKENS)
    config = PolicyConfig(gpu_memory_utilization=1.0, async_scheduling=True,
                          **{"enable_prefix_caching": False, "block_size": 4, **variant})
    got = assert_matches_reference(trace, cost_model(2000), config)
    assert np.all(got.state == State.FINISHED) and got.steps > trace.output_tokens.max() + n


@pytest.mark.parametrize("fast_forward", ["0", "1"])
@pytest.mark.parametrize("threshold", [0, 48])
def test_chunked_prefill_stretches_are_bit_identical(monkeypatch, fast_forward, threshold):
    """Long prompts chunked next to the same decodes (fast-forwarded as a stretch while
    the chunk takes the rest of the budget, or nothing waits) match the reference, with
    arrivals queueing behind them and KV filling up."""
    monkeypatch.setenv("SERVETUNE_ENGINE_FAST_FORWARD", fast_forward)
    rng = np.random.default_rng(11)
    n = 24
    trace = make_trace(np.cumsum(rng.exponential(0.05, n)), rng.integers(200, 900, n), rng.integers(20, 200, n))
    for config in (PolicyConfig(gpu_memory_utilization=1.0, block_size=4, max_num_batched_tokens=64,
                                long_prefill_token_threshold=threshold),
                   PolicyConfig(gpu_memory_utilization=1.0, block_size=4, max_num_batched_tokens=64,
                                long_prefill_token_threshold=threshold, admission_mode="reservation")):
        got = assert_matches_reference(trace, cost_model(3000), config)
        assert got.prefill_tokens_computed >= trace.prompt_tokens.sum()
        assert got.steps > 500


@pytest.mark.parametrize("fast_forward", ["0", "1"])
@pytest.mark.parametrize("variant", [dict(), dict(schedule_mode="prefill_first"), dict(admission_mode="reservation"),
                                     dict(admission_mode="predicted", scheduling_policy="priority", aging_rate=0.5),
                                     dict(scheduling_policy="sjf", enable_prefix_caching=True)])
def test_backed_up_queue_stretches_are_bit_identical(monkeypatch, fast_forward, variant):
    """KV too small for the offered load: a queue stays backed up behind a head that
    cannot start, and decode stretches run across finishes and arrivals while free KV
    stays below what the head needs (``_head_start_free``). Matches the reference."""
    monkeypatch.setenv("SERVETUNE_ENGINE_FAST_FORWARD", fast_forward)
    rng = np.random.default_rng(5)
    n = 80
    prompt = rng.integers(20, 400, n)
    hashes = [[int(h) for h in rng.integers(0, 6, size=p // BLOCK_TOKENS)] for p in prompt]
    trace = make_trace(np.cumsum(rng.exponential(0.02, n)), prompt, rng.integers(50, 400, n),
                       priority=rng.integers(0, 3, n), hashes=hashes, block_tokens=BLOCK_TOKENS)
    config = PolicyConfig(gpu_memory_utilization=1.0, block_size=4, max_num_batched_tokens=512, kv_headroom=0.05,
                          **{"enable_prefix_caching": False, **variant})
    got = assert_matches_reference(trace, cost_model(1500), config)
    assert np.all(got.state == State.FINISHED)
    assert np.mean(got.queue_s > 0.5) > 0.35, "the queue must stay backed up (prefix hits shorten it a little)"


def test_full_prompt_block_computed_twice_is_not_freed_twice():
    """Regression (hypothesis): requests 3 and 6 share the full-prompt block 0. Request 3
    caches it and finishes (the entry goes idle, counted free); request 6, admitted before
    the entry existed, completes the same block under long_prefill_token_threshold
    chunking and deduplicates onto the idle entry. That must not free 32 blocks twice."""
    prompt = [1, 1, 1, 32, 1, 1, 32, 1]
    hashes = [[10000], [10010], [10020], [0], [10040], [10050], [0], [10070]]
    trace = make_trace(np.zeros(8), prompt, np.zeros(8, dtype=int), np.ones(8, dtype=int), hashes=hashes,
                       block_tokens=BLOCK_TOKENS)
    config = PolicyConfig(max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=False,
                          long_prefill_token_threshold=24, gpu_memory_utilization=1.0, block_size=1,
                          scheduling_policy="fcfs", schedule_mode="decode_first", admission_mode="none",
                          preemption_mode="recompute", preemption_victim="newest", enable_prefix_caching=True)
    got = assert_matches_reference(trace, cost_model(250), config)  # raised "leaked KV" before the fix
    assert np.all(got.state == State.FINISHED)
    assert got.kv_peak_blocks <= got.kv_capacity_blocks


def test_swapped_out_requests_never_pin_the_gpu():
    """Regression (hypothesis): swapped-out requests used to keep their prefix-cache
    references, pinning 160 of 250 blocks while the recomputed head needed 91, so nothing
    could run. A victim holding cached prefix blocks is now recomputed, not swapped."""
    n = 29
    prompt, output = [1] * n, [0] * n
    prompt[14], prompt[16], prompt[18] = 30, 46, 129
    output[14], output[16], output[18] = 62, 24, 16
    blocks_of = {16: 2, 18: 5}
    hashes = [[10_000 + 10 * i + j for j in range(blocks_of.get(i, 1))] for i in range(n)]
    trace = make_trace(np.zeros(n), prompt, output, np.maximum(output, 1), hashes=hashes, block_tokens=BLOCK_TOKENS)
    config = PolicyConfig(max_num_batched_tokens=256, max_num_seqs=4, enable_chunked_prefill=False,
                          gpu_memory_utilization=1.0, block_size=1, max_prefill_tokens=32,
                          preemption_mode="swap", enable_prefix_caching=True)
    got = assert_matches_reference(trace, cost_model(250, 64), config)  # "engine stalled" before the fix
    assert np.all(got.state == State.FINISHED)
    assert got.preemptions.sum() > 0 and got.swap_outs == 0, "every victim held cached blocks: recomputed"


def test_lpm_head_unblocked_by_eviction_is_not_fast_forwarded_past():
    """Regression (fleet reference, fast-forward on): under LPM with prefix caching, decode
    steps that evict idle cached prefixes reorder the waiting queue, so a smaller request
    can become the head and start although free KV only shrank. Fast-forward treated the
    queue as stuck and admitted it late."""
    prompt = [1] * 6 + [26, 120, 158, 160, 1, 1, 1, 136, 1, 144]
    output = [0] * 6 + [54] * 4 + [0, 0, 0, 40, 0, 30]
    offsets = [0, 1, 2, 3, 4, 5, 6, 7, 11, 16, 21, 22, 23, 24, 29, 30, 35]
    flat = [10000, 10010, 10020, 10030, 10040, 10050, 10060, 10070, 10071, 10072, 10073, 10080, 10081, 10082,
            10083, 10084, 0, 1, 2, 3, 10094, 10100, 10110, 10120, 10130, 10131, 10132, 10133, 10134, 10140,
            0, 1, 2, 3, 10154]
    hashes = [flat[offsets[i]:offsets[i + 1]] for i in range(16)]
    trace = make_trace(np.zeros(16), prompt, output, np.maximum(output, 1), hashes=hashes, block_tokens=32)
    config = PolicyConfig(max_num_batched_tokens=512, max_num_seqs=8, enable_chunked_prefill=False,
                          gpu_memory_utilization=1.0, block_size=4, scheduling_policy="lpm",
                          schedule_mode="prefill_first", enable_prefix_caching=True)
    got = assert_matches_reference(trace, cost_model(800, 64), config)  # request 15 ended late before the fix
    assert got.preemptions.sum() > 0, "the case needs preempted prompts cached and then evicted"
