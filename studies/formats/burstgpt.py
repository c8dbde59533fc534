"""BurstGPT CSV: ``Timestamp`` (seconds from the trace start), ``Model``, ``Request tokens``,
``Response tokens``, ``Total tokens``, ``Log Type`` (later releases add ``Session ID`` and
``Elapsed time``, which are ignored; any other column is named in a warning).

Failed requests have 0 response tokens; they are kept as requests that generate nothing
(``meta["zero_output_rows"]`` counts them). ``model=`` and ``log_type=`` keep only the
named values, counting what they drop in ``meta["filtered_rows"]``; ``tenants="model"``
or ``"log_type"`` turns that column into tenants. Times stay on the file's clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from studies.formats._rows import Rows, constant_cap, drop_rows, read_csv
from studies.traces import Trace, TraceError, encode_names

COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
_IGNORED = ("Session ID", "Elapsed time")  # later releases' columns: known, and not needed
_TENANT_COLUMNS = {"model": "Model", "log_type": "Log Type"}


def read(path: Path, *, strict: bool = False, model: str | Sequence[str] | None = None,
         log_type: str | Sequence[str] | None = None, tenants: str | None = None,
         max_tokens: int | None = None, drop_zero_prompt: bool = False) -> Trace:
    if tenants is not None and tenants not in _TENANT_COLUMNS:
        raise TraceError(f"option tenants={tenants!r}; expected one of {list(_TENANT_COLUMNS)} or None")
    meta: dict = {"format": "burstgpt"}
    rows = read_csv(path)
    rows.require(*COLUMNS)
    rows.ignore_unknown(COLUMNS + _IGNORED, "BurstGPT")
    rows = _keep(rows, "Model", model, "model", meta)
    rows = _keep(rows, "Log Type", log_type, "log_type", meta)
    if drop_zero_prompt:
        prompt = rows.frame["Request tokens"].str.strip_chars()
        rows = drop_rows(rows, (prompt == "0").fill_null(False).to_numpy(), "zero_prompt", meta)
    hint = "" if drop_zero_prompt else " (drop_zero_prompt=True drops rows with 0)"
    output = rows.tokens("Response tokens", minimum=0)
    rows.integers("Total tokens", minimum=0)  # validated, not used: it is request + response
    meta["zero_output_rows"] = int(np.count_nonzero(output == 0))
    columns = {
        "arrival_s": rows.times("Timestamp"),
        "prompt_tokens": rows.tokens("Request tokens", minimum=1, hint=hint),
        "output_tokens": output,
        "max_tokens": constant_cap(max_tokens, rows.n),
    }
    fields = {}
    if tenants is not None:
        columns["tenant"], fields["tenant_names"] = encode_names(rows.strings(_TENANT_COLUMNS[tenants], "unknown"))
    return rows.to_trace(columns, time_column="Timestamp", strict=strict, meta=meta, **fields)


def _keep(rows: Rows, column: str, wanted: str | Sequence[str] | None, reason: str, meta: dict) -> Rows:
    """Filter to the wanted values of a text column (an explicit option, so counted)."""
    if wanted is None:
        return rows
    wanted = [wanted] if isinstance(wanted, str) else list(wanted)
    values = rows.strings(column, "")
    present = set(values.tolist())
    unknown = [w for w in wanted if w not in present]
    if unknown:
        raise TraceError(f"{rows.path}: column {column!r} has no rows with {unknown}; "
                         f"values present: {sorted(present)}")
    return drop_rows(rows, ~np.isin(values, wanted), reason, meta)
