"""The bundled sample trace: real-derived, small, and loadable without ../shared."""

import numpy as np

from studies.data import SAMPLE_TRACE
from studies.traces import load_trace, trace_stats


def test_sample_is_small_and_complete():
    assert SAMPLE_TRACE.stat().st_size < 300_000
    t = load_trace(SAMPLE_TRACE)
    s = trace_stats(t)
    assert s["rows"] == 918 and s["span_s"] < 300 and s["blocks"]["total"] == 24_752
    assert np.all(np.diff(t.arrival_s) > 0)  # buckets spread: no two arrivals at once
    assert t.block_tokens == 512 and (t.block_counts == -(-t.prompt_tokens // 512)).all()


def test_sample_is_the_start_of_mooncake(mooncake_path):
    full = load_trace(mooncake_path, spread="uniform")
    sample = load_trace(SAMPLE_TRACE)
    head = full.take(np.arange(sample.n))
    np.testing.assert_array_equal(head.prompt_tokens, sample.prompt_tokens)
    np.testing.assert_array_equal(head.block_hashes, sample.block_hashes)
    np.testing.assert_allclose(head.arrival_s, sample.arrival_s)
    assert full.arrival_s[sample.n] >= 300
