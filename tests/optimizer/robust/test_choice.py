"""The choice among candidates: robust over variants, the defaults kept within noise, and
the knobs that carry the gain."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pytest

from optimizer.robust.choice import NOISE, Gains, choose, gains_over, minimal, ratio


def test_gains_over_divides_each_variant_by_the_reference_and_ties_at_zero_are_no_gain():
    goodput = np.array([[2.0, 0.0, 3.0], [1.0, 1.0, 0.0]])
    reference = np.array([1.0, 0.0, 0.0])
    first, second = gains_over(goodput, reference)
    assert first.per_variant == (2.0, 1.0, math.inf)  # neither served anything: a tie, not a loss
    assert second.per_variant == (1.0, math.inf, 1.0)
    assert ratio(0.0, 2.0) == 0.0 and math.isnan(ratio(math.nan, 1.0))


def test_typical_is_the_geometric_mean_and_worst_the_minimum():
    g = Gains((1.0, 4.0))
    assert g.typical == pytest.approx(2.0) and g.worst == 1.0 and g.best == 4.0
    assert Gains((0.0, 5.0)).typical == 0.0
    assert Gains((2.0, math.inf)).typical == math.inf


def test_the_in_sample_winner_that_loses_on_one_variant_is_passed_over():
    lucky = Gains((3.0, 3.0, 0.9))  # the biggest win on two windows, a 10% loss on the third
    steady = Gains((1.3, 1.2, 1.25))
    decision = choose([lucky, steady])
    assert decision.chosen == 1
    assert "1.25x typical" in decision.reason and "1.20x at worst" in decision.reason


def test_a_gain_within_noise_keeps_the_defaults():
    decision = choose([Gains((1.01, 1.02, 1.0)), Gains((1.0, 1.0, 1.0))])
    assert decision.chosen is None
    assert "within the 3% noise" in decision.reason


def test_every_candidate_regressing_keeps_the_defaults_and_says_by_how_much():
    decision = choose([Gains((1.5, 0.8)), Gains((1.2, 0.95))])
    assert decision.chosen is None
    assert "0.95x" in decision.reason and "more than 3%" in decision.reason


def test_no_candidate_keeps_the_defaults():
    assert choose([]).chosen is None


def test_a_loss_inside_the_noise_is_not_a_regression():
    assert choose([Gains((1.4, 1 - NOISE / 2))]).chosen == 0


@dataclass(frozen=True)
class Knobs:
    budget: int = 8192
    seqs: int = 256
    block: int = 16

    def replace(self, **changes):
        return replace(self, **changes)


DEFAULT = Knobs()


def _score(configs):
    """Only the budget carries the gain (2x at 2048); seqs moves it by 1%; block by nothing."""
    out = []
    for c in configs:
        g = (2.0 if c.budget == 2048 else 1.0) * (1.01 if c.seqs == 128 else 1.0)
        out.append(Gains((g, g)))
    return out


def _revert(config, knob):
    return config.replace(**{knob: getattr(DEFAULT, knob)})


def test_minimal_keeps_only_the_knobs_whose_removal_costs_more_than_the_noise():
    tuned = Knobs(budget=2048, seqs=128, block=32)
    reduced, kept = minimal(tuned, DEFAULT, ("budget", "seqs", "block"), _score, _revert, lambda k: f"--{k}")
    assert reduced == Knobs(budget=2048)
    assert [(k.knob, k.flag, k.value, k.default) for k in kept] == [("budget", "--budget", 2048, 8192)]
    assert kept[0].removal_cost == pytest.approx(0.5)  # 2.02x -> 1.01x without it
    assert kept[0].describe() == "--budget 2048"


def test_minimal_keeps_a_knob_the_target_refuses_to_drop():
    tuned = Knobs(budget=2048, block=32)
    reduced, kept = minimal(tuned, DEFAULT, ("budget", "block"), _score,
                            lambda c, k: None if k == "block" else _revert(c, k), str)
    assert reduced == tuned and {k.knob for k in kept} == {"budget", "block"}


def test_minimal_does_not_drift_by_dropping_many_small_knobs():
    """Each knob alone costs 2% (inside the noise), but dropping all three costs 6%: only the
    first drops are taken, the total loss never passes the noise."""
    def score(configs):
        return [Gains(((1.02 ** sum((c.budget != 8192, c.seqs != 256, c.block != 16))) * 1.5,)) for c in configs]

    tuned = Knobs(budget=4096, seqs=128, block=32)
    reduced, kept = minimal(tuned, DEFAULT, ("budget", "seqs", "block"), score, _revert, str)
    full = score([tuned])[0].typical
    assert 1 - score([reduced])[0].typical / full <= NOISE
    assert len(kept) == 2


def test_a_knob_refused_alone_goes_back_once_the_knob_it_is_tied_to_has():
    """Like vLLM's rule budget >= max_num_seqs: seqs cannot go back to 256 while the budget is
    128, but once the budget is back it can, and neither carries the gain here."""
    def revert(config, knob):
        out = _revert(config, knob)
        return None if out.budget < out.seqs else out

    def score(configs):
        return [Gains((1.5 if c.block == 32 else 1.0,)) for c in configs]

    tuned = Knobs(budget=128, seqs=64, block=32)
    reduced, kept = minimal(tuned, DEFAULT, ("budget", "seqs", "block"), score, revert, str)
    assert reduced == Knobs(block=32) and [k.knob for k in kept] == ["block"]


def test_minimal_never_reduces_a_file_to_one_within_the_noise_of_the_defaults():
    """The full file gains 4%, 2% from each knob: dropping either loses less than the noise,
    but leaves a file gaining 2%, which the choice would not export: both stay."""
    def score(configs):
        return [Gains(((1.02 if c.budget == 2048 else 1.0) * (1.0196 if c.seqs == 128 else 1.0),)) for c in configs]

    tuned = Knobs(budget=2048, seqs=128)
    assert score([tuned])[0].typical >= 1 + NOISE
    reduced, kept = minimal(tuned, DEFAULT, ("budget", "seqs"), score, _revert, str)
    assert reduced == tuned and {k.knob for k in kept} == {"budget", "seqs"}
