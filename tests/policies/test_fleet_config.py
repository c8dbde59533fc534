"""Fleet knobs in PolicyConfig: defaults keep today's behaviour, validation, packing, flags."""

import pytest

from policies.config import (
    FLEET_KNOBS,
    KNOB_BY_NAME,
    ConfigError,
    PolicyConfig,
    active_fleet_knobs,
    check_fleet,
)
from policies.engines import ENGINES, EngineContext, preset, target

FLEET = dict(router="consistent_hash", router_cache_threshold=0.7, router_balance_abs=8, router_balance_rel=2.5,
             router_queue_weight=0.25, hash_virtual_nodes=64, hash_prefix_blocks=3, hash_by_tenant=True,
             hash_overflow_factor=2.0, migration=True, migration_threshold=6.5, migration_interval_s=0.2,
             migration_pause_ms=10.0, interconnect_gbps=400.0, prefill_replicas=2)


def test_defaults_are_round_robin_with_nothing_moving():
    config = PolicyConfig()
    assert (config.router, config.migration, config.prefill_replicas) == ("round_robin", False, 0)
    # the sglang-router defaults (0.3.2) and the contract's ring
    assert (config.router_cache_threshold, config.router_balance_abs, config.router_balance_rel) == (0.3, 64, 1.5)
    assert (config.hash_virtual_nodes, config.hash_overflow_factor) == (160, 1.25)
    h100 = EngineContext("h100", 80.0)
    # each engine routes its data-parallel replicas its own way; nothing else moves
    vllm, sglang = preset("vllm-default", h100), preset("sglang-default", h100)
    assert (vllm.router, sglang.router) == ("vllm_dp", "round_robin")  # SGLang's "auto" is round_robin
    for defaults in (vllm, sglang):
        assert all(getattr(defaults, name) == getattr(config, name) for name in FLEET_KNOBS if name != "router")


def test_fleet_values_round_trip_through_vector_and_toml():
    config = PolicyConfig(**FLEET)
    assert set(FLEET) == set(FLEET_KNOBS)
    assert PolicyConfig.from_vector(config.to_vector()) == config
    assert PolicyConfig.from_toml(config.to_toml()) == config
    assert config.to_vector()[KNOB_BY_NAME["router"].index] == 5  # position in ROUTERS


@pytest.mark.parametrize("change, message", [
    ({"router": "random"}, "router must be one of"),
    ({"router_cache_threshold": 1.5}, r"router_cache_threshold must be in \[0, 1\]"),
    ({"router_balance_rel": 0.5}, "router_balance_rel must be in"),
    ({"hash_virtual_nodes": 0}, "hash_virtual_nodes must be in"),
    ({"interconnect_gbps": 0.0}, "interconnect_gbps must be in"),
    ({"prefill_replicas": -1}, "prefill_replicas must be in"),
    ({"migration": "yes"}, "migration must be true or false"),
])
def test_bad_fleet_values_name_the_knob(change, message):
    with pytest.raises(ConfigError, match=message):
        PolicyConfig(**change)


def test_check_fleet_against_the_replica_count():
    check_fleet(PolicyConfig(prefill_replicas=3), 4)
    check_fleet(PolicyConfig(prefill_replicas=3), 1)  # one replica ignores the fleet knobs
    check_fleet(PolicyConfig(router="cache_aware"), 64)
    with pytest.raises(ConfigError, match="prefill_replicas=4 leaves no decode replica among 4; give at most 3"):
        check_fleet(PolicyConfig(prefill_replicas=4), 4)
    with pytest.raises(ConfigError, match="tracks at most 64 replicas, got 65"):
        check_fleet(PolicyConfig(router="cache_aware"), 65)
    with pytest.raises(ConfigError, match="replicas must be an integer"):
        check_fleet(PolicyConfig(), 0)


def test_active_fleet_knobs_follow_the_router_migration_and_pd():
    assert active_fleet_knobs(PolicyConfig()) == ("router",)
    assert active_fleet_knobs(PolicyConfig(router="cache_aware")) == (
        "router", "router_cache_threshold", "router_balance_abs", "router_balance_rel")
    assert active_fleet_knobs(PolicyConfig(router="unified", prefill_replicas=1)) == (
        "router", "router_queue_weight", "prefill_replicas", "interconnect_gbps")
    assert "hash_by_tenant" in active_fleet_knobs(PolicyConfig(router="consistent_hash"))
    assert active_fleet_knobs(PolicyConfig(migration=True))[1:] == (
        "migration", "migration_threshold", "migration_interval_s", "migration_pause_ms", "interconnect_gbps")


def test_sglang_router_flags_are_recorded_and_no_engine_flag_is_claimed():
    flags = {name: KNOB_BY_NAME[name].router for name in FLEET_KNOBS if KNOB_BY_NAME[name].router}
    assert flags == {"router": "policy", "router_cache_threshold": "cache-threshold",
                     "router_balance_abs": "balance-abs-threshold", "router_balance_rel": "balance-rel-threshold"}
    # the only fleet knob an engine flag drives is the router of its own data-parallel replicas
    # (SGLang's --load-balance-method); thresholds, migration and P/D pools are no engine's flag
    claimed = {(name, flag.key): flag.knob for name in ENGINES for flag in target(name).flags
               if flag.knob in FLEET_KNOBS}
    assert claimed == {("sglang", "load-balance-method"): "router"}
