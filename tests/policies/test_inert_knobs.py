"""Knobs that change nothing under a config are never listed as a change."""

from policies.config import FLEET_KNOBS, PolicyConfig, inert_knobs


def test_a_knob_without_its_parent_is_inert():
    config = PolicyConfig(max_wait_action="admit_first", admission_quantile=0.6)
    inert = inert_knobs(config)
    assert {"max_wait_action", "admission_quantile", "schedule_conservativeness"} <= inert
    active = inert_knobs(config.replace(max_wait_s=5.0, admission_mode="predicted"))
    assert "max_wait_action" not in active and "admission_quantile" not in active


def test_fleet_knobs_act_only_across_replicas():
    config = PolicyConfig(router="cache_aware")
    assert set(FLEET_KNOBS) <= inert_knobs(config, replicas=1)
    assert {"router", "router_cache_threshold"}.isdisjoint(inert_knobs(config, replicas=4))
    assert "hash_virtual_nodes" in inert_knobs(config, replicas=4)


def test_inert_knobs_do_not_change_a_simulation():
    """What inert_knobs calls inert really changes nothing in the engine."""
    import numpy as np

    from costmodels.costmodel import CostModel
    from policies.engine import simulate
    from studies.traces import Trace

    n = 40
    trace = Trace.from_columns(np.arange(n) * 0.01, np.full(n, 200), np.full(n, 30), max_tokens=np.full(n, 64))
    base = PolicyConfig(max_num_seqs=8)
    changed = base.replace(max_wait_action="admit_first", admission_quantile=0.6, aging_rate=3.0,
                           deadline_margin_ms=5.0, vtc_input_weight=7.0, num_speculative_tokens=9)
    assert {"max_wait_action", "admission_quantile", "aging_rate", "deadline_margin_ms", "vtc_input_weight",
            "num_speculative_tokens"} <= inert_knobs(changed)
    cost = CostModel.synthetic(100_000)
    a, b = simulate(trace, cost, base), simulate(trace, cost, changed)
    assert np.array_equal(a.finish_s, b.finish_s) and np.array_equal(a.first_token_s, b.first_token_s)
