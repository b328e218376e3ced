"""The worker: one process's loop over a study's trials. Ask, run, tell, heartbeat, stop and timeout checks, retries.

    while budget left and not stopped:
        under the study's lock: fail lost trials (their retries are queued), count, ask
        run the trial (its runner: sweep.runners) while a thread beats for it
        the outcome (sweep.outcomes) decides: tell, queue a retry or not, count a failure streak
        its checkpoints are released (sweep.checkpoints)

Several workers (processes, machines) may run this on one study at once: counting the trials in flight and asking
for a new one happen under `ask_lock`, so exactly `n_trials` trials are used. Every storage call goes through the
storage `Boundary` (sweep.storage): an outage is waited out for `storage_patience` seconds. The worker holds no
checkpoint or storage details of its own.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from sweep.checkpoints import CheckpointService
from sweep.components import build_sampler, unexplored_point
from sweep.confirm import confirmations_due
from sweep.outcomes import (
    ATTR_CONFIRMS,
    ATTR_FAIL,
    ATTR_INTERRUPTED,
    ATTR_OUTCOME,
    ATTR_RETRY_DEPTH,
    ATTR_RETRY_OF,
    ATTR_RETRY_REASON,
    ATTR_TRACEBACK,
    ATTR_WARM_START,
    ATTR_WITHDRAWN,
    FOLDER_FIX,
    HEARTBEAT_ATTR,
    LOST_REASON,
    STOP_ATTR,
    Fault,
    Outcome,
    TimedOut,
    TrialResult,
    budget_counts,
    failure_reason,
    failure_signature,
    infrastructure_fault,
    jsonable,
    lost_in_a_row,
    outcome_of,
    retried_numbers,
)
from sweep.progress import Events, NoEvents
from sweep.results import ran_by_sweep
from sweep.runners import Runner, runner_for
from sweep.schema import StudySpec, sqlite_damage
from sweep.signals import Preempted, mark_unmarked, raise_pending, trial_code
from sweep.storage import (
    Boundary,
    PatientStorage,
    StorageAway,
    StorageUnavailable,
    ask_lock,
    clock_offset,
    damaged_database,
    database_gone,
    database_identity,
    error_line,
    is_transient,
    never_lost,
    release_idle_connections,
    storage_refusal,
)
from sweep.tracking import end_lost_run
from sweep.urls import sqlite_path
from sweep.workers import LAUNCHED_ENV
from trainer.messages import error_words, message, unreadable
from trainer.precision import host_memory_limit

__all__ = ["Events", "InfrastructureError", "NoEvents", "Preempted", "RunSummary", "StudyBrokenError", "Worker",
           "request_stop"]

MAX_INFRA_REPEATS = 3  # the same fault of the machine this many times in a row stops the worker
MAX_LOST_REPEATS = 3  # a lineage lost this many times in a row without getting further is failed, not retried


class StudyBrokenError(Exception):
    """Several trials in a row failed the same way: the code or the data is broken, not the configs, or (`varying`:
    the searched keys and values the failures differ in, before any trial trained) a region of the search space.
    `advice(used)` words it again with the budget used once the run has wound down: in a cohort, the members that
    ended at the same evaluation are recorded after the one that completed the row, and may spend the rest of the
    budget."""

    def __init__(self, count: int, signature: str, n_trials: int, used: int, varying: str = "") -> None:
        self.count, self.signature, self.n_trials, self.varying = count, signature, n_trials, varying
        super().__init__(self.advice(used))

    def advice(self, used: int) -> str:
        rerun = (f"Fix it, then rerun with a larger --n-trials: these failures spent the budget ({used}/"
                 f"{self.n_trials} trials done), so a rerun alone trains nothing" if used >= self.n_trials else
                 "Fix it and rerun, or raise max_repeated_failures")
        broken = (f"the code or the data is likely broken, or these values of {self.varying} fail (no trial "
                  "has trained yet: narrow the space if others train)" if self.varying else
                  "the code or the data is likely broken, not the configs")
        return f"{self.count} trials in a row failed the same way ({self.signature}); {broken}. {rerun}."


def _has_trained(trial: FrozenTrial) -> bool:
    """Whether `trial` trained: completed, or pruned by a rule other than NaN/Inf (its code ran), by a worker of
    sweep's (a baseline's value added with `Study.add_trial` ran no code)."""
    return ran_by_sweep(trial) and (trial.state == TrialState.COMPLETE or (
        trial.state == TrialState.PRUNED and failure_signature(trial) is None))


def _varying(trials: list[FrozenTrial], row: Collection[int]) -> str:
    """Where the failed trials of a row differ in their messages' numbers and in some searched keys' values, those
    keys with their values ("model.hidden (17, 25, 30)"; "" where they do not): before any trial has trained, a region
    of the search space that fails reads the same way as broken code."""
    failed = [t for t in trials if t.number in row]
    if len({failure_reason(t) for t in failed}) < 2:
        return ""
    keys = sorted(key for key in set().union(*(t.params for t in failed))
                  if len({repr(t.params.get(key)) for t in failed}) > 1)
    return ", ".join(f"{key} ({', '.join(str(t.params.get(key)) for t in failed)})" for key in keys[:3])


def _twin(trial: optuna.Trial, trials: list[FrozenTrial]) -> int | None:
    """Another live trial queued for the same thing as `trial` (the retry of the same trial, the confirmation of the
    same warm trial): its number, or None. A failed one (a lost or interrupted attempt) is no twin."""
    attrs = trial.user_attrs
    key, target = ((ATTR_RETRY_OF, attrs[ATTR_RETRY_OF]) if ATTR_RETRY_OF in attrs
                   else (ATTR_CONFIRMS, attrs.get(ATTR_CONFIRMS)))
    for other in trials:
        if (other.number != trial.number and other.state != TrialState.FAIL and key in other.user_attrs
                and other.user_attrs[key] == target):
            return other.number
    return None


class InfrastructureError(Exception):
    """The same fault of the machine (disk full, checkpoint folder gone) repeated: fix it, then rerun."""


BLOCKED_BEAT_S = 1.0  # the least wait of a heartbeat write taken for the database being blocked (`_blocked_s`)


class Beats:
    """The trials a worker's heartbeat thread beats for: one, or a cohort's members."""

    def __init__(self, storage: PatientStorage | None) -> None:
        self.storage, self._ids, self._guard = storage, set[int](), threading.Lock()

    def add(self, *trials: optuna.Trial) -> None:
        """Beat for `trials` from now on, each given its heartbeat settings and its first beat first (all of them
        in one transaction)."""
        with self._guard:
            ids = [t._trial_id for t in trials if t._trial_id not in self._ids]  # noqa: SLF001 - no public id
        if not ids:
            return
        if self.storage is not None:
            # Its settings with its first beat, in one transaction: a trial with no heartbeat is never found stale,
            # one with a beat and no settings is judged by the judge's own (review: an outage between the two
            # writes let a shorter grace fail it).
            self.storage.start_heartbeats(ids, HEARTBEAT_ATTR, {
                "interval": self.storage.heartbeat_interval, "grace": self.storage.grace_period})
        with self._guard:
            self._ids.update(ids)

    def discard(self, trial: optuna.Trial) -> None:
        with self._guard:
            self._ids.discard(trial._trial_id)  # noqa: SLF001

    def ids(self) -> list[int]:
        with self._guard:
            return sorted(self._ids)


@dataclass
class RunSummary:
    ran: int  # trials this worker finished
    budget_used: int
    n_trials: int
    timed_out: bool = False
    exhausted: bool = False  # the sampler has tried every point of a finite search space
    stopped: bool = False  # `sweep stop` asked the workers to finish


def request_stop(study: optuna.Study) -> None:
    """Ask every worker running now to finish its current trial and exit; a later `sweep run` resumes. Stamped by the
    storage's clock (`clock_offset`): each worker, on its own machine, reads it back on its own clock."""
    study.set_user_attr(STOP_ATTR, time.time() + clock_offset(study._storage))  # noqa: SLF001



@contextlib.contextmanager
def unmarked_if_away(what: str, stop: BaseException) -> Iterator[None]:
    """Marking a stopped trial (Ctrl-C, SIGTERM) while the storage is unreachable: the worker does not wait for it
    (a scheduler's grace period is shorter than `storage_patience`), and exits as the signal says (130, 143). The
    trial is left running; the next run finds it lost by its heartbeat and trains it again from its last
    registered checkpoint."""
    try:
        yield
    except StorageUnavailable as exc:
        if isinstance(stop, TimedOut):
            raise
        warnings.warn(f"{what} could not be marked ({exc}); the next run finds them lost and retries them",
                      stacklevel=1)
        raise mark_unmarked(stop) from None

MAX_REASON = 2000  # characters of a failure's reason kept on its trial (its traceback attr keeps the last 4000)


class _Unreadable(Exception):
    """An exception whose `str()` raises, in its place: its type's name and what its `str()` raised."""


def readable(exc: BaseException) -> BaseException:
    """`exc`, or a stand-in when its `str()` raises (a user's exception class whose `__str__` is broken): the reason
    and every check of it (transient? the storage's refusal?) read it, and the study must not end there."""
    return exc if message(exc) is not None else _Unreadable(unreadable(exc))


def _trained(runner: Runner) -> TrialResult:
    """`runner.run()` as a trial's code (`trial_code`)."""
    with trial_code(passing=(StorageUnavailable, TimedOut)):
        return runner.run()


def signalled(stop: BaseException) -> tuple[str, Outcome]:
    """How a trial stopped by Ctrl-C or SIGTERM ends: its reason and outcome. An error it raised once the signal had
    come (`sweep.signals.trial_code`: the stop's cause) is kept in the reason."""
    reason, outcome = (("preempted (SIGTERM)", Outcome.PREEMPTED) if isinstance(stop, Preempted) else
                       ("interrupted", Outcome.INTERRUPTED))
    if stop.__cause__ is not None:
        reason = f"{reason}; the trial then raised {error_words(stop.__cause__)}"
    return reason, outcome


class Worker:
    """Runs trials of one study until its budget is used (by this worker and any others), `timeout` seconds pass,
    or `sweep stop` asks to finish. A trial that raises ends as failed, or, when the fault is the machine's, is
    retried; the study goes on. On Ctrl-C or SIGTERM the running trial is marked and queued again, and the exception
    propagates. `storage_url` is None only for an in-memory study (no lock, no checkpoints)."""

    def __init__(self, study: optuna.Study, spec: StudySpec, *, storage_url: str | None, boundary: Boundary,
                 events: Events | None = None, n_trials: int | None = None, timeout: float | None = None,
                 cohort: int | None = None) -> None:
        self.study, self.spec, self.url, self.boundary = study, spec, storage_url, boundary
        self.events = events if events is not None else NoEvents()
        self.n_trials = n_trials if n_trials is not None else spec.n_trials
        self.timeout = timeout if timeout is not None else spec.timeout
        self.storage = study._storage  # noqa: SLF001 - Optuna has no public handle on a study's storage
        try:
            self.checkpoints = CheckpointService(storage_url, spec, study, boundary) if storage_url else None
        except OSError as exc:  # the store became read-only, full or a file since the command checked it (review)
            where = f": {exc.filename}" if exc.filename else ""
            raise InfrastructureError(f"cannot make the checkpoints' folders: {exc.strerror or exc}{where}; fix the "
                                      "store (checkpoints.store; an object store's outbox is under TMPDIR), then "
                                      "rerun the same command") from None
        self.database = database_identity(storage_url)  # a SQLite study's file, as this worker opened it
        self.ran = 0
        # How each trial this worker ended (by trial number, which is the order they were asked in) counts towards
        # `max_repeated_failures`: its failure signature, or None for any other end (`_check_streak`).
        self.ended_ways: dict[int, str | None] = {}
        # Whether a trial of this run has trained (completed, or pruned by a rule other than NaN/Inf): from then on
        # failures are "the same way" only with the same numbers in their messages (`_check_streak`).
        self.trained_one = False
        self.started_wall = time.time()  # this run's start (`begin`: its launcher's, for a launched worker)
        self.given_up: set[int] = set()  # lost trials failed as killed by their config (`_killed_by_its_config`)
        self.infra: tuple[int, str | None] = (0, None)  # the same for faults of the machine
        self.adopted: set[int] = set()  # silent trials this worker beat once for (`_adopt_silent_trials`)
        self.beats: Beats | None = None  # the trials this worker beats for now (`beating`): never judged lost by it
        self.beating_since: float | None = None  # when the heartbeat write in progress started (None: none is)
        self.sampler_stopped = False
        self.fault: Fault | None = None  # the latest fault of the machine, its kind compared for repeats
        self.started = time.monotonic()  # the sampler has tried every point of the space (brute force, grid)
        self.first = True  # no trial asked yet: a worker joining a study reseeds its sampler at its first ask
        self.cohort_size = cohort if cohort is not None else spec.execution.cohort_size()

    def begin(self) -> float:
        """Before the first trial: the cheap reconciliation of the study's checkpoints. Returns the wall time the
        worker started at (a `sweep stop` later than that stops it)."""
        started_wall = time.time()
        with contextlib.suppress(KeyError, ValueError):  # a launched worker: from its launcher's start
            started_wall = min(started_wall, float(os.environ[LAUNCHED_ENV]))
        self.started_wall = started_wall
        if self.checkpoints is not None:
            if (gone := self.boundary.call(self.checkpoints.store_unavailable)) is not None:
                raise InfrastructureError(gone)  # before its rows are taken for missing files and forgotten
            if dropped := self.checkpoints.reconcile():  # a resume point deleted by hand, say (review: its retry
                shown = "; ".join(problem.detail for problem in dropped[:3])  # started over with no word)
                more = f"; and {len(dropped) - 3} more" if len(dropped) > 3 else ""
                warnings.warn(f"{len(dropped)} checkpoint{'s' if len(dropped) > 1 else ''} whose file is gone "
                              f"{'were' if len(dropped) > 1 else 'was'} dropped from the registry ({shown}{more}): no "
                              "trial warm-starts from it, and a retry that would have resumed there resumes from an "
                              "older one or starts over",
                              stacklevel=2)
        return started_wall

    def run(self) -> RunSummary:
        """Run trials one at a time until the budget is used (a cohort of them: `sweep.cohort.CohortLoop`)."""
        if self.cohort_size != 1:
            warnings.warn("execution.cohort: this study's trials run one at a time (cohorts batch the built-in "
                          "trainer's models; a loop or command study has none)", stacklevel=1)
        return self.run_single(self.begin())

    def run_single(self, started_wall: float) -> RunSummary:
        """The loop with one trial at a time."""
        started = self.started
        while True:
            raise_pending()
            if self.timeout is not None and time.monotonic() - started >= self.timeout:
                return self._summary(timed_out=True)
            if self._stop_requested(started_wall):
                return self._summary(stopped=True)
            trial, spent, trials = self._ask_next()
            if spent:
                return self._summary()
            if trial is None and self.sampler_stopped:  # the grid was done before this trial was asked
                return self._summary(exhausted=True)
            if trial is None:  # the last trials run elsewhere; wait in case one of their workers dies
                self._adopt_silent_trials(trials)
                # Holding no idle connection meanwhile: on a server short of slots, those starved the worker of the
                # trial waited for, which this one then failed as lost (review).
                release_idle_connections()
                time.sleep(self.spec.heartbeat_interval)
                continue
            frozen = self._run_one(trial)
            if frozen is not None and self.finished(frozen):
                return self._summary(exhausted=True)

    def finished(self, frozen: FrozenTrial, *, streak: bool = True, running: Collection[int] = ()) -> bool:
        """Count a trial this worker ended; True when the sampler has tried every point (the loop ends). `streak`:
        whether its failure counts towards `max_repeated_failures` (a cohort's members ended by one exception are
        one failure of the code or data, not K: only the first of them counts). `running`: the numbers of the
        trials still in flight on this worker (a cohort's other members)."""
        self._said(frozen)
        if streak:
            self._check_streak(frozen, running)
        return self.sampler_stopped

    def _said(self, frozen: FrozenTrial) -> None:
        """Count an ended trial and print its line."""
        self.ran += 1
        self.events.trial_finished(frozen)

    def _ask_next(self, fixed: dict[str, Any] | None = None) -> tuple[optuna.Trial | None, bool, list[FrozenTrial]]:
        """Under the study's lock: fail lost trials, count the budget and ask for the next trial, its searched keys
        sampled at once. Returns (the trial or None while the last trials run elsewhere, whether the budget is spent,
        the study's trials). `fixed`: params the sampler must not change (a cohort's shape keys), through Optuna's
        `PartialFixedSampler`."""
        asked, spent, trials = self._ask_many(1, fixed)
        return (asked[0] if asked else None), spent, trials

    def _database_still_there(self) -> None:
        """Raise `InfrastructureError` when the SQLite file this worker opened is no longer the one at its path
        (deleted, or replaced by another file): its connections write on into the old file, which nothing will read
        again. Found by review: every trial after an `rm` of the database was printed as done, and all were lost."""
        if (gone := database_gone(self.database)) is not None:
            raise InfrastructureError(gone)

    def _ask_many(self, count: int, fixed: dict[str, Any] | None = None,
                  gate: Callable[[list[FrozenTrial]], bool] | None = None,
                  ) -> tuple[list[optuna.Trial], bool, list[FrozenTrial]]:
        """Up to `count` trials asked as `_ask_next` asks one, under one hold of the lock and one read of the study
        (a cohort's free slots at an evaluation boundary): each is counted against the budget and sampled knowing
        the ones asked before it, as if asked one after another. Returns the trials (fewer when the budget or the
        trials in flight elsewhere allow fewer), whether the budget is spent, and the study's trials. `gate`: asked
        with the study's trials under the lock before each one, whether it may be asked (a cohort's ramp)."""
        self._database_still_there()
        asked: list[optuna.Trial] = []
        created: list[optuna.Trial] = []  # every trial `study.ask` made, the one being sampled when it fails too
        spent, trials = False, list[FrozenTrial]()
        try:
            with self._lock() as lost:
                self._fail_lost_trials()
                with self._shared_reads():
                    while len(asked) < count:
                        trial, spent, trials = self._count_and_ask(fixed, created, gate)
                        if trial is None:
                            break
                        asked.append(trial)
                if not asked or not lost():
                    return asked, spent, trials
            fenced = [self._fence(trial) for trial in asked]
        except BaseException as exc:
            # The trials asked before the failure never reach their caller: a first heartbeat, if the storage takes
            # it, lets the next worker find them lost and retry them (a trial with none is never found stale).
            if isinstance(self.storage, PatientStorage) and not isinstance(exc, StorageUnavailable):
                for trial in created:
                    with contextlib.suppress(Exception), self.boundary.no_wait():
                        self.storage.record_heartbeat(trial._trial_id)  # noqa: SLF001
            raise
        return [trial for trial, _, _ in fenced if trial is not None], spent, fenced[-1][2]

    def _fence(self, trial: optuna.Trial) -> tuple[optuna.Trial | None, bool, list[FrozenTrial]]:
        """The lock went with its server session while `trial` was asked (a PostgreSQL restart): another worker may
        have counted the trials without it and asked too. Counted again under the lock, a trial beyond the budget is
        withdrawn before it trains (the loop then asks again, or waits for the last trials)."""
        with self._lock():
            trials = self.study.get_trials(deepcopy=False)
            used, running = budget_counts(trials)
            queued = ATTR_RETRY_OF in trial.user_attrs or ATTR_CONFIRMS in trial.user_attrs  # its place was counted
            twin = _twin(trial, trials) if queued else None  # queued twice: by this worker and one that took the lock
            if (used + running <= self.n_trials or queued) and twin is None:
                return trial, False, trials
            reason = (f"withdrawn: asked while the storage restarted, beyond n_trials ({self.n_trials}); "
                      "never trained") if twin is None else (
                f"withdrawn: asked while the study's lock was lost, as trial {twin} was for the same "
                f"{'retry' if ATTR_RETRY_OF in trial.user_attrs else 'confirmation'}; never trained")
            trial.set_user_attr(ATTR_WITHDRAWN, reason)
            trial.set_user_attr(ATTR_FAIL, reason)
            self.study.tell(trial, state=TrialState.FAIL)
            warnings.warn(f"trial {trial.number} {reason}", stacklevel=2)
            return None, False, self.study.get_trials(deepcopy=False)

    def _shared_reads(self) -> contextlib.AbstractContextManager[None]:
        if isinstance(self.storage, PatientStorage):
            return self.storage.shared_ask_reads()
        return contextlib.nullcontext()

    def _count_and_ask(self, fixed: dict[str, Any] | None, created: list[optuna.Trial] | None = None,
                       gate: Callable[[list[FrozenTrial]], bool] | None = None,
                       ) -> tuple[optuna.Trial | None, bool, list[FrozenTrial]]:
        trials = self.study.get_trials(deepcopy=False)
        queued, young = self._requeue_orphans(trials)
        if queued:
            trials = self.study.get_trials(deepcopy=False)
        if self.first and trials:  # joining a study others have sampled: draw other configs than theirs
            waiting = sum(t.state == TrialState.WAITING for t in trials)
            joined = (len(trials), waiting) if waiting else (len(trials),)
            self.study.sampler = build_sampler(self.spec, joined_at=joined)
        self.first = False
        used, running = budget_counts(trials)
        used, running = used - young, running + young  # their retries are on the way: wait for them, as for running
        if used >= self.n_trials:
            return None, True, trials
        if used + running >= self.n_trials:
            return None, False, trials
        if self._warm_results_pending(trials, used + running):
            return None, False, trials
        if gate is not None and not gate(trials):
            return None, False, trials
        self._queue_confirmation(trials, used + running)
        if self.spec.sampler.type == "bruteforce" and not any(t.state == TrialState.WAITING for t in trials):
            point = unexplored_point(self.spec, fixed or {}, trials)  # a queued trial comes first, with its own params
            if point is None and not fixed:  # the whole grid is taken: BruteForceSampler would draw a copy of a
                confirming = self._confirm_the_grid(trials, running)  # point (a rerun of a finished grid trained one
                if confirming is None:  # per run), then stop
                    self.sampler_stopped = True
                    return None, False, trials
                if not confirming:
                    return None, False, trials
            elif point is None:  # every point of these shapes is taken: the cohort drains, the next draws anew
                return None, False, trials
            elif fixed:
                fixed = {**fixed, **point}
        sampler = self.study.sampler
        if fixed:
            self.study.sampler = optuna.samplers.PartialFixedSampler(fixed, sampler)
        try:
            trial = self.study.ask()
            if created is not None:
                created.append(trial)
            self._sample(trial)
            return trial, False, trials
        finally:
            self.study.sampler = sampler

    def _sample(self, trial: optuna.Trial) -> None:
        """Every searched key drawn now, as the runner's `spec.suggest` would draw them (it then finds them set):
        the sampler's reads of the study share the one read made under the lock, where drawing at the trial's first
        suggest read every trial again, twice for TPE. A sampler that raises is met again by the runner's suggest,
        which fails this trial alone, with its message, as any error of a trial's start does."""
        try:
            self.spec.suggest(trial)
        except (StorageUnavailable, StorageAway):
            raise
        except Exception:  # noqa: BLE001 - the runner's suggest raises it again, where a trial's errors go
            pass
        queued = getattr(trial, "_fixed_params", None)  # Optuna's: the params `enqueue_trial` gave it, read at ask
        unknown = sorted(set(queued) - set(self.spec.space)) if isinstance(queued, dict) else []
        if unknown and ATTR_RETRY_OF not in trial.user_attrs:  # a retry's keys were searched when it first ran
            # A typo in a queued trial's params (`study.enqueue_trial({"lr": ...})`) trained a sampled config
            # without a word (review).
            warnings.warn(f"trial {trial.number} was queued with {', '.join(map(repr, unknown))}, which this study "
                          f"does not search (it searches {', '.join(map(repr, self.spec.space)) or 'nothing'}): "
                          "ignored, and the searched keys it did not give are sampled", stacklevel=2)

    # -----------------------------------------------------------------------------------------------------------------
    # One trial.

    @property
    def deadline(self) -> float | None:
        """When `--timeout` passes (`time.monotonic()`), or None."""
        return None if self.timeout is None else self.started + self.timeout

    @property
    def timed_out_reason(self) -> str:
        """The reason a trial stopped by `--timeout` ends with (it is queued, as an interrupted trial is)."""
        return f"interrupted: --timeout of {self.timeout:g} s"

    def _run_one(self, trial: optuna.Trial) -> FrozenTrial | None:
        runner = runner_for(trial, self.spec, self.events, self.boundary, self.checkpoints, deadline=self.deadline,
                            storage_url=self.url)
        try:
            with self._heartbeat(trial):
                result = _trained(runner)
        except (KeyboardInterrupt, Preempted, TimedOut) as exc:
            reason, outcome = ((self.timed_out_reason, Outcome.INTERRUPTED) if isinstance(exc, TimedOut) else
                               signalled(exc))
            with unmarked_if_away(f"trial {trial.number}", exc):
                ended = self._end(trial, TrialResult(outcome, None, {ATTR_FAIL: reason, ATTR_INTERRUPTED: True}),
                                  runner)
            if isinstance(exc, TimedOut):
                if ended is not None:  # its line, as a cohort's members stopped by the timeout have theirs
                    self.events.trial_finished(ended)
                return None  # the loop sees the timeout and stops
            raise
        except StorageUnavailable:
            raise  # nothing can be stored: the worker exits, and the trial is found lost and retried later
        except BaseException as exc:  # noqa: BLE001 - a failing trial must never take the study down: nor does a user's
            result = self._failure(exc)  # asyncio.CancelledError, GeneratorExit or sys.exit, which are no Exception
        return self._end(trial, result, runner)

    def _failure(self, raised: BaseException) -> TrialResult:
        if damaged_database(raised) is not None and self._storage_damaged():
            # The study's SQLite file, damaged where this trial's write reached: bad input, not the config's fault
            # (files review: each run failed one trial for it, counted). It ends the run: one line, exit 2. A damaged
            # file of the trial's own (its data, read by its code) is its config's error, as any other (diff review).
            raise raised
        exc = readable(raised)
        folders = self.checkpoints.folders if self.checkpoints is not None else []
        fault = infrastructure_fault(exc, folders)
        if fault is None and is_transient(exc):
            first = str(exc).splitlines()[0] if str(exc) else ""
            fault = Fault(f"lost connection: {type(exc).__name__}: {first}", f"connection: {type(exc).__name__}",
                          "bring the storage back, or point --storage at one this machine reaches")
        refusal = storage_refusal(exc) if fault is None else None  # a checkpoint's row refused, say
        if refusal is not None:
            fault = Fault(*refusal, "grant the storage's role its rights, make the database writable again")
        if fault is not None:
            kept = {ATTR_TRACEBACK: "".join(traceback.format_exception(raised))[-4000:]} if refusal else {}
            return TrialResult(Outcome.INFRASTRUCTURE, None, {ATTR_FAIL: f"infrastructure: {fault.reason}", **kept},
                               fault=fault)
        said = str(exc) or ("out of memory" if isinstance(exc, MemoryError) else "")  # Python's own has no words
        reason = f"{type(raised).__name__}: {said}"
        if (limit := host_memory_limit(exc)) is not None:  # where it ran out: the process's limit (ulimit -v)
            reason = f"{reason} ({limit})"
        if isinstance(exc, optuna.exceptions.StorageInternalError) and exc.__cause__ is not None:
            reason = f"{reason.strip()} ({error_line(exc)})"  # the database's words, not a guess
        return TrialResult(Outcome.FAILED, None, {ATTR_FAIL: reason,
                                                  ATTR_TRACEBACK: "".join(traceback.format_exception(raised))[-4000:]})

    def _storage_damaged(self) -> bool:
        """Whether the study's own storage is a SQLite file that SQLite finds damaged (`PRAGMA quick_check`)."""
        path = sqlite_path(self.url) if self.url is not None else None
        return path is not None and sqlite_damage(path) is not None

    def _end(self, trial: optuna.Trial, result: TrialResult, runner: Runner, *,
             counted: bool = True) -> FrozenTrial | None:
        """Release the checkpoints (first: the best one's artifact is an attr, which only a running trial takes),
        store the outcome, queue the retry it calls for. None when another worker declared the trial lost meanwhile
        (its retry trains it again). `counted`: whether a fault of the machine that ended it counts towards
        `MAX_INFRA_REPEATS` (one fault that ends a cohort's members counts once)."""
        runner.release(result)
        try:
            frozen = self._tell(trial, result)
        except optuna.exceptions.UpdateFinishedTrialError:
            if (told := self._ended_from_outside(trial)) is not None:
                warnings.warn(f"trial {trial.number} was {told} while this worker trained it; not retried",
                              stacklevel=1)
                return None
            # No heartbeat within the grace period (a paused machine, a storage outage longer than the grace period):
            # another worker failed it and queued a retry, which trains it again. This worker goes on.
            warnings.warn(f"trial {trial.number} was declared lost while this worker trained it (another worker "
                          "found no heartbeat of it within the grace period); its retry trains it again", stacklevel=1)
            return None
        if result.outcome == Outcome.INFRASTRUCTURE:
            self.fault = result.fault
        if result.outcome.retried:
            try:
                with self._lock():  # against `_requeue_orphans` of a worker that found this one stalled past the grace
                    self._retry(frozen, str(result.reason), infrastructure=result.outcome == Outcome.INFRASTRUCTURE,
                                counted=counted)
            except InfrastructureError:  # the same fault again, which stops the worker: this trial's line first,
                self._said(frozen)  # as the ones before it had theirs (review: the last of the three had none)
                raise
        return frozen

    def _ended_from_outside(self, trial: optuna.Trial) -> str | None:
        """How a trial this worker trained was ended by another program (optuna-dashboard's buttons, `Study.tell`),
        in words, or None when a worker of the study declared it lost. Such a tell writes no outcome, where a worker
        fails a lost trial and writes why in one transaction (`PatientStorage.fail_lost_trial`; review: a trial
        failed by hand was taken for lost, "worker lost: no heartbeat" written over it, and its config trained
        again). A FAIL told from outside is the user's decision: stored as failed, with that reason, never retried."""
        if not isinstance(self.storage, PatientStorage):
            return None
        trial_id = trial._trial_id  # noqa: SLF001 - Optuna has no public id of a running trial
        ended = self.storage.get_trial(trial_id)
        if ATTR_OUTCOME in ended.user_attrs or ATTR_FAIL in ended.user_attrs or not ended.state.is_finished():
            return None
        told = f"told {ended.state.name} from outside (optuna-dashboard, Study.tell)"
        if ended.state == TrialState.FAIL:
            self.storage.record_lost(trial_id, f"{told} while it trained", outcome=Outcome.FAILED.value)
        return told

    def _tell(self, trial: optuna.Trial, result: TrialResult) -> FrozenTrial:
        self._database_still_there()  # not told into a file nothing reads, and printed as done
        attrs = {key: jsonable(value) for key, value in {**result.attrs, ATTR_OUTCOME: result.outcome.value}.items()}
        if isinstance(reason := attrs.get(ATTR_FAIL), str) and len(reason) > MAX_REASON:  # a user's 10 MB message
            attrs[ATTR_FAIL] = f"{reason[:MAX_REASON]}... ({len(reason) - MAX_REASON} more characters)"
        if isinstance(self.storage, PatientStorage):  # one transaction for all of them
            self.storage.set_trial_user_attrs(trial._trial_id, attrs)  # noqa: SLF001 - no public id of a running trial
        else:
            for key, value in attrs.items():
                trial.set_user_attr(key, value)
        value = result.value if result.outcome == Outcome.COMPLETE else None
        try:
            return self.study.tell(trial, value, state=result.outcome.state)
        except ValueError:
            # "Cannot tell a FAIL trial": another worker declared it lost between its attrs and its tell (a storage
            # outage longer than the heartbeat grace period). The same case as a refused attr, told the same way.
            if self.storage.get_trial(trial._trial_id).state.is_finished():  # noqa: SLF001
                raise optuna.exceptions.UpdateFinishedTrialError(
                    f"trial {trial.number} was finished by another worker before this one told it") from None
            raise
        except RuntimeError as exc:
            # Samplers that have tried every point call Study.stop(), which only works inside study.optimize;
            # tell() has stored the trial anyway.
            if "Study.stop" not in str(exc):
                raise
            # With warm_start.confirm, the next ask decides (`_confirm_the_grid`): the best warm trials may still
            # be due their cold retrain.
            self.sampler_stopped = not (self.spec.sampler.type == "bruteforce" and self._confirming)
            return self.study.get_trials(deepcopy=False)[trial.number]

    def _requeue_orphans(self, trials: list[FrozenTrial]) -> tuple[bool, int]:
        """Queue the retry of every trial that ended for a reason not its config's (lost, interrupted, preempted,
        the machine's) and has none: its worker was killed between storing its end and queuing its retry, two
        writes milliseconds apart, or between failing a lost trial and queuing its retry. Without this the budget would
        count the trial as used and its config would never finish. Only trials that ended more than a grace period
        ago: a live worker queues its retry at once. Returns (whether one was queued, how many younger ones wait:
        the budget counts them as running, not used, so a rerun right after the kill waits for them)."""
        retried = retried_numbers(trials)
        now, queued, young = datetime.datetime.now(), False, 0
        for trial in trials:
            if trial.state != TrialState.FAIL or trial.number in retried or ATTR_WITHDRAWN in trial.user_attrs:
                continue
            outcome = outcome_of(trial)
            if outcome is None or not outcome.retried:
                continue
            ended = trial.datetime_complete
            if ended is not None and (now - ended).total_seconds() < self.spec.heartbeat_grace_period:
                young += 1
                continue
            reason = str(trial.user_attrs.get(ATTR_FAIL) or LOST_REASON)
            if ATTR_OUTCOME not in trial.user_attrs and isinstance(self.storage, PatientStorage):
                self.storage.record_lost(trial._trial_id, reason)  # noqa: SLF001 - Optuna has no public trial id
            if outcome is Outcome.LOST and self._killed_by_its_config(trial, trials):
                continue  # failed now, as its worker would have: no retry
            warnings.warn(f"trial {trial.number} ended ({outcome.value}) without its retry queued (its worker was "
                          "killed in between); queued now", stacklevel=2)
            self._retry(trial, reason)
            queued = True
        return queued, young

    def _warm_results_pending(self, trials: list[FrozenTrial], taken: int) -> bool:
        """Whether the next trial, one of the budget's last `warm_start.confirm`, must wait for a running trial that
        is (or may still become) warm: the confirmations retrain the best warm trials, and one still running may end
        best among them (with `--workers N` or a cohort, the last slots are asked while others train). A running
        trial that has reported without a donor started cold and is not waited for; a queued (waiting) trial is
        asked next anyway, so the wait never holds the last trials back from the workers that would train them."""
        if not self._confirming or self.n_trials - taken > self._confirming:
            return False
        return any(t.state == TrialState.RUNNING and ATTR_CONFIRMS not in t.user_attrs
                   and (ATTR_WARM_START in t.user_attrs or not t.intermediate_values) for t in trials)

    @property
    def _confirming(self) -> int:
        """`warm_start.confirm`, K: how many of the best warm trials the study retrains cold (0: none)."""
        return self.spec.warm_start.confirm if self.spec.warm_start.enabled else 0

    def _queue_confirmation(self, trials: list[FrozenTrial], taken: int, *, now: bool = False) -> bool:
        """With `warm_start.confirm: K`, the last trials of the budget retrain the best K warm trials cold: when no
        more budget is left than confirmations are due (or `now`), the next one is queued, so that `ask` takes it.
        Whether one was."""
        due = confirmations_due(trials, self._confirming, self.spec.direction == "maximize")
        if not due or (not now and self.n_trials - taken > len(due)) \
                or any(t.state == TrialState.WAITING for t in trials):
            return False
        self.study.enqueue_trial(due[0].params, user_attrs={ATTR_CONFIRMS: due[0].number})
        return True

    def _confirm_the_grid(self, trials: list[FrozenTrial], running: int) -> bool | None:
        """The sampler has tried every point with budget left: with `warm_start.confirm: K`, the best K warm trials
        are retrained cold now, one per ask, as the budget's last trials would have (review: a grid that ran out
        first ended the study with its warm values never confirmed). True: one is queued, `ask` takes it; False:
        trials still running may end among the best warm ones, wait for them; None: nothing to confirm."""
        if not self._confirming:
            return None
        if running:
            return False
        return self._queue_confirmation(trials, 0, now=True) or None

    def _retry(self, trial: FrozenTrial, reason: str, *, infrastructure: bool = False, counted: bool = True) -> None:
        """Queue the trial's params again; the retry resumes from the newest checkpoint of its lineage. Faults of
        the machine in a row are counted (`retry_depth`), and the same one `MAX_INFRA_REPEATS` times stops this
        worker: retrying cannot help until someone fixes the machine (`counted`: False for the second and later
        trials one fault ended at once)."""
        trials = self.study.get_trials(deepcopy=False)
        if any(t.user_attrs.get(ATTR_RETRY_OF) == trial.number for t in trials):
            return  # queued already (`_requeue_orphans`): this worker stalled between the trial's end and now
        if outcome_of(trial) is Outcome.LOST and self._killed_by_its_config(trial, trials):
            return
        depth = trial.user_attrs.get(ATTR_RETRY_DEPTH, 0) + 1 if infrastructure else 0
        carried = {ATTR_CONFIRMS: trial.user_attrs[ATTR_CONFIRMS]} if ATTR_CONFIRMS in trial.user_attrs else {}
        # A queued trial (a retry, a confirmation) killed after `ask` took it and before its params were written holds
        # them only where the queue put them: without those, its retry would draw new ones and resume its lineage's
        # checkpoints, trained with the old.
        params = {**trial.system_attrs.get("fixed_params", {}), **trial.params}
        self.study.enqueue_trial(params, user_attrs={ATTR_RETRY_OF: trial.number, ATTR_RETRY_REASON: reason,
                                                           ATTR_RETRY_DEPTH: depth, **carried})
        if infrastructure and not counted:
            return
        if infrastructure:
            kind = None if self.fault is None else self.fault.kind  # the same errno in the same folder, whichever file
            count = self.infra[0] + 1 if self.infra[1] == kind else 1
            self.infra = (count, kind)
            if count >= MAX_INFRA_REPEATS:
                fix = FOLDER_FIX if self.fault is None else self.fault.fix
                raise InfrastructureError(
                    f"{count} trials in a row were stopped by the same fault of the machine, not of their configs: "
                    f"{reason.removeprefix('infrastructure: ')}. Fix it ({fix}), then rerun the same command: the "
                    "trials resume from their checkpoints.")
        else:
            self.infra = (0, None)

    def _killed_by_its_config(self, trial: FrozenTrial, trials: list[FrozenTrial]) -> bool:
        """Whether lost `trial` ends its lineage's retries: its attempts were lost `MAX_LOST_REPEATS` times in a row,
        alone, without getting further (`lost_in_a_row`), the mark of a config that kills its worker (a segfault in its
        code, the kernel's out-of-memory killer, an `os._exit`): retried, it would kill every worker that takes it
        and hold the study's budget forever (review). It is then failed as the config's fault, with its reason,
        and counts towards `n_trials` as a failed trial does."""
        if trial.number in self.given_up:  # (this process's cached copy of it may still say lost)
            return True
        attempts = {t.number: t for t in trials} | {trial.number: trial}
        count = lost_in_a_row(attempts, trial.number)
        if count < MAX_LOST_REPEATS:
            return False
        self.given_up.add(trial.number)
        reason = (f"worker lost {count} times in a row on this config without getting further, training alone each "
                  "time: its code kills the worker (a crash, the out-of-memory killer, an exit); not retried again")
        if isinstance(self.storage, PatientStorage):
            self.storage.record_lost(trial._trial_id, reason, Outcome.FAILED.value)  # noqa: SLF001 - its storage id
        warnings.warn(f"trial {trial.number} failed: {reason}", stacklevel=3)
        return True

    def _check_streak(self, frozen: FrozenTrial, running: Collection[int] = ()) -> None:
        """Stop the study when the last `max_repeated_failures` trials this worker asked all failed the same way.
        Once a trial of this run has trained (this worker's or another's, started since the run began), the code
        runs: failures whose messages differ in their numbers are a region of the configs ("hidden 17 unsupported"
        for widths above 16), not the same way (review: a study stopped at five of them in a row). Not an earlier
        run's: code edited since may be broken for every config.
        "In a row" is in the order the trials were asked, not the order they ended: in a cohort the members that
        train on end after the ones that fail at once, so a config that fails at its start (one value of a searched
        key) would otherwise make a row of failures that one trial at a time never sees. A trial asked earlier that
        is still training has not failed, so it ends the row; a trial that ended any other way ends it too."""
        if not self.spec.max_repeated_failures:
            return
        ended = (TrialState.COMPLETE, TrialState.PRUNED)
        self.trained_one = self.trained_one or _has_trained(frozen) or (frozen.state == TrialState.FAIL and any(
            _has_trained(t) for t in self.study.get_trials(deepcopy=False, states=ended)
            if t.datetime_start is not None and t.datetime_start.timestamp() >= self.started_wall))
        signature = self.ended_ways[frozen.number] = failure_signature(frozen, numbers=self.trained_one)
        in_flight = set(running)
        row = []
        if signature is not None:  # the row this trial's failure belongs to, both ways from it
            order = sorted({*self.ended_ways, *in_flight})
            at = order.index(frozen.number)
            for side in (order[at::-1], order[at + 1:]):
                for number in side:
                    if number in in_flight or self.ended_ways[number] != signature:
                        break
                    row.append(number)
        self._trim_ended_ways(min(in_flight, default=None))
        if len(row) >= self.spec.max_repeated_failures:
            assert signature is not None  # shown as this trial failed, its numbers too
            trials = self.study.get_trials(deepcopy=False)
            shown = failure_reason(frozen) if outcome_of(frozen) is Outcome.FAILED else signature
            raise StudyBrokenError(len(row), shown, self.n_trials, budget_counts(trials)[0], _varying(trials, row))

    def _trim_ended_ways(self, lowest_in_flight: int | None) -> None:
        """Forget the ends no row can reach again: every trial that ends from now on is one in flight or a new one,
        numbered at or above the lowest in flight, and a row reaching down from there stops at the highest trial
        below it that ended other than by failing, or whose failure differs from the one above it."""
        below = sorted(n for n in self.ended_ways if lowest_in_flight is None or n < lowest_in_flight)
        for upper, lower in zip(reversed(below), reversed([None, *below[:-1]])):
            way = self.ended_ways[upper]
            if way is None:
                self.ended_ways = {n: w for n, w in self.ended_ways.items() if n > upper}
                return
            if lower is not None and self.ended_ways[lower] != way:
                self.ended_ways = {n: w for n, w in self.ended_ways.items() if n > lower}
                return

    # -----------------------------------------------------------------------------------------------------------------
    # Lost trials and heartbeats.

    def _fail_lost_trials(self) -> None:
        """A RUNNING trial whose worker stopped beating for the grace period is failed as lost, with its reason, and
        its params queued again (the retry resumes from the lineage's checkpoint)."""
        if not isinstance(self.storage, PatientStorage):
            return
        recovered, beating = self.boundary.recovered_at, self.beating_since
        if beating is not None and time.monotonic() - beating >= self._blocked_s():
            return  # this worker's own beat is waiting for the database: so are the others' (see `beating`)
        if recovered is not None and time.monotonic() - recovered < self.spec.heartbeat_grace_period:
            # Right after an outage no worker could beat for its length: give them the grace period to beat again
            # before anyone is judged lost, or every trial that trained through the outage would be.
            return
        study_id = self.study._study_id  # noqa: SLF001 - Optuna has no public handle on it
        mine = set(self.beats.ids()) if self.beats is not None else set()  # alive, whatever their beats say
        for trial_id in self.storage.stale_trial_ids(study_id):
            if trial_id not in mine and self._silent_for_its_grace(trial_id) \
                    and self.storage.fail_lost_trial(trial_id, LOST_REASON):
                lost = self.storage.get_trial(trial_id)
                self._retry(lost, LOST_REASON)
                end_lost_run(self.spec, self.url, self.study.study_name, lost)

    def _silent_for_its_grace(self, trial_id: int) -> bool:
        """Whether a trial this worker's grace period finds silent is silent for its own worker's too: a worker of
        the same study may run an edited study file with a longer grace period (and beat less often); judged by this
        one's, its live trials were failed as lost and trained twice (review)."""
        assert isinstance(self.storage, PatientStorage)
        settings = self.storage.get_trial(trial_id).system_attrs.get(HEARTBEAT_ATTR)
        grace = settings.get("grace") if isinstance(settings, dict) else None
        if not isinstance(grace, (int, float)) or isinstance(grace, bool) or grace <= self.spec.heartbeat_grace_period:
            return True
        age = self.storage.heartbeat_age_s(trial_id)
        return age is None or age > grace

    def _blocked_s(self) -> float:
        """How long a heartbeat write must wait before it may have made a live trial look lost: beats come every
        `heartbeat_interval`, so a wait longer than the grace period less two intervals could (at least
        `BLOCKED_BEAT_S`; a slow write shorter than that changes nothing)."""
        interval = self.storage.heartbeat_interval if isinstance(self.storage, PatientStorage) else None
        return max(BLOCKED_BEAT_S, self.spec.heartbeat_grace_period - 2 * (interval or 0))

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
                try:
                    self.storage.backend.record_heartbeat(trial._trial_id)  # noqa: SLF001
                except Exception as exc:
                    if damaged_database(exc) is not None:  # never found lost then: the run would wait forever
                        raise

    @contextlib.contextmanager
    def _heartbeat(self, trial: optuna.Trial) -> Iterator[None]:
        with self.beating() as beats:
            beats.add(trial)
            yield

    @contextlib.contextmanager
    def beating(self) -> Iterator[Beats]:
        """Beats for the running trials (add and discard them as they start and end) from a background thread, so
        a worker that dies stops beating. Straight to the database, not through the boundary: a beat missed in an
        outage is simply the next one's job."""
        if not isinstance(self.storage, PatientStorage) or self.storage.heartbeat_interval is None:
            yield Beats(None)
            return
        beats = Beats(self.storage)
        storage, interval = self.storage, self.storage.heartbeat_interval
        stopped = threading.Event()

        def beat() -> None:
            while not stopped.wait(interval):
                ids = beats.ids()
                if not ids:
                    continue
                self.beating_since = started = time.monotonic()
                with contextlib.suppress(Exception):  # a storage blip: beat again next time rather than never
                    storage.beat(ids)  # all of them with one time: a dead worker's trials go stale together
                self.beating_since = None
                if time.monotonic() - started >= self._blocked_s():
                    # A small write that waited this long waited for a lock (another process's long write
                    # transaction): every worker's beats waited as long, so no trial is judged lost until they
                    # have had the grace period to beat again, as after an outage.
                    self.boundary.recovered_at = time.monotonic()

        thread = threading.Thread(target=beat, daemon=True, name="heartbeat")
        thread.start()
        outer, self.beats = self.beats, beats
        try:
            yield beats
        finally:
            self.beats = outer
            stopped.set()
            thread.join()

    # -----------------------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _lock(self) -> Iterator[Callable[[], bool]]:
        """The study's lock (`ask_lock`). What this worker wrote under it is stored before it is released, writes
        deferred in a cohort's block too (`PatientStorage.deferred_writes`): the next worker to take it reads them."""
        with contextlib.nullcontext(never_lost) if self.url is None else ask_lock(
                self.url, self.study.study_name, self.boundary, stale_after=self.spec.heartbeat_grace_period) as lost:
            yield lost
            if isinstance(self.storage, PatientStorage):
                self.storage.flush_deferred()

    def _stop_requested(self, since: float) -> bool:
        requested = self.study.user_attrs.get(STOP_ATTR)
        return requested is not None and requested - clock_offset(self.storage) > since

    def _summary(self, **flags: bool) -> RunSummary:
        used = budget_counts(self.study.get_trials(deepcopy=False))[0]
        if used >= self.n_trials:  # the budget is spent: a timeout that came first left nothing to rerun
            flags["timed_out"] = False
        return RunSummary(self.ran, used, self.n_trials, **flags)
