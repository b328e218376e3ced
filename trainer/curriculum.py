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
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trainer.imports import import_callable

if TYPE_CHECKING:
    from trainer.config import TrainingConfig
    from trainer.data import DeviceBatches
    from trainer.tasks.base import Task

__all__ = [
    "BUILTIN_SCHEDULES",
    "CurriculumConfig",
    "CurriculumSampler",
    "STAGE_JUMP",
    "build_sampler",
    "curriculum_from_dict",
    "difficulty_ranks",
    "level_at",
    "resolve_schedule",
    "stage_starts",
]

Schedule = Callable[[int, int], float]

BUILTIN_SCHEDULES = ("none", "constant", "linear", "exponential", "step")

# A rise (or fall) of the level by at least this much from one step to the next is a change of stage: the data the
# run sees changes at once, and the loss may jump. Smooth schedules over more than ~20 steps have no stage changes.
STAGE_JUMP = 0.05


@dataclass(frozen=True)
class CurriculumConfig:
    """A curriculum's settings, addressed as `curriculum.<key>` in a config or a study file.

    Levels run from `start_level` at step 0 up to 1 at the end step: `end_steps` if set, else
    `end_fraction * max_steps`. After the end step every schedule but `constant` trains on the whole set.
    """

    # none | constant | linear | exponential | step | package.module:function (called as f(step, max_steps) -> level).
    schedule: str = "none"
    start_level: float = 0.2  # linear, exponential (must be > 0), step: the level at step 0
    end_fraction: float = 0.8  # the level reaches 1 at this fraction of max_steps...
    end_steps: int | None = None  # ...or at this step, when set
    stages: int = 4  # step: the number of levels from start_level to 1, both included
    level: float = 1.0  # constant: the level throughout
    tolerance: float = 0.0  # a batch may draw samples up to level + tolerance

    def problems(self) -> list[tuple[str, str]]:
        """Invalid settings as `(key, message)`, keys relative to `curriculum.`."""
        out = []
        if self.schedule not in BUILTIN_SCHEDULES:
            if not re.fullmatch(r"[\w.]+:[A-Za-z_]\w*", self.schedule):
                out.append(("schedule", f"expected one of {', '.join(BUILTIN_SCHEDULES)} or "
                                        f"'package.module:function', got {self.schedule!r}"))
            else:
                try:
                    resolve_schedule(self.schedule)
                except ValueError as exc:
                    out.append(("schedule", str(exc)))
        for name in ("start_level", "level", "tolerance"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                out.append((name, f"expected a level in [0, 1], got {value!r}"))
        if not 0.0 < self.end_fraction <= 1.0:
            out.append(("end_fraction", f"expected a fraction in (0, 1], got {self.end_fraction!r}"))
        if self.end_steps is not None and self.end_steps < 1:
            out.append(("end_steps", f"expected a step >= 1 or null, got {self.end_steps!r}"))
        if self.stages < 2:
            out.append(("stages", f"expected at least 2 (the start level and 1), got {self.stages!r}"))
        if self.schedule == "exponential" and self.start_level == 0:
            out.append(("start_level", "the exponential schedule grows the level by a constant factor, so it needs "
                                       "start_level > 0, got 0"))
        return out

    def end_step(self, max_steps: int) -> int:
        """The step at which the level reaches 1."""
        return self.end_steps if self.end_steps is not None else max(1, round(self.end_fraction * max_steps))


# ---------------------------------------------------------------------------------------------------------------------
# Schedules: pure functions of the step.

@functools.lru_cache(maxsize=16)
def resolve_schedule(name: str) -> Schedule:
    """A user schedule `package.module:function`, imported; a ValueError that names what is missing otherwise.
    Cached: the loop asks for the level at every step."""
    return import_callable(name, "schedule", BUILTIN_SCHEDULES)


def level_at(step: int, config: CurriculumConfig, max_steps: int) -> float:
    """The difficulty level for optimizer step `step` (0-based), in [0, 1].

    1. `none` is always 1 (the whole set) and `constant` always `level`;
    2. the others rise from `start_level` at step 0 to 1 at the end step, then stay at 1:
       `linear` by equal steps, `exponential` by a constant factor (slow first, fast last), `step` in `stages`
       equal stretches of constant level (the last stage, level 1, starts at the end step);
    3. a user schedule is called as `f(step, max_steps)`, and what it returns is checked.
    """
    name = config.schedule
    if name == "none":
        return 1.0
    if name == "constant":
        return config.level
    if name not in BUILTIN_SCHEDULES:
        level = float(resolve_schedule(name)(step, max_steps))
        if not 0.0 <= level <= 1.0:  # also refuses NaN
            raise ValueError(f"schedule {name!r} returned {level!r} at step {step}; a level must be in [0, 1]")
        return level
    start = config.start_level
    progress = min(1.0, step / config.end_step(max_steps))
    if name == "linear":
        return start + (1.0 - start) * progress
    if name == "exponential":
        return start ** (1.0 - progress)  # start * (1 / start) ** progress
    stage = min(config.stages - 1, math.floor(progress * (config.stages - 1)))  # "step"
    return start + (1.0 - start) * stage / (config.stages - 1)


@functools.lru_cache(maxsize=64)
def stage_starts(config: CurriculumConfig, max_steps: int) -> tuple[int, ...]:
    """The steps at which a new stage begins: where the level moves by at least `STAGE_JUMP` from the step before.

    A function of the config alone, so the pruner computes it from the trial's stored config, with no state. Cached:
    the pruner asks at every report, and a user schedule is scanned step by step.
    """
    if config.schedule in ("none", "constant"):
        return ()
    starts, previous = [], level_at(0, config, max_steps)
    for step in range(1, max_steps):
        level = level_at(step, config, max_steps)
        if abs(level - previous) >= STAGE_JUMP:
            starts.append(step)
        previous = level
    return tuple(starts)


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
        from trainer.data import DeviceBatches  # here, not above: trainer.config imports this module

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
            from trainer.config import ConfigError

            raise ConfigError([("curriculum.schedule", f"task {task.name!r} provides no per-sample difficulty; use "
                                                       "schedule 'none' or give the task a `difficulty`")])
    return CurriculumSampler(curriculum, config.max_steps, len(task.train[0]), config.batch_size, config.seed, device,
                             scores)


def curriculum_from_dict(values: Mapping[str, Any] | None) -> CurriculumConfig:
    """A `CurriculumConfig` from a stored trial config's `curriculum` mapping; the default (none) when absent."""
    if not values:
        return CurriculumConfig()
    known = CurriculumConfig.__dataclass_fields__
    return CurriculumConfig(**{k: v for k, v in values.items() if k in known})
