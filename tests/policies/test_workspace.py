"""The activation workspace of the steps a run formed (issue 16 part 2): the kernel keeps
the largest step and when it first formed, and ``policies.workspace`` says whether it fit
the memory left beside weights, KV pool and fixed reserves."""

import math

import numpy as np
import pytest

from costmodels import build
from policies.config import PolicyConfig
from policies.engine import simulate
from policies.workspace import out_of_memory, room_tokens

from .conftest import make_trace

N = 600  # requests in one burst: 16 prompt tokens each, so a 256-token chunk prefills 16 a step


@pytest.fixture(scope="module")
def llama():
    return build("meta-llama/Llama-3.1-8B", "h100")


def _burst():
    return make_trace(np.zeros(N), np.full(N, 16), np.full(N, 40))


def test_prefill_first_decodes_every_running_request_whatever_the_chunk(llama):
    config = PolicyConfig(schedule_mode="prefill_first", max_num_batched_tokens=256, max_num_seqs=1024,
                          gpu_memory_utilization=1.0)
    result = simulate(_burst(), llama, config)
    assert result.peak_step_tokens == N  # the first decode step, once all 600 prompts are in
    # it starts as the last of the 38 prefill steps (16 prompts each) ends: SGLang prefills first
    assert result.peak_step_s == result.first_token_s.max() > 0
    # at utilisation 1.0 the memory left holds exactly one 256-token profiling pass
    assert room_tokens(llama, config) == 256
    why = out_of_memory(result.peak_step_tokens, result.peak_step_s, llama, config, "the server dies")
    per_token = llama.activation_bytes_per_token
    assert why == (f"runs out of GPU memory by t={result.peak_step_s:.6g} s: a 600-token step needs "
                   f"{600 * per_token / 2**30:.2f} GiB of activations, but {256 * per_token / 2**30:.2f} GiB "
                   "(256 tokens) is left beside the weights, the KV pool and the fixed reserves at "
                   "gpu_memory_utilization=1 and max_num_batched_tokens=256; the server dies")
    # 10% of the GPU left to nobody holds ~70k more tokens of activations: the same run fits
    roomy = config.replace(gpu_memory_utilization=0.9)
    assert room_tokens(llama, roomy) == 256 + math.floor(0.1 * llama.gpu_memory_bytes / per_token)
    assert out_of_memory(N, result.peak_step_s, llama, roomy, "the server dies") is None


def test_decode_first_never_computes_more_than_the_budget_its_profile_covered(llama):
    # vLLM's loop: decodes first, within the token budget, so no step outgrows the profiling pass
    config = PolicyConfig(max_num_batched_tokens=256, max_num_seqs=1024, gpu_memory_utilization=1.0)
    result = simulate(_burst(), llama, config)
    assert result.peak_step_tokens == 256
    assert out_of_memory(result.peak_step_tokens, result.peak_step_s, llama, config, "-") is None


def test_a_cost_model_without_activations_never_runs_out():
    from costmodels.costmodel import CostModel

    assert room_tokens(CostModel.synthetic(1000), PolicyConfig(gpu_memory_utilization=1.0)) == math.inf
