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


# rows of Shares.tenants (per tenant) and Shares.classes (per class); counts are exact in f8
TS_COUNTER = 0  # VTC virtual counter (weighted, lifted)
TS_SERVICE = 1  # charged service (raw, for the audit)
TS_WAITING = 2  # queued requests (backlog)
TS_KV = 3  # KV blocks held by running requests
TS_TOKENS = 4  # tokens scheduled in the current step
TS_WEIGHT = 5  # the side parameters (tenant_params columns)
TS_KV_QUOTA = 6
TS_TOKEN_QUOTA = 7
N_TENANT_ROWS = 8
CS_KV = 0
CS_TOKENS = 1
CS_HEADROOM = 2  # the side parameters (class_params columns)
CS_KV_SHARE = 3
CS_TOKEN_SHARE = 4
N_CLASS_ROWS = 5


class Shares(NamedTuple):
    """Per-tenant ledger, usage and parameters, and per-class usage and budgets, as two
    field-major matrices (few arrays keep kernel calls cheap)."""

    tenants: np.ndarray  # f8[N_TENANT_ROWS, T]
    classes: np.ndarray  # f8[N_CLASS_ROWS, C]

    # Python-side views by name (tests, inspection)
    counter = property(lambda self: self.tenants[TS_COUNTER])
    service = property(lambda self: self.tenants[TS_SERVICE])
    waiting = property(lambda self: self.tenants[TS_WAITING].astype(np.int64))


@njit(cache=True, nogil=True, _nrt=True)
def new_shares(tenant_params, class_params):
    """Zeroed ledger and usage for ``side_params`` arrays (f8[T, 3], f8[C, 3])."""
    sh = Shares(np.empty((N_TENANT_ROWS, tenant_params.shape[0])), np.empty((N_CLASS_ROWS, class_params.shape[0])))
    clear(sh, tenant_params, class_params)
    return sh


@njit(cache=True, nogil=True, _nrt=True)
def clear(sh, tenant_params, class_params):
    """Zero the ledger and usage in place and set the side parameters. The matrices may
    be wider than the tenants and classes given; extra columns stay zero (never used)."""
    tenants, classes = sh.tenants, sh.classes
    tenants[:] = 0.0
    classes[:] = 0.0
    for t in range(tenant_params.shape[0]):
        tenants[TS_WEIGHT, t] = tenant_params[t, T_WEIGHT]
        tenants[TS_KV_QUOTA, t] = tenant_params[t, T_KV_QUOTA]
        tenants[TS_TOKEN_QUOTA, t] = tenant_params[t, T_TOKEN_QUOTA]
    for c in range(class_params.shape[0]):
        classes[CS_HEADROOM, c] = class_params[c, C_HEADROOM]
        classes[CS_KV_SHARE, c] = class_params[c, C_KV_SHARE]
        classes[CS_TOKEN_SHARE, c] = class_params[c, C_TOKEN_SHARE]


# -- VTC ledger ------------------------------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def enqueue(sh, t):
    """Tenant t queues a request; lift its counter if it was not backlogged."""
    ts = sh.tenants
    if ts[TS_WAITING, t] == 0:
        lowest = np.inf
        for u in range(ts.shape[1]):
            if u != t and ts[TS_WAITING, u] > 0 and ts[TS_COUNTER, u] < lowest:
                lowest = ts[TS_COUNTER, u]
        if lowest < np.inf and lowest > ts[TS_COUNTER, t]:
            ts[TS_COUNTER, t] = lowest
    ts[TS_WAITING, t] += 1


@njit(cache=True, nogil=True, inline="always")
def dequeue(sh, t):
    sh.tenants[TS_WAITING, t] -= 1


@njit(cache=True, nogil=True, inline="always")
def charge(sh, t, cost):
    """Charge tenant t ``cost`` units of service."""
    ts = sh.tenants
    ts[TS_SERVICE, t] += cost
    ts[TS_COUNTER, t] += cost / ts[TS_WEIGHT, t]


@njit(cache=True, nogil=True, inline="always")
def step_cost(unit, request_tokens, step_tokens, step_s, kv_tokens, kv_bytes_per_token):
    """A request's step-end charge under the time-based units (tokens charge as they go)."""
    if unit == GPU_TIME:
        return step_s * request_tokens / step_tokens if step_tokens > 0 else 0.0
    if unit == KV_BYTE_SECONDS:
        return float(kv_tokens) * kv_bytes_per_token * step_s
    return 0.0


@njit(cache=True, nogil=True, _nrt=False)
def token_cost(unit, prompt_tokens, output_tokens, w_in, w_out):
    """Charge for computed prompt and generated output tokens under the ``tokens`` unit."""
    if unit == TOKENS:
        return w_in * prompt_tokens + w_out * output_tokens
    return 0.0


# -- quotas and class budgets ----------------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def new_step(sh):
    sh.tenants[TS_TOKENS] = 0.0
    sh.classes[CS_TOKENS] = 0.0


@njit(cache=True, nogil=True, inline="always")
def hold_kv(sh, t, c, delta_blocks):
    sh.tenants[TS_KV, t] += delta_blocks
    sh.classes[CS_KV, c] += delta_blocks


@njit(cache=True, nogil=True, inline="always")
def use_tokens(sh, t, c, n):
    sh.tenants[TS_TOKENS, t] += n
    sh.classes[CS_TOKENS, c] += n


@njit(cache=True, nogil=True, _nrt=False)
def admission_check(sh, t, c, need_blocks, first_tokens, free_blocks_after, kv_capacity, token_budget, n_running):
    """ADMIT, OVER_TENANT_QUOTA or OVER_CLASS_BUDGET for a new request of tenant t, class c.

    ``need_blocks``: KV blocks its first chunk allocates; ``first_tokens``: tokens of that
    chunk; ``free_blocks_after``: free (and evictable) blocks left once it is admitted.
    A limit binds only once its tenant or class holds something (KV, or tokens in this
    step), and a class headroom only while anything runs: a request larger than a quota
    still runs alone, so quotas can never stall the engine.
    """
    ts = sh.tenants
    kv = ts[TS_KV, t]
    tokens = ts[TS_TOKENS, t]
    if ((kv > 0 and kv + need_blocks > int(ts[TS_KV_QUOTA, t] * kv_capacity))
            or (tokens > 0 and tokens + first_tokens > int(ts[TS_TOKEN_QUOTA, t] * token_budget))):
        return OVER_TENANT_QUOTA
    cs = sh.classes
    kv = cs[CS_KV, c]
    tokens = cs[CS_TOKENS, c]
    if ((kv > 0 and kv + need_blocks > int(cs[CS_KV_SHARE, c] * kv_capacity))
            or (tokens > 0 and tokens + first_tokens > int(cs[CS_TOKEN_SHARE, c] * token_budget))
            or (n_running > 0 and free_blocks_after < cs[CS_HEADROOM, c] * kv_capacity)):
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
