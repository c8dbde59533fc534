"""Routers over a hand-built replica summary: each rule of the fleet contract, tie-breaks included."""

import numpy as np
import pytest

from costmodels.steptable import linear_tables
from policies.config import PolicyConfig
from policies.hashring import build_ring, request_key, ring_buffers, ring_lookup
from policies.routing import (
    ALIVE,
    CACHED_TOKENS,
    FREE,
    HEAD_DEMAND,
    HEADROOM,
    N_SUMMARY,
    OUTSTANDING,
    QUEUED_TOKENS,
    RUNNING,
    T_QUEUE,
    T_RISK,
    T_SAVED,
    T_TRANSFER,
    WAITING,
    choose_decode,
    choose_replica,
    fill_unified_terms,
    forget_replica,
    kv_freeness,
    matched_entries,
    migration_freeness,
    new_router_state,
    remember,
    ring_key,
)

BLOCK_TOKENS = 16
NO_ENTRIES = np.zeros(0, dtype=np.int64)
KEY = np.uint64(0)


def summary(n, **columns):
    s = np.zeros((n, N_SUMMARY))
    s[:, ALIVE] = 1.0
    names = {"outstanding": OUTSTANDING, "running": RUNNING, "waiting": WAITING, "free": FREE,
             "headroom": HEADROOM, "head": HEAD_DEMAND, "queued": QUEUED_TOKENS, "cached": CACHED_TOKENS,
             "alive": ALIVE}
    for name, values in columns.items():
        s[:, names[name]] = values
    return s


def route(config, s, state, entries=NO_ENTRIES, prompt=64, key=KEY):
    return choose_replica(config.to_vector(), s, state, np.asarray(entries, dtype=np.int64), BLOCK_TOKENS,
                          prompt, key)


def fresh(n, entries=32):
    return new_router_state(n, entries, 160)


def test_round_robin_walks_the_eligible_replicas_in_index_order():
    config, state = PolicyConfig(router="round_robin"), fresh(4)
    s = summary(4)
    assert [route(config, s, state) for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    s[2, ALIVE] = 0.0  # the pointer stands at 2: it skips the dead replica
    assert [route(config, s, state) for _ in range(4)] == [3, 0, 1, 3]
    s[:, ALIVE] = 0.0
    assert route(config, s, state) == -1


def test_least_outstanding_takes_the_lowest_index_among_ties_and_skips_dead():
    config = PolicyConfig(router="least_outstanding")
    s = summary(4, outstanding=[3, 1, 1, 0], alive=[1, 1, 1, 0])
    assert route(config, s, fresh(4)) == 1


def test_least_kv_maximises_llumnix_freeness():
    config = PolicyConfig(router="least_kv")
    # replica 0: (100 - 10 - 30) / (2 + 3) = 12 blocks per request; replica 1: (50 - 0 - 0) / 2 = 25
    s = summary(2, free=[100, 50], headroom=[10, 0], head=[30, 0], running=[2, 2], waiting=[3, 0])
    assert kv_freeness(s, 0) == pytest.approx(12.0) and kv_freeness(s, 1) == pytest.approx(25.0)
    assert route(config, s, fresh(2)) == 1
    # migration counts a non-empty queue as one request: 60 / (2 + 1)
    assert migration_freeness(s, 0) == pytest.approx(20.0) and migration_freeness(s, 1) == pytest.approx(25.0)
    s[1, FREE] = 10.0  # 10 / 2 = 5 < 12
    assert route(config, s, fresh(2)) == 0


def test_cache_aware_follows_prefixes_then_the_smallest_set():
    config, state = PolicyConfig(router="cache_aware"), fresh(4)
    s = summary(4)
    assert route(config, s, state, [0, 1, 2, 3]) == 0  # all sets empty: smallest set, lowest index
    assert list(state.set_size) == [4, 0, 0, 0]
    assert route(config, s, state, [0, 1, 5, 6]) == 0  # 2 blocks = 32 of 64 tokens: 0.5 > 0.3
    assert state.set_size[0] == 6  # entries 0 and 1 were there already
    assert route(config, s, state, [7, 8, 9, 10]) == 1  # no match: the smallest set
    assert route(config, s, state, [0, 11, 12, 13]) == 2  # 16 of 64 = 0.25 <= 0.3: the smallest set
    assert route(config.replace(router_cache_threshold=0.2), s, state, [0, 14]) == 0  # 0.25 > 0.2
    assert matched_entries(state, np.array([0, 1, 5, 9]), 0) == 3


def test_cache_aware_best_match_ties_go_to_fewer_outstanding():
    config, state = PolicyConfig(router="cache_aware"), fresh(3)
    for j in (1, 2):
        remember(state, np.array([20, 21]), j)
    s = summary(3, outstanding=[0, 5, 3])
    assert route(config, s, state, [20, 21, 22, 23]) == 2


def test_cache_aware_imbalance_goes_to_least_outstanding_and_still_records_the_prefix():
    config, state = PolicyConfig(router="cache_aware"), fresh(3)
    remember(state, np.array([0, 1, 2, 3]), 0)
    s = summary(3, outstanding=[100, 0, 30])  # 100 - 0 > 64 and 100 > 0 x 1.5
    assert route(config, s, state, [0, 1, 2, 3]) == 1
    assert matched_entries(state, np.array([0, 1, 2, 3]), 1) == 4
    forget_replica(state, 1)
    s[:, OUTSTANDING] = [60, 0, 30]  # 60 - 0 <= 64: balanced enough, the prefix wins
    assert route(config, s, state, [0, 1, 2, 3]) == 0
    s[:, OUTSTANDING] = [100, 80, 90]  # 20 <= 64
    assert route(config.replace(router_balance_abs=10), s, state, [0, 1, 2, 3]) == 0  # 100 <= 80 x 1.5
    assert route(config.replace(router_balance_abs=10, router_balance_rel=1.2), s, state, [0, 1, 2, 3]) == 1


def test_cache_aware_skips_dead_replicas_and_forgets_a_failed_set():
    config, state = PolicyConfig(router="cache_aware"), fresh(3)
    remember(state, np.array([0, 1, 2, 3]), 1)
    s = summary(3, alive=[1, 0, 1])
    assert route(config, s, state, [0, 1, 2, 3]) == 0
    forget_replica(state, 1)
    assert state.set_size[1] == 0 and matched_entries(state, np.array([0, 1]), 1) == 0
    assert matched_entries(state, np.array([0, 1]), 0) == 2  # other sets untouched


def lone(x, cached, per_token=2e-6, per_seq=1e-6, per_pair=1e-10, overhead=0.004):
    """linear_tables' lone prefill of x tokens on top of `cached`, written out."""
    return 0.0 if x <= 0 else overhead + per_token * x + per_seq + per_pair * (x * cached + x * (x + 1) // 2)


def test_unified_terms_follow_the_contract_formulas():
    config = PolicyConfig(router="unified", block_size=16, max_num_batched_tokens=8192, interconnect_gbps=50.0)
    s = summary(1, free=[50], headroom=[2], queued=[10_000], cached=[600])
    fill_unified_terms(s, 0, linear_tables(), 131_072, config.to_vector(), 1000, 200, 1000)
    assert s[0, T_SAVED] == pytest.approx(lone(1000, 0) - lone(400, 600), rel=1e-12)
    assert s[0, T_QUEUE] == pytest.approx(10_000 / 8192 * lone(8192, 0), rel=1e-12)
    assert s[0, T_TRANSFER] == pytest.approx(1000 * 131_072 / 50e9, rel=1e-12)
    need, available = 75, 50 - 2 - 625  # blocks(1200), free - headroom - blocks(10,000)
    assert s[0, T_RISK] == pytest.approx(lone(1000, 0) * (need - available) / need, rel=1e-12)


def test_unified_queue_term_avoids_the_hot_cached_replica():
    # replica 0 holds the prefix but has a long queue; replica 1 is cold and idle
    s = summary(2, free=[100_000, 100_000], queued=[200_000, 0], cached=[3000, 0])
    for j in (0, 1):
        fill_unified_terms(s, j, linear_tables(), 131_072, PolicyConfig().to_vector(), 4000, 100, 0)
    assert s[0, T_SAVED] > 0 and s[1, T_SAVED] == 0 and s[0, T_TRANSFER] == s[0, T_RISK] == 0
    assert route(PolicyConfig(router="unified"), s, fresh(2)) == 1
    assert route(PolicyConfig(router="unified", router_queue_weight=0.0), s, fresh(2)) == 0


def test_consistent_hash_takes_the_primary_overflows_to_the_secondary_and_fails_over():
    config, state = PolicyConfig(router="consistent_hash"), fresh(4)
    key = np.uint64(0x1234_5678_9ABC_DEF0)
    points, owners = ring_buffers(4, 160)
    size = build_ring(np.ones(4, dtype=np.bool_), 160, points, owners)
    primary, secondary = ring_lookup(points, owners, size, key)
    s = summary(4, outstanding=2.0)
    s[primary, OUTSTANDING] = 3.0  # mean 2.25: 3 <= 1.25 x 2.25 + 1
    assert route(config, s, state, key=key) == primary
    s[primary, OUTSTANDING] = 10.0  # mean 4: 10 > 6
    assert route(config, s, state, key=key) == secondary
    assert route(config.replace(hash_overflow_factor=3.0), s, state, key=key) == primary  # 10 <= 13
    s[primary, ALIVE] = 0.0  # the ring is rebuilt without it: its keys go to the secondary
    assert route(config, s, state, key=key) == secondary


def test_ring_key_reads_prefix_blocks_and_tenant_from_the_config():
    hashes = np.array([5, 6, 7, 5, 6, 9], dtype=np.int64)  # requests 0 and 1 share two leading blocks
    two = PolicyConfig(hash_prefix_blocks=2).to_vector()
    assert ring_key(two, hashes, 0, 3, 0, 0) == ring_key(two, hashes, 3, 6, 1, 1) == request_key(
        hashes, 0, 3, 0, 0, 2, False)
    three = PolicyConfig(hash_prefix_blocks=3).to_vector()
    assert ring_key(three, hashes, 0, 3, 0, 0) != ring_key(three, hashes, 3, 6, 1, 0)
    by_tenant = PolicyConfig(hash_prefix_blocks=2, hash_by_tenant=True).to_vector()
    assert ring_key(by_tenant, hashes, 0, 3, 0, 0) != ring_key(by_tenant, hashes, 3, 6, 1, 1)


def test_decode_choice_counts_promises():
    s = summary(3, free=[100, 100, 40], headroom=[10, 10, 0], running=[1, 1, 0])
    promised = np.array([0.0, 60.0, 0.0])
    # need 30: replica 1 has 90 - 60 = 30 left (fits exactly) but less freeness than 0 (90)
    assert choose_decode(s, promised, 30) == 0
    promised[0] = 70.0  # replica 0: 70 + 30 > 90; replica 1: 30 - 0 = 30 / 1; replica 2: 40 / 1
    assert choose_decode(s, promised, 30) == 2
    assert choose_decode(s, promised, 41) == -1


def test_router_state_is_sized_for_the_fleet():
    state = new_router_state(3, 10, 8)
    assert state.entry_owners.shape == (10,) and state.ring_points.shape == (24,)
    with pytest.raises(ValueError, match="n_replicas"):
        new_router_state(0, 10, 8)


# -- the engines' own DP balancers ------------------------------------------------------------
def dp_summary(n, capacity=100, seq=0, **columns):
    from policies.routing import CAPACITY, SEQ_TOKENS

    s = summary(n, **columns)
    s[:, CAPACITY] = capacity
    s[:, SEQ_TOKENS] = seq
    return s


def test_vllm_dp_round_robins_over_empty_replicas():
    """vllm/v1/engine/core_client.py:1772-1805: equal scores, the scan start rotating by one
    per request, so empty engines are taken in turn."""
    config, state = PolicyConfig(router="vllm_dp"), fresh(4)
    s = dp_summary(4, free=100)
    assert [route(config, s, state) for _ in range(6)] == [0, 1, 2, 3, 0, 1]


def test_vllm_dp_takes_the_least_loaded_and_the_first_of_the_scan_on_ties():
    config, state = PolicyConfig(router="vllm_dp"), fresh(3)
    # loads 2, 1, 1 (score = max(in-flight, waiting + running)): start 0, the scan meets 1 first
    s = dp_summary(3, outstanding=[2, 1, 1], running=[2, 1, 1], free=100)
    assert route(config, s, state) == 1
    # start 1 now; in-flight counts beyond the snapshot's running + waiting
    s = dp_summary(3, outstanding=[3, 3, 2], running=[0, 0, 0], free=100)
    assert route(config, s, state) == 2
    # start 2: ties between 2 and 0 go to 2, the first in the scan (strict <)
    s = dp_summary(3, outstanding=[1, 5, 1], running=[1, 5, 1], free=100)
    assert route(config, s, state) == 2
    assert route(config, s, state) == 0  # start 0 (wrapped): 0 first


def test_vllm_dp_avoids_a_queue_under_kv_pressure():
    """score += waiting x 6.0 x max(0, kv_cache_usage - 0.5): replica 0 (2 waiting, 90% of
    its KV used) scores 2 + 2 x 6 x 0.4 = 6.8 against replica 1's 3 (one waiting, 40% used);
    at 40% the penalty is off and replica 0's 2 wins from either scan start."""
    config, state = PolicyConfig(router="vllm_dp"), fresh(2)
    pressured = dp_summary(2, outstanding=[2, 3], running=[0, 2], waiting=[2, 1], free=[10, 60])
    relaxed = dp_summary(2, outstanding=[2, 3], running=[0, 2], waiting=[2, 1], free=[60, 60])
    assert route(config, pressured, state) == 1  # scan from 0
    assert route(config, pressured, state) == 1  # scan from 1
    assert route(config, relaxed, state) == 0  # scan from 0
    assert route(config, relaxed, state) == 0  # scan from 1
    # the penalty needs waiting requests: the same usage with nothing waiting adds nothing
    idle_full = dp_summary(2, outstanding=[2, 3], running=[2, 3], waiting=[0, 0], free=[10, 60])
    assert route(config, idle_full, state) == 0


def test_vllm_dp_skips_ineligible_replicas_and_their_start():
    config, state = PolicyConfig(router="vllm_dp"), fresh(4)
    s = dp_summary(4, free=100, alive=[1, 0, 1, 1])
    assert [route(config, s, state) for _ in range(5)] == [0, 2, 3, 0, 2]
    s[:, ALIVE] = 0.0
    assert route(config, s, state) == -1


def test_total_requests_takes_the_fewest_running_plus_waiting():
    """sglang/srt/managers/data_parallel_controller.py:141-142: ``index(min(total_requests))``."""
    config = PolicyConfig(router="total_requests")
    s = dp_summary(4, running=[3, 1, 0, 0], waiting=[0, 1, 2, 1], alive=[1, 1, 1, 0])
    assert route(config, s, fresh(4)) == 1  # 3, 2, 2 (and a dead 1): the first of the ties


def test_total_tokens_takes_the_fewest_tokens_then_requests():
    """data_parallel_controller.py:143-148: min (num_total_tokens, total_requests); tokens =
    used KV tokens + waiting requests' prompt + output so far (load_inquirer.py:145-147)."""
    config = PolicyConfig(router="total_tokens", block_size=16)
    # used blocks 10, 12, 10 -> 160, 192, 160 tokens; + waiting seqlen 40, 0, 40 -> 200, 192, 200
    s = dp_summary(3, free=[90, 88, 90], seq=[40, 0, 40], running=[2, 1, 1], waiting=[1, 0, 1])
    assert route(config, s, fresh(3)) == 1
    # 200 tokens each: the fewest requests (3, 1, 2) ...
    s = dp_summary(3, free=[90, 88, 90], seq=[40, 8, 40], running=[2, 1, 1], waiting=[1, 0, 1])
    assert route(config, s, fresh(3)) == 1
    # ... and on a tie of both, the lowest index
    s = dp_summary(3, free=[90, 88, 90], seq=[40, 8, 40], running=[2, 1, 1], waiting=[1, 1, 1])
    assert route(config, s, fresh(3)) == 1  # replicas 1 and 2 tie at (200, 2)


def test_cache_aware_without_a_prefix_match_prefers_a_replica_holding_the_adapter():
    from policies.routing import T_ADAPTER

    config, state = PolicyConfig(router="cache_aware"), fresh(3)
    remember(state, np.array([9, 10, 11]), 1)  # replica 1 has the largest set
    s = summary(3)
    s[:, T_ADAPTER] = [0.04, 0.0, 0.04]  # the adapter is resident on replica 1 only
    assert route(config, s, state, [0, 1]) == 1  # no match: the smallest set among the fastest loads
    s[:, T_ADAPTER] = [0.0, 0.0, 0.0]  # a base-model request: every replica ties, as before
    assert route(config, s, state, [2, 3]) == 0  # the smallest set, lowest index
    s[:, T_ADAPTER] = [0.04, 0.04, 0.002]  # in replica 2's host cache only: a copy beats a disk read
    assert route(config, s, state, [4, 5]) == 2


def test_unified_charges_the_adapter_load_like_the_other_terms():
    from policies.routing import T_ADAPTER

    config = PolicyConfig(router="unified")
    s = summary(2)
    s[:, T_SAVED] = [0.010, 0.008]  # replica 0 holds more of the prefix ...
    s[:, T_ADAPTER] = [0.005, 0.0]  # ... but would load the adapter: 0.005 < 0.008
    assert route(config, s, fresh(2)) == 1
    s[0, T_ADAPTER] = 0.001  # 0.009 > 0.008
    assert route(config, s, fresh(2)) == 0
