"""Tasks for the data-parallel tests: the digits task with a fault planted in one rank's training loss.

Referenced from study files as `tests.e2e.ddp_tasks:...`; the children ranks import them too (they see rank 0's
`sys.path`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.tasks import Task, cross_entropy
from trainer.tasks.digits import digits


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def poisoned(rank: int = 1, step: int = 12) -> Task:
    """Digits, whose training loss on `rank` alone turns NaN at its `step`-th training batch (1-based); evaluation
    (no gradient) is untouched."""
    calls = [0]

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        value = cross_entropy(out, y)
        if out.requires_grad and _rank() == rank:
            calls[0] += 1
            if calls[0] == step:
                return value * float("nan")
        return value

    return dataclasses.replace(digits(), loss=loss)


def slow(sleep_s: float = 0.02) -> Task:
    """Digits, each training batch `sleep_s` slower: a trial long enough to be killed in the middle."""

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if out.requires_grad:
            time.sleep(sleep_s)
        return cross_entropy(out, y)

    return dataclasses.replace(digits(), loss=loss)


def broken_child() -> Task:
    """Digits on rank 0; on any other rank (a `trainer.rank` child, RANK in its environment) an error of its own."""
    if os.environ.get("RANK", "0") != "0":
        raise RuntimeError("this rank's data is missing")
    return digits()


def killed_child(step: int = 3) -> Task:
    """Digits, whose rank 1 kills itself (SIGKILL, as the out-of-memory killer would) at its `step`-th batch."""
    calls = [0]

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if out.requires_grad and _rank() == 1:
            calls[0] += 1
            if calls[0] == step:
                os.kill(os.getpid(), signal.SIGKILL)
        return cross_entropy(out, y)

    return dataclasses.replace(digits(), loss=loss)


def exiting_child(step: int = 3) -> Task:
    """Digits, whose rank 1 ends itself with exit code 0 (`sys.exit(0)` in the task's code) at its `step`-th batch."""
    calls = [0]

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if out.requires_grad and _rank() == 1:
            calls[0] += 1
            if calls[0] == step:
                sys.exit(0)
        return cross_entropy(out, y)

    return dataclasses.replace(digits(), loss=loss)


def hung_child(marker: str, step: int = 25) -> Task:
    """Digits, whose rank 1 stops answering at its `step`-th training batch (it sleeps, as a wedged GPU or a stuck
    filesystem would leave it) after touching `marker`: rank 0 then waits in its next collective."""
    calls = [0]

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if out.requires_grad and _rank() == 1:
            calls[0] += 1
            if calls[0] == step:
                Path(marker).touch()
                time.sleep(3600)
        return cross_entropy(out, y)

    return dataclasses.replace(digits(), loss=loss)


def padded() -> Task:
    """Digits with about half of its targets -100 (padding, which cross entropy leaves out of its mean), drawn
    from a fixed seed: the ranks' slices of a batch keep different numbers of targets."""
    task = digits()
    generator = torch.Generator().manual_seed(0)
    (x, y), (vx, vy) = task.train, task.val
    y, vy = y.clone(), vy.clone()
    y[torch.rand(len(y), generator=generator) < 0.5] = -100
    vy[torch.rand(len(vy), generator=generator) < 0.5] = -100
    return dataclasses.replace(task, train=(x, y), val=(vx, vy))
