"""`servetune export RUN_DIR`: the recommended file, or one trial's config as its engine's file.

A trial was searched in one engine's space (the study's ``engine``), so it is written for
that engine only; a what-if study's trials are servetune policies (``policy.toml``).
Without ``--trial`` it is the file ``tune`` recommended (chosen on traffic variants, its
knobs reduced to those that carry the gain, its replica count sized: ``optimizer.robust``),
as the run folder holds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from optimizer.cli.report import user_errors


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.command("export")(export_command)


def export_command(
    run_dir: Annotated[Path, typer.Argument(help="run folder written by `servetune tune` (or its study folder "
                                                 "with --backend)")],
    backend: Annotated[str | None, typer.Option("--backend", help="vllm or sglang (default: the study's engine)")] = None,
    trial: Annotated[int | None, typer.Option("--trial", help="trial number (default: the file tune "
                                                               "recommended)")] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="file to write (default: stdout)")] = None,
    storage: Annotated[str | None, typer.Option("--storage", help="study storage URL, when it is a database")] = None,
) -> None:
    """Write trial N of RUN_DIR (default: the recommended file) as a `<backend> serve --config` YAML file."""
    from optimizer.outputs.exports import BACKENDS, ExportError

    try:
        if backend is not None and backend not in BACKENDS:
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


def _export(run_dir: Path, backend: str | None, number: int | None, storage: str | None) -> str:
    from optimizer.outputs.exports import ExportError, engine_yaml, policy_toml
    from optimizer.outputs.reopen import open_run, target_folder
    from optimizer.outputs.replay import deployment_of, file_replay
    from optimizer.outputs.trials import find_trial, trial_config, trial_fleet
    from policies.engines import target

    run_dir = target_folder(run_dir, backend)  # a study folder: the backend's target in it
    spec, study = open_run(run_dir, storage)
    engine = target(spec.engine)
    if backend is not None and backend != spec.engine:
        raise ExportError(f"this study searched {engine.display}'s knobs ({spec.engine}); its trials are not "
                          f"{backend} configs. Export the {backend} study's run folder instead")
    if number is None:
        return _recommended(run_dir, engine)
    chosen = find_trial(study.get_trials(deepcopy=False), number)
    config = trial_config(chosen, spec, engine.baselines(spec.context))
    note = f"servetune study {spec.study_name}, trial {chosen.number}"
    if engine.what_if:
        return policy_toml(config, note, what_if=True)
    fleet = trial_fleet(chosen, spec)
    # the file as tune writes it: the config read back from its first writing (a knob the
    # file scales per attention-DP group settles there)
    deployed = file_replay(spec, engine, config, fleet, note).config
    return engine_yaml(engine, deployed, deployment_of(spec, fleet), spec.context, note=note)


def _recommended(run_dir: Path, engine) -> str:
    """The file ``tune`` recommended, as written to the run folder (the choice among trials
    needs the traffic variants, so it is read, not redone)."""
    from optimizer.outputs.exports import ExportError

    name = "policy.toml" if engine.what_if else f"{engine.name}.yaml"
    path = Path(run_dir) / name
    if not path.is_file():
        raise ExportError(f"{run_dir} has no {name} yet (a study run with --no-outputs): run `servetune report "
                          f"{run_dir}` to choose and write it, or pass --trial N")
    return path.read_text()
