"""Speculative decoding in the exports: the draft length in each engine's own shape, the
drafter from the study or a marked placeholder, and servetune-only verify budgets named."""

from __future__ import annotations

import re

import pytest
import yaml

from optimizer.drafter import Drafter
from optimizer.exports import (
    FILL_IN,
    Deployment,
    ExportError,
    engine_args,
    engine_yaml,
    knobs_from_engine_yaml,
)
from policies.config import SPECULATIVE_MODES
from policies.presets import preset

EAGLE = Drafter(method="eagle3", model="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
DEPLOY = Deployment("meta-llama/Llama-3.1-8B", drafter=EAGLE)


def speculating(mode="fixed", k=5, backend="vllm"):
    """The backend's own defaults, speculating: nothing else needs a note."""
    return preset(f"{backend}-default").replace(speculative_mode=mode, num_speculative_tokens=k)


def test_vllm_carries_the_drafter_and_draft_length_in_speculative_config():
    text = engine_yaml(speculating(k=5), DEPLOY, "vllm")
    data = yaml.safe_load(text)
    assert data["speculative-config"] == {"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                                          "num_speculative_tokens": 5}
    assert FILL_IN not in text and "FILL IN" not in text
    assert knobs_from_engine_yaml(text, "vllm")["num_speculative_tokens"] == 5


def test_sglang_carries_the_algorithm_and_the_full_chain_triple():
    text = engine_yaml(speculating(k=3), DEPLOY, "sglang")
    data = yaml.safe_load(text)
    assert data["speculative-algorithm"] == "EAGLE3"
    assert data["speculative-draft-model-path"] == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    # a chain of 3 drafts: 3 steps, one candidate each, 4 tokens verified with the root
    assert (data["speculative-num-steps"], data["speculative-eagle-topk"], data["speculative-num-draft-tokens"]) \
        == (3, 1, 4)
    assert knobs_from_engine_yaml(text, "sglang")["num_speculative_tokens"] == 3


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_speculation_off_writes_nothing_and_reads_back_nothing(backend):
    mapped = engine_args(speculating("off", k=9, backend=backend), DEPLOY, backend)
    assert not any(flag.startswith("speculative") for flag in mapped.args)
    assert not mapped.not_carried and not mapped.fill_in
    text = engine_yaml(speculating("off", backend=backend), DEPLOY, backend)
    assert "num_speculative_tokens" not in knobs_from_engine_yaml(text, backend)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
@pytest.mark.parametrize("mode", [m for m in SPECULATIVE_MODES if m not in ("off", "fixed")])
def test_adaptive_verify_budgets_are_named_servetune_only(backend, mode):
    config = speculating(mode, k=7, backend=backend)
    mapped = engine_args(config, DEPLOY, backend)
    assert set(mapped.not_carried) == {"speculative_mode"}
    assert "verifies all 7 drafts every step" in mapped.not_carried["speculative_mode"]
    text = engine_yaml(config, DEPLOY, backend)
    assert re.search(rf"^#\s+speculative_mode = '{mode}': .* has no per-step verify budget", text, re.M)
    # the engine still speculates with the drafter, on the full block
    assert knobs_from_engine_yaml(text, backend)["num_speculative_tokens"] == 7


def test_fixed_k_needs_no_note_and_draft_cost_is_never_a_flag():
    for backend in ("vllm", "sglang"):
        config = speculating("fixed", backend=backend).replace(speculative_draft_cost_mode="mtp",
                                                               speculative_draft_cost=0.4)
        assert not engine_args(config, DEPLOY, backend).not_carried


@pytest.mark.parametrize("backend, keys", [
    ("vllm", ["speculative-config.method", "speculative-config.model"]),
    ("sglang", ["speculative-algorithm", "speculative-draft-model-path"]),
])
def test_without_a_declared_drafter_the_files_carry_marked_placeholders(backend, keys):
    deploy = Deployment("meta-llama/Llama-3.1-8B")
    mapped = engine_args(speculating(), deploy, backend)
    assert list(mapped.fill_in) == keys
    assert all(value.startswith(FILL_IN) for value in mapped.fill_in.values())
    text = engine_yaml(speculating(), deploy, backend)
    header = [line for line in text.splitlines() if line.startswith("# FILL IN before serving")]
    assert len(header) == 1 and all(key in header[0] for key in keys)
    assert text.count(FILL_IN) == 2  # placeholders in the body, never a guessed drafter


def test_a_drafter_without_a_checkpoint_or_sglang_name_leaves_only_what_is_unknown():
    ngram = Deployment("m", drafter=Drafter(method="ngram"))
    assert engine_args(speculating(), ngram, "vllm").args["speculative-config"] == {
        "method": "ngram", "num_speculative_tokens": 5}
    assert not engine_args(speculating(), ngram, "vllm").fill_in
    args = engine_args(speculating(), ngram, "sglang").args
    assert args["speculative-algorithm"] == "NGRAM" and "speculative-draft-model-path" not in args
    suffix = engine_args(speculating(), Deployment("m", drafter=Drafter(method="suffix")), "sglang")
    assert list(suffix.fill_in) == ["speculative-algorithm"]  # no SGLang algorithm is known for it
    mtp = Deployment("m", drafter=Drafter(method="deepseek_mtp", sglang_algorithm="EAGLE"))
    assert engine_args(speculating(), mtp, "sglang").args["speculative-algorithm"] == "EAGLE"


def test_a_speculative_config_that_is_not_a_mapping_is_named():
    with pytest.raises(ExportError, match="speculative-config must be a mapping"):
        knobs_from_engine_yaml('speculative-config: "{}"\n', "vllm")
