"""`servetune report` and `servetune export` on a run folder made by the study code."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from optimizer.cli import app
from tests.optimizer.test_exports import SGLANG_0523_KEYS, VLLM_033_KEYS
from tests.optimizer.test_outputs_fixtures import make_trace

runner = CliRunner()


def _study(tmp, engine: str):
    from optimizer.search.evaluate import Evaluator
    from optimizer.search.spec import load_spec
    from optimizer.search.study import create_or_resume, enqueue_baselines, run
    from studies.traces import write_trace

    rng = np.random.default_rng(5)
    n = 300
    trace = make_trace(np.cumsum(rng.exponential(0.05, n)), rng.integers(100, 2000, n), rng.integers(2, 200, n))
    path = write_trace(trace, tmp / "trace.csv")
    spec = load_spec(trace=path, model="meta-llama/Llama-3.1-8B", gpu="h100", slo="ttft:1000,tpot:60",
                     trials=8, batch_size=4, study_name=f"cli-test-{engine}", run_dir=tmp / engine, engine=engine)
    study = create_or_resume(spec)
    evaluator = Evaluator(spec)
    enqueue_baselines(study, spec, evaluator.baselines())
    run(study, spec, evaluator)
    return spec.run_dir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A vLLM study's run folder."""
    return _study(tmp_path_factory.mktemp("run"), "vllm")


@pytest.fixture(scope="module")
def sglang_run_dir(tmp_path_factory):
    return _study(tmp_path_factory.mktemp("run"), "sglang")


def test_report_regenerates_the_run_folder(run_dir):
    result = runner.invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "weighted goodput vs vllm-default" in result.output
    assert "sglang-default" not in result.output  # a vLLM study's baseline is vLLM's own defaults
    for name in ("summary.json", "trials.parquet", "vllm.yaml", "bench-vllm.sh", "trace.jsonl", "bench.json",
                 "capacity-review.md", "capacity-review.html", "plots/pareto.png", "plots/rate-sweep.svg"):
        assert (run_dir / name).stat().st_size > 0, name
    # only the study's own engine file: its trials are not SGLang configs or what-ifs
    assert not (run_dir / "sglang.yaml").exists() and not (run_dir / "policy.toml").exists()


def test_export_writes_the_requested_trial_for_the_studys_engine(run_dir, sglang_run_dir, tmp_path):
    from optuna.trial import TrialState

    from optimizer.outputs.reopen import open_run

    _, study = open_run(run_dir, None)
    # a sampled trial the search completed (vLLM's rules prune some, e.g. a budget below max-num-seqs)
    number = next(t.number for t in study.get_trials(deepcopy=False)
                  if t.state == TrialState.COMPLETE and "baseline" not in t.user_attrs)
    out = tmp_path / "t.yaml"
    result = runner.invoke(app, ["export", str(run_dir), "--trial", str(number), "--backend", "vllm", "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert f"trial {number}" in text.splitlines()[1]
    assert set(yaml.safe_load(text)) <= VLLM_033_KEYS
    # without --trial: the file tune recommended, which a study run without outputs has not chosen yet
    result = runner.invoke(app, ["export", str(sglang_run_dir)])
    assert result.exit_code == 2 and "has no sglang.yaml yet" in result.output
    assert runner.invoke(app, ["report", str(sglang_run_dir)]).exit_code == 0
    result = runner.invoke(app, ["export", str(sglang_run_dir)])  # the backend defaults to the study's engine
    assert result.exit_code == 0, result.output
    assert result.stdout == (sglang_run_dir / "sglang.yaml").read_text()
    data = yaml.safe_load(result.stdout)
    assert set(data) <= SGLANG_0523_KEYS and data["model-path"] == "meta-llama/Llama-3.1-8B"
    assert 0 < data["mem-fraction-static"] < 0.92  # activation reserve taken out


@pytest.mark.parametrize(("args", "message"), [
    (["export", "{run}", "--backend", "trtllm"], "unknown backend 'trtllm'"),
    (["export", "{run}", "--backend", "vllm", "--trial", "99"], "no trial 99 in this study"),
    (["export", "{run}", "--backend", "sglang"], "its trials are not sglang configs"),
    (["export", "{missing}", "--backend", "vllm"], "does not exist"),
    (["report", "{missing}"], "does not exist"),
    (["report", "{empty}"], "not a servetune run folder"),
])
def test_bad_run_folder_trial_or_backend_is_one_line_and_exit_2(run_dir, tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    paths = {"run": run_dir, "missing": tmp_path / "nope", "empty": tmp_path / "empty"}
    result = runner.invoke(app, [a.format(**paths) for a in args])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_sglang_bench_replay_uses_sglangs_own_client_and_compares(sglang_run_dir):
    import json

    from optimizer.bench.results import SGLANG_ONLY, RequestTimes
    from optimizer.bench.run import BenchRun
    from studies.replay import SGLANG_TOKENS_PER_ID

    assert runner.invoke(app, ["report", str(sglang_run_dir)]).exit_code == 0
    script = (sglang_run_dir / "bench-sglang.sh").read_text()
    assert 'CLIENT="${CLIENT:-sglang}"' in script
    assert "--dataset-name mooncake" in script and "trace-sglang.jsonl" in script and "--output-details" in script
    bench = BenchRun.open(sglang_run_dir)
    rows = [json.loads(line) for line in (sglang_run_dir / "trace-sglang.jsonl").read_text().splitlines()]
    ids = np.array([len(r["hash_ids"]) for r in rows])
    # SGLang writes ~129 tokens per id: the rebuilt prompts land near the trace's
    assert np.all(np.abs(ids * SGLANG_TOKENS_PER_ID - bench.trace.prompt_tokens) <= SGLANG_TOKENS_PER_ID)
    sim = RequestTimes.simulated(bench.simulate(bench.trace, bench.cost_model()), bench.trace)
    reported = bench.trace.prompt_tokens + 30  # the chat template SGLang adds
    body = {SGLANG_ONLY: int(sim.output_tokens.sum()), "duration": sim.duration_s,
            "input_lens": reported.tolist(), "output_lens": sim.output_tokens.tolist(),
            "ttfts": (sim.ttft_ms / 1e3).tolist(),
            "itls": [[(e - t) / 1e3 / max(o - 1, 1)] * max(o - 1, 0)
                     for t, e, o in zip(sim.ttft_ms, sim.e2el_ms, sim.output_tokens, strict=True)],
            "errors": [""] * sim.n}
    path = sglang_run_dir / "bench-result.json"
    path.write_text(json.dumps(body) + "\n")
    out = runner.invoke(app, ["compare", str(sglang_run_dir), str(path)], terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "sglang:bench-result.json vs simulated sglang.yaml" in out.output


def test_report_refuses_a_trace_changed_since_the_study_ran(tmp_path):
    """`report` re-simulates: on a trace edited in place it would print figures of traffic the
    study never saw beside the study's own (issue 50); it refuses, as `tune` does."""
    run_dir = _study(tmp_path, "vllm")
    trace = tmp_path / "trace.csv"
    lines = trace.read_text().splitlines()
    trace.write_text("\n".join(lines[:-5]) + "\n")  # the last requests gone
    result = runner.invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "differs from the one study 'cli-test-vllm' was created with" in result.output
    assert not (run_dir / "summary.json").exists()


def test_report_and_export_take_the_study_folder_as_compare_does(run_dir, tmp_path):
    """`runs/<study>` (every target's folder inside) was refused as "not a servetune run folder"
    (issue 47): report regenerates each target; export takes the one target, or --backend."""
    import shutil

    study = tmp_path / "study"
    shutil.copytree(run_dir.parent, study, symlinks=True)
    result = runner.invoke(app, ["report", str(study)])
    assert result.exit_code == 0, result.output
    assert f"{study / 'vllm'}: " in result.output and (study / "vllm" / "summary.json").is_file()
    exported = runner.invoke(app, ["export", str(study)])
    assert exported.exit_code == 0 and exported.stdout == (study / "vllm" / "vllm.yaml").read_text()
    (study / "sglang").mkdir()
    (study / "sglang" / "study.json").write_text((study / "vllm" / "study.json").read_text())
    ambiguous = runner.invoke(app, ["export", str(study)])
    assert ambiguous.exit_code == 2 and "holds the studies of ['sglang', 'vllm']; pass --backend NAME" in ambiguous.output
    chosen = runner.invoke(app, ["export", str(study), "--backend", "vllm"])
    assert chosen.exit_code == 0 and chosen.stdout == exported.stdout


def test_the_journal_opens_with_optunas_own_storage_as_optuna_dashboard_opens_it(run_dir):
    """docs/guide.md points `optuna-dashboard` at a run folder's journal: it reads it through
    Optuna's plain JournalStorage (no servetune code), so every trial must be there."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(run_dir / "study.journal")))
    (summary,) = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    assert summary.study_name == "cli-test-vllm" and len(study.trials) >= 8
    assert study.best_trial.values is not None
