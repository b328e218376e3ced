"""Curricula: which training samples a run may see at each step, as plain, searchable config.

A curriculum has two halves (the "scoring" and "pacing" functions of Hacohen & Weinshall, 2019):

1. *Difficulty*: the task scores each training sample once (`Task.difficulty`, higher is harder). Scores are compared
   by rank only: a sample's difficulty is the fraction of the training set that is strictly easier than it, in
   [0, 1). Any scale of score therefore means the same, and a level reads as a share of the data.
2. *Schedule*: a pure function of the step, `(step, max_steps) -> level in [0, 1]`, like the learning rate. At each
   step the sampler draws batches only from samples whose difficulty is at most `level + tolerance`; at level 1 (and
   with the schedule `none`) from the whole set.

Because the level depends on the step alone, the host knows the pool size without reading the device, a resumed run
is at the same level as the uninterrupted one, and the fast-fail rules can compute where the stages change from the
config alone (`stage_starts`).

This module holds the difficulty half and the sampler; the schedule half (`CurriculumConfig`, `level_at`,
`stage_starts`) is pure and torch-free, in `trainer.pacing`, and re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trainer.batches import DeviceBatches
from trainer.config import ConfigError
from trainer.pacing import (
    BUILTIN_SCHEDULES,
    STAGE_JUMP,
    CurriculumConfig,
    Schedule,
    curriculum_from_dict,
    level_at,
    resolve_schedule,
    stage_starts,
)

if TYPE_CHECKING:
    from trainer.config import TrainingConfig
    from trainer.tasks.base import Task

__all__ = [
    "BUILTIN_SCHEDULES",
    "STAGE_JUMP",
    "CurriculumConfig",
    "CurriculumSampler",
    "Schedule",
    "build_sampler",
    "curriculum_from_dict",
    "difficulty_ranks",
    "level_at",
    "resolve_schedule",
    "stage_starts",
]


# ---------------------------------------------------------------------------------------------------------------------
# Difficulty and the sampler.

def difficulty_ranks(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(order, ranks)`: the sample indices sorted easiest first (a stable sort, so ties keep their index order) and,
    for each position of that order, the fraction of samples strictly easier. Ties share a rank."""
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 1 or len(scores) == 0:
        raise ValueError(f"difficulty scores must be one non-empty vector, but got shape {scores.shape}")
    if not np.isfinite(scores).all():
        raise ValueError(f"difficulty scores must be finite, but {int((~np.isfinite(scores)).sum())} are not")
    order = np.argsort(scores, kind="stable")
    ordered = scores[order]
    ranks = np.searchsorted(ordered, ordered, side="left") / len(scores)
    return order, ranks


class CurriculumSampler:
    """Training batches for a curriculum: at step `s`, batches from the samples whose difficulty rank is at most
    `level_at(s) + tolerance`.

    Cheap by construction: the samples are sorted by difficulty once, here; a step's pool is a prefix of that order,
    whose length the host computes from the step alone (a binary search in the sorted ranks: no pass over the data
    and no read from the device); the batch is drawn on the device by `DeviceBatches`. The pool moves a whole batch
    at a time (rounded down, never below one batch) so that a slowly rising level reshuffles at most once per batch
    of new samples, not at every step. At level 1 the pool is the whole set.

    State (`state_dict`) is the batch position plus the last step served: the level is a function of the step, so a
    resumed sampler continues at the same level with the same batches.
    """

    def __init__(self, config: CurriculumConfig, max_steps: int, n: int, batch_size: int, seed: int,
                 device: torch.device, scores: np.ndarray | None = None) -> None:
        if config.schedule != "none" and scores is None:
            raise ValueError(f"curriculum.schedule {config.schedule!r} needs per-sample difficulty scores")
        if scores is not None and len(scores) != n:
            raise ValueError(f"expected one difficulty score per training sample ({n}), but got {len(scores)}")
        self.config = config
        self.max_steps = max_steps
        self.n = n
        self.batch_size = batch_size
        if config.schedule == "none" or scores is None:
            order, self.ranks = None, np.zeros(n)
        else:
            order_np, self.ranks = difficulty_ranks(scores)
            order = torch.from_numpy(order_np).to(device)  # copied to the device once
        self.batches: DeviceBatches = DeviceBatches(n, batch_size, seed, device, order=order)
        self.step = -1  # the last step served

    def level_at(self, step: int) -> float:
        return level_at(step, self.config, self.max_steps)

    def pool_at(self, step: int) -> int:
        """How many of the easiest samples step `step` draws from."""
        threshold = self.level_at(step) + self.config.tolerance
        if threshold >= 1.0:
            return self.n
        admitted = int(np.searchsorted(self.ranks, threshold, side="right"))
        return min(self.n, max(self.batch_size, admitted // self.batch_size * self.batch_size))

    def next(self, step: int) -> torch.Tensor:
        """The indices of one (micro-)batch for optimizer step `step`; call it once per micro-batch."""
        self.step = step
        return self.batches.next(self.pool_at(step))

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "level": self.level_at(max(self.step, 0)), "n": self.n,
                "batches": self.batches.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["n"]) != self.n:
            raise ValueError(f"the state is for a training set of {state['n']} samples, this one has {self.n}")
        self.batches.load_state_dict(state["batches"])
        self.step = int(state["step"])


def build_sampler(config: TrainingConfig, task: Task, device: torch.device) -> CurriculumSampler:
    """The run's batch sampler. Difficulty scores are asked of the task only when a curriculum is on, since a task
    may compute them on demand."""
    curriculum = config.curriculum
    scores = None
    if curriculum.schedule != "none":
        scores = task.difficulty_scores()
        if scores is None:
            raise ConfigError([("curriculum.schedule", f"task {task.name!r} provides no per-sample difficulty; use "
                                                       "schedule 'none' or give the task a `difficulty`")])
    return CurriculumSampler(curriculum, config.max_steps, len(task.train[0]), config.batch_size, config.seed, device,
                             scores)
