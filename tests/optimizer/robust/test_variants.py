"""Traffic variants: contiguous folds of the tuning window at rates around the trace's."""

from __future__ import annotations

import numpy as np

from optimizer.robust.variants import MIN_FOLD_REQUESTS, RATE_SCALES, folds, variants
from tests.optimizer.tuning_helpers import make_trace


def test_folds_cut_the_window_into_equal_contiguous_parts_rebased_to_zero():
    trace = make_trace(300, gap_s=1.0)  # arrivals 0..299 s
    parts = folds(trace, 3)
    assert [f.name for f in parts] == ["fold 1/3", "fold 2/3", "fold 3/3"]
    assert sum(f.trace.n for f in parts) == trace.n  # every request in exactly one fold
    assert [f.trace.n for f in parts] == [100, 100, 100]
    for f in parts:
        assert 0.0 <= f.trace.arrival_s[0] < 1.0 and np.all(np.diff(f.trace.arrival_s) >= 0)  # from its window start
    assert parts[1].trace.meta["window_s"] == [99.66666666666667, 199.33333333333334]


def test_a_trace_too_small_for_three_folds_gets_fewer():
    trace = make_trace(2 * MIN_FOLD_REQUESTS + 10, gap_s=0.5)
    assert len(folds(trace, 3)) == 2
    tiny = make_trace(MIN_FOLD_REQUESTS, gap_s=0.5)
    only = folds(tiny, 3)
    assert len(only) == 1 and only[0].trace is tiny


def test_variants_are_every_fold_at_every_rate():
    vs = variants(make_trace(300, gap_s=1.0))
    assert len(vs) == 3 * len(RATE_SCALES)
    assert vs[0].name == "fold 1/3 x0.8" and vs[-1].name == "fold 3/3 x1.2"
