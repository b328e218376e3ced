"""Fast-fail in the loop: `LossGuard` watches the training loss on the device between evaluations.

The rules themselves (`FastFailConfig`, `judge`, the NaN policy, curriculum stage grace) are pure and torch-free, in
`trainer.fast_fail_rules`; they are re-exported here, so `trainer.fast_fail` is the one place to import fast-fail from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from trainer.fast_fail_rules import (
    FastFailConfig,
    Rule,
    StudyReference,
    Verdict,
    in_stage_grace,
    judge,
    latest_stage_start,
    study_reference,
    training_metric,
)
from trainer.sync import allowed_sync

__all__ = ["FastFailConfig", "LossGuard", "Rule", "StudyReference", "Verdict", "in_stage_grace", "judge",
           "latest_stage_start", "study_reference", "training_metric"]


class LossGuard:
    """Watches the training loss on the device between evaluations: trips when a step's loss is NaN/Inf or above the
    explosion threshold. Watching costs no sync; the loop reads it at the check interval, and when it has tripped
    runs an evaluation whose value goes to the reporter, so the decision is still `judge`'s (or the pruner's).
    Like `judge`, it does not apply the explosion threshold within the grace period after a curriculum stage change
    (decided on the host from the step: still no sync); NaN/Inf always trip it."""

    def __init__(self, config: FastFailConfig, device: torch.device, stage_starts: Sequence[int] = ()) -> None:
        self.config = config
        self.stage_starts = tuple(stage_starts)
        self.worst = torch.full((), -math.inf, device=device)  # the largest loss since the last check
        self.threshold: float | None = None

    def arm(self, initial: float) -> None:
        """Set the explosion threshold from the initial validation loss."""
        factor = self.config.loss_explosion_factor
        if self.config.enabled and factor is not None and math.isfinite(initial) and initial > 0:
            self.threshold = factor * initial

    def observe(self, loss: torch.Tensor, step: int) -> None:
        """One kernel per step: a running maximum, through which NaN propagates (so it sticks) like +Inf. Where the
        explosion rule does not apply (warmup, a stage's grace), only NaN/Inf may count: `loss - loss` is 0 for a
        finite loss and NaN otherwise. A -Inf training loss is left to the next evaluation's NaN/Inf rule."""
        if not self.config.enabled:
            return
        explosion = (self.threshold is not None and step >= (self.config.warmup_steps or 0)
                     and not in_stage_grace(step, self.stage_starts, self.config.stage_grace_steps or 0))
        torch.maximum(self.worst, loss if explosion else loss - loss, out=self.worst)

    def tripped(self) -> bool:
        """Read the running maximum: one sync, at the check interval only."""
        with allowed_sync():
            worst = float(self.worst)
        return math.isnan(worst) or worst == math.inf or (self.threshold is not None and worst > self.threshold)

    def reset(self) -> None:
        self.worst.fill_(-math.inf)
