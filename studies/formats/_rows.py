"""Rows read from a trace file, parsed column by column with errors that say where.

Every reader goes through ``Rows``: polars does the parsing in bulk, and any value that
does not fit is reported with the file, the row, the file line and the column, instead
of surfacing as a polars exception. Nothing is dropped without a word: blank rows are
skipped with a warning giving their count and lines (``meta["blank_rows"]``), and columns
a format does not read are refused (native) or named in a warning (the public formats).
The final step, ``to_trace``, sorts the rows by arrival (with a warning, or an error under
``strict``) and builds the ``Trace``.
"""

from __future__ import annotations

import csv
import json
import re
import warnings
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import polars as pl

from studies.names import closest, unknown_names
from studies.traces import MAX_TOKENS, Trace, TraceError, TraceWarning, csr_take

_ROW = "__row__"
_TOO_MANY_TOKENS = f"at most {MAX_TOKENS:,} tokens (no model holds a longer sequence)"


class Rows:
    """A polars frame read from ``path``, with the file line each row came from.

    ``notes`` are counts of what reading had to fix up (``blank_rows``); they end up in
    the trace's ``meta``.
    """

    def __init__(self, path: Path, frame: pl.DataFrame, lines: np.ndarray | None, notes: dict | None = None,
                 found: list[str] | None = None):
        self.path = path
        self.frame = frame
        self._lines = lines
        self.notes = dict(notes or {})
        #: every column the file has, read or not (a JSON lines file is read by its schema)
        self.found = [c for c in frame.columns if c != _ROW] if found is None else found

    @property
    def n(self) -> int:
        return self.frame.height

    @property
    def columns(self) -> list[str]:
        return self.frame.columns

    def lines(self) -> np.ndarray | None:
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
        """Every named column must be in the file; a missing one is matched to the found
        column it is probably misspelt as."""
        missing = [c for c in columns if c not in self.frame.columns]
        if missing:
            found = self.found
            spare = [c for c in found if c not in columns]
            guesses = [f"{c!r} for {m!r}" for m in missing if (c := closest(m, spare))]
            hint = f" (misspelt? found {', '.join(guesses)})" if guesses else ""
            raise TraceError(f"{self.path}: missing column(s) {missing}{hint}; found {found}; "
                             f"expected {list(columns)}")

    def reject_unknown(self, known: tuple[str, ...]) -> None:
        """A column outside ``known`` is an error: in a schema of our own, it is a typo."""
        unknown = self._unknown(known)
        if unknown:
            raise TraceError(f"{self.path}: {unknown_names('column', unknown, known, 'expected only')}")

    def ignore_unknown(self, known: Iterable[str], format: str) -> None:
        """Columns outside ``known`` are not read: say so, naming the known column each may
        misspell (a public format's files may carry extra columns)."""
        known = tuple(known)
        unknown = self._unknown(known)
        if unknown:
            warn(f"{self.path}: {unknown_names('column', unknown, known, f'{format} reads')}; "
                 f"ignored {len(unknown)} column(s)")

    def _unknown(self, known: Iterable[str]) -> list[str]:
        return [c for c in self.frame.columns if c not in known and c != _ROW]

    def filter(self, keep: np.ndarray) -> Rows:
        lines = self.lines()
        return Rows(self.path, self.frame.filter(pl.Series(keep)), None if lines is None else lines[keep], self.notes,
                    self.found)

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

    def tokens(self, column: str, *, minimum: int, hint: str = "") -> np.ndarray:
        """A token count: an integer >= ``minimum`` and at most ``MAX_TOKENS``, beyond which
        no model holds the sequence (a data error, never cut down to fit)."""
        values, missing, bad = self._parse(column, pl.Int64)
        size = self._parse(column, pl.Float64)[0]  # however large, even past 64 bits
        expected = f"an integer >= {minimum}"
        too_many = np.isfinite(size) & (size > MAX_TOKENS)
        self.check(column, [(missing, expected), (too_many, _TOO_MANY_TOKENS), (bad, expected),
                            (values < minimum, expected + hint)])
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
            warn(f"{problem}; {len(backwards)} such row(s), sorted by arrival")
            order = np.argsort(arrival, kind="stable")
            columns = {name: None if values is None else values[order] for name, values in columns.items()}
            if block_offsets is not None:
                block_offsets, block_hashes = csr_take(block_offsets, block_hashes, order)
            meta = {**meta, "resorted_rows": len(backwards)}
        return Trace.from_columns(**columns, block_offsets=block_offsets, block_hashes=block_hashes,
                                  source=str(self.path), meta={**self.notes, **meta}, **fields)


# -- reading files into Rows -------------------------------------------------------------


def warn(message: str) -> None:
    """A ``TraceWarning``: the trace was read, after the fix-up ``message`` names."""
    warnings.warn(message, TraceWarning, stacklevel=3)


def _skip_blank(path: Path, blank_lines: np.ndarray, kind: str) -> dict:
    """Say which blank ``kind`` were skipped, by line; returns the note for ``meta``."""
    count = len(blank_lines)
    if not count:
        return {}
    shown = ", ".join(str(line) for line in blank_lines[:10]) + (", ..." if count > 10 else "")
    warn(f"{path}: skipped {count} blank {kind}: line(s) {shown}")
    return {"blank_rows": count}


def read_csv(path: Path) -> Rows:
    """Every column as text (parsing happens per column, so errors can name the row).

    A row whose every field is empty is skipped with a warning; a row with some fields
    empty is kept, so the column that lacks a value is named as an error."""
    try:
        frame = pl.read_csv(path, infer_schema=False, row_index_name=_ROW)
    except pl.exceptions.NoDataError:
        raise TraceError(f"{path}: the file is empty; expected a CSV header and rows") from None
    except pl.exceptions.PolarsError as exc:
        raise _locate_csv_problem(path, exc) from None
    data = [c for c in frame.columns if c != _ROW]
    blank = frame.select(pl.all_horizontal(pl.col(data).str.strip_chars().fill_null("") == "")).to_series()
    lines = frame[_ROW].to_numpy().astype(np.int64) + 2  # line 1 is the header
    notes = _skip_blank(path, lines[blank.to_numpy()], "row(s) (every field empty)")
    frame = frame.filter(~blank)
    if frame.height == 0:
        raise TraceError(f"{path}: has a header but no rows; expected at least one request")
    return Rows(path, frame.drop(_ROW), lines[~blank.to_numpy()], notes)


def _locate_csv_problem(path: Path, exc: Exception) -> TraceError:
    bad_text = _first_non_utf8(path)
    if bad_text is not None:
        return bad_text
    with open(path, newline="", encoding="utf-8", errors="replace") as handle:
        reader = csv.reader(handle)
        header = next(reader, [])
        for fields in reader:
            if fields and len(fields) != len(header):
                return TraceError(f"{path}: line {reader.line_num}: {len(fields)} fields; expected "
                                  f"{len(header)} ({','.join(header)})")
    return TraceError(f"{path}: not a readable CSV file ({str(exc).splitlines()[0]})")


def _first_non_utf8(path: Path) -> TraceError | None:
    """The first line holding bytes that are not UTF-8 (polars says only that some are)."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                return TraceError(f"{path}: line {number}, byte {err.start + 1}: "
                                  f"{raw[err.start:err.end]!r} is not UTF-8; expected UTF-8 text "
                                  f"(re-encode the file, e.g. iconv -f latin1 -t utf-8)")
    return None


#: Bytes that leave a line blank.
_BLANK = np.zeros(256, dtype=bool)
_BLANK[[9, 10, 11, 12, 13, 32]] = True


def _line_numbers(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(numbers of the lines with content, numbers of the blank lines), from 1, without a
    Python loop over lines."""
    buf = np.frombuffer(data, dtype=np.uint8)
    starts = np.r_[0, np.flatnonzero(buf[:-1] == 10) + 1]  # a final newline starts no line
    filled = np.logical_or.reduceat(~_BLANK[buf], starts)
    numbers = np.arange(1, len(starts) + 1, dtype=np.int64)
    return numbers[filled], numbers[~filled]


def read_jsonl(path: Path, schema: dict[str, pl.DataType], known: Iterable[str] | None = None,
               format: str = "") -> Rows:
    """One JSON object per line, read with an explicit schema.

    Keys are checked on every line: with ``known`` (a schema of our own), any other key is
    an error naming its line; otherwise keys outside ``schema`` are named in a warning. A
    schema key that no line carries is an absent column (as in CSV), not an empty one.
    """
    data = path.read_bytes()
    if not data.strip():
        raise TraceError(f"{path}: the file is empty; expected one JSON object per line")
    filled, blank = _line_numbers(data)
    notes = _skip_blank(path, blank, "line(s) (no JSON object)")
    inferred = _json_keys(path, schema, known)
    keys = list(inferred)
    # polars casts a number to the text a String column asks for: the line scan refuses it by line
    numbers_as_text = any(re.search(rb'"' + re.escape(key.encode()) + rb'"\s*:\s*[^"\sn]', data)
                          for key in keys if schema.get(key) == pl.String)
    if (known is not None and set(keys) - set(known)) or numbers_as_text:
        _check_json_lines(path, schema, known)  # raises, naming the first line with the problem
    ignored = [key for key in keys if key not in schema]
    if known is None and ignored:
        warn(f"{path}: {unknown_names('key', ignored, schema, f'{format} reads')}; ignored {len(ignored)} key(s)")
    present = {key: dtype for key, dtype in schema.items() if key in keys}  # absent keys: absent columns
    try:
        frame = pl.read_ndjson(path, schema=present)
    except pl.exceptions.PolarsError as exc:
        _check_json_lines(path, schema, known)
        raise TraceError(f"{path}: not readable as JSON lines ({str(exc).splitlines()[0]})") from None
    return Rows(path, frame, filled, notes, keys)


def _json_keys(path: Path, schema: dict[str, pl.DataType], known: Iterable[str] | None) -> dict:
    """Every key of every line, in order of first appearance, with the type polars infers
    for it over the whole file in one pass; when it cannot (bad JSON, bytes that are not
    UTF-8, clashing types), the line scan names why."""
    try:
        return dict(pl.scan_ndjson(path, infer_schema_length=None).collect_schema())
    except pl.exceptions.PolarsError:
        return dict.fromkeys(_check_json_lines(path, schema, known))


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


def _check_json_lines(path: Path, schema: dict[str, pl.DataType], known: Iterable[str] | None) -> list[str]:
    """Read the file line by line in Python and raise for the first line that is not UTF-8,
    not a JSON object, has a key outside ``known`` (when given) or a value of the wrong
    type; returns every key seen (in order of first appearance) when no line has a problem."""
    known = None if known is None else tuple(known)
    keys: dict[str, None] = {}
    row = 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            row += 1
            where = f"{path}: row {row} (line {number})"
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                raise TraceError(f"{where}, byte {err.start + 1}: {raw[err.start:err.end]!r} is not UTF-8; "
                                 f"expected UTF-8 text (re-encode the file, e.g. iconv -f latin1 -t utf-8)") from None
            except json.JSONDecodeError as err:
                raise TraceError(f"{where}, character {err.colno}: not valid JSON ({err.msg}); "
                                 f"expected one JSON object per line") from None
            if not isinstance(record, dict):
                raise TraceError(f"{where}: got {type(record).__name__}; expected a JSON object")
            unknown = [key for key in record if known is not None and key not in known]
            if unknown:
                raise TraceError(f"{path}: line {number}: {unknown_names('key', unknown, known, 'expected only')}")
            for key, dtype in schema.items():
                value = record.get(key)
                if value is not None and not _json_fits(value, dtype):
                    expected = _JSON_EXPECTED.get(dtype, "a list of integers")
                    if dtype in (pl.Int64, pl.Float64) and isinstance(value, int) and not isinstance(value, bool):
                        expected += " within 64 bits"  # an integer, but past what a column holds
                    raise TraceError(f"{where}, column {key!r}: got {value!r}; expected {expected}")
            keys.update(dict.fromkeys(record))
    return list(keys)


def read_parquet(path: Path) -> Rows:
    try:
        frame = pl.read_parquet(path)
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise TraceError(f"{path}: not a readable Parquet file, truncated or corrupt? "
                         f"({str(exc).splitlines()[0]})") from None
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
