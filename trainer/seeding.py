"""Seeding every source of randomness, and the record that lets someone else re-run a result."""

from __future__ import annotations

import functools
import os
import platform
import random
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["deterministic_cublas", "reproducibility_record", "seed_everything", "seed_worker"]


def seed_everything(seed: int, *, deterministic: bool = False) -> None:
    """Seed python, numpy and torch (all CUDA devices too).

    `deterministic` turns on torch's deterministic algorithms: slower on GPU, and the only way to get bit-identical GPU
    runs. CPU runs of the trainer are bit-identical without it. PYTHONHASHSEED is not set here: it only takes effect in
    a new interpreter, and the trainer never hashes strings to make decisions.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device as well
    if deterministic:
        deterministic_cublas()
        torch.backends.cudnn.benchmark = False
    # Process-wide switches, set by every run either way: a sweep worker trains many trials in one process, and one
    # deterministic trial must not make the next ones slow (or refuse ops that have no deterministic kernel).
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic


def deterministic_cublas() -> None:
    """cuBLAS needs a fixed workspace to be deterministic. torch reads the setting once per process, at the first
    cuBLAS call, so a process that will train a deterministic run after others (a sweep worker whose study searches
    `deterministic`) calls this before any of them."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def seed_worker(worker_id: int) -> None:
    """`DataLoader(worker_init_fn=seed_worker)`: give each loader worker its own seed derived from the run's seed.

    torch already seeds its own RNG per worker (base_seed + worker_id); python's and numpy's are copied from the parent
    and would repeat the same numbers in every worker without this.
    """
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


@functools.lru_cache(maxsize=1)
def _git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _project_version() -> str | None:
    try:
        return metadata.version("sweep")
    except metadata.PackageNotFoundError:
        return None


def reproducibility_record(seed: int, device: torch.device, *, deterministic: bool = False) -> dict[str, Any]:
    """What it takes to re-run a result: seed, library versions, device, and the code's version."""
    cuda = device.type == "cuda"
    return {
        "seed": seed,
        "deterministic": deterministic,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "device_type": device.type,
        "sweep_version": _project_version(),
        "git_commit": _git_commit(),
    }
