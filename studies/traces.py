"""The request trace: one row per request, as a frozen structure of NumPy arrays.

The engine takes these arrays as they are, so every field has a fixed dtype and the rows
are sorted by arrival. Prefix blocks are stored as CSR: request ``i`` owns
``block_hashes[block_offsets[i]:block_offsets[i + 1]]``, each block covering
``block_tokens`` prompt tokens (the last one may be partial).

What the scheduler may know about output lengths is kept apart from the truth:
``output_tokens`` is the true length (revealed only as tokens are generated),
``max_tokens`` the client's cap, ``max_tokens_source`` where each cap came from (the
file or caller, a study-level default, or nothing yet: see ``studies.lengths``), and
``output_estimate`` the length the scheduler predicts (SJF's job size), named by
``output_estimator`` (``"cap"``, the default, means the estimate is the cap itself).

Each request also names what it runs on (the workload's version ``v_i``): ``adapter``,
the LoRA adapter it asks for (code into ``adapter_names``; the name ``""`` is the base
model), ``model_version`` (code into ``model_version_names``; ``""`` = the one model
served) and ``cache_salt``, its security domain (code into ``cache_salt_names``; ``""`` =
none), the per-request ``cache_salt`` both engines take: vLLM puts it in the first
block's hash, which chains into every later one (vllm/v1/core/kv_cache_utils.py:659-669),
SGLang's ``RadixKey`` namespaces its tree by it (sglang/srt/mem_cache/radix_cache.py:72-77,
245-247), so two domains never share cached KV. A cached prefix block is only reusable by
a request of the same identity, so the prefix cache and the routers read
``Trace.cache_block_hashes``, the block hashes salted by that identity
(``identity_salted_hashes``), never the raw ``block_hashes``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: Priority convention: a larger value is more urgent and is served first.
DEFAULT_PRIORITY = 0


class TraceError(ValueError):
    """A trace file or array that cannot be used, with where and why."""


class TraceWarning(UserWarning):
    """A trace file was usable only after a fix-up (rows sorted by time, blank rows skipped,
    columns ignored, outputs cut at the context): the message says what, how many and where."""


#: ``max_tokens_source`` codes. ``CAP_NONE``: the source gave no cap, and ``max_tokens``
#: holds ``NO_CAP``, so the engine caps the output where it would for a client that sends
#: none: at the longest sequence less the prompt (``studies.lengths.with_client_caps``
#: sets that cap explicitly for a study). Never the true length.
#: ``CAP_GIVEN``: the file or caller gave the cap. ``CAP_DEFAULT``: a study-level default
#: (a constant, or the model's context less the prompt) replaced the placeholder.
CAP_NONE, CAP_GIVEN, CAP_DEFAULT = 0, 1, 2
#: ``max_tokens`` of a request that sent no cap: larger than any sequence an engine holds.
NO_CAP = 1 << 40
CAP_SOURCES = {CAP_NONE: "none", CAP_GIVEN: "given", CAP_DEFAULT: "default"}
#: Most tokens a prompt, an output or a cap may hold: the longest ``max_model_len`` an engine
#: config takes (``policies.config`` bounds that knob at 2**24). A larger count in a file is a
#: data error (no model holds such a sequence), never a request to replay.
MAX_TOKENS = 1 << 24

#: ``output_estimator`` of a trace whose estimate is its cap (it follows ``max_tokens``).
ESTIMATE_IS_CAP = "cap"

#: The name of "no adapter" (the base model) and of the only model version of a trace
#: that names none: identity columns whose every name is this salt nothing.
BASE = ""
#: The columns that make a request's cache identity, in the order they are salted in.
IDENTITY_KEYS = ("model_version", "adapter", "cache_salt")


@dataclass(frozen=True, eq=False)
class Trace:
    """Requests to replay, sorted by arrival.

    ``deadline_s`` is absolute, on the same clock as ``arrival_s`` (NaN = no deadline):
    the client gives up if the request has not finished by then.

    ``max_tokens_source`` (i1, ``CAP_*``; default all ``CAP_GIVEN``, since the caller
    gave ``max_tokens``) says where each cap came from. ``output_estimate`` (i8) is the
    output length the scheduler predicts; with ``output_estimator == "cap"`` (the
    default) it is ``max_tokens`` and follows it through ``replace``; any other estimator
    (a ``studies.lengths.Predictor`` spec, ``"file"``, ...) names an explicit estimate.
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
    output_estimate: np.ndarray | None = None  # i8, the scheduler's output-length estimate
    max_tokens_source: np.ndarray | None = None  # i1, CAP_* per request
    output_estimator: str = ESTIMATE_IS_CAP
    adapter: np.ndarray | None = None  # i4, index into adapter_names ("" = the base model)
    adapter_names: tuple[str, ...] = (BASE,)
    model_version: np.ndarray | None = None  # i4, index into model_version_names
    model_version_names: tuple[str, ...] = (BASE,)
    cache_salt: np.ndarray | None = None  # i4, index into cache_salt_names ("" = none)
    cache_salt_names: tuple[str, ...] = (BASE,)

    _DTYPES = {
        "arrival_s": np.float64,
        "prompt_tokens": np.int64,
        "output_tokens": np.int64,
        "max_tokens": np.int64,
        "tenant": np.int32,
        "priority": np.int32,
        "slo_class": np.int32,
        "deadline_s": np.float64,
        "output_estimate": np.int64,
        "max_tokens_source": np.int8,
        "adapter": np.int32,
        "model_version": np.int32,
        "cache_salt": np.int32,
    }

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if not isinstance(self.output_estimator, str) or not self.output_estimator:
            raise TraceError(f"output_estimator {self.output_estimator!r}; expected a non-empty name")
        if self.output_estimate is None:
            if self.output_estimator != ESTIMATE_IS_CAP:
                raise TraceError(f"output_estimator {self.output_estimator!r} needs an output_estimate column")
            object.__setattr__(self, "output_estimate", self.max_tokens)
        if self.max_tokens_source is None:
            object.__setattr__(self, "max_tokens_source", np.full(n, CAP_GIVEN, dtype=np.int8))
        for name in IDENTITY_KEYS:
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros(n, dtype=np.int32))
            names = getattr(self, f"{name}_names")
            if (not isinstance(names, tuple) or not names or not all(isinstance(v, str) for v in names)
                    or len(set(names)) != len(names)):
                raise TraceError(f"{name}_names {names!r}; expected a non-empty tuple of distinct strings")
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
        uncapped = self.max_tokens_source == CAP_NONE  # max_tokens is the NO_CAP placeholder
        checks = (
            ("arrival_s", ~np.isfinite(self.arrival_s) | (self.arrival_s < 0), "a finite time >= 0"),
            ("prompt_tokens", _outside(self.prompt_tokens, 1), f"an integer in [1, {MAX_TOKENS}]"),
            ("output_tokens", _outside(self.output_tokens, 0), f"an integer in [0, {MAX_TOKENS}]"),
            ("max_tokens", _outside(self.max_tokens, 1) & ~(uncapped & (self.max_tokens == NO_CAP)),
             f"an integer in [1, {MAX_TOKENS}] (or NO_CAP with source 'none')"),
            ("max_tokens_source", ~np.isin(self.max_tokens_source, list(CAP_SOURCES)),
             f"one of {sorted(CAP_SOURCES)} ({', '.join(CAP_SOURCES.values())})"),
            ("output_estimate", _outside(self.output_estimate, 1) & (self.output_estimate != NO_CAP),
             f"an integer in [1, {MAX_TOKENS}] (or NO_CAP)"),
            ("tenant", (self.tenant < 0) | (self.tenant >= len(self.tenant_names)), "a known tenant"),
            ("slo_class", (self.slo_class < 0) | (self.slo_class >= len(self.slo_class_names)), "a known SLO class"),
            ("adapter", (self.adapter < 0) | (self.adapter >= len(self.adapter_names)), "a known adapter"),
            ("model_version", (self.model_version < 0) | (self.model_version >= len(self.model_version_names)),
             "a known model version"),
            ("cache_salt", (self.cache_salt < 0) | (self.cache_salt >= len(self.cache_salt_names)), "a known salt"),
            ("deadline_s", self.deadline_s < self.arrival_s, "NaN or a time >= arrival_s"),
        )
        for name, bad, expected in checks:
            rows = np.flatnonzero(bad)
            if len(rows):
                value = getattr(self, name)[rows[0]].item()
                raise TraceError(f"row {rows[0]}: column {name!r} is {value!r}; expected {expected}")
        if self.output_estimator == ESTIMATE_IS_CAP and not np.array_equal(self.output_estimate, self.max_tokens):
            row = int(np.flatnonzero(self.output_estimate != self.max_tokens)[0])
            raise TraceError(f"row {row}: output_estimate {self.output_estimate[row]} differs from max_tokens "
                             f"{self.max_tokens[row]} while output_estimator is 'cap'; name the estimator")
        unsorted = np.flatnonzero(np.diff(self.arrival_s) < 0)
        if len(unsorted):
            raise TraceError(f"row {unsorted[0] + 1}: arrival_s goes backwards; a Trace must be sorted")

    @property
    def n(self) -> int:
        return len(self.arrival_s)

    def __len__(self) -> int:
        return self.n

    @property
    def max_tokens_given(self) -> np.ndarray:
        """Per request (bool): the file or caller gave its cap."""
        return self.max_tokens_source == CAP_GIVEN

    @property
    def caps_known(self) -> bool:
        """Every request has a real cap (given or a study default), none ``NO_CAP``."""
        return not np.any(self.max_tokens_source == CAP_NONE)

    @property
    def has_adapters(self) -> bool:
        """Some request asks for a LoRA adapter (the engine then runs its adapter pool)."""
        base = [code for code, name in enumerate(self.adapter_names) if name == BASE]
        return len(base) < len(self.adapter_names) and bool(np.any(~np.isin(self.adapter, base)))

    @property
    def adapter_labels(self) -> np.ndarray:
        """Adapter name of every request (``""``: the base model)."""
        return self.labels("adapter")

    @property
    def cache_salt_labels(self) -> np.ndarray:
        """Cache salt of every request (``""``: none)."""
        return self.labels("cache_salt")

    @property
    def cache_block_hashes(self) -> np.ndarray:
        """The prefix-block hashes the caches and routers key on: salted by each request's
        (model_version, adapter, cache_salt), so a block only matches under the same weights
        and security domain (a fresh array)."""
        if all(getattr(self, f"{key}_names") == (BASE,) for key in IDENTITY_KEYS):
            return np.array(self.block_hashes, dtype=np.int64)  # nothing to salt
        return identity_salted_hashes(self.block_offsets, self.block_hashes,
                                      [self.labels(key) for key in IDENTITY_KEYS])

    @property
    def block_counts(self) -> np.ndarray:
        """Prefix blocks per request (i8)."""
        return np.diff(self.block_offsets)

    @classmethod
    def from_columns(
        cls,
        arrival_s,
        prompt_tokens,
        output_tokens,
        *,
        max_tokens=None,
        max_tokens_source=None,
        output_estimate=None,
        tenant=None,
        priority=None,
        slo_class=None,
        deadline_s=None,
        block_offsets=None,
        block_hashes=None,
        adapter=None,
        model_version=None,
        **fields,
    ) -> Trace:
        """Build a trace from the columns a source has, filling the rest with defaults.

        Without ``max_tokens`` the trace has no caps: ``max_tokens_source`` is ``CAP_NONE``
        and ``max_tokens`` is ``NO_CAP`` (``studies.lengths.with_client_caps`` gives the
        study's default caps); with it, ``CAP_GIVEN`` unless ``max_tokens_source`` says
        otherwise. ``output_estimate`` given means ``output_estimator="given"`` unless named
        in ``fields``. Other defaults: tenant, priority and SLO class 0, no deadline, no
        prefix blocks. ``fields`` are the scalar fields (``block_tokens``, ``tenant_names``,
        ``slo_class_names``, ``source``, ``meta``, ``output_estimator``, ``adapter_names``,
        ``model_version_names``, ``cache_salt_names``); ``adapter`` / ``model_version`` /
        ``cache_salt`` default to code 0 (the base model, the one version, no salt).
        """
        output_tokens = np.asarray(output_tokens, dtype=np.int64)
        n = len(output_tokens)
        zeros = np.zeros(n, dtype=np.int32)
        if max_tokens_source is None:
            max_tokens_source = np.full(n, CAP_NONE if max_tokens is None else CAP_GIVEN, dtype=np.int8)
        if output_estimate is not None:
            fields.setdefault("output_estimator", "given")
        return cls(
            arrival_s=arrival_s,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            max_tokens=np.full(n, NO_CAP, dtype=np.int64) if max_tokens is None else max_tokens,
            max_tokens_source=max_tokens_source,
            output_estimate=output_estimate,
            tenant=zeros if tenant is None else tenant,
            priority=zeros if priority is None else priority,
            slo_class=zeros if slo_class is None else slo_class,
            deadline_s=np.full(n, np.nan) if deadline_s is None else deadline_s,
            block_offsets=np.zeros(n + 1, dtype=np.int64) if block_offsets is None else block_offsets,
            block_hashes=np.zeros(0, dtype=np.int64) if block_hashes is None else block_hashes,
            adapter=adapter,
            model_version=model_version,
            **fields,
        )

    def replace(self, **changes) -> Trace:
        """A copy with some fields changed, validated like a new trace.

        New ``max_tokens`` count as given by the caller (``CAP_GIVEN``) unless
        ``max_tokens_source`` is changed too; while the estimator is ``"cap"`` the
        estimate follows the new caps. A new ``output_estimate`` needs its estimator
        named (``output_estimator=``) unless the trace already has one that is not the cap.
        """
        if "max_tokens" in changes and "max_tokens_source" not in changes:
            changes["max_tokens_source"] = np.full(len(changes["max_tokens"]), CAP_GIVEN, dtype=np.int8)
        if changes.get("output_estimator", self.output_estimator) == ESTIMATE_IS_CAP:
            changes.setdefault("output_estimate", None)
        return dataclasses.replace(self, **changes)

    def take(self, rows) -> Trace:
        """The requests at ``rows`` (in that order, which must keep arrivals sorted)."""
        rows = np.asarray(rows, dtype=np.int64)
        offsets, hashes = csr_take(self.block_offsets, self.block_hashes, rows)
        columns = {name: getattr(self, name)[rows] for name in self._DTYPES}
        return self.replace(**columns, block_offsets=offsets, block_hashes=hashes, meta=dict(self.meta))

    def labels(self, column: str) -> np.ndarray:
        """The names of a coded column (``tenant``, ``slo_class`` or an ``IDENTITY_KEYS`` one)
        per request, for comparisons and files that must not depend on codes."""
        return np.asarray(getattr(self, f"{column}_names"), dtype=object)[getattr(self, column)]

    @property
    def tenant_labels(self) -> np.ndarray:
        """Tenant name of every request, for comparisons that must not depend on codes."""
        return self.labels("tenant")

    @property
    def slo_class_labels(self) -> np.ndarray:
        """SLO class name of every request."""
        return self.labels("slo_class")


def _outside(values: np.ndarray, low: int) -> np.ndarray:
    """Per row (bool): a token count below ``low`` or above ``MAX_TOKENS``."""
    return (values < low) | (values > MAX_TOKENS)


def identity_salted_hashes(block_offsets: np.ndarray, block_hashes: np.ndarray,
                           identity: Sequence[np.ndarray]) -> np.ndarray:
    """Block hashes salted by each request's identity, so that two requests share a block
    only if they share the block *and* every identity key (e.g. model version, adapter:
    KV computed under other weights is other KV).

    ``identity``: one array of names per key, a row per request. A request whose keys are
    all ``BASE`` keeps its hashes as they are (a trace without identities is unchanged);
    any other gets ``hash XOR h(keys)``, with ``h`` a 62-bit BLAKE2 digest of the keys,
    fixed across runs and machines (Python's ``hash`` of a string is not).
    """
    hashes = np.array(block_hashes, dtype=np.int64)
    if not len(hashes):
        return hashes
    n = len(block_offsets) - 1
    columns = [np.asarray(column, dtype=object) for column in identity]
    combo = np.zeros(n, dtype=np.int64)  # each distinct tuple of keys, as one mixed-radix code
    names: list[tuple[str, ...]] = []
    for column in columns:
        codes, seen = encode_names(column.astype(str))
        combo = combo * len(seen) + codes
        names.append(seen)
    unique, inverse = np.unique(combo, return_inverse=True)
    salt = np.zeros(len(unique), dtype=np.int64)
    for k, code in enumerate(unique):
        row = []
        for seen in reversed(names):
            row.append(seen[code % len(seen)])
            code //= len(seen)
        row.reverse()
        if any(key != BASE for key in row):
            digest = hashlib.blake2b("\x1f".join(row).encode(), digest_size=8).digest()
            salt[k] = int.from_bytes(digest, "little") >> 2  # non-negative, fits i8
    per_request = salt[inverse]
    return hashes ^ np.repeat(per_request, np.diff(block_offsets))


def csr_take(offsets: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Select (and reorder) CSR rows without a Python loop: returns (offsets, values)."""
    counts = (offsets[1:] - offsets[:-1])[rows]
    new_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=new_offsets[1:])
    # value j of new row i sits at old_start[i] + (j - new_start[i])
    shift = np.repeat(offsets[:-1][rows] - new_offsets[:-1], counts)
    return new_offsets, values[shift + np.arange(new_offsets[-1], dtype=np.int64)]


def encode_names(values: Sequence[str] | np.ndarray) -> tuple[np.ndarray, tuple[str, ...]]:
    """Codes (i4) and names for a column of strings, names in order of first appearance."""
    values = np.asarray(values, dtype=str)
    if len(values) == 0:
        return np.zeros(0, dtype=np.int32), ("default",)
    names, first, inverse = np.unique(values, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(order), dtype=np.int32)
    rank[order] = np.arange(len(order), dtype=np.int32)
    return rank[inverse], tuple(str(name) for name in names[order])


def _summary(values: np.ndarray) -> dict:
    if len(values) == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan"), "min": 0, "max": 0}
    p50, p99 = np.percentile(values, [50, 99])  # numpy's default linear interpolation
    return {"mean": float(values.mean()), "p50": float(p50), "p99": float(p99),
            "min": int(values.min()), "max": int(values.max())}


def trace_stats(trace: Trace) -> dict:
    """Summary of a trace: size, rates, token percentiles and prefix-block reuse.

    ``mean_rate`` is (rows - 1) / span (gaps per second); ``peak_minute_rate`` is the
    largest count of arrivals in any 60 s bin counted from the first arrival, / 60.
    ``repeat_fraction`` is the share of prefix blocks already seen earlier in the trace.
    """
    n = trace.n
    span = float(trace.arrival_s[-1] - trace.arrival_s[0]) if n else 0.0
    if n:
        bins = ((trace.arrival_s - trace.arrival_s[0]) // 60.0).astype(np.int64)
        peak = float(np.bincount(bins).max() / 60.0)
    else:
        peak = 0.0
    total_blocks = len(trace.block_hashes)
    distinct = len(np.unique(trace.block_hashes))
    return {
        "rows": n,
        "span_s": span,
        "mean_rate": (n - 1) / span if span > 0 else float("nan"),
        "peak_minute_rate": peak,
        "prompt_tokens": _summary(trace.prompt_tokens),
        "output_tokens": _summary(trace.output_tokens),
        # caps the trace gives (requests without one: no_cap_requests)
        "max_tokens": _summary(trace.max_tokens[trace.max_tokens_source != CAP_NONE]),
        "no_cap_requests": int(np.sum(trace.max_tokens_source == CAP_NONE)),
        "blocks": {
            "block_tokens": trace.block_tokens,
            "total": total_blocks,
            "distinct": distinct,
            "repeat_fraction": (total_blocks - distinct) / total_blocks if total_blocks else 0.0,
        },
        "tenants": _counts(trace.tenant, trace.tenant_names),
        "adapters": _counts(trace.adapter, trace.adapter_names),
        "model_versions": _counts(trace.model_version, trace.model_version_names),
        "cache_salts": _counts(trace.cache_salt, trace.cache_salt_names),
        "slo_classes": _counts(trace.slo_class, trace.slo_class_names),
        "with_deadline": int(np.count_nonzero(~np.isnan(trace.deadline_s))),
        "source": trace.source,
    }


def _counts(codes: np.ndarray, names: tuple[str, ...]) -> dict[str, int]:
    counts = np.bincount(codes, minlength=len(names))
    return {name: int(count) for name, count in zip(names, counts, strict=True)}


def load_trace(path: str | Path, format: str | None = None, *, strict: bool = False, **options) -> Trace:
    """Read a trace file into a sorted ``Trace``.

    ``format`` is one of ``mooncake``, ``azure``, ``burstgpt``, ``native``; by default it
    is detected from the file's content. Unsorted rows are sorted with a warning, or raise
    under ``strict=True``. ``options`` go to the format's reader (see ``docs/traces.md``):
    e.g. Mooncake ``spread="uniform"|"poisson"|"raw"`` and ``seed``, BurstGPT ``model=``.
    Bad input raises ``TraceError`` naming the file, row and column.
    """
    from studies import formats  # the readers build Traces, so they import this module

    return formats.read(Path(path), format, strict=strict, options=options)


def write_trace(trace: Trace, path: str | Path, format: str = "native") -> Path:
    """Write a trace; native by suffix (.parquet, .csv, .jsonl), or ``mooncake``/``azure``.

    Native files keep every field, so any trace round-trips through them.
    """
    from studies import formats

    return formats.write(trace, Path(path), format)
