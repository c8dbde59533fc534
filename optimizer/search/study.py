"""The Optuna study: storage, creation and resume, baselines, and the batched trial loop.

Storage is a journal file ``RUN_DIR/study.journal`` by default, or any Optuna RDB URL
(``--storage`` or ``SERVETUNE_STORAGE``), e.g. PostgreSQL for workers on many machines.
The study stores its spec (``user_attrs["servetune_spec"]``) and fingerprint, so a worker
needs only the study name and storage, and a different question under the same name, or
a run folder that belongs to another study, is refused instead of mixed in.

The loop asks a batch of trials, builds their configs, prunes the ones that cannot run
(the engine refuses them at start-up, or the trace cannot fit), simulates the rest in one
parallel ``simulate_many`` call and tells each result as soon as its batch finishes, so a
killed run loses at most the batch in flight; a run that ran out of activation memory
(``policies.workspace``) is pruned with the step, the memory and the time instead. The trial
budget is global: every process counts the study's non-failed trials, so several workers
share one budget; a trial asked past the budget (two workers racing) is told FAIL with
``user_attrs["over_budget"]``. Every trial names its owning process from the moment it is
written (``optimizer.search.ownership``); trials left RUNNING by a dead local process (and, on an
RDB, by a remote worker whose heartbeat went stale) are failed when a process opens the
study and between batches of every running process, and a baseline among them is enqueued
again. A process whose share is done waits while other processes' trials run, so the
survivors of a killed worker still reach the budget in completed trials.

The manifest ``RUN_DIR/study.json`` stores the spec with absolute paths, so ``report``
and ``bench`` read a run folder from any working directory.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.search import objective as objectives
from optimizer.search.capacity import capacity_many
from optimizer.search.ownership import (
    WORKER_ATTR,
    OwnedJournalStorage,
    OwnedRDBStorage,
    heartbeats,
    one_append,
    worker_id,
)
from optimizer.search.samplers import make_sampler
from optimizer.search.space import speculative_starts
from optimizer.search.spec import StudySpec, spec_from_dict
from policies.engine import SimulationStalled

MANIFEST = "study.json"
JOURNAL = "study.journal"
SPEC_ATTR = "servetune_spec"
FINGERPRINT_ATTR = "servetune_fingerprint"
BOUNDS_ATTR = "bounds"
START_ATTR = "start"  # the trial is a verify budget's starting point (enqueue_baselines)
HEARTBEAT_S = 60
POLL_S = 1.0  # how often a process with nothing to ask checks the other processes' trials


class StudyError(RuntimeError):
    """Storage that cannot be reached, or a study/run folder that does not match the spec."""


@dataclass
class RunStats:
    """What one process did: trials told, and where its wall time went."""

    told: int = 0
    pruned: int = 0
    wall_s: float = 0.0
    optuna_s: float = 0.0  # ask, suggest, tell, budget checks (beside the engine's batch in flight)
    engine_s: float = 0.0  # simulate + score

    @property
    def trials_per_s(self) -> float:
        return self.told / self.wall_s if self.wall_s > 0 else 0.0


# -- storage ---------------------------------------------------------------------------
def storage_url(spec: StudySpec) -> str | None:
    return spec.storage or os.environ.get("SERVETUNE_STORAGE") or None


def redact(url: str) -> str:
    """The URL with any password replaced by ***."""
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in creds else url


def open_storage(spec: StudySpec):
    """The study's storage; raises StudyError naming the storage when it cannot be opened.
    A journal's half-written records are set aside first (``repair_journal``)."""
    url = storage_url(spec)
    if url is None or "://" not in url:
        path = Path(url) if url else Path(spec.run_dir) / JOURNAL
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            from optuna.storages.journal import JournalFileBackend

            backend = JournalFileBackend(str(path))
            repair_journal(path)
            return OwnedJournalStorage(backend)
        except OSError as exc:
            raise StudyError(f"cannot open journal storage {path}: {exc.strerror or exc}") from None
    kwargs: dict[str, Any] = {}
    if url.startswith("postgresql"):
        kwargs["engine_kwargs"] = {"connect_args": {"connect_timeout": 10}}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return OwnedRDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=3 * HEARTBEAT_S, **kwargs)
    except Exception as exc:  # sqlalchemy/driver errors vary by backend
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StudyError(f"cannot reach storage {redact(url)}: {detail}") from None


class StudyWarning(UserWarning):
    """Something done to a study's storage that its user should know of (a repaired journal)."""


#: How every record of Optuna's journal begins: where a record appended after a torn one starts.
_RECORD_START = b'{"op_code"'


def repair_journal(path: Path) -> str | None:
    """Set aside what a torn write left in the journal at ``path`` and say so; None if whole.

    A write cut short (a full disk, a kill mid-append) leaves a last record without its line
    end; Optuna skips it when reading, but the next append would glue a whole record onto it,
    and from then on the journal no longer reads. Under the journal's own lock (no writer is
    mid-append), a torn tail is cut off, and a line that is a torn record with a whole one
    glued on (a journal written before this repair existed) keeps the whole one. The file as
    it was is kept beside it (``<journal>.torn-<time>``). Every complete record stays.
    """
    from optuna.storages.journal import JournalFileSymlinkLock

    if not path.is_file() or path.stat().st_size == 0:
        return None
    lock = JournalFileSymlinkLock(str(path))
    held = Path(f"{path}.lock")
    if os.path.lexists(held):  # say why the next seconds may pass in silence
        warnings.warn(f"{path} is locked ({held.name}): another process is writing it, or one was killed while "
                      f"writing; a lock nobody renews is taken over after {lock.grace_period} s", StudyWarning,
                      stacklevel=2)
    lock.acquire()
    try:
        data = path.read_bytes()
        *lines, tail = data.split(b"\n")
        kept, dropped = [], len(tail)
        for line in lines:
            record = _whole_record(line)
            if record is None:
                dropped += len(line) + 1  # with its line end
            else:
                dropped += len(line) - len(record)
                kept.append(record)
        if dropped == 0:
            return None
        aside = path.with_name(f"{path.name}.torn-{datetime.now():%Y%m%dT%H%M%S%f}-{os.getpid()}")
        aside.write_bytes(data)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(b"".join(line + b"\n" for line in kept))
        os.replace(tmp, path)
    finally:
        lock.release()
    message = (f"{path}: {dropped} byte(s) of a half-written record (a full disk or a kill mid-write) set aside; "
               f"every complete record is kept; the journal as it was is in {aside.name}")
    warnings.warn(message, StudyWarning, stacklevel=2)
    return message


def _whole_record(line: bytes) -> bytes | None:
    """``line`` if it is a whole record, else the whole record glued after a torn one, else None."""
    glued = line.rfind(_RECORD_START)
    for start in (0, glued) if glued > 0 else (0,):
        try:
            json.loads(line[start:])
        except ValueError:
            continue
        return line[start:]
    return None


# -- creation and resume -----------------------------------------------------------------
def create_or_resume(spec: StudySpec, *, seed: int | None = None) -> optuna.Study:
    """Open the spec's study, creating it (with baselines enqueued) if it does not exist.

    Refuses a run folder or an existing study that holds a different question.
    """
    fingerprint = spec.fingerprint()
    _check_manifest(spec, fingerprint)
    storage = open_storage(spec)
    direction_names = list(objectives.objective_for(spec).directions)
    names = {s.study_name for s in _all_studies(storage, spec)}
    if storage_url(spec) is None and names - {spec.study_name}:
        raise StudyError(f"{Path(spec.run_dir) / JOURNAL} holds study {sorted(names)}, not {spec.study_name!r}; "
                         "use another --run-dir or the original --study-name")
    study = optuna.create_study(storage=storage, study_name=spec.study_name, directions=direction_names,
                                sampler=make_sampler(spec, spec.seed if seed is None else seed),
                                load_if_exists=True)
    stored = study.user_attrs.get(FINGERPRINT_ATTR)
    if stored is None:
        if study.get_trials(deepcopy=False):
            raise StudyError(f"study {spec.study_name!r} already has trials but was not made by servetune; "
                             "choose another --study-name")
        study.set_user_attr(SPEC_ATTR, manifest_spec(spec))  # absolute paths: workers start anywhere
        study.set_user_attr(FINGERPRINT_ATTR, fingerprint)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(list(objectives.objective_for(spec).metrics))
    elif stored != fingerprint:
        raise StudyError(_mismatch(f"study {spec.study_name!r}", study.user_attrs.get(SPEC_ATTR, {}),
                                   manifest_spec(spec)))
    _write_manifest(spec, fingerprint)
    reap(study)  # so a baseline a killed run left RUNNING is enqueued again
    return study


def load_for_worker(study_name: str, storage: str, *, trace: str | None = None, batch_size: int | None = None,
                    seed: int | None = None) -> tuple[StudySpec, optuna.Study]:
    """Join an existing study as a worker: the spec comes from the study itself.

    A journal path that does not exist is refused (opening it would create an empty one).
    """
    if "://" not in storage and not Path(storage).is_file():
        raise StudyError(f"no study journal at {storage}: start the study with `servetune tune` first, "
                         "or pass the journal it wrote (RUN_DIR/study.journal)")
    probe = open_storage(_Probe(storage))
    try:
        study = optuna.load_study(study_name=study_name, storage=probe)
    except KeyError:
        known = sorted(s.study_name for s in optuna.get_all_study_summaries(probe))
        raise StudyError(f"no study {study_name!r} in {redact(storage)}; studies there: {known}") from None
    stored = study.user_attrs.get(SPEC_ATTR)
    if stored is None:
        raise StudyError(f"study {study_name!r} was not created by servetune tune; start it with tune first")
    spec = spec_from_dict(stored, storage=storage, trace=trace, batch_size=batch_size)
    check_fingerprint(spec, study, "pass --trace with the same file")
    study.sampler = make_sampler(spec, seed)
    return spec, study


def check_fingerprint(spec: StudySpec, study: optuna.Study, remedy: str) -> None:
    """Refuse a study whose inputs (the trace's content first) changed since it was created:
    its trials' figures belong to the old ones."""
    if spec.fingerprint() != study.user_attrs.get(FINGERPRINT_ATTR):
        raise StudyError(f"the trace at {spec.trace} (or another input) differs from the one study "
                         f"{spec.study_name!r} was created with; {remedy}")


@dataclass(frozen=True)
class _Probe:
    storage: str
    run_dir: str = "."


def _all_studies(storage, spec: StudySpec):
    try:
        return storage.get_all_studies()
    except Exception as exc:
        url = storage_url(spec)
        raise StudyError(f"cannot read storage {redact(url) if url else Path(spec.run_dir) / JOURNAL}: {exc}") from None


def _check_manifest(spec: StudySpec, fingerprint: str) -> None:
    path = Path(spec.run_dir) / MANIFEST
    if not path.exists():
        return
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StudyError(f"{path} is unreadable ({exc}); it is not a servetune run folder") from None
    if manifest.get("study_name") != spec.study_name:
        raise StudyError(f"run folder {spec.run_dir} belongs to study {manifest.get('study_name')!r}, not "
                         f"{spec.study_name!r}; use another --run-dir, or the original --study-name to resume it")
    if manifest.get("fingerprint") != fingerprint:
        raise StudyError(_mismatch(f"run folder {spec.run_dir}", manifest.get("spec", {}), manifest_spec(spec)))


def _write_manifest(spec: StudySpec, fingerprint: str) -> None:
    path = Path(spec.run_dir) / MANIFEST
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    url = storage_url(spec)
    body = {"study_name": spec.study_name, "fingerprint": fingerprint,
            "storage": redact(url) if url else JOURNAL, "spec": manifest_spec(spec)}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=2, default=str) + "\n")
    tmp.replace(path)


def manifest_spec(spec: StudySpec) -> dict:
    """``spec.to_dict()`` with its file paths absolute, as the manifest and the study store it."""
    data = spec.to_dict()
    data["trace"]["path"] = str(Path(spec.trace).resolve())
    for key in ("calibration", "model_config"):
        if key in data["deployment"]:
            data["deployment"][key] = str(Path(data["deployment"][key]).resolve())
    return data


def _mismatch(what: str, stored: dict, new: dict) -> str:
    differing = sorted(section for section in ("trace", "deployment", "slo", "objective", "constraints", "space")
                       if stored.get(section) != new.get(section))
    detail = f" ({', '.join(differing)} differ)" if differing else " (the trace file's content differs)"
    return (f"{what} was created for a different question{detail}; nothing was changed. Rerun with the "
            "original spec to resume, or pass another --study-name / --run-dir to start a new study")


# -- baselines ---------------------------------------------------------------------------
def enqueue_baselines(study: optuna.Study, spec: StudySpec, baselines: dict) -> None:
    """Enqueue each preset that has no trial yet, or only failed ones (a rerun finds the
    others there), then each verify budget's starting point (``space.speculative_starts``);
    on a new study, before any sampled trial."""
    trials = [t for t in study.get_trials(deepcopy=False) if t.state != TrialState.FAIL]
    present = {t.user_attrs.get("baseline") for t in trials}
    for name, config in baselines.items():
        if name not in present:
            study.enqueue_trial(spec.search_space.params_for(config, spec.fleet), user_attrs={"baseline": name})
    started = {t.user_attrs.get(START_ATTR) for t in trials}
    for name, config in speculative_starts(spec.search_space, baselines).items():
        if name not in started:
            study.enqueue_trial(spec.search_space.params_for(config, spec.fleet), user_attrs={START_ATTR: name})


def study_bounds(study: optuna.Study, spec: StudySpec, evaluator) -> objectives.Bounds:
    """The study's bounds (``objective.bounds``), computed once from the baselines and
    stored, so every process and every rerun judges trials by the same ones."""
    stored = study.user_attrs.get(BOUNDS_ATTR)
    if stored is None:
        limits = objectives.bounds(spec.constraints, spec.slos,
                                   evaluator.reports(list(evaluator.baselines().values())))
        study.set_user_attr(BOUNDS_ATTR, limits.to_dict())
        return limits
    return objectives.Bounds(**stored)


# -- the loop ------------------------------------------------------------------------------
def reap(study: optuna.Study) -> int:
    """Fail the trials of dead owners (local pids, stale heartbeats); return how many."""
    return fail_dead_local_trials(study) + _fail_stale(study)


def fail_dead_local_trials(study: optuna.Study) -> int:
    """Fail RUNNING trials whose owner is a dead process on this host, and claimed trials
    that never got an owner (``orphaned``); return how many."""
    host = socket.gethostname()
    failed = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = str(t.user_attrs.get(WORKER_ATTR, ""))
        owner_host, _, pid = owner.rpartition(":")
        if (owner_host == host and pid.isdigit() and not alive(int(pid))) or orphaned(t):
            study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
            failed += 1
    return failed


#: How long a claimed trial may stand without an owner: claiming an enqueued trial and
#: stamping its owner are two consecutive writes (``optimizer.search.ownership``), so one left
#: ownerless longer was claimed by a process killed between them.
ORPHAN_GRACE_S = 30.0


def orphaned(trial: FrozenTrial) -> bool:
    """A RUNNING trial with no owner, claimed more than ``ORPHAN_GRACE_S`` ago."""
    if trial.state != TrialState.RUNNING or WORKER_ATTR in trial.user_attrs or trial.datetime_start is None:
        return False
    return (datetime.now() - trial.datetime_start).total_seconds() > ORPHAN_GRACE_S


def alive(pid: int) -> bool:
    """Whether process ``pid`` on this host is running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run(study: optuna.Study, spec: StudySpec, evaluator, *, on_trial: Callable | None = None,
        stop: Callable[[], bool] | None = None, overlap: bool = True) -> RunStats:
    """Run batches until the study holds ``spec.trials`` finished trials (global budget).

    A batch is simulated on a worker thread while the next batch is asked (the kernels
    release the GIL, so TPE's ask runs beside them instead of after them); the evaluator is
    touched only by that thread and the study only by this one, and the next ask sees the
    batch in flight as running trials (TPE's constant liar). Between batches, dead owners'
    trials are failed (their baselines enqueued again) and their slots asked anew; with
    nothing left to ask while other processes' trials run, it waits for them, since their
    owner may die. ``on_trial(frozen_trial, stats)`` is called after each tell (progress
    display). An error or interrupt fails the trials not yet told (at most two batches).
    ``overlap=False`` evaluates and tells each batch before asking the next (the loop
    ``benchmarks/tuner_speed.py`` and ``search_quality.py`` compare against).
    """
    stats = RunStats()
    start = time.perf_counter()
    engine_before = evaluator.engine_seconds
    limits = study_bounds(study, spec, evaluator)
    baselines = evaluator.baselines()
    me = worker_id()
    waited = False
    batch: list = []
    flight: _Flight | None = None
    lane = ThreadPoolExecutor(1, thread_name_prefix="servetune-evaluate") if overlap else None
    try:
        while True:
            stopping = stop is not None and stop()
            batch, k = [], 0
            if not stopping:
                t0 = time.perf_counter()
                if reap(study):
                    enqueue_baselines(study, spec, baselines)
                trials = study.get_trials(deepcopy=False)
                waiting = sum(t.state == TrialState.WAITING for t in trials)
                counted = sum(t.state != TrialState.FAIL for t in trials)
                k = min(spec.batch_size, max(0, spec.trials - counted) + waiting)
                if k:
                    batch = _ask(study, spec, baselines, k)
                stats.optuna_s += time.perf_counter() - t0
            if flight is not None:
                flight.land(study, spec, limits, stats, on_trial)
                flight = None
                if not batch:
                    continue  # count again: the budget may be met, or a told trial freed a slot
            if not batch:
                if stopping or k or not _wait_for_others(trials, me, warn=not waited):
                    break  # stopped, the last slots went to another process, or no trial runs elsewhere
                waited = True
                continue
            flight = _Flight.launch(lane, study, spec, evaluator, batch)
            batch = []
            if lane is None:
                flight.land(study, spec, limits, stats, on_trial)
                flight = None
    except BaseException:
        for trial, *_ in batch + (flight.batch if flight is not None else []):
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)  # told trials are skipped
        raise
    finally:
        if flight is not None:
            flight.beats.close()
        if lane is not None:
            lane.shutdown(wait=True)
    stats.engine_s = evaluator.engine_seconds - engine_before
    stats.wall_s = time.perf_counter() - start
    return stats


def _wait_for_others(trials, me: str, *, warn: bool) -> bool:
    """Whether trials run in other processes (or were claimed without an owner yet, failed
    once orphaned); if so, wait ``POLL_S``, since their owner may die and its trials are then
    failed and asked again here. ``warn``: say so (once per run)."""
    elsewhere = [t for t in trials if t.state == TrialState.RUNNING and t.user_attrs.get(WORKER_ATTR) != me]
    if not elsewhere:
        return False
    if warn:  # the budget is spent here, the rest is other processes' trials
        owners = sorted({str(t.user_attrs.get(WORKER_ATTR, "no owner yet")) for t in elsewhere})
        warnings.warn(f"waiting for {len(elsewhere)} trial(s) other processes are running ({', '.join(owners)}): "
                      "a dead owner's are failed and asked again here (a local pid at once, a remote worker once "
                      f"its heartbeat is {3 * HEARTBEAT_S:g} s stale, an unclaimed one after {ORPHAN_GRACE_S:g} s)",
                      StudyWarning, stacklevel=3)
    time.sleep(POLL_S)
    return True


@dataclass
class _Outcome:
    """What the evaluator made of one trial: pruned (with the reason) or scored."""

    trial: Any
    config: Any
    fleet: Any
    pruned: str | None = None
    report: Any = None
    capacity: float | None = None


@dataclass
class _Flight:
    """A batch being evaluated on the worker thread, its trials kept alive by heartbeats."""

    batch: list
    future: Future
    beats: ExitStack

    @classmethod
    def launch(cls, lane: ThreadPoolExecutor | None, study, spec, evaluator, batch) -> _Flight:
        """Start evaluating ``batch`` on ``lane`` (None: here, before returning)."""
        beats = ExitStack()
        beats.enter_context(heartbeats(study, [trial._trial_id for trial, *_ in batch]))
        if lane is not None:
            return cls(batch, lane.submit(_evaluate, spec, evaluator, batch), beats)
        future: Future = Future()
        try:
            future.set_result(_evaluate(spec, evaluator, batch))
        except BaseException:
            beats.close()
            raise
        return cls(batch, future, beats)

    def land(self, study, spec, limits, stats: RunStats, on_trial) -> None:
        """Wait for the batch's outcomes and tell them."""
        try:
            outcomes = self.future.result()
        finally:
            self.beats.close()
        for o in outcomes:
            if o.pruned is not None:
                _tell_pruned(study, o.trial, o.config, o.fleet, o.pruned, stats, on_trial)
                continue
            t0 = time.perf_counter()
            with one_append(study):
                values = objectives.record(o.trial, spec, o.config, o.report, limits, fleet=o.fleet,
                                           capacity=o.capacity)
            frozen = study.tell(o.trial, values)
            stats.optuna_s += time.perf_counter() - t0
            stats.told += 1
            if on_trial:
                on_trial(frozen, stats)


def _evaluate(spec, evaluator, batch) -> list[_Outcome]:
    """Each trial of ``batch`` pruned or scored; touches the evaluator, never the study."""
    outcomes, runnable = [], []
    for trial, config, fleet in batch:
        reason = evaluator.infeasibility(config, fleet)
        if reason is None:
            runnable.append((trial, config, fleet))
        else:
            outcomes.append(_Outcome(trial, config, fleet, pruned=reason))
    runnable = _drop_stalled(evaluator, runnable, outcomes)
    if not runnable:
        return outcomes
    configs, fleets = [c for _, c, _ in runnable], [f for _, _, f in runnable]
    reports = evaluator.reports(configs, fleets=fleets)
    capacities = capacity_many(evaluator, configs, spec.capacity_target, fleets=fleets) \
        if spec.objective == "capacity" else [None] * len(configs)
    for (trial, config, fleet), report, capacity in zip(runnable, reports, capacities, strict=True):
        oom = evaluator.out_of_memory(config, fleet)
        if oom is not None:  # the engine would have died mid-run: not a config to recommend
            outcomes.append(_Outcome(trial, config, fleet, pruned=f"{evaluator.target.display} {oom}"))
        else:
            outcomes.append(_Outcome(trial, config, fleet, report=report, capacity=capacity))
    return outcomes


def _tell_pruned(study, trial, config, fleet, reason: str, stats: RunStats, on_trial) -> None:
    t0 = time.perf_counter()
    with one_append(study):
        trial.set_user_attr("config", config.to_dict())
        for name, value in fleet.to_dict().items():
            trial.set_user_attr(name, value)
        trial.set_user_attr("pruned", reason)
    frozen = study.tell(trial, state=TrialState.PRUNED)
    stats.optuna_s += time.perf_counter() - t0
    stats.told += 1
    stats.pruned += 1
    if on_trial:
        on_trial(frozen, stats)


def _drop_stalled(evaluator, runnable, outcomes: list[_Outcome]) -> list:
    """``runnable`` less the configs whose simulation stalls (a servetune defect, named in
    the trial, which is pruned so that it counts against the budget and the study goes on)."""
    try:
        evaluator.reports([c for _, c, _ in runnable], fleets=[f for *_, f in runnable])
        return runnable
    except SimulationStalled:
        pass
    kept = []
    for trial, config, fleet in runnable:  # alone, to find which ones stall
        try:
            evaluator.reports([config], fleets=[fleet])
            kept.append((trial, config, fleet))
        except SimulationStalled as exc:
            outcomes.append(_Outcome(trial, config, fleet, pruned=f"internal error, please report it: {exc}"))
    return kept


def _ask(study, spec, baselines, k) -> list[tuple[Any, Any, Any]]:
    """Up to ``k`` (trial, config, fleet); baselines run on the spec's fleet."""
    batch = []
    for _ in range(k):
        with warnings.catch_warnings():  # Optuna expects heartbeats from optimize(); ours come from run()
            warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
            trial = study.ask()
        earlier = sum(t.state != TrialState.FAIL and t.number < trial.number
                      for t in study.get_trials(deepcopy=False))
        if earlier >= spec.trials:
            trial.set_user_attr("over_budget", True)
            study.tell(trial, state=TrialState.FAIL)
            break
        name = trial.user_attrs.get("baseline")
        if name in baselines and _duplicate_baseline(study, trial.number, name):
            # two processes started on one study each enqueued the defaults: run them once
            trial.set_user_attr("duplicate_baseline", True)
            study.tell(trial, state=TrialState.FAIL)
            continue
        with one_append(study):
            if name in baselines:
                config, fleet = baselines[name], spec.fleet
                spec.search_space.record(trial, config, fleet)
            else:
                config, fleet = spec.search_space.suggest(trial), spec.search_space.suggest_fleet(trial)
        batch.append((trial, config, fleet))
    return batch


def _duplicate_baseline(study, number: int, name: str) -> bool:
    """Whether an earlier trial of baseline ``name`` ran, runs or waits (not failed)."""
    return any(t.number < number and t.user_attrs.get("baseline") == name and t.state != TrialState.FAIL
               for t in study.get_trials(deepcopy=False))


def _fail_stale(study: optuna.Study) -> int:
    """Fail RUNNING trials whose heartbeat went stale (a no-op on storages without
    heartbeats); return how many."""
    storage = study._storage  # Optuna exposes no public handle on a study's storage
    if not getattr(storage, "get_heartbeat_interval", lambda: None)():
        return 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        stale = storage._get_stale_trial_ids(study._study_id)
        optuna.storages.fail_stale_trials(study)
    return len(stale)


# -- results -------------------------------------------------------------------------------
def best_goodput_trial(study: optuna.Study, max_gpus: int | None = None):
    """The feasible completed trial with the most weighted goodput (any objective mode).

    ``max_gpus`` restricts it to trials whose fleet uses at most that many GPUs.
    """
    best = None
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if not objectives.is_feasible(t) or "report" not in t.user_attrs:
            continue
        if max_gpus is not None and t.user_attrs.get("gpus", 0) > max_gpus:
            continue
        if best is None or _goodput(t) > _goodput(best):
            best = t
    return best


def baseline_trials(study: optuna.Study) -> dict[str, Any]:
    return {t.user_attrs["baseline"]: t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if "baseline" in t.user_attrs}


def gains(study: optuna.Study) -> dict[str, float]:
    """Best weighted goodput / each baseline's, on the same trace and at most the baseline's GPUs.

    inf when a baseline has no goodput. Capping the GPUs keeps a study that searches the
    fleet from crediting a bigger fleet's goodput to the scheduler knobs.
    """
    out = {}
    for name, t in baseline_trials(study).items():
        best = best_goodput_trial(study, max_gpus=t.user_attrs.get("gpus"))
        if best is None:
            continue
        base = _goodput(t)
        out[name] = _goodput(best) / base if base > 0 else float("inf")
    return out


def _goodput(t) -> float:
    return float(t.user_attrs["report"].get("weighted_goodput") or 0.0)
