"""`servetune cost`: inspect a cost model, export its SPS(B) curve, calibrate against runs."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from costmodels.moeops import DEFAULT_DISTRIBUTION

cost_app = typer.Typer(help="Step time and KV capacity of a model on a GPU.", no_args_is_help=True)
console = Console()

DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
PREFILL_TOKENS = (512, 2048, 8192)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def _build(model, gpu, tp, framework, gemm_dtype, kv_dtype, model_config, calibration, sps_csv, **layout):
    from costmodels import CostModelError, build

    try:
        return build(model, gpu, tp=tp, framework=framework, gemm_dtype=gemm_dtype, kv_dtype=kv_dtype,
                     model_config=model_config, calibration=calibration, sps_csv=sps_csv, **layout)
    except CostModelError as exc:
        _fail(str(exc))


# shared options, one definition each
Model = typer.Option(..., "--model", help="HF id or alias, e.g. meta-llama/Llama-3.1-8B")
Gpu = typer.Option(..., "--gpu", help="a100 | h100 | h200 | b200, or a GPU spec YAML")
Tp = typer.Option(1, "--tp", help="tensor-parallel degree")
Framework = typer.Option("vllm", "--framework", help="vllm | sglang | trtllm")
GemmDtype = typer.Option("bf16", "--gemm-dtype", "--dtype", help="weights and GEMMs: bf16 | fp8 | nvfp4 (B200)")
KvDtype = typer.Option("bf16", "--kv-dtype", help="bf16 | fp8")
ModelConfig = typer.Option(None, "--model-config", help="HuggingFace config.json of another model")
MoeEp = typer.Option(1, "--moe-ep-size", help="expert-parallel degree of the MoE layers (divides --tp)")
AttentionDp = typer.Option(1, "--attention-dp-size", help="attention data-parallel groups (divides --tp)")
MoeDistribution = typer.Option(DEFAULT_DISTRIBUTION, "--moe-distribution",
                               help="routing skew of the fused-MoE table: balanced | power_law_1.01 | power_law_1.2")
Calibration = typer.Option(None, "--calibration", help="calibration JSON from `servetune cost calibrate`")
SpsCsv = typer.Option(None, "--sps-csv", help="use a measured SPS(B) CSV as the step-time source")
Context = typer.Option(1024, "--context", help="KV tokens per sequence for decode step times")
Utilization = typer.Option(0.9, "--gpu-memory-utilization")
BlockSize = typer.Option(16, "--block-size")
BatchedTokens = typer.Option(8192, "--max-num-batched-tokens",
                             help="step budget: vLLM sizes the KV pool after a profiling pass of this many tokens")
Plot = typer.Option(None, "--plot", help="write the SPS(B) curve as a PNG")
Format = typer.Option("text", "--format", help="text | json")
SpsOutput = typer.Option(..., "-o", "--output", help="file to write")
Runs = typer.Argument(..., help="measured runs CSV (aiconfigurator silicon format or canonical)")
CalibrationOutput = typer.Option(Path("calibration.json"), "-o", "--output")


def summary(cost, utilization: float, block_size: int, context: int, batched_tokens: int) -> dict:
    """Capacity and step times of ``cost`` as plain data (the JSON output)."""
    from costmodels import CostModelError, sps_curve, step_seconds

    try:
        tokens = cost.kv_capacity_tokens(utilization, batched_tokens)
        blocks = cost.kv_capacity_blocks(utilization, block_size, batched_tokens)
    except CostModelError as exc:
        _fail(str(exc))
    decode = {}
    for b in DECODE_BATCHES:
        s, out = step_seconds(cost.tables, b, b, b, b * context, 0.0)
        decode[str(b)] = {"step_ms": s * 1e3, "out_of_range": bool(out)}
    prefill = {}
    for n in PREFILL_TOKENS:
        s, out = step_seconds(cost.tables, n, 1, 0, 0.0, n * (n + 1) / 2.0)
        prefill[str(n)] = {"step_ms": s * 1e3, "out_of_range": bool(out)}
    return {
        "name": cost.name, "source": cost.source, "tp": cost.tp,
        "gpu_memory_gib": cost.gpu_memory_bytes / 2**30, "weights_gib_per_gpu": cost.weight_bytes / 2**30,
        "reserved_gib_per_gpu": cost.reserve_bytes(batched_tokens) / 2**30, "max_num_batched_tokens": batched_tokens,
        "kv_bytes_per_token": cost.kv_bytes_per_token,
        "gpu_memory_utilization": utilization, "kv_capacity_tokens": tokens,
        "block_size": block_size, "kv_capacity_blocks": blocks,
        "swap_gib_per_s": cost.swap_bytes_per_s / 2**30, "swap_capacity_blocks": cost.swap_capacity_blocks(block_size),
        "decode_context": context, "decode_step": decode, "prefill_step": prefill,
        "sps": sps_curve(cost, context=context).to_dicts(),
    }


def _print(info: dict) -> None:
    console.print(f"[bold]{info['name']}[/bold]  ({info['source']})")
    console.print(f"weights {info['weights_gib_per_gpu']:.2f} GiB/GPU, reserve {info['reserved_gib_per_gpu']:.2f} "
                  f"GiB/GPU of {info['gpu_memory_gib']:.0f} GiB; KV {info['kv_bytes_per_token']:,} B/token/GPU")
    console.print(f"KV capacity at gpu_memory_utilization={info['gpu_memory_utilization']} and "
                  f"max_num_batched_tokens={info['max_num_batched_tokens']}: "
                  f"{info['kv_capacity_tokens']:,} tokens = {info['kv_capacity_blocks']:,} blocks of "
                  f"{info['block_size']}; swap {info['swap_capacity_blocks']:,} blocks at "
                  f"{info['swap_gib_per_s']:.1f} GiB/s")
    table = Table(title=f"step time (decode at {info['decode_context']} KV tokens/seq; * = outside profiled range)")
    for col in ("shape", "step ms", "steps/s", "tokens/s"):
        table.add_column(col, justify="right")
    for b, v in info["decode_step"].items():
        mark = "*" if v["out_of_range"] else ""
        table.add_row(f"decode B={b}", f"{v['step_ms']:.2f}{mark}", f"{1e3 / v['step_ms']:.1f}",
                      f"{int(b) * 1e3 / v['step_ms']:,.0f}")
    for n, v in info["prefill_step"].items():
        mark = "*" if v["out_of_range"] else ""
        table.add_row(f"prefill {n} tok", f"{v['step_ms']:.2f}{mark}", f"{1e3 / v['step_ms']:.1f}",
                      f"{int(n) * 1e3 / v['step_ms']:,.0f}")
    console.print(table)


def _plot(curve: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["batch_tokens"] for r in curve], [r["steps_per_s"] for r in curve], marker="o")
    ax.set(xscale="log", xlabel="batched tokens B (decode sequences)", ylabel="steps per second", title=title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@cost_app.command("show")
def show(
    model: str = Model, gpu: str = Gpu, tp: int = Tp, framework: str = Framework,
    gemm_dtype: str = GemmDtype, kv_dtype: str = KvDtype, model_config: Path = ModelConfig,
    calibration: Path = Calibration, sps_csv: Path = SpsCsv, context: int = Context,
    gpu_memory_utilization: float = Utilization, block_size: int = BlockSize,
    max_num_batched_tokens: int = BatchedTokens, plot: Path = Plot, fmt: str = Format,
    moe_ep_size: int = MoeEp, attention_dp_size: int = AttentionDp, moe_distribution: str = MoeDistribution,
) -> None:
    """KV capacity, weight memory and step times at a few batch shapes (with attention DP:
    of one DP group)."""
    if fmt not in ("text", "json"):
        _fail(f"--format must be text or json, got {fmt!r}")
    cost = _build(model, gpu, tp, framework, gemm_dtype, kv_dtype, model_config, calibration, sps_csv,
                  moe_ep_size=moe_ep_size, attention_dp_size=attention_dp_size, moe_distribution=moe_distribution)
    info = summary(cost, gpu_memory_utilization, block_size, context, max_num_batched_tokens)
    if plot is not None:
        _plot(info["sps"], plot, f"{cost.name}, {context} KV tokens/seq")
    if fmt == "json":
        typer.echo(json.dumps(info, indent=1))
    else:
        _print(info)
        if plot is not None:
            console.print(f"SPS(B) plot written to {plot}")


@cost_app.command("sps")
def sps(
    model: str = Model, gpu: str = Gpu, tp: int = Tp, framework: str = Framework,
    gemm_dtype: str = GemmDtype, kv_dtype: str = KvDtype, model_config: Path = ModelConfig,
    calibration: Path = Calibration, context: int = Context,
    output: Path = SpsOutput,
    fmt: str = typer.Option("csv", "--format", help="csv (SPS(B) of plain decodes) | sglang-dspark (SGLang's "
                            "SpsCostTable JSON for DSPARK's planner, as tune writes it beside sglang.yaml)"),
    block_size: int = typer.Option(7, "--block-size", help="sglang-dspark: speculative-dspark-block-size"),
    max_running_requests: int = typer.Option(48, "--max-running-requests",
                                             help="sglang-dspark: the largest request count probed"),
    draft_cost_mode: str = typer.Option("fraction", "--draft-cost-mode", help="sglang-dspark: fraction | mtp"),
    draft_cost: float = typer.Option(0.05, "--draft-cost", help="sglang-dspark: the drafter's cost per position"),
) -> None:
    """Export SPS(B), steps per second vs batched decode tokens: CSV, or SGLang's DSPARK table."""
    from costmodels import CostModelError, write_sps_csv

    if fmt not in ("csv", "sglang-dspark"):
        _fail(f"--format must be csv or sglang-dspark, got {fmt!r}")
    cost = _build(model, gpu, tp, framework, gemm_dtype, kv_dtype, model_config, calibration, None)
    try:
        if fmt == "csv":
            curve = write_sps_csv(cost, output, context=context)
            typer.echo(f"wrote {curve.height} rows to {output}")
            return
        from policies.config import ConfigError, PolicyConfig
        from policies.engines.sglang import sps_table
        from policies.speculative import SPS_TABLE_CONTEXT

        try:
            config = PolicyConfig(num_speculative_tokens=block_size, max_num_seqs=max_running_requests,
                                  speculative_draft_cost_mode=draft_cost_mode, speculative_draft_cost=draft_cost)
        except ConfigError as exc:
            _fail(str(exc))
        table = sps_table(cost.tables, config)
        output.write_text(json.dumps(table, indent=1) + "\n")
    except (CostModelError, OSError) as exc:
        _fail(str(exc))
    typer.echo(f"wrote {len(table['sample_batch_tokens'])} probes to {output} (DSPARK block {block_size}, up to "
               f"{max_running_requests} requests, {SPS_TABLE_CONTEXT} KV tokens each)")


@cost_app.command("calibrate")
def calibrate_cmd(
    runs: Path = Runs,
    output: Path = CalibrationOutput,
    fit: str = typer.Option("replay", "--fit", help="replay (the closed loop as the benchmark client ran it) "
                            "| formula (steady-state TPOT only; fast, for a first look)"),
) -> None:
    """Fit per-step overhead and prefill/decode scales to measured runs; print MAPE before/after.

    The replay fit (``optimizer.fidelity.replayfit.calibrate_replay``) replays every run through
    the engine as AIPerf drove it and fits TTFT and TPOT together; it takes about a minute
    per (model, framework, dtype) on 2 cores. Entries are per model and parallel path across
    its layouts, plus one pooled per (GPU, framework, dtype, path); ``build`` walks setup,
    model, family, pooled, other GPU, other path (``costmodels.calibration.match_entry``)."""
    from costmodels import CostModelError, calibrate, load_runs, save_calibration
    from costmodels.calibration import entry_path
    from optimizer.fidelity.closedloop import ClosedLoopError
    from optimizer.fidelity.replayfit import calibrate_replay

    if fit not in ("replay", "formula"):
        _fail(f"--fit must be replay or formula, got {fit!r}")
    try:
        measured = load_runs(runs)
        entries = calibrate_replay(measured) if fit == "replay" else calibrate(measured)
        save_calibration(entries, output)
    except (CostModelError, ClosedLoopError, OSError) as exc:
        _fail(str(exc))
    table = Table(title=f"{fit} calibration (in-sample MAPE %, before -> after)")
    for col in ("gpu", "framework", "model", "dtype", "path", "tp", "runs", "overhead ms", "prefill x", "decode x", "TPOT",
                "TTFT"):
        table.add_column(col)
    for e in entries:
        scale = e["scale"]
        table.add_row(e["gpu"], e["framework"], e["model"], e["gemm_dtype"], entry_path(e), ",".join(map(str, e["tp"])),
                      str(e["n_runs"]), f"{e['overhead_s'] * 1e3:.2f}", f"{scale * e.get('prefill_scale', 1.0):.3f}",
                      f"{scale * e.get('decode_scale', 1.0):.3f}",
                      f"{e['tpot_mape_before']:.1f} -> {e['tpot_mape_after']:.1f}",
                      f"{e['ttft_mape_before']:.1f} -> {e['ttft_mape_after']:.1f}")
    console.print(table)
    for e in entries:
        if e.get("pinned_terms"):
            console.print(f"[yellow]{e['model']} {e['framework']}/{e['gemm_dtype']} {entry_path(e)}: "
                          f"{', '.join(e['pinned_terms'])} held at the fit's range limit: the runs did not place "
                          "them, the entry's other terms absorb the rest[/yellow]")
    console.print(f"wrote {output}; in-sample figures only: `python benchmarks/fidelity.py --runs {runs}` scores "
                  "each entry on groups it was not fitted on")


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.add_typer(cost_app, name="cost")
