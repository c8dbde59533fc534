"""The worst-case reservation rule, in plain Python: the statement the kernel must agree with.

Orca-style admission: a request may start only if the KV memory for its whole remaining
prompt plus its full output cap is still unreserved, so admitted work can never run out
of memory and never needs preemption. The engine's ``reservation`` admission mode applies
this rule in KV blocks at every step (with block_size 1 and the same byte scale it admits
exactly what ``admit_by_reservation`` admits).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A request asking for admission."""

    name: str
    priority: int  # larger = more urgent
    deadline: float  # absolute; NaN = none (sorts last)
    prompt_remaining: int  # prompt tokens whose KV is not yet held
    max_output: int  # output cap, tokens
    kv_bytes_per_token: int

    @property
    def required_bytes(self) -> int:
        return (self.prompt_remaining + self.max_output) * self.kv_bytes_per_token


def admit_by_reservation(
    candidates: Sequence[Candidate], active_bytes: int, capacity_bytes: int, headroom_bytes: int
) -> tuple[list[str], int]:
    """Names admitted, in order, and the bytes reserved afterwards (active included).

    Candidates are taken by (-priority, deadline); each is admitted while
    ``reserved + required <= capacity - headroom`` and the first that does not fit stops
    admission (no overtaking, so a large request cannot starve). Raises ValueError if any
    value is negative or the active usage plus headroom already exceeds the capacity.
    """
    for label, value in (("active_bytes", active_bytes), ("capacity_bytes", capacity_bytes),
                         ("headroom_bytes", headroom_bytes)):
        if value < 0:
            raise ValueError(f"{label} must be >= 0, got {value}")
    for c in candidates:
        for label in ("prompt_remaining", "max_output", "kv_bytes_per_token"):
            if getattr(c, label) < 0:
                raise ValueError(f"candidate {c.name!r}: {label} must be >= 0, got {getattr(c, label)}")
    if active_bytes + headroom_bytes > capacity_bytes:
        raise ValueError(
            f"active usage {active_bytes} B + headroom {headroom_bytes} B exceeds capacity {capacity_bytes} B"
        )
    limit = capacity_bytes - headroom_bytes
    reserved = active_bytes
    admitted: list[str] = []
    for c in sorted(candidates, key=lambda c: (-c.priority, math.inf if math.isnan(c.deadline) else c.deadline)):
        if reserved + c.required_bytes > limit:
            break
        reserved += c.required_bytes
        admitted.append(c.name)
    return admitted, reserved
