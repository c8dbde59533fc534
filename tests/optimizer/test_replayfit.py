"""Calibration by replay (``optimizer.fidelity.replayfit``): the closed loop fitted to runs it must reproduce."""

import json

import numpy as np
import polars as pl
import pytest

from costmodels import build
from costmodels.compose import with_comm_scale
from optimizer.cli.validate import format_report, predict_runs
from optimizer.fidelity.closedloop import BenchClient, ClosedLoopError, benchmark_means
from optimizer.fidelity.replayfit import (
    UNMEASURED_SERVER,
    calibrate_replay,
    fit_replay,
    pinned_terms,
    server_config,
)
from optimizer.search.targets import context_of

MODEL, GPU = "meta-llama/Llama-3.1-8B", "h100_sxm"
BENCH = BenchClient(requests_per_client=4)
TRUTH = {"overhead_s": 3e-3, "prefill_scale": 1.3, "decode_scale": 0.85}


def _measured(framework, server, tps=(1,), truth=TRUTH):
    """Runs "measured" on a server whose step costs ``truth`` and runs ``server`` overrides."""
    rows = []
    for tp in tps:
        cost = build(MODEL, GPU, tp=tp, framework=framework, calibration=False)
        terms = {k: v for k, v in truth.items() if k != "comm_scale"}
        tables = with_comm_scale(cost.tables, cost.comm_s, truth.get("comm_scale", 1.0))._replace(scale=1.0, **terms)
        true = cost.__class__(**{**cost.__dict__, "tables": tables})
        config = server_config(framework, context_of(true, GPU, context_len=0, tp=tp), server)
        for clients, isl, osl in [(8, 1024, 128), (8, 4096, 512), (32, 1024, 512), (32, 4096, 128), (16, 2048, 256)]:
            ttft, tpot = benchmark_means(true, config, clients, isl, osl, BENCH)
            rows.append((MODEL, GPU, framework, "bf16", tp, clients, isl, osl, ttft, tpot))
    return pl.DataFrame(rows, schema=["model", "gpu", "framework", "gemm_dtype", "tp", "batch_size", "isl", "osl",
                                      "ttft_ms", "tpot_ms"], orient="row")


def test_replay_fit_recovers_known_terms_and_the_servers_token_budget():
    runs = _measured("vllm", {"max_num_batched_tokens": 4096})
    fit = fit_replay(runs, bench=BENCH)
    assert fit["measured_server"] == {"max_num_batched_tokens": 4096}
    assert fit["prefill_scale"] == pytest.approx(TRUTH["prefill_scale"], rel=0.05)
    assert fit["decode_scale"] == pytest.approx(TRUTH["decode_scale"], rel=0.05)
    assert fit["overhead_s"] == pytest.approx(TRUTH["overhead_s"], abs=5e-4)
    assert fit["tpot_mape_after"] < 1.0 and fit["ttft_mape_after"] < 2.0
    assert fit["tpot_mape_after"] < fit["tpot_mape_before"]
    assert fit["pinned_terms"] == []  # every term placed inside its range


def test_calibrate_replay_writes_entries_build_and_validate_apply(tmp_path):
    runs = _measured("trtllm", {"enable_chunked_prefill": True}, tps=(1, 2))
    entries = calibrate_replay(runs, bench=BENCH)
    assert [e["model"] for e in entries] == [MODEL, "*"]  # the model's entry, then the pooled fallback
    mine = entries[0]
    assert mine["tp"] == [1, 2] and mine["kv_dtype"] == "bf16" and mine["fit"] == "replay"
    assert mine["measured_server"] == {"enable_chunked_prefill": True}
    assert mine["error"]["in_sample_tpot_mape"] == mine["tpot_mape_after"] < 2.0
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"format": "servetune-calibration/1", "entries": entries}))
    cost = build(MODEL, GPU, tp=2, framework="trtllm", calibration=path)
    assert cost.tables.prefill_scale == pytest.approx(mine["prefill_scale"])
    assert cost.tables.decode_scale == pytest.approx(mine["decode_scale"])
    pred = predict_runs(runs, calibration=path, bench=BENCH)
    assert set(pred["measured_server"].to_list()) == {json.dumps({"enable_chunked_prefill": True})}
    assert set(pred["calibration_match"].to_list()) == {"setup"}
    ape = (pred["pred_tpot_ms"] / pred["tpot_ms"] - 1).abs().mean() * 100
    assert ape < 2.0
    # a setup the file has no TP for falls back to the model's entry, with its server
    other = predict_runs(runs.with_columns(pl.lit(4).alias("tp")).head(1), calibration=path, bench=BENCH)
    assert other["calibration_match"][0] == "model"
    assert other["measured_server"][0] == json.dumps({"enable_chunked_prefill": True})


def test_fit_replay_takes_one_framework():
    runs = pl.concat([_measured("vllm", {}).head(1), _measured("trtllm", {}).head(1)])
    with pytest.raises(ClosedLoopError, match="one framework"):
        fit_replay(runs)


def test_uncalibrated_runs_replay_with_the_unmeasured_server():
    runs = _measured("vllm", {}).head(2)
    pred = predict_runs(runs, calibration=False, bench=BENCH)
    assert pred["calibration_match"].to_list() == ["off", "off"] and pred["measured_server"][0] == "{}"
    assert np.isfinite(pred["pred_ttft_ms"].to_numpy()).all()
    trt = predict_runs(runs.with_columns(pl.lit("trtllm").alias("framework")).head(1), calibration=False, bench=BENCH)
    assert trt["measured_server"][0] == json.dumps(UNMEASURED_SERVER["trtllm"]) != "{}"  # TRT-LLM chunks


def test_another_models_entry_lends_its_terms_but_not_its_server(tmp_path):
    """The fits choose a measured server per model, so a setup replayed on an entry of
    another model (here the pooled one) gets the framework's unmeasured server, while the
    entry's own model, at any TP, keeps the entry's."""
    server = {"enable_chunked_prefill": True, "max_num_batched_tokens": 2048}
    assert server != UNMEASURED_SERVER["trtllm"]
    entry = {"gpu": GPU, "framework": "trtllm", "gemm_dtype": "bf16", "tp": [1], "overhead_s": 2e-3, "scale": 1.0,
             "prefill_scale": 1.2, "decode_scale": 0.9, "measured_server": server, "fit": "replay"}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"format": "servetune-calibration/1",
                                "entries": [entry | {"model": MODEL}, entry | {"model": "*"}]}))
    runs = _measured("trtllm", {}).head(1)
    own = predict_runs(runs.with_columns(pl.lit(2).alias("tp")), calibration=path, bench=BENCH)
    assert own["calibration_match"][0] == "model" and own["measured_server"][0] == json.dumps(server)
    other = predict_runs(runs.with_columns(pl.lit("Qwen/Qwen3-8B").alias("model")), calibration=path, bench=BENCH)
    assert other["calibration_match"][0] == "pooled"
    assert other["measured_server"][0] == json.dumps(UNMEASURED_SERVER["trtllm"])
    cost = build("Qwen/Qwen3-8B", GPU, tp=1, framework="trtllm", calibration=path)
    assert cost.tables.decode_scale == pytest.approx(0.9) and cost.calibration["measured_server"] is None


def test_the_residual_scale_is_the_soft_l1_scale_of_the_fit(monkeypatch):
    import types

    import scipy.optimize

    from optimizer.fidelity.replayfit import PREFILL_STEP_START_MS, RESIDUAL_SCALE

    scales, starts = [], []

    def least_squares(fun, x0, **kw):
        scales.append(kw["f_scale"])
        starts.append(list(x0))
        assert kw["loss"] == "soft_l1" and len(kw["bounds"][0]) == len(x0) == len(kw["x_scale"])
        return types.SimpleNamespace(x=np.array([3.0, 1.3, 0.85, 40.0, 0.7][:len(x0)]), cost=0.0)

    monkeypatch.setattr(scipy.optimize, "least_squares", least_squares)
    runs = _measured("trtllm", {}).head(1)
    fit_replay(runs, bench=BENCH, candidates=({},))
    fit = fit_replay(runs, bench=BENCH, candidates=({},), residual_scale=0.02, comm_scale=True)
    assert scales == [RESIDUAL_SCALE, 0.02]
    assert fit["overhead_s"] == pytest.approx(3e-3) and fit["decode_scale"] == pytest.approx(0.85)
    assert len(starts[0]) == 4 and starts[0][3] == PREFILL_STEP_START_MS  # the prompt-step time starts off zero
    assert len(starts[1]) == 5 and starts[1][4] == 1.0  # asked for, the communication starts at its tables' time
    assert fit["prefill_step_s"] == pytest.approx(0.04) and fit["comm_scale"] == pytest.approx(0.7)


def test_only_trtllm_fits_a_prompt_step_time_and_when_asked_a_communication_scale(monkeypatch):
    """vLLM replays piecewise CUDA graphs for mixed batches and runs its collectives
    unfused: its fit has three terms and its entries no prompt-step time and the tables'
    communication (``replayfit.PREFILL_STEP_FRAMEWORKS``, ``COMM_SCALE_FRAMEWORKS``)."""
    import types

    import scipy.optimize

    from optimizer.fidelity.replayfit import COMM_SCALE_FRAMEWORKS, PREFILL_STEP_FRAMEWORKS

    sizes = []

    def least_squares(fun, x0, **kw):
        sizes.append(len(x0))
        assert np.isfinite(fun(np.asarray(x0), *kw["args"])).all()  # the residuals take a vector that long
        return types.SimpleNamespace(x=np.array([3.0, 1.3, 0.85, 40.0, 0.7][:len(x0)]), cost=0.0)

    monkeypatch.setattr(scipy.optimize, "least_squares", least_squares)
    assert PREFILL_STEP_FRAMEWORKS == COMM_SCALE_FRAMEWORKS == {"trtllm"}
    vllm = fit_replay(_measured("vllm", {}).head(1), bench=BENCH, candidates=({},), comm_scale=True)
    trt = fit_replay(_measured("trtllm", {}).head(1), bench=BENCH, candidates=({},), comm_scale=True)
    plain = fit_replay(_measured("trtllm", {}).head(1), bench=BENCH, candidates=({},))
    assert sizes == [3, 5, 4] and plain["comm_scale"] == 1.0
    assert vllm["prefill_step_s"] == 0.0 and trt["prefill_step_s"] == pytest.approx(0.04)
    assert vllm["comm_scale"] == 1.0 and trt["comm_scale"] == pytest.approx(0.7)


def test_pinned_terms_are_the_limits_a_fit_ends_on_except_the_zero_time_floors():
    # order and units of the fit: overhead ms, prefill scale, decode scale, prompt-step ms
    assert pinned_terms([0.0, 1.0, 1.0, 0.0]) == []  # no fixed time at all is physics, not a limit
    assert pinned_terms([0.0, 0.2, 0.2]) == ["prefill_scale", "decode_scale"]
    assert pinned_terms([50.0, 10.0, 5.0, 500.0]) == ["overhead_s", "prefill_scale", "decode_scale", "prefill_step_s"]
    assert pinned_terms([49.0, 0.21, 4.99, 499.0]) == []  # near is not on: 1e-3 of the range
    assert pinned_terms([1.0, 1.0, 4.996]) == ["decode_scale"]


def test_a_fit_the_runs_push_past_a_limit_says_so_in_the_entry_and_the_cost_model(tmp_path):
    truth = {**TRUTH, "decode_scale": 8.0}  # decode 8x the tables: beyond the fit's 5x
    runs = _measured("vllm", {}, truth=truth)
    entries = calibrate_replay(runs, bench=BENCH)
    mine = entries[0]
    assert mine["decode_scale"] == pytest.approx(5.0)
    assert mine["pinned_terms"] == ["decode_scale"]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"format": "servetune-calibration/1", "entries": entries}))
    cost = build(MODEL, GPU, tp=1, framework="vllm", calibration=path)
    assert cost.calibration["pinned_terms"] == ["decode_scale"]
    assert "decode_scale held at the fit's range limit" in cost.source
    pred = predict_runs(runs, calibration=path, bench=BENCH)
    assert set(pred["calibration_pinned"].to_list()) == {"decode_scale"}
    report = format_report(pred)
    assert f"{MODEL} vllm/bf16 (setup entry): decode_scale  ({runs.height} runs)" in report
    assert "limit of their range" not in format_report(predict_runs(runs, calibration=False, bench=BENCH))


def test_a_trtllm_fit_recovers_how_far_its_collectives_run_from_their_tables():
    """TP1 runs carry no communication and TP2 runs do, so the fit tells the collectives'
    scale from the decode scale."""
    truth = {**TRUTH, "comm_scale": 0.5}
    fit = fit_replay(_measured("trtllm", {"enable_chunked_prefill": True}, tps=(1, 2), truth=truth), bench=BENCH,
                     candidates=({"enable_chunked_prefill": True},), comm_scale=True)
    assert fit["comm_scale"] == pytest.approx(0.5, abs=0.08)
    assert fit["decode_scale"] == pytest.approx(TRUTH["decode_scale"], rel=0.05)
    assert fit["tpot_mape_after"] < 1.5 and fit["pinned_terms"] == []


def test_an_attention_dp_run_is_replayed_on_all_of_its_ranks():
    from optimizer.fidelity.replayfit import run_clients

    # aiconfigurator's batch_size is per attention-DP group: the run's clients are 8 x 16
    assert run_clients({"batch_size": 16, "attention_dp_size": 8}) == (128, 8)
    assert run_clients({"batch_size": 16, "attention_dp_size": 1}) == (16, 1)
    assert run_clients({"batch_size": 5}) == (5, 1)
