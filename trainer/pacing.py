"""A curriculum's pacing: its settings (`CurriculumConfig`) and the level at each step, as pure functions of the step.

The "pacing function" half of a curriculum (Hacohen & Weinshall, 2019; the "scoring" half, per-sample difficulty, and
the sampler that draws from it live in `trainer.curriculum`). Nothing here imports torch or numpy: `trainer.config`
holds a `CurriculumConfig`, and the sweep's pruner computes `stage_starts` from a stored config, in processes that
need not load torch.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from trainer.imports import import_callable
from trainer.messages import short_repr

__all__ = [
    "BUILTIN_SCHEDULES",
    "STAGE_JUMP",
    "CurriculumConfig",
    "Schedule",
    "curriculum_from_dict",
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
                                        f"'package.module:function', got {short_repr(self.schedule)}"))
            else:
                try:
                    resolve_schedule(self.schedule)
                except ValueError as exc:
                    out.append(("schedule", str(exc)))
        for name in ("start_level", "level", "tolerance"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                out.append((name, f"expected a level in [0, 1], got {short_repr(value)}"))
        if not 0.0 < self.end_fraction <= 1.0:
            out.append(("end_fraction", f"expected a fraction in (0, 1], got {short_repr(self.end_fraction)}"))
        if self.end_steps is not None and self.end_steps < 1:
            out.append(("end_steps", f"expected a step >= 1 or null, got {short_repr(self.end_steps)}"))
        if self.stages < 2:
            out.append(("stages", f"expected at least 2 (the start level and 1), got {short_repr(self.stages)}"))
        if self.schedule == "exponential" and self.start_level == 0:
            out.append(("start_level", "the exponential schedule grows the level by a constant factor, so it needs "
                                       "start_level > 0, got 0"))
        return out

    def schedule_problem(self, max_steps: int) -> str | None:
        """What is wrong with a user schedule (`package.module:function`), found by calling it at the first and last
        steps as the loop would: it raises, or returns no level in [0, 1]. None for a built-in schedule, one that
        cannot be imported (`problems` says so), or one that works."""
        if self.schedule in BUILTIN_SCHEDULES or self.problems():
            return None
        for step in sorted({0, max(0, max_steps - 1)}):
            try:
                level_at(step, self, max_steps)
            except Exception as exc:  # noqa: BLE001 - whatever the user's function raises is the problem to show
                first = (str(exc).strip().splitlines() or [""])[0]
                return first if isinstance(exc, ValueError) and first.startswith("schedule ") else (
                    f"schedule {self.schedule!r} raised {type(exc).__name__} at step {step}: {first}")
        return None

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


def curriculum_from_dict(values: Mapping[str, Any] | None) -> CurriculumConfig:
    """A `CurriculumConfig` from a stored trial config's `curriculum` mapping; the default (none) when absent."""
    if not values:
        return CurriculumConfig()
    known = CurriculumConfig.__dataclass_fields__
    return CurriculumConfig(**{k: v for k, v in values.items() if k in known})
