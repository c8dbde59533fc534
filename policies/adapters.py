"""One replica's LoRA adapter pool: GPU slots, the host cache behind them, and the rule
that bounds the distinct adapters of a batch. Jitted pure functions over preallocated
arrays; ``tests/policies/reference_adapters.py`` is the plain-Python twin.

What the engines do (vLLM 0.33.0, SGLang 0.5.23; paths under ``site-packages``):

- A batch holds at most ``slots`` distinct adapters, counted over every *running*
  request: vLLM's scheduler skips a waiting request whose adapter is new when
  ``len(scheduled_loras) == max_loras`` (vllm/v1/core/sched/scheduler.py:1040-1047 counts
  the running requests' adapters, :1091-1102 skips); SGLang skips it when
  ``{req.lora_id} | running_loras`` exceeds ``max_loras_per_batch``
  (srt/managers/scheduler.py:4186-4191, :4208-4209, :4429-4442; lora_manager.py:427-432),
  and counts the base model as one of them (srt/arg_groups/fields/lora.py:66-69: "include
  base-only request"): ``base_slot``. A skipped request keeps its place in the queue.
- The GPU holds ``slots`` adapters (vLLM ``max_loras`` LoRA slots, lora/model_manager.py:
  348-353; SGLang's memory pool of ``max_loras_per_batch`` buffers, lora/mem_pool.py:
  139-158). Activating an adapter that is not resident evicts one no running request uses:
  the least recently used (vLLM's ``LRUCacheLoRAModelManager.activate_adapter``,
  lora/model_manager.py:1441-1453; SGLang ``lora_eviction_policy lru``), or the first
  loaded (SGLang ``fifo``, lora/eviction_policy.py:90-130).
- Behind the GPU, the host keeps ``host_slots`` adapters (vLLM ``max_cpu_loras``, an LRU
  cache: lora/worker_manager.py:288-313, model_manager.py:1393-1397, 1455-1457; SGLang
  ``max_loaded_loras``). An adapter not there is read from disk first. Every GPU-resident
  adapter is also in the host cache (``host_slots >= slots``: vllm/config/lora.py:121-126,
  srt/arg_groups/lora_hook.py:157-160).

Layout: ``pool`` i8[N_ROWS, adapters] (per adapter: running requests, GPU stamp, host
stamp; a stamp is -1 when absent) and ``state`` i8[N_STATE]. Stamps come from one counter
ticked at every acquire and release: under LRU they record the last use, under FIFO the
GPU stamp records the load.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# pool rows (per adapter)
RUNNING, GPU, HOST = 0, 1, 2
N_ROWS = 3
# state slots
SLOTS, HOST_SLOTS, POLICY, IN_USE, ON_GPU, ON_HOST, STAMP = range(7)
N_STATE = 7
# POLICY values (the lora_eviction_policy knob's choice indices) and acquire's results
LRU, FIFO = 0, 1
RESIDENT, FROM_HOST, FROM_DISK = 0, 1, 2


def new_pool(adapters: int, slots: int, host_slots: int, policy: int, preload: bool = False
             ) -> tuple[np.ndarray, np.ndarray]:
    """An empty pool for ``adapters`` adapters (Python side: tests, inspection)."""
    pool = np.empty((N_ROWS, adapters), dtype=np.int64)
    state = np.empty(N_STATE, dtype=np.int64)
    clear(pool, state, slots, host_slots, policy, preload)
    return pool, state


@njit(cache=True, nogil=True, _nrt=True)
def clear(pool, state, slots, host_slots, policy, preload):
    """Nothing on the GPU, nothing running: ``slots`` GPU slots, ``host_slots`` host entries,
    empty or (``preload``, which needs ``host_slots >= adapters``) holding every adapter."""
    pool[RUNNING] = 0
    pool[GPU] = -1
    pool[HOST] = 0 if preload else -1
    state[:] = 0
    state[SLOTS] = slots
    state[HOST_SLOTS] = host_slots
    state[POLICY] = policy
    state[ON_HOST] = pool.shape[1] if preload else 0


@njit(cache=True, nogil=True, inline="always")
def can_join(pool, state, a):
    """Whether a request on adapter ``a`` (-1: the base model, outside the pool) may start
    beside the running ones: its adapter already runs, or a distinct one more fits."""
    return a < 0 or pool[RUNNING, a] > 0 or state[IN_USE] < state[SLOTS]


@njit(cache=True, nogil=True, inline="always")
def _tick(state):
    state[STAMP] += 1
    return state[STAMP]


@njit(cache=True, nogil=True, inline="always")  # inlined: both callers pass a constant exclude_gpu
def _oldest(stamps, running, exclude_gpu, gpu):
    """The adapter with the smallest stamp >= 0 that no running request uses (and, with
    ``exclude_gpu``, that is not on the GPU); -1 if none."""
    best, best_stamp = -1, np.iinfo(np.int64).max
    for a in range(stamps.shape[0]):
        s = stamps[a]
        if s >= 0 and s < best_stamp and running[a] == 0 and not (exclude_gpu and gpu[a] >= 0):
            best, best_stamp = a, s
    return best


@njit(cache=True, nogil=True, _nrt=False)
def acquire(pool, state, a):
    """A request on adapter ``a`` (>= 0; ``can_join`` said yes) starts running: make ``a``
    resident, evicting per the policy. Returns ``RESIDENT``, ``FROM_HOST`` or ``FROM_DISK``:
    where its weights came from (the caller charges the copy)."""
    stamp = _tick(state)
    if pool[RUNNING, a] == 0:
        state[IN_USE] += 1
    pool[RUNNING, a] += 1
    kind = RESIDENT
    if pool[GPU, a] < 0:
        if state[ON_GPU] >= state[SLOTS]:
            victim = _oldest(pool[GPU], pool[RUNNING], False, pool[GPU])
            pool[GPU, victim] = -1  # a victim exists: fewer than SLOTS distinct adapters run
            state[ON_GPU] -= 1
        kind = FROM_HOST
        if pool[HOST, a] < 0:
            kind = FROM_DISK
            if state[ON_HOST] >= state[HOST_SLOTS]:
                victim = _oldest(pool[HOST], pool[RUNNING], True, pool[GPU])
                pool[HOST, victim] = -1  # HOST_SLOTS >= SLOTS: one is off the GPU
                state[ON_HOST] -= 1
            state[ON_HOST] += 1
        pool[GPU, a] = stamp
        state[ON_GPU] += 1
    elif state[POLICY] == LRU:
        pool[GPU, a] = stamp
    pool[HOST, a] = stamp
    return kind


@njit(cache=True, nogil=True, _nrt=False)
def release(pool, state, a):
    """A request on adapter ``a`` (>= 0) stops running (it ended, was preempted or left)."""
    stamp = _tick(state)
    pool[RUNNING, a] -= 1
    if pool[RUNNING, a] == 0:
        state[IN_USE] -= 1
    if state[POLICY] == LRU:
        pool[GPU, a] = stamp
    pool[HOST, a] = stamp


@njit(cache=True, nogil=True, inline="always")
def load_seconds(kind, adapter_bytes, host_bytes_per_s, disk_bytes_per_s):
    """Seconds to bring an adapter's weights to the GPU: host -> GPU over the GPU's host link,
    and first from disk into the host cache when it was not there."""
    if kind == RESIDENT:
        return 0.0
    seconds = adapter_bytes / host_bytes_per_s
    if kind == FROM_DISK:
        seconds += adapter_bytes / disk_bytes_per_s
    return seconds


@njit(cache=True, nogil=True, _nrt=False)
def step_seconds(grid, rank, tokens):
    """Seconds the adapters' GEMMs add to a step of ``tokens`` adapter tokens at ``rank``:
    ``grid`` is ``costmodels.lora.LoRACost.grid()`` (row 0 tokens, column 0 ranks), read
    linearly in both, clamped at the axes' ends (a rank outside the engines' choices
    never reaches here: ``max_lora_rank`` is one of them)."""
    if tokens <= 0:
        return 0.0
    n_r, n_t = grid.shape[0] - 1, grid.shape[1] - 1
    i = _bracket(grid[1:, 0], rank, n_r)
    j = _bracket(grid[0, 1:], tokens, n_t)
    r0, r1 = grid[1 + i, 0], grid[2 + i, 0]
    t0, t1 = grid[0, 1 + j], grid[0, 2 + j]
    wr = min(max((rank - r0) / (r1 - r0), 0.0), 1.0)
    wt = min(max((tokens - t0) / (t1 - t0), 0.0), 1.0)
    low = (1 - wt) * grid[1 + i, 1 + j] + wt * grid[1 + i, 2 + j]
    high = (1 - wt) * grid[2 + i, 1 + j] + wt * grid[2 + i, 2 + j]
    return (1 - wr) * low + wr * high


@njit(cache=True, nogil=True, inline="always")
def _bracket(axis, x, n):
    """The i with axis[i] <= x < axis[i + 1], clamped to [0, n - 2]."""
    i = 0
    while i < n - 2 and axis[i + 1] <= x:
        i += 1
    return i
