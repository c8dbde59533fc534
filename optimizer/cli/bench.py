"""`servetune compare` and `servetune calibrate`: measured bench runs read back.

``compare RUN_DIR RESULT`` sets a bench result (``vllm bench serve``, SGLang
``bench_serving`` or AIPerf) beside the simulation of the same requests through the same
config file. ``calibrate --from-bench RESULT...`` fits the cost model's overhead, prefill
and decode scales to one or more such runs and writes a calibration file that
``simulate``, ``tune`` and ``validate`` take with ``--calibration``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from costmodels.costmodel import CostModelError
from optimizer.bench.results import BenchResultError
from policies.config import ConfigError
from studies.traces import TraceError

USER_ERRORS = (BenchResultError, CostModelError, TraceError, ConfigError)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.command("compare")(compare_command)
    app.command("calibrate")(calibrate_command)


def compare_command(
    run_dir: Annotated[Path, typer.Argument(help="run folder (runs/<study> or runs/<study>/<engine>)")],
    result: Annotated[Path, typer.Argument(help="bench result: vllm bench serve JSON, SGLang bench_serving JSONL, "
                                                "or an AIPerf profile_export.jsonl (or its folder)")],
    engine: Annotated[str | None, typer.Option("--engine", help="which target's replay (default: told by the "
                                                                 "result's client, or the only one)")] = None,
    run: Annotated[int | None, typer.Option("--run", help="line of an SGLang JSONL holding several runs")] = None,
    calibration: Annotated[Path | None, typer.Option("--calibration", help="simulate with this calibration "
                                                                           "(default: the study's)")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="scatter plot path (default: beside the result)")] = None,
    output_format: Annotated[str, typer.Option("--format", help="table or json")] = "table",
) -> None:
    """Simulated vs measured: goodput, SLO attainment, TTFT/TPOT/ITL/E2E, per-request error."""
    console = Console()
    try:
        from optimizer.bench.compare import compare, scatter
        from optimizer.bench.results import read_result
        from optimizer.bench.run import BenchRun

        measured = read_result(result, run=run)
        client = measured.source.split(":", 1)[0]
        chosen = engine or (client if client in ("vllm", "sglang") and _has(run_dir, client) else None)
        bench = BenchRun.open(run_dir, chosen)
        cost = bench.cost_model(calibration)
        comparison = compare(bench, measured, cost)
        plot_path = plot or (result if result.is_dir() else result.parent) / f"{result.stem}-vs-simulated.png"
        scatter(comparison, plot_path, f"{bench.manifest['study']}: {bench.manifest['config']}")
    except USER_ERRORS as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if output_format == "json":
        typer.echo(json.dumps({**comparison.to_dict(), "cost_model": cost.source, "plot": str(plot_path)}, indent=2,
                              default=_plain))
        return
    table = Table(title=f"{measured.source} vs simulated {bench.manifest['config']} ({cost.source})")
    for column in ("metric", "simulated", "measured", "error"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for row in comparison.rows:
        table.add_row(row.metric, _num(row.simulated), _num(row.measured),
                      "-" if math.isnan(row.error) else f"{row.error:+.1%}")
    console.print(table)
    errors = Table(title="per-request error, simulated / measured - 1")
    for column in ("metric", "requests", "MAPE", "p10", "p50", "p90"):
        errors.add_column(column, justify="left" if column == "metric" else "right")
    for key, e in comparison.per_request.items():
        errors.add_row(key.upper(), str(e["requests"]), _pct(e["mape"]), _pct(e["p10"], signed=True),
                       _pct(e["p50"], signed=True), _pct(e["p90"], signed=True))
    console.print(errors)
    phases = "; ".join(f"{name} {_pct(p['mean_error'], signed=True)} over {p['requests']} requests"
                       for name, p in comparison.phases.items())
    console.print(f"mean signed error by phase: {phases}. Largest disagreement: [bold]{comparison.worst}[/]")
    for note in comparison.notes:
        console.print(f"[yellow]{note}[/]")
    console.print(f"scatter plot: {plot_path}")


def calibrate_command(
    from_bench: Annotated[list[Path], typer.Option("--from-bench", help="bench result file, beside the run folder's "
                                                                        "bench.json (repeatable)")],
    model: Annotated[str, typer.Option("--model", help="the model the runs served")],
    gpu: Annotated[str, typer.Option("--gpu", help="GPU type the runs used")],
    tp: Annotated[int, typer.Option("--tp", help="tensor-parallel degree")] = 1,
    framework: Annotated[str, typer.Option("--framework", help="the op tables to calibrate: vllm, sglang, trtllm")] =
    "vllm",
    run_dir: Annotated[list[Path] | None, typer.Option(
        "--run-dir", help="the run folder of each result, in order (default: the result's own folder)")] = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="calibration file (entries of other setups kept)")] =
    Path("calibration.json"),
    dtype: Annotated[str, typer.Option("--dtype", help="weights the runs served: bf16, fp8 or nvfp4")] = "bf16",
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="their KV cache: auto, bf16 or fp8")] = "auto",
) -> None:
    """Fit per-step overhead and prefill/decode scales to measured runs, by replaying them."""
    console = Console()
    try:
        from costmodels import build
        from optimizer.bench.fit import MeasuredRun, calibrate_from_bench, save_entry
        from optimizer.bench.results import read_result
        from optimizer.bench.run import BenchRun

        folders = run_dir or [None] * len(from_bench)
        if len(folders) != len(from_bench):
            raise BenchResultError(f"{len(from_bench)} results but {len(folders)} --run-dir; give one per result")
        from optimizer.search.spec import DTYPES, KV_DTYPES

        if dtype not in DTYPES or kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--dtype takes {list(DTYPES)} and --kv-dtype {list(KV_DTYPES)}")
        kv = "bf16" if kv_dtype == "auto" else kv_dtype
        base = build(model, gpu, tp=tp, framework=framework, calibration=False, gemm_dtype=dtype, kv_dtype=kv)
        runs = []
        for result, folder in zip(from_bench, folders, strict=True):
            measured = read_result(result)
            bench = BenchRun.open(folder or (result if result.is_dir() else result).parent)
            _check_setup(bench, result, base.name, model, gpu, tp)
            runs.append(MeasuredRun(str(result), bench, measured))
        console.print(f"fitting {base.name} to {len(runs)} run(s) (each fit replays them dozens of times)...")
        arch = base.name.split("@", 1)[0]
        from costmodels.gpus import load_gpu

        entry = calibrate_from_bench(runs, base, {"model": arch, "gpu": load_gpu(gpu).name, "framework": framework,
                                                  "gemm_dtype": dtype, "kv_dtype": kv, "tp": tp})
        save_entry(entry, output)
    except USER_ERRORS as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    table = Table(title=f"calibration of {base.name} (MAPE of per-request figures, %)")
    for column in ("", "TTFT", "TPOT"):
        table.add_column(column, justify="left" if not column else "right")
    error = entry["error"]
    for label, key in (("uncalibrated", "before"), ("in sample", "in_sample"),
                       ("leave one run out", "leave_one_run_out")):
        figures = error.get(key)
        table.add_row(label, *([_num(figures["ttft_mape"]), _num(figures["tpot_mape"])] if figures else ["-", "-"]))
    console.print(table)
    console.print(f"overhead {entry['overhead_s'] * 1e3:.3f} ms, prefill x{entry['prefill_scale']:.4f}, "
                  f"decode x{entry['decode_scale']:.4f}; written to {output} (use --calibration {output})")
    if error.get("note"):
        console.print(f"[yellow]{error['note']}[/]")


def _check_setup(bench, result: Path, name: str, model: str, gpu: str, tp: int) -> None:
    deployment = bench.manifest["deployment"]
    mine = (deployment["model"], deployment["gpu"], int(deployment["tp"]))
    if mine != (model, gpu, tp):
        raise BenchResultError(f"{result}: the run served {mine[0]} on {mine[1]} at TP {mine[2]}, not the "
                               f"{model} on {gpu} at TP {tp} being calibrated")


def _has(run_dir: Path, engine: str) -> bool:
    from optimizer.bench.scripts import MANIFEST

    return (run_dir / engine / MANIFEST).is_file() or (run_dir / MANIFEST).is_file()


def _num(value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4g}"


def _pct(value: float, signed: bool = False) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:+.1%}" if signed else f"{value:.1%}"


def _plain(value):
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")
