"""Scenario definitions build seeded traces; the matrix runner is deterministic for a seed."""

import json

import numpy as np
import optuna
import pytest

from benchmarks.scenarios import markdown, run_scenario
from costmodels import build
from studies.scenarios import SCENARIOS, ScenarioError, build_trace, check_scenario, load_scenarios

optuna.logging.set_verbosity(optuna.logging.WARNING)


def small(name: str, duration_s: float = 10.0) -> dict:
    data = json.loads(json.dumps(SCENARIOS[name]))
    data["workload"]["duration_s"] = duration_s
    return data


def test_every_builtin_scenario_is_well_formed_and_seeded():
    for name, data in SCENARIOS.items():
        check_scenario(name, data)
    a, b = build_trace("bursty", SCENARIOS["bursty"]), build_trace("bursty", SCENARIOS["bursty"])
    for column in ("arrival_s", "prompt_tokens", "output_tokens", "max_tokens", "block_hashes"):
        np.testing.assert_array_equal(getattr(a, column), getattr(b, column))
    other = build_trace("bursty", {**SCENARIOS["bursty"], "seed": 99})
    assert not np.array_equal(a.arrival_s[:50], other.arrival_s[:50])


def test_every_builtin_scenario_is_a_distinct_workload():
    """The matrix counts workloads, not names: no two scenarios replay the same trace
    (prefix-cold-hot once reused hotspot-shift's seed and trace)."""
    digests = {}
    for name, data in SCENARIOS.items():
        trace = build_trace(name, data)
        digest = hash(tuple(np.asarray(getattr(trace, c)).tobytes()
                            for c in ("arrival_s", "prompt_tokens", "output_tokens", "max_tokens", "output_estimate",
                                      "block_hashes", "adapter")))
        assert digest not in digests, f"{name} replays the same trace as {digests.get(digest)}"
        digests[digest] = name
    assert len(digests) == len(SCENARIOS) >= 17


def test_optimistic_admission_on_long_uncapped_answers_ends_in_preemption_storms():
    """Every admission rule that expects shorter outputs than the reports produce runs the
    pool full and preempts (vLLM recomputes, SGLang retracts), all on the same trace."""
    cost = build("meta-llama/Llama-3.1-8B", "h100")
    result = run_scenario("optimistic-admission", SCENARIOS["optimistic-admission"], cost, trials=0)
    runs = result["policies"]
    for policy in ("vllm-default", "sglang-default", "predicted-p90", "sglang-conservative-3"):
        assert runs[policy]["kv_peak_fraction"] == 1.0 and runs[policy]["preemptions"] >= 20, policy
    assert runs["vllm-default"]["preemptions"] > 5 * runs["sglang-default"]["preemptions"]  # no reserve at all


def test_phases_run_back_to_back_as_tenants():
    trace = build_trace("recovery", SCENARIOS["recovery"])
    assert set(trace.tenant_names) == {"after", "overload"}
    after = trace.tenant == trace.tenant_names.index("after")
    assert trace.arrival_s[after].min() >= 60.0 and trace.arrival_s[~after].max() < 60.0
    # 45 req/s for 60 s, then 8 req/s for 120 s
    assert (~after).sum() / 60 == pytest.approx(45, rel=0.1) and after.sum() / 120 == pytest.approx(8, rel=0.15)


def test_misestimated_lengths_set_max_tokens():
    under = build_trace("under-estimate", small("under-estimate", 30))
    over = build_trace("over-estimate", small("over-estimate", 30))
    assert np.median(under.max_tokens / under.output_tokens) < 0.6
    assert np.median(over.max_tokens / over.output_tokens) > 3.0


def test_bad_scenarios_name_the_scenario_and_key(tmp_path):
    with pytest.raises(ScenarioError, match="'x'.*unknown key"):
        check_scenario("x", {**SCENARIOS["steady"], "colour": "red"})
    with pytest.raises(ScenarioError, match="either arrivals"):
        check_scenario("x", {"workload": {"tenants": []}})
    with pytest.raises(ScenarioError, match="'x': workload"):
        build_trace("x", {"workload": {"duration_s": 10, "arrivals": {"kind": "zipf"}, "tenants": [{}]}})
    path = tmp_path / "s.toml"
    path.write_text('[mine]\nseed = 3\nslo = {default = {ttft = 500}}\n[mine.workload]\nduration_s = 5\n'
                    'arrivals = {kind = "poisson", rate = 4}\ntenants = [{name = "a", prompt = {mean = 64}}]\n')
    trace = build_trace("mine", load_scenarios(path)["mine"])
    assert trace.tenant_names == ("a",) and 5 <= trace.n <= 40


def test_runner_is_deterministic_for_a_seed():
    cost = build("meta-llama/Llama-3.1-8B", "h100")
    data = small("short-short")
    first = run_scenario("short-short", data, cost, trials=4, seed=0)
    second = run_scenario("short-short", data, cost, trials=4, seed=0)
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    assert set(first["policies"]) == {"fifo-no-batching", "vllm-default", "sglang-default", "tuned"}
    # one request at a time cannot keep up with 120 req/s: continuous batching must win
    assert first["policies"]["vllm-default"]["request_goodput"] > 10 * first["policies"]["fifo-no-batching"][
        "request_goodput"]


def test_missing_features_are_pending_not_faked():
    cost = build("meta-llama/Llama-3.1-8B", "h100")
    future = {**small("steady", 5), "requires": ["warp_drive"]}
    assert "warp_drive" in run_scenario("steady", future, cost, trials=0)["pending"]["*"]
    data = {**small("steady", 5), "policies": {"future": {"base": "vllm-default", "set": {"warp_drive": True}}}}
    result = run_scenario("steady", data, cost, trials=0)
    assert "warp_drive" in result["pending"]["future"] and "vllm-default" in result["policies"]


def test_worker_failure_runs_every_policy_and_router_on_the_failing_fleet():
    cost = build("meta-llama/Llama-3.1-8B", "h100")
    data = small("worker-failure", 12)
    data["failures"] = {"windows": ["1@4:8"]}
    first = run_scenario("worker-failure", data, cost, trials=2, seed=0)
    assert json.dumps(first, sort_keys=True) == json.dumps(run_scenario("worker-failure", data, cost, trials=2,
                                                                        seed=0), sort_keys=True)
    assert first["fleet"] == {"replicas": 4, "router": "round_robin", "failures": {"windows": ["1@4:8"]}}
    routers = {"least_outstanding", "least_kv", "cache_aware", "unified", "consistent_hash"}
    assert set(first["policies"]) == {"fifo-no-batching", "vllm-default", "sglang-default", "tuned",
                                      *(f"vllm+{r}" for r in routers)}
    for policy, report in first["policies"].items():
        assert report["failure_windows"] == 1 and report["failure_affected"] > 0, policy
        assert set(report["per_replica"]) == {"0", "1", "2", "3"}, policy
    healthy = first["reference"]["vllm-default, no failure"]  # the same windows, nobody fails
    assert healthy["failure_windows"] == 1 and healthy["failure_affected"] == healthy["reprefill_tokens"] == 0
    assert healthy["goodput_during_failures"] is not None
    assert healthy["n_offered"] == first["policies"]["vllm-default"]["n_offered"] == first["requests"]
    assert first["policies"]["vllm-default"]["reprefill_tokens"] > 0
    table = markdown(first)
    assert "| re-routed | re-prefill tok | goodput during / after failure /s |" in table
    assert "| vllm-default, no failure |" in table and "The tuned policy routes with" in table


def test_a_failure_on_a_replica_the_scenario_lacks_names_the_scenario():
    cost = build("meta-llama/Llama-3.1-8B", "h100")
    data = {**small("worker-failure", 5), "failures": {"windows": ["4@1:2"]}}
    with pytest.raises(ScenarioError, match="'worker-failure' failures: a window names replica 4, but the scenario "
                                            r"has 4 replica\(s\)"):
        run_scenario("worker-failure", data, cost, trials=0)
    with pytest.raises(ScenarioError, match="replicas must be an integer >= 1"):
        check_scenario("x", {**SCENARIOS["steady"], "replicas": 0})
    with pytest.raises(ScenarioError, match="failures must be a table"):
        check_scenario("x", {**SCENARIOS["steady"], "failures": {"when": "soon"}})


def test_adapter_cold_hot_serves_its_adapters_with_lora_and_reports_their_loads():
    cost = build("meta-llama/Llama-3.1-8B", "h100")
    data = small("adapter-cold-hot", 20)
    data["workload"]["tenants"][0]["adapters"]["shift_s"] = 10  # the hot set turns cold mid-trace
    result = run_scenario("adapter-cold-hot", data, cost, trials=0)
    reports = result["policies"]
    assert set(reports) == {"fifo-no-batching", "vllm-default", "sglang-default", "vllm-4-slots", "vllm-16-slots"}
    for policy, report in reports.items():
        assert report["adapter_loads"] > 0 and report["adapter_load_s"] > 0, policy
    one, sixteen = reports["vllm-default"], reports["vllm-16-slots"]  # 1 slot, 1 host entry vs 16 and 64
    distinct = len(set(build_trace("adapter-cold-hot", data).adapter_labels))
    assert one["adapter_disk_loads"] == one["adapter_loads"]  # a host cache of one: every load reads the disk
    assert sixteen["adapter_disk_loads"] <= distinct < sixteen["adapter_loads"]  # each read once, then copied
    # one slot runs one adapter at a time: the others' requests queue behind it
    assert sixteen["request_goodput"] > one["request_goodput"] and sixteen["p50_ttft_ms"] < one["p50_ttft_ms"] / 10
    assert reports["sglang-default"]["adapter_disk_loads"] == 0  # SGLang holds its adapters in host memory
    assert "| adapter loads (disk) | adapter load s |" in markdown(result)


def test_a_drafter_scenario_runs_the_speculating_policies_with_its_acceptance():
    result = run_scenario("spec-dspark", small("spec-dspark", 20.0), build("meta-llama/Llama-3.1-8B", "h100"),
                          trials=0)
    runs = result["policies"]
    assert result["speculative"]["method"] == "dspark" and result["speculative"]["draft_cost"] == 0.04
    for plain in ("vllm-default", "sglang-default", "fifo-no-batching"):  # the standard rows do not speculate
        assert runs[plain]["mean_verify_budget"] is None or np.isnan(runs[plain]["mean_verify_budget"])
    assert runs["vllm k=2"]["mean_verify_budget"] == pytest.approx(2, abs=0.1)
    assert 6 < runs["vllm k=7"]["mean_verify_budget"] <= 7  # less only in an answer's last 7 tokens
    # a flat 0.73 profile: a 7-block verify keeps about 1 + 0.73 + ... + 0.73^7 = 3.4 tokens
    assert 2.9 < runs["vllm k=7"]["mean_accepted_length"] < 3.9
    static, compact, cap = (runs[f"sglang DSPARK {m}"] for m in ("static", "compact", "cap-accept"))
    assert compact["mean_verify_budget"] < static["mean_verify_budget"]  # the planner trims
    assert cap["mean_verify_budget"] == pytest.approx(static["mean_verify_budget"], rel=0.05)  # the whole block
    assert cap["mean_accepted_length"] < static["mean_accepted_length"]  # ... with acceptance capped
    assert "| drafts verified / decode | tokens / verify |" in markdown(result)


def test_a_speculating_policy_needs_the_scenarios_drafter():
    data = small("spec-eagle3")
    del data["speculative"]
    with pytest.raises(ScenarioError, match="'vllm k=2' speculates, but the scenario declares no drafter"):
        run_scenario("spec-eagle3", data, build("meta-llama/Llama-3.1-8B", "h100"), trials=0)
    data = small("spec-eagle3")
    data["speculative"]["acceptance"] = [1.5]
    with pytest.raises(ScenarioError, match="scenario 'spec-eagle3' speculative"):
        run_scenario("spec-eagle3", data, build("meta-llama/Llama-3.1-8B", "h100"), trials=0)
