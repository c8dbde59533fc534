import json

import pytest

from costmodels import CostModel, CostModelError, build
from costmodels.architecture import load_model
from costmodels.build import CUDA_GRAPH_BYTES, RUNTIME_BYTES, activation_bytes_per_token

# codellama/CodeLlama-34b-Instruct-hf config.json (the fields servetune reads)
CODELLAMA_34B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
                 "intermediate_size": 22016, "num_hidden_layers": 48, "num_attention_heads": 64,
                 "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 16384,
                 "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def test_kv_capacity_follows_vllm_sizing():
    cost = build("meta-llama/Llama-3.1-8B", "h100")
    arch = load_model("meta-llama/Llama-3.1-8B")
    logits = 256 * arch.vocab_size * 4
    assert cost.reserved_bytes == pytest.approx(logits + CUDA_GRAPH_BYTES + RUNTIME_BYTES)
    assert cost.activation_bytes_per_token == activation_bytes_per_token(arch, 1)
    budget = 0.9 * 80 * 2**30 - arch.weight_bytes(1) - cost.reserved_bytes - 8192 * cost.activation_bytes_per_token
    assert cost.kv_capacity_tokens(0.9, 8192) == int(budget // 131_072)
    assert cost.kv_capacity_blocks(0.9, 16, 8192) == cost.kv_capacity_tokens(0.9, 8192) // 16
    # vLLM reports about 1.2 GiB activation peak for Llama-3.1-8B at 8192 tokens
    assert 0.8 * 2**30 < 8192 * cost.activation_bytes_per_token < 2.0 * 2**30


@pytest.mark.parametrize("budget, logged_blocks", [(64, 2790), (4096, 2537)])
def test_vllm_pool_follows_the_profiling_budget(tmp_path, budget, logged_blocks):
    """vLLM profiles at max_num_batched_tokens (gpu_model_runner.py:524, :6132) and keeps the
    peak out of the pool; CodeLlama-34B on one 80 GB GPU at utilisation 0.9 logged these
    block counts (block size 16)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CODELLAMA_34B))
    cost = build("codellama/CodeLlama-34b-Instruct-hf", "h100", model_config=path)
    assert cost.kv_capacity_blocks(0.9, 16, budget) == pytest.approx(logged_blocks, rel=0.02)


def test_a_larger_step_budget_leaves_a_smaller_pool_in_the_engine():
    """The simulated engine sizes the pool at the config's own budget."""
    from policies.config import PolicyConfig
    from policies.engine import validate
    from studies.traces import Trace

    cost = build("meta-llama/Llama-3.1-8B", "h100")
    trace = Trace.from_columns([0.0, 1.0], [16, 16], [4, 4])
    small, _ = validate(trace, cost, PolicyConfig(max_num_batched_tokens=512, gpu_memory_utilization=0.9))
    large, _ = validate(trace, cost, PolicyConfig(max_num_batched_tokens=16384, gpu_memory_utilization=0.9))
    freed = (16384 - 512) * cost.activation_bytes_per_token / (cost.kv_bytes_per_token * 16)
    assert small - large == pytest.approx(freed, abs=1)


def test_more_memory_and_tp_give_more_kv():
    h100 = build("meta-llama/Llama-3.1-70B", "h100", tp=4).kv_capacity_tokens(0.9)
    h200 = build("meta-llama/Llama-3.1-70B", "h200", tp=4).kv_capacity_tokens(0.9)
    tp8 = build("meta-llama/Llama-3.1-70B", "h100", tp=8).kv_capacity_tokens(0.9)
    assert h200 > 2 * h100 and tp8 > 2 * h100


def test_budget_smaller_than_weights_is_an_error():
    cost = build("meta-llama/Llama-3.1-8B", "h100")
    with pytest.raises(CostModelError, match="leaves no KV memory"):
        cost.kv_capacity_tokens(0.15)


def test_explicit_kv_byte_budget_and_swap():
    cost = build("meta-llama/Llama-3.1-8B", "h100")
    assert cost.kv_blocks_for_bytes(2**30, 16) == 2**30 // (131_072 * 16)
    assert cost.swap_capacity_blocks(16) == 4 * 2**30 // (131_072 * 16)
    assert 40e9 < cost.swap_bytes_per_s < 64e9  # PCIe 5.0 x16
    with pytest.raises(CostModelError):
        cost.kv_blocks_for_bytes(0, 16)


def test_synthetic_contract_unchanged():
    assert CostModel.synthetic(1000).kv_capacity_blocks(1.0, 16) == 62
