"""Fleet figures in the report: failures (affected, re-prefill, goodput during and after) and replicas."""

import dataclasses
import json
import math

import numpy as np
import pytest

from studies.metrics import score
from studies.slo import parse_slo
from tests.studies.test_metrics import F, R, make_result, make_trace

NAN = math.nan
SLO = parse_slo("ttft:1000")


def fleet_run(windows=((1, 10.0, 20.0),), **changes):
    """Six requests arriving 0..5 s over two replicas; the run window is 0..30 s.

    0 finishes at 5 (good), 1 at 12 inside the window (good), 2 at 15 inside but with a 5 s
    TTFT (not good), 3 at 25 and 4 at 30 after the window (good), 5 rejected.
    """
    trace = make_trace([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    result = make_result([F, F, F, F, F, R], first=[0.5, 1.5, 7.0, 3.5, 4.5, NAN],
                         finish=[5.0, 12.0, 15.0, 25.0, 30.0, 5.0], generated=[10, 10, 10, 10, 10, 0])
    rows = np.array(windows, dtype=float).reshape(-1, 3)
    fleet = dict(
        replica=np.array([0, 0, 1, 1, 0, -1], np.int32),
        reroutes=np.array([0, 1, 1, 0, 0, 0], np.int32),
        reprefill_tokens=np.array([0, 300, 500, 0, 0, 0], np.int64),
        failure_replica=rows[:, 0].astype(np.int32), failure_down_s=rows[:, 1], failure_up_s=rows[:, 2],
        replica_routed=np.array([4, 4]), replica_prefix_hit_tokens=np.array([100, 0]),
        replica_prefix_query_tokens=np.array([400, 0]), replica_kv_peak_blocks=np.array([50, 80]),
        replica_kv_capacity_blocks=np.array([100, 100]),
    )
    return trace, dataclasses.replace(result, **{**fleet, **changes})


def test_failure_figures_count_affected_requests_reprefill_and_goodput_around_the_window():
    trace, result = fleet_run()
    report = score(result, trace, SLO)
    assert report.duration_s == 30.0 and report.n_good == 4
    assert (report.failure_windows, report.failure_affected, report.reprefill_tokens) == (1, 2, 800)
    assert report.goodput_during_failures == pytest.approx(1 / 10)  # request 1 in [10, 20)
    assert report.goodput_after_failures == pytest.approx(2 / 10)  # requests 3 and 4 in [20, 30]


def test_overlapping_windows_count_their_union_and_an_open_window_has_no_after():
    trace, result = fleet_run(windows=((0, 8.0, 14.0), (1, 11.0, 16.0)))
    report = score(result, trace, SLO)
    assert report.goodput_during_failures == pytest.approx(1 / 8)  # union [8, 16): request 1
    assert report.goodput_after_failures == pytest.approx(2 / 14)  # [16, 30]: requests 3 and 4
    trace, result = fleet_run(windows=((1, 10.0, math.inf),))
    report = score(result, trace, SLO)
    assert report.goodput_during_failures == pytest.approx(3 / 20)  # [10, 30]: requests 1, 3, 4
    assert math.isnan(report.goodput_after_failures)
    trace, result = fleet_run(windows=((1, 40.0, 50.0),))  # after the run: an empty window
    assert score(result, trace, SLO).goodput_during_failures == 0.0


def test_per_replica_entries():
    trace, result = fleet_run()
    per_replica = score(result, trace, SLO).per_replica
    assert list(per_replica) == ["0", "1"]
    assert per_replica["0"] == {"routed": 4, "finished": 3, "prefix_hit_rate": 0.25, "kv_peak_blocks": 50,
                                "kv_peak_fraction": 0.5}
    assert per_replica["1"]["finished"] == 2 and math.isnan(per_replica["1"]["prefix_hit_rate"])


def test_a_single_replica_run_has_no_fleet_figures():
    trace, result = fleet_run()
    single = make_result([F] * 6, first=[0.5] * 6, finish=[5.0] * 6, generated=[10] * 6)
    report = score(single, trace, SLO)
    assert (report.failure_windows, report.failure_affected, report.reprefill_tokens) == (0, 0, 0)
    assert math.isnan(report.goodput_during_failures) and math.isnan(report.goodput_after_failures)
    assert report.per_replica == {}
    assert not [row for row in report.summary_rows() if row[0] in ("failures", "replicas")]


def test_fleet_rows_in_the_summary_and_strict_json():
    trace, result = fleet_run()
    report = score(result, trace, SLO)
    rows = {(section, label): value for section, label, value in report.summary_rows()}
    assert rows[("failures", "windows / requests affected / re-prefill tokens")] == "1 / 2 / 800"
    assert rows[("failures", "goodput during / after failures (req/s)")] == "0.100 / 0.200"
    assert rows[("replicas", "replica 1: routed / finished / prefix hit / KV peak")] == "4 / 2 / n/a / 80.0%"
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["per_replica"]["1"]["prefix_hit_rate"] is None


@pytest.mark.parametrize("change, message", [
    ({"reroutes": np.zeros(3, np.int32)}, "reroutes has 3 entries; give one per request"),
    ({"failure_up_s": np.zeros(0)}, "must have equal lengths"),
    ({"replica_kv_peak_blocks": np.array([1])}, "must have equal lengths"),
    ({"replica": np.array([0, 0, 2, 1, 0, -1], np.int32)}, "names replica 2 but per-replica fields cover 2"),
])
def test_inconsistent_fleet_fields_are_named(change, message):
    trace, result = fleet_run(**change)
    with pytest.raises(ValueError, match=message):
        score(result, trace, SLO)
