"""Capacity search: doubling then bisection to the highest rate meeting the attainment target."""

import pytest

from optimizer.search.capacity import capacity, capacity_many
from policies.config import PolicyConfig
from tests.optimizer.tuning_helpers import fake_report, make_trace


class KneeEvaluator:
    """Attainment 1.0 up to a knee rate scale per config (its max_num_seqs / 10), 0.5 past it."""

    def __init__(self):
        self.trace = make_trace(101, gap_s=0.1)  # 10 req/s
        self.calls = []

    def reports(self, configs, rate_scale=1.0):
        self.calls.append((rate_scale, len(configs)))
        return [fake_report(1.0, slo_attainment=1.0 if rate_scale <= c.max_num_seqs / 10 else 0.5) for c in configs]


@pytest.mark.parametrize("knee_seqs", [3, 10, 47, 500])
def test_finds_the_knee_within_tolerance(knee_seqs):
    ev = KneeEvaluator()
    result = capacity(ev, PolicyConfig(max_num_seqs=knee_seqs), target=0.9, tolerance=0.02)
    knee = knee_seqs / 10
    assert knee / 1.02 <= result.rate_scale <= knee and result.bracketed
    assert result.rps == pytest.approx(result.rate_scale * 10.0)
    assert all((a >= 0.9) == (s <= knee) for s, a, _ in result.probes)


def test_unreachable_and_unbounded_ends():
    ev = KneeEvaluator()
    never = capacity(ev, PolicyConfig(max_num_seqs=1), min_scale=0.5)  # knee 0.1 < min_scale
    assert never.rate_scale == 0.0
    always = capacity(ev, PolicyConfig(max_num_seqs=1 << 16), max_scale=64)
    assert always.rate_scale == 64 and not always.bracketed


def test_configs_share_doubling_probes():
    ev = KneeEvaluator()
    results = capacity_many(ev, [PolicyConfig(max_num_seqs=s) for s in (40, 80, 160)])
    assert [r.rate_scale > 0 for r in results] == [True] * 3
    first_rounds = ev.calls[:3]
    assert first_rounds == [(1.0, 3), (2.0, 3), (4.0, 3)]


def test_bad_target():
    with pytest.raises(ValueError, match="target"):
        capacity(KneeEvaluator(), PolicyConfig(), target=0)
