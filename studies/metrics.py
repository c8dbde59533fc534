"""Score a simulated run: goodput and the latency, load and memory figures around it.

Goodput follows ``vllm bench serve --goodput``: a request is good only if it FINISHED and
meets every configured bound of its SLO class (``metric <= bound``); TTFT = first token −
arrival, E2E = finish − arrival, TPOT = (E2E − TTFT)/(n − 1) and 0 when n ≤ 1 (n = tokens
generated). Rejected, failed, timed-out and cancelled requests are never good. A configured
bound whose metric is NaN (no first token recorded) is not met.

Two windows (issue 16). Offered and accepted load are over the trace's arrival window,
first to last arrival (``arrival_window_s``): it is the same under every policy, and
accepted + rejected = offered holds on it (``accepted_rps = offered_rps * (1 -
rejected_fraction)``). Everything a policy delivers (throughput, goodput, per-tenant and
per-class rates, Little's law) is over the run window ``duration_s``, first arrival to the
last end time of any request, so those rates add up among themselves. Goodput is also
given per fixed window of ``goodput_window_s`` seconds tiling the run window from the
first arrival (the last one may be shorter): ``goodput_windows`` lists each window's good
requests finishing in it per second of it, so their length-weighted mean is
``request_goodput``; ``goodput_window_min`` / ``_p10`` are over the full-length windows
only (NaN when the run is shorter than one window). Rates over an empty window are 0;
fractions with nothing to divide by are NaN (``None`` in ``to_dict``). Latency
percentiles are over finished requests, NumPy's linear interpolation; TPOT percentiles,
as in vLLM bench, only over finished requests with more than one output token.

A fleet run (issue 8) adds failure figures and one entry per replica. Failure windows are
half-open [down, up): goodput during failures counts good requests finishing inside any
window, per second of the windows' union within the run window; goodput after failures
counts good requests finishing at or after the last recovery, per second from it to the
run's end (NaN when a replica never came back before the end). Requests finishing between
two windows count in neither.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import PurePath
from typing import Any

import numpy as np

from policies.result import STEP_HIST_BINS, Reject, SimResult, State, step_time_bin_values
from studies.slo import SLOSet
from studies.traces import Trace

LATENCY_METRICS = ("ttft", "tpot", "e2el", "queue")
PERCENTILES = (50, 90, 99)
STEP_PERCENTILES = (50, 95, 99)
GOODPUT_WINDOW_S = 10.0  # default length of the fixed goodput windows


@dataclass(frozen=True)
class Report:
    """The figures of one scored run; flat so the tuner and exports read them by name."""

    n_offered: int
    n_accepted: int
    n_rejected: int
    n_finished: int
    n_timed_out: int
    n_cancelled: int
    n_failed: int
    n_good: int
    duration_s: float
    offered_rps: float
    accepted_rps: float
    rejected_fraction: float
    request_throughput: float
    output_throughput: float
    request_goodput: float
    token_goodput: float
    weighted_goodput: float
    slo_attainment: float
    mean_ttft_ms: float
    p50_ttft_ms: float
    p90_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    p50_tpot_ms: float
    p90_tpot_ms: float
    p99_tpot_ms: float
    mean_e2el_ms: float
    p50_e2el_ms: float
    p90_e2el_ms: float
    p99_e2el_ms: float
    mean_queue_ms: float
    p50_queue_ms: float
    p90_queue_ms: float
    p99_queue_ms: float
    kv_peak_fraction: float
    preemptions: int
    preemption_rate: float
    prefix_tokens_saved: int
    prefix_hit_rate: float
    out_of_range_steps: int
    reject_reasons: dict[str, int]
    per_tenant: dict[str, dict[str, Any]]
    jain_index: float
    per_class: dict[str, dict[str, Any]]
    # speculative decoding (NaN / 0 when it is off): drafts verified per decode, tokens per
    # verify that checked at least one draft (bonus + accepted), drafts rejected or past the
    # output's end, and output tokens per engine step
    mean_verify_budget: float = math.nan
    mean_accepted_length: float = math.nan
    verify_tokens_wasted: int = 0
    tokens_per_step: float = math.nan
    # fleet (issue 8); 0 / NaN / {} for a single-replica run without failures
    failure_windows: int = 0
    failure_affected: int = 0  # requests withdrawn from a failed replica at least once
    reprefill_tokens: int = 0  # tokens whose KV a failure destroyed and that were computed again
    goodput_during_failures: float = math.nan  # good requests per second, see the module docstring
    goodput_after_failures: float = math.nan
    # per replica index: routed, finished, prefix_hit_rate, kv_peak_blocks, kv_peak_fraction
    per_replica: dict[str, dict[str, Any]] = field(default_factory=dict)
    # issue 16: a complete report; windows as in the module docstring
    arrival_window_s: float = 0.0  # first to last arrival: the window of offered_rps / accepted_rps
    n_truncated: int = 0  # finished before their true output length: a cap (max_tokens, model length) ended them
    prefill_time_saved_s: float = 0.0  # lone-prefill seconds the prefix-cache hits saved (SimResult's)
    # step times: mean exact (busy / steps); percentiles from the kernel's log-spaced histogram,
    # each within STEP_HIST_REL_ERROR (1.8%) of the true step-time percentile
    mean_step_ms: float = math.nan
    p50_step_ms: float = math.nan
    p95_step_ms: float = math.nan
    p99_step_ms: float = math.nan
    # KV blocks used / capacity over time: the sampled series, each sample held until the next
    kv_mean_fraction: float = math.nan
    kv_p50_fraction: float = math.nan
    kv_p95_fraction: float = math.nan
    migrations: int = 0  # fleet: running requests moved with their KV
    handoffs: int = 0  # fleet P/D: prefill -> decode transfers
    # LoRA adapters (issue 16 part 1): loads onto a GPU (of them, read from disk first) and the
    # seconds those loads added to steps, summed over replicas
    adapter_loads: int = 0
    adapter_disk_loads: int = 0
    adapter_load_s: float = 0.0
    goodput_window_s: float = GOODPUT_WINDOW_S
    goodput_windows: list[float] = field(default_factory=list)  # good requests per second, per window
    goodput_window_min: float = math.nan
    goodput_window_p10: float = math.nan
    # Little's law over the run window: L = time-average of running + waiting (series) against
    # lambda * W = summed time in system (arrival to end) of every ended request / window;
    # gap = L / (lambda W) - 1 (see ``_littles_law``)
    mean_in_system: float = math.nan
    littles_law_lw: float = math.nan
    littles_law_gap: float = math.nan
    # activation workspace (policies.workspace): the most tokens one step computed, and the
    # start of the first step that computed that many (NaN: no step)
    peak_step_tokens: int = 0
    peak_step_s: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable values; NaN becomes ``None``."""
        return json_safe(asdict(self))

    def summary_rows(self) -> list[tuple[str, str, str]]:
        """(section, label, formatted value) rows of the key figures, for a console table."""
        rows = [
            ("load", "offered / accepted / rejected",
             f"{self.n_offered:,} / {self.n_accepted:,} / {self.n_rejected:,} ({_pct(self.rejected_fraction)})"),
            ("load", "finished/timed out/cancelled/failed",
             f"{self.n_finished:,} / {self.n_timed_out:,} / {self.n_cancelled:,} / {self.n_failed:,}"),
            ("load", "arrival / run window (s)", f"{_num(self.arrival_window_s, 1)} / {_num(self.duration_s, 1)}"),
            ("load", "offered / accepted rate (req/s)", f"{_num(self.offered_rps, 3)} / {_num(self.accepted_rps, 3)}"),
            ("load", "truncated by max_tokens / model length",
             f"{self.n_truncated:,} ({_pct(_ratio(self.n_truncated, self.n_finished))} of finished)"),
            ("load", "Little's law L / lambda*W (gap)",
             f"{_num(self.mean_in_system, 2)} / {_num(self.littles_law_lw, 2)} ({_pct(self.littles_law_gap)})"),
            ("goodput", "request goodput (req/s)", _num(self.request_goodput, 3)),
            ("goodput", f"per {self.goodput_window_s:g} s window min / p10 (req/s)",
             f"{_num(self.goodput_window_min, 3)} / {_num(self.goodput_window_p10, 3)}"),
            ("goodput", "token goodput (tok/s)", _num(self.token_goodput, 1)),
            ("goodput", "weighted goodput (/s)", _num(self.weighted_goodput, 3)),
            ("goodput", "SLO attainment", f"{self.n_good:,} good, {_pct(self.slo_attainment)}"),
            ("goodput", "request throughput (req/s)", _num(self.request_throughput, 3)),
            ("goodput", "output throughput (tok/s)", _num(self.output_throughput, 1)),
        ]
        for metric in LATENCY_METRICS:
            values = [getattr(self, f"{stat}_{metric}_ms") for stat in ("mean", "p50", "p90", "p99")]
            rows.append(("latency", f"{metric.upper()} ms mean/p50/p90/p99",
                         " / ".join(_num(v, 1 if abs(v) < 100 else 0) for v in values)))
        rows += [
            ("latency", "step ms mean/p50/p95/p99", " / ".join(
                _num(v, 2) for v in (self.mean_step_ms, self.p50_step_ms, self.p95_step_ms, self.p99_step_ms))),
            ("memory", "KV high-water", _pct(self.kv_peak_fraction)),
            ("memory", "KV level mean / p50 / p95", " / ".join(
                _pct(v) for v in (self.kv_mean_fraction, self.kv_p50_fraction, self.kv_p95_fraction))),
            ("memory", "preemptions", f"{self.preemptions:,} ({_num(self.preemption_rate, 3)} per accepted)"),
            ("memory", "prefix tokens saved", f"{self.prefix_tokens_saved:,} ({_pct(self.prefix_hit_rate)} of prompts)"),
            ("memory", "prefill time saved by the cache (s)", _num(self.prefill_time_saved_s, 3)),
            ("fairness", "Jain index over tenants (weighted)", _num(self.jain_index, 3)),
        ]
        reasons = ", ".join(f"{name} {count:,}" for name, count in self.reject_reasons.items())
        rows.append(("rejects", "reject reasons", reasons or "none"))
        if self.verify_tokens_wasted or self.mean_verify_budget > 0:
            rows.append(("speculation", "verify budget / accepted length / wasted",
                         f"{_num(self.mean_verify_budget, 2)} / {_num(self.mean_accepted_length, 2)} / "
                         f"{self.verify_tokens_wasted:,} tokens"))
        if self.failure_windows:
            rows += [
                ("failures", "windows / requests affected / re-prefill tokens",
                 f"{self.failure_windows:,} / {self.failure_affected:,} / {self.reprefill_tokens:,}"),
                ("failures", "goodput during / after failures (req/s)",
                 f"{_num(self.goodput_during_failures, 3)} / {_num(self.goodput_after_failures, 3)}"),
            ]
        if self.migrations or self.handoffs:
            rows.append(("replicas", "migrations / P/D hand-offs", f"{self.migrations:,} / {self.handoffs:,}"))
        if self.adapter_loads:
            rows.append(("adapters", "LoRA loads (from disk) / time they cost (s)",
                         f"{self.adapter_loads:,} ({self.adapter_disk_loads:,}) / {_num(self.adapter_load_s, 3)}"))
        for j, entry in self.per_replica.items():
            rows.append(("replicas", f"replica {j}: routed / finished / prefix hit / KV peak",
                         f"{entry['routed']:,} / {entry['finished']:,} / {_pct(entry['prefix_hit_rate'])} / "
                         f"{_pct(entry['kv_peak_fraction'])}"))
        if self.out_of_range_steps:
            rows.append(("warning", "steps outside the profiled range", f"{self.out_of_range_steps:,}"))
        return rows


def request_latencies(result: SimResult, trace: Trace) -> dict[str, np.ndarray]:
    """Per-request TTFT, TPOT, E2E and queue time in ms (NaN where the event never happened)."""
    ttft = (result.first_token_s - trace.arrival_s) * 1e3
    e2el = (result.finish_s - trace.arrival_s) * 1e3
    n = result.tokens_generated
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(n > 1, (e2el - ttft) / np.maximum(n - 1, 1), 0.0)
    return {"ttft": ttft, "tpot": tpot, "e2el": e2el, "queue": result.queue_s * 1e3}


def good_requests(result: SimResult, trace: Trace, slos: SLOSet) -> np.ndarray:
    """Boolean mask: finished and within every configured bound of the request's SLO class."""
    bounds, _ = class_table(trace, slos)
    return _good(result, request_latencies(result, trace), bounds[trace.slo_class])


def score(result: SimResult, trace: Trace, slos: SLOSet, *, goodput_window_s: float = GOODPUT_WINDOW_S) -> Report:
    """The goodput report of ``result``, a simulation of ``trace``, against ``slos``;
    goodput is also given per window of ``goodput_window_s`` seconds (module docstring)."""
    if not goodput_window_s > 0:
        raise ValueError(f"goodput_window_s must be > 0, got {goodput_window_s}")
    _check(result, trace)
    n = trace.n
    state = result.state
    finished = state == State.FINISHED
    rejected = state == State.REJECTED
    lat = request_latencies(result, trace)
    bounds, weights = class_table(trace, slos)
    good = _good(result, lat, bounds[trace.slo_class])
    request_weight = weights[trace.slo_class]
    generated = result.tokens_generated

    duration = _window(result, trace)
    arrivals = _arrival_window(trace)
    n_rejected = int(rejected.sum())
    n_accepted = n - n_rejected
    n_good = int(good.sum())
    preemptions = int(result.preemptions.sum())
    saved = int(result.cached_prompt_tokens.sum())
    looked_up = int(trace.prompt_tokens[np.isfinite(result.queue_s)].sum())

    latency_fields = {}
    for metric in LATENCY_METRICS:
        values = _latency_sample(metric, lat, finished, generated)
        latency_fields[f"mean_{metric}_ms"] = float(values.mean()) if len(values) else math.nan
        for q, v in zip(PERCENTILES, _percentiles(values, PERCENTILES), strict=True):
            latency_fields[f"p{q}_{metric}_ms"] = v

    per_tenant, jain = _tenants(result, trace, finished, good, duration)
    return Report(
        n_offered=n,
        n_accepted=n_accepted,
        n_rejected=n_rejected,
        n_finished=int(finished.sum()),
        n_timed_out=int((state == State.TIMED_OUT).sum()),
        n_cancelled=int((state == State.CANCELLED).sum()),
        n_failed=int((state == State.FAILED).sum()),
        n_good=n_good,
        duration_s=duration,
        offered_rps=_per_second(n, arrivals),
        accepted_rps=_per_second(n_accepted, arrivals),
        rejected_fraction=_ratio(n_rejected, n),
        request_throughput=_per_second(int(finished.sum()), duration),
        output_throughput=_per_second(int(generated[finished].sum()), duration),
        request_goodput=_per_second(n_good, duration),
        token_goodput=_per_second(int(generated[good].sum()), duration),
        weighted_goodput=_per_second(float(request_weight[good].sum()), duration),
        slo_attainment=_ratio(n_good, n),
        **latency_fields,
        kv_peak_fraction=_ratio(result.kv_peak_blocks, result.kv_capacity_blocks),
        preemptions=preemptions,
        preemption_rate=_ratio(preemptions, n_accepted),
        prefix_tokens_saved=saved,
        prefix_hit_rate=_ratio(saved, looked_up),
        out_of_range_steps=int(result.out_of_range_steps),
        reject_reasons=_reject_reasons(result, rejected),
        per_tenant=per_tenant,
        jain_index=jain,
        per_class=_classes(trace, slos, lat, finished, good, generated, request_weight, duration),
        mean_verify_budget=_ratio(result.spec_drafted_tokens, result.spec_decodes),
        mean_accepted_length=_ratio(result.spec_verifies + result.spec_accepted_tokens, result.spec_verifies),
        verify_tokens_wasted=int(result.spec_drafted_tokens - result.spec_accepted_tokens),
        tokens_per_step=_ratio(int(generated.sum()), result.steps),
        **_failures(result, trace, good, duration),
        arrival_window_s=arrivals,
        n_truncated=int((finished & (generated < trace.output_tokens)).sum()),
        prefill_time_saved_s=float(result.prefill_time_saved_s),
        **_step_times(result),
        **_kv_levels(result, _run_end(trace, duration)),
        migrations=int(result.migrations),
        handoffs=int(result.handoffs),
        adapter_loads=int(result.adapter_loads),
        adapter_disk_loads=int(result.adapter_disk_loads),
        adapter_load_s=float(result.adapter_load_s),
        **_goodput_windows(result, trace, good, duration, goodput_window_s),
        **_littles_law(result, trace, duration),
        per_replica=_replicas(result),
        peak_step_tokens=int(result.peak_step_tokens),
        peak_step_s=float(result.peak_step_s),
    )


# -- pieces ----------------------------------------------------------------------------------


def _check(result: SimResult, trace: Trace) -> None:
    """A result that does not belong to the trace, or breaks the SimResult contract, is an error."""
    per_request = ("state", "reject_reason", "first_token_s", "finish_s", "tokens_generated",
                   "preemptions", "cached_prompt_tokens", "queue_s")
    for name in per_request:
        size = len(getattr(result, name))
        if size != trace.n:
            raise ValueError(f"SimResult.{name} has {size} entries but the trace has {trace.n} requests")
    valid_states = np.array([s.value for s in State])
    bad = np.flatnonzero(~np.isin(result.state, valid_states))
    if len(bad):
        raise ValueError(f"request {bad[0]}: unknown state code {result.state[bad[0]]}")
    bad = np.flatnonzero((result.reject_reason < 0) | (result.reject_reason >= len(Reject)))
    if len(bad):
        raise ValueError(f"request {bad[0]}: unknown reject reason code {result.reject_reason[bad[0]]}")
    bad = np.flatnonzero((result.state == State.REJECTED) & (result.reject_reason == Reject.NONE))
    if len(bad):
        raise ValueError(f"request {bad[0]} is rejected without a reason")
    bad = np.flatnonzero((result.state == State.FINISHED) & ~np.isfinite(result.finish_s))
    if len(bad):
        raise ValueError(f"request {bad[0]} is finished but has no finish time")
    if len(result.step_time_hist) not in (0, STEP_HIST_BINS):
        raise ValueError(f"SimResult.step_time_hist has {len(result.step_time_hist)} bins; give "
                         f"{STEP_HIST_BINS} or none")
    _check_fleet(result, trace)


def _check_fleet(result: SimResult, trace: Trace) -> None:
    """The fleet fields: per-request ones empty or one per request, the rest consistent."""
    for name in ("reroutes", "reprefill_tokens"):
        size = len(getattr(result, name))
        if size not in (0, trace.n):
            raise ValueError(f"SimResult.{name} has {size} entries; give one per request ({trace.n}) or none")
    for group in (_FAILURE_FIELDS, _REPLICA_FIELDS):
        sizes = {name: len(getattr(result, name)) for name in group}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"SimResult fields {sizes} must have equal lengths")
    replicas = len(result.replica_routed)
    if replicas and result.n and result.replica.max() >= replicas:
        raise ValueError(f"SimResult.replica names replica {result.replica.max()} but per-replica "
                         f"fields cover {replicas}")


_FAILURE_FIELDS = ("failure_replica", "failure_down_s", "failure_up_s")
_REPLICA_FIELDS = ("replica_routed", "replica_prefix_hit_tokens", "replica_prefix_query_tokens",
                   "replica_kv_peak_blocks", "replica_kv_capacity_blocks")


def _failures(result: SimResult, trace: Trace, good: np.ndarray, duration: float) -> dict[str, Any]:
    """Failure figures (see the module docstring); NaN rates when the run had no failure."""
    figures = {
        "failure_windows": len(result.failure_down_s),
        "failure_affected": int((result.reroutes > 0).sum()),
        "reprefill_tokens": int(result.reprefill_tokens.sum()),
    }
    if not figures["failure_windows"] or trace.n == 0:
        return figures
    down, up = result.failure_down_s, result.failure_up_s
    start = float(trace.arrival_s[0])
    end = start + duration
    finish = result.finish_s[good]
    inside = ((finish[:, None] >= down) & (finish[:, None] < up)).any(axis=1)
    last_up = float(up.max())
    figures["goodput_during_failures"] = _per_second(int(inside.sum()), _union_length(down, up, start, end))
    figures["goodput_after_failures"] = (_per_second(int((finish >= last_up).sum()), end - last_up)
                                         if last_up < end else math.nan)
    return figures


def _union_length(down: np.ndarray, up: np.ndarray, start: float, end: float) -> float:
    """Length of the union of the intervals [down, up) clipped to [start, end]."""
    total, reach = 0.0, start
    for lo, hi in sorted(zip(np.clip(down, start, end), np.clip(up, start, end), strict=True)):
        if hi > reach:
            total += hi - max(lo, reach)
            reach = hi
    return total


def _replicas(result: SimResult) -> dict[str, dict[str, Any]]:
    replicas = len(result.replica_routed)
    finished = np.bincount(result.replica[result.replica >= 0], minlength=replicas)
    return {
        str(j): {
            "routed": int(result.replica_routed[j]),
            "finished": int(finished[j]),
            "prefix_hit_rate": _ratio(result.replica_prefix_hit_tokens[j], result.replica_prefix_query_tokens[j]),
            "kv_peak_blocks": int(result.replica_kv_peak_blocks[j]),
            "kv_peak_fraction": _ratio(result.replica_kv_peak_blocks[j], result.replica_kv_capacity_blocks[j]),
        }
        for j in range(replicas)
    }


def class_table(trace: Trace, slos: SLOSet) -> tuple[np.ndarray, np.ndarray]:
    """Bounds (k, 3) in ms and weights (k,) for each of the trace's SLO class codes."""
    classes = [slos.lookup(name) for name in trace.slo_class_names]
    bounds = np.array([c.bounds_ms for c in classes], dtype=np.float64).reshape(len(classes), 3)
    weights = np.array([c.weight for c in classes], dtype=np.float64)
    return bounds, weights


def _good(result: SimResult, lat: dict[str, np.ndarray], bounds: np.ndarray) -> np.ndarray:
    """Finished and every metric within its bound; ``bounds`` is (n, 3) ms, inf = unset."""
    good = result.state == State.FINISHED
    for j, metric in enumerate(("ttft", "tpot", "e2el")):
        good &= np.isinf(bounds[:, j]) | (lat[metric] <= bounds[:, j])
    return good


def _window(result: SimResult, trace: Trace) -> float:
    """The run window: first arrival to the last end time of any request (policy-dependent)."""
    if trace.n == 0:
        return 0.0
    ends = result.finish_s[np.isfinite(result.finish_s)]
    last = ends.max() if len(ends) else trace.arrival_s[-1]
    return max(float(last - trace.arrival_s[0]), 0.0)


def _arrival_window(trace: Trace) -> float:
    """The trace's arrival window, first to last arrival: the same under every policy."""
    return float(trace.arrival_s[-1] - trace.arrival_s[0]) if trace.n else 0.0


def _run_end(trace: Trace, duration: float) -> float:
    """When the run window ends on the trace clock."""
    return float(trace.arrival_s[0]) + duration if trace.n else 0.0


def _step_times(result: SimResult) -> dict[str, float]:
    """Mean step time (exact) and its percentiles read from the step-time histogram.

    A percentile q is the representative time (``policies.result.step_time_bin_values``)
    of the bin holding the step of rank ceil(q/100 * steps), so it is within
    ``STEP_HIST_REL_ERROR`` (1.8%) of the true nearest-rank percentile for steps inside
    the histogram's range (10 us to 100 s). NaN without steps or a histogram.
    """
    figures = {"mean_step_ms": _ratio(result.busy_s * 1e3, result.steps)}
    hist = result.step_time_hist
    total = int(hist.sum()) if len(hist) else 0
    cumulative = np.cumsum(hist)
    values_ms = step_time_bin_values() * 1e3
    for q in STEP_PERCENTILES:
        rank = max(1, math.ceil(q / 100 * total))
        figures[f"p{q}_step_ms"] = float(values_ms[np.searchsorted(cumulative, rank)]) if total else math.nan
    return figures


def _held_durations(t: np.ndarray, end: float) -> np.ndarray:
    """How long each series sample holds: until the next sample, the last one until ``end``."""
    return np.clip(np.diff(np.append(t, max(end, t[-1]))), 0.0, None)


def _weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The smallest value whose weight share at or below it reaches q percent."""
    order = np.argsort(values, kind="stable")
    share = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(share, q / 100 * share[-1])])


def _kv_levels(result: SimResult, end: float) -> dict[str, float]:
    """KV level over time: time-weighted mean, median and p95 of blocks used / capacity in
    the sampled series over the run window; NaN without samples or capacity."""
    names = ("kv_mean_fraction", "kv_p50_fraction", "kv_p95_fraction")
    if not len(result.series_t) or result.kv_capacity_blocks <= 0:
        return dict.fromkeys(names, math.nan)
    held = _held_durations(result.series_t, end)
    if held.sum() <= 0:
        return dict.fromkeys(names, math.nan)
    level = result.series_kv_blocks / result.kv_capacity_blocks
    mean = float((level * held).sum() / held.sum())
    return dict(zip(names, (mean, _weighted_percentile(level, held, 50), _weighted_percentile(level, held, 95)),
                    strict=True))


def _goodput_windows(result: SimResult, trace: Trace, good: np.ndarray, duration: float,
                     window_s: float) -> dict[str, Any]:
    """Goodput per fixed window tiling the run window from the first arrival (module
    docstring): good requests finishing in each window per second of it."""
    figures: dict[str, Any] = {"goodput_window_s": float(window_s), "goodput_windows": [],
                               "goodput_window_min": math.nan, "goodput_window_p10": math.nan}
    if duration <= 0:
        return figures
    count = max(1, math.ceil(duration / window_s - 1e-9))  # a rounding-sized tail joins the last window
    lengths = np.full(count, float(window_s))
    lengths[-1] = duration - window_s * (count - 1)
    offsets = result.finish_s[good] - trace.arrival_s[0]
    index = np.minimum((offsets // window_s).astype(np.int64), count - 1)  # the run's end is in the last
    rates = np.bincount(index, minlength=count) / lengths
    figures["goodput_windows"] = [float(r) for r in rates]
    full = rates[lengths >= window_s]
    if len(full):
        figures["goodput_window_min"] = float(full.min())
        figures["goodput_window_p10"] = float(np.percentile(full, 10))
    return figures


def _littles_law(result: SimResult, trace: Trace, duration: float) -> dict[str, float]:
    """Little's law (L = lambda W) over the run window, as a consistency check of the series
    against the per-request times.

    L is the time-average of running + waiting requests in the sampled series; lambda W is
    the summed time in system (arrival to end) of every request that ended, over the
    window. The series misses the moments a request spends before the step boundary that
    admits it (or rejects it), in a fleet's queue and in flight between replicas, and it
    is sampled, so L runs a little below lambda W; a gap of more than a few percent on a
    steady trace means the two disagree.
    """
    names = ("mean_in_system", "littles_law_lw", "littles_law_gap")
    if not len(result.series_t) or duration <= 0:
        return dict.fromkeys(names, math.nan)
    held = _held_durations(result.series_t, _run_end(trace, duration))
    in_system = float(((result.series_running + result.series_waiting) * held).sum()) / duration
    ended = np.isfinite(result.finish_s)
    lw = float((result.finish_s[ended] - trace.arrival_s[ended]).sum()) / duration
    return dict(zip(names, (in_system, lw, _ratio(in_system, lw) - 1.0), strict=True))


def _latency_sample(metric: str, lat: dict[str, np.ndarray], finished: np.ndarray,
                    generated: np.ndarray) -> np.ndarray:
    mask = finished & (generated > 1) if metric == "tpot" else finished
    values = lat[metric][mask]
    return values[np.isfinite(values)]


def _percentiles(values: np.ndarray, qs: tuple[int, ...]) -> list[float]:
    if not len(values):
        return [math.nan] * len(qs)
    return [float(v) for v in np.percentile(values, qs)]


def _per_second(count: float, duration: float) -> float:
    """A count over the window; 0 over an empty window, where nothing could be measured."""
    return float(count) / duration if duration > 0 else 0.0


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else math.nan


def _reject_reasons(result: SimResult, rejected: np.ndarray) -> dict[str, int]:
    counts = np.bincount(result.reject_reason[rejected].astype(np.int64), minlength=len(Reject))
    return {Reject(code).name.lower(): int(c) for code, c in enumerate(counts) if c}


def _tenants(result: SimResult, trace: Trace, finished: np.ndarray, good: np.ndarray,
             duration: float) -> tuple[dict[str, dict[str, Any]], float]:
    """Per-tenant service and the weighted Jain index over tenants that offered any request.

    Service counts a prompt once its prefill completed (a first token exists) plus every
    output token generated, whatever the request's final state. The Jain index is over
    each tenant's service divided by its fair-share weight (``SimResult.tenant_weight``;
    1 each when the result has none): (sum x)^2 / (k sum x^2) with x = service / weight,
    so 1 means service in proportion to the weights.
    """
    k = len(trace.tenant_names)
    prefilled = np.isfinite(result.first_token_s) | finished
    service = np.where(prefilled, trace.prompt_tokens, 0) + result.tokens_generated
    offered = np.bincount(trace.tenant, minlength=k)
    n_finished = np.bincount(trace.tenant, weights=finished, minlength=k)
    n_good = np.bincount(trace.tenant, weights=good, minlength=k)
    served = np.bincount(trace.tenant, weights=service, minlength=k)
    total = served.sum()
    # the engine's audit: service charged in its fairness_cost_unit, against weight shares
    charged = result.tenant_service if len(result.tenant_service) == k else np.zeros(k)
    weight = result.tenant_weight if len(result.tenant_weight) == k else np.ones(k)
    waited = np.where(np.isfinite(result.queue_s), result.queue_s, -np.inf)
    max_wait = np.full(k, -np.inf)
    np.maximum.at(max_wait, trace.tenant, waited)
    per_tenant = {
        name: {
            "offered": int(offered[i]),
            "finished": int(n_finished[i]),
            "good": int(n_good[i]),
            "goodput": _per_second(n_good[i], duration),
            "service_tokens": int(served[i]),
            "share": _ratio(served[i], total),
            "charged_service": float(charged[i]),
            "charged_share": _ratio(charged[i], charged.sum()),
            "weight_share": _ratio(weight[i], weight[offered > 0].sum()) if offered[i] else 0.0,
            "max_wait_s": float(max_wait[i]) if np.isfinite(max_wait[i]) else math.nan,
        }
        for i, name in enumerate(trace.tenant_names)
    }
    x = served[offered > 0] / weight[offered > 0]
    squares = float((x * x).sum())
    jain = float(x.sum()) ** 2 / (len(x) * squares) if squares > 0 else math.nan
    return per_tenant, jain


def _classes(trace: Trace, slos: SLOSet, lat: dict[str, np.ndarray], finished: np.ndarray,
             good: np.ndarray, generated: np.ndarray, request_weight: np.ndarray,
             duration: float) -> dict[str, dict[str, Any]]:
    out = {}
    for code, name in enumerate(trace.slo_class_names):
        mine = trace.slo_class == code
        offered = int(mine.sum())
        n_good = int((good & mine).sum())
        entry = {
            "slo": slos.lookup(name).describe(),
            "offered": offered,
            "good": n_good,
            "attainment": _ratio(n_good, offered),
            "request_goodput": _per_second(n_good, duration),
            "weighted_goodput": _per_second(request_weight[good & mine].sum(), duration),
        }
        for metric in LATENCY_METRICS:
            values = _latency_sample(metric, lat, finished & mine, generated)
            entry[f"p99_{metric}_ms"] = _percentiles(values, (99,))[0]
        out[name] = entry
    return out


def json_safe(value: Any) -> Any:
    """Strict-JSON form of nested reports: NumPy scalars as Python, NaN/inf as None, paths as text."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, PurePath):
        return str(value)
    return value


def _num(value: float, digits: int) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:,.{digits}f}"


def _pct(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{100 * value:.1f}%"
