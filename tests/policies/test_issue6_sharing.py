"""Issue 6 in the engine: prefix caching, queue orders, fair sharing, starvation guards.

The contract properties and the exact kernel/reference agreement for every new mode are
covered by ``test_engine_properties`` and ``test_engine_reference`` (their strategies draw
tenants, classes, prefix hashes and every new knob).
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.config import PolicyConfig
from policies.engine import simulate
from policies.fairness import SharingSpec
from policies.result import Reject, State
from studies.metrics import score
from studies.slo import parse_slo

from .conftest import cost_model, make_trace

BT = 64


def base(**knobs):
    return PolicyConfig(gpu_memory_utilization=1.0, **knobs)


@st.composite
def replayed_twice(draw):
    """A trace whose requests share prefixes, then the same requests again later."""
    n = draw(st.integers(2, 10))
    arrival = np.cumsum(draw(st.lists(st.floats(0, 0.3), min_size=n, max_size=n)))
    hashes, prompt = [], []
    for i in range(n):
        root, shared, own = draw(st.integers(0, 2)), draw(st.integers(0, 4)), draw(st.integers(0, 2))
        chain = [root * 1000 + j for j in range(shared)] + [10**6 + i * 10 + j for j in range(own)]
        hashes.append(chain)
        prompt.append(max(1, len(chain) * BT - draw(st.integers(0, BT - 1))))
    output = draw(st.lists(st.integers(1, 30), min_size=n, max_size=n))
    return make_trace(np.concatenate([arrival, arrival + arrival[-1] + 0.5]), prompt * 2, output * 2,
                      hashes=hashes * 2, block_tokens=BT)


@settings(max_examples=40, deadline=None)
@given(replayed_twice(), st.sampled_from([8, 16, 64]), st.sampled_from([64, 256, 4096]))
def test_caching_never_computes_more_prefill_tokens(trace, block_size, budget):
    cost = cost_model(1 << 16)
    config = base(block_size=block_size, max_num_batched_tokens=budget)
    on = simulate(trace, cost, config.replace(enable_prefix_caching=True))
    off = simulate(trace, cost, config.replace(enable_prefix_caching=False))
    assert on.prefill_tokens_computed <= off.prefill_tokens_computed
    assert off.cached_prompt_tokens.sum() == 0 and off.prefix_query_tokens == 0
    assert on.prefix_hit_tokens <= on.prefix_query_tokens
    assert np.all(on.state == State.FINISHED) and np.all(off.state == State.FINISHED)


def test_requests_sharing_one_prefix_hit_after_the_first():
    n, blocks = 5, 4
    trace = make_trace(np.arange(n) * 10.0, [blocks * BT + 7] * n, [4] * n, hashes=[[11, 12, 13, 14]] * n,
                       block_tokens=BT)
    r = simulate(trace, cost_model(1 << 14), base(enable_prefix_caching=True))
    assert list(r.cached_prompt_tokens) == [0] + [blocks * BT] * (n - 1)
    assert r.prefill_tokens_computed == (blocks * BT + 7) + (n - 1) * 7
    assert r.prefix_hit_tokens / r.prefix_query_tokens == pytest.approx((n - 1) * blocks * BT / (n * (blocks * BT + 7)))
    assert r.prefill_time_saved_s > 0


def _vtc_overload(policy):
    """VTC's 'overload' suite: 1.5 and 3 req/s, 256-token inputs and outputs, 6 minutes,
    served by a small KV pool (10,000 tokens as the paper's A10G) below the demand. Every
    request gives up at the end of the 6 minutes, so service is counted while both tenants
    are backlogged."""
    span = 360.0
    a, b = np.arange(0, span, 1 / 1.5), np.arange(0, span, 1 / 3.0)
    arrival = np.concatenate([a, b])
    tenant = np.concatenate([np.zeros(len(a)), np.ones(len(b))]).astype(int)
    order = np.argsort(arrival, kind="stable")
    n = len(arrival)
    trace = make_trace(arrival[order], [256] * n, [256] * n, tenant=tenant[order], deadline=[span] * n,
                       n_tenants=2)
    cost = cost_model(10_000, per_token_s=2e-4, per_seq_s=0.0, per_kv_token_s=0.0, per_pair_s=0.0, overhead_s=0.02)
    config = base(scheduling_policy=policy, fairness_cost_unit="tokens", vtc_input_weight=1.0,
                  vtc_output_weight=2.0, max_num_batched_tokens=2048, block_size=16)
    return trace, simulate(trace, cost, config)


def test_vtc_gives_backlogged_tenants_equal_service_where_fcfs_splits_one_to_two():
    (trace, vtc), (_, fcfs) = _vtc_overload("vtc"), _vtc_overload("fcfs")
    for r in (vtc, fcfs):  # overloaded: plenty of requests never finish in time
        assert (r.state == State.FINISHED).mean() < 0.8
    w_in, w_out, max_batch_tokens = 1.0, 2.0, 10_000
    bound = 2 * max(w_in * 256, w_out * max_batch_tokens)  # VTC: |W_f - W_g| <= 2U
    assert abs(vtc.tenant_service[0] - vtc.tenant_service[1]) <= bound
    assert vtc.tenant_service[1] / vtc.tenant_service[0] == pytest.approx(1.0, abs=0.1)
    assert fcfs.tenant_service[1] / fcfs.tenant_service[0] == pytest.approx(2.0, rel=0.15)
    report = score(vtc, trace, parse_slo("e2el:60000"))
    for name in ("t0", "t1"):  # the audit: charged share against weight share
        assert report.per_tenant[name]["charged_share"] == pytest.approx(0.5, abs=0.05)
        assert report.per_tenant[name]["weight_share"] == 0.5


def test_edf_meets_more_deadlines_than_fcfs_when_deadlines_disagree_with_arrivals():
    # bursts where the later arrivals carry the tighter deadlines
    n = 60  # bursts of 6 every 1.5 s; two slots serve a burst in about 1.3 s
    arrival = np.repeat(np.arange(n // 6) * 1.5, 6) + np.tile(np.arange(6) * 1e-3, n // 6)
    slack = np.tile([1.6, 1.5, 1.4, 1.1, 0.55, 0.55], n // 6)
    trace = make_trace(arrival, [200] * n, [40] * n, deadline=arrival + slack)
    cost = cost_model(1 << 14, per_token_s=1e-4, overhead_s=0.01)
    config = base(max_num_seqs=2, deadline_margin_ms=0.0)
    met = {p: int((simulate(trace, cost, config.replace(scheduling_policy=p)).state == State.FINISHED).sum())
           for p in ("fcfs", "edf")}
    assert met["edf"] > met["fcfs"]


def test_edf_rejects_a_head_whose_deadline_is_already_unmeetable():
    # its lone prefill takes 20 ms: with the 50 ms margin a 60 ms deadline is already lost
    trace = make_trace([0.0, 0.0], [100, 100], [5, 5], deadline=[math.nan, 0.06])
    cost = cost_model(1 << 14, per_token_s=1e-4, overhead_s=0.01)
    r = simulate(trace, cost, base(scheduling_policy="edf"))
    assert r.state[1] == State.REJECTED and r.reject_reason[1] == Reject.DEADLINE_UNMEETABLE
    assert r.state[0] == State.FINISHED
    late = simulate(trace, cost, base(scheduling_policy="edf", deadline_margin_ms=0.0))
    assert late.reject_reason[1] == Reject.NONE, "without the margin it is tried (and times out)"


def _priority_stream(aging_rate):
    """A saturating stream of urgent requests and one low-priority request at the start."""
    n = 80
    arrival = np.arange(n) * 0.05
    arrival[1] = 0.001  # the low-priority request comes while the first urgent one runs
    priority = [5, 0] + [5] * (n - 2)
    trace = make_trace(arrival, [100] * n, [30] * n, priority=priority)
    cost = cost_model(1 << 14, per_token_s=1e-4, overhead_s=0.01)
    return simulate(trace, cost, base(scheduling_policy="priority", max_num_seqs=1, aging_rate=aging_rate))


def test_ageing_bounds_the_longest_wait():
    strict, aged = _priority_stream(0.0), _priority_stream(50.0)
    assert strict.queue_s[1] == np.nanmax(strict.queue_s), "strict priority starves the low one"
    # gap of 5 levels at 50 levels/s: after 0.1 s it outranks every newer urgent request, so
    # it waits for at most the ~3 requests queued before then (~0.26 s each alone)
    service_s = np.nanmin(aged.finish_s - aged.first_token_s) + 0.03
    assert aged.queue_s[1] <= 5 / 50.0 + 3 * service_s < strict.queue_s[1]
    assert np.nanmax(aged.queue_s) < np.nanmax(strict.queue_s)


def test_max_wait_admit_first_serves_instead_of_rejecting():
    trace = make_trace(np.arange(20) * 0.01, [300] * 20, [60] * 20, priority=[0] * 10 + [9] * 10)
    cost = cost_model(1 << 14, per_token_s=1e-4, overhead_s=0.01)
    config = base(scheduling_policy="priority", max_num_seqs=1, max_wait_s=0.5)
    rejected = simulate(trace, cost, config)
    admitted = simulate(trace, cost, config.replace(max_wait_action="admit_first"))
    assert (rejected.reject_reason == Reject.MAX_WAIT).sum() > 0
    assert np.all(admitted.state == State.FINISHED)


def test_tenant_quota_holds_back_a_high_priority_tenant():
    n = 40
    tenant = [0] * 20 + [1] * 20
    priority = [9] * 20 + [0] * 20
    trace = make_trace(np.zeros(n), [200] * n, [50] * n, tenant=tenant, priority=priority, n_tenants=2)
    cost = cost_model(4000)
    config = base(scheduling_policy="priority", block_size=16)
    free = simulate(trace, cost, config)
    quota = simulate(trace, cost, config, sharing=SharingSpec.from_mapping({"tenants": {"t0": {"kv_quota": 0.3}}}))
    first = lambda r, t: np.nanmin(r.queue_s[np.array(tenant) == t])  # noqa: E731
    assert first(quota, 1) < first(free, 1), "the quota lets the low-priority tenant in earlier"
    assert np.all(quota.state == State.FINISHED)
