"""The bad-input suite for the command line (issue 18): flags and config files that make no sense.

``servetune simulate`` and ``servetune tune`` are given an unknown model or GPU, a TP that
does not divide the heads, a model that does not fit, malformed or impossible ``--slo``,
non-positive ``--rate-scale`` and ``--trials``, and policy, SLO and spec TOML files with
impossible values, unknown keys and typos. Each case must end at validation, before any
kernel runs (``simulate``'s kernels are replaced by a tripwire; ``tune`` must not create
its run folder), with exit code 2, no traceback, and one ``error:`` line naming what is
wrong and where (the flag, the file, the key).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optimizer.cli import app
from studies.data import SAMPLE_TRACE

runner = CliRunner()
MODEL = "meta-llama/Llama-3.1-8B"
LATIN1, NEWLINE = b"\xe9", b"\n"
SIMULATE = ["simulate", "--trace", str(SAMPLE_TRACE), "--model", MODEL, "--gpu", "h100"]


@pytest.fixture(autouse=True)
def no_kernel(monkeypatch):
    """Every case must fail before a simulation: a kernel call is a test failure."""
    def tripwire(*args, **kwargs):
        raise AssertionError("a kernel ran: the bad input was not caught at validation")

    monkeypatch.setattr("policies.engine.simulate", tripwire)
    monkeypatch.setattr("policies.fleet.simulate_fleet", tripwire)


def assert_refused(result, pattern: str) -> str:
    """Exit code 2, no traceback, and exactly one ``error:`` line, matching ``pattern``."""
    assert not isinstance(result.exception, Exception), result.output  # SystemExit is the clean exit
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), result.stderr
    return errors[0]


# -- simulate: flags -----------------------------------------------------------------------


SIMULATE_FLAGS = [
    pytest.param(["--model", "no-such-model"], r"unknown model 'no-such-model'; built-in:", id="unknown-model"),
    pytest.param(["--gpu", "tpu"], r"unknown GPU 'tpu'; valid: a100, h100, h200", id="unknown-gpu"),
    pytest.param(["--model", "meta-llama/Llama-3.1-7B"], r"unknown model 'meta-llama/Llama-3.1-7B'; did you mean "
                 r"meta-llama/Llama-3.1-70B, meta-llama/Llama-3.1-8B, .*--model-config PATH\)$", id="model-typo"),
    pytest.param(["--gpu", "h1000"], r"unknown GPU 'h1000'; did you mean h100\? valid:", id="gpu-typo"),
    pytest.param(["--tp", "3"], r"tp=3 does not divide num_attention_heads=32.*valid tp: \[1, 2, 4, 8\]",
                 id="tp-does-not-divide-heads"),
    pytest.param(["--model", "meta-llama/Llama-3.1-70B", "--gpu", "a100"], r"Llama-3.1-70B needs .* GiB .* more than",
                 id="model-does-not-fit"),
    pytest.param(["--slo", "ttft=2000"], r"SLO part 'ttft=2000': expected KEY:MS", id="slo-malformed"),
    pytest.param(["--slo", "latency:5"], r"SLO part 'latency:5': expected KEY:MS with KEY one of", id="slo-unknown-key"),
    pytest.param(["--slo", "ttft:fast"], r"'fast' is not a number of milliseconds", id="slo-not-a-number"),
    pytest.param(["--slo", "ttft:0"], r"SLO string 'ttft:0'.*ttft must be a finite number of ms > 0", id="slo-zero"),
    pytest.param(["--slo", "tpot:-100"], r"tpot must be a finite number of ms > 0.*got -100", id="slo-negative"),
    pytest.param(["--slo", "ttft:nan"], r"ttft must be a finite number of ms > 0.*got nan", id="slo-nan"),
    pytest.param(["--slo", "e2el:inf"], r"e2el must be a finite number of ms > 0.*got inf", id="slo-inf"),
    pytest.param(["--rate-scale", "0"], r"--rate-scale: rate factor 0\.0; expected a finite number > 0",
                 id="rate-scale-zero"),
    pytest.param(["--rate-scale", "-2"], r"--rate-scale: rate factor -2\.0", id="rate-scale-negative"),
    pytest.param(["--rate-scale", "nan"], r"--rate-scale: rate factor nan", id="rate-scale-nan"),
    pytest.param(["--set", "max_num_seqs=inf"], r"--set 'max_num_seqs=inf': max_num_seqs must be in \[1, 65536\], "
                                                r"got inf", id="set-inf"),
    pytest.param(["--set", "max_num_seqz=64"], r"--set 'max_num_seqz=64': unknown knob\(s\) \['max_num_seqz'\] "
                                               r"\(did you mean 'max_num_seqs'\?\)", id="set-typo"),
    pytest.param(["--set", "max_num_seqs=true"], r"--set 'max_num_seqs=true': max_num_seqs must be a number, got True",
                 id="set-bool-for-a-number"),
    pytest.param(["--set", "block_size=7"], r"block_size=7: refused by vLLM and SGLang \(vLLM: block-size 7 is not "
                                            r"one of \[1, 8, 16, 32, 64, 128\].*SGLang: chunked-prefill-size \(8192\) "
                                            r"must be divisible by page-size \(7\)", id="set-block-size-7"),
    pytest.param(["--set", "max_num_seqs"], r"--set 'max_num_seqs': expected KNOB=VALUE", id="set-without-value"),
    pytest.param(["--trace-format", "azure"], r"is a Parquet file, which only the native format reads",
                 id="trace-format-azure-on-parquet"),
    pytest.param(["--predictor", "psychic"], r"unknown predictor 'psychic'", id="predictor-unknown"),
]


@pytest.mark.parametrize("args, pattern", SIMULATE_FLAGS)
def test_simulate_refuses_bad_flags(args, pattern):
    line = assert_refused(runner.invoke(app, [*SIMULATE, *args]), pattern)
    assert "PAR1" not in line  # a binary file is named, never quoted


def test_simulate_names_a_trace_directory_and_a_missing_trace(tmp_path):
    base = ["simulate", "--model", MODEL, "--gpu", "h100", "--trace"]
    assert_refused(runner.invoke(app, [*base, str(tmp_path)]), rf"{re.escape(str(tmp_path))}: is a directory")
    assert_refused(runner.invoke(app, [*base, str(tmp_path / "none.csv")]), r"none\.csv: no such file")


def test_simulate_prints_a_trace_warning_as_one_clean_line(tmp_path):
    """Unsorted rows are sorted with one ``warning:`` line (no Python source location),
    before the run stops at a later bad flag."""
    trace = tmp_path / "unsorted.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n5,10,2\n0,10,2\n9,10,2\n1,10,2\n")
    result = runner.invoke(app, ["simulate", "--trace", str(trace), "--model", MODEL, "--gpu", "h100",
                                 "--predictor", "psychic"])
    assert_refused(result, "unknown predictor")
    warned = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "2 such row(s), sorted by arrival" in warned[0] and str(trace) in warned[0]
    assert ".py:" not in result.stderr and "TraceWarning" not in result.stderr


# -- simulate: config files ----------------------------------------------------------------


CONFIG_FILES = [
    pytest.param("--config", "[policy]\nmax_num_seqs = inf\n", r"policy\.toml: max_num_seqs must be in \[1, 65536\], "
                                                              r"got inf", id="policy-inf"),
    pytest.param("--config", "[policy]\nmax_num_batched_tokens = 100000000000000000000000000000\n",
                 r"policy\.toml: max_num_batched_tokens must be in", id="policy-huge-integer"),
    pytest.param("--config", "[policy]\nmax_num_seqs = 'many'\n", r"policy\.toml: max_num_seqs must be a number, "
                                                                 r"got 'many'", id="policy-wrong-type"),
    pytest.param("--config", "[policy]\nmax_num_seqz = 64\n", r"policy\.toml: unknown knob\(s\) \['max_num_seqz'\] "
                                                             r"\(did you mean 'max_num_seqs'\?\)", id="policy-typo"),
    pytest.param("--config", "[policy]\nblock_size = 7\n", r"policy\.toml.*block_size=7: refused by vLLM and SGLang",
                 id="policy-block-size-7"),
    pytest.param("--config", "[policy]\nmax_num_seqs = 64\n[polcy]\nmax_num_batched_tokens = 4096\n",
                 r"policy\.toml: only a \[policy\] table is read; found \['polcy'\] beside it",
                 id="policy-table-beside-policy"),
    pytest.param("--config", "[policy]\nscheduling_policy = 'fifo'\n",
                 r"policy\.toml: scheduling_policy must be one of \['fcfs'", id="policy-unknown-choice"),
    pytest.param("--config", "[policy]\nmax_num_seqs = 64\n# caf\xe9\n".encode("latin-1"),
                 r"policy\.toml: line 3: b'\\xe9' is not UTF-8", id="policy-not-utf8"),
    pytest.param("--config", "[policy\nmax_num_seqs = 64\n", r"policy\.toml: not valid TOML", id="policy-not-toml"),
    pytest.param("--slo-file", "[slo.default]\nttft = 0\n", r"slo\.toml: SLO class 'default': ttft must be a finite "
                                                           r"number of ms > 0", id="slo-file-zero"),
    pytest.param("--slo-file", "[slo.default]\nttfb = 500\n", r"slo\.toml: SLO class 'default': unknown key\(s\) "
                                                             r"\['ttfb'\] \(did you mean 'ttft'\?\)", id="slo-file-typo"),
    pytest.param("--slo-file", "[slo.default]\nttft = '500'\n", r"ttft must be a finite number of ms > 0.*got '500'",
                 id="slo-file-wrong-type"),
    pytest.param("--slo-file", "slo = 5\n", r"SLO classes must be tables such as \[slo\.default\]",
                 id="slo-file-not-a-table"),
]


@pytest.mark.parametrize("flag, text, pattern", CONFIG_FILES)
def test_simulate_refuses_bad_config_files(tmp_path, flag, text, pattern):
    name = "policy.toml" if flag == "--config" else "slo.toml"
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    line = assert_refused(runner.invoke(app, [*SIMULATE, flag, str(path)]), pattern)
    assert str(path) in line


def test_simulate_names_a_config_directory(tmp_path):
    assert_refused(runner.invoke(app, [*SIMULATE, "--config", str(tmp_path)]), r"--config .*: is a directory")


# -- tune: flags and spec files ------------------------------------------------------------


TUNE_FLAGS = [
    pytest.param(["--trials", "0"], r"trials must be an integer >= 1, got 0", id="trials-zero"),
    pytest.param(["--trials", "-5"], r"trials must be an integer >= 1, got -5", id="trials-negative"),
    pytest.param(["--rate-scale", "0"], r"rate_scale must be a number > 0, got 0\.0", id="rate-scale-zero"),
    pytest.param(["--rate-scale", "-1"], r"rate_scale must be a number > 0, got -1\.0", id="rate-scale-negative"),
    pytest.param(["--slo", "ttft:0"], r"ttft must be a finite number of ms > 0", id="slo-zero"),
    pytest.param(["--slo", "ttft=100"], r"SLO part 'ttft=100': expected KEY:MS", id="slo-malformed"),
    pytest.param(["--gpu", "tpu"], r"unknown GPU 'tpu'", id="unknown-gpu"),
    pytest.param(["--tp", "3"], r"deployment: .*tp=3 does not divide", id="tp-does-not-divide-heads"),
    pytest.param(["--model", "meta-llama/Llama-3.1-70B", "--gpu", "a100"], r"deployment: .*needs .* GiB",
                 id="model-does-not-fit"),
    pytest.param(["--predictor", "noisy:x"], r"predictor 'noisy:x'; expected 'noisy:SIGMA'", id="predictor-malformed"),
]


def tune(tmp_path: Path, *args: str):
    """``servetune tune`` on the sample, its run folder in ``tmp_path`` (it must stay absent).
    ``args`` come last: an option given twice takes its last value."""
    run_dir = tmp_path / "runs"
    result = runner.invoke(app, ["tune", "--trace", str(SAMPLE_TRACE), "--model", MODEL, "--gpu", "h100",
                                 "--slo", "ttft:2000", "--engine", "vllm", "--run-dir", str(run_dir), *args])
    assert not run_dir.exists(), "the run started: the bad input was not caught at validation"
    return result


@pytest.mark.parametrize("args, pattern", TUNE_FLAGS)
def test_tune_refuses_bad_flags(tmp_path, args, pattern):
    assert_refused(tune(tmp_path, *args), pattern)


SPEC = f'[trace]\npath = "{SAMPLE_TRACE}"\n[deployment]\nmodel = "{MODEL}"\ngpu = "h100"\n[slo.default]\nttft = 2000\n'
SPEC_FILES = [
    pytest.param("[studdy]\ntrials = 3\n", r"unknown section\(s\) \['studdy'\] \(did you mean 'study'\?\)",
                 id="spec-section-typo"),
    pytest.param("[study]\ntrial = 3\n", r"\[study\] has unknown key\(s\) \['trial'\] \(did you mean 'trials'\?\)",
                 id="spec-key-typo"),
    pytest.param("[constraints]\np99_ttft = 500\n", r"\[constraints\] has unknown key\(s\) \['p99_ttft'\] "
                                                   r"\(did you mean 'p99_ttft_ms'\?\)", id="spec-constraint-typo"),
    pytest.param("[study]\ntrials = 0\n", r"trials must be an integer >= 1, got 0", id="spec-trials-zero"),
    pytest.param("[study]\nname = 5\n", r"study name 5 may use letters", id="spec-name-not-text"),
    pytest.param("[study]\nseed = true\n", r"seed must be an integer >= 0, got True", id="spec-seed-bool"),
    pytest.param("[space.max_num_seqs]\nlow = 8\nhigh = inf\n", r"\[space\.max_num_seqs\] high: max_num_seqs must be "
                                                               r"in \[1, 65536\], got inf", id="spec-space-high-inf"),
    pytest.param("[space.max_num_seqs]\nlow = 64\nhigh = 8\n", r"\[space\.max_num_seqs\]: low 64 is above high 8",
                 id="spec-space-empty-range"),
    pytest.param("[space.max_num_seqs]\nlo = 8\nhigh = 64\n", r"\[space\.max_num_seqs\] has unknown key\(s\) \['lo'\]",
                 id="spec-space-key-typo"),
    pytest.param("[space.block_size]\nvalue = 7\n", r"\[space\.block_size\]: block_size=7: refused by vLLM and SGLang "
                                                   r"\(vLLM: block-size 7 is not one of", id="spec-space-block-size-7"),
    pytest.param("[space.block_size]\nchoices = [16, 24]\n", r"\[space\.block_size\]: block_size=24: refused by vLLM",
                 id="spec-space-block-size-choice"),
    pytest.param("[trace]\nrate_scale = '2'\n", r"rate_scale must be a number > 0, got '2'", id="spec-rate-scale-text"),
    pytest.param("[trace]\nrate_scale = inf\n", r"rate_scale must be a number > 0, got inf", id="spec-rate-scale-inf"),
    pytest.param("[trace]\nmax_tokens = 1000000000000\n", r"max_tokens must be an integer in \[1, 16777216\], "
                                                         r"got 1000000000000", id="spec-max-tokens-1e12"),
    pytest.param("[trace]\noptions = 5\n", r"trace options must be a table", id="spec-trace-options-not-a-table"),
    pytest.param("[trace]\npredictor = 'psychic'\n", r"unknown predictor 'psychic'", id="spec-predictor-unknown"),
    pytest.param("[slo.default]\nttft = 0\n", r"SLO class 'default': ttft must be a finite number of ms > 0",
                 id="spec-slo-zero"),
    pytest.param("[constraints]\np99_ttft_ms = inf\n", r"constraints\.p99_ttft_ms must be a number >= 0, got inf",
                 id="spec-constraint-inf"),
    pytest.param("[objective]\ncapacity_target = 'most'\n", r"capacity_target is an SLO-attainment fraction",
                 id="spec-capacity-target-text"),
    pytest.param("[deployment]\ntp = 3\n", r"deployment: .*tp=3 does not divide", id="spec-tp-does-not-divide"),
    pytest.param("[deployment]\ngpu = 'v100'\n", r"deployment: unknown GPU 'v100'", id="spec-unknown-gpu"),
    pytest.param("[study]\nrun_dir = 7\n", r"run_dir must be a path \(a string\), got 7", id="spec-run-dir-not-text"),
    pytest.param(b"[study]\ntrials = 3\n# caf\xe9\n", r"line \d+: b'\\xe9' is not UTF-8", id="spec-not-utf8"),
]


@pytest.mark.parametrize("extra, pattern", SPEC_FILES)
def test_tune_refuses_bad_spec_files(tmp_path, extra, pattern):
    spec = tmp_path / "spec.toml"
    data = _merged(SPEC, extra.decode("latin-1") if isinstance(extra, bytes) else extra)
    spec.write_bytes(data)
    result = runner.invoke(app, ["tune", str(spec), "--engine", "vllm", "--run-dir", str(tmp_path / "runs")])
    assert not (tmp_path / "runs").exists(), "the run started: the bad spec was not caught at validation"
    line = assert_refused(result, pattern)
    assert str(spec) in line
    if LATIN1 in data:  # the line the byte is on
        assert f"line {data[:data.index(LATIN1)].count(NEWLINE) + 1}:" in line


def _merged(base: str, extra: str) -> bytes:
    """``base`` with ``extra``'s tables added: a key of a table ``base`` has replaces base's
    (TOML refuses a table given twice). Latin-1 text stays Latin-1 bytes."""
    tables: dict[str, list[str]] = {}
    for text in (base, extra):
        name = ""
        for line in text.splitlines():
            if line.startswith("["):
                name = line
                tables.setdefault(name, [])
            elif line.strip():
                key = line.split("=")[0].strip()
                tables.setdefault(name, [])
                tables[name] = [kept for kept in tables[name] if kept.split("=")[0].strip() != key] + [line]
    text = "".join(f"{name}\n" + "".join(f"{line}\n" for line in lines) for name, lines in tables.items())
    return text.encode("latin-1")


def test_the_suite_has_its_cases():
    assert len(SIMULATE_FLAGS) + len(CONFIG_FILES) + len(TUNE_FLAGS) + len(SPEC_FILES) + 4 >= 60
