"""Router exports: sglang-router flags in router.yaml, and engine headers that say routing is elsewhere."""

import pytest
import yaml

from optimizer.exports import (
    Deployment,
    ExportError,
    engine_args,
    engine_yaml,
    knobs_from_router_yaml,
    policy_toml,
    router_args,
    router_yaml,
)
from policies.config import PolicyConfig
from policies.presets import preset

# sglang-router 0.3.2 flags (serving-configs.md §3), checked independently of optimizer.exports.
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


def test_engine_headers_send_routing_to_router_yaml():
    config = preset("vllm-default").replace(router="cache_aware", router_cache_threshold=0.6, migration=True)
    vllm = engine_args(config, FLEET, "vllm")
    assert set(vllm.not_carried) == {"router", "router_cache_threshold", "migration"}
    assert vllm.not_carried["router"] == "'cache_aware': sglang-router --policy, in router.yaml"
    assert "simulated only" in vllm.not_carried["migration"]
    text = engine_yaml(config, FLEET, "vllm")
    assert "vLLM has no request router" in text and "router.yaml" in text
    assert not set(yaml.safe_load(text)) & {"policy", "cache-threshold", "router"}
    assert "not a flag of SGLang serve" in engine_yaml(config, FLEET, "sglang")
    # one replica: the fleet knobs act on nothing, so nothing is said about them
    single = Deployment("m")
    assert not engine_args(config.replace(migration=False), single, "vllm").not_carried
    assert "router.yaml" not in engine_yaml(config, single, "vllm")


def test_policy_toml_names_the_router_flags():
    text = policy_toml(PolicyConfig())
    lines = text.splitlines()
    comment = lines[lines.index('router = "round_robin"') - 1]
    assert "sglang-router --policy" in comment and "NOT EXPOSED" not in comment
    assert "NOT EXPOSED" in lines[lines.index("migration = false") - 1]


def test_bad_router_yaml_is_named():
    with pytest.raises(ExportError, match=r"unknown flag\(s\) \['worker-urls'\]"):
        knobs_from_router_yaml("worker-urls: [a]\npolicy: cache_aware\n")
    with pytest.raises(ExportError, match="top-level mapping"):
        knobs_from_router_yaml("- 1\n")
