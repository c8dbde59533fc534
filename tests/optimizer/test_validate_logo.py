"""Leave-one-group-out fidelity (benchmarks/fidelity.py): a group's fit never sees its rows."""

import importlib.util
from pathlib import Path

import polars as pl
import pytest

from optimizer.fidelity.closedloop import BenchClient

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fidelity_bench", ROOT / "benchmarks" / "fidelity.py")
fidelity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fidelity)

LLAMA, QWEN = "meta-llama/Llama-3.1-8B", "Qwen/Qwen3-32B"
COLS = ["model", "gpu", "framework", "gemm_dtype", "tp", "batch_size", "isl", "osl", "ttft_ms", "tpot_ms"]
RUNS = pl.DataFrame([
    (LLAMA, "h100_sxm", "trtllm", "bf16", 1, 8, 1024, 32, 150.0, 7.5),
    (LLAMA, "h100_sxm", "trtllm", "bf16", 1, 16, 1024, 32, 140.0, 9.0),
    (LLAMA, "h100_sxm", "trtllm", "bf16", 2, 8, 1024, 32, 120.0, 5.0),
    (LLAMA, "h100_sxm", "trtllm", "bf16", 2, 16, 2048, 32, 130.0, 6.5),
    (QWEN, "h100_sxm", "trtllm", "bf16", 2, 8, 1024, 32, 300.0, 18.0),
    (QWEN, "h100_sxm", "vllm", "bf16", 2, 8, 1024, 32, 150.0, 18.0),
], schema=COLS, orient="row").with_row_index("row")


def test_every_group_is_held_out_once_and_never_trained_on():
    seen = []
    for _, held, train in fidelity.logo_splits(RUNS):
        assert set(held["row"].to_list()).isdisjoint(train["row"].to_list())
        assert sorted(held["row"].to_list() + train["row"].to_list()) == RUNS["row"].to_list()
        assert held.select(fidelity.LOGO_KEYS).unique().height == 1
        seen += held["row"].to_list()
    assert sorted(seen) == RUNS["row"].to_list()


def test_the_fold_falls_back_as_apply_calibration_would():
    keys = {tuple(k): fidelity.fallback_key(held, train) for k, held, train in fidelity.logo_splits(RUNS)}
    assert keys[(LLAMA, "h100_sxm", "trtllm", "bf16", 1)] == ("h100_sxm", "trtllm", LLAMA, "bf16", "tp")  # its other TP
    assert keys[(QWEN, "h100_sxm", "trtllm", "bf16", 2)] == ("h100_sxm", "trtllm", "*", "bf16", "tp")  # pooled
    assert keys[(QWEN, "h100_sxm", "vllm", "bf16", 2)] is None  # nothing of its framework: uncalibrated


def test_a_groups_fit_never_sees_its_rows():
    calls = []

    def fitter(train, keys=None):
        calls.append((set(train["row"].to_list()), keys))
        return []

    fidelity.recording_fitter = fitter  # the pool pickles fitters by name
    insample, logo, entries = fidelity.evaluate(RUNS, fidelity.recording_fitter, BenchClient(requests_per_client=2))
    n_slices = RUNS.select("gpu", "framework", "gemm_dtype").unique().height
    assert len(calls) == n_slices + 4  # the in-sample fit, one slice per (gpu, framework, dtype); one per group
    folds = calls[n_slices:]
    for (_, held, train), (trained, keys) in zip(fidelity.logo_splits(RUNS), folds, strict=True):
        assert trained.isdisjoint(held["row"].to_list())
        fallback = fidelity.fallback_key(held, train)
        assert keys == (None if fallback is None else [fallback])  # only the entry the held-out setup falls back to
    assert set().union(*(t for t, _ in calls[:n_slices])) == set(RUNS["row"].to_list())
    assert logo["row"].to_list() == RUNS["row"].to_list() and insample.height == RUNS.height
    assert set(logo["calibration_match"].to_list()) == {"off"}  # the fitter gave no entry


def test_logo_scores_with_the_fold_entry_and_reports_both_figures():
    insample, logo, entries = fidelity.evaluate(RUNS, fidelity.formula_fitter, BenchClient(requests_per_client=2))
    table = fidelity.group_table(insample, logo)
    assert table["model"].to_list()[-1] == "all" and table.height == 5
    match = dict(zip(logo["row"].to_list(), logo["calibration_match"].to_list(), strict=True))
    assert match[0] == "model" and match[4] == "pooled" and match[5] == "off"
    assert set(insample["calibration_match"].to_list()) == {"setup"}
    text = fidelity.format_groups(table)
    assert "TTFT in" in text and "LOGO" in text and "bias" in text
    ok = logo.filter(pl.col("error").is_null())  # the signed bias: median replayed / measured, less 1
    assert table["tpot_bias_logo"][-1] == pytest.approx(((ok["pred_tpot_ms"] / ok["tpot_ms"]).median() - 1) * 100)
    assert all(r["ttft_logo"] == pytest.approx(r["ttft_logo"]) for r in table.iter_rows(named=True))


def test_breadth_rows_servetune_cannot_score_are_kept_with_their_reason(tmp_path):
    cols = ["model_path", "system", "backend", "tp_size", "attention_dp_size", "moe_tp_size", "moe_ep_size",
            "gemm_quant_mode", "batch_size", "isl", "osl", "silicon_ttft_ms", "silicon_tpot_ms"]
    r1 = "deepseek-ai/DeepSeek-R1"
    path = tmp_path / "breadth.csv"
    pl.DataFrame([
        (r1, "h200_sxm", "trtllm", 8, 1, 1, 8, "fp8", 2, 128, 8, 150.0, 20.0),  # scorable
        (r1, "h200_sxm", "trtllm", 64, 1, 8, 8, "fp8", 2, 128, 8, 150.0, 20.0),  # 64 GPUs
        ("meta-llama/Llama-3.1-70B", "b200_sxm", "trtllm", 2, 1, 2, 1, "nvfp4", 2, 128, 8, 50.0, 9.0),  # scorable
        ("meta-llama/Llama-3.1-70B", "h200_sxm", "trtllm", 2, 1, 2, 1, "nvfp4", 2, 128, 8, 50.0, 9.0),  # no FP4
        (r1, "h200_sxm", "trtllm", 4, 2, 2, 2, "fp8", 2, 128, 8, 150.0, 20.0),  # GPU counts disagree
    ], schema=cols, orient="row").write_csv(path)
    scored, skipped = fidelity.split_scorable(fidelity.load_runs(path, bad_rows="mark").with_row_index("row"))
    assert scored["row"].to_list() == [0, 2] and "error" not in scored.columns
    reasons = dict(zip(skipped["row"].to_list(), skipped["reason"].to_list(), strict=True))
    assert sorted(reasons) == [1, 3, 4]
    assert reasons[1].startswith("no cost model: ") and "tp=64" in reasons[1]
    assert "h200_sxm has no nvfp4 tensor cores" in reasons[3]
    assert reasons[4] == "row 6: layout: moe_tp_size 2 x moe_ep_size 2 = 4 GPUs, but tp_size 4 x attention_dp_size 2 = 8"


def test_a_run_filed_again_under_another_model_name_is_scored_once(tmp_path):
    cols = ["model_path", "system", "backend", "tp_size", "attention_dp_size", "moe_tp_size", "moe_ep_size",
            "gemm_quant_mode", "batch_size", "isl", "osl", "silicon_ttft_ms", "silicon_tpot_ms"]
    v3, r1 = "deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-R1"
    path = tmp_path / "breadth.csv"
    pl.DataFrame([
        (v3, "h200_sxm", "trtllm", 8, 1, 8, 1, "fp8", 2, 128, 8, 150.0, 20.0),
        (r1, "h200_sxm", "trtllm", 8, 1, 8, 1, "fp8", 2, 128, 8, 150.0, 20.0),  # row 0 again
        (r1, "h200_sxm", "trtllm", 8, 1, 8, 1, "fp8", 2, 128, 8, 151.0, 20.0),  # another run of the point
        (r1, "h200_sxm", "trtllm", 8, 1, 1, 8, "fp8", 2, 128, 8, 150.0, 20.0),  # another layout
    ], schema=cols, orient="row").write_csv(path)
    scored, skipped = fidelity.split_scorable(fidelity.load_runs(path, bad_rows="mark").with_row_index("row"))
    assert scored["row"].to_list() == [0, 2, 3]
    assert skipped["row"].to_list() == [1]
    assert skipped["reason"][0] == f"{v3}'s run again, number for number: scored once, as {v3}'s"


def test_install_replaces_entries_in_place_drops_the_runs_stale_ones_and_keeps_the_rest(tmp_path, monkeypatch):
    from costmodels import load_calibration, save_calibration

    base = {"gpu": "h100_sxm", "framework": "trtllm", "gemm_dtype": "fp8", "overhead_s": 0.001, "scale": 1.0,
            "error": {}}
    dense, old_ep = {**base, "model": "*"}, {**base, "model": "*", "path": "ep", "overhead_s": 0.002}
    stale = {**base, "model": "deepseek-ai/DeepSeek-R1", "gpu": "h200_sxm"}  # the new fit makes no such entry
    other = {**stale, "model": "Qwen/Qwen3-32B", "gpu": "h100_sxm"}  # a model these runs do not name
    monkeypatch.setattr(fidelity, "BUNDLED", tmp_path / "calibration.json")
    save_calibration([dense, old_ep, stale, other], fidelity.BUNDLED)
    new_ep = {**old_ep, "overhead_s": 0.003}
    added = {**base, "model": "*", "path": "ep+dp"}
    fidelity.install([new_ep, added], {"deepseek-ai/DeepSeek-R1", "deepseek-ai/DeepSeek-V3"})
    # a replaced entry keeps its place (match_entry takes the first of equal candidates); new keys go last
    assert load_calibration(fidelity.BUNDLED) == [dense, new_ep, other, added]


def test_a_setup_whose_light_load_ttft_moves_with_output_length_is_flagged():
    # same ISL and concurrency, OSL 128 then 512: A's measured TTFT doubles, B's holds;
    # the replay holds both (no queue at this load), so only A is flagged
    rows = []
    for model, ttft_long in (("A", 200.0), ("B", 105.0)):
        for c in (4, 8):
            rows += [(model, c, 128, 100.0, 100.0), (model, c, 512, ttft_long, 101.0)]
        rows.append((model, 64, 128, 900.0, 300.0))  # past LIGHT_LOAD: not a point
    pred = pl.DataFrame(rows, schema=["model", "batch_size", "osl", "ttft_ms", "pred_ttft_ms"], orient="row")
    pred = pred.with_columns(isl=pl.lit(1024), error=pl.lit(None, pl.Utf8))
    logo = pred.with_columns(pl.when(pl.col("model") == "A").then(pl.col("ttft_ms") * 1.5)
                             .otherwise(pl.col("ttft_ms") * 1.1).alias("pred_ttft_ms"))
    table, split = fidelity.osl_sensitivity(pred, logo, ["model"])
    by = {r["model"]: r for r in table.iter_rows(named=True)}
    assert by["A"]["points"] == 2 and by["A"]["measured"] == pytest.approx(2.0) and by["A"]["flagged"]
    assert by["B"]["measured"] == pytest.approx(1.05) and not by["B"]["flagged"]
    assert by["A"]["replayed"] == pytest.approx(1.01)
    assert split["flagged"] == {"runs": 5, "logo_ttft_mape": pytest.approx(50.0)}
    assert split["not_flagged"] == {"runs": 5, "logo_ttft_mape": pytest.approx(10.0)}
    text = "\n".join(fidelity.format_osl(table, split, ["model"]))
    assert "A: 2 points, measured x2.00, replayed x1.01  FLAGGED" in text and "B: 2 points" in text


def test_a_client_or_fit_variant_is_fitted_replayed_and_named_in_the_command(monkeypatch):
    import argparse

    from costmodels.moeops import DEFAULT_DISTRIBUTION
    from optimizer.fidelity.replayfit import RESIDUAL_SCALE, TTFT_WEIGHT

    defaults = dict(ttft_weight=TTFT_WEIGHT, residual_scale=RESIDUAL_SCALE, moe_distribution=DEFAULT_DISTRIBUTION,
                    mtp_acceptance=None, comm_scale=False)
    args = argparse.Namespace(quick=False, client_ingress_ms=150.0, client_jitter_ms=0.0, **defaults)
    bench = fidelity.bench_client(args)
    assert bench.ingress_s == pytest.approx(0.15) and bench.jitter_s == 0.0
    assert fidelity.command_line(args, "breadth") == "python benchmarks/fidelity.py --part breadth --client-ingress-ms 150"
    plain = argparse.Namespace(quick=True, client_ingress_ms=0.0, client_jitter_ms=0.0, **defaults)
    assert fidelity.command_line(plain, "dense") == "python benchmarks/fidelity.py --quick"
    assert fidelity.bench_client(plain) == BenchClient()
    mtp = argparse.Namespace(**{**vars(plain), "quick": False, "mtp_acceptance": 0.5})  # the breadth MTP runs only
    assert fidelity.command_line(mtp, "breadth") == "python benchmarks/fidelity.py --part breadth --mtp-acceptance 0.5"
    assert fidelity.command_line(mtp, "dense") == "python benchmarks/fidelity.py"
    fit = argparse.Namespace(quick=False, client_ingress_ms=0.0, client_jitter_ms=0.0, ttft_weight=TTFT_WEIGHT,
                             residual_scale=0.02, moe_distribution="balanced", mtp_acceptance=None, comm_scale=True)
    assert fidelity.command_line(fit, "dense") == ("python benchmarks/fidelity.py --residual-scale 0.02 "
                                                   "--moe-distribution balanced --comm-scale")
    seen = []
    monkeypatch.setattr(fidelity, "calibrate_replay", lambda train, **kw: seen.append(kw) or [])
    fidelity.replay_fitter(RUNS, bench=bench, **fidelity.fit_options(fit))
    builder = seen[0].pop("builder")
    assert seen == [{"keys": None, "bench": bench, "ttft_weight": TTFT_WEIGHT, "residual_scale": 0.02,
                     "comm_scale": True}]
    assert builder.keywords == {"moe_distribution": "balanced"}  # the fit times MoE at the asked skew
