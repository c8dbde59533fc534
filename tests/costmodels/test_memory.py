import pytest

from costmodels import CostModel, CostModelError, build
from costmodels.architecture import load_model
from costmodels.build import CUDA_GRAPH_BYTES, RUNTIME_BYTES, activation_peak_bytes


def test_kv_capacity_follows_vllm_sizing():
    cost = build("meta-llama/Llama-3.1-8B", "h100")
    arch = load_model("meta-llama/Llama-3.1-8B")
    reserve = activation_peak_bytes(arch, 1) + CUDA_GRAPH_BYTES + RUNTIME_BYTES
    assert cost.reserved_bytes == pytest.approx(reserve)
    budget = 0.9 * 80 * 2**30 - arch.weight_bytes(1) - reserve
    assert cost.kv_capacity_tokens(0.9) == int(budget // 131_072)
    assert cost.kv_capacity_blocks(0.9, 16) == cost.kv_capacity_tokens(0.9) // 16
    # vLLM reports about 1.2 GiB activation peak for Llama-3.1-8B at 8192 tokens
    assert 0.8 * 2**30 < activation_peak_bytes(arch, 1) < 2.0 * 2**30


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
