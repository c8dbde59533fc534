"""`servetune export RUN_DIR`: one trial's config as a vLLM or SGLang config file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from optimizer.cli.report import user_errors


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.command("export")(export_command)


def export_command(
    run_dir: Annotated[Path, typer.Argument(help="run folder written by `servetune tune`")],
    backend: Annotated[str, typer.Option("--backend", help="vllm or sglang")],
    trial: Annotated[int | None, typer.Option("--trial", help="trial number (default: the best trial)")] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="file to write (default: stdout)")] = None,
    storage: Annotated[str | None, typer.Option("--storage", help="study storage URL, when it is a database")] = None,
) -> None:
    """Write trial N of RUN_DIR (default: the best) as a `<backend> serve --config` YAML file."""
    from optimizer.exports import BACKENDS, ExportError

    try:
        if backend not in BACKENDS:
            raise ExportError(f"unknown backend {backend!r}; valid: {list(BACKENDS)}")
        text = _export(run_dir, backend, trial, storage)
        if output is not None:
            output.write_text(text)
    except user_errors() as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except OSError as exc:
        typer.echo(f"error: cannot write {output}: {exc.strerror}", err=True)
        raise typer.Exit(2) from None
    if output is None:
        typer.echo(text, nl=False)
    else:
        typer.echo(f"wrote {output}", err=True)


def _export(run_dir: Path, backend: str, number: int | None, storage: str | None) -> str:
    from optimizer.exports import Deployment, engine_yaml
    from optimizer.outputs import (
        directions,
        find_trial,
        open_run,
        recommend,
        trial_config,
        trial_fleet,
    )
    from policies.presets import PRESETS, preset

    spec, study = open_run(run_dir, storage)
    trials = study.get_trials(deepcopy=False)
    chosen = recommend(trials, spec, directions(study)) if number is None else find_trial(trials, number)
    config = trial_config(chosen, spec, {name: preset(name, spec.gpu) for name in PRESETS})
    fleet = trial_fleet(chosen, spec)
    deployment = Deployment(spec.model, tp=fleet.tp, replicas=fleet.replicas, gpu=spec.gpu,
                            reserved_fraction=_reserved_fraction(spec, fleet.tp) if backend == "sglang" else 0.0,
                            drafter=spec.speculative)
    return engine_yaml(config, deployment, backend, note=f"servetune study {spec.study_name}, trial {chosen.number}")


def _reserved_fraction(spec, tp: int) -> float:
    """Activation reserve / GPU memory from the study's cost model (SGLang counts weights + KV only)."""
    from optimizer.evaluate import build_cost_model

    cost_model = build_cost_model(spec, tp)
    return cost_model.reserved_bytes / cost_model.gpu_memory_bytes
