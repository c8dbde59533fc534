"""SPS(B): steps per second at B batched tokens, exported as CSV or read as a step-time source.

The exported curve is a decode-only batch of B sequences at a fixed context, the shape
capacity planners quote. A user who has measured their own engine can hand the same CSV
(``batch_tokens`` and ``step_ms`` or ``steps_per_s``) to ``costmodels.build(...,
sps_csv=PATH)``: step time then depends on the batched tokens alone, with attention's
dependence on context folded into the measured curve.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from costmodels.costmodel import CostModel, CostModelError
from costmodels.steptable import StepTables, step_seconds

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_FLAT_AXIS = np.array([0.0, 1e300])  # a part the measured curve already includes


def sps_curve(cost: CostModel, batches=DEFAULT_BATCHES, context: int = 1024) -> pl.DataFrame:
    """One decode step per batch size B, every sequence reading ``context`` KV tokens."""
    if context < 0:
        raise CostModelError(f"context must be >= 0, got {context}")
    rows = []
    for b in batches:
        if b <= 0:
            raise CostModelError(f"batch sizes must be positive, got {b}")
        seconds, out = step_seconds(cost.tables, float(b), float(b), float(b), float(b * context), 0.0)
        rows.append((int(b), context, seconds * 1e3, 1.0 / seconds, b / seconds, out))
    return pl.DataFrame(rows, schema=["batch_tokens", "context", "step_ms", "steps_per_s", "tokens_per_s",
                                      "out_of_range"], orient="row")


def write_sps_csv(cost: CostModel, path: str | Path, batches=DEFAULT_BATCHES, context: int = 1024) -> pl.DataFrame:
    curve = sps_curve(cost, batches, context)
    curve.write_csv(path)
    return curve


def read_step_csv(path: str | Path) -> StepTables:
    """StepTables from a measured SPS(B) CSV; CostModelError naming the row on bad data."""
    path = Path(path)
    if not path.is_file():
        raise CostModelError(f"SPS CSV {path} does not exist")
    try:
        df = pl.read_csv(path)
    except (pl.exceptions.PolarsError, UnicodeDecodeError) as exc:
        raise CostModelError(f"{path}: cannot read as CSV ({exc})") from exc
    if "batch_tokens" not in df.columns or not ({"step_ms", "steps_per_s"} & set(df.columns)):
        raise CostModelError(f"{path}: needs columns 'batch_tokens' and 'step_ms' (or 'steps_per_s'); "
                             f"found {df.columns}")
    if df.height < 2:
        raise CostModelError(f"{path}: needs at least 2 rows, found {df.height}")
    try:
        tokens = df["batch_tokens"].cast(pl.Float64, strict=True).to_numpy()
        seconds = (df["step_ms"].cast(pl.Float64, strict=True).to_numpy() / 1e3 if "step_ms" in df.columns
                   else 1.0 / df["steps_per_s"].cast(pl.Float64, strict=True).to_numpy())
    except pl.exceptions.PolarsError as exc:
        raise CostModelError(f"{path}: non-numeric value ({exc})") from exc
    for name, values in (("batch_tokens", tokens), ("step time", seconds)):
        bad = np.flatnonzero(~np.isfinite(values) | (values <= 0))
        if len(bad):
            raise CostModelError(f"{path}: row {bad[0] + 2}: {name} {values[bad[0]]!r} is not a positive number")
    rising = np.flatnonzero(np.diff(tokens) <= 0)
    if len(rising):
        raise CostModelError(f"{path}: row {rising[0] + 3}: batch_tokens {tokens[rising[0] + 1]:g} does not "
                             f"increase (previous {tokens[rising[0]]:g}); rows must be strictly ascending")
    falling = np.flatnonzero(np.diff(seconds) < 0)
    if len(falling):
        raise CostModelError(f"{path}: row {falling[0] + 3}: step time falls from {seconds[falling[0]] * 1e3:g} ms "
                             f"to {seconds[falling[0] + 1] * 1e3:g} ms as the batch grows; a step with more "
                             "tokens cannot be faster")
    zero = np.zeros(2)
    return StepTables.from_grids(
        linear_tokens=tokens, linear_s=seconds,
        head_seqs=_FLAT_AXIS, head_s=zero,
        decode_batch=_FLAT_AXIS, decode_kv=_FLAT_AXIS, decode_s=np.zeros((2, 2)), decode_kv_measured=np.full(2, _FLAT_AXIS[1]),
        prefill_pairs=_FLAT_AXIS, prefill_s=zero,
        overhead_s=0.0, scale=1.0,
    )
