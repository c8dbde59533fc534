"""Bench replays (issue 14): the replayed trace, result parsers, compare and calibrate."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from costmodels import build
from optimizer.bench.compare import compare
from optimizer.bench.fit import MeasuredRun, calibrate_from_bench, save_entry
from optimizer.bench.results import BenchResultError, RequestTimes, read_result, write_vllm_result
from optimizer.bench.run import BenchRun
from optimizer.cli import app
from optimizer.outputs.replay import file_replay, write_bench_replay
from optimizer.search.evaluate import Evaluator
from optimizer.search.spec import load_spec
from optimizer.search.study import _write_manifest
from studies.formats import mooncake, native
from studies.replay import as_replayed
from studies.traces import Trace

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "bench"
MODEL, GPU = "meta-llama/Llama-3.1-8B", "h100"


def traffic(n: int = 120, seed: int = 3) -> Trace:
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(0.25, n))
    prompts = rng.integers(200, 3000, n)
    blocks = -(-prompts // 512)
    hashes = np.concatenate([np.r_[0, rng.integers(1000 * i + 1, 1000 * i + 900, b - 1)] for i, b in enumerate(blocks)])
    offsets = np.r_[0, np.cumsum(blocks)]
    return Trace.from_columns(arrival + 10.0, prompts, rng.integers(20, 200, n), block_offsets=offsets,
                              block_hashes=hashes, slo_class=(np.arange(n) % 2).astype(np.int32),
                              slo_class_names=("chat", "batch"))


def make_run(tmp_path: Path, trace: Trace, slo_file: str | None = None) -> Path:
    """A vLLM run folder written by the code tune uses (study.json, vllm.yaml, bench files)."""
    path = native.write(trace, tmp_path / "trace.parquet")
    slos = tmp_path / "slo.toml"
    slos.write_text(slo_file or "[slo.chat]\nttft = 2000\ntpot = 100\n[slo.batch]\nttft = 8000\n")
    spec = load_spec(trace=path, model=MODEL, gpu=GPU, slo_file=slos, engine="vllm", run_dir=tmp_path / "run",
                     trials=1)
    spec.run_dir.mkdir()
    _write_manifest(spec, spec.fingerprint())
    evaluator = Evaluator(spec)
    config = evaluator.baselines()["vllm-default"]
    replay = file_replay(spec, evaluator.target, config, spec.fleet)
    (spec.run_dir / replay.name).write_text(replay.text)
    write_bench_replay(spec.run_dir, spec, evaluator, replay, spec.fleet, {})
    return spec.run_dir


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("bench"), traffic())


def test_replayed_trace_reads_back_as_the_study_trace(run_folder):
    study = traffic()
    replayed = as_replayed(study)
    back = mooncake.read(run_folder / "trace.jsonl", spread="raw", block_tokens=512)
    assert back.n == study.n
    np.testing.assert_allclose(back.arrival_s, study.arrival_s - study.arrival_s[0], atol=1e-6)
    assert back.arrival_s[0] == 0.0  # the replay tools sleep until each timestamp, counted from their start
    assert np.array_equal(back.prompt_tokens, study.prompt_tokens)
    assert np.array_equal(back.output_tokens, study.output_tokens)
    assert np.array_equal(back.block_offsets, study.block_offsets)  # the study trace lists every block here
    assert np.array_equal(back.block_hashes, study.block_hashes)
    assert np.array_equal(back.block_hashes, replayed.block_hashes)


def test_blocks_a_trace_lacks_get_fresh_unshared_ids():
    bare = Trace.from_columns([0.0, 1.0], [1200, 100], [5, 5], block_offsets=[0, 1, 1], block_hashes=[7])
    replayed = as_replayed(bare)
    assert replayed.block_counts.tolist() == [3, 1]  # ceil(prompt / 512): vLLM builds prompts from the ids
    assert replayed.block_hashes[0] == 7 and len(set(replayed.block_hashes.tolist())) == 4
    assert replayed.max_tokens.tolist() == [5, 5]  # the replay sends each output's length


def test_the_replay_sends_no_cache_salt_so_its_simulation_shares_every_prefix():
    salted = Trace.from_columns([0.0, 1.0], [1024, 1024], [5, 5], block_offsets=[0, 2, 4], block_hashes=[7, 8, 7, 8],
                                cache_salt=np.array([0, 1], dtype=np.int32), cache_salt_names=("a", "b"))
    replayed = as_replayed(salted)
    assert replayed.cache_salt_names == ("",) and not replayed.cache_salt.any()
    keyed = replayed.cache_block_hashes
    assert keyed[:2].tolist() == keyed[2:].tolist() == [7, 8]


def test_bench_script_replays_each_distinct_slo_class(run_folder):
    script = (run_folder / "bench-vllm.sh").read_text()
    manifest = json.loads((run_folder / "bench.json").read_text())
    assert "--dataset-name timed_trace" in script and "--timed-trace-chunk-hash-size 512" in script
    assert "--timed-trace-sec-multiplier 0.001" in script and "--num-prompts 120" in script
    assert "--save-detailed" in script and "--ignore-eos" in script and "--random-input-len" not in script
    classes = {c["name"]: c for c in manifest["classes"]}
    assert classes["chat"]["bounds_ms"] == {"ttft": 2000.0, "tpot": 100.0}
    assert classes["batch"]["bounds_ms"] == {"ttft": 8000.0}
    assert "chat) AIPERF_GOODPUT='time_to_first_token:2000 inter_token_latency:100' replay bench-result-chat.json " \
           "ttft:2000 tpot:100" in script
    # the header's figure is the file's simulation on exactly the replayed traffic
    figure = classes["chat"]["simulated"]["request_goodput"]
    assert f"-> bench-result-chat.json: goodput {figure:.4g} req/s" in script


def test_vllm_result_parser():
    times = read_result(FIXTURES / "vllm_result.json")
    assert times.source.startswith("vllm:")
    assert times.prompt_tokens.tolist() == [1200, 700, 3000] and times.output_tokens.tolist() == [5, 3, 4]
    np.testing.assert_allclose(times.ttft_ms, [46.810829, 42.163666, 42.368444])
    np.testing.assert_allclose(times.sent_s, [0.0, 0.4947, 0.9951], atol=1e-9)
    assert times.tpot_ms[1] == pytest.approx((times.e2el_ms[1] - times.ttft_ms[1]) / 2)
    assert len(times.itl_ms) == 4 + 2 + 3


def test_sglang_result_parser():
    times = read_result(FIXTURES / "sglang_result.jsonl")
    assert times.source.startswith("sglang:") and np.isnan(times.sent_s).all()  # SGLang keeps no send times
    assert times.prompt_tokens.tolist() == [1196, 731, 3014]
    with pytest.raises(BenchResultError, match="2 runs appended.*--run"):
        read_result(FIXTURES / "sglang_two_runs.jsonl")
    assert read_result(FIXTURES / "sglang_two_runs.jsonl", run=1).n == 3


def test_aiperf_result_parser():
    times = read_result(FIXTURES / "aiperf_profile_export.jsonl")
    assert times.source.startswith("aiperf:")
    assert times.prompt_tokens.tolist() == [1200, 700, 3000] and times.output_tokens.tolist() == [5, 3, 4]
    np.testing.assert_allclose(times.ttft_ms, [46.810829, 42.163666, 42.368444])
    np.testing.assert_allclose(times.e2el_ms, [89.4439, 63.700816, 74.239251])
    assert times.sent_s[0] == 0.0 and times.sent_s[2] == pytest.approx(0.995, abs=1e-3)


def test_a_result_without_detail_or_of_another_trace_is_refused(run_folder, tmp_path):
    with pytest.raises(BenchResultError, match=r"vllm_result_no_detail.json: no per-request field.*--save-detailed"):
        read_result(FIXTURES / "vllm_result_no_detail.json")
    run = BenchRun.open(run_folder)
    with pytest.raises(BenchResultError, match="3 requests, but .*trace.jsonl has 120: .*another trace"):
        run.traffic(read_result(FIXTURES / "vllm_result.json"))
    sim = RequestTimes.simulated(run.simulate(run.trace, run.cost_model()), run.trace)
    longer = replace(sim, output_tokens=sim.output_tokens + 1, source="vllm:x.json")
    with pytest.raises(BenchResultError, match="request 0 produced .* output tokens"):
        run.traffic(longer)
    shifted = replace(sim, prompt_tokens=sim.prompt_tokens + 1, source="vllm:x.json")
    with pytest.raises(BenchResultError, match="request 0 sent a .*-token prompt"):
        run.traffic(shifted)
    assert run.traffic(replace(shifted, source="sglang:x.jsonl")).n == 120  # SGLang rebuilds prompts near them


TRUTH = {"overhead_s": 0.0061, "prefill_scale": 1.25, "decode_scale": 0.88}
KEY = {"model": MODEL, "gpu": "h100_sxm", "framework": "vllm", "gemm_dtype": "bf16", "kv_dtype": "bf16",
       "tp": 1}


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory):
    """A bench result made by a server whose step times follow known factors, on 300
    requests that go from light load to a burst and back: decode batches of every size,
    which is what tells the per-step overhead from the decode scale."""
    n = 300
    gaps = np.r_[np.full(n // 4, 0.4), np.full(n // 2, 0.03), np.full(n // 4, 0.4)]
    bursty = traffic(n, seed=5)
    bursty = bursty.replace(arrival_s=10 + np.cumsum(np.random.default_rng(5).exponential(gaps)))
    run = BenchRun.open(make_run(tmp_path_factory.mktemp("bursty"), bursty))
    base = build(MODEL, GPU, calibration=False)
    truth_cost = replace(base, tables=base.tables._replace(scale=1.0, **TRUTH))
    sim = RequestTimes.simulated(run.simulate(run.trace, truth_cost), run.trace)
    result = write_vllm_result(sim, tmp_path_factory.mktemp("perturbed") / "bench-result.json")
    return run, base, truth_cost, read_result(result), result


def test_compare_sees_a_wrong_model(perturbed):
    run, base, truth_cost, measured, _ = perturbed
    right = compare(run, measured, truth_cost)
    assert all(e["mape"] < 1e-9 for e in right.per_request.values())  # the run the model itself made
    wrong = compare(run, measured, base)
    assert wrong.per_request["ttft"]["mape"] > 0.05 and wrong.per_request["tpot"]["mape"] > 0.05
    assert wrong.worst in ("decode", "prefill", "queueing")


def test_calibrate_recovers_known_factors_and_compare_then_agrees(perturbed, tmp_path):
    run, base, _, measured, result = perturbed
    entry = calibrate_from_bench([MeasuredRun(str(result), run, measured)], base, dict(KEY))
    for key, value in TRUTH.items():
        assert entry[key] == pytest.approx(value, rel=0.02), key
    error = entry["error"]
    assert error["in_sample"]["tpot_mape"] < error["before"]["tpot_mape"] / 10
    assert error["leave_one_run_out"] is None and "one run" in error["note"]

    comparison = compare(run, measured, run.cost_model(save_entry(entry, tmp_path / "calibration.json")))
    assert comparison.per_request["tpot"]["mape"] < 0.02
    for row in comparison.rows:
        if np.isfinite(row.error):
            assert abs(row.error) < 0.02, row.metric


def test_compare_cli_prints_the_table_and_writes_the_plot(run_folder, tmp_path):
    run = BenchRun.open(run_folder)
    sim = RequestTimes.simulated(run.simulate(run.trace, run.cost_model()), run.trace)
    result = write_vllm_result(sim, tmp_path / "bench-result.json")
    out = CliRunner().invoke(app, ["compare", str(run_folder.parent / "run"), str(result)], terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "goodput (req/s)" in out.output and "p99 TTFT (ms)" in out.output and "p90 E2E (ms)" in out.output
    assert "Largest disagreement" in out.output
    assert (tmp_path / "bench-result-vs-simulated.png").stat().st_size > 1000
    bad = CliRunner().invoke(app, ["compare", str(run_folder), str(FIXTURES / "vllm_result.json")])
    assert bad.exit_code == 2 and "another trace" in bad.output


def test_calibrate_cli_writes_a_file_simulate_takes(run_folder, tmp_path):
    run = BenchRun.open(run_folder)
    sim = RequestTimes.simulated(run.simulate(run.trace, run.cost_model()), run.trace)
    result = write_vllm_result(sim, tmp_path / "bench-result.json")
    output = tmp_path / "cal.json"
    out = CliRunner().invoke(app, ["calibrate", "--from-bench", str(result), "--run-dir", str(run_folder),
                                   "--model", MODEL, "--gpu", GPU, "-o", str(output)], terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "leave one run out" in out.output and "one run: no out-of-sample error" in out.output
    twice = CliRunner().invoke(app, ["calibrate", "--from-bench", str(result), "--from-bench", str(result),
                                     "--run-dir", str(run_folder), "--run-dir", str(run_folder), "--model", MODEL,
                                     "--gpu", GPU, "-o", str(tmp_path / "two.json")], terminal_width=200)
    assert twice.exit_code == 0, twice.output
    held = json.loads((tmp_path / "two.json").read_text())["entries"][0]["error"]["leave_one_run_out"]
    assert set(held) == {"ttft_mape", "tpot_mape"}  # fitted on one run, scored on the other
    entry = json.loads(output.read_text())["entries"][0]
    assert entry["tp"] == [1] and entry["source"] == "bench replay"
    cost = build(MODEL, GPU, calibration=output)
    assert cost.calibration["match"] == "setup" and cost.tables.prefill_scale == entry["prefill_scale"]
    wrong = CliRunner().invoke(app, ["calibrate", "--from-bench", str(result), "--run-dir", str(run_folder),
                                     "--model", MODEL, "--gpu", "a100", "-o", str(output)])
    assert wrong.exit_code == 2 and "not the" in wrong.output


def test_a_bench_replay_of_an_attention_dp_file_steps_its_groups_together(tmp_path):
    from types import SimpleNamespace

    from optimizer.bench.run import BenchRun
    from policies.config import PolicyConfig
    from policies.fleet import simulate_fleet
    from tests.policies.conftest import cost_model, poisson_trace

    trace, cost = poisson_trace(60, rate=200.0, seed=2), cost_model(4000)
    config = PolicyConfig(gpu_memory_utilization=1.0, router="round_robin")
    run = BenchRun(tmp_path, {"deployment": {"tp": 8, "replicas": 1, "attention_dp": 2}},
                   SimpleNamespace(seed=4, speculative=None), config, trace)
    replayed = run.simulate(trace, cost)
    together = simulate_fleet(trace, cost, config, seed=4, replicas=2, lockstep=2)
    apart = simulate_fleet(trace, cost, config, seed=4, replicas=2)
    np.testing.assert_array_equal(replayed.finish_s, together.finish_s)
    assert not np.array_equal(replayed.finish_s, apart.finish_s)


def test_saving_an_entry_keeps_the_files_measured_error_per_tier(tmp_path):
    from costmodels.calibration import load_calibration, load_tier_errors, save_calibration

    path = tmp_path / "calibration.json"
    tiers = {"method": "held out", "tiers": {"none": {"ttft_mape": 40.0, "tpot_mape": 20.0, "runs": 30, "setups": 2}}}
    save_calibration([], path, tier_errors=tiers)
    entry = {"model": "meta-llama/Llama-3.1-8B", "gpu": "h100_sxm", "framework": "vllm", "gemm_dtype": "bf16",
             "kv_dtype": "bf16", "tp": [1], "overhead_s": 1e-3, "scale": 1.0}
    save_entry(entry, path)
    assert load_tier_errors(path) == tiers and load_calibration(path) == [entry]
