"""vLLM's prefix-cache rules in the engine (``VLLM_CACHE``), each on a run small enough to count
by hand, against SGLang's radix-cache rules on the same run."""

from __future__ import annotations

import numpy as np

from policies.config import PolicyConfig
from policies.engine import simulate

from .conftest import cost_model, make_trace

BT = 32  # trace block tokens


def _run(schedule_mode: str, arrivals, prompts, hashes, outputs, kv_tokens: int = 4096):
    trace = make_trace(np.asarray(arrivals, float), np.asarray(prompts), np.asarray(outputs),
                       hashes=hashes, block_tokens=BT)
    config = PolicyConfig(gpu_memory_utilization=1.0, block_size=4, max_num_batched_tokens=512,
                          enable_prefix_caching=True, schedule_mode=schedule_mode)
    return simulate(trace, cost_model(kv_tokens), config)


def test_a_block_is_shared_in_the_step_that_schedules_it():
    """Two prompts with one 3-block prefix arrive together. vLLM caches a block when the step
    computing it is scheduled (kv_cache_manager.py allocate_slots -> cache_blocks), so the
    second, scheduled later in that step, hits all 3 blocks; SGLang enters a prefix into its
    radix tree once computed, so the second computes it too."""
    prefix = [11, 12, 13]
    args = ([0.0, 0.0], [3 * BT + 5, 3 * BT + 9], [prefix + [21], prefix + [22]], [4, 4])
    vllm = _run("decode_first", *args)
    sglang = _run("prefill_first", *args)
    assert vllm.cached_prompt_tokens.tolist() == [0, 3 * BT]
    assert sglang.cached_prompt_tokens.tolist() == [0, 0]


def test_a_request_recomputed_finds_its_own_blocks_again():
    """A pool too small for both requests' outputs (264 tokens each, 400 in all) preempts the
    newer one (recompute). Under
    vLLM's rules its blocks stay cached, generated tokens included (kv_cache_manager.py:616-625),
    so its re-prefill hits them: far more cached tokens than its prompt's hash blocks alone,
    and more than SGLang's target, which frees a retracted request's KV uncached."""
    prompts = [2 * BT, 2 * BT]
    hashes = [[1, 2], [3, 4]]
    vllm = _run("decode_first", [0.0, 0.0], prompts, hashes, [200, 200], kv_tokens=400)
    sglang = _run("prefill_first", [0.0, 0.0], prompts, hashes, [200, 200], kv_tokens=400)
    assert vllm.preemptions.sum() >= 1 and sglang.preemptions.sum() >= 1
    assert vllm.prefix_hit_tokens > 2 * BT, "its own generated blocks were hit, not just a prompt block"
    assert vllm.prefix_hit_tokens > sglang.prefix_hit_tokens
