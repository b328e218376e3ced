"""One trial: sampled params plus fixed values become a `TrainingConfig`, the trainer trains it, and the outcome
becomes an Optuna state with its reason stored on the trial."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from sweep.blobs import load_blob, local_copy
from sweep.checkpoints import TrialCheckpointer, collect_study, retention_keeps
from sweep.pruners import FastFailPruner
from sweep.warmstart import categorical_key, coordinates, shape_key, warm_start_from
from trainer.checkpoint import CheckpointError, TrainState
from trainer import Task, TrainingConfig, load_task, train
from sweep.study import (ATTR_CONFIG, ATTR_FAIL, ATTR_METRICS, ATTR_PRUNE, ATTR_REPRO, ATTR_RESUMED_FROM,
                         ATTR_RETRY_OF, ATTR_STEPS, ATTR_STEPS_TRAINED, ATTR_WALL, ATTR_WARM_START,
                         ATTR_CHECKPOINT, ATTR_SPEED)

if TYPE_CHECKING:
    from sweep.blobs import CheckpointStore
    from sweep.registry import Registry
    from sweep.spec import StudySpec
    from sweep.study import Events

__all__ = ["TrialReporter", "release_checkpoints", "run_trial"]

Outcome = tuple[TrialState, "float | None", dict[str, Any]]
SPEED_KEYS = ("samples_per_s", "tokens_per_s", "peak_mem_mb", "gpu_util_pct")


class TrialReporter:
    """Adapts an Optuna trial to the trainer's `Reporter`: each evaluation's metric is reported to the study, and the
    study's pruner decides whether to stop, so every decision lives in the storage. At the last step nothing is left
    to save, so the pruner is not asked: a trial that used its whole budget completes."""

    def __init__(self, trial: optuna.Trial, spec: StudySpec, config: TrainingConfig, events: Events) -> None:
        self.trial = trial
        self.metric = spec.metric
        self.maximize = spec.direction == "maximize"
        self.config = config
        self.events = events
        self.series: list[tuple[int, float]] = []
        self.prune_reason: dict[str, Any] | None = None
        self.report_ms: list[float] = []  # storage round trips of report + should_prune, kept on the trial
        self.speed: dict[str, float] = {}  # the latest throughput and memory, kept on the trial

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.events.trial_log(self.trial.number, step, metrics)
        self.speed = {k: round(float(metrics[k]), 1) for k in SPEED_KEYS if k in metrics}

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        value = metrics[self.metric]
        started = time.perf_counter()
        self.trial.report(value, step)
        self.series.append((step, value))
        prune = step < self.config.max_steps and self.trial.should_prune()
        self.report_ms.append(round(1000 * (time.perf_counter() - started), 2))
        if prune:
            self.prune_reason = self._explain(step, value, metrics)
        return prune

    def _explain(self, step: int, value: float, metrics: Mapping[str, float]) -> dict[str, Any]:
        """Which rule pruned: the fast-fail verdict if there is one (the same pure function the pruner applied to the
        same values), else the wrapped or configured pruner's name."""
        pruner = self.trial.study.pruner
        reason: dict[str, Any] = {"rule": pruner_name(pruner), "step": step, "value": value}
        if isinstance(pruner, FastFailPruner):
            verdict = pruner.verdict(self.series, self.config.to_dict(), self.maximize)
            if verdict is not None:
                reason = {**verdict.as_dict(), "message": verdict.message()}
            else:
                reason["rule"] = pruner_name(pruner.then)
        if "train_loss" in metrics:  # the loop's guard brought this evaluation forward
            reason["train_loss"] = metrics["train_loss"]
        return reason


def pruner_name(pruner: optuna.pruners.BasePruner | None) -> str:
    from sweep.study import PRUNERS

    names = {cls: name for name, cls in PRUNERS.items()}
    return names.get(type(pruner), type(pruner).__name__)


def _resume_state(trial: optuna.Trial, registry: Registry) -> TrainState | None:
    """A retry of a trial whose worker died or was interrupted continues from that trial's last checkpoint, not from
    step 0. A checkpoint that is missing or fails its hash is refused with a warning, and the trial starts over."""
    origin = trial.user_attrs.get(ATTR_RETRY_OF)
    if origin is None:
        return None
    study = trial.study.study_name
    for _ in range(3):
        record = registry.latest_for_trial(study, int(origin))
        if record is None:
            return None
        if registry.pin(record.id):  # never collected while (or after) this trial continues from it
            break
    else:  # collected each time between the lookup and the pin: start over
        return None
    registry.finish_trial(study, int(origin), donor=False)  # the lost trial's other checkpoints: collectable
    try:
        state = load_blob(record.uri, record.sha256)
    except CheckpointError as exc:
        warnings.warn(f"trial {trial.number}: not resuming from trial {origin}'s checkpoint: {exc}", stacklevel=2)
        return None
    trial.set_user_attr(ATTR_RESUMED_FROM, {"trial": int(origin), "step": state.step})
    original = [t for t in trial.study.get_trials(deepcopy=False) if t.number == int(origin)]
    lineage = original[0].user_attrs.get(ATTR_WARM_START) if original else None
    if lineage is not None:  # the original's parent is this run's parent too (reproduce replays from it)
        trial.set_user_attr(ATTR_WARM_START, lineage)
    return state


@functools.lru_cache(maxsize=4)
def _cached_task(name: str, args_json: str) -> Task:
    return load_task(name, json.loads(args_json))


def task_for(name: str, args: Mapping[str, Any]) -> Task:
    """Load a task once per worker process: its data is reused by every trial with the same task arguments."""
    return _cached_task(name, json.dumps(dict(args), sort_keys=True))


def run_trial(trial: optuna.Trial, spec: StudySpec, events: Events, registry: Registry | None = None,
              store: CheckpointStore | None = None, artifacts: Any = None) -> Outcome:
    params = spec.suggest(trial)
    events.trial_started(trial.number, params)
    config = spec.config_for(params)
    trial.set_user_attr(ATTR_CONFIG, config.to_dict())
    task = task_for(config.task, config.task_args)
    reporter = TrialReporter(trial, spec, config, events)
    study = trial.study.study_name
    checkpointer, resume, warm = None, None, None
    if registry is not None and store is not None:
        key = shape_key(config, task)
        handoff = (spec.warm_start.handoff_step(config.max_steps, config.eval_every_steps)
                   if spec.warm_start.enabled else 0)
        if spec.checkpoints.enabled:
            checkpointer = TrialCheckpointer(registry, store, study, trial.number, params, spec.checkpoints,
                                             spec.metric, spec.direction == "maximize", shape_key=key,
                                             coords=coordinates(spec.space, params),
                                             cat_key=categorical_key(spec.space, params),
                                             keep_steps=[handoff] if handoff else [])
        resume = _resume_state(trial, registry)
        if resume is None and handoff:
            found = warm_start_from(registry, spec, study, trial.number, params, config, key, handoff)
            if found is not None:
                warm, donor = found
                trial.set_user_attr(ATTR_WARM_START, {**donor.lineage(), "inherit": spec.warm_start.inherit})
    result = train(config, task, reporter, resume=resume, warm_start=warm, checkpointer=checkpointer)
    first_step = resume.step if resume is not None else warm.state.step if warm is not None else 0
    attrs: dict[str, Any] = {ATTR_REPRO: result.reproducibility, ATTR_METRICS: result.metrics,
                             ATTR_STEPS: result.steps, ATTR_STEPS_TRAINED: result.steps - first_step,
                             ATTR_WALL: round(result.wall_time_s, 3), "report_ms": reporter.report_ms,
                             ATTR_SPEED: reporter.speed}
    if result.status == "stopped" and reporter.prune_reason is not None:
        attrs[ATTR_PRUNE] = reporter.prune_reason
        outcome: Outcome = (TrialState.PRUNED, None, attrs)
    elif not math.isfinite(value := result.metrics[spec.metric]):
        attrs[ATTR_FAIL] = f"diverged: {spec.metric} is {value} at step {result.steps}"
        outcome = (TrialState.FAIL, None, attrs)
    else:
        outcome = (TrialState.COMPLETE, value, attrs)
    if registry is not None and checkpointer is not None:
        _finish_checkpoints(trial, spec, registry, checkpointer, artifacts, donor=outcome[0] != TrialState.FAIL)
    return outcome


def _finish_checkpoints(trial: optuna.Trial, spec: StudySpec, registry: Registry, checkpointer: TrialCheckpointer,
                        artifacts: Any, *, donor: bool) -> None:
    """The trial is over (completed, pruned or diverged). First its best checkpoint becomes a dashboard artifact, if
    the study's retention would keep it: its checkpoints are not final yet, so no other worker's retention can delete
    them meanwhile, and a worker that drops the trial later finds the artifact to remove. Then they count for
    retention (and become warm-start donors if the trial completed or was pruned), and retention applies."""
    with _cleanup(trial.number, "uploading its best checkpoint as an artifact"):
        best = checkpointer.best_record()
        keep = spec.checkpoints.keep_top_trials
        if artifacts is not None and best is not None and (keep is None or retention_keeps(
                registry, trial.study.study_name, trial.number, best.value, not donor, keep,
                spec.direction == "maximize")):
            with local_copy(best.uri) as path:
                artifact_id = optuna.artifacts.upload_artifact(artifact_store=artifacts, file_path=str(path),
                                                               study_or_trial=trial,
                                                               mimetype="application/octet-stream")
            trial.set_user_attr(ATTR_CHECKPOINT, {"artifact_id": artifact_id, "step": best.step,
                                                  "value": best.value, "sha256": best.sha256, "size": best.size})
    release_checkpoints(trial.study, trial.number, spec, registry, artifacts, donor=donor)


def release_checkpoints(study: optuna.Study, trial_number: int, spec: StudySpec, registry: Registry, artifacts: Any,
                        *, donor: bool) -> None:
    """The trial ended: its checkpoints count for the study's retention (and are warm-start donors if it completed
    or was pruned), and retention applies. Also for a trial that raised and will not be retried: its checkpoints,
    written before the error, are then collected like any ended trial's instead of kept forever."""
    with _cleanup(trial_number, "releasing its checkpoints"):
        registry.finish_trial(study.study_name, trial_number, donor=donor)
        apply_retention(study, spec, registry, artifacts)


@contextlib.contextmanager
def _cleanup(trial_number: int, what: str) -> Iterator[None]:
    """Checkpoint bookkeeping after training: an error here (the storage, the blob store) is a warning, never the
    trial's outcome. A trial that trained to the end is not recorded as failed, and a failing one never takes the
    study down; what was not released stays on disk, as before this step."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - see above
        warnings.warn(f"trial {trial_number}: {what} failed: {type(exc).__name__}: {exc}", stacklevel=3)


def apply_retention(study: optuna.Study, spec: StudySpec, registry: Registry, artifacts: Any) -> list[int]:
    """With `keep_top_trials`, only the study's best ended trials keep checkpoints, and a trial that loses them
    loses its dashboard artifact too (a copy of its best checkpoint), so the disk a study uses stays bounded.
    Optuna cannot edit a finished trial, so the dashboard still lists that artifact; `sweep dashboard` serves a
    note in its place (`sweep.blobs.RetainedArtifacts`). Returns the trials that lost checkpoints."""
    if spec.checkpoints.keep_top_trials is None:
        return []
    dropped = collect_study(registry, study.study_name, spec.checkpoints.keep_top_trials,
                            spec.direction == "maximize")
    if artifacts is not None and dropped:
        wanted = set(dropped)
        for frozen in study.get_trials(deepcopy=False):
            recorded = frozen.user_attrs.get(ATTR_CHECKPOINT) if frozen.number in wanted else None
            if recorded is not None:
                with contextlib.suppress(optuna.artifacts.exceptions.ArtifactNotFound):
                    artifacts.remove(recorded["artifact_id"])
    return dropped
