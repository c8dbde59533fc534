import json

import pytest

from costmodels import CostModelError, build, load_model
from costmodels.architecture import ModelArch

# (layers, kv heads, head_dim) from each model's config.json
CLOSED_FORM = {
    "meta-llama/Llama-3.1-8B": (32, 8, 128),
    "meta-llama/Llama-3.1-70B": (80, 8, 128),
    "Qwen/Qwen3-8B": (36, 8, 128),
    "Qwen/Qwen3-32B": (64, 8, 128),
}


@pytest.mark.parametrize("name", CLOSED_FORM)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kv_bytes_per_token_closed_form(name, tp):
    layers, kv_heads, head_dim = CLOSED_FORM[name]
    arch = load_model(name)
    assert arch.kv_bytes_per_token(tp, "bf16") == 2 * layers * (kv_heads // tp) * head_dim * 2
    assert arch.kv_bytes_per_token(tp, "fp8") == 2 * layers * (kv_heads // tp) * head_dim


def test_llama_8b_kv_bytes_in_built_cost_model():
    assert build("meta-llama/Llama-3.1-8B", "h100").kv_bytes_per_token == 131_072


@pytest.mark.parametrize("name, billions", [("meta-llama/Llama-3.1-8B", 8.03), ("meta-llama/Llama-3.1-70B", 70.55),
                                            ("Qwen/Qwen3-8B", 8.19), ("Qwen/Qwen3-32B", 32.76)])
def test_parameter_count_matches_published_size(name, billions):
    assert load_model(name).num_params() / 1e9 == pytest.approx(billions, rel=0.01)


@pytest.mark.parametrize("spelling", ["llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct",
                                      "meta-llama/Meta-Llama-3.1-8B", "meta-llama--Meta-Llama-3.1-8B_config.json"])
def test_aliases_resolve_to_canonical_name(spelling):
    assert load_model(spelling).name == "meta-llama/Llama-3.1-8B"


def test_unknown_model_lists_valid_names():
    with pytest.raises(CostModelError, match="Qwen/Qwen3-32B"):
        load_model("gpt-5")


def test_tp_that_does_not_divide_heads_is_rejected():
    with pytest.raises(CostModelError, match=r"tp=3 .*valid tp: \[1, 2, 4, 8\]"):
        build("Qwen/Qwen3-8B", "h100", tp=3)


def test_weights_per_gpu_split_by_tp():
    arch = load_model("meta-llama/Llama-3.1-70B")
    assert arch.weight_bytes(4) == pytest.approx(arch.num_params() * 2 / 4)
    assert arch.weight_bytes(4, "fp8") == pytest.approx(arch.num_params() / 4)


def test_custom_config_any_dense_gqa_model(tmp_path):
    cfg = {"num_hidden_layers": 24, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 4,
           "intermediate_size": 5632, "vocab_size": 32000, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    cost = build("my-model", "h100", tp=2, model_config=path)
    assert cost.kv_bytes_per_token == 2 * 24 * 2 * 128 * 2
    arch = ModelArch.from_hf_config(path)
    assert arch.head_dim == 128 and arch.tie_word_embeddings
    assert "profiled" in cost.source


def test_config_missing_keys_and_moe_are_rejected(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 4096}))
    with pytest.raises(CostModelError, match="missing keys"):
        ModelArch.from_hf_config(path)
    dense = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
             "vocab_size": 100}
    path.write_text(json.dumps(dense | {"num_local_experts": 8}))
    with pytest.raises(CostModelError, match="mixture-of-experts .*needs num_experts_per_tok"):
        ModelArch.from_hf_config(path)
    with pytest.raises(CostModelError, match="does not exist"):
        ModelArch.from_hf_config(tmp_path / "nope.json")
