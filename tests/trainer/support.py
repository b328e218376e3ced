"""Small test doubles the trainer tests share (real objects, not mocks: the trainer's `Checkpointer` protocol)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from trainer.checkpoint import CheckpointInfo


class SaveAt:
    """A `Checkpointer` that saves once, at `step`, to `path`; `infos` holds what the trainer reported back."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path
        self.infos: list[CheckpointInfo] = []

    def path_for(self, step: int, metrics: Mapping[str, float] | None) -> Path | None:
        return self.path if step == self.step else None

    def saved(self, info: CheckpointInfo, metrics: Mapping[str, float] | None) -> None:
        self.infos.append(info)
