"""Study specs: flags alone suffice, TOML files load, flags override, bad specs are named."""

from pathlib import Path

import pytest

from optimizer.search.spec import (
    SpecError,
    StudySpec,
    default_batch_size,
    load_spec,
    spec_from_dict,
)
from tests.optimizer.tuning_helpers import write_csv_trace

EXAMPLES = Path(__file__).resolve().parents[2] / "studies" / "examples"


@pytest.fixture
def trace(tmp_path):
    return write_csv_trace(tmp_path / "chat.csv")


def test_four_flags_are_enough(trace):
    spec = load_spec(trace=trace, model="meta-llama/Llama-3.1-8B", gpu="h100", slo="ttft:2000,tpot:100")
    assert spec.study_name == "chat-llama-3.1-8b-h100"
    assert spec.run_dir == Path("runs") / spec.study_name
    assert (spec.trials, spec.seed, spec.sampler, spec.objective) == (100, 0, "tpe", "goodput")
    assert spec.batch_size == default_batch_size()
    assert spec.slos.classes[0].tpot_ms == 100
    assert spec.constraints.max_rejected_fraction is None  # auto: best baseline + slack
    assert spec.constraints.p99_ttft_ms is None and spec.constraints.ttft_tail_factor == 2.0  # auto: tail bound


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_examples_load(example):
    spec = load_spec(example)
    assert spec.trace.is_absolute() and spec.trace.name.endswith((".csv", ".jsonl"))
    assert spec.slos.has_bounds and spec.search_space.names


def test_flags_override_the_file(tmp_path, trace):
    path = tmp_path / "s.toml"
    path.write_text(f'[study]\ntrials = 7\nseed = 3\n[trace]\npath = "{trace.name}"\n'
                    '[deployment]\nmodel = "m"\ngpu = "h100"\n[slo]\ndefault = { ttft = 100 }\n'
                    '[space.max_num_seqs]\nlow = 4\nhigh = 8\n')
    spec = load_spec(path, trials=20, slo="tpot:50")
    assert (spec.trials, spec.seed) == (20, 3)
    assert spec.trace == trace
    assert spec.slos.classes[0].tpot_ms == 50 and spec.slos.classes[0].ttft_ms is None
    assert spec.search_space.params[[p.name for p in spec.search_space.params].index("max_num_seqs")].high == 8


def test_fingerprint_tracks_the_question_not_the_budget(tmp_path, trace):
    base = load_spec(trace=trace, model="m", gpu="h100", slo="ttft:2000")
    assert base.fingerprint() == base.replace(trials=5, batch_size=1, storage="x.journal").fingerprint()
    assert base.fingerprint() != load_spec(trace=trace, model="m", gpu="h100", slo="ttft:1000").fingerprint()
    moved = tmp_path / "moved.csv"
    moved.write_bytes(trace.read_bytes())
    assert base.fingerprint() == base.replace(trace=moved).fingerprint()
    rebuilt = spec_from_dict(base.to_dict())
    assert rebuilt.fingerprint() == base.fingerprint() and rebuilt.study_name == base.study_name


@pytest.mark.parametrize("toml, message", [
    ('[slo.default]\nweight = 2\n', "no SLO bound is set"),
    ('[slo]\ndefault = { ttft = 100 }\n[objective]\nmode = "fastest"\n', "objective 'fastest' is unknown"),
    ('[slo]\ndefault = { ttft = 100 }\n[studdy]\ntrials = 3\n', r"unknown section\(s\) \['studdy'\]"),
    ('[slo]\ndefault = { ttft = 100 }\n[study]\ntrial = 3\n', r"\[study\] has unknown key\(s\) \['trial'\]"),
    ('[slo]\ndefault = { ttft = 100 }\n[study]\ntrials = 0\n', "trials must be an integer >= 1"),
    ('[slo]\ndefault = { ttft = 100 }\n[constraints]\np99_ttft_ms = -1\n', "p99_ttft_ms must be a number >= 0"),
    ('[slo]\ndefault = { ttft = 100 }\n[constraints]\nmax_rejected = 0.1\n', r"unknown key\(s\) \['max_rejected'\]"),
    ('[slo]\ndefault = { ttft = 100 }\n[constraints]\nttft_tail_factor = 0.5\n', "ttft_tail_factor is 0 \\(off\\) or >= 1"),
    ('[slo]\ndefault = { ttft = 100 }\n[space.max_num_seqs]\nlow = 9\nhigh = 2\n', "low 9 is above high 2"),
    ('[slo]\ndefault = { ttft = 100 }\n[space.warp_drive]\nlow = 9\n', "unknown knob"),
    ('[slo]\ndefault = { ttft = 100 }\n[space]\nothers = "fixed"\n', "search space is empty"),
    ('[slo]\ndefault = { ttft = 100 }\n[trace]\nrate_scale = 2\ntarget_rps = 3\n', "not both"),
    ('[slo]\ndefault = { ttft = 100 }\n[study]\nname = "a b"\n', "study name 'a b'"),
    ('[slo\n', "not valid TOML"),
])
def test_bad_specs_name_the_problem(tmp_path, trace, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(f'[deployment]\nmodel = "m"\ngpu = "h100"\n{toml}' if not toml.startswith("[slo\n") else toml)
    with pytest.raises(SpecError, match=message) as info:
        load_spec(path, trace=trace)
    assert str(path) in str(info.value)


def test_missing_flags_are_listed():
    with pytest.raises(SpecError, match="missing --trace FILE, --gpu G, --slo"):
        load_spec(model="m")


def test_unknown_gpu_for_presets_is_an_error(trace):
    with pytest.raises(SpecError, match="unknown GPU 'tpu'"):
        load_spec(trace=trace, model="m", gpu="tpu", slo="ttft:1")


def test_spec_is_a_frozen_value(trace):
    spec = load_spec(trace=trace, model="m", gpu="h100", slo="ttft:1")
    assert isinstance(spec, StudySpec)
    with pytest.raises(AttributeError):
        spec.trials = 3


def test_a_default_study_name_spells_large_and_small_rates_without_an_exponent():
    """`--target-rps 1000000` built the name ...-1e+06rps, which the name rule refused (issue 50)."""
    from optimizer.search.spec import load_spec
    from studies.data import SAMPLE_TRACE

    def name(**rate):
        return load_spec(trace=SAMPLE_TRACE, model="meta-llama/Llama-3.1-8B", gpu="h100", slo="ttft:2000",
                         **rate).study_name

    assert name(target_rps=1_000_000.0).endswith("-1000000rps")
    assert name(target_rps=1e-5).endswith("-0.00001rps")
    assert name(rate_scale=0.3).endswith("-x0.3") and name(rate_scale=2.0).endswith("-x2")  # as before
