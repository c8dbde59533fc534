"""Azure LLM inference trace CSV: ``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``.

Both public layouts are read: 2023 (Splitwise; ``2023-11-16 18:15:46.6805900``, no time
zone) and 2024 (DynamoLLM; the same columns with a UTC offset such as ``+00:00``).
Arrival is seconds after the earliest timestamp, at microsecond resolution; the earliest
timestamp is kept in ``meta["start_time"]``. There is no prefix information. A timestamp
must name a real instant (a valid date and clock, an offset of a real time zone), and
other columns are not read: a warning names them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from studies.formats._rows import Rows, constant_cap, drop_rows, read_csv
from studies.traces import Trace, TraceError

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_STAMP = r"^(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2}(?:\.\d+)?)\s*(Z|[+-]\d{2}:?\d{2})?$"
_EXPECTED_STAMP = "a date-time like '2023-11-16 18:15:46.6805900' (optionally with a UTC offset)"
#: Real time zones lie within UTC-12:00 and UTC+14:00.
_MAX_OFFSET_MIN = 14 * 60
_EXPECTED_OFFSET = "a UTC offset within +-14:00 with minutes 00-59, e.g. '+00:00' or '-05:30'"


def read(path: Path, *, strict: bool = False, max_tokens: int | None = None,
         drop_zero_prompt: bool = False) -> Trace:
    meta = {"format": "azure"}
    rows = read_csv(path)
    rows.require(*COLUMNS)
    rows.ignore_unknown(COLUMNS, "Azure")
    if drop_zero_prompt:
        prompt = rows.frame["ContextTokens"].str.strip_chars()
        rows = drop_rows(rows, (prompt == "0").fill_null(False).to_numpy(), "zero_prompt", meta)
    hint = "" if drop_zero_prompt else " (drop_zero_prompt=True drops rows with 0)"
    micros = _microseconds(rows)
    start = int(micros.min())
    meta["start_time"] = str(pl.Series([start]).cast(pl.Datetime("us"))[0])  # UTC, no zone
    columns = {
        "arrival_s": (micros - start) / 1e6,
        "prompt_tokens": rows.tokens("ContextTokens", minimum=1, hint=hint),
        "output_tokens": rows.tokens("GeneratedTokens", minimum=0),
        "max_tokens": constant_cap(max_tokens, rows.n),
    }
    return rows.to_trace(columns, time_column="TIMESTAMP", strict=strict, meta=meta)


def _microseconds(rows: Rows) -> np.ndarray:
    """UTC microseconds since the epoch for every TIMESTAMP.

    A stamp must name a real instant: a valid date and clock, and a UTC offset of real
    time zones (at most 14 hours, minutes under 60); ``+25:99`` is an error, not a shift.
    """
    raw = rows.frame["TIMESTAMP"].str.strip_chars()
    parts = raw.str.extract_groups(_STAMP).struct.unnest()
    date, clock, zone = parts["1"], parts["2"], parts["3"]
    stamp = (date + " " + clock).str.to_datetime("%Y-%m-%d %H:%M:%S%.f", time_unit="us", strict=False)
    zone = zone.fill_null("Z").replace("Z", "+00:00").str.replace(":", "")
    sign = np.where(zone.str.slice(0, 1).to_numpy() == "-", -1, 1)
    hours = zone.str.slice(1, 2).cast(pl.Int64).to_numpy()
    minutes = zone.str.slice(3, 2).cast(pl.Int64).to_numpy()
    offset_min = hours * 60 + minutes
    rows.check("TIMESTAMP", [(stamp.is_null().to_numpy(), _EXPECTED_STAMP),
                             ((minutes > 59) | (offset_min > _MAX_OFFSET_MIN), _EXPECTED_OFFSET)])
    return stamp.cast(pl.Int64).to_numpy() - sign * offset_min * 60_000_000


def write(trace: Trace, path: Path) -> Path:
    """Azure CSV, timestamps from ``meta["start_time"]`` (default 2000-01-01) plus arrival.

    Only arrival, prompt and output tokens are part of the format. Reading the file back
    puts the first arrival at 0.
    """
    if np.any(trace.prompt_tokens < 1):
        raise TraceError("Azure rows need ContextTokens >= 1")
    start = pl.Series([trace.meta.get("start_time", "2000-01-01 00:00:00")]).str.to_datetime(
        "%Y-%m-%d %H:%M:%S%.f", time_unit="us", strict=False)[0]
    if start is None:
        raise TraceError(f"meta start_time {trace.meta['start_time']!r}; expected {_EXPECTED_STAMP}")
    micros = np.rint(trace.arrival_s * 1e6).astype(np.int64)
    stamps = pl.Series(micros).cast(pl.Duration("us")) + start
    pl.DataFrame({
        "TIMESTAMP": stamps.dt.strftime("%Y-%m-%d %H:%M:%S.%6f") + "0",  # the 2023 files' 7 digits
        "ContextTokens": trace.prompt_tokens,
        "GeneratedTokens": trace.output_tokens,
    }).write_csv(path)
    return path
