"""Per-tenant fair sharing (VTC), tenant quotas and per-class budgets, as jitted functions.

VTC (Sheng et al., OSDI'24): each tenant has a virtual counter of the service it got,
divided by its weight; the scheduler admits from the backlogged tenant with the smallest
counter. A tenant that becomes backlogged is lifted to ``max(own, min over the other
backlogged tenants)``, so idling never banks credit. Service is charged in a selectable
unit (``fairness_cost_unit``):

- ``tokens``: ``w_in`` per prompt token computed (cache hits are free; recompute after a
  preemption is charged again, it is real work) plus ``w_out`` per output token; VTC's
  defaults are 1 and 2. Prompt tokens are charged when their chunk is scheduled, so
  admissions within one step already see each other (as VTC charges at admission);
  output tokens when generated.
- ``gpu_time``: the step's seconds split over the requests in proportion to the tokens
  each computed in it.
- ``kv_byte_seconds``: KV bytes of the request's context (shared prefix included) times
  the step's seconds.

The ledger keeps both the weighted, lifted counter that orders the queue and the raw
charged ``service`` the operator audits (shares of service against shares of weight).

Quotas and budgets are admission rules: a request is admitted only if its tenant stays
within its KV quota (fraction of KV blocks held by its running requests) and token quota
(fraction of the step's token budget), and its SLO class within its KV share, token share
and its own KV headroom (fraction of blocks kept free after admitting it). Priority does
not bypass them; a blocked tenant or class waits while others go ahead. Running requests
keep what they hold. Per-tenant and per-class values cannot live in the flat knob vector,
so they travel beside it as ``tenant_params`` f8[n_tenants, 3] (weight, kv_quota,
token_quota) and ``class_params`` f8[n_classes, 3] (kv_headroom, kv_share, token_share),
built by ``side_params`` from a ``SharingSpec``; the flat knobs give the defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from numba import njit

TOKENS, GPU_TIME, KV_BYTE_SECONDS = 0, 1, 2
FAIRNESS_COST_UNITS = ("tokens", "gpu_time", "kv_byte_seconds")

T_WEIGHT, T_KV_QUOTA, T_TOKEN_QUOTA = 0, 1, 2
C_HEADROOM, C_KV_SHARE, C_TOKEN_SHARE = 0, 1, 2

ADMIT, OVER_TENANT_QUOTA, OVER_CLASS_BUDGET = 0, 1, 2


class Shares(NamedTuple):
    """Per-tenant ledger and usage, per-class usage, and the side parameters."""

    counter: np.ndarray  # f8[T], VTC virtual counter (weighted, lifted)
    service: np.ndarray  # f8[T], charged service (raw, for the audit)
    waiting: np.ndarray  # i8[T], queued requests (backlog)
    tenant_kv: np.ndarray  # i8[T], KV blocks held by running requests
    tenant_tokens: np.ndarray  # i8[T], tokens scheduled in the current step
    class_kv: np.ndarray  # i8[C]
    class_tokens: np.ndarray  # i8[C]
    tenant_params: np.ndarray  # f8[T, 3]
    class_params: np.ndarray  # f8[C, 3]


@njit(cache=True, nogil=True)
def new_shares(tenant_params, class_params):
    """Zeroed ledger and usage for ``side_params`` arrays (f8[T, 3], f8[C, 3])."""
    n_t = tenant_params.shape[0]
    n_c = class_params.shape[0]
    return Shares(
        np.zeros(n_t),
        np.zeros(n_t),
        np.zeros(n_t, dtype=np.int64),
        np.zeros(n_t, dtype=np.int64),
        np.zeros(n_t, dtype=np.int64),
        np.zeros(n_c, dtype=np.int64),
        np.zeros(n_c, dtype=np.int64),
        tenant_params,
        class_params,
    )


# -- VTC ledger ------------------------------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def enqueue(sh, t):
    """Tenant t queues a request; lift its counter if it was not backlogged."""
    if sh.waiting[t] == 0:
        lowest = np.inf
        for u in range(sh.waiting.shape[0]):
            if u != t and sh.waiting[u] > 0 and sh.counter[u] < lowest:
                lowest = sh.counter[u]
        if lowest < np.inf and lowest > sh.counter[t]:
            sh.counter[t] = lowest
    sh.waiting[t] += 1


@njit(cache=True, nogil=True, inline="always")
def dequeue(sh, t):
    sh.waiting[t] -= 1


@njit(cache=True, nogil=True, inline="always")
def charge(sh, t, cost):
    """Charge tenant t ``cost`` units of service."""
    sh.service[t] += cost
    sh.counter[t] += cost / sh.tenant_params[t, T_WEIGHT]


@njit(cache=True, nogil=True, inline="always")
def step_cost(unit, request_tokens, step_tokens, step_s, kv_tokens, kv_bytes_per_token):
    """A request's step-end charge under the time-based units (tokens charge as they go)."""
    if unit == GPU_TIME:
        return step_s * request_tokens / step_tokens if step_tokens > 0 else 0.0
    if unit == KV_BYTE_SECONDS:
        return float(kv_tokens) * kv_bytes_per_token * step_s
    return 0.0


@njit(cache=True, nogil=True)
def token_cost(unit, prompt_tokens, output_tokens, w_in, w_out):
    """Charge for computed prompt and generated output tokens under the ``tokens`` unit."""
    if unit == TOKENS:
        return w_in * prompt_tokens + w_out * output_tokens
    return 0.0


# -- quotas and class budgets ----------------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def new_step(sh):
    sh.tenant_tokens[:] = 0
    sh.class_tokens[:] = 0


@njit(cache=True, nogil=True, inline="always")
def hold_kv(sh, t, c, delta_blocks):
    sh.tenant_kv[t] += delta_blocks
    sh.class_kv[c] += delta_blocks


@njit(cache=True, nogil=True, inline="always")
def use_tokens(sh, t, c, n):
    sh.tenant_tokens[t] += n
    sh.class_tokens[c] += n


@njit(cache=True, nogil=True)
def admission_check(sh, t, c, need_blocks, first_tokens, free_blocks_after, kv_capacity, token_budget, n_running):
    """ADMIT, OVER_TENANT_QUOTA or OVER_CLASS_BUDGET for a new request of tenant t, class c.

    ``need_blocks``: KV blocks its first chunk allocates; ``first_tokens``: tokens of that
    chunk; ``free_blocks_after``: free (and evictable) blocks left once it is admitted.
    A limit binds only once its tenant or class holds something (KV, or tokens in this
    step), and a class headroom only while anything runs: a request larger than a quota
    still runs alone, so quotas can never stall the engine.
    """
    tp = sh.tenant_params
    kv = sh.tenant_kv[t]
    tokens = sh.tenant_tokens[t]
    if ((kv > 0 and kv + need_blocks > int(tp[t, T_KV_QUOTA] * kv_capacity))
            or (tokens > 0 and tokens + first_tokens > int(tp[t, T_TOKEN_QUOTA] * token_budget))):
        return OVER_TENANT_QUOTA
    cp = sh.class_params
    kv = sh.class_kv[c]
    tokens = sh.class_tokens[c]
    if ((kv > 0 and kv + need_blocks > int(cp[c, C_KV_SHARE] * kv_capacity))
            or (tokens > 0 and tokens + first_tokens > int(cp[c, C_TOKEN_SHARE] * token_budget))
            or (n_running > 0 and free_blocks_after < cp[c, C_HEADROOM] * kv_capacity)):
        return OVER_CLASS_BUDGET
    return ADMIT


# -- side parameters -------------------------------------------------------------------------
@dataclass(frozen=True)
class TenantShare:
    """One tenant's fair-share weight and quotas (None = the config's default quota)."""

    weight: float = 1.0
    kv_quota: float | None = None
    token_quota: float | None = None


@dataclass(frozen=True)
class ClassBudget:
    """One SLO class's admission budget (None headroom = the config's kv_headroom)."""

    kv_headroom: float | None = None
    kv_share: float = 1.0
    token_share: float = 1.0


@dataclass(frozen=True)
class SharingSpec:
    """Per-tenant and per-class settings, by name; a study spec's ``[sharing]`` table."""

    tenants: Mapping[str, TenantShare] = field(default_factory=dict)
    classes: Mapping[str, ClassBudget] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SharingSpec:
        """From ``{"tenants": {name: {weight, kv_quota, token_quota}}, "classes": {...}}``."""
        unknown = set(data) - {"tenants", "classes"}
        if unknown:
            raise ValueError(f"sharing: unknown table(s) {sorted(unknown)}; expected tenants, classes")

        def build(kind, fields_of, table):
            out = {}
            for name, values in table.items():
                bad = set(values) - set(fields_of.__dataclass_fields__)
                if bad:
                    raise ValueError(f"sharing.{kind}.{name}: unknown key(s) {sorted(bad)}; "
                                     f"known: {sorted(fields_of.__dataclass_fields__)}")
                out[name] = fields_of(**values)
            return out

        return cls(tenants=build("tenants", TenantShare, data.get("tenants", {})),
                   classes=build("classes", ClassBudget, data.get("classes", {})))


def side_params(
    tenant_names: tuple[str, ...],
    class_names: tuple[str, ...],
    spec: SharingSpec | None = None,
    *,
    kv_quota: float = 1.0,
    token_quota: float = 1.0,
    kv_headroom: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """``tenant_params`` and ``class_params`` for a trace's tenants and classes.

    Names in ``spec`` must be tenants / classes of the trace; fractions must lie in (0, 1]
    (headroom in [0, 1)) and weights be positive; anything else raises ValueError naming it.
    """
    spec = spec or SharingSpec()
    for kind, given, known in (("tenant", spec.tenants, tenant_names), ("class", spec.classes, class_names)):
        unknown = set(given) - set(known)
        if unknown:
            raise ValueError(f"sharing: unknown {kind}(s) {sorted(unknown)}; the trace has {list(known)}")
    tenant_params = np.empty((len(tenant_names), 3))
    for row, name in enumerate(tenant_names):
        share = spec.tenants.get(name, TenantShare())
        tenant_params[row] = (
            _positive(f"tenant {name!r} weight", share.weight),
            _fraction(f"tenant {name!r} kv_quota", kv_quota if share.kv_quota is None else share.kv_quota),
            _fraction(f"tenant {name!r} token_quota", token_quota if share.token_quota is None else share.token_quota),
        )
    class_params = np.empty((len(class_names), 3))
    for row, name in enumerate(class_names):
        budget = spec.classes.get(name, ClassBudget())
        headroom = kv_headroom if budget.kv_headroom is None else budget.kv_headroom
        if not 0.0 <= headroom < 1.0:
            raise ValueError(f"sharing: class {name!r} kv_headroom must be in [0, 1), got {headroom!r}")
        class_params[row] = (
            headroom,
            _fraction(f"class {name!r} kv_share", budget.kv_share),
            _fraction(f"class {name!r} token_share", budget.token_share),
        )
    return tenant_params, class_params


def _positive(what: str, x: float) -> float:
    if not (isinstance(x, int | float) and np.isfinite(x) and x > 0):
        raise ValueError(f"sharing: {what} must be a positive number, got {x!r}")
    return float(x)


def _fraction(what: str, x: float) -> float:
    if not (isinstance(x, int | float) and 0.0 < x <= 1.0):
        raise ValueError(f"sharing: {what} must be in (0, 1], got {x!r}")
    return float(x)
