from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from trainer.seeding import reproducibility_record, seed_everything, seed_worker


def test_seed_everything_seeds_python_numpy_and_torch() -> None:
    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    seed_everything(7)
    first = draw()
    seed_everything(7)
    assert draw() == first
    seed_everything(8)
    assert draw() != first


class NumpyNoise(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> float:
        return float(np.random.rand())


def loader_draws(seed: int) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(NumpyNoise(), batch_size=1, num_workers=2, worker_init_fn=seed_worker, generator=generator)
    return [float(x) for x in loader]


def test_loader_workers_get_distinct_reproducible_seeds() -> None:
    draws = loader_draws(0)
    # Without seed_worker both workers would inherit the parent's numpy state and draw the same numbers.
    assert len(set(draws)) == 4
    assert loader_draws(0) == draws
    assert loader_draws(1) != draws


def test_reproducibility_record_names_what_a_rerun_needs() -> None:
    record = reproducibility_record(5, torch.device("cpu"))
    assert record["seed"] == 5 and record["torch"] == torch.__version__ and record["device_type"] == "cpu"
    assert {"numpy", "python", "cuda", "cudnn", "device", "sweep_version", "git_commit"} <= set(record)


def test_a_deterministic_run_does_not_make_the_next_run_in_the_process_deterministic() -> None:
    # A sweep worker trains trial after trial in one process; torch's switch is process-wide.
    from trainer import TrainingConfig, train

    base = {"max_steps": 2, "eval_every_steps": 2, "log_every_steps": 2, "batch_size": 8, "model": {"hidden": 8}}
    try:
        train(TrainingConfig.from_dict({**base, "deterministic": True}))
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        train(TrainingConfig.from_dict(base))
        assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
