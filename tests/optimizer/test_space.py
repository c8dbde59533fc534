"""The search space: every knob covered, conditionals honoured, overrides validated."""

import numpy as np
import optuna
import pytest

from costmodels.costmodel import CostModel
from optimizer.search.space import SpaceError, build_space, infeasibility
from policies.config import KNOBS, PolicyConfig
from policies.engines import EngineContext, preset
from policies.engines.servetune import SEARCH
from tests.optimizer.tuning_helpers import sampled

optuna.logging.set_verbosity(optuna.logging.WARNING)




def test_every_knob_is_searched_or_fixed():
    space = build_space()
    described = dict(space.describe())
    assert list(described) == [*(k.name for k in KNOBS), "tp", "replicas"]
    assert described["tp"] == "fixed = 1" and described["replicas"] == "fixed = 1"
    for name in ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold", "kv_headroom",
                 "admission_mode", "admission_quantile", "preemption_mode", "scheduling_policy"):
        assert name in space.names
    assert set(space.fixed) | set(space.names) == {k.name for k in KNOBS}
    assert space.fixed["gpu_memory_utilization"] == PolicyConfig().gpu_memory_utilization


def test_conditional_params_appear_only_with_their_parent():
    for config, params in sampled(build_space()):
        assert ("admission_quantile" in params) == (config.admission_mode == "predicted")
        assert ("schedule_conservativeness" in params) == (config.admission_mode == "new_token_ratio")
        assert ("max_prefill_tokens" in params) == (config.schedule_mode == "prefill_first")
        if not config.enable_chunked_prefill:
            assert "long_prefill_token_threshold:on" not in params
            assert config.long_prefill_token_threshold == 0
    modes = {c.admission_mode for c, _ in sampled(build_space())}
    assert modes == {"none", "reservation", "predicted", "new_token_ratio"}


def test_off_gate_gives_zero_or_a_value_in_range():
    values = [c.long_prefill_token_threshold for c, p in sampled(build_space())
              if p.get("long_prefill_token_threshold:on") is not None]
    assert 0 in values
    assert all(v == 0 or 64 <= v <= 8192 for v in values) and any(v > 0 for v in values)


def test_overrides_range_choices_fixed_value_and_others_fixed():
    space = build_space({
        "others": "fixed",
        "max_num_seqs": {"low": 16, "high": 64},
        "block_size": {"choices": [16, 32]},
        "kv_headroom": {"value": 0.1},
    })
    assert space.names == ("max_num_seqs", "block_size")
    assert space.base.kv_headroom == 0.1
    for config, _ in sampled(space, 30):
        assert 16 <= config.max_num_seqs <= 64 and config.block_size in (16, 32)
        assert config.kv_headroom == 0.1 and config.admission_mode == "none"


def test_giving_a_range_opens_a_knob_fixed_by_default():
    assert "gpu_memory_utilization" not in build_space().names
    space = build_space({"gpu_memory_utilization": {"low": 0.8, "high": 0.95}})
    assert "gpu_memory_utilization" in space.names


def test_knobs_that_act_only_under_another_are_asked_only_then():
    """max_wait_action does nothing without a max wait, the fairness cost unit nothing
    outside VTC's order: neither is a free parameter (issue 16)."""
    for config, params in sampled(build_space(), 80):
        assert "max_wait_action" not in params and config.max_wait_action == PolicyConfig().max_wait_action
        assert ("fairness_cost_unit" in params) == (config.scheduling_policy == "vtc")
    waiting = build_space({"max_wait_s": {"low": 0.5, "high": 30.0, "off": True}})
    for config, params in sampled(waiting, 40):
        assert ("max_wait_action" in params) == (config.max_wait_s != 0)
    assert dict(waiting.describe())["max_wait_action"].endswith("when max_wait_s != 0")


def test_user_condition():
    space = build_space({"others": "fixed", "scheduling_policy": {},
                         "max_num_seqs": {"low": 8, "high": 16, "when": {"scheduling_policy": ["priority"]}}})
    for config, params in sampled(space, 30):
        assert ("max_num_seqs" in params) == (config.scheduling_policy == "priority")


@pytest.mark.parametrize("overrides, message", [
    ({"max_num_seq": {"low": 1, "high": 2}}, r"unknown knob\(s\) \['max_num_seq'\]"),
    ({"max_num_seqs": {"low": 64, "high": 8}}, "low 64 is above high 8"),
    ({"kv_headroom": {"low": 0.0, "high": 2.0}}, r"kv_headroom\] high: kv_headroom must be in \[0, 0.9\]"),
    ({"max_num_seqs": {"low": 0, "high": 8}}, "must be in"),
    ({"kv_headroom": {"low": 0.0, "high": 0.5, "log": True}}, "log range needs low > 0"),
    ({"scheduling_policy": {"choices": []}}, "choices is empty"),
    ({"scheduling_policy": {"choices": ["lifo"]}}, "must be one of"),
    ({"max_num_seqs": {"lo": 1}}, r"unknown key\(s\) \['lo'\]"),
    ({"max_queue_len": {"low": 8}}, "give both low and high"),
    ({"max_num_seqs": {"low": 8, "high": 16, "when": {"nope": [1]}}}, "unknown knob 'nope'"),
    ({"max_num_seqs": {"low": 8, "high": 16, "when": {"router": "on"}}}, 'when router = "on" needs a number knob'),
    ({"others": "none"}, "others must be"),
    ({"others": "fixed"}, "search space is empty"),
])
def test_bad_overrides_name_the_knob(overrides, message):
    with pytest.raises(SpaceError, match=message):
        build_space(overrides)


def test_baseline_params_replay_the_preset():
    space = build_space()
    h100 = EngineContext("h100", 80.0)
    for config in (preset("vllm-default", h100), preset("sglang-default", h100)):
        params = space.params_for(config)
        study = optuna.create_study()
        study.enqueue_trial(params)
        trial = study.ask()
        space.record(trial, config)
        assert trial.params == params
        replay = optuna.create_study()
        replay.enqueue_trial(params)  # params the space cannot express are sampled, the rest replayed
        assert space.suggest(replay.ask()).max_num_batched_tokens == config.max_num_batched_tokens
        # SGLang's request cap comes from its KV pool (2048 without KV sizing), above the
        # what-if range [8, 1024]: left out of the params, not recorded falsely
        assert ("max_num_seqs" in params) == (8 <= config.max_num_seqs <= 1024)
    # a value outside the searched range is left out rather than recorded falsely
    narrow = build_space({"max_num_batched_tokens": {"low": 256, "high": 4096, "log": True}})
    assert "max_num_batched_tokens" not in narrow.params_for(preset("vllm-default", h100))


def test_infeasible_configs_are_named():
    cm = CostModel.synthetic(10_000)
    tokens = np.array([500, 4000])
    prompts = np.array([400, 3000])
    ok = PolicyConfig(gpu_memory_utilization=1.0)
    assert infeasibility(ok, cm, tokens, prompts) is None
    assert "kv_headroom=0.7" in infeasibility(ok.replace(kv_headroom=0.7), cm, tokens, prompts)
    assert "max_model_len=1000" in infeasibility(ok.replace(max_model_len=1000), cm, tokens, prompts)
    assert "without chunked prefill" in infeasibility(
        ok.replace(enable_chunked_prefill=False, max_num_batched_tokens=2048), cm, tokens, prompts)
    assert "smallest request" in infeasibility(ok, CostModel.synthetic(256), tokens, prompts)
    # hardware that cannot hold the largest request is not the config's fault
    assert infeasibility(ok, CostModel.synthetic(2048), tokens, prompts) is None


def test_defaults_only_name_real_knobs():
    assert set(SEARCH) <= {k.name for k in KNOBS}
