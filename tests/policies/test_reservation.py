"""The seed reservation rule, and the kernel's `reservation` mode agreeing with it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodels.costmodel import CostModel
from policies.config import PolicyConfig
from policies.engine import simulate
from policies.reservation import Candidate, admit_by_reservation
from policies.result import Reject

from .conftest import make_trace


def _issue_candidates(**override):
    a = dict(name="a", priority=1, deadline=10.0, prompt_remaining=2, max_output=4, kv_bytes_per_token=100)
    a.update(override)
    return [
        Candidate(**a),
        Candidate("b", 2, 5.0, 1, 3, 100),
        Candidate("c", 1, 20.0, 8, 1, 100),
    ]


def test_issue_example_admits_b_then_a():
    admitted, reserved = admit_by_reservation(_issue_candidates(), active_bytes=200, capacity_bytes=1300,
                                              headroom_bytes=100)
    assert admitted == ["b", "a"]
    assert reserved == 1200


def test_negative_max_output_raises():
    with pytest.raises(ValueError, match="max_output"):
        admit_by_reservation(_issue_candidates(max_output=-1), 200, 1300, 100)


def test_active_plus_headroom_over_capacity_raises():
    with pytest.raises(ValueError, match="exceeds capacity"):
        admit_by_reservation(_issue_candidates(), 1250, 1300, 100)


def test_first_misfit_stops_admission():
    # c does not fit after b; a smaller d behind it must not overtake
    cands = [Candidate("c", 5, 1.0, 50, 50, 1), Candidate("d", 1, 2.0, 1, 1, 1)]
    assert admit_by_reservation(cands, 0, 60, 0) == ([], 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=8),
       st.integers(20, 160), st.sampled_from([0.0, 0.05, 0.2]))
def test_kernel_first_step_admits_what_the_rule_admits(reqs, capacity, headroom_frac):
    """All requests arrive together: the first step starts exactly the rule's admitted set.

    With block_size 1 a block is a token, so the rule in bytes (x kv_bytes_per_token)
    and the kernel in blocks agree; deadlines follow arrival order as the kernel's
    priority queue breaks ties by arrival.
    """
    n = len(reqs)
    priority = [p for p, _, _ in reqs]
    prompt = [q for _, q, _ in reqs]
    max_out = [m for _, _, m in reqs]
    trace = make_trace(np.zeros(n), prompt, max_out, max_tokens=max_out, priority=priority)
    config = PolicyConfig(admission_mode="reservation", block_size=1, scheduling_policy="priority",
                          max_num_batched_tokens=100_000, max_num_seqs=64, gpu_memory_utilization=1.0,
                          kv_headroom=headroom_frac)
    kv = 100
    cost = CostModel.synthetic(kv_capacity_tokens=capacity, kv_bytes_per_token=kv)
    result = simulate(trace, cost, config)
    headroom = int(headroom_frac * capacity)
    # the engine caps a request's output at what the KV pool could ever hold
    cap_out = [min(max_out[i], capacity - prompt[i]) for i in range(n)]
    fits = [i for i in range(n) if cap_out[i] > 0 and prompt[i] + cap_out[i] <= capacity - headroom]
    cands = [Candidate(str(i), priority[i], float(i), prompt[i], cap_out[i], kv) for i in fits]
    admitted, _ = admit_by_reservation(cands, 0, capacity * kv, headroom * kv)
    started_first = {str(i) for i in range(n) if result.queue_s[i] == 0.0}
    assert started_first == set(admitted)
    too_big = set(range(n)) - set(fits)
    assert all(result.reject_reason[i] == Reject.EXCEEDS_CAPACITY for i in too_big)
