"""`servetune validate`: simulate measured closed-loop runs and compare TTFT and TPOT.

Each row of a runs CSV (aiconfigurator's ``silicon_*.csv`` format, or the canonical
columns of ``costmodels.calibration.COLUMNS``) is one benchmark: ``batch_size`` clients,
``isl``-token prompts, ``osl`` output tokens, on ``tp_size`` GPUs. Every row is replayed
through the engine as the benchmark client ran it (``optimizer.closedloop.BenchClient``:
AIPerf's start-up burst, warm-up, profiled request count and length draws) with the
calibrated cost model of its (model, GPU, framework, dtype, TP) and that framework's
scheduler defaults, and the mean TTFT and TPOT over the profiled requests are compared
with the measured ones.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import numpy as np
import polars as pl
import typer

from optimizer.closedloop import BenchClient, ClosedLoopError, run_benchmark, server_config
from optimizer.targets import context_of

GROUP = ["model", "framework", "gemm_dtype"]


def register(app: typer.Typer) -> None:
    app.command("validate")(validate_command)


def predict_runs(runs: pl.DataFrame, *, model_config: str | Path | None = None, calibration=None,
                 bench: BenchClient | None = None, on_row=None) -> pl.DataFrame:
    """``runs`` (from ``load_runs``) with predicted ``pred_ttft_ms``/``pred_tpot_ms``, the
    ``calibration_match`` of the row's cost model (setup, model, pooled, none or off), the
    ``measured_server`` scheduler overrides it was replayed with (JSON; from the matched
    calibration entry when a replay fit chose them, else the framework's defaults) and
    ``error`` (why a row could not be simulated, else null). ``bench``: how the client
    drives the server (default ``BenchClient()``, AIPerf as aiconfigurator runs it)."""
    from costmodels import build
    from costmodels.architecture import ALIASES

    unknown = sorted({m for m in runs["model"].to_list() if m.lower() not in ALIASES})
    if unknown and (model_config is None or len(unknown) > 1):
        hint = "pass --model-config CONFIG.json for it" if len(unknown) == 1 else "validate one such model per file"
        raise ClosedLoopError(f"runs name models that are not built in: {unknown}; {hint}")
    costs: dict[tuple, object] = {}
    bench = bench or BenchClient()
    out: dict[str, list] = {"pred_ttft_ms": [], "pred_tpot_ms": [], "calibration_match": [], "measured_server": [],
                            "error": []}
    servers: dict[tuple, dict] = {}
    for i, row in enumerate(runs.iter_rows(named=True)):
        key = (row["model"], row["gpu"], row["framework"], row["gemm_dtype"], row["tp"])
        if key not in costs:
            costs[key] = build(row["model"], row["gpu"], tp=row["tp"], framework=row["framework"],
                               gemm_dtype=row["gemm_dtype"], kv_dtype=row["gemm_dtype"],
                               model_config=model_config if row["model"] in unknown else None,
                               calibration=calibration)
        match = (costs[key].calibration or {}).get("match", "none")
        if key not in servers:
            servers[key] = measured_server(costs[key], row, calibration)
        try:
            ctx = context_of(costs[key], row["gpu"], context_len=0, tp=row["tp"])  # a closed loop never nears it
            loop = run_benchmark(costs[key], server_config(row["framework"], ctx, servers[key]), row["batch_size"],
                                 row["isl"], row["osl"], bench)
            values = (loop.mean_ttft_ms, loop.mean_tpot_ms, match, json.dumps(servers[key]), None)
        except ClosedLoopError as exc:
            values = (math.nan, math.nan, match, json.dumps(servers[key]), f"row {i + 2}: {exc}")
        for name, value in zip(out, values, strict=True):
            out[name].append(value)
        if on_row is not None:
            on_row(i)
    text = ("error", "calibration_match", "measured_server")
    return runs.with_columns(pl.Series(k, v, dtype=pl.Utf8 if k in text else None) for k, v in out.items())


def measured_server(cost, row: dict, calibration) -> dict:
    """The scheduler overrides a replay fit chose for the runs of ``cost``'s calibration
    entry (its ``measured_server``; ``optimizer.closedloop.SERVER_CANDIDATES``), {} when the
    entry has none (a formula fit) or no entry applied."""
    from costmodels.calibration import BUNDLED, load_calibration
    from costmodels.gpus import load_gpu

    used = cost.calibration or {}
    if used.get("match") not in ("setup", "model", "pooled") or calibration is False:
        return {}
    path = BUNDLED if calibration is None else Path(calibration)
    gpu = load_gpu(row["gpu"]).name
    for e in load_calibration(path):
        if (e["gpu"], e["framework"], e["gemm_dtype"], e["model"], e.get("tp"), e["overhead_s"], e["scale"]) == (
                gpu, row["framework"], row["gemm_dtype"], used["model"], used.get("tp"), used["overhead_s"],
                used["scale"]):
            return dict(e.get("measured_server") or {})
    return {}


def _ape(pred: str, measured: str) -> pl.Expr:
    return ((pl.col(pred) - pl.col(measured)).abs() / pl.col(measured) * 100.0)


def mape_table(pred: pl.DataFrame) -> pl.DataFrame:
    """MAPE (%) of TTFT and TPOT per (model, framework, dtype) and over all rows ("all")."""
    ok = pred.filter(pl.col("error").is_null())
    aggs = [pl.len().alias("runs"), _ape("pred_ttft_ms", "ttft_ms").mean().alias("ttft_mape"),
            _ape("pred_tpot_ms", "tpot_ms").mean().alias("tpot_mape")]
    groups = ok.group_by(GROUP, maintain_order=True).agg(aggs)
    overall = ok.select(aggs).with_columns(pl.lit("all").alias(c) for c in GROUP)
    return pl.concat([groups, overall.select(groups.columns)])


def worst_rows(pred: pl.DataFrame, metric: str, k: int = 5) -> pl.DataFrame:
    """The ``k`` rows with the largest relative error of ``metric`` (ttft or tpot)."""
    return (pred.filter(pl.col("error").is_null())
            .with_columns(_ape(f"pred_{metric}_ms", f"{metric}_ms").alias(f"{metric}_ape"))
            .sort(f"{metric}_ape", descending=True).head(k)
            .select([*GROUP, "tp", "batch_size", "isl", "osl", f"{metric}_ms", f"pred_{metric}_ms", f"{metric}_ape"]))


def scatter_figure(pred: pl.DataFrame):
    """Predicted vs measured TTFT and TPOT, log-log, one colour per (model, framework)."""
    from matplotlib.figure import Figure

    ok = pred.filter(pl.col("error").is_null())
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


def format_report(pred: pl.DataFrame, worst: int = 5) -> str:
    """The MAPE table, the worst rows and any rows that could not be simulated, as text."""
    lines = [f"{'model':26} {'framework':13} {'runs':>4}  {'TTFT MAPE':>9}  {'TPOT MAPE':>9}"]
    for r in mape_table(pred).iter_rows(named=True):
        lines.append(f"{r['model']:26} {r['framework'] + '/' + r['gemm_dtype']:13} {r['runs']:4d}  "
                     f"{r['ttft_mape']:8.1f}%  {r['tpot_mape']:8.1f}%")
    for metric in ("ttft", "tpot"):
        lines.append(f"\nworst {metric.upper()} rows:")
        for r in worst_rows(pred, metric, worst).iter_rows(named=True):
            lines.append(f"  {r['model'].split('/')[-1]:12} {r['framework']:6} tp{r['tp']} c{r['batch_size']:<4} "
                         f"{r['isl']}->{r['osl']:<5} measured {r[f'{metric}_ms']:9.1f} ms  simulated "
                         f"{r[f'pred_{metric}_ms']:9.1f} ms  ({r[f'{metric}_ape']:.0f}% off)")
    failed = pred.filter(pl.col("error").is_not_null())["error"].to_list()
    if failed:
        lines.append(f"\n{len(failed)} run(s) not simulated (left out of the MAPE):")
        lines += [f"  {e}" for e in failed]
    if "measured_server" in pred.columns:
        used = pred.group_by("framework", "calibration_match", "measured_server", maintain_order=True).len()
        lines.append("\ncalibration entry and measured-server scheduler overrides replayed:")
        lines += [f"  {r['framework']:6} {r['calibration_match']:7} {r['measured_server']}  ({r['len']} runs)"
                  for r in used.iter_rows(named=True)]
    return "\n".join(lines)


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
    """Replay measured closed-loop runs through the engine; print TTFT/TPOT MAPE."""
    from costmodels import CostModelError, load_runs

    try:
        runs = load_runs(runs_csv, builtin_only=model_config is None)
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
    if plot is not None:
        scatter_figure(pred).savefig(plot, dpi=120)
        typer.echo(f"scatter plot: {plot}")
