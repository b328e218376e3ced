"""The worker: one process's loop over a study's trials. Ask, run, tell, heartbeat, stop and timeout checks, retries.

    while budget left and not stopped:
        under the study's lock: fail lost trials (their retries are queued), count, ask
        run the trial (TrainerTrial) while a thread beats for it
        the outcome (sweep.outcomes) decides: tell, queue a retry or not, count a failure streak
        its checkpoints are released (sweep.checkpoints)

Several workers (processes, machines) may run this on one study at once: counting the trials in flight and asking
for a new one happen under `ask_lock`, so exactly `n_trials` trials are used. Every storage call goes through the
storage `Boundary` (sweep.storage): an outage is waited out for `storage_patience` seconds. The worker holds no
checkpoint or storage details of its own.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from sweep.checkpoints import CheckpointService
from sweep.components import build_sampler
from sweep.objective import TrainerTrial
from sweep.outcomes import (
    ATTR_FAIL,
    ATTR_INTERRUPTED,
    ATTR_OUTCOME,
    ATTR_RETRY_DEPTH,
    ATTR_RETRY_OF,
    ATTR_RETRY_REASON,
    ATTR_TRACEBACK,
    LOST_REASON,
    STOP_ATTR,
    Fault,
    Outcome,
    TimedOut,
    TrialResult,
    budget_counts,
    failure_signature,
    infrastructure_fault,
    jsonable,
)
from sweep.progress import Events, NoEvents
from sweep.schema import StudySpec
from sweep.signals import Preempted, raise_pending
from sweep.storage import Boundary, PatientStorage, StorageUnavailable, ask_lock, is_transient

__all__ = ["Events", "InfrastructureError", "NoEvents", "Preempted", "RunSummary", "StudyBrokenError", "Worker",
           "request_stop"]

MAX_INFRA_REPEATS = 3  # the same fault of the machine this many times in a row stops the worker


class StudyBrokenError(Exception):
    """Several trials in a row failed the same way: the code or the data is broken, not the configs."""


class InfrastructureError(Exception):
    """The same fault of the machine (disk full, checkpoint folder gone) repeated: fix it, then rerun."""


@dataclass
class RunSummary:
    ran: int  # trials this worker finished
    budget_used: int
    n_trials: int
    timed_out: bool = False
    exhausted: bool = False  # the sampler has tried every point of a finite search space
    stopped: bool = False  # `sweep stop` asked the workers to finish


def request_stop(study: optuna.Study) -> None:
    """Ask every worker running now to finish its current trial and exit; a later `sweep run` resumes."""
    study.set_user_attr(STOP_ATTR, time.time())


class Worker:
    """Runs trials of one study until its budget is used (by this worker and any others), `timeout` seconds pass,
    or `sweep stop` asks to finish. A trial that raises ends as failed, or, when the fault is the machine's, is
    retried; the study goes on. On Ctrl-C or SIGTERM the running trial is marked and queued again, and the exception
    propagates. `storage_url` is None only for an in-memory study (no lock, no checkpoints)."""

    def __init__(self, study: optuna.Study, spec: StudySpec, *, storage_url: str | None, boundary: Boundary,
                 events: Events | None = None, n_trials: int | None = None, timeout: float | None = None) -> None:
        self.study, self.spec, self.url, self.boundary = study, spec, storage_url, boundary
        self.events = events if events is not None else NoEvents()
        self.n_trials = n_trials if n_trials is not None else spec.n_trials
        self.timeout = timeout if timeout is not None else spec.timeout
        self.storage = study._storage  # noqa: SLF001 - Optuna has no public handle on a study's storage
        self.checkpoints = CheckpointService(storage_url, spec, study, boundary) if storage_url else None
        self.ran = 0
        self.streak: tuple[int, str | None] = (0, None)  # trials in a row that failed the same way, and how
        self.infra: tuple[int, str | None] = (0, None)  # the same for faults of the machine
        self.adopted: set[int] = set()  # silent trials this worker beat once for (`_adopt_silent_trials`)
        self.sampler_stopped = False
        self.fault_kind: str | None = None  # the latest fault of the machine, as compared for repeats
        self.started = time.monotonic()  # the sampler has tried every point of the space (brute force, grid)

    def run(self) -> RunSummary:
        started_wall, started = time.time(), self.started
        if self.checkpoints is not None:
            self.checkpoints.reconcile()
        first = True
        while True:
            raise_pending()
            if self.timeout is not None and time.monotonic() - started >= self.timeout:
                return self._summary(timed_out=True)
            if self._stop_requested(started_wall):
                return self._summary(stopped=True)
            with self._lock():
                self._fail_lost_trials()
                trials = self.study.get_trials(deepcopy=False)
                if first and trials:  # joining a study others have sampled: draw other configs than theirs
                    self.study.sampler = build_sampler(self.spec, joined_at=len(trials))
                first = False
                used, running = budget_counts(trials)
                if used >= self.n_trials:
                    return self._summary()
                trial = self.study.ask() if used + running < self.n_trials else None
            if trial is None:  # the last trials run elsewhere; wait in case one of their workers dies
                self._adopt_silent_trials(trials)
                time.sleep(self.spec.heartbeat_interval)
                continue
            frozen = self._run_one(trial)
            if frozen is None:
                continue
            self.ran += 1
            self.events.trial_finished(frozen)
            self._check_streak(frozen)
            if self.sampler_stopped:
                return self._summary(exhausted=True)

    # -----------------------------------------------------------------------------------------------------------------
    # One trial.

    def _run_one(self, trial: optuna.Trial) -> FrozenTrial | None:
        deadline = None if self.timeout is None else self.started + self.timeout
        runner = TrainerTrial(trial, self.spec, self.events, self.boundary, self.checkpoints, deadline=deadline,
                              storage_url=self.url)
        try:
            with self._heartbeat(trial):
                result = runner.run()
        except (KeyboardInterrupt, Preempted, TimedOut) as exc:
            outcome = Outcome.PREEMPTED if isinstance(exc, Preempted) else Outcome.INTERRUPTED
            reason = ("preempted (SIGTERM)" if isinstance(exc, Preempted) else
                      f"interrupted: --timeout of {self.timeout:g} s" if isinstance(exc, TimedOut) else "interrupted")
            self._end(trial, TrialResult(outcome, None, {ATTR_FAIL: reason, ATTR_INTERRUPTED: True}), runner)
            if isinstance(exc, TimedOut):
                return None  # the loop sees the timeout and stops
            raise
        except StorageUnavailable:
            raise  # nothing can be stored: the worker exits, and the trial is found lost and retried later
        except Exception as exc:  # noqa: BLE001 - a failing trial must never take the study down
            result = self._failure(exc)
        return self._end(trial, result, runner)

    def _failure(self, exc: Exception) -> TrialResult:
        folders = self.checkpoints.folders if self.checkpoints is not None else []
        fault = infrastructure_fault(exc, folders)
        if fault is None and is_transient(exc):
            first = str(exc).splitlines()[0] if str(exc) else ""
            fault = Fault(f"lost connection: {type(exc).__name__}: {first}", f"connection: {type(exc).__name__}")
        if fault is not None:
            self.fault_kind = fault.kind
            return TrialResult(Outcome.INFRASTRUCTURE, None, {ATTR_FAIL: f"infrastructure: {fault.reason}"})
        return TrialResult(Outcome.FAILED, None, {ATTR_FAIL: f"{type(exc).__name__}: {exc}",
                                                  ATTR_TRACEBACK: traceback.format_exc()[-4000:]})

    def _end(self, trial: optuna.Trial, result: TrialResult, runner: TrainerTrial) -> FrozenTrial | None:
        """Release the checkpoints (first: the best one's artifact is an attr, which only a running trial takes),
        store the outcome, queue the retry it calls for. None when another worker declared the trial lost meanwhile
        (its retry trains it again)."""
        runner.release(result)
        try:
            frozen = self._tell(trial, result)
        except optuna.exceptions.UpdateFinishedTrialError:
            # No heartbeat within the grace period (a paused machine, a storage outage longer than the grace period):
            # another worker failed it and queued a retry, which trains it again. This worker goes on.
            warnings.warn(f"trial {trial.number} was declared lost while this worker trained it (no heartbeat for "
                          f"{self.spec.heartbeat_grace_period} s); its retry trains it again", stacklevel=1)
            return None
        if result.outcome.retried:
            self._retry(frozen, str(result.reason), infrastructure=result.outcome == Outcome.INFRASTRUCTURE)
        return frozen

    def _tell(self, trial: optuna.Trial, result: TrialResult) -> FrozenTrial:
        for key, value in {**result.attrs, ATTR_OUTCOME: result.outcome.value}.items():
            trial.set_user_attr(key, jsonable(value))
        value = result.value if result.outcome == Outcome.COMPLETE else None
        try:
            return self.study.tell(trial, value, state=result.outcome.state)
        except RuntimeError as exc:
            # Samplers that have tried every point call Study.stop(), which only works inside study.optimize;
            # tell() has stored the trial anyway.
            if "Study.stop" not in str(exc):
                raise
            self.sampler_stopped = True
            return self.study.get_trials(deepcopy=False)[trial.number]

    def _retry(self, trial: FrozenTrial, reason: str, *, infrastructure: bool = False) -> None:
        """Queue the trial's params again; the retry resumes from the newest checkpoint of its lineage. Faults of
        the machine in a row are counted (`retry_depth`), and the same one `MAX_INFRA_REPEATS` times stops this
        worker: retrying cannot help until someone fixes the machine."""
        depth = trial.user_attrs.get(ATTR_RETRY_DEPTH, 0) + 1 if infrastructure else 0
        self.study.enqueue_trial(trial.params, user_attrs={ATTR_RETRY_OF: trial.number, ATTR_RETRY_REASON: reason,
                                                           ATTR_RETRY_DEPTH: depth})
        if infrastructure:
            kind = self.fault_kind  # the same errno in the same folder, whichever file it was
            count = self.infra[0] + 1 if self.infra[1] == kind else 1
            self.infra = (count, kind)
            if count >= MAX_INFRA_REPEATS:
                raise InfrastructureError(
                    f"{count} trials in a row were stopped by the same fault of the machine, not of their configs: "
                    f"{reason.removeprefix('infrastructure: ')}. Fix it (free space, remount or recreate the "
                    "folder), then rerun the same command: the trials resume from their checkpoints.")
        else:
            self.infra = (0, None)

    def _check_streak(self, frozen: FrozenTrial) -> None:
        signature = failure_signature(frozen)
        count = self.streak[0] + 1 if signature is not None and signature == self.streak[1] else int(
            signature is not None)
        self.streak = (count, signature)
        if self.spec.max_repeated_failures and count >= self.spec.max_repeated_failures:
            raise StudyBrokenError(
                f"{count} trials in a row failed the same way ({signature}); the code or the data is likely "
                f"broken, not the configs. Fix it and rerun, or raise max_repeated_failures.")

    # -----------------------------------------------------------------------------------------------------------------
    # Lost trials and heartbeats.

    def _fail_lost_trials(self) -> None:
        """A RUNNING trial whose worker stopped beating for the grace period is failed as lost, with its reason, and
        its params queued again (the retry resumes from the lineage's checkpoint)."""
        if not isinstance(self.storage, PatientStorage):
            return
        recovered = self.boundary.recovered_at
        if recovered is not None and time.monotonic() - recovered < self.spec.heartbeat_grace_period:
            # Right after an outage no worker could beat for its length: give them the grace period to beat again
            # before anyone is judged lost, or every trial that trained through the outage would be.
            return
        study_id = self.study._study_id  # noqa: SLF001 - Optuna has no public handle on it
        for trial_id in self.storage.stale_trial_ids(study_id):
            if self.storage.fail_lost_trial(trial_id, LOST_REASON):
                self._retry(self.storage.get_trial(trial_id), LOST_REASON)

    def _adopt_silent_trials(self, trials: list[FrozenTrial]) -> None:
        """A trial whose worker was stopped between asking for it and its first heartbeat (Ctrl-C while the sampler
        ran) stays RUNNING with no heartbeat, and the stale check never looks at it: the study would wait for it
        forever. One heartbeat on its behalf, once it is older than the grace period, makes it a trial that stopped
        beating, which the stale check then fails and retries. Once per trial: for a live trial the beat changes
        nothing, and a dead worker's trial is found stale one grace period later than it would have been."""
        if not isinstance(self.storage, PatientStorage):
            return
        for trial in trials:
            if trial.state == TrialState.RUNNING and trial.number not in self.adopted \
                    and self.storage.trial_age_s(trial) > self.spec.heartbeat_grace_period:
                self.adopted.add(trial.number)
                with contextlib.suppress(Exception):
                    self.storage.backend.record_heartbeat(trial._trial_id)  # noqa: SLF001

    @contextlib.contextmanager
    def _heartbeat(self, trial: optuna.Trial) -> Iterator[None]:
        """Beats for the running trial from a background thread, so a worker that dies stops beating. Straight to
        the database, not through the boundary: a beat missed in an outage is simply the next one's job."""
        if not isinstance(self.storage, PatientStorage) or self.storage.heartbeat_interval is None:
            yield
            return
        backend, interval, trial_id = self.storage.backend, self.storage.heartbeat_interval, trial._trial_id  # noqa: SLF001
        stopped = threading.Event()

        def beat() -> None:
            while not stopped.wait(interval):
                with contextlib.suppress(Exception):  # a storage blip: beat again next time rather than never again
                    backend.record_heartbeat(trial_id)

        self.storage.record_heartbeat(trial_id)
        thread = threading.Thread(target=beat, daemon=True, name=f"heartbeat-{trial.number}")
        thread.start()
        try:
            yield
        finally:
            stopped.set()
            thread.join()

    # -----------------------------------------------------------------------------------------------------------------

    def _lock(self) -> contextlib.AbstractContextManager[None]:
        if self.url is None:
            return contextlib.nullcontext()
        return ask_lock(self.url, self.study.study_name, self.boundary)

    def _stop_requested(self, since: float) -> bool:
        requested = self.study.user_attrs.get(STOP_ATTR)
        return requested is not None and requested > since

    def _summary(self, **flags: bool) -> RunSummary:
        used = budget_counts(self.study.get_trials(deepcopy=False))[0]
        return RunSummary(self.ran, used, self.n_trials, **flags)
