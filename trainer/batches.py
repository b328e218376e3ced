"""Which samples each training batch takes: seeded shuffles of sample indices, on the device, resumable from a position.

Below the curriculum's sampler (`trainer.curriculum.CurriculumSampler`, which chooses the pool) and the two data
paths (`trainer.data`, which gather the rows): the batch order is a function of the seed and the position alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from trainer.config import ConfigError

__all__ = ["DeviceBatches", "permutation"]


def permutation(n: int, seed: int, draw: int, device: torch.device) -> torch.Tensor:
    """The `draw`-th shuffle of `range(n)` for `seed`: a function of its arguments alone, so it can be drawn again on
    resume instead of being saved."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + draw) % 2**63)
    return torch.randperm(n, generator=generator, device=device)


class DeviceBatches:
    """Shuffled batch indices over `n` samples, epoch after epoch, dropping each epoch's last partial batch.

    A batch may be restricted to a *pool*: the first `pool` samples of a fixed `order` (a curriculum passes its
    samples sorted easiest first, and a pool that grows with its level). A batch is then `order[perm[i:i + b]]` for a
    shuffle `perm` of `range(pool)`: picking from a prefix costs one gather, never a pass over the data. A new shuffle
    ("epoch") is drawn when the current one is used up or when the pool changes size; the shuffle of epoch `e` is a
    function of `(seed, e, pool)` alone, so the position `(epoch, cursor, pool)` is the whole state: a resumed run
    continues with exactly the batches the uninterrupted run would have seen. Without `order` and with the whole set
    as the pool, the batches are those of a plain shuffled epoch loop.
    """

    def __init__(self, n: int, batch_size: int, seed: int, device: torch.device,
                 order: torch.Tensor | None = None) -> None:
        if batch_size > n:
            raise ConfigError([("batch_size", f"expected at most the training set size ({n}), got {batch_size}")])
        if order is not None and tuple(order.shape) != (n,):
            raise ValueError(f"order must hold one index per sample, shape ({n},), but got {tuple(order.shape)}")
        self.n = n
        self.batch_size = batch_size
        self.seed = seed
        self.device = device
        self.order = None if order is None else order.to(device)
        self.epoch = 0
        self.cursor = 0
        self.pool = n
        self._perm = permutation(n, seed, 0, device)

    def next(self, pool: int | None = None) -> torch.Tensor:
        """The next batch's indices, drawn from the first `pool` samples of the order (all of them when None)."""
        pool = self.n if pool is None else pool
        if not self.batch_size <= pool <= self.n:
            raise ValueError(f"pool must be in [batch_size, n] = [{self.batch_size}, {self.n}], but got {pool=}")
        if pool != self.pool or self.cursor + self.batch_size > self.pool:
            self.epoch += 1
            self.cursor = 0
            self.pool = pool
            self._perm = permutation(pool, self.seed, self.epoch, self.device)
        idx = self._perm[self.cursor : self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return idx if self.order is None else self.order[idx]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "pool": self.pool}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        pool = int(state.get("pool", self.n))  # states saved before pools existed covered the whole set
        if not self.batch_size <= pool <= self.n:
            raise ValueError(f"state['pool'] must be in [{self.batch_size}, {self.n}] for this data set, but got "
                             f"{pool=}; was the state saved for a different data set or batch size?")
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self.pool = pool
        self._perm = permutation(pool, self.seed, self.epoch, self.device)
