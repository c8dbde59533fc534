"""The Trace model: defaults, validation, row selection with CSR blocks, and statistics."""

import numpy as np
import pytest

from studies.traces import (
    CAP_NONE,
    NO_CAP,
    Trace,
    TraceError,
    csr_take,
    encode_names,
    load_trace,
    trace_stats,
)


def small() -> Trace:
    return Trace.from_columns(
        [0.0, 1.0, 2.5, 70.0], [600, 10, 1100, 5], [3, 0, 7, 1],
        block_offsets=[0, 2, 2, 5, 6], block_hashes=[1, 2, 1, 2, 9, 4],
    )


def test_from_columns_defaults():
    t = small()
    # no caps given: NO_CAP / CAP_NONE, never the true output length (which the scheduler must not see)
    assert t.max_tokens.tolist() == [NO_CAP] * 4 and t.max_tokens_source.tolist() == [CAP_NONE] * 4
    assert t.output_estimator == "cap" and t.output_estimate.tolist() == [NO_CAP] * 4
    assert t.tenant_names == ("default",) and t.tenant.dtype == np.int32
    assert np.isnan(t.deadline_s).all() and t.block_tokens == 512
    assert not t.arrival_s.flags.writeable


@pytest.mark.parametrize("column, value, message", [
    ("prompt_tokens", [0, 1], "row 0: column 'prompt_tokens' is 0"),
    ("output_tokens", [1, -1], "row 1: column 'output_tokens' is -1"),
    ("arrival_s", [0.0, np.nan], "row 1: column 'arrival_s'"),
    ("deadline_s", [np.nan, 0.5], "row 1: column 'deadline_s'"),
])
def test_validation_names_row_and_column(column, value, message):
    columns = {"arrival_s": [0.0, 1.0], "prompt_tokens": [1, 1], "output_tokens": [1, 1]}
    extra = {}
    if column in columns:
        columns[column] = value
    else:
        extra[column] = value
    with pytest.raises(TraceError, match=message):
        Trace.from_columns(columns["arrival_s"], columns["prompt_tokens"], columns["output_tokens"], **extra)


def test_unsorted_trace_is_rejected():
    with pytest.raises(TraceError, match="row 1: arrival_s goes backwards"):
        Trace.from_columns([1.0, 0.0], [1, 1], [1, 1])


def test_take_moves_blocks_with_their_requests():
    t = small().take([0, 2, 3])
    assert t.prompt_tokens.tolist() == [600, 1100, 5]
    assert t.block_offsets.tolist() == [0, 2, 5, 6]
    assert t.block_hashes.tolist() == [1, 2, 1, 2, 9, 4]
    assert small().take([1]).block_hashes.tolist() == []
    with pytest.raises(TraceError, match="backwards"):
        small().take([2, 0])


def test_csr_take_reorders():
    offsets, values = csr_take(np.array([0, 1, 3, 3]), np.array([7, 8, 9]), np.array([2, 1, 0, 1]))
    assert offsets.tolist() == [0, 0, 2, 3, 5] and values.tolist() == [8, 9, 7, 8, 9]


def test_encode_names_in_first_appearance_order():
    codes, names = encode_names(["b", "a", "b", "c"])
    assert names == ("b", "a", "c") and codes.tolist() == [0, 1, 0, 2]


def test_stats_by_hand():
    s = trace_stats(small())
    assert s["rows"] == 4 and s["span_s"] == 70.0
    assert s["mean_rate"] == pytest.approx(3 / 70)
    assert s["peak_minute_rate"] == pytest.approx(3 / 60)  # three arrivals in [0, 60)
    assert s["prompt_tokens"]["p50"] == np.percentile([600, 10, 1100, 5], 50)
    assert s["blocks"] == {"block_tokens": 512, "total": 6, "distinct": 4, "repeat_fraction": 2 / 6}
    assert s["tenants"] == {"default": 4}


def test_stats_of_mooncake_match_its_readme(mooncake_path):
    s = trace_stats(load_trace(mooncake_path, spread="raw"))
    assert s["rows"] == 12_031
    assert s["span_s"] == pytest.approx(3537, abs=0.5)
    assert round(s["mean_rate"], 2) == 3.40 and round(s["peak_minute_rate"], 2) == 4.12
    p, o = s["prompt_tokens"], s["output_tokens"]
    assert (round(p["mean"]), round(p["p50"]), round(p["p99"]), p["min"], p["max"]) == (12_035, 6_909, 85_400, 891, 126_195)
    assert (round(o["mean"]), round(o["p50"]), round(o["p99"]), o["min"], o["max"]) == (343, 350, 1_119, 1, 2_000)
    assert (s["blocks"]["total"], s["blocks"]["distinct"]) == (288_500, 182_790)
    assert round(s["blocks"]["repeat_fraction"], 3) == 0.366


def test_stats_of_azure_match_its_readme(azure_path):
    s = trace_stats(load_trace(azure_path))
    assert s["rows"] == 19_366
    assert s["span_s"] == pytest.approx(3501.7, abs=0.05)
    assert round(s["mean_rate"], 2) == 5.53 and round(s["peak_minute_rate"], 2) == 8.45
    p, o = s["prompt_tokens"], s["output_tokens"]
    assert (round(p["mean"]), round(p["p50"]), round(p["p99"]), p["min"], p["max"]) == (1_155, 1_020, 4_142, 2, 14_050)
    assert (round(o["mean"]), round(o["p50"]), round(o["p99"]), o["min"], o["max"]) == (211, 129, 601, 7, 1_000)
    assert s["blocks"]["total"] == 0
