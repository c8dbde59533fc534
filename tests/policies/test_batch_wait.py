"""TensorRT-LLM's batch waiting: prompts held beside running requests until the batch fills."""

import pytest

from policies.config import PolicyConfig, inert_knobs
from policies.engine import simulate

from .conftest import cost_model, make_trace

# Step = 2 ms + 0.1 ms per token: request 0's 100-token prefill ends at 12 ms, then each decode takes 2.1 ms
COST = cost_model(100_000, per_token_s=1e-4, per_seq_s=0.0, per_kv_token_s=0.0, per_pair_s=0.0, overhead_s=2e-3)
PLAIN = PolicyConfig(gpu_memory_utilization=1.0, enable_chunked_prefill=False)
WAIT = PLAIN.replace(batch_wait_iters=5, batch_wait_token_ratio=0.9)


def test_a_prompt_arriving_beside_a_decode_waits_the_set_number_of_steps():
    trace = make_trace([0.0, 0.013], [100, 100], [50, 5])
    plain, held = simulate(trace, COST, PLAIN), simulate(trace, COST, WAIT)
    assert plain.first_token_s[0] == held.first_token_s[0] == pytest.approx(0.012)
    # without the wait it starts at the first boundary after it arrives (14.1 ms); held 5 decode steps
    assert plain.first_token_s[1] == pytest.approx(0.0141 + 0.0121)  # 101 tokens: 2 + 10.1 ms
    assert held.first_token_s[1] - plain.first_token_s[1] == pytest.approx(5 * 0.0021)


def test_prompts_that_fill_the_budget_share_threshold_or_an_idle_engine_do_not_wait():
    full = make_trace([0.0, 0.013, 0.013, 0.013], [100, 3000, 3000, 3000], [50, 5, 5, 5])
    # one decode token + the 8191 tokens left of the budget reach 0.9 x 8192
    assert simulate(full, COST, WAIT).first_token_s[1] == simulate(full, COST, PLAIN).first_token_s[1]
    idle = make_trace([0.0], [100], [5])  # nothing runs beside it
    assert simulate(idle, COST, WAIT).first_token_s[0] == pytest.approx(0.012)


def test_batch_waiting_needs_both_knobs():
    one = make_trace([0.0, 0.013], [100, 100], [50, 5])
    for config in (PLAIN.replace(batch_wait_iters=5), PLAIN.replace(batch_wait_token_ratio=0.9)):
        assert simulate(one, COST, config).first_token_s[1] == simulate(one, COST, PLAIN).first_token_s[1]
    assert {"batch_wait_iters", "batch_wait_token_ratio"} <= inert_knobs(PLAIN)
    assert not {"batch_wait_iters", "batch_wait_token_ratio"} & inert_knobs(WAIT)
