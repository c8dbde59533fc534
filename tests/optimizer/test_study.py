"""The study loop with a fake engine: baselines first, a global budget, resume, constraints,
pruning, caching, interruption, and refusal of mismatched run folders or storage."""

import math
import time

import optuna
import pytest
from optuna.trial import TrialState

from costmodels.costmodel import CostModel
from optimizer.search.evaluate import Evaluator
from optimizer.search.spec import load_spec
from optimizer.search.study import (
    StudyError,
    baseline_trials,
    best_goodput_trial,
    create_or_resume,
    enqueue_baselines,
    gains,
    load_for_worker,
    redact,
    run,
)
from optimizer.search.targets import context_of
from policies.engines import preset
from tests.optimizer.tuning_helpers import (
    FakeEngine,
    fake_goodput,
    fake_report,
    fake_score,
    make_trace,
    write_csv_trace,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture
def trace_file(tmp_path):
    return write_csv_trace(tmp_path / "tiny.csv")


#: the synthetic cost model every study here runs on, and the engines' context for it
COST_MODEL = CostModel.synthetic(1_000_000)
CONTEXT = context_of(COST_MODEL, "h100", context_len=0)


def make_spec(trace_file, tmp_path, **flags):
    # model "m" is no built-in model: the engines' defaults are sized from the synthetic pool
    values = dict(trace=trace_file, model="m", gpu="h100", slo="ttft:1000", trials=12, batch_size=4,
                  run_dir=tmp_path / "run", context=CONTEXT)
    values.update(flags)
    return load_spec(**values)


def tune(spec, engine=None):
    evaluator = Evaluator(spec, trace=make_trace(), cost_model=COST_MODEL,
                          engine=engine or FakeEngine(), scorer=fake_score)
    study = create_or_resume(spec)
    enqueue_baselines(study, spec, evaluator.baselines())
    return study, run(study, spec, evaluator), evaluator


def finished(study):
    return [t for t in study.get_trials() if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]


def test_baselines_first_then_budget_exactly(trace_file, tmp_path):
    spec = make_spec(trace_file, tmp_path)
    study, stats, _ = tune(spec)
    trials = study.get_trials()
    assert [t.user_attrs.get("baseline") for t in trials[:2]] == ["vllm-default", "sglang-default"]
    for t in trials[:2]:
        assert t.user_attrs["config"] == preset(t.user_attrs["baseline"], spec.context).to_dict()
        assert t.values[0] == pytest.approx(fake_goodput(preset(t.user_attrs["baseline"], spec.context)))
    assert len(finished(study)) == 12 == stats.told
    assert all("report" in t.user_attrs and t.constraints for t in trials if t.state == TrialState.COMPLETE)
    assert stats.engine_s > 0 and stats.optuna_s > 0 and stats.wall_s >= max(stats.engine_s, stats.optuna_s)


def test_rerun_continues_and_keeps_every_trial(trace_file, tmp_path):
    spec = make_spec(trace_file, tmp_path)
    study, _, _ = tune(spec)
    before = {t.number: t.values for t in finished(study)}
    study2, stats, _ = tune(spec.replace(trials=20))
    after = {t.number: t.values for t in finished(study2)}
    assert stats.told == 8 and len(after) == 20
    assert all(after[n] == v for n, v in before.items())
    assert len(baseline_trials(study2)) == 2  # baselines are not enqueued twice
    _, stats, _ = tune(spec.replace(trials=20))
    assert stats.told == 0


def test_search_improves_on_the_baselines(trace_file, tmp_path):
    spec = make_spec(trace_file, tmp_path, trials=60)
    study, _, _ = tune(spec)
    best = best_goodput_trial(study)
    assert best.user_attrs["report"]["weighted_goodput"] > 90  # optimum is 100
    assert all(g > 1 for g in gains(study).values())


def test_rejecting_traffic_is_infeasible_by_default(trace_file, tmp_path):
    # the fake rejects half the requests whenever max_wait_s > 0; the baselines reject none
    spec = make_spec(trace_file, tmp_path, trials=30,
                     space={"others": "fixed", "max_wait_s": {"low": 1.0, "high": 10.0, "off": True}})
    study, _, _ = tune(spec)
    assert study.user_attrs["bounds"]["rejected_fraction"] == pytest.approx(0.01)
    shedding = [t for t in study.get_trials() if t.state == TrialState.COMPLETE
                and t.user_attrs["config"]["max_wait_s"] > 0]
    assert shedding and all(t.constraints["rejected_fraction"] == pytest.approx(0.49) for t in shedding)
    assert best_goodput_trial(study).user_attrs["config"]["max_wait_s"] == 0
    # an explicit absolute cap allows it
    loose = make_spec(trace_file, tmp_path, trials=30, run_dir=tmp_path / "loose",
                      space={"others": "fixed", "max_wait_s": {"low": 1.0, "high": 10.0, "off": True}},
                      constraints={"max_rejected_fraction": 0.6})
    study, _, _ = tune(loose)
    assert all(t.constraints["rejected_fraction"] <= 0 for t in study.get_trials() if t.state == TrialState.COMPLETE)


def starving_score(result, trace, slos):
    """SJF serves 20% more, but its p99 TTFT is a minute: the tail it starves."""
    sjf = result.scheduling_policy == "sjf"
    return fake_report(fake_goodput(result) * (1.2 if sjf else 1.0), p99_ttft_ms=60_000.0 if sjf else 300.0)


def tune_with(spec, scorer):
    evaluator = Evaluator(spec, trace=make_trace(), cost_model=COST_MODEL, engine=FakeEngine(), scorer=scorer)
    study = create_or_resume(spec)
    enqueue_baselines(study, spec, evaluator.baselines())
    run(study, spec, evaluator)
    return study


@pytest.mark.parametrize("constraints, bound, sjf_wins", [
    ({}, 2000.0, False),  # 2 x max(loosest TTFT SLO 1000 ms, best baseline p99 300 ms)
    ({"ttft_tail_factor": 4.0}, 4000.0, False),
    ({"ttft_tail_factor": 0}, None, True),  # off: the starving order wins
    ({"p99_ttft_ms": 100_000.0}, 100_000.0, True),  # an explicit bound replaces the auto one
])
def test_a_tail_starved_for_goodput_is_infeasible_by_default(trace_file, tmp_path, constraints, bound, sjf_wins):
    spec = make_spec(trace_file, tmp_path, trials=16, constraints=constraints,
                     space={"others": "fixed", "scheduling_policy": {"choices": ["fcfs", "sjf"]}})
    study = tune_with(spec, starving_score)
    assert study.user_attrs["bounds"]["p99_ttft_ms"] == bound
    sjf = [t for t in study.get_trials() if t.state == TrialState.COMPLETE
           and t.user_attrs["config"]["scheduling_policy"] == "sjf"]
    assert sjf and all(t.constraints.get("p99_ttft_ms", -1) > 0 for t in sjf) != sjf_wins
    assert (best_goodput_trial(study).user_attrs["config"]["scheduling_policy"] == "sjf") == sjf_wins


def test_infeasible_configs_are_pruned_without_simulating(trace_file, tmp_path):
    small = CostModel.synthetic(9_000)
    spec = make_spec(trace_file, tmp_path, trials=20, space={"kv_headroom": {"low": 0.0, "high": 0.9}},
                     context=context_of(small, "h100", context_len=0))
    engine = FakeEngine()
    evaluator = Evaluator(spec, trace=make_trace(prompt=5000, output=2000),
                          cost_model=small, engine=engine, scorer=fake_score)
    study = create_or_resume(spec)
    enqueue_baselines(study, spec, evaluator.baselines())
    stats = run(study, spec, evaluator)
    pruned = [t for t in study.get_trials() if t.state == TrialState.PRUNED]
    assert pruned and stats.pruned == len(pruned)
    assert all("kv_headroom" in t.user_attrs["pruned"] or "chunked prefill" in t.user_attrs["pruned"]
               for t in pruned)
    simulated = {c.to_vector().tobytes() for c in engine.simulated}
    assert all(evaluator.infeasibility(c) is None for c in engine.simulated)
    assert len(simulated) == len(engine.simulated)  # nothing simulated twice


def test_repeated_configs_hit_the_cache(trace_file, tmp_path):
    spec = make_spec(trace_file, tmp_path, trials=30,
                     space={"others": "fixed", "max_num_seqs": {"choices": [64, 128]}})
    engine = FakeEngine()
    study, stats, evaluator = tune(spec, engine)
    assert stats.told == 30
    assert len(engine.simulated) <= 4  # 2 baselines + at most 2 distinct configs
    assert evaluator.simulations == len(engine.simulated)


def test_interrupt_keeps_told_trials_and_fails_the_batch(trace_file, tmp_path):
    spec = make_spec(trace_file, tmp_path, trials=40, batch_size=2)
    with pytest.raises(KeyboardInterrupt):
        tune(spec, FakeEngine(fail_on_call=4))
    study = create_or_resume(spec)
    states = [t.state for t in study.get_trials()]
    assert states.count(TrialState.COMPLETE) == 6 and TrialState.RUNNING not in states
    _, stats, _ = tune(spec)
    assert len(finished(create_or_resume(spec))) == 40 and stats.told == 34


class PeekingEngine(FakeEngine):
    """Notes, on each simulation, whether the study gained running trials beyond the batch
    being simulated within ``patience`` s: the next batch, asked while this one runs."""

    def __init__(self, patience: float):
        super().__init__()
        self.study, self.patience, self.saw_next_batch = None, patience, []

    def simulate_many(self, trace, cost_model, configs, seed=0):
        deadline = time.monotonic() + self.patience
        while time.monotonic() < deadline:
            running = sum(t.state == TrialState.RUNNING for t in self.study.get_trials(deepcopy=False))
            if running > len(configs):
                break
            time.sleep(0.005)
        self.saw_next_batch.append(running > len(configs))
        return super().simulate_many(trace, cost_model, configs, seed)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_next_batch_is_asked_while_one_simulates(trace_file, tmp_path, overlap):
    spec = make_spec(trace_file, tmp_path, trials=12, batch_size=2)
    engine = PeekingEngine(patience=2.0 if overlap else 0.2)
    evaluator = Evaluator(spec, trace=make_trace(), cost_model=COST_MODEL, engine=engine, scorer=fake_score)
    study = engine.study = create_or_resume(spec)
    enqueue_baselines(study, spec, evaluator.baselines())
    stats = run(study, spec, evaluator, overlap=overlap)
    assert stats.told == 12 and len(finished(study)) == 12
    first, *batches, last = engine.saw_next_batch
    assert not first  # the baselines, simulated for the study's bounds before any ask
    assert batches == [overlap] * len(batches) and len(batches) >= 3  # each batch's successor asked beside it
    assert not last  # the budget is spent: nothing more to ask


def test_an_error_in_flight_fails_that_batch_and_the_one_asked_beside_it(trace_file, tmp_path):
    spec = make_spec(trace_file, tmp_path, trials=40, batch_size=2)
    with pytest.raises(RuntimeError):
        tune(spec, FakeEngine(fail_on_call=3, error=RuntimeError))
    states = [t.state for t in create_or_resume(spec).get_trials()]
    assert states.count(TrialState.COMPLETE) == 4 and states.count(TrialState.FAIL) == 4
    assert TrialState.RUNNING not in states


class StallingEngine(FakeEngine):
    """A simulation that stalls (SimulationStalled) for every config with max_num_seqs 64."""

    def simulate_many(self, trace, cost_model, configs, seed=0):
        from policies.engine import SimulationStalled

        if any(c.max_num_seqs == 64 for c in configs):
            raise SimulationStalled("simulation made no progress at t=1.5 s, replica 0")
        return super().simulate_many(trace, cost_model, configs, seed)


def test_a_stalled_simulation_prunes_its_trial_with_the_reason_and_the_study_goes_on(trace_file, tmp_path):
    spec = make_spec(trace_file, tmp_path, trials=20,
                     space={"others": "fixed", "max_num_seqs": {"choices": [64, 128, 256]}})
    study, stats, _ = tune(spec, StallingEngine())
    done = finished(study)
    assert len(done) == 20 and stats.told == 20
    stalled = [t for t in done if t.user_attrs["config"]["max_num_seqs"] == 64]
    assert stalled and all(t.state == TrialState.PRUNED for t in stalled)
    assert all(t.user_attrs["pruned"].startswith("internal error, please report it: simulation made no progress "
                                                 "at t=1.5 s, replica 0") for t in stalled)
    others = [t for t in done if t.user_attrs["config"]["max_num_seqs"] != 64]
    assert others and all(t.state == TrialState.COMPLETE for t in others)  # batch-mates of a stall still scored


def test_multi_objective_mode_records_both_values(trace_file, tmp_path):
    spec = make_spec(trace_file, tmp_path, objective="goodput-cost", trials=8)
    study, _, _ = tune(spec)
    assert study.directions[1].name == "MINIMIZE" and study.metric_names == ["weighted_goodput", "usd_per_mtok"]
    t = best_goodput_trial(study)
    goodput_tokens = t.user_attrs["report"]["token_goodput"]
    assert t.values[1] == pytest.approx(spec.usd_per_gpu_hour / 3600 / goodput_tokens * 1e6)


def test_capacity_mode(trace_file, tmp_path):
    spec = make_spec(trace_file, tmp_path, objective="capacity", trials=4, batch_size=2)
    study, _, _ = tune(spec)
    for t in study.get_trials(states=(TrialState.COMPLETE,)):
        cap = t.user_attrs["capacity"]
        assert t.values[0] == pytest.approx(cap["rps"]) and cap["probes"]


def test_a_run_folder_of_another_study_is_refused_untouched(trace_file, tmp_path):
    spec = make_spec(trace_file, tmp_path)
    tune(spec)
    manifest = (spec.run_dir / "study.json").read_bytes()
    journal = (spec.run_dir / "study.journal").read_bytes()
    with pytest.raises(StudyError, match="belongs to study 'tiny-m-h100', not 'other'"):
        create_or_resume(spec.replace(study_name="other"))
    with pytest.raises(StudyError, match=r"different question \(slo differ\); nothing was changed"):
        create_or_resume(make_spec(trace_file, tmp_path, slo="ttft:5"))
    assert (spec.run_dir / "study.json").read_bytes() == manifest
    assert (spec.run_dir / "study.journal").read_bytes() == journal


def test_a_journal_holding_another_study_is_refused(trace_file, tmp_path):
    spec = make_spec(trace_file, tmp_path)
    tune(spec)
    (spec.run_dir / "study.json").unlink()
    with pytest.raises(StudyError, match="holds study"):
        create_or_resume(spec.replace(study_name="other"))


def test_unreachable_storage_is_a_clear_error(trace_file, tmp_path):
    spec = make_spec(trace_file, tmp_path, storage="postgresql+psycopg2://u:secret@127.0.0.1:1/db")
    with pytest.raises(StudyError, match=r"cannot reach storage postgresql\+psycopg2://u:\*\*\*@127.0.0.1:1/db") as info:
        create_or_resume(spec)
    assert "secret" not in str(info.value)
    assert not (spec.run_dir / "study.json").exists()
    assert redact("sqlite:///x.db") == "sqlite:///x.db"


def test_worker_loads_the_spec_from_the_study(trace_file, tmp_path):
    journal = str(tmp_path / "shared.journal")
    spec = make_spec(trace_file, tmp_path, storage=journal, trials=6)
    tune(spec)
    loaded, study = load_for_worker(spec.study_name, journal, seed=1)
    assert loaded.fingerprint() == spec.fingerprint() and len(study.get_trials()) == 6
    with pytest.raises(StudyError, match="no study 'nope'"):
        load_for_worker("nope", journal)
    trace_file.write_text(trace_file.read_text().replace("0.1,", "0.2,", 1))
    with pytest.raises(StudyError, match="differs from the one study"):
        load_for_worker(spec.study_name, journal)


def test_gains_are_relative_to_each_baseline(trace_file, tmp_path):
    study, _, _ = tune(make_spec(trace_file, tmp_path))
    best = best_goodput_trial(study).user_attrs["report"]["weighted_goodput"]
    found = gains(study)
    assert set(found) == {"vllm-default", "sglang-default"}
    for name, ratio in found.items():
        base = baseline_trials(study)[name].user_attrs["report"]["weighted_goodput"]
        # SGLang's default request cap (2048, from its KV pool) scores 0 under fake_goodput: inf
        assert ratio == (pytest.approx(best / base) if base > 0 else math.inf)
    assert math.isfinite(found["vllm-default"])
