"""Runners: what trains one trial. The worker (`sweep.worker`) talks to each through the same small contract.

- `sweep.objective.TrainerTrial`: the built-in trainer (`task:` in the study file);
- `sweep.runners.loop.LoopTrial`: a user's training function (`loop: package.module:function`);
- `sweep.runners.command.CommandTrial`: a user's command, run as a subprocess per trial (`command: python ...`).

Each reports through `sweep.objective.TrialReporter` (so fast-fail and every Optuna pruner decide the same way) and
checkpoints through `sweep.checkpoints.CheckpointService` (resume, warm start, retention), and returns a
`sweep.outcomes.TrialResult`; what an exception means is the worker's call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import optuna

    from sweep.checkpoints import CheckpointService
    from sweep.outcomes import TrialResult
    from sweep.progress import Events
    from sweep.schema import StudySpec
    from sweep.storage import Boundary

__all__ = ["Runner", "runner_for"]


class Runner(Protocol):
    def run(self) -> TrialResult:
        """Train the trial; its result (an exception: the worker decides what it means)."""

    def release(self, result: TrialResult) -> None:
        """The trial ended with `result`: hand its checkpoints back (and close its trackers)."""


def runner_for(trial: optuna.Trial, spec: StudySpec, events: Events, boundary: Boundary,
               checkpoints: CheckpointService | None, *, deadline: float | None = None,
               storage_url: str | None = None) -> Runner:
    """The runner of the study's form: its `task`, `loop` or `command`."""
    if spec.form == "loop":
        from sweep.runners.loop import LoopTrial

        return LoopTrial(trial, spec, events, boundary, checkpoints, deadline=deadline, storage_url=storage_url)
    if spec.form == "command":
        from sweep.runners.command import CommandTrial

        return CommandTrial(trial, spec, events, boundary, checkpoints, deadline=deadline,
                            storage_url=storage_url)
    from sweep.objective import TrainerTrial

    return TrainerTrial(trial, spec, events, boundary, checkpoints, deadline=deadline, storage_url=storage_url)
