import json

import numpy as np
import polars as pl
import pytest

from costmodels import (
    CostModelError,
    build,
    calibrate,
    load_calibration,
    load_runs,
    save_calibration,
)
from tests.costmodels.conftest import SILICON


@pytest.fixture(scope="module")
def entries():
    if not SILICON.is_file():
        pytest.skip(f"measured runs not found at {SILICON} (set SERVETUNE_SHARED)")
    return calibrate(load_runs(SILICON))


def test_decode_tpot_mape_within_10_percent_after_calibration(entries):
    for e in entries:
        if e["model"] == "*":
            continue
        print(f"{e['model']} {e['framework']}/{e['gemm_dtype']} tp{e['tp']} runs={e['n_runs']}: TPOT MAPE "
              f"{e['tpot_mape_before']:.1f}% -> {e['tpot_mape_after']:.1f}%")
        assert e["tpot_mape_after"] <= 10.0
        assert e["tpot_mape_after"] <= e["tpot_mape_before"] + 1e-9


def test_calibration_file_round_trip_and_build_applies_it(entries, tmp_path):
    path = tmp_path / "calib.json"
    save_calibration(entries, path)
    assert load_calibration(path) == json.loads(path.read_text())["entries"]
    cost = build("Qwen/Qwen3-32B", "h100", tp=4, framework="vllm", calibration=path)
    entry = next(e for e in entries if e["model"] == "Qwen/Qwen3-32B" and e["framework"] == "vllm")
    assert cost.tables.overhead_s == entry["overhead_s"] and cost.tables.scale == entry["scale"]
    assert "calibrated:calib.json" in cost.source


def test_bundled_calibration_matches_a_fresh_fit(entries):
    # the bundled file is what build applies; a formula fit in it must match a fresh one (a
    # replay fit, ``optimizer.fidelity.replayfit.calibrate_replay``, is checked by benchmarks/fidelity.py)
    from costmodels.calibration import BUNDLED

    cost = build("meta-llama/Llama-3.1-8B", "h100", framework="trtllm")
    bundled = next(e for e in load_calibration(BUNDLED)
                   if e["model"] == "meta-llama/Llama-3.1-8B" and e["framework"] == "trtllm")
    assert cost.tables.scale == pytest.approx(bundled["scale"], rel=1e-12)
    assert cost.tables.prefill_scale == pytest.approx(bundled.get("prefill_scale", 1.0), rel=1e-12)
    assert cost.tables.decode_scale == pytest.approx(bundled.get("decode_scale", 1.0), rel=1e-12)
    if bundled.get("fit", "formula") == "formula":
        entry = next(e for e in entries if e["model"] == "meta-llama/Llama-3.1-8B")
        assert cost.tables.scale == pytest.approx(entry["scale"], rel=1e-6)
    assert "calibrated:default" in cost.source
    assert "uncalibrated" in build("meta-llama/Llama-3.1-8B", "h100", framework="sglang").source


def test_calibration_without_matching_entry_is_an_error(entries, tmp_path):
    path = tmp_path / "calib.json"
    save_calibration([e for e in entries if e["framework"] == "vllm"], path)
    with pytest.raises(CostModelError, match="no entry"):
        build("meta-llama/Llama-3.1-8B", "a100", framework="trtllm", calibration=path)  # no trtllm fit anywhere


def write(tmp_path, df):
    path = tmp_path / "runs.csv"
    df.write_csv(path)
    return path


GOOD = {"model": ["meta-llama/Llama-3.1-8B"] * 3, "gpu": ["h100"] * 3, "framework": ["vllm"] * 3,
        "tp": [1, 1, 1], "batch_size": [8, 32, 64], "isl": [1024] * 3, "osl": [256] * 3,
        "ttft_ms": [50.0, 80.0, 120.0], "tpot_ms": [8.0, 10.0, 12.0]}


def test_canonical_runs_csv_is_accepted_and_fit(tmp_path):
    [per_model, pooled] = calibrate(load_runs(write(tmp_path, pl.DataFrame(GOOD))))
    assert per_model["model"] == "meta-llama/Llama-3.1-8B" and pooled["model"] == "*"
    assert per_model["tpot_mape_after"] < 5.0 and np.isfinite(per_model["ttft_mape_after"])


@pytest.mark.parametrize("change, message", [
    (lambda d: d.drop("tpot_ms"), "missing column 'tpot_ms'"),
    (lambda d: d.with_columns(pl.Series("isl", [1024, -5, 1024])), r"row 3, column 'isl'"),
    (lambda d: d.with_columns(pl.Series("model", ["llama-9", "x", "y"])), "unknown models"),
    (lambda d: d.with_columns(pl.Series("client", ["aiperf", "guidellm", "aiperf"])),
     r"row 3, column 'client': 'guidellm' is not one of aiperf, inferencex"),
    (lambda d: d.with_columns(pl.Series("mtp_acceptance", ["0.6", "", "1.5"])),
     r"row 4, column 'mtp_acceptance': '1.5' is not a number in \(0, 1\]"),
])
def test_bad_runs_csv_names_the_problem(tmp_path, change, message):
    with pytest.raises(CostModelError, match=message):
        load_runs(write(tmp_path, change(pl.DataFrame(GOOD))))


def test_each_run_names_the_client_that_measured_it(tmp_path):
    """aiconfigurator's file has no client column: its InferenceX rows (a database dump or
    a dated export) are named by their source tag, the rest were run by its AIPerf script;
    a file's own ``client`` column wins."""
    sources = ["db-dump/2026-04-27; config_id=83; silicon_concurrency=64; workflow_run_id=101",
               "source_file=2026-04-06.csv; model=DeepSeek-R1; silicon_concurrency=16; wip=False",
               "source_file=/data/h100_sxm/trtllm/1.0.0rc3/Qwen_Qwen3-235B-A22B-FP8.csv; silicon_concurrency=4"]
    tagged = pl.DataFrame(GOOD).with_columns(pl.Series("silicon_data_source", sources))
    assert load_runs(write(tmp_path, tagged))["client"].to_list() == ["inferencex", "inferencex", "aiperf"]
    assert load_runs(write(tmp_path, pl.DataFrame(GOOD)))["client"].to_list() == ["aiperf"] * 3
    own = tagged.with_columns(pl.Series("client", ["AIPerf", "aiperf", "inferencex"]))
    assert load_runs(write(tmp_path, own))["client"].to_list() == ["aiperf", "aiperf", "inferencex"]


def test_bundled_entries_are_one_per_key_with_their_out_of_sample_error():
    from costmodels.calibration import BUNDLED, entry_key

    bundled = load_calibration(BUNDLED)
    keys = [entry_key(e) for e in bundled]
    assert len(keys) == len(set(keys))
    assert all(e["error"]["out_of_sample"]["runs"] > 0 for e in bundled)
    v3 = dict(gemm_dtype="fp8", kv_dtype="fp8", framework="trtllm")
    tp8 = build("deepseek-ai/DeepSeek-V3", "h200", tp=8, **v3)
    assert (tp8.calibration["match"], tp8.calibration["model"]) == ("setup", "deepseek-ai/DeepSeek-V3")
    ep8 = build("deepseek-ai/DeepSeek-V3", "h200", tp=8, moe_ep_size=8, **v3)  # V3 never measured with EP
    assert (ep8.calibration["match"], ep8.calibration["model"]) == ("family", "deepseek-ai/DeepSeek-R1")
    r1 = build("deepseek-ai/DeepSeek-R1", "h200", tp=8, **v3)  # its TP8 rows are V3's, filed again: scored once
    assert (r1.calibration["match"], r1.calibration["model"]) == ("family", "deepseek-ai/DeepSeek-V3")


def test_a_run_may_record_its_mtp_acceptance(tmp_path):
    """Blank where the run did not speculate; a bad value marks only its row."""
    runs = pl.DataFrame(GOOD).with_columns(pl.Series("mtp_acceptance", ["0.6", "", "nan"]))
    marked = load_runs(write(tmp_path, runs), bad_rows="mark")
    assert marked["mtp_acceptance"].to_list() == [0.6, None, None]
    assert marked["error"].to_list() == [None, None, "row 4: column 'mtp_acceptance': 'nan' is not a number in (0, 1]"]
    assert "mtp_acceptance" not in load_runs(write(tmp_path, pl.DataFrame(GOOD))).columns
