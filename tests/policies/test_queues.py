"""Waiting-queue orders: the lane heap agrees with the sorted twin; each order's semantics."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import prefix_cache as pcm
from policies import queues as q
from tests.policies.reference_sharing import (
    LPM_FCFS_ABOVE,
    RefPrefixCache,
    RefWaitQueue,
    order_keys,
)

BT = 32


def _empty_cache(n, hashes=None, prompts=None):
    hashes = hashes or [[] for _ in range(n)]
    prompts = np.asarray(prompts or [BT * 4] * n, dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(h) for h in hashes])
    flat = np.array([x for h in hashes for x in h], dtype=np.int64)
    return pcm.new_prefix_cache(offsets, flat, prompts, BT, 16), offsets, prompts


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 12))
    n_tenants = draw(st.integers(1, 3))
    n_classes = draw(st.integers(1, 2))
    by_tenant, by_class = draw(st.booleans()), draw(st.booleans())
    tenant = draw(st.lists(st.integers(0, n_tenants - 1), min_size=n, max_size=n))
    klass = draw(st.lists(st.integers(0, n_classes - 1), min_size=n, max_size=n))
    arrival = sorted(draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)))
    priority = draw(st.lists(st.integers(-2, 2), min_size=n, max_size=n))
    deadline = [a + d if d is not None else math.nan
                for a, d in zip(arrival, draw(st.lists(st.none() | st.integers(0, 10), min_size=n, max_size=n)), strict=True)]
    job = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    chains = [[draw(st.integers(0, 2)) * 10 + j for j in range(draw(st.integers(0, 3)))] for _ in range(n)]
    ops = draw(st.lists(st.tuples(st.sampled_from(["push", "push", "remove", "promote", "pick", "cache"]),
                                  st.integers(0, n - 1), st.integers(0, 2**16)), max_size=40))
    return dict(n=n, n_tenants=n_tenants, n_classes=n_classes, by_tenant=by_tenant, by_class=by_class,
                tenant=tenant, klass=klass, arrival=arrival, priority=priority, deadline=deadline, job=job,
                chains=chains, order=draw(st.integers(0, 5)), aging=draw(st.sampled_from([0.0, 0.5])), ops=ops)


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_lane_heap_agrees_with_sorted_twin(s):
    n = s["n"]
    lane_of, lane_tenant = q.lanes(np.array(s["tenant"]), np.array(s["klass"]), s["n_tenants"], s["n_classes"],
                                   s["by_tenant"], s["by_class"])
    wq = q.new_wait_queue(lane_of, lane_tenant)
    ref = RefWaitQueue(lane_of, lane_tenant)
    prompts = [BT * 3 + 1] * n
    pc, offsets, prompt_arr = _empty_cache(n, s["chains"], prompts)
    rc = RefPrefixCache(s["chains"], prompts, BT, 16)
    counters = np.zeros(s["n_tenants"])
    seq = 0
    order = s["order"]
    for op, i, x in s["ops"]:
        queued = wq.pos[i] >= 0
        if op == "push" and not queued:
            seq = seq + 1 if x % 3 else -seq - 1  # arrivals append, preemptions prepend
            args = (order, seq, float(s["arrival"][i]), s["priority"][i], s["deadline"][i], float(s["job"][i]), s["aging"])
            k1, k2 = q.order_keys(*args)
            assert (k1, k2) == order_keys(*args)
            q.push(wq, i, k1, k2)
            ref.push(i, k1, k2)
        elif op == "remove":
            q.remove(wq, i)
            ref.remove(i)
        elif op == "promote" and queued:
            q.promote(wq, i)
            ref.promote(i)
        elif op == "cache":  # a request computes its whole prompt, feeding LPM
            if pc.held[i] == 0:
                pcm.acquire(pc, offsets, i, 0)
                pcm.insert(pc, offsets, i, prompts[i])
                rc.acquire(i, 0)
                rc.insert(i, prompts[i])
        elif op == "pick":
            blocked = np.array([(x >> lane) & 1 == 1 for lane in range(len(lane_tenant))])
            counters[:] = [(x >> (4 + 2 * t)) & 3 for t in range(s["n_tenants"])]
            got = q.pick(wq, order, blocked, counters, pc, offsets, prompt_arr)
            assert got == ref.pick(order, blocked, counters, rc)
        assert wq.total[0] == len(ref.keys)
        assert sorted(i for i in range(n) if wq.pos[i] >= 0) == sorted(ref.keys)
        for lane in range(len(lane_tenant)):
            members = [i for i in ref.keys if lane_of[i] == lane]
            want = min(members, key=lambda r: (*ref.keys[r], r)) if members else -1
            assert q.top(wq, lane) == want


def _push_all(order, arrival, priority=None, deadline=None, job=None, aging=0.0):
    n = len(arrival)
    wq = q.new_wait_queue(np.zeros(n), np.zeros(1))
    for i in range(n):
        k1, k2 = q.order_keys(order, i, float(arrival[i]), (priority or [0] * n)[i],
                              (deadline or [math.nan] * n)[i], float((job or [0] * n)[i]), aging)
        q.push(wq, i, k1, k2)
    return wq


def _drain(wq):
    out = []
    while wq.total[0]:
        i = q.top(wq, 0)
        q.remove(wq, i)
        out.append(i)
    return out


def test_priority_serves_larger_first_then_arrival():
    wq = _push_all(q.PRIORITY, [0, 1, 2, 3], priority=[0, 5, 0, 5])
    assert _drain(wq) == [1, 3, 0, 2]


def test_ageing_lets_an_old_low_priority_request_overtake_new_urgent_ones():
    # rate 1 level/s: request 0 (priority 0, t=0) beats priority-5 arrivals after t=5
    wq = _push_all(q.PRIORITY, [0, 4, 6], priority=[0, 5, 5], aging=1.0)
    assert _drain(wq) == [1, 0, 2]


def test_edf_puts_requests_without_deadline_last_by_arrival():
    wq = _push_all(q.EDF, [0, 1, 2, 3], deadline=[math.nan, 9.0, math.nan, 4.0])
    assert _drain(wq) == [3, 1, 0, 2]


def test_sjf_orders_by_predicted_job():
    wq = _push_all(q.SJF, [0, 1, 2], job=[30, 10, 20])
    assert _drain(wq) == [1, 2, 0]


def test_promoted_request_goes_first():
    wq = _push_all(q.PRIORITY, [0, 1, 2], priority=[9, 9, 0])
    q.promote(wq, 2)
    assert _drain(wq) == [2, 0, 1]


def test_lpm_prefers_the_longest_cached_prefix_until_128_wait():
    n = LPM_FCFS_ABOVE + 1
    hashes = [[1, 2, 3]] + [[100 + i] for i in range(1, n - 1)] + [[1, 2, 3]]
    pc, offsets, prompts = _empty_cache(n, hashes, [BT * 3 + 1] * n)
    pcm.acquire(pc, offsets, 0, 0)
    pcm.insert(pc, offsets, 0, BT * 3 + 1)  # request 0 ran; its prefix is cached
    wq = q.new_wait_queue(np.zeros(n), np.zeros(1))
    for i in range(1, n):
        q.push(wq, i, *q.order_keys(q.LPM, i, 0.0, 0, math.nan, 0.0, 0.0))
    no_block, zero = np.zeros(1, dtype=np.bool_), np.zeros(1)
    assert wq.total[0] == LPM_FCFS_ABOVE
    assert q.pick(wq, q.LPM, no_block, zero, pc, offsets, prompts) == n - 1
    q.push(wq, 0, *q.order_keys(q.LPM, n, 0.0, 0, math.nan, 0.0, 0.0))
    assert q.pick(wq, q.LPM, no_block, zero, pc, offsets, prompts) == 1, "FCFS past 128 waiting"


def test_vtc_picks_the_smallest_counter_lane_and_skips_blocked_lanes():
    lane_of, lane_tenant = q.lanes(np.array([0, 1, 1]), np.zeros(3), 2, 1, True, False)
    wq = q.new_wait_queue(lane_of, lane_tenant)
    for i in range(3):
        q.push(wq, i, *q.order_keys(q.VTC, i, 0.0, 0, math.nan, 0.0, 0.0))
    pc, offsets, prompts = _empty_cache(3)
    counters = np.array([5.0, 1.0])
    assert q.pick(wq, q.VTC, np.array([False, False]), counters, pc, offsets, prompts) == 1
    assert q.pick(wq, q.VTC, np.array([False, True]), counters, pc, offsets, prompts) == 0
    assert q.pick(wq, q.VTC, np.array([True, True]), counters, pc, offsets, prompts) == -1


def test_deadline_unmeetable_uses_the_margin():
    assert not q.deadline_unmeetable(1.0, math.nan, 100.0, 0.05)
    assert not q.deadline_unmeetable(1.0, 2.0, 0.9, 0.05)
    assert q.deadline_unmeetable(1.0, 2.0, 0.96, 0.05)


def test_lane_map_out_of_range_is_refused():
    with pytest.raises(ValueError, match="lane_of"):
        q.new_wait_queue(np.array([0, 2]), np.zeros(2))


def test_service_estimates_follow_the_step_table():
    from costmodels.steptable import linear_tables

    t = linear_tables(per_token_s=1e-3, per_seq_s=0.0, per_kv_token_s=0.0, per_pair_s=0.0, overhead_s=0.01)
    lower, job = q.service_estimates(t, np.array([100, 1000]), np.array([1, 11]))
    np.testing.assert_allclose(lower, [0.11, 1.01])
    np.testing.assert_allclose(job, [0.11, 1.01 + 10 * 0.011])


def test_clear_empties_every_lane_and_keeps_its_room():
    lane_of, lane_tenant = q.lanes(np.array([0, 1, 1, 0]), np.zeros(4), 2, 1, True, False)
    wq = q.new_wait_queue(lane_of, lane_tenant)
    fresh = q.new_wait_queue(lane_of, lane_tenant)
    for i in range(4):
        q.push(wq, i, 0.0, float(i))
    q.remove(wq, 2)
    q.clear(wq, lane_tenant)
    for a, b in ((wq.keys, fresh.keys), (wq.slots, fresh.slots), (wq.lanes, fresh.lanes)):
        np.testing.assert_array_equal(a, b)
    for i in (3, 1, 0, 2):
        q.push(wq, i, 0.0, float(i))
    assert wq.total[0] == 4 and q.top(wq, 0) == 0 and q.top(wq, 1) == 1
