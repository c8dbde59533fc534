"""Measured serving runs: a runs file read into canonical columns, checked row by row.

A run is one closed-loop benchmark (``batch_size`` clients of ``isl`` prompt and ``osl``
output tokens, mean TTFT and TPOT measured) on one instance layout. ``load_runs`` reads
aiconfigurator's silicon CSVs or a file in canonical names, names the file, row and column
of every bad value, and gives each run its layout (``SETUP``) and benchmark ``client``.
Calibration (``costmodels.calibration``, ``optimizer.fidelity.replayfit``) and validation fit and
score these rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from costmodels.architecture import ALIASES, load_model
from costmodels.costmodel import CostModelError, read_json_file

# canonical column -> accepted spellings (aiconfigurator's silicon CSV first)
COLUMNS = {
    "model": ("model_path", "model"),
    "gpu": ("system", "gpu"),
    "framework": ("backend", "framework"),
    "tp": ("tp_size", "tp"),
    "gemm_dtype": ("gemm_quant_mode", "gemm_dtype"),
    "kv_dtype": ("kv_cache_dtype", "kv_dtype"),
    "batch_size": ("batch_size", "concurrency"),
    "isl": ("isl",),
    "osl": ("osl",),
    "ttft_ms": ("silicon_ttft_ms", "ttft_ms"),
    "tpot_ms": ("silicon_tpot_ms", "tpot_ms"),
    "attention_dp_size": ("attention_dp_size",),
    "moe_tp_size": ("moe_tp_size",),
    "moe_ep_size": ("moe_ep_size",),
    "pp_size": ("pp_size",),
    "framework_version": ("backend_version", "framework_version"),
}
#: the parallel layout columns (``_layout``): absent or empty, a run is plain TP
LAYOUT = ("attention_dp_size", "moe_tp_size", "moe_ep_size", "pp_size")
#: columns a runs file may lack: a missing GEMM dtype is bf16; a missing KV dtype stays
#: null (not recorded: a caller assumes the GEMM dtype and should say so); a missing
#: framework version is the pinned engine's (its defaults, e.g. vLLM's loop, are assumed)
OPTIONAL = {"gemm_dtype", "kv_dtype", "framework_version", *LAYOUT}
#: The benchmark clients a run may name (``client``; the closed-loop replay drives each as
#: its client did: ``optimizer.fidelity.closedloop.CLIENT_VARIANTS``). A file without the column
#: names it per run from aiconfigurator's ``silicon_data_source`` (``client_column``).
CLIENT_NAMES = ("aiperf", "inferencex")
#: ``silicon_data_source`` tags of runs from SemiAnalysis InferenceX's nightly database
#: rather than aiconfigurator's own AIPerf script: its dumps ("db-dump/<date>; config_id=..;
#: workflow_run_id=..") and its dated exports ("source_file=<date>.csv; model=..; wip=..").
#: Both hold exactly InferenceX's grid (ISL/OSL 1024/1024, 1024/8192, 8192/1024, concurrency
#: 1 to 256) and no other; aiconfigurator's AIPerf rows name their source CSV by path.
INFERENCEX_SOURCE = r"^(db-dump/|source_file=\d{4}-\d{2}-\d{2}\.csv;)"
#: GEMM quantization modes named as servetune's dtypes. aiconfigurator's "fp8_block" is an
#: FP8 GEMM with 128x128 block scales; the block scaling is the checkpoint's
#: (``architecture.weight_quant``), which picks the block-scaled tables itself.
GEMM_DTYPES = {"float16": "bf16", "bfloat16": "bf16", "fp8_block": "fp8"}
TEXT = ("model", "gpu", "framework")
COUNTS = ("tp", "batch_size", "isl", "osl")  # whole numbers
NUMBERS = (*COUNTS, "ttft_ms", "tpot_ms")


def load_runs(path: str | Path, *, builtin_only: bool = True, bad_rows: str = "raise",
              model_config: str | Path | None = None) -> pl.DataFrame:
    """Measured runs with canonical columns; CostModelError naming file, row and column on bad data.

    ``tp`` is the GPUs of one instance (``costmodels.layout.ParallelLayout.tp``), with its
    layout in ``moe_ep_size`` and ``attention_dp_size``; a file in aiconfigurator's format
    gives ``tp_size`` per attention-DP group, so GPUs = ``tp_size x attention_dp_size``,
    which must equal ``moe_tp_size x moe_ep_size`` (see ``_layout``). ``batch_size`` is the
    clients of one attention-DP group, as aiconfigurator records it (its rows with
    ``attention_dp_size`` 8 note ``silicon_concurrency`` = 8 x ``batch_size``).

    An optional ``mtp_acceptance`` column gives an MTP run's measured acceptance per draft
    position, in (0, 1] (blank: not recorded; ``optimizer.fidelity.inferencex`` then assumes one).

    Built-in model names become canonical; others are an error unless ``builtin_only`` is
    False (validation against a model given by its config.json, ``model_config``, for the
    model ``config_target`` names), when they stay as written. Whether a model has experts
    (so whether its MoE layout columns are read) comes from its config, built in or given.
    A bad value (missing, not a positive number, a fractional count) is an error under
    ``bad_rows="raise"`` (calibration: a fit must not silently lose runs); under ``"mark"``
    (validation scores every other row) its row gets an ``error`` column, "row N: column
    'osl': -5 is not a positive number", N the file line (the header is line 1), and nulls
    in the bad columns. A file that is bad as a whole (unreadable, no rows, a missing
    column, a numeric column without one number) raises either way.
    """
    if bad_rows not in ("raise", "mark"):
        raise ValueError(f"bad_rows must be 'raise' or 'mark', got {bad_rows!r}")
    path = Path(path)
    raw = _read_runs(path)
    runs = raw.select(**_canonical_columns(path, raw), client=client_column(raw)).with_columns(
        pl.col("gemm_dtype").cast(pl.Utf8).fill_null("bf16").replace(GEMM_DTYPES),
        pl.col("kv_dtype").cast(pl.Utf8).str.to_lowercase(), pl.col("model").cast(pl.Utf8),
        pl.col("gpu").cast(pl.Utf8), pl.col("framework").cast(pl.Utf8).str.to_lowercase())
    problems = [[] for _ in range(runs.height)]
    for name in TEXT:
        _check_text(runs[name], problems)
    for i in np.flatnonzero(~runs["client"].is_in(CLIENT_NAMES).fill_null(False).to_numpy()).tolist():
        problems[i].append(f"column 'client': {runs['client'][i]!r} is not one of {', '.join(CLIENT_NAMES)}")
    cleaned = [_check_numbers(path, runs[name], problems) for name in NUMBERS]
    runs = runs.with_columns(cleaned)
    runs = runs.drop(LAYOUT).with_columns(_layout(runs, problems, _has_experts(runs["model"], model_config)))
    if "mtp_acceptance" in raw.columns:  # a run that measured its drafter (optimizer.fidelity.inferencex)
        runs = runs.with_columns(_acceptance(raw["mtp_acceptance"], problems))
    first = next((i for i, p in enumerate(problems) if p), None)
    if first is not None and bad_rows == "raise":
        raise CostModelError(f"{path}: row {first + 2}, {problems[first][0]}")
    unknown = sorted({m for m in runs["model"].drop_nulls().to_list() if m.lower() not in ALIASES})
    if unknown and builtin_only:
        raise CostModelError(f"{path}: unknown models {unknown}; calibrate built-in models only")
    runs = runs.with_columns(pl.col("model").str.to_lowercase().replace_strict(ALIASES, default=pl.col("model")),
                             *(pl.col(c).cast(pl.Int64) for c in (*COUNTS, "moe_ep_size", "attention_dp_size")))
    if bad_rows == "mark":
        errors = [f"row {i + 2}: {'; '.join(p)}" if p else None for i, p in enumerate(problems)]
        runs = runs.with_columns(pl.Series("error", errors, dtype=pl.Utf8))
    return runs


def client_column(raw: pl.DataFrame) -> pl.Expr:
    """The ``client`` that measured each run: the file's own column when it has one (lower
    case), else from ``silicon_data_source`` (``INFERENCEX_SOURCE`` rows "inferencex"),
    else "aiperf", the client of aiconfigurator's benchmark script."""
    if "client" in raw.columns:
        return pl.col("client").cast(pl.Utf8).str.to_lowercase()
    if "silicon_data_source" in raw.columns:
        source = pl.col("silicon_data_source").cast(pl.Utf8).fill_null("")
        return pl.when(source.str.contains(INFERENCEX_SOURCE)).then(pl.lit("inferencex")).otherwise(pl.lit("aiperf"))
    return pl.lit("aiperf")


def _read_runs(path: Path) -> pl.DataFrame:
    if not path.is_file():
        raise CostModelError(f"runs file {path} does not exist")
    try:
        raw = pl.read_csv(path, infer_schema_length=None)
    except (pl.exceptions.PolarsError, UnicodeDecodeError) as exc:
        raise CostModelError(f"{path}: cannot read as CSV ({exc})") from exc
    if raw.is_empty():
        raise CostModelError(f"{path}: no runs")
    return raw


def _canonical_columns(path: Path, raw: pl.DataFrame) -> dict[str, pl.Expr]:
    """Canonical name -> the file's column under its first accepted spelling (null if optional and absent)."""
    cols = {}
    for name, spellings in COLUMNS.items():
        found = next((s for s in spellings if s in raw.columns), None)
        if found is None and name not in OPTIONAL:
            raise CostModelError(f"{path}: missing column {name!r} (accepted: {', '.join(spellings)})")
        cols[name] = pl.col(found) if found else pl.lit(None, dtype=pl.Utf8)
    return cols


def _check_text(column: pl.Series, problems: list[list[str]]) -> None:
    """Append "missing value" to the problems of each row without a value in ``column``."""
    for i in np.flatnonzero(column.is_null().to_numpy()).tolist():
        problems[i].append(f"column {column.name!r}: missing value")


def _check_numbers(path: Path, column: pl.Series, problems: list[list[str]]) -> pl.Series:
    """``column`` as floats, null where a row's value is bad (each such row's reason appended
    to its problems): missing, not a positive number (text included), or, for a count, not
    whole. A column without a single number is a malformed file: CostModelError."""
    name = column.name
    values = column.cast(pl.Float64, strict=False)  # text that is no number becomes null
    if values.is_null().all():
        raise CostModelError(f"{path}: column {name!r} is not numeric (first value {column[0]!r})")
    v = values.fill_null(np.nan).to_numpy()
    with np.errstate(invalid="ignore"):
        positive = np.isfinite(v) & (v > 0)
        ok = positive & (v == np.round(v)) if name in COUNTS else positive
    for i in np.flatnonzero(~ok).tolist():
        raw = column[i]
        why = ("missing value" if raw is None else f"{raw!r} is not a positive number" if not positive[i]
               else f"{raw!r} is not a whole number")
        problems[i].append(f"column {name!r}: {why}")
    return pl.Series(name, np.where(ok, v, np.nan)).fill_nan(None)


def _acceptance(column: pl.Series, problems: list[list[str]]) -> pl.Series:
    """The optional ``mtp_acceptance`` column (each MTP draft position's acceptance the run
    measured) as floats: blank where the run did not record one, else in (0, 1]."""
    values = column.cast(pl.Float64, strict=False).to_list()
    for i, (raw, x) in enumerate(zip(column.to_list(), values, strict=True)):
        if raw not in (None, "") and not (x is not None and 0.0 < x <= 1.0):
            problems[i].append(f"column 'mtp_acceptance': {raw!r} is not a number in (0, 1]")
            values[i] = None
    return pl.Series("mtp_acceptance", values, dtype=pl.Float64)


def _has_experts(models: pl.Series, model_config: str | Path | None = None) -> np.ndarray:
    """Per run, whether its model may have expert layers: False for a model whose config
    (built in, or ``model_config`` for the model ``config_target`` names) has none; a model
    without a readable config gets its MoE columns checked."""
    names = models.drop_nulls().unique(maintain_order=True).to_list()
    target = config_target([m for m in names if m.lower() not in ALIASES], model_config)
    dense = {}
    for m in names:
        canonical = ALIASES.get(m.lower())
        try:
            if canonical is not None:
                dense[m] = load_model(canonical).moe is None
            elif m == target:
                dense[m] = load_model(m, model_config).moe is None
        except CostModelError:  # an unreadable config: its rows say so when they are simulated
            pass
    return np.array([not dense.get(m, False) for m in models.to_list()], dtype=bool)


def config_target(unknown: list[str], model_config: str | Path | None) -> str | None:
    """The model ``model_config`` describes among ``unknown``: the only one, else the one
    its ``_name_or_path`` or folder names; None without a config or a unique match."""
    if model_config is None or not unknown:
        return None
    if len(unknown) == 1:
        return unknown[0]
    config = read_json_file(model_config, "model config")
    names = {str(config.get("_name_or_path", "")).lower(), Path(model_config).resolve().parent.name.lower()} - {""}
    matches = [m for m in unknown if m.lower() in names or m.rsplit("/", 1)[-1].lower() in names]
    return matches[0] if len(matches) == 1 else None


def _layout(runs: pl.DataFrame, problems: list[list[str]], experts: np.ndarray) -> list[pl.Series]:
    """Each run's instance GPUs (``tp``), ``moe_ep_size`` and ``attention_dp_size``.

    aiconfigurator's rows give ``tp_size`` per attention-DP group (its
    ``attention_dp_size`` groups share the expert layers): the instance has
    ``tp_size x attention_dp_size`` GPUs, and ``moe_tp_size x moe_ep_size`` must name as
    many. An empty layout value is the plain-TP default: 1, and ``moe_tp_size`` the GPUs
    over the EP size. A dense model's MoE columns are not read (``experts`` False: the
    dense rows of aiconfigurator carry placeholders there, 1 and 0) and its EP size is 1.
    A value that is not a positive whole number, a layout whose GPU counts disagree or
    ``pp_size`` above 1 (pipeline stages are not modelled) is a problem of its row, and
    its layout columns are null."""
    values, bad = {}, np.zeros(runs.height, dtype=bool)
    for name in LAYOUT:
        raw = runs[name]
        v = raw.cast(pl.Float64, strict=False).fill_null(np.nan).to_numpy()
        given = raw.is_not_null().to_numpy() & (experts if name.startswith("moe_") else True)
        with np.errstate(invalid="ignore"):
            wrong = given & ~(np.isfinite(v) & (v >= 1) & (v == np.round(v)))
        for i in np.flatnonzero(wrong).tolist():
            problems[i].append(f"column {name!r}: {raw[i]!r} is not a positive whole number")
        values[name], bad = np.where(given, v, np.nan), bad | wrong
    tp = runs["tp"].fill_null(np.nan).to_numpy()
    dp, ep = np.nan_to_num(values["attention_dp_size"], nan=1.0), np.nan_to_num(values["moe_ep_size"], nan=1.0)
    gpus = tp * dp
    with np.errstate(invalid="ignore", divide="ignore"):  # a bad EP size of 0: its row is already marked
        moe_tp = np.where(np.isnan(values["moe_tp_size"]), gpus / ep, values["moe_tp_size"])
    for i in np.flatnonzero(~bad & np.isfinite(gpus)).tolist():
        if values["pp_size"][i] > 1:
            problems[i].append(f"column 'pp_size': {values['pp_size'][i]:g} pipeline stages, which servetune "
                               "does not model")
            bad[i] = True
        elif moe_tp[i] * ep[i] != gpus[i]:
            problems[i].append(f"layout: moe_tp_size {moe_tp[i]:g} x moe_ep_size {ep[i]:g} = {moe_tp[i] * ep[i]:g} "
                               f"GPUs, but tp_size {tp[i]:g} x attention_dp_size {dp[i]:g} = {gpus[i]:g}")
            bad[i] = True
    return [pl.Series(name, np.where(bad, np.nan, v)).fill_nan(None)
            for name, v in (("tp", gpus), ("moe_ep_size", ep), ("attention_dp_size", dp))]


#: The KV-cache dtype of a run that records none, by its GEMM dtype: the weights' own (bf16,
#: fp8); NVIDIA's NVFP4 checkpoints store the KV cache in FP8 (``kv_cache_quant_algo``).
ASSUMED_KV_DTYPE = {"bf16": "bf16", "fp8": "fp8", "nvfp4": "fp8"}


def kv_dtype_of(gemm_dtype: str, recorded: str | None = None) -> str:
    """A run's KV-cache dtype: the one it records, else ``ASSUMED_KV_DTYPE``'s."""
    return recorded or ASSUMED_KV_DTYPE.get(gemm_dtype, gemm_dtype)


#: A run's instance layout columns (``load_runs``), in ``ParallelLayout``'s order.
SETUP = ("tp", "moe_ep_size", "attention_dp_size")


def with_layout(runs: pl.DataFrame) -> pl.DataFrame:
    """``runs`` with the layout columns of ``load_runs``: a frame made without them (by hand,
    in tests) is plain TP, EP and attention DP 1."""
    return runs.with_columns(pl.lit(1, pl.Int64).alias(c) for c in SETUP[1:] if c not in runs.columns)


def layout_label(run: dict) -> str:
    """A run's layout as text: "tp8", or "tp8 ep8 dp8" with expert / attention data parallelism."""
    ep, dp = run["moe_ep_size"], run["attention_dp_size"]
    return f"tp{run['tp']}" + (f" ep{ep}" if ep != 1 else "") + (f" dp{dp}" if dp != 1 else "")
