"""SLO classes: latency bounds a request must meet to count as good, and its weight.

Bounds are in milliseconds and follow ``vllm bench serve --goodput``: ``ttft``, ``tpot``
and ``e2el``; an unset bound is not checked. A request is good only if it finished and
meets every bound of its class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from studies.names import unknown_names
from studies.tomlfile import read_toml

SLO_KEYS = ("ttft", "tpot", "e2el")


class SLOError(ValueError):
    """An SLO string or file that cannot be parsed, naming the part and what is valid."""


@dataclass(frozen=True)
class SLOClass:
    name: str = "default"
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    weight: float = 1.0

    def __post_init__(self) -> None:
        for key in SLO_KEYS:
            value = getattr(self, f"{key}_ms")
            # 0 ms is a bound no request meets: a typo or a unit slip, never a target
            if value is not None and not (_is_number(value) and math.isfinite(value) and value > 0):
                raise SLOError(f"SLO class {self.name!r}: {key} must be a finite number of ms > 0 "
                               f"(leave it out for no bound), got {value!r}")
        if not (_is_number(self.weight) and math.isfinite(self.weight) and self.weight >= 0):
            raise SLOError(f"SLO class {self.name!r}: weight must be >= 0 (a finite number), got {self.weight!r}")

    @property
    def bounds_ms(self) -> tuple[float, float, float]:
        """(ttft, tpot, e2el) with inf for unset bounds: the form the scorer vectorises."""
        return tuple(math.inf if v is None else float(v) for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def describe(self) -> str:
        parts = [f"{k}:{getattr(self, f'{k}_ms'):g}" for k in SLO_KEYS if getattr(self, f"{k}_ms") is not None]
        return ",".join(parts) or "none"


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class SLOSet:
    """The SLO classes of a study; a trace's SLO class names look up here, else ``default``."""

    classes: tuple[SLOClass, ...] = (SLOClass(),)

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if not names:
            raise SLOError("an SLO set needs at least one class")
        if len(set(names)) != len(names):
            raise SLOError(f"duplicate SLO class names in {names}")

    def lookup(self, name: str) -> SLOClass:
        for c in self.classes:
            if c.name == name:
                return c
        for c in self.classes:
            if c.name == "default":
                return c
        raise SLOError(f"trace SLO class {name!r} has no SLO and there is no 'default' class; "
                       f"defined: {[c.name for c in self.classes]}")

    @property
    def has_bounds(self) -> bool:
        return any(any(math.isfinite(b) for b in c.bounds_ms) for c in self.classes)

    def describe(self) -> str:
        return "; ".join(f"{c.name}: {c.describe()} (w={c.weight:g})" for c in self.classes)


def parse_slo(text: str, name: str = "default", weight: float = 1.0) -> SLOSet:
    """Parse ``ttft:2000,tpot:100,e2el:30000`` (ms, vLLM bench style) into a one-class set.

    Spaces may separate pairs instead of commas, as ``vllm bench serve --goodput`` takes them.
    """
    bounds: dict[str, float] = {}
    for part in text.replace(",", " ").split():
        key, sep, value = part.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise SLOError(f"SLO part {part!r}: expected KEY:MS with KEY one of {list(SLO_KEYS)}")
        if key in bounds:
            raise SLOError(f"SLO part {part!r}: {key} given twice")
        try:
            bounds[key] = float(value)
        except ValueError:
            raise SLOError(f"SLO part {part!r}: {value!r} is not a number of milliseconds") from None
    if not bounds:
        raise SLOError(f"SLO string {text!r} has no bounds; example: ttft:2000,tpot:100")
    try:
        return SLOSet((SLOClass(name, *(bounds.get(k) for k in SLO_KEYS), weight=weight),))
    except SLOError as exc:
        raise SLOError(f"SLO string {text!r}: {exc}") from None


def slo_from_mapping(data: dict) -> SLOSet:
    """Build from ``{name: {ttft = ms, tpot = ms, e2el = ms, weight = w}}`` (TOML tables)."""
    if not isinstance(data, dict):
        raise SLOError(f"SLO classes must be tables such as [slo.default] with ttft = 2000, got {data!r}")
    classes = []
    for cname, body in data.items():
        if not isinstance(body, dict):
            raise SLOError(f"SLO class {cname!r} must be a table of bounds, got {body!r}")
        unknown = set(body) - {*SLO_KEYS, "weight"}
        if unknown:
            raise SLOError(f"SLO class {cname!r}: {unknown_names('key', unknown, [*SLO_KEYS, 'weight'])}")
        classes.append(SLOClass(cname, *(body.get(k) for k in SLO_KEYS), weight=body.get("weight", 1.0)))
    return SLOSet(tuple(classes))


def load_slo_toml(path: str | Path) -> SLOSet:
    """Read ``[slo.NAME]`` tables (or top-level NAME tables) from a TOML file."""
    data = read_toml(path, SLOError)
    try:
        return slo_from_mapping(data.get("slo", data))
    except SLOError as exc:
        raise SLOError(f"{path}: {exc}") from None
