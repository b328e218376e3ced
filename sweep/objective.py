"""One trial: sampled params plus fixed values become a `TrainingConfig`, the trainer trains it, and the outcome
becomes an Optuna state with its reason stored on the trial."""

from __future__ import annotations

import functools
import json
import math
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from sweep.checkpoints import TrialCheckpointer
from sweep.pruners import FastFailPruner
from trainer.checkpoint import CheckpointError, TrainState, load_checkpoint
from trainer import Task, TrainingConfig, load_task, train
from sweep.study import (ATTR_CONFIG, ATTR_FAIL, ATTR_METRICS, ATTR_PRUNE, ATTR_REPRO, ATTR_RESUMED_FROM,
                         ATTR_RETRY_OF, ATTR_STEPS, ATTR_WALL)

if TYPE_CHECKING:
    from pathlib import Path

    from sweep.registry import Registry
    from sweep.spec import StudySpec
    from sweep.study import Events

__all__ = ["TrialReporter", "run_trial"]

Outcome = tuple[TrialState, "float | None", dict[str, Any]]


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

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.events.trial_log(self.trial.number, step, metrics)

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
    record = registry.latest_for_trial(trial.study.study_name, int(origin))
    if record is None:
        return None
    try:
        state = load_checkpoint(record.uri, sha256=record.sha256)
    except CheckpointError as exc:
        warnings.warn(f"trial {trial.number}: not resuming from trial {origin}'s checkpoint: {exc}", stacklevel=2)
        return None
    trial.set_user_attr(ATTR_RESUMED_FROM, {"trial": int(origin), "step": state.step})
    return state


@functools.lru_cache(maxsize=4)
def _cached_task(name: str, args_json: str) -> Task:
    return load_task(name, json.loads(args_json))


def task_for(name: str, args: Mapping[str, Any]) -> Task:
    """Load a task once per worker process: its data is reused by every trial with the same task arguments."""
    return _cached_task(name, json.dumps(dict(args), sort_keys=True))


def run_trial(trial: optuna.Trial, spec: StudySpec, events: Events, registry: Registry | None = None,
              store: Path | None = None) -> Outcome:
    params = spec.suggest(trial)
    events.trial_started(trial.number, params)
    config = spec.config_for(params)
    trial.set_user_attr(ATTR_CONFIG, config.to_dict())
    reporter = TrialReporter(trial, spec, config, events)
    checkpointer, resume = None, None
    if registry is not None and store is not None:
        if spec.checkpoints.enabled:
            checkpointer = TrialCheckpointer(registry, store, trial.study.study_name, trial.number, params,
                                             spec.checkpoints, spec.metric, spec.direction == "maximize")
        resume = _resume_state(trial, registry)
    result = train(config, task_for(config.task, config.task_args), reporter, resume=resume,
                   checkpointer=checkpointer)
    attrs: dict[str, Any] = {ATTR_REPRO: result.reproducibility, ATTR_METRICS: result.metrics,
                             ATTR_STEPS: result.steps, ATTR_WALL: round(result.wall_time_s, 3),
                             "report_ms": reporter.report_ms}
    if result.status == "stopped" and reporter.prune_reason is not None:
        attrs[ATTR_PRUNE] = reporter.prune_reason
        return TrialState.PRUNED, None, attrs
    value = result.metrics[spec.metric]
    if not math.isfinite(value):
        attrs[ATTR_FAIL] = f"diverged: {spec.metric} is {value} at step {result.steps}"
        return TrialState.FAIL, None, attrs
    return TrialState.COMPLETE, value, attrs
