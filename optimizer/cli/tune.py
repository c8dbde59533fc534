"""`servetune tune`, `servetune worker` and `servetune warmup`.

``tune`` creates or resumes a study (rerunning the same command continues it), runs the
baselines and the search, prints the gain over both baselines and writes the run folder.
``worker`` joins an existing study from any machine that reaches its storage. ``warmup``
compiles the engine's kernels ahead, so the first trial does not pay for it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from costmodels.costmodel import CostModelError
from optimizer.cli.failure_options import FailOption, MtbfOption, RepairOption
from optimizer.cli.trace import trace_warnings_as_lines
from optimizer.search.spec import SpecError, load_spec
from optimizer.search.study import RunStats, StudyError
from policies.config import ConfigError
from policies.engines import ENGINES
from studies.slo import SLOError
from studies.traces import TraceError

USER_ERRORS = (SpecError, StudyError, TraceError, ConfigError, CostModelError, SLOError)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the progress bar and summary say it all
    app.command("tune")(tune_command)
    app.command("worker")(worker_command)
    app.command("warmup")(warmup_command)


def tune_command(
    spec_file: Annotated[Path | None, typer.Argument(help="study spec TOML (flags override it)")] = None,
    trace: Annotated[Path | None, typer.Option("--trace", help="request trace file")] = None,
    model: Annotated[str | None, typer.Option("--model", help="model name, e.g. meta-llama/Llama-3.1-8B")] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="GPU type, e.g. h100")] = None,
    slo: Annotated[str | None, typer.Option("--slo", help="SLO bounds in ms, e.g. ttft:2000,tpot:100")] = None,
    slo_file: Annotated[Path | None, typer.Option("--slo-file", help="TOML of \\[slo.NAME] classes")] = None,
    trace_format: Annotated[str | None, typer.Option("--trace-format", help="trace format; detected if unset")] = None,
    rate_scale: Annotated[float | None, typer.Option("--rate-scale", help="multiply the arrival rate")] = None,
    target_rps: Annotated[float | None, typer.Option("--target-rps", help="scale the trace to this rate")] = None,
    tp: Annotated[int | None, typer.Option("--tp", help="tensor-parallel degree")] = None,
    replicas: Annotated[int | None, typer.Option("--replicas", help="engine replicas")] = None,
    router: Annotated[str | None, typer.Option("--router", help="fix the fleet's router (default: searched when "
                                                                 "replicas > 1)")] = None,
    prefill_replicas: Annotated[int | None, typer.Option(
        "--prefill-replicas", help="fix the prefill pool size (0 = colocated; default: searched)")] = None,
    fail: FailOption = None,
    mtbf: MtbfOption = None,
    repair: RepairOption = None,
    framework: Annotated[str | None, typer.Option("--framework", help="profiles: vllm, sglang, trtllm")] = None,
    speculative: Annotated[Path | None, typer.Option(
        "--speculative", help="drafter TOML (acceptance profile, draft cost, method): searches speculative "
                              "decoding's verify budget and draft length")] = None,
    objective: Annotated[str | None, typer.Option("--objective", help="goodput, goodput-gpus, goodput-ttft, "
                                                                      "goodput-cost or capacity")] = None,
    capacity: Annotated[bool, typer.Option("--capacity", help="maximise capacity (same as --objective capacity)")] = False,
    capacity_target: Annotated[float | None, typer.Option("--capacity-target", help="SLO attainment target")] = None,
    max_rejected: Annotated[float | None, typer.Option("--max-rejected-fraction",
                                                       help="absolute cap (default: best baseline + 0.01)")] = None,
    trials: Annotated[int | None, typer.Option("--trials", help="trial budget, shared by all workers")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", help="trials simulated in parallel")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="sampler and simulation seed")] = None,
    sampler: Annotated[str | None, typer.Option("--sampler", help="tpe (bounded history past 525 trials), tpe-full, nsga2 or random")] = None,
    study_name: Annotated[str | None, typer.Option("--study-name", help="default: <trace>-<model>-<gpu>")] = None,
    storage: Annotated[str | None, typer.Option("--storage", envvar="SERVETUNE_STORAGE",
                                                help="Optuna RDB URL or journal path")] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="default: runs/<study-name>")] = None,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="continue an existing study")] = True,
    outputs: Annotated[bool, typer.Option("--outputs/--no-outputs", help="write configs, plots, review")] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")] = False,
    engine: Annotated[str, typer.Option("--engine", help="vllm, sglang or both: search only the knobs that engine "
                                                          "runs, and export its file")] = "both",
    what_if: Annotated[bool, typer.Option("--what-if", help="also search servetune's own policies (no engine runs "
                                                             "them): what this traffic would gain if it had them")] = False,
    holdout: Annotated[float | None, typer.Option(
        "--holdout", help="share of the trace window, at its end, kept out of tuning and scored after it "
                          "(default 0.25; 0 = off)")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", help="the cap clients send where the trace has none (default: context - prompt)")] = None,
    predictor: Annotated[str | None, typer.Option(
        "--predictor", help="output estimate SJF orders by: cap (default), noisy:SIGMA, oracle (an upper bound)")] = None,
    calibration: Annotated[Path | None, typer.Option(
        "--calibration", help="calibration file from `servetune calibrate` (default: the bundled one)")] = None,
    model_config: Annotated[Path | None, typer.Option(
        "--model-config", help="HuggingFace config.json of a model servetune does not ship (--model names it)")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="weights: bf16 (default), fp8 or nvfp4 (B200)")] = None,
    kv_dtype: Annotated[str | None, typer.Option("--kv-dtype", help="KV cache: auto (default), bf16 or fp8")] = None,
) -> None:
    """Search the scheduler knobs for the most weighted goodput on a trace, per engine."""
    console = Console()
    try:
        if capacity and objective not in (None, "capacity"):
            raise SpecError(f"--capacity and --objective {objective} contradict each other")
        flags = dict(trace=trace, model=model, gpu=gpu, slo=slo, slo_file=slo_file, trace_format=trace_format,
                     rate_scale=rate_scale, target_rps=target_rps, tp=tp, replicas=replicas, framework=framework,
                     router=router, prefill_replicas=prefill_replicas, fail=fail, mtbf_s=mtbf, repair_s=repair,
                     speculative=speculative,
                     objective="capacity" if capacity else objective, capacity_target=capacity_target,
                     trials=trials, batch_size=batch_size, seed=seed, sampler=sampler, study_name=study_name,
                     storage=storage, run_dir=run_dir, max_tokens=max_tokens, predictor=predictor,
                     calibration=calibration, model_config=model_config, dtype=dtype, kv_dtype=kv_dtype,
                     holdout=_holdout(holdout, spec_file))
        with trace_warnings_as_lines():  # one line each, as `simulate` prints them
            names = _targets(engine, what_if)
            probe = load_spec(spec_file, **flags)  # the study's name and run folder, shared by its targets
            _check_deployment(probe)
            probe_framework = framework if framework is not None else _spec_value(spec_file, "deployment", "framework")
            spaces = _spaces_per_target(probe.space, names, console)
            summaries = {}
            for name in names:
                # an engine's study is timed with that engine's profiled op tables unless --framework says
                own = {"framework": name if name in ENGINES else "vllm"} if probe_framework is None else {}
                spec = load_spec(spec_file, **{**flags, **own, "engine": name, "study_name": f"{probe.study_name}-{name}",
                                               "run_dir": Path(probe.run_dir) / name, "space": spaces[name]})
                if max_rejected is not None:
                    spec = spec.replace(constraints=dataclasses.replace(spec.constraints,
                                                                        max_rejected_fraction=max_rejected))
                summaries[name] = _tune(spec, console, resume=resume, outputs=outputs, quiet=quiet)
            if outputs:
                _write_overview(Path(probe.run_dir), probe.study_name, summaries)
                _print_overview(console, summaries)
    except USER_ERRORS as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:  # outside the trial loop (which says what it kept): before or after it
        typer.echo("interrupted: every finished trial is kept (outputs half written are discarded); rerun the "
                   "same command to continue", err=True)
        raise typer.Exit(130) from None


#: Share of the trace window held out of tuning by default, scored after it.
DEFAULT_HOLDOUT = 0.25


def _spec_value(spec_file: Path | None, section: str, key: str):
    """What a spec file sets for ``[section] key``, if anything (e.g. the framework, then
    every target uses its tables)."""
    if spec_file is None:
        return None
    from studies.tomlfile import read_toml

    body = read_toml(spec_file, SpecError).get(section) or {}
    return body.get(key) if isinstance(body, dict) else None


def _check_deployment(spec) -> None:
    """Name an unknown model or GPU before any study or run folder is created."""
    from costmodels.architecture import load_model
    from costmodels.gpus import load_gpu

    load_model(spec.model, spec.model_config)
    load_gpu(spec.gpu)


def _holdout(flag: float | None, spec_file: Path | None) -> float:
    """``--holdout``, else the spec file's ``[study] holdout``, else the default."""
    if flag is not None:
        return flag
    found = _spec_value(spec_file, "study", "holdout")
    return DEFAULT_HOLDOUT if found is None else found


def _targets(engine: str, what_if: bool) -> list[str]:

    if engine not in (*ENGINES, "both"):
        raise SpecError(f"--engine {engine!r} is unknown; valid: {[*ENGINES, 'both']}")
    names = list(ENGINES) if engine == "both" else [engine]
    return [*names, "servetune"] if what_if else names


def _spaces_per_target(space: dict, names: list[str], console: Console) -> dict[str, dict]:
    """The spec's [space] overrides each target can take: a knob one target of the run lacks
    applies to the others (said on the console); a knob none of them has is an error."""
    from policies.config import FLEET_KNOBS
    from policies.engines import target

    fleet_dims = {"others", "tp", "replicas"}
    knobs = {k for k in space if k not in fleet_dims}
    carried = {n: set(target(n).knobs) | (set(FLEET_KNOBS) if target(n).what_if else set()) for n in names}
    nowhere = sorted(k for k in knobs if not any(k in c for c in carried.values()))
    if nowhere:
        raise SpecError(f"[space] names {nowhere}, which no target of this run has a flag for "
                        f"({', '.join(names)}); servetune's own policies are searched with --what-if")
    out = {}
    for name in names:
        skipped = sorted(k for k in knobs if k not in carried[name])
        if skipped:
            console.print(f"[dim]{target(name).display} has no flag for {', '.join(skipped)}: those [space] "
                          "entries apply to the other targets only[/]")
        out[name] = {k: v for k, v in space.items() if k not in skipped}
    return out


def _tune(spec, console: Console, *, resume: bool, outputs: bool, quiet: bool) -> dict | None:
    from optimizer.search.evaluate import Evaluator
    from optimizer.search.study import create_or_resume, enqueue_baselines

    evaluator = Evaluator(spec)
    _check_tunable(evaluator.full_trace, spec)
    if evaluator.holdout_trace is not None:
        _check_tunable(evaluator.trace, spec, part=f"its tuning part (the last {spec.holdout:.0%} of the window "
                                                   "held out: --holdout)")
    study = create_or_resume(spec)
    done = _counted(study)
    if done and not resume:
        raise StudyError(f"study {spec.study_name!r} already has {done} trials; rerun without --no-resume to "
                         "continue it, or pass another --study-name")
    from policies.engines import target

    engine = target(spec.engine)
    console.rule(f"{engine.display} {engine.version}" + (" (what-if)" if engine.what_if else ""))
    console.print(f"study [bold]{spec.study_name}[/]: {evaluator.trace.n} requests"
                  + (f" (+ {evaluator.holdout_trace.n} held out)" if evaluator.holdout_trace is not None else "")
                  + f", {spec.model} on "
                  f"{spec.gpu} ({spec.fleet.describe()}"
                  + (f", failures: {spec.failures.describe()}" if spec.failures else "")
                  + f"), cost model {evaluator.cost_model.source}; "
                  f"{spec.trials} trials{f', {done} done' if done else ''}; run folder {spec.run_dir}")
    enqueue_baselines(study, spec, evaluator.baselines())
    # only what the trials run: the first trial does not wait for the fleet kernel the sizing needs
    _load_kernels(console, _trial_kernels(spec), speculative=spec.speculative is not None)
    stats = _run(study, spec, evaluator, quiet, done)
    _print_summary(console, study, spec, stats)
    if not outputs:
        console.print("[yellow]--no-outputs: no file written, so no gain is stated (a gain is that of the "
                      "exported file, read back and simulated)[/]")
        return None
    from optimizer.outputs.runfolder import write_run_outputs
    from optimizer.outputs.trials import OutputError

    _load_kernels(console, ("fleet",), speculative=spec.speculative is not None)  # GPUs are sized by fleet runs
    console.print("choosing what to deploy (traffic variants, minimal files, error bands, GPUs by fleet runs) and "
                  "writing the run folder")
    try:
        with _spinner(console) as progress:
            progress.add_task("working on the outputs", total=None)
            result = write_run_outputs(spec.run_dir, study, spec, evaluator)
    except OutputError as exc:
        raise StudyError(f"{exc}{_why_nothing_ran(study)}") from None
    _print_file_gains(console, result.summary)
    console.print(f"wrote {len(result.files)} files to {spec.run_dir}")
    return result.summary


def _check_tunable(trace, spec, part: str = "") -> None:
    """Stop before the search on a trace (or the ``part`` of it tuned on) with no arrival rate:
    a study scales the rate, sizes fleets for it and writes a timed replay, none of which a
    trace without a time span has."""
    span = float(trace.arrival_s[-1] - trace.arrival_s[0]) if trace.n else 0.0
    if trace.n < 2 or not span > 0:
        where = f"{spec.trace}, {part}" if part else str(spec.trace)
        raise StudyError(f"{where}: {trace.n} request(s) arriving over {span:g} s; tuning needs arrivals spread "
                         "over time (at least 2 requests at different times) to have a rate to scale, size fleets "
                         "for and replay (`servetune simulate` runs such a trace"
                         + ("; --holdout 0 tunes on the whole trace)" if part else ")"))


def _why_nothing_ran(study) -> str:
    """Why no trial completed: the reasons trials were pruned for, most frequent first."""
    from collections import Counter

    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    reasons = Counter(t.user_attrs["pruned"] for t in trials if "pruned" in t.user_attrs)
    if not reasons or any(t.state == TrialState.COMPLETE for t in trials):
        return ""
    return ("; no config could serve this trace, the defaults included. Pruned: "
            + "; ".join(f"{n} trial(s): {reason}" for reason, n in reasons.most_common(3)))


def worker_command(
    study_name: Annotated[str, typer.Option("--study", help="name of a study created by servetune tune")],
    storage: Annotated[str, typer.Option("--storage", envvar="SERVETUNE_STORAGE", help="Optuna RDB URL or journal")],
    trace: Annotated[Path | None, typer.Option("--trace", help="the study's trace, if at another path here")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", help="trials simulated in parallel")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="sampler seed (default: from the process id)")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")] = False,
) -> None:
    """Join a study and evaluate trials until its shared budget is spent."""
    console = Console()
    try:
        from optimizer.search.evaluate import Evaluator
        from optimizer.search.study import load_for_worker

        with trace_warnings_as_lines():
            spec, study = load_for_worker(study_name, storage, trace=str(trace) if trace else None,
                                          batch_size=batch_size, seed=seed if seed is not None else os.getpid())
            evaluator = Evaluator(spec)
            _load_kernels(console, _trial_kernels(spec), speculative=spec.speculative is not None)
            stats = _run(study, spec, evaluator, quiet, _counted(study))
        _print_summary(console, study, spec, stats)
    except USER_ERRORS as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:  # before or after the trial loop, which says what it kept itself
        typer.echo("interrupted: every finished trial is kept in the study", err=True)
        raise typer.Exit(130) from None


def warmup_command() -> None:
    """Compile (or load from the cache) the simulator kernels, single replica, fleet and
    closed loop (validate, calibrate), so the first trial is fast."""
    from optimizer.fidelity import closedloop
    from policies import engine, fleet

    start = time.perf_counter()
    engine.warmup()
    fleet.warmup()
    closedloop.warmup()
    typer.echo(f"kernels ready in {time.perf_counter() - start:.1f} s")


#: A cold compile of each kernel a study runs, on a 2-core machine: the single-replica engine
#: (74 s of CPU for the README's main command, without the speculative planner; about twice
#: that with a drafter) and the fleet's, which sizes the GPUs (117 s of CPU more).
COLD_COMPILE = {"engine": "1-3 min", "fleet": "2-5 min"}


def _trial_kernels(spec) -> tuple[str, ...]:
    """The kernels a trial may run: the single-replica engine, and the fleet's when a trial
    may run more than one replica, or failures."""
    replicas = max((max(p.choices) if p.choices else int(p.high) for p in spec.search_space.fleet_params
                    if p.name == "replicas"), default=spec.fleet.replicas)
    return ("engine", "fleet") if replicas > 1 or spec.failures is not None else ("engine",)


def _cold(kernel) -> bool:
    """Neither compiled in this process nor in Numba's cache for this source version."""
    if kernel.signatures:
        return False
    try:  # the kernel's cache index (in jitcache's folder): empty when missing or stale
        return not kernel._cache._cache_file._load_index()
    except Exception:  # Numba's internals moved: cannot tell, so say nothing
        return False


def _load_kernels(console: Console, kernels: tuple[str, ...], *, speculative: bool) -> None:
    """Load ``kernels`` ("engine", "fleet") into this process (the warm-up) before the part of
    the study that runs them (the trials, then the fleet sizing), so none is loaded mid-run
    and the first trial does not wait for a kernel only the sizing needs; if one is not
    compiled yet, say so first, with a spinner while it compiles. A study without a drafter
    warms up without the speculative planner (``engine.Statics.spec``)."""
    from policies import engine
    from policies import fleet as fleet_sim

    known = {"engine": ("the single-replica engine", engine.simulate_kernel, engine.warmup),
             "fleet": ("the fleet kernel (replicas behind a router)", fleet_sim.fleet_kernel, fleet_sim.warmup)}
    cold = [key for key in kernels if _cold(known[key][1])]
    for key in kernels:  # already in this process, or from Numba's disk cache: under a second
        if key not in cold:
            known[key][2](speculative)
    if not cold:
        return
    console.print(f"compiling {' and '.join(known[key][0] for key in cold)} (first run of this version on this "
                  f"machine; usually {' + '.join(COLD_COMPILE[key] for key in cold)} on 2 cores; cached afterwards)")
    start = time.perf_counter()
    with _spinner(console) as progress:
        for key in cold:
            task = progress.add_task(f"compiling {known[key][0]}", total=None)
            known[key][2](speculative)
            progress.remove_task(task)
    console.print(f"kernels compiled in {time.perf_counter() - start:.0f} s")


def _spinner(console: Console):
    """A spinner with the elapsed time for a long step with no progress of its own (a compile,
    the outputs): the step blocks this thread, rich redraws the clock from its own."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                    transient=True)


def _counted(study) -> int:
    from optuna.trial import TrialState

    return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.get_trials(deepcopy=False))


def _run(study, spec, evaluator, quiet: bool, done: int) -> RunStats:
    from optimizer.search.progress import TuneProgress
    from optimizer.search.study import run

    with TuneProgress(spec.trials, done, quiet=quiet) as progress:
        try:
            return run(study, spec, evaluator, on_trial=progress.update)
        except KeyboardInterrupt:
            progress.__exit__(None)
            typer.echo(f"interrupted: {_counted(study)} finished trials are kept; rerun the same command to continue",
                       err=True)
            raise typer.Exit(130) from None


def _print_summary(console: Console, study, spec, stats: RunStats) -> None:
    from optimizer.outputs.trials import directions, fleet_front, recommend
    from optimizer.search.study import baseline_trials, best_goodput_trial

    best = best_goodput_trial(study)
    console.print(f"{stats.told} trials in {stats.wall_s:.1f} s ({stats.trials_per_s:.2f} trials/s); "
                  f"engine busy {_share(stats.engine_s, stats.wall_s)} of wall time, Optuna "
                  f"{_share(stats.optuna_s, stats.wall_s)} (asking the next batch while the engine runs)"
                  + (f"; {stats.pruned} pruned before simulating" if stats.pruned else ""))
    if best is None:
        console.print("[yellow]no feasible trial yet: every config broke a constraint or was pruned[/]")
        return
    best = recommend(study.get_trials(deepcopy=False), spec, directions(study))  # as the run folder says
    rows = {f"best searched (trial {best.number})": best, **baseline_trials(study)}
    table = Table(title=f"{spec.study_name}: trials as searched, SLO {spec.slos.describe()}")
    failures = ("re-routed", "good/s during failures") if spec.failures is not None else ()
    for column in ("config", "GPUs", "weighted goodput (/s)", "SLO attainment", "p99 TTFT (ms)", "p99 TPOT (ms)",
                   "rejected", *failures):
        table.add_column(column, justify="left" if column == "config" else "right")
    for name, t in rows.items():
        r = t.user_attrs["report"]
        cells = [_num(r.get("failure_affected"), 0), _num(r.get("goodput_during_failures"), 3)] if failures else []
        table.add_row(name, str(t.user_attrs.get("gpus", "-")), _num(r.get("weighted_goodput"), 3),
                      _pct(r.get("slo_attainment")), _num(r.get("p99_ttft_ms"), 0), _num(r.get("p99_tpot_ms"), 1),
                      _pct(r.get("rejected_fraction")), *cells)
    console.print(table)
    attainments = [t.user_attrs["report"].get("slo_attainment") or 0.0 for t in rows.values()]
    if min(attainments) >= 0.999:
        console.print("[yellow]every config here meets the SLOs for (nearly) every request: the trace is light for "
                      "this deployment; raise the load (--rate-scale) or search capacity (--capacity)[/]")
    front = fleet_front(study.get_trials(deepcopy=False))
    if front:
        console.print("goodput vs GPUs: " + "; ".join(
            f"{p.gpus} ({p.replicas} x TP {p.tp}" + (f", {p.router}" if p.replicas > 1 else "")
            + f"): {p.weighted_goodput:.3f}/s"
            + ("" if p.gain is None else f" ({p.gain:+.1%} vs fewer GPUs)") + f", {100 * p.slo_attainment:.1f}% SLO"
            for p in front))


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def _num(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _print_file_gains(console: Console, summary: dict) -> None:
    """The recommendation's figures: the exported file, replayed; held-out and verdict first."""
    from optimizer.outputs.runfolder import ATTENTION_DP_CAVEAT

    rec = summary["recommendation"]
    best = summary["best"]["report"]
    lead = summary["verdict"]
    what = "what-if " if rec["what_if"] else ""
    first, *rest = summary["answer"]["lines"]
    console.print(f"[bold]{first}[/]")
    for line in rest:
        console.print(line)
    if lead["kind"] == "capacity":
        gpus = lead["gpus_needed"]
        console.print(f"[bold red]no default meets the SLOs for {lead['target_attainment']:.0%} of requests on this "
                      f"deployment[/]: the recommended {rec['file']} needs "
                      + (f"[bold]{gpus} GPU(s)[/] ({lead['replicas_needed']} replicas)" if gpus else "more GPUs than "
                         "the capacity search reached") + " at these SLOs; size by that, not by a gain over a "
                      "default that misses them")
    for name, entry in summary["baselines"].items():
        theirs = entry["report"].get("weighted_goodput") or 0.0
        mine = best.get("weighted_goodput") or 0.0
        text = f"{mine / theirs:.2f}x" if theirs > 0 else "unbounded (the default has no goodput)"
        console.print(f"{what}gain of {rec['file']} over {name}: [bold]{text}[/] weighted goodput "
                      f"({mine:.3f} vs {theirs:.3f}/s; the file read back as {rec['engine']} runs it, simulated)")
    held = summary.get("generalisation")
    if held:
        parts = []
        for scale, figures in held["scales"].items():
            gains = ", ".join(f"{g:.2f}x" if math.isfinite(g) else "unbounded" for g in figures["gain"].values())
            parts.append(f"{scale} rate: {gains}")
        console.print(f"held out (last {held['share']:.0%} of the window, {held['requests']} requests, not tuned on): "
                      + "; ".join(parts))
    bound = summary.get("oracle_upper_bound")
    if bound:
        mine = next(iter(bound["weighted_goodput"].values()))
        console.print(f"[dim]{bound['label']}: {mine:.3f}/s; "
                      + ", ".join(f"{g:.2f}x over {n}" if math.isfinite(g) else f"unbounded over {n}"
                                  for n, g in bound["gain"].items()) + " (not a recommendation)[/]")
    if summary["best"].get("fleet", {}).get("attention_dp", 1) > 1:
        console.print(f"[yellow]{ATTENTION_DP_CAVEAT}[/]")
    extrapolated = {n: e["report"].get("out_of_range_steps") for n, e in summary["baselines"].items()}
    extrapolated[rec["file"]] = best.get("out_of_range_steps")
    flagged = {n: v for n, v in extrapolated.items() if v}
    if flagged:
        console.print("[yellow]steps timed outside the profiled tables (extrapolated): "
                      + ", ".join(f"{n} {v:,}" for n, v in flagged.items()) + "[/]")


def _write_overview(run_dir: Path, study: str, summaries: dict) -> None:
    """runs/<study>/summary.json: each target's file, its replayed gain, held-out gain and
    verdict; and runs/<study>/bench-<engine>.sh, each running that engine's bench replay."""
    import json

    from studies.metrics import json_safe

    overview = {"study": study, "targets": {}}
    for name, summary in summaries.items():
        if summary is None:
            continue
        best = summary["best"]["report"].get("weighted_goodput") or 0.0
        answer = summary["answer"]
        overview["targets"][name] = {
            "folder": name, "file": summary["recommendation"]["file"], "keep_defaults": answer["keep_defaults"],
            "knobs_changed": answer["knobs_changed"], "gain_range": answer["gain"],
            "gpus": answer["sizing"]["recommended"]["gpus"], "deploy": answer["deploy"],
            "what_if": summary["recommendation"]["what_if"],
            "weighted_goodput": best,
            "gain": {b: (best / (e["report"].get("weighted_goodput") or 0.0)
                         if e["report"].get("weighted_goodput") else None)
                     for b, e in summary["baselines"].items()},
            "held_out": summary.get("generalisation"), "verdict": summary["verdict"]}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(json_safe(overview), indent=2) + "\n")
    for name in overview["targets"]:
        script = run_dir / name / f"bench-{name}.sh"
        if script.is_file():  # the study folder's entry point to each engine's replay
            wrapper = run_dir / script.name
            wrapper.write_text(f"#!/usr/bin/env bash\n# {name}'s bench replay: {name}/{script.name} (results land there)\n"
                               f'exec bash "$(dirname "${{BASH_SOURCE[0]}}")/{name}/{script.name}" "$@"\n')
            wrapper.chmod(0o755)


def _print_overview(console: Console, summaries: dict) -> None:
    """What to deploy per target: the file, the knobs it changes, the GPUs and the gain, each
    with its range (traffic variants and the cost model's error)."""
    rows = [(n, s) for n, s in summaries.items() if s is not None]
    if len(rows) < 2:
        return
    table = Table(title="what to deploy (each figure: the exported file, read back and simulated; ranges over "
                        "traffic variants and the cost model's error)")
    for column in ("target", "file", "knobs changed", "GPUs (range)", "SLO attainment", "gain (range)",
                   "held-out gain", "cost model"):
        table.add_column(column, justify="left" if column in ("target", "file", "knobs changed", "cost model")
                         else "right")
    for name, s in rows:
        answer = s["answer"]
        knobs = ("defaults kept" if answer["keep_defaults"] else
                 ", ".join(k["text"] for k in answer["knobs_changed"]) or "none")
        gpus = answer["sizing"]["recommended"]["gpus"]
        deploy = answer["sizing"]["recommended"]["deploy"]
        gain = answer["gain"]
        held = (s.get("generalisation") or {}).get("scales", {}).get("x1", {}).get("gain", {})
        held_text = ", ".join(f"{g:.2f}x" if math.isfinite(g) else "unbounded" for g in held.values()) or "-"
        label = name + (" (what-if)" if s["recommendation"]["what_if"] else "")
        per = deploy["gpus_per_replica"]
        gpus_text = _range(gpus, "{:.0f}") + (f" = {deploy['replicas']} x {per}" if deploy["replicas"] else "")
        error = answer["model_error"]
        calibrated = (f"calibrated ({error['tier']}), +-{100 * error['ttft']:.0f}% TTFT" if error["calibrated"]
                      else "uncalibrated")
        table.add_row(label, s["recommendation"]["file"], knobs, gpus_text,
                      _pct(deploy.get("attainment")), _range(gain, "{:.2f}x"), held_text, calibrated)
    console.print(table)


def _range(figure: dict, fmt: str) -> str:
    """``point (low-high)`` of a range dict; out of reach / unbounded for infinities or None."""
    def show(v):
        if v is None:
            return "out of reach"
        return "unbounded" if math.isinf(v) else fmt.format(v)
    point, low, high = (figure.get(k) for k in ("point", "low", "high"))
    if show(low) == show(high):
        return show(point)
    return f"{show(point)} ({show(low)}-{show(high)})"
