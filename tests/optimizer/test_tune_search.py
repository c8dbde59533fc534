"""With the real engine: the search finds a best config known by construction."""

import optuna
from optuna.trial import TrialState

from optimizer.search.evaluate import Evaluator
from optimizer.search.spec import load_spec
from optimizer.search.study import best_goodput_trial, create_or_resume, enqueue_baselines, run
from optimizer.search.targets import context_of
from tests.optimizer.tuning_helpers import burst_cost_model, burst_trace, write_csv_trace

optuna.logging.set_verbosity(optuna.logging.WARNING)

#: max_num_seqs = 50 is a needle on a log range (40-48 tie one wave worse): 40 trials found it
#: only for some sampler seeds (seed 0 before the engine targets, not after; seed 1 neither),
#: 80 for each of seeds 0-5 while each batch was told before the next was asked. Asked beside
#: the batch in flight (``run``'s overlap), TPE sees one batch less per ask: 80 trials find it
#: for 1 of seeds 0-5, 100 for 5, 120 for all 6.
TRIAL_BUDGET = 120


def test_search_finds_the_largest_batch_under_the_tpot_bound(tmp_path):
    # 200 requests at t=0 and a step of 2 + 0.1 * batch ms: with TPOT <= 7.05 ms the best
    # max_num_seqs is exactly 50 (4 waves); 51+ breaks TPOT, 49- needs a fifth wave.
    trace = burst_trace()
    cost_model = burst_cost_model()
    spec = load_spec(trace=write_csv_trace(tmp_path / "burst.csv", trace), model="synthetic", gpu="h100",
                     slo="ttft:60000,tpot:7.05", trials=TRIAL_BUDGET, batch_size=2, run_dir=tmp_path / "run",
                     space={"others": "fixed", "max_num_seqs": {"low": 8, "high": 1024, "log": True}},
                     context=context_of(cost_model, "h100", context_len=0))  # "synthetic" is no built-in model
    evaluator = Evaluator(spec, trace=trace, cost_model=cost_model)
    study = create_or_resume(spec)
    enqueue_baselines(study, spec, evaluator.baselines())
    run(study, spec, evaluator)
    best = best_goodput_trial(study)
    assert best.user_attrs["config"]["max_num_seqs"] == 50
    assert best.user_attrs["report"]["slo_attainment"] == 1.0
    baseline = [t for t in study.get_trials(states=(TrialState.COMPLETE,)) if "baseline" in t.user_attrs]
    assert all(t.user_attrs["report"]["weighted_goodput"] < 0.5 * best.values[0] for t in baseline)
