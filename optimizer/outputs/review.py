"""The capacity review: the numbers a reviewer asks for, as Markdown and HTML.

How many GPUs this traffic needs at these SLOs, the headroom left at the current rate, what
limits the best config (compute, KV cache or queueing), the gain over the engine defaults,
the fleet (the router simulated, each replica's share, and what failures cost when the
study declares them), and the plots. The document is built once as a list of blocks and rendered twice, so the
Markdown and HTML never disagree.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optimizer.outputs.exports import Deployment
from policies.config import KNOBS, PolicyConfig, active_fleet_knobs, inert_knobs
from policies.result import SimResult
from studies.slo import SLOSet

# Thresholds of the limit diagnosis. A KV-bound run preempts or rejects for memory; a
# compute-bound one keeps the GPU busy; a queueing one waits although neither is exhausted.
BUSY_HIGH = 0.85  # engine busy fraction of the window
KV_PEAK_HIGH = 0.95  # KV high-water fraction
PREEMPTION_HIGH = 0.05  # preemptions per accepted request
KV_REJECT_HIGH = 0.01  # fraction of offered requests rejected for memory
QUEUE_SHARE_HIGH = 0.5  # mean queue time / mean TTFT
KV_REJECT_REASONS = ("kv_high_water", "exceeds_capacity", "max_preemptions")


# -- what limits a config -----------------------------------------------------------------------


@dataclass(frozen=True)
class LoadSignals:
    """The saturation signals of one run, each a fraction."""

    busy_fraction: float  # summed step time / (window x replicas)
    kv_peak_fraction: float
    preemption_rate: float  # per accepted request
    kv_reject_fraction: float  # memory-related rejects / offered
    queue_share: float  # mean queue time / mean TTFT

    @classmethod
    def of(cls, result: SimResult, report: Mapping[str, Any]) -> LoadSignals:
        """From a simulation and its report (``Report.to_dict()``)."""
        window = _num(report.get("duration_s"))
        offered = _num(report.get("n_offered"))
        reasons = report.get("reject_reasons") or {}
        kv_rejects = sum(reasons.get(r, 0) for r in KV_REJECT_REASONS)
        return cls(
            busy_fraction=_ratio(result.busy_s, window * simulated_replicas(result)),
            kv_peak_fraction=_num(report.get("kv_peak_fraction")),
            preemption_rate=_num(report.get("preemption_rate"), 0.0),
            kv_reject_fraction=_ratio(kv_rejects, offered),
            queue_share=_ratio(_num(report.get("mean_queue_ms")), _num(report.get("mean_ttft_ms"))),
        )


@dataclass(frozen=True)
class Diagnosis:
    """The resource that limits a config ("kv", "compute", "queueing" or "none") and why."""

    limit: str
    summary: str
    evidence: tuple[str, ...]


def diagnose(s: LoadSignals) -> Diagnosis:
    """Name the limit. KV comes first: preemption recompute also inflates the busy fraction."""
    evidence = (
        f"engine busy {_pct(s.busy_fraction)} of the window (high at >= {BUSY_HIGH:.0%})",
        f"KV high-water {_pct(s.kv_peak_fraction)} (high at >= {KV_PEAK_HIGH:.0%})",
        f"{_fmt(s.preemption_rate, 3)} preemptions per accepted request (high at >= {PREEMPTION_HIGH:g})",
        f"{_pct(s.kv_reject_fraction)} of requests rejected for KV memory (high at >= {KV_REJECT_HIGH:.0%})",
        f"queueing is {_pct(s.queue_share)} of mean TTFT (dominant at >= {QUEUE_SHARE_HIGH:.0%})",
    )
    kv_full = _ge(s.kv_peak_fraction, KV_PEAK_HIGH)
    if _ge(s.preemption_rate, PREEMPTION_HIGH) or _ge(s.kv_reject_fraction, KV_REJECT_HIGH) or (
            kv_full and _ge(s.queue_share, QUEUE_SHARE_HIGH)):
        return Diagnosis("kv", "KV-bound: the KV cache is full, so requests are preempted, rejected or "
                               "wait for memory. More KV memory (GPU memory utilisation, TP, smaller "
                               "reservations) or fewer concurrent sequences helps.", evidence)
    if _ge(s.busy_fraction, BUSY_HIGH):
        return Diagnosis("compute", "Compute-bound: the GPUs are busy almost all the time; only more or "
                                    "faster GPUs (or shorter outputs) raise goodput.", evidence)
    if _ge(s.queue_share, QUEUE_SHARE_HIGH):
        return Diagnosis("queueing", "Queueing-bound: requests spend most of their TTFT waiting although "
                                     "compute and KV have room; the batch caps (token budget, max sequences) "
                                     "or arrival bursts hold them back.", evidence)
    return Diagnosis("none", "Not saturated: compute, KV and queueing all have room at this rate.", evidence)


def routing_label(config: PolicyConfig, replicas: int) -> str:
    """How a fleet of ``replicas`` routes under ``config``: the router simulated and the
    fleet knobs that act with it."""
    if replicas <= 1:
        return "one replica, no routing"
    settings = [f"{k}={_show(getattr(config, k))}" for k in active_fleet_knobs(config) if k != "router"]
    return f"{config.router} router" + (f" ({', '.join(settings)})" if settings else "")


def simulated_replicas(result: SimResult) -> int:
    """Replicas the run simulated: the fleet's per-replica figures, else the highest replica a
    request finished on (at least 1)."""
    if len(result.replica_routed):
        return len(result.replica_routed)
    return max(1, int(result.replica.max()) + 1) if len(result.replica) else 1


# -- how many GPUs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Capacity:
    """How much traffic a config serves at the target SLO attainment, and on how many GPUs.

    ``max_rate_scale`` multiplies the trace's arrival rate (1.0 = the trace as given), as
    measured on ``replicas`` replicas of TP ``tp``; ``capped`` says the search stopped at
    its upper bound, so the true capacity is higher. The GPUs needed are not that rate
    scaled: they are the fewest replicas whose simulated fleet meets the target
    (``sized``, ``optimizer.robust.fleetsize``); None where no sizing ran.
    """

    max_rate_scale: float
    trace_rps: float
    replicas: int = 1
    tp: int = 1
    capped: bool = False
    sized: Any = None  # optimizer.robust.answer.Sizing

    @property
    def max_rps(self) -> float:
        return self.max_rate_scale * self.trace_rps

    @property
    def headroom(self) -> float:
        """Extra traffic the replicas absorb before attainment falls below target (-1..inf)."""
        return self.max_rate_scale - 1.0

    @property
    def replicas_needed(self) -> int | None:
        """Replicas the simulated fleet needs for the target; None if out of reach or not sized."""
        return None if self.sized is None else self.sized.deploy.replicas

    @property
    def gpus_needed(self) -> int | None:
        replicas = self.replicas_needed
        return None if replicas is None else replicas * self.tp

    @property
    def gpus(self) -> int:
        return self.replicas * self.tp


# -- the document -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigFigures:
    """What the review shows for one config: its knobs, report, capacity and limit."""

    name: str
    config: PolicyConfig
    report: Mapping[str, Any]
    capacity: Capacity | None = None
    diagnosis: Diagnosis | None = None
    trial: int | None = None
    diagnosed_at_rps: float | None = None  # arrival rate of the run the diagnosis comes from


@dataclass(frozen=True)
class FleetPoint:
    """The best feasible trial at one GPU count of a fleet search."""

    gpus: int
    tp: int
    replicas: int
    weighted_goodput: float
    slo_attainment: float
    trial: int
    pareto: bool  # more goodput than every smaller GPU count
    gain: float | None = None  # goodput / the best smaller GPU count's - 1 (None at the smallest)
    router: str = "round_robin"  # the trial's router (acts only with more than one replica)


@dataclass(frozen=True)
class ReviewInputs:
    title: str
    deployment: Deployment
    slos: SLOSet
    target_attainment: float
    trace_description: str
    best: ConfigFigures
    baselines: Sequence[ConfigFigures] = ()
    objectives: Sequence[tuple[str, float, str]] = ()  # (name, value, direction) of the best trial
    plots: Mapping[str, str] = field(default_factory=dict)  # caption -> relative PNG path
    notes: Sequence[str] = ()
    fleet_front: Sequence[FleetPoint] = ()  # best trial per GPU count, when the study searched the fleet
    failures: str | None = None  # the study's failure plan, described
    answer: Sequence[str] = ()  # what to deploy, with its ranges (optimizer.robust.deploy.answer_lines)


Block = tuple[str, Any]  # ("h1" | "h2" | "p" | "ul" | "table" | "img", payload)

_COMPARED = (("weighted_goodput", "weighted goodput (/s)", 3), ("request_goodput", "request goodput (req/s)", 3),
             ("slo_attainment", "SLO attainment", None), ("p99_ttft_ms", "p99 TTFT (ms)", 0),
             ("p99_tpot_ms", "p99 TPOT (ms)", 1), ("rejected_fraction", "rejected", None),
             ("kv_peak_fraction", "KV high-water", None), ("kv_mean_fraction", "KV mean level", None),
             ("preemption_rate", "preemptions / request", 3), ("p99_step_ms", "p99 step time (ms)", 1),
             ("goodput_window_min", "worst-window goodput (req/s)", 3),
             ("prefill_time_saved_s", "prefill time saved by the prefix cache (s)", 1))


def build_review(r: ReviewInputs) -> list[Block]:
    """The review as blocks, in reading order."""
    d = r.deployment
    best = r.best
    blocks: list[Block] = [
        ("h1", r.title),
        ("p", f"Traffic: {r.trace_description}. Model {d.model} on {d.gpu.upper()}, "
              f"{d.replicas} replica(s) x TP {d.tp} = {d.gpus} GPU(s)"
              + "".join(f", {label} {v}" for label, v in (("expert parallel", d.moe_ep),
                                                          ("attention DP groups", d.attention_dp)) if v > 1)
              + (f", {routing_label(best.config, d.replicas)}" if d.replicas > 1 else "")
              + (f", failures: {r.failures}" if r.failures else "")
              + f". SLOs: {r.slos.describe()}. Target: SLO attainment >= {r.target_attainment:.0%}."),
    ]
    if r.answer:
        blocks += [("h2", "What to deploy"), ("ul", list(r.answer))]
    blocks += [
        ("h2", "How many GPUs"),
        ("p", "GPUs needed: the fewest replicas whose fleet, simulated behind the engine's own router on the whole "
              "trace at its rate, keeps SLO attainment at the target; the larger of the tuning and held-out parts' "
              "counts sizes the deployment. Max rate and headroom are of the simulated deployment."),
        ("table", _capacity_table([best, *r.baselines])),
    ]
    if best.capacity is not None:
        blocks.append(("p", _capacity_sentence(best.name, best.capacity, r.target_attainment)))
    if r.fleet_front:
        blocks += [("h2", "Goodput vs GPUs"),
                   ("p", "The best feasible config the search found at each GPU count (replicas x TP, "
                         "behind the router it chose). Pareto-optimal counts buy more goodput than every smaller one; "
                         "\"vs fewer GPUs\" says how much, against the best smaller count."),
                   ("table", _front_table(r.fleet_front))]
    blocks.append(("h2", "What limits the best config"))
    if best.diagnosis is not None:
        where = "" if best.diagnosed_at_rps is None else f"At {_fmt(best.diagnosed_at_rps, 3)} req/s (its capacity): "
        blocks += [("p", where + best.diagnosis.summary), ("ul", list(best.diagnosis.evidence))]
    else:
        blocks.append(("p", "No load signals were recorded for the best config."))
    blocks += [("h2", "Gain over the engine defaults"), ("table", _comparison_table(best, r.baselines))]
    blocks += [("p", line) for line in _gain_sentences(best, r.baselines)]
    if r.objectives:
        blocks.append(("p", "Objectives of the best trial: " + "; ".join(
            f"{name} = {_fmt(value, 4)} ({direction})" for name, value, direction in r.objectives) + "."))
    blocks += _fleet_blocks(best, r.baselines)
    changed = _changed_knobs(best, r.baselines, r.deployment.replicas)
    blocks += [("h2", "Best config"), ("table", changed)]
    if r.notes:
        blocks += [("h2", "Notes"), ("ul", list(r.notes))]
    if r.plots:
        blocks.append(("h2", "Plots"))
        blocks += [("img", (caption, path)) for caption, path in r.plots.items()]
    return blocks


def _capacity_table(rows: Sequence[ConfigFigures]) -> list[list[str]]:
    table = [["config", "max rate (req/s)", "headroom at trace rate", "GPUs needed", "tuning / held-out part",
              "limit"]]
    for f in rows:
        c = f.capacity
        if c is None:
            table.append([f.name, "n/a", "n/a", "n/a", "n/a", f.diagnosis.limit if f.diagnosis else "n/a"])
            continue
        more = "+" if c.capped else ""
        gpus = c.gpus_needed
        table.append([
            f.name,
            f"{_fmt(c.max_rps, 3)}{more}",
            f"{c.headroom:+.0%}{more}",
            ("not sized" if c.sized is None else "target out of reach" if gpus is None
             else f"{gpus} ({c.replicas_needed} x TP {c.tp})" + _spread(c.sized)),
            "n/a" if c.sized is None else " / ".join(
                _sized_at(s) for s in (c.sized.tuning, c.sized.holdout) if s is not None),
            f.diagnosis.limit if f.diagnosis else "n/a",
        ])
    return table


def _spread(sizing) -> str:
    low, high = sizing.replicas.low, sizing.replicas.high
    if low == high:
        return ""
    return f", range {low:.0f}-{'out of reach' if math.isinf(high) else f'{high:.0f}'} replicas"


def _sized_at(size) -> str:
    if size.replicas is None:
        return f"> {size.max_replicas}"
    return f"{size.replicas} ({_pct(size.attainment)})"


def _front_table(points: Sequence[FleetPoint]) -> list[list[str]]:
    table = [["GPUs", "replicas x TP", "router", "weighted goodput (/s)", "vs fewer GPUs", "SLO attainment", "trial",
              "Pareto-optimal"]]
    for p in points:
        table.append([str(p.gpus), f"{p.replicas} x TP {p.tp}", p.router if p.replicas > 1 else "-",
                      _fmt(p.weighted_goodput, 3),
                      "-" if p.gain is None else f"{p.gain:+.1%}", _pct(p.slo_attainment), str(p.trial),
                      "yes" if p.pareto else "no"])
    return table


_FAILURE_ROWS = (("failure_windows", "failure windows", "{:,}"), ("failure_affected", "requests re-routed", "{:,}"),
                 ("reprefill_tokens", "re-prefill tokens", "{:,}"),
                 ("goodput_during_failures", "goodput during failures (req/s)", "{:.3f}"),
                 ("goodput_after_failures", "goodput after recovery (req/s)", "{:.3f}"))


def _fleet_blocks(best: ConfigFigures, baselines: Sequence[ConfigFigures]) -> list[Block]:
    """The fleet section (runs of the fleet kernel only): each replica's share under the best
    config, and what failures cost."""
    per_replica = best.report.get("per_replica") or {}
    if not per_replica and not best.report.get("failure_windows"):
        return []
    blocks: list[Block] = [("h2", "Fleet")]
    if per_replica:
        blocks.append(("p", f"{best.name} behind the {routing_label(best.config, len(per_replica))}: what each "
                            "replica received and served."))
        table = [["replica", "requests routed", "finished there", "prefix hit rate", "KV high-water"]]
        table += [[j, f"{e['routed']:,}", f"{e['finished']:,}", _pct(_num(e.get("prefix_hit_rate"))),
                   _pct(_num(e.get("kv_peak_fraction")))] for j, e in per_replica.items()]
        blocks.append(("table", table))
    if best.report.get("failure_windows"):
        rows = [best, *baselines]
        table = [["failures", *[f.name for f in rows]]]
        for key, label, fmt in _FAILURE_ROWS:
            table.append([label, *["n/a" if f.report.get(key) is None else fmt.format(f.report[key]) for f in rows]])
        blocks += [("p", "Requests on a failed replica are re-routed and prefilled again from scratch; goodput "
                         "during failures counts good requests finishing while a replica is down, after recovery "
                         "those finishing once every replica is back."), ("table", table)]
    return blocks


def _capacity_sentence(name: str, c: Capacity, target: float) -> str:
    gpus = c.gpus_needed
    if c.sized is not None and gpus is None:
        return (f"{name} does not reach {target:.0%} SLO attainment with up to {c.sized.deploy.max_replicas} "
                "simulated replicas: the SLOs are tighter than one request's latency on this hardware.")
    bound = "at least " if c.capped else ""
    if c.headroom >= 0:
        state = f"it has {bound}{c.headroom:.0%} headroom: traffic can grow to {bound}{_fmt(c.max_rps, 3)} req/s"
    else:
        state = (f"it is over capacity: attainment holds only up to {_fmt(c.max_rps, 3)} req/s, "
                 f"{-c.headroom:.0%} below the trace rate")
    if gpus is None:
        return f"On the simulated {c.gpus} GPU(s) {state}."
    return (f"With {name}, this traffic needs {gpus} GPU(s) ({c.replicas_needed} replica(s) x TP "
            f"{c.tp}) to keep SLO attainment >= {target:.0%} in a simulated fleet (sized on the "
            f"{c.sized.sized_on}); on the simulated {c.gpus} GPU(s) {state}.")


def _comparison_table(best: ConfigFigures, baselines: Sequence[ConfigFigures]) -> list[list[str]]:
    table = [["metric", best.name, *[b.name for b in baselines]]]
    table.append(["GPUs (replicas x TP)", *[
        "n/a" if f.capacity is None else f"{f.capacity.gpus} ({f.capacity.replicas} x TP {f.capacity.tp})"
        for f in (best, *baselines)]])
    for key, label, digits in _COMPARED:
        fmt = _pct if digits is None else (lambda v, k=digits: _fmt(v, k))
        table.append([label, *[fmt(_num(f.report.get(key))) for f in (best, *baselines)]])
    return table


def _gain_sentences(best: ConfigFigures, baselines: Sequence[ConfigFigures]) -> list[str]:
    mine = _num(best.report.get("weighted_goodput"))
    lines = []
    for b in baselines:
        theirs = _num(b.report.get("weighted_goodput"))
        gain = gain_ratio(mine, theirs)
        gpus = ""
        if best.capacity is not None and b.capacity is not None and best.capacity.gpus != b.capacity.gpus:
            gpus = f" on {best.capacity.gpus} vs {b.capacity.gpus} GPUs"
        if gain is None:
            lines.append(f"{b.name} has no goodput on this trace; {best.name} delivers {_fmt(mine, 3)}/s{gpus}.")
        else:
            lines.append(f"Weighted goodput {gain:+.1%} over {b.name} ({_fmt(mine, 3)} vs {_fmt(theirs, 3)}/s{gpus}).")
    return lines


def gain_ratio(value: float, baseline: float) -> float | None:
    """Relative gain value/baseline - 1; None when the baseline is zero or unknown."""
    if not (math.isfinite(value) and math.isfinite(baseline)) or baseline == 0:
        return None
    return value / baseline - 1.0


def _changed_knobs(best: ConfigFigures, baselines: Sequence[ConfigFigures], replicas: int) -> list[list[str]]:
    """Knobs whose best value differs from at least one baseline (policy.toml has them all)."""
    table = [["knob", best.name, *[b.name for b in baselines]]]
    # the best's own fleet when its capacity was measured, else the deployment's
    inert = inert_knobs(best.config, best.capacity.replicas if best.capacity is not None else replicas)
    for knob in KNOBS:
        if knob.name in inert:
            continue  # it changes nothing under the recommendation
        value = getattr(best.config, knob.name)
        others = [getattr(b.config, knob.name) for b in baselines]
        if not others or any(o != value for o in others):
            table.append([knob.name, _show(value), *[_show(o) for o in others]])
    return table


# -- rendering ----------------------------------------------------------------------------------


def to_markdown(blocks: Sequence[Block]) -> str:
    out = []
    for kind, payload in blocks:
        if kind == "h1":
            out.append(f"# {payload}")
        elif kind == "h2":
            out.append(f"## {payload}")
        elif kind == "p":
            out.append(payload)
        elif kind == "ul":
            out.append("\n".join(f"- {item}" for item in payload))
        elif kind == "table":
            head, *rows = payload
            lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
            out.append("\n".join(lines))
        elif kind == "img":
            caption, path = payload
            out.append(f"![{caption}]({path})")
    return "\n\n".join(out) + "\n"


def to_html(blocks: Sequence[Block]) -> str:
    e = html.escape
    title = next((payload for kind, payload in blocks if kind == "h1"), "capacity review")
    body = []
    for kind, payload in blocks:
        if kind in ("h1", "h2", "p"):
            body.append(f"<{kind}>{e(payload)}</{kind}>")
        elif kind == "ul":
            body.append("<ul>" + "".join(f"<li>{e(item)}</li>" for item in payload) + "</ul>")
        elif kind == "table":
            head, *rows = payload
            cells = "".join(f"<th>{e(c)}</th>" for c in head)
            trs = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
            body.append(f"<table><thead><tr>{cells}</tr></thead><tbody>{trs}</tbody></table>")
        elif kind == "img":
            caption, path = payload
            body.append(f'<figure><img src="{e(path)}" alt="{e(caption)}"><figcaption>{e(caption)}'
                        "</figcaption></figure>")
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.4}"
             "table{border-collapse:collapse}td,th{border:1px solid #bbb;padding:.2em .6em;text-align:left}"
             "img{max-width:100%}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{e(title)}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_review(directory: str | Path, inputs: ReviewInputs) -> tuple[Path, Path]:
    """Write capacity-review.md and capacity-review.html into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    blocks = build_review(inputs)
    md, page = directory / "capacity-review.md", directory / "capacity-review.html"
    md.write_text(to_markdown(blocks))
    page.write_text(to_html(blocks))
    return md, page


# -- formatting ---------------------------------------------------------------------------------


def _num(value: Any, default: float = math.nan) -> float:
    """Report values arrive as JSON (None for NaN); turn them back into floats."""
    return default if value is None else float(value)


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den and math.isfinite(den) else math.nan


def _ge(value: float, threshold: float) -> bool:
    return math.isfinite(value) and value >= threshold


def _fmt(value: float, digits: int) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:,.{digits}f}"


def _pct(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{100 * value:.1f}%"


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|")
