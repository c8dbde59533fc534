"""`tune` reads what its spec file sets and names a bad deployment before creating anything."""

import numpy as np
from typer.testing import CliRunner

from optimizer.cli import app
from optimizer.cli.tune import DEFAULT_HOLDOUT, _holdout

SAMPLE = "studies/data/mooncake_conversation_300s.parquet"


def test_the_spec_files_holdout_is_used_unless_the_flag_says_otherwise(tmp_path):
    spec = tmp_path / "study.toml"
    spec.write_text("[study]\nholdout = 0.1\n")
    assert _holdout(None, spec) == 0.1
    assert _holdout(0.3, spec) == 0.3
    assert _holdout(None, None) == DEFAULT_HOLDOUT
    (tmp_path / "bare.toml").write_text("[study]\ntrials = 4\n")
    assert _holdout(None, tmp_path / "bare.toml") == DEFAULT_HOLDOUT


def test_an_unknown_model_or_gpu_is_named_before_any_run_folder(tmp_path):
    for flag, value, message in (("--model", "nope", "unknown model 'nope'"), ("--gpu", "tpu9", "unknown GPU")):
        args = {"--model": "meta-llama/Llama-3.1-8B", "--gpu": "h100", flag: value}
        run_dir = tmp_path / value
        result = CliRunner().invoke(app, ["tune", "--trace", SAMPLE, *[x for kv in args.items() for x in kv],
                                          "--slo", "ttft:2000", "--trials", "2", "--run-dir", str(run_dir)])
        assert result.exit_code == 2 and message in result.output
        assert "Traceback" not in result.output and not run_dir.exists()


def _tune(tmp_path, trace, *extra):
    from tests.optimizer.tuning_helpers import write_csv_trace

    path = write_csv_trace(tmp_path / "t.csv", trace)
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["tune", "--trace", str(path), "--model", "meta-llama/Llama-3.1-8B", "--gpu",
                                      "h100", "--slo", "ttft:2000,tpot:100", "--trials", "4", "--engine", "vllm",
                                      "-q", "--run-dir", str(run_dir), *extra])
    return result, run_dir


def test_a_trace_with_no_arrival_rate_stops_before_the_search_with_the_reason(tmp_path):
    """One request, or every request at t = 0: no rate to scale, no fleet to size, no timed
    replay; `tune` says so before creating anything (it used to die in the output phase)."""
    from tests.optimizer.tuning_helpers import make_trace

    for n, gap in ((1, 0.1), (50, 0.0)):
        result, run_dir = _tune(tmp_path / f"{n}", make_trace(n, gap_s=gap))
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert f"{n} request(s) arriving over 0 s; tuning needs arrivals spread over time" in result.output
        assert not run_dir.exists()


def test_a_tuning_part_with_no_arrival_rate_stops_before_the_search_and_names_the_holdout(tmp_path):
    """Two requests a second apart, or three at t = 0, 0, 10: the whole trace has a rate, but
    the part left after the default hold-out has one request, or all at once (it used to run
    the whole search, then die writing the bench command)."""
    from tests.optimizer.tuning_helpers import make_trace

    three = make_trace(3).replace(arrival_s=np.array([0.0, 0.0, 10.0]))
    for name, trace, n in (("two", make_trace(2, gap_s=1.0), 1), ("three", three, 2)):
        result, run_dir = _tune(tmp_path / name, trace)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert f"its tuning part (the last 25% of the window held out: --holdout): {n} request(s) arriving over 0 s" \
            in " ".join(result.output.split())
        assert "--holdout 0 tunes on the whole trace" in " ".join(result.output.split())
        assert not run_dir.exists()


def test_requests_over_the_context_are_left_to_the_engine_and_the_rest_is_tuned(tmp_path):
    """Two requests of 140,000 tokens on Llama-3.1-8B's 131,072-token context: every config
    refuses them, so they prune no config (they used to prune every one, the defaults too);
    the engine rejects them as it would, counted; a trace of nothing else is refused by name."""
    import json

    from tests.optimizer.tuning_helpers import make_trace

    trace = make_trace(100, gap_s=0.1, prompt=500, output=50)
    prompts = trace.prompt_tokens.copy()
    prompts[[3, 7]] = 140_000
    result, run_dir = _tune(tmp_path / "some", trace.replace(prompt_tokens=prompts))
    assert result.exit_code == 0, result.output
    assert "choosing what to deploy" in result.output  # the outputs stage says what it does, not a silent wait
    assert "2 request(s) need more than the model's context of 131,072 tokens (prompt + recorded output; " \
        "requests 3, 7)" in " ".join(result.output.split())
    summary = json.loads((run_dir / "vllm" / "summary.json").read_text())
    assert summary["best"]["report"]["n_rejected"] == 2  # both arrive in the tuning part
    result, run_dir = _tune(tmp_path / "all", make_trace(5, gap_s=0.1, prompt=140_000))
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "needs more than the model's 131,072-token context (prompt + output): no config can serve any of them; " \
        "their prompts alone fill it: drop them, or tune a model with a longer context" in " ".join(result.output.split())


def test_a_study_where_every_config_was_pruned_says_why_in_one_line():
    import optuna

    from optimizer.cli.tune import _why_nothing_ran

    study = optuna.create_study()
    for reason in ("KV holds 100 tokens; the smallest request needs 500", "KV holds 100 tokens; the smallest "
                   "request needs 500", "max_model_len=4096 rejects requests of up to 9000 tokens the KV holds"):
        trial = study.ask()
        trial.set_user_attr("pruned", reason)
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    text = _why_nothing_ran(study)
    assert text.startswith("; no config could serve this trace, the defaults included. Pruned: 2 trial(s): KV holds")
    assert "1 trial(s): max_model_len=4096" in text and "\n" not in text
    assert _why_nothing_ran(optuna.create_study()) == ""


def test_an_interrupt_while_the_outputs_are_written_says_what_is_kept(tmp_path, monkeypatch):
    """SIGINT outside the trial loop ended with no message (issue 50): now one line, exit 130."""
    from tests.optimizer.tuning_helpers import make_trace

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("optimizer.outputs.runfolder.write_run_outputs", interrupted)
    result, run_dir = _tune(tmp_path, make_trace(60, gap_s=0.1, prompt=500, output=50))
    assert result.exit_code == 130 and "Traceback" not in result.output
    assert "interrupted: every finished trial is kept" in result.output
    assert (run_dir / "vllm" / "study.journal").is_file()


def _record_warmups_and_trials(monkeypatch) -> list:
    """Each kernel warm-up (its name and whether it compiles the speculative planner) and the
    start of the trials, in the order `tune` runs them."""
    from optimizer.search import study as study_module
    from policies import engine, fleet

    events = []
    for name, module in (("engine", engine), ("fleet", fleet)):
        def warmup(speculative=True, real=module.warmup, name=name):
            events.append((name, speculative))
            real(speculative)
        monkeypatch.setattr(module, "warmup", warmup)
    real_run = study_module.run

    def run(*args, **kwargs):
        events.append("trials")
        return real_run(*args, **kwargs)

    monkeypatch.setattr(study_module, "run", run)
    return events


def test_tune_loads_its_kernels_before_the_first_trial_even_from_a_warm_cache(tmp_path, monkeypatch):
    """Issue 51: with the kernels already in Numba's disk cache, `tune` used to skip its
    warm-up, so the first trial and the first fleet run loaded them mid-search; it now
    warms up in its own process either way (the fleet too for a fleet study), before any
    trial, and only a cold cache is announced as a compile."""
    from tests.optimizer.tuning_helpers import make_trace

    events = _record_warmups_and_trials(monkeypatch)
    monkeypatch.setattr("optimizer.cli.tune._cold", lambda kernel: False)  # as after `servetune warmup`
    result, _ = _tune(tmp_path, make_trace(60, gap_s=0.1, prompt=500, output=50), "--replicas", "2", "--no-outputs")
    assert result.exit_code == 0, result.output
    assert events == [("engine", False), ("fleet", False), "trials"]
    assert "compiling" not in result.output


def test_the_first_trial_does_not_wait_for_the_fleet_kernel_only_the_sizing_runs(tmp_path, monkeypatch):
    """Issue 47: a one-replica study compiled the fleet kernel (117 s of CPU cold) before its
    first trial, though only the GPU sizing after the search runs it. It is now loaded, and
    announced when cold, right before the outputs."""
    from policies import fleet
    from tests.optimizer.tuning_helpers import make_trace

    events = _record_warmups_and_trials(monkeypatch)
    monkeypatch.setattr("optimizer.cli.tune._cold", lambda kernel: kernel is fleet.fleet_kernel)
    result, _ = _tune(tmp_path, make_trace(60, gap_s=0.1, prompt=500, output=50))
    assert result.exit_code == 0, result.output
    assert events == [("engine", False), "trials", ("fleet", False)]
    announced = result.output.index("compiling the fleet kernel")
    assert result.output.index("trials in") < announced < result.output.index("choosing what to deploy")
    assert "compiling the single-replica engine" not in result.output
