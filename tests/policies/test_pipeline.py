"""Async scheduling (vLLM) and the overlap schedule (SGLang): each rule of
``policies.engine.pipeline`` on a run small enough to count its steps by hand.

Every step that computes a token takes 1/64 s (overhead only), so times are step counts.
"""

from __future__ import annotations

import numpy as np
import pytest

from policies.config import PolicyConfig
from policies.engine import simulate

from .conftest import cost_model, make_trace

STEP = 1 / 64


def _cost(kv_tokens=4096):
    return cost_model(kv_tokens, per_token_s=0.0, per_seq_s=0.0, per_kv_token_s=0.0, per_pair_s=0.0,
                      overhead_s=STEP)


def _vllm(**kw):
    return PolicyConfig(gpu_memory_utilization=1.0, block_size=16, enable_prefix_caching=False, **kw)


def _both(trace, config, kv_tokens=4096):
    cost = _cost(kv_tokens)
    return (simulate(trace, cost, config.replace(async_scheduling=False)),
            simulate(trace, cost, config.replace(async_scheduling=True)))


def test_an_arrival_during_a_step_first_runs_two_steps_later():
    """vLLM 0.33 v1/engine/core.py step_with_batch_queue: step k+1 is formed as step k starts,
    so a request arriving while step k runs waits for k+2 (k+1 in the sync loop)."""
    trace = make_trace([0.0, 1.5 * STEP], [32, 32], [20, 5])
    sync, asyn = _both(trace, _vllm())
    # request 1 arrives during step 1 (t in [1, 2) steps): sync schedules it at 2, async at 3
    assert sync.first_token_s[1] == pytest.approx(3 * STEP)
    assert asyn.first_token_s[1] == pytest.approx(4 * STEP)
    assert asyn.first_token_s[0] == sync.first_token_s[0]  # a running request decodes without a gap
    assert asyn.finish_s[0] == sync.finish_s[0]


def test_an_idle_engine_forms_at_the_arrival():
    trace = make_trace([0.0, 10.0], [32, 32], [3, 3])
    sync, asyn = _both(trace, _vllm())
    np.testing.assert_array_equal(asyn.first_token_s, sync.first_token_s)
    assert asyn.first_token_s[1] == pytest.approx(10.0 + STEP)


def test_a_finished_request_frees_its_seat_a_step_late():
    """Two seats: the waiting request takes the finished one's seat one step after the sync
    loop would, since the finished request is still on vLLM's running list (len(running)
    == max_num_seqs) when the next step is formed beside the other's decode."""
    trace = make_trace([0.0, 0.0, 0.0], [32, 32, 32], [20, 4, 4], max_tokens=[20, 4, 4])
    sync, asyn = _both(trace, _vllm(max_num_seqs=2))
    assert sync.first_token_s[2] == pytest.approx(5 * STEP)
    assert asyn.first_token_s[2] == pytest.approx(6 * STEP)


def test_an_empty_formation_waits_for_the_outputs_and_forms_again():
    """One seat: with only the finishing request to run, the step formed beside it is empty;
    vLLM then waits for the step in flight and forms again (core.py step_with_batch_queue),
    so the next request starts when the sync loop would start it."""
    trace = make_trace([0.0, 0.0], [32, 32], [4, 4], max_tokens=[4, 4])
    sync, asyn = _both(trace, _vllm(max_num_seqs=1))
    np.testing.assert_array_equal(asyn.first_token_s, sync.first_token_s)
    assert sync.steps == asyn.steps == 8


def test_an_eos_finisher_decodes_once_more_a_length_finisher_does_not():
    """vLLM 0.33 v1/core/sched/scheduler.py:801-814 skips a request whose token in flight
    reaches max_tokens; one that stops on EOS before its cap gets one more decode, thrown
    away: a step that computes a token and takes time."""
    length = make_trace([0.0], [32], [4], max_tokens=[4])
    eos = make_trace([0.0], [32], [4], max_tokens=[100])
    for trace, extra in ((length, 0), (eos, 1)):
        sync, asyn = _both(trace, _vllm())
        assert asyn.finish_s[0] == sync.finish_s[0] == pytest.approx(4 * STEP)
        assert asyn.steps == sync.steps + extra
        assert asyn.busy_s == pytest.approx(sync.busy_s + extra * STEP)


def test_an_sglang_victim_loses_its_token_in_flight():
    """SGLang's overlap loop throws a retracted request's token in flight away
    (batch_result_processor.py:344-349; vLLM keeps it, scheduler.py:1825-1836, which the
    recorded vLLM runs check): a request retracted right after its prefill streams its first
    token only once it has been prefilled again, long after that first prefill ended."""
    # A's decode needs a fourth block as B's prefill takes the last three of six
    trace = make_trace([0.0, 0.5 * STEP], [47, 40], [20, 5], max_tokens=[20, 5])
    config = _vllm(schedule_mode="prefill_first", preemption_victim="fewest_output", admission_mode="none",
                   async_scheduling=True)
    got = simulate(trace, _cost(96), config)
    first_prefill_end = trace.arrival_s[1] + got.queue_s[1] + STEP
    assert got.preemptions.tolist() == [0, 1]
    assert got.first_token_s[1] > first_prefill_end + STEP  # not the token its first prefill sampled
    assert got.tokens_generated.tolist() == [20, 5] and (got.state == 0).all()
