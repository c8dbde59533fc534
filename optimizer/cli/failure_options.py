"""The failure flags ``servetune simulate`` and ``servetune tune`` share (``optimizer.search.failplan``)."""

from __future__ import annotations

from typing import Annotated

import typer

FailOption = Annotated[str | None, typer.Option(
    "--fail", help="failure windows REPLICA@DOWN:UP in seconds, e.g. 2@600:900,0@100:200")]
MtbfOption = Annotated[float | None, typer.Option(
    "--mtbf", help="random failures: mean seconds between a replica's failures (with --repair)")]
RepairOption = Annotated[float | None, typer.Option(
    "--repair", help="random failures: seconds a failed replica stays down")]
