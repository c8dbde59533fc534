"""How wrong the step-time model may be for this setup, and cost models moved by it.

The tier is the calibration entry the cost model matched (``costmodels.calibration``,
``MATCHES``). Where the entry states an out-of-sample error (``benchmarks/fidelity.py``,
leave one (model, framework, TP) group out), that error is this setup's: a ``setup``,
``model``, ``family`` or ``pooled`` entry of the same GPU and path. Everywhere else (no
entry, an entry lent from another GPU or another parallel path, the roofline) the error is
the one measured on setups without a calibration entry of their own (issue 45's runs of
other frameworks, dtypes and GPUs: TTFT 41%, TPOT 51% at worst), and the band says the
setup is uncalibrated. An entry stating only its in-sample error counts double: an in-sample
error understates what unseen rows show (the dense fit's 21.6% in sample became 40.7%
on fresh setups).

A figure's band from the model's error is the figure re-simulated with every prefill step
scaled by (1 +- TTFT error) and every decode step by (1 +- TPOT error)
(``StepTables.prefill_scale`` / ``decode_scale``), at the four corners.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Matches whose entry was fitted on this GPU and parallel path: its stated error applies.
OWN_TIERS = ("setup", "model", "family", "pooled")
#: The error on setups with no entry of their own (issue 45: dense 40.7% / 17.3%, breadth
#: 41.3% / 51.1% out of sample, servetune validate): TTFT and TPOT, as fractions.
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


def model_error(cost_model) -> ModelError:
    """The error ``cost_model``'s calibration tier was measured to have (see the module)."""
    used = cost_model.calibration or {"match": "none"}
    tier = used.get("match", "none")
    if "roofline" in (cost_model.source or "") and "profiled" not in (cost_model.source or ""):
        tier = "roofline"
    error = used.get("error") or {}
    held = error.get("out_of_sample") or error.get("leave_one_run_out") or {}
    ttft, tpot = held.get("ttft_mape"), held.get("tpot_mape")
    if tier in OWN_TIERS and _known(ttft) and _known(tpot):
        return ModelError(ttft / 100, tpot / 100, tier, True,
                          f"{tier} calibration entry, out of sample: TTFT {ttft:.1f}%, TPOT {tpot:.1f}%")
    inside = (error.get("in_sample_ttft_mape"), error.get("in_sample_tpot_mape"))
    if tier in OWN_TIERS and all(_known(v) for v in inside):
        a, b = (IN_SAMPLE_ONLY_FACTOR * v / 100 for v in inside)
        return ModelError(a, b, tier, True, f"{tier} calibration entry, in sample only (TTFT {inside[0]:.1f}%, "
                          f"TPOT {inside[1]:.1f}%), taken at x{IN_SAMPLE_ONLY_FACTOR:g}")
    ttft_u, tpot_u = UNCALIBRATED
    why = {"none": "no calibration entry", "off": "calibration off", "roofline": "roofline step times",
           "other_gpu": "an entry lent from another GPU", "other_path": "an entry lent from another parallel path"}
    return ModelError(ttft_u, tpot_u, tier, False,
                      f"uncalibrated ({why.get(tier, tier)}): TTFT {100 * ttft_u:.0f}%, TPOT {100 * tpot_u:.0f}%, "
                      "the error measured on setups without an entry of their own")


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
