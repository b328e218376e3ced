"""The two ways batches reach the model: the data set on the device, or gathered by DataLoader workers on the host.
Both draw the same batch indices, so on a CPU they train identically, and either resumes exactly."""

from __future__ import annotations

import math
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.trainer.support import SaveAt
from trainer import ConfigError, TrainingConfig, load_task, train
from trainer.checkpoint import load_checkpoint
from trainer.data import DeviceData, LoaderData, build_batches, choose_data_loader
from trainer.tasks import TaskError
from trainer.tasks.digits import load_digits_arrays

CPU = torch.device("cpu")


def tiny(**values) -> TrainingConfig:
    base = {"max_steps": 60, "eval_every_steps": 20, "log_every_steps": 10, "batch_size": 32,
            "model": {"hidden": 16, "dropout": 0.1}, "learning_rate": 3e-3}  # dropout: the global RNG matters too
    return TrainingConfig.from_dict({**base, **values})


def curve(result) -> list:
    return [(r["step"], r["train_loss"], r["grad_norm"]) for r in result.logs] + result.evals


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("extra", [
    {},
    {"gradient_accumulation_steps": 3, "batch_size": 16},
    {"curriculum": {"schedule": "linear", "end_fraction": 0.5}},
], ids=["plain", "accumulation", "curriculum"])
def test_the_dataloader_path_trains_exactly_like_the_device_path(digits, workers: int, extra: dict) -> None:
    device = train(tiny(data_loader="device", **extra), digits)
    loader = train(tiny(data_loader="dataloader", loader_workers=workers, **extra), digits)
    assert curve(loader) == curve(device)


def test_auto_keeps_the_data_on_a_cpu_device(digits) -> None:
    assert choose_data_loader(tiny(), digits, CPU) == "device"
    assert isinstance(build_batches(tiny(), digits, CPU), DeviceData)
    assert isinstance(build_batches(tiny(data_loader="dataloader"), digits, CPU), LoaderData)


@pytest.mark.parametrize("resume_with", ["dataloader", "device"])
def test_a_dataloader_run_resumes_exactly_on_either_path(digits, tmp_path: Path, resume_with: str) -> None:
    # The loader runs ahead of the loop (2 workers x prefetch 2): the checkpoint must hold the loop's position.
    config = tiny(data_loader="dataloader", loader_workers=2, prefetch_factor=2, max_steps=100)
    full = train(config, digits, checkpointer=SaveAt(50, tmp_path / "s.pt"))  # epochs of 35 batches: mid-epoch
    state = load_checkpoint(tmp_path / "s.pt")
    resumed = train(tiny(data_loader=resume_with, max_steps=100), digits, resume=state)
    assert curve(resumed) == [entry for entry in curve(full) if entry[0] > 50]


def test_loader_workers_stop_when_training_stops(digits) -> None:
    class StopAtFirstReport:
        def log(self, step, metrics) -> None:
            pass

        def report(self, step, metrics) -> bool:
            return step > 0

    result = train(tiny(data_loader="dataloader", loader_workers=2), digits, StopAtFirstReport())
    assert result.status == "stopped"
    assert multiprocessing.active_children() == []


@pytest.fixture()
def digit_files(tmp_path: Path) -> dict[str, str]:
    """The digits as .npy files: 8x8 uint8 images (any shape and dtype will do) and int32 labels."""
    x, y = load_digits_arrays()
    images = (x * 16).astype(np.uint8).reshape(-1, 8, 8)
    paths = {}
    for key, array in {"train_x": images[:1400], "train_y": y[:1400].astype(np.int32),
                       "val_x": images[1400:], "val_y": y[1400:].astype(np.int32)}.items():
        paths[key] = str(tmp_path / f"{key}.npy")
        np.save(paths[key], array)
    return paths


def test_the_arrays_task_trains_from_memory_mapped_files(digit_files: dict[str, str]) -> None:
    config = {"task": "arrays", "task_args": {**digit_files, "classes": 10}, "max_steps": 150,
              "eval_every_steps": 50, "log_every_steps": 50, "batch_size": 32, "learning_rate": 1e-2,
              "model": {"hidden": 32}}
    task = load_task("arrays", config["task_args"])
    assert task.train[0].shape == (1400, 8, 8) and task.train[0].dtype == torch.uint8
    mapped = np.load(digit_files["train_x"], mmap_mode="c")
    assert task.train[0].data_ptr() != mapped.ctypes.data  # each load maps the file anew ...
    assert isinstance(mapped, np.memmap)  # ... as a memory map, read when touched
    loader = train(TrainingConfig.from_dict({**config, "data_loader": "dataloader"}), task)
    device = train(TrainingConfig.from_dict({**config, "data_loader": "device"}), task)
    assert curve(loader) == curve(device)
    assert loader.metrics["val_accuracy"] > 0.6


def test_the_arrays_task_names_the_bad_argument(digit_files: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="classes"):
        load_task("arrays", {**digit_files})
    with pytest.raises(FileNotFoundError, match=r"task_args\.val_y"):
        load_task("arrays", {**digit_files, "val_y": str(tmp_path / "missing.npy"), "classes": 10})
    np.save(tmp_path / "short.npy", np.zeros(5, dtype=np.int64))
    with pytest.raises(ValueError, match="as many samples"):
        load_task("arrays", {**digit_files, "train_y": str(tmp_path / "short.npy"), "classes": 10})
    np.save(tmp_path / "floats.npy", np.zeros(1400, dtype=np.float32))
    with pytest.raises(ValueError, match="integer class indices"):
        load_task("arrays", {**digit_files, "train_y": str(tmp_path / "floats.npy"), "classes": 10})
    # Labels beyond `classes` failed every trial at its first batch ("IndexError: Target 9 is out of bounds").
    with pytest.raises(ValueError, match=r"task_args\.train_y holds class indices from 0 to 9, but task_args\.classes "
                                         r"is 5: expected indices in \[0, 4\]"):
        load_task("arrays", {**digit_files, "classes": 5})
    # Files that are no array of numbers: numpy's and torch's words named neither the argument nor the file, and a
    # text file drew numpy's advice to unpickle it.
    np.save(tmp_path / "words.npy", np.array(["a", "b"]))
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}, {"b": 2}], dtype=object), allow_pickle=True)
    (tmp_path / "text.npy").write_text("1,2,3\n")
    for name, said in (("words", "can't convert np.ndarray of type numpy.str_"),
                       ("objects", "Python objects in dtype"),
                       ("text", "not a .npy file of numbers (numpy would have to unpickle it, which is never done)")):
        with pytest.raises(ValueError) as info:
            load_task("arrays", {**digit_files, "train_x": str(tmp_path / f"{name}.npy"), "classes": 10})
        start = ("arrays raised ValueError: task_args.train_x: expected a .npy array of numbers, with samples on "
                 f"dimension 0; '{tmp_path / name}.npy': ")
        assert str(info.value).startswith(start), info.value
        assert said in str(info.value) and "allow_pickle" not in str(info.value)
    with pytest.raises(ValueError, match=r"task_args\.val_x: expected a \.npy file, but '.*' is a folder"):
        load_task("arrays", {**digit_files, "val_x": str(tmp_path), "classes": 10})
    # Samples with no feature, and complex numbers (their imaginary part dropped with a warning), trained (review).
    np.save(tmp_path / "empty.npy", np.zeros((1400, 0), dtype=np.float32))
    with pytest.raises(ValueError, match=r"task_args\.train_x: expected samples with at least one feature, but its "
                                         r"samples have shape \(0,\)"):
        load_task("arrays", {**digit_files, "train_x": str(tmp_path / "empty.npy"), "classes": 10})
    np.save(tmp_path / "complex.npy", np.zeros((1400, 8, 8), dtype=np.complex64))
    with pytest.raises(ValueError, match=r"task_args\.train_x: expected real numbers .*, got torch\.complex64"):
        load_task("arrays", {**digit_files, "train_x": str(tmp_path / "complex.npy"), "classes": 10})


def test_the_arrays_task_takes_what_its_files_hold_and_refuses_what_would_fail_every_trial(
        digit_files: dict[str, str], tmp_path: Path) -> None:
    """Found by review: 1-D inputs (a number per sample) failed every trial at the model's flatten; uint16 labels
    (more than 256 classes) were torch's "min_all not implemented"; one NaN in the validation inputs made every
    trial's loss NaN at its first evaluation, blamed on its config; an .npz archive was "'NpzFile' object has no
    attribute 'ndim'"."""
    x, y = np.load(digit_files["train_x"]), np.load(digit_files["train_y"])
    vx, vy = np.load(digit_files["val_x"]), np.load(digit_files["val_y"])
    files = {name: str(tmp_path / f"{name}.npy") for name in ("x1", "vx1", "y16", "vy16", "nan")}
    np.save(files["x1"], x[:, 3, 3].astype(np.float32))
    np.save(files["vx1"], vx[:, 3, 3].astype(np.float32))
    np.save(files["y16"], y.astype(np.uint16))
    np.save(files["vy16"], vy.astype(np.uint16))
    task = load_task("arrays", {"train_x": files["x1"], "train_y": files["y16"], "val_x": files["vx1"],
                                "val_y": files["vy16"], "classes": 10})
    assert task.train[1].dtype == torch.int64 and task.train[1].tolist() == y.tolist()
    config = TrainingConfig.from_dict({"task": "arrays", "max_steps": 20, "eval_every_steps": 10,
                                       "log_every_steps": 10, "batch_size": 32, "model": {"hidden": 8}})
    result = train(config, task)
    assert result.status == "completed" and math.isfinite(result.metrics["val_loss"])
    poisoned = vx.astype(np.float32)
    poisoned[7, 2, 2] = np.inf
    np.save(files["nan"], poisoned)
    with pytest.raises(ValueError, match=r"task_args\.val_x: expected finite numbers .*, but sample 7 holds NaN or "
                                         r"infinity"):
        load_task("arrays", {**digit_files, "val_x": files["nan"], "classes": 10})
    np.savez(tmp_path / "archive.npz", x)
    with pytest.raises(ValueError, match=r"task_args\.train_x: .*a \.npz archive of 1 arrays, not one array"):
        load_task("arrays", {**digit_files, "train_x": str(tmp_path / "archive.npz"), "classes": 10})
    # Tasks review: a torch.save file (a zip too) was "a .npz archive of 7 arrays".
    torch.save(torch.from_numpy(x), tmp_path / "x.pt")
    with pytest.raises(ValueError, match=r"task_args\.train_x: .*'[^']*x\.pt': a zip file but no \.npz archive of "
                                         r"arrays \(a torch\.save file\?\), not one \.npy array"):
        load_task("arrays", {**digit_files, "train_x": str(tmp_path / "x.pt"), "classes": 10})


@pytest.mark.parametrize(("values", "key"), [({"data_loader": "gpu"}, "data_loader"),
                                             ({"loader_workers": -1}, "loader_workers"),
                                             ({"prefetch_factor": 0}, "prefetch_factor"),
                                             # DataLoader counted 1e11 batches out one by one: a hang (review)
                                             ({"prefetch_factor": 99_999_999_999}, "prefetch_factor")])
def test_loader_settings_are_validated(values: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainingConfig.from_dict(values)
    assert [k for k, _ in info.value.problems] == [key]


def test_the_data_fingerprint_follows_the_data_and_is_in_every_run_s_record(digits) -> None:
    from trainer.batched import CohortMember, train_batched
    from trainer.tasks import Task
    from trainer.tasks.base import DIGEST_ELEMENTS

    def task(train_x: torch.Tensor, val_y: torch.Tensor | None = None) -> Task:
        targets = torch.zeros(len(train_x), dtype=torch.long)
        return Task("t", (train_x, targets), (train_x[:4], targets[:4] if val_y is None else val_y),
                    build_model=lambda cfg: torch.nn.Linear(1, 1))

    x = torch.arange(600, dtype=torch.float32).reshape(100, 6)
    digest = task(x).data_digest()
    assert digest == task(x.clone()).data_digest() and len(digest) == 16
    edited = x.clone()
    edited[57, 2] += 1
    assert task(edited).data_digest() != digest  # any element of a small set
    assert task(x, torch.ones(4, dtype=torch.long)).data_digest() != digest  # the validation targets count too
    assert task(x.reshape(100, 2, 3)).data_digest() != digest  # and the shape
    for dtype in (torch.bfloat16, torch.bool, torch.uint8, torch.complex64):  # dtypes numpy lacks or views oddly
        typed = x > 300 if dtype == torch.bool else x.to(dtype)
        changed = typed.clone()
        changed[3, 1] = typed[57, 2]  # 19 becomes 344 (88 as uint8; True for x > 300): one element's bytes
        assert task(typed).data_digest() not in (None, digest, task(changed).data_digest())
    # A set above DIGEST_ELEMENTS is read in runs of whole samples, the first and the last among them.
    big = torch.zeros(DIGEST_ELEMENTS // 8 + 1, 16, dtype=torch.uint8)
    first, last = big.clone(), big.clone()
    first[0, 5], last[-1, 5] = 1, 1
    assert len({task(t).data_digest() for t in (big, first, last)}) == 3

    result = train(tiny(max_steps=20), digits)
    assert result.reproducibility["data"] == digits.data_digest()
    (member,) = train_batched([CohortMember(tiny(max_steps=20))], task=digits)
    assert member.reproducibility["data"] == digits.data_digest()
