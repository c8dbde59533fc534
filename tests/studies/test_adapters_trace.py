"""The adapter / model-version columns: trace validation, native round trips, bad values,
identity salting of prefix blocks, and the synthetic adapter popularity with its hot shift."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from studies import synthetic
from studies.traces import (
    BASE,
    Trace,
    TraceError,
    identity_salted_hashes,
    load_trace,
    trace_stats,
    write_trace,
)


def _trace(adapters, versions=None):
    n = len(adapters)
    a_names = tuple(dict.fromkeys([BASE, *adapters]))
    v = versions or [BASE] * n
    v_names = tuple(dict.fromkeys([BASE, *v]))
    return Trace.from_columns(
        np.arange(n, dtype=float), np.full(n, 1100), np.full(n, 4), max_tokens=np.full(n, 4),
        block_offsets=np.arange(0, 2 * n + 1, 2), block_hashes=np.tile([11, 12], n), block_tokens=512,
        adapter=[a_names.index(a) for a in adapters], adapter_names=a_names,
        model_version=[v_names.index(x) for x in v], model_version_names=v_names)


def test_same_prompt_blocks_under_different_identities_never_share_a_cache_hash():
    trace = _trace(["", "lora-a", "lora-b", "lora-a", ""], ["", "", "", "", "v2"])
    hashes = trace.cache_block_hashes.reshape(trace.n, 2)
    np.testing.assert_array_equal(hashes[0], [11, 12])  # the base model's blocks are the raw ones
    np.testing.assert_array_equal(hashes[1], hashes[3])  # same adapter: same blocks
    distinct = {tuple(row) for row in hashes[[0, 1, 2, 4]]}
    assert len(distinct) == 4
    assert not set(hashes[1]) & set(hashes[2]) and not set(hashes[0]) & set(hashes[4])


def test_a_trace_without_identities_keeps_its_hashes_and_has_no_adapters():
    trace = Trace.from_columns([0.0, 1.0], [600, 600], [3, 3], block_offsets=[0, 2, 3], block_hashes=[5, 6, 5])
    np.testing.assert_array_equal(trace.cache_block_hashes, trace.block_hashes)
    assert not trace.has_adapters and trace.adapter_names == (BASE,)


def test_salt_is_fixed_across_calls_and_keyed_by_every_identity_column():
    offsets, hashes = np.array([0, 1, 2]), np.array([9, 9])
    one = identity_salted_hashes(offsets, hashes, (np.array(["v1", "v1"], dtype=object), np.array(["a", "b"])))
    again = identity_salted_hashes(offsets, hashes, (np.array(["v1", "v1"], dtype=object), np.array(["a", "b"])))
    np.testing.assert_array_equal(one, again)
    assert one[0] != one[1]
    # the keys are a tuple: ("v1", "a") is not ("v1a", "") nor ("a", "v1")
    other = identity_salted_hashes(offsets, hashes, (np.array(["v1a", "a"], dtype=object), np.array(["", "v1"])))
    assert one[0] not in other


@pytest.mark.parametrize("suffix", ["csv", "jsonl", "parquet"])
def test_native_files_round_trip_adapter_and_model_version(tmp_path, suffix):
    trace = _trace(["lora-b", "", "lora-a", "lora-b"], ["v1", "v1", "v2", ""])
    back = load_trace(write_trace(trace, tmp_path / f"t.{suffix}"))
    np.testing.assert_array_equal(back.adapter_labels, trace.adapter_labels)
    versions = np.asarray(back.model_version_names, dtype=object)[back.model_version]
    np.testing.assert_array_equal(versions, ["v1", "v1", "v2", ""])
    np.testing.assert_array_equal(back.cache_block_hashes, trace.cache_block_hashes)
    assert back.has_adapters


def test_a_number_where_an_adapter_name_belongs_is_refused_by_row_and_column(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"arrival_s": 0.0, "prompt_tokens": 5, "output_tokens": 1, "adapter": "a"},
            {"arrival_s": 1.0, "prompt_tokens": 5, "output_tokens": 1, "adapter": 7}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(TraceError, match=r"line 2.*adapter|adapter.*line 2"):
        load_trace(path)
    parquet = tmp_path / "t.parquet"
    pl.DataFrame({"arrival_s": [0.0, 1.0], "prompt_tokens": [5, 5], "output_tokens": [1, 1],
                  "model_version": [None, 3]}).write_parquet(parquet)
    with pytest.raises(TraceError, match=r"row 2, column 'model_version': got 3; expected a name \(text\)"):
        load_trace(parquet)


def test_trace_refuses_unknown_adapter_codes_and_bad_names():
    with pytest.raises(TraceError, match=r"row 1: column 'adapter' is 2; expected a known adapter"):
        Trace.from_columns([0.0, 1.0], [5, 5], [1, 1], adapter=[0, 2], adapter_names=("", "a"))
    with pytest.raises(TraceError, match="adapter_names"):
        Trace.from_columns([0.0], [5], [1], adapter_names=("a", "a"))


def test_take_keeps_each_requests_adapter():
    trace = _trace(["", "lora-a", "lora-b"])
    picked = trace.take([0, 2])
    np.testing.assert_array_equal(picked.adapter_labels, ["", "lora-b"])


def test_synthetic_adapters_follow_zipf_and_the_hot_set_turns_cold_at_the_shift():
    tenant = synthetic.Tenant(prompt=synthetic.LogNormal(200, 0.2), output=synthetic.LogNormal(20, 0.2),
                              adapters=synthetic.Adapters(count=8, zipf=1.5, shift_s=300.0))
    trace = synthetic.generate(synthetic.Poisson(20.0), duration_s=600.0, tenants=[tenant], seed=3)
    labels = trace.adapter_labels
    early, late = labels[trace.arrival_s < 300], labels[trace.arrival_s >= 300]
    top_early = max(set(early), key=list(early).count)
    top_late = max(set(late), key=list(late).count)
    assert top_early == "lora-0" and top_late == "lora-4"  # rank 0 moved by count // 2
    assert np.mean(early == "lora-0") > 2 * np.mean(early == "lora-1") * 0.9  # 1 / rank**1.5
    assert np.mean(late == "lora-0") < np.mean(early == "lora-0") / 3  # the old hot adapter went cold
    assert trace_stats(trace)["adapters"][BASE] == 0


def test_synthetic_without_adapters_draws_the_same_trace_as_before():
    plain = synthetic.generate(synthetic.Poisson(5.0), duration_s=60.0, seed=4)
    assert not plain.has_adapters
    with_lora = synthetic.generate(synthetic.Poisson(5.0), duration_s=60.0, seed=4, tenants=[
        synthetic.Tenant(adapters=synthetic.Adapters(count=3, base_share=0.5))])
    np.testing.assert_array_equal(plain.arrival_s, with_lora.arrival_s)
    np.testing.assert_array_equal(plain.prompt_tokens, with_lora.prompt_tokens)
    share = np.mean(with_lora.adapter_labels == BASE)
    assert 0.3 < share < 0.7


@pytest.mark.parametrize("kwargs, match", [({"count": 0}, "count"), ({"count": 2, "base_share": 1.5}, "base_share"),
                                           ({"count": 2, "shift_s": 0.0}, "shift_s"),
                                           ({"count": 2, "shift_by": 2}, "shift_by")])
def test_bad_adapter_popularity_is_refused_by_name(kwargs, match):
    with pytest.raises(TraceError, match=match):
        synthetic.Adapters(**kwargs)
