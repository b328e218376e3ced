"""The sweep side of checkpoints: when a trial saves (the study's policy), where the blob goes, registering it, and
keeping each trial's latest plus its best k. A running trial only ever deletes its own checkpoints, so a checkpoint
that another trial is resuming or warm-starting from (a finished or dead trial's) is never collected under it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.checkpoint import CheckpointInfo

if TYPE_CHECKING:
    from sweep.registry import Registry
    from sweep.spec import CheckpointPolicy

__all__ = ["TrialCheckpointer"]


class TrialCheckpointer:
    """The trainer's `Checkpointer` for one trial."""

    def __init__(self, registry: Registry, store: Path, study: str, trial_number: int, params: Mapping[str, Any],
                 policy: CheckpointPolicy, metric: str, maximize: bool) -> None:
        self.registry, self.store, self.study, self.number = registry, store, study, trial_number
        self.params, self.policy, self.metric, self.maximize = dict(params), policy, metric, maximize
        self.best: float | None = None

    def _improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return self.best is None or (value > self.best if self.maximize else value < self.best)

    def path_for(self, step: int, metrics: Mapping[str, float] | None) -> Path | None:
        periodic = self.policy.every_steps is not None and step % self.policy.every_steps == 0
        best = self.policy.on_best and metrics is not None and self._improves(metrics[self.metric])
        if best:
            self.best = metrics[self.metric]  # type: ignore[index]
        if not (periodic or best):
            return None
        return self.store / f"trial{self.number:05d}-step{step:08d}.pt"

    def saved(self, info: CheckpointInfo, metrics: Mapping[str, float] | None) -> None:
        value = None if metrics is None else metrics.get(self.metric)
        self.registry.register(study=self.study, trial_number=self.number, step=info.step, value=value,
                               params=self.params, shape_key="", uri=str(info.path), size=info.size,
                               sha256=info.sha256)
        self._collect()

    def _collect(self) -> None:
        records = self.registry.for_trial(self.study, self.number)
        if not records:
            return
        latest = max(records, key=lambda r: (r.step, r.id))
        scored = sorted((r for r in records if r.value is not None and math.isfinite(r.value)),
                        key=lambda r: -r.value if self.maximize else r.value)  # type: ignore[operator]
        keep = {latest.id, *(r.id for r in scored[: self.policy.keep_top_k])}
        doomed = [r for r in records if r.id not in keep]
        self.registry.forget([r.id for r in doomed])  # the row first: nobody is sent to a deleted file
        for record in doomed:
            if not any(r.uri == record.uri for r in records if r.id in keep):
                Path(record.uri).unlink(missing_ok=True)
