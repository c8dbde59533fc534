"""Per-request times of one run, measured or simulated, in one form.

Readers, one per benchmark client, each written from the client's own source:

- ``vllm bench serve --save-result --save-detailed`` (vLLM 0.33,
  vllm/benchmarks/serve.py, ``benchmark()``'s ``result``): one JSON object with lists
  ``input_lens``, ``output_lens``, ``ttfts`` (s), ``itls`` (s, per request), ``start_times``
  (perf_counter s), ``errors``; in request order.
- ``python -m sglang.bench_serving --output-file F --output-details`` (SGLang 0.5.23,
  sglang/benchmark/serving.py, ``result | result_details``): JSON lines, each a run, with
  the same four lists (no start times); a file that holds several runs is an error unless
  one is chosen.
- AIPerf 0.13 ``profile_export.jsonl``: one JSON object per request, ``metadata`` and
  ``metrics`` with ``{"value", "unit"}`` entries (``optimizer.bench.aiperf`` has the
  field names and their source).

Times are milliseconds. TPOT is per request ``(e2el - ttft) / (output - 1)`` (0 for
one-token outputs), as ``vllm bench serve`` and ``bench_serving`` compute it for goodput.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from policies.result import SimResult, State
from studies.traces import Trace


class BenchResultError(ValueError):
    """A result file that cannot be read or does not match the run, naming file and field."""


@dataclass(frozen=True)
class RequestTimes:
    """One run, per request (length n, in the trace's order); NaN where a request failed.

    ``sent_s``: when each request was sent, from the first (NaN where the client does not
    record it); ``itl_ms``: every inter-token gap of the run (None where only per-request
    figures exist, as in a simulation).
    """

    source: str
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    ok: np.ndarray
    ttft_ms: np.ndarray
    e2el_ms: np.ndarray
    sent_s: np.ndarray
    itl_ms: np.ndarray | None = None
    duration_s: float = float("nan")

    @property
    def n(self) -> int:
        return len(self.ok)

    @property
    def tpot_ms(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            per = (self.e2el_ms - self.ttft_ms) / np.maximum(self.output_tokens - 1, 1)
        return np.where(self.output_tokens > 1, per, 0.0)

    @property
    def mean_itl_ms(self) -> float:
        """Inter-token gaps averaged over tokens (the token-weighted TPOT when no gaps are kept)."""
        if self.itl_ms is not None:
            return float(np.mean(self.itl_ms)) if len(self.itl_ms) else float("nan")
        gaps = np.where(self.ok, np.maximum(self.output_tokens - 1, 0), 0)
        span = np.where(self.ok & (gaps > 0), self.e2el_ms - self.ttft_ms, 0.0)
        return float(span.sum() / gaps.sum()) if gaps.sum() else float("nan")

    @classmethod
    def simulated(cls, result: SimResult, trace: Trace) -> RequestTimes:
        """A simulation of ``trace`` in this form; requests that did not finish are not ok."""
        ok = result.state == State.FINISHED
        ttft = np.where(ok, (result.first_token_s - trace.arrival_s) * 1e3, np.nan)
        e2el = np.where(ok, (result.finish_s - trace.arrival_s) * 1e3, np.nan)
        end = float(np.nanmax(result.finish_s)) if np.any(np.isfinite(result.finish_s)) else float("nan")
        return cls("simulated", np.asarray(trace.prompt_tokens), np.where(ok, result.tokens_generated, 0), ok,
                   ttft, e2el, np.asarray(trace.arrival_s - trace.arrival_s[0]), None,
                   end - float(trace.arrival_s[0]))


def write_vllm_result(times: RequestTimes, path: str | Path) -> Path:
    """``times`` as ``vllm bench serve --save-detailed`` writes a run (seconds; each
    request's gaps spread evenly over its decode): the inverse of its reader, for round
    trips of a simulated "measurement"."""
    gaps = [[(e - t) / 1e3 / max(o - 1, 1)] * max(o - 1, 0)
            for t, e, o in zip(times.ttft_ms, times.e2el_ms, times.output_tokens, strict=True)]
    body = {"duration": times.duration_s, "input_lens": times.prompt_tokens.tolist(),
            "output_lens": times.output_tokens.tolist(), "ttfts": (times.ttft_ms / 1e3).tolist(), "itls": gaps,
            "latencies": (times.e2el_ms / 1e3).tolist(), "start_times": times.sent_s.tolist(),
            "errors": ["" if ok else "failed" for ok in times.ok]}
    path = Path(path)
    path.write_text(json.dumps(body))
    return path


def read_result(path: str | Path, *, run: int | None = None) -> RequestTimes:
    """The per-request times of a result file, its client told by its content.

    ``run`` picks one line of an SGLang JSONL that holds several runs (0-based). An AIPerf
    artifact folder stands for its ``profile_export.jsonl``.
    """
    path = Path(path)
    if path.is_dir() and (path / AIPERF_EXPORT).is_file():  # an AIPerf artifact folder
        path = path / AIPERF_EXPORT
    if not path.is_file():
        raise BenchResultError(f"result file {path} does not exist")
    text = path.read_text()
    if not text.strip():
        raise BenchResultError(f"result file {path} is empty")
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict):
        if "metadata" in whole and "metrics" in whole:
            return _aiperf(path, [whole])
        if SGLANG_ONLY in whole:  # one appended run
            return _sglang(path, [whole], run)
        return _vllm(path, whole)
    lines = _json_lines(path, text)
    if all("metadata" in row and "metrics" in row for row in lines):
        return _aiperf(path, lines)
    return _sglang(path, lines, run)


def _json_lines(path: Path, text: str) -> list[dict]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchResultError(f"{path}: line {number} is not JSON ({exc.msg}); expected a vllm bench serve "
                                   "result, SGLang bench_serving JSONL or an AIPerf profile_export.jsonl") from None
        if not isinstance(row, dict):
            raise BenchResultError(f"{path}: line {number} is a {type(row).__name__}, not a JSON object")
        rows.append(row)
    return rows


AIPERF_EXPORT = "profile_export.jsonl"
SGLANG_ONLY = "total_output_tokens_retokenized"  # a key bench_serving writes and vllm bench serve does not
_DETAIL = ("input_lens", "output_lens", "ttfts", "itls", "errors")


def _lists(path: Path, data: dict, hint: str) -> dict[str, list]:
    missing = [k for k in _DETAIL if k not in data]
    if missing:
        raise BenchResultError(f"{path}: no per-request field(s) {missing}; {hint}")
    n = len(data["input_lens"])
    for key in _DETAIL:
        if not isinstance(data[key], list) or len(data[key]) != n:
            raise BenchResultError(f"{path}: field {key!r} has {len(data[key]) if isinstance(data[key], list) else 'no'}"
                                   f" entries; input_lens has {n}")
    return {k: data[k] for k in _DETAIL}


def _from_lists(source: str, path: Path, lists: dict, sent: np.ndarray, duration: float,
                latencies: list | None = None) -> RequestTimes:
    """``latencies`` (s, vLLM's) where the client records them; else TTFT plus the gaps."""
    errors = lists["errors"]
    ok = np.array([not e for e in errors], dtype=bool)
    ttft = np.array([t if t is not None else np.nan for t in lists["ttfts"]], dtype=np.float64) * 1e3
    gaps = [np.asarray(g if g is not None else [], dtype=np.float64) * 1e3 for g in lists["itls"]]
    if isinstance(latencies, list) and len(latencies) == len(ok):
        e2el = np.array([x if x is not None else np.nan for x in latencies], dtype=np.float64) * 1e3
    else:
        e2el = ttft + np.array([g.sum() for g in gaps])
    ttft, e2el = np.where(ok, ttft, np.nan), np.where(ok, e2el, np.nan)
    itl = np.concatenate([g for g, good in zip(gaps, ok, strict=True) if good] or [np.zeros(0)])
    return RequestTimes(f"{source}:{path.name}", np.asarray(lists["input_lens"], dtype=np.int64),
                        np.asarray(lists["output_lens"], dtype=np.int64), ok, ttft, e2el, sent, itl, duration)


def _vllm(path: Path, data: dict) -> RequestTimes:
    lists = _lists(path, data, "run vllm bench serve with --save-result --save-detailed")
    starts = data.get("start_times")
    n = len(lists["input_lens"])
    if isinstance(starts, list) and len(starts) == n:
        start = np.asarray(starts, dtype=np.float64)
        sent = start - np.nanmin(start)
    else:
        sent = np.full(n, np.nan)
    return _from_lists("vllm", path, lists, sent, float(data.get("duration", np.nan)), data.get("latencies"))


def _sglang(path: Path, rows: list[dict], run: int | None) -> RequestTimes:
    if run is None:
        if len(rows) > 1:
            raise BenchResultError(f"{path}: {len(rows)} runs appended in one file (bench_serving appends); "
                                   "choose one with --run INDEX")
        run = 0
    if not 0 <= run < len(rows):
        raise BenchResultError(f"{path}: --run {run} out of range; the file holds {len(rows)} run(s)")
    data = rows[run]
    lists = _lists(path, data, "run sglang.bench_serving with --output-file F --output-details")
    return _from_lists("sglang", path, lists, np.full(len(lists["input_lens"]), np.nan),
                       float(data.get("duration", np.nan)))


def _aiperf(path: Path, rows: list[dict]) -> RequestTimes:
    from optimizer.bench.aiperf import records

    return records(path, rows)
