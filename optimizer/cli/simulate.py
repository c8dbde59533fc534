"""`servetune simulate`: replay a trace under one configuration and print its goodput report.

``--replicas N`` (N > 1) or a failure plan (``--fail``, or ``--mtbf`` with ``--repair``)
replays it through the fleet kernel (``policies.fleet``) behind the config's router
(``--router``, ``--prefill-replicas`` set those knobs); the report then has a per-replica
table and, with failures, what they cost. Failure times are on the clock of the replayed
trace (after ``--rate-scale``). An engine file that lays a MoE model out with expert or
attention data parallelism runs on that layout's cost model, one scheduler per attention
group, the groups of an instance stepping together and failing together.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from costmodels.costmodel import CostModelError
from costmodels.layout import ParallelLayout
from optimizer.cli.failure_options import FailOption, MtbfOption, RepairOption
from optimizer.cli.trace import trace_warnings_as_lines
from optimizer.search.failplan import FailurePlan
from policies.config import KNOB_BY_NAME, ConfigError, PolicyConfig, check_fleet
from policies.engines import PRESETS, EngineContext, preset
from policies.failures import FailureError
from studies.metrics import Report, score
from studies.names import unknown_names
from studies.slo import SLOError, SLOSet, load_slo_toml, parse_slo
from studies.tomlfile import read_toml
from studies.traces import TraceError
from studies.transforms import check_rate_factor

#: Errors that mean "bad input from the user": one line and exit code 2, no traceback.
USER_ERRORS = (TraceError, ConfigError, CostModelError, SLOError, FailureError)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.command("simulate")(simulate_command)


def simulate_command(
    trace: Annotated[Path, typer.Option("--trace", help="request trace file (CSV, JSONL, Parquet)")],
    model: Annotated[str, typer.Option("--model", help="model name or HuggingFace config.json")],
    gpu: Annotated[str, typer.Option("--gpu", help="GPU type, e.g. h100")],
    trace_format: Annotated[str | None, typer.Option("--trace-format", help="trace format; guessed if unset")] = None,
    tp: Annotated[int, typer.Option("--tp", help="tensor-parallel degree")] = 1,
    replicas: Annotated[int | None, typer.Option(
        "--replicas", help="engine replicas behind the router (default: the engine file's data-parallel replicas, "
                           "else 1)")] = None,
    router: Annotated[str | None, typer.Option("--router", help="the fleet's router (sets the config's router)")] = None,
    prefill_replicas: Annotated[int | None, typer.Option(
        "--prefill-replicas", help="replicas 0..P-1 prefill, the rest decode (0 = colocated)")] = None,
    fail: FailOption = None,
    mtbf: MtbfOption = None,
    repair: RepairOption = None,
    framework: Annotated[str | None, typer.Option(
        "--framework", help="vllm, sglang or trtllm profiles (default: the engine of --config / --preset, as tune "
                            "times it; else vllm)")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", help="policy.toml, or an exported vllm.yaml / sglang.yaml (read as that engine runs it)")] = None,
    preset_name: Annotated[str | None, typer.Option("--preset", help=f"one of {', '.join(PRESETS)}")] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="knob=value, repeatable")] = None,
    slo: Annotated[str | None, typer.Option("--slo", help="default class bounds, e.g. ttft:2000,tpot:100")] = None,
    slo_file: Annotated[Path | None, typer.Option("--slo-file", help="TOML file of \\[slo.NAME] classes")] = None,
    rate_scale: Annotated[float, typer.Option("--rate-scale", help="multiply the arrival rate by X")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="simulation seed")] = 0,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", help="the cap clients send where the trace has none (default: context - prompt)")] = None,
    predictor: Annotated[str, typer.Option(
        "--predictor", help="output estimate SJF orders by: cap, noisy:SIGMA, or oracle (an upper bound)")] = "cap",
    calibration: Annotated[Path | None, typer.Option(
        "--calibration", help="calibration file from `servetune calibrate` (default: the bundled one)")] = None,
    model_config: Annotated[Path | None, typer.Option(
        "--model-config", help="HuggingFace config.json of a model servetune does not ship (--model names it)")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="weights: bf16, fp8 or nvfp4 (B200)")] = "bf16",
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="KV cache: auto (the weights' activations), bf16, fp8")] =
    "auto",
    output_format: Annotated[str, typer.Option("--format", help="table or json")] = "table",
    timeline: Annotated[Path | None, typer.Option("--timeline", help="write a timeline plot (PNG)")] = None,
) -> None:
    """Replay TRACE through one scheduler configuration and report its goodput."""
    from policies.engine import SimulationStalled

    try:
        if timeline is not None and not timeline.parent.is_dir():
            raise ConfigError(f"--timeline {timeline}: folder {timeline.parent} does not exist")
        fleet_knobs = {k: v for k, v in (("router", router), ("prefill_replicas", prefill_replicas)) if v is not None}
        with trace_warnings_as_lines():
            run = _simulate(trace, trace_format, model, gpu, tp, framework, config, preset_name, overrides or [],
                            slo, slo_file, rate_scale, seed, output_format, replicas,
                            FailurePlan.from_flags(fail, mtbf, repair), fleet_knobs, max_tokens, predictor,
                            calibration, model_config, dtype, kv_dtype)
    except USER_ERRORS as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except SimulationStalled as exc:  # a servetune defect, not the input's: said so, no traceback
        typer.echo(f"internal error: {exc}; please report this command and its trace", err=True)
        raise typer.Exit(3) from None
    report, result = run.pop("report"), run.pop("result")
    if output_format == "json":
        typer.echo(json.dumps({**run, "report": report.to_dict()}, indent=2, allow_nan=False))
        if report.out_of_range_steps:
            typer.echo(f"warning: {_range_warning(report)}", err=True)
    else:
        _print_table(Console(), run, report)
    if timeline is not None:
        # matplotlib loads only when a plot is asked for
        from optimizer.outputs.timeline import save_timeline

        title = f"{run['model']} on {run['gpu']} ({run['replicas']} x TP {run['tp']}), {run['config_source']}"
        save_timeline(result, timeline, title)
        (Console(stderr=True) if output_format == "json" else Console()).print(f"timeline written to {timeline}")


def _simulate(trace_path: Path, trace_format: str | None, model: str, gpu: str, tp: int, framework: str | None,
              config_path: Path | None, preset_name: str | None, overrides: list[str], slo: str | None,
              slo_file: Path | None, rate_scale: float, seed: int, output_format: str, replicas: int | None = None,
              failures: FailurePlan | None = None, fleet_knobs: dict | None = None, max_tokens: int | None = None,
              predictor: str = "cap", calibration: Path | None = None, model_config: Path | None = None,
              dtype: str = "bf16", kv_dtype: str = "auto") -> dict:
    """Validate every input first (cheap ones before the trace), then simulate and score."""
    if output_format not in ("table", "json"):
        raise ConfigError(f"--format must be table or json, got {output_format!r}")
    try:
        check_rate_factor(rate_scale)
    except TraceError as exc:
        raise TraceError(f"--rate-scale: {exc}") from None
    slos = _slos(slo, slo_file)
    # Imported only now: `servetune --help` and bad flags should not wait for the engine.
    from optimizer.search.spec import DTYPES, KV_DTYPES, block_size_refusals
    from optimizer.search.targets import engine_context

    if dtype not in DTYPES or kv_dtype not in KV_DTYPES:
        raise ConfigError(f"--dtype takes {list(DTYPES)} and --kv-dtype {list(KV_DTYPES)}; got {dtype!r}, {kv_dtype!r}")
    kv = "bf16" if kv_dtype == "auto" else kv_dtype
    config_file = None if model_config is None else str(_existing(model_config, "--model-config", ConfigError))
    framework = _framework(framework, config_path, preset_name)
    ctx = engine_context(model, gpu, tp, framework, replicas or 1, config_file, dtype, kv)
    policy, config_source, layout, file_replicas = _policy(config_path, preset_name, ctx, overrides, fleet_knobs or {})
    # the replicas an exported file deploys (tune writes the count its fleet sizing found)
    replicas = replicas if replicas is not None else file_replicas or 1
    if layout.tp != tp:
        raise ConfigError(f"{config_source}: lays out {layout.tp} GPUs per instance, but --tp is {tp}; pass --tp "
                          f"{layout.tp}")
    # an attention-DP instance runs one scheduler per group, the groups stepping together
    ranks = layout.attention_dp_size
    schedulers = replicas * ranks
    refused = block_size_refusals(policy.block_size, policy.max_num_batched_tokens, ctx)
    if refused:
        raise ConfigError(f"{config_source}: {refused}")
    check_fleet(policy, schedulers, ranks)
    if failures is not None and failures.windows is not None:
        failures.windows.check_replicas(replicas)

    from costmodels import build
    from policies.engine import simulate
    from studies.lengths import Predictor, with_client_caps
    from studies.traces import load_trace
    from studies.transforms import scale_rate

    requests = load_trace(trace_path, format=trace_format)
    if rate_scale != 1.0:
        requests = scale_rate(requests, rate_scale)
    cost_model = build(model, gpu, tp=tp, framework=framework, calibration=calibration, model_config=config_file,
                       gemm_dtype=dtype, kv_dtype=kv, moe_ep_size=layout.moe_ep_size,
                       attention_dp_size=ranks)  # first: names an unknown model
    requests = with_client_caps(requests, max_tokens=max_tokens, context_len=ctx.context_len)
    requests = Predictor.parse(predictor).apply(requests, seed=seed)
    schedule = None if failures is None else failures.schedule(replicas, requests.arrival_s, seed).per_rank(ranks)
    if schedulers > 1 or schedule is not None:
        from policies.fleet import simulate_fleet

        result = simulate_fleet(requests, cost_model, policy, seed=seed, replicas=schedulers, failures=schedule,
                                lockstep=ranks)
    else:
        result = simulate(requests, cost_model, policy, seed=seed)
    return {
        "trace": str(trace_path),
        "requests": requests.n,
        "rate_scale": rate_scale,
        "model": model,
        "gpu": gpu,
        "tp": tp,
        "replicas": replicas,
        "layout": {"moe_ep": layout.moe_ep_size, "attention_dp": ranks},
        "failures": None if schedule is None else schedule.describe(),
        "framework": framework,
        "cost_model": cost_model.name,
        "cost_model_source": cost_model.source,
        "dtype": {"weights": dtype, "kv": kv},
        "config_source": config_source,
        "config": policy.to_dict(),
        "slo": slos.describe(),
        "seed": seed,
        "report": score(result, requests, slos),
        "result": result,
    }


def _slos(slo: str | None, slo_file: Path | None) -> SLOSet:
    """``--slo`` is the default class, ``--slo-file`` the named ones; neither means no bounds."""
    classes = list(load_slo_toml(_existing(slo_file, "--slo-file", SLOError)).classes) if slo_file else []
    if slo is not None:
        if any(c.name == "default" for c in classes):
            raise SLOError(f"--slo sets the default class but {slo_file} defines [slo.default] too; drop one")
        classes += parse_slo(slo).classes
    return SLOSet(tuple(classes)) if classes else SLOSet()


def _policy(config_path: Path | None, preset_name: str | None, ctx: EngineContext, overrides: list[str],
            knobs: dict | None = None) -> tuple[PolicyConfig, str, ParallelLayout, int | None]:
    """The base config (a file, else a preset, vllm-default by default) with ``--set`` and
    the flags' ``knobs`` (``--router``, ``--prefill-replicas``) applied, the instance layout
    it runs on (an engine file's own; else plain TP of ``ctx.tp`` GPUs) and the replicas an
    engine file deploys (None for a preset or a policy.toml).

    An engine file (``.yaml``) is read as its engine runs it (``optimizer.outputs.exports.read_engine_file``);
    which engine is told by its model key (vLLM ``model``, SGLang ``model-path``)."""
    layout, replicas = ParallelLayout(ctx.tp), None
    if config_path is not None and preset_name is not None:
        raise ConfigError("give --config or --preset, not both")
    if config_path is not None:
        path = _existing(config_path, "--config", ConfigError)
        if path.suffix in (".yaml", ".yml"):
            (policy, layout, replicas), source = _engine_file(path, ctx), str(path)
        else:
            policy, source = _policy_file(path), str(path)
    else:
        name = preset_name or "vllm-default"
        policy, source = preset(name, ctx), f"{name} ({ctx.gpu})"
    changes = {**dict(_parse_override(item) for item in overrides), **(knobs or {})}
    if changes:
        policy = policy.replace(**changes)
        source += " + " + ", ".join(f"{k}={v}" for k, v in changes.items())
    return policy, source, layout, replicas


def _policy_file(path: Path) -> PolicyConfig:
    """A ``policy.toml``: knobs under ``[policy]`` (or at top level), each checked; an
    unknown key is named with the knob it probably misspells, and a table beside
    ``[policy]`` is refused rather than ignored."""
    data = read_toml(path, ConfigError)
    body = data.get("policy", data)
    if not isinstance(body, dict):
        raise ConfigError(f"{path}: policy must be a table of knob = value, got {body!r}")
    if body is not data and set(data) != {"policy"}:
        raise ConfigError(f"{path}: only a [policy] table is read; found {sorted(set(data) - {'policy'})} beside it")
    unknown = sorted(set(body) - set(KNOB_BY_NAME))
    if unknown:
        raise ConfigError(f"{path}: {unknown_names('knob', unknown, KNOB_BY_NAME, 'known')}")
    try:
        return PolicyConfig.from_mapping(body)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _framework(given: str | None, config_path: Path | None, preset_name: str | None) -> str:
    """The op tables to time with: ``--framework`` if given, else the engine of the config
    file or preset (an SGLang file is timed with SGLang's tables, as `tune` timed it), else
    vLLM's. A ``--framework`` that contradicts the engine is taken, and said."""
    engine = None
    if config_path is not None and Path(config_path).suffix in (".yaml", ".yml") and Path(config_path).is_file():
        engine = _yaml_engine(_yaml(Path(config_path)), Path(config_path))
    elif preset_name is not None:
        engine = next((e for e in ("vllm", "sglang") if preset_name.startswith(f"{e}-")), None)
    if given is None:
        return engine or "vllm"
    if engine is not None and given != engine:
        typer.echo(f"warning: --framework {given} times {config_path or preset_name} with {given}'s op tables; its "
                   f"engine is {engine}, whose tables `tune` timed it with", err=True)
    return given


def _yaml(path: Path):
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None


def _yaml_engine(data, path: Path) -> str:
    """Which engine a config file is for, told by its model key (vLLM ``model``, SGLang ``model-path``)."""
    keys = set(data) if isinstance(data, dict) else set()
    engine = "sglang" if "model-path" in keys else "vllm" if "model" in keys else None
    if engine is None:
        raise ConfigError(f"{path}: neither a vLLM (model: ...) nor an SGLang (model-path: ...) config file")
    return engine


def _engine_file(path: Path, ctx: EngineContext) -> tuple[PolicyConfig, ParallelLayout, int]:
    from optimizer.outputs.exports import ExportError, read_engine_file
    from policies.engines import EngineError, target

    data = _yaml(path)
    engine = _yaml_engine(data, path)
    try:
        deployment = target(engine).deployment_from_args(data, ctx)
        config = read_engine_file(target(engine), path.read_text(), ctx)
    except (ExportError, EngineError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return config, ParallelLayout(deployment.tp, deployment.moe_ep, deployment.attention_dp), deployment.replicas


def _parse_override(item: str) -> tuple[str, object]:
    """``knob=value`` with the value read as a TOML literal (8192, 0.9, true), else as text,
    checked alone; an unknown knob is named with the one it probably misspells."""
    knob, sep, text = item.partition("=")
    knob = knob.strip()
    if not sep or not knob:
        raise ConfigError(f"--set {item!r}: expected KNOB=VALUE, e.g. --set max_num_seqs=256")
    if knob not in KNOB_BY_NAME:
        raise ConfigError(f"--set {item!r}: {unknown_names('knob', [knob], KNOB_BY_NAME, 'known')}")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    try:
        PolicyConfig().replace(**{knob: value})  # the value alone, so the error names this flag
    except ConfigError as exc:
        raise ConfigError(f"--set {item!r}: {exc}") from None
    return knob, value


def _existing(path: Path, flag: str, error: type[Exception]) -> Path:
    if path.is_dir():
        raise error(f"{flag} {path}: is a directory; expected a file")
    if not path.is_file():
        raise error(f"{flag} {path}: no such file")
    return path


def _range_warning(report: Report) -> str:
    return (f"{report.out_of_range_steps} steps fell outside the cost model's profiled range; "
            "their step times are extrapolated, so treat the latencies with care")


def _print_table(console: Console, run: dict, report: Report) -> None:
    fleet = f"{run['replicas']} x TP{run['tp']}" if run["replicas"] > 1 else f"TP{run['tp']}"
    console.print(f"[bold]{run['trace']}[/] ({run['requests']:,} requests, rate x{run['rate_scale']:g}) · "
                  f"{run['model']} on {run['gpu']} {fleet} ({run['framework']})")
    console.print(f"cost model: {run['cost_model']} [dim]({run['cost_model_source']})[/]")
    console.print(f"config: {run['config_source']} · SLO: {run['slo']} · seed {run['seed']}")
    if run["replicas"] > 1 or run["failures"] is not None:
        from optimizer.outputs.review import routing_label

        console.print(f"fleet: {routing_label(PolicyConfig.from_mapping(run['config']), run['replicas'])}"
                      + ("" if run["failures"] is None else f" · failures (replica@down:up s): {run['failures']}"))
    table = Table(show_header=False, show_lines=False)
    table.add_column("figure", style="dim")
    table.add_column("value", justify="right")
    section = None
    for group, label, value in report.summary_rows():
        if group in ("warning", "replicas"):
            continue  # printed below: the warning where it is seen, replicas as their own table
        if section is not None and group != section:
            table.add_section()
        table.add_row(label, value)
        section = group
    console.print(table)
    if len(report.per_class) > 1:
        console.print(_breakdown("SLO class", report.per_class,
                                 ("offered", "good", "attainment", "request_goodput", "p99_ttft_ms", "p99_tpot_ms")))
    if report.per_replica:
        console.print(_breakdown("replica", report.per_replica,
                                 ("routed", "finished", "prefix_hit_rate", "kv_peak_blocks", "kv_peak_fraction")))
    if len(report.per_tenant) > 1:
        console.print(_breakdown("tenant", report.per_tenant,
                                 ("offered", "finished", "good", "goodput", "service_tokens", "share")))
    if report.out_of_range_steps:
        console.print(f"[bold yellow]warning:[/] {_range_warning(report)}")


def _breakdown(kind: str, rows: dict[str, dict], columns: tuple[str, ...]) -> Table:
    table = Table(title=f"per {kind}", header_style="bold")
    table.add_column(kind)
    for column in columns:
        table.add_column(column.replace("_", " "), justify="right")
    for name, entry in rows.items():
        table.add_row(name, *(_cell(entry[c]) for c in columns))
    return table


def _cell(value: object) -> str:
    if isinstance(value, int | np.integer):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "n/a"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)
