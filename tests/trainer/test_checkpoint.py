"""Checkpoints: exact resume in a fresh process, atomic writes, and refusing what cannot be trusted."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.trainer.support import SaveAt
from trainer import TrainingConfig, load_task, train
from trainer.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    LoopState,
    TrainState,
    load_checkpoint,
    save_checkpoint,
    save_checkpoints,
    sha256_of,
    user_checkpoint,
)

CONFIG = {"max_steps": 60, "log_every_steps": 10, "eval_every_steps": 20, "batch_size": 32, "learning_rate": 0.01,
          "model": {"hidden": 32, "dropout": 0.2}, "optimizer": "adamw", "warmup_steps": 5}


RESUME = """
import json, sys
from trainer import TrainingConfig, train
from trainer.checkpoint import load_checkpoint
state = load_checkpoint(sys.argv[1], sha256=sys.argv[2])
result = train(TrainingConfig.from_dict(state.config), resume=state)
print(json.dumps({"logs": result.logs, "evals": result.evals, "steps": result.steps}))
"""


@pytest.mark.parametrize("curriculum", [{}, {"schedule": "linear", "end_fraction": 0.9}])
def test_resume_in_a_fresh_process_reproduces_the_run_bit_for_bit(tmp_path: Path, curriculum: dict) -> None:
    config = TrainingConfig.from_dict({**CONFIG, "curriculum": curriculum})
    saver = SaveAt(30, tmp_path / "step30.pt")
    full = train(config, checkpointer=saver)
    [info] = saver.infos
    assert info.step == 30 and info.sha256 == sha256_of(info.path)
    done = subprocess.run([sys.executable, "-c", RESUME, str(info.path), info.sha256], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    resumed = json.loads(done.stdout)
    tail = [r for r in full.logs if r["step"] > 30]
    assert [(r["step"], r["train_loss"], r["grad_norm"]) for r in resumed["logs"]] == \
        [(r["step"], r["train_loss"], r["grad_norm"]) for r in tail]
    assert [[s, m] for s, m in resumed["evals"]] == [[s, m] for s, m in full.evals if s > 30]
    assert resumed["steps"] == 60


def test_a_failed_write_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    path = tmp_path / "latest.pt"
    saver = SaveAt(20, path)
    train(TrainingConfig.from_dict(CONFIG), checkpointer=saver)
    before = sha256_of(path)
    state = load_checkpoint(path)

    class Unpicklable:
        def __reduce__(self):
            raise OSError("No space left on device (a real failure in the middle of writing)")

    broken = TrainState(**{**state.__dict__, "metrics": {"val_loss": Unpicklable()}})  # fails after the tensors
    with pytest.raises(CheckpointWriteError, match="No space left") as info:
        save_checkpoint(path, broken)
    assert info.value.filename == str(path) and info.value.errno is None  # the disk has room: not ENOSPC
    assert sha256_of(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt"]  # no temporary file left behind
    assert load_checkpoint(path, sha256=before).step == 20


def test_corrupt_truncated_and_code_carrying_checkpoints_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    train(TrainingConfig.from_dict(CONFIG), checkpointer=SaveAt(10, path))
    good = sha256_of(path)
    data = bytearray(path.read_bytes())

    data[len(data) // 2] ^= 0xFF
    (tmp_path / "flipped.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its recorded hash"):
        load_checkpoint(tmp_path / "flipped.pt", sha256=good)

    (tmp_path / "short.pt").write_bytes(path.read_bytes()[: len(data) // 3])
    with pytest.raises(CheckpointError, match="unreadable") as short:
        load_checkpoint(tmp_path / "short.pt")
    assert "\n" not in str(short.value)  # one line, as the warning that falls back to an older checkpoint prints it

    torch.save({"format": 1, "step": 1, "payload": subprocess.Popen}, tmp_path / "code.pt")  # a pickled class
    with pytest.raises(CheckpointError, match="unreadable") as code:
        load_checkpoint(tmp_path / "code.pt")  # weights_only: never unpickled
    # One line naming what was refused (torch's several paragraphs advise loading it without weights_only).
    said = str(code.value)
    assert "\n" not in said and "GLOBAL" in said and "Popen" in said and "weights_only=False" not in said, said


@pytest.mark.parametrize(("payload", "why"), [
    ({"format": 1, "step": 100, "model": {}},
     "'optimizer', 'scaler', 'rng', 'data', 'config', 'metrics', 'loop' missing"),
    ({"format": 1, "step": "100"}, "its step is '100', expected a whole number"),
    ({"format": 1, "model": torch.zeros(2)}, "its 'model' is Tensor, expected a mapping"),
    ({"format": 1, "loop": {"loss_sum": "x"}}, "its 'loop' is unreadable"),
], ids=["keys-missing", "step", "model", "loop"])
def test_a_file_that_matches_its_hash_but_holds_no_training_state_is_refused(tmp_path: Path, payload: dict,
                                                                              why: str) -> None:
    # Found by review: a registered file whose hash matched but which held something else raised KeyError in the
    # trainer, so the trial failed (counted, as its config's fault) where an older checkpoint was sound; as a
    # warm-start donor it failed every later trial. A CheckpointError makes resume and warm start try the next one.
    path = tmp_path / "c.pt"
    train(TrainingConfig.from_dict(CONFIG), checkpointer=SaveAt(10, path))
    # The first payload alone; the others replace one part of a real checkpoint.
    forged = payload if payload.get("model") == {} else {**torch.load(path, weights_only=True), **payload}
    torch.save(forged, tmp_path / "forged.pt")
    with pytest.raises(CheckpointError, match="not a training state") as refused:
        load_checkpoint(tmp_path / "forged.pt", sha256=sha256_of(tmp_path / "forged.pt"))
    assert why in str(refused.value) and "\n" not in str(refused.value)


def test_checkpoints_hold_the_whole_training_state(tmp_path: Path) -> None:
    path = tmp_path / "s.pt"
    train(TrainingConfig.from_dict(CONFIG), load_task("digits"), checkpointer=SaveAt(20, path))
    state = load_checkpoint(path)
    assert state.step == 20 and state.config["max_steps"] == 60
    assert {"python", "numpy", "torch"} <= set(state.rng) and state.optimizer["state"]
    assert state.data and "val_loss" in state.metrics and state.loop.guard_threshold > 0


def test_a_resume_between_log_steps_carries_the_running_loss(tmp_path: Path) -> None:
    # Saved at an evaluation (step 20) five steps into a log interval: the log at step 30 averages steps 16 to 30.
    config = TrainingConfig.from_dict({**CONFIG, "log_every_steps": 15})
    full = train(config, checkpointer=SaveAt(20, tmp_path / "mid.pt"))
    state = load_checkpoint(tmp_path / "mid.pt")
    assert state.loop.steps_since_log == 5 and state.loop.loss_sum > 0
    resumed = train(config, resume=state)
    assert [(r["step"], r["train_loss"]) for r in resumed.logs] == \
        [(r["step"], r["train_loss"]) for r in full.logs if r["step"] > 20]


def test_a_resume_trains_on_the_thread_count_its_checkpoint_was_written_with(tmp_path: Path) -> None:
    # Found by review: a trial killed under `--workers 2` (one thread each on two cores) and resumed by a worker
    # alone (two threads) continued on another count, where a CPU sums in another order: neither the uninterrupted
    # run nor `sweep reproduce` gave its values. The resume takes the checkpoint's count, and gives this process's
    # own back afterwards.
    config = TrainingConfig.from_dict(CONFIG)
    before = torch.get_num_threads()
    other = 1 if before > 1 else 2
    torch.set_num_threads(other)
    try:
        full = train(config, checkpointer=SaveAt(30, tmp_path / "step30.pt"))
    finally:
        torch.set_num_threads(before)
    state = load_checkpoint(tmp_path / "step30.pt")
    assert state.loop.threads == other
    resumed = train(config, resume=state)
    assert torch.get_num_threads() == before
    assert resumed.reproducibility["threads"]["intra_op"] == other
    assert [(r["step"], r["train_loss"], r["grad_norm"]) for r in resumed.logs] == \
        [(r["step"], r["train_loss"], r["grad_norm"]) for r in full.logs if r["step"] > 30]
    assert resumed.evals == [e for e in full.evals if e[0] > 30]


def test_the_loop_state_is_stored_as_the_plain_mapping_older_checkpoints_hold(tmp_path: Path) -> None:
    path = tmp_path / "s.pt"
    train(TrainingConfig.from_dict({**CONFIG, "log_every_steps": 15}), checkpointer=SaveAt(20, path))
    payload = torch.load(path, weights_only=True)
    assert payload["format"] == 1
    assert payload["loop"] == load_checkpoint(path).loop.as_dict()
    assert set(payload["loop"]) == {"loss_sum", "steps_since_log", "guard_threshold", "threads"}
    assert payload["loop"]["threads"] == torch.get_num_threads()
    # A mapping without some of the keys reads as a loop that had not run them: nothing summed, no threshold.
    payload["loop"] = {"steps_since_log": 3}
    assert TrainState.from_payload(payload).loop == LoopState(loss_sum=0.0, steps_since_log=3, guard_threshold=None)


# ---------------------------------------------------------------------------------------------------------------------
# Write failures on a real small file system.

def weights(step: int, floats: int) -> TrainState:
    return TrainState(step=step, model={"w": torch.full((floats,), float(step))}, optimizer={}, scaler={}, rng={},
                      data={})


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs, mounted for the test (root only; skipped where mounting is not possible)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, check=True)


def test_a_full_disk_is_a_checkpoint_write_error_and_the_previous_checkpoint_stays(small_disk: Path) -> None:
    path = small_disk / "latest.pt"
    before = save_checkpoint(path, weights(1, 10_000))  # 40 KB
    free = shutil.disk_usage(small_disk).free
    with pytest.raises(CheckpointWriteError) as info:
        save_checkpoint(path, weights(2, 400_000))  # 1.6 MB: torch's writer fails with an opaque RuntimeError
    error = info.value
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC and error.filename == str(path)
    assert str(error).startswith(f"cannot write checkpoint {path}: no space left on device (")
    assert "KiB free" in str(error) and "\n" not in str(error)
    assert sorted(p.name for p in small_disk.iterdir()) == ["latest.pt"]  # the temporary file is gone...
    assert shutil.disk_usage(small_disk).free == free  # ...and so is the space it took
    assert load_checkpoint(path, sha256=before.sha256).step == 1


def test_a_disk_out_of_inodes_is_named_so_not_out_of_space(small_disk: Path) -> None:
    """Found by review: a file system with bytes free but no inode left was reported as out of space, "35.2 MiB
    free; the checkpoint needs at least 174.5 KiB", which contradicts itself."""
    subprocess.run(["mount", "-o", "remount,nr_inodes=4", str(small_disk)], capture_output=True, check=True)
    made = 0
    with contextlib.suppress(OSError):
        while made < 16:
            (small_disk / f"filler{made}").touch()
            made += 1
    path = small_disk / "latest.pt"
    with pytest.raises(CheckpointWriteError) as info:
        save_checkpoint(path, weights(1, 1_000))
    assert info.value.errno == errno.ENOSPC
    assert str(info.value).startswith(f"cannot write checkpoint {path}: no free inodes left on its file system"), \
        str(info.value)


def test_a_read_only_disk_is_a_checkpoint_write_error_with_its_own_errno(small_disk: Path) -> None:
    path = small_disk / "latest.pt"
    before = save_checkpoint(path, weights(1, 1_000))
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], capture_output=True, check=True)
    with pytest.raises(CheckpointWriteError) as info:
        save_checkpoint(path, weights(2, 1_000))
    assert info.value.errno == errno.EROFS and info.value.filename == str(path)
    assert str(info.value).startswith(f"cannot write checkpoint {path}: read-only file system (")
    assert load_checkpoint(path, sha256=before.sha256).step == 1



@pytest.mark.parametrize("depth", [0, 1], ids=["its-folder", "a-folder-above"])
def test_a_file_where_the_checkpoint_folder_must_be_is_a_write_error_that_names_it(tmp_path: Path,
                                                                                   depth: int) -> None:
    """A file put where the study's folder was (`mkdir` refuses it: "file exists", naming neither) is the machine's
    fault: the worker retries the trial and does not count it, where it failed every trial as the config's (review)."""
    blocked = tmp_path / "store" / "study"
    blocked.parent.mkdir()
    blocked.write_text("not a folder")
    path = blocked / ("sub" if depth else "") / "trial00000-step00000100.pt"
    with pytest.raises(CheckpointWriteError) as info:
        save_checkpoint(path, weights(1, 10))
    assert info.value.errno in (errno.EEXIST, errno.ENOTDIR) and info.value.filename == str(path)
    assert str(info.value) == f"cannot write checkpoint {path}: {blocked} is a file, not a folder"


def test_checkpoints_written_together_are_the_files_written_one_by_one_and_a_failure_stays_its_own(
        tmp_path: Path) -> None:
    """A cohort's members' checkpoints are written on threads at once: each file is the one `save_checkpoint`
    writes; a write that fails (its folder is a file here) is returned as its error, the others are written."""
    alone = [save_checkpoint(tmp_path / "alone" / f"{k}.pt", weights(k, 1000 * k)) for k in range(1, 6)]
    (tmp_path / "blocked").write_text("a file where the checkpoint folder should be")
    paths = [tmp_path / "together" / f"{k}.pt" for k in range(1, 6)]
    paths[2] = tmp_path / "blocked" / "3.pt"
    made: list[int] = []
    results = save_checkpoints([(path, lambda k=k: made.append(k) or weights(k, 1000 * k))
                                for k, path in enumerate(paths, start=1)])
    assert made == [1, 2, 3, 4, 5]  # each state made once, in order, on the calling thread
    failed = results.pop(2)
    assert isinstance(failed, CheckpointWriteError) and failed.filename == str(paths[2])
    del alone[2], paths[2]
    for info, single, path in zip(results, alone, paths):
        assert not isinstance(info, BaseException)
        assert info.path == path and info.sha256 == single.sha256 == sha256_of(path) and info.step == single.step
    assert sorted(p.name for p in (tmp_path / "together").iterdir()) == ["1.pt", "2.pt", "4.pt", "5.pt"]


def test_checkpoints_written_together_hold_at_most_max_bytes_of_states_in_flight(tmp_path: Path) -> None:
    """A state is made only once those in flight hold less than `max_bytes`: with room for one (40 KB each, 50 KB
    allowed), each state is made after the previous file is written."""
    paths = [tmp_path / f"{k}.pt" for k in range(4)]
    written_before: list[int] = []

    def make(k: int) -> TrainState:
        written_before.append(sum(path.exists() for path in paths))
        return weights(k, 10_000)

    results = save_checkpoints([(path, lambda k=k: make(k)) for k, path in enumerate(paths)], max_bytes=50_000)
    assert written_before == [0, 1, 2, 3]
    assert [load_checkpoint(info.path, sha256=info.sha256).step for info in results] == [0, 1, 2, 3]  # type: ignore[union-attr]


def test_a_state_that_cannot_be_made_ends_the_jobs_and_the_written_ones_are_returned(tmp_path: Path) -> None:
    """Making a member's state can fail (out of device memory, say): the writes already started finish and are
    returned for registering, the failure in that job's place, and no later job starts."""
    def make(k: int) -> TrainState:
        if k == 2:
            raise RuntimeError("out of memory")
        return weights(k, 1000)

    results = save_checkpoints([(tmp_path / f"{k}.pt", lambda k=k: make(k)) for k in range(4)])
    assert [type(r).__name__ for r in results] == ["CheckpointInfo", "CheckpointInfo", "RuntimeError"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.pt", "1.pt"]

@pytest.mark.parametrize(("state", "named"), [
    ({"mean": np.zeros(3)}, "state['mean'] is a numpy.ndarray"),
    ({"best": np.float64(0.5)}, "state['best'] is a numpy.float64"),
    ({"model": torch.nn.Linear(2, 2)}, "state['model'] is a torch.nn.modules.linear.Linear"),
    ({"history": [1.0, {"fn": print}]}, "state['history'][1]['fn'] is a builtin_function_or_method"),
])
def test_a_user_state_that_weights_only_loading_would_refuse_is_refused_when_saved(state: dict, named: str) -> None:
    # Otherwise the save succeeds and the retry or warm start that needs it cannot load it.
    with pytest.raises(TypeError, match=re.escape(named)):
        user_checkpoint(3, state, {})


def test_a_user_state_of_tensors_and_plain_values_round_trips(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    state = {"model": model.state_dict(), "step": 3, "name": "x", "lrs": [0.1, 0.01], "shape": (2, 2), "none": None}
    saved = save_checkpoint(tmp_path / "u.pt", user_checkpoint(3, state, {"lr": 0.1}))
    loaded = load_checkpoint(saved.path, saved.sha256)
    assert loaded.user["model"]["weight"].equal(model.weight) and loaded.user["lrs"] == [0.1, 0.01]
