"""`servetune validate`: simulate measured closed-loop runs and compare TTFT and TPOT.

Each row of a runs CSV (aiconfigurator's ``silicon_*.csv`` format, or the canonical
columns of ``costmodels.runs.COLUMNS``) is one benchmark: ``batch_size`` clients,
``isl``-token prompts, ``osl`` output tokens, on ``tp_size`` GPUs. Every row is replayed
through the engine as the benchmark client ran it (``optimizer.fidelity.closedloop.BenchClient``:
AIPerf's start-up burst, warm-up, profiled request count and length draws) with the
calibrated cost model of its (model, GPU, framework, dtype, TP) and that framework's
scheduler defaults, and the mean TTFT and TPOT over the profiled requests are compared
with the measured ones.

A row that cannot be simulated (a bad value, a model that is not built in and has no
``--model-config``, a dtype or GPU without a cost model, a run that does not fit the
server) gets its reason in ``error`` and is left out of the MAPE; the rest are scored.
The report says which cost model (op tables, or a roofline fallback and why), KV dtype and
calibration entry each group of rows used, and which rows ran uncalibrated.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import polars as pl
import typer

from costmodels.costmodel import CostModel, CostModelError
from costmodels.runs import SETUP, kv_dtype_of, layout_label, with_layout
from optimizer.fidelity.closedloop import (
    BenchClient,
    ClosedLoopError,
    ClosedLoopResult,
    client_for,
    run_benchmark,
    server_max_seq_len,
)
from optimizer.fidelity.inferencex import known_server
from optimizer.fidelity.replayfit import UNMEASURED_SERVER, run_clients, run_server
from optimizer.robust.modelerror import model_error
from optimizer.search.targets import context_of
from policies.config import ConfigError
from policies.engines import EngineContext

GROUP = ["model", "framework", "gemm_dtype"]
#: the columns ``predict_runs`` adds, with their types
PREDICTED = {"pred_ttft_ms": pl.Float64, "pred_tpot_ms": pl.Float64, "calibration_match": pl.Utf8,
             "calibration_error": pl.Utf8, "calibration_pinned": pl.Utf8, "measured_server": pl.Utf8, "cost_source": pl.Utf8, "kv_dtype": pl.Utf8,
             "kv_dtype_assumed": pl.Boolean, "error": pl.Utf8}


def register(app: typer.Typer) -> None:
    app.command("validate")(validate_command)


@dataclass(frozen=True)
class Setup:
    """What every row of one (model, GPU, framework, GEMM and KV dtype, TP) replays with."""

    cost: CostModel
    ctx: EngineContext  # the scheduler's context (its KV pool bounds a closed loop's runs)
    server: dict  # the fitted measured-server overrides (``measured_server``)
    max_seq_len: int | None  # ``optimizer.fidelity.closedloop.server_max_seq_len``


def predict_runs(runs: pl.DataFrame, *, model_config: str | Path | None = None, calibration=None,
                 bench: BenchClient | None = None, on_row=None, moe_distribution: str | None = None,
                 server: dict | None = None) -> pl.DataFrame:
    """``runs`` (from ``load_runs``) with predicted ``pred_ttft_ms``/``pred_tpot_ms``, the
    ``calibration_match`` of the row's cost model (setup, model, pooled, none or off) and
    the terms its entry's fit left on a range limit (``calibration_pinned``, comma-separated;
    null when none), the ``measured_server`` scheduler overrides it was replayed with (JSON;
    from the matched calibration entry when a replay fit chose them, else the framework's
    defaults), its
    ``cost_source`` (``CostModel.source``: op tables or a roofline fallback with its
    reason, and the calibration), the ``kv_dtype`` it assumed (``kv_dtype_assumed``: the
    runs record none, so the GEMM dtype) and ``error``: why the row could not be simulated,
    "row N: ...", else null. A row that arrives with an ``error`` (``load_runs(...,
    bad_rows="mark")``) keeps it. ``model_config``: see ``model_configs``. ``bench``: how
    the client drives the server (default ``BenchClient()``, AIPerf as aiconfigurator runs
    it). ``on_row(i)`` is called after each row. ``moe_distribution``: the MoE routing skew
    (``costmodels.build``; None: its default). ``server``: the measured-server overrides
    every row is replayed with when known (its launch settings), instead of what the
    calibration entry fitted or the framework's unmeasured default."""
    bench = bench or BenchClient()
    runs = with_layout(runs)
    configs = model_configs(runs["model"].drop_nulls().unique(maintain_order=True).to_list(), model_config)
    setups: dict[tuple, Setup | str] = {}  # a setup's failure is cached as its reason
    out = {name: [] for name in PREDICTED}
    for i, row in enumerate(runs.iter_rows(named=True)):
        for name, value in _predict_row(i, row, configs, setups, calibration, bench, moe_distribution,
                                        server).items():
            out[name].append(value)
        if on_row is not None:
            on_row(i)
    return runs.with_columns(pl.Series(k, v, dtype=PREDICTED[k]) for k, v in out.items())


def _predict_row(i: int, row: dict, configs: dict, setups: dict, calibration, bench: BenchClient,
                 moe_distribution: str | None, server: dict | None) -> dict:
    """The ``PREDICTED`` values of row ``i`` (file line ``i + 2``)."""
    recorded = row.get("kv_dtype")
    kv_dtype = kv_dtype_of(row["gemm_dtype"], recorded)
    values = dict.fromkeys(PREDICTED) | {"pred_ttft_ms": math.nan, "pred_tpot_ms": math.nan,
                                         "kv_dtype": kv_dtype, "kv_dtype_assumed": recorded is None,
                                         "error": row.get("error")}
    if values["error"] is not None:
        return values
    key = (row["model"], row["gpu"], row["framework"], row["gemm_dtype"], kv_dtype, *(row[c] for c in SETUP))
    if key not in setups:
        setups[key] = _setup(row, kv_dtype, configs[row["model"]], calibration, moe_distribution, server)
    setup = setups[key]
    if isinstance(setup, str):
        return values | {"error": f"row {i + 2}: {setup}"}
    known = known_server(row)
    server = setup.server if known is None else {"script": known.script, **known.overrides}
    used = setup.cost.calibration or {}
    values |= {"calibration_match": used.get("match", "none"), "calibration_error": model_error(setup.cost).stated,
               "calibration_pinned": ", ".join(used.get("pinned_terms") or []) or None,
               "measured_server": json.dumps(server), "cost_source": setup.cost.source}
    try:
        loop = simulate_row(setup, row, bench)
    except (ClosedLoopError, ConfigError) as exc:
        return values | {"error": f"row {i + 2}: {exc}"}
    return values | {"pred_ttft_ms": loop.mean_ttft_ms, "pred_tpot_ms": loop.mean_tpot_ms}


def _setup(row: dict, kv_dtype: str, model_config: Path | str | None, calibration,
           moe_distribution: str | None, server: dict | None) -> Setup | str:
    """The row's ``Setup``, or why it has none (``model_config`` a str: the model's reason);
    its server is ``server`` when known, else ``measured_server``'s."""
    if isinstance(model_config, str):
        return model_config
    from costmodels import build

    layout = {c: row[c] for c in SETUP[1:]}
    skew = {} if moe_distribution is None else {"moe_distribution": moe_distribution}
    label = f"{row['model']} on {row['gpu']} {layout_label(row)} {row['framework']}/{row['gemm_dtype']} (KV {kv_dtype})"
    try:  # one attention-DP group of the run's layout, each group's scheduler its row's batch_size clients
        cost = build(row["model"], row["gpu"], tp=row["tp"], framework=row["framework"], gemm_dtype=row["gemm_dtype"],
                     kv_dtype=kv_dtype, model_config=model_config, calibration=calibration, **layout, **skew)
        server = measured_server(cost, row["framework"]) if server is None else dict(server)
        return Setup(cost, context_of(cost, row["gpu"], context_len=0, tp=row["tp"]), server,
                     server_max_seq_len(row["framework"], row["model"], model_config))
    except (CostModelError, ClosedLoopError, ConfigError) as exc:
        return f"cannot replay {label}: {exc}"


def simulate_row(setup: Setup, row: dict, bench: BenchClient) -> ClosedLoopResult:
    """Row ``row``'s benchmark replayed on ``setup`` as ``bench`` drives it, varied as the
    run's own client (its ``client``: ``client_for``) against the run's server (``run_server``)."""
    config, acceptance = run_server(row["framework"], setup.ctx, setup.server, row)
    clients, ranks = run_clients(row)
    return run_benchmark(setup.cost, config, clients, row["isl"], row["osl"], client_for(row.get("client"), bench),
                         max_seq_len=setup.max_seq_len, acceptance=acceptance, ranks=ranks)


def model_configs(models: list[str], model_config: str | Path | None) -> dict[str, Path | str | None]:
    """Per model the runs name: None (built in), the config.json its cost model is built
    from, or the reason its rows cannot be simulated (a str).

    ``model_config`` is for the one model that is not built in; when the runs name several,
    it goes to the one it names (its ``_name_or_path`` or its folder, as ``org/Name`` or
    ``Name``) and the others' rows are errors naming them."""
    from costmodels.architecture import ALIASES, BUILTIN
    from costmodels.runs import config_target

    unknown = [m for m in models if m.lower() not in ALIASES]
    target = config_target(unknown, model_config)
    builtin = ", ".join(BUILTIN)
    out: dict[str, Path | str | None] = dict.fromkeys(models)
    for m in unknown:
        if m == target:
            out[m] = Path(model_config)
        elif model_config is None:
            out[m] = f"unknown model {m!r}; pass --model-config CONFIG.json for it (built-in: {builtin})"
        else:
            given = f"--model-config {model_config} is for {target!r}" if target else (
                f"--model-config {model_config} names none of the {len(unknown)} models not built in ({unknown})")
            out[m] = (f"unknown model {m!r}; {given}: validate {m!r}'s rows in a file of their own with its "
                      f"config.json (built-in: {builtin})")
    return out


def measured_server(cost, framework: str) -> dict:
    """The scheduler overrides a replay fit chose for the runs of ``cost``'s calibration
    entry (its ``measured_server``; ``optimizer.fidelity.replayfit.SERVER_CANDIDATES``), {} when the
    entry has none (a formula fit), ``UNMEASURED_SERVER`` when no entry of the model applied."""
    server = (cost.calibration or {}).get("measured_server")
    return dict(UNMEASURED_SERVER[framework] if server is None else server)


def _ape(pred: str, measured: str) -> pl.Expr:
    return ((pl.col(pred) - pl.col(measured)).abs() / pl.col(measured) * 100.0)


def _scored(pred: pl.DataFrame) -> pl.DataFrame:
    return pred.filter(pl.col("error").is_null())


def _uncalibrated() -> pl.Expr:
    return pl.col("calibration_match") == "none"


def mape_table(pred: pl.DataFrame) -> pl.DataFrame:
    """MAPE (%) of TTFT and TPOT per (model, framework, dtype) and over all rows ("all"),
    with the scored rows and how many of them ran uncalibrated (no calibration entry)."""
    ok = _scored(pred)
    aggs = [pl.len().alias("runs"), _uncalibrated().sum().cast(pl.Int64).alias("uncalibrated"),
            _ape("pred_ttft_ms", "ttft_ms").mean().alias("ttft_mape"),
            _ape("pred_tpot_ms", "tpot_ms").mean().alias("tpot_mape")]
    groups = ok.group_by(GROUP, maintain_order=True).agg(aggs)
    overall = ok.select(aggs).with_columns(pl.lit("all").alias(c) for c in GROUP)
    return pl.concat([groups, overall.select(groups.columns)])


def worst_rows(pred: pl.DataFrame, metric: str, k: int = 5) -> pl.DataFrame:
    """The ``k`` rows with the largest relative error of ``metric`` (ttft or tpot)."""
    return (_scored(pred)
            .with_columns(_ape(f"pred_{metric}_ms", f"{metric}_ms").alias(f"{metric}_ape"))
            .sort(f"{metric}_ape", descending=True).head(k)
            .select([*GROUP, "tp", "batch_size", "isl", "osl", f"{metric}_ms", f"pred_{metric}_ms", f"{metric}_ape"]))


def scatter_figure(pred: pl.DataFrame):
    """Predicted vs measured TTFT and TPOT, log-log, one colour per (model, framework)."""
    from matplotlib.figure import Figure

    ok = _scored(pred)
    fig = Figure(figsize=(11, 5), layout="constrained")
    for ax, metric in zip(fig.subplots(1, 2), ("ttft", "tpot"), strict=True):
        for (model, fw, dtype), g in ok.group_by(GROUP, maintain_order=True):
            ax.scatter(g[f"{metric}_ms"], g[f"pred_{metric}_ms"], s=14, alpha=0.75,
                       label=f"{model.split('/')[-1]} {fw}/{dtype}")
        both = np.concatenate([ok[f"{metric}_ms"].to_numpy(), ok[f"pred_{metric}_ms"].to_numpy()])
        lo, hi = both.min() / 1.5, both.max() * 1.5
        ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
        ax.fill_between([lo, hi], [lo / 1.25, hi / 1.25], [lo * 1.25, hi * 1.25], color="grey", alpha=0.15,
                        label="±25%")
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel=f"measured {metric.upper()} (ms)",
               ylabel=f"simulated {metric.upper()} (ms)", title=f"mean {metric.upper()} per run")
        ax.legend(fontsize=8)
    return fig


def tables_source(source: str) -> str:
    """The step-time part of a ``CostModel.source`` (op tables or roofline, and their
    notes), without the calibration ``apply_calibration`` appends (reported apart)."""
    return re.split(r"; (?:calibrated:|uncalibrated)", source, maxsplit=1)[0]


def roofline_reason(source: str) -> str | None:
    """Why a cost model fell back to the roofline ("roofline:GPU/DTYPE (reason)"), or None
    when it uses profiled or measured step times."""
    tables = tables_source(source)
    if not tables.startswith("roofline:"):
        return None
    return tables.partition(" (")[2].removesuffix(")") or "no reason recorded"


def _report_mape(pred: pl.DataFrame, worst: int) -> list[str]:
    """The MAPE table (with the uncalibrated rows per group) and the ``worst`` rows per metric."""
    lines = [f"{'model':26} {'framework':13} {'runs':>4} {'uncal':>5}  {'TTFT MAPE':>9}  {'TPOT MAPE':>9}"]
    for r in mape_table(pred).iter_rows(named=True):
        lines.append(f"{r['model']:26} {r['framework'] + '/' + r['gemm_dtype']:13} {r['runs']:4d} "
                     f"{r['uncalibrated']:5d}  {r['ttft_mape']:8.1f}%  {r['tpot_mape']:8.1f}%")
    for metric in ("ttft", "tpot"):
        lines.append(f"\nworst {metric.upper()} rows:")
        for r in worst_rows(pred, metric, worst).iter_rows(named=True):
            lines.append(f"  {r['model'].split('/')[-1]:12} {r['framework']:6} tp{r['tp']} c{r['batch_size']:<4} "
                         f"{r['isl']}->{r['osl']:<5} measured {r[f'{metric}_ms']:9.1f} ms  simulated "
                         f"{r[f'pred_{metric}_ms']:9.1f} ms  ({r[f'{metric}_ape']:.0f}% off)")
    return lines


def _report_cost_models(pred: pl.DataFrame) -> list[str]:
    """Distinct (framework, GEMM/KV dtype, step-time source) with their row counts; a
    roofline fallback is flagged with its reason, an assumed KV dtype is marked."""
    used = (pred.filter(pl.col("cost_source").is_not_null())
            .with_columns(pl.col("cost_source").map_elements(tables_source, return_dtype=pl.Utf8).alias("_tables"))
            .group_by("framework", "gemm_dtype", "kv_dtype", "kv_dtype_assumed", "_tables", maintain_order=True).len())
    if used.is_empty():
        return []
    lines = ["\ncost model per (framework, GEMM/KV dtype):"]
    for r in used.iter_rows(named=True):
        kv = r["kv_dtype"] + (" (assumed)" if r["kv_dtype_assumed"] else "")
        fallback = roofline_reason(r["_tables"])
        tables = r["_tables"] if fallback is None else f"ROOFLINE FALLBACK: {fallback} [{r['_tables'].split(' ')[0]}]"
        lines.append(f"  {r['framework']:6} {r['gemm_dtype'] + '/' + kv:20} {tables}  ({r['len']} runs)")
    if used["kv_dtype_assumed"].any():
        lines.append("  (assumed): the runs record no KV dtype (no kv_cache_dtype column), so KV is taken to be "
                     "stored in the GEMM dtype")
    return lines


def _report_tiers(pred: pl.DataFrame) -> list[str]:
    """Per (model, framework/dtype, GPU, TP): the calibration tier its rows used and the error
    stated for that tier, the band ``tune`` would print for the setup (``model_error``)."""
    rows = _scored(pred)
    if rows.is_empty():
        return []
    groups = rows.group_by(*GROUP, "gpu", "tp", "calibration_match", "calibration_error", maintain_order=True).len()
    return ["\ncalibration tier per setup, and the error tune's bands take for it:",
            *(f"  {r['model']} {r['framework']}/{r['gemm_dtype']} on {r['gpu']} tp{r['tp']}: {r['calibration_match']}"
              f"; {r['calibration_error']}  ({r['len']} runs)" for r in groups.iter_rows(named=True))]


def _report_uncalibrated(pred: pl.DataFrame) -> list[str]:
    """The scored rows that ran uncalibrated, per (model, framework/dtype, GPU, TP)."""
    rows = _scored(pred).filter(_uncalibrated())
    if rows.is_empty():
        return []
    groups = rows.group_by(*GROUP, "gpu", "tp", maintain_order=True).len()
    return [f"\n{rows.height} rows uncalibrated (no calibration entry: the tables' own overhead and scale):",
            *(f"  {r['model']} {r['framework']}/{r['gemm_dtype']} on {r['gpu']} tp{r['tp']}  ({r['len']} runs)"
              for r in groups.iter_rows(named=True))]


def server_label() -> pl.Expr:
    """``measured_server`` as a report names it: a run's launch script by its name (its
    settings vary by run and are in the predictions), else the fitted overrides."""
    script = pl.col("measured_server").str.json_path_match("$.script")
    return pl.when(script.is_not_null()).then(pl.lit("script ") + script).otherwise(pl.col("measured_server"))


def _report_servers(pred: pl.DataFrame) -> list[str]:
    """The calibration match and measured-server overrides replayed, with their row counts."""
    used = (pred.filter(pl.col("measured_server").is_not_null()).with_columns(server_label().alias("server"))
            .group_by("framework", "calibration_match", "server", maintain_order=True).len())
    if used.is_empty():
        return []
    return ["\ncalibration entry and measured-server scheduler overrides replayed (a launch script's per run):",
            *(f"  {r['framework']:6} {r['calibration_match']:7} {r['server']}  ({r['len']} runs)"
              for r in used.iter_rows(named=True))]


def _report_pinned(pred: pl.DataFrame) -> list[str]:
    """The scored rows replayed on an entry whose fit left terms on a limit of their range."""
    rows = _scored(pred).filter(pl.col("calibration_pinned").is_not_null())
    if rows.is_empty():
        return []
    groups = rows.group_by(*GROUP, "calibration_match", "calibration_pinned", maintain_order=True).len()
    return ["\nrows replayed on an entry whose fit left terms on a limit of their range (their values are the "
            "limit's, not the runs'):",
            *(f"  {r['model']} {r['framework']}/{r['gemm_dtype']} ({r['calibration_match']} entry): "
              f"{r['calibration_pinned']}  ({r['len']} runs)" for r in groups.iter_rows(named=True))]


def format_report(pred: pl.DataFrame, worst: int = 5) -> str:
    """The MAPE table, the worst rows, the rows that could not be simulated, the cost
    models and calibration entries used, and the rows that ran uncalibrated, as text."""
    scored = _scored(pred).height
    lines = _report_mape(pred, worst) if scored else [f"no run of {pred.height} could be simulated"]
    failed = pred.filter(pl.col("error").is_not_null())["error"].to_list()
    if failed:
        lines.append(f"\n{len(failed)} run(s) not simulated (left out of the MAPE):")
        lines += [f"  {e}" for e in failed]
    return "\n".join(lines + _report_cost_models(pred) + _report_tiers(pred) + _report_uncalibrated(pred)
                     + _report_servers(pred) + _report_pinned(pred))


def _check_arguments(model_config: Path | None, calibration: Path | None) -> None:
    """CostModelError for a --model-config that is no JSON file or a --calibration that is
    no calibration file: arguments of the whole run, not of one row."""
    from costmodels.calibration import load_calibration
    from costmodels.costmodel import read_json_file

    if model_config is not None:
        read_json_file(model_config, "model config")
    if calibration is not None:
        load_calibration(calibration)


def validate_command(
    runs_csv: Annotated[Path, typer.Argument(help="measured runs CSV (aiconfigurator silicon format or canonical)")],
    model_config: Annotated[Path | None, typer.Option("--model-config",
                                                      help="config.json of a model that is not built in")] = None,
    calibration: Annotated[Path | None, typer.Option("--calibration", help="calibration JSON (default: bundled)")] = None,
    requests_per_client: Annotated[float, typer.Option(
        "--requests-per-client", help="profiled requests per client (AIPerf --request-count / C)")] = 10.0,
    warmup_per_client: Annotated[float, typer.Option(
        "--warmup-per-client", help="warm-up requests per client, awaited before profiling")] = 2.0,
    isl_stddev: Annotated[float, typer.Option("--isl-stddev", help="prompt length stddev (tokens)")] = 0.0,
    osl_stddev: Annotated[float, typer.Option("--osl-stddev", help="output length stddev (tokens)")] = 0.0,
    plot: Annotated[Path | None, typer.Option("--plot", help="write the predicted-vs-measured scatter (PNG)")] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="write per-run predictions (CSV)")] = None,
    worst: Annotated[int, typer.Option("--worst", help="worst rows to list per metric")] = 5,
) -> None:
    """Replay measured closed-loop runs through the engine; print TTFT/TPOT MAPE.

    Each run is driven as its client drove it: AIPerf with the options below, or the
    client the run names (a ``client`` column, or aiconfigurator's source tag: InferenceX
    runs draw their lengths in [0.8 L, L], whatever the stddev options say).

    Rows that cannot be simulated are listed with their reason and left out of the MAPE;
    exit code 0 when at least one row was scored, 2 when none was (or the file or an
    argument is bad)."""
    from costmodels import load_runs

    try:
        _check_arguments(model_config, calibration)
        runs = load_runs(runs_csv, builtin_only=False, bad_rows="mark", model_config=model_config)
        bench = BenchClient(requests_per_client=requests_per_client, warmup_per_client=warmup_per_client,
                            isl_stddev=isl_stddev, osl_stddev=osl_stddev)
        pred = predict_runs(runs, model_config=model_config, calibration=calibration, bench=bench)
    except (CostModelError, ClosedLoopError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(format_report(pred, worst))
    if output is not None:
        pred.write_csv(output)
        typer.echo(f"predictions: {output}")
    failed = pred["error"].is_not_null().sum()
    if failed == pred.height:
        typer.echo(f"error: none of the {pred.height} runs in {runs_csv} could be simulated (reasons above)", err=True)
        raise typer.Exit(2)
    if failed:
        typer.echo(f"warning: {failed} of {pred.height} runs in {runs_csv} not simulated (reasons above)", err=True)
    if plot is not None:
        scatter_figure(pred).savefig(plot, dpi=120)
        typer.echo(f"scatter plot: {plot}")
