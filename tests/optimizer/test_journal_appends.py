"""A trial's params and attributes reach the journal in one append, as the same records."""

import json
from contextlib import nullcontext

import optuna
from optuna.storages.journal import JournalFileBackend

from optimizer.search.ownership import OwnedJournalStorage, one_append


def _study(path):
    storage = OwnedJournalStorage(JournalFileBackend(str(path)))
    return optuna.create_study(storage=storage, study_name="s", sampler=optuna.samplers.RandomSampler(seed=0))


def _write_trial(study, batched: bool):
    trial = study.ask()
    body = one_append(study) if batched else nullcontext()
    with body:
        trial.suggest_int("budget", 256, 16384, log=True)
        trial.suggest_categorical("policy", ["fcfs", "priority"])
        trial.set_user_attr("config", {"budget": 1})
        trial.set_user_attr("report", {"goodput": 0.5})
        trial.set_constraint("rejected_fraction", -0.1)
    study.tell(trial, 1.0)


def _records(path):
    """The journal's records less what differs between any two runs (writer, clock)."""
    varying = {"worker_id", "datetime_start", "datetime_complete"}
    return [{k: v for k, v in json.loads(line).items() if k not in varying} for line in path.read_text().splitlines()]


def test_one_append_writes_the_records_one_by_one_writes(tmp_path):
    one, many = tmp_path / "one.journal", tmp_path / "many.journal"
    _write_trial(_study(one), batched=True)
    _write_trial(_study(many), batched=False)
    assert _records(one) == _records(many)
    reread = optuna.load_study(study_name="s", storage=OwnedJournalStorage(JournalFileBackend(str(one))))
    (trial,) = reread.trials
    assert trial.user_attrs["report"] == {"goodput": 0.5} and trial.constraints == {"rejected_fraction": -0.1}
    assert set(trial.params) == {"budget", "policy"} and trial.state == optuna.trial.TrialState.COMPLETE


def test_the_body_is_one_fsync_and_the_trial_sees_its_own_writes(tmp_path, monkeypatch):
    study = _study(tmp_path / "j.journal")
    appends = []
    backend = study._storage._backend
    original = backend.append_logs
    monkeypatch.setattr(backend, "append_logs", lambda logs: (appends.append(len(logs)), original(logs))[1])
    trial = study.ask()
    appends.clear()
    with one_append(study):
        trial.suggest_int("budget", 256, 16384)
        trial.set_user_attr("report", {"goodput": 0.5})
        trial.set_constraint("p99_ttft_ms", 3.0)
        assert appends == []  # nothing written yet ...
        assert trial.user_attrs["report"] == {"goodput": 0.5}  # ... but the trial sees its writes
    assert appends == [3]
    assert study._storage.get_trial(trial._trial_id).user_attrs["report"] == {"goodput": 0.5}


def test_records_written_before_a_raise_still_reach_the_journal(tmp_path):
    study = _study(tmp_path / "j.journal")
    trial = study.ask()
    try:
        with one_append(study):
            trial.set_user_attr("config", {"budget": 1})
            raise RuntimeError("engine failed")
    except RuntimeError:
        pass
    assert study._storage.get_trial(trial._trial_id).user_attrs["config"] == {"budget": 1}


def test_other_storages_write_as_they_come():
    study = optuna.create_study()
    trial = study.ask()
    with one_append(study):
        trial.set_user_attr("config", {"budget": 1})
        assert study._storage.get_trial(trial._trial_id).user_attrs["config"] == {"budget": 1}


def test_a_seeded_tpe_asks_the_same_trials_when_params_are_written_in_one_append(tmp_path):
    """Buffering a trial's param records until its suggestions end changes no sampling:
    the sampler reads the trial being asked from its own cache, and the others from the file."""
    from types import SimpleNamespace

    from optimizer.search.samplers import make_sampler

    def asked(path, batched: bool) -> list[dict]:
        storage = OwnedJournalStorage(JournalFileBackend(str(path)))
        spec = SimpleNamespace(sampler="tpe", trials=40, batch_size=2)
        study = optuna.create_study(storage=storage, study_name="s", sampler=make_sampler(spec, 5))
        for _ in range(20):
            pair = [study.ask(), study.ask()]  # a batch in flight: the constant liar reads the other
            for trial in pair:
                with one_append(study) if batched else nullcontext():
                    trial.suggest_int("budget", 256, 16384, log=True)
                    if trial.suggest_categorical("gate", [False, True]):
                        trial.suggest_int("threshold", 64, 8192)
            for trial in pair:
                study.tell(trial, -abs(trial.params["budget"] - 3000) + trial.params.get("threshold", 0))
        return [t.params for t in study.trials]

    assert asked(tmp_path / "one.journal", True) == asked(tmp_path / "many.journal", False)
