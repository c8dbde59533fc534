"""`servetune trace`: inspect, convert and synthesise request traces.

Every command reports a bad file or option as one line, ``error: ...``, and exits with
code 2; warnings (rows that had to be sorted, blank rows skipped, columns ignored) are
printed as they come, one line each (``trace_warnings_as_lines``, which ``simulate``
uses too), not hidden.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from studies import formats, synthetic, transforms
from studies.traces import Trace, TraceError, TraceWarning, load_trace, trace_stats, write_trace

trace_app = typer.Typer(help="Inspect, convert and synthesise request traces.", no_args_is_help=True)
_out = Console()
_err = Console(stderr=True)


class TraceFormat(StrEnum):
    mooncake = "mooncake"
    azure = "azure"
    burstgpt = "burstgpt"
    native = "native"


class Spread(StrEnum):
    uniform = "uniform"
    poisson = "poisson"
    raw = "raw"


class OutputFormat(StrEnum):
    table = "table"
    json = "json"


class WriteFormat(StrEnum):
    native = "native"
    mooncake = "mooncake"
    azure = "azure"


class Arrival(StrEnum):
    poisson = "poisson"
    gamma = "gamma"
    onoff = "onoff"
    diurnal = "diurnal"


TraceFormatOpt = Annotated[TraceFormat | None, typer.Option("--trace-format", help="Input format (default: detect).")]
StrictOpt = Annotated[bool, typer.Option("--strict", help="Unsorted rows are an error instead of sorted with a warning.")]
SpreadOpt = Annotated[Spread | None, typer.Option(help="Mooncake: place requests within each ~3 s bucket (default uniform).")]
SeedOpt = Annotated[int, typer.Option(help="Seed for random choices (Poisson spreading, sampling, synthesis).")]
ModelOpt = Annotated[list[str] | None, typer.Option("--model", help="BurstGPT: keep only this model (repeatable).")]


@contextmanager
def trace_warnings_as_lines() -> Iterator[None]:
    """Inside, print every ``TraceWarning`` (and ``StudyWarning``: a repaired journal) as it
    comes as one line, ``warning: ...``, on stderr: its message already names the file, the
    rows and what was done, where Python's own format would add the source line that raised
    it. Other warnings are left alone."""
    from optimizer.search.study import StudyWarning

    with warnings.catch_warnings():
        warnings.simplefilter("always", TraceWarning)
        warnings.simplefilter("always", StudyWarning)
        show_other = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, TraceWarning | StudyWarning):
                typer.echo(f"warning: {message}", err=True)
            else:
                show_other(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


@contextmanager
def _reported() -> Iterator[None]:
    """Turn trace errors into one line and exit code 2; print warnings as they come."""
    with trace_warnings_as_lines():
        try:
            yield
        except (TraceError, OSError) as exc:
            _err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None


def _load(file: Path, trace_format: TraceFormat | None, strict: bool, spread: Spread | None,
          seed: int, model: list[str] | None, default_spread: Spread = Spread.uniform) -> Trace:
    name = trace_format.value if trace_format else formats.detect(file)
    options: dict = {}
    if name == "mooncake":
        options.update(spread=(spread or default_spread).value, seed=seed)
    elif spread is not None:
        raise TraceError(f"--spread applies to Mooncake traces; {file} is {name}")
    if model:
        options["model"] = model
    return load_trace(file, name, strict=strict, **options)


@trace_app.command("stats")
def stats(
    file: Annotated[Path, typer.Argument(help="Trace file (Mooncake JSONL, Azure/BurstGPT CSV, native).")],
    format: Annotated[OutputFormat, typer.Option("--format", "-f", help="table or json.")] = OutputFormat.table,
    trace_format: TraceFormatOpt = None,
    strict: StrictOpt = False,
    spread: Annotated[Spread | None, typer.Option(
        help="Mooncake: raw (default) describes the file as recorded; uniform/poisson preview the "
             "arrivals a simulation replays.")] = None,
    seed: SeedOpt = 0,
    model: ModelOpt = None,
) -> None:
    """Rows, span, arrival rates, token percentiles and prefix-block reuse of a trace."""
    with _reported():
        trace = _load(file, trace_format, strict, spread, seed, model, default_spread=Spread.raw)
    summary = trace_stats(trace)
    summary["meta"] = trace.meta
    if format is OutputFormat.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        _print_stats(summary)


def _print_stats(s: dict) -> None:
    head = Table(title=f"{s['source']}", show_header=False)
    head.add_row("requests", f"{s['rows']:,}")
    head.add_row("span", f"{s['span_s']:,.1f} s")
    head.add_row("mean rate", f"{s['mean_rate']:.2f} req/s")
    head.add_row("peak-minute rate", f"{s['peak_minute_rate']:.2f} req/s")
    blocks = s["blocks"]
    head.add_row("prefix blocks", f"{blocks['total']:,} of {blocks['block_tokens']} tokens, "
                                  f"{blocks['distinct']:,} distinct, {blocks['repeat_fraction']:.1%} repeats")
    head.add_row("tenants", ", ".join(f"{k} {v:,}" for k, v in s["tenants"].items()))
    head.add_row("SLO classes", ", ".join(f"{k} {v:,}" for k, v in s["slo_classes"].items()))
    head.add_row("with deadline", f"{s['with_deadline']:,}")
    for key in ("format", "spread", "filtered_rows", "blank_rows", "resorted_rows", "rate_scale"):
        if key in s["meta"]:
            head.add_row(key, str(s["meta"][key]))
    tokens = Table(title="tokens")
    for column in ("", "mean", "p50", "p99", "min", "max"):
        tokens.add_column(column, justify="right")
    for name in ("prompt_tokens", "output_tokens", "max_tokens"):
        t = s[name]
        tokens.add_row(name, *(f"{t[k]:,.0f}" for k in ("mean", "p50", "p99", "min", "max")))
    _out.print(head)
    _out.print(tokens)


def _window(text: str | None) -> tuple[float, float | None] | None:
    if text is None:
        return None
    start, sep, end = text.partition(":")
    try:
        return float(start or 0), (float(end) if end else None)
    except ValueError:
        raise TraceError(f"--window {text!r}; expected START:END in seconds, e.g. 600:1200") from None


@trace_app.command("convert")
def convert(
    file: Annotated[Path, typer.Argument(help="Trace file to read.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write (.parquet, .csv or .jsonl).")],
    to: Annotated[WriteFormat, typer.Option(help="Output format; native keeps every field.")] = WriteFormat.native,
    trace_format: TraceFormatOpt = None,
    strict: StrictOpt = False,
    spread: SpreadOpt = None,
    seed: SeedOpt = 0,
    model: ModelOpt = None,
    window: Annotated[str | None, typer.Option(help="Keep arrivals in START:END seconds (rebased to 0).")] = None,
    rate_scale: Annotated[float | None, typer.Option(help="Multiply the arrival rate (compress time).")] = None,
    target_rps: Annotated[float | None, typer.Option(help="Scale time to this mean rate.")] = None,
    sample: Annotated[float | None, typer.Option(help="Keep this random fraction of requests.")] = None,
) -> None:
    """Read any supported trace, optionally window / rescale / sample it, and write it."""
    with _reported():
        trace = _load(file, trace_format, strict, spread, seed, model)
        bounds = _window(window)
        if bounds is not None:
            trace = transforms.window(trace, *bounds)
        if sample is not None:
            trace = transforms.sample(trace, sample, seed=seed)
        if rate_scale is not None or target_rps is not None:
            trace = transforms.scale_rate(trace, rate_scale, target_rps=target_rps)
        write_trace(trace, output, to.value)
    _out.print(f"wrote {trace.n:,} requests to {output}")


def _tenants(spec: str | None, make: Callable[..., synthetic.Tenant]) -> list[synthetic.Tenant]:
    """``name:weight[:priority[:slo_class]]`` pairs, comma-separated."""
    if not spec:
        return [make()]
    tenants = []
    for part in spec.split(","):
        fields = part.strip().split(":")
        if not 2 <= len(fields) <= 4:
            raise TraceError(f"--tenants part {part!r}; expected NAME:WEIGHT[:PRIORITY[:SLO_CLASS]]")
        try:
            weight = float(fields[1])
            priority = int(fields[2]) if len(fields) > 2 else 0
        except ValueError:
            raise TraceError(f"--tenants part {part!r}: weight must be a number, priority an integer") from None
        slo = fields[3] if len(fields) > 3 else "default"
        tenants.append(make(name=fields[0], weight=weight, priority=priority, slo_class=slo))
    return tenants


@trace_app.command("synth")
def synth(
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write (.parquet, .csv or .jsonl).")],
    duration: Annotated[float, typer.Option(help="Seconds of traffic.")] = 600.0,
    rate: Annotated[float, typer.Option(help="Mean arrival rate (req/s; sessions/s with --turns-mean).")] = 5.0,
    arrival: Annotated[Arrival, typer.Option(help="Arrival process.")] = Arrival.poisson,
    cv: Annotated[float, typer.Option(help="gamma: coefficient of variation of the gaps.")] = 2.0,
    burst_factor: Annotated[float, typer.Option(help="onoff: on-rate / mean rate (off-rate 0).")] = 4.0,
    on_s: Annotated[float, typer.Option(help="onoff: mean on-period (s); off-periods fill the rest.")] = 30.0,
    amplitude: Annotated[float, typer.Option(help="diurnal: relative swing of the rate (0..1).")] = 0.5,
    period: Annotated[float, typer.Option(help="diurnal: period in seconds.")] = 3600.0,
    prompt_mean: Annotated[float, typer.Option(help="Mean prompt tokens (log-normal).")] = 1024.0,
    prompt_cv: Annotated[float, typer.Option(help="Prompt length coefficient of variation.")] = 1.0,
    output_mean: Annotated[float, typer.Option(help="Mean output tokens (log-normal).")] = 256.0,
    output_cv: Annotated[float, typer.Option(help="Output length coefficient of variation.")] = 1.0,
    like: Annotated[Path | None, typer.Option(help="Take lengths from this trace instead.")] = None,
    like_how: Annotated[str, typer.Option(help="With --like: 'fit' (log-normal) or 'resample'.")] = "fit",
    prefix_groups: Annotated[int, typer.Option(help="Shared system-prompt groups (0 = none).")] = 0,
    prefix_tokens: Annotated[int, typer.Option(help="Tokens of each shared prefix.")] = 1024,
    zipf: Annotated[float, typer.Option(help="Group popularity exponent.")] = 0.0,
    hot_share: Annotated[float, typer.Option(help="Share of requests sent to the current hot group.")] = 0.0,
    hot_shift: Annotated[float, typer.Option(help="Seconds before the hot group moves on.")] = float("inf"),
    turns_mean: Annotated[float, typer.Option(help="Mean turns per conversation (1 = single requests).")] = 1.0,
    think_s: Annotated[float, typer.Option(help="Mean seconds between turns.")] = 30.0,
    max_tokens_bias: Annotated[float, typer.Option(help="max_tokens = bias x true output length.")] = 1.0,
    max_tokens_cv: Annotated[float, typer.Option(help="Noise (cv) on the max_tokens estimate.")] = 0.0,
    tenants: Annotated[str | None, typer.Option(help="Mix: NAME:WEIGHT[:PRIORITY[:SLO_CLASS]],...")] = None,
    adapters: Annotated[int, typer.Option(help="LoRA adapters requests ask for (0 = base model only).")] = 0,
    adapter_zipf: Annotated[float, typer.Option(help="Adapter popularity exponent (1/rank**zipf).")] = 1.0,
    adapter_base_share: Annotated[float, typer.Option(help="Share of requests for the base model.")] = 0.0,
    adapter_shift: Annotated[float, typer.Option(
        help="Seconds before the adapter ranking rotates by half (the hot set turns cold).")] = float("inf"),
    seed: SeedOpt = 0,
) -> None:
    """Generate a seeded synthetic trace."""
    with _reported():
        process = {
            Arrival.poisson: lambda: synthetic.Poisson(rate),
            Arrival.gamma: lambda: synthetic.Gamma(rate, cv),
            Arrival.onoff: lambda: synthetic.OnOff(rate * burst_factor, on_s, on_s * (burst_factor - 1)),
            Arrival.diurnal: lambda: synthetic.Diurnal(rate, amplitude, period),
        }[arrival]()
        if like is not None:
            lengths = synthetic.lengths_like(load_trace(like), like_how)
        else:
            lengths = {"prompt": synthetic.LogNormal(prompt_mean, prompt_cv),
                       "output": synthetic.LogNormal(output_mean, output_cv)}
        shared = dict(
            **lengths,
            prefix=synthetic.SharedPrefix(prefix_groups, prefix_tokens, zipf, hot_share, hot_shift)
            if prefix_groups else None,
            conversation=synthetic.Conversation(turns_mean, think_s) if turns_mean > 1 else None,
            estimate=synthetic.OutputEstimate(max_tokens_bias, max_tokens_cv)
            if (max_tokens_bias, max_tokens_cv) != (1.0, 0.0) else None,
            adapters=synthetic.Adapters(adapters, adapter_zipf, adapter_base_share, adapter_shift)
            if adapters else None,
        )
        mix = _tenants(tenants, lambda **kw: synthetic.Tenant(**shared, **kw))
        trace = synthetic.generate(process, duration_s=duration, tenants=mix, seed=seed)
        write_trace(trace, output)
    _out.print(f"wrote {trace.n:,} requests to {output}")


def register(app: typer.Typer) -> None:
    """Add ``servetune trace ...`` to the root app."""
    app.add_typer(trace_app, name="trace")
