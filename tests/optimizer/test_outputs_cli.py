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


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from optimizer.evaluate import Evaluator
    from optimizer.spec import load_spec
    from optimizer.study import create_or_resume, enqueue_baselines, run
    from studies.traces import write_trace

    tmp = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(5)
    n = 300
    trace = make_trace(np.cumsum(rng.exponential(0.05, n)), rng.integers(100, 2000, n), rng.integers(2, 200, n))
    path = write_trace(trace, tmp / "trace.csv")
    spec = load_spec(trace=path, model="meta-llama/Llama-3.1-8B", gpu="h100", slo="ttft:1000,tpot:60",
                     trials=8, batch_size=4, study_name="cli-test", run_dir=tmp / "run")
    study = create_or_resume(spec)
    evaluator = Evaluator(spec)
    enqueue_baselines(study, spec, evaluator.baselines())
    run(study, spec, evaluator)
    return spec.run_dir


def test_report_regenerates_the_run_folder(run_dir):
    result = runner.invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "weighted goodput vs vllm-default" in result.output
    for name in ("summary.json", "trials.parquet", "vllm.yaml", "sglang.yaml", "policy.toml", "bench.sh",
                 "capacity-review.md", "capacity-review.html", "plots/pareto.png", "plots/rate-sweep.svg"):
        assert (run_dir / name).stat().st_size > 0, name


def test_export_writes_the_requested_trial_for_each_backend(run_dir, tmp_path):
    out = tmp_path / "t3.yaml"
    result = runner.invoke(app, ["export", str(run_dir), "--trial", "3", "--backend", "vllm", "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert "trial 3" in text.splitlines()[1]
    assert set(yaml.safe_load(text)) <= VLLM_033_KEYS
    result = runner.invoke(app, ["export", str(run_dir), "--backend", "sglang"])
    assert result.exit_code == 0, result.output
    data = yaml.safe_load(result.stdout)
    assert set(data) <= SGLANG_0523_KEYS and data["model-path"] == "meta-llama/Llama-3.1-8B"
    assert 0 < data["mem-fraction-static"] < 0.92  # activation reserve taken out


@pytest.mark.parametrize(("args", "message"), [
    (["export", "{run}", "--backend", "trtllm"], "unknown backend 'trtllm'"),
    (["export", "{run}", "--backend", "vllm", "--trial", "99"], "no trial 99 in this study"),
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
