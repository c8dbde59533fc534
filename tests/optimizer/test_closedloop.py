"""The closed-loop driver: the benchmark client as it drives a server (AIPerf concurrency mode)."""

from dataclasses import replace

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from costmodels import build
from costmodels.costmodel import CostModel
from costmodels.runs import CLIENT_NAMES
from costmodels.steptable import linear_tables
from optimizer.cli import app
from optimizer.fidelity.closedloop import (
    CLIENT_VARIANTS,
    LOCKSTEP,
    TRTLLM_DEFAULT,
    BenchClient,
    ClosedLoopError,
    benchmark_means,
    client_for,
    framework_config,
    run_benchmark,
)
from optimizer.fidelity.replayfit import (
    SEQS_BELOW_CLIENTS,
    SERVER_CANDIDATES,
    for_clients,
    run_server,
    server_config,
)
from policies.config import PolicyConfig

# Step = 2 ms + 0.1 ms per token: a prefill of P tokens takes 2 + 0.1 P ms, a decode step of S sequences 2 + 0.1 S.
LINEAR = CostModel.synthetic(1_000_000, tables=linear_tables(per_token_s=1e-4, per_seq_s=0.0, per_kv_token_s=0.0,
                                                              per_pair_s=0.0, overhead_s=2e-3))
CONFIG = PolicyConfig(gpu_memory_utilization=1.0)
LLAMA_TRT = build("meta-llama/Llama-3.1-8B", "h100", framework="trtllm")


def waves(loop, clients):
    return loop.sent_s.reshape(-1, clients)


def test_startup_burst_then_one_send_per_finish():
    loop = run_benchmark(LINEAR, CONFIG, 4, 100, 10, BenchClient(requests_per_client=3, warmup_per_client=2))
    assert np.all(loop.sent_s[:4] == 0.0)  # every client starts at once
    assert sorted(loop.client[:4]) == [0, 1, 2, 3]
    for k in range(4):  # a client's next send is its previous request's finish, within a phase
        mine = np.flatnonzero(loop.client == k)
        same_phase = loop.profiled[mine[1:]] == loop.profiled[mine[:-1]]
        np.testing.assert_array_equal(loop.sent_s[mine[1:]][same_phase], loop.finish_s[mine[:-1]][same_phase])


def test_profiled_phase_opens_with_a_burst_after_every_warmup_response():
    bench = BenchClient(requests_per_client=4, warmup_per_client=2, osl_stddev=3.0)
    loop = run_benchmark(LINEAR, CONFIG, 8, 100, 20, bench)
    warm, prof = ~loop.profiled, loop.profiled
    assert warm.sum() == 16 and prof.sum() == 32  # warm-up 2C, profiled 4C
    last_warm = loop.finish_s[warm].max()
    assert loop.sent_s[prof].min() == last_warm  # awaited: nothing profiled is sent before the last warm-up ends
    assert np.sum(loop.sent_s[prof] == last_warm) == 8  # ... and then all C clients send at once
    # the mean is over the profiled requests only
    assert loop.mean_ttft_ms == pytest.approx(loop.ttft_ms[prof].mean())
    assert loop.mean_ttft_ms != pytest.approx(loop.ttft_ms.mean())


def test_without_awaiting_warmup_the_loop_is_continuous():
    loop = run_benchmark(LINEAR, CONFIG, 4, 100, 10, BenchClient(requests_per_client=2, warmup_per_client=1,
                                                                   await_warmup=False))
    assert np.all(loop.sent_s[:4] == 0.0) and not np.any(loop.sent_s[4:] == 0.0)
    assert np.isin(loop.sent_s[4:], loop.finish_s[:8]).all()  # profiled requests follow warm-up ones at once


def test_concurrency_is_held_at_c_until_clients_run_out_of_credits():
    bench = BenchClient(requests_per_client=6, warmup_per_client=0, osl_stddev=4.0, isl_stddev=20.0)
    loop = run_benchmark(LINEAR, CONFIG, 6, 200, 30, bench)
    last_credit = loop.sent_s.max()  # the last request sent: from then on clients stop
    for t in np.linspace(1e-6, last_credit - 1e-6, 200):
        assert loop.in_flight(t) == 6
    assert loop.in_flight(loop.finish_s.max() - 1e-9) == 1  # the tail drains


def test_identical_lengths_stay_in_lockstep_and_drawn_lengths_drift_apart():
    same = run_benchmark(LINEAR, CONFIG, 4, 100, 20, BenchClient(requests_per_client=5, warmup_per_client=0))
    w = waves(same, 4)
    assert np.all(w == w[:, :1])  # every wave's four sends coincide
    drawn = run_benchmark(LINEAR, CONFIG, 4, 100, 20, BenchClient(requests_per_client=5, warmup_per_client=0,
                                                                    osl_stddev=5.0))
    spread = np.ptp(np.sort(drawn.sent_s)[-4:])
    assert len(np.unique(drawn.sent_s[4:])) > 12 and spread > 0  # clients send at their own times
    assert drawn.trace.output_tokens.std() > 0 and same.trace.output_tokens.std() == 0


def test_deterministic_for_a_seed():
    bench = BenchClient(osl_stddev=8.0, isl_stddev=30.0, seed=7)
    a = run_benchmark(LINEAR, CONFIG, 5, 300, 40, bench)
    b = run_benchmark(LINEAR, CONFIG, 5, 300, 40, bench)
    np.testing.assert_array_equal(a.sent_s, b.sent_s)
    np.testing.assert_array_equal(a.finish_s, b.finish_s)
    c = run_benchmark(LINEAR, CONFIG, 5, 300, 40, BenchClient(osl_stddev=8.0, isl_stddev=30.0, seed=8))
    assert not np.array_equal(a.trace.output_tokens, c.trace.output_tokens)
    lo, hi = BenchClient(range_ratio=0.5).lengths(1000, 100, 10)
    assert lo.min() >= 50 and lo.max() <= 150 and hi.min() >= 5 and hi.max() <= 15


def test_floor_style_lengths_stay_at_or_below_the_asked_length():
    """sglang.bench_serving and InferenceX draw in [r L, L], so their mean length is
    (1 + r) L / 2: a 1024-token row at r = 0.8 sends 922-token prompts on average."""
    prompt, output = BenchClient(range_ratio=0.8, range_style="floor").lengths(20_000, 1024, 8192)
    assert prompt.min() == 819 and prompt.max() == 1024 and output.min() == 6553 and output.max() == 8192
    assert prompt.mean() == pytest.approx(921.5, rel=0.005) and output.mean() == pytest.approx(7372.5, rel=0.005)
    centred, _ = BenchClient(range_ratio=0.8).lengths(20_000, 1024, 8192)
    assert centred.max() > 1800 and centred.mean() == pytest.approx(1024, rel=0.01)
    with pytest.raises(ClosedLoopError, match="range_style"):
        BenchClient(range_ratio=0.8, range_style="below")


def test_warmup_requests_can_resend_the_first_prompt():
    bench = BenchClient(range_ratio=0.8, range_style="floor", warmup_repeats_first=True)
    prompt, output = bench.lengths(30, 1000, 100, n_warm=10)
    assert set(prompt[:10]) == {prompt[10]} and set(output[:10]) == {output[10]}
    assert len(set(prompt[10:])) > 5  # the profiled requests keep their own draws
    drawn, _ = replace(bench, warmup_repeats_first=False).lengths(30, 1000, 100, n_warm=10)
    np.testing.assert_array_equal(drawn[10:], prompt[10:])
    assert len(set(drawn[:10])) > 1


def test_every_client_the_loader_accepts_has_a_replay_variant():
    """The loader's client names (costmodels) and the replay's variants (optimizer) are two
    lists across a layer boundary: a name in one only would be a KeyError mid-replay."""
    assert set(CLIENT_VARIANTS) == set(CLIENT_NAMES)


def test_an_inferencex_run_is_replayed_with_its_own_client():
    """client_for: InferenceX's benchmark_serving keeps AIPerf's counts and the caller's
    ingress delay but draws lengths in [0.8 L, L]; drawn lengths let the clients drift
    apart, so their prompts stop arriving in one wave and the mean TTFT falls."""
    aiperf = BenchClient(ingress_s=0.004)
    ix = client_for("inferencex", aiperf)
    assert (ix.range_ratio, ix.range_style, ix.warmup_repeats_first, ix.ingress_s) == (0.8, "floor", True, 0.004)
    assert ix.counts(16) == aiperf.counts(16) and client_for(None, aiperf) == aiperf == client_for("aiperf", aiperf)
    # AIPerf's length stddevs are AIPerf's: InferenceX's own draw replaces them
    assert client_for("inferencex", BenchClient(isl_stddev=30.0)).isl_stddev == 0.0
    same = run_benchmark(LINEAR, CONFIG, 16, 1000, 100, aiperf)
    drawn = run_benchmark(LINEAR, CONFIG, 16, 1000, 100, ix)
    profiled = drawn.trace.prompt_tokens[drawn.profiled]
    assert 800 <= profiled.min() and profiled.max() <= 1000
    assert len(np.unique(drawn.sent_s[drawn.profiled])) > len(np.unique(same.sent_s[same.profiled]))
    assert drawn.mean_ttft_ms < 0.8 * same.mean_ttft_ms


def test_lockstep_matches_the_hand_computed_loop():
    # Two clients start together: one 200-token prefill step (22 ms), then 9 decode steps of
    # 2 sequences (2.2 ms). Nothing breaks the symmetry, so every wave repeats it.
    loop = run_benchmark(LINEAR, CONFIG, 2, 100, 10, LOCKSTEP)
    e2e = 0.022 + 9 * 0.0022
    np.testing.assert_allclose(loop.sent_s.reshape(-1, 2), [[0, 0], [e2e, e2e], [2 * e2e] * 2, [3 * e2e] * 2],
                               rtol=1e-12)
    assert loop.mean_ttft_ms == pytest.approx(22.0)
    assert loop.mean_tpot_ms == pytest.approx(2.2)
    # a server-side ingress delay is in TTFT (and delays the engine), not in TPOT
    late = run_benchmark(LINEAR, CONFIG, 2, 100, 10, BenchClient(requests_per_client=3, warmup_per_client=1,
                                                                   await_warmup=False, ingress_s=0.005))
    assert late.mean_ttft_ms == pytest.approx(27.0) and late.mean_tpot_ms == pytest.approx(2.2)


def test_ramp_spreads_the_start():
    loop = run_benchmark(LINEAR, CONFIG, 4, 100, 10, BenchClient(requests_per_client=2, warmup_per_client=0,
                                                                   ramp_s=0.04))
    np.testing.assert_allclose(np.sort(loop.sent_s[:4]), [0.0, 0.01, 0.02, 0.03])


@pytest.mark.parametrize("framework, clients, isl, osl", [("trtllm", 16, 2048, 64), ("vllm", 32, 1024, 96),
                                                          ("sglang", 24, 3000, 50)])
def test_the_finish_horizon_changes_nothing(framework, clients, isl, osl):
    # the driver lets the engine run (fast-forward included) up to a horizon no finish can
    # precede; stepping one engine step at a time must give the same run bit for bit
    cost = build("meta-llama/Llama-3.1-8B", "h100", framework=framework)
    from optimizer.search.targets import context_of

    config = framework_config(framework, context_of(cost, "h100", context_len=0))
    bench = BenchClient(requests_per_client=3, osl_stddev=osl / 10, isl_stddev=isl / 20)
    fast = run_benchmark(cost, config, clients, isl, osl, bench)
    exact = run_benchmark(cost, config, clients, isl, osl, bench, exact_steps=True)
    np.testing.assert_array_equal(fast.finish_s, exact.finish_s)
    np.testing.assert_array_equal(fast.first_token_s, exact.first_token_s)
    assert benchmark_means(cost, config, clients, isl, osl, bench) == pytest.approx((fast.mean_ttft_ms, fast.mean_tpot_ms),
                                                                                   rel=1e-12)


#: silicon_dense_h100.csv: Llama-3.1-8B on TRT-LLM 1.0, one H100, 8 clients: (isl, osl,
#: measured mean TTFT ms, measured mean TPOT ms)
MEASURED_C8_TP1 = [(1024, 128, 190.95, 7.944), (1024, 256, 318.02, 7.549), (1024, 512, 550.01, 7.417),
                   (2048, 128, 264.94, 9.324), (2048, 256, 205.15, 8.386), (2048, 512, 691.66, 8.166),
                   (4096, 128, 441.07, 12.404), (4096, 256, 605.28, 10.249), (4096, 512, 856.91, 9.647)]


def test_reproduces_measured_h100_runs_as_well_as_the_calibration_states():
    """The bundled calibration's entry states its in-sample error; replayed as validate
    replays them (AIPerf's harness, the entry's measured-server settings), these runs
    are within it: TPOT within 10% on average, TTFT no worse than the stated error."""
    from optimizer.cli.validate import measured_server
    from optimizer.fidelity.closedloop import server_max_seq_len
    from optimizer.fidelity.replayfit import server_config
    from optimizer.search.targets import context_of

    assert LLAMA_TRT.calibration["match"] == "setup"
    server = measured_server(LLAMA_TRT, "trtllm")
    config = for_clients(server_config("trtllm", context_of(LLAMA_TRT, "h100", context_len=0), server), server, 8)
    seq = server_max_seq_len("trtllm", "meta-llama/Llama-3.1-8B")
    ttft_err, tpot_err = [], []
    for isl, osl, ttft, tpot in MEASURED_C8_TP1:
        loop = run_benchmark(LLAMA_TRT, config, 8, isl, osl, max_seq_len=seq)
        ttft_err.append(abs(loop.mean_ttft_ms / ttft - 1))
        tpot_err.append(abs(loop.mean_tpot_ms / tpot - 1))
    assert np.mean(tpot_err) <= 0.10
    stated = LLAMA_TRT.calibration["error"]["in_sample_ttft_mape"] / 100
    assert np.mean(ttft_err) <= 1.25 * stated


def test_bad_sizes_and_requests_that_never_fit_are_errors():
    with pytest.raises(ClosedLoopError, match="clients"):
        run_benchmark(LINEAR, CONFIG, 0, 100, 10)
    with pytest.raises(ClosedLoopError, match="no profiled request"):
        run_benchmark(LINEAR, CONFIG, 2, 100, 10, BenchClient(requests_per_client=0.1))
    with pytest.raises(ClosedLoopError, match="finite number"):
        BenchClient(gap_s=-1.0)
    with pytest.raises(ClosedLoopError, match="either"):
        BenchClient(range_ratio=0.1, osl_stddev=2.0)
    tiny = CostModel.synthetic(64, tables=LINEAR.tables)
    with pytest.raises(ClosedLoopError, match="did not finish"):
        run_benchmark(tiny, CONFIG, 2, 100, 10)
    with pytest.raises(ClosedLoopError, match="unknown framework"):
        framework_config("tgi", None)


def _runs_csv(path, rows):
    cols = ["model", "gpu", "framework", "tp", "batch_size", "isl", "osl", "ttft_ms", "tpot_ms"]
    pl.DataFrame(rows, schema=cols, orient="row").write_csv(path)
    return path


def test_validate_command_prints_mape_and_writes_predictions(tmp_path):
    runs = _runs_csv(tmp_path / "runs.csv", [("meta-llama/Llama-3.1-8B", "h100", "trtllm", 1, 8, 1024, 128, 190.95, 7.94),
                                             ("meta-llama/Llama-3.1-8B", "h100", "trtllm", 2, 8, 1024, 128, 140.0, 5.0)])
    out = CliRunner().invoke(app, ["validate", str(runs), "-o", str(tmp_path / "pred.csv"),
                                   "--plot", str(tmp_path / "scatter.png"), "--requests-per-client", "5"])
    assert out.exit_code == 0, out.output
    assert "all/all" in out.output and "worst TTFT rows" in out.output
    pred = pl.read_csv(tmp_path / "pred.csv")
    # what validate predicts is the closed loop of the row's setup, as the benchmark drove it
    from optimizer.cli.validate import measured_server
    from optimizer.fidelity.closedloop import server_max_seq_len
    from optimizer.fidelity.replayfit import server_config
    from optimizer.search.targets import context_of

    server = measured_server(LLAMA_TRT, "trtllm")
    config = for_clients(server_config("trtllm", context_of(LLAMA_TRT, "h100", context_len=0), server), server, 8)
    loop = run_benchmark(LLAMA_TRT, config, 8, 1024, 128, BenchClient(requests_per_client=5),
                         max_seq_len=server_max_seq_len("trtllm", "meta-llama/Llama-3.1-8B"))
    assert (pred["pred_ttft_ms"][0], pred["pred_tpot_ms"][0]) == pytest.approx((loop.mean_ttft_ms, loop.mean_tpot_ms),
                                                                               rel=1e-9)
    assert pred["pred_tpot_ms"][0] == pytest.approx(7.94, rel=0.2)  # the right scale: measured 7.94 ms
    assert (tmp_path / "scatter.png").stat().st_size > 0


def test_validate_command_names_bad_rows_and_unknown_models(tmp_path):
    bad = _runs_csv(tmp_path / "bad.csv", [("meta-llama/Llama-3.1-8B", "h100", "trtllm", 1, 8, 1024, -5, 1.0, 1.0)])
    out = CliRunner().invoke(app, ["validate", str(bad)])
    assert out.exit_code == 2 and "row 2" in out.output and "osl" in out.output
    unknown = _runs_csv(tmp_path / "unknown.csv", [("acme/Mystery-7B", "h100", "trtllm", 1, 8, 1024, 128, 1.0, 1.0)])
    out = CliRunner().invoke(app, ["validate", str(unknown)])
    assert out.exit_code == 2 and "acme/Mystery-7B" in out.output


def test_a_server_one_request_short_of_the_clients_keeps_one_client_waiting():
    """SEQS_BELOW_CLIENTS: the server runs C - 1 of the C clients' requests, so each request
    waits about one completion interval, (OSL - 1) x TPOT / (C - 1), and light-load TTFT
    grows with the output length (the Llama-3.1-8B TRT-LLM rows), where a server with room
    for every client gives the same TTFT at any output length."""
    below = {"enable_chunked_prefill": True, SEQS_BELOW_CLIENTS: 1}
    assert server_config("trtllm", None, below) == TRTLLM_DEFAULT.replace(enable_chunked_prefill=True)
    assert for_clients(CONFIG, {}, 8) is CONFIG
    assert for_clients(CONFIG, below, 8).max_num_seqs == 7
    bench = BenchClient(requests_per_client=12, warmup_per_client=2, osl_stddev=5.0)
    clients = 4

    def run(server, osl):
        loop = run_benchmark(LINEAR, for_clients(CONFIG, server, clients), clients, 100, osl, bench)
        started = loop.sent_s + loop.result.queue_s
        for t in np.concatenate([started, loop.finish_s - 1e-9]):
            assert np.sum((started <= t) & (loop.finish_s > t)) <= clients - (1 if server else 0)
        return loop

    short, long_ = run(below, 50), run(below, 400)
    wait = (long_.mean_tpot_ms * 399 - short.mean_tpot_ms * 49) / (clients - 1)  # one completion interval more
    assert long_.mean_ttft_ms - short.mean_ttft_ms == pytest.approx(wait, rel=0.3)
    roomy = run({}, 50), run({}, 400)
    assert abs(roomy[1].mean_ttft_ms - roomy[0].mean_ttft_ms) < 0.1 * wait


def test_a_server_that_caps_each_prompt_per_step_shares_the_step_among_waiting_prompts():
    """The TRT-LLM candidate with long_prefill_token_threshold 1024: prompts that wait
    together progress together (at most the cap each per step) instead of one after the
    other, so mean TTFT at a burst rises for long prompts; a lone prompt (the engine's rule:
    nobody to starve) and prompts within the cap replay as without it."""
    capped = {"enable_chunked_prefill": True, "max_num_batched_tokens": 4096, "long_prefill_token_threshold": 1024}
    assert capped in SERVER_CANDIDATES["trtllm"]
    free = dict(capped, long_prefill_token_threshold=0)
    bench = BenchClient(requests_per_client=1, warmup_per_client=0)

    def run(server, isl, clients):
        return run_benchmark(LINEAR, server_config("trtllm", None, server), clients, isl, 8, bench)

    assert run(capped, 4096, 1).mean_ttft_ms == pytest.approx(run(free, 4096, 1).mean_ttft_ms)
    shared, serial = run(capped, 4096, 4), run(free, 4096, 4)
    spread = lambda loop: np.ptp(loop.first_token_s)  # noqa: E731
    assert spread(shared) < 0.5 * spread(serial)  # the burst's prompts finish together
    assert shared.mean_ttft_ms > serial.mean_ttft_ms
    assert run(capped, 1000, 4).mean_ttft_ms == pytest.approx(run(free, 1000, 4).mean_ttft_ms)


# -- an attention-DP instance: ranks stepping together ---------------------------------------------------
def test_ranks_with_like_loads_run_as_one_rank_of_their_share():
    # fixed lengths and clients spread evenly: every rank holds a like batch at every step,
    # so the group's step (the slowest rank's, its token-linear ops at the ranks' mean) is
    # one rank's, and 4 ranks of 8 clients replay as one rank of 2
    bench = BenchClient(requests_per_client=3)
    one = run_benchmark(LINEAR, CONFIG, 2, 300, 40, bench)
    four = run_benchmark(LINEAR, CONFIG, 8, 300, 40, bench, ranks=4)
    assert four.mean_ttft_ms == pytest.approx(one.mean_ttft_ms, rel=1e-9)
    assert four.mean_tpot_ms == pytest.approx(one.mean_tpot_ms, rel=1e-9)
    assert four.result.steps == 4 * one.result.steps  # every rank steps each time
    assert set(four.client % 4) == {0, 1, 2, 3}


def test_uneven_ranks_wait_for_the_slowest():
    # drawn lengths put unlike batches on the ranks: a rank's step lasts its slowest peer's,
    # so the same clients over 2 ranks see a longer TPOT than 2 ranks' worth alone would
    bench = BenchClient(requests_per_client=4, isl_stddev=200, osl_stddev=15)
    together = run_benchmark(LINEAR, CONFIG, 8, 600, 40, bench, ranks=2)
    alone = run_benchmark(LINEAR, CONFIG, 4, 600, 40, bench)
    assert together.mean_tpot_ms > alone.mean_tpot_ms


@pytest.mark.parametrize("framework", ["trtllm", "vllm"])
def test_the_finish_horizon_changes_nothing_for_ranks_stepping_together(framework):
    cost = build("Qwen/Qwen3-30B-A3B", "h100", tp=4, framework=framework, moe_ep_size=4, attention_dp_size=4)
    from optimizer.search.targets import context_of

    config = framework_config(framework, context_of(cost, "h100", context_len=0))
    bench = BenchClient(requests_per_client=2, osl_stddev=8, isl_stddev=100)
    fast = run_benchmark(cost, config, 16, 1500, 60, bench, ranks=4)
    exact = run_benchmark(cost, config, 16, 1500, 60, bench, ranks=4, exact_steps=True)
    np.testing.assert_array_equal(fast.finish_s, exact.finish_s)
    assert benchmark_means(cost, config, 16, 1500, 60, bench, ranks=4) == pytest.approx(
        (fast.mean_ttft_ms, fast.mean_tpot_ms), rel=1e-12)


def test_a_vllm_run_is_replayed_with_the_loop_its_version_ran():
    """vLLM turned async scheduling on by default in v0.14.0 (its release notes, vllm#27614):
    the 90 measured vLLM 0.12.0 runs ran the synchronous loop; an unversioned run is the
    pinned engine's, as is a TRT-LLM or SGLang run of any version."""
    from optimizer.search.targets import context_of
    from policies.engines.vllm import async_by_default

    assert [async_by_default(v) for v in ("0.12.0", "0.13.0", "0.14.0rc1", "0.14.0", "0.33.0", None)] == \
        [False, False, True, True, True, True]
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        async_by_default("nightly")
    ctx = context_of(build("meta-llama/Llama-3.1-8B", "h100", framework="vllm"), "h100", context_len=0)
    assert not framework_config("vllm", ctx, "0.12.0").async_scheduling
    assert framework_config("vllm", ctx, "0.12.0") == framework_config("vllm", ctx).replace(async_scheduling=False)
    assert framework_config("vllm", ctx, "0.33.0") == framework_config("vllm", ctx)
    assert framework_config("vllm", ctx).async_scheduling
    row = {"framework": "vllm", "framework_version": "0.12.0", "batch_size": 8, "client": "aiperf"}
    config, _ = run_server("vllm", ctx, {"max_num_batched_tokens": 4096}, row)
    assert not config.async_scheduling and config.max_num_batched_tokens == 4096
    assert run_server("vllm", ctx, None, {**row, "framework_version": None})[0].async_scheduling


def test_the_runs_file_names_the_framework_version(tmp_path):
    from costmodels.runs import load_runs

    header = "model,gpu,framework,tp,batch_size,isl,osl,ttft_ms,tpot_ms"
    row = "meta-llama/Llama-3.1-8B,h100_sxm,vllm,1,8,1024,128,100,10"
    (tmp_path / "with.csv").write_text(f"{header},backend_version\n{row},0.12.0\n")
    (tmp_path / "without.csv").write_text(f"{header}\n{row}\n")
    assert load_runs(tmp_path / "with.csv")["framework_version"].to_list() == ["0.12.0"]
    assert load_runs(tmp_path / "without.csv")["framework_version"].to_list() == [None]
