"""AIPerf 0.13's per-request export, ``<artifact-dir>/profile_export.jsonl``.

Layout (aiperf/post_processors/record_export_jsonl_writer.py and
aiperf/common/models/record_models.py, ``MetricRecordInfo``): one object per request with
``metadata`` (``conversation_id``, ``turn_index``, ``request_start_ns`` wall clock,
``benchmark_phase`` "warmup" or "profiling") and ``metrics``, each ``{"value", "unit"}``
(``time_to_first_token``, ``request_latency``, ``inter_chunk_latency`` a list,
``input_sequence_length``, ``output_sequence_length``); a failed request has a top-level
``error``. Lines come in completion order. With ``--random-seed`` a mooncake_trace row k
without ``session_id`` is ``conversation_id == "session_%06d" % k``
(aiperf/dataset/loader/mooncake_trace.py), which is how lines map back to the trace.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from optimizer.bench.results import BenchResultError, RequestTimes

_TO_MS = {"ms": 1.0, "s": 1e3, "sec": 1e3, "us": 1e-3, "ns": 1e-6, "tokens": 1.0}  # counts stay counts
_SESSION = re.compile(r"session_(\d+)$")


def _ms(path: Path, line: int, metrics: dict, name: str) -> float | list[float] | None:
    entry = metrics.get(name)
    if entry is None:
        return None
    if not isinstance(entry, dict) or "value" not in entry:
        raise BenchResultError(f"{path}: record {line}, metric {name!r} is not a {{value, unit}} entry")
    unit = entry.get("unit", "ms")
    if unit not in _TO_MS:
        raise BenchResultError(f"{path}: record {line}, metric {name!r} in unit {unit!r}; expected one of "
                               f"{sorted(_TO_MS)}")
    value = entry["value"]
    return [v * _TO_MS[unit] for v in value] if isinstance(value, list) else float(value) * _TO_MS[unit]


def records(path: Path, rows: list[dict]) -> RequestTimes:
    """RequestTimes in trace-row order from the records; warm-up records are skipped."""
    rows = [r for r in rows if (r.get("metadata") or {}).get("benchmark_phase", "profiling") != "warmup"]
    by_row: dict[int, tuple[int, dict]] = {}
    for line, record in enumerate(rows, 1):
        meta = record["metadata"]
        match = _SESSION.match(str(meta.get("conversation_id", "")))
        if match is None or meta.get("turn_index", 0) != 0:
            raise BenchResultError(
                f"{path}: record {line} has conversation_id {meta.get('conversation_id')!r}; a line maps back to "
                "its trace row only as session_NNNNNN (run aiperf with --random-seed, trace rows without session_id)")
        row = int(match.group(1))
        if row in by_row:
            raise BenchResultError(f"{path}: records {by_row[row][0]} and {line} are both trace row {row}")
        by_row[row] = (line, record)
    n = len(by_row)
    missing = sorted(set(range(n)) - set(by_row))
    if missing:
        raise BenchResultError(f"{path}: {n} records but no record of trace row(s) {missing[:5]}; the export "
                               "is incomplete or belongs to another trace")
    prompt, output = np.zeros(n, np.int64), np.zeros(n, np.int64)
    ok = np.zeros(n, bool)
    ttft, e2el, start = (np.full(n, np.nan) for _ in range(3))
    gaps: list[np.ndarray] = []
    for row in range(n):
        line, record = by_row[row]
        metrics = record.get("metrics") or {}
        start[row] = float(record["metadata"].get("request_start_ns", np.nan))
        isl = _ms(path, line, metrics, "input_sequence_length")
        prompt[row] = int(isl) if isl is not None else 0
        if record.get("error") or record["metadata"].get("was_cancelled"):
            continue
        first, whole = _ms(path, line, metrics, "time_to_first_token"), _ms(path, line, metrics, "request_latency")
        if first is None or whole is None:
            raise BenchResultError(f"{path}: record {line} (trace row {row}) lacks time_to_first_token or "
                                   "request_latency; was the run streamed (--streaming)?")
        ok[row], ttft[row], e2el[row] = True, first, whole
        output[row] = int(_ms(path, line, metrics, "output_sequence_length") or 0)
        chunks = _ms(path, line, metrics, "inter_chunk_latency")
        gaps.append(np.asarray(chunks if isinstance(chunks, list) else [], dtype=np.float64))
    sent = (start - np.nanmin(start)) * 1e-9 if np.isfinite(start).any() else start
    ends = start + np.where(ok, e2el, 0.0) * 1e6
    duration = float((np.nanmax(ends) - np.nanmin(start)) * 1e-9) if ok.any() else float("nan")
    return RequestTimes(f"aiperf:{path.name}", prompt, output, ok, ttft, e2el, sent,
                        np.concatenate(gaps) if gaps else np.zeros(0), duration)
