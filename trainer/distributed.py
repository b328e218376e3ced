"""Data-parallel training of one run over several processes ("ranks"): DistributedDataParallel, torchrun-style.

One run, N processes, one model: every rank builds the same model from the same seed, DDP averages the gradients,
and every rank takes the same optimizer step. The data: the global batch is the config's `batch_size` (per
micro-batch), and every rank draws the SAME global batch indices from the same seeded sampler and keeps its own
contiguous slice of `batch_size / N` of them; so the data order, the sampler's position in a checkpoint and the
metrics are those of the one-rank run, up to the floating-point order of the gradient all-reduce.

Between ranks, per evaluation, exactly one small collective: rank 0 (which alone reports to a driver) broadcasts its
verdict, continue or stop (`Ranks.verdict`). Every rank evaluates the whole validation set itself (their weights
are the same), so every rank's result holds the same metrics and fast-fail reference. Besides that: one all-reduce
per log step (the logged train_loss is the global batch's mean) and, with fast-fail on, one per guard check (a
NaN/Inf or exploding loss on ANY rank brings the evaluation forward on all of them). None per step beyond DDP's own
gradient all-reduce.

`Ranks()` is one process (the null object: every call does nothing); `ProcessGroup` is a real group. A group joins
from a torchrun environment (`from_environment`: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or rank 0
starts the other ranks itself as `python -m trainer.rank` children (`local_ranks`): that is how a sweep worker runs a
trial on N devices. Every collective has a timeout, so a rank that dies takes the others down within it instead of
hanging them forever; gloo notices a closed connection at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from trainer.checkpoint import TrainState, save_checkpoint
from trainer.config import ConfigError, DeviceUnavailable, TrainingConfig
from trainer.lifetime import signal_on_parent_death
from trainer.sync import allowed_sync

__all__ = ["DEFAULT_TIMEOUT_S", "LOST_EXIT", "ProcessGroup", "RankFailed", "RankResult", "Ranks", "collective_failed",
           "die_with_parent", "free_port", "from_environment", "join_parent", "local_ranks", "signal_name"]

DEFAULT_TIMEOUT_S = 300.0  # how long a collective waits for a rank that neither answers nor closes its connection
ADDRESS = "127.0.0.1"


class Ranks:
    """One process: rank 0 of 1. Every method is what a group would do, done for one: nothing."""

    rank = 0
    world = 1
    local_rank = 0

    @property
    def is_main(self) -> bool:
        """Whether this rank talks to the driver (reports, checkpoints): rank 0."""
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """This rank's device, given the config's."""
        return device

    def wrap(self, model: nn.Module) -> nn.Module:
        """What runs the training steps: the model, or DDP around it."""
        return model

    def defer_sync(self, model: nn.Module, *, compiled: bool) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        """What defers the gradient all-reduce during a step's earlier micro-batches: nothing to defer here."""
        return contextlib.nullcontext

    def check_batch(self, config: TrainingConfig) -> None:
        """Refuse a global batch that the ranks cannot split evenly."""

    def shard(self, indices: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the global batch's indices."""
        return indices

    def agree(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (all-reduce MAX)."""
        return flag

    def verdict(self, stop: bool) -> bool:
        """Rank 0's decision, on every rank (a broadcast): the one collective of an evaluation."""
        return stop

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar tensor over the ranks."""
        return value

    def total(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of a scalar tensor over the ranks, in float32 (on the device: no sync)."""
        return value.to(torch.float32)

    def finish(self) -> None:
        """After a clean end: wait for every rank to get here, then leave the group (`close`)."""

    def close(self) -> None:
        pass


class ProcessGroup(Ranks):
    """This process's place in an initialised `torch.distributed` group: NCCL on CUDA, gloo on a CPU."""

    def __init__(self, rank: int, world: int, local_rank: int, device_type: str) -> None:
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.cuda = device_type == "cuda"
        # NCCL's collectives take CUDA tensors; gloo's take CPU ones.
        self.comm = torch.device("cuda", local_rank) if self.cuda else torch.device("cpu")

    @classmethod
    def join(cls, rank: int, world: int, *, init_method: str | None = None, store: dist.Store | None = None,
             local_rank: int | None = None, device_type: str | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> ProcessGroup:
        """Join a group of `world` ranks, met at `init_method` or through `store` (blocks until all have joined, up
        to the timeout)."""
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        local = rank if local_rank is None else local_rank
        if device_type == "cuda":
            torch.cuda.set_device(local)
            # A collective that times out (a peer died or hangs) raises in the calling thread, where rank 0 turns it
            # into a retried trial, instead of NCCL's watchdog aborting the whole process: rank 0 is the sweep
            # worker. (Not yet run on GPUs: no GPU in this project's sessions.)
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=init_method, store=store,
                                rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        return cls(rank, world, local, device_type)

    def device(self, device: torch.device) -> torch.device:
        return torch.device("cuda", self.local_rank) if device.type == "cuda" else device

    def wrap(self, model: nn.Module) -> nn.Module:
        # DDP broadcasts rank 0's parameters at construction (they are equal already: the same seed built them) and
        # averages the gradients in backward; `model` itself stays what is evaluated and saved, without `module.`.
        return nn.parallel.DistributedDataParallel(model, device_ids=[self.local_rank] if self.cuda else None)

    def defer_sync(self, model: nn.Module, *, compiled: bool) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        # DDP's no_sync: gradients accumulate locally, and the step's last backward averages their sum. Not under
        # torch.compile, whose DDP support splits the graph at buckets and is not tested here with no_sync.
        if compiled or not isinstance(model, nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext
        return model.no_sync

    def check_batch(self, config: TrainingConfig) -> None:
        if config.batch_size % self.world:
            raise ConfigError([("batch_size", f"expected a multiple of the {self.world} ranks (the global batch is "
                                              f"split evenly between them), got {config.batch_size}")])

    def shard(self, indices: torch.Tensor) -> torch.Tensor:
        size = len(indices) // self.world
        return indices[self.rank * size:(self.rank + 1) * size]

    def agree(self, flag: bool) -> bool:
        value = torch.tensor([float(flag)], device=self.comm)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        with allowed_sync():  # an intended read-back, at a check step
            return bool(value.item())

    def verdict(self, stop: bool) -> bool:
        value = torch.tensor([float(stop)], device=self.comm)
        dist.broadcast(value, src=0)
        with allowed_sync():  # an intended read-back, at an evaluation
            return bool(value.item())

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        return self.total(value) / self.world

    def total(self, value: torch.Tensor) -> torch.Tensor:
        total = value.detach().to(self.comm, torch.float32).clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total.to(value.device)

    def finish(self) -> None:
        # A rank that tore its connections down while another still finished its last collective would make that
        # one's gloo abort; after the barrier every rank is past all of them.
        dist.barrier()
        self.close()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankEnvironmentError(ValueError):
    """The environment's description of the group (torchrun's variables) is incomplete or malformed."""


def from_environment(timeout_s: float = DEFAULT_TIMEOUT_S, device_type: str | None = None) -> Ranks:
    """The group torchrun (or `local_ranks`) describes in this process's environment, joined; one process (`Ranks()`)
    when WORLD_SIZE is unset or 1. A variable missing or malformed raises `RankEnvironmentError`, naming it."""
    world = _environment_int("WORLD_SIZE", "1", low=0)
    if world <= 1:
        return Ranks()
    rank = _environment_int("RANK", None, low=0, high=world - 1)
    local_rank = _environment_int("LOCAL_RANK", str(rank), low=0)
    if not os.environ.get("MASTER_ADDR", "").strip():
        raise _unset("MASTER_ADDR")
    _environment_int("MASTER_PORT", None, low=1, high=65535)
    return ProcessGroup.join(rank, world, init_method="env://", local_rank=local_rank, device_type=device_type,
                             timeout_s=timeout_s)


def _unset(name: str) -> RankEnvironmentError:
    return RankEnvironmentError(f"{name}: not set, with WORLD_SIZE={os.environ.get('WORLD_SIZE')}: start the ranks "
                                "with torchrun, which sets it")


def _environment_int(name: str, default: str | None, *, low: int, high: int | None = None) -> int:
    text = os.environ.get(name, default)
    if text is None:
        raise _unset(name)
    try:
        value = int(text.strip(), 10) if text.strip().isascii() else None
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise RankEnvironmentError(f"{name}: expected a whole number {span}, got {text!r}")
    return value


def join_parent(timeout_s: float = DEFAULT_TIMEOUT_S, device_type: str | None = None) -> ProcessGroup:
    """In a child that `local_ranks` started: say so in rank 0's store (rank 0 waits for that, watching for children
    that die first), then join the group through it."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device_type == "cuda":  # a GPU it cannot have fails it before it says it started: rank 0 sees that at once
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    store.set(f"{_STARTED}{rank}", "1")
    return ProcessGroup.join(rank, world, store=store, local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                             device_type=device_type, timeout_s=timeout_s)


_STARTED = "sweep/started/"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick for port 0): a new one for each trial's group."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((ADDRESS, 0))
        return int(probe.getsockname()[1])


PARENT_ENV = "SWEEP_RANK_PARENT"  # rank 0's pid, in a child's environment (`die_with_parent`)


def die_with_parent() -> None:
    """In a child that `local_ranks` started: end with rank 0, even when it was SIGKILLed while this rank was stuck
    in code of its own (a hang no collective notices, since none is running). Linux's parent-death signal; elsewhere
    the group's collectives notice a dead rank 0."""
    parent = os.environ.get(PARENT_ENV)
    if parent is not None and not signal_on_parent_death(signal.SIGKILL, int(parent)):  # rank 0 died already
        os._exit(LOST_EXIT)


def exit_process(code: int) -> NoReturn:
    """End a rank's process (a torchrun rank, or a child `local_ranks` started) with `code`, once its group is done
    with: stdout and stderr flushed, then `os._exit`, past the interpreter's shutdown. At that shutdown, C++ static
    destructors tear down what gloo and the store left behind, and now and then abort on a thread still joinable
    ("terminate called without an active exception", SIGABRT: 2 of 34 torchrun runs of a 20-step config on this
    2-core CPU), which would turn a run that finished, its result printed, into a failed one for torchrun."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing more to say on it
            stream.flush()
    os._exit(code)


# A child's exit code when one of its collectives failed (a peer died, or did not answer within the timeout): the
# group is lost, not the rank's own error; rank 0 retries the trial (`RankFailed.lost`). EX_TEMPFAIL, from sysexits.h.
LOST_EXIT = 75


class RankFailed(RuntimeError):
    """A rank other than 0 died, failed or hung: the run cannot go on. `lost` when a signal killed it or it did not
    answer within the timeout (a fault of the machine, or an operator's SIGKILL: worth a retry); otherwise it exited
    with an error of its own (`tail`: its last output). `rank` is None for a hang: a collective does not say whose."""

    def __init__(self, rank: int | None, returncode: int | None, tail: str = "", *, timeout_s: float = 0.0) -> None:
        self.rank, self.returncode, self.tail = rank, returncode, tail
        self.signal = -returncode if returncode is not None and returncode < 0 else None
        self.lost = returncode is None or self.signal is not None or returncode == LOST_EXIT
        # Its exception's line, else its last line (torch prefixes a rank's traceback lines with "[rankN]: "): an
        # exception whose message spans lines ends with advice ("In addition, you can set ...") that says nothing.
        lines = [re.sub(r"^\[rank\d+\]:\s*", "", line) for line in tail.strip().splitlines()]
        raised = [line for line in lines if _EXCEPTION_LINE.match(line)]
        last = raised[-1] if raised else lines[-1] if lines else ""
        if UNUSED_PARAMETERS in last:  # its advice (`find_unused_parameters=True`) names an option sweep does not take
            last = ("RuntimeError: the model has parameters its loss does not use, which DDP cannot train on several "
                    "ranks: leave them out of the model, or give them a part in the loss")
        last = last[:300]
        if returncode is None:
            message = f"a rank did not answer within the collective timeout of {timeout_s:g} s (hung)"
        elif self.signal is not None:
            message = f"rank {rank} was killed by {signal_name(self.signal)}"
        elif returncode == LOST_EXIT:
            message = f"rank {rank} lost the group (a collective failed)" + (f": {last}" if last else "")
        elif returncode == 0:  # its code (a sys.exit(0) in a task's function) ended it: the others cannot go on
            message = f"rank {rank} ended (exit code 0) before the run did" + (f": {last}" if last else "")
        else:
            message = f"rank {rank} exited with code {returncode}" + (f": {last}" if last else "")
        super().__init__(message)


def signal_name(signum: int) -> str:
    """SIGKILL, SIGRTMIN+3, or "signal 99" for a number this platform does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        if hasattr(signal, "SIGRTMIN") and signal.SIGRTMIN <= signum <= signal.SIGRTMAX:
            return f"SIGRTMIN+{signum - signal.SIGRTMIN}"
        return f"signal {signum}"


UNUSED_PARAMETERS = "parameters that were not used in producing loss"  # DDP's error, in the torch versions we run on
_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)(: |$)")


@dataclass
class RankResult:
    """What a child rank printed when it finished: its status and the step it stopped at; and its exit code."""

    rank: int
    status: str
    steps: int
    exit_code: int | None = None


@dataclass
class LocalGroup:
    """`local_ranks`'s handle: rank 0's group, and the children's pids and results (after the block)."""

    group: ProcessGroup
    pids: list[int]
    results: list[RankResult] = field(default_factory=list)


def _remove_stale_rank_folders() -> None:
    """The rank folders (`sweep-ranks-PID-*`: config, logs, a copy of the start state) of workers that died without
    cleaning up (SIGKILL, the OOM killer): removed when their process is gone. Another user's, or a live one's, stay."""
    for folder in Path(tempfile.gettempdir()).glob("sweep-ranks-*-*"):
        pid = folder.name.split("-")[2]
        try:
            if not pid.isdigit() or folder.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # alive (another user's process: EPERM), or the folder went meanwhile
            continue


# A rank imports what rank 0 imports: its `sys.path`, in its order, is the PYTHONPATH each rank is given, and `-P`
# (Python 3.11 and later) keeps `python -m` from putting the working folder before it, where a same-named task module
# (a `tasks.py` there as well as beside the study) would be another rank's data and model.
_RANK_PYTHON = [sys.executable, "-P"] if sys.version_info >= (3, 11) else [sys.executable]


@contextlib.contextmanager
def local_ranks(config: TrainingConfig, world: int, *, resume: TrainState | None = None,
                warm: TrainState | None = None, warm_optimizer: bool = False,
                timeout_s: float = DEFAULT_TIMEOUT_S, withheld: Collection[str] = (),
                end_on: Collection[int] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[LocalGroup]:
    """Run this process as rank 0 of `world` and start ranks 1..world-1 as `python -m trainer.rank` children on this
    machine, with `config` and the run's start (`resume` or `warm`, handed over as a checkpoint file, read back with
    `weights_only`); they never see a driver. The children see this process's `sys.path` (a user's task module) and
    environment but the variables named in `withheld` (a driver's secrets), and run in their own session (a
    terminal's Ctrl-C reaches rank 0 alone, which ends them).

    On leaving, normally or not, the group is destroyed and the children are joined: after a clean end they finish
    on their own; otherwise (an exception, Ctrl-C) they are terminated, and killed a few seconds later. A child that
    died first turns the exception of rank 0's failed collective into `RankFailed`.

    A signal in `end_on` (Ctrl-C, SIGTERM) ends the children at once, even while rank 0 waits in a collective or
    for the group to form, where Python runs no signal handler until the wait ends (a hung rank: the whole timeout):
    the wait then fails now, and the handler runs."""
    _check_devices(config, world)
    _remove_stale_rank_folders()
    folder = Path(tempfile.mkdtemp(prefix=f"sweep-ranks-{os.getpid()}-"))
    children: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    group: ProcessGroup | None = None
    try:
        config_file = folder / "config.json"
        config_file.write_text(json.dumps(config.to_dict()))
        args = [str(config_file)]
        state = resume if resume is not None else warm
        if state is not None:
            save_checkpoint(folder / "start.pt", state)
            args += ["--resume" if resume is not None else "--warm", str(folder / "start.pt")]
            args += ["--warm-optimizer"] if warm is not None and warm_optimizer else []
        # Rank 0's store, on a port the OS picks now (port 0): a new one for each trial's group.
        store = dist.TCPStore(ADDRESS, 0, world, is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        port = store.port
        path = os.pathsep.join([p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
        for rank in range(1, world):
            env = {**{name: value for name, value in os.environ.items() if name not in withheld},
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": ADDRESS,
                   "MASTER_PORT": str(port), "PYTHONPATH": path, "SWEEP_RANK_TIMEOUT_S": str(timeout_s),
                   PARENT_ENV: str(os.getpid())}
            logs.append(folder / f"rank{rank}.log")
            with open(logs[-1], "wb") as log:
                children.append(subprocess.Popen([*_RANK_PYTHON, "-m", "trainer.rank", *args], env=env, stdout=log,
                                                 stderr=subprocess.STDOUT, start_new_session=True))
        _wait_started(store, children, logs, timeout_s)
        with _ended_on(end_on, children):
            try:  # a child that died, exited or hung after it said it started: as in a collective below
                group = ProcessGroup.join(0, world, store=store, device_type=_device_type(config),
                                          timeout_s=timeout_s)
            except BaseException as exc:  # noqa: BLE001 - raised again, as what it means
                _raise_rank_failure(exc, children, logs, timeout_s)
            handle = LocalGroup(group, [child.pid for child in children])
            try:
                yield handle
                # Past this barrier every rank has finished training: how a child then exits (gloo's teardown has
                # been seen to abort now and then) changes nothing of the run; its exit code is kept with its result.
                # A child that dies before it fails the run as any collective would.
                group.finish()
            except BaseException as exc:  # noqa: BLE001 - raised again, as what it means
                _raise_rank_failure(exc, children, logs, timeout_s)
        group = None
        _end(children, grace_s=timeout_s, terminate=False)
        handle.results = [_result(rank, log, child.returncode) for rank, (child, log)
                          in enumerate(zip(children, logs), start=1)]
    finally:
        if group is not None:
            group.close()
        _end(children, grace_s=5.0)
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _ended_on(signals: Collection[int], children: list[subprocess.Popen[bytes]]) -> Iterator[None]:
    """While the block runs, a signal in `signals` that reaches this process sends the children SIGTERM at once,
    from a thread that hears of it through Python's wakeup fd (the handlers stay as they are and run as before). Only
    in the main thread, which alone may set the wakeup fd; one set before is passed every byte."""
    if not signals or threading.current_thread() is not threading.main_thread():
        yield
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not possible here: the children are ended when the handler's exception comes
        reader.close()
        writer.close()
        yield
        return
    wanted = {int(signum) for signum in signals}

    def watch() -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:  # the block ended
                return
            if previous != -1:
                with contextlib.suppress(OSError):
                    os.write(previous, data)
            if wanted.intersection(data):  # SIGTERM, then SIGKILL for one that has not ended 5 s later
                with contextlib.suppress(Exception):  # a thread of its own: nothing to raise to
                    _end(children, grace_s=5.0)

    thread = threading.Thread(target=watch, daemon=True, name="rank-signals")
    thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        writer.close()
        thread.join(timeout=5.0)
        reader.close()


def _raise_rank_failure(exc: BaseException, children: list[subprocess.Popen[bytes]], logs: list[Path],
                        timeout_s: float) -> NoReturn:
    """Rank 0's `exc` (raised while the children run) as the `RankFailed` of the child that caused it, or of a hang
    when a collective or the group's store timed out; else `exc` itself. The children are ended either way."""
    # Which children had ended before we end them: a rank's death closes its connections as it exits, so rank 0's
    # failed collective may come a moment before the exit code does.
    exited = [_exit_code(child, 2.0 if isinstance(exc, Exception) else 0.0) for child in children]
    _end(children, grace_s=5.0)
    failed = _first_failure(exited, logs, early=_peer_gone(exc))
    if failed is None and collective_failed(exc):
        failed = RankFailed(None, None, timeout_s=timeout_s)
    if failed is not None and isinstance(exc, Exception):
        raise failed from exc
    raise exc


def _wait_started(store: dist.TCPStore, children: list[subprocess.Popen[bytes]], logs: list[Path],
                  timeout_s: float) -> None:
    """Until every child has said it started (`join_parent`): one that exits first fails the run now, not after
    the timeout that joining the group would wait."""
    keys = [f"{_STARTED}{rank}" for rank in range(1, len(children) + 1)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        failed = _first_failure([child.poll() for child in children], logs, early=True)
        if failed is not None:
            raise failed
        if time.monotonic() > deadline:
            raise RankFailed(None, None, timeout_s=timeout_s)
        time.sleep(0.02)


def _check_devices(config: TrainingConfig, world: int) -> None:
    """Before any child starts: this machine has the devices `world` ranks train on (rank r on `cuda:r`), else
    `DeviceUnavailable`, the machine's shortcoming, which a sweep retries on another worker. Found by a child, it
    was that child's exit code 1, read as the config's failure."""
    from trainer.precision import resolve_device

    device = resolve_device(config.device)
    count = torch.cuda.device_count() if device.type == "cuda" else world
    if count < world:
        raise DeviceUnavailable(f"device {config.device!r} on {world} ranks needs {world} CUDA devices (rank r "
                                f"trains on cuda:r), but torch sees {count}")


def _device_type(config: TrainingConfig) -> str:
    from trainer.precision import resolve_device

    return resolve_device(config.device).type


def _end(children: list[subprocess.Popen[bytes]], *, grace_s: float, terminate: bool = True) -> None:
    """Wait for the children (after SIGTERM when `terminate`; a stopped one is continued, so that it takes the
    SIGTERM now); any still running `grace_s` after is killed."""
    for child in children:
        if terminate and child.poll() is None:
            with contextlib.suppress(OSError):  # ended meanwhile
                child.terminate()
                child.send_signal(signal.SIGCONT)  # stopped (SIGSTOP, ^Z, a debugger): its SIGTERM waits for this
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _exit_code(child: subprocess.Popen[bytes], wait_s: float) -> int | None:
    try:
        return child.wait(timeout=wait_s) if wait_s else child.poll()
    except subprocess.TimeoutExpired:
        return None


def collective_failed(exc: BaseException) -> bool:
    """Whether `exc` is a collective (or the group's store) failing on a peer that died or did not answer: torch's
    distributed errors, and the plain RuntimeError gloo raises for a timeout; not a rank's own errors that merely
    mention a timeout (a storage's or a driver's: subclasses of RuntimeError)."""
    if isinstance(exc, dist.DistError):
        return True
    return type(exc) is RuntimeError and "timed out" in str(exc).lower()


def _first_failure(codes: list[int | None], logs: list[Path], *, early: bool) -> RankFailed | None:
    """The first child that ended with an error or by a signal; with `early` (the run was under way: its children
    had not finished), else the first that ended at all, with code 0 (review: a rank whose task's code called
    sys.exit(0) failed the trial with gloo's "Connection closed by peer", naming no rank). The codes are read before
    rank 0 ends its children, so a SIGTERM among them came from outside (a batch system's preemption signals the
    whole job): lost, retried."""
    for rank, (code, log) in enumerate(zip(codes, logs), start=1):
        if code is not None and code != 0:
            return RankFailed(rank, code, _tail(log))
    for rank, (code, log) in enumerate(zip(codes, logs), start=1):
        if early and code == 0:
            return RankFailed(rank, code, _tail(log))
    return None


def _peer_gone(exc: BaseException) -> bool:
    """Whether rank 0's `exc` is a collective that failed because a peer went away or did not answer (then a child
    that exited 0 had ended before the run did), not rank 0's own error after its children had finished."""
    return collective_failed(exc) or (type(exc) is RuntimeError and any(
        words in str(exc) for words in ("Connection closed by peer", "Connection reset by peer", "Broken pipe")))


def _tail(log: Path, size: int = 2000) -> str:
    try:
        return log.read_bytes()[-size:].decode(errors="replace")
    except OSError:
        return ""


def _result(rank: int, log: Path, exit_code: int | None) -> RankResult:
    for line in reversed(_tail(log, 4000).splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                values: dict[str, Any] = json.loads(line)
                return RankResult(rank, str(values["status"]), int(values["steps"]), exit_code)
    return RankResult(rank, "unknown", -1, exit_code)
