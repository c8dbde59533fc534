"""Out-of-memory configs in a study (issue 16 part 2): a config vLLM refuses at start-up,
and a run whose step outgrew the memory left for its activations, both end as PRUNED
trials whose reason says what the engine does; neither is ever exported. The engine is
the fake one (``tuning_helpers``): these tests are about the study's bookkeeping."""

import json

import optuna
import pytest
from optuna.trial import TrialState

from costmodels import build
from optimizer.outputs.exports import Deployment, ExportError, engine_yaml
from optimizer.search.evaluate import Evaluator
from optimizer.search.spec import load_spec
from optimizer.search.study import best_goodput_trial, create_or_resume, enqueue_baselines, run
from optimizer.search.targets import context_of
from policies.config import PolicyConfig
from policies.engines import target
from policies.workspace import room_tokens
from tests.costmodels.test_memory import CODELLAMA_34B
from tests.optimizer import tuning_helpers as fake

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def codellama(tmp_path_factory):
    """CodeLlama-34B on one 80 GB H100: its 63 GiB of weights leave little beside the pool."""
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(CODELLAMA_34B))
    cost = build("codellama/CodeLlama-34b-Instruct-hf", "h100", model_config=path)
    return cost, context_of(cost, "h100", context_len=CODELLAMA_34B["max_position_embeddings"])


def _study(tmp_path, cost, ctx, engine, space, scorer=fake.fake_score, trials=10):
    spec = load_spec(trace=fake.write_csv_trace(tmp_path / "t.csv"), model="m", gpu="h100", slo="ttft:1000", trials=trials,
                     batch_size=4, run_dir=tmp_path / "run", context=ctx, engine=engine, space=space)
    evaluator = Evaluator(spec, trace=fake.make_trace(), cost_model=cost, engine=fake.FakeEngine(), scorer=scorer)
    study = create_or_resume(spec)
    enqueue_baselines(study, spec, evaluator.baselines())
    run(study, spec, evaluator)
    return study, spec


def test_a_budget_whose_profiling_pass_leaves_no_kv_is_pruned_with_vllms_error(tmp_path, codellama):
    # at utilisation 0.85 a 32768-token profiling pass takes the 6 GiB the pool would have had
    cost, ctx = codellama
    space = {"others": "fixed", "gpu_memory_utilization": {"value": 0.85},
             "max_num_batched_tokens": {"choices": [2048, 32768]}}
    study, spec = _study(tmp_path, cost, ctx, "vllm", space)
    trials = study.get_trials()
    big = [t for t in trials if t.user_attrs["config"]["max_num_batched_tokens"] == 32768]
    assert big and all(t.state == TrialState.PRUNED for t in big)
    for t in big:
        assert t.user_attrs["pruned"].startswith("vLLM 0.33.0 refuses it: No available memory for the cache blocks. "
                                                 "Try increasing `gpu_memory_utilization` "
                                                 "[vllm/v1/core/kv_cache_planning.py:56-64]")
        assert "max-num-batched-tokens 32768" in t.user_attrs["pruned"]
    small = [t for t in trials if t.user_attrs["config"]["max_num_batched_tokens"] == 2048]
    assert small and all(t.state == TrialState.COMPLETE for t in small)
    # the recommendation is a completed trial; the pruned config has no file
    best = best_goodput_trial(study)
    assert best.user_attrs["config"]["max_num_batched_tokens"] != 32768
    refused = PolicyConfig.from_mapping(big[0].user_attrs["config"])
    with pytest.raises(ExportError, match="No available memory for the cache blocks"):
        engine_yaml(target("vllm"), refused, Deployment("m"), ctx)


def test_vllms_max_model_len_check_quotes_its_error(codellama):
    cost, ctx = codellama
    config = target("vllm").defaults(ctx).replace(gpu_memory_utilization=0.85, max_num_batched_tokens=16384)
    broken = target("vllm").violations(config, ctx)
    assert len(broken) == 1 and broken[0].startswith(
        "To serve at least one request with the model's max seq len (16384), its KV cache is needed, which is "
        "larger than the available KV cache memory (")
    assert broken[0].endswith("[vllm/v1/core/kv_cache_planning.py:66-84]")
    assert not target("vllm").violations(config.replace(max_model_len=4096), ctx)


def test_the_what_if_target_runs_vllms_memory_sizing_and_its_refusals(codellama):
    cost, ctx = codellama
    config = target("servetune").defaults(ctx).replace(gpu_memory_utilization=0.85, max_num_batched_tokens=32768)
    assert target("servetune").violations(config, ctx) == target("vllm").violations(config, ctx) != []


def _oom_scorer(cost, oomed_seqs):
    """Scores like ``fake_score``, but a config with max_num_seqs ``oomed_seqs`` formed a
    step one token past the room for its activations, first at t = 12.5 s."""
    def score(result, trace, slos):
        peak = int(room_tokens(cost, result)) + 1 if result.max_num_seqs == oomed_seqs else 0
        return fake.fake_report(fake.fake_goodput(result), p99_ttft_ms=100.0, peak_step_tokens=peak, peak_step_s=12.5)
    return score


def test_a_run_whose_step_outgrew_its_activation_memory_is_pruned_with_when_and_why(tmp_path, codellama):
    cost, ctx = codellama
    space = {"others": "fixed", "max_num_seqs": {"choices": [64, 4096]}}
    study, _ = _study(tmp_path, cost, ctx, "sglang", space, scorer=_oom_scorer(cost, 4096))
    trials = study.get_trials()
    oomed = [t for t in trials if t.user_attrs["config"]["max_num_seqs"] == 4096 and "baseline" not in t.user_attrs]
    assert oomed and all(t.state == TrialState.PRUNED for t in oomed)
    reason = oomed[0].user_attrs["pruned"]
    assert reason.startswith("SGLang runs out of GPU memory by t=12.5 s: a ")
    assert "-token step needs" in reason and "left beside the weights, the KV pool and the fixed reserves" in reason
    assert reason.endswith("every request in flight fails [srt/managers/scheduler.py:6370-6373, "
                           "srt/entrypoints/engine.py:1976-1982]")
    fine = [t for t in trials if t.user_attrs["config"]["max_num_seqs"] == 64]
    assert fine and all(t.state == TrialState.COMPLETE for t in fine)
    assert best_goodput_trial(study).user_attrs["config"]["max_num_seqs"] != 4096


def test_an_sglang_run_whose_decode_batch_outgrows_the_reserve_is_pruned_end_to_end(tmp_path):
    """The real engine: 600 requests at once on Llama-3.1-8B, each capped at its 40-token
    answer (so the new-token ratio admits them all); with mem-fraction-static leaving exactly
    a 256-token chunk's activations, SGLang prefills them 16 a step and then decodes all 600
    together, which the reserve cannot hold; with 64 running at most, every step fits."""
    import numpy as np

    from studies.traces import Trace

    cost = build("meta-llama/Llama-3.1-8B", "h100")
    ctx = context_of(cost, "h100", context_len=131072)
    n = 600
    trace = Trace.from_columns(np.zeros(n), np.full(n, 16), np.full(n, 40), max_tokens=np.full(n, 40))
    space = {"others": "fixed", "max_num_batched_tokens": {"value": 256}, "gpu_memory_utilization": {"value": 1.0},
             "max_num_seqs": {"choices": [64, 1024]}}
    spec = load_spec(trace=fake.write_csv_trace(tmp_path / "t.csv", trace), model="m", gpu="h100",
                     slo="ttft:100000", trials=6, batch_size=2, run_dir=tmp_path / "run", context=ctx,
                     engine="sglang", space=space)
    evaluator = Evaluator(spec, trace=trace, cost_model=cost)
    study = create_or_resume(spec)
    run(study, spec, evaluator)
    trials = study.get_trials()
    full = [t for t in trials if t.user_attrs["config"]["max_num_seqs"] == 1024]
    assert full and all(t.state == TrialState.PRUNED for t in full)
    result, _ = evaluator.simulate(PolicyConfig.from_mapping(full[0].user_attrs["config"]))
    assert result.peak_step_tokens == n
    assert full[0].user_attrs["pruned"].startswith(f"SGLang runs out of GPU memory by t={result.peak_step_s:.6g} s: "
                                                   "a 600-token step needs ")
    capped = [t for t in trials if t.user_attrs["config"]["max_num_seqs"] == 64]
    assert capped and all(t.state == TrialState.COMPLETE for t in capped)
