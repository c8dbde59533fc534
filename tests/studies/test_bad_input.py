"""The bad-input suite (issue 18): every trace format against every class of bad file.

For each format (Mooncake JSONL, Azure CSV in its 2023 and 2024 layouts, BurstGPT CSV,
native CSV, JSONL and Parquet) a small good trace of three requests is written, then
broken one way: empty file, header only, blank rows, NaN, inf, negative, zero-length
prompt, huge token counts, unsorted and duplicate timestamps, invalid timestamps and
offsets, bytes that are not UTF-8, wrong types, missing, unknown and misspelt columns,
truncated Parquet, a directory, a missing file. Each case says what must happen:

* ``Refused``: ``load_trace`` raises ``TraceError`` naming the file and where (row, line,
  column or key); ``servetune trace stats`` prints that one ``error:`` line, exit code 2;
* ``Warned``: the trace loads with one ``TraceWarning`` naming the file and the exact
  count of rows affected (also kept in ``meta``); the CLI prints it as one ``warning:``
  line, with no Python source location, exit code 0;
* ``Accepted``: every row loads, with no warning.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from optimizer.cli import app
from studies.traces import MAX_TOKENS, TraceError, TraceWarning, load_trace

runner = CliRunner()
NAN, INF = float("nan"), float("inf")
TOO_MANY = re.escape(f"at most {MAX_TOKENS:,} tokens")


# -- the formats ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Format:
    """One trace layout: its file kind, its columns and how a good row of it looks."""

    name: str  # the test-id prefix
    kind: str  # csv, jsonl or parquet
    time: str  # the arrival column
    prompt: str
    output: str
    stamp: Callable[[int], object]  # the arrival value of second s
    extra: dict = field(default_factory=dict)  # the other columns of a good row
    public: bool = True  # a published layout (extra columns warned about), not servetune's own

    def row(self, second: int, prompt: object = 100, output: object = 10) -> dict:
        return {self.time: self.stamp(second), self.prompt: prompt, self.output: output, **self.extra}

    def good(self) -> list:
        return [self.row(0), self.row(1), self.row(2)]

    def at(self, row: int, column: str) -> str:
        """The regex of where a message must say row ``row`` (from 1) of ``column`` is."""
        if self.kind == "parquet":
            return rf"row {row}, column '{column}'"
        line = row + 1 if self.kind == "csv" else row  # CSV line 1 is the header
        return rf"row {row} \(line {line}\), column '{column}'"


NATIVE = dict(time="arrival_s", prompt="prompt_tokens", output="output_tokens", stamp=float, public=False)
FORMATS = (
    Format("mooncake", "jsonl", "timestamp", "input_length", "output_length", lambda s: s * 1000,
           {"hash_ids": []}),
    Format("azure2023", "csv", "TIMESTAMP", "ContextTokens", "GeneratedTokens",
           lambda s: f"2023-11-16 18:15:{s:02d}.6805900"),
    Format("azure2024", "csv", "TIMESTAMP", "ContextTokens", "GeneratedTokens",
           lambda s: f"2024-05-10 00:00:{s:02d}.009930+00:00"),
    Format("burstgpt", "csv", "Timestamp", "Request tokens", "Response tokens", float,
           {"Model": "ChatGPT", "Total tokens": 110, "Log Type": "Conversation log"}),
    Format("native-csv", "csv", **NATIVE),
    Format("native-jsonl", "jsonl", **NATIVE),
    Format("native-parquet", "parquet", **NATIVE),
)
NUMERIC_TIME = tuple(f for f in FORMATS if not f.name.startswith("azure"))
BY_NAME = {f.name: f for f in FORMATS}


# -- what must happen ----------------------------------------------------------------------


@dataclass(frozen=True)
class Refused:
    where: str  # regex the error must match (besides naming the file)


@dataclass(frozen=True)
class Warned:
    says: str  # regex the one warning must match (besides naming the file)
    rows: int  # requests loaded
    meta: dict = field(default_factory=dict)  # the exact counts kept in trace.meta


@dataclass(frozen=True)
class Accepted:
    rows: int


@dataclass(frozen=True)
class Case:
    fmt: Format
    content: Callable[[Format], list | bytes] | None  # None: the path is made by ``make``
    expect: Refused | Warned | Accepted
    make: Callable[[Path], Path] | None = None
    trace_format: str | None = None  # the format named to the reader (default: detected)


# -- writing files -------------------------------------------------------------------------


def parquet(frame: pl.DataFrame, **options) -> bytes:
    buffer = io.BytesIO()
    frame.write_parquet(buffer, **options)
    return buffer.getvalue()


def render(fmt: Format, rows: list) -> bytes:
    """Rows as the bytes of a ``fmt`` file. A row is a dict, or a raw text line (CSV/JSONL)."""
    if fmt.kind == "parquet":
        columns = {name: [row.get(name) for row in rows] for name in rows[0]}
        # a column mixing text and numbers is written as text, as a hand-edited file would be
        columns = {name: [None if v is None else str(v) for v in values]
                   if any(isinstance(v, str) for v in values) else values for name, values in columns.items()}
        return parquet(pl.DataFrame(columns, strict=False))
    if fmt.kind == "jsonl":
        return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    header = list(next(r for r in rows if isinstance(r, dict)))
    lines = [",".join(header)] + [r if isinstance(r, str) else ",".join("" if r[c] is None else str(r[c])
                                                                         for c in header) for r in rows]
    return ("\n".join(lines) + "\n").encode()


# -- building bad files from good ones -----------------------------------------------------


good = Format.good


def changed(row: int, **values) -> Callable[[Format], list]:
    """The good rows with row ``row`` (from 1) changed; keys are 'time', 'prompt', 'output'."""
    def content(fmt: Format) -> list:
        rows = fmt.good()
        rows[row - 1].update({getattr(fmt, k): v for k, v in values.items()})
        return rows
    return content


def at_seconds(*seconds: int) -> Callable[[Format], list]:
    """Rows arriving at these seconds, in this order, written as the format writes times."""
    return lambda fmt: [fmt.row(s) for s in seconds]


def renamed(column: str, to: Callable[[str], str]) -> Callable[[Format], list]:
    def content(fmt: Format) -> list:
        name = getattr(fmt, column)
        return [{(to(k) if k == name else k): v for k, v in row.items()} for row in fmt.good()]
    return content


def dropped(column: str) -> Callable[[Format], list]:
    return lambda fmt: [{k: v for k, v in row.items() if k != getattr(fmt, column)} for row in fmt.good()]


def with_columns(**values) -> Callable[[Format], list]:
    return lambda fmt: [{**row, **values} for row in fmt.good()]


def with_row(row: int, **values) -> Callable[[Format], list]:
    """The good rows, row ``row`` (from 1) with more columns (raw names): empty in the
    other rows of a CSV file, absent from the other lines of a JSONL one."""
    def content(fmt: Format) -> list:
        rows = fmt.good()
        for number, other in enumerate(rows, 1):
            if number == row:
                other.update(values)
            elif fmt.kind != "jsonl":
                other.update(dict.fromkeys(values))
        return rows
    return content


def line(row: int, text: str) -> Callable[[Format], list]:
    """The good rows with row ``row`` (from 1) replaced by a raw line."""
    def content(fmt: Format) -> list:
        rows: list = fmt.good()
        rows[row - 1] = text
        return rows
    return content


def blank_after(*rows: int) -> Callable[[Format], list]:
    """The good rows with a blank row after each of ``rows``: ``,,`` in CSV (as a spreadsheet
    exports an empty row), an empty line in JSONL."""
    def content(fmt: Format) -> list:
        out: list = []
        for number, row in enumerate(fmt.good(), 1):
            out.append(row)
            if number in rows:
                out.append("," * (len(row) - 1) if fmt.kind == "csv" else "")
        return out
    return content


def header_only(fmt: Format) -> bytes:
    if fmt.kind == "parquet":
        return parquet(pl.DataFrame(schema={fmt.time: pl.Float64, fmt.prompt: pl.Int64, fmt.output: pl.Int64}))
    return (",".join(fmt.good()[0]) + "\n").encode() if fmt.kind == "csv" else b"\n  \n"


def not_utf8(fmt: Format) -> bytes:
    """Row 2's prompt holds a Latin-1 byte (a file saved by a spreadsheet in its own encoding)."""
    return render(fmt, changed(2, prompt="MARK")(fmt)).replace(b"MARK", b"1\xe90")


def gzipped(fmt: Format) -> bytes:
    return gzip.compress(render(fmt, fmt.good()))


def parquet_metadata(text: str) -> Callable[[Format], bytes]:
    """A native Parquet file whose ``servetune`` metadata is ``text``."""
    def content(fmt: Format) -> bytes:
        frame = pl.DataFrame({"arrival_s": [0.0], "prompt_tokens": [5], "output_tokens": [1]})
        return parquet(frame, metadata={"servetune": text})
    return content


def truncated(fmt: Format) -> bytes:
    data = render(fmt, fmt.good())
    return data[: len(data) // 2]


def empty(fmt: Format) -> bytes:
    return b""


# -- the cases -----------------------------------------------------------------------------


def _misspelt(name: str) -> str:
    return name[:-1]  # one letter short: ContextToken, input_lengt, prompt_token


def _generic(fmt: Format) -> list:
    """The classes every format is tried with: (class id, content, expectation)."""
    at = fmt.at
    hint = ".*drop_zero_prompt" if fmt.public else ""
    jsonl = fmt.kind == "jsonl"
    prompt, output = _misspelt(fmt.prompt), fmt.output
    if fmt.public:
        misspelt = rf"missing column\(s\) \['{fmt.prompt}'\] \(misspelt\? found '{prompt}' for '{fmt.prompt}'\)"
        extra = Warned(r"unknown (column|key)\(s\) \['colour'\].*ignored 1 ", rows=3)
    else:
        unknown = "line 1: unknown key" if jsonl else "unknown column"
        misspelt = rf"{unknown}\(s\) \['{prompt}'\] \(did you mean '{fmt.prompt}'\?\)"
        extra = Refused(rf"{unknown}\(s\) \['colour'\]")
    cases = [
        ("empty-file", empty, Refused("the file is empty")),
        ("header-only", header_only, Refused({"csv": "has a header but no rows", "jsonl": "the file is empty",
                                              "parquet": "has no rows"}[fmt.kind])),
        ("nan-time", changed(2, time=NAN), Refused(at(2, fmt.time) + ": got '?nan'?")),
        ("inf-prompt", changed(2, prompt=INF), Refused(at(2, fmt.prompt) + ": got '?inf'?; expected an integer")),
        ("negative-output", changed(2, output=-5), Refused(at(2, output) + r": got '?-5'?; expected an integer >= 0")),
        ("zero-prompt", changed(2, prompt=0), Refused(at(2, fmt.prompt) + r": got '?0'?; expected an integer >= 1"
                                                      + hint)),
        ("missing-value", changed(2, prompt=None), Refused(at(2, fmt.prompt) + ": got nothing")),
        ("huge-output-1e12", changed(2, output=10**12), Refused(at(2, output) + f": got '?1000000000000'?; "
                                                                                f"expected {TOO_MANY}")),
        ("huge-prompt-1e12", changed(3, prompt=10**12), Refused(at(3, fmt.prompt) + f".*expected {TOO_MANY}")),
        ("wrong-type", changed(2, prompt="many"), Refused(at(2, fmt.prompt) + ": got 'many'; expected an integer")),
        ("unsorted", at_seconds(5, 0, 9, 1),
         Warned(at(2, fmt.time) + r": arrival 0\.000000 s is before the previous row's 5\.000000 s; "
                                  r"2 such row\(s\), sorted by arrival", rows=4, meta={"resorted_rows": 2})),
        ("duplicate-times", at_seconds(0, 0, 1), Accepted(rows=3)),
        ("missing-column", dropped("output"), Refused(rf"missing column\(s\) \['{output}'\]")),
        ("misspelt-column", renamed("prompt", _misspelt), Refused(misspelt)),
        ("unknown-column", with_columns(colour="red"), extra),
        ("gzip-compressed", gzipped, Refused("is gzip-compressed; decompress it first")),
    ]
    if fmt in NUMERIC_TIME:
        cases += [
            ("negative-time", changed(2, time=-1), Refused(at(2, fmt.time) + r".*expected a finite time >= 0")),
            ("text-time", changed(2, time="yesterday"), Refused(at(2, fmt.time) + ": got 'yesterday'")),
        ]
    if fmt.kind != "parquet":
        first, second = (2, 4) if jsonl else (3, 5)  # the lines the blank rows sit on (CSV: after a header)
        kind = r"line\(s\) \(no JSON object\)" if jsonl else r"row\(s\) \(every field empty\)"
        cases += [
            ("blank-row", blank_after(1), Warned(rf"skipped 1 blank {kind}: line\(s\) {first}$", rows=3,
                                                 meta={"blank_rows": 1})),
            ("blank-rows", blank_after(1, 2), Warned(rf"skipped 2 blank {kind}: line\(s\) {first}, {second}$",
                                                     rows=3, meta={"blank_rows": 2})),
            ("not-utf8", not_utf8, Refused(("" if not jsonl else r"row 2 \(") + rf"line {2 if jsonl else 3}\)?, "
                                           r"byte \d+: b'\\xe9' is not UTF-8")),
            ("beyond-64-bits", changed(2, output=10**30),
             Refused(at(2, output) + (": got 10{30}; expected an integer within 64 bits" if jsonl
                                      else f": got '10{{30}}'; expected {TOO_MANY}"))),
        ]
    return cases


def _azure(fmt: Format) -> list:
    """Timestamps that name no instant, in either Azure layout."""
    stamp = r".*expected a date-time like"
    offset = r".*expected a UTC offset within \+-14:00"
    return [
        ("invalid-date", changed(2, time="2023-02-30 10:00:00"), Refused(fmt.at(2, "TIMESTAMP") + stamp)),
        ("invalid-clock", changed(2, time="2023-11-16 25:15:50.9"), Refused(fmt.at(2, "TIMESTAMP") + stamp)),
        ("not-a-time", changed(2, time="yesterday"), Refused(fmt.at(2, "TIMESTAMP") + ": got 'yesterday'" + stamp)),
        ("offset-25:99", changed(2, time="2023-11-16 18:15:50.995169+25:99"),
         Refused(fmt.at(2, "TIMESTAMP") + ": got '2023-11-16 18:15:50.995169\\+25:99'" + offset)),
        ("offset-minutes-60", changed(2, time="2024-05-10 00:00:01.5-05:60"), Refused(fmt.at(2, "TIMESTAMP") + offset)),
        ("offset-past-14h", changed(3, time="2024-05-10 00:00:01.5+14:30"), Refused(fmt.at(3, "TIMESTAMP") + offset)),
        ("extra-field", line(2, f"{fmt.stamp(1)},100,10,7"), Refused(r"line 3: 4 fields; expected 3")),
    ]


NATIVE_CSV, NATIVE_JSONL, NATIVE_PARQUET = BY_NAME["native-csv"], BY_NAME["native-jsonl"], BY_NAME["native-parquet"]
SPECIAL = [
    (NATIVE_JSONL, "minimal-columns", good, Accepted(rows=3)),
    (NATIVE_JSONL, "misspelt-key-line-2", with_row(2, deadline=5.0),
     Refused(r"line 2: unknown key\(s\) \['deadline'\] \(did you mean 'deadline_s'\?\)")),
    (NATIVE_JSONL, "misspelt-key-line-1", with_row(1, deadline=5.0),
     Refused(r"line 1: unknown key\(s\) \['deadline'\] \(did you mean 'deadline_s'\?\)")),
    (NATIVE_JSONL, "invalid-json", line(2, '{"arrival_s": 1.0,'), Refused(r"row 2 \(line 2\), character \d+: not valid JSON")),
    (NATIVE_JSONL, "not-an-object", line(2, "[1, 2]"), Refused(r"row 2 \(line 2\): got list; expected a JSON object")),
    (NATIVE_CSV, "deadline-before-arrival", with_row(2, deadline_s=0.5),
     Refused(NATIVE_CSV.at(2, "deadline_s") + ": got '0.5'; expected a time >= arrival_s")),
    (NATIVE_CSV, "priority-past-32-bits", with_columns(priority=2**40),
     Refused(NATIVE_CSV.at(1, "priority") + ".*expected a 32-bit integer")),
    (NATIVE_CSV, "huge-max-tokens", with_row(2, max_tokens=10**12),
     Refused(NATIVE_CSV.at(2, "max_tokens") + f".*{TOO_MANY}")),
    (NATIVE_CSV, "block-tokens-zero", with_columns(block_tokens=0),
     Refused(NATIVE_CSV.at(1, "block_tokens") + ": got '0'; expected an integer >= 1")),
    (NATIVE_PARQUET, "null-row", changed(2, time=None, prompt=None, output=None),
     Refused(NATIVE_PARQUET.at(2, "arrival_s") + ": got nothing")),
    (NATIVE_PARQUET, "truncated", truncated, Refused("not a readable Parquet file, truncated or corrupt")),
    (NATIVE_PARQUET, "metadata-not-json", parquet_metadata("not json"),
     Refused(r"Parquet metadata 'servetune' is not JSON \(Expecting value at character 1\)")),
    (NATIVE_PARQUET, "metadata-a-list", parquet_metadata("[1, 2]"),
     Refused(r"Parquet metadata 'servetune' is a JSON list; expected an object")),
    (NATIVE_PARQUET, "metadata-wrong-type", parquet_metadata('{"tenant_names": 5}'),
     Refused(r"Parquet metadata 'servetune', key 'tenant_names': got 5; expected a list of distinct names")),
    (NATIVE_PARQUET, "metadata-unknown-key", parquet_metadata('{"block_token": 16}'),
     Refused(r"Parquet metadata 'servetune': unknown key\(s\) \['block_token'\] \(did you mean 'block_tokens'\?\)")),
    (BY_NAME["mooncake"], "hash-ids-not-integers", with_row(2, hash_ids=["a"]),
     Refused(BY_NAME["mooncake"].at(2, "hash_ids") + r": got \['a'\]")),
    (BY_NAME["mooncake"], "not-an-object", line(2, "[1, 2]"), Refused(r"row 2 \(line 2\): got list")),
    (BY_NAME["burstgpt"], "later-release-columns", with_columns(**{"Session ID": 7, "Elapsed time": 0.5}),
     Accepted(rows=3)),
]


def _cases() -> list:
    cases = []
    for fmt in FORMATS:
        classes = _generic(fmt) + (_azure(fmt) if fmt.name.startswith("azure") else [])
        cases += [pytest.param(Case(fmt, content, expect), id=f"{fmt.name}-{name}") for name, content, expect in classes]
    cases += [pytest.param(Case(fmt, content, expect), id=f"{fmt.name}-{name}") for fmt, name, content, expect in SPECIAL]
    azure = BY_NAME["azure2023"]
    cases += [
        pytest.param(Case(NATIVE_PARQUET, good, Refused("is a Parquet file, which only the native format reads"),
                          trace_format="azure"), id="native-parquet-read-as-azure"),
        pytest.param(Case(azure, None, Refused("is a directory; expected a trace file"),
                          make=lambda tmp: _mkdir(tmp / "trace.csv")), id="any-directory"),
        pytest.param(Case(azure, None, Refused("no such file"), make=lambda tmp: tmp / "absent.csv"),
                     id="any-missing-file"),
    ]
    return cases


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


CASES = _cases()


# -- the test ------------------------------------------------------------------------------


def _file(case: Case, tmp_path: Path) -> Path:
    if case.make is not None:
        return case.make(tmp_path)
    content = case.content(case.fmt)
    path = tmp_path / f"trace.{case.fmt.kind}"
    path.write_bytes(content if isinstance(content, bytes) else render(case.fmt, content))
    return path


def _load(path: Path, case: Case):
    """(trace or None, the TraceError's message or None, the TraceWarnings' messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trace, message = load_trace(path, case.trace_format), None
        except TraceError as exc:
            trace, message = None, str(exc)
    return trace, message, [str(w.message) for w in caught if issubclass(w.category, TraceWarning)]


@pytest.mark.parametrize("case", CASES)
def test_bad_trace_is_named_where_it_is_wrong(tmp_path, case):
    path = _file(case, tmp_path)
    trace, message, said = _load(path, case)
    expect = case.expect
    if isinstance(expect, Refused):
        assert message is not None, f"loaded {trace.n if trace else 0} rows; expected: {expect.where}"
        assert str(path) in message and "\n" not in message, message
        assert re.search(expect.where, message), message
    else:
        assert message is None, message
        assert trace.n == expect.rows
        if isinstance(expect, Warned):
            assert len(said) == 1, said
            assert str(path) in said[0] and re.search(expect.says, said[0]), said[0]
            assert {k: trace.meta.get(k) for k in expect.meta} == expect.meta
        else:
            assert said == []
    _check_cli(path, case, message, said)


def _check_cli(path: Path, case: Case, message: str | None, said: list[str]) -> None:
    """``servetune trace stats`` says the same in one line per problem, with no traceback."""
    args = ["trace", "stats", str(path), *(["--trace-format", case.trace_format] if case.trace_format else [])]
    result = runner.invoke(app, args)
    assert not isinstance(result.exception, Exception), result.output  # SystemExit is the clean exit
    assert "Traceback" not in result.output and ".py:" not in result.stderr
    lines = result.stderr.splitlines()
    if message is not None:
        assert result.exit_code == 2
        assert [x for x in lines if x.startswith("error:")] == [f"error: {message}"]
    else:
        assert result.exit_code == 0, result.output
        assert [x for x in lines if x.startswith("warning:")] == [f"warning: {x}" for x in said]


def test_the_suite_covers_every_format_and_class():
    ids = {p.id for p in CASES}
    assert len(ids) == len(CASES) >= 60
    for fmt in FORMATS:
        for name in ("empty-file", "header-only", "nan-time", "inf-prompt", "negative-output", "zero-prompt",
                     "huge-output-1e12", "unsorted", "duplicate-times", "wrong-type", "missing-column",
                     "misspelt-column", "unknown-column"):
            assert f"{fmt.name}-{name}" in ids


def test_outputs_past_the_context_are_counted_in_a_warning(tmp_path):
    """A request the model's context cannot hold as recorded is never cut silently: the
    warning counts each kind, and ``meta`` keeps the total."""
    from studies.lengths import with_client_caps

    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,max_tokens\n"
                    "0,100,10,\n1,5000,10,\n2,100,9000,\n3,100,9000,9000\n4,100,9000,50\n")
    with pytest.warns(TraceWarning) as caught:
        trace = with_client_caps(load_trace(path), context_len=4096)
    (message,) = [str(w.message) for w in caught]
    assert message == (f"{path}: 4 request(s) need more than the model's context of 4,096 tokens (prompt + "
                       "recorded output; requests 1, 2, 3, 4): 1 with a prompt of the context or more; 2 with their "
                       "output cut by their cap to fit; 1 with a cap past it")
    assert trace.meta["client_caps"]["beyond_context"] == 4
    assert trace.max_tokens.tolist() == [3996, 1, 3996, 9000, 50]  # the cap a client without one gets
