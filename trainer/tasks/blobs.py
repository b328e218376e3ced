"""`blobs`: Gaussian clusters whose samples carry a known noise level, the ground truth for curriculum tests.

Each class is a cluster centre in `dims` dimensions; each sample is its centre plus Gaussian noise scaled by its own
noise level, drawn uniformly from [0, 1] and multiplied by `max_noise`. The noise level *is* the sample's difficulty:
a quiet sample sits on its centre, a loud one may land nearer another class. Tests can thus check a sampler against the
true difficulty, and a curriculum study has a task where easy-first is meaningful by construction. Tiny and quick.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from trainer.tasks.base import Task, accuracy_sum

__all__ = ["blobs", "make_blobs"]

MODEL_DEFAULTS = {"hidden": 32}


def make_blobs(n: int, classes: int, dims: int, max_noise: float, seed: int) -> tuple[np.ndarray, np.ndarray,
                                                                                      np.ndarray]:
    """(inputs [n, dims] float32, labels [n] int64, noise levels [n] in [0, 1]), a function of the arguments alone."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dims))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)  # at distance 1 from the origin: noise sets difficulty
    labels = rng.integers(0, classes, size=n)
    noise = rng.uniform(0.0, 1.0, size=n)
    inputs = centres[labels] + rng.normal(size=(n, dims)) * (noise * max_noise)[:, None]
    return inputs.astype(np.float32), labels.astype(np.int64), noise


def blobs(n: int = 2048, classes: int = 4, dims: int = 8, max_noise: float = 1.5, val_fraction: float = 0.25,
          seed: int = 0) -> Task:
    """The validation set has the same spread of noise levels as the training set: it measures the whole task."""
    if n < 8 or classes < 2 or dims < 1:
        raise ValueError(f"task_args need n >= 8, classes >= 2 and dims >= 1, but got {n=}, {classes=}, {dims=}")
    if not (max_noise >= 0 and math.isfinite(max_noise)):  # (tasks review: .inf pruned every trial as "nan")
        raise ValueError(f"task_args.max_noise must be a finite number >= 0, but got {max_noise=}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"task_args.val_fraction must be in (0, 1), but got {val_fraction=}")
    if seed < 0:  # numpy's generator takes no negative seed, and its message names no argument
        raise ValueError(f"task_args.seed must be >= 0, but got {seed=}")
    with np.errstate(over="ignore", invalid="ignore"):
        x, y, noise = make_blobs(n, classes, dims, max_noise, seed)
    if not np.isfinite(x).all():  # 1e39 is finite, but not in float32: NaN and infinity in every batch
        raise ValueError(f"task_args.max_noise={max_noise:g} makes inputs beyond float32's range (about 3.4e38); "
                         "expected a far smaller noise")
    n_val = max(1, round(n * val_fraction))

    def build(cfg: dict[str, Any]) -> nn.Module:
        if cfg["hidden"] < 1:
            raise ValueError(f"model.hidden must be >= 1, but got hidden={cfg['hidden']}")
        return nn.Sequential(nn.Linear(dims, cfg["hidden"]), nn.ReLU(), nn.Linear(cfg["hidden"], classes))

    return Task(
        name="blobs",
        train=(torch.from_numpy(x[n_val:]), torch.from_numpy(y[n_val:])),
        val=(torch.from_numpy(x[:n_val]), torch.from_numpy(y[:n_val])),
        build_model=build,
        model_defaults=MODEL_DEFAULTS,
        eval_metrics=accuracy_sum,
        eval_metric_names=("accuracy",),
        difficulty=noise[n_val:].copy(),
    )
