"""Synthetic generators hit their requested moments for a fixed seed and are reproducible."""

import numpy as np
import pytest

from studies import synthetic as S
from studies.traces import TraceError, trace_stats


def rng(seed=0):
    return np.random.default_rng(seed)


@pytest.mark.parametrize("process, rate", [
    (S.Poisson(5.0), 5.0), (S.Gamma(5.0, 3.0), 5.0), (S.OnOff(20.0, 5.0, 15.0), 5.0), (S.Diurnal(8.0, 0.8, 500.0), 8.0),
])
def test_arrival_rates(process, rate):
    times = process.times(rng(), 20_000)
    assert np.all(np.diff(times) >= 0) and times[0] >= 0 and times[-1] < 20_000
    assert len(times) / 20_000 == pytest.approx(rate, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_gamma_cv(cv):
    gaps = np.diff(S.Gamma(10.0, cv).times(rng(1), 10_000))
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_onoff_is_bursty_and_diurnal_follows_its_curve():
    counts = np.bincount(S.OnOff(20.0, 5.0, 15.0).times(rng(), 2000).astype(int), minlength=2000)
    assert (counts == 0).mean() > 0.5  # mostly off
    d = S.Diurnal(10.0, 0.9, 1000.0)
    t = d.times(rng(), 100_000)
    phase = (t % 1000) // 250  # quarter periods: rising peak, falling, trough, rising
    share = np.bincount(phase.astype(int), minlength=4) / len(t)
    assert share[0] > 0.35 and share[2] < 0.15


def test_lognormal_moments_and_fit():
    x = S.LogNormal(1000, 0.8).sample(rng(), 200_000)
    assert x.mean() == pytest.approx(1000, rel=0.02) and x.std() / x.mean() == pytest.approx(0.8, rel=0.03)
    fitted = S.LogNormal.fit(x)
    assert fitted.mean == pytest.approx(1000, rel=0.03) and fitted.cv == pytest.approx(0.8, rel=0.05)
    assert S.LogNormal(50, 3, low=10, high=60).sample(rng(), 1000).min() >= 10


def test_generate_is_reproducible_and_seed_dependent():
    args = dict(duration_s=200, tenants=[S.Tenant(prefix=S.SharedPrefix(3, 1024))])
    a, b = S.generate(S.Poisson(5), seed=7, **args), S.generate(S.Poisson(5), seed=7, **args)
    for column in ("arrival_s", "prompt_tokens", "output_tokens", "block_hashes"):
        np.testing.assert_array_equal(getattr(a, column), getattr(b, column))
    assert not np.array_equal(a.arrival_s, S.generate(S.Poisson(5), seed=8, **args).arrival_s)


def test_tenant_mix_weights_priorities_classes_and_deadlines():
    t = S.generate(S.Poisson(50), duration_s=400, seed=2, tenants=[
        S.Tenant("chat", weight=3, priority=2, slo_class="fast", deadline_s=30.0),
        S.Tenant("batch", weight=1, priority=-1, slo_class="slow", output=S.LogNormal(800, 0.5)),
    ])
    s = trace_stats(t)
    assert s["tenants"]["chat"] / t.n == pytest.approx(0.75, abs=0.02)
    chat = t.tenant_labels == "chat"
    assert set(t.priority[chat]) == {2} and set(t.slo_class_labels[chat]) == {"fast"}
    np.testing.assert_allclose(t.deadline_s[chat] - t.arrival_s[chat], 30.0)
    assert np.isnan(t.deadline_s[~chat]).all()
    assert t.output_tokens[~chat].mean() == pytest.approx(800, rel=0.05)


def test_shared_prefix_groups_share_leading_blocks():
    t = S.generate(S.Poisson(20), duration_s=100, seed=1,
                   tenants=[S.Tenant(prompt=S.LogNormal(3000, 0.2), prefix=S.SharedPrefix(4, 1024))])
    first_two = np.stack([t.block_hashes[t.block_offsets[i]:t.block_offsets[i] + 2] for i in range(t.n)])
    assert len({tuple(r) for r in first_two}) == 4  # 1024 tokens = 2 shared blocks, 4 groups
    third = t.block_hashes[t.block_offsets[:-1] + 2]
    assert len(np.unique(third)) == t.n  # the rest is each request's own


def test_hot_spot_moves_between_groups():
    t = S.generate(S.Poisson(20), duration_s=600, seed=3,
                   tenants=[S.Tenant(prefix=S.SharedPrefix(5, 512, hot_share=0.9, hot_shift_s=100))])
    first = t.block_hashes[t.block_offsets[:-1]]
    hot = [np.bincount(first[(t.arrival_s >= k * 100) & (t.arrival_s < (k + 1) * 100)]).argmax() for k in range(6)]
    assert len(set(hot[:5])) == 5 and hot[5] == hot[0]  # a new hot group each period, cycling


def test_conversations_reuse_their_history():
    t = S.generate(S.Poisson(1), duration_s=300, seed=4, tenants=[
        S.Tenant(prompt=S.LogNormal(600, 0.3), output=S.LogNormal(300, 0.3), conversation=S.Conversation(4, 10))])
    s = trace_stats(t)
    assert t.n / 300 == pytest.approx(4.0, rel=0.25)  # sessions/s x turns
    assert s["blocks"]["repeat_fraction"] > 0.4
    assert s["prompt_tokens"]["mean"] > 1.5 * 600  # later turns carry the history


def test_output_estimate_bias():
    t = S.generate(S.Poisson(20), duration_s=200, seed=5,
                   tenants=[S.Tenant(estimate=S.OutputEstimate(bias=0.5))])
    np.testing.assert_array_equal(t.max_tokens, np.ceil(np.maximum(t.output_tokens, 1) * 0.5))
    over = S.misestimate(t, S.OutputEstimate(bias=2.0, cv=0.5, cap=4096), seed=1)
    ratio = over.max_tokens / np.maximum(over.output_tokens, 1)
    assert np.median(ratio) == pytest.approx(2.0 / np.sqrt(1.25), rel=0.1) and over.max_tokens.max() <= 4096


def test_lengths_like_a_trace():
    base = S.generate(S.Poisson(20), duration_s=500, seed=6, tenants=[S.Tenant(prompt=S.LogNormal(2000, 0.7))])
    like = S.generate(S.Poisson(20), duration_s=500, seed=7, tenants=[S.Tenant(**S.lengths_like(base))])
    assert like.prompt_tokens.mean() == pytest.approx(2000, rel=0.1)
    resampled = S.lengths_like(base, "resample")["prompt"].sample(rng(), 100)
    assert set(resampled) <= set(base.prompt_tokens)


@pytest.mark.parametrize("make, message", [
    (lambda: S.Gamma(5, 0), "cv=0"), (lambda: S.Poisson(-1), "rate=-1"), (lambda: S.Diurnal(1, 2.0), "amplitude"),
    (lambda: S.SharedPrefix(0, 10), "groups >= 1"), (lambda: S.Conversation(0.5, 1), "turns_mean"),
    (lambda: S.generate(S.Poisson(1), duration_s=10, tenants=[]), "at least one tenant"),
    (lambda: S.generate(S.Poisson(1), duration_s=10, tenants=[S.Tenant("a"), S.Tenant("a")]), "distinct"),
])
def test_bad_parameters(make, message):
    with pytest.raises(TraceError, match=message):
        make()
