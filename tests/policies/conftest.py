"""Shared builders for the engine tests: small traces and cost models made in code."""

from __future__ import annotations

import numpy as np
import pytest

from costmodels.costmodel import CostModel
from costmodels.steptable import linear_tables
from studies.traces import Trace


def make_trace(arrival, prompt, output, max_tokens=None, priority=None, deadline=None, *, tenant=None,
               slo_class=None, hashes=None, block_tokens=512, n_tenants=1, n_classes=1) -> Trace:
    """A trace from columns; ``hashes`` is one list of prefix-block hashes per request."""
    n = len(arrival)
    output = np.asarray(output)
    hashes = hashes if hashes is not None else [[] for _ in range(n)]
    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(h) for h in hashes])
    return Trace(
        arrival_s=np.asarray(arrival, dtype=float),
        prompt_tokens=np.asarray(prompt),
        output_tokens=output,
        max_tokens=np.maximum(output, 1) if max_tokens is None else np.asarray(max_tokens),
        tenant=np.zeros(n) if tenant is None else np.asarray(tenant),
        priority=np.zeros(n) if priority is None else np.asarray(priority),
        slo_class=np.zeros(n) if slo_class is None else np.asarray(slo_class),
        deadline_s=np.full(n, np.nan) if deadline is None else np.asarray(deadline, dtype=float),
        block_offsets=offsets,
        block_hashes=np.array([x for h in hashes for x in h], dtype=np.int64),
        block_tokens=block_tokens,
        tenant_names=tuple(f"t{i}" for i in range(n_tenants)) if n_tenants > 1 else ("default",),
        slo_class_names=tuple(f"c{i}" for i in range(n_classes)) if n_classes > 1 else ("default",),
    )


def poisson_trace(n: int, rate: float, seed: int, prompt=(1, 400), output=(1, 200)) -> Trace:
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1.0 / rate, n))
    return make_trace(arrival, rng.integers(*prompt, n), rng.integers(*output, n))


def cost_model(kv_tokens: int = 4096, host_tokens: int = 0, **table_kw) -> CostModel:
    return CostModel.synthetic(kv_capacity_tokens=kv_tokens, tables=linear_tables(**table_kw),
                               swap_capacity_tokens=host_tokens)


@pytest.fixture
def small_trace() -> Trace:
    return poisson_trace(300, rate=40.0, seed=1)


def new_replica(trace, cost, config, seed=0, acceptance=None):
    """One engine replica for ``trace`` (``policies.engine.new_replica``), its statics and the
    tenants' weights, as the fleet builds it (``acceptance``: the speculative model)."""
    from policies import engine
    from policies.fairness import T_WEIGHT

    cap, host = engine.validate(trace, cost, config)
    st = engine.statics(trace, cost, [config], acceptance)
    tenant_params, class_params = engine.fairness_params(trace, config, None)
    rep = engine.new_replica(st, config.to_vector(), cap, host, cost.kv_bytes_per_token, cost.swap_bytes_per_s, seed,
                             engine.default_series_every(trace), True, tenant_params, class_params,
                             float(trace.arrival_s[0]))
    return rep, st, tenant_params[:, T_WEIGHT]
