"""Fleet knobs in the search space: searched only on more than one replica, each under its parent."""

import optuna
import pytest

from optimizer.search.space import Fleet, SpaceError, build_space
from policies.config import FLEET_KNOBS, ROUTERS, PolicyConfig
from policies.engines import EngineContext, preset


def vllm_default() -> PolicyConfig:
    return preset("vllm-default", EngineContext("h100", 80.0))

optuna.logging.set_verbosity(optuna.logging.WARNING)

CHILDREN = {
    "router_cache_threshold": ("router", "cache_aware"), "router_balance_abs": ("router", "cache_aware"),
    "router_balance_rel": ("router", "cache_aware"), "router_queue_weight": ("router", "unified"),
    "hash_virtual_nodes": ("router", "consistent_hash"), "hash_prefix_blocks": ("router", "consistent_hash"),
    "hash_by_tenant": ("router", "consistent_hash"), "hash_overflow_factor": ("router", "consistent_hash"),
    "migration_threshold": ("migration", True), "migration_interval_s": ("migration", True),
}


def sampled(space, n=120, seed=0):
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out = []
    for _ in range(n):
        trial = study.ask()
        config = space.suggest(trial)
        out.append((config, space.suggest_fleet(trial), dict(trial.params)))
        study.tell(trial, 0.0)
    return out


def test_one_replica_searches_no_fleet_knob():
    for config, _, params in sampled(build_space(), n=30):
        assert not set(params) & {*FLEET_KNOBS, "prefill_replicas:on"}
        assert all(getattr(config, name) == getattr(PolicyConfig(), name) for name in FLEET_KNOBS)


def test_a_fleet_searches_the_router_and_each_knob_only_under_its_parent():
    runs = sampled(build_space(fleet=Fleet(replicas=4)))
    for config, _, params in runs:
        assert "router" in params and "migration" in params and "prefill_replicas:on" in params
        for child, (parent, value) in CHILDREN.items():
            assert (child in params) == (getattr(config, parent) == value), child
        assert 0 <= config.prefill_replicas <= 3
        assert "migration_pause_ms" not in params and "interconnect_gbps" not in params  # hardware, fixed
    # the what-if space searches every router, the engines' own (vllm_dp, SGLang's DP methods) included
    assert {c.router for c, _, _ in runs} == set(ROUTERS)
    assert {c.prefill_replicas for c, _, _ in runs} == {0, 1, 2, 3}


def test_searched_replicas_gate_the_fleet_knobs_and_bound_prefill_replicas():
    runs = sampled(build_space({"replicas": {"low": 1, "high": 3}}), n=80)
    assert {f.replicas for _, f, _ in runs} == {1, 2, 3}
    for config, fleet, params in runs:
        assert ("router" in params) == (fleet.replicas > 1)
        assert config.prefill_replicas <= fleet.replicas - 1


def test_a_trial_rebuilt_from_its_params_gives_the_same_config():
    space = build_space({"replicas": {"low": 1, "high": 4}})
    for config, fleet, params in sampled(space, n=40, seed=3):
        fixed = optuna.trial.FixedTrial(params)
        assert space.suggest(fixed) == config and space.suggest_fleet(fixed) == fleet


def test_baselines_on_a_fleet_record_their_fleet_knobs():
    space = build_space(fleet=Fleet(replicas=4))
    params = space.params_for(vllm_default())
    assert params["router"] == "vllm_dp" and params["migration"] is False  # vLLM routes its DP replicas itself
    assert params["prefill_replicas:on"] is False
    assert "router" not in build_space().params_for(vllm_default())
    # a P/D split the trial's fleet cannot hold is left out rather than recorded falsely
    assert "prefill_replicas" not in space.params_for(vllm_default().replace(prefill_replicas=5))


def test_describe_and_overrides_of_fleet_knobs():
    described = dict(build_space().describe())
    assert described["router"].endswith("when replicas > 1")
    assert "when router in ['cache_aware'] when replicas > 1" in described["router_cache_threshold"]
    assert "(high at most replicas - 1)" in described["prefill_replicas"]
    space = build_space({"router": {"choices": ["cache_aware", "unified"]}}, fleet=Fleet(replicas=2))
    assert {c.router for c, _, _ in sampled(space, n=20)} == {"cache_aware", "unified"}
    with pytest.raises(SpaceError, match=r"\[space.prefill_replicas\]: give a range"):
        build_space({"prefill_replicas": {"choices": [0, 1]}})
