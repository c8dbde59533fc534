"""Fleets in the tuner: failure plans, the spec's fleet flags, and how the evaluator runs fleets.

The evaluator tests use a recording fleet engine, so they check what is simulated (which
engine, which configs together, under which failure windows, cached under which key)
without the kernels; tests/optimizer/test_fleet_runs.py runs the real fleet kernel.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from optimizer.outputs.exports import Deployment
from optimizer.outputs.review import (
    ConfigFigures,
    ReviewInputs,
    build_review,
    routing_label,
    to_markdown,
)
from optimizer.search.evaluate import Evaluator
from optimizer.search.failplan import FailurePlan, compressed
from optimizer.search.space import Fleet
from optimizer.search.spec import SpecError, load_spec, spec_from_dict
from optimizer.search.targets import context_of
from policies.config import PolicyConfig
from policies.failures import FailureError, FailureSchedule
from studies.slo import parse_slo
from tests.optimizer.tuning_helpers import (
    FakeEngine,
    burst_cost_model,
    fake_score,
    make_trace,
    write_csv_trace,
)

#: model "m" is no built-in model: the engines' defaults are sized from the synthetic pool
BURST_CONTEXT = context_of(burst_cost_model(), "h100", context_len=0)

# -- failure plans ---------------------------------------------------------------------------------


def test_a_plan_is_windows_or_random_failures_and_round_trips():
    windows = FailurePlan.from_flags(fail="2@600:900,0@100:inf")
    assert windows.windows.rows() == [(0, 100.0, math.inf), (2, 600.0, 900.0)]
    assert FailurePlan.from_mapping(windows.to_dict()).windows.rows() == windows.windows.rows()
    random = FailurePlan.from_mapping({"mtbf_s": 3600, "repair_s": 300})
    assert (random.mtbf_s, random.repair_s, random.highest_replica) == (3600, 300, -1)
    assert FailurePlan.from_mapping(random.to_dict()) == random
    assert FailurePlan.from_flags() is None


@pytest.mark.parametrize(("make", "message"), [
    (lambda: FailurePlan.from_flags(fail="1@5:9", mtbf_s=10.0, repair_s=1.0), "not both"),
    (lambda: FailurePlan.from_flags(mtbf_s=10.0), "need both an MTBF and a repair time"),
    (lambda: FailurePlan.from_flags(mtbf_s=10.0, repair_s=-1.0), "repair_s must be a number of seconds > 0"),
    (lambda: FailurePlan.from_flags(fail="1@9:5"), r"t_up \('5'\) must be after t_down"),
    (lambda: FailurePlan.from_mapping({"windows": ["1@5:9"], "mttr": 3}), r"unknown key\(s\) \['mttr'\]"),
    (lambda: FailurePlan.from_mapping({"windows": []}), "window list is empty"),
])
def test_bad_plans_name_the_problem(make, message):
    with pytest.raises(FailureError, match=message):
        make()


def test_random_failures_are_seeded_per_replica_and_start_at_the_first_arrival():
    plan = FailurePlan(mtbf_s=50.0, repair_s=5.0)
    arrivals = np.linspace(1000.0, 1600.0, 50)
    four = plan.schedule(4, arrivals, seed=3)
    assert len(four) > 4 and four.t_down.min() >= 1000.0 and four.t_down.max() < 1600.0
    np.testing.assert_array_equal(four.t_up - four.t_down, 5.0)
    again = plan.schedule(4, arrivals, seed=3)
    np.testing.assert_array_equal(again.t_down, four.t_down)
    assert not np.array_equal(plan.schedule(4, arrivals, seed=4).t_down[:4], four.t_down[:4])
    # a fleet of 2 fails as the first 2 replicas of the fleet of 4
    two = plan.schedule(2, arrivals, seed=3)
    first_two = four.replica < 2
    np.testing.assert_array_equal(two.t_down, four.t_down[first_two])


def test_windows_compress_with_the_trace_around_its_first_arrival():
    schedule = FailureSchedule.parse("1@5:20,0@110:150,2@130:inf")
    fast = compressed(schedule, t0=100.0, factor=2.0)
    assert fast.rows() == [(1, 5.0, 20.0), (0, 105.0, 125.0), (2, 115.0, math.inf)]
    assert compressed(schedule, 100.0, 1.0) is schedule


# -- the spec ------------------------------------------------------------------------------------------


@pytest.fixture
def trace_file(tmp_path):
    return write_csv_trace(tmp_path / "t.csv")


def test_fleet_flags_fix_the_router_and_pools_for_the_search_and_the_baselines(trace_file):
    spec = load_spec(trace=trace_file, model="m", gpu="h100", slo="ttft:500", replicas=4, router="cache_aware",
                     prefill_replicas=1, fail="3@1:2", context=BURST_CONTEXT)
    assert "router" not in spec.search_space.names and "prefill_replicas" not in spec.search_space.names
    assert "router_cache_threshold" in spec.search_space.names  # the fixed router's own thresholds are searched
    assert spec.deployment_knobs == {"router": "cache_aware", "prefill_replicas": 1}
    evaluator = Evaluator(spec, trace=make_trace(), cost_model=burst_cost_model(), engine=FakeEngine(),
                          scorer=fake_score)
    assert {c.router for c in evaluator.baselines().values()} == {"cache_aware"}
    assert {c.prefill_replicas for c in evaluator.baselines().values()} == {1}
    stored = spec_from_dict(spec.to_dict())
    assert stored.fingerprint() == spec.fingerprint() and stored.failures.windows.rows() == [(3, 1.0, 2.0)]
    plain = load_spec(trace=trace_file, model="m", gpu="h100", slo="ttft:500", replicas=4)
    assert plain.deployment_knobs == {} and "failures" not in plain.to_dict()
    assert "router" in plain.search_space.names


def test_the_failures_table_is_part_of_the_question(tmp_path, trace_file):
    path = tmp_path / "s.toml"
    path.write_text(f'[trace]\npath = "{trace_file.name}"\n[deployment]\nmodel = "m"\ngpu = "h100"\nreplicas = 2\n'
                    '[slo]\ndefault = { ttft = 500 }\n[failures]\nwindows = ["1@10:20"]\n')
    spec = load_spec(path)
    assert spec.failures.windows.rows() == [(1, 10.0, 20.0)]
    flagged = load_spec(path, mtbf_s=60.0, repair_s=5.0)  # flags replace the file's plan
    assert flagged.failures == FailurePlan(mtbf_s=60.0, repair_s=5.0)
    assert len({spec.fingerprint(), flagged.fingerprint(), load_spec(path, fail="0@10:20").fingerprint()}) == 3
    path.write_text(path.read_text().replace('"1@10:20"', '"2@10:20"'))
    with pytest.raises(SpecError, match=r"names replica 2, but the deployment has at most 2 replica\(s\)"):
        load_spec(path)
    # a searched replica count admits windows up to its highest value
    assert load_spec(path, space={"replicas": {"low": 1, "high": 3}}).failures.highest_replica == 2
    path.write_text(path.read_text().replace('windows = ["2@10:20"]', "mtbf_s = 0\nrepair_s = 5"))
    with pytest.raises(SpecError, match="mtbf_s must be a number of seconds > 0"):
        load_spec(path)


# -- the evaluator ---------------------------------------------------------------------------------------


class RecordingFleet(FakeEngine):
    """A fleet engine stand-in: each call's replicas, failure rows and configs are recorded."""

    def __init__(self):
        super().__init__()
        self.fleet_calls = []
        self.lockstep = []  # each call's ranks per attention-DP instance

    def simulate_fleet_many(self, trace, cost_model, configs, seed=0, *, replicas, failures=None, lockstep=1):
        self.fleet_calls.append((replicas, None if failures is None else failures.rows(), list(configs), seed))
        self.lockstep.append(lockstep)
        return list(configs)


def _evaluator(trace_file, **flags):
    spec = load_spec(trace=trace_file, model="m", gpu="h100", slo="ttft:500", seed=5, context=BURST_CONTEXT, **flags)
    fleet = RecordingFleet()
    evaluator = Evaluator(spec, trace=make_trace(50, gap_s=0.1), cost_model=burst_cost_model(), engine=fleet,
                          fleet_engine=fleet, scorer=fake_score)
    return evaluator, fleet


def test_one_replica_runs_the_engine_and_a_fleet_runs_one_fleet_call_per_fleet(trace_file):
    evaluator, fleet = _evaluator(trace_file)
    a, b = PolicyConfig(max_num_seqs=16), PolicyConfig(max_num_seqs=32)
    evaluator.reports([a, b, a, b], fleets=[Fleet(replicas=1), Fleet(replicas=1), Fleet(replicas=3),
                                            Fleet(replicas=3)])
    assert fleet.calls == 1 and fleet.simulated == [a, b]  # the single-replica engine, both configs at once
    assert fleet.fleet_calls == [(3, None, [a, b], 5)]  # the fleet kernel, seeded with the study's seed
    evaluator.reports([b], fleets=[Fleet(replicas=3)])
    assert len(fleet.fleet_calls) == 1 and evaluator.simulations == 4  # cached


def test_failures_run_on_every_fleet_compressed_with_the_rate_and_keyed_apart(trace_file):
    evaluator, fleet = _evaluator(trace_file, replicas=2, fail="0@1:3")
    config = PolicyConfig()
    evaluator.reports([config])
    evaluator.reports([config], rate_scale=2.0)
    evaluator.reports([config], fleets=[Fleet(replicas=1)])  # one replica with failures: the fleet kernel too
    assert [call[:2] for call in fleet.fleet_calls] == [(2, [(0, 1.0, 3.0)]), (2, [(0, 0.5, 1.5)]),
                                                        (1, [(0, 1.0, 3.0)])]
    assert fleet.calls == 0 and evaluator.simulations == 3
    key = evaluator._key(config, Fleet(replicas=2), 1.0)
    plain, _ = _evaluator(trace_file, replicas=2)
    assert plain._key(config, Fleet(replicas=2), 1.0) != key  # same config and fleet, other failures


def test_a_window_on_a_replica_the_trial_lacks_prunes_the_trial(trace_file):
    evaluator, _ = _evaluator(trace_file, fail="1@1:3", space={"replicas": {"low": 1, "high": 2}})
    assert "replica 1 does not exist in a fleet of 1" in evaluator.infeasibility(PolicyConfig(), Fleet(replicas=1))
    assert evaluator.infeasibility(PolicyConfig(), Fleet(replicas=2)) is None


def test_a_fleet_the_config_cannot_split_is_pruned_with_the_reason(trace_file):
    evaluator, _ = _evaluator(trace_file, replicas=2)
    assert "prefill_replicas=2 leaves no decode replica among 2" in evaluator.infeasibility(
        PolicyConfig(prefill_replicas=2))
    assert evaluator.infeasibility(PolicyConfig(prefill_replicas=1)) is None


# -- what the run folder says about the fleet -------------------------------------------------------------


def test_the_routing_label_names_the_router_and_the_knobs_acting_with_it():
    assert routing_label(PolicyConfig(router="cache_aware"), 1) == "one replica, no routing"
    assert routing_label(PolicyConfig(), 4) == "round_robin router"
    assert routing_label(PolicyConfig(router="unified", router_queue_weight=2.0, prefill_replicas=1), 4) == (
        "unified router (router_queue_weight=2, prefill_replicas=1, interconnect_gbps=50)")


def test_the_review_shows_each_replica_and_what_failures_cost():
    per_replica = {str(j): {"routed": 10 + j, "finished": 9 + j, "prefix_hit_rate": 0.25 * j, "kv_peak_blocks": 5,
                            "kv_peak_fraction": 0.5} for j in range(2)}
    failures = {"failure_windows": 1, "failure_affected": 7, "reprefill_tokens": 12345,
                "goodput_during_failures": 3.5, "goodput_after_failures": None}
    config = PolicyConfig(router="least_kv")
    best = ConfigFigures("best (trial 3)", config, {"weighted_goodput": 6.0, "per_replica": per_replica, **failures})
    vllm = ConfigFigures("vllm-default", PolicyConfig(), {"weighted_goodput": 4.0, **failures,
                                                          "failure_affected": 9, "goodput_during_failures": 1.25})
    inputs = ReviewInputs("Capacity review: fleet", Deployment("m", replicas=2), parse_slo("ttft:500"), 0.9,
                          "synthetic", best, (vllm,), failures="replica@down:up seconds 1@5:9")
    md = to_markdown(build_review(inputs))
    assert "2 replica(s) x TP 1 = 2 GPU(s), least_kv router, failures: replica@down:up seconds 1@5:9." in md
    fleet = md.split("## Fleet")[1].split("\n## ")[0]
    assert "best (trial 3) behind the least_kv router" in fleet
    assert "| 1 | 11 | 10 | 25.0% | 50.0% |" in fleet
    assert "| requests re-routed | 7 | 9 |" in fleet and "| re-prefill tokens | 12,345 | 12,345 |" in fleet
    assert "| goodput during failures (req/s) | 3.500 | 1.250 |" in fleet
    assert "| goodput after recovery (req/s) | n/a | n/a |" in fleet
    single = ConfigFigures("best", PolicyConfig(), {"weighted_goodput": 1.0})
    assert "## Fleet" not in to_markdown(build_review(ReviewInputs("r", Deployment("m"), parse_slo("ttft:500"), 0.9,
                                                                    "synthetic", single)))
