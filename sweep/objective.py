"""The built-in runner: one trial trained by `trainer.train`.

Sampled params plus fixed values become a `TrainingConfig`; a retry resumes from the newest checkpoint of its
lineage (and first copies the lineage's reported values up to there, so pruners, the report and the dashboard see one
continuous curve), a fresh trial may warm-start from a donor; the trainer trains, reporting each evaluation to the
study, whose pruner decides; the result becomes a `TrialResult`. The worker (`sweep.worker`) decides what an
exception means; this module only trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import signal
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import optuna

from sweep.components import pruner_name
from sweep.confirm import warm_lineage
from sweep.outcomes import (
    ATTR_CONFIG,
    ATTR_CONFIRMS,
    ATTR_FAIL,
    ATTR_LINEAGE,
    ATTR_LOSS_CURVE,
    ATTR_METRICS,
    ATTR_PRUNE,
    ATTR_RANKS,
    ATTR_REPORT_MS,
    ATTR_REPRO,
    ATTR_RESUMED_FROM,
    ATTR_SPEED,
    ATTR_STEPS,
    ATTR_STEPS_TRAINED,
    ATTR_TRAIN_CURVE,
    ATTR_WALL,
    ATTR_WARM_START,
    OWNER_ATTR,
    RANK_FIX,
    Fault,
    Outcome,
    TimedOut,
    TrialResult,
    lineage,
)
from sweep.pruners import FastFailPruner, handoff_point, judges_by_rungs, should_prune
from sweep.signals import FORWARD, raise_pending, sheltered, stop_requested
from sweep.storage import PatientStorage, StorageAway
from sweep.tracking import Guarded, open_trackers
from sweep.warmstart import shape_key
from sweep.workers import SECRET_ENV_NAMES, STORAGE_FILE_ENV
from trainer import Task, TrainingConfig, TrainResult, load_task, train
from trainer.checkpoint import CheckpointInfo, TrainState, WarmStart
from trainer.distributed import RankFailed, local_ranks, signal_name
from trainer.fast_fail_rules import FastFailConfig
from trainer.loop import TrainingSeries
from trainer.seeding import thread_record

if TYPE_CHECKING:
    from sweep.checkpoints import CheckpointService, TrialCheckpointer
    from sweep.progress import Events
    from sweep.schema import StudySpec
    from sweep.storage import Boundary
    from sweep.tracking import Tracker

__all__ = ["Deadline", "Prepared", "Start", "TrainerTrial", "TrialReporter", "finish_trackers", "metric_value",
           "resume_lineage", "task_for", "trial_trackers", "warm_start"]

SPEED_KEYS = ("samples_per_s", "tokens_per_s", "peak_mem_mb", "gpu_util_pct")


def store_config(trial: optuna.Trial, config: Mapping[str, Any]) -> None:
    """The trial's config, and the torch thread counts its process trains with, stored as it starts: a trial that
    never ends by its own hand (lost, killed) has its threads for `sweep reproduce` too, whose replay on the process's
    own count differed in the last digits, with nothing named (review: a lost trial of `--workers 2`). Its end writes
    the whole reproducibility record over this one."""
    trial.set_user_attr(ATTR_CONFIG, config)
    trial.set_user_attr(ATTR_REPRO, {"threads": thread_record()})


def metric_value(metrics: Mapping[str, float], metric: str) -> float:
    """The study's metric in one evaluation's `metrics`, or NaN when the evaluation's loss (`val_loss`) is NaN or
    infinite: a model whose outputs are not numbers has no accuracy or score worth keeping (its argmax still picks a
    class), and fast-fail's `nan` rule, failing a trial whose final value is NaN, and keeping it out of warm start's
    donors and the best trials, must see it whatever the metric."""
    value = metrics[metric]
    loss = metrics.get("val_loss")
    if metric != "val_loss" and isinstance(loss, (int, float)) and not math.isfinite(loss):
        return math.nan
    return value


def diverged_words(metrics: Mapping[str, Any], metric: str, value: float) -> str:
    """What made an evaluation's metric `value` (NaN or infinite, by `metric_value`) so: its own value, or its
    evaluation's val_loss where the metric itself was a finite number (review: a command's last line
    `{"val_accuracy": 0.99, "val_loss": NaN}` failed as "val_accuracy is nan")."""
    own, loss = metrics.get(metric), metrics.get("val_loss")
    if (metric != "val_loss" and isinstance(own, (int, float)) and not isinstance(own, bool) and math.isfinite(own)
            and isinstance(loss, (int, float)) and not isinstance(loss, bool) and not math.isfinite(loss)):
        return f"val_loss is {float(loss)} (with {metric} {float(own):g})"
    return f"{metric} is {value}"


class TrialReporter:
    """Adapts an Optuna trial to the trainer's `Reporter`: each evaluation's metric is reported to the study, and the
    study's pruner decides whether to stop, so every decision lives in the storage. At the last step nothing is left
    to save, so the pruner is not asked: a trial that used its whole budget completes.

    While the storage is away the trial keeps training: its values wait here and are reported, in order, at the
    first evaluation the storage answers again (or by `flush` when the trial ends); the pruner is asked then.
    `prior`: the values its lineage reported before this trial resumed. `config`: the trial's config as plain data
    (a `TrainingConfig`'s dict, or a user loop's own), which the fast-fail rules read (`max_steps` and the like).
    `inherited_until`: a warm trial's handoff step; its evaluation there is the donor's work, so it is neither stored
    nor judged: pruners see only the steps the trial trained itself. `judged=False` (a cold confirmation): values are
    stored, the pruner is never asked. `answers_deadline`: a user's loop or command, which saves its own checkpoints:
    once `--timeout` has passed, a report returns True ("stop": it saves and returns) and `timed_out` is set, where
    the built-in trainer's, with no checkpoint to stop at, raises `TimedOut` there. `signals=False` (a command, whose
    runner answers Ctrl-C and SIGTERM itself, while the command saves): a report never raises them."""

    def __init__(self, trial: optuna.Trial, spec: StudySpec, config: Mapping[str, Any], events: Events,
                 boundary: Boundary, prior: Sequence[tuple[int, float]] = (), *, deadline: Deadline | None = None,
                 inherited_until: int | None = None, judged: bool = True, trackers: Sequence[Tracker] = (),
                 answers_deadline: bool = False, signals: bool = True,
                 curves: Mapping[str, Sequence[tuple[int, float]]] | None = None) -> None:
        self.trial, self.config, self.events, self.boundary = trial, dict(config), events, boundary
        self.inherited_until, self.judged = inherited_until, judged
        pruner = trial.study.pruner
        if judged and not isinstance(pruner, FastFailPruner) and judges_by_rungs(pruner) and (
                inherited_until is not None or ATTR_WARM_START in trial.user_attrs):
            self.judged = False  # a warm trial in successive halving's rungs: see `judges_by_rungs`
        max_steps = config.get("max_steps")  # a user's loop may have none: then no step is known to be the last
        self.max_steps = max_steps if isinstance(max_steps, int) and not isinstance(max_steps, bool) else None
        self.deadline, self.answers_deadline, self.signals = deadline, answers_deadline, signals
        self.timed_out = False  # a report answered "stop" because `--timeout` passed (`answers_deadline`)
        self.metric = spec.metric
        self.maximize = spec.direction == "maximize"
        # A loop's or command's warm trials may count their steps from 0: judged at their lineages' steps.
        self.lineages = spec.warm_start.enabled and (spec.loop is not None or spec.command is not None)
        self.series: list[tuple[int, float]] = list(prior)
        self.steps = {step for step, _ in self.series}
        self.unsent: list[tuple[int, float]] = []
        self.prune_reason: dict[str, Any] | None = None
        self.report_ms: list[float] = []  # storage round trips of report + should_prune, kept on the trial
        self.speed: dict[str, float] = {}  # the latest throughput and memory, kept on the trial
        # The overfitting rule's training values (empty when it is off, and for a user's loop, which has no fast_fail).
        self.training = TrainingSeries(_fast_fail_of(self.config), self.metric)
        self.training_unsent = False
        # The val_loss curve for fast-fail's NaN/Inf and explosion rules, where the study's metric is another.
        watches = (isinstance(pruner, FastFailPruner) and pruner.config.enabled
                   and pruner.config.loss_explosion_factor is not None and spec.metric != "val_loss")
        self.losses: list[tuple[int, float]] | None = [] if watches and self.judged else None
        self.losses_unsent = False
        # A retry's lineage's curves (`Start.curves`): its rules go on from them, and they are stored at the first
        # flush, before the pruner's first read (an explosion is judged against the lineage's first val_loss).
        lineage = curves or {}
        if self.losses is not None and lineage.get(ATTR_LOSS_CURVE):
            self.losses, self.losses_unsent = list(lineage[ATTR_LOSS_CURVE]), True
        if self.training.name is not None and lineage.get(ATTR_TRAIN_CURVE):
            self.training.series, self.training_unsent = list(lineage[ATTR_TRAIN_CURVE]), True
        self.trackers = list(trackers)  # TensorBoard, MLflow (sweep.tracking): empty with tracking off

    def poll(self, step: int) -> None:
        if self.signals:
            raise_pending()  # Ctrl-C or SIGTERM: between two steps, a clean point of the loop

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.signals:
            raise_pending()  # Ctrl-C or SIGTERM: stop here, at a clean point of the loop
        with sheltered():
            self.events.trial_log(self.trial.number, step, metrics)
            self.speed = {k: round(float(metrics[k]), 1) for k in SPEED_KEYS if k in metrics}
            self.training.log(metrics)
            for tracker in self.trackers:
                tracker.log(step, metrics)

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        if self.signals:
            raise_pending()
        with sheltered():  # a handler of the trial's code (PyTorch's for SIGCHLD) never raises mid-write
            return self._report(step, metrics)

    def _report(self, step: int, metrics: Mapping[str, float]) -> bool:
        if self.inherited_until is not None and step <= self.inherited_until:
            return False  # the donor's value at the handoff: its lineage's, not this trial's
        if step in self.steps:
            return False  # the study keeps a step's first value (a resumed loop may report its resume step again)
        for tracker in self.trackers:
            tracker.report(step, metrics)
        value = metric_value(metrics, self.metric)
        self.series.append((step, value))
        self.steps.add(step)
        self.unsent.append((step, value))
        if self.training.pair(step) is not None:
            self.training_unsent = True
        if self.losses is not None and "val_loss" in metrics:
            self.losses.append((step, float(metrics["val_loss"])))
            self.losses_unsent = True
        started = time.perf_counter()
        try:
            with self.boundary.no_wait():
                self.flush()
                with self._one_read():
                    prune = self.judged and not self._last(step) and should_prune(self.trial, self.lineages)
                    # Which rule pruned, from the same read: its own read, outside that, met a dropped connection
                    # as the machine's fault, and a pruned trial was retried (review).
                    reason = self._explain(step, value, metrics) if prune else None
        except StorageAway:
            return False  # keep training; the pruner judges this value with the next one the storage takes
        self.report_ms.append(round(1000 * (time.perf_counter() - started), 2))
        if prune:
            self.prune_reason = reason
        elif self.deadline is not None and self.deadline.checkpointer is None and not self._last(step) \
                and self.deadline.passed():
            if not self.answers_deadline:
                raise TimedOut()  # nothing to resume from: stop now
            self.timed_out = True  # the loop saves, then returns; its runner then stops the trial as timed out
            return True
        return prune

    def _one_read(self) -> contextlib.AbstractContextManager[None]:
        """One read of the study's finished trials for the pruner's whole decision: fast-fail reads them for its
        study reference, the pruner it wraps (median, percentile...) reads them again. Nothing is told meanwhile, so
        the decision is the one two reads would give (`PatientStorage.shared_finished_reads`; inside a cohort's
        step, the step's one read)."""
        storage = self.trial.storage
        return storage.shared_finished_reads() if isinstance(storage, PatientStorage) else contextlib.nullcontext()

    def _last(self, step: int) -> bool:
        # The final evaluation, which ends the trial whatever is decided: not judged. Only that step: a loop whose
        # reports run past `max_steps` (a global batch step where max_steps counts epochs) was never judged again,
        # a NaN ran on and `--timeout` was not answered.
        return self.max_steps is not None and step == self.max_steps

    def flush(self) -> None:
        with sheltered():
            self._flush()

    def _flush(self) -> None:
        if self.training_unsent:  # before the values: the pruner reads both when asked
            self.trial.set_user_attr(ATTR_TRAIN_CURVE, [list(pair) for pair in self.training.series])
            self.training_unsent = False
        if self.losses_unsent and self.losses is not None:
            self.trial.set_user_attr(ATTR_LOSS_CURVE, [list(pair) for pair in self.losses])
            self.losses_unsent = False
        while self.unsent:
            step, value = self.unsent[0]
            self.trial.report(value, step)
            self.unsent.pop(0)

    def _explain(self, step: int, value: float, metrics: Mapping[str, float]) -> dict[str, Any]:
        """Which rule pruned: the fast-fail verdict if there is one (the same pure function the pruner applied to the
        same values), else the wrapped or configured pruner's name."""
        pruner = self.trial.study.pruner
        reason: dict[str, Any] = {"rule": pruner_name(pruner), "step": step, "value": value}
        if isinstance(pruner, FastFailPruner):
            # The reports in step order, as `prune` reads them from the trial (a loop may report out of order).
            verdict = pruner.verdict(sorted(self.series), self.config, self.maximize, self.trial.study,
                                     train_series=self.training.series, warm=ATTR_WARM_START in self.trial.user_attrs,
                                     loss_series=self.losses or (), handoff=handoff_point(self.trial.user_attrs))
            if verdict is not None:
                reason = {**verdict.as_dict(), "message": verdict.message()}
            else:
                reason["rule"] = pruner_name(pruner.then)
        if "train_loss" in metrics:  # the loop's guard brought this evaluation forward
            reason["train_loss"] = metrics["train_loss"]
        return reason




def trial_trackers(spec: StudySpec, storage_url: str | None, trial: optuna.Trial, params: Mapping[str, Any],
                   config: Mapping[str, Any], prior: Sequence[tuple[int, float]]) -> list[Guarded]:
    """The trial's trackers (none with tracking off), for any runner: the built-in trainer, a loop, a command. A
    retry's run starts with its lineage's evaluations (`prior`): one curve, as in Optuna."""
    owner = trial.study.user_attrs.get(OWNER_ATTR) if spec.tracking.mlflow.enabled else None
    trackers = open_trackers(spec, storage_url, trial.study.study_name, trial.number, params, config, owner)
    for step, value in prior:
        for tracker in trackers:
            tracker.report(step, {spec.metric: value})
    return trackers

def finish_trackers(trackers: Sequence[Guarded], result: TrialResult, checkpointer: TrialCheckpointer | None) -> None:
    """The trial's trackers (TensorBoard, MLflow) told how it ended, and where its best checkpoint lies."""
    if not trackers:
        return
    best = None
    if checkpointer is not None:
        with contextlib.suppress(Exception):  # the registry not answering: tracking never fails a trial
            record = checkpointer.best_record()
            best = None if record is None else {"uri": record.uri, "step": record.step, "value": record.value,
                                                "sha256": record.sha256}
    attrs = {**result.attrs, "checkpoint": best}
    for tracker in trackers:
        tracker.finish(result.outcome.value, result.value, attrs)

def _fast_fail_of(config: Mapping[str, Any]) -> FastFailConfig:
    """The fast-fail settings a trial's config dict holds (off when it holds none)."""
    settings = config.get("fast_fail")
    if not isinstance(settings, Mapping):
        return FastFailConfig(enabled=False)
    known = {f.name for f in dataclasses.fields(FastFailConfig)}
    return FastFailConfig(**{k: v for k, v in settings.items() if k in known})


class Deadline:
    """`--timeout` within one log or evaluation interval: once it has passed, the trial stops at its next log or
    evaluation step, after a checkpoint there (with checkpoints on; without, at its next evaluation), and is queued
    like an interrupted trial, its retry resuming from that checkpoint."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.checkpointer: TrialCheckpointer | None = None

    def passed(self) -> bool:
        return time.monotonic() >= self.at


class _Timed:
    """The trainer's `Checkpointer`: the trial's own, plus one checkpoint once the deadline has passed, after which
    the trial stops."""

    def __init__(self, inner: TrialCheckpointer, deadline: Deadline, max_steps: int) -> None:
        self.inner, self.deadline, self.max_steps = inner, deadline, max_steps

    def path_for(self, step: int, metrics: Mapping[str, float] | None) -> Any:
        if self.deadline.passed():
            self.inner.keep_steps.add(step)  # saved whatever the policy says
        return self.inner.path_for(step, metrics)

    def saved(self, info: CheckpointInfo, metrics: Mapping[str, float] | None) -> None:
        self.inner.saved(info, metrics)
        if self.deadline.passed() and info.step in self.inner.keep_steps and info.step < self.max_steps:
            raise TimedOut()


@functools.lru_cache(maxsize=4)
def _cached_task(name: str, args_json: str) -> Task:
    return load_task(name, json.loads(args_json))


def task_for(name: str, args: Mapping[str, Any]) -> Task:
    """Load a task once per worker process: its data is reused by every trial with the same task arguments."""
    return _cached_task(name, json.dumps(dict(args), sort_keys=True))


@dataclass
class Start:
    """Where a trial's training begins: from its lineage's checkpoint, from a donor's, or from scratch."""

    resume: TrainState | None = None
    warm: WarmStart | None = None
    prior: tuple[tuple[int, float], ...] = ()  # the lineage's reported values up to the resume step
    # The lineage's curves the fast-fail rules read besides the metric (`ATTR_LOSS_CURVE`, `ATTR_TRAIN_CURVE`), up to
    # the resume step: a retry's rules judge one continuous curve, as its pruner does its metric's
    curves: Mapping[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.resume.step if self.resume is not None else self.warm.state.step if self.warm is not None else 0


@dataclass
class Prepared:
    """A trial ready to train: what `TrainerTrial.prepare` returns."""

    params: dict[str, Any]
    config: TrainingConfig
    task: Task
    start: Start
    reporter: TrialReporter
    checkpointer: Any


class TrialRun:
    """What every runner of one trial holds (the built-in trainer's, a loop's, a command's): the trial, its study's
    spec, where its events, storage calls and checkpoints go, its deadline and trackers; `release` hands its
    checkpoints back to retention and closes its trackers once it has ended."""

    def __init__(self, trial: optuna.Trial, spec: StudySpec, events: Events, boundary: Boundary,
                 checkpoints: CheckpointService | None, *, deadline: float | None = None,
                 storage_url: str | None = None) -> None:
        self.trial, self.spec, self.events, self.boundary, self.checkpoints = trial, spec, events, boundary, checkpoints
        self.checkpointer: TrialCheckpointer | None = None
        self.deadline = None if deadline is None else Deadline(deadline)
        self.storage_url = storage_url
        self.trackers: list[Guarded] = []  # TensorBoard, MLflow: none with tracking off

    def release(self, result: TrialResult) -> None:
        """The trial has ended with `result`: its checkpoints go back to retention, and its trackers close."""
        if self.checkpoints is not None:
            self.checkpoints.release(self.trial, result.outcome, self.checkpointer)
        if not self.trackers and not result.outcome.retried:
            # It ended before its trackers opened (its config refused by the task or the model, a sampler's error):
            # its run says so, as every other trial's does (review: such trials were missing from MLflow and
            # TensorBoard alone).
            with contextlib.suppress(Exception):  # tracking never fails a trial
                config = self.trial.user_attrs.get(ATTR_CONFIG)
                self.trackers = trial_trackers(self.spec, self.storage_url, self.trial, self.trial.params,
                                               config if isinstance(config, Mapping) else {}, [])
        finish_trackers(self.trackers, result, self.checkpointer)


class TrainerTrial(TrialRun):
    """One trial of the built-in trainer, from its params to its result; `release` hands its checkpoints back."""

    def run(self) -> TrialResult:
        return self.train_prepared(self.prepare())

    def train_prepared(self, prepared: Prepared) -> TrialResult:
        """Train a prepared trial by the ordinary loop (a cohort trains its members itself) and return its result;
        with `resources.devices_per_trial: N` > 1, data-parallel on N ranks (`_train_ranks`)."""
        if self.spec.resources.devices_per_trial > 1:
            return self._train_ranks(prepared, self.spec.resources.devices_per_trial)
        with self.boundary.no_wait():  # the storage going away pauses nothing: the reports wait (see TrialReporter)
            result = train(prepared.config, prepared.task, prepared.reporter, resume=prepared.start.resume,
                           warm_start=prepared.start.warm, checkpointer=prepared.checkpointer)
        return self.result_of(prepared, result)

    def _train_ranks(self, prepared: Prepared, world: int) -> TrialResult:
        """Data-parallel on `world` ranks: this process is rank 0, with the reporter and the checkpointer (so reports,
        heartbeats, signals, checkpoints and retries are as with one), and starts the others as children that get
        the config and the start only, never the storage (nor a password in their environment). A child that a
        signal killed or that hung (a machine's fault, an operator's SIGKILL) ends the trial as an infrastructure
        fault, retried from its checkpoint; one that failed on its own, as failed."""
        start, resources = prepared.start, self.spec.resources
        try:
            with local_ranks(prepared.config, world, resume=start.resume,
                             warm=None if start.warm is None else start.warm.state,
                             warm_optimizer=start.warm is not None and start.warm.optimizer,
                             timeout_s=float(resources.collective_timeout_s),
                             withheld=(*SECRET_ENV_NAMES, STORAGE_FILE_ENV,
                                       *filter(None, [self.spec.storage_password_env])),
                             end_on=(signal.SIGINT, signal.SIGTERM, *FORWARD.values())) as ranks:
                with self.boundary.no_wait():  # as with one rank: the reports wait while the storage is away
                    with contextlib.suppress(StorageAway):  # the children wait in DDP's setup meanwhile: no waiting
                        self.trial.set_user_attr(ATTR_RANKS, {"world": world, "pids": ranks.pids})
                    result = train(prepared.config, prepared.task, prepared.reporter, resume=start.resume,
                                   warm_start=start.warm, checkpointer=prepared.checkpointer, ranks=ranks.group)
        except RankFailed as exc:
            prepared.reporter.flush()
            # Ctrl-C or SIGTERM ended the children (rank 0 may have been waiting in a collective, where no handler
            # runs): the trial was interrupted or preempted, as with one device, not lost to a fault.
            raise_pending()
            stop = stop_requested()
            if stop is not None:
                raise stop() from None
            outcome = Outcome.INFRASTRUCTURE if exc.lost else Outcome.FAILED
            prefix = "infrastructure: " if exc.lost else ""
            how = ("hung" if exc.returncode is None else "lost the group" if exc.signal is None
                   else f"killed by {signal_name(exc.signal)}")
            return TrialResult(outcome, None, {ATTR_FAIL: f"{prefix}{exc}", ATTR_RANKS: {
                "world": world, "pids": self.trial.user_attrs.get(ATTR_RANKS, {}).get("pids", []),
                "failed_rank": exc.rank, "output_tail": exc.tail[-2000:]}},
                fault=Fault(str(exc), f"a rank {how}", RANK_FIX) if exc.lost else None)
        trial_result = self.result_of(prepared, result)
        trial_result.attrs[ATTR_RANKS] = {"world": world, "pids": ranks.pids, "ranks": [
            {"rank": 0, "status": result.status, "steps": result.steps},
            *({"rank": r.rank, "status": r.status, "steps": r.steps, "exit_code": r.exit_code}
              for r in ranks.results)]}
        return trial_result

    def prepare(self) -> Prepared:
        """Everything `trainer.train` (or a batched cohort) takes for this trial: its config from the sampled params,
        where it starts (its lineage's checkpoint, a donor's, or scratch), its reporter and its checkpointer."""
        trial, spec = self.trial, self.spec
        params = spec.suggest(trial)
        self.events.trial_started(trial.number, params)
        config = spec.config_for(params)
        store_config(trial, config.to_dict())
        task = task_for(config.task, config.task_args)
        confirming = trial.user_attrs.get(ATTR_CONFIRMS)
        start = self._start(params, config, task, warm_allowed=confirming is None)
        if confirming is not None:
            trial.set_user_attr(ATTR_LINEAGE, f"cold confirmation of warm trial #{confirming}: its own config from "
                                "step 0, never pruned")
        self.trackers = trial_trackers(spec, self.storage_url, trial, params, config.to_dict(), start.prior)
        reporter = TrialReporter(trial, spec, config.to_dict(), self.events, self.boundary, start.prior,
                                 judged=confirming is None, curves=start.curves,
                                 inherited_until=None if start.warm is None else start.warm.state.step,
                                 trackers=self.trackers)
        return self._timed(Prepared(params, config, task, start, reporter, self.checkpointer))

    def until(self, prepared: Prepared, deadline: float | None) -> Prepared:
        """`prepared`, stopped by `--timeout` at `deadline` (`time.monotonic()`) as a runner made with that deadline
        stops it: for a trial a cohort's loop trains alone, which ran past the timeout to its end (review)."""
        if deadline is None or self.deadline is not None:
            return prepared
        self.deadline = Deadline(deadline)
        return self._timed(prepared)

    def _timed(self, prepared: Prepared) -> Prepared:
        """`prepared` with this runner's deadline: its reporter answers it, and with checkpoints on, it stops at its
        next log or evaluation step after a checkpoint there (`_Timed`)."""
        prepared.reporter.deadline = self.deadline
        if self.deadline is not None and self.checkpointer is not None:
            self.deadline.checkpointer = self.checkpointer
            prepared.checkpointer = _Timed(self.checkpointer, self.deadline, prepared.config.max_steps)
        return prepared

    def result_of(self, prepared: Prepared, result: TrainResult) -> TrialResult:
        """The trial's outcome from what training returned: complete, pruned (with the rule that pruned) or failed
        (diverged)."""
        reporter, metric = prepared.reporter, self.spec.metric
        reporter.flush()  # values held while the storage was away: the trial's curve is whole before its result
        attrs: dict[str, Any] = {ATTR_REPRO: result.reproducibility, ATTR_METRICS: result.metrics,
                                 ATTR_STEPS: result.steps, ATTR_STEPS_TRAINED: result.steps - prepared.start.step,
                                 ATTR_WALL: round(result.wall_time_s, 3), ATTR_REPORT_MS: reporter.report_ms,
                                 ATTR_SPEED: reporter.speed}
        if result.status == "stopped" and reporter.prune_reason is not None:
            return TrialResult(Outcome.PRUNED, None, {**attrs, ATTR_PRUNE: reporter.prune_reason})
        value = metric_value(result.metrics, metric) if metric in result.metrics else math.nan
        if not math.isfinite(value):
            return TrialResult(Outcome.FAILED, None,
                               {**attrs, ATTR_FAIL: f"diverged: {metric} is {value} at step {result.steps}"})
        return TrialResult(Outcome.COMPLETE, value, attrs)

    def _start(self, params: Mapping[str, Any], config: TrainingConfig, task: Task, *,
               warm_allowed: bool = True) -> Start:
        """A retry resumes from its lineage's newest intact checkpoint; otherwise, with warm start on (and not a cold
        confirmation), the trial starts from its nearest donor's checkpoint; otherwise from scratch."""
        if self.checkpoints is None:
            return Start()
        spec, trial = self.spec, self.trial
        key = shape_key(config, task)
        handoff = (spec.warm_start.handoff_step(config.max_steps, config.eval_every_steps)
                   if spec.warm_start.enabled else 0)
        if spec.checkpoints.enabled:
            self.checkpointer = self.checkpoints.checkpointer(trial.number, params, key, handoff)

        def evaluated(step: int) -> bool:
            return step % config.eval_every_steps == 0 or step == config.max_steps

        start = resume_lineage(trial, self.checkpoints, spec.metric, evaluated, keep_steps=[handoff] if handoff else [])
        if start is None and handoff and warm_allowed:
            start = warm_start(trial, spec, self.checkpoints, params, config, key, handoff)
        return start or Start()


def resume_lineage(trial: optuna.Trial, checkpoints: CheckpointService, metric: str,
                   evaluated: Callable[[int], bool], *, keep_steps: Sequence[int] = ()) -> Start | None:
    """A retry's start: the newest intact checkpoint of its lineage, after the lineage's reported values up to there
    are copied onto this trial (one continuous curve, from the lineage's first report). None: not a retry, or no
    checkpoint to resume from. `evaluated(step)`: whether the runner reports at that step (a checkpointed value
    whose report was lost is reported again then)."""
    if trial.user_attrs.get("retry_of") is None:
        return None
    trials = {t.number: t for t in trial.study.get_trials(deepcopy=False)}
    # Only checkpoints trained with this trial's params: a lineage whose params were lost (a queued retry killed before
    # it wrote them) must not hand its state to other ones.
    ancestors = lineage(trials, trial.number)[1:]
    for number in ancestors:  # said only where there is something not to resume from (one lost as it was asked: none)
        if trials[number].params and trials[number].params != trial.params and checkpoints.holds_any(number):
            warnings.warn(f"trial {trial.number} does not resume from trial {number}'s checkpoints: they were trained "
                          f"with other params ({trials[number].params}, this trial {trial.params})", stacklevel=2)
    from sweep.checkpoints import belongs_to

    budget = (trial.user_attrs.get(ATTR_CONFIG) or {}).get("max_steps")
    found = checkpoints.resume_point([n for n in ancestors if trials[n].params == trial.params], keep_steps,
                                     accept=lambda state: belongs_to(state, trial.params, budget))
    if found is None:
        return None
    source = trials[found.trial]
    prior = {step: value for step, value in source.intermediate_values.items() if step <= found.step}
    stored = found.state.metrics.get(metric)
    if found.step not in prior and stored is not None and evaluated(found.step):
        prior[found.step] = stored  # evaluated and checkpointed, but lost before its report was stored
    # Evaluations whose reports never reached the study (held through a storage outage, then lost with the worker):
    # the checkpoint's history has them. A warm lineage's own reports begin after its donor's handoff.
    handoff = (source.user_attrs.get(ATTR_WARM_START) or {}).get("step", -1)
    for step, metrics in found.state.evals:
        if step not in prior and step <= found.step and step > handoff and metric in metrics and evaluated(step):
            prior[step] = metric_value(metrics, metric)
    for step, value in sorted(prior.items()):  # one continuous curve, from the lineage's first report
        trial.report(value, step)
    curves = {name: _stored_curve(source, name, handoff, found.step) for name in (ATTR_LOSS_CURVE, ATTR_TRAIN_CURVE)}
    for step, metrics in found.state.evals:  # as the values: what a lost worker never stored, its checkpoint has
        if handoff < step <= found.step and isinstance(loss := metrics.get("val_loss"), (int, float)):
            curves[ATTR_LOSS_CURVE].setdefault(step, float(loss))
    trial.set_user_attr(ATTR_RESUMED_FROM, {"trial": found.trial, "step": found.step})
    parent = source.user_attrs.get(ATTR_WARM_START)
    if parent is not None:  # the lineage's donor is this run's too (reproduce replays from it)
        trial.set_user_attr(ATTR_WARM_START, parent)
        trial.set_user_attr(ATTR_LINEAGE, warm_lineage(parent, (trial.user_attrs.get(ATTR_CONFIG) or {}).get(
            "max_steps", "?")))
    return Start(resume=found.state, prior=tuple(sorted(prior.items())),
                 curves={name: tuple(sorted(curve.items())) for name, curve in curves.items() if curve})


def _stored_curve(trial: optuna.trial.FrozenTrial, name: str, after: int, until: int) -> dict[int, float]:
    """A curve user attr of `trial` (pairs of step and value), its steps in (after, until]; pairs that are not two
    numbers (a database edited by hand) are passed over."""
    stored = trial.user_attrs.get(name)
    curve: dict[int, float] = {}
    for pair in stored if isinstance(stored, list) else ():
        if isinstance(pair, list) and len(pair) == 2 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in pair) and after < pair[0] <= until:
            curve[int(pair[0])] = float(pair[1])
    return curve


def _stored_configs(study: optuna.Study) -> Callable[[str, int], Mapping[str, Any] | None]:
    """A finished trial's stored config by study name and trial number, from the study's storage (another study's
    donor: the keys its study fixed), each trial read once."""
    storage = study._storage  # noqa: SLF001 - Optuna has no public read of one trial of another study by number
    read: dict[tuple[str, int], Mapping[str, Any] | None] = {}

    def config_of(name: str, number: int) -> Mapping[str, Any] | None:
        if (name, number) not in read:
            try:
                trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(name),
                                                                            number)
                stored = storage.get_trial(trial_id).user_attrs.get(ATTR_CONFIG)
            except KeyError:  # the study or the trial was deleted since its checkpoint was registered
                stored = None
            read[name, number] = stored if isinstance(stored, Mapping) else None
        return read[name, number]

    return config_of


def warm_start(trial: optuna.Trial, spec: StudySpec, checkpoints: CheckpointService, params: Mapping[str, Any],
               config: TrainingConfig | Mapping[str, Any], key: str, handoff: int) -> Start | None:
    """A fresh trial's start from its nearest donor's checkpoint (recorded on the trial), or None."""
    found = checkpoints.warm_start(trial.number, params, config, key, handoff, _stored_configs(trial.study))
    if found is None:
        return None
    warm, donor = found
    parent = {**donor.lineage(), "inherit": spec.warm_start.inherit}
    trial.set_user_attr(ATTR_WARM_START, parent)
    last = config.max_steps if isinstance(config, TrainingConfig) else config.get("max_steps", "?")
    trial.set_user_attr(ATTR_LINEAGE, warm_lineage(parent, last))
    return Start(warm=warm)
