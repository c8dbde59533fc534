"""Caps and output-length estimates: the true length never leaks into what the scheduler reads."""

import json

import numpy as np
import pytest

from studies import synthetic as syn
from studies import transforms as tf
from studies.lengths import Predictor, prepare_lengths, with_client_caps
from studies.traces import (
    CAP_DEFAULT,
    CAP_GIVEN,
    CAP_NONE,
    Trace,
    TraceError,
    load_trace,
    write_trace,
)
from tests.studies.conftest import write

MOONCAKE = "".join(json.dumps(r) + "\n" for r in [
    {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]},
    {"timestamp": 1000, "input_length": 100, "output_length": 5, "hash_ids": [0]},
    {"timestamp": 2000, "input_length": 5000, "output_length": 2, "hash_ids": [0, 2]},
])
AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:50.99,396,109\n"
NATIVE = ("arrival_s,prompt_tokens,output_tokens,max_tokens\n"
          "0.5,600,3,16\n1.25,10,0,\n")


def test_files_without_caps_are_marked_without_caps(tmp_path):
    for name, text in (("m.jsonl", MOONCAKE), ("a.csv", AZURE)):
        t = load_trace(write(tmp_path, name, text))
        assert not t.caps_known and not t.max_tokens_given.any()
        assert np.all(t.max_tokens_source == CAP_NONE)
    t = load_trace(write(tmp_path, "a2.csv", AZURE), max_tokens=64)  # the caller's constant: given caps
    assert t.caps_known and t.max_tokens_given.all() and t.max_tokens.tolist() == [64, 64]
    t = load_trace(write(tmp_path, "n.csv", NATIVE))  # a cap column: given where a cell has a value
    assert t.max_tokens_given.tolist() == [True, False] and not t.caps_known


def test_caller_built_traces_have_caps_unless_omitted():
    assert Trace.from_columns([0.0], [10], [5], max_tokens=[7]).max_tokens_given.all()
    assert not Trace.from_columns([0.0], [10], [5]).caps_known


def test_client_caps_are_context_less_prompt_or_a_constant(tmp_path):
    t = load_trace(write(tmp_path, "m.jsonl", MOONCAKE), spread="raw")
    capped = with_client_caps(t, context_len=4096)
    assert capped.max_tokens.tolist() == [3496, 3996, 1]  # a prompt over the context: cap 1, not an error
    assert capped.caps_known and np.all(capped.max_tokens_source == CAP_DEFAULT)
    assert capped.output_estimate.tolist() == capped.max_tokens.tolist()  # the estimate is the cap
    assert capped.meta["client_caps"]["defaulted"] == 3
    constant = with_client_caps(t, context_len=4096, max_tokens=256)
    assert constant.max_tokens.tolist() == [256] * 3
    # study defaults can be re-derived for another context
    assert with_client_caps(capped, context_len=1000).max_tokens.tolist() == [400, 900, 1]


def test_given_caps_are_kept_unless_overridden(tmp_path):
    t = load_trace(write(tmp_path, "n.csv", NATIVE))
    capped = with_client_caps(t, context_len=100, max_tokens=50)
    assert capped.max_tokens.tolist() == [16, 50]
    assert capped.max_tokens_source.tolist() == [CAP_GIVEN, CAP_DEFAULT]
    forced = with_client_caps(t, context_len=100, max_tokens=50, override=True)
    assert forced.max_tokens.tolist() == [50, 50] and np.all(forced.max_tokens_source == CAP_DEFAULT)


@pytest.mark.parametrize("kwargs, match", [
    (dict(context_len=0), "context_len=0; expected an integer >= 1"),
    (dict(context_len=4096.0), "context_len=4096.0"),
    (dict(context_len=4096, max_tokens=0), "max_tokens=0"),
    (dict(context_len=4096, override=True), "override=True needs a constant max_tokens"),
])
def test_client_caps_errors(kwargs, match):
    with pytest.raises(TraceError, match=match):
        with_client_caps(Trace.from_columns([0.0], [10], [5]), **kwargs)


def _big_trace(n=20_000, seed=0):
    rng = np.random.default_rng(seed)
    output = rng.integers(200, 2000, n)
    return with_client_caps(Trace.from_columns(np.sort(rng.uniform(0, 100, n)), np.full(n, 50), output),
                            context_len=1 << 20)


def test_noisy_predictor_has_the_stated_log_error():
    t = _big_trace()
    for sigma in (0.3, 0.5, 1.0):
        est = Predictor.parse(f"noisy:{sigma}").apply(t, seed=7)
        assert est.output_estimator == f"noisy:{sigma:g}"
        log_err = np.log(est.output_estimate / t.output_tokens)
        assert np.std(log_err) == pytest.approx(sigma, rel=0.1)
        assert abs(np.mean(log_err)) < 0.05
        assert np.array_equal(est.output_estimate, Predictor("noisy", sigma).apply(t, seed=7).output_estimate)
        assert not np.array_equal(est.output_estimate, Predictor("noisy", sigma).apply(t, seed=8).output_estimate)
    # clipped to [1, max_tokens]
    small = with_client_caps(t, context_len=1 << 20, max_tokens=300, override=True)
    est = Predictor.parse("noisy:2").apply(small, seed=1).output_estimate
    assert est.min() >= 1 and est.max() <= 300


def test_cap_and_oracle_predictors():
    t = _big_trace(100)
    cap = Predictor.parse("cap").apply(t)
    np.testing.assert_array_equal(cap.output_estimate, t.max_tokens)
    assert cap.output_estimator == "cap"
    oracle = Predictor.parse(" Oracle ").apply(t)
    np.testing.assert_array_equal(oracle.output_estimate, t.output_tokens)
    assert oracle.output_estimator == "oracle"
    # back to the cap: the estimate follows the caps again
    assert np.array_equal(Predictor().apply(oracle).output_estimate, t.max_tokens)
    assert prepare_lengths(Trace.from_columns([0.0], [10], [5]), context_len=20, predictor="oracle"
                           ).output_estimate.tolist() == [5]


@pytest.mark.parametrize("spec, match", [
    ("noisy", "noisy:SIGMA"), ("noisy:", "noisy:SIGMA"), ("noisy:abc", "noisy:SIGMA"),
    ("noisy:-1", "sigma=-1.0"), ("noisy:nan", "sigma=nan"), ("oracle:1", "takes no argument"),
    ("perfect", "unknown predictor 'perfect'"), (3, "expected 'cap'"),
])
def test_bad_predictor_specs(spec, match):
    with pytest.raises(TraceError, match=match):
        Predictor.parse(spec)


def test_predictor_needs_real_caps_first():
    with pytest.raises(TraceError, match="with_client_caps"):
        Predictor.parse("cap").apply(Trace.from_columns([0.0], [10], [5]))


def test_estimate_follows_new_caps_and_explicit_estimates_need_a_name():
    t = Trace.from_columns([0.0, 1.0], [10, 10], [5, 6], max_tokens=[8, 9])
    assert t.replace(max_tokens=[3, 4]).output_estimate.tolist() == [3, 4]
    with pytest.raises(TraceError, match="output_estimator is 'cap'"):
        t.replace(output_estimate=[2, 2])
    named = t.replace(output_estimate=[2, 2], output_estimator="mine")
    assert named.replace(max_tokens=[3, 4]).output_estimate.tolist() == [2, 2]
    with pytest.raises(TraceError, match="'output_estimate' is 0"):
        t.replace(output_estimate=[0, 2], output_estimator="mine")


def test_synthetic_tenants_without_an_estimate_send_no_cap():
    plain = syn.generate(syn.Poisson(rate=20), duration_s=5, seed=1)
    assert not plain.max_tokens_given.any()
    guessed = syn.generate(syn.Poisson(rate=20), duration_s=5, seed=1, tenants=[
        syn.Tenant("a", estimate=syn.OutputEstimate(bias=2.0)), syn.Tenant("b")])
    np.testing.assert_array_equal(guessed.max_tokens_given, guessed.tenant_labels == "a")
    assert syn.misestimate(plain, syn.OutputEstimate(bias=0.5)).max_tokens_given.all()


def test_transforms_carry_estimates_and_cap_sources():
    raw = Trace.from_columns(np.arange(6.0), np.full(6, 10), np.arange(1, 7))
    t = Predictor.parse("noisy:0.5").apply(with_client_caps(raw, context_len=1000, max_tokens=4).replace(
        max_tokens_source=np.array([1, 2, 1, 2, 1, 2], np.int8)), seed=3)
    sampled = tf.sample(t, n=3, seed=1)
    picked = np.searchsorted(t.arrival_s, sampled.arrival_s)
    for part, rows in ((tf.window(t, 2.0, 5.0), [2, 3, 4]), (sampled, picked),
                       (tf.scale_rate(t, 2.0), range(6)), (tf.relabel(t, tenant="x"), range(6))):
        rows = list(rows)
        assert part.output_estimator == "noisy:0.5"
        np.testing.assert_array_equal(part.output_estimate, t.output_estimate[rows])
        np.testing.assert_array_equal(part.max_tokens_source, t.max_tokens_source[rows])
    merged = tf.concat_as_tenants([("a", t), ("b", raw)])
    assert merged.output_estimator == "mixed" and not merged.caps_known
    assert sorted(merged.max_tokens_source.tolist()) == sorted(t.max_tokens_source.tolist() + [CAP_NONE] * 6)
    same = tf.concat_as_tenants([("a", raw), ("b", raw)])
    assert same.output_estimator == "cap" and np.array_equal(same.output_estimate, same.max_tokens)


@pytest.mark.parametrize("suffix", ["csv", "jsonl", "parquet"])
def test_native_round_trip_of_estimates_and_caps(tmp_path, suffix):
    raw = Trace.from_columns([0.0, 1.0, 2.0], [10, 20, 30], [5, 0, 9])
    path = write_trace(raw, tmp_path / f"raw.{suffix}")
    back = load_trace(path)
    assert not back.max_tokens_given.any() and back.output_estimator == "cap"
    np.testing.assert_array_equal(back.max_tokens, raw.max_tokens)
    est = Predictor.parse("noisy:0.5").apply(with_client_caps(raw, context_len=100), seed=2)
    back = load_trace(write_trace(est, tmp_path / f"est.{suffix}"))
    np.testing.assert_array_equal(back.output_estimate, est.output_estimate)
    np.testing.assert_array_equal(back.max_tokens, est.max_tokens)
    assert back.max_tokens_given.all()  # a file with a cap column has caps
    assert back.output_estimator == ("noisy:0.5" if suffix == "parquet" else "file")


def test_native_estimate_column_must_be_complete(tmp_path):
    path = write(tmp_path, "e.csv", "arrival_s,prompt_tokens,output_tokens,max_tokens,output_estimate\n"
                                    "0,10,5,8,4\n1,10,5,8,\n")
    with pytest.raises(TraceError, match=r"row 2 \(line 3\), column 'output_estimate': got nothing"):
        load_trace(path)
