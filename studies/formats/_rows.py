"""Rows read from a trace file, parsed column by column with errors that say where.

Every reader goes through ``Rows``: polars does the parsing in bulk, and any value that
does not fit is reported with the file, the row, the file line and the column, instead
of surfacing as a polars exception. The final step, ``to_trace``, sorts the rows by
arrival (with a warning, or an error under ``strict``) and builds the ``Trace``.
"""

from __future__ import annotations

import csv
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl

from studies.traces import Trace, TraceError, TraceWarning, csr_take

_ROW = "__row__"


class Rows:
    """A polars frame read from ``path``, with the file line each row came from."""

    def __init__(self, path: Path, frame: pl.DataFrame, lines: np.ndarray | Callable[[], np.ndarray] | None):
        self.path = path
        self.frame = frame
        self._lines = lines

    @property
    def n(self) -> int:
        return self.frame.height

    @property
    def columns(self) -> list[str]:
        return self.frame.columns

    def lines(self) -> np.ndarray | None:
        if callable(self._lines):
            self._lines = self._lines()
        return self._lines

    # -- locating problems -------------------------------------------------------------

    def where(self, row: int, column: str | None = None) -> str:
        """``file: row R (line L), column 'C'`` with R counted from 1 over the data rows."""
        text = f"{self.path}: row {row + 1}"
        lines = self.lines()
        if lines is not None:
            text += f" (line {lines[row]})"
        return text + (f", column {column!r}" if column else "")

    def error(self, row: int, column: str, expected: str) -> TraceError:
        value = self.frame[column][row] if column in self.frame.columns else None
        if isinstance(value, pl.Series):
            value = value.to_list()
        got = "nothing" if value is None or (isinstance(value, str) and not value.strip()) else repr(value)
        return TraceError(f"{self.where(row, column)}: got {got}; expected {expected}")

    def check(self, column: str, problems: list[tuple[np.ndarray, str]]) -> None:
        """Raise for the earliest row any mask flags, saying what that row should hold."""
        flagged = [(int(np.argmax(mask)), expected) for mask, expected in problems if mask.any()]
        if flagged:
            row, expected = min(flagged, key=lambda item: item[0])
            raise self.error(row, column, expected)

    def require(self, *columns: str) -> None:
        """Every named column must be in the file."""
        missing = [c for c in columns if c not in self.frame.columns]
        if missing:
            found = [c for c in self.frame.columns if c != _ROW]
            raise TraceError(f"{self.path}: missing column(s) {missing}; found {found}; "
                             f"expected {list(columns)}")

    def reject_unknown(self, known: tuple[str, ...]) -> None:
        unknown = [c for c in self.frame.columns if c not in known and c != _ROW]
        if unknown:
            raise TraceError(f"{self.path}: unknown column(s) {unknown}; expected only {list(known)}")

    def filter(self, keep: np.ndarray) -> Rows:
        lines = self.lines()
        return Rows(self.path, self.frame.filter(pl.Series(keep)), None if lines is None else lines[keep])

    # -- typed columns -----------------------------------------------------------------

    def _parse(self, column: str, dtype: pl.DataType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(values, missing, unparsable) for one column parsed as ``dtype``."""
        raw = self.frame[column]
        if raw.dtype == pl.String:
            raw = raw.str.strip_chars()
            missing = raw.is_null() | (raw == "").fill_null(True)
        elif raw.dtype.is_numeric() or raw.dtype == pl.Null:
            missing = raw.is_null()
        else:
            raise TraceError(f"{self.path}: column {column!r} holds {raw.dtype}; expected numbers")
        parsed = raw.cast(dtype, strict=False)
        bad = parsed.is_null() & ~missing
        if dtype == pl.Int64 and raw.dtype.is_float():
            bad = bad | ~(raw.is_finite() & (raw == raw.floor())).fill_null(True)
        fill = 0 if dtype == pl.Int64 else float("nan")
        values = parsed.fill_null(fill).to_numpy()
        return values, missing.to_numpy(), bad.to_numpy()

    def integers(self, column: str, *, minimum: int, hint: str = "") -> np.ndarray:
        values, missing, bad = self._parse(column, pl.Int64)
        expected = f"an integer >= {minimum}"
        self.check(column, [(missing, expected), (bad, expected), (values < minimum, expected + hint)])
        return values.astype(np.int64, copy=False)

    def optional_integers(self, column: str, default: int | np.ndarray) -> np.ndarray:
        """An optional integer column: absent or empty cells take ``default`` (a value, or
        one per row)."""
        if column not in self.frame.columns:
            return np.broadcast_to(default, self.n).astype(np.int64)
        values, missing, bad = self._parse(column, pl.Int64)
        self.check(column, [(bad, "an integer or nothing")])
        return np.where(missing, default, values).astype(np.int64)

    def given(self, column: str) -> np.ndarray:
        """Per row (bool): the cell holds a value (all False when the column is absent)."""
        if column not in self.frame.columns:
            return np.zeros(self.n, dtype=bool)
        return ~self._parse(column, pl.Int64)[1]

    def times(self, column: str, *, scale: float = 1.0) -> np.ndarray:
        """A time column, finite and >= 0, times ``scale`` to give seconds."""
        values, missing, bad = self._parse(column, pl.Float64)
        expected = "a finite time >= 0"
        self.check(column, [(missing, expected), (bad, expected), (~np.isfinite(values), expected),
                            (values < 0, expected)])
        return values * scale

    def optional_times(self, column: str) -> np.ndarray:
        """An optional time column: absent, empty or NaN cells are NaN (none)."""
        if column not in self.frame.columns:
            return np.full(self.n, np.nan)
        values, missing, bad = self._parse(column, pl.Float64)
        self.check(column, [(bad, "a time in seconds, or nothing for none"),
                            (np.isinf(values), "a finite time, or nothing for none")])
        return np.where(missing, np.nan, values)

    def strings(self, column: str, default: str) -> np.ndarray:
        """A text column with empty cells (or no column) meaning ``default``."""
        if column not in self.frame.columns:
            return np.full(self.n, default, dtype=object)
        raw = self.frame[column].cast(pl.String, strict=False).str.strip_chars()
        return raw.fill_null(default).replace("", default).to_numpy().astype(object)

    def block_lists(self, column: str, prompt_tokens: np.ndarray, block_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Prefix-block ids as CSR (offsets, hashes) from a list column (or a CSV text
        column of space-separated integers). An empty cell means no blocks."""
        if column not in self.frame.columns:
            return np.zeros(self.n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64)
        raw = self.frame[column]
        if raw.dtype == pl.String:
            words = raw.str.strip_chars().str.split(" ").list.eval(pl.element().filter(pl.element() != ""))
            lists = words.list.eval(pl.element().cast(pl.Int64, strict=False))
        elif isinstance(raw.dtype, pl.List) and (raw.dtype.inner.is_integer() or raw.dtype.inner == pl.Null):
            lists = raw.cast(pl.List(pl.Int64))
        elif raw.dtype == pl.Null:
            lists = pl.Series(column, [None] * self.n, dtype=pl.List(pl.Int64))
        else:
            raise TraceError(f"{self.path}: column {column!r} holds {raw.dtype}; expected lists of integers")
        counts = lists.list.len().fill_null(0).to_numpy().astype(np.int64)
        offsets = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        flat = lists.explode(empty_as_null=False, keep_nulls=False)
        bad_row = np.zeros(self.n, dtype=bool)
        bad_elements = np.flatnonzero(flat.is_null().to_numpy())
        bad_row[np.searchsorted(offsets, bad_elements, side="right") - 1] = True
        most = -(-prompt_tokens // block_tokens)
        self.check(column, [
            (bad_row, "integer block ids"),
            (counts > most, f"at most ceil(prompt tokens / {block_tokens}) block ids"),
        ])
        return offsets, flat.fill_null(0).to_numpy().astype(np.int64)

    # -- the result ----------------------------------------------------------------------

    def to_trace(self, columns: dict, *, time_column: str, strict: bool, meta: dict,
                 block_offsets: np.ndarray | None = None, block_hashes: np.ndarray | None = None,
                 **fields) -> Trace:
        """Sort by arrival if needed (warn, or raise under ``strict``) and build the Trace."""
        arrival = columns["arrival_s"]
        backwards = np.flatnonzero(np.diff(arrival) < 0)
        if len(backwards):
            row = int(backwards[0]) + 1
            problem = (f"{self.where(row, time_column)}: arrival {arrival[row]:.6f} s is before "
                       f"the previous row's {arrival[row - 1]:.6f} s")
            if strict:
                raise TraceError(f"{problem}; expected rows sorted by time (strict)")
            warnings.warn(f"{problem}; {len(backwards)} such row(s), sorted by arrival",
                          TraceWarning, stacklevel=4)
            order = np.argsort(arrival, kind="stable")
            columns = {name: None if values is None else values[order] for name, values in columns.items()}
            if block_offsets is not None:
                block_offsets, block_hashes = csr_take(block_offsets, block_hashes, order)
            meta = {**meta, "resorted_rows": len(backwards)}
        return Trace.from_columns(**columns, block_offsets=block_offsets, block_hashes=block_hashes,
                                  source=str(self.path), meta=meta, **fields)


# -- reading files into Rows -------------------------------------------------------------


def read_csv(path: Path) -> Rows:
    """Every column as text (parsing happens per column, so errors can name the row)."""
    try:
        frame = pl.read_csv(path, infer_schema=False, row_index_name=_ROW)
    except pl.exceptions.NoDataError:
        raise TraceError(f"{path}: the file is empty; expected a CSV header and rows") from None
    except pl.exceptions.PolarsError as exc:
        raise _locate_csv_problem(path, exc) from None
    data = [c for c in frame.columns if c != _ROW]
    blank = frame.select(pl.all_horizontal(pl.col(data).is_null())).to_series()
    frame = frame.filter(~blank)  # blank lines hold no request
    if frame.height == 0:
        raise TraceError(f"{path}: has a header but no rows; expected at least one request")
    lines = frame[_ROW].to_numpy().astype(np.int64) + 2  # line 1 is the header
    return Rows(path, frame.drop(_ROW), lines)


def _locate_csv_problem(path: Path, exc: Exception) -> TraceError:
    with open(path, newline="", encoding="utf-8", errors="replace") as handle:
        reader = csv.reader(handle)
        header = next(reader, [])
        for fields in reader:
            if fields and len(fields) != len(header):
                return TraceError(f"{path}: line {reader.line_num}: {len(fields)} fields; expected "
                                  f"{len(header)} ({','.join(header)})")
    return TraceError(f"{path}: not a readable CSV file ({str(exc).splitlines()[0]})")


def read_jsonl(path: Path, schema: dict[str, pl.DataType]) -> Rows:
    """One JSON object per line, read with an explicit schema (unknown keys are ignored)."""
    if not path.read_bytes().strip():
        raise TraceError(f"{path}: the file is empty; expected one JSON object per line")
    try:
        frame = pl.read_ndjson(path, schema=schema)
    except pl.exceptions.PolarsError as exc:
        raise _locate_json_problem(path, schema, exc) from None
    return Rows(path, frame, lambda: _jsonl_lines(path))


def _jsonl_lines(path: Path) -> np.ndarray:
    with open(path, "rb") as handle:
        return np.array([number for number, line in enumerate(handle, 1) if line.strip()], dtype=np.int64)


def _json_fits(value, dtype: pl.DataType) -> bool:
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63

    if dtype == pl.Int64:
        return is_int(value)
    if dtype == pl.Float64:  # Python's json accepts NaN and Infinity; JSON does not
        return is_int(value) or (isinstance(value, float) and np.isfinite(value))
    if dtype == pl.String:
        return isinstance(value, str)
    if isinstance(dtype, pl.List):
        return isinstance(value, list) and all(v is None or _json_fits(v, dtype.inner) for v in value)
    return True


_JSON_EXPECTED = {pl.Int64: "an integer", pl.Float64: "a number", pl.String: "a string"}


def _locate_json_problem(path: Path, schema: dict[str, pl.DataType], exc: Exception) -> TraceError:
    row = 0
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            row += 1
            where = f"{path}: row {row} (line {number})"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                return TraceError(f"{where}, character {err.colno}: not valid JSON ({err.msg}); "
                                  f"expected one JSON object per line")
            if not isinstance(record, dict):
                return TraceError(f"{where}: got {type(record).__name__}; expected a JSON object")
            for key, dtype in schema.items():
                value = record.get(key)
                if value is not None and not _json_fits(value, dtype):
                    expected = _JSON_EXPECTED.get(dtype, "a list of integers")
                    return TraceError(f"{where}, column {key!r}: got {value!r}; expected {expected}")
    return TraceError(f"{path}: not readable as JSON lines ({str(exc).splitlines()[0]})")


def read_parquet(path: Path) -> Rows:
    try:
        frame = pl.read_parquet(path)
    except pl.exceptions.PolarsError as exc:
        raise TraceError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
    if frame.height == 0:
        raise TraceError(f"{path}: has no rows; expected at least one request")
    return Rows(path, frame, None)


def constant_cap(max_tokens: int | None, n: int) -> np.ndarray | None:
    """The ``max_tokens=`` reader option: one output cap for every request (the caller's
    caps, ``CAP_GIVEN``), or None: the format carries no caps, and the trace is marked
    without them (``CAP_NONE``; ``studies.lengths.with_client_caps`` gives the study's)."""
    if max_tokens is None:
        return None
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise TraceError(f"option max_tokens={max_tokens!r}; expected an integer >= 1")
    return np.full(n, max_tokens, dtype=np.int64)


def drop_rows(rows: Rows, drop: np.ndarray, reason: str, meta: dict) -> Rows:
    """Remove rows an explicit option filtered out, counting them in ``meta``."""
    count = int(drop.sum())
    if count == 0:
        return rows
    filters = meta.setdefault("filters", {})
    filters[reason] = filters.get(reason, 0) + count
    meta["filtered_rows"] = meta.get("filtered_rows", 0) + count
    kept = rows.filter(~drop)
    if kept.n == 0:
        raise TraceError(f"{rows.path}: every row was filtered out ({filters}); expected some left")
    return kept
