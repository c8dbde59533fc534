"""Speculative decoding in a study: a declared drafter opens the verify-budget knobs, its
profile reaches every simulation, and without one nothing speculative is searched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from optimizer.search.drafter import Drafter, DrafterError, drafter_from_mapping, load_drafter
from optimizer.search.evaluate import Evaluator
from optimizer.search.space import WHAT_IF_SPECULATIVE_MODES, build_space, speculative_searched
from optimizer.search.spec import SpecError, load_spec, spec_from_dict
from policies.config import BATCH_SCHEDULE_KNOBS
from policies.speculative import DEFAULT_PROFILE
from tests.optimizer.tuning_helpers import (
    burst_cost_model,
    fake_score,
    make_trace,
    sampled,
    write_csv_trace,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)

DRAFTER_TOML = """\
method = "eagle3"
model = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
acceptance = [0.9, 0.7, 0.5, 0.3, 0.1]
spread = 0.2
draft_cost_mode = "mtp"
draft_cost = 0.4
[profiles]
code = [0.95, 0.9]
"""
SPECULATING = [m for m in WHAT_IF_SPECULATIVE_MODES if m != "off"]


@pytest.fixture
def trace(tmp_path):
    return write_csv_trace(tmp_path / "chat.csv")


@pytest.fixture
def drafter_file(tmp_path):
    path = tmp_path / "drafter.toml"
    path.write_text(DRAFTER_TOML)
    return path




# ======================================================================================
# the drafter declaration
# ======================================================================================
def test_a_drafter_file_gives_its_profile_cost_and_names(drafter_file):
    drafter = load_drafter(drafter_file)
    assert drafter.acceptance.default == (0.9, 0.7, 0.5, 0.3, 0.1) and drafter.acceptance.spread == 0.2
    assert drafter.acceptance.profiles == {"code": (0.95, 0.9)}
    assert drafter.config_values() == {"speculative_draft_cost_mode": "mtp", "speculative_draft_cost": 0.4}
    assert drafter.max_draft_tokens == 5  # the longest profile: more drafts are never accepted
    assert (drafter.method, drafter.model, drafter.sglang) == ("eagle3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                                                               "EAGLE3")
    assert drafter_from_mapping(drafter.to_dict()) == drafter
    default = Drafter()
    assert default.acceptance.default == DEFAULT_PROFILE and default.max_draft_tokens == len(DEFAULT_PROFILE)


@pytest.mark.parametrize("text, message", [
    ("acceptance = [0.9, 1.5]\n", "position 2 must be in"),
    ("acceptance = []\n", "is empty"),
    ("accept = [0.9]\n", r"unknown key\(s\) \['accept'\]"),
    ('draft_cost_mode = "tree"\n', "draft_cost_mode must be one of"),
    ("draft_cost = -1\n", "draft_cost must be"),
    ("max_draft_tokens = 40\n", r"max_draft_tokens must be an integer in \[1, 16\]"),
    ('spread = "wide"\n', "spread must be a finite number"),
    ('sglang_algorithm = "MEDUSA"\n', "sglang_algorithm must be one of"),
    ('method = ""\n', "method must be a non-empty name"),
    ("acceptance = [0.9\n", "not valid TOML"),
])
def test_bad_drafter_files_name_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(DrafterError, match=message) as info:
        load_drafter(path)
    assert str(path) in str(info.value)


# ======================================================================================
# the search space
# ======================================================================================
def test_without_a_drafter_nothing_speculative_is_searched():
    space = build_space()
    assert not {"speculative_mode", "num_speculative_tokens"} & set(space.names)
    assert all(c.speculative_mode == "off" for c, _ in sampled(space, 10))


def test_a_drafter_opens_every_verify_budget_policy_and_the_draft_length():
    space = build_space(drafter_tokens=5)
    described = dict(space.describe())
    assert described["speculative_mode"] == "{" + ", ".join(WHAT_IF_SPECULATIVE_MODES) + "}"
    assert described["num_speculative_tokens"] == f"[1, 5] when speculative_mode in {SPECULATING}"
    runs = sampled(space, 80)
    assert {c.speculative_mode for c, _ in runs} == set(WHAT_IF_SPECULATIVE_MODES)
    for config, params in runs:
        assert ("num_speculative_tokens" in params) == (config.speculative_mode != "off")
        assert 1 <= config.num_speculative_tokens <= 5 or config.speculative_mode == "off"
    # a study narrows it like any knob
    narrowed = build_space({"speculative_mode": {"choices": ["off", "dspark"]},
                            "num_speculative_tokens": {"low": 2, "high": 4}}, drafter_tokens=5)
    assert {c.speculative_mode for c, _ in sampled(narrowed, 30)} == {"off", "dspark"}
    assert dict(narrowed.describe())["num_speculative_tokens"].startswith("[2, 4] when speculative_mode")


DSPARK_TOML = 'method = "dspark"\nacceptance = [0.9, 0.8, 0.7, 0.6]\n'


@pytest.mark.parametrize("engine, drafter, modes", [
    ("vllm", DSPARK_TOML, ["off", "fixed", "batch_schedule", "adaptive_verify"]),
    ("vllm", DRAFTER_TOML, ["off", "fixed", "batch_schedule"]),  # adaptive verification reads DSpark's head
    ("sglang", DSPARK_TOML, ["off", "fixed", "sps_table"]),
    ("sglang", DRAFTER_TOML, ["off", "fixed"]),  # only DSPARK's planner reads an SPS table
])
def test_an_engine_searches_the_verify_budgets_its_file_can_carry(tmp_path, trace, engine, drafter, modes):
    path = tmp_path / "drafter.toml"
    path.write_text(drafter)
    spec = load_spec(trace=trace, model="m", gpu="h100", slo="ttft:2000", speculative=path, engine=engine)
    runs = sampled(spec.search_space, 120)
    assert {c.speculative_mode for c, _ in runs} == set(modes)
    k = spec.speculative.max_draft_tokens
    for config, params in runs:
        scheduled = config.speculative_mode == "batch_schedule"
        assert ("speculative_batch_2" in params) == ("speculative_k_3" in params) == scheduled
        if scheduled:
            assert config.speculative_batch_2 >= 2 and 0 <= config.speculative_k_2 <= k
            assert config.speculative_batch_3 == 0 or config.speculative_batch_3 >= 3
    # the defaults are scored with the drafter verifying its whole draft too (SGLang: 48 running requests)
    presets = Evaluator(spec, trace=make_trace(), cost_model=burst_cost_model()).baselines()
    with_drafter = {name: c for name, c in presets.items() if "+drafter" in name}
    assert len(with_drafter) == 1 and len(presets) == 2
    (config,) = with_drafter.values()
    assert (config.speculative_mode, config.num_speculative_tokens) == ("fixed", k)
    assert config.max_num_seqs == (48 if engine == "sglang" else presets[f"{engine}-default"].max_num_seqs)


@pytest.mark.parametrize("engine, starts", [
    ("vllm", ["batch_schedule", "adaptive_verify"]),
    ("sglang", ["sps_table"]),
])
def test_each_verify_budget_starts_from_the_defaults_with_the_drafter(tmp_path, trace, engine, starts):
    """After the baselines, one enqueued trial per engine budget: the sampler sees every mode
    before it settles the categorical; a resumed study enqueues none twice."""
    from optimizer.search.study import START_ATTR, enqueue_baselines

    path = tmp_path / "drafter.toml"
    path.write_text(DSPARK_TOML)
    spec = load_spec(trace=trace, model="m", gpu="h100", slo="ttft:2000", speculative=path, engine=engine)
    baselines = Evaluator(spec, trace=make_trace(), cost_model=burst_cost_model()).baselines()
    study = optuna.create_study(direction="maximize")
    for _ in range(2):
        enqueue_baselines(study, spec, baselines)
    waiting = study.get_trials(deepcopy=False)
    assert [t.user_attrs.get("baseline") for t in waiting[:2]] == list(baselines)
    assert [t.user_attrs[START_ATTR] for t in waiting[2:]] == [f"{engine}-default+drafter-k4 {m}" for m in starts]
    fixed = baselines[f"{engine}-default+drafter-k4"]
    for _ in baselines:
        study.ask()
    for t, mode in zip(waiting[2:], starts, strict=True):
        trial = study.ask()
        assert trial.number == t.number
        config = spec.search_space.suggest(trial)
        assert config.speculative_mode == mode
        # the defaults with the drafter (its block of 4), but for the budget
        assert {k for k, v in config.to_dict().items() if v != getattr(fixed, k)} <= {"speculative_mode",
                                                                                     *BATCH_SCHEDULE_KNOBS}
        if mode == "batch_schedule":  # the whole block below 32 requests, half of it from 32, one less from 128
            assert [getattr(config, k) for k in BATCH_SCHEDULE_KNOBS] == [32, 2, 128, 1]


# ======================================================================================
# the study spec
# ======================================================================================
def test_the_spec_flag_declares_the_drafter_and_its_cost_is_fixed(trace, drafter_file):
    spec = load_spec(trace=trace, model="m", gpu="h100", slo="ttft:2000", speculative=drafter_file)
    assert spec.speculative == load_drafter(drafter_file)
    assert "speculative_mode" in spec.search_space.names
    assert spec.search_space.fixed["speculative_draft_cost_mode"] == "mtp"
    assert spec.search_space.fixed["speculative_draft_cost"] == 0.4
    # stored with the study and rebuilt by a worker without the file
    drafter_file.unlink()
    assert spec_from_dict(spec.to_dict()).speculative == spec.speculative


def test_the_spec_file_declares_the_drafter_inline_or_by_path(tmp_path, trace, drafter_file):
    head = f'[trace]\npath = "{trace.name}"\n[deployment]\nmodel = "m"\ngpu = "h100"\n[slo]\ndefault = {{ ttft = 100 }}\n'
    inline = tmp_path / "inline.toml"
    inline.write_text(head + "[speculative]\n" + DRAFTER_TOML.replace("[profiles]", "[speculative.profiles]"))
    by_path = tmp_path / "by_path.toml"
    by_path.write_text(f'speculative = "{drafter_file.name}"\n' + head)
    assert load_spec(inline).speculative == load_spec(by_path).speculative == load_drafter(drafter_file)
    bad = tmp_path / "bad.toml"
    bad.write_text(head + "[speculative]\nacceptance = [2.0]\n")
    with pytest.raises(SpecError, match=r"bad.toml: \[speculative\]: acceptance profile default position 1"):
        load_spec(bad)


def test_speculation_without_a_drafter_is_refused(tmp_path, trace):
    for space in ({"speculative_mode": {"choices": ["off", "dspark"]}}, {"speculative_mode": {"value": "fixed"}}):
        with pytest.raises(SpecError, match="speculative_mode needs a drafter.*--speculative DRAFTER.toml"):
            load_spec(trace=trace, model="m", gpu="h100", slo="ttft:2000", space=space)


def test_the_fingerprint_follows_the_drafter_profile_not_its_names(trace, drafter_file):
    plain = load_spec(trace=trace, model="m", gpu="h100", slo="ttft:2000")
    assert "speculative" not in plain.to_dict()  # studies without a drafter keep their fingerprint
    spec = load_spec(trace=trace, model="m", gpu="h100", slo="ttft:2000", speculative=drafter_file)
    assert spec.fingerprint() != plain.fingerprint()
    renamed = spec.replace(speculative=Drafter(spec.speculative.acceptance, "mtp", 0.4, method="eagle"))
    assert renamed.fingerprint() == spec.fingerprint()
    drafter_file.write_text(DRAFTER_TOML.replace("spread = 0.2", "spread = 0.5"))
    respread = load_spec(trace=trace, model="m", gpu="h100", slo="ttft:2000", speculative=drafter_file)
    assert respread.fingerprint() != spec.fingerprint()


class Recorded(Exception):
    """Raised by RecordingEngine once it has the options of its first call."""


class RecordingEngine:
    """Engine stand-in that records the keyword options of its first call and stops."""

    def __init__(self):
        self.options = None

    def simulate(self, trace, cost_model, config, seed=0, **options):
        return self.simulate_many(trace, cost_model, [config], seed, **options)

    def simulate_many(self, trace, cost_model, configs, seed=0, **options):
        self.options = options
        raise Recorded

    def simulate_fleet_many(self, trace, cost_model, configs, seed=0, *, replicas, failures=None, lockstep=1,
                            **options):
        return self.simulate_many(trace, cost_model, configs, seed, **options)


@pytest.mark.parametrize("replicas", [1, 2])
def test_every_simulation_uses_the_declared_drafters_profile(trace, drafter_file, replicas):
    for speculative in (drafter_file, None):
        spec = load_spec(trace=trace, model="m", gpu="h100", slo="ttft:2000", speculative=speculative,
                         replicas=replicas)
        engine = RecordingEngine()
        evaluator = Evaluator(spec, trace=make_trace(), cost_model=burst_cost_model(), engine=engine,
                              fleet_engine=engine, scorer=fake_score)
        with pytest.raises(Recorded):
            evaluator.reports([spec.search_space.base.replace(num_speculative_tokens=3)])
        assert engine.options == ({} if speculative is None else {"acceptance": spec.speculative.acceptance})


def test_tune_names_a_bad_drafter_file(trace, tmp_path):
    bad = tmp_path / "drafter.toml"
    bad.write_text("acceptance = [0.9, -0.1]\n")
    out = subprocess.run([sys.executable, "-c", "from optimizer.cli import main; main()", "tune", "--trace",
                          str(trace), "--model", "m", "--gpu", "h100", "--slo", "ttft:500", "--speculative", str(bad),
                          "--no-outputs"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"drafter file {bad}" in out.stderr and "position 2 must be in [0, 1]" in out.stderr


@pytest.mark.parametrize("name, method, sglang", [("dspark", "dspark", "DSPARK"), ("eagle3", "eagle3", "EAGLE3"),
                                                  ("draft_model", "draft_model", "STANDALONE")])
def test_the_example_drafters_load_with_their_engines_names(name, method, sglang):
    drafter = load_drafter(Path(__file__).parents[2] / "studies" / "examples" / "drafters" / f"{name}.toml")
    assert (drafter.method, drafter.sglang) == (method, sglang)
    assert all(0.0 < p < 1.0 for p in drafter.acceptance.default)
    assert drafter.max_draft_tokens <= len(drafter.acceptance.default)


def test_the_searched_verify_budget_knobs_are_a_files_changes(tmp_path, trace):
    # the minimal-file pass and "knobs changed" weigh them like the engine's flags
    path = tmp_path / "drafter.toml"
    path.write_text(DSPARK_TOML)
    spec = load_spec(trace=trace, model="m", gpu="h100", slo="ttft:2000", speculative=path, engine="vllm")
    assert speculative_searched(spec.search_space) == (
        "speculative_mode", "num_speculative_tokens", "speculative_batch_2", "speculative_k_2",
        "speculative_batch_3", "speculative_k_3")
    assert speculative_searched(load_spec(trace=trace, model="m", gpu="h100", slo="ttft:2000").search_space) == ()
