"""`TrialCheckpointer`'s policy on a real training run, a real SQLite registry and a real blob store: when it saves.

Wall-clock checkpoints (`checkpoints.every_seconds`) are tested on a fake clock that the run itself moves forward
(each log step "takes" a fixed number of seconds), so nothing waits and nothing depends on the machine's speed.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from sweep.blobs import CheckpointStore
from sweep.checkpoints import TrialCheckpointer
from sweep.registry import Registry
from sweep.schema import CheckpointPolicy
from trainer import TrainingConfig, load_task, train
from trainer.checkpoint import CheckpointInfo
from trainer.loop import NullReporter


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Ticking(NullReporter):
    """A reporter through which each log step moves the fake clock `seconds` forward."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.clock.now += self.seconds


class Recording(TrialCheckpointer):
    """The real checkpointer, remembering every step it registered (retention later keeps only some of them)."""

    steps: list[int]

    def saved(self, info: CheckpointInfo, metrics: Mapping[str, float] | None) -> None:
        assert info.path.exists()
        super().saved(info, metrics)
        self.steps.append(info.step)


def checkpointed_steps(tmp_path: Path, policy: dict[str, object], seconds_per_log: float) -> list[int]:
    """Train 60 steps (a log every 5, an evaluation every 20) under `policy`; the steps at which a checkpoint was
    written and registered."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    registry, store, clock = Registry(url), CheckpointStore(tmp_path / "blobs", "s"), FakeClock()
    checkpointer = Recording(registry, store, "s", 0, {"learning_rate": 0.05},
                             CheckpointPolicy.model_validate(policy), "val_loss", maximize=False, clock=clock)
    checkpointer.steps = []
    config = TrainingConfig.from_dict({"task": "digits", "max_steps": 60, "log_every_steps": 5,
                                       "eval_every_steps": 20, "batch_size": 16, "model.hidden": 8,
                                       "fast_fail.enabled": False})
    result = train(config, load_task("digits"), Ticking(clock, seconds_per_log), checkpointer=checkpointer)
    assert result.status == "completed"
    if checkpointer.steps:  # the latest one is registered and kept
        assert max(r.step for r in registry.for_trial("s", 0)) == checkpointer.steps[-1]
    return checkpointer.steps


@pytest.mark.parametrize(("every_seconds", "seconds_per_log", "expected"), [
    pytest.param(30, 10, [15, 30, 45, 60], id="every-third-log-step"),
    pytest.param(25, 10, [15, 30, 45, 60], id="at-the-first-log-step-after-the-interval"),
    pytest.param(10, 10, list(range(5, 61, 5)), id="every-log-step-when-each-takes-as-long"),
    pytest.param(3600, 10, [], id="a-short-run-never-reaches-an-hour"),
])
def test_every_seconds_saves_by_the_wall_clock(tmp_path: Path, every_seconds: float, seconds_per_log: float,
                                               expected: list[int]) -> None:
    assert checkpointed_steps(tmp_path, {"on_best": False, "every_seconds": every_seconds},
                              seconds_per_log) == expected


def test_every_seconds_counts_from_the_last_checkpoint_whatever_wrote_it(tmp_path: Path) -> None:
    # every_steps 20 saves at 20, 40, 60; the clock (10 s a log) then reaches 30 s only at 35 and 55.
    assert checkpointed_steps(tmp_path, {"on_best": False, "every_steps": 20, "every_seconds": 30}, 10) == [
        15, 20, 35, 40, 55, 60]


def test_every_seconds_alone_turns_checkpoints_on() -> None:
    assert CheckpointPolicy.model_validate({"on_best": False, "every_seconds": 600}).enabled
    assert not CheckpointPolicy.model_validate({"on_best": False}).enabled


def test_a_cohort_s_checkpoints_registered_together_keep_what_each_trial_keeps_alone(tmp_path: Path) -> None:
    # A cohort's members register a step's checkpoints together (`register_together`: one transaction for all of
    # them, after the step) where a lone trial registers each at once. Either way each trial keeps its latest, its
    # best `keep_top_k` and its handoff step, and the files of the rows that went are deleted, the others kept.
    from sweep.checkpoints import register_together
    from trainer.checkpoint import sha256_of

    curves = {0: [0.9, 0.5, 0.7, 0.4, 0.6], 1: [0.8, 0.85, 0.3, 0.9, 0.95]}

    def run(together: bool) -> tuple[dict[int, list[int]], list[str], int]:
        root = tmp_path / str(together)
        root.mkdir()
        registry, store = Registry(f"sqlite:///{root / 'r.db'}"), CheckpointStore(root / "blobs", "s")
        policy = CheckpointPolicy.model_validate({"keep_top_k": 1})
        members = [TrialCheckpointer(registry, store, "s", n, {"n": n}, policy, "val_loss", maximize=False,
                                     keep_steps=[20] if n == 1 else []) for n in (0, 1)]
        waited = 0
        for i, step in enumerate(range(10, 60, 10)):
            for n, checkpointer in enumerate(members):
                checkpointer.deferred = together
                path = checkpointer.path_at(step)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(f"trial {n} step {step}".encode())
                checkpointer.saved(CheckpointInfo(path, sha256_of(path), path.stat().st_size, step),
                                   {"val_loss": curves[n][i]})
            waited += sum(len(c.pending) for c in members)
            if together:
                register_together(members)
        kept = {n: sorted(r.step for r in registry.for_trial("s", n)) for n in (0, 1)}
        return kept, sorted(p.name for p in (root / "blobs").rglob("*.pt")), waited

    alone, together = run(False), run(True)
    assert alone[0] == together[0] == {0: [40, 50], 1: [20, 30, 50]}
    assert alone[1] == together[1] == ["trial00000-step00000040.pt", "trial00000-step00000050.pt",
                                       "trial00001-step00000020.pt", "trial00001-step00000030.pt",
                                       "trial00001-step00000050.pt"]
    assert (alone[2], together[2]) == (0, 10)  # deferred: each waited for the step's end


def test_the_dashboard_artifact_folder_is_made_again_when_it_was_removed(tmp_path: Path) -> None:
    """The checkpoint store removed while a study ran: the trials' folder was made again, `_artifacts/` was not, and
    every later trial's dashboard artifact failed (a warning each, none on the dashboard)."""
    import io
    import shutil

    from sweep.blobs import artifact_store_at

    store = artifact_store_at(str(tmp_path / "store" / "_artifacts"))
    shutil.rmtree(tmp_path / "store")
    store.write("a1", io.BytesIO(b"checkpoint"))
    with store.open_reader("a1") as reader:
        assert reader.read() == b"checkpoint"


def test_an_artifact_upload_that_fails_midway_leaves_no_partial_copy(tmp_path: Path) -> None:
    """Found by review (a store on a full tmpfs): a best checkpoint's upload that met ENOSPC left a truncated copy in
    `_artifacts/` that nothing named or removed, its space never given back."""
    import errno
    import io

    from sweep.blobs import artifact_store_at

    class FailsAfterOneChunk(io.RawIOBase):  # the copy's first chunk lands, then the disk is full
        def __init__(self) -> None:
            self.sent = 0

        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            if self.sent:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.sent = len(buffer)
            buffer[:] = b"x" * len(buffer)
            return len(buffer)

    store = artifact_store_at(str(tmp_path / "_artifacts"))
    with pytest.raises(OSError, match="No space left"):
        store.write("a1", FailsAfterOneChunk())
    assert list((tmp_path / "_artifacts").iterdir()) == []
    store.write("a2", io.BytesIO(b"whole"))
    assert (tmp_path / "_artifacts" / "a2").read_bytes() == b"whole"


class Deleting(NullReporter):
    """A reporter that deletes the study's checkpoint folder at log step `at` (a share unmounted, `rm -rf`)."""

    def __init__(self, folder: Path, at: int) -> None:
        self.folder, self.at = folder, at

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if step == self.at:
            shutil.rmtree(self.folder)


def test_a_study_folder_deleted_mid_run_is_not_made_anew_by_the_next_checkpoint(tmp_path: Path) -> None:
    # Files review: the next checkpoint made the folder again, without its owner file; another study of the same
    # name then claimed it, and its `sweep check --repair` deleted this study's checkpoints as orphans. As when a run
    # starts with the folder gone: the machine's fault, named, and nothing made.
    from trainer.checkpoint import CheckpointWriteError

    registry, store = Registry(f"sqlite:///{tmp_path / 'study.db'}"), CheckpointStore(tmp_path / "blobs", "s")
    store.folder.mkdir(parents=True)
    checkpointer = TrialCheckpointer(registry, store, "s", 0, {"learning_rate": 0.05},
                                     CheckpointPolicy.model_validate({"every_steps": 10}), "val_loss", maximize=False)
    config = TrainingConfig.from_dict({"task": "digits", "max_steps": 60, "log_every_steps": 5,
                                       "eval_every_steps": 20, "batch_size": 16, "model.hidden": 8})
    with pytest.raises(CheckpointWriteError, match=r"the study's folder .* is gone since this run wrote in it"):
        train(config, load_task("digits"), Deleting(store.folder, 25), checkpointer=checkpointer)
    assert not store.folder.exists() and [r.step for r in registry.for_trial("s", 0)] == [20]
    # A folder that was never there (a study from before owner files) is made by the first checkpoint, as before.
    fresh = TrialCheckpointer(registry, CheckpointStore(tmp_path / "new", "s"), "s", 1, {"learning_rate": 0.05},
                              CheckpointPolicy.model_validate({"every_steps": 10}), "val_loss", maximize=False)
    assert train(config, load_task("digits"), checkpointer=fresh).status == "completed"
    assert (tmp_path / "new" / "s" / "trial00001-step00000060.pt").exists()
