"""Cohorts: a worker keeps up to K trials in flight as one stacked model (`trainer.batched.Cohort`), and the study
sees nothing different but the speed: every member is an ordinary Optuna trial with its own params, reports, pruning
decision, checkpoints and outcome.

- Sampling: members must share a batch signature (the same model shapes, optimizer kind, batch size...), while the
  study may search keys that change it (`model.hidden`). The first member of a cohort is sampled freely; the keys
  whose values would change its signature (its *shape keys*, found by building the model on the meta device with each
  searched key moved to another value) are then fixed for the cohort's later members through Optuna's
  `PartialFixedSampler`, so every other key stays the sampler's. A cohort takes `GENERATIONS` (4) times its size in
  members, then drains, and the next cohort's first member draws its shapes freely: the choice of shapes stays the
  sampler's too, at the cost of a partly empty cohort while one drains. A study with no shape keys (it searches the
  optimizer, the schedule, the seed...) has nothing to draw anew: its cohort never drains until the budget is spent.
  A cohort never holds or takes more members than its fixed shapes leave configs to draw (`variety`); a study whose
  every searched key is a shape key trains one trial at a time (its members would be copies of one config).
- Pruning one by one: each member reports to its own trial through its own `TrialReporter`. A member that is pruned,
  completes, fails or diverges leaves at once and is told to the study; its slot is refilled with a newly asked trial
  at the next evaluation boundary, so the device stays full until the budget is spent. At a boundary where no trial
  takes the free slots (the rest of the budget is in flight, the study stops, the cohort drains) and at least half
  of the slots are free, the cohort drops them (`Cohort.shrink`): its tail costs about what its members need; a
  retry that comes later gets a slot back.
- The pruner's startup (`execution.ramp`, off by default: the device stays full): Optuna's median and percentile
  pruners (and the forecast and leaders pruners) judge no trial before `n_startup_trials` trials have completed, and
  judge against completed trials only. Members that start together end together, so a first cohort of K runs K
  trials unjudged to their end where one trial at a time runs `n_startup_trials`, and their unselected values lower
  the bar for every later trial. With the ramp on, while the study has fewer completed trials than that, a cohort is
  a *ramp*: it holds only the startup trials still missing (those running elsewhere counted, at least one), takes no
  more members once they are in flight, and drains; the cohort after it has the full size.
- The storage work made together: the free slots' trials are asked under one hold of the study's lock
  (`Worker._ask_many`); the members' reports and attrs in a step, a refill or the telling of those that left are
  one transaction (`PatientStorage.deferred_writes`), their checkpoints' registrations after each step another
  (`sweep.checkpoints.register_together`). A member another worker declared lost meanwhile (its writes refused)
  leaves the cohort at that step, as interrupted: its retry trains it.
- Everything else is the worker's: the budget (asked under the study's lock), heartbeats (one thread for every
  member), retries, confirmations. A retry whose shapes differ from the cohort's, and a study whose model cannot be
  batched, train one trial at a time (with one line saying why).
- Out of memory (in a step, while a cohort is made or a member joins): a cohort's size ran out, not a member's
  config. Its members end as interrupted and are retried from their checkpoints, and the worker's cohorts hold half
  as many (rounded up) from then on (a cohort of one that runs out fails its trial, as one trial alone would).
- Stopping: `sweep stop` lets the members finish and asks for no more; `--timeout`, Ctrl-C and SIGTERM end every
  member as interrupted (or preempted) and queue its retry, which resumes from its newest checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import socket
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optuna
import torch
from optuna.trial import TrialState

from sweep.checkpoints import register_together
from sweep.objective import Prepared, TrainerTrial
from sweep.outcomes import (
    ATTR_COHORT,
    ATTR_FAIL,
    ATTR_INTERRUPTED,
    ATTR_RETRY_OF,
    Outcome,
    TimedOut,
    TrialResult,
    budget_counts,
    lost_in_a_cohort,
)
from sweep.pruners import startup_trials
from sweep.signals import Preempted, raise_pending, trial_code
from sweep.storage import PatientStorage, StorageAway, StorageUnavailable, release_idle_connections
from sweep.worker import InfrastructureError, StudyBrokenError, signalled, unmarked_if_away
from trainer.batched import Cohort, CohortMember, MemberFailures, batch_problem, batch_signature, max_cohort_size
from trainer.precision import out_of_memory, out_of_memory_words

if TYPE_CHECKING:
    from sweep.schema import Param, StudySpec
    from sweep.worker import Beats, RunSummary, Worker  # the loop drives a worker: its ask, end and heartbeats
    from trainer import Task, TrainingConfig

__all__ = ["CohortLoop", "shape_keys"]

AUTO_LIMIT = 256  # `cohort: auto` takes what fits the device's memory, up to this many (a CPU's RAM fits far more)
GENERATIONS = 4  # with shape keys, a cohort takes this many times its size in members, then drains; the next one
# draws its shapes anew


def shape_keys(spec: StudySpec, params: dict[str, Any], config: TrainingConfig, task: Task) -> list[str]:
    """The searched keys whose values change `config`'s batch signature: each is moved to another value of its
    range (its ends, or another choice) and the model built again on the meta device. A value the trainer refuses
    beside the others drawn (`max_steps: 1` below `warmup_steps: 6`) says nothing about shapes: it is passed over,
    not counted as a change (which would fix that key for the whole cohort). A member whose shapes differ all the
    same trains alone (`CohortLoop._admit`), so a key missed here costs speed, never a wrong result."""
    signature = batch_signature(config, task)
    keys = []
    for key, param in spec.space.items():
        for other in _other_values(param, params.get(key)):
            try:
                changed = batch_signature(spec.config_for({**params, key: other}), task)
            except Exception:  # noqa: BLE001 - not a config at all with the others' values: try the next
                continue
            if changed != signature:
                keys.append(key)
                break
    return keys


def variety(spec: StudySpec, keys: list[str]) -> float:
    """How many configs a cohort's members can differ in once its shape `keys` are fixed: the product of the other
    searched keys' sizes (a continuous range: infinity). 1: the members would all be one config."""
    count: float = 1
    for key, param in spec.space.items():
        if key not in keys:
            count *= _size(param)
    return count


def _size(param: Param) -> float:
    """The values a searched key can take (Optuna's grid for a stepped range; a continuous range: infinity)."""
    choices = getattr(param, "choices", None)
    if choices is not None:
        return len({repr(choice) for choice in choices})
    step = getattr(param, "step", None)
    if param.low == param.high:  # type: ignore[union-attr]
        return 1
    if step is None:
        return math.inf
    width = param.high - param.low  # type: ignore[union-attr]
    return width // step + 1 if isinstance(width, int) and isinstance(step, int) else round(width / step) + 1


def _other_values(param: Param, value: Any) -> list[Any]:
    choices = getattr(param, "choices", None)
    if choices is not None:
        return [c for c in choices if c != value]
    low, high = param.low, param.high  # type: ignore[union-attr]
    middle = (low + high) // 2 if isinstance(low, int) and isinstance(high, int) else (low + high) / 2
    return [v for v in dict.fromkeys((low, high, middle)) if v != value]  # the middle: where an end is refused


def _interrupted(reason: str, outcome: Outcome) -> TrialResult:
    return TrialResult(outcome, None, {ATTR_FAIL: reason, ATTR_INTERRUPTED: True})


@dataclass
class _Member:
    trial: optuna.Trial
    runner: TrainerTrial
    prepared: Prepared


class CohortLoop:
    """The worker's loop with up to `size` trials in flight at once (0: as many as the device holds)."""

    share_reads = True  # False: each member's pruner reads the study's trials itself (the decisions are the same)

    def __init__(self, worker: Worker, size: int) -> None:
        self.worker, self.size = worker, size
        self.cohort: Cohort | None = None
        self.members: dict[int, _Member] = {}  # by the cohort's member id
        self.fixed: dict[str, Any] | None = None
        self.keys: list[str] | None = None  # the study's shape keys, found with the first cohort
        self.variety: float = math.inf  # the configs a cohort's members can differ in, its shapes fixed (`variety`)
        self.single = False  # the model cannot be batched: one trial at a time
        self.spent = False
        self.exhausted = False  # the sampler has tried every point: the members in flight finish, then the run ends
        self.stopping = self.timed_out = False  # kept across a failed cohort: the loop goes on with the next one
        self.cohorts = 0
        self.admitted = 0  # members the current cohort has taken
        # The completed trials the pruner waits for, which a ramp holds the first cohorts to (0: no ramp).
        self.startup = startup_trials(worker.study.pruner) if worker.spec.execution.ramp else 0
        self.ramp = False  # the current cohort holds the pruner's startup trials (see the module's doc)
        self.seen: list[optuna.trial.FrozenTrial] = []  # the study's trials as the latest ask read them
        self.building = 0  # the size of the cohort being made (0: none is)
        self.made = 0  # the size the current cohort was made with (it shrinks in its tail: `_open_slots`)
        self.tag = f"{socket.gethostname()}:{os.getpid()}"

    def run(self, started_wall: float) -> RunSummary:
        worker = self.worker
        with worker.beating() as beats:
            while True:  # a cohort that fails is ended, member by member, and the loop goes on with the next one
                try:
                    with trial_code(passing=(StorageUnavailable, TimedOut, StudyBrokenError, InfrastructureError)):
                        return self._loop(beats, started_wall)
                except (KeyboardInterrupt, Preempted, TimedOut) as exc:
                    with unmarked_if_away("the cohort's trials", exc):
                        self._interrupt_all(beats, *signalled(exc))
                    raise
                except StorageUnavailable:
                    raise  # nothing can be stored: the members are found lost and retried later
                except (StudyBrokenError, InfrastructureError):
                    self._interrupt_all(beats, "interrupted: the worker stopped", Outcome.INTERRUPTED)
                    raise
                except BaseException as exc:  # a failing cohort must never take the study down (see Worker._run_one)
                    if not self.members:
                        raise  # no trial's doing: the worker's own fault, which trying again would repeat
                    if self._out_of_memory(beats, exc):
                        continue
                    result = worker._failure(exc)  # noqa: SLF001
                    stop: Exception | None = None
                    finished = {m: own for m in self.members if (own := self._finished(m)) is not None}
                    failing = [m for m in self.members if m not in finished]
                    for member_id, own in finished.items():  # told as it ended, before the cohort failed
                        try:
                            self._end(beats, member_id, own)
                        except (InfrastructureError, StudyBrokenError) as fault:
                            stop = stop or fault
                    for n, member_id in enumerate(failing):
                        try:  # one exception, one failure towards max_repeated_failures (not one per member)
                            self._end(beats, member_id, result, streak=n == 0, counted=n == 0)
                        except (InfrastructureError, StudyBrokenError) as fault:  # the other members are told too
                            stop = stop or fault
                    self.cohort = None
                    if stop is not None:
                        raise stop from exc

    def _out_of_memory(self, beats: Beats, exc: BaseException,
                       starting: tuple[optuna.Trial, TrainerTrial] | None = None) -> bool:
        """A cohort of more than one slot ran out of memory (in its step, while it was made, or while a member
        joined): the cohort's size did, not a member's config. Each member, and the trial `starting` if one was
        joining, ends as interrupted and is retried from its newest checkpoint (not counted, not a failure), and this
        worker's cohorts hold half as many (rounded up) from now on. False for anything else, and for a cohort of
        one: then the config itself does not fit, and it fails as one trial alone would."""
        cohort = self.cohort
        size = self.made if cohort is not None else self.building  # as made: a tail's shrinking is not its size
        if size < 2 or not out_of_memory(exc):
            return False
        step = cohort.step_count if cohort is not None else 0
        smaller = (size + 1) // 2
        finished = {m: own for m in self.members if (own := self._finished(m)) is not None}
        self.cohort = cohort = None  # its stacked tensors go before the next cohort is made
        # ...and so do the frames the error came up through, which the error holds while it is handled: their locals
        # hold the cohort and its step's tensors (review: under `ulimit -v`, a halved cohort that fits in a fresh
        # process ran out again beside the old one's memory, and then a cohort of one did).
        traceback.clear_frames(exc.__traceback__)
        self.building = 0
        self.size = smaller
        reason = f"interrupted: its cohort of {size} ran out of memory at step {step}; retried in a cohort of {smaller}"
        warnings.warn(f"execution.cohort: a cohort of {size} ran out of memory ({out_of_memory_words(exc)}); its "
                      f"trials are retried from their checkpoints, and this worker's cohorts hold {smaller} from "
                      "now on",
                      stacklevel=2)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        result = _interrupted(reason, Outcome.INTERRUPTED)
        if starting is not None:
            trial, runner = starting
            self._drop(trial)
            beats.discard(trial)
            self._end_unadmitted(trial, result, runner)
        for member_id in list(self.members):
            self._end(beats, member_id, finished.get(member_id, result), streak=False)
        return True

    def _loop(self, beats: Beats, started_wall: float) -> RunSummary:
        worker = self.worker
        while True:
            raise_pending()
            self.timed_out = self.timed_out or (worker.timeout is not None
                                                and time.monotonic() - worker.started >= worker.timeout)
            cohort = self.cohort
            if cohort is None or cohort.at_boundary():  # `sweep stop` is a storage read: not every step
                away = self._check_stop(started_wall, training=cohort is not None and bool(cohort.active))
                if self.timed_out and cohort is not None:
                    self._interrupt_all(beats, worker.timed_out_reason, Outcome.INTERRUPTED)
                elif not self.stopping and not away:
                    with self._shared_reads(), self._deferred():  # the new members' step-0 reports, one by one
                        self._fill(beats)
                if self.cohort is not None and len(self.cohort.active) <= self.cohort.capacity // 2:
                    # Slots no trial took cost their share of every step: dropped once half are empty, so that a
                    # tail passes through few sizes (on a CPU, each new size checks its batched kernels once).
                    self.cohort.shrink()
            stopping, timed_out = self.stopping, self.timed_out
            cohort = self.cohort
            if cohort is not None and not cohort.active:
                self._tell_left(beats)
                self.cohort = cohort = None  # drained: the next one's shapes are the sampler's choice
                if not stopping and not self.spent:
                    continue
            if cohort is None or not cohort.active:
                self._tell_left(beats)
                if self.single and not stopping and not self.spent:
                    return worker.run_single(started_wall)
                if stopping or self.spent:
                    return worker._summary(timed_out=timed_out, stopped=stopping and not timed_out,  # noqa: SLF001
                                           exhausted=self.exhausted)
                trials = worker.study.get_trials(deepcopy=False)
                worker._adopt_silent_trials(trials)  # noqa: SLF001 - the last trials run elsewhere
                release_idle_connections()  # none held idle while they run (`Worker.run_single`'s wait)
                time.sleep(worker.spec.heartbeat_interval)
                continue
            unwritten: dict[int, Exception] = {}
            raised: frozenset[int] = frozenset()
            with worker.boundary.no_wait(), self._shared_reads(), self._deferred():
                try:
                    cohort.step()
                except MemberFailures as failures:  # the step is done; these members failed alone
                    unwritten, raised = failures.failures, failures.raised
                except BaseException:  # what the step saved before it failed is registered too
                    with contextlib.suppress(Exception):
                        self._register_checkpoints()
                    raise
                self._register_checkpoints()
            # Each ends as its trial alone would: a member's own loss or metrics that raised is its config's error
            # (each counts); checkpoints one step could not write are one fault of the machine (counted once).
            for n, (member_id, exc) in enumerate(sorted(unwritten.items(), key=lambda item: item[0] not in raised)):
                cohort.remove(member_id)
                own = member_id in raised
                self._end(beats, member_id, worker._failure(exc), streak=own or n == len(raised),  # noqa: SLF001
                          counted=own or n == len(raised))
            self._end_lost_members(beats)
            self._tell_left(beats)

    def _tell_left(self, beats: Beats) -> None:
        """`_collect`; once the sampler has tried every point, no member is asked any more and the members in flight
        train to their ends (it returned at once, leaving them RUNNING: found lost, retried by the next run)."""
        if self._collect(beats):
            self.exhausted = self.spent = True

    def _check_stop(self, started_wall: float, *, training: bool) -> bool:
        """Whether the run stops (`sweep stop`, `--timeout`), read at a boundary. While members are `training`, a
        storage that is away is not waited for: True then (nothing asked, nothing told), and the members train on,
        their reports and checkpoints' registrations held until it is back, as a lone trial's are."""
        worker = self.worker
        if self.stopping or self.timed_out:
            self.stopping = True
            return False
        try:  # the reports held so far are written first (`PatientStorage._call`)
            with worker.boundary.no_wait() if training else contextlib.nullcontext():
                self.stopping = worker._stop_requested(started_wall)  # noqa: SLF001
        except StorageAway:
            return True
        return False

    def _away(self) -> bool:
        """Whether members still train while the storage is unreachable: members that left the cohort meanwhile
        are told when it is back (at a boundary's read), and the others train on."""
        return self.cohort is not None and bool(self.cohort.active) and not self.worker.boundary.available

    def _shared_reads(self) -> contextlib.AbstractContextManager[None]:
        """One read of the study's finished trials for every member's pruner in a step, or in a refill's step-0
        reports (no member is told during a step, and a trial told during a refill drops the read: each decision is
        the one it would be alone; `PatientStorage.shared_finished_reads`)."""
        storage = self.worker.storage
        if self.share_reads and isinstance(storage, PatientStorage):
            return storage.shared_finished_reads()
        return contextlib.nullcontext()

    def _deferred(self) -> contextlib.AbstractContextManager[None]:
        """The members' reports and attrs in a step (or a refill) written in one transaction at its end, where each
        was one (`PatientStorage.deferred_writes`; each member's pruner decides as it would alone)."""
        storage = self.worker.storage
        if self.share_reads and isinstance(storage, PatientStorage):
            return storage.deferred_writes()
        return contextlib.nullcontext()

    # -- members -----------------------------------------------------------------------------------------------------
    def _fill(self, beats: Beats) -> None:
        """Ask trials for the free slots (all of them when there is no cohort yet): a new cohort's first member
        alone, then the free slots' trials together (`Worker._ask_many`: one hold of the lock, one read of the
        study), admitted one by one."""
        worker = self.worker
        waiting: list[optuna.Trial] = []  # asked, not admitted yet
        try:
            while waiting or self._wants_members():
                if not waiting:
                    # A new cohort's first member draws its shapes freely; the cohort's later members share them.
                    fixed = self.fixed if self.cohort is not None else None
                    # A ramp's count of the startup trials in flight, made again under the lock with the ask's read:
                    # another worker's ramp may have taken the last one since (review: 4 admitted where 3 were missing).
                    gate = self._ramp_open if self.cohort is not None and self.ramp else None
                    waiting, self.spent, self.seen = worker._ask_many(self._wanted(), fixed, gate)  # noqa: SLF001
                    if not waiting and worker.sampler_stopped:  # the whole grid was taken before this ask
                        self.exhausted = self.spent = True
                    if not waiting:
                        return
                    beats.add(*waiting)  # beating while they wait their turn (one may train alone meanwhile)
                if self.cohort is not None and self._open_slots() < 1:  # never: asked for the open slots
                    self._give_back(beats, waiting, _interrupted("interrupted: asked for a cohort slot that was "
                                                                 "taken", Outcome.INTERRUPTED))
                    return
                trial = waiting.pop(0)
                runner = TrainerTrial(trial, worker.spec, worker.events, worker.boundary, worker.checkpoints,
                                      storage_url=worker.url)
                try:
                    admitted = self._admit(beats, trial, runner, 1 + len(waiting))
                except (KeyboardInterrupt, Preempted, TimedOut) as exc:
                    # Ctrl-C or SIGTERM while this trial started (its step-0 report) or trained alone: it is not a
                    # member yet, so `_interrupt_all` would not see it. Marked and queued here, as the members are.
                    self._drop(trial)
                    beats.discard(trial)
                    with unmarked_if_away(f"trial {trial.number}", exc):
                        self._end_unadmitted(trial, _interrupted(*signalled(exc)), runner)
                    raise
                except (StorageUnavailable, StudyBrokenError, InfrastructureError):
                    raise
                except BaseException as exc:  # noqa: BLE001 - the trial's config, start or slot failed: it alone fails
                    if self._out_of_memory(beats, exc, (trial, runner)):
                        # The others asked with it were drawn for the cohort that ran out: queued again, they join
                        # the smaller cohort made next.
                        self._give_back(beats, waiting, _interrupted("interrupted: its cohort ran out of memory "
                                                                     "before it started", Outcome.INTERRUPTED))
                        continue
                    self._drop(trial)
                    beats.discard(trial)
                    frozen = worker._end(trial, worker._failure(exc), runner)  # noqa: SLF001
                    if frozen is not None and worker.finished(frozen, running=self._in_flight()):
                        self.exhausted = self.spent = True  # the sampler has tried every point
                    continue
                if self.timed_out:  # a trial trained alone met --timeout: the others asked with it are queued
                    self._give_back(beats, waiting, _interrupted(worker.timed_out_reason, Outcome.INTERRUPTED))
                    return
                if not admitted:  # the study goes on one trial at a time: the others asked with it are queued
                    self._give_back(beats, waiting, _interrupted("interrupted: asked for a cohort; the study "
                                                                 "trains one trial at a time", Outcome.INTERRUPTED))
                    return
        except (KeyboardInterrupt, Preempted, TimedOut) as exc:
            with unmarked_if_away("the trials asked for the cohort", exc):
                self._give_back(beats, waiting, _interrupted(*signalled(exc)))  # as the one that was starting
            raise
        except (StudyBrokenError, InfrastructureError):
            self._give_back(beats, waiting, _interrupted("interrupted: the worker stopped", Outcome.INTERRUPTED))
            raise
        except StorageUnavailable:
            for trial in waiting:  # nothing can be stored: found lost by their heartbeats, and retried
                beats.discard(trial)
            raise

    def _give_back(self, beats: Beats, trials: list[optuna.Trial], result: TrialResult) -> None:
        """End trials asked for this cohort that never started in it, with `result` (interrupted or preempted:
        each is queued again, not counted)."""
        worker = self.worker
        while trials:
            trial = trials.pop(0)
            beats.discard(trial)
            self._end_unadmitted(trial, result, TrainerTrial(trial, worker.spec, worker.events, worker.boundary,
                                                             worker.checkpoints, storage_url=worker.url))

    def _end_unadmitted(self, trial: optuna.Trial, result: TrialResult, runner: TrainerTrial) -> None:
        """End a trial asked for the cohort that is no member (yet) as interrupted or preempted, with its line, as
        a member's (queued again: not counted, no failure)."""
        frozen = self.worker._end(trial, result, runner)  # noqa: SLF001
        if frozen is not None:
            self.worker.events.trial_finished(frozen)

    def _wants_members(self) -> bool:
        """Whether the cohort takes another member now (or a new cohort is to be made)."""
        cohort = self.cohort
        # Not once --timeout has passed (a trial trained alone met it): nothing more is asked or admitted.
        return not self.spent and not self.single and not self.timed_out and (cohort is None or (
            self._open_slots() > 0 and (not self.keys or self.admitted < self._intake())
            and not (self.ramp and self._startup_in_flight())))

    def _wanted(self) -> int:
        """How many trials to ask together: one for a new cohort (its first member shapes it) and in a ramp (each
        admission changes what it waits for); else the free slots, within the cohort's generations."""
        cohort = self.cohort
        if cohort is None or self.ramp:
            return 1
        free = self._open_slots()
        return max(1, min(free, self._intake() - self.admitted) if self.keys else free)

    def _intake(self) -> int:
        """The members a cohort with shape keys takes before it drains: its generations, and no more than the configs
        its fixed shapes leave to draw."""
        return int(min(GENERATIONS * self.made, self.variety))

    def _open_slots(self) -> int:
        """The members the cohort takes now: its size as made, less its members (a cohort that took none at a
        boundary has shrunk to its members, and grows again for one that joins: `Cohort.shrink`)."""
        cohort = self.cohort
        return 0 if cohort is None else self.made - len(cohort.active)

    def _drop(self, trial: optuna.Trial) -> None:
        """Take `trial` out of the cohort if it got a slot before its admission failed."""
        for member_id, member in list(self.members.items()):
            if member.trial is trial:
                del self.members[member_id]
                if self.cohort is not None:
                    with contextlib.suppress(KeyError):
                        self.cohort.remove(member_id)

    def _admit(self, beats: Beats, trial: optuna.Trial, runner: TrainerTrial, joining: int = 1) -> bool:
        """Start `trial` in a free slot (the cohort's first member shapes it). False when its model cannot be
        batched: it was trained alone, and the study goes on one trial at a time. `joining`: this trial and those
        asked with it that wait their turn (a shrunk cohort grows once for all of them)."""
        prepared = runner.prepare()
        if self._suspect(trial):
            # Its lineage was lost twice in a cohort: it, or another member, killed it. Alone, a loss is its own
            # (`lost_in_a_row` counts it), and a member that kills every worker cannot take the others with it
            # again (review: innocent members died with a poison one three times and were failed with it).
            self._alone(beats, trial, runner, prepared)
            return True
        if self.cohort is None and not self._start_cohort(trial, prepared):
            self._alone(beats, trial, runner, prepared)  # the model cannot be batched: this one, then singly
            return False
        assert self.cohort is not None
        if batch_signature(prepared.config, prepared.task) != self.cohort.signature:
            # A retry (or a confirmation) of another shape than the cohort's: it trains alone now, the cohort waits
            # at this boundary.
            self._alone(beats, trial, runner, prepared)
            return True
        beats.add(trial)
        if not self.cohort.free_slots:  # shrunk at an earlier boundary: the slots of those joining now, at once
            self.cohort.grow(max(1, min(joining, self._open_slots())))
        if runner.checkpointer is not None:  # its checkpoints are registered with the others' after each step
            runner.checkpointer.deferred = True
        member_id = self.cohort.add(CohortMember(prepared.config, prepared.reporter, prepared.start.resume,
                                                 prepared.start.warm, prepared.checkpointer))
        self.members[member_id] = _Member(trial, runner, prepared)
        self.admitted += 1
        trial.set_user_attr(ATTR_COHORT, {"id": f"{self.tag}:{self.cohorts}", "size": self.made,
                                          "member": member_id})
        return True

    def _start_cohort(self, trial: optuna.Trial, prepared: Prepared) -> bool:
        """A new cohort shaped like `prepared`'s config; False (with one warning) when its model cannot be batched."""
        problem = batch_problem(prepared.config, prepared.task)
        if problem is not None:
            warnings.warn(f"execution.cohort: this study's model cannot be trained in cohorts ({problem}); its trials "
                          "train one at a time", stacklevel=2)
            self.single = True
            return False
        if self.keys is None:
            self.keys = shape_keys(self.worker.spec, prepared.params, prepared.config, prepared.task)
            self.variety = variety(self.worker.spec, self.keys) if self.worker.spec.space else math.inf
            if self.keys and self.variety <= 1:
                warnings.warn(f"execution.cohort: every key this study searches ({', '.join(self.keys)}) changes the "
                              "model's shapes, so a cohort's members would all train one and the same config; its "
                              "trials train one at a time", stacklevel=2)
                self.single = True
                return False
        size = self.size or min(max_cohort_size(prepared.config, prepared.task), AUTO_LIMIT)
        size = int(min(size, self.variety))  # more members than configs to draw: copies of one another
        completed, running = self._startup_counts(self.seen)
        self.ramp = completed < self.startup
        if self.ramp:  # the startup trials still missing, less those running elsewhere; this one at least
            size = min(size, max(1, self.startup - completed - running))
        # Never more slots than this run has trials left (a rerun's, not the study's whole budget): a slot no trial
        # will fill still costs memory and time (review: a rerun with 2 trials left made a cohort of 5).
        left = self.worker.n_trials - budget_counts(self.seen)[0]
        self.building = max(1, min(size, left))
        self.cohort = Cohort(prepared.task, prepared.config, self.building)
        self.made, self.building = self.building, 0
        self.cohorts += 1
        self.admitted = 0
        self.fixed = {key: prepared.params[key] for key in self.keys if key in prepared.params} or None
        # A ramp cohort drains once its startup trials are in: the next one draws anew (review: it said "try one").
        if self.fixed and self.cohorts == 1 and not self.ramp and left <= self._intake():
            one = len(self.fixed) == 1
            # One of several workers (`--workers N`, a Slurm array, pods; sweep.workers.WORKER_ENV): its cohort is
            # one of several, each with its own draw, so the study tries more than this one (review: two workers
            # each said the study tried theirs alone).
            several = os.environ.get("SWEEP_WORKER") is not None
            tries = (f"this worker's cohort tries one ({self._fixed_text()}), each worker's its own" if several else
                     f"this run's {left} trials left try one ({self._fixed_text()})" if left < self.worker.n_trials
                     else f"this study's {self.worker.n_trials} trials try one ({self._fixed_text()})")
            # What a key changes: the model's shapes, or what else members must share (the optimizer kind, the
            # task's args; review: "optimizer changes the model's shapes").
            warnings.warn(f"execution.cohort: {', '.join(self.fixed)} {'changes' if one else 'change'} what a "
                          "cohort's members must share (the model's shapes, the optimizer kind, the task's args), so "
                          f"a cohort's members share its first member's {'value' if one else 'values'} "
                          f"and a cohort takes {self._intake()} members before the next draws anew: {tries}; a "
                          "smaller cohort or more trials search them", stacklevel=2)
        return True

    def _fixed_text(self) -> str:
        return ", ".join(f"{key}={value!r}" for key, value in (self.fixed or {}).items())

    @staticmethod
    def _startup_counts(trials: list[optuna.trial.FrozenTrial]) -> tuple[int, int]:
        """The completed and the running trials among `trials`."""
        return (sum(t.state == TrialState.COMPLETE for t in trials),
                sum(t.state == TrialState.RUNNING for t in trials))

    def _startup_in_flight(self) -> bool:
        """Whether the ramp cohort takes no more members: the startup trials still missing are all in flight, here
        or elsewhere (or none is missing: it drains, and the next cohort has the full size)."""
        return not self._ramp_open(self.worker.study.get_trials(
            deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING)))

    def _ramp_open(self, trials: list[optuna.trial.FrozenTrial]) -> bool:
        """Whether, by `trials`, a startup trial is still missing that no worker runs."""
        completed, running = self._startup_counts(trials)
        return completed + running < self.startup

    def _suspect(self, trial: optuna.Trial) -> bool:
        """A retry whose lineage was lost twice in a cohort of several (`lost_in_a_cohort`; once is a machine's
        fault as often as not, and its retry joins a cohort again), from the study's trials as the ask that took it
        read them."""
        seen = self.seen  # by number (a study's trials are numbered from 0 in order)
        asked = seen[trial.number] if trial.number < len(seen) and seen[trial.number].number == trial.number else None
        origin = (asked.user_attrs if asked is not None else trial.user_attrs).get(ATTR_RETRY_OF)
        return isinstance(origin, int) and lost_in_a_cohort({t.number: t for t in seen}, origin) >= 2

    def _alone(self, beats: Beats, trial: optuna.Trial, runner: TrainerTrial, prepared: Prepared) -> None:
        """Train one trial by the ordinary loop, now (the cohort, if any, waits)."""
        worker = self.worker
        beats.add(trial)
        storage = worker.storage
        timed_out = False
        try:  # its reports stored as it trains, as any lone trial's, not with the refill's
            with (trial_code(passing=(StorageUnavailable, TimedOut)),  # an error a signal caused is that stop
                  storage.writes_now() if isinstance(storage, PatientStorage) else contextlib.nullcontext()):
                result = runner.train_prepared(runner.until(prepared, worker.deadline))
        except TimedOut:  # stopped at its checkpoint after the deadline, queued as one trial at a time queues it
            result = _interrupted(worker.timed_out_reason, Outcome.INTERRUPTED)
            timed_out = self.timed_out = True  # the members left are interrupted at the loop's next boundary
        except (KeyboardInterrupt, Preempted, StorageUnavailable):
            raise
        except BaseException as exc:  # noqa: BLE001 - a failing trial must never take the study down
            result = worker._failure(exc)  # noqa: SLF001
        finally:
            beats.discard(trial)
        frozen = worker._end(trial, result, runner)  # noqa: SLF001
        if frozen is not None and timed_out:
            worker.events.trial_finished(frozen)  # its line; an interrupted trial counts towards no streak
        elif frozen is not None:
            worker.finished(frozen, running=self._in_flight())

    def _collect(self, beats: Beats) -> bool:
        """Tell the study every member that left the cohort since the last look. True when the sampler has tried
        every point (the loop ends)."""
        if self.cohort is None or self._away():
            return False
        if not any(m in self.cohort.results for m in self.members):  # nothing to tell: no flush of the held reports
            return False
        exhausted = False
        with self._deferred():  # each member's last attrs go with its outcome's, before its state
            for member_id in [m for m in self.members if m in self.cohort.results]:
                member = self.members[member_id]
                result = member.runner.result_of(member.prepared, self.cohort.results[member_id])
                exhausted = self._end(beats, member_id, result) or exhausted
        return exhausted

    def _register_checkpoints(self) -> None:
        """The members' checkpoints of the step, registered together (`register_together`)."""
        register_together([m.runner.checkpointer for m in self.members.values() if m.runner.checkpointer is not None])

    def _end_lost_members(self, beats: Beats) -> None:
        """Members another worker declared lost (no heartbeat within the grace period: a machine paused, a long
        storage outage) had their reports refused: they leave the cohort now, as interrupted, and their retries,
        queued by that worker, train them again from their checkpoints (never counted twice)."""
        storage = self.worker.storage
        refused = storage.take_refused() if isinstance(storage, PatientStorage) else set()
        for member_id, member in list(self.members.items()):
            if member.trial._trial_id in refused:  # noqa: SLF001 - Optuna has no public id of a running trial
                if self.cohort is not None and member_id not in self.cohort.results:
                    with contextlib.suppress(KeyError):
                        self.cohort.remove(member_id)
                self._end(beats, member_id, _interrupted("interrupted: declared lost by another worker while it "
                                                         "trained", Outcome.INTERRUPTED), streak=False)

    def _end(self, beats: Beats, member_id: int, result: TrialResult, *, streak: bool = True,
             counted: bool = True) -> bool:
        """End a member's trial with `result`; `streak` and `counted`: whether its failure counts towards
        `max_repeated_failures` and a fault of the machine towards `MAX_INFRA_REPEATS` (one exception that ends
        several members counts once)."""
        member = self.members.pop(member_id)
        beats.discard(member.trial)
        frozen = self.worker._end(member.trial, result, member.runner, counted=counted)  # noqa: SLF001
        return frozen is not None and self.worker.finished(frozen, streak=streak, running=self._in_flight())

    def _in_flight(self) -> set[int]:
        """The numbers of the members' trials: still training, none has failed (`Worker.finished`)."""
        return {member.trial.number for member in self.members.values()}

    def _interrupt_all(self, beats: Beats, reason: str, outcome: Outcome) -> None:
        """End every member now as interrupted or preempted: each is queued again and resumes from its newest
        checkpoint."""
        for member_id in list(self.members):
            if (own := self._finished(member_id)) is not None:  # finished before (told late: the storage was away)
                # Told as it ended; not towards the failure streak, whose StudyBrokenError would leave the members
                # after it untold (the run is stopping for another reason already).
                with contextlib.suppress(InfrastructureError, StudyBrokenError):
                    self._end(beats, member_id, own, streak=False)
                continue
            if self.cohort is not None:
                with contextlib.suppress(KeyError):
                    self.cohort.remove(member_id)
            self._end(beats, member_id, _interrupted(reason, outcome))
        self.cohort = None

    def _finished(self, member_id: int) -> TrialResult | None:
        """The result of a member that has left the cohort but is not told yet (`_collect` waits while the storage is
        away): the cohort ending now, for whatever reason, must not change how it ended."""
        cohort = self.cohort
        if cohort is None or member_id not in cohort.results:
            return None
        member = self.members[member_id]
        try:  # its held reports are written first: an error there must not hide the one ending the cohort
            return member.runner.result_of(member.prepared, cohort.results[member_id])
        except Exception:  # noqa: BLE001 - then it ends as the others do
            return None
