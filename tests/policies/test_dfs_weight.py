"""SGLang 0.5.23's ``dfs-weight`` waiting order (``scheduling_policy="dfs_weight"``).

SGLang (sglang/srt/mem_cache/base_prefix_cache.py:347-387, ``_dfs_weight_order``, called
by ``SchedulePolicy._sort_by_dfs_weight``, managers/schedule_policy.py:496-502, once per
``calc_priority``): every waiting request sits at ``req.last_node``, the deepest radix node
its prompt matched (root if none); a node's weight counts the requests in its subtree;
the queue becomes a depth-first walk from the root, children sorted by descending weight
(a stable sort of the insertion-ordered ``node.children``: ties go to the child the node
gained first), and a node's own requests are emitted when the walk *leaves* it (the
``(node, True)`` stack entry pops after its children's), i.e. after all its subtrees.
In servetune the nodes are the prefix cache's hash blocks and "gained first" is the
entry's creation stamp.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import prefix_cache as pcm
from policies import queues as qm
from policies.config import SCHEDULING_POLICIES, PolicyConfig
from policies.engine import simulate

from .conftest import cost_model, make_trace
from .reference_sharing import RefPrefixCache, dfs_weight_order
from .test_engine_reference import assert_matches_reference, configs, traces

BT = 32
A1, A2, B1 = 500, 501, 300  # cached chains: A = a1 -> a2 (a2 a child of a1), B = b1
# two seeds cache A (first) and B (second); six requests then wait, all at once:
#   w0: a1, x   w1: b1, x   w2: a1, a2, x   w3: unmatched   w4: b1, x   w5: a1, x
SEED_HASHES = [[A1, A2], [B1]]
SEED_PROMPT = [2 * BT + 1, BT + 8]
WAIT_HASHES = [[A1, 900], [B1, 901], [A1, A2, 902], [777, 903], [B1, 904], [A1, 905]]
WAIT_PROMPT = [2 * BT + 1, 2 * BT + 1, 3 * BT + 1, 2 * BT + 1, 2 * BT + 1, 2 * BT + 1]


def test_policy_is_appended_last():
    assert SCHEDULING_POLICIES[-1] == "dfs_weight" and SCHEDULING_POLICIES.index("lof") == 6
    assert qm.QUEUE_ORDERS == SCHEDULING_POLICIES and qm.DFS_WEIGHT == 7


def _kernel_order(hashes, prompt, cached, waiting, block_tokens=BT):
    """Insert the full blocks of the ``cached`` requests in that order, queue ``waiting``
    in enqueue order, run ``dfs_rekey`` once and drain the queue head by head."""
    offsets = np.zeros(len(hashes) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(h) for h in hashes])
    flat = np.array([x for h in hashes for x in h], dtype=np.int64)
    prompt = np.asarray(prompt, dtype=np.int64)
    pc = pcm.new_prefix_cache(offsets, flat, prompt, block_tokens, 16)
    for i in cached:
        pcm.insert(pc, offsets, i, int(prompt[i]))
        pcm.release(pc, offsets, i)
    q = qm.new_wait_queue(np.zeros(len(hashes), dtype=np.int64), np.zeros(1, dtype=np.int64))
    for seq, i in enumerate(waiting, 1):
        qm.push(q, i, *qm.order_keys(qm.DFS_WEIGHT, seq, 0.0, 0, np.nan, 0.0, 0.0))
    qm.dfs_rekey(q, pc, offsets, prompt)
    assert not pc.tab[pcm.E_WAIT].any(), "scratch row left dirty"
    out = []
    blocked = np.zeros(1, dtype=np.int64)
    while qm.queued(q):
        r = qm.pick(q, qm.DFS_WEIGHT, blocked, np.zeros(1), pc, offsets, prompt)
        qm.remove(q, r)
        out.append(int(r))
    return out


def _ref_order(hashes, prompt, cached, waiting, block_tokens=BT):
    cache = RefPrefixCache(hashes, prompt, block_tokens, 16)
    for i in cached:
        cache.insert(i, prompt[i])
        cache.release(i)
    seq = {i: n for n, i in enumerate(waiting)}
    return dfs_weight_order(cache, list(waiting), key=lambda i: seq[i])


def test_hand_worked_order():
    """Tree after the seeds: root -> a1 -> a2, root -> b1 (a1 created before b1).
    Attach points: w0, w5 at a1; w2 at a2 (deeper cached child); w1, w4 at b1; w3 at root.
    Weights: a1 = 3 (w0, w2, w5), a2 = 1, b1 = 2, root = 6.
    Walk: root's children by weight: a1 (3) then b1 (2). a1's only child a2: emit w2; leave
    a1: emit w0, w5 (queue order). b1 has no child: emit w1, w4. Leave root: emit w3.
    Order: w2, w0, w5, w1, w4, w3 (lpm would give w2, w0, w1, w4, w5, w3; fcfs w0..w5)."""
    hashes, prompt = SEED_HASHES + WAIT_HASHES, SEED_PROMPT + WAIT_PROMPT
    waiting = list(range(2, 8))
    expected = [2 + w for w in (2, 0, 5, 1, 4, 3)]
    assert _ref_order(hashes, prompt, [0, 1], waiting) == expected
    assert _kernel_order(hashes, prompt, [0, 1], waiting) == expected


def test_equal_weights_go_to_the_child_created_first_not_the_smaller_hash():
    """SGLang sorts ``node.children`` (an insertion-ordered dict) stably by -weight: with
    B cached before A and two waiting under each, B's requests come first although
    hash(B) > hash(A); a heavier A still wins."""
    hashes = [[B1], [A1], [A1, 1], [B1, 2], [A1, 3], [B1, 4], [A1, 5]]
    prompt = [BT + 1] * 2 + [2 * BT + 1] * 5
    for cached, waiting, expected in (([0, 1], [2, 3, 4, 5], [3, 5, 2, 4]),
                                      ([1, 0], [2, 3, 4, 5], [2, 4, 3, 5]),
                                      ([0, 1], [2, 3, 4, 5, 6], [2, 4, 6, 3, 5])):
        assert _ref_order(hashes, prompt, cached, waiting) == expected
        assert _kernel_order(hashes, prompt, cached, waiting) == expected


def _engine_trace():
    arrival = np.array([0.0, 0.5] + [2.0] * 6)
    return make_trace(arrival, SEED_PROMPT + WAIT_PROMPT, [2] * 8, hashes=SEED_HASHES + WAIT_HASHES,
                      block_tokens=BT)


def _start_order(result):
    return [int(i) for i in np.argsort(result.first_token_s[2:], kind="stable")]


def test_engine_resorts_every_round_with_one_seat():
    """With ``max_num_seqs=1`` each round admits one request and the next round re-sorts
    what is left (SGLang calls calc_priority per prefill batch). Round 1: w2 (as in the
    hand-worked order). Round 2: a1 = {w0, w5} and b1 = {w1, w4} weigh 2 each, a1 was
    created first: w0. Round 3: b1 (2) beats a1 (1): w1. Round 4: a1 and b1 weigh 1, a1
    first: w5. Then w4, then the unmatched w3."""
    config = PolicyConfig(gpu_memory_utilization=1.0, max_num_seqs=1, scheduling_policy="dfs_weight",
                          enable_prefix_caching=True)
    got = assert_matches_reference(_engine_trace(), cost_model(4096), config)
    assert _start_order(got) == [2, 0, 1, 5, 4, 3]
    lpm = simulate(_engine_trace(), cost_model(4096), dataclasses.replace(config, scheduling_policy="lpm"), 0)
    assert _start_order(lpm) == [2, 0, 1, 4, 5, 3]


def test_prefix_cache_off_is_fcfs():
    """SGLang turns a cache-aware policy into fcfs when the tree cache is disabled
    (schedule_policy.py:324-338, ``_validate_and_adjust_policy``)."""
    config = PolicyConfig(gpu_memory_utilization=1.0, max_num_seqs=1, scheduling_policy="dfs_weight",
                          enable_prefix_caching=False)
    got = assert_matches_reference(_engine_trace(), cost_model(4096), config)
    fcfs = simulate(_engine_trace(), cost_model(4096), dataclasses.replace(config, scheduling_policy="fcfs"), 0)
    assert _start_order(got) == [0, 1, 2, 3, 4, 5]
    for name in ("first_token_s", "finish_s", "state", "tokens_generated", "preemptions"):
        np.testing.assert_array_equal(getattr(got, name), getattr(fcfs, name), err_msg=name)


def test_no_fcfs_fallback_past_128_waiting():
    """SGLang's >128-waiting fallback covers lpm and hrrn only (schedule_policy.py:304-315):
    with 130 waiting, dfs-weight still serves the deepest match first, lpm (fcfs past 128
    here) does not."""
    n_wait = 130
    hashes = SEED_HASHES + [[10_000 + i, 20_000 + i] for i in range(n_wait - 1)] + [[A1, A2, 902]]
    prompt = SEED_PROMPT + [2 * BT + 1] * (n_wait - 1) + [3 * BT + 1]
    arrival = np.array([0.0, 0.5] + [2.0] * n_wait)
    trace = make_trace(arrival, prompt, [2] * len(prompt), hashes=hashes, block_tokens=BT)
    config = PolicyConfig(gpu_memory_utilization=1.0, max_num_seqs=1, scheduling_policy="dfs_weight",
                          enable_prefix_caching=True)
    got = assert_matches_reference(trace, cost_model(1 << 16), config)
    assert int(np.argmin(got.first_token_s[2:])) == n_wait - 1
    lpm = simulate(trace, cost_model(1 << 16), dataclasses.replace(config, scheduling_policy="lpm"), 0)
    assert int(np.argmin(lpm.first_token_s[2:])) == 0


@st.composite
def _forests(draw):
    """Chains over a small hash forest (consistent: a hash names its prefix), some
    cached in a random order, the rest waiting in a random order."""
    n = draw(st.integers(2, 14))
    hashes = []
    for _ in range(n):
        path, node = [], 0
        for _ in range(draw(st.integers(1, 4))):
            node = node * 3 + draw(st.integers(1, 3))  # children 3n+1..3n+3: a tree on ints
            path.append(node)
        hashes.append(path)
    prompt = [len(h) * BT + draw(st.integers(0, 5)) for h in hashes]
    ids = draw(st.permutations(range(n)))
    k = draw(st.integers(0, n - 1))
    return hashes, prompt, list(ids[:k]), list(ids[k:])


@settings(max_examples=300, deadline=None)
@given(_forests())
def test_rekey_equals_the_tree_walk(forest):
    hashes, prompt, cached, waiting = forest
    assert _kernel_order(hashes, prompt, cached, waiting) == _ref_order(hashes, prompt, cached, waiting)


@st.composite
def _dfs_configs(draw):
    return dataclasses.replace(draw(configs()), scheduling_policy="dfs_weight",
                               enable_prefix_caching=draw(st.sampled_from([True, True, True, False])))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), _dfs_configs(), st.sampled_from([250, 400, 800, 3000]), st.sampled_from([0, 64, 4096]))
def test_kernel_equals_reference_on_shared_prefixes(trace, config, kv_tokens, host_tokens):
    assert_matches_reference(trace, cost_model(kv_tokens, host_tokens), config)
