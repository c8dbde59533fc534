"""The ``servetune`` command line: one typer app, each command group in its own module."""

from __future__ import annotations

import typer

from optimizer.cli import bench, cost, export, report, simulate, trace, tune, validate

app = typer.Typer(
    name="servetune",
    help="Find the scheduler configuration with the most goodput on your traffic.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
for module in (trace, cost, simulate, tune, report, export, validate, bench):
    module.register(app)


def main() -> None:
    app()
