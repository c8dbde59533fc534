"""Fair-share ledger, cost units, quotas and class budgets; side parameters from a spec."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import fairness as f
from policies import prefix_cache as pcm
from policies import queues as q
from tests.policies.reference_sharing import RefShares


def _shares(weights=(1.0, 1.0), kv_quota=1.0, token_quota=1.0, classes=((0.0, 1.0, 1.0),)):
    tp = np.array([[w, kv_quota, token_quota] for w in weights])
    return f.new_shares(tp, np.array(classes, dtype=float))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(0.25, 4.0), min_size=1, max_size=4),
       st.lists(st.tuples(st.sampled_from(["enq", "deq", "charge"]), st.integers(0, 3), st.floats(0, 100)), max_size=40))
def test_ledger_agrees_with_twin(weights, ops):
    sh = _shares(weights)
    ref = RefShares(weights)
    for op, t, x in ops:
        t %= len(weights)
        if op == "enq":
            f.enqueue(sh, t)
            ref.enqueue(t)
        elif op == "deq" and ref.waiting[t] > 0:
            f.dequeue(sh, t)
            ref.dequeue(t)
        elif op == "charge":
            f.charge(sh, t, x)
            ref.charge(t, x)
        assert list(sh.waiting) == ref.waiting
        np.testing.assert_allclose(sh.counter, ref.counter, rtol=0, atol=1e-9)
        np.testing.assert_allclose(sh.service, ref.service, rtol=0, atol=1e-9)


def test_lift_to_the_least_served_backlogged_tenant_only_when_becoming_backlogged():
    sh = _shares((1.0, 1.0, 1.0))
    for t, served in ((0, 50.0), (1, 80.0)):
        f.enqueue(sh, t)
        f.charge(sh, t, served)
    f.enqueue(sh, 2)  # idle tenant returns: no credit for idling
    assert sh.counter[2] == 50.0
    f.charge(sh, 2, 100.0)
    f.enqueue(sh, 2)  # already backlogged: no lift
    assert sh.counter[2] == 150.0


def test_no_lift_when_nobody_else_waits_and_never_downward():
    sh = _shares()
    f.charge(sh, 0, 30.0)
    f.enqueue(sh, 0)
    assert sh.counter[0] == 30.0
    f.enqueue(sh, 1)
    assert sh.counter[1] == 30.0
    f.dequeue(sh, 1)
    f.charge(sh, 1, 40.0)
    f.enqueue(sh, 1)  # 70 > 30: stays
    assert sh.counter[1] == 70.0


def test_weights_scale_the_counter_not_the_audited_service():
    sh = _shares((1.0, 2.0))
    f.charge(sh, 0, 10.0)
    f.charge(sh, 1, 10.0)
    assert list(sh.counter) == [10.0, 5.0]
    assert list(sh.service) == [10.0, 10.0]


def test_cost_units():
    assert f.token_cost(f.TOKENS, 256, 3, 1.0, 2.0) == 262.0
    assert f.token_cost(f.GPU_TIME, 256, 3, 1.0, 2.0) == 0.0
    assert f.step_cost(f.GPU_TIME, 30, 120, 0.02, 999, 1) == pytest.approx(0.005)
    assert f.step_cost(f.GPU_TIME, 0, 0, 0.02, 0, 1) == 0.0
    assert f.step_cost(f.KV_BYTE_SECONDS, 1, 10, 0.5, 1000, 2048) == 1000 * 2048 * 0.5
    assert f.step_cost(f.TOKENS, 1, 10, 0.5, 1000, 2048) == 0.0


def test_tenant_quota_blocks_admission_once_the_tenant_holds_something():
    sh = _shares(kv_quota=0.25, token_quota=0.5)
    assert f.admission_check(sh, 0, 0, 90, 900, 10, 100, 1000, 3) == f.ADMIT, "an idle tenant always gets one"
    f.hold_kv(sh, 0, 0, 20)
    assert f.admission_check(sh, 0, 0, 5, 10, 500, 100, 1000, 3) == f.ADMIT
    assert f.admission_check(sh, 0, 0, 6, 10, 500, 100, 1000, 3) == f.OVER_TENANT_QUOTA
    f.use_tokens(sh, 0, 0, 495)
    assert f.admission_check(sh, 0, 0, 1, 6, 500, 100, 1000, 3) == f.OVER_TENANT_QUOTA
    assert f.admission_check(sh, 1, 0, 1, 6, 500, 100, 1000, 3) == f.ADMIT, "other tenants are unaffected"
    f.new_step(sh)
    assert f.admission_check(sh, 0, 0, 1, 500, 500, 100, 1000, 3) == f.ADMIT


def test_class_budget_and_headroom():
    sh = _shares(classes=((0.0, 1.0, 1.0), (0.2, 0.5, 0.25)))
    assert f.admission_check(sh, 0, 1, 10, 10, 19, 100, 1000, 1) == f.OVER_CLASS_BUDGET, "headroom 20 blocks"
    assert f.admission_check(sh, 0, 1, 10, 10, 19, 100, 1000, 0) == f.ADMIT, "headroom never stalls an idle engine"
    assert f.admission_check(sh, 0, 0, 10, 10, 19, 100, 1000, 1) == f.ADMIT
    f.hold_kv(sh, 0, 1, 45)
    f.use_tokens(sh, 0, 1, 1)
    assert f.admission_check(sh, 0, 1, 6, 10, 40, 100, 1000, 1) == f.OVER_CLASS_BUDGET, "KV share 50 blocks"
    assert f.admission_check(sh, 0, 1, 5, 249, 40, 100, 1000, 1) == f.ADMIT
    assert f.admission_check(sh, 0, 1, 5, 250, 40, 100, 1000, 1) == f.OVER_CLASS_BUDGET, "token share 250"


def test_vtc_shares_service_equally_where_fcfs_follows_demand():
    """Two always-backlogged tenants, demand 1:2, one 256+256-token request served at a time."""
    w_in, w_out, size = 1.0, 2.0, 256
    cost = w_in * size + w_out * size

    def serve(order, n_served):
        n = 3 * n_served
        tenant = np.array([0 if i % 3 == 0 else 1 for i in range(n)])  # tenant 1 sends twice as much
        lane_of, lane_tenant = q.lanes(tenant, np.zeros(n), 2, 1, order == q.VTC, False)
        wq = q.new_wait_queue(lane_of, lane_tenant)
        sh = _shares()
        for i in range(n):
            q.push(wq, i, *q.order_keys(order, i, i / 4.5, 0, math.nan, 0.0, 0.0))
            f.enqueue(sh, tenant[i])
        pc = pcm.new_prefix_cache(np.zeros(n + 1, np.int64), np.zeros(0, np.int64), np.full(n, size), 512, 16)
        blocked = np.zeros(len(lane_tenant), dtype=np.bool_)
        for _ in range(n_served):
            i = q.pick(wq, order, blocked, sh.counter, pc, np.zeros(n + 1, np.int64), np.full(n, size))
            q.remove(wq, i)
            f.dequeue(sh, tenant[i])
            f.charge(sh, tenant[i], cost)
        return sh.service

    vtc = serve(q.VTC, 60)
    fcfs = serve(q.FCFS, 60)
    assert abs(vtc[0] - vtc[1]) <= 2 * max(w_in * size, w_out * size)  # VTC's 2U bound
    assert fcfs[1] / fcfs[0] == pytest.approx(2.0)


def test_side_params_fill_defaults_and_overrides():
    spec = f.SharingSpec.from_mapping({"tenants": {"b": {"weight": 3, "kv_quota": 0.5}},
                                       "classes": {"agent": {"kv_headroom": 0.1, "token_share": 0.25}}})
    tp, cp = f.side_params(("a", "b"), ("chat", "agent"), spec, kv_quota=0.8, kv_headroom=0.05)
    assert tp.tolist() == [[1.0, 0.8, 1.0], [3.0, 0.5, 1.0]]
    assert cp.tolist() == [[0.05, 1.0, 1.0], [0.1, 1.0, 0.25]]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"tenants": {"zed": {}}}, r"unknown tenant\(s\) \['zed'\]"),
        ({"tenants": {"a": {"weight": 0}}}, "weight must be a positive number"),
        ({"tenants": {"a": {"weight": math.nan}}}, "weight must be a positive number"),
        ({"tenants": {"a": {"token_quota": 1.5}}}, r"token_quota must be in \(0, 1\]"),
        ({"classes": {"chat": {"kv_headroom": 1.0}}}, r"kv_headroom must be in \[0, 1\)"),
        ({"classes": {"chat": {"kv_share": 0}}}, r"kv_share must be in \(0, 1\]"),
    ],
)
def test_bad_sharing_values_name_what_and_where(data, message):
    with pytest.raises(ValueError, match=message):
        f.side_params(("a",), ("chat",), f.SharingSpec.from_mapping(data))


def test_unknown_keys_in_a_sharing_table_are_refused():
    with pytest.raises(ValueError, match=r"sharing.tenants.a: unknown key\(s\) \['wieght'\]"):
        f.SharingSpec.from_mapping({"tenants": {"a": {"wieght": 2}}})
    with pytest.raises(ValueError, match="unknown table"):
        f.SharingSpec.from_mapping({"tenant": {}})


def test_clear_zeroes_the_ledger_and_keeps_the_parameters():
    sh = _shares((2.0, 1.0), kv_quota=0.5)
    f.enqueue(sh, 0)
    f.charge(sh, 0, 10.0)
    f.hold_kv(sh, 1, 0, 7)
    tp = np.array([[2.0, 0.5, 1.0], [1.0, 0.5, 1.0]])
    f.clear(sh, tp, np.array([[0.0, 1.0, 1.0]]))
    fresh = _shares((2.0, 1.0), kv_quota=0.5)
    np.testing.assert_array_equal(sh.tenants, fresh.tenants)
    np.testing.assert_array_equal(sh.classes, fresh.classes)
