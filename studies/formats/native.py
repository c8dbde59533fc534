"""The native schema: every ``Trace`` field, as Parquet, CSV or JSON lines.

Columns (documented in ``docs/traces.md``; only the first three are required):

========================  =========================================================
``arrival_s``             seconds, float, >= 0
``prompt_tokens``         integer >= 1
``output_tokens``         integer >= 0 (the true length)
``max_tokens``            integer >= 1, the client's cap; empty = none given (the
                          trace marks the row ``CAP_NONE``: ``max_tokens`` holds
                          ``NO_CAP`` until ``studies.lengths.with_client_caps`` sets
                          the study's cap)
``output_estimate``       integer >= 1 in every row, the scheduler's predicted output
                          length (``Trace.output_estimate``); absent = the cap
``tenant``                name; empty = ``default``
``priority``              integer, larger = more urgent; empty = 0
``slo_class``             name; empty = ``default``
``deadline_s``            absolute seconds on the arrival clock; empty/NaN = none
``block_hashes``          prefix-block ids: a list (Parquet, JSONL) or space-separated
                          integers (CSV); empty = none
``block_tokens``          tokens per block, the same in every row; default 512
========================  =========================================================

Parquet files also carry the tenant and SLO class name order, the source and the
estimator's name in their key-value metadata (key ``servetune``), so codes round-trip
exactly; in CSV and JSONL, names are numbered in order of first appearance and an
``output_estimate`` column reads back as estimator ``"file"``. Caps a study default set
(``CAP_DEFAULT``) are written as values, so they read back as the file's caps.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

from studies.formats._rows import Rows, read_csv, read_jsonl, read_parquet
from studies.traces import (
    CAP_GIVEN,
    CAP_NONE,
    ESTIMATE_IS_CAP,
    NO_CAP,
    Trace,
    TraceError,
    encode_names,
)

COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens", "max_tokens", "tenant", "priority",
           "slo_class", "deadline_s", "block_hashes", "block_tokens", "output_estimate")
JSON_SCHEMA = {
    "arrival_s": pl.Float64, "prompt_tokens": pl.Int64, "output_tokens": pl.Int64,
    "max_tokens": pl.Int64, "tenant": pl.String, "priority": pl.Int64, "slo_class": pl.String,
    "deadline_s": pl.Float64, "block_hashes": pl.List(pl.Int64), "block_tokens": pl.Int64,
    "output_estimate": pl.Int64,
}
METADATA_KEY = "servetune"
SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}


def kind_of(path: Path) -> str:
    """``parquet``, ``jsonl`` or ``csv``, from the first bytes of the file."""
    with open(path, "rb") as handle:
        head = handle.read(4096)
    if head.startswith(b"PAR1"):
        return "parquet"
    return "jsonl" if head.lstrip().startswith(b"{") else "csv"


def read(path: Path, *, strict: bool = False) -> Trace:
    kind = kind_of(path)
    saved: dict = {}
    if kind == "parquet":
        rows = read_parquet(path)
        saved = json.loads(pl.read_parquet_metadata(path).get(METADATA_KEY, "{}"))
    elif kind == "jsonl":
        rows = read_jsonl(path, JSON_SCHEMA)
        _reject_unknown_keys(path)
    else:
        rows = read_csv(path)
    rows.reject_unknown(COLUMNS)
    rows.require("arrival_s", "prompt_tokens", "output_tokens")
    block_tokens = _block_tokens(rows, saved)
    arrival = rows.times("arrival_s")
    prompt = rows.integers("prompt_tokens", minimum=1)
    output = rows.integers("output_tokens", minimum=0)
    max_tokens = rows.optional_integers("max_tokens", default=np.full(len(output), NO_CAP, dtype=np.int64))
    rows.check("max_tokens", [(max_tokens < 1, "an integer >= 1, or nothing for no cap")])
    cap_source = np.where(rows.given("max_tokens"), CAP_GIVEN, CAP_NONE).astype(np.int8)
    estimate, estimator = None, {}
    if rows.given("output_estimate").any():  # JSONL reads an absent key as an all-empty column
        estimate = rows.integers("output_estimate", minimum=1)
        estimator = {"output_estimator": saved.get("output_estimator", "file")}
    deadline = rows.optional_times("deadline_s")
    rows.check("deadline_s", [(deadline < arrival, "a time >= arrival_s, or nothing for none")])
    tenant, tenant_names = _codes(rows.strings("tenant", "default"), saved.get("tenant_names"))
    slo_class, slo_names = _codes(rows.strings("slo_class", "default"), saved.get("slo_class_names"))
    columns = {
        "arrival_s": arrival,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "max_tokens": max_tokens,
        "max_tokens_source": cap_source,
        "output_estimate": estimate,
        "tenant": tenant,
        "priority": _priorities(rows),
        "slo_class": slo_class,
        "deadline_s": deadline,
    }
    offsets, hashes = rows.block_lists("block_hashes", prompt, block_tokens)
    meta = {"format": "native", **saved.get("meta", {})}
    trace = rows.to_trace(columns, time_column="arrival_s", strict=strict, meta=meta,
                          block_offsets=offsets, block_hashes=hashes, block_tokens=block_tokens,
                          tenant_names=tenant_names, slo_class_names=slo_names, **estimator)
    return trace.replace(source=saved["source"]) if saved.get("source") else trace


def _reject_unknown_keys(path: Path) -> None:
    """Polars ignores keys outside the schema; a misspelt column must not vanish silently."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                unknown = sorted(set(json.loads(line)) - set(COLUMNS))
                if unknown:
                    raise TraceError(f"{path}: line {number}: unknown key(s) {unknown}; "
                                     f"expected only {list(COLUMNS)}")
                return


def _block_tokens(rows: Rows, saved: dict) -> int:
    if "block_tokens" not in rows.columns:
        return int(saved.get("block_tokens", 512))
    values = rows.integers("block_tokens", minimum=1)
    rows.check("block_tokens", [(values != values[0], f"{values[0]}, as in the first row (one block size per trace)")])
    return int(values[0])


def _priorities(rows: Rows) -> np.ndarray:
    values = rows.optional_integers("priority", default=0)
    limit = np.iinfo(np.int32)
    rows.check("priority", [((values < limit.min) | (values > limit.max), "a 32-bit integer")])
    return values


def _codes(labels: np.ndarray, saved_names: list[str] | None) -> tuple[np.ndarray, tuple[str, ...]]:
    """Codes for name labels: the saved name order first, new names after in first-seen order."""
    codes, seen = encode_names(labels)
    names = list(saved_names or [])
    names += [name for name in seen if name not in names]
    remap = np.array([names.index(name) for name in seen], dtype=np.int32)
    return remap[codes], tuple(names)


def write(trace: Trace, path: Path) -> Path:
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise TraceError(f"{path}: unknown suffix {path.suffix!r}; expected one of {sorted(SUFFIXES)}")
    frame = pl.DataFrame({
        "arrival_s": trace.arrival_s,
        "prompt_tokens": trace.prompt_tokens,
        "output_tokens": trace.output_tokens,
        "max_tokens": pl.Series(trace.max_tokens).set(pl.Series(trace.max_tokens_source == CAP_NONE), None),
        "tenant": pl.Series(trace.tenant_labels, dtype=pl.String),
        "priority": trace.priority.astype(np.int64),
        "slo_class": pl.Series(trace.slo_class_labels, dtype=pl.String),
        "deadline_s": trace.deadline_s,
        "block_hashes": _lists(trace),
        "block_tokens": np.full(trace.n, trace.block_tokens, dtype=np.int64),
    })
    with_estimate = trace.output_estimator != ESTIMATE_IS_CAP
    if with_estimate:
        frame = frame.with_columns(pl.Series("output_estimate", trace.output_estimate))
    if kind == "parquet":
        saved = {"tenant_names": list(trace.tenant_names), "slo_class_names": list(trace.slo_class_names),
                 "block_tokens": trace.block_tokens, "source": trace.source,
                 "meta": _jsonable(trace.meta)}
        if with_estimate:
            saved["output_estimator"] = trace.output_estimator
        frame.write_parquet(path, metadata={METADATA_KEY: json.dumps(saved)})
    elif kind == "jsonl":
        frame.with_columns(pl.col("deadline_s").fill_nan(None)).write_ndjson(path)
    else:
        frame.with_columns(
            pl.col("deadline_s").fill_nan(None),
            pl.col("block_hashes").list.eval(pl.element().cast(pl.String)).list.join(" "),
        ).write_csv(path)
    return path


def _lists(trace: Trace) -> pl.Series:
    """The CSR blocks as a polars list column, without a Python loop."""
    lists = pa.LargeListArray.from_arrays(pa.array(trace.block_offsets), pa.array(trace.block_hashes))
    return pl.Series("block_hashes", lists).cast(pl.List(pl.Int64))


def _jsonable(meta: dict) -> dict:
    """The JSON-serialisable part of ``meta`` (provenance only; never needed to replay)."""
    return {key: value for key, value in meta.items() if _is_jsonable(value)}


def _is_jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
