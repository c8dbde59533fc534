"""Trace file formats: one module per format, each with ``read`` (and maybe ``write``).

``detect`` recognises a file by its content (Parquet magic, the keys of the first JSON
line, or the CSV header), never by its name, so a renamed file still loads.
"""

from __future__ import annotations

import csv
import inspect
import json
from pathlib import Path

from studies.formats import azure, burstgpt, mooncake, native
from studies.traces import Trace, TraceError

READERS = {"mooncake": mooncake.read, "azure": azure.read, "burstgpt": burstgpt.read, "native": native.read}
WRITERS = {"native": native.write, "mooncake": mooncake.write, "azure": azure.write}
FORMATS = tuple(READERS)


#: Leading bytes of the compressed files traces are often shipped as.
_COMPRESSED = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"PK\x03\x04": "zip"}


def check_file(path: Path) -> None:
    """Raise unless ``path`` is a file: a folder or a missing path is named as such."""
    if path.is_dir():
        raise TraceError(f"{path}: is a directory; expected a trace file ({', '.join(FORMATS)})")
    if not path.is_file():
        raise TraceError(f"{path}: no such file")


def _head(path: Path) -> bytes:
    """The first 64 KiB of a trace file, refused when they are not a trace's: a compressed
    or other binary file would otherwise be decoded and quoted as text."""
    check_file(path)
    with open(path, "rb") as handle:
        head = handle.read(65536)
    for magic, kind in _COMPRESSED.items():
        if head.startswith(magic):
            raise TraceError(f"{path}: is {kind}-compressed; decompress it first (servetune reads "
                             f"Parquet, CSV and JSON lines)")
    nul = head.find(b"\x00")
    if nul >= 0 and not head.startswith(b"PAR1"):
        raise TraceError(f"{path}: holds binary bytes (NUL at byte {nul}); expected a Parquet, CSV or "
                         f"JSON-lines trace")
    return head


def detect(path: Path) -> str:
    """The format of a trace file, from its first bytes."""
    head = _head(path)
    if head.startswith(b"PAR1"):
        return "native"
    # Decode before testing for emptiness: str.strip also removes Unicode blanks.
    lines = [(i, line) for i, line in enumerate(head.decode("utf-8", "replace").splitlines(), 1) if line.strip()]
    if not lines:
        raise TraceError(f"{path}: the file is empty; expected a trace ({', '.join(FORMATS)})")
    number, first = lines[0]
    if first.lstrip().startswith("{"):
        try:
            keys = set(json.loads(first))
        except json.JSONDecodeError as err:
            raise TraceError(f"{path}: row 1 (line {number}), character {err.colno}: not valid JSON "
                             f"({err.msg}); expected one JSON object per line") from None
        if "arrival_s" in keys:
            return "native"
        if "input_length" in keys or "hash_ids" in keys:
            return "mooncake"
        raise TraceError(f"{path}: JSON keys {sorted(keys)} match no known format; expected Mooncake "
                         f"(timestamp, input_length, output_length, hash_ids) or native (arrival_s, ...)")
    header = {name.strip() for name in next(csv.reader([first]))}
    if "TIMESTAMP" in header:
        return "azure"
    if "Request tokens" in header or {"Timestamp", "Model"} <= header:
        return "burstgpt"
    if "arrival_s" in header:
        return "native"
    raise TraceError(f"{path}: unknown trace format (first line {first[:100]!r}); expected Mooncake JSONL, "
                     f"Azure CSV, BurstGPT CSV or a native CSV/JSONL/Parquet file, or name the format")


def read(path: Path, format: str | None, *, strict: bool, options: dict) -> Trace:
    if format is not None and format not in READERS:
        raise TraceError(f"unknown trace format {format!r}; expected one of {list(FORMATS)}")
    if format is None:
        name = detect(path)
    elif _head(path).startswith(b"PAR1") and format != "native":
        raise TraceError(f"{path}: is a Parquet file, which only the native format reads; expected "
                         f"{format} text, or drop the format (it is detected)")
    else:
        name = format
    reader = READERS[name]
    valid = [p for p in inspect.signature(reader).parameters if p not in ("path", "strict")]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TraceError(f"{path}: {name} traces take no option(s) {unknown}; valid: {valid}")
    return reader(path, strict=strict, **options)


def write(trace: Trace, path: Path, format: str = "native") -> Path:
    if format not in WRITERS:
        raise TraceError(f"cannot write trace format {format!r}; expected one of {list(WRITERS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return WRITERS[format](trace, path)
