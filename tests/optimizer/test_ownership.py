"""A trial names its owner from its first write: a process killed anywhere after ``ask``
leaves a trial the next process can fail, so the study's budget is never held by a ghost."""

import subprocess
import sys
import time
import warnings

import optuna
import pytest
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from optimizer.search.ownership import (
    WORKER_ATTR,
    OwnedJournalStorage,
    OwnedRDBStorage,
    heartbeats,
    worker_id,
)
from optimizer.search.study import _fail_stale, fail_dead_local_trials

optuna.logging.set_verbosity(optuna.logging.WARNING)

# The child asks and dies before it could record anything about the trial itself.
ASK_AND_DIE = """
import os, sys, optuna
from optuna.storages.journal import JournalFileBackend
from optimizer.search.ownership import OwnedJournalStorage, OwnedRDBStorage
url = sys.argv[1]
storage = (OwnedRDBStorage(url, heartbeat_interval=1, grace_period=1) if "://" in url
           else OwnedJournalStorage(JournalFileBackend(url)))
optuna.load_study(study_name="s", storage=storage).ask()
os._exit(0)
"""


def ask_and_die(url):
    subprocess.run([sys.executable, "-c", ASK_AND_DIE, url], check=True, timeout=120)


def journal_study(tmp_path):
    path = str(tmp_path / "study.journal")
    return path, optuna.create_study(study_name="s", storage=OwnedJournalStorage(JournalFileBackend(path)))


def test_a_trial_asked_by_a_killed_process_names_it_and_is_failed(tmp_path):
    path, study = journal_study(tmp_path)
    ask_and_die(path)
    (ghost,) = study.get_trials()
    assert ghost.state == TrialState.RUNNING
    host, _, pid = ghost.user_attrs[WORKER_ATTR].rpartition(":")
    assert host == worker_id().rpartition(":")[0] and pid.isdigit() and pid != worker_id().rpartition(":")[2]
    assert fail_dead_local_trials(study) == 1
    assert study.get_trials()[0].state == TrialState.FAIL


def test_live_trials_and_claimed_waiting_trials_belong_to_this_process(tmp_path):
    _, study = journal_study(tmp_path)
    study.enqueue_trial({"x": 0.5}, user_attrs={"baseline": "b"})
    claimed, fresh = study.ask(), study.ask()
    for trial in (claimed, fresh):
        assert study.get_trials()[trial.number].user_attrs[WORKER_ATTR] == worker_id()
    assert study.get_trials()[claimed.number].user_attrs["baseline"] == "b"
    assert fail_dead_local_trials(study) == 0
    assert all(t.state == TrialState.RUNNING for t in study.get_trials())


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")  # we beat ourselves, outside optimize()
def test_rdb_trials_of_a_dead_remote_worker_go_stale_while_beating_ones_stay(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = OwnedRDBStorage(url, heartbeat_interval=1, grace_period=1)
    study = optuna.create_study(study_name="s", storage=storage)
    ask_and_die(url)  # its trial got one heartbeat at creation, then none
    live = study.ask()
    with heartbeats(study, [live._trial_id]):
        time.sleep(3.5)
        _fail_stale(study)
    states = {t.number: t.state for t in study.get_trials()}
    assert states == {0: TrialState.FAIL, 1: TrialState.RUNNING}
