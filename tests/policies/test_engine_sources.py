"""Engine rules taken from the real engines' source (vLLM 0.33, SGLang 0.5.23), each
checked on the kernel and, through ``assert_matches_reference``, on the reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policies.config import PolicyConfig

from .conftest import cost_model, make_trace
from .test_engine_reference import assert_matches_reference

BUDGET = 2048
THRESHOLD = 512
LONG = 5000  # ceil(5000 / 2048) = 3 chunks alone, ceil(5000 / 512) = 10 under the threshold


def _config(**kw):
    return PolicyConfig(gpu_memory_utilization=1.0, block_size=16, max_num_batched_tokens=BUDGET,
                        long_prefill_token_threshold=THRESHOLD, **kw)


@pytest.mark.parametrize("fast_forward", ["0", "1"])
@pytest.mark.parametrize("schedule_mode", ["decode_first", "prefill_first"])
def test_long_prefill_threshold_skips_a_lone_request(monkeypatch, fast_forward, schedule_mode):
    """vLLM 0.33 vllm/v1/core/sched/scheduler.py:754-763: ``long_prefill_token_threshold``
    is 0 unless running + waiting > 1 at the start of ``schedule()``. A lone 5000-token
    prompt under threshold 512 prefills in ceil(5000 / 2048) = 3 steps, not 10."""
    monkeypatch.setenv("SERVETUNE_ENGINE_FAST_FORWARD", fast_forward)
    trace = make_trace([0.0], [LONG], [1])
    got = assert_matches_reference(trace, cost_model(16384), _config(schedule_mode=schedule_mode))
    assert got.steps == math.ceil(LONG / BUDGET) == 3
    assert got.prefill_tokens_computed == LONG


@pytest.mark.parametrize("fast_forward", ["0", "1"])
def test_long_prefill_threshold_applies_with_a_second_request(monkeypatch, fast_forward):
    """The same prompt next to a second request (a short one decoding throughout) is cut
    to 512 tokens a step: its first token comes at the end of step ceil(5000 / 512) = 10."""
    monkeypatch.setenv("SERVETUNE_ENGINE_FAST_FORWARD", fast_forward)
    trace = make_trace([0.0, 0.0], [LONG, 10], [1, 100])
    config = _config()
    got = assert_matches_reference(trace, cost_model(16384), config)
    alone = assert_matches_reference(make_trace([0.0], [LONG], [1]), cost_model(16384), config)
    # the long request's first token waits 10 steps; alone it took 3
    assert got.first_token_s[0] > alone.first_token_s[0]
    ten = make_trace([0.0, 0.0], [LONG, 10], [1, 100])
    uncapped = assert_matches_reference(ten, cost_model(16384), config.replace(long_prefill_token_threshold=0))
    assert uncapped.first_token_s[0] < got.first_token_s[0]
    # steps: 10 while both run (the long prompt's chunks), then the short one's 100 - 10 decodes
    assert got.steps == math.ceil(LONG / THRESHOLD) + (100 - math.ceil(LONG / THRESHOLD))


def test_long_prefill_threshold_drops_once_the_other_request_ends():
    """The rule is re-evaluated every step: once the short request has finished the long
    one is alone and takes the whole budget for the rest of its prompt."""
    # short: 10-token prompt, 3 tokens out -> it runs steps 1..3, the long prompt gets 512 a step meanwhile
    trace = make_trace([0.0, 0.0], [LONG, 10], [1, 3])
    got = assert_matches_reference(trace, cost_model(16384), _config())
    left = LONG - 3 * THRESHOLD
    assert got.steps == 3 + math.ceil(left / BUDGET)


# -- SGLang lof ---------------------------------------------------------------------------
def _lof_trace(output, max_tokens):
    """A long request occupying the only sequence slot, then two waiting requests with
    the given true output lengths and caps, arriving in order 1, 2."""
    return make_trace([0.0, 0.001, 0.002], [20, 20, 20], [30, *output], [30, *max_tokens])


def test_lof_serves_the_larger_cap_first():
    """sglang/srt/managers/schedule_policy.py:504-519 ``_sort_by_longest_output``: the
    waiting queue sorted by -max_new_tokens (stable). With one sequence slot, request 2
    (cap 50) starts before request 1 (cap 10), though it arrived later; FCFS the reverse."""
    trace = _lof_trace([5, 5], [10, 50])
    lof = assert_matches_reference(trace, cost_model(4096), PolicyConfig(
        gpu_memory_utilization=1.0, max_num_seqs=1, scheduling_policy="lof"))
    fcfs = assert_matches_reference(trace, cost_model(4096), PolicyConfig(
        gpu_memory_utilization=1.0, max_num_seqs=1, scheduling_policy="fcfs"))
    assert lof.first_token_s[2] < lof.first_token_s[1]
    assert fcfs.first_token_s[1] < fcfs.first_token_s[2]


def test_lof_ties_keep_enqueue_order():
    trace = _lof_trace([5, 5], [40, 40])
    got = assert_matches_reference(trace, cost_model(4096), PolicyConfig(
        gpu_memory_utilization=1.0, max_num_seqs=1, scheduling_policy="lof"))
    assert got.first_token_s[1] < got.first_token_s[2]


def test_lof_never_reads_the_true_output_length():
    """Swapping the two waiting requests' true output lengths (caps unchanged) leaves the
    order, hence the start times, unchanged: lof reads the cap, not output_tokens."""
    config = PolicyConfig(gpu_memory_utilization=1.0, max_num_seqs=1, scheduling_policy="lof")
    a = assert_matches_reference(_lof_trace([3, 40], [45, 50]), cost_model(4096), config)
    b = assert_matches_reference(_lof_trace([40, 3], [45, 50]), cost_model(4096), config)
    assert a.first_token_s[2] < a.first_token_s[1] and b.first_token_s[2] < b.first_token_s[1]
    np.testing.assert_array_equal(a.queue_s[:1], b.queue_s[:1])
    assert a.queue_s[2] == b.queue_s[2]  # request 2 (larger cap) starts at the same time either way
