"""`digits`: scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes) and an MLP.

The data file ships inside the scikit-learn wheel; it is read straight from there with numpy, so the trainer neither
imports scikit-learn nor downloads anything.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from trainer.tasks.base import Task, accuracy_sum

__all__ = ["MLP", "digits", "linear_margin_difficulty", "load_digits_arrays"]

MODEL_DEFAULTS = {"hidden": 64, "depth": 2, "activation": "relu", "dropout": 0.0}
MAX_DEPTH = 1000  # hidden layers of the built-in MLP (digits, blobs, arrays)
ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


def _data_file() -> Path:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("task 'digits' reads its data from scikit-learn's package: pip install scikit-learn")
    for location in spec.submodule_search_locations:
        path = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if path.exists():
            return path
    raise FileNotFoundError("scikit-learn is installed but its datasets/data/digits.csv.gz is missing")


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images [1797, 64] float32 in [0, 1], labels [1797] int64)."""
    with gzip.open(_data_file(), "rt") as fh:
        raw = np.loadtxt(fh, delimiter=",", dtype=np.float32)
    return raw[:, :-1] / 16.0, raw[:, -1].astype(np.int64)


class MLP(nn.Module):
    def __init__(self, n_in: int, n_out: int, hidden: int, depth: int, activation: str, dropout: float) -> None:
        super().__init__()
        if hidden < 1 or depth < 0:
            raise ValueError(f"model.hidden must be >= 1 and model.depth >= 0, but got {hidden=}, {depth=}")
        if depth > MAX_DEPTH:  # each layer is a module: a million of them take minutes to build, even on meta
            raise ValueError(f"model.depth must be at most {MAX_DEPTH}, but got {depth=}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"model.activation must be one of {sorted(ACTIVATIONS)}, but got {activation=}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), but got {dropout=}")
        layers: list[nn.Module] = []
        width = n_in
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), ACTIVATIONS[activation](), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, n_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def linear_margin_difficulty(x: np.ndarray, y: np.ndarray, n_classes: int, ridge: float = 1.0) -> np.ndarray:
    """Per-sample difficulty: minus the margin of a ridge-regression classifier on the same samples.

    A cheap, deterministic proxy for "how hard is this image": one closed-form least-squares fit (a 65x65 solve, no
    iterations, no seed), then each sample's score for its true class minus its best other score. Samples far on the
    right side of a linear boundary are easy; ambiguous or mislabelled-looking ones (negative margin) are hardest.
    """
    features = np.hstack([x, np.ones((len(x), 1))]).astype(np.float64)
    targets = np.eye(n_classes)[y]
    weights = np.linalg.solve(features.T @ features + ridge * np.eye(features.shape[1]), features.T @ targets)
    scores = features @ weights
    rows = np.arange(len(y))
    true = scores[rows, y].copy()
    scores[rows, y] = -np.inf
    return scores.max(axis=1) - true


def digits(val_fraction: float = 0.2, split_seed: int = 0) -> Task:
    """The split is fixed by `split_seed`, not by the training seed: every trial is judged on the same samples."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"task_args.val_fraction must be in (0, 1), but got {val_fraction=}")
    if split_seed < 0:  # numpy's generator takes no negative seed, and its message names no argument
        raise ValueError(f"task_args.split_seed must be >= 0, but got {split_seed=}")
    x, y = load_digits_arrays()
    order = np.random.default_rng(split_seed).permutation(len(x))
    n_val = round(len(x) * val_fraction)
    val, train = order[:n_val], order[n_val:]

    def build(cfg: dict[str, Any]) -> nn.Module:
        return MLP(64, 10, **cfg)

    def difficulty() -> np.ndarray:  # computed only when a curriculum asks for it
        return linear_margin_difficulty(x[train], y[train], 10)

    return Task(
        name="digits",
        train=(torch.from_numpy(x[train]), torch.from_numpy(y[train])),
        val=(torch.from_numpy(x[val]), torch.from_numpy(y[val])),
        build_model=build,
        model_defaults=MODEL_DEFAULTS,
        eval_metrics=accuracy_sum,
        eval_metric_names=("accuracy",),
        difficulty=difficulty,
    )
