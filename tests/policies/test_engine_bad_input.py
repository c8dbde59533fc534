"""Impossible configs fail up front with a clear message; hopeless requests are rejected."""

from __future__ import annotations

import numpy as np
import pytest

from policies.config import ConfigError, PolicyConfig
from policies.engine import simulate, simulate_many, validate
from policies.result import Reject, State

from .conftest import cost_model, make_trace


def _trace():
    return make_trace([0.0, 0.1, 0.2], [10, 20, 30], [5, 5, 5])


@pytest.mark.parametrize(("config", "message"), [
    (PolicyConfig(gpu_memory_utilization=1.0, max_num_batched_tokens=8, block_size=16), "smaller than one KV block"),
    (PolicyConfig(gpu_memory_utilization=1.0, max_model_len=5000), "max_model_len=5000"),
    (PolicyConfig(gpu_memory_utilization=1.0, enable_chunked_prefill=False, max_num_batched_tokens=512,
                  max_model_len=1024), "without chunked prefill"),
    (PolicyConfig(gpu_memory_utilization=0.3, block_size=16), "gpu_memory_utilization"),
])
def test_impossible_configs_raise_config_error(config, message):
    cost = cost_model(4096) if config.gpu_memory_utilization == 1.0 else _weights_heavy()
    with pytest.raises(ConfigError, match=message):
        validate(_trace(), cost, config)
    with pytest.raises(ConfigError, match=message):
        simulate_many(_trace(), cost, [PolicyConfig(gpu_memory_utilization=1.0), config])


def _weights_heavy():
    from dataclasses import replace

    return replace(cost_model(4096), weight_bytes=cost_model(4096).gpu_memory_bytes * 0.5)


def test_kv_smaller_than_one_block_raises():
    with pytest.raises(ConfigError, match="less than one block"):
        simulate(_trace(), cost_model(8), PolicyConfig(gpu_memory_utilization=1.0, block_size=16))


def test_empty_trace_and_bad_series_spacing_raise():
    empty = make_trace(np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    with pytest.raises(ValueError, match="no requests"):
        simulate(empty, cost_model(4096), PolicyConfig(gpu_memory_utilization=1.0))
    with pytest.raises(ValueError, match="series_every_s"):
        simulate(_trace(), cost_model(4096), PolicyConfig(gpu_memory_utilization=1.0), series_every_s=0.0)


@pytest.mark.parametrize("mode", ["none", "reservation", "predicted", "new_token_ratio"])
def test_request_that_can_never_fit_is_rejected_not_crashed(mode):
    trace = make_trace([0.0, 0.0, 0.5], [100, 5000, 100], [10, 10, 10])
    result = simulate(trace, cost_model(1024), PolicyConfig(gpu_memory_utilization=1.0, admission_mode=mode))
    assert result.state.tolist() == [State.FINISHED, State.REJECTED, State.FINISHED]
    assert result.reject_reason[1] == Reject.EXCEEDS_CAPACITY


def test_queue_full_and_high_water_reject_with_reasons():
    trace = make_trace(np.zeros(6), np.full(6, 200), np.full(6, 50))
    full = simulate(trace, cost_model(100_000), PolicyConfig(gpu_memory_utilization=1.0, max_queue_len=2))
    assert (full.reject_reason == Reject.QUEUE_FULL).sum() == 4
    late = make_trace(np.arange(6) * 0.05, np.full(6, 200), np.full(6, 200))
    water = simulate(late, cost_model(1024), PolicyConfig(gpu_memory_utilization=1.0, kv_high_water=0.3))
    assert (water.reject_reason == Reject.KV_HIGH_WATER).sum() > 0


def test_max_preemptions_rejects_with_reason():
    rng = np.random.default_rng(0)
    trace = make_trace(np.zeros(30), rng.integers(50, 100, 30), rng.integers(100, 200, 30))
    result = simulate(trace, cost_model(800), PolicyConfig(gpu_memory_utilization=1.0, max_preemptions=1,
                                                           block_size=4))
    capped = result.reject_reason == Reject.MAX_PREEMPTIONS
    assert capped.sum() > 0
    assert result.preemptions.max() <= 1
