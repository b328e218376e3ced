"""Seeding every source of randomness, and the record that lets someone else re-run a result.

On a CPU the thread counts belong to that record: a sum split over another number of threads rounds differently, so
a rerun matches bit for bit only with the counts the run had (`apply_threads`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import random
import subprocess
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["THREAD_ENV", "apply_threads", "command_record", "deterministic_cublas", "git_commit", "kept_global_state",
           "reproducibility_record", "seed_everything", "seed_worker", "settle_vector_math", "thread_record"]

# The variables that set the thread counts of a process that imports torch (read once, when torch loads).
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def settle_vector_math() -> None:
    """Make MKL's vector math (VML: torch's CPU sqrt, exp, log, tanh, ... on float tensors) ready on this thread,
    before any op calls it from several threads at once.

    torch splits such an op on a tensor of more than 2,048 elements between its intra-op threads, each calling VML.
    When a process's first VML call is such a split, VML sets itself up on two threads at once, and one thread's
    half is then now and then computed less accurately (seen with torch 2.13 on two threads: the first `log` of
    4,096 elements wrong by up to 1e-4 relative on one half in 13 processes of 60; AdamW's first `sqrt` then moved
    the first layer's weights a little differently, and a CPU run no longer matched its rerun bit for bit). One
    call on one thread first sets VML up for every function and dtype (`tests/trainer/test_seeding.py`). Called
    when this module is imported: every path that trains imports it before its first step.
    """
    for dtype in (torch.float32, torch.float64):
        torch.exp(torch.zeros(16, dtype=dtype))  # 16 elements: one chunk, on this thread


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


@contextlib.contextmanager
def kept_global_state() -> Iterator[None]:
    """Put back, afterwards, what a run sets for the whole process: python's, numpy's and torch's global generators
    (CUDA's too, where CUDA was in use before) and torch's determinism and float32 matmul switches. A run seeds and
    sets them for itself; a caller in a notebook or a script keeps its own (review: a user's deterministic mode was
    found off, and the caller's generators in a trial's state, after `train` returned)."""
    python, numpy_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    deterministic, warn_only = (torch.are_deterministic_algorithms_enabled(),
                                torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32)
    try:
        matmul: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:  # set through torch's per-backend `fp32_precision` (review): the caller's, left alone
        matmul = None
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
         torch.backends.cudnn.allow_tf32) = cudnn
        if matmul is not None:
            torch.set_float32_matmul_precision(matmul)


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
    return git_commit(root) if (root / ".git").exists() else None


def git_commit(folder: Path) -> str | None:
    """The commit checked out in the git work tree that holds `folder`, with "-dirty" when a tracked file differs
    from it; None outside a work tree or without git."""
    try:
        out = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


@functools.lru_cache(maxsize=4)
def _workdir_commit(folder: str) -> str | None:
    """`git_commit` of a command's working folder, once per process (two git calls per trial are not free in a large
    work tree), as the project's own commit is."""
    return git_commit(Path(folder))


def command_record(argv: list[str], seed: int | None) -> dict[str, Any]:
    """What it takes to re-run a command's trial: its command line and working folder, the commit of the code there
    (a git work tree), the config's seed, the thread variables it inherited (`threads`: a worker of `--workers N`
    sets OMP_NUM_THREADS, and the command's torch sums in another order on another count), and the worker's
    platform, Python and project version. What the command imports and on what device it trains are the command's
    own, which only it can record."""
    workdir = Path.cwd()
    return {
        "seed": seed,
        "command": list(argv),
        "workdir": str(workdir),
        "workdir_git_commit": _workdir_commit(str(workdir)),
        "threads": {name: os.environ.get(name) for name in THREAD_ENV},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "sweep_version": _project_version(),
        "git_commit": _git_commit(),
    }


def _project_version() -> str | None:
    try:
        return metadata.version("sweep")
    except metadata.PackageNotFoundError:
        return None


def reproducibility_record(seed: int, device: torch.device, *, deterministic: bool = False,
                           data: str | None = None) -> dict[str, Any]:
    """What it takes to re-run a result: seed, library versions, device, thread counts, the code's version, and
    (`data`) a fingerprint of the data trained on (`Task.data_digest`; None for a loop's own)."""
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
        "threads": thread_record(),
        "sweep_version": _project_version(),
        "git_commit": _git_commit(),
        "data": data,
    }


def thread_record() -> dict[str, int | str | None]:
    """torch's intra-op threads (one op split across cores) and inter-op threads (ops run side by side), and the
    environment variables that set them (None: unset)."""
    return {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads(),
            **{name: os.environ.get(name) for name in THREAD_ENV}}


def apply_threads(record: Mapping[str, Any]) -> None:
    """Run this process (and the processes it starts) with the thread counts of a `reproducibility_record`.

    A record without them (written before they were recorded) changes nothing. torch fixes the inter-op count once
    inter-op work has started in a process, or once it has been set: a different count then raises a RuntimeError
    saying to rerun in a fresh process; the same count is left as it is.
    """
    threads = record.get("threads")
    if not threads:
        return
    for name in THREAD_ENV:  # for child processes: this one's torch read them when it was imported
        if threads.get(name) is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(threads[name])
    if threads.get("intra_op") is not None:
        torch.set_num_threads(int(threads["intra_op"]))
    inter_op = threads.get("inter_op")
    if inter_op is None or torch.get_num_interop_threads() == int(inter_op):
        return
    try:
        torch.set_num_interop_threads(int(inter_op))
    except RuntimeError as exc:
        raise RuntimeError(f"cannot run with the recorded {inter_op} inter-op threads: this process already uses "
                           f"{torch.get_num_interop_threads()}, and torch fixes that count once inter-op work has "
                           "started or it has been set; rerun in a fresh process") from exc


settle_vector_math()
