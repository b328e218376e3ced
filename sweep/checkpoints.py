"""The sweep side of checkpoints: when a trial saves (the study's policy), where the blob goes, registering it, and
garbage collection: each trial keeps its latest plus its best k, and with `keep_top_trials` only the study's best
finished trials keep any. A checkpoint that some trial resumed or warm-started from is pinned in the registry and
never collected (see `Registry.pin`), so a running trial never loses its parent, and reproduce can always find it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweep.blobs import delete_blob
from trainer.checkpoint import CheckpointInfo

if TYPE_CHECKING:
    from sweep.blobs import CheckpointStore
    from sweep.registry import CheckpointRecord, Registry
    from sweep.spec import CheckpointPolicy

__all__ = ["TrialCheckpointer", "collect_study", "ranked_trials", "retention_keeps"]


class TrialCheckpointer:
    """The trainer's `Checkpointer` for one trial."""

    def __init__(self, registry: Registry, store: CheckpointStore, study: str, trial_number: int, params: Mapping[str, Any],
                 policy: CheckpointPolicy, metric: str, maximize: bool, shape_key: str = "",
                 coords: Sequence[float | None] = (), cat_key: str = "", keep_steps: Sequence[int] = ()) -> None:
        self.registry, self.store, self.study, self.number = registry, store, study, trial_number
        self.params, self.policy, self.metric, self.maximize = dict(params), policy, metric, maximize
        self.shape_key, self.coords, self.cat_key = shape_key, list(coords), cat_key
        self.keep_steps = set(keep_steps)  # always saved and kept: the warm-start handoff point
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
        if not (periodic or best or step in self.keep_steps):
            return None
        return self.store.local_path(f"trial{self.number:05d}-step{step:08d}.pt")

    def saved(self, info: CheckpointInfo, metrics: Mapping[str, float] | None) -> None:
        value = None if metrics is None else metrics.get(self.metric)
        self.registry.register(study=self.study, trial_number=self.number, step=info.step, value=value,
                               params=self.params, shape_key=self.shape_key, uri=self.store.put(info.path),
                               size=info.size,
                               sha256=info.sha256, coords=self.coords, cat_key=self.cat_key)
        self._collect()

    def best_record(self) -> CheckpointRecord | None:
        """The trial's best checkpoint (its latest when none has a value), or None when it wrote none. Until
        the trial ends (`Registry.finish_trial`), no other worker's retention touches its checkpoints."""
        records = self.registry.for_trial(self.study, self.number)
        scored = best_first(records, self.maximize)
        return scored[0] if scored else max(records, key=lambda r: (r.step, r.id), default=None)

    def _collect(self) -> None:
        records = self.registry.for_trial(self.study, self.number)
        if not records:
            return
        latest = max(records, key=lambda r: (r.step, r.id))
        scored = best_first(records, self.maximize)
        keep = {latest.id, *(r.id for r in scored[: self.policy.keep_top_k]),
                *(r.id for r in records if r.step in self.keep_steps)}
        gone = set(self.registry.forget([r.id for r in records if r.id not in keep]))  # pinned ones stay
        kept = {r.uri for r in records if r.id not in gone}
        for record in records:  # the rows first, then the files: nobody is sent to a deleted file
            if record.id in gone and record.uri not in kept:
                delete_blob(record.uri)


def best_first(records: Sequence[CheckpointRecord], maximize: bool) -> list[CheckpointRecord]:
    """The checkpoints with a finite value, best first."""
    scored = [r for r in records if r.value is not None and math.isfinite(r.value)]
    return sorted(scored, key=lambda r: -r.value if maximize else r.value)  # type: ignore[operator]


def ranked_trials(ranges: Mapping[int, tuple[float | None, float | None, bool]], maximize: bool) -> list[int]:
    """Trials best first by their best checkpointed value: those that completed or were pruned, then those that
    failed, each without any value last."""
    def key(number: int) -> tuple[bool, float]:
        low, high, failed = ranges[number]
        best = high if maximize else low
        return failed, math.inf if best is None else (-best if maximize else best)

    return sorted(ranges, key=key)


def retention_keeps(registry: Registry, study: str, trial_number: int, value: float | None, failed: bool,
                    keep_trials: int, maximize: bool) -> bool:
    """Whether `collect_study` would keep this trial's checkpoints were it to end now with its best `value`."""
    ranges = dict(registry.value_range_per_trial(study))
    finite = value if value is not None and math.isfinite(value) else None
    ranges[trial_number] = (finite, finite, failed)
    return trial_number in ranked_trials(ranges, maximize)[:keep_trials]


def collect_study(registry: Registry, study: str, keep_trials: int, maximize: bool) -> list[int]:
    """Keep checkpoints only for the study's `keep_trials` best ended trials (`ranked_trials`; pinned ones always
    stay).
    Returns the trials that lost checkpoints in this call (each trial is returned once: its rows are then gone)."""
    ranked = ranked_trials(registry.value_range_per_trial(study), maximize)
    dropped, uris = registry.forget_unpinned(study, ranked[keep_trials:])
    for uri in uris:
        delete_blob(uri)
    return dropped
