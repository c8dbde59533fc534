"""Which candidate to recommend, if any, and which of its knobs carry the gain.

Every candidate (and every default) is run on every traffic variant (``variants``); its
gain on a variant is its weighted goodput over the reference default's there. The search
ranked trials on one window, so the choice does not: among the candidates that lose to
the default by no more than ``NOISE`` on any variant, the one with the highest typical gain
(the geometric mean over variants) is chosen. A variant where both tie (a light window:
every config meets the SLOs) counts as no gain, not as a loss.

The defaults are kept, and said why, when no candidate passes, or when the chosen one's
typical gain is within ``NOISE`` of 1: a win that small is one window's luck as often as
not, and the file would change a production config for nothing.

Minimal files: each changed knob is put back at the default in turn (the knob whose
removal costs least first) and stays back when the file would still be chosen (no condition
below the default by more than ``NOISE``, a typical gain above it) and its typical gain stays
within ``NOISE`` of the full file's; the rest are the knobs that carry the gain.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Relative goodput change not told apart from none: below it a gain is not exported, and a
#: variant may fall that far below the default without counting as a regression.
NOISE = 0.03


def ratio(value: float, baseline: float) -> float:
    """value / baseline: inf when the baseline has none (and the value some), 1 when neither
    has any, nan when unknown."""
    if not (math.isfinite(value) and math.isfinite(baseline)):
        return math.nan
    if baseline > 0:
        return value / baseline
    return math.inf if value > 0 else 1.0


def geometric_mean(values) -> float:
    """Of positive values; inf if one is, 0 if one is 0 (or less), nan if there are none."""
    known = np.asarray(values, dtype=np.float64)
    if len(known) == 0:
        return math.nan
    if np.isinf(known).any():
        return math.inf
    if (known <= 0).any():
        return 0.0
    return float(np.exp(np.mean(np.log(known))))


@dataclass(frozen=True)
class Gains:
    """One config's gain over the reference default on each variant (in ``variants`` order)."""

    per_variant: tuple[float, ...]

    @property
    def worst(self) -> float:
        known = [g for g in self.per_variant if not math.isnan(g)]
        return min(known) if known else math.nan

    @property
    def best(self) -> float:
        known = [g for g in self.per_variant if not math.isnan(g)]
        return max(known) if known else math.nan

    @property
    def typical(self) -> float:
        """Geometric mean over the variants (inf if the default has no goodput somewhere the
        config has some; 0 if the config has none somewhere the default has some)."""
        return geometric_mean([g for g in self.per_variant if not math.isnan(g)])

    def holds(self, noise: float = NOISE) -> bool:
        """No variant below the default by more than ``noise``."""
        return self.worst >= 1.0 - noise

    def to_dict(self) -> dict[str, Any]:
        return {"typical": self.typical, "worst": self.worst, "best": self.best, "per_variant": list(self.per_variant)}


def gains_over(goodput: np.ndarray, reference: np.ndarray) -> list[Gains]:
    """Gains of each row of ``goodput`` (configs x variants) over ``reference`` (variants)."""
    return [Gains(tuple(ratio(float(v), float(r)) for v, r in zip(row, reference, strict=True))) for row in goodput]


@dataclass(frozen=True)
class Decision:
    """The candidate recommended (its index), or None: keep the defaults, for ``reason``."""

    chosen: int | None
    reason: str


def choose(candidates: Sequence[Gains], noise: float = NOISE) -> Decision:
    """The candidate whose gain holds with the highest typical gain, or keep the defaults."""
    if not candidates:
        return Decision(None, "the search found no feasible config besides the defaults")
    passing = [i for i, g in enumerate(candidates) if g.holds(noise)]
    if not passing:
        worst = max(g.worst for g in candidates)
        return Decision(None, f"every candidate loses to the defaults by more than {noise:.0%} under some condition "
                              f"(traffic variant or the cost model's error; the best worst case is {_x(worst)})")
    best = max(passing, key=lambda i: (candidates[i].typical, candidates[i].worst, -i))
    typical = candidates[best].typical
    if not typical >= 1.0 + noise:
        return Decision(None, f"the best gain that holds under every condition is {typical:.3f}x, within the "
                              f"{noise:.0%} noise of the defaults")
    return Decision(best, f"its gain holds under every traffic variant and the cost model's error: "
                          f"{_x(typical)} typical, {_x(candidates[best].worst)} at worst")


def _x(value: float) -> str:
    return "unbounded" if math.isinf(value) else f"{value:.2f}x"


@dataclass(frozen=True)
class KnobChange:
    """A knob the recommended file changes from the default, and what removing it costs."""

    knob: str
    flag: str  # as the file spells it
    value: Any
    default: Any
    removal_cost: float  # relative typical gain lost when this knob alone goes back (nan: refused alone)

    def describe(self) -> str:
        return f"{self.flag} {_show(self.value)}"

    def to_dict(self) -> dict[str, Any]:
        return {"knob": self.knob, "flag": self.flag, "value": self.value, "default": self.default,
                "removal_cost": self.removal_cost, "text": self.describe()}


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def minimal(config, default, knobs: Sequence[str], score: Callable[[list], list[Gains]],
            revert: Callable[[Any, str], Any], flag_of: Callable[[str], str],
            noise: float = NOISE) -> tuple[Any, list[KnobChange]]:
    """``config`` with every knob that does not carry the gain back at ``default``'s value.

    ``score(configs)`` gives each config's Gains; ``revert(config, knob)`` returns ``config``
    with ``knob`` at the default as the target runs it, or None when the target refuses
    that config (the knob then stays). Returns the reduced config and the knobs it keeps.
    """
    changed = [k for k in knobs if getattr(config, k) != getattr(default, k)]
    if not changed:
        return config, []
    full = score([config])[0]
    alone = {k: revert(config, k) for k in changed}
    tried = [k for k in changed if alone[k] is not None]
    cost = {k: math.nan for k in changed}
    for k, g in zip(tried, score([alone[k] for k in tried]), strict=True):
        cost[k] = _loss(full.typical, g.typical)
    current = config
    # cheapest first; a knob the target refuses to drop alone is tried last, once others are back
    for k in sorted(changed, key=lambda k: (math.isnan(cost[k]), 0.0 if math.isnan(cost[k]) else cost[k], k)):
        candidate = revert(current, k)
        if candidate is None:
            continue
        g = score([candidate])[0]
        # still a file the choice would export: it holds, it gains beyond the noise, and it
        # keeps the full file's gain within the noise
        if g.holds(noise) and g.typical >= 1.0 + noise and _loss(full.typical, g.typical) <= noise:
            current = candidate
    kept = [KnobChange(k, flag_of(k), getattr(current, k), getattr(default, k), cost[k])
            for k in changed if getattr(current, k) != getattr(default, k)]
    return current, kept


def _loss(full: float, reduced: float) -> float:
    """Relative typical gain lost going from ``full`` to ``reduced`` (0 when none)."""
    if math.isinf(full):
        return 0.0 if math.isinf(reduced) else math.inf
    if not full > 0:
        return 0.0
    return max(0.0, 1.0 - reduced / full)
