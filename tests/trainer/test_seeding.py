from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from trainer.limits import usable_cores
from trainer.seeding import THREAD_ENV, apply_threads, reproducibility_record, seed_everything, seed_worker


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
    assert {"numpy", "python", "cuda", "cudnn", "device", "threads", "sweep_version", "git_commit"} <= set(record)


@pytest.fixture
def threads_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch's intra-op thread count and the thread variables as they were before the test."""
    before = torch.get_num_threads()
    for name in THREAD_ENV:
        monkeypatch.delenv(name, raising=False)  # monkeypatch puts back what was there
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_a_rerun_gets_the_thread_counts_the_run_recorded(threads_restored: None) -> None:
    from trainer import TrainingConfig, train

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # as `sweep run --workers N` starts its workers
    record = train(TrainingConfig.from_dict({"max_steps": 2, "eval_every_steps": 2, "batch_size": 8,
                                             "model": {"hidden": 8}})).reproducibility
    assert record["threads"] == {"intra_op": 1, "inter_op": torch.get_num_interop_threads(), "OMP_NUM_THREADS": "1",
                                 "MKL_NUM_THREADS": None}
    torch.set_num_threads(3)
    del os.environ["OMP_NUM_THREADS"]
    os.environ["MKL_NUM_THREADS"] = "3"
    apply_threads(record)
    assert torch.get_num_threads() == 1
    assert os.environ.get("OMP_NUM_THREADS") == "1" and "MKL_NUM_THREADS" not in os.environ  # for child processes


def test_a_record_without_thread_counts_changes_nothing(threads_restored: None) -> None:
    torch.set_num_threads(2)
    apply_threads({"seed": 0})  # a record written before thread counts were recorded
    assert torch.get_num_threads() == 2 and not any(name in os.environ for name in THREAD_ENV)


APPLY_INTEROP = """
import sys, torch
from trainer.seeding import apply_threads
torch.set_num_interop_threads(1)  # torch fixes the count from here on
apply_threads({"threads": {"intra_op": 1, "inter_op": 1}})  # the same count: nothing to change
try:
    apply_threads({"threads": {"intra_op": 1, "inter_op": 2}})
except RuntimeError as exc:
    print(exc)
    sys.exit(3)
"""


def test_an_inter_op_count_that_torch_has_fixed_asks_for_a_fresh_process() -> None:
    done = subprocess.run([sys.executable, "-c", APPLY_INTEROP], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 3, done.stderr
    assert "recorded 2 inter-op threads" in done.stdout and "uses 1" in done.stdout
    assert "fresh process" in done.stdout


class _SeesDeterminism:
    """A reporter that notes torch's deterministic switch at each evaluation: what the run trained with."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def log(self, step: int, metrics: object) -> None:
        pass

    def report(self, step: int, metrics: object) -> bool:
        self.seen.append(torch.are_deterministic_algorithms_enabled())
        return False


def test_a_run_trains_with_its_own_determinism_and_gives_the_caller_its_switches_and_generators_back() -> None:
    # A sweep worker trains trial after trial in one process, and torch's switch is process-wide: a deterministic
    # trial must not make the next ones deterministic. And a notebook's own settings are its own (review: a caller's
    # deterministic mode was off, and its generators in the trial's state, once `train` returned).
    from trainer import TrainingConfig, train

    base = {"max_steps": 2, "eval_every_steps": 2, "log_every_steps": 2, "batch_size": 8, "model": {"hidden": 8}}
    try:
        seen = _SeesDeterminism()
        train(TrainingConfig.from_dict({**base, "deterministic": True}), reporter=seen)
        assert seen.seen and all(seen.seen) and not torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        random.seed(7), np.random.seed(7), torch.manual_seed(7)
        expected = [random.random(), float(np.random.random()), torch.rand(1).item()]
        random.seed(7), np.random.seed(7), torch.manual_seed(7)
        seen = _SeesDeterminism()
        train(TrainingConfig.from_dict(base), reporter=seen)
        assert seen.seen and not any(seen.seen)  # the run's own setting, not the caller's
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert [random.random(), float(np.random.random()), torch.rand(1).item()] == expected
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False


FIRST_VECTOR_MATH = """
import torch
torch.set_num_threads(2)
import trainer.seeding  # what every path that trains imports before its first step
x = torch.rand(4096, generator=torch.Generator().manual_seed(0)) + 0.01
first = x.log()  # log, not the exp the trainer settles VML with: one call sets VML up for every function
print(int((first != x.log()).sum()))
"""


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the race needs two threads running at once")
def test_the_first_vector_math_of_a_trainer_process_is_computed_as_every_later_one() -> None:
    """A process's first MKL vector-math call split over two threads set MKL up on both at once, and one half came
    out less accurate in about one process in eight (`trainer.seeding.settle_vector_math`); 30 processes without the
    fix all agree with a chance of about 1.5%."""
    def wrong_elements(_: int) -> int:
        done = subprocess.run([sys.executable, "-c", FIRST_VECTOR_MATH], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.strip())

    with ThreadPoolExecutor(2) as pool:
        wrong = list(pool.map(wrong_elements, range(30)))
    assert wrong == [0] * 30


def test_a_caller_that_set_torch_s_per_backend_precision_can_still_train() -> None:
    # Found by review: reading the float32 matmul precision raises once torch's newer per-backend switches
    # (`fp32_precision`) were set, and putting the caller's settings back made every `train` fail before its step.
    script = """
import torch
torch.backends.cuda.matmul.fp32_precision = "tf32"
from trainer import TrainingConfig, train
result = train(TrainingConfig.from_dict({"max_steps": 2, "eval_every_steps": 2, "log_every_steps": 2,
                                         "batch_size": 8, "model": {"hidden": 8}}))
print(result.status, torch.backends.cuda.matmul.fp32_precision)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["completed", "tf32"]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to take one away")
def test_the_cores_a_process_may_use_are_its_affinity_and_slurm_s_share_not_the_machine_s(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--workers N` split `os.cpu_count()` threads among its workers: on a 64-core node a Slurm job given 4 cores
    (its cgroup, `--cpus-per-task=4`) ran each of 2 workers on 32 threads, and a resumed run widened to the node's
    count. The share now comes from what this process may run on."""
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    allowed = os.sched_getaffinity(0)
    assert usable_cores() == len(allowed)
    os.sched_setaffinity(0, {min(allowed)})  # as `taskset -c 0` or a one-core cgroup leaves it
    try:
        assert usable_cores() == 1 < (os.cpu_count() or 1)
    finally:
        os.sched_setaffinity(0, allowed)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    assert usable_cores() == 1
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "²")  # not Slurm's (a digit to isdigit, not to int): the affinity alone
    assert usable_cores() == len(allowed)
