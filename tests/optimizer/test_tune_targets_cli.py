"""`servetune tune` per target, as a user runs it: one study and one folder per engine, the
what-if target apart, and the console stating the exported file's gain."""

import json

import numpy as np
import yaml
from typer.testing import CliRunner

from optimizer.cli import app
from policies.config import PolicyConfig
from studies.traces import Trace
from tests.optimizer.tuning_helpers import write_csv_trace


def _trace_file(tmp_path):
    rng = np.random.default_rng(3)
    n = 300
    trace = Trace.from_columns(np.cumsum(rng.exponential(0.02, n)), rng.integers(200, 2000, n),
                               rng.integers(10, 200, n))  # no caps: clients send none
    return write_csv_trace(tmp_path / "chat.csv", trace)


def test_tune_writes_one_deployable_file_per_engine_and_what_ifs_apart(tmp_path):
    runs = tmp_path / "runs"
    result = CliRunner().invoke(app, [
        "tune", "--trace", str(_trace_file(tmp_path)), "--model", "meta-llama/Llama-3.1-8B", "--gpu", "h100",
        "--slo", "ttft:300,tpot:30", "--trials", "6", "--batch-size", "2", "--what-if", "--run-dir", str(runs),
        "-q"])
    assert result.exit_code == 0, result.output
    overview = json.loads((runs / "summary.json").read_text())
    assert set(overview["targets"]) == {"vllm", "sglang", "servetune"}
    assert yaml.safe_load((runs / "vllm" / "vllm.yaml").read_text())["model"] == "meta-llama/Llama-3.1-8B"
    assert "model-path" in yaml.safe_load((runs / "sglang" / "sglang.yaml").read_text())
    assert not (runs / "vllm" / "sglang.yaml").exists() and not (runs / "vllm" / "policy.toml").exists()
    PolicyConfig.from_toml((runs / "servetune" / "policy.toml").read_text())
    assert not (runs / "servetune" / "vllm.yaml").exists()
    for name in ("vllm", "sglang"):
        summary = json.loads((runs / name / "summary.json").read_text())
        gain = overview["targets"][name]["gain"][f"{name}-default"]
        shown = f"gain of {name}.yaml over {name}-default: "
        assert shown in result.output.replace("\n", " ")
        assert summary["recommendation"]["file"] == f"{name}.yaml"
        theirs = summary["baselines"][f"{name}-default"]["report"]["weighted_goodput"]
        if theirs > 0:
            assert gain == summary["best"]["report"]["weighted_goodput"] / theirs
        else:  # the default serves nothing within the SLOs: no ratio is stated
            assert gain is None and "unbounded (the default has no goodput)" in result.output
    # the bench replay, from the study folder: tune -> bench -> compare
    for name in ("vllm", "sglang"):
        wrapper = (runs / f"bench-{name}.sh").read_text()
        assert f'exec bash "$(dirname "${{BASH_SOURCE[0]}}")/{name}/bench-{name}.sh" "$@"' in wrapper
        assert (runs / name / "trace.jsonl").is_file() and (runs / name / "bench.json").is_file()
    assert not (runs / "bench-servetune.sh").exists() and not (runs / "servetune" / "trace.jsonl").exists()
    from optimizer.bench.results import RequestTimes, write_vllm_result
    from optimizer.bench.run import BenchRun

    bench = BenchRun.open(runs / "vllm")
    measured = RequestTimes.simulated(bench.simulate(bench.trace, bench.cost_model()), bench.trace)
    result_file = write_vllm_result(measured, runs / "vllm" / "bench-result.json")
    compared = CliRunner().invoke(app, ["compare", str(runs), str(result_file)], terminal_width=200)
    assert compared.exit_code == 0, compared.output
    assert "vs simulated vllm.yaml" in compared.output and "+0.0%" in compared.output
    what_if = json.loads((runs / "servetune" / "summary.json").read_text())
    assert what_if["recommendation"]["what_if"] is True and "oracle_upper_bound" in what_if
    assert "what-if gain of policy.toml" in result.output.replace("\n", " ")


def test_an_engine_study_refuses_a_router_the_engine_lacks(tmp_path):
    result = CliRunner().invoke(app, [
        "tune", "--trace", str(_trace_file(tmp_path)), "--model", "meta-llama/Llama-3.1-8B", "--gpu", "h100",
        "--slo", "ttft:300,tpot:30", "--trials", "2", "--engine", "vllm", "--replicas", "2",
        "--router", "cache_aware", "--run-dir", str(tmp_path / "r"), "-q"])
    assert result.exit_code == 2
    assert "no target of this run has a flag for" in result.output and "--what-if" in result.output


def test_a_space_entry_one_engine_lacks_applies_to_the_others_and_says_so():
    from rich.console import Console

    from optimizer.cli.tune import _spaces_per_target

    console = Console(record=True, width=200)
    space = {"long_prefill_token_threshold": {"low": 256, "high": 4096}, "max_num_seqs": {"low": 8, "high": 64}}
    spaces = _spaces_per_target(space, ["vllm", "sglang"], console)
    assert spaces["vllm"] == space
    assert spaces["sglang"] == {"max_num_seqs": {"low": 8, "high": 64}}
    assert "SGLang has no flag for long_prefill_token_threshold" in console.export_text()


def test_simulating_the_exported_file_gives_the_figures_tune_stated(tmp_path):
    trace = _trace_file(tmp_path)
    runs = tmp_path / "runs"
    common = ["--model", "meta-llama/Llama-3.1-8B", "--gpu", "h100", "--slo", "ttft:300,tpot:30"]
    tuned = CliRunner().invoke(app, ["tune", "--trace", str(trace), *common, "--trials", "6", "--batch-size", "2",
                                     "--engine", "sglang", "--holdout", "0", "--run-dir", str(runs), "-q"])
    assert tuned.exit_code == 0, tuned.output
    summary = json.loads((runs / "sglang" / "summary.json").read_text())
    # an SGLang file is timed with SGLang's op tables, as its study was, and runs the replicas it
    # deploys: no flag needed to get the figures its header states
    replayed = CliRunner().invoke(app, ["simulate", "--trace", str(trace), *common,
                                        "--config", str(runs / "sglang" / "sglang.yaml"), "--format", "json"])
    assert replayed.exit_code == 0, replayed.output
    run = json.loads(replayed.stdout)
    deployed = summary["answer"]["deploy"]
    assert run["framework"] == "sglang" and run["replicas"] == deployed["replicas"]
    assert run["report"]["weighted_goodput"] == deployed["report"]["weighted_goodput"]
    assert run["report"]["p99_ttft_ms"] == deployed["report"]["p99_ttft_ms"]
    # on the study's own fleet (one replica) it is the figure the gain is stated with
    one = CliRunner().invoke(app, ["simulate", "--trace", str(trace), *common, "--replicas", "1",
                                   "--config", str(runs / "sglang" / "sglang.yaml"), "--format", "json"])
    report = json.loads(one.stdout)["report"]
    assert report["weighted_goodput"] == summary["best"]["report"]["weighted_goodput"]
    assert report["p99_ttft_ms"] == summary["best"]["report"]["p99_ttft_ms"]
