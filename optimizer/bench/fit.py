"""Fit the cost model's free parameters to measured bench runs by replaying them.

Each run is re-simulated on the traffic its client sent (``BenchRun.traffic``), through
the config file it ran, under a candidate (per-step overhead, prefill scale, decode
scale) (``costmodels.steptable``: ``step = decode_scale * decode part + prefill_scale *
prefill part + overhead``). The fit minimises squared log errors, each run and metric
of per-request TPOT, and (weighted less) of mean TTFT per prompt-length quartile. A request's TTFT jumps by a
whole step when a small change moves its arrival to the other side of a step boundary,
so per-request TTFT (and, over a few hundred requests, even its deciles) is too rough a
target; the mean averages the jumps out. Nelder-Mead first, because a replay stays
piecewise in the parameters.

Overhead and decode scale trade off when a run's decode batches are all small (a
decode step costs ``decode_scale * T(B) + overhead`` with T nearly flat in B): runs
that span light and heavy load separate them.

Error is stated twice: in sample (fitted and scored on all runs) and leave one run out
(fitted without a run, scored on it), which is what a new run should expect; with a
single run there is no out-of-sample figure, and the entry says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from optimizer.bench.results import RequestTimes
from optimizer.bench.run import BenchRun

#: mean TTFT is matched per prompt-length quantile: its rise with the prompt is the
#: prefill scale, its floor the overhead
TTFT_BINS = 4
#: TTFT's weight against TPOT's: TTFT carries the prefill scale but also the queueing
#: that amplifies every error, so it counts less
TTFT_WEIGHT = 0.3
#: decode scales (relative to the first fit) the valley profile tries
PROFILE = np.linspace(0.85, 1.15, 13)


@dataclass(frozen=True)
class MeasuredRun:
    """A bench run: its replay, what it measured and the traffic it sent."""

    name: str
    run: BenchRun
    measured: RequestTimes

    @property
    def traffic(self):
        return self.run.traffic(self.measured)


@dataclass(frozen=True)
class Fit:
    overhead_s: float
    prefill_scale: float
    decode_scale: float

    def tables(self, base):
        return base._replace(overhead_s=self.overhead_s, scale=1.0, prefill_scale=self.prefill_scale,
                             decode_scale=self.decode_scale)


def run_errors(run: MeasuredRun, traffic, cost_model) -> dict[str, np.ndarray]:
    """Per-request relative errors (simulated / measured - 1) of TTFT and TPOT."""
    sim = RequestTimes.simulated(run.run.simulate(traffic, cost_model), traffic)
    return run_errors_from(sim, run.measured, traffic)


def run_errors_from(sim: RequestTimes, measured: RequestTimes, traffic) -> dict[str, np.ndarray]:
    out = {}
    for key in ("ttft", "tpot"):
        s, m = getattr(sim, f"{key}_ms"), getattr(measured, f"{key}_ms")
        use = sim.ok & measured.ok & (m > 0) & np.isfinite(s)
        if key == "tpot":
            use &= traffic.output_tokens > 1
        out[key] = np.where(use, s / np.where(use, m, 1.0) - 1.0, np.nan)
        # a request the model never finishes counts as a large error, not as no error
        out[key] = np.where(measured.ok & ~sim.ok, 1.0, out[key])
    return out


def run_residuals(run: MeasuredRun, traffic, cost_model) -> np.ndarray:
    """The fit's residuals on one run (module docstring): per-request TPOT log errors,
    scaled so they weigh as much as the log error of mean TTFT."""
    sim = RequestTimes.simulated(run.run.simulate(traffic, cost_model), traffic)
    measured = run.measured
    tpot = run_errors_from(sim, measured, traffic)["tpot"]
    tpot = np.log1p(np.maximum(np.where(np.isfinite(tpot), tpot, 0.0), -0.999))
    both = np.flatnonzero(measured.ok & sim.ok)
    bins = np.array_split(both[np.argsort(traffic.prompt_tokens[both], kind="stable")], TTFT_BINS)
    ttft = [np.log(sim.ttft_ms[b].mean() / measured.ttft_ms[b].mean()) for b in bins if len(b)]
    unfinished = np.mean(measured.ok & ~sim.ok)  # a request the model never finishes costs as a 2x error
    return np.r_[tpot / np.sqrt(max(len(tpot), 1)), TTFT_WEIGHT * np.asarray(ttft) / np.sqrt(max(len(ttft), 1)),
                 np.sqrt(unfinished) * np.log(2.0)]


def run_loss(run: MeasuredRun, traffic, cost_model) -> float:
    return float(np.sum(run_residuals(run, traffic, cost_model) ** 2))


def fit(runs: list[MeasuredRun], base_cost) -> Fit:
    """The parameters minimising squared log error over ``runs`` (module docstring).

    Nelder-Mead from three starts; then a profile along the overhead/decode-scale valley
    (each decode scale of a grid around the best, its overhead re-fitted), which a local
    search leaves at whichever rough dip it met first; then Nelder-Mead again from the
    profile's best.
    """
    traffic = [r.traffic for r in runs]

    def loss(x: np.ndarray) -> float:
        cost = replace(base_cost, tables=_params(x).tables(base_cost.tables))
        return sum(run_loss(r, t, cost) for r, t in zip(runs, traffic, strict=True))

    def local(start: np.ndarray):
        return minimize(loss, start, method="Nelder-Mead",
                        options={"xatol": 1e-4, "fatol": 1e-10, "maxiter": 600, "initial_simplex": _simplex(start)})

    x0 = np.array([base_cost.tables.overhead_s * 1e3, 0.0, 0.0])
    best = min((local(start) for start in (x0, x0 + [2.0, 0.2, -0.2], x0 + [-1.0, -0.2, 0.2])), key=lambda r: r.fun)
    x, value = best.x, best.fun
    for log_decode in best.x[2] + np.log(PROFILE):
        def along(overhead_ms: np.ndarray, log_decode=log_decode) -> float:
            return loss(np.array([overhead_ms[0], best.x[1], log_decode]))

        found = minimize(along, best.x[:1], method="Nelder-Mead",
                         options={"xatol": 1e-3, "fatol": 1e-10, "initial_simplex": [[best.x[0]], [best.x[0] + 0.5]]})
        if found.fun < value:
            x, value = np.array([found.x[0], best.x[1], log_decode]), found.fun
    polished = local(x)
    return _params(polished.x if polished.fun < value else x)


def _simplex(x: np.ndarray) -> np.ndarray:
    steps = np.array([1.0, 0.1, 0.1])  # 1 ms of overhead, 10% on each scale
    return np.vstack([x, *(x + np.diag(steps))])


def _params(x: np.ndarray) -> Fit:
    return Fit(abs(float(x[0])) * 1e-3, math.exp(float(x[1])), math.exp(float(x[2])))


def mape(runs: list[MeasuredRun], cost) -> dict[str, float]:
    """Mean absolute per-request error (%) of TTFT and TPOT over ``runs``."""
    pooled = {"ttft": [], "tpot": []}
    for r in runs:
        for key, e in run_errors(r, r.traffic, cost).items():
            pooled[key].append(e[np.isfinite(e)])
    return {f"{k}_mape": float(np.mean(np.abs(np.concatenate(v))) * 100) if sum(map(len, v)) else math.nan
            for k, v in pooled.items()}


def calibrate_from_bench(runs: list[MeasuredRun], base_cost, key: dict) -> dict:
    """A calibration entry (``costmodels.calibration`` format) fitted on ``runs``, with
    its error before, in sample and leave one run out."""
    def with_fit(f: Fit):
        return replace(base_cost, tables=f.tables(base_cost.tables))

    fitted = fit(runs, base_cost)
    error = {"before": mape(runs, base_cost), "in_sample": mape(runs, with_fit(fitted)), "leave_one_run_out": None,
             "per_run": {}}
    if len(runs) > 1:
        held = []
        for i, r in enumerate(runs):
            others = fit(runs[:i] + runs[i + 1:], base_cost)
            scored = mape([r], with_fit(others))
            error["per_run"][r.name] = {"out_of_sample": scored, "params": others.__dict__}
            held.append(scored)
        error["leave_one_run_out"] = {k: float(np.mean([h[k] for h in held])) for k in held[0]}
    else:
        error["note"] = "one run: no out-of-sample error; measure another run (another rate or trace) to get one"
    return {**key, "tp": [int(key["tp"])], "source": "bench replay",
            "fitted_on": [r.name for r in runs], "n_runs": len(runs), "scale": 1.0, **fitted.__dict__,
            "error": error}


def save_entry(entry: dict, path: str | Path) -> Path:
    """Write ``entry`` into the calibration file at ``path``, replacing an entry of the
    same setup and keeping the others."""
    from costmodels.calibration import load_calibration, load_tier_errors, save_calibration

    path = Path(path)
    entries, tiers = (load_calibration(path), load_tier_errors(path)) if path.is_file() else ([], {})
    same = ("model", "gpu", "framework", "gemm_dtype", "kv_dtype", "tp")
    kept = [e for e in entries if any(e.get(k) != entry.get(k) for k in same)]
    save_calibration([*kept, entry], path, tier_errors=tiers)
    return path
