"""Mini-batches drawn on the device: the data set lives in device memory, the shuffle is a seeded on-device
permutation, and a batch is an index slice. No DataLoader and no host-to-device copy per step."""

from __future__ import annotations

import torch

from trainer.config import ConfigError

__all__ = ["DeviceBatches"]


class DeviceBatches:
    """Shuffled batch indices over `n` samples, epoch after epoch, dropping each epoch's last partial batch.

    The permutation of epoch `e` is a function of `(seed, e)` alone, so the position `(epoch, cursor)` is the whole
    state: a resumed run continues with exactly the batches the uninterrupted run would have seen.
    """

    def __init__(self, n: int, batch_size: int, seed: int, device: torch.device) -> None:
        if batch_size > n:
            raise ConfigError([("batch_size", f"expected at most the training set size ({n}), got {batch_size}")])
        self.n = n
        self.batch_size = batch_size
        self.seed = seed
        self.device = device
        self.epoch = 0
        self.cursor = 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator(device=self.device)
        generator.manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
        return torch.randperm(self.n, generator=generator, device=self.device)

    def next(self) -> torch.Tensor:
        if self.cursor + self.batch_size > self.n:
            self.epoch += 1
            self.cursor = 0
            self._perm = self._permutation(self.epoch)
        idx = self._perm[self.cursor : self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return idx

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self._perm = self._permutation(self.epoch)
