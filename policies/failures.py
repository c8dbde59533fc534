"""Failure schedules: which replica is down from when to when.

A schedule is rows (replica, t_down, t_up) in seconds on the trace clock: the replica
stops at t_down, losing the KV of every request it holds, and comes back empty at t_up
(``inf``: never). It is given explicitly (CLI ``--fail 2@600:900,0@100:200``, or TOML
``[failures] windows = ["2@600:900"]``) or drawn by ``random_failures`` from a mean time between failures
and a repair time, seeded. What the fleet does at each event is the fleet contract's
(policies.fleet); this module only validates and orders the events.

Rules, each checked with an error naming the row: replica an integer >= 0 (and below the
fleet's size, ``check_replicas``), 0 <= t_down < t_up, and the windows of one replica
neither overlap nor touch (a replica back at t is not down again at t: merge such rows).
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


class FailureError(ValueError):
    """A failure schedule that cannot be run, naming the row and what is wrong."""


@dataclass(frozen=True, eq=False)
class FailureSchedule:
    """Failure windows sorted by (t_down, replica); build with ``from_rows`` or a parser."""

    replica: np.ndarray  # i8[k]
    t_down: np.ndarray  # f8[k]
    t_up: np.ndarray  # f8[k], inf = never back

    def __post_init__(self) -> None:
        columns = [np.asarray(c) for c in (self.replica, self.t_down, self.t_up)]
        if any(c.ndim != 1 for c in columns) or len({len(c) for c in columns}) != 1:
            raise FailureError("a failure schedule needs three 1-D columns of equal length (replica, t_down, t_up)")
        rows = _validated(zip(*columns, strict=True), "failure")
        for name, column in zip(("replica", "t_down", "t_up"), _columns(rows), strict=True):
            object.__setattr__(self, name, column)

    @classmethod
    def from_rows(cls, rows: Iterable[Sequence[Any]], where: str = "failure") -> FailureSchedule:
        """Validate (replica, t_down, t_up) rows; ``where`` prefixes the row in errors."""
        return cls(*_columns(_validated(rows, where)))

    @classmethod
    def empty(cls) -> FailureSchedule:
        return cls.from_rows([])

    def __len__(self) -> int:
        return len(self.replica)

    def rows(self) -> list[tuple[int, float, float]]:
        return [(int(r), float(d), float(u)) for r, d, u in zip(self.replica, self.t_down, self.t_up, strict=True)]

    def check_replicas(self, n_replicas: int) -> None:
        """Raise FailureError if a row names a replica the fleet of ``n_replicas`` lacks."""
        bad = np.flatnonzero(self.replica >= n_replicas)
        if len(bad):
            r, d, u = self.rows()[bad[0]]
            raise FailureError(f"failure {r}@{d:g}:{u:g}: replica {r} does not exist in a fleet of "
                               f"{n_replicas} (replicas 0..{n_replicas - 1})")

    def per_rank(self, ranks: int) -> FailureSchedule:
        """The schedule of instances of ``ranks`` schedulers each (attention-DP ranks,
        replicas ``i * ranks .. i * ranks + ranks - 1`` of the fleet kernel): an instance's
        window takes all of its ranks down and back together, as a rank's failure stops
        the instance's lockstep."""
        return FailureSchedule.from_rows([(r * ranks + k, d, u) for r, d, u in self.rows() for k in range(ranks)])

    def check_lockstep(self, ranks: int) -> None:
        """Raise FailureError unless every window stops whole instances of ``ranks`` ranks
        (ranks stepping together cannot fail one by one)."""
        rows = set(self.rows())
        for r, d, u in sorted(rows):
            first = r - r % ranks
            missing = [first + k for k in range(ranks) if (first + k, d, u) not in rows]
            if missing:
                raise FailureError(f"failure {r}@{d:g}:{u:g}: replica {r} is a rank of the attention-DP instance "
                                   f"of replicas {first}..{first + ranks - 1}, which step together and fail "
                                   f"together; ranks {missing} lack that window")

    def events(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every down and up event as (time f8, replica i8, up b1) arrays, in processing order.

        Sorted by time; at equal times downs come before ups (the fleet contract's event
        order), then by replica. Windows that never end have no up event.
        """
        finite = np.isfinite(self.t_up)
        times = np.concatenate([self.t_down, self.t_up[finite]])
        replicas = np.concatenate([self.replica, self.replica[finite]])
        up = np.concatenate([np.zeros(len(self), dtype=np.bool_), np.ones(int(finite.sum()), dtype=np.bool_)])
        order = np.lexsort((replicas, up, times))
        return times[order], replicas[order], up[order]

    def describe(self) -> str:
        return ",".join(f"{r}@{d:g}:{u:g}" for r, d, u in self.rows())

    @classmethod
    def parse(cls, text: str) -> FailureSchedule:
        """Parse ``"2@600:900,0@100:200"``: replica @ down seconds : up seconds (``inf`` = never)."""
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise FailureError(f"failure schedule {text!r} is empty; give e.g. 2@600:900")
        return cls.from_rows([_parse_item(item) for item in items], where=f"--fail {text!r}")

    @classmethod
    def from_toml(cls, text: str) -> FailureSchedule:
        """Read ``[failures] windows = [...]`` from TOML text (keys may also sit at top level)."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise FailureError(f"[failures]: not valid TOML ({exc})") from None
        return cls.from_mapping(data.get("failures", data))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "[failures]") -> FailureSchedule:
        """A parsed ``[failures]`` table: ``windows``, each a string ``"2@600:900"`` or a table
        ``{replica = 2, down_s = 600, up_s = 900}`` (``up_s`` omitted: never back)."""
        unknown = sorted(set(data) - {"windows"})
        if unknown:
            raise FailureError(f"{where}: unknown key(s) {unknown}; valid: ['windows']")
        windows = data.get("windows")
        if not isinstance(windows, list):
            raise FailureError(f"{where}: windows must be a list of \"R@DOWN:UP\" strings or tables, got {windows!r}")
        rows = []
        for i, window in enumerate(windows):
            if isinstance(window, str):
                rows.append(_parse_item(window))
            elif isinstance(window, Mapping):
                extra = sorted(set(window) - {"replica", "down_s", "up_s"})
                if extra or "replica" not in window or "down_s" not in window:
                    raise FailureError(f"{where} windows[{i}]: needs replica and down_s (up_s optional), "
                                       f"got keys {sorted(window)}")
                rows.append((window["replica"], window["down_s"], window.get("up_s", math.inf)))
            else:
                raise FailureError(f"{where} windows[{i}]: expected \"R@DOWN:UP\" or a table, got {window!r}")
        return cls.from_rows(rows, where=f"{where} windows")


def random_failures(n_replicas: int, horizon_s: float, mtbf_s: float, repair_s: float,
                    seed: int = 0) -> FailureSchedule:
    """Failures of each replica over [0, horizon_s): exponential up-times of mean ``mtbf_s``,
    each followed by ``repair_s`` seconds down.

    Replica j draws from its own stream seeded by (seed, j), so a replica's failures do
    not depend on the fleet's size. A failure starting before the horizon is kept whole.
    """
    for name, value in (("n_replicas", n_replicas), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < (name == "n_replicas"):
            raise FailureError(f"{name} must be an integer >= {int(name == 'n_replicas')}, got {value!r}")
    for name, value in (("horizon_s", horizon_s), ("mtbf_s", mtbf_s), ("repair_s", repair_s)):
        if not (isinstance(value, int | float | np.integer | np.floating) and math.isfinite(value) and value > 0):
            raise FailureError(f"{name} must be a finite number > 0, got {value!r}")
    rows = []
    for j in range(n_replicas):
        rng = np.random.default_rng([seed, j])
        t = 0.0
        while True:
            t += rng.exponential(mtbf_s)
            if t >= horizon_s:
                break
            rows.append((j, t, t + repair_s))
            t += repair_s
    return FailureSchedule.from_rows(rows, where="random failure")


_ITEM = re.compile(r"^\s*(?P<replica>[^@]+)@(?P<down>[^:]+):(?P<up>.+)$")


def _validated(rows: Iterable[Sequence[Any]], where: str) -> list[tuple[int, float, float]]:
    """Rows checked (see the module docstring) and sorted by (t_down, replica)."""
    parsed = [_row(row, f"{where} row {i}") for i, row in enumerate(rows)]
    by_replica: dict[int, list[tuple[float, float, int]]] = {}
    for i, (replica, down, up) in enumerate(parsed):
        by_replica.setdefault(replica, []).append((down, up, i))
    for replica, windows in by_replica.items():
        windows.sort()
        for (down0, up0, i0), (down1, up1, i1) in zip(windows, windows[1:], strict=False):
            if down1 <= up0:
                raise FailureError(f"{where} rows {i0} and {i1}: replica {replica}'s windows "
                                   f"[{down0:g}, {up0:g}) and [{down1:g}, {up1:g}) overlap or touch; merge them")
    return sorted(parsed, key=lambda r: (r[1], r[0]))


def _columns(rows: list[tuple[int, float, float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.array([r[0] for r in rows], dtype=np.int64), np.array([r[1] for r in rows], dtype=np.float64),
            np.array([r[2] for r in rows], dtype=np.float64))


def _parse_item(item: str) -> tuple[str, str, str]:
    match = _ITEM.match(item)
    if not match:
        raise FailureError(f"failure {item!r}: expected REPLICA@DOWN:UP in seconds, e.g. 2@600:900")
    return match["replica"].strip(), match["down"].strip(), match["up"].strip()


def _row(row: Sequence[Any], where: str) -> tuple[int, float, float]:
    if isinstance(row, str | bytes) or len(row) != 3:
        raise FailureError(f"{where}: expected (replica, t_down, t_up), got {row!r}")
    replica, down, up = (x.item() if isinstance(x, np.generic) else x for x in row)
    try:
        replica_value = int(replica)
        exact = replica_value == float(replica)
    except (TypeError, ValueError):
        exact = False
    if isinstance(replica, bool) or not exact or replica_value < 0:
        raise FailureError(f"{where}: replica must be an integer >= 0, got {replica!r}")
    down_value, up_value = _seconds(down, where, "t_down"), _seconds(up, where, "t_up")
    if not math.isfinite(down_value) or down_value < 0:
        raise FailureError(f"{where}: t_down must be a finite time >= 0, got {down!r}")
    if not up_value > down_value:
        raise FailureError(f"{where}: t_up ({up!r}) must be after t_down ({down!r})")
    return replica_value, down_value, up_value


def _seconds(value: Any, where: str, name: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise FailureError(f"{where}: {name} must be a number of seconds, got {value!r}") from None
    if math.isnan(seconds) or isinstance(value, bool):
        raise FailureError(f"{where}: {name} must be a number of seconds, got {value!r}")
    return seconds
