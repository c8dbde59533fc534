"""Speculative decoding in the exports: the draft length in each engine's own shape, the
drafter from the study or a marked placeholder, and servetune-only verify budgets projected
onto the fixed block the engines verify."""

from __future__ import annotations

import pytest
import yaml

from optimizer.outputs.exports import (
    FILL_IN,
    Deployment,
    ExportError,
    read_engine_file,
)
from optimizer.outputs.exports import engine_args as _engine_args
from optimizer.outputs.exports import engine_yaml as _engine_yaml
from optimizer.search.drafter import Drafter
from policies.config import SPECULATIVE_MODES
from policies.engines import EngineContext, preset, target

EAGLE = Drafter(method="eagle3", model="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
DEPLOY = Deployment("meta-llama/Llama-3.1-8B", drafter=EAGLE)
CTX = EngineContext("h100", 80.0, context_len=131072)


def speculating(mode="fixed", k=5, backend="vllm"):
    """The backend's own defaults, speculating."""
    return preset(f"{backend}-default", CTX).replace(speculative_mode=mode, num_speculative_tokens=k)


def engine_args(config, deployment, backend):
    return _engine_args(target(backend), config, deployment, CTX)


def engine_yaml(config, deployment, backend):
    return _engine_yaml(target(backend), config, deployment, CTX)


def read_back(text, backend, drafter=None):
    return read_engine_file(target(backend), text, CTX, drafter=drafter)


def test_vllm_carries_the_drafter_and_draft_length_in_speculative_config():
    text = engine_yaml(speculating(k=5), DEPLOY, "vllm")
    data = yaml.safe_load(text)
    assert data["speculative-config"] == {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                                          "num_speculative_tokens": 5}
    assert FILL_IN not in text and "FILL IN" not in text
    back = read_back(text, "vllm")
    assert (back.speculative_mode, back.num_speculative_tokens) == ("fixed", 5)


def test_sglang_carries_the_algorithm_and_the_full_chain_triple():
    text = engine_yaml(speculating(k=3, backend="sglang"), DEPLOY, "sglang")
    data = yaml.safe_load(text)
    assert data["speculative-algorithm"] == "EAGLE3"
    assert data["speculative-draft-model-path"] == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    # a chain of 3 drafts: 3 steps, one candidate each, 4 tokens verified with the root
    assert (data["speculative-num-steps"], data["speculative-eagle-topk"], data["speculative-num-draft-tokens"]) \
        == (3, 1, 4)
    back = read_back(text, "sglang")
    assert (back.speculative_mode, back.num_speculative_tokens) == ("fixed", 3)


def test_a_draft_model_is_vllms_draft_model_method_and_sglangs_standalone_chain():
    """The shapes both engines accepted in engine-check at stop 63 (vLLM 0.33.0 built the
    SpeculativeConfig, its equal-vocabulary rule included, vllm/config/speculative.py:2040;
    SGLang 0.5.23's check_server_args passed: STANDALONE drafts a chain, topk 1)."""
    deploy = Deployment("meta-llama/Llama-3.1-8B", drafter=Drafter(method="draft_model",
                                                                   model="meta-llama/Llama-3.2-1B-Instruct"))
    vllm = yaml.safe_load(engine_yaml(speculating(k=5), deploy, "vllm"))
    assert vllm["speculative-config"] == {"method": "draft_model", "model": "meta-llama/Llama-3.2-1B-Instruct",
                                          "num_speculative_tokens": 5}
    sglang = yaml.safe_load(engine_yaml(speculating(k=5, backend="sglang"), deploy, "sglang"))
    assert sglang["speculative-algorithm"] == "STANDALONE"
    assert sglang["speculative-draft-model-path"] == "meta-llama/Llama-3.2-1B-Instruct"
    assert (sglang["speculative-num-steps"], sglang["speculative-eagle-topk"],
            sglang["speculative-num-draft-tokens"]) == (5, 1, 6)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_speculation_off_writes_nothing_and_reads_back_nothing(backend):
    mapped = engine_args(speculating("off", k=9, backend=backend), DEPLOY, backend)
    assert not any(flag.startswith("speculative") for flag in mapped.args)
    assert not mapped.fill_in
    text = engine_yaml(speculating("off", backend=backend), DEPLOY, backend)
    assert read_back(text, backend).speculative_mode == "off"


@pytest.mark.parametrize("backend, mode", [(b, m) for b in ("vllm", "sglang") for m in SPECULATIVE_MODES
                                            if m != "off" and m not in target(b).speculative_modes])
def test_what_if_verify_budgets_become_the_engines_fixed_block(backend, mode):
    # a per-step budget the engine has no flag for is servetune's what-if: an engine file of
    # such a config runs (and reads back as) the fixed block of k drafts (the engines' own
    # budgets: tests/policies/test_engine_speculative.py)
    config = speculating(mode, k=7, backend=backend)
    runs = target(backend).resolve(config, CTX)
    assert (runs.speculative_mode, runs.num_speculative_tokens) == ("fixed", 7)
    text = engine_yaml(config, DEPLOY, backend)
    assert mode not in text
    back = read_back(text, backend, drafter=EAGLE)
    assert (back.speculative_mode, back.num_speculative_tokens) == ("fixed", 7)
    assert back == runs.replace(**EAGLE.config_values())


def test_the_draft_cost_is_never_a_flag_but_the_drafters():
    drafter = Drafter(method="eagle3", model="m-draft", draft_cost_mode="mtp", draft_cost=0.4)
    for backend in ("vllm", "sglang"):
        config = speculating("fixed", backend=backend).replace(**drafter.config_values())
        text = engine_yaml(config, Deployment("m", drafter=drafter), backend)
        assert "0.4" not in text and "mtp" not in text
        back = read_back(text, backend, drafter=drafter)
        assert (back.speculative_draft_cost_mode, back.speculative_draft_cost) == ("mtp", 0.4)


@pytest.mark.parametrize("backend, keys", [
    ("vllm", ["speculative-config.method", "speculative-config.model"]),
    ("sglang", ["speculative-algorithm", "speculative-draft-model-path"]),
])
def test_without_a_declared_drafter_the_files_carry_marked_placeholders(backend, keys):
    deploy = Deployment("meta-llama/Llama-3.1-8B")
    mapped = engine_args(speculating(backend=backend), deploy, backend)
    assert list(mapped.fill_in) == keys
    assert all(value.startswith(FILL_IN) for value in mapped.fill_in.values())
    text = engine_yaml(speculating(backend=backend), deploy, backend)
    header = [line for line in text.splitlines() if line.startswith("# FILL IN before serving")]
    assert len(header) == 1 and all(key in header[0] for key in keys)
    assert text.count(FILL_IN) == 2  # placeholders in the body, never a guessed drafter


def test_a_drafter_without_a_checkpoint_or_sglang_name_leaves_only_what_is_unknown():
    ngram = Deployment("m", drafter=Drafter(method="ngram"))
    assert engine_args(speculating(), ngram, "vllm").args["speculative-config"] == {
        "method": "ngram", "num_speculative_tokens": 5}
    assert not engine_args(speculating(), ngram, "vllm").fill_in
    args = engine_args(speculating(backend="sglang"), ngram, "sglang").args
    assert args["speculative-algorithm"] == "NGRAM" and "speculative-draft-model-path" not in args
    suffix = engine_args(speculating(backend="sglang"), Deployment("m", drafter=Drafter(method="suffix")), "sglang")
    assert list(suffix.fill_in) == ["speculative-algorithm"]  # no SGLang algorithm is known for it
    mtp = Deployment("m", drafter=Drafter(method="deepseek_mtp", sglang_algorithm="EAGLE"))
    assert engine_args(speculating(backend="sglang"), mtp, "sglang").args["speculative-algorithm"] == "EAGLE"


def test_a_speculative_config_that_is_not_a_mapping_is_named():
    with pytest.raises(ExportError, match="speculative-config must be a mapping"):
        read_back('speculative-config: "{}"\n', "vllm")
