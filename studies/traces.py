"""The request trace: one row per request, as a frozen structure of NumPy arrays.

The engine takes these arrays as they are, so every field has a fixed dtype and the rows
are sorted by arrival. Prefix blocks are stored as CSR: request ``i`` owns
``block_hashes[block_offsets[i]:block_offsets[i + 1]]``, each block covering
``block_tokens`` prompt tokens (the last one may be partial).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: Priority convention: a larger value is more urgent and is served first.
DEFAULT_PRIORITY = 0


class TraceError(ValueError):
    """A trace file or array that cannot be used, with where and why."""


@dataclass(frozen=True, eq=False)
class Trace:
    """Requests to replay, sorted by arrival.

    ``deadline_s`` is absolute, on the same clock as ``arrival_s`` (NaN = no deadline):
    the client gives up if the request has not finished by then.
    """

    arrival_s: np.ndarray  # f8
    prompt_tokens: np.ndarray  # i8
    output_tokens: np.ndarray  # i8, true length, revealed only as tokens are generated
    max_tokens: np.ndarray  # i8, the request's output cap
    tenant: np.ndarray  # i4, index into tenant_names
    priority: np.ndarray  # i4, larger = more urgent
    slo_class: np.ndarray  # i4, index into slo_class_names
    deadline_s: np.ndarray  # f8, absolute, NaN = none
    block_offsets: np.ndarray  # i8[n + 1]
    block_hashes: np.ndarray  # i8
    block_tokens: int = 512
    tenant_names: tuple[str, ...] = ("default",)
    slo_class_names: tuple[str, ...] = ("default",)
    source: str = ""
    meta: dict = field(default_factory=dict)

    _DTYPES = {
        "arrival_s": np.float64,
        "prompt_tokens": np.int64,
        "output_tokens": np.int64,
        "max_tokens": np.int64,
        "tenant": np.int32,
        "priority": np.int32,
        "slo_class": np.int32,
        "deadline_s": np.float64,
    }

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        for name, dtype in self._DTYPES.items():
            arr = np.ascontiguousarray(getattr(self, name), dtype=dtype)
            if arr.ndim != 1 or len(arr) != n:
                raise TraceError(f"column {name!r} has {arr.shape} values; expected {n}")
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        for name in ("block_offsets", "block_hashes"):
            arr = np.ascontiguousarray(getattr(self, name), dtype=np.int64)
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        self._validate()

    def _validate(self) -> None:
        n = self.n
        if len(self.block_offsets) != n + 1 or (n >= 0 and self.block_offsets[0] != 0):
            raise TraceError(f"block_offsets must have n + 1 = {n + 1} entries starting at 0")
        if np.any(np.diff(self.block_offsets) < 0) or self.block_offsets[-1] != len(self.block_hashes):
            raise TraceError("block_offsets must be non-decreasing and end at len(block_hashes)")
        if self.block_tokens <= 0:
            raise TraceError(f"block_tokens must be positive, got {self.block_tokens}")
        checks = (
            ("arrival_s", ~np.isfinite(self.arrival_s) | (self.arrival_s < 0), "a finite time >= 0"),
            ("prompt_tokens", self.prompt_tokens < 1, "an integer >= 1"),
            ("output_tokens", self.output_tokens < 0, "an integer >= 0"),
            ("max_tokens", self.max_tokens < 1, "an integer >= 1"),
            ("tenant", (self.tenant < 0) | (self.tenant >= len(self.tenant_names)), "a known tenant"),
            ("slo_class", (self.slo_class < 0) | (self.slo_class >= len(self.slo_class_names)), "a known SLO class"),
            ("deadline_s", self.deadline_s < self.arrival_s, "NaN or a time >= arrival_s"),
        )
        for name, bad, expected in checks:
            rows = np.flatnonzero(bad)
            if len(rows):
                value = getattr(self, name)[rows[0]]
                raise TraceError(f"row {rows[0]}: column {name!r} is {value!r}; expected {expected}")
        unsorted = np.flatnonzero(np.diff(self.arrival_s) < 0)
        if len(unsorted):
            raise TraceError(f"row {unsorted[0] + 1}: arrival_s goes backwards; a Trace must be sorted")

    @property
    def n(self) -> int:
        return len(self.arrival_s)

    def __len__(self) -> int:
        return self.n
