"""Kills and other processes, as issue 18 found them: a run folder read from another
directory, a worker pointed at no journal, outputs swapped in whole, baselines a killed
run left RUNNING, and a budget the survivors of a killed worker still reach."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from optuna.trial import TrialState
from typer.testing import CliRunner

import costmodels
from optimizer.cli import app
from optimizer.outputs.reopen import open_run
from optimizer.outputs.runfolder import RunOutputs, write_run_outputs
from optimizer.outputs.staging import OUTPUTS, staged_outputs
from optimizer.search.evaluate import Evaluator
from optimizer.search.spec import load_spec
from optimizer.search.study import (
    JOURNAL,
    MANIFEST,
    StudyWarning,
    create_or_resume,
    enqueue_baselines,
    load_for_worker,
)
from tests.optimizer.test_study import COST_MODEL, finished, make_spec, tune
from tests.optimizer.tuning_helpers import FakeEngine, fake_score, make_trace, write_csv_trace

# Claims ``argv[3]`` trials of study ``argv[2]`` in journal ``argv[1]``, sleeps ``argv[4]`` s
# and dies without telling them: a killed tune or worker.
ASK_AND_DIE = """
import os, sys, time, optuna
from optuna.storages.journal import JournalFileBackend
from optimizer.search.ownership import OwnedJournalStorage
study = optuna.load_study(study_name=sys.argv[2], storage=OwnedJournalStorage(JournalFileBackend(sys.argv[1])))
for _ in range(int(sys.argv[3])):
    study.ask()
print("asked", flush=True)
time.sleep(float(sys.argv[4]))
os._exit(0)
"""


@pytest.fixture
def trace_file(tmp_path):
    return write_csv_trace(tmp_path / "tiny.csv")


def ask_and_die(spec, n: int, linger_s: float = 0.0) -> subprocess.Popen:
    """A process that claims ``n`` trials, then dies ``linger_s`` later; returns once they are claimed."""
    child = subprocess.Popen([sys.executable, "-c", ASK_AND_DIE, str(spec.run_dir / JOURNAL), spec.study_name,
                              str(n), str(linger_s)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "asked"
    # reaped as soon as it exits, as a shell reaps a killed worker (a zombie's pid is alive)
    threading.Thread(target=child.wait, daemon=True).start()
    return child


# -- 1. report from any working directory -----------------------------------------------------


def test_a_run_folder_opens_from_another_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_csv_trace(tmp_path / "trace.csv")
    spec = load_spec(trace="trace.csv", model="meta-llama/Llama-3.1-8B", gpu="h100", slo="ttft:1000",
                     run_dir="runs/x", study_name="x")
    create_or_resume(spec)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    loaded, _ = open_run(tmp_path / "runs" / "x")
    assert loaded.trace == (tmp_path / "trace.csv").resolve()
    # a manifest written before paths were stored absolute: relative to where tune ran
    manifest_path = tmp_path / "runs" / "x" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["spec"]["trace"]["path"] = "trace.csv"
    manifest_path.write_text(json.dumps(manifest))
    loaded, _ = open_run(tmp_path / "runs" / "x")
    assert loaded.trace.resolve() == (tmp_path / "trace.csv").resolve()



def test_a_worker_started_in_another_directory_finds_the_files_tune_was_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_csv_trace(tmp_path / "trace.csv")
    calibration = tmp_path / "calibration.json"
    calibration.write_text((Path(costmodels.__file__).parent / "data" / "calibration.json").read_text())
    spec = load_spec(trace="trace.csv", model="meta-llama/Llama-3.1-8B", gpu="h100", slo="ttft:1000",
                     run_dir="runs/x", study_name="x", calibration="calibration.json")
    create_or_resume(spec)
    asked = spec.fingerprint()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    joined, _ = load_for_worker("x", str(tmp_path / "runs" / "x" / JOURNAL))
    assert joined.trace == (tmp_path / "trace.csv").resolve()
    assert Path(joined.calibration) == calibration.resolve()
    assert joined.fingerprint() == asked  # the same question, wherever it is asked from

# -- 2. a worker on a journal that does not exist ----------------------------------------------


def test_worker_on_a_missing_journal_says_so_and_creates_nothing(tmp_path):
    journal = tmp_path / "nope" / "study.journal"
    result = CliRunner().invoke(app, ["worker", "--study", "s", "--storage", str(journal)])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: no study journal at ") and str(journal) in result.stderr
    assert not (tmp_path / "nope").exists()


# -- 3. outputs swapped in whole ----------------------------------------------------------------


def _write(out, label: str, plots: bool = True) -> None:
    (out / "vllm.yaml").write_text(f"best: {label}\n")
    if plots:
        (out / "plots").mkdir()
        (out / "plots" / "pareto.png").write_text(label)
    (out / "summary.json").write_text(json.dumps({"best": label}))


def _outputs(run) -> dict:
    return {name: (run / name).read_text() for name in ("vllm.yaml", "summary.json")}


def test_a_failed_write_leaves_the_previous_outputs_whole_and_nothing_behind(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / JOURNAL).write_text("journal")
    (run / MANIFEST).write_text("{}")
    (run / "summary.json").write_text("written before generations")  # an older run folder
    with staged_outputs(run) as out:
        _write(out, "old")
    before = _outputs(run)
    assert before == {"vllm.yaml": "best: old\n", "summary.json": '{"best": "old"}'}
    with pytest.raises(RuntimeError), staged_outputs(run) as out:
        (out / "vllm.yaml").write_text("best: new\n")
        raise RuntimeError("killed while writing")
    assert _outputs(run) == before and (run / "plots" / "pareto.png").read_text() == "old"
    with staged_outputs(run) as out:
        _write(out, "new", plots=False)
    assert _outputs(run) == {"vllm.yaml": "best: new\n", "summary.json": '{"best": "new"}'}
    assert not (run / "plots").exists() and not (run / "plots").is_symlink()  # not in this generation
    assert (run / JOURNAL).read_text() == "journal" and (run / MANIFEST).read_text() == "{}"
    assert sorted(p.name for p in (run / OUTPUTS).iterdir()) == sorted(["current", os.readlink(run / OUTPUTS / "current")])
    assert sorted(p.name for p in run.iterdir()) == sorted([OUTPUTS, JOURNAL, MANIFEST, "vllm.yaml", "summary.json"])


def test_write_run_outputs_keeps_the_old_outputs_when_a_writer_fails(tmp_path, monkeypatch):
    import optimizer.outputs.runfolder as outputs

    run = tmp_path / "run"

    def writer(label, fail=False):
        def write(out, study, spec, evaluator):
            _write(out, label)
            if fail:
                raise OSError("disk full")
            return RunOutputs({"vllm.yaml": out / "vllm.yaml", "summary.json": out / "summary.json"}, {"best": label})
        return write

    monkeypatch.setattr(outputs, "_write_outputs", writer("old"))
    written = write_run_outputs(run, None, None, None)
    assert written.files == {"vllm.yaml": run / "vllm.yaml", "summary.json": run / "summary.json"}
    monkeypatch.setattr(outputs, "_write_outputs", writer("new", fail=True))
    # one named error, never the OS error's traceback (a read-only folder, a full disk: issue 50)
    with pytest.raises(outputs.OutputError, match=r"cannot write the outputs to .*run: disk full; the study's "
                                                  r"trials are kept and the previous outputs stay"):
        write_run_outputs(run, None, None, None)
    assert _outputs(run) == {"vllm.yaml": "best: old\n", "summary.json": '{"best": "old"}'}
    assert len(list((run / OUTPUTS).glob("gen-*"))) == 1


# -- 4. baselines a killed run left RUNNING ------------------------------------------------------


def test_baselines_left_running_by_a_killed_run_are_enqueued_again_and_run_once(trace_file, tmp_path):
    spec = make_spec(trace_file, tmp_path)
    study = create_or_resume(spec)
    evaluator = Evaluator(spec, trace=make_trace(), cost_model=COST_MODEL, engine=FakeEngine(), scorer=fake_score)
    enqueue_baselines(study, spec, evaluator.baselines())
    ask_and_die(spec, 2).wait()  # the killed run had claimed both baselines
    assert [t.state for t in study.get_trials()] == [TrialState.RUNNING] * 2
    study, _, _ = tune(spec)
    trials = study.get_trials()
    assert [t.state for t in trials[:2]] == [TrialState.FAIL] * 2
    done = [t.user_attrs.get("baseline") for t in trials if t.state == TrialState.COMPLETE]
    assert sorted(b for b in done if b) == ["sglang-default", "vllm-default"]
    assert len(finished(study)) == spec.trials


# Claims the first enqueued trial of study ``argv[2]`` in journal ``argv[1]`` and dies before
# stamping its owner: the kill between the two writes of a claim (issue 50).
CLAIM_AND_DIE = """
import os, sys, optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState
storage = JournalStorage(JournalFileBackend(sys.argv[1]))  # not the owned storage: no stamp
study = optuna.load_study(study_name=sys.argv[2], storage=storage)
waiting = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.WAITING][0]
storage.set_trial_state_values(waiting._trial_id, TrialState.RUNNING)
os._exit(0)
"""


def test_a_baseline_claimed_by_a_run_killed_before_it_named_itself_is_run_again(trace_file, tmp_path, monkeypatch):
    """The claim and the owner's stamp are two writes; a kill between them left the default's
    trial RUNNING with no owner forever: the study ended a trial short with no baseline, and no
    rerun repaired it. Now such an orphan is failed once its grace has passed (0 s here) and
    its baseline enqueued again; the budget still counts exactly."""
    monkeypatch.setattr("optimizer.search.study.ORPHAN_GRACE_S", 0.0)
    spec = make_spec(trace_file, tmp_path)
    study = create_or_resume(spec)
    evaluator = Evaluator(spec, trace=make_trace(), cost_model=COST_MODEL, engine=FakeEngine(), scorer=fake_score)
    enqueue_baselines(study, spec, evaluator.baselines())
    subprocess.run([sys.executable, "-c", CLAIM_AND_DIE, str(spec.run_dir / JOURNAL), spec.study_name], check=True)
    first = study.get_trials()[0]
    assert first.state == TrialState.RUNNING and "worker" not in first.user_attrs
    study, _, _ = tune(spec)
    trials = study.get_trials()
    assert trials[0].state == TrialState.FAIL
    done = [t.user_attrs.get("baseline") for t in trials if t.state == TrialState.COMPLETE]
    assert sorted(b for b in done if b) == ["sglang-default", "vllm-default"]
    assert len(finished(study)) == spec.trials


def test_an_ownerless_claim_within_its_grace_is_left_alone():
    from datetime import datetime, timedelta

    from optuna.trial import create_trial

    from optimizer.search.study import ORPHAN_GRACE_S, orphaned

    fresh = create_trial(state=TrialState.RUNNING)
    assert not orphaned(fresh)  # just claimed: its owner's stamp may be the next write
    old = create_trial(state=TrialState.RUNNING)
    old.datetime_start = datetime.now() - timedelta(seconds=ORPHAN_GRACE_S + 1)
    assert orphaned(old)
    old.user_attrs["worker"] = "host:1"
    assert not orphaned(old)  # owned: the pid check decides


# -- a journal torn by a full disk or a kill mid-write (issue 50) ---------------------------------


@pytest.fixture(scope="module")
def whole_journal(tmp_path_factory):
    """A finished study's journal, written by a process that is gone."""
    import socket

    tmp = tmp_path_factory.mktemp("journal")
    spec = make_spec(write_csv_trace(tmp / "tiny.csv"), tmp, trials=8)
    tune(spec)
    journal = spec.run_dir / JOURNAL
    # the process that wrote it is gone (as after a kill): its trials name a dead owner
    me = f"{socket.gethostname()}:{os.getpid()}".encode()
    journal.write_bytes(journal.read_bytes().replace(me, f"{socket.gethostname()}:999999999".encode()))
    return journal


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0.05, 0.999), glue=st.booleans())
def test_a_journal_cut_mid_record_resumes_with_every_completed_trial(whole_journal, tmp_path_factory, cut, glue):
    """Cut the journal at any byte (a torn last record), optionally with a whole record glued
    on after it (what an append after a torn write left, before the repair); the rerun sets
    the torn bytes aside, says so, keeps every trial completed before the cut and reaches
    the budget."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    source = whole_journal
    data = source.read_bytes()
    at = int(len(data) * cut)
    torn = data[:at]
    if not torn.endswith(b"\n"):
        lines = data.split(b"\n")
        complete = b"\n".join(lines[: torn.count(b"\n")]) + (b"\n" if torn.count(b"\n") else b"")
    else:
        complete = torn
    tmp = tmp_path_factory.mktemp("cut")
    spec = make_spec(write_csv_trace(tmp / "tiny.csv"), tmp, trials=8)
    spec.run_dir.mkdir(parents=True)
    shutil.copy(source.parent / MANIFEST, spec.run_dir / MANIFEST)
    journal = spec.run_dir / JOURNAL
    journal.write_bytes(torn + (b'{"op_code":2,"worker_id":"x","study_id":0,"user_attr":{"glued":true}}\n'
                                if glue and not torn.endswith(b"\n") else b""))
    # what was complete before the cut, read by Optuna's own journal from the whole lines
    (tmp / "complete.journal").write_bytes(complete)
    before = optuna.load_study(study_name=spec.study_name,
                               storage=JournalStorage(JournalFileBackend(str(tmp / "complete.journal"))))
    done_before = {t.number: t.values for t in before.get_trials() if t.state == TrialState.COMPLETE}
    torn_bytes = not torn.endswith(b"\n")
    with pytest.warns(StudyWarning, match="half-written record") if torn_bytes else nullcontext():
        study, _, _ = tune(spec)
    after = {t.number: t.values for t in study.get_trials() if t.state == TrialState.COMPLETE}
    if glue and torn_bytes:
        assert study.user_attrs.get("glued") is True  # the whole record after the torn one is kept
    assert all(after.get(n) == v for n, v in done_before.items())  # nothing completed is lost or changed
    assert len(finished(study)) == spec.trials
    assert any(p.name.startswith(f"{JOURNAL}.torn-") for p in spec.run_dir.iterdir()) == torn_bytes


# -- 5. a worker killed while the others go on ---------------------------------------------------


def test_survivors_reach_the_budget_when_a_worker_dies_mid_study(trace_file, tmp_path):
    spec = make_spec(trace_file, tmp_path)
    create_or_resume(spec)
    child = ask_and_die(spec, 1, linger_s=5.0)  # alive when the run starts, dead before it ends
    start = time.perf_counter()
    # the wait for the other process's trial is said, not sat through in silence (issue 50)
    with pytest.warns(StudyWarning, match=r"waiting for 1 trial\(s\) other processes are running \(.*:\d+\)"):
        study, stats, _ = tune(spec)
    child.wait()
    states = [t.state for t in study.get_trials()]
    assert len(finished(study)) == spec.trials == stats.told
    assert TrialState.RUNNING not in states and states.count(TrialState.FAIL) == 1
    assert time.perf_counter() - start < 30


def test_a_lock_left_by_a_kill_is_said_and_taken_over(tmp_path, monkeypatch):
    """A journal lock a killed writer left made the next run sit about 30 s in silence (issue 50):
    it is said at once, and taken over once stale (Optuna's grace, shortened here)."""
    import optuna.storages.journal as journal

    from optimizer.search.study import repair_journal

    path = tmp_path / JOURNAL
    path.write_bytes(b'{"op_code":2,"worker_id":"x","study_id":0,"user_attr":{"a":1}}\n')
    os.symlink(path, f"{path}.lock")  # what a writer killed while appending leaves
    real = journal.JournalFileSymlinkLock
    monkeypatch.setattr(journal, "JournalFileSymlinkLock", lambda p: real(p, grace_period=1))
    start = time.monotonic()
    with pytest.warns(StudyWarning, match=r"study.journal is locked \(study.journal.lock\): .* taken over after 1 s"):
        assert repair_journal(path) is None
    assert time.monotonic() - start < 20 and not os.path.lexists(f"{path}.lock")


def test_defaults_enqueued_twice_by_two_processes_run_once(trace_file, tmp_path):
    """Two `tune` processes started together on one folder each enqueued the defaults, and
    vLLM's default ran twice (issue 50): the later copy is dropped unrun, outside the budget."""
    spec = make_spec(trace_file, tmp_path)
    study = create_or_resume(spec)
    evaluator = Evaluator(spec, trace=make_trace(), cost_model=COST_MODEL, engine=FakeEngine(), scorer=fake_score)
    enqueue_baselines(study, spec, evaluator.baselines())
    for name, config in evaluator.baselines().items():  # the other process's enqueue, before it saw ours
        study.enqueue_trial(spec.search_space.params_for(config, spec.fleet), user_attrs={"baseline": name},
                            skip_if_exists=False)
    study, _, _ = tune(spec)
    done = [t.user_attrs.get("baseline") for t in study.get_trials() if t.state == TrialState.COMPLETE]
    assert sorted(b for b in done if b) == ["sglang-default", "vllm-default"]
    dropped = [t for t in study.get_trials() if t.user_attrs.get("duplicate_baseline")]
    assert len(dropped) == 2 and all(t.state == TrialState.FAIL for t in dropped)
    assert len(finished(study)) == spec.trials
