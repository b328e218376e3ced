"""How training batches reach the model.

A data set that fits is moved to the device once and batched there (`DeviceData`): the shuffle is a seeded on-device
permutation, a batch an index gather. No DataLoader and no host-to-device copy per step. A larger one stays on the
host, in RAM or memory-mapped from disk, and DataLoader worker processes gather its batches (`LoaderData`), pinned
and copied without blocking. Both draw their batch indices with the same sampler (`trainer.batches.DeviceBatches`, under
the curriculum's `CurriculumSampler`), so the batch order is a function of the seed and the data position alone, and a
checkpoint from either path resumes exactly.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from trainer.batches import DeviceBatches, permutation
from trainer.curriculum import build_sampler
from trainer.seeding import seed_worker

if TYPE_CHECKING:
    from trainer.config import TrainingConfig
    from trainer.curriculum import CurriculumSampler
    from trainer.tasks.base import Task

__all__ = ["DEVICE_SHARE", "DeviceBatches", "DeviceData", "LoaderData", "build_batches", "choose_data_loader",
           "permutation"]

Shard = Callable[[torch.Tensor], torch.Tensor]  # a batch's indices -> those this process gathers


def _whole(indices: torch.Tensor) -> torch.Tensor:
    return indices


# `data_loader: auto` keeps the training set on a CUDA device when it takes at most this share of the free memory:
# the rest is for the model, its activations and the optimizer state.
DEVICE_SHARE = 0.5


# ---------------------------------------------------------------------------------------------------------------------
# The two paths. Each gives the loop `next(step) -> (inputs, targets)` on the device, the curriculum level at a step,
# and its position as a state dict (the same format for both).

def choose_data_loader(config: TrainingConfig, task: Task, device: torch.device) -> str:
    """`device` or `dataloader`: the config's choice, or for `auto`, device unless on CUDA the training set would take
    more than `DEVICE_SHARE` of the free device memory. On a CPU the data already lies in host memory (or is mapped
    there), so the device path copies nothing."""
    if config.data_loader != "auto":
        return config.data_loader
    if device.type != "cuda":
        return "device"
    need = sum(t.element_size() * t.numel() for t in task.train)
    free, _ = torch.cuda.mem_get_info(device)
    return "device" if need <= DEVICE_SHARE * free else "dataloader"


def build_batches(config: TrainingConfig, task: Task, device: torch.device,
                  shard: Shard = _whole) -> DeviceData | LoaderData:
    """The run's training batches, by the path `choose_data_loader` picks. `shard`: which of each batch's indices
    this process gathers (a data-parallel rank's slice; the sampler, and so its position, is the whole batch's)."""
    if choose_data_loader(config, task, device) == "device":
        return DeviceData(build_sampler(config, task, device), task.train, device, shard)
    # The loader draws its indices on the CPU: the same function of (seed, epoch, cursor), but a CUDA generator
    # shuffles differently, so on a GPU the two paths see different (equally seeded) orders; on a CPU the same.
    return LoaderData(build_sampler(config, task, torch.device("cpu")), task.train, device, config, shard)


class DeviceData:
    """The training set moved to the device once; a batch is a gather by on-device indices."""

    kind = "device"

    def __init__(self, sampler: CurriculumSampler, train: tuple[torch.Tensor, torch.Tensor],
                 device: torch.device, shard: Shard = _whole) -> None:
        self.sampler = sampler
        self.shard = shard
        self.inputs, self.targets = (t.to(device) for t in train)

    def next(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One (micro-)batch for optimizer step `step`; call it once per micro-batch."""
        idx = self.shard(self.sampler.next(step))
        return self.inputs[idx], self.targets[idx]

    def level_at(self, step: int) -> float:
        return self.sampler.level_at(step)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        pass


class LoaderData:
    """Batches gathered on the host by DataLoader worker processes, for data that does not fit on the device.

    The main process draws every micro-batch's indices, in order, with the run's sampler on the CPU; the workers
    (forked on Linux, so a memory-mapped set is shared, never copied) gather those rows; the batches come back in
    order, pinned when the device is CUDA, and are copied with `non_blocking=True`, so the host never waits for the
    copy. The loader runs ahead by `loader_workers * prefetch_factor` batches, so the sampler's own
    position is ahead of the loop's: each drawn batch carries the position after it, and `state_dict()` is the
    position after the last batch the loop *took*. The loader starts at the first `next()`, after any resume.
    """

    kind = "dataloader"

    def __init__(self, sampler: CurriculumSampler, train: tuple[torch.Tensor, torch.Tensor], device: torch.device,
                 config: TrainingConfig, shard: Shard = _whole) -> None:
        self.sampler = sampler
        self.shard = shard
        self.train = train
        self.device = device
        self.max_steps = config.max_steps
        self.accumulation = config.gradient_accumulation_steps
        self.workers = config.loader_workers
        self.prefetch_factor = config.prefetch_factor
        self.pin_memory = config.pin_memory and device.type == "cuda"
        self.seed = config.seed
        self._batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._drawn: deque[tuple[int, dict[str, Any]]] = deque()  # (step, position after it), drawn but not taken
        self._position = sampler.state_dict()

    def next(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._batches is None:
            self._batches = iter(self._loader(step))
        inputs, targets = next(self._batches)
        drawn_for, self._position = self._drawn.popleft()
        if drawn_for != step:
            raise RuntimeError(f"the loader drew this batch for step {drawn_for}, but the loop asked for step {step}: "
                               "batches must be taken in order, gradient_accumulation_steps per step")
        return (inputs.to(self.device, non_blocking=self.pin_memory),
                targets.to(self.device, non_blocking=self.pin_memory))

    def level_at(self, step: int) -> float:
        return self.sampler.level_at(step)

    def state_dict(self) -> dict[str, Any]:
        return self._position

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._batches is not None:
            raise RuntimeError("load_state_dict must come before the first batch is taken")
        self.sampler.load_state_dict(state)
        self._position = self.sampler.state_dict()

    def close(self) -> None:
        """Stop the workers now (dropping the loader would stop them too)."""
        self._batches = None

    def _loader(self, first_step: int) -> DataLoader:
        order = _draw(self.sampler, self._drawn, first_step, self.max_steps, self.accumulation, self.shard)
        # Forked workers share the parent's tensors (a memory map stays a map); other start methods pickle them into
        # shared memory, a copy. Fork only on Linux: elsewhere it is unsafe or absent.
        fork = sys.platform.startswith("linux")
        return DataLoader(
            _Rows(*self.train), sampler=order, batch_size=None,  # the sampler yields whole batches of indices
            num_workers=self.workers, pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if self.workers else None,
            multiprocessing_context=multiprocessing.get_context("fork") if fork and self.workers else None,
            worker_init_fn=seed_worker,
            generator=torch.Generator().manual_seed(self.seed),  # the loader seeds its workers from this, not from
        )                                                        # the global RNG, which dropout goes on using


def _draw(sampler: CurriculumSampler, drawn: deque[tuple[int, dict[str, Any]]], first_step: int, max_steps: int,
          accumulation: int, shard: Shard) -> Iterator[np.ndarray]:
    """Every remaining micro-batch's indices in order, recording the position after each. A plain function, not a
    method: a generator holding the `LoaderData` would make a reference cycle and keep the workers alive."""
    for step in range(first_step, max_steps):
        for _ in range(accumulation):
            idx = shard(sampler.next(step))
            drawn.append((step, sampler.state_dict()))
            yield idx.numpy()  # an array travels to a worker as bytes; a tensor would go through shared memory


class _Rows(Dataset):
    """Rows of the training tensors, gathered a whole batch at a time."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(idx)
        return self.inputs[rows], self.targets[rows]
