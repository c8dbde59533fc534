"""Prefix cache kernels: agree with the plain-Python twin, keep the KV ledger exact."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import prefix_cache as pcm
from tests.policies.reference_sharing import RefPrefixCache

BT = 64  # hash block tokens, small so prompts span several blocks
PER = BT // 16  # units of a hash block by vLLM's rules at block_size 16


def _cache(hashes, prompts, kv_block_size, block_tokens=BT, keep=False):
    """The kernels' cache and its twin, by SGLang's rules or (``keep``) vLLM's."""
    offsets = np.zeros(len(hashes) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(h) for h in hashes])
    flat = np.array([x for h in hashes for x in h], dtype=np.int64)
    prompts = np.asarray(prompts, dtype=np.int64)
    pc = pcm.new_prefix_cache(offsets, flat, prompts, block_tokens, kv_block_size, keep_copies=keep, pool=400)
    ref = RefPrefixCache(hashes, prompts.tolist(), block_tokens, kv_block_size, keep_copies=keep)
    return pc, ref, offsets, prompts


@st.composite
def workloads(draw):
    """Requests whose hash chains branch off a few shared conversations, plus ops."""
    n = draw(st.integers(1, 7))
    roots = draw(st.lists(st.integers(-(2**62), 2**62), min_size=1, max_size=3, unique=True))
    hashes, prompts = [], []
    for r in range(n):
        root = roots[draw(st.integers(0, len(roots) - 1))]
        shared = draw(st.integers(0, 4))
        chain = [hash((root, j)) for j in range(shared)] + [hash((root, r, j)) for j in range(draw(st.integers(0, 2)))]
        prompt = draw(st.integers(max(1, (len(chain) - 1) * BT + 1), max(1, len(chain) * BT + 40)))
        hashes.append(chain)
        prompts.append(prompt)
    ops = draw(
        st.lists(
            st.tuples(st.sampled_from(["admit", "compute", "release", "release_own", "evict"]), st.integers(0, n - 1),
                      st.integers(1, 200)),
            max_size=40,
        )
    )
    bs = draw(st.sampled_from([1, 16, 48, 64, 100]))
    return hashes, prompts, bs, ops, draw(st.booleans()) and BT % bs == 0  # vLLM's rules need bs | BT


@st.composite
def copy_workloads(draw):
    """Requests of one conversation admitted before the shared blocks are computed, so they
    compute them side by side (vLLM's copies), with evictions between: every copy rule runs."""
    n = draw(st.integers(2, 5))
    shared = draw(st.integers(1, 4))
    hashes = [[hash(("shared", j)) for j in range(shared)] + [hash((r, j)) for j in range(draw(st.integers(0, 1)))]
              for r in range(n)]
    prompts = [len(chain) * BT + draw(st.integers(0, 40)) for chain in hashes]
    admits = [("admit", r, 1) for r in range(n)]
    ops = draw(st.lists(st.tuples(st.sampled_from(["compute"] * 4 + ["release", "release_own", "evict", "admit"]),
                                  st.integers(0, n - 1), st.integers(1, 2 * BT)), min_size=20, max_size=60))
    return hashes, prompts, draw(st.sampled_from([16, 64])), admits + ops, True


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_kernels_agree_with_twin_and_ledger_balances(workload):
    _agree_and_balance(*workload)


@settings(max_examples=150, deadline=None)
@given(copy_workloads())
def test_copies_agree_with_twin_and_ledger_balances(workload):
    _agree_and_balance(*workload)


def _agree_and_balance(hashes, prompts, bs, ops, keep):
    """Run the ops on the kernels and the twin: same answers, and the KV ledger balances."""
    pc, ref, offsets, prompts = _cache(hashes, prompts, bs, keep=keep)
    ut = pc.unit_tokens
    ctx = {}  # active request -> computed tokens
    # The engine's ledger: idle (evictable) entries count as free KV, so "in use" is the
    # private blocks of active requests plus the entries someone references.
    in_use = 0
    for op, i, x in ops:
        if op == "admit" and i not in ctx:
            got = pcm.match(pc, offsets, prompts, i, prompts[i])
            assert got == ref.match(i, prompts[i])
            assert 0 <= got[1] < prompts[i], "a full hit still computes one token"
            part, own = pcm.partial_blocks(pc, offsets, i, got[0]), pcm.own_blocks(pc, i)
            assert (part, own) == (ref.partial_blocks(i, got[0]), ref.own_blocks(i))
            assert 0 <= part < pc.unit_blocks
            assert pcm.acquire(pc, offsets, i, got[0]) == ref.acquire(i, got[0]) == got[2]
            # it takes the head of a partly evicted entry, or (after a whole prefix) up to x
            # blocks of its own run, as blocks of its own
            take = min(own, x) if got[0] == pc.n_full[i] and got[1] == got[0] * ut else part
            pcm.take_partial(pc, offsets, i, got[0])
            ref.take_partial(i, got[0])
            pcm.take_own(pc, i)
            ref.take_own(i)
            in_use += got[2] + take  # idle entries it now references, and the blocks it took, leave the pool
            ctx[i] = got[1] + take * bs
        elif op == "compute" and i in ctx:
            new = ctx[i] + x
            need = pcm.grow_blocks(ctx[i], new, pc.held[i], pc.n_full[i], ut, bs, pc.unit_blocks)
            assert need == ref.grow_blocks(i, ctx[i], new, bs) >= 0
            in_use += need
            freed = pcm.insert(pc, offsets, i, new)
            assert freed == ref.insert(i, new)
            in_use -= freed
            ctx[i] = new
        elif op in ("release", "release_own") and i in ctx:
            private = pcm.private_blocks(ctx.pop(i), pc.held[i], ut, bs)
            if op == "release_own" and keep:  # vLLM: blocks past its prefix stay cached, idle, ahead of it
                pcm.keep_tail(pc, offsets, i, x % (private + 1))
                ref.keep_tail(i, x % (private + 1))
            in_use -= private
            idle = pcm.release(pc, offsets, i)
            assert idle == ref.release(i)
            in_use -= idle
        elif op == "evict":
            # Evicting turns idle entries into plain free blocks: already counted free.
            assert pcm.evict(pc, x % 50) == ref.evict(x % 50)
        assert list(pc.held) == ref.held and list(pc.copies) == ref.copies
        assert pcm.cache_blocks(pc) == ref.cache_blocks()
        private = sum(pcm.private_blocks(c, pc.held[r], ut, bs) for r, c in ctx.items())
        copies = [pcm.held_copy_blocks(pc, r) for r in range(len(hashes))]
        assert copies == [ref.held_copy_blocks(r) for r in range(len(hashes))]
        cached, evictable = pcm.cache_blocks(pc)
        assert in_use == private + cached - evictable + sum(copies), "KV ledger out of balance"
        assert np.all(pc.refs >= 0) and np.all(pc.refs[~pc.cached] == 0)
    s = pc.stats
    assert (s[pcm.S_INSERTS], s[pcm.S_DEDUPS], s[pcm.S_EVICTIONS]) == (ref.inserts, ref.dedups, ref.evictions)


def test_requests_sharing_one_prefix_hit_after_the_first():
    hashes = [[11, 12, 13]] * 4
    pc, _, offsets, prompts = _cache(hashes, [3 * BT + 10] * 4, 16)
    first = pcm.match(pc, offsets, prompts, 0, prompts[0])
    assert first == (0, 0, 0)
    pcm.acquire(pc, offsets, 0, 0)
    pcm.insert(pc, offsets, 0, 3 * BT + 10)
    for i in (1, 2, 3):
        k, tokens, idle = pcm.match(pc, offsets, prompts, i, prompts[i])
        assert (k, tokens, idle) == (3, 3 * BT, 0)
        pcm.acquire(pc, offsets, i, k)
    assert list(pc.refs[pc.cached]) == [4, 4, 4]


def test_full_prompt_hit_computes_one_token_without_a_new_block():
    pc, _, offsets, prompts = _cache([[5, 6], [5, 6]], [2 * BT, 2 * BT], 16)
    pcm.acquire(pc, offsets, 0, 0)
    pcm.insert(pc, offsets, 0, 2 * BT)
    k, tokens, _ = pcm.match(pc, offsets, prompts, 1, prompts[1])
    assert (k, tokens) == (2, 2 * BT - 1)
    pcm.acquire(pc, offsets, 1, k)
    assert pcm.grow_blocks(tokens, 2 * BT, k, 2, BT, 16, pc.entry_blocks) == 0
    assert pcm.grow_blocks(2 * BT, 2 * BT + 1, k, 2, BT, 16, pc.entry_blocks) == 1


def test_partial_tail_block_is_never_cached():
    pc, _, offsets, prompts = _cache([[7, 8], [7, 8]], [BT + 30, BT + 30], 16)
    pcm.acquire(pc, offsets, 0, 0)
    pcm.insert(pc, offsets, 0, BT + 30)
    assert pcm.match(pc, offsets, prompts, 1, prompts[1])[:2] == (1, BT)


def test_lru_evicts_least_recently_released_and_chain_tails_first():
    pc, _, offsets, prompts = _cache([[1, 2], [3, 4]], [2 * BT, 2 * BT], 64)
    for i in (0, 1):
        pcm.acquire(pc, offsets, i, 0)
        pcm.insert(pc, offsets, i, 2 * BT)
    pcm.release(pc, offsets, 0)
    pcm.release(pc, offsets, 1)
    assert pcm.evict(pc, 1) == 1  # one KV block per entry at kv_block_size = BT
    assert pcm.match(pc, offsets, prompts, 0, prompts[0])[0] == 1, "request 0's tail went first"
    assert pcm.match(pc, offsets, prompts, 1, prompts[1])[0] == 2
    assert pcm.evict(pc, 100) == 3, "eviction stops when nothing is idle"


def test_an_entry_is_evicted_a_block_at_a_time_and_its_head_still_hits():
    pc, ref, offsets, prompts = _cache([[1, 2], [1, 2]], [2 * BT + 5] * 2, 16)
    pcm.insert(pc, offsets, 0, 2 * BT)
    ref.insert(0, 2 * BT)
    pcm.release(pc, offsets, 0)
    ref.release(0)
    assert pcm.evict(pc, 1) == ref.evict(1) == 1
    assert pcm.match(pc, offsets, prompts, 1, prompts[1]) == ref.match(1, prompts[1]) == (1, BT, pc.entry_blocks)
    assert pcm.partial_blocks(pc, offsets, 1, 1) == ref.partial_blocks(1, 1) == pc.entry_blocks - 1
    pcm.acquire(pc, offsets, 1, 1)
    pcm.take_partial(pc, offsets, 1, 1)
    assert pcm.cache_blocks(pc) == (pc.entry_blocks, 0), "the head it took is its own now"
    assert pcm.insert(pc, offsets, 1, 2 * BT) == 0 and pcm.match(pc, offsets, prompts, 0, prompts[0])[0] == 2


def test_referenced_entries_are_never_evicted():
    pc, _, offsets, prompts = _cache([[1, 2], [1, 2]], [2 * BT + 1] * 2, 16)
    pcm.acquire(pc, offsets, 0, 0)
    pcm.insert(pc, offsets, 0, 2 * BT)
    assert pcm.evict(pc, 10**6) == 0
    pcm.release(pc, offsets, 0)
    k, _, idle = pcm.match(pc, offsets, prompts, 1, prompts[1])
    assert (k, idle) == (2, 2 * pc.entry_blocks)
    pcm.acquire(pc, offsets, 1, k)
    assert pcm.cache_blocks(pc) == (2 * pc.entry_blocks, 0)


def test_dedup_onto_an_idle_entry_frees_nothing():
    """Request 1 computes the block request 0 cached and released meanwhile: the idle
    entry already counted as free, so taking it back nets the pool to zero (it was a
    double free); onto a referenced entry the request's copy is freed."""
    pc, ref, offsets, _ = _cache([[9], [9], [9]], [BT] * 3, 16)
    assert pcm.insert(pc, offsets, 0, BT) == ref.insert(0, BT) == 0
    assert pcm.release(pc, offsets, 0) == ref.release(0) == pc.entry_blocks
    assert pcm.insert(pc, offsets, 1, BT) == ref.insert(1, BT) == 0
    assert pcm.insert(pc, offsets, 2, BT) == ref.insert(2, BT) == pc.entry_blocks
    assert pc.stats[pcm.S_EVICTABLE] == 0 and pc.refs[pc.cached].tolist() == [2]
    assert not ref.idle and ref.refs == {9: 2}


def test_own_run_goes_before_the_prefix_it_follows_and_tail_first():
    """vLLM frees a request's blocks tail first: its own blocks are evicted before its prefix
    entries, a block at a time, and what survives is the run's head."""
    pc, ref, offsets, prompts = _cache([[1, 2], [1, 2]], [2 * BT + 100] * 2, 16)
    pcm.acquire(pc, offsets, 0, 0)
    pcm.insert(pc, offsets, 0, 2 * BT + 100)
    pcm.keep_tail(pc, offsets, 0, 6)
    pcm.release(pc, offsets, 0)
    assert pcm.cache_blocks(pc) == (2 * pc.entry_blocks + 6, 2 * pc.entry_blocks + 6)
    assert pcm.evict(pc, 4) == 4 and pcm.own_blocks(pc, 0) == 2, "own blocks first, one at a time"
    assert pcm.match(pc, offsets, prompts, 1, prompts[1])[0] == 2, "its prefix is untouched"
    assert pcm.evict(pc, 3) == 3, "then the run's head, then the tail block of the prefix's last entry"
    assert pcm.own_blocks(pc, 0) == 0 and pcm.match(pc, offsets, prompts, 1, prompts[1])[0] == 1
    assert pcm.partial_blocks(pc, offsets, 1, 1) == pc.entry_blocks - 1, "a lookup still hits the entry's head"
    assert pcm.evict(pc, pc.entry_blocks) == pc.entry_blocks and pc.stats[pcm.S_EVICTIONS] == 1
    assert pcm.partial_blocks(pc, offsets, 1, 1) == 0, "own runs are not counted as entry evictions"


def test_a_copy_of_a_held_block_is_kept_until_its_request_lets_go():
    """vLLM keeps a block two requests computed at once twice under one hash: the second
    request's copy is its own until it lets go, when it joins the idle blocks; SGLang frees
    the duplicate at once and the request references the entry."""
    for keep in (False, True):
        pc, ref, offsets, _ = _cache([[9], [9]], [BT + 1] * 2, 16, keep=keep)
        freed = 0 if keep else pc.entry_blocks
        pcm.insert(pc, offsets, 0, BT)
        ref.insert(0, BT)
        assert pcm.insert(pc, offsets, 1, BT) == ref.insert(1, BT) == freed
        assert pc.copies[1] == ref.copies[1] == (pc.entry_blocks if keep else 0)
        assert pc.refs[pc.cached].tolist() == [1 if keep else 2], "a copy's holder does not reference the entry"
        assert pcm.release(pc, offsets, 1) == ref.release(1) == (pc.entry_blocks if keep else 0)
        assert pc.copies[1] == 0
        assert pcm.cache_blocks(pc) == ref.cache_blocks() == ((2 if keep else 1) * pc.entry_blocks,
                                                              pc.entry_blocks if keep else 0)


def _leapfrog(hashes, prompts):
    """Request 0 computes the chain first; request 1 computes it again while 0 holds it."""
    pc, ref, offsets, prompts = _cache(hashes, prompts, 16, keep=True)
    for r in (0, 1):
        assert pcm.insert(pc, offsets, r, len(hashes[r]) * BT) == ref.insert(r, len(hashes[r]) * BT) == 0
    return pc, ref, offsets, prompts


def test_the_entry_goes_idle_when_its_hitters_let_go_while_a_copy_is_held():
    """vLLM's ref counts are per block (vllm/v1/core/block_pool.py:816-849): the first
    computer's blocks are free once it lets go, though request 1 still holds its copy."""
    pc, ref, offsets, prompts = _leapfrog([[9], [9], [9]], [BT + 1] * 3)
    assert pcm.release(pc, offsets, 0) == ref.release(0) == pc.entry_blocks
    assert pcm.cache_blocks(pc) == ref.cache_blocks() == (pc.entry_blocks, pc.entry_blocks)
    assert pcm.match(pc, offsets, prompts, 2, prompts[2]) == ref.match(2, prompts[2]) == (PER, BT, pc.entry_blocks), \
        "a lookup hits the oldest copy, idle, and pays for it"


def test_a_surviving_copy_takes_the_place_of_an_evicted_entry():
    """Once the oldest copy of a hash is evicted, lookups hit the next oldest
    (vllm/v1/core/block_pool.py:63-72, 102-128): held by request 1, it costs a hitter nothing."""
    pc, ref, offsets, prompts = _leapfrog([[9], [9], [9]], [BT + 1] * 3)
    pcm.release(pc, offsets, 0)
    ref.release(0)
    assert pcm.evict(pc, pc.entry_blocks) == ref.evict(pc.entry_blocks) == pc.entry_blocks
    assert pc.stats[pcm.S_EVICTIONS] == ref.evictions == 0, "the hash is still cached"
    assert pcm.match(pc, offsets, prompts, 2, prompts[2]) == ref.match(2, prompts[2]) == (PER, BT, 0)
    assert pcm.held_copy_blocks(pc, 1) == 0 and pc.refs[pc.cached].tolist() == [1], "request 1 holds the entry now"
    assert pcm.release(pc, offsets, 1) == ref.release(1) == pc.entry_blocks
    assert pcm.evict(pc, 100) == ref.evict(100) == pc.entry_blocks and pc.stats[pcm.S_EVICTIONS] == PER


def test_an_idle_copy_takes_its_own_place_in_the_lru_order():
    """A promoted idle copy keeps the place its holder's release gave it, behind blocks
    released after the evicted entry."""
    pc, ref, offsets, prompts = _leapfrog([[9], [9], [5], [9]], [BT + 1] * 4)
    pcm.release(pc, offsets, 0)  # the entry, idle first
    pcm.release(pc, offsets, 1)  # then the copy
    pcm.insert(pc, offsets, 2, BT)
    pcm.release(pc, offsets, 2)  # then entry 5
    ref.release(0)
    ref.release(1)
    ref.insert(2, BT)
    ref.release(2)
    assert pcm.evict(pc, pc.entry_blocks) == ref.evict(pc.entry_blocks)
    assert pcm.match(pc, offsets, prompts, 3, prompts[3]) == ref.match(3, prompts[3]) == (PER, BT, pc.entry_blocks), \
        "the copy still hits"
    assert pcm.evict(pc, pc.entry_blocks) == ref.evict(pc.entry_blocks)
    assert pcm.match(pc, offsets, prompts, 3, prompts[3])[0] == ref.match(3, prompts[3])[0] == 0, \
        "the copy went next, before entry 5"
    assert pcm.match(pc, offsets, prompts, 2, prompts[2])[0] == PER


def test_a_request_frees_its_copies_and_entries_deepest_first():
    """vLLM frees a request's blocks in reverse chain order (single_type_kv_cache_manager.py:
    591-599), copies and entries interleaved: the deepest goes into the free queue first."""
    hashes = [[1, 2, 3], [1, 2, 3]]
    pc, ref, offsets, prompts = _cache(hashes, [3 * BT + 1] * 2, 16, keep=True)
    pcm.insert(pc, offsets, 0, 2 * BT)  # request 0 computes entries 1 and 2
    ref.insert(0, 2 * BT)
    pcm.insert(pc, offsets, 1, 3 * BT)  # request 1: copies of 1 and 2, then entry 3
    ref.insert(1, 3 * BT)
    pcm.release(pc, offsets, 1)
    ref.release(1)
    eb = pc.entry_blocks
    for left in (2, 1, 0):  # entry 3, then the copy of 2, then the copy of 1
        assert pcm.evict(pc, eb) == ref.evict(eb) == eb
        assert pcm.cache_blocks(pc) == ref.cache_blocks() == ((2 + left) * eb, left * eb)
    assert pcm.match(pc, offsets, prompts, 1, prompts[1])[0] == ref.match(1, prompts[1])[0] == 2 * PER, \
        "request 0's entries 1 and 2 stay"


def test_a_copy_beyond_the_pool_is_refused_not_written_past_it():
    offsets = np.array([0, 1, 2, 3], dtype=np.int64)
    pc = pcm.new_prefix_cache(offsets, np.full(3, 9, dtype=np.int64), np.full(3, BT + 1, dtype=np.int64), BT, 16,
                              keep_copies=True, pool=1)
    pcm.insert(pc, offsets, 0, BT)
    pcm.insert(pc, offsets, 1, BT)  # the pool's one column
    with pytest.raises(RuntimeError, match="pool holds"):
        pcm.insert(pc, offsets, 2, BT)


def test_caching_off_grow_is_plain_block_arithmetic():
    for old, new, bs in [(0, 1, 16), (15, 17, 16), (0, 1000, 7), (33, 33, 4)]:
        expected = -(-new // bs) - -(-old // bs)
        assert pcm.grow_blocks(old, new, 0, 0, 512, bs, 32) == expected


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block_tokens"):
        pcm.new_prefix_cache(np.zeros(2, np.int64), np.zeros(0, np.int64), np.ones(1, np.int64), 0, 16)


def test_clear_returns_a_used_cache_to_empty():
    """A replica that fails loses its cache: ``clear`` leaves exactly a fresh cache."""
    pc, _, offsets, prompts = _cache([[1, 2, 3], [1, 2, 4]], [3 * BT + 5, 3 * BT + 5], 16, keep=True)
    fresh, _, _, _ = _cache([[1, 2, 3], [1, 2, 4]], [3 * BT + 5, 3 * BT + 5], 16, keep=True)
    pcm.acquire(pc, offsets, 0, 0)
    pcm.insert(pc, offsets, 0, 3 * BT)
    k, _, _ = pcm.match(pc, offsets, prompts, 1, prompts[1])
    pcm.acquire(pc, offsets, 1, k)
    pcm.release(pc, offsets, 0)
    assert pc.stats[pcm.S_CACHED] == 3 * pc.entry_blocks and pc.held[1] == 2 * PER
    pcm.insert(pc, offsets, 0, 3 * BT)  # request 0 computes its chain again: three copies
    pcm.insert(pc, offsets, 1, 2 * BT + 40)  # request 1 computes the head of its third entry: a node of two units
    pcm.acquire(pc, offsets, 0, 0)
    assert pc.stats[pcm.S_POOL_NEXT] > pc.n_entries + 2
    pcm.clear(pc, fresh.n_full // fresh.per_entry)
    fixed = pc.n_entries + 2  # the pool's columns and rows are written only as they are taken
    for a, b in ((pc.req, fresh.req), (pc.tab[:pcm.E_ENTRY, :fixed], fresh.tab[:pcm.E_ENTRY, :fixed]),
                 (pc.stats, fresh.stats), (pc.units, fresh.units)):
        np.testing.assert_array_equal(a, b)
    assert pcm.match(pc, offsets, prompts, 1, prompts[1]) == (0, 0, 0)


def test_a_request_hits_the_head_of_a_block_another_is_still_computing():
    """vLLM caches each 16-token block as it is scheduled (vllm/v1/core/kv_cache_manager.py:
    616-625): a request admitted while another computes a shared hash block in chunks hits the
    blocks scheduled so far, and both then compute the rest; the first to schedule a block
    holds it, the other a copy (the held-out parity fixtures ``burst-pc-leapfrog-b2048`` and
    others show the whole pattern)."""
    pc, ref, offsets, prompts = _cache([[7, 8], [7, 8], [7, 8]], [2 * BT + 3] * 3, 16, keep=True)
    assert pcm.insert(pc, offsets, 0, 40) == ref.insert(0, 40) == 0  # two full blocks of entry 7, and a part
    assert pc.tab[pcm.E_CACHED, 0] == 2, "one node, growing with its computer"
    assert pcm.match(pc, offsets, prompts, 1, prompts[1]) == ref.match(1, prompts[1]) == (2, 32, 0)
    assert pcm.acquire(pc, offsets, 1, 2) == ref.acquire(1, 2) == 0
    pcm.insert(pc, offsets, 0, BT)  # the holders part ways: the entry is split into its units
    ref.insert(0, BT)
    assert pc.tab[pcm.E_CACHED, 0] == pcm.SPLIT and pc.tab[pcm.E_SPLIT, 0] == PER
    pcm.insert(pc, offsets, 1, BT + 16)  # request 1 computes blocks 2-3 again (copies), then 8's first
    ref.insert(1, BT + 16)
    assert pcm.held_copy_blocks(pc, 1) == ref.held_copy_blocks(1) == 2
    assert pcm.match(pc, offsets, prompts, 2, prompts[2]) == ref.match(2, prompts[2]) == (PER + 1, BT + 16, 0)
    for r in (0, 1):
        assert pcm.release(pc, offsets, r) == ref.release(r)
        assert pcm.cache_blocks(pc) == ref.cache_blocks()
    for _ in range(PER + 3):  # entry 7's units, the two copies, entry 8's block
        assert pcm.evict(pc, 1) == ref.evict(1) == 1
        assert pcm.match(pc, offsets, prompts, 2, prompts[2]) == ref.match(2, prompts[2])
    assert pc.tab[pcm.E_CACHED, 0] == 0 and pcm.cache_blocks(pc) == (0, 0), "whole again once nothing is cached"


def test_a_prompt_computed_in_chunks_leaves_whole_entries():
    """A request computing a long prompt alone, in chunks that end inside hash blocks, leaves
    one node per block: the fast path stays the common one."""
    pc, ref, offsets, prompts = _cache([[1, 2, 3]], [3 * BT + 7], 16, keep=True)
    for ctx in (23, 70, 100, 3 * BT + 7):
        pcm.insert(pc, offsets, 0, ctx)
        ref.insert(0, ctx)
    assert list(pc.tab[pcm.E_CACHED, :3]) == [PER] * 3
    assert pc.stats[pcm.S_POOL_NEXT] == pc.n_entries + 1 and pcm.cache_blocks(pc) == ref.cache_blocks()


def test_a_fully_cached_prompt_computes_its_last_block_again():
    """vLLM hits at most ``(tokens - 1) // block_size`` blocks: a prompt of whole blocks, all
    cached, computes its last block anew (vllm/v1/core/kv_cache_manager.py
    ``get_computed_blocks``); a request that generated tokens before a preemption hits them all."""
    pc, ref, offsets, prompts = _cache([[5], [5]], [BT, BT], 16, keep=True)
    pcm.insert(pc, offsets, 0, BT)
    ref.insert(0, BT)
    assert pcm.match(pc, offsets, prompts, 1, BT) == ref.match(1, BT) == (PER - 1, BT - 16, 0)
    assert pcm.match(pc, offsets, prompts, 1, BT + 1)[0] == PER
