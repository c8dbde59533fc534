"""Engine targets: each engine's defaults, validity rules and file mapping, from its source.

Rules cite the engine source they come from (vLLM 0.33.0 / SGLang 0.5.23, paths relative to
site-packages), as checked with ../shared/tools/engine-check.
"""

from __future__ import annotations

import optuna
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from optimizer.outputs.exports import Deployment, ExportError, engine_yaml, read_engine_file
from optimizer.search.space import build_space
from optimizer.search.targets import engine_context
from policies.config import PolicyConfig
from policies.engines import ENGINES, EngineContext, EngineError, preset, target

LLAMA = "meta-llama/Llama-3.1-8B"


@pytest.fixture(scope="module")
def h100() -> EngineContext:
    return engine_context(LLAMA, "h100")


def test_vllm_defaults_follow_its_batch_tiers(h100):
    # vllm/engine/arg_utils.py:2973-3005 get_batch_defaults, OPENAI_API_SERVER column
    a100 = EngineContext("a100", 80.0, 131072)
    b200 = EngineContext("b200", 179.0, 131072)
    assert (preset("vllm-default", h100).max_num_batched_tokens, preset("vllm-default", h100).max_num_seqs) == (8192, 1024)
    assert (preset("vllm-default", a100).max_num_batched_tokens, preset("vllm-default", a100).max_num_seqs) == (2048, 256)
    assert preset("vllm-default", b200).max_num_batched_tokens == 16384


def test_vllm_max_model_len_is_the_model_context(h100):
    # vLLM derives max_model_len from max_position_embeddings: 131072 for Llama-3.1-8B
    assert preset("vllm-default", h100).max_model_len == 131072


def test_sglang_defaults_size_requests_from_the_kv_pool(h100):
    config = preset("sglang-default", h100)
    # srt/model_executor/model_runner.py: request pool min(max(tokens / ctx * 512, 2048), 4096)
    assert config.max_num_seqs == 2048
    # mem_fraction_static 0.835 on an H100 at TP 1, written back as such
    args = target("sglang").to_args(config, Deployment(LLAMA).engine, h100)
    assert args["mem-fraction-static"] == pytest.approx(0.835)
    assert config.schedule_mode == "prefill_first" and config.admission_mode == "new_token_ratio"


@pytest.mark.parametrize(("changes", "rule"), [
    ({"max_num_batched_tokens": 512, "max_num_seqs": 1024}, "vllm/config/scheduler.py:331"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 8192}, "vllm/config/scheduler.py:318"),
    ({"long_prefill_token_threshold": 200000}, "vllm/config/scheduler.py:355"),
    ({"max_model_len": 200000}, "max_position_embeddings"),
])
def test_vllm_refuses_what_vllm_refuses(h100, changes, rule):
    vllm = target("vllm")
    config = preset("vllm-default", h100).replace(**changes)
    assert any(rule in v for v in vllm.violations(config, h100))
    with pytest.raises(ExportError, match="refuses"):
        engine_yaml(vllm, config, Deployment(LLAMA), h100)


def test_sglang_chunk_must_divide_by_page(h100):
    # srt/server_args.py check_server_args: chunked_prefill_size must be divisible by page_size
    sglang = target("sglang")
    config = preset("sglang-default", h100).replace(block_size=16, max_num_batched_tokens=1000)
    assert any("divisible by page-size" in v for v in sglang.violations(config, h100))
    assert not sglang.violations(config.replace(max_num_batched_tokens=1024), h100)


def test_vllm_booleans_are_spelled_so_the_loader_keeps_them(h100):
    # vllm/utils/argparse_utils.py:653-658: `key: false` is dropped by `vllm serve --config`;
    # only `no-key: true` turns a BooleanOptionalAction flag off.
    vllm = target("vllm")
    text = engine_yaml(vllm, preset("vllm-default", h100).replace(enable_prefix_caching=False), Deployment(LLAMA), h100)
    data = yaml.safe_load(text)
    assert data["no-enable-prefix-caching"] is True and "enable-prefix-caching" not in data
    assert all(value is not False for value in data.values())


def test_sglang_store_true_flags_are_only_written_true(h100):
    sglang = target("sglang")
    on = yaml.safe_load(engine_yaml(sglang, preset("sglang-default", h100), Deployment(LLAMA), h100))
    off = yaml.safe_load(engine_yaml(sglang, preset("sglang-default", h100).replace(enable_prefix_caching=False),
                                     Deployment(LLAMA), h100))
    assert "disable-radix-cache" not in on and off["disable-radix-cache"] is True


def test_both_engines_schedule_the_next_step_while_one_runs_unless_the_file_says_not(h100):
    # vLLM 0.33 vllm/config/vllm.py:1685-1719: async_scheduling left unset resolves on; a file
    # turns it off with `no-async-scheduling: true` (and `async-scheduling: true` is not written:
    # set explicitly, vLLM hard-fails where it would have resolved it off, vllm.py:1668-1684).
    # SGLang 0.5.23 srt/arg_groups/fields/schedule.py:193-199: disable_overlap_schedule False.
    vllm, sglang = target("vllm"), target("sglang")
    assert preset("vllm-default", h100).async_scheduling and preset("sglang-default", h100).async_scheduling
    on = yaml.safe_load(engine_yaml(vllm, preset("vllm-default", h100), Deployment(LLAMA), h100))
    off = yaml.safe_load(engine_yaml(vllm, preset("vllm-default", h100).replace(async_scheduling=False),
                                     Deployment(LLAMA), h100))
    assert "async-scheduling" not in on and "no-async-scheduling" not in on and off["no-async-scheduling"] is True
    assert read_engine_file(vllm, yaml.safe_dump(off), h100).async_scheduling is False
    s_off = yaml.safe_load(engine_yaml(sglang, preset("sglang-default", h100).replace(async_scheduling=False),
                                       Deployment(LLAMA), h100))
    assert s_off["disable-overlap-schedule"] is True
    assert read_engine_file(sglang, yaml.safe_dump(s_off), h100).async_scheduling is False


def test_vllm_runs_suffix_speculation_synchronously(h100):
    # vllm/config/vllm.py:3066-3068: suffix and custom_class speculators need the V1 model runner,
    # which cannot overlap them (vllm.py:1651-1663): unset, async resolves off (vllm.py:1711-1717);
    # asked for, vLLM refuses to start (vllm.py:1678-1682).
    vllm = target("vllm")
    base = {"model": LLAMA, "speculative-config": {"method": "suffix", "num_speculative_tokens": 3}}
    assert read_engine_file(vllm, yaml.safe_dump(base), h100).async_scheduling is False
    eagle = {**base, "speculative-config": {"method": "eagle3", "num_speculative_tokens": 3}}
    assert read_engine_file(vllm, yaml.safe_dump(eagle), h100).async_scheduling is True
    with pytest.raises(ExportError, match="Async scheduling is not supported"):
        read_engine_file(vllm, yaml.safe_dump({**base, "async-scheduling": True}), h100)


def test_engine_resolve_keeps_only_what_the_engine_runs(h100):
    # vLLM V1 has no admission rule, swap or step-time cap: a config is projected onto its behaviour
    vllm = target("vllm")
    wish = preset("vllm-default", h100).replace(admission_mode="reservation", preemption_mode="swap",
                                                step_time_cap_ms=50.0, scheduling_policy="priority",
                                                max_num_seqs=64)
    runs = vllm.resolve(wish, h100)
    assert (runs.admission_mode, runs.preemption_mode, runs.step_time_cap_ms) == ("none", "recompute", 0.0)
    assert runs.max_num_seqs == 64
    # vllm/v1/core/sched/scheduler.py:931-938: under priority the least urgent running request is preempted
    assert runs.preemption_victim == "lowest_priority"


def test_unknown_keys_in_an_engine_file_are_refused(h100):
    with pytest.raises(ExportError, match="does not simulate"):
        read_engine_file(target("vllm"), "model: m\nmax-num-partial-prefills: 2\n", h100)


def test_a_file_read_back_is_the_config_written(h100):
    for name in ENGINES:
        engine = target(name)
        config = engine.resolve(preset(f"{name}-default", h100).replace(max_num_seqs=96, enable_prefix_caching=False),
                                h100)
        text = engine_yaml(engine, config, Deployment(LLAMA), h100)
        assert read_engine_file(engine, text, h100) == config


@pytest.mark.parametrize("name", ENGINES)
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_every_valid_sampled_trial_exports_and_reads_back(h100, name, seed):
    """Property: a trial of an engine's space that its rules accept is written to a file
    those rules accept, and that file reads back as the trial; one they refuse is never written."""
    engine = target(name)
    space = build_space({}, engine.defaults(h100), target=engine, context=h100)
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed)).ask()
    config = space.suggest(trial)
    assert set(space.names) <= set(engine.knobs)
    if engine.violations(config, h100):
        with pytest.raises(ExportError):
            engine_yaml(engine, config, Deployment(LLAMA), h100)
        return
    text = engine_yaml(engine, config, Deployment(LLAMA), h100)
    assert not engine.violations(read_engine_file(engine, text, h100), h100)
    assert read_engine_file(engine, text, h100) == config


def test_an_engine_space_refuses_knobs_the_engine_lacks(h100):
    from optimizer.search.space import SpaceError

    with pytest.raises(SpaceError, match="no flag for"):
        build_space({"admission_mode": {"choices": ["reservation"]}}, target=target("vllm"), context=h100)


def test_unknown_engine_is_named():
    with pytest.raises(EngineError, match="valid"):
        target("tgi")


def test_what_if_target_keeps_every_knob(h100):
    servetune = target("servetune")
    wish = PolicyConfig(admission_mode="reservation", step_time_cap_ms=50.0)
    assert servetune.resolve(wish, h100) == wish
    assert set(servetune.baselines(h100)) == {"vllm-default", "sglang-default"}
