"""A rich progress bar for a tuning run: trials done, best goodput so far, trials per second.

Silent when the console is not a terminal (CI logs, pipes) or with ``quiet``; the run's
final summary is printed either way by the CLI.
"""

from __future__ import annotations

import math
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from optimizer.search.objective import is_feasible


class TuneProgress:
    """Context manager; pass ``update`` as the study loop's ``on_trial`` callback."""

    def __init__(self, total: int, done: int = 0, *, quiet: bool = False, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.enabled = not quiet and self.console.is_terminal
        self.best = math.nan
        self.done = done
        self._start = time.perf_counter()
        self._told = 0
        self._bar = None
        if self.enabled:
            self._bar = Progress(
                TextColumn("[bold]tuning"), BarColumn(), MofNCompleteColumn(),
                TextColumn("best {task.fields[best]}"), TextColumn("{task.fields[rate]} trials/s"),
                TimeElapsedColumn(), console=self.console, transient=False,
            )
            self._task = self._bar.add_task("tune", total=total, completed=done, best="-", rate="-")

    def __enter__(self) -> TuneProgress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(self, trial, stats=None) -> None:
        """Count a told trial; track the best feasible weighted goodput seen."""
        self.done += 1
        self._told += 1
        report = trial.user_attrs.get("report")
        if report and is_feasible(trial):
            goodput = report.get("weighted_goodput") or 0.0
            if math.isnan(self.best) or goodput > self.best:
                self.best = goodput
        if self._bar is not None:
            elapsed = time.perf_counter() - self._start
            self._bar.update(self._task, completed=self.done,
                             best="-" if math.isnan(self.best) else f"{self.best:.3f}/s",
                             rate=f"{self._told / elapsed:.1f}" if elapsed > 0 else "-")
