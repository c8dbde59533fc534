"""`servetune tune` killed with SIGKILL while compiling, mid-trial and while writing its
outputs, and rerun on the same folder each time: every completed trial is kept, the budget
is met exactly, nothing is left RUNNING, the outputs in the folder always describe one
generation, and `servetune report` regenerates a consistent folder (issue 18, item 3).
The same for a worker killed on PostgreSQL."""

import json
import os
import signal
import subprocess
import sys
import uuid

import optuna
import polars as pl
import pytest
import yaml
from optuna.trial import TrialState

from tests.optimizer.test_tune_cli import (
    MODEL,
    chat_trace_file,
    counted,
    load,
    open_storage_for,
    pg_url,
    servetune,
    wait_for,
)

__all__ = ["pg_url"]  # the fixture, shared with the tune CLI tests

# tune, dying by SIGKILL the moment it starts writing trials.parquet: summary.json and the
# engine file of the new generation are staged by then, so the swap is what a kill interrupts
KILL_WHILE_WRITING = """
import os, signal, sys
import optimizer.outputs.runfolder as outputs
def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
outputs.trials_frame = die
from optimizer.cli import main
sys.argv = ["servetune", *sys.argv[1:]]
main()
"""


@pytest.fixture
def trace_file(tmp_path):
    """400 requests: small, so that every tune here writes its outputs quickly."""
    return chat_trace_file(tmp_path / "chat.csv", 400, seed=1)


def tune_cmd(trace, run_dir, name, trials, *extra):
    return servetune("tune", "--trace", trace, *MODEL, "--study-name", name, "--run-dir", run_dir,
                     "--engine", "vllm", "--quiet", "--batch-size", 2, "--trials", trials, *extra)


def run_ok(cmd, cwd, env=None):
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def safely(predicate):
    """``predicate``, False while what it reads is not there yet (no journal, no study)."""
    def check():
        try:
            return predicate()
        except (OSError, KeyError):
            return False
    return check


def kill_when(cmd, cwd, ready, env=None):
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_for(safely(ready), timeout=300)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def completed(journal, name) -> dict:
    return {t.number: t.values for t in load(open_storage_for(journal), name).get_trials()
            if t.state == TrialState.COMPLETE}


def outputs_of(folder) -> dict:
    """The run folder's outputs as a reader sees them, checked to describe one study state."""
    summary = json.loads((folder / "summary.json").read_text())
    engine_file = (folder / "vllm.yaml").read_text()
    frame = pl.read_parquet(folder / "trials.parquet")
    trial = summary["best"]["trial"]
    assert f"trial {trial}" in engine_file, "vllm.yaml and summary.json describe different trials"
    assert frame.height == sum(summary["trials"].values()), "trials.parquet and summary.json differ"
    best = frame.filter(pl.col("number") == trial)
    assert best.height == 1 and best["state"][0] == "COMPLETE"
    assert yaml.safe_load(engine_file), "the engine file does not parse"
    return {"trial": trial, "trials": summary["trials"], "yaml": engine_file}


def test_tune_killed_at_each_stage_and_rerun_loses_nothing(trace_file, tmp_path):
    run_dir, name = tmp_path / "run", "kills"
    folder = run_dir / "vllm"
    journal, study = str(folder / "study.journal"), f"{name}-vllm"

    # 1. while compiling: an empty kernel cache makes the first trials wait minutes on Numba
    cold = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "empty-cache")}
    kill_when(tune_cmd(trace_file, run_dir, name, 6), tmp_path,
              lambda: os.path.exists(journal) and load(open_storage_for(journal), study).get_trials(), env=cold)
    assert not completed(journal, study)

    # rerun: the claimed trials of the dead process are failed and asked again; outputs written
    run_ok(tune_cmd(trace_file, run_dir, name, 6), tmp_path)
    first = outputs_of(folder)
    assert first["trials"].get("complete", 0) + first["trials"].get("pruned", 0) == 6
    assert "running" not in first["trials"]

    # 2. mid-trial, with a larger budget: the outputs of the last run stay whole
    kill_when(tune_cmd(trace_file, run_dir, name, 500), tmp_path,
              lambda: len(counted(load(open_storage_for(journal), study))) >= 12)  # the journal exists by now
    kept = completed(journal, study)
    assert outputs_of(folder) == first
    budget = len(counted(load(open_storage_for(journal), study))) + 4  # beyond what the killed run reached

    # 3. while writing outputs: summary.json is staged, trials.parquet not; the folder shows
    # the old generation, never a mix
    subprocess.run([sys.executable, "-c", KILL_WHILE_WRITING, *tune_cmd(trace_file, run_dir, name, budget)[3:]],
                   cwd=tmp_path, capture_output=True, timeout=600)
    assert outputs_of(folder) == first
    assert len(counted(load(open_storage_for(journal), study))) == budget

    # the rerun keeps every completed trial, holds exactly the budget, leaves none RUNNING
    run_ok(tune_cmd(trace_file, run_dir, name, budget), tmp_path)
    final = load(open_storage_for(journal), study)
    assert len(counted(final)) == budget
    assert not final.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
    now = completed(journal, study)
    assert all(now[n] == v for n, v in kept.items())
    after = outputs_of(folder)
    assert after["trials"].get("complete", 0) + after["trials"].get("pruned", 0) == budget
    leftovers = [p.name for p in (folder / ".outputs").iterdir() if p.name != "current"]
    assert leftovers == [os.readlink(folder / ".outputs" / "current")], "a killed generation was left behind"

    # report regenerates the same recommendation from the study, from another directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run_ok(servetune("report", folder), elsewhere)
    assert outputs_of(folder) == after


@pytest.mark.postgres
def test_a_worker_killed_on_postgres_leaves_the_budget_to_the_survivors(trace_file, tmp_path, pg_url):
    url = pg_url
    name = f"pgkill-{uuid.uuid4().hex[:8]}"
    study, budget = f"{name}-vllm", 60
    common = ["--batch-size", 1, "--quiet"]
    tune = subprocess.Popen(tune_cmd(trace_file, tmp_path / name, name, budget, "--storage", url, "--no-outputs"),
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (tmp_path / name / "vllm" / "study.json").exists())
        victim = subprocess.Popen(servetune("worker", "--study", study, "--storage", url, *common),
                                  cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(safely(lambda: any(t.user_attrs.get("worker", "").endswith(f":{victim.pid}")
                                    for t in load(url, study).get_trials(states=(TrialState.COMPLETE,)))))
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        before = {t.number: t.values for t in load(url, study).get_trials(states=(TrialState.COMPLETE,))}
        _, err = tune.communicate(timeout=600)
        assert tune.returncode == 0, err.decode()
        final = load(url, study)
        assert len(counted(final)) == budget
        assert not final.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))
        now = {t.number: t.values for t in final.get_trials(states=(TrialState.COMPLETE,))}
        assert all(now[n] == v for n, v in before.items())
    finally:
        tune.kill()
        optuna.delete_study(study_name=study, storage=url)
