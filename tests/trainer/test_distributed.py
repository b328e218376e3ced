"""The trainer alone, data-parallel on 2 gloo ranks of this CPU: this process is rank 0 (`local_ranks`), the other
rank a real `python -m trainer.rank` child. Tiny models, few steps; each test starts one child."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml

from tests.trainer.support import SaveAt
from trainer.checkpoint import WarmStart, load_checkpoint
from trainer.config import ConfigError, TrainingConfig
from trainer.distributed import ProcessGroup, RankFailed, local_ranks
from trainer.loop import NullReporter, TrainResult, train

# Two ranks' evaluations match one rank's up to the order of the gradient all-reduce's float sums: measured here,
# they agree to ~1e-7 relative over 40 steps (bench/distributed.py); the bound leaves room for other CPUs' kernels.
REL_TOL = 1e-4

CONFIG = {"task": "digits", "max_steps": 40, "eval_every_steps": 10, "log_every_steps": 10, "batch_size": 32,
          "learning_rate": 0.05, "model": {"hidden": 16}}


def config(**edits: object) -> TrainingConfig:
    return TrainingConfig.from_dict({**CONFIG, **edits})


def two_ranks(cfg: TrainingConfig, **kwargs: object) -> tuple[TrainResult, list[tuple[str, int]]]:
    """Train `cfg` on 2 ranks: rank 0's result, and each child's (status, steps)."""
    resume, warm = kwargs.pop("resume", None), kwargs.pop("warm_start", None)
    assert warm is None or isinstance(warm, WarmStart)
    with local_ranks(cfg, 2, resume=resume, warm=None if warm is None else warm.state,  # type: ignore[arg-type]
                     timeout_s=120) as ranks:
        result = train(cfg, resume=resume, warm_start=warm, ranks=ranks.group, **kwargs)  # type: ignore[arg-type]
    return result, [(r.status, r.steps) for r in ranks.results]


def assert_close(got: list[tuple[int, dict[str, float]]], want: list[tuple[int, dict[str, float]]]) -> None:
    assert [step for step, _ in got] == [step for step, _ in want]
    for (step, a), (_, b) in zip(got, want):
        for key in b:
            assert math.isclose(a[key], b[key], rel_tol=REL_TOL), (step, key, a[key], b[key])


@pytest.mark.slow
@pytest.mark.parametrize(("data_loader", "accumulation", "task"),
                         [("device", 1, "digits"), ("dataloader", 1, "digits"), ("device", 2, "digits"),
                          ("device", 1, "tests.e2e.ddp_tasks:padded"), ("dataloader", 2, "tests.e2e.ddp_tasks:padded")])
def test_two_ranks_report_what_one_rank_reports_within_the_tolerance(data_loader: str, accumulation: int,
                                                                      task: str) -> None:
    # With accumulation, the earlier micro-batches' gradients stay local (DDP's no_sync) and the step's last backward
    # averages their sum: the same gradient as one rank's. With padding (-100 targets), the ranks' slices keep
    # different numbers of targets: the mean of their means was not the global batch's mean (review).
    edits = {"data_loader": data_loader, "gradient_accumulation_steps": accumulation, "task": task}
    one = train(config(**edits), reporter=NullReporter())
    two, children = two_ranks(config(**edits), reporter=NullReporter())
    assert two.status == "completed" and children == [("completed", 40)]
    assert_close(two.evals, one.evals)
    # The logged train_loss is the global batch's mean, as with one rank, not rank 0's half of it.
    for a, b in zip(two.logs, one.logs):
        assert math.isclose(a["train_loss"], b["train_loss"], rel_tol=REL_TOL), (a, b)
    assert two.reproducibility["ranks"] == 2


class StopAt:
    def __init__(self, step: int) -> None:
        self.step = step
        self.asked: list[int] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        self.asked.append(step)
        return step >= self.step


@pytest.mark.slow
def test_rank_0_s_verdict_stops_every_rank_at_the_same_step() -> None:
    reporter = StopAt(20)
    result, children = two_ranks(config(), reporter=reporter)
    assert (result.status, result.steps) == ("stopped", 20)
    assert children == [("stopped", 20)]
    assert reporter.asked == [0, 10, 20]  # rank 0 alone is asked (step 0: fast-fail's reference evaluation)


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_and_warm_starts_one_rank(tmp_path: Path) -> None:
    one = train(config(), reporter=NullReporter())
    saver = SaveAt(20, tmp_path / "two.pt")
    two_ranks(config(), reporter=NullReporter(), checkpointer=saver)
    assert [info.step for info in saver.infos] == [20]  # rank 0 wrote it, once
    state = load_checkpoint(saver.path, saver.infos[0].sha256)
    assert not any(key.startswith("module.") for key in state.model)  # today's single-model format, no DDP prefix

    resumed = train(config(), reporter=NullReporter(), resume=state)  # on one rank: the tail of the one-rank run
    assert_close(resumed.evals, one.evals[-2:])

    warm = train(config(seed=7), reporter=NullReporter(), warm_start=WarmStart(state))
    assert warm.evals[0][0] == 20  # starts from the 2-rank run's step and weights: its evaluation there is the donor's
    assert_close(warm.evals[:1], [e for e in one.evals if e[0] == 20])


@pytest.mark.slow
def test_a_one_rank_checkpoint_resumes_on_two_ranks(tmp_path: Path) -> None:
    one = train(config(), reporter=NullReporter(), checkpointer=(saver := SaveAt(20, tmp_path / "one.pt")))
    state = load_checkpoint(saver.path)
    resumed, children = two_ranks(config(), reporter=NullReporter(), resume=state)
    assert children == [("completed", 40)]
    assert_close(resumed.evals, one.evals[-2:])


def test_a_global_batch_the_ranks_cannot_split_is_refused() -> None:
    group = ProcessGroup(0, 3, 0, "cpu")  # not joined: the check needs only the group's size
    with pytest.raises(ConfigError, match="expected a multiple of the 3 ranks"):
        group.check_batch(config(batch_size=32))
    group.check_batch(config(batch_size=33))


def test_each_rank_takes_its_own_contiguous_slice_of_the_global_batch() -> None:
    import torch

    indices = torch.arange(10, 18)
    slices = [ProcessGroup(rank, 2, rank, "cpu").shard(indices).tolist() for rank in range(2)]
    assert slices == [[10, 11, 12, 13], [14, 15, 16, 17]]


@pytest.mark.slow
def test_torchrun_trains_the_trainer_data_parallel_without_a_study(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "max_steps": 20}))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "trainer",
                           str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = done.stdout.splitlines()  # rank 0 alone prints
    result = json.loads(line)
    one = train(config(max_steps=20), reporter=NullReporter())
    assert (result["status"], result["steps"]) == ("completed", 20)
    assert math.isclose(result["metrics"]["val_loss"], one.metrics["val_loss"], rel_tol=REL_TOL)
    assert result["reproducibility"]["ranks"] == 2


class Fault:
    """A reporter that, at its evaluation of `step`, sends `signum` to the child rank."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum
        self.pids: list[int] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        if step == self.step:
            os.kill(self.pids[0], self.signum)
        return False


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "message"), [
    (signal.SIGKILL, "rank 1 was killed by SIGKILL"),
    (signal.SIGSTOP, "a rank did not answer within the collective timeout of 5 s (hung)"),
    # From outside (a batch system's preemption signals every process of the job): lost, retried, not failed.
    (signal.SIGTERM, "rank 1 was killed by SIGTERM"),
])
def test_a_rank_that_dies_or_hangs_fails_the_run_within_the_timeout(signum: int, message: str) -> None:
    fault = Fault(10, signum)
    started = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        with local_ranks(config(max_steps=400), 2, timeout_s=5) as ranks:
            fault.pids = ranks.pids
            train(config(max_steps=400), reporter=fault, ranks=ranks.group)
    assert str(failed.value) == message and failed.value.lost
    assert time.monotonic() - started < 120  # within the timeout (plus start-up), not forever
    assert not alive(fault.pids[0])  # ended and reaped: no orphan, no zombie


class Busy(NullReporter):
    """Rank 0 busy past the collective timeout at one evaluation (a slow checkpoint upload, a storage outage) while
    the other ranks wait for its verdict."""

    def __init__(self, step: int, seconds: float) -> None:
        self.step, self.seconds = step, seconds

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        if step == self.step:
            time.sleep(self.seconds)
        return False


@pytest.mark.slow
def test_a_rank_that_timed_out_waiting_for_rank_0_loses_the_group_and_the_run_is_retried() -> None:
    # Rank 1's collective times out and it exits as having lost the group; on a loaded machine rank 0's own wait for
    # it may time out first, and the run ends as hung: the same fault seen from either side, a retry either way.
    lost_or_hung = r"^(rank 1 lost the group \(a collective failed\)|a rank did not answer within the collective)"
    with pytest.raises(RankFailed, match=lost_or_hung) as failed:
        with local_ranks(config(max_steps=400), 2, timeout_s=3) as ranks:
            train(config(max_steps=400), reporter=Busy(10, 8.0), ranks=ranks.group)
    assert failed.value.lost  # the group's fault, not the rank's own error: worth a retry


@pytest.mark.slow
def test_a_child_that_dies_before_joining_fails_the_run_at_once(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # A real early death: the child's interpreter runs this sitecustomize (the children see rank 0's sys.path) and
    # exits before it reaches the group. Rank 0 must not wait out the 600 s that joining the group would.
    (tmp_path / "sitecustomize.py").write_text("import os\nif os.environ.get('RANK', '0') != '0':\n    os._exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"^rank 1 exited with code 3$") as failed:
        with local_ranks(config(), 2, timeout_s=600) as ranks:
            train(config(), reporter=NullReporter(), ranks=ranks.group)
    assert not failed.value.lost  # its own error: the trial fails, no retry
    assert time.monotonic() - started < 300


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "message", "lost"), [
    ("raise SystemExit(3)", r"^rank 1 exited with code 3$", False),
    ("os.kill(os.getpid(), signal.SIGKILL)", r"^rank 1 was killed by SIGKILL$", True),
    ("time.sleep(600)", r"^a rank did not answer within the collective timeout of 5 s \(hung\)$", True),
])
def test_a_child_that_fails_after_it_said_it_started_but_before_the_group_formed_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str, message: str, lost: bool) -> None:
    # Between its check-in and the group (a GPU's set_device that fails, a process killed then): rank 0's join of
    # the group times out in the store. That is the child's failure, named as in a collective, not a DistStoreError
    # blamed on the trial's config.
    (tmp_path / "sitecustomize.py").write_text(
        "import os, signal, time\n"
        "if os.environ.get('RANK', '0') != '0':\n"
        "    import torch.distributed as dist\n"
        "    def init_process_group(*args, **kwargs):\n"
        f"        {fault}\n"
        "    dist.init_process_group = init_process_group\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RankFailed, match=message) as failed:
        with local_ranks(config(), 2, timeout_s=5) as ranks:
            train(config(), reporter=NullReporter(), ranks=ranks.group)
    assert failed.value.lost is lost


def test_rank_folders_of_a_worker_that_died_are_removed_at_the_next_start_and_a_live_ones_are_kept() -> None:
    # A worker SIGKILLed during a data-parallel trial left its rank folder behind (config, logs, a copy of the start
    # state) on every kill.
    import tempfile

    from trainer.distributed import _remove_stale_rank_folders

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead = Path(tempfile.mkdtemp(prefix=f"sweep-ranks-{int(gone.stdout)}-"))
    (dead / "start.pt").write_bytes(b"state")
    live = Path(tempfile.mkdtemp(prefix=f"sweep-ranks-{os.getpid()}-"))
    try:
        _remove_stale_rank_folders()
        assert not dead.exists() and live.is_dir()
    finally:
        for folder in (dead, live):
            if folder.exists():
                for child in folder.iterdir():
                    child.unlink()
                folder.rmdir()


def test_a_rank_killed_by_a_signal_without_a_name_is_still_a_lost_rank() -> None:
    # Real-time signals have no name in Python's Signals: the message said ValueError instead of the rank's fate.
    rt = signal.SIGRTMIN + 6
    failed = RankFailed(1, -rt)
    assert str(failed) == "rank 1 was killed by SIGRTMIN+6" and failed.lost
    assert str(RankFailed(2, -int(signal.SIGKILL))) == "rank 2 was killed by SIGKILL"


def test_padding_is_found_in_any_slice_of_the_targets_and_only_where_the_loss_leaves_it_out() -> None:
    import dataclasses

    import torch

    from trainer.loop import holds_padding
    from trainer.tasks import load_task

    digits = load_task("digits", {})
    assert not holds_padding(digits, rows=100)
    x, y = digits.train
    last = y.clone()
    last[-1] = -100  # in the last slice of 100 rows only
    padded = dataclasses.replace(digits, train=(x, last))
    assert holds_padding(padded, rows=100) and holds_padding(padded)
    mse = dataclasses.replace(padded, loss=lambda out, target: torch.nn.functional.mse_loss(out, out.detach()))
    assert not holds_padding(mse, rows=100)  # a loss of its own counts every sample
