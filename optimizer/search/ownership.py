"""Storages whose trials name their owning process from the first write, and heartbeats.

``study.ask()`` writes a RUNNING trial, then runs the sampler, and only then could the
caller record who owns it. A process killed in between would leave a RUNNING trial that
no one can attribute; it would hold a slot of the study's global budget forever. Here
the owner (``host:pid``) is part of the write that creates the trial, so the next local
process can tell that the owner is dead and fail the trial. A WAITING trial (an enqueued
baseline) is stamped straight after it is claimed, with no sampling in between.

On an RDB, remote workers cannot be checked by pid: each trial gets a heartbeat when it
is created and every ``heartbeat_interval`` while it is evaluated, and Optuna fails the
ones whose heartbeat went stale.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import datetime
from typing import Any

import optuna
from optuna.storages import JournalStorage, RDBStorage
from optuna.trial import FrozenTrial, TrialState

WORKER_ATTR = "worker"


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class _OwnedTrials:
    """Mixin over an Optuna storage: new and claimed trials carry ``user_attrs["worker"]``."""

    def _owned(self, template_trial: FrozenTrial | None) -> FrozenTrial:
        return template_trial or FrozenTrial(
            number=-1, state=TrialState.RUNNING, value=None, datetime_start=datetime.now(), datetime_complete=None,
            params={}, distributions={}, user_attrs={WORKER_ATTR: worker_id()}, system_attrs={},
            intermediate_values={}, trial_id=-1)

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        claimed = super().set_trial_state_values(trial_id, state, values)
        if claimed and state == TrialState.RUNNING:
            self.set_trial_user_attr(trial_id, WORKER_ATTR, worker_id())
            self._started(trial_id)
        return claimed

    def _started(self, trial_id: int) -> None:
        """Hook for storages that track liveness per trial."""


class OwnedJournalStorage(_OwnedTrials, JournalStorage):
    """A journal file (one host): dead owners are found by pid.

    Optuna appends (locks, writes and fsyncs) each record on its own; ``one_append`` gathers
    the records a body writes into one append at its end: the same records, a fraction of the
    fsyncs (a trial's params, or its evidence and constraints).
    """

    _pending: list[dict[str, Any]] | None = None

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        return super().create_new_trial(study_id, self._owned(template_trial))

    def _write_log(self, op_code: int, extra_fields: dict[str, Any]) -> None:
        if self._pending is None:
            super()._write_log(op_code, extra_fields)
        else:
            self._pending.append({"op_code": op_code, "worker_id": self._replay_result.worker_id, **extra_fields})

    @contextmanager
    def one_append(self) -> Iterator[None]:
        """Write the body's records as one append when it ends (also when it raises, as they
        would have been written one by one). Only for writes whose readers use the trial's
        own cache until then: params and attributes, never a trial's creation or state.
        A kill inside the body loses them with the trial, which is then reaped as any other."""
        self._pending = []
        try:
            yield
        finally:
            logs, self._pending = self._pending, None
            if logs:
                with self._thread_lock:
                    self._backend.append_logs(logs)
                    self._sync_with_backend()


class OwnedRDBStorage(_OwnedTrials, RDBStorage):
    """An RDB shared across hosts: a trial's first heartbeat is written as it starts."""

    # Optuna's cache in front of an RDB calls this private method, not create_new_trial.
    def _create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> FrozenTrial:
        trial = super()._create_new_trial(study_id, self._owned(template_trial))
        if template_trial is None:
            self._started(trial._trial_id)
        return trial

    def _started(self, trial_id: int) -> None:
        if self.get_heartbeat_interval():
            self.record_heartbeat(trial_id)


@contextmanager
def heartbeats(study: optuna.Study, trial_ids: Sequence[int]) -> Iterator[None]:
    """Beat for ``trial_ids`` from a background thread while the body runs (the engine
    releases the GIL), so a long batch is not mistaken for a dead worker."""
    storage = study._storage  # Optuna exposes no public handle on a study's storage
    interval = getattr(storage, "get_heartbeat_interval", lambda: None)()
    if not interval or not trial_ids:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            for trial_id in trial_ids:
                storage.record_heartbeat(trial_id)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name="servetune-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def one_append(study: optuna.Study):
    """``OwnedJournalStorage.one_append`` on a journal; on other storages, writes as they come."""
    storage = study._storage  # Optuna exposes no public handle on a study's storage
    return storage.one_append() if isinstance(storage, OwnedJournalStorage) else nullcontext()
