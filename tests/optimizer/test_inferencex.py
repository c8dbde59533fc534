"""InferenceX's scripts as known servers: each run replays on the server its script set."""

import json

import polars as pl
import pytest

from costmodels import build, save_calibration
from costmodels.costmodel import CostModel
from costmodels.steptable import linear_tables
from optimizer.cli.validate import format_report, predict_runs
from optimizer.fidelity.closedloop import BenchClient, benchmark_means, client_for, run_benchmark
from optimizer.fidelity.inferencex import MTP_ACCEPTANCE, MTP_DRAFT_FRACTION, known_server
from optimizer.fidelity.replayfit import (
    SEQS_BELOW_CLIENTS,
    calibrate_replay,
    fit_replay,
    run_server,
)
from optimizer.search.targets import context_of
from policies.config import PolicyConfig
from policies.speculative import AcceptanceModel

V3, R1, LLAMA = "deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-R1", "meta-llama/Llama-3.1-70B"


def _row(model=V3, gpu="h200_sxm", clients=4, isl=8192, ep=1, dp=1, client="inferencex", dtype="fp8", **kw):
    return {"model": model, "gpu": gpu, "framework": "trtllm", "client": client, "gemm_dtype": dtype,
            "batch_size": clients, "isl": isl, "osl": 1024, "tp": 8, "moe_ep_size": ep, "attention_dp_size": dp,
            **kw}


def test_the_deepseek_tp_script_sizes_the_step_for_the_burst_and_does_not_chunk():
    # dsr1_fp8_h200_trt_slurm.sh: ceil((C + ISL + 64) / 64) * 64 = ceil(8260 / 64) * 64
    server = known_server(_row(clients=4, isl=8192))
    assert server.script == "dsr1_fp8_h200_trt_slurm.sh" and server.acceptance is None
    assert server.overrides == {"enable_chunked_prefill": False, "max_num_batched_tokens": 8320}
    assert known_server(_row(clients=64, isl=1024)).overrides["max_num_batched_tokens"] == 1152  # 1152 exactly


def test_the_deepseek_mtp_script_runs_three_drafts_without_attention_dp_and_one_with_it():
    ep = known_server(_row(model=R1, clients=16, isl=1024, ep=8))  # (3 + 1) x 16 + 1024 + 64 = 1152
    assert ep.script == "dsr1_fp8_h200_trt_mtp.sh"
    assert ep.overrides == {"enable_chunked_prefill": False, "max_num_seqs": 16, "max_num_batched_tokens": 1152,
                            "speculative_mode": "fixed", "num_speculative_tokens": 3,
                            "speculative_draft_cost_mode": "fraction", "speculative_draft_cost": MTP_DRAFT_FRACTION}
    assert list(ep.acceptance.default) == [MTP_ACCEPTANCE] * 3
    dp = known_server(_row(model=R1, clients=8, isl=1024, ep=8, dp=8))  # 2 x 8 + 1088 = 1104 -> 1152
    assert dp.overrides["num_speculative_tokens"] == 1 and dp.overrides["max_num_seqs"] == 8
    assert dp.overrides["max_num_batched_tokens"] == 1152 and list(dp.acceptance.default) == [MTP_ACCEPTANCE]
    # attention_dp_config: enable_balance, timeout_iters 60, batching_wait_iters 0
    assert (dp.overrides["dp_balance_timeout_iters"], dp.overrides["dp_balance_batching_iters"]) == (60, 0)
    assert "dp_balance_timeout_iters" not in ep.overrides
    # a run that measured its acceptance replays with it
    assert list(known_server(_row(model=R1, ep=8, mtp_acceptance=0.5)).acceptance.default) == [0.5] * 3


def test_the_llama_b200_script_has_a_fixed_budget_and_other_runs_have_no_known_server():
    assert known_server(_row(model=LLAMA, gpu="b200_sxm", clients=128)).overrides == {
        "enable_chunked_prefill": False, "max_num_batched_tokens": 16384}
    # its 1k/1k runs below TP 8 hold new prompts while the batch fills
    assert known_server(_row(model=LLAMA, gpu="b200_sxm", isl=1024, tp=4)).overrides == {
        "enable_chunked_prefill": False, "max_num_batched_tokens": 16384, "batch_wait_iters": 20,
        "batch_wait_token_ratio": 0.9}
    assert "batch_wait_iters" not in known_server(_row(model=LLAMA, gpu="b200_sxm", isl=1024, tp=8)).overrides
    assert "batch_wait_iters" not in known_server(_row(model=LLAMA, gpu="b200_sxm", isl=1024, osl=8192,
                                                       tp=4)).overrides
    assert known_server(_row(model=LLAMA, gpu="b200_sxm", dtype="nvfp4")) is None  # another script
    assert known_server(_row(client="aiperf")) is None  # aiconfigurator's servers are fitted
    assert known_server(_row(model="Qwen/Qwen3-235B-A22B-FP8", gpu="h100_sxm")) is None
    assert known_server(_row(framework="vllm")) is None
    assert known_server(_row(tp=64, ep=8)) is None  # the scripts serve DeepSeek on one node of 8 GPUs


def test_a_known_server_replaces_the_fitted_one_and_an_unknown_run_keeps_it():
    cost = build("meta-llama/Llama-3.1-8B", "h100", framework="trtllm", calibration=False)
    ctx = context_of(cost, "h100", context_len=0)
    fitted = {"enable_chunked_prefill": True, "max_num_batched_tokens": 4096, SEQS_BELOW_CLIENTS: 1}
    config, acceptance = run_server("trtllm", ctx, fitted, _row(model=LLAMA, gpu="b200_sxm", clients=8))
    assert (config.enable_chunked_prefill, config.max_num_batched_tokens, config.max_num_seqs) == (False, 16384, 2048)
    assert acceptance is None
    config, _ = run_server("trtllm", ctx, fitted, _row(client="aiperf", clients=8))
    assert (config.enable_chunked_prefill, config.max_num_batched_tokens, config.max_num_seqs) == (True, 4096, 7)


# Step = 2 ms + 0.1 ms per token
LINEAR = CostModel.synthetic(1_000_000, tables=linear_tables(per_token_s=1e-4, per_seq_s=0.0, per_kv_token_s=0.0,
                                                              per_pair_s=0.0, overhead_s=2e-3))
SPEC = PolicyConfig(gpu_memory_utilization=1.0, speculative_mode="fixed", num_speculative_tokens=3,
                    speculative_draft_cost_mode="mtp", speculative_draft_cost=0.0)


def test_a_speculating_closed_loop_gains_up_to_one_plus_k_tokens_a_step_and_skips_no_finish():
    bench = BenchClient(requests_per_client=2, warmup_per_client=1)
    plain = benchmark_means(LINEAR, PolicyConfig(gpu_memory_utilization=1.0), 4, 100, 41, bench)[1]
    every = benchmark_means(LINEAR, SPEC, 4, 100, 41, bench, acceptance=AcceptanceModel(default=(1.0,) * 3))[1]
    never = benchmark_means(LINEAR, SPEC, 4, 100, 41, bench, acceptance=AcceptanceModel(default=(0.0,) * 3))[1]
    # all accepted: 40 tokens after the first in 10 steps of 4 verify tokens per request (2 + 1.6 ms)
    assert every == pytest.approx(3.6 / 4, rel=1e-6)
    assert plain == pytest.approx(2.4, rel=1e-6)
    # none accepted: one token a step, each verifying as many drafts as tokens remain (3.6 ms; 3.2, 2.8, 2.4 last)
    assert never == pytest.approx((37 * 3.6 + 3.2 + 2.8 + 2.4) / 40, rel=1e-6)
    # the finish horizon counts a step's 1 + k tokens: running step by step changes nothing
    half = AcceptanceModel(default=(0.5,) * 3)
    fast = run_benchmark(LINEAR, SPEC, 4, 100, 41, bench, acceptance=half)
    exact = run_benchmark(LINEAR, SPEC, 4, 100, 41, bench, acceptance=half, exact_steps=True)
    assert (fast.finish_s == exact.finish_s).all() and (fast.first_token_s == exact.first_token_s).all()


def test_runs_on_known_servers_are_fitted_on_them_and_validated_with_them(tmp_path):
    truth = {"overhead_s": 4e-3, "prefill_scale": 1.2, "decode_scale": 0.9, "prefill_step_s": 0.0}
    cost = build(LLAMA, "b200_sxm", tp=4, framework="trtllm", gemm_dtype="fp8", kv_dtype="fp8", calibration=False)
    true = cost.__class__(**{**cost.__dict__, "tables": cost.tables._replace(scale=1.0, **truth)})
    ctx = context_of(true, "b200_sxm", context_len=0, tp=4)
    rows = []
    for clients, isl, osl in [(4, 1024, 256), (16, 8192, 128), (32, 1024, 512), (8, 4096, 256)]:
        row = _row(model=LLAMA, gpu="b200_sxm", clients=clients, isl=isl, osl=osl, tp=4)
        config, _ = run_server("trtllm", ctx, None, row)
        ttft, tpot = benchmark_means(true, config, clients, isl, osl, client_for("inferencex", BenchClient()))
        rows.append({**row, "ttft_ms": ttft, "tpot_ms": tpot})
    runs = pl.DataFrame(rows)
    fit = fit_replay(runs)
    assert fit["measured_server"] == {}  # every run's server is known: none is chosen
    assert fit["decode_scale"] == pytest.approx(truth["decode_scale"], rel=0.05)
    assert fit["tpot_mape_after"] < 1.0 and fit["ttft_mape_after"] < 3.0
    path = tmp_path / "cal.json"
    save_calibration(calibrate_replay(runs), path)
    pred = predict_runs(runs, calibration=path)
    assert json.loads(pred["measured_server"][0]) == {"script": "70b_fp8_b200_trt_slurm.sh",
                                                       "enable_chunked_prefill": False,
                                                       "max_num_batched_tokens": 16384}
    assert (((pred["pred_tpot_ms"] / pred["tpot_ms"]) - 1).abs() < 0.02).all()
    # the report names the script once, its per-run settings being in the predictions
    assert "setup   script 70b_fp8_b200_trt_slurm.sh  (4 runs)" in format_report(pred)


def test_the_mtp_acceptance_matches_the_blogs_speedup_on_these_tables():
    # TensorRT-LLM's MTP blog: 2.16x at batch 1 with 3 MTP layers; the step ratio is the tables'
    from costmodels.steptable import step_seconds

    ratios = []
    for ep in (1, 8):
        tables = build(R1, "h200_sxm", tp=8, framework="trtllm", gemm_dtype="fp8", kv_dtype="fp8",
                       calibration=False, moe_ep_size=ep).tables
        decode = step_seconds(tables, 1, 1, 1, 1000, 0)[0]
        ratios.append((step_seconds(tables, 4, 4, 1, 1003, 0)[0] + 3 * MTP_DRAFT_FRACTION * decode) / decode)
    c = MTP_ACCEPTANCE
    assert 1 + c + c**2 + c**3 == pytest.approx(2.16 * sum(ratios) / 2, rel=0.03)
