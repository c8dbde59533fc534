"""`servetune report RUN_DIR`: regenerate a run folder's plots, review and summary from its study."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def user_errors() -> tuple[type[Exception], ...]:
    """What a user can get wrong in a run folder; anything else is a bug and keeps its traceback."""
    from costmodels.costmodel import CostModelError
    from optimizer.outputs.exports import ExportError
    from optimizer.outputs.trials import OutputError
    from optimizer.search.spec import SpecError
    from optimizer.search.study import StudyError
    from studies.traces import TraceError

    return OutputError, ExportError, SpecError, StudyError, TraceError, CostModelError


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.command("report")(report_command)


def report_command(
    run_dir: Annotated[Path, typer.Argument(help="run folder written by `servetune tune` (a study folder: every "
                                                 "target in it)")],
    storage: Annotated[str | None, typer.Option("--storage", help="study storage URL, when it is a database "
                                                "(default: the run folder's journal or SERVETUNE_STORAGE)")] = None,
) -> None:
    """Regenerate the configs, plots, capacity review and summary of RUN_DIR from its study."""
    from optimizer.outputs.reopen import target_folders

    for folder in target_folders(run_dir) or [run_dir]:  # none: the one below names what is missing
        _report(folder, storage)


def _report(run_dir: Path, storage: str | None) -> None:
    from optimizer.cli.trace import trace_warnings_as_lines
    from optimizer.outputs.reopen import open_run
    from optimizer.outputs.runfolder import write_run_outputs
    from optimizer.search.evaluate import Evaluator
    from optimizer.search.study import check_fingerprint

    try:
        with trace_warnings_as_lines():
            spec, study = open_run(run_dir, storage)
        # its figures are re-simulated: on the trace the study ran, never on a file changed since
        check_fingerprint(spec, study, "restore that file, or tune the new one in another run folder")
        outputs = write_run_outputs(run_dir, study, spec, Evaluator(spec))
    except user_errors() as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        typer.echo(f"interrupted: {run_dir}'s previous outputs are kept whole (nothing half written stays)", err=True)
        raise typer.Exit(130) from None
    best = outputs.summary["best"]
    typer.echo(f"{run_dir}: " + outputs.summary["answer"]["lines"][0])
    typer.echo(f"best trial {best['trial']}: " + ", ".join(f"{k} {v:.4g}" for k, v in best["values"].items()
                                                          if isinstance(v, int | float)))
    for name, entry in outputs.summary["baselines"].items():
        change = entry["gains"]["weighted_goodput"]["change"]
        typer.echo(f"  weighted goodput vs {name}: " + ("n/a" if change is None else f"{change:+.1%}"))
    typer.echo(f"wrote {len(outputs.files)} files to {run_dir}")
