"""Cache identity: a cached block is reused only by a request of the same ``cache_salt``
(its security domain), on one replica and across a fleet's ring."""

import numpy as np
import pytest

from policies import engine
from policies.config import PolicyConfig
from policies.fleet import simulate_fleet
from studies.formats import native
from studies.traces import load_trace, write_trace
from studies.transforms import concat_as_tenants

from .conftest import cost_model, make_trace

CONFIG = PolicyConfig(gpu_memory_utilization=1.0, max_num_batched_tokens=2048, block_size=16)
SHARED = [11, 12, 13, 14]  # four 512-token blocks every request's prompt starts with


def _salted(trace, salts):
    names = tuple(dict.fromkeys(salts))
    return trace.replace(cache_salt=np.array([names.index(s) for s in salts], dtype=np.int32), cache_salt_names=names)


def _same_prompts(n):
    """n requests 1 s apart, each a 2,100-token prompt on the same four hash blocks."""
    return make_trace(np.arange(n) * 1.0, np.full(n, 2100), np.full(n, 8), hashes=[SHARED] * n)


def test_a_block_is_shared_within_a_salt_and_never_across_salts():
    trace = _salted(_same_prompts(4), ["acme", "globex", "acme", ""])
    result = engine.simulate(trace, cost_model(40_000), CONFIG)
    # acme's second request hits acme's blocks; globex and the unsalted one find nothing
    assert list(result.cached_prompt_tokens) == [0, 0, 2048, 0]
    plain = engine.simulate(_same_prompts(4), cost_model(40_000), CONFIG)
    assert list(plain.cached_prompt_tokens) == [0, 2048, 2048, 2048]


def test_salting_is_exactly_giving_each_salt_its_own_block_ids():
    """The engine run with salts equals the run where every salt's blocks were renamed
    apart by hand, request for request (the salt acts only on identity)."""
    n = 12
    rng = np.random.default_rng(3)
    salts = [["", "a", "b"][k] for k in rng.integers(0, 3, n)]
    hashes = [SHARED[: int(rng.integers(1, 5))] for _ in range(n)]
    base = make_trace(np.sort(rng.uniform(0, 5, n)), np.full(n, 2100), rng.integers(1, 60, n), hashes=hashes)
    renamed = make_trace(base.arrival_s, base.prompt_tokens, base.output_tokens,
                         hashes=[[h + 1000 * "_ab".index(s or "_") for h in hs] for hs, s in zip(hashes, salts, strict=True)])
    salted = engine.simulate(_salted(base, salts), cost_model(40_000), CONFIG)
    by_hand = engine.simulate(renamed, cost_model(40_000), CONFIG)
    for name in ("cached_prompt_tokens", "first_token_s", "finish_s"):
        np.testing.assert_array_equal(getattr(salted, name), getattr(by_hand, name), err_msg=name)
    assert salted.cached_prompt_tokens.sum() > 0


def test_cache_block_hashes_leave_unsalted_requests_alone_and_are_stable():
    trace = _salted(_same_prompts(3), ["", "x", "x"])
    keyed = trace.cache_block_hashes
    blocks = trace.block_offsets
    np.testing.assert_array_equal(keyed[blocks[0]:blocks[1]], SHARED)
    np.testing.assert_array_equal(keyed[blocks[1]:blocks[2]], keyed[blocks[2]:blocks[3]])
    assert not set(keyed[blocks[1]:blocks[2]]) & set(SHARED)
    # a salt's value depends on its name only, not on its code in this trace
    again = _salted(_same_prompts(3), ["x", "", "x"])
    np.testing.assert_array_equal(again.cache_block_hashes[blocks[0]:blocks[1]], keyed[blocks[1]:blocks[2]])


def test_the_ring_keys_cross_domain_requests_apart():
    """Consistent hashing on the prefix: one domain's requests all land on one replica, and
    the other domain's requests, with the same prompts, never hit the first one's blocks."""
    n = 24
    salts = ["red" if i % 2 else "blue" for i in range(n)]
    trace = _salted(_same_prompts(n).replace(arrival_s=np.arange(n) * 0.5), salts)
    config = CONFIG.replace(router="consistent_hash")
    result = simulate_fleet(trace, cost_model(40_000), config, replicas=4)
    for salt in ("red", "blue"):
        rows = np.flatnonzero(np.array(salts) == salt)
        assert len(set(result.replica[rows])) == 1, f"{salt}'s requests share one replica"
        # only the domain's first request computes the shared prefix
        assert (result.cached_prompt_tokens[rows] == 0).sum() == 1


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".jsonl"])
def test_cache_salt_round_trips_through_native_files(tmp_path, suffix):
    trace = _salted(_same_prompts(3), ["", "acme", "globex"])
    back = load_trace(write_trace(trace, tmp_path / f"t{suffix}"))
    assert list(back.cache_salt_labels) == ["", "acme", "globex"]
    np.testing.assert_array_equal(back.cache_block_hashes, trace.cache_block_hashes)
    unsalted = load_trace(write_trace(_same_prompts(2), tmp_path / f"u{suffix}"))
    assert unsalted.cache_salt_names == ("",) and "cache_salt" in native.COLUMNS


def test_merged_traces_keep_each_requests_salt():
    a = _salted(_same_prompts(2), ["s1", ""])
    b = _salted(_same_prompts(2), ["s2", "s1"])
    merged = concat_as_tenants([("a", a), ("b", b)], share_prefixes=True)
    by_tenant = {(t, s) for t, s in zip(merged.tenant_labels, merged.cache_salt_labels, strict=True)}
    assert by_tenant == {("a", "s1"), ("a", ""), ("b", "s2"), ("b", "s1")}
