"""`arrays`: classification over `.npy` files, memory-mapped, for data sets larger than RAM.

The four files are opened with `numpy.load(mmap_mode="c")`: nothing is read until a batch touches its rows, and the
operating system's page cache decides what stays in memory. (Copy-on-write rather than read-only, so torch can wrap
the arrays without a copy or a warning; nothing ever writes to them.) Train with `data_loader: dataloader` (or
`auto`, which picks it on a GPU when the set does not fit): loader workers gather each batch's rows from the mapping.
The validation set is moved to the device once for evaluation, so keep it to what fits there.

Inputs may have any shape and numeric dtype; the model flattens each sample to a vector and casts it to float32.
Targets are integer class indices in [0, classes).
"""

from __future__ import annotations

import math
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainer.tasks.base import Task, accuracy_sum, first_unfinite
from trainer.tasks.digits import MLP

__all__ = ["arrays", "open_array"]

MODEL_DEFAULTS = {"hidden": 64, "depth": 2, "activation": "relu", "dropout": 0.0}


def open_array(path: str | Path, key: str) -> torch.Tensor:
    """A tensor over a memory-mapped `.npy` file; `key` names the task argument in errors."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"task_args.{key}: expected a .npy file, but {str(path)!r} is a folder")
    if not path.is_file():
        raise FileNotFoundError(f"task_args.{key}: no such file {str(path)!r}")
    try:  # never unpickled (np.load's default): an object array, or a file that is no .npy, is refused
        array = np.load(path, mmap_mode="c")
        if not isinstance(array, np.ndarray):  # a zip file: an .npz archive of arrays (np.savez), under any name
            array.close()
            with zipfile.ZipFile(path) as archive:
                members = archive.namelist()
            if not members or not all(name.endswith(".npy") for name in members):  # tasks review: it was "a .npz
                # archive of 7 arrays"
                raise ValueError("a zip file but no .npz archive of arrays (a torch.save file?), not one .npy "
                                 "array: save it with np.save")
            raise ValueError(f"a .npz archive of {len(members)} arrays, not one array: save it with np.save")
        if array.ndim < 1 or len(array) == 0:
            raise ValueError(f"expected samples on dimension 0, but it has shape {array.shape}")
        return torch.from_numpy(array)
    except (ValueError, TypeError, EOFError) as exc:  # numpy's and torch's words name neither the file nor the key
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        if "pickled" in first:  # not numpy's advice to unpickle it: whoever wrote the file would choose the code run
            first = "not a .npy file of numbers (numpy would have to unpickle it, which is never done)"
        raise ValueError(f"task_args.{key}: expected a .npy array of numbers, with samples on dimension 0; "
                         f"{str(path)!r}: {first}") from exc


def _class_indices(targets: torch.Tensor) -> torch.Tensor:
    """Labels as torch reduces and indexes with them: unsigned ones wider than a byte (uint16 for more than 256
    classes) read into int64 (torch has neither `min` nor a cross-entropy target of them)."""
    if targets.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return torch.from_numpy(targets.numpy().astype(np.int64))
    return targets


class FlatMLP(nn.Module):
    """Flattens each sample and casts it to float32, then an MLP."""

    def __init__(self, n_in: int, n_out: int, **cfg: Any) -> None:
        super().__init__()
        self.mlp = MLP(n_in, n_out, **cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x.reshape(len(x), -1).float())  # a sample of one number (1-D inputs) too


def class_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy with targets of any integer dtype (files often hold int32 or uint8 labels)."""
    return F.cross_entropy(logits, targets.long())


def arrays(train_x: str, train_y: str, val_x: str, val_y: str, classes: int) -> Task:
    if classes < 2:
        raise ValueError(f"task_args.classes must be >= 2, but got {classes=}")
    x, y = open_array(train_x, "train_x"), open_array(train_y, "train_y")
    vx, vy = open_array(val_x, "val_x"), open_array(val_y, "val_y")
    y, vy = _class_indices(y), _class_indices(vy)
    for (inputs, targets), split in (((x, y), "train"), ((vx, vy), "val")):
        if len(inputs) != len(targets):
            raise ValueError(f"task_args.{split}_x and {split}_y must hold as many samples, but got {len(inputs)} "
                             f"and {len(targets)}")
        if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dim() != 1:
            raise ValueError(f"task_args.{split}_y must be a 1-D array of integer class indices, but got "
                             f"{targets.dtype} of shape {tuple(targets.shape)}")
        if len(targets) and (int(targets.min()) < 0 or int(targets.max()) >= classes):
            # One pass over memory-mapped labels: cheap beside the training that would fail at the first such batch.
            raise ValueError(f"task_args.{split}_y holds class indices from {int(targets.min())} to "
                             f"{int(targets.max())}, but task_args.classes is {classes}: expected indices in "
                             f"[0, {classes - 1}]")
    for inputs, key in ((x, "train_x"), (vx, "val_x")):
        if inputs.dtype.is_complex:  # cast to float32 by the model, it lost its imaginary part with a warning
            raise ValueError(f"task_args.{key}: expected real numbers (integers, floats or booleans), got "
                             f"{inputs.dtype}")
        if math.prod(inputs.shape[1:]) == 0:
            raise ValueError(f"task_args.{key}: expected samples with at least one feature, but its samples have "
                             f"shape {tuple(inputs.shape[1:])}")
    if (sample := first_unfinite(vx, as_float32=True)) is not None:  # every trial's first evaluation was NaN
        raise ValueError(f"task_args.val_x: expected finite numbers (as float32, which the model reads), but "
                         f"sample {sample} holds NaN or infinity")
    if x.shape[1:] != vx.shape[1:]:
        raise ValueError(f"train_x and val_x samples differ in shape: {tuple(x.shape[1:])} and {tuple(vx.shape[1:])}")
    n_in = math.prod(x.shape[1:])

    def build(cfg: dict[str, Any]) -> nn.Module:
        return FlatMLP(n_in, classes, **cfg)

    return Task(
        name="arrays",
        train=(x, y),
        val=(vx, vy),
        build_model=build,
        model_defaults=MODEL_DEFAULTS,
        loss=class_cross_entropy,
        eval_metrics=accuracy_sum,
        eval_metric_names=("accuracy",),
    )
