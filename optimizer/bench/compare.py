"""A measured bench run beside the simulation of the same requests.

The simulation replays the config file the bench ran on the traffic the client sent
(``BenchRun.traffic``: its send times and prompt lengths), so the two differ only where
the model of the server differs from the server. Reported: goodput and SLO attainment
(each request against its own SLO class), mean and p50/p90/p99 of TTFT, TPOT, ITL and
E2E, the per-request error distribution, and which phase disagrees most:

- decode: TPOT (the steps a running request waits between tokens);
- prefill: TTFT of requests the simulation started at once (no queueing);
- queueing: TTFT of requests that waited for a slot or KV in the simulation.

ITL percentiles are the measured token gaps; the simulator times requests, not tokens,
so its ITL is the token-weighted mean only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from optimizer.bench.results import RequestTimes
from optimizer.bench.run import BenchRun
from studies.metrics import class_table
from studies.traces import Trace

QUANTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "e2el")
#: a simulated request whose queue time is at least this share of its TTFT is "queued"
QUEUED_SHARE = 0.5


@dataclass(frozen=True)
class Row:
    metric: str
    simulated: float
    measured: float

    @property
    def error(self) -> float:
        """(simulated - measured) / measured; NaN where undefined."""
        if not (math.isfinite(self.simulated) and math.isfinite(self.measured)) or self.measured == 0:
            return math.nan
        return self.simulated / self.measured - 1.0


@dataclass(frozen=True)
class Comparison:
    rows: list[Row]
    #: per metric: MAPE and the 10th/50th/90th percentile of the per-request relative error
    per_request: dict[str, dict[str, float]]
    #: per phase (decode, prefill, queueing): requests and mean signed relative error
    phases: dict[str, dict[str, float]]
    worst: str
    simulated: RequestTimes
    measured: RequestTimes
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"rows": [{"metric": r.metric, "simulated": r.simulated, "measured": r.measured, "error": r.error}
                         for r in self.rows],
                "per_request": self.per_request, "phases": self.phases, "worst": self.worst, "notes": self.notes}


def good(times: RequestTimes, trace: Trace, slos) -> np.ndarray:
    """Per request: finished and within every bound of its own SLO class."""
    bounds, _ = class_table(trace, slos)
    mine = bounds[trace.slo_class]
    ok = times.ok.copy()
    for j, key in enumerate(METRICS):
        ok &= np.isinf(mine[:, j]) | (getattr(times, f"{key}_ms") <= mine[:, j])
    return ok


def _stats(name: str, sim: np.ndarray, meas: np.ndarray) -> list[Row]:
    sim, meas = sim[np.isfinite(sim)], meas[np.isfinite(meas)]
    rows = [Row(f"mean {name} (ms)", _mean(sim), _mean(meas))]
    rows += [Row(f"p{q} {name} (ms)", _pct(sim, q), _pct(meas, q)) for q in QUANTILES]
    return rows


def _mean(x: np.ndarray) -> float:
    return float(np.mean(x)) if len(x) else math.nan


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else math.nan


def compare(run: BenchRun, measured: RequestTimes, cost_model) -> Comparison:
    """Simulate what ``measured`` sent and set the two side by side."""
    traffic = run.traffic(measured)
    result = run.simulate(traffic, cost_model)
    sim = RequestTimes.simulated(result, traffic)
    slos = run.spec.slos
    sim_good, meas_good = good(sim, traffic, slos), good(measured, traffic, slos)
    rows = [Row("goodput (req/s)", sim_good.sum() / sim.duration_s, meas_good.sum() / measured.duration_s),
            Row("SLO attainment", float(sim_good.mean()), float(meas_good.mean())),
            Row("finished requests", float(sim.ok.sum()), float(measured.ok.sum()))]
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT")):
        rows += _stats(label, getattr(sim, f"{key}_ms")[sim.ok], getattr(measured, f"{key}_ms")[measured.ok])
    itl = measured.itl_ms if measured.itl_ms is not None else np.zeros(0)
    rows.append(Row("mean ITL (ms)", sim.mean_itl_ms, measured.mean_itl_ms))
    rows += [Row(f"p{q} ITL (ms)", math.nan, _pct(itl, q)) for q in QUANTILES]
    rows += _stats("E2E", sim.e2el_ms[sim.ok], measured.e2el_ms[measured.ok])

    both = sim.ok & measured.ok
    per_request = {}
    errors = {}
    for key in METRICS:
        s, m = getattr(sim, f"{key}_ms"), getattr(measured, f"{key}_ms")
        use = both & (m > 0) & np.isfinite(s) & np.isfinite(m)
        if key == "tpot":
            use &= traffic.output_tokens > 1
        e = s[use] / m[use] - 1.0
        errors[key] = (use, e)
        per_request[key] = {"requests": int(use.sum()), "mape": float(np.mean(np.abs(e))) if len(e) else math.nan,
                            **{f"p{q}": _pct(e, q) for q in (10, 50, 90)}}
    use, e = errors["ttft"]
    queued = (result.queue_s * 1e3 >= QUEUED_SHARE * sim.ttft_ms)[use]
    phases = {"decode": _phase(errors["tpot"][1]), "prefill": _phase(e[~queued]), "queueing": _phase(e[queued])}
    ranked = [(abs(p["mean_error"]), name) for name, p in phases.items() if p["requests"]]
    worst = max(ranked)[1] if ranked else "none"
    return Comparison(rows, per_request, phases, worst, sim, measured, list(run.notes))


def _phase(errors: np.ndarray) -> dict[str, float]:
    return {"requests": int(len(errors)), "mean_error": float(np.mean(errors)) if len(errors) else math.nan}


def scatter(comparison: Comparison, path: str | Path, title: str = "") -> Path:
    """Simulated vs measured TTFT and TPOT per request, log-log, with the y = x line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    sim, meas = comparison.simulated, comparison.measured
    both = sim.ok & meas.ok
    for ax, key, label in zip(fig.subplots(1, 2), ("ttft", "tpot"), ("TTFT (ms)", "TPOT (ms)"), strict=True):
        s, m = getattr(sim, f"{key}_ms")[both], getattr(meas, f"{key}_ms")[both]
        keep = (s > 0) & (m > 0)
        ax.scatter(m[keep], s[keep], s=6, alpha=0.5)
        if keep.any():
            low, high = min(m[keep].min(), s[keep].min()), max(m[keep].max(), s[keep].max())
            ax.plot([low, high], [low, high], color="black", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"simulated {label}")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path
