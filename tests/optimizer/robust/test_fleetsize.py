"""GPUs needed by fleet simulation: the fewest replicas meeting the target, searched."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from optimizer.robust.fleetsize import MAX_SIZED_REPLICAS, fleet_curve, fleet_size
from optimizer.search.space import Fleet


@dataclass
class _Report:
    slo_attainment: float
    weighted_goodput: float


class _Fleets:
    """An evaluator stand-in whose attainment is a known function of the replica count."""

    def __init__(self, attainment):
        self.attainment = attainment
        self.asked: list[int] = []

    def reports(self, configs, rate_scale=1.0, fleets=None):
        n = fleets[0].replicas
        self.asked.append(n)
        return [_Report(self.attainment(n), 10.0 * self.attainment(n))]


def _needs(k):
    return lambda n: 0.95 if n >= k else 0.5 * n / k


@pytest.mark.parametrize("needed", [1, 2, 3, 5, 7, 8, 13, 40])
@pytest.mark.parametrize("start", [1, 4, 20])
def test_the_smallest_count_meeting_the_target_is_found_from_any_start(needed, start):
    ev = _Fleets(_needs(needed))
    size = fleet_size(ev, object(), Fleet(tp=2), 0.9, start=start)
    assert size.replicas == needed and size.gpus == 2 * needed
    assert size.attainment == 0.95
    assert needed in ev.asked and (needed == 1 or needed - 1 in ev.asked)  # both sides of the edge were run
    assert len(set(ev.asked)) == len(ev.asked)  # no count simulated twice
    assert len(ev.asked) <= 2 * MAX_SIZED_REPLICAS.bit_length() + 2
    assert [p[0] for p in size.probes] == sorted(set(ev.asked))


def test_a_target_no_fleet_reaches_is_out_of_reach():
    ev = _Fleets(lambda n: 0.5)
    size = fleet_size(ev, object(), Fleet(), 0.9, max_replicas=16)
    assert size.replicas is None and size.gpus is None and size.attainment is None
    assert max(ev.asked) == 16


def test_the_count_beats_scaling_one_replica_when_replicas_pool_a_burst():
    """One replica serves 50% at this load, so scaling it says 2; a pooled fleet of 2 serves
    only 85% (the burst lands unevenly) and 3 are needed: the sizing runs the fleet."""
    ev = _Fleets({1: 0.5, 2: 0.85, 3: 0.93, 4: 0.97}.get)
    assert fleet_size(ev, object(), Fleet(), 0.9).replicas == 3


def test_fleet_curve_runs_every_count():
    ev = _Fleets(_needs(3))
    curve = fleet_curve(ev, object(), Fleet(), 4)
    assert [n for n, _, _ in curve] == [1, 2, 3, 4]
    assert curve[2][1] == 0.95 and curve[0][2] == pytest.approx(10 * 0.5 / 3)
