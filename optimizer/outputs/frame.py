"""``trials.parquet``: every trial of the study as one table row.

Built with polars from ``study.trials`` with Optuna's column prefixes, so the whole study
can be read back without Optuna; nested values become JSON text, which parquet stores.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import polars as pl
from optuna.trial import FrozenTrial, TrialState

from optimizer.outputs.trials import baseline_name, is_feasible
from studies.metrics import json_safe


def trials_frame(trials: Sequence[FrozenTrial], names: Sequence[str]) -> pl.DataFrame:
    """One row per trial: values by metric name, params, constraints, the report's scalars.

    Column prefixes follow Optuna's ``trials_dataframe``: ``params_``, ``user_attrs_``,
    plus ``constraints_`` and ``report_``; nested report parts are JSON strings.
    """
    rows = []
    for t in trials:
        row: dict[str, Any] = {
            "number": t.number,
            "state": t.state.name,
            "baseline": baseline_name(t),
            "feasible": is_feasible(t) if t.state == TrialState.COMPLETE else None,
            "datetime_start": t.datetime_start,
            "datetime_complete": t.datetime_complete,
            "duration_s": t.duration.total_seconds() if t.duration is not None else None,
        }
        for i, name in enumerate(names):
            row[f"values_{name}"] = t.values[i] if t.values is not None else None
        row.update({f"params_{k}": v for k, v in t.params.items()})
        row.update({f"constraints_{k}": v for k, v in t.constraints.items()})
        for key, value in t.user_attrs.items():
            if key == "report" and isinstance(value, dict):
                row.update({f"report_{k}": _cell(v) for k, v in value.items()})
            elif key not in ("baseline",):
                row[f"user_attrs_{key}"] = _cell(value)
        rows.append(row)
    columns: dict[str, list[Any]] = {}
    for i, row in enumerate(rows):
        for key, value in row.items():
            columns.setdefault(key, [None] * len(rows))[i] = value
    return pl.DataFrame({k: pl.Series(k, v, strict=False) for k, v in columns.items()})


def _cell(value: Any) -> Any:
    """A parquet-friendly scalar: nested values as JSON text."""
    if isinstance(value, dict | list | tuple):
        return json.dumps(json_safe(value), sort_keys=True)
    return value
