"""How wrong the step-time model may be for this setup, and cost models moved by it.

The tier is how the cost model got its calibration entry (``costmodels.calibration``,
``MATCHES``), "none" without one, or "roofline" when the step times are the roofline's.
Where the entry was fitted on this setup's own model on this GPU and path (``setup``,
``model``), its stated out-of-sample error (``benchmarks/fidelity.py``, leave one setup out)
is this setup's. Every other tier (an entry of another model, GPU or path, none, the
roofline) takes the error measured for that tier on runs whose setup and model were held out
(``benchmarks/fidelity_unseen.py``; the calibration file's ``tier_errors``), as a user of an
unmeasured setup meets it. A tier measured on too few runs falls back to the lent entry's
own stated error (family, pooled), else to a wide stated default. An entry stating only its
in-sample error counts double: an in-sample error understates what unseen rows show (the
dense fit's 21.6% in sample became 40.7% on fresh setups).

A figure's band from the model's error is the figure re-simulated with every prefill step
scaled by (1 +- TTFT error) and every decode step by (1 +- TPOT error)
(``StepTables.prefill_scale`` / ``decode_scale``), at the four corners.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from costmodels.calibration import MIN_TIER_RUNS

#: Tiers whose entry was fitted on this model, GPU and parallel path: its stated error is the setup's.
OWN_TIERS = ("setup", "model")
#: Tiers whose entry was fitted on this GPU and path for other models: the setup counts as calibrated.
LENT_TIERS = ("family", "pooled")
#: The error for a tier nobody measured (issue 45: dense 40.7% / 17.3%, breadth 41.3% /
#: 51.1% out of sample on setups without an entry, servetune validate): TTFT and TPOT, as fractions.
UNCALIBRATED = (0.41, 0.51)
#: An in-sample-only error is taken at this multiple (in-sample understates).
IN_SAMPLE_ONLY_FACTOR = 2.0


@dataclass(frozen=True)
class ModelError:
    """The step-time model's relative error for one setup: prefill (TTFT) and decode (TPOT)."""

    ttft: float
    tpot: float
    tier: str  # the calibration match, "none" or "roofline"
    calibrated: bool
    stated: str  # where the figures come from, for the console and the review

    def corners(self) -> list[tuple[float, float]]:
        """(prefill factor, decode factor) at each corner of the error box."""
        return [(1 + a * self.ttft, 1 + b * self.tpot) for a in (-1, 1) for b in (-1, 1)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def error_tier(match: str, source: str) -> str:
    """The tier a cost model's error is read at: its calibration ``match``, or "roofline"
    when its step times are the roofline's (``CostModel.source``)."""
    return "roofline" if "roofline" in source and "profiled" not in source else match


def model_error(cost_model) -> ModelError:
    """The error ``cost_model``'s calibration tier was measured to have (see the module)."""
    used = cost_model.calibration or {"match": "none"}
    tier = error_tier(used.get("match", "none"), cost_model.source or "")
    calibrated = tier in OWN_TIERS + LENT_TIERS
    own = _entry_error(used.get("error") or {}, tier, calibrated)
    if tier in OWN_TIERS and own is not None:
        return own
    tables = used.get("tier_errors") or {}
    measured = (tables.get("tiers") or {}).get(tier)
    if measured and measured.get("runs", 0) >= MIN_TIER_RUNS:
        return ModelError(measured["ttft_mape"] / 100, measured["tpot_mape"] / 100, tier, calibrated,
                          f"{tier} tier{'' if calibrated else ' (uncalibrated)'}, measured on "
                          f"{measured['runs']} runs of {measured.get('setups', '?')} setups with their setup and model "
                          f"held out: TTFT {measured['ttft_mape']:.1f}%, TPOT {measured['tpot_mape']:.1f}%")
    if own is not None:
        return own
    ttft_u, tpot_u = UNCALIBRATED
    why = {"none": "no calibration entry", "off": "calibration off", "roofline": "roofline step times",
           "other_gpu": "an entry lent from another GPU", "other_path": "an entry lent from another parallel path"}
    return ModelError(ttft_u, tpot_u, tier, False,
                      f"uncalibrated ({why.get(tier, tier)}): TTFT {100 * ttft_u:.0f}%, TPOT {100 * tpot_u:.0f}%, "
                      "the error measured on setups without an entry of their own")


def _entry_error(error: dict, tier: str, calibrated: bool) -> ModelError | None:
    """The error a calibration entry states: out of sample, else in sample taken at
    ``IN_SAMPLE_ONLY_FACTOR``; None when it states neither, or when the entry is not this
    GPU's and path's (its stated error is of the setups it was fitted on, not this one)."""
    if not calibrated:
        return None
    held = error.get("out_of_sample") or error.get("leave_one_run_out") or {}
    ttft, tpot = held.get("ttft_mape"), held.get("tpot_mape")
    if _known(ttft) and _known(tpot):
        return ModelError(ttft / 100, tpot / 100, tier, True,
                          f"{tier} calibration entry, out of sample: TTFT {ttft:.1f}%, TPOT {tpot:.1f}%")
    inside = error.get("in_sample") or {}
    inside = (error.get("in_sample_ttft_mape", inside.get("ttft_mape")),
              error.get("in_sample_tpot_mape", inside.get("tpot_mape")))
    if all(_known(v) for v in inside):
        a, b = (IN_SAMPLE_ONLY_FACTOR * v / 100 for v in inside)
        return ModelError(a, b, tier, True, f"{tier} calibration entry, in sample only (TTFT {inside[0]:.1f}%, "
                          f"TPOT {inside[1]:.1f}%), taken at x{IN_SAMPLE_ONLY_FACTOR:g}")
    return None


def _known(value) -> bool:
    return isinstance(value, int | float) and value == value and value >= 0


def scaled(cost_model, prefill: float, decode: float):
    """``cost_model`` with every prefill step part times ``prefill`` and decode part times ``decode``."""
    t = cost_model.tables
    tables = t._replace(prefill_scale=t.prefill_scale * prefill, decode_scale=t.decode_scale * decode)
    return dataclasses.replace(cost_model, tables=tables)


def scaled_builder(build: Callable[[Any], Any], prefill: float, decode: float) -> Callable[[Any], Any]:
    """A cost-model builder (``Evaluator(cost_model_for=...)``) whose models are ``scaled``."""
    return lambda key: scaled(build(key), prefill, decode)
