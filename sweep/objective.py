"""One trial: sampled params plus fixed values become a `TrainingConfig`, the trainer trains it, and the outcome
becomes an Optuna state with its reason stored on the trial."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from trainer import Task, load_task, train
from sweep.study import (ATTR_CONFIG, ATTR_FAIL, ATTR_METRICS, ATTR_PRUNE, ATTR_REPRO, ATTR_STEPS, ATTR_WALL)

if TYPE_CHECKING:
    from sweep.spec import StudySpec
    from sweep.study import Events

__all__ = ["TrialReporter", "run_trial"]

Outcome = tuple[TrialState, "float | None", dict[str, Any]]


class TrialReporter:
    """Adapts an Optuna trial to the trainer's `Reporter`: each evaluation's metric is reported to the study, and the
    study's pruner decides whether to stop, so every decision lives in the storage."""

    def __init__(self, trial: optuna.Trial, metric: str, events: Events) -> None:
        self.trial = trial
        self.metric = metric
        self.events = events
        self.pruned_at: tuple[int, float] | None = None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.events.trial_log(self.trial.number, step, metrics)

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        value = metrics[self.metric]
        self.trial.report(value, step)
        if self.trial.should_prune():
            self.pruned_at = (step, value)
            return True
        return False


@functools.lru_cache(maxsize=4)
def _cached_task(name: str, args_json: str) -> Task:
    return load_task(name, json.loads(args_json))


def task_for(name: str, args: Mapping[str, Any]) -> Task:
    """Load a task once per worker process: its data is reused by every trial with the same task arguments."""
    return _cached_task(name, json.dumps(dict(args), sort_keys=True))


def run_trial(trial: optuna.Trial, spec: StudySpec, events: Events) -> Outcome:
    params = spec.suggest(trial)
    events.trial_started(trial.number, params)
    config = spec.config_for(params)
    trial.set_user_attr(ATTR_CONFIG, config.to_dict())
    reporter = TrialReporter(trial, spec.metric, events)
    result = train(config, task_for(config.task, config.task_args), reporter)
    attrs: dict[str, Any] = {ATTR_REPRO: result.reproducibility, ATTR_METRICS: result.metrics,
                             ATTR_STEPS: result.steps, ATTR_WALL: round(result.wall_time_s, 3)}
    if reporter.pruned_at is not None:
        step, value = reporter.pruned_at
        attrs[ATTR_PRUNE] = {"rule": spec.pruner.type, "step": step, "value": value}
        return TrialState.PRUNED, None, attrs
    value = result.metrics[spec.metric]
    if not math.isfinite(value):
        attrs[ATTR_FAIL] = f"diverged: {spec.metric} is {value} at step {result.steps}"
        return TrialState.FAIL, None, attrs
    return TrialState.COMPLETE, value, attrs
