"""Window, rate scaling, sampling, relabelling and concatenation as tenants."""

import numpy as np
import pytest

from studies import transforms as T
from studies.traces import Trace, TraceError, trace_stats


def trace() -> Trace:
    return Trace.from_columns(
        [0.0, 10.0, 20.0, 30.0, 40.0], [600, 10, 1100, 5, 7], [3, 0, 7, 1, 2],
        deadline_s=[5.0, np.nan, 26.0, np.nan, 41.0],
        block_offsets=[0, 2, 2, 5, 6, 7], block_hashes=[1, 2, 1, 2, 9, 4, 5], source="t",
    )


def test_window_keeps_rows_and_rebases_times():
    w = T.window(trace(), 10, 35)
    assert w.prompt_tokens.tolist() == [10, 1100, 5]
    assert w.arrival_s.tolist() == [0, 10, 20] and w.deadline_s[1] == 16
    assert w.block_hashes.tolist() == [1, 2, 9, 4] and w.meta["window_s"] == [10.0, 35.0]
    assert T.window(trace(), 10, 35, rebase=False).arrival_s[0] == 10
    with pytest.raises(TraceError, match=r"holds no requests; the trace spans \[0.000, 40.000\]"):
        T.window(trace(), 41, 50)
    with pytest.raises(TraceError, match="expected end_s > start_s"):
        T.window(trace(), 5, 5)


def test_scale_rate_compresses_time_and_keeps_deadline_budgets():
    s = T.scale_rate(trace(), 2.0)
    assert s.arrival_s.tolist() == [0, 5, 10, 15, 20]
    assert s.deadline_s[0] == 5 and s.deadline_s[2] == 16  # budget (6 s) kept
    assert s.prompt_tokens.tolist() == trace().prompt_tokens.tolist()
    t = T.scale_rate(trace(), target_rps=1.0)
    assert trace_stats(t)["mean_rate"] == pytest.approx(1.0) and t.meta["rate_scale"] == pytest.approx(10.0)
    assert T.scale_rate(s, 0.5).meta["rate_scale"] == 1.0


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"), ({"factor": 2, "target_rps": 1}, "exactly one"), ({"factor": 0}, "expected a finite number > 0"),
])
def test_scale_rate_rejects_bad_arguments(kwargs, message):
    with pytest.raises(TraceError, match=message):
        T.scale_rate(trace(), **kwargs)


def test_scale_rate_of_zero_span_is_an_error():
    single = Trace.from_columns([3.0, 3.0], [1, 1], [1, 1])
    with pytest.raises(TraceError, match="zero-length span"):
        T.scale_rate(single, target_rps=5)


def test_sample_is_seeded_and_ordered():
    a, b = T.sample(trace(), n=3, seed=1), T.sample(trace(), n=3, seed=1)
    assert a.arrival_s.tolist() == b.arrival_s.tolist() and a.n == 3
    assert np.all(np.diff(a.arrival_s) >= 0)
    assert T.sample(trace(), 0.4, seed=0).n == 2
    with pytest.raises(TraceError, match="between 1 and 5"):
        T.sample(trace(), n=6)


def test_concat_as_tenants_merges_in_time_and_separates_prefixes():
    a = trace()
    b = T.relabel(T.scale_rate(trace(), 2.0), slo_class="batch", priority=-1)
    merged = T.concat_as_tenants([("x", a), ("y", b)])
    assert merged.n == 10 and np.all(np.diff(merged.arrival_s) >= 0)
    assert merged.tenant_names == ("x", "y") and trace_stats(merged)["tenants"] == {"x": 5, "y": 5}
    assert trace_stats(merged)["slo_classes"] == {"default": 5, "batch": 5}
    xs, ys = merged.tenant_labels == "x", merged.tenant_labels == "y"
    assert merged.priority[ys].tolist() == [-1] * 5
    x_ids = set(np.concatenate([merged.block_hashes[merged.block_offsets[i]:merged.block_offsets[i + 1]] for i in np.flatnonzero(xs)]))
    y_ids = set(np.concatenate([merged.block_hashes[merged.block_offsets[i]:merged.block_offsets[i + 1]] for i in np.flatnonzero(ys)]))
    assert not x_ids & y_ids
    assert trace_stats(merged)["blocks"]["distinct"] == 2 * trace_stats(a)["blocks"]["distinct"]
    shared = T.concat_as_tenants([("x", a), ("y", b)], share_prefixes=True)
    assert trace_stats(shared)["blocks"]["distinct"] == trace_stats(a)["blocks"]["distinct"]
    with pytest.raises(TraceError, match="distinct"):
        T.concat_as_tenants([("x", a), ("x", b)])


def test_relabel_deadlines():
    r = T.relabel(trace(), tenant="t", deadline_after_s=2.5)
    assert r.tenant_names == ("t",) and (r.deadline_s - r.arrival_s).tolist() == [2.5] * 5
