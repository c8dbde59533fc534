"""The tuner and the CLI on the real fleet kernel: round robin equals independent replicas,
failures reach every simulation, and `simulate` / `tune` report each replica and what the
failures cost."""

from __future__ import annotations

import json

import numpy as np
import optuna
import pytest
from typer.testing import CliRunner

from costmodels.costmodel import CostModel
from costmodels.steptable import linear_tables
from optimizer.cli import app
from optimizer.search.evaluate import Evaluator
from optimizer.search.space import Fleet
from optimizer.search.spec import load_spec
from policies import engine
from policies.config import PolicyConfig
from policies.failures import FailureSchedule
from policies.fleet import simulate_fleet
from policies.result import State
from studies.metrics import score
from studies.slo import parse_slo
from studies.traces import load_trace
from tests.optimizer.tuning_helpers import make_trace, write_csv_trace

optuna.logging.set_verbosity(optuna.logging.WARNING)
runner = CliRunner()


def _base_trace(n=60, gap_s=0.05):
    rng = np.random.default_rng(11)
    trace = make_trace(n, gap_s=gap_s)
    output = rng.integers(5, 60, n)
    return trace.replace(prompt_tokens=rng.integers(20, 400, n), output_tokens=output, max_tokens=output + 10)


def _interleaved(base, replicas: int):
    """Request i*R + r is base request i, arriving r*gap/R later: R x the base rate."""
    gap = float(base.arrival_s[1] - base.arrival_s[0])
    fleet = base.take(np.repeat(np.arange(base.n), replicas))
    return fleet.replace(arrival_s=fleet.arrival_s + np.tile(np.arange(replicas) * gap / replicas, base.n))


def _cost_model():
    # 1 ms + 0.05 ms per token: a 60-request stream at 20 req/s queues on one replica.
    tables = linear_tables(per_token_s=5e-5, per_seq_s=0.0, per_kv_token_s=0.0, per_pair_s=0.0, overhead_s=1e-3)
    return CostModel.synthetic(20_000, tables=tables)


def test_a_round_robin_fleet_at_r_times_the_rate_serves_each_share_as_one_replica_would(tmp_path):
    replicas = 3
    base = _base_trace()
    trace = _interleaved(base, replicas)
    config = PolicyConfig(max_num_batched_tokens=512, max_num_seqs=8, gpu_memory_utilization=1.0)
    spec = load_spec(trace=write_csv_trace(tmp_path / "t.csv", trace), model="synthetic", gpu="h100",
                     slo="ttft:20,tpot:2", replicas=replicas, run_dir=tmp_path / "run", seed=4)
    evaluator = Evaluator(spec, trace=trace, cost_model=_cost_model())
    result, report = evaluator.simulate(config)

    alone = [engine.simulate(base, _cost_model(), config, seed=4) for r in range(replicas)]
    for r in range(replicas):
        rows = np.arange(r, trace.n, replicas)
        np.testing.assert_array_equal(result.state[rows], alone[r].state)
        np.testing.assert_array_equal(result.tokens_generated[rows], alone[r].tokens_generated)
        for name in ("first_token_s", "finish_s"):
            np.testing.assert_allclose(getattr(result, name)[rows] - trace.arrival_s[rows],
                                       getattr(alone[r], name) - base.arrival_s, atol=1e-9, err_msg=name)
        assert set(result.replica[rows]) <= {r, -1}
    assert report.slo_attainment == evaluator.scorer(alone[0], base, spec.slos).slo_attainment
    assert 0 < report.slo_attainment < 1  # the load is real: some requests miss
    assert [e["routed"] for e in report.per_replica.values()] == [base.n] * replicas

    # The same traffic on one replica is worse: the fleet's replicas really share the load.
    _, single = evaluator.simulate(config, fleet=Fleet(replicas=1))
    assert single.slo_attainment < report.slo_attainment and single.per_replica == {}


def test_the_study_failures_reach_its_simulations_and_cost_goodput(tmp_path):
    trace = _interleaved(_base_trace(), 2)
    output = np.random.default_rng(2).integers(200, 400, trace.n)  # each request runs ~0.3 s: a replica holds some
    trace = trace.replace(output_tokens=output, max_tokens=output)
    spec = load_spec(trace=write_csv_trace(tmp_path / "t.csv", trace), model="synthetic", gpu="h100",
                     slo="ttft:50,tpot:5", replicas=2, fail="1@0.5:1.5", run_dir=tmp_path / "run")
    evaluator = Evaluator(spec, trace=trace, cost_model=_cost_model())
    config = PolicyConfig(router="least_outstanding", gpu_memory_utilization=1.0)
    failed, report = evaluator.simulate(config)
    assert np.isin(failed.state, [State.FINISHED, State.REJECTED, State.TIMED_OUT]).all()
    assert report.n_offered == trace.n and report.failure_windows == 1
    assert report.failure_affected > 0 and report.reprefill_tokens > 0
    # nothing reaches replica 1 while it is down; it serves again once it is back
    down = (trace.arrival_s >= 0.5) & (trace.arrival_s < 1.5)
    assert not (failed.replica[down & (failed.reroutes == 0)] == 1).any()
    assert (failed.replica[trace.arrival_s >= 1.6] == 1).any()
    plain = Evaluator(spec.replace(failures=None), trace=trace, cost_model=_cost_model())
    _, healthy = plain.simulate(config)
    assert healthy.failure_windows == 0 and report.slo_attainment <= healthy.slo_attainment


# -- the CLI -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    """120 chat requests over ~12 s."""
    rng = np.random.default_rng(5)
    n = 120
    trace = make_trace(n).replace(arrival_s=np.cumsum(rng.exponential(0.1, n)),
                                  prompt_tokens=rng.integers(50, 1500, n), output_tokens=rng.integers(1, 200, n),
                                  max_tokens=np.full(n, 200))
    return write_csv_trace(tmp_path_factory.mktemp("trace") / "chat.csv", trace)


MODEL = ["--model", "meta-llama/Llama-3.1-8B", "--gpu", "h100"]


def test_simulate_runs_the_fleet_and_prints_each_replica_and_the_failure(trace_file):
    args = ["simulate", "--trace", str(trace_file), *MODEL, "--slo", "ttft:500,tpot:50", "--replicas", "3",
            "--router", "least_kv", "--fail", "2@3:6"]
    out = runner.invoke(app, [*args, "--format", "json"])
    assert out.exit_code == 0, out.output
    run = json.loads(out.output)
    assert (run["replicas"], run["failures"], run["config"]["router"]) == (3, "2@3:6", "least_kv")

    from costmodels import build

    trace = load_trace(trace_file)
    direct = simulate_fleet(trace, build("meta-llama/Llama-3.1-8B", "h100"), PolicyConfig.from_mapping(run["config"]),
                            replicas=3, failures=FailureSchedule.parse("2@3:6"))
    expected = json.loads(json.dumps(score(direct, trace, parse_slo("ttft:500,tpot:50")).to_dict()))
    assert run["report"] == expected and set(run["report"]["per_replica"]) == {"0", "1", "2"}

    table = runner.invoke(app, args)
    assert table.exit_code == 0, table.output
    assert "least_kv router" in table.output and "per replica" in table.output
    assert "windows / requests affected / re-prefill tokens" in table.output


@pytest.mark.parametrize(("flags", "message"), [
    (["--replicas", "2", "--fail", "2@3:6"], "replica 2 does not exist in a fleet of 2"),
    (["--replicas", "2", "--fail", "1@6:3"], "must be after t_down"),
    (["--replicas", "2", "--mtbf", "30"], "need both an MTBF and a repair time"),
    (["--replicas", "2", "--prefill-replicas", "2"], "prefill_replicas=2 leaves no decode replica"),
    (["--replicas", "2", "--router", "random"], "router"),
])
def test_simulate_names_bad_fleet_flags(trace_file, flags, message):
    out = runner.invoke(app, ["simulate", "--trace", str(trace_file), *MODEL, *flags])
    assert out.exit_code == 2 and message in out.output


def test_tune_on_a_failing_fleet_reports_the_router_each_replica_and_the_failure(trace_file, tmp_path):
    # cache_aware is sglang-router's policy, no engine's own flag: the what-if study routes by it,
    # and the vLLM study keeps vLLM's own data-parallel balancing (saying the router is not its flag)
    runs = tmp_path / "run"
    out = runner.invoke(app, ["tune", "--trace", str(trace_file), *MODEL, "--slo", "ttft:500,tpot:50",
                              "--replicas", "2", "--router", "cache_aware", "--fail", "1@3:6", "--trials", "4",
                              "--batch-size", "2", "--run-dir", str(runs), "--engine", "vllm", "--what-if",
                              "--quiet"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "vLLM has no flag for router" in out.output
    assert "failures: replica@down:up seconds 1@3:6" in out.output
    assert "re-routed" in out.output and "good/s during failures" in out.output
    vllm = json.loads((runs / "vllm" / "summary.json").read_text())
    assert vllm["best"]["config"]["router"] == "vllm_dp"  # vllm.yaml read back: vLLM's own DP balancer
    # (the vllm-default baseline is test_exports.py::test_an_engines_baseline_is_what_its_file_runs's)
    run_dir = runs / "servetune"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["deployment"]["failures"] == {"windows": ["1@3:6"]}
    assert summary["deployment"]["routing"].startswith("cache_aware router")
    for entry in (summary["best"], *summary["baselines"].values()):
        assert entry["config"]["router"] == "cache_aware"  # the deployment's router, baselines included
        assert entry["fleet"]["failures"]["failure_windows"] == 1 and set(entry["fleet"]["per_replica"]) == {"0", "1"}
    review = (run_dir / "capacity-review.md").read_text()
    assert "## Fleet" in review and "| requests re-routed |" in review
    assert "Every simulation ran with the study's failures" in review
