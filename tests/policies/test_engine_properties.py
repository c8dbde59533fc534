"""Contract properties of SimResult over random traces and configs, and JIT-off agreement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from policies.config import ConfigError, PolicyConfig
from policies.engine import simulate, simulate_many, statics
from policies.result import Reject, State

from .conftest import cost_model, poisson_trace
from .test_engine_reference import configs, traces


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), configs(), st.sampled_from([250, 800, 3000]), st.sampled_from([0, 4096]), st.integers(0, 2**31))
def test_contract_properties(trace, config, kv_tokens, host_tokens, seed):
    cost = cost_model(kv_tokens, host_tokens)
    try:
        result = simulate(trace, cost, config, seed=seed)
    except ConfigError:
        assume(False)
    state = result.state
    # every request ends in exactly one known state, with a reason iff rejected
    assert set(np.unique(state)) <= {int(s) for s in State}
    assert np.all((result.reject_reason != Reject.NONE) == (state == State.REJECTED))
    assert np.all(np.isfinite(result.finish_s))
    # a request never scheduled was turned away or left in the queue, and produced nothing
    never_scheduled = np.isnan(result.queue_s)
    assert set(np.unique(state[never_scheduled])) <= {State.REJECTED, State.CANCELLED}
    assert np.all(result.tokens_generated[never_scheduled] == 0)
    # time order per request
    arrival = trace.arrival_s
    has_first = ~np.isnan(result.first_token_s)
    assert np.all(result.first_token_s[has_first] >= arrival[has_first])
    assert np.all(result.finish_s >= arrival)
    finished = state == State.FINISHED
    assert np.all(result.finish_s[finished] >= result.first_token_s[finished])
    assert np.all(result.first_token_s[has_first] <= result.finish_s[has_first]), "a first token after the end"
    assert not np.any(has_first[state == State.CANCELLED]), "a cancelled request saw a token"
    assert np.all(result.queue_s[~np.isnan(result.queue_s)] >= 0)
    # tokens: finished requests produced min(output, max_tokens) (at least one), none exceed it
    cap = np.maximum(1, np.minimum(trace.output_tokens, trace.max_tokens))
    assert np.all(result.tokens_generated <= cap)
    if config.max_model_len == 0 and config.enable_chunked_prefill:  # no length cap below the KV pool
        assert np.all(result.tokens_generated[finished] == cap[finished])
    assert np.all(has_first == (result.tokens_generated > 0))
    # KV never over capacity; same seed, same result bit for bit
    assert result.kv_peak_blocks <= result.kv_capacity_blocks
    assert np.all(result.series_kv_blocks <= result.kv_capacity_blocks)
    again = simulate(trace, cost, config, seed=seed)
    for name in ("state", "first_token_s", "finish_s", "tokens_generated", "preemptions", "queue_s"):
        np.testing.assert_array_equal(getattr(again, name), getattr(result, name))
    assert (again.steps, again.busy_s) == (result.steps, result.busy_s)


def test_deadline_ends_are_timed_out_or_cancelled():
    trace = poisson_trace(200, rate=200.0, seed=4)
    deadline = trace.arrival_s + 0.05
    from .conftest import make_trace

    tight = make_trace(trace.arrival_s, trace.prompt_tokens, trace.output_tokens, deadline=deadline)
    result = simulate(tight, cost_model(20000), PolicyConfig(gpu_memory_utilization=1.0))
    late = (result.state == State.TIMED_OUT) | (result.state == State.CANCELLED)
    assert late.sum() > 20
    np.testing.assert_array_equal(result.finish_s[late], deadline[late])
    assert np.all(result.first_token_s[result.state == State.TIMED_OUT] <= deadline[result.state == State.TIMED_OUT])
    cancelled = result.state == State.CANCELLED
    assert np.all(np.isnan(result.first_token_s[cancelled])) and np.all(result.tokens_generated[cancelled] == 0)


@pytest.mark.parametrize("output", [1, 40])
def test_a_first_token_produced_after_the_deadline_reaches_nobody(output):
    """The deadline falls inside the request's prefill step: the token made at the step's
    end comes after the client left, so the request is CANCELLED with no token, never a
    first token after its own end (issue 18's impossible results)."""
    from .conftest import make_trace

    trace = make_trace([0.0], [6000], [output], deadline=[0.001])
    result = simulate(trace, cost_model(20000), PolicyConfig(gpu_memory_utilization=1.0))
    assert result.busy_s > 0.001  # the step did run past the deadline
    assert result.state[0] == State.CANCELLED and result.finish_s[0] == 0.001
    assert np.isnan(result.first_token_s[0]) and result.tokens_generated[0] == 0


def test_simulate_many_equals_simulate():
    trace = poisson_trace(300, rate=60.0, seed=2)
    cost = cost_model(3000, host_tokens=1000)
    configs = [PolicyConfig(gpu_memory_utilization=1.0),
               PolicyConfig(gpu_memory_utilization=1.0, schedule_mode="prefill_first", admission_mode="new_token_ratio",
                            block_size=1, preemption_victim="fewest_output"),
               PolicyConfig(gpu_memory_utilization=1.0, preemption_mode="swap", max_num_seqs=8)]
    many = simulate_many(trace, cost, configs)
    for config, got in zip(configs, many, strict=True):
        one = simulate(trace, cost, config)
        for name in ("state", "first_token_s", "finish_s", "tokens_generated", "preemptions"):
            np.testing.assert_array_equal(getattr(got, name), getattr(one, name))
        assert got.steps == one.steps
    assert many[0].steps != many[1].steps


def test_a_plain_config_replays_alike_with_and_without_the_speculative_inputs():
    """``Statics.spec`` is None unless a config of the batch speculates (the kernels then
    compile without the planner); a config that does not speculate must not notice which."""
    trace = poisson_trace(200, rate=60.0, seed=4)
    cost = cost_model(3000)
    plain = PolicyConfig(gpu_memory_utilization=1.0)
    drafting = plain.replace(speculative_mode="fixed", num_speculative_tokens=3)
    assert statics(trace, cost, [plain, plain.replace(max_num_seqs=8)]).spec is None
    assert statics(trace, cost, [plain, drafting]).spec is not None
    alone = simulate(trace, cost, plain)
    beside, drafted = simulate_many(trace, cost, [plain, drafting])
    for name in ("state", "first_token_s", "finish_s", "tokens_generated"):
        np.testing.assert_array_equal(getattr(beside, name), getattr(alone, name))
    assert beside.steps == alone.steps and drafted.steps < alone.steps  # the drafter did run


_JIT_OFF_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    from tests.policies.conftest import cost_model, poisson_trace
    from policies.config import PolicyConfig
    from policies.engine import simulate
    trace = poisson_trace(40, rate=100.0, seed=5)
    out = []
    for kw in ({{}}, {{"schedule_mode": "prefill_first", "admission_mode": "new_token_ratio", "block_size": 1}},
               {{"preemption_mode": "auto", "admission_mode": "predicted"}}):
        r = simulate(trace, cost_model(900, host_tokens=400), PolicyConfig(gpu_memory_utilization=1.0, **kw))
        out.append([r.state.tolist(), r.finish_s.tolist(), r.tokens_generated.tolist(), r.steps, r.busy_s])
    # LoRA: two adapters and the base model over one slot (skips, loads, the adapters' GEMMs)
    import numpy as np
    from costmodels.costmodel import CostModel
    from costmodels.lora import LoRACost
    lora = CostModel.synthetic(90_000, lora=LoRACost.linear(2e6, 1e-6))
    with_adapters = trace.replace(adapter=np.arange(trace.n) % 3, adapter_names=("", "a", "b"))
    r = simulate(with_adapters, lora, PolicyConfig(gpu_memory_utilization=1.0, enable_lora=True, max_loras=1))
    out.append([r.state.tolist(), r.finish_s.tolist(), r.adapter_loads, r.adapter_load_s, r.steps, r.busy_s])
    print(json.dumps(out))
""")


def _run_script(disable_jit: bool) -> list:
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1" if disable_jit else "0"}
    done = subprocess.run([sys.executable, "-c", _JIT_OFF_SCRIPT.format(root=root)], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout)


def test_jit_and_disabled_jit_agree():
    assert _run_script(True) == _run_script(False)
