"""The cost model's error per calibration tier, and cost models moved by it."""

from __future__ import annotations

import dataclasses

import pytest

from costmodels.calibration import MIN_TIER_RUNS
from costmodels.costmodel import CostModel
from costmodels.steptable import linear_tables, step_seconds
from optimizer.robust.modelerror import UNCALIBRATED, model_error, scaled


def _model(calibration, source="profiled:aiconfigurator/h100_sxm/vllm-0.24.0"):
    tables = linear_tables(per_token_s=1e-4, per_seq_s=1e-5, per_kv_token_s=0.0, per_pair_s=0.0, overhead_s=1e-3)
    return dataclasses.replace(CostModel.synthetic(100_000, tables=tables), calibration=calibration, source=source)


def _entry(match, error, tiers=None):
    return {"file": "default", "match": match, "error": error,
            "tier_errors": {"method": "held out", "tiers": tiers} if tiers else {}}


def _tier(ttft, tpot, runs=MIN_TIER_RUNS):
    return {"ttft_mape": ttft, "tpot_mape": tpot, "runs": runs, "setups": 2}


def test_an_own_entry_brings_its_out_of_sample_error():
    e = model_error(_model(_entry("pooled", {"out_of_sample": {"ttft_mape": 16.4, "tpot_mape": 6.1}})))
    assert (e.ttft, e.tpot, e.tier, e.calibrated) == (pytest.approx(0.164), pytest.approx(0.061), "pooled", True)
    assert "out of sample" in e.stated


def test_a_lent_entry_takes_its_tiers_measured_error_over_its_own():
    # the pool's own figure is of the models it was fitted on; the tier's is of models held out
    tiers = {"pooled": _tier(30.0, 12.0)}
    e = model_error(_model(_entry("pooled", {"out_of_sample": {"ttft_mape": 16.4, "tpot_mape": 6.1}}, tiers)))
    assert (e.ttft, e.tpot, e.calibrated) == (pytest.approx(0.30), pytest.approx(0.12), True)
    assert "pooled tier" in e.stated and "held out" in e.stated


def test_the_same_models_entry_keeps_its_own_error_over_the_tiers():
    tiers = {"model": _tier(30.0, 12.0)}
    e = model_error(_model(_entry("model", {"out_of_sample": {"ttft_mape": 9.0, "tpot_mape": 3.0}}, tiers)))
    assert (e.ttft, e.tpot) == (pytest.approx(0.09), pytest.approx(0.03))


@pytest.mark.parametrize("tier", ["none", "other_gpu", "other_path"])
def test_an_uncalibrated_tier_reads_its_measured_error(tier):
    tiers = {tier: _tier(25.0, 40.0)}
    calibration = {"file": None, "match": "none", "tier_errors": {"tiers": tiers}} if tier == "none" else \
        _entry(tier, {"out_of_sample": {"ttft_mape": 5.0, "tpot_mape": 2.0}}, tiers)
    e = model_error(_model(calibration))
    assert (e.ttft, e.tpot, e.tier, e.calibrated) == (pytest.approx(0.25), pytest.approx(0.40), tier, False)
    assert "(uncalibrated)" in e.stated


def test_a_tier_measured_on_too_few_runs_is_not_read():
    tiers = {"other_gpu": _tier(1.0, 1.0, runs=MIN_TIER_RUNS - 1), "pooled": _tier(1.0, 1.0, runs=MIN_TIER_RUNS - 1)}
    lent = model_error(_model(_entry("other_gpu", {"out_of_sample": {"ttft_mape": 5.0, "tpot_mape": 2.0}}, tiers)))
    assert (lent.ttft, lent.tpot) == UNCALIBRATED
    pooled = model_error(_model(_entry("pooled", {"out_of_sample": {"ttft_mape": 16.0, "tpot_mape": 6.0}}, tiers)))
    assert (pooled.ttft, pooled.tpot) == (pytest.approx(0.16), pytest.approx(0.06))


def test_an_in_sample_only_entry_counts_double():
    e = model_error(_model(_entry("setup", {"in_sample_ttft_mape": 10.0, "in_sample_tpot_mape": 4.0})))
    assert (e.ttft, e.tpot) == (pytest.approx(0.2), pytest.approx(0.08))
    assert "in sample only" in e.stated
    bench_fit = model_error(_model(_entry("setup", {"in_sample": {"ttft_mape": 10.0, "tpot_mape": 4.0},
                                                    "leave_one_run_out": None})))
    assert (bench_fit.ttft, bench_fit.tpot) == (pytest.approx(0.2), pytest.approx(0.08))


@pytest.mark.parametrize("calibration", [None, {"file": None, "match": "none"},
                                         _entry("other_gpu", {"out_of_sample": {"ttft_mape": 5.0, "tpot_mape": 2.0}}),
                                         _entry("other_path", {"out_of_sample": {"ttft_mape": 5.0, "tpot_mape": 2.0}})])
def test_no_entry_of_this_setups_own_gives_the_wide_uncalibrated_error(calibration):
    e = model_error(_model(calibration))
    assert (e.ttft, e.tpot) == UNCALIBRATED and not e.calibrated
    assert e.stated.startswith("uncalibrated")


def test_roofline_step_times_are_uncalibrated_whatever_the_entry():
    e = model_error(_model(_entry("pooled", {"out_of_sample": {"ttft_mape": 5.0, "tpot_mape": 2.0}}),
                           source="roofline"))
    assert e.tier == "roofline" and not e.calibrated and (e.ttft, e.tpot) == UNCALIBRATED
    measured = model_error(_model(_entry("pooled", {}, {"roofline": _tier(60.0, 30.0)}), source="roofline"))
    assert (measured.ttft, measured.tpot) == (pytest.approx(0.6), pytest.approx(0.3))


def test_corners_span_the_error_box():
    e = model_error(_model(None))
    assert sorted(e.corners()) == sorted((1 + a * UNCALIBRATED[0], 1 + b * UNCALIBRATED[1])
                                         for a in (-1, 1) for b in (-1, 1))


def test_scaled_moves_prefill_and_decode_steps_by_their_own_factor():
    base = _model(None)
    slow_prefill, slow_decode = scaled(base, 1.5, 1.0), scaled(base, 1.0, 1.5)

    def step(model, n_tokens, n_decode):  # (new tokens, sampling seqs, decodes, KV read, prefill pairs)
        return step_seconds(model.tables, n_tokens, n_decode + 1, n_decode, 0, 0)[0]

    decode_only = (32, 32)
    assert step(slow_prefill, *decode_only) == pytest.approx(step(base, *decode_only))
    assert step(slow_decode, *decode_only) > step(base, *decode_only)
    mixed = (2048 + 32, 32)  # a 2048-token chunk beside 32 decodes
    added = step(slow_prefill, *mixed) - step(base, *mixed)
    assert added == pytest.approx(0.5 * (step(base, *mixed) - step(base, *decode_only)), rel=0.05)
