"""`sweep reproduce STUDY TRIAL`: train one trial again from what the storage holds and compare its reports.

The stored `config` user attr is the trial's whole `TrainingConfig` (fixed values, sampled params, seed, task); a
warm-started trial also names its parent checkpoint (`warm_start_from`), which is loaded again. The rerun reports to
a local recorder, not to the study, and stops where the trial stopped (a pruned trial is replayed up to its last
report). It runs with the torch thread counts the trial recorded (`reproducibility.threads`): a worker of
`--workers N` trained with a share of the cores, and a sum over another number of threads rounds differently. On CPU
the values must match bit for bit; on a GPU within a relative tolerance, since cuBLAS and cuDNN kernels are not
deterministic unless `deterministic: true`.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import optuna
import torch

from sweep.blobs import load_blob
from sweep.objective import task_for
from sweep.outcomes import ATTR_CONFIG, ATTR_REPRO, ATTR_WARM_START, SPEC_ATTR
from trainer import TrainingConfig, train
from trainer.checkpoint import CheckpointError, WarmStart
from trainer.precision import resolve_device
from trainer.seeding import THREAD_ENV, apply_threads

__all__ = ["Comparison", "reproduce_trial"]


@dataclass
class Comparison:
    trial: int
    steps_compared: int
    tolerance: float  # 0.0: bit for bit
    first_difference: tuple[int, float, float] | None  # (step, stored, reproduced)

    @property
    def identical(self) -> bool:
        return self.first_difference is None and self.steps_compared > 0


class _Recorder:
    def __init__(self, stop_at: int, metric: str) -> None:
        self.stop_at, self.metric = stop_at, metric
        self.values: dict[int, float] = {}

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        self.values[step] = metrics[self.metric]
        return step >= self.stop_at


def _same(a: float, b: float, tolerance: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if tolerance == 0.0:
        return a == b
    return math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance)


def _parent(trial: optuna.trial.FrozenTrial) -> WarmStart | None:
    """A warm-started trial is replayed from the same parent checkpoint (pinned, so never collected), checked
    against the hash recorded when the trial started from it."""
    lineage = trial.user_attrs.get(ATTR_WARM_START)
    if lineage is None:
        return None
    try:
        state = load_blob(lineage["uri"], lineage["sha256"])
    except CheckpointError as exc:
        raise ValueError(f"trial {trial.number} was warm-started from trial {lineage['trial']}'s checkpoint, which "
                         f"cannot be used: {exc}") from None
    return WarmStart(state, optimizer=lineage.get("inherit") == "weights+optimizer")


@contextlib.contextmanager
def _threads_of(record: Mapping[str, Any]) -> Iterator[None]:
    """The trial's own torch thread counts for the rerun, and this process's back afterwards."""
    before = {"threads": {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads(),
                          **{name: os.environ.get(name) for name in THREAD_ENV}}}
    try:
        apply_threads(record)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    try:
        yield
    finally:
        apply_threads(before)


def reproduce_trial(study: optuna.Study, number: int, *, gpu_tolerance: float = 1e-3) -> Comparison:
    trials = [t for t in study.get_trials(deepcopy=False) if t.number == number]
    if not trials:
        raise KeyError(f"study {study.study_name!r} has no trial {number}")
    trial = trials[0]
    if ATTR_CONFIG not in trial.user_attrs or not trial.intermediate_values:
        raise ValueError(f"trial {number} has no stored config or reported values to compare (state "
                         f"{trial.state.name.lower()})")
    config = TrainingConfig.from_dict(trial.user_attrs[ATTR_CONFIG])
    metric = study.user_attrs.get(SPEC_ATTR, {}).get("metric", "val_loss")
    stored = dict(sorted(trial.intermediate_values.items()))
    recorder = _Recorder(max(stored), metric)
    with _threads_of(trial.user_attrs.get(ATTR_REPRO) or {}):
        train(config, task_for(config.task, config.task_args), recorder, warm_start=_parent(trial))
    tolerance = 0.0 if resolve_device(config.device).type == "cpu" or config.deterministic else gpu_tolerance
    difference = None
    for step, value in stored.items():
        again = recorder.values.get(step, math.nan)
        if not _same(value, again, tolerance):
            difference = (step, value, again)
            break
    return Comparison(number, len(stored), tolerance, difference)
