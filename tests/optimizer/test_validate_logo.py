"""Leave-one-group-out fidelity (benchmarks/fidelity.py): a group's fit never sees its rows."""

import importlib.util
from pathlib import Path

import polars as pl
import pytest

from optimizer.closedloop import BenchClient

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
    assert keys[(LLAMA, "h100_sxm", "trtllm", "bf16", 1)] == ("h100_sxm", "trtllm", LLAMA, "bf16")  # its other TP
    assert keys[(QWEN, "h100_sxm", "trtllm", "bf16", 2)] == ("h100_sxm", "trtllm", "*", "bf16")  # pooled
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
    assert "TTFT in" in text and "LOGO" in text
    assert all(r["ttft_logo"] == pytest.approx(r["ttft_logo"]) for r in table.iter_rows(named=True))
