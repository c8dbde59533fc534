"""``preemption_mode = "auto"`` weighs the wait until a swapped request can return (issue 16
part 6): four requests fill a 1024-token pool at t = 1.0 s and the newest is preempted. Its
copy out and back (2.7 ms) is cheaper than re-prefilling its 256 tokens (4.5 ms), so auto
swaps it, unless its client leaves before the running batch frees its 64 blocks: with the
others capped at 1000 tokens they are expected to take 1.0 s, with caps of 300 (their true
length) 0.07 s. The kernel agrees with the reference in every case."""

import math

import pytest

from policies.config import PolicyConfig

from .conftest import cost_model, make_trace
from .test_engine_reference import assert_matches_reference

CONFIG = PolicyConfig(gpu_memory_utilization=1.0, block_size=4, preemption_mode="auto", max_num_batched_tokens=256,
                      max_model_len=1024)


@pytest.mark.parametrize("cap, deadline_s, swaps", [
    (300, math.nan, True), (1000, math.nan, True),  # no deadline: the wait delays both ways alike
    (300, 1.2, True),  # back by about 1.07 s, before its client leaves
    (1000, 1.2, False),  # expected back at about 2.0 s, after its client left: copying it out is waste
    (1000, 100.0, True),
])
def test_auto_swaps_only_a_victim_expected_back_before_its_deadline(cap, deadline_s, swaps):
    n = 4
    trace = make_trace([0.0] * n, [8] * n, [300] * n, max_tokens=[cap] * n, deadline=[math.nan] * (n - 1) + [deadline_s])
    got = assert_matches_reference(trace, cost_model(1024, host_tokens=1024), CONFIG)
    assert got.preemptions.tolist() == [0, 0, 0, 1]
    assert got.swap_outs == (1 if swaps else 0)
