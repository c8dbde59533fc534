"""`servetune tune` and `servetune worker` as users run them: separate processes sharing a
study through a journal file (or PostgreSQL), killed and resumed without losing a trial."""

import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from optimizer.search.study import open_storage
from studies.traces import Trace
from tests.optimizer.tuning_helpers import make_trace, write_csv_trace

optuna.logging.set_verbosity(optuna.logging.WARNING)

MODEL = ["--model", "meta-llama/Llama-3.1-8B", "--gpu", "h100", "--slo", "ttft:500,tpot:30"]


def servetune(*args):
    return [sys.executable, "-c", "from optimizer.cli import main; main()", *map(str, args)]


def chat_trace_file(path, n: int, seed: int = 0):
    """``n`` chat requests at about 20 req/s (prompts 100-3000, outputs 10-300 tokens) as a CSV."""
    rng = np.random.default_rng(seed)
    base = make_trace(n)
    trace = Trace(**{**{f: getattr(base, f) for f in ("tenant", "priority", "slo_class", "deadline_s",
                                                        "block_offsets", "block_hashes")},
                     "arrival_s": np.cumsum(rng.exponential(0.05, n)),
                     "prompt_tokens": rng.integers(100, 3000, n), "output_tokens": rng.integers(10, 300, n),
                     "max_tokens": np.full(n, 300)})
    return write_csv_trace(path, trace)


@pytest.fixture
def trace_file(tmp_path):
    return chat_trace_file(tmp_path / "chat.csv", 1500)


@pytest.fixture
def pg_url():
    """The PostgreSQL server ``.ci/postgres.sh`` starts; a test needing it skips without one."""
    url = os.environ.get("SERVETUNE_TEST_PG_URL")
    if not url:
        pytest.skip("SERVETUNE_TEST_PG_URL is unset; source .ci/postgres.sh to start a server")
    return url


def load(storage, name):
    return optuna.load_study(study_name=name, storage=storage)


def counted(study):
    return [t for t in study.get_trials() if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]


def wait_for(predicate, timeout=120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError("timed out")


def test_tune_prints_gains_and_rejects_bad_input(trace_file, tmp_path):
    out = subprocess.run(servetune("tune", "--trace", trace_file, *MODEL, "--trials", 6, "--no-outputs",
                                   "--run-dir", tmp_path / "run"),
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    # one study per engine (both by default), each against its own engine's defaults
    assert "vLLM 0.33.0" in text and "SGLang 0.5.23" in text
    assert "│ vllm-default " in text and "│ sglang-default " in text
    # a gain is the exported file's, replayed: without outputs none is stated, rather than a searched trial's
    assert text.count("--no-outputs: no file written, so no gain is stated") == 2
    assert "gain of" not in text and "gain over" not in text
    bad = subprocess.run(servetune("tune", "--trace", trace_file, *MODEL, "--trials", 6, "--slo", "ttft:1",
                                   "--run-dir", tmp_path / "run"),
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and "different question (slo differ)" in bad.stderr and "Traceback" not in bad.stderr


def test_resume_after_kill_keeps_every_completed_trial(trace_file, tmp_path):
    run_dir = tmp_path / "run"
    journal = str(run_dir / "vllm" / "study.journal")  # runs/<study>/<engine>/
    name = "killme-vllm"  # the study of the vLLM target
    cmd = servetune("tune", "--trace", trace_file, *MODEL, "--study-name", "killme", "--run-dir", run_dir,
                    "--engine", "vllm", "--no-outputs", "--quiet", "--batch-size", 2)
    proc = subprocess.Popen([*cmd, "--trials", "500"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: os.path.exists(journal) and len(counted(load(open_storage_for(journal), name))) >= 12)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = {t.number: t.values for t in counted(load(open_storage_for(journal), name))}
    out = subprocess.run([*cmd, "--trials", "40"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    study = load(open_storage_for(journal), name)
    after = {t.number: t.values for t in counted(study)}
    assert len(after) == 40
    assert all(after[n] == v for n, v in before.items())
    assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))


def open_storage_for(journal):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(journal))


def shared_study(trace_file, tmp_path, storage, name, reader):
    """One tune process and two workers on one storage; the budget is met exactly.

    The budget is large enough that the tune process is still searching when the workers
    have started (about 3 s of imports and set-up each), so all of them take trials."""
    budget = 240
    common = ["--batch-size", 1, "--quiet"]
    tune = subprocess.Popen(servetune("tune", "--trace", trace_file, *MODEL, "--trials", budget, "--study-name", name,
                                      "--run-dir", tmp_path / name, "--storage", storage, "--engine", "vllm",
                                      "--no-outputs", *common),
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for(lambda: (tmp_path / name / "vllm" / "study.json").exists())
    workers = [subprocess.Popen(servetune("worker", "--study", f"{name}-vllm", "--storage", storage, *common),
                                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
    for p in (tune, *workers):
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()
    study = reader()
    done = counted(study)
    assert len(done) == budget
    assert len({t.number for t in done}) == budget
    extra = [t for t in study.get_trials() if t.state == TrialState.FAIL]
    assert all(t.user_attrs.get("over_budget") for t in extra)
    assert len([t for t in done if "baseline" in t.user_attrs]) == 1  # a vLLM study's one baseline: vllm-default
    assert len({t.user_attrs["worker"] for t in done}) >= 2  # the workers did share the work


def test_processes_share_one_journal(trace_file, tmp_path):
    journal = str(tmp_path / "shared.journal")
    shared_study(trace_file, tmp_path, journal, "shared", lambda: load(open_storage_for(journal), "shared-vllm"))


@pytest.mark.postgres
def test_processes_share_one_postgres_study(trace_file, tmp_path, pg_url):
    url = pg_url
    name = f"pg-{uuid.uuid4().hex[:8]}"
    try:
        shared_study(trace_file, tmp_path, url, name, lambda: load(url, f"{name}-vllm"))
    finally:
        optuna.delete_study(study_name=f"{name}-vllm", storage=url)


@pytest.mark.postgres
def test_open_storage_reaches_postgres(tmp_path, pg_url):
    url = pg_url

    class Spec:
        storage = url
        run_dir = tmp_path

    assert open_storage(Spec()).get_all_studies() is not None
