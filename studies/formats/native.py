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
``adapter``               LoRA adapter name; empty = the base model
``model_version``         model (weights / tokenizer) version name; empty = the one
                          model served
``cache_salt``            security domain (vLLM's and SGLang's per-request
                          ``cache_salt``): cached KV is shared only within one salt;
                          empty = none
``deadline_s``            absolute seconds on the arrival clock; empty/NaN = none
``block_hashes``          prefix-block ids: a list (Parquet, JSONL) or space-separated
                          integers (CSV); empty = none
``block_tokens``          tokens per block, the same in every row; default 512
========================  =========================================================

Parquet files also carry the tenant, SLO class, adapter, model version and cache salt name
order, the source and the
estimator's name in their key-value metadata (key ``servetune``), so codes round-trip
exactly (metadata that is not that JSON object is refused by name); in CSV and JSONL,
names are numbered in order of first appearance and an ``output_estimate`` column reads
back as estimator ``"file"``. A column or JSON key outside this table is an error naming
it and the column it may misspell, checked on every line; a JSON key no line carries is
an absent column, as in CSV. Token counts above ``MAX_TOKENS`` are refused. Caps a study default set
(``CAP_DEFAULT``) are written as values, so they read back as the file's caps.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

from studies.formats._rows import Rows, read_csv, read_jsonl, read_parquet
from studies.names import unknown_names
from studies.traces import (
    BASE,
    CAP_GIVEN,
    CAP_NONE,
    ESTIMATE_IS_CAP,
    IDENTITY_KEYS,
    MAX_TOKENS,
    NO_CAP,
    Trace,
    TraceError,
    encode_names,
)

COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens", "max_tokens", "tenant", "priority",
           "slo_class", "deadline_s", "block_hashes", "block_tokens", "output_estimate", *IDENTITY_KEYS)
JSON_SCHEMA = {
    "arrival_s": pl.Float64, "prompt_tokens": pl.Int64, "output_tokens": pl.Int64,
    "max_tokens": pl.Int64, "tenant": pl.String, "priority": pl.Int64, "slo_class": pl.String,
    "deadline_s": pl.Float64, "block_hashes": pl.List(pl.Int64), "block_tokens": pl.Int64,
    "output_estimate": pl.Int64, **dict.fromkeys(IDENTITY_KEYS, pl.String),
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
        saved = _saved_metadata(path)
    elif kind == "jsonl":
        rows = read_jsonl(path, JSON_SCHEMA, known=COLUMNS)
    else:
        rows = read_csv(path)
    rows.reject_unknown(COLUMNS)
    rows.require("arrival_s", "prompt_tokens", "output_tokens")
    block_tokens = _block_tokens(rows, saved)
    arrival = rows.times("arrival_s")
    prompt = rows.tokens("prompt_tokens", minimum=1)
    output = rows.tokens("output_tokens", minimum=0)
    cap_source = np.where(rows.given("max_tokens"), CAP_GIVEN, CAP_NONE).astype(np.int8)
    max_tokens = rows.optional_integers("max_tokens", default=np.full(len(output), NO_CAP, dtype=np.int64))
    rows.check("max_tokens", [(max_tokens < 1, "an integer >= 1, or nothing for no cap"),
                              ((max_tokens > MAX_TOKENS) & (cap_source == CAP_GIVEN),
                               f"at most {MAX_TOKENS:,} tokens (no model holds a longer sequence), or nothing")])
    estimate, estimator = None, {}
    if "output_estimate" in rows.columns:
        estimate = rows.tokens("output_estimate", minimum=1)
        estimator = {"output_estimator": saved.get("output_estimator", "file")}
    deadline = rows.optional_times("deadline_s")
    rows.check("deadline_s", [(deadline < arrival, "a time >= arrival_s, or nothing for none")])
    tenant, tenant_names = _codes(rows.strings("tenant", "default"), saved.get("tenant_names"))
    slo_class, slo_names = _codes(rows.strings("slo_class", "default"), saved.get("slo_class_names"))
    identity_codes, identity_names = {}, {}
    for name in IDENTITY_KEYS:
        _require_text(rows, name)
        identity_codes[name], identity_names[f"{name}_names"] = _codes(rows.strings(name, BASE),
                                                                       saved.get(f"{name}_names", [BASE]))
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
        **identity_codes,
    }
    offsets, hashes = rows.block_lists("block_hashes", prompt, block_tokens)
    meta = {"format": "native", **saved.get("meta", {})}
    trace = rows.to_trace(columns, time_column="arrival_s", strict=strict, meta=meta,
                          block_offsets=offsets, block_hashes=hashes, block_tokens=block_tokens,
                          tenant_names=tenant_names, slo_class_names=slo_names, **identity_names, **estimator)
    return trace.replace(source=saved["source"]) if saved.get("source") else trace


def _names(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value) and len(set(value)) == len(value)


#: The metadata a native Parquet file carries (``write``): key -> (check, what it must be).
_SAVED = {
    "tenant_names": (_names, "a list of distinct names"),
    "slo_class_names": (_names, "a list of distinct names"),
    **{f"{key}_names": (_names, "a list of distinct names") for key in IDENTITY_KEYS},
    "block_tokens": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_TOKENS,
                     f"an integer in [1, {MAX_TOKENS}]"),
    "source": (lambda v: isinstance(v, str), "a string"),
    "meta": (lambda v: isinstance(v, dict), "an object"),
    "output_estimator": (lambda v: isinstance(v, str) and bool(v), "a non-empty name"),
}


def _saved_metadata(path: Path) -> dict:
    """The ``servetune`` key-value metadata of a Parquet file, checked field by field: a
    file another tool wrote or edited must be refused by name, not crash the reader."""
    text = pl.read_parquet_metadata(path).get(METADATA_KEY)
    if text is None:
        return {}
    where = f"{path}: Parquet metadata {METADATA_KEY!r}"
    try:
        saved = json.loads(text)
    except json.JSONDecodeError as err:
        raise TraceError(f"{where} is not JSON ({err.msg} at character {err.pos + 1}); expected the object "
                         f"servetune writes, or no such key") from None
    if not isinstance(saved, dict):
        raise TraceError(f"{where} is a JSON {type(saved).__name__}; expected an object with keys {list(_SAVED)}")
    if set(saved) - set(_SAVED):
        raise TraceError(f"{where}: {unknown_names('key', set(saved) - set(_SAVED), _SAVED)}")
    for key, value in saved.items():
        fits, expected = _SAVED[key]
        if not fits(value):
            raise TraceError(f"{where}, key {key!r}: got {value!r}; expected {expected}")
    return saved


def _block_tokens(rows: Rows, saved: dict) -> int:
    if "block_tokens" not in rows.columns:
        return int(saved.get("block_tokens", 512))
    values = rows.tokens("block_tokens", minimum=1)
    rows.check("block_tokens", [(values != values[0], f"{values[0]}, as in the first row (one block size per trace)")])
    return int(values[0])


def _require_text(rows: Rows, column: str) -> None:
    """A name column must hold text (or nothing): a number where a name belongs is refused
    by row, never turned into a name."""
    if column not in rows.columns or rows.frame[column].dtype in (pl.String, pl.Null):
        return
    raw = rows.frame[column]
    first = int(np.flatnonzero(raw.is_not_null().to_numpy())[0])
    raise rows.error(first, column, f"a name (text), not {raw.dtype}")


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
        **{key: pl.Series(trace.labels(key), dtype=pl.String) for key in IDENTITY_KEYS},
    })
    with_estimate = trace.output_estimator != ESTIMATE_IS_CAP
    if with_estimate:
        frame = frame.with_columns(pl.Series("output_estimate", trace.output_estimate))
    if kind == "parquet":
        saved = {"tenant_names": list(trace.tenant_names), "slo_class_names": list(trace.slo_class_names),
                 **{f"{key}_names": list(getattr(trace, f"{key}_names")) for key in IDENTITY_KEYS},
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
