"""Router exports: sglang-router flags in router.yaml (what-if fleets), and engine files that carry
only the engine's own data-parallel routing."""

import pytest
import yaml

from optimizer.outputs.exports import (
    Deployment,
    ExportError,
    engine_yaml,
    knobs_from_router_yaml,
    policy_toml,
    read_engine_file,
    router_args,
    router_yaml,
)
from policies.config import PolicyConfig, inert_knobs
from policies.engines import EngineContext, preset, target

# sglang-router 0.3.2 flags (serving-configs.md §3), checked independently of optimizer.outputs.exports.
ROUTER_032_KEYS = frozenset({"policy", "cache-threshold", "balance-abs-threshold", "balance-rel-threshold",
                             "eviction-interval-secs", "max-tree-size", "dp-aware", "max-payload-size",
                             "assignment-mode"})
FLEET = Deployment("meta-llama/Llama-3.1-8B", tp=1, replicas=4)


def test_cache_aware_router_yaml_carries_its_thresholds_and_round_trips():
    config = PolicyConfig(router="cache_aware", router_cache_threshold=0.55, router_balance_abs=16,
                          router_balance_rel=1.25)
    text = router_yaml(config, FLEET)
    data = yaml.safe_load(text)
    assert set(data) <= ROUTER_032_KEYS
    assert data == {"policy": "cache_aware", "cache-threshold": 0.55, "balance-abs-threshold": 16,
                    "balance-rel-threshold": 1.25}
    assert knobs_from_router_yaml(text) == {"router": "cache_aware", "router_cache_threshold": 0.55,
                                            "router_balance_abs": 16, "router_balance_rel": 1.25}
    assert ("--policy cache_aware --cache-threshold 0.55 --balance-abs-threshold 16 "
            "--balance-rel-threshold 1.25") in text
    assert "reads no config file" in text


def test_round_robin_needs_only_the_policy():
    assert router_args(PolicyConfig()).args == {"policy": "round_robin"}
    assert not router_args(PolicyConfig()).not_carried


@pytest.mark.parametrize("router", ["least_outstanding", "least_kv", "unified", "consistent_hash"])
def test_routers_sglang_router_lacks_are_named_not_invented(router):
    config = PolicyConfig(router=router)
    mapped = router_args(config)
    assert "policy" not in mapped.args and "router" in mapped.not_carried
    text = router_yaml(config, FLEET)
    assert yaml.safe_load(text) is None  # nothing to pass
    assert f"#   router = {router!r}: sglang-router's --policy accepts only" in text
    assert "routes by its default (cache_aware)" in text


def test_migration_and_pd_are_listed_as_simulated_only():
    config = PolicyConfig(router="cache_aware", migration=True, prefill_replicas=1)
    mapped = router_args(config)
    assert set(mapped.not_carried) == {"migration", "migration_threshold", "migration_interval_s",
                                       "migration_pause_ms", "prefill_replicas", "interconnect_gbps"}
    assert all("simulated only" in why for why in mapped.not_carried.values())


def test_engine_files_carry_only_the_engines_own_routing():
    ctx = EngineContext("h100", 80.0, context_len=131072)
    vllm, sglang = target("vllm"), target("sglang")
    # vLLM: data-parallel replicas sit behind its API server's own balancer; nothing migrates
    # and every replica prefills, whatever the what-if config asked for
    wish = preset("vllm-default", ctx).replace(router="cache_aware", router_cache_threshold=0.6, migration=True)
    runs = vllm.resolve(wish, ctx)
    assert (runs.router, runs.migration, runs.prefill_replicas) == ("vllm_dp", False, 0)
    text = engine_yaml(vllm, wish, FLEET, ctx)
    data = yaml.safe_load(text)
    assert data["data-parallel-size"] == 4
    assert not set(data) & {"policy", "cache-threshold", "router", "load-balance-method"}
    assert "router.yaml" not in text and "migration" not in text
    back, inert = read_engine_file(vllm, text, ctx), inert_knobs(runs, FLEET.replicas)
    assert "router_cache_threshold" in inert  # a cache-aware threshold acts on nothing behind vllm_dp
    assert {k: v for k, v in back.to_dict().items() if k not in inert} == {
        k: v for k, v in runs.to_dict().items() if k not in inert}
    # SGLang: --load-balance-method across its dp-size replicas, read back as the router
    config = preset("sglang-default", ctx).replace(router="total_tokens")
    text = engine_yaml(sglang, config, FLEET, ctx)
    data = yaml.safe_load(text)
    assert (data["dp-size"], data["load-balance-method"]) == (4, "total_tokens")
    assert read_engine_file(sglang, text, ctx).router == "total_tokens"
    # sglang-router's cache-aware policy is no flag of SGLang serve: refused, never written
    with pytest.raises(ExportError, match="load-balance-method"):
        engine_yaml(sglang, config.replace(router="cache_aware"), FLEET, ctx)
    # one replica: nothing to balance, so no flag
    assert "load-balance-method" not in yaml.safe_load(engine_yaml(sglang, config, Deployment("m"), ctx))


def test_policy_toml_names_the_router_flags():
    text = policy_toml(PolicyConfig())
    lines = text.splitlines()
    comment = lines[lines.index('router = "round_robin"') - 1]
    assert "sglang-router --policy" in comment and "NOT IN ANY ENGINE" not in comment
    assert "sglang --load-balance-method" in comment
    assert "NOT IN ANY ENGINE" in lines[lines.index("migration = false") - 1]


def test_bad_router_yaml_is_named():
    with pytest.raises(ExportError, match=r"unknown flag\(s\) \['worker-urls'\]"):
        knobs_from_router_yaml("worker-urls: [a]\npolicy: cache_aware\n")
    with pytest.raises(ExportError, match="top-level mapping"):
        knobs_from_router_yaml("- 1\n")
