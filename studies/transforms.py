"""Transformations of a trace: each takes a Trace and returns a new, validated one.

Token lengths are never changed here; only which requests there are, when they arrive
and how they are labelled. Each transform records itself in ``meta`` so a result says
how its trace was made (e.g. ``meta["rate_scale"]``, which results should quote).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from studies.traces import IDENTITY_KEYS, Trace, TraceError, csr_take, encode_names


def window(trace: Trace, start_s: float, end_s: float | None = None, *, rebase: bool = True) -> Trace:
    """Requests arriving in ``[start_s, end_s)``; with ``rebase``, times shift so the
    window starts at 0 (deadlines move with their requests)."""
    end = np.inf if end_s is None else end_s
    if not end > start_s:
        raise TraceError(f"window [{start_s}, {end_s}) is empty; expected end_s > start_s")
    rows = np.flatnonzero((trace.arrival_s >= start_s) & (trace.arrival_s < end))
    if len(rows) == 0:
        first, last = (trace.arrival_s[[0, -1]] if trace.n else (np.nan, np.nan))
        raise TraceError(f"window [{start_s}, {end_s}) holds no requests; the trace spans [{first:.3f}, {last:.3f}] s")
    picked = trace.take(rows)
    meta = {**picked.meta, "window_s": [float(start_s), None if end_s is None else float(end_s)]}
    if not rebase:
        return picked.replace(meta=meta)
    return picked.replace(arrival_s=picked.arrival_s - start_s, deadline_s=picked.deadline_s - start_s,
                          meta=meta)


def check_rate_factor(factor: float) -> None:
    """A rate factor must be a finite number > 0: 0 stops time, a negative one reverses it."""
    if isinstance(factor, bool) or not (isinstance(factor, int | float | np.number) and np.isfinite(factor)
                                        and factor > 0):
        raise TraceError(f"rate factor {factor!r}; expected a finite number > 0")


def scale_rate(trace: Trace, factor: float | None = None, *, target_rps: float | None = None) -> Trace:
    """Compress (factor > 1) or stretch (factor < 1) time around the first arrival, so the
    mean rate is multiplied by ``factor``, or becomes ``target_rps``.

    Deadlines keep their budget (deadline - arrival), since a client's patience does not
    scale with the load.
    """
    if (factor is None) == (target_rps is None):
        raise TraceError("scale_rate needs exactly one of factor or target_rps")
    if target_rps is not None:
        span = trace.arrival_s[-1] - trace.arrival_s[0] if trace.n else 0.0
        if not span > 0:
            raise TraceError(f"cannot scale a trace with a zero-length span ({trace.n} request(s) at one "
                             f"instant) to {target_rps} req/s; expected requests spread over time")
        factor = target_rps / ((trace.n - 1) / span)
    check_rate_factor(factor)
    t0 = trace.arrival_s[0] if trace.n else 0.0
    arrival = t0 + (trace.arrival_s - t0) / factor
    meta = {**trace.meta, "rate_scale": float(factor) * trace.meta.get("rate_scale", 1.0)}
    return trace.replace(arrival_s=arrival, deadline_s=arrival + (trace.deadline_s - trace.arrival_s), meta=meta)


def sample(trace: Trace, fraction: float | None = None, *, n: int | None = None, seed: int = 0) -> Trace:
    """A random subset of requests (without replacement, order kept): a ``fraction`` of
    them or exactly ``n``. Thinning lowers the rate by the same fraction."""
    if (fraction is None) == (n is None):
        raise TraceError("sample needs exactly one of fraction or n")
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise TraceError(f"sample fraction {fraction!r}; expected 0 < fraction <= 1")
        n = int(round(fraction * trace.n))
    if not 1 <= n <= trace.n:
        raise TraceError(f"sample of {n} request(s) from {trace.n}; expected between 1 and {trace.n}")
    rows = np.sort(np.random.default_rng(seed).choice(trace.n, size=n, replace=False))
    picked = trace.take(rows)
    return picked.replace(meta={**picked.meta, "sampled": {"n": n, "of": trace.n, "seed": seed}})


def relabel(trace: Trace, *, tenant: str | None = None, slo_class: str | None = None,
            priority: int | None = None, deadline_after_s: float | None = None) -> Trace:
    """Give every request the same tenant, SLO class, priority, or a deadline this many
    seconds after its arrival: the way to turn a real trace into one class of a mix."""
    changes: dict = {}
    if tenant is not None:
        changes.update(tenant=np.zeros(trace.n, np.int32), tenant_names=(tenant,))
    if slo_class is not None:
        changes.update(slo_class=np.zeros(trace.n, np.int32), slo_class_names=(slo_class,))
    if priority is not None:
        changes["priority"] = np.full(trace.n, priority, np.int32)
    if deadline_after_s is not None:
        if not deadline_after_s >= 0:
            raise TraceError(f"deadline_after_s {deadline_after_s!r}; expected seconds >= 0")
        changes["deadline_s"] = trace.arrival_s + deadline_after_s
    return trace.replace(**changes)


def concat_as_tenants(parts: Sequence[tuple[str, Trace]], *, share_prefixes: bool = False) -> Trace:
    """Merge traces into one, each becoming a tenant named by its label (``label/tenant``
    when a part already has several tenants). Times are kept as they are.

    Block ids of different parts are made disjoint unless ``share_prefixes`` says that
    equal ids in different parts really are the same prefix. Caps keep their per-request
    ``max_tokens_source``; the output estimates keep their values, under the parts' common
    ``output_estimator`` (``"mixed"`` when the parts' estimators differ).
    """
    if not parts:
        raise TraceError("concat_as_tenants needs at least one (name, trace) pair")
    labels = [name for name, _ in parts]
    if len(set(labels)) != len(labels):
        raise TraceError(f"tenant names must be distinct, got {labels}")
    with_blocks = {t.block_tokens for _, t in parts if len(t.block_hashes)}
    if len(with_blocks) > 1:
        raise TraceError(f"parts use different block sizes {sorted(with_blocks)}; expected one")
    tenants, classes, hashes, counts = [], [], [], []
    identities = {key: [] for key in IDENTITY_KEYS}
    next_id = 0
    for name, part in parts:
        own = part.tenant_labels
        tenants.append(np.full(part.n, name, dtype=object) if len(part.tenant_names) == 1
                       else np.array([f"{name}/{t}" for t in own], dtype=object))
        classes.append(part.slo_class_labels)
        for key in IDENTITY_KEYS:
            identities[key].append(part.labels(key))
        ids = part.block_hashes
        if not share_prefixes and len(ids):
            _, dense = np.unique(ids, return_inverse=True)
            ids = dense.astype(np.int64) + next_id
            next_id = int(ids.max()) + 1
        hashes.append(ids)
        counts.append(part.block_counts)
    tenant, tenant_names = encode_names(np.concatenate(tenants))
    slo_class, slo_names = encode_names(np.concatenate(classes))
    identity = {key: encode_names(np.concatenate(labels)) for key, labels in identities.items()}
    offsets = np.zeros(sum(p.n for _, p in parts) + 1, dtype=np.int64)
    np.cumsum(np.concatenate(counts), out=offsets[1:])
    columns = {column: np.concatenate([getattr(p, column) for _, p in parts]) for column in Trace._DTYPES}
    columns.update(tenant=tenant, slo_class=slo_class, **{key: codes for key, (codes, _) in identity.items()})
    order = np.argsort(columns["arrival_s"], kind="stable")
    estimators = {part.output_estimator for _, part in parts}
    block_offsets, block_hashes = csr_take(offsets, np.concatenate(hashes), order)
    return Trace(
        **{column: values[order] for column, values in columns.items()},
        block_offsets=block_offsets, block_hashes=block_hashes,
        block_tokens=with_blocks.pop() if with_blocks else parts[0][1].block_tokens,
        tenant_names=tenant_names, slo_class_names=slo_names, source="+".join(labels),
        **{f"{key}_names": names for key, (_, names) in identity.items()},
        meta={"concat": {name: part.source for name, part in parts}},
        output_estimator=estimators.pop() if len(estimators) == 1 else "mixed",
    )
