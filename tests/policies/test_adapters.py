"""The LoRA adapter pool (``policies.adapters``) against its plain-Python twin, and the
engine's use of it: the batch limit, load delays, LRU eviction, the KV the slots take and
the adapters' GEMMs in the step time."""

from __future__ import annotations

import numpy as np
import pytest

from costmodels.costmodel import CostModel
from costmodels.lora import LoRACost
from policies import adapters as adm
from policies.config import ConfigError, PolicyConfig
from policies.engine import simulate
from studies.traces import Trace
from tests.policies.reference_adapters import RefAdapterPool


def _ref_state(ref: RefAdapterPool, n: int) -> tuple:
    gpu = sorted(ref.gpu)
    host = sorted(ref.host)
    return list(ref.running), gpu, host


def _kernel_state(pool: np.ndarray, n: int) -> tuple:
    return (pool[adm.RUNNING].tolist(), np.flatnonzero(pool[adm.GPU] >= 0).tolist(),
            np.flatnonzero(pool[adm.HOST] >= 0).tolist())


@pytest.mark.parametrize("policy", ["lru", "fifo"])
@pytest.mark.parametrize("seed", range(6))
def test_pool_matches_the_reference_over_random_use(policy, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    slots = int(rng.integers(1, n + 1))
    host_slots = int(rng.integers(slots, n + 2))
    preload = bool(rng.integers(0, 2)) and host_slots >= n
    pool, state = adm.new_pool(n, slots, host_slots, adm.LRU if policy == "lru" else adm.FIFO, preload)
    ref = RefAdapterPool(n, slots, host_slots, policy, preload)
    running: list[int] = []
    kinds = []
    for _ in range(300):
        if running and rng.random() < 0.45:
            a = running.pop(int(rng.integers(len(running))))
            adm.release(pool, state, a)
            ref.release(a)
        else:
            a = int(rng.integers(-1, n))
            joins = adm.can_join(pool, state, a)
            assert joins == ref.can_join(a)
            if joins and a >= 0:
                kind = adm.acquire(pool, state, a)
                assert kind == ref.acquire(a)
                kinds.append(kind)
                running.append(a)
        assert _kernel_state(pool, n) == _ref_state(ref, n)
        assert state[adm.IN_USE] == ref.distinct_running() <= slots
        assert state[adm.ON_GPU] == len(ref.gpu) <= slots and state[adm.ON_HOST] == len(ref.host) <= host_slots
    assert adm.FROM_HOST in kinds or slots == n or preload is False  # the host cache served some loads
    assert adm.RESIDENT in kinds


def test_lru_evicts_the_least_recently_used_idle_adapter_and_fifo_the_first_loaded():
    for policy, evicted in ((adm.LRU, 1), (adm.FIFO, 0)):
        pool, state = adm.new_pool(3, 2, 3, policy)
        for a in (0, 1):
            adm.acquire(pool, state, a)
            adm.release(pool, state, a)
        adm.acquire(pool, state, 0)  # 0 used again: under LRU, 1 is now the oldest
        adm.release(pool, state, 0)
        assert adm.acquire(pool, state, 2) == adm.FROM_DISK
        assert pool[adm.GPU, evicted] < 0 and pool[adm.GPU, 1 - evicted] >= 0
        assert adm.acquire(pool, state, evicted) == adm.FROM_HOST  # still in the host cache


def test_an_adapter_a_running_request_uses_is_never_evicted():
    pool, state = adm.new_pool(3, 2, 2, adm.LRU)
    adm.acquire(pool, state, 0)  # stays running
    adm.acquire(pool, state, 1)
    adm.release(pool, state, 1)
    assert adm.can_join(pool, state, 2)
    adm.acquire(pool, state, 2)
    assert pool[adm.GPU, 0] >= 0 and pool[adm.GPU, 1] < 0
    assert not adm.can_join(pool, state, 1)  # two distinct adapters run: a third must wait
    assert adm.can_join(pool, state, 0) and adm.can_join(pool, state, -1)


def test_load_seconds_are_the_copy_over_the_host_link_plus_the_disk_read_when_not_cached():
    assert adm.load_seconds(adm.RESIDENT, 1e9, 25e9, 2e9) == 0.0
    assert adm.load_seconds(adm.FROM_HOST, 1e9, 25e9, 2e9) == pytest.approx(0.04)
    assert adm.load_seconds(adm.FROM_DISK, 1e9, 25e9, 2e9) == pytest.approx(0.54)


def test_step_seconds_reads_the_lora_grid_linearly():
    cost = LoRACost.linear(1.0, 1e-6)
    grid = cost.grid()
    assert adm.step_seconds(grid, 16.0, 0) == 0.0
    assert adm.step_seconds(grid, 16.0, 1000) == pytest.approx(16 * 1000 * 1e-6)
    assert adm.step_seconds(grid, 24.0, 10) == pytest.approx(24 * 10 * 1e-6)


# -- the engine ---------------------------------------------------------------------------
BYTES_PER_RANK = 2e6  # a 32 MB adapter at rank 16
HOST_BW = 25e9


def _cost(**kw) -> CostModel:
    return CostModel.synthetic(200_000, swap_bytes_per_s=HOST_BW, lora=LoRACost.linear(BYTES_PER_RANK, 0.0, **kw))


def _trace(adapters: list[str], gap: float = 0.001, prompt: int = 64, output: int = 20) -> Trace:
    n = len(adapters)
    names = tuple(dict.fromkeys(["", *adapters]))
    return Trace.from_columns(np.arange(n) * gap, np.full(n, prompt), np.full(n, output),
                              max_tokens=np.full(n, output), adapter=[names.index(a) for a in adapters],
                              adapter_names=names)


def test_one_slot_runs_one_adapter_at_a_time_and_skipped_requests_keep_their_place():
    trace = _trace(["a", "b", "a", "b", "a", ""])
    result = simulate(trace, _cost(), PolicyConfig(enable_lora=True, max_loras=1))
    first = result.first_token_s
    # "a" requests (0, 2, 4) and the base request run first; each "b" waits for every "a" to end
    assert max(first[[0, 2, 4, 5]]) < min(first[[1, 3]])
    assert min(first[[1, 3]]) >= max(result.finish_s[[0, 2, 4]])
    assert result.adapter_loads == 2 and result.adapter_disk_loads == 2  # a, then b: each read once from disk
    two = simulate(trace, _cost(), PolicyConfig(enable_lora=True, max_loras=2))
    assert two.finish_s.max() < result.finish_s.max()
    assert np.all(np.diff(two.first_token_s[:5]) >= 0)  # both run together, in arrival order


def test_a_load_delays_the_step_by_the_copy_and_the_host_cache_spares_the_disk():
    rank = 16
    adapter_bytes = BYTES_PER_RANK * rank
    disk = 2e9
    trace = _trace(["a", "b", "a", "b"], gap=1.0)  # one at a time: each finishes before the next arrives
    config = PolicyConfig(enable_lora=True, max_loras=1, max_lora_rank=rank)
    cached = simulate(trace, _cost(disk_bytes_per_s=disk), config.replace(max_cpu_loras=2))
    uncached = simulate(trace, _cost(disk_bytes_per_s=disk), config.replace(max_cpu_loras=1))
    copy_s, read_s = adapter_bytes / HOST_BW, adapter_bytes / disk
    assert cached.adapter_loads == uncached.adapter_loads == 4
    assert (cached.adapter_disk_loads, uncached.adapter_disk_loads) == (2, 4)
    assert cached.adapter_load_s == pytest.approx(4 * copy_s + 2 * read_s)
    assert uncached.adapter_load_s == pytest.approx(4 * (copy_s + read_s))
    base = simulate(_trace(["", "", "", ""], gap=1.0), _cost(disk_bytes_per_s=disk), config)
    ttft = cached.first_token_s - trace.arrival_s
    base_ttft = base.first_token_s - trace.arrival_s
    np.testing.assert_allclose(ttft - base_ttft, [copy_s + read_s, copy_s + read_s, copy_s, copy_s], rtol=1e-9)


def test_adapter_slots_take_kv_memory_and_their_gemms_add_to_each_step():
    trace = _trace(["a"] * 4 + [""] * 4)
    plain = simulate(trace.replace(adapter=np.zeros(8, dtype=np.int32)), CostModel.synthetic(200_000),
                     PolicyConfig())
    slow = CostModel.synthetic(200_000, lora=LoRACost.linear(BYTES_PER_RANK, 1e-6))
    lora = simulate(trace, slow, PolicyConfig(enable_lora=True, max_loras=4, max_lora_rank=16))
    kv_bytes = slow.kv_bytes_per_token
    lost = int(-(-4 * 16 * BYTES_PER_RANK // (kv_bytes * 16)))
    assert plain.kv_capacity_blocks - lora.kv_capacity_blocks in (lost - 1, lost)
    assert lora.busy_s > plain.busy_s + lora.adapter_load_s  # the shrink/expand GEMMs cost time
    with_base_trace = simulate(trace.replace(adapter=np.zeros(8, dtype=np.int32)), slow,
                               PolicyConfig(enable_lora=True, max_loras=4, max_lora_rank=16))
    assert with_base_trace.adapter_loads == 0 and with_base_trace.busy_s == pytest.approx(plain.busy_s)


def test_sglang_counts_the_base_model_as_one_adapter_of_the_batch():
    trace = _trace(["a", "", "a", ""])
    counted = simulate(trace, _cost(), PolicyConfig(enable_lora=True, max_loras=1, lora_base_slot=True,
                                                      lora_preload=True))
    first = counted.first_token_s
    assert max(first[[0, 2]]) < min(first[[1, 3]])  # the base requests wait for the adapter's to end
    assert counted.adapter_loads == 1 and counted.adapter_disk_loads == 0  # preloaded: one host copy
    free = simulate(trace, _cost(), PolicyConfig(enable_lora=True, max_loras=1))
    assert free.finish_s.max() < counted.finish_s.max()


def test_lora_inputs_are_checked_by_name():
    trace = _trace(["a", ""])
    with pytest.raises(ConfigError, match="asks for LoRA adapters.*enable_lora is off"):
        simulate(trace, _cost(), PolicyConfig())
    with pytest.raises(ConfigError, match="has no LoRA cost"):
        simulate(trace, CostModel.synthetic(200_000), PolicyConfig(enable_lora=True))
    with pytest.raises(ConfigError, match="max_cpu_loras=1 must be >= max_loras=2"):
        simulate(trace, _cost(), PolicyConfig(enable_lora=True, max_loras=2, max_cpu_loras=1))
