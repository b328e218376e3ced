"""Checkpoints: the whole training state, written atomically, read back as data only.

A checkpoint holds everything an exact resume needs: model, optimizer, grad scaler, the step, every RNG (python,
numpy, torch, CUDA), the data sampler's position, the loop's running loss, the fast-fail guard's threshold and the
resolved config. It is written to a temporary file, fsynced and renamed, so a crash or a full disk mid-write leaves
the previous checkpoint intact; its SHA-256 is returned for the caller to record. It is read with
`torch.load(weights_only=True)`: a checkpoint another worker wrote is data, never code. A file whose hash does not
match, or that is truncated, is refused with `CheckpointError`.

A write that fails is a fault of the machine, not of the run: `CheckpointWriteError`, an `OSError` whose `errno` says
which (ENOSPC for a full disk, whether the OS said so or torch's writer only failed opaquely) and whose message names
the path and the free space.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import hashlib
import os
import random
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.yaml_file import short_repr

__all__ = ["CheckpointError", "CheckpointInfo", "CheckpointWriteError", "LoopState", "TrainState", "WarmStart",
           "capture_rng", "load_checkpoint", "restore_rng", "save_checkpoint", "save_checkpoints", "sha256_of",
           "user_checkpoint"]

FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted: missing, truncated, corrupt, or not what its hash says."""


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written: a full disk, a read-only or lost mount, an I/O error. A fault of the
    machine, not of the run or its config. `errno` says which (ENOSPC: no space left; None when the failure had no
    code), `filename` is the checkpoint's path. The temporary file is gone, and a previous checkpoint at that path is
    as it was."""

    def __init__(self, code: int | None, message: str, filename: str) -> None:
        super().__init__(code, message, filename)

    def __str__(self) -> str:
        return str(self.strerror)  # the one-line message, which names the path already


@dataclass(frozen=True)
class LoopState:
    """The loop's own running values that an exact resume needs, besides model, optimizer, data position and RNGs.

    Saved as a plain mapping of these keys (format 1, as checkpoints have always held it); a key that a mapping lacks
    takes its default, the state of a loop that has not started.
    """

    loss_sum: float = 0.0  # the training loss summed since the last log step (read back from the device when saved)
    steps_since_log: int = 0  # the steps in that sum
    guard_threshold: float | None = None  # the fast-fail guard's explosion threshold, set by the step-0 evaluation
    # torch's intra-op threads the run trained with (a CPU sums in another order on another count): a resume takes
    # the same count, so that it continues bit for bit (`trainer.loop.train`). None: not recorded.
    threads: int | None = None

    def as_dict(self) -> dict[str, Any]:
        values = asdict(self)
        if self.threads is None:  # then the mapping is the one older checkpoints hold
            del values["threads"]
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LoopState:
        threshold, threads = values.get("guard_threshold"), values.get("threads")
        return cls(loss_sum=float(values.get("loss_sum", 0.0)), steps_since_log=int(values.get("steps_since_log", 0)),
                   guard_threshold=None if threshold is None else float(threshold),
                   threads=threads if isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1
                   else None)


@dataclass
class TrainState:
    """Resume state as a typed record, not loose dict keys."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scaler: dict[str, Any]
    rng: dict[str, Any]
    data: dict[str, Any]
    loop: LoopState = field(default_factory=LoopState)
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    user: dict[str, Any] = field(default_factory=dict)  # a user's own loop's state (`run.save`); the trainer's: empty
    # Every evaluation of the run up to `step`, (step, metrics), its resumed-from runs' included: the curve a retry
    # copies when the reports that would hold it never reached the study (lost with the worker in a storage outage).
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    def payload(self) -> dict[str, Any]:
        payload = {"format": FORMAT, "step": self.step, "model": self.model, "optimizer": self.optimizer,
                   "scaler": self.scaler, "rng": self.rng, "data": self.data, "loop": self.loop.as_dict(),
                   "config": self.config, "metrics": self.metrics}
        if self.user:  # only then: the trainer's checkpoints stay as they have always been
            payload["user"] = self.user
        if self.evals:  # plain lists and floats, which a weights-only load reads
            payload["evals"] = [[int(step), {str(k): float(v) for k, v in metrics.items()}]
                                for step, metrics in self.evals]
        return payload

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> TrainState:
        if payload.get("format") != FORMAT:
            raise CheckpointError(f"unknown checkpoint format {payload.get('format')!r}, expected {FORMAT}")
        # What the trainer reads without a check of its own: a file that matches its hash but holds something else
        # (written by another tool, or edited) is refused here, as an unreadable one is, and an older one is tried.
        missing = [key for key in _PAYLOAD_KEYS if key not in payload]
        if missing:
            raise CheckpointError(f"not a training state: {', '.join(map(repr, missing))} missing")
        step = payload["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(f"not a training state: its step is {short_repr(step)}, expected a whole number")
        for key in ("model", "optimizer", "rng", "data", "config", "metrics", "loop"):
            if not isinstance(payload[key], dict):
                raise CheckpointError(f"not a training state: its {key!r} is {type(payload[key]).__name__}, expected "
                                      "a mapping")
        try:
            loop = LoopState.from_dict(payload["loop"])
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"not a training state: its 'loop' is unreadable ({exc})") from None
        return cls(**{k: payload[k] for k in ("step", "model", "optimizer", "scaler", "rng", "data", "config",
                                              "metrics")}, loop=loop,
                   user=payload.get("user") or {}, evals=_evals(payload.get("evals")))


_PAYLOAD_KEYS = ("step", "model", "optimizer", "scaler", "rng", "data", "config", "metrics", "loop")


def _evals(stored: Any) -> list[tuple[int, dict[str, float]]]:
    """A checkpoint's evaluation history; a malformed one (or none: a checkpoint written before it was kept) is
    empty: it only fills gaps in a retry's curve, never its training state."""
    try:
        return [(int(step), {str(k): float(v) for k, v in metrics.items()}) for step, metrics in stored or []]
    except (TypeError, ValueError, AttributeError):
        return []


def user_checkpoint(step: int, state: Mapping[str, Any], config: Mapping[str, Any],
                    metrics: Mapping[str, float] | None = None) -> TrainState:
    """A checkpoint of a user's own training loop (a sweep `loop` or `command`): its `state` (tensors and plain
    values, as `state_dict()`s are) as `user`, with every RNG's state now, its config and the metrics reported at
    `step`. The same file format, hash and `weights_only` loading as the trainer's. A value that loading would refuse
    (a numpy array, a whole module, a function) is a TypeError naming it, now rather than at the retry that needs
    it."""
    _check_loadable(state, "state")
    return TrainState(step=int(step), model={}, optimizer={}, scaler={}, rng=capture_rng(), data={},
                      config=dict(config), metrics=dict(metrics or {}), user=dict(state))


# What `torch.load(weights_only=True)` reads back: these types exactly (a numpy float is a float subclass, pickled
# as numpy's, and refused), tensors and torch's own small types, and dicts, lists, tuples and sets of them.
_PLAIN = {int, float, bool, str, bytes, bytearray, complex, type(None)}
_TORCH = (torch.Tensor, torch.dtype, torch.device, torch.Size)


def _check_loadable(value: Any, where: str) -> None:
    """Raise TypeError naming the first value in `value` that `torch.load(weights_only=True)` would refuse."""
    if type(value) in _PLAIN or isinstance(value, _TORCH):
        return
    if type(value) in (dict, collections.OrderedDict):
        for key, item in value.items():
            _check_loadable(key, f"{where}: key {key!r}")
            _check_loadable(item, f"{where}[{key!r}]")
        return
    if type(value) in (list, tuple, set):
        for i, item in enumerate(value):
            _check_loadable(item, f"{where}[{i}]")
        return
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    hint = {"numpy": "torch.from_numpy(x), or float(x) for a number", "torch": "its .state_dict()"}.get(
        type(value).__module__.split(".")[0], "tensors and plain values (numbers, strings, lists, dicts)")
    raise TypeError(f"{where} is a {kind}, which a checkpoint cannot hold (it is read back with "
                    f"torch.load(weights_only=True)); save {hint} instead")


@dataclass(frozen=True)
class WarmStart:
    """Start a run from another run's checkpoint: its weights, and its optimizer state when `optimizer` is true."""

    state: TrainState
    optimizer: bool = False


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    sha256: str
    size: int
    step: int


def capture_rng() -> dict[str, Any]:
    """Every RNG's state, as tensors and plain values (what weights_only loading accepts)."""
    numpy_state = np.random.get_state(legacy=False)  # a dict; stored as the fields of the legacy tuple
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": numpy_state["bit_generator"],
                  "keys": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                  "pos": int(numpy_state["state"]["pos"]), "has_gauss": int(numpy_state["has_gauss"]),
                  "cached": float(numpy_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(_tuples(state["python"]))
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # As many devices as both runs see: a run resumed where fewer GPUs are visible (a worker pinned to one) would
        # otherwise fail on a device index it does not have. Training uses the first, which is always restored.
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


def _tuples(value: Any) -> Any:
    """random.setstate wants tuples where a round trip may have produced lists."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(path: str | Path, state: TrainState) -> CheckpointInfo:
    """Write atomically: temporary file, fsync, rename, fsync of the folder. Returns where, its hash and size.

    A failed write raises `CheckpointWriteError`, with the temporary file removed and a previous checkpoint at `path`
    left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    payload = state.payload()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as handle:
                torch.save(payload, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half of one
        finally:
            tmp.unlink(missing_ok=True)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)  # make the rename itself durable
        finally:
            os.close(folder)
    except OSError as exc:
        raise _write_error(path, exc, _tensor_bytes(payload)) from exc
    except RuntimeError as exc:
        if not _is_write_failure(exc):
            raise  # not the file system's doing
        raise _write_error(path, exc, _tensor_bytes(payload)) from exc
    return CheckpointInfo(path, sha256_of(path), path.stat().st_size, state.step)


def save_checkpoints(jobs: Sequence[tuple[Path, Callable[[], TrainState]]], *, max_parallel: int = 8,
                     max_bytes: int = 256 * 2**20) -> list[CheckpointInfo | BaseException]:
    """Several checkpoints at once (a cohort's members at one evaluation), each written as `save_checkpoint`
    writes it, but on threads, so that their fsyncs overlap and the file system commits them together (8 small
    files with their two fsyncs each, on the development machine's disk: 50-60 ms one after another, 5-12 ms at
    once). Each job's state is made on the calling thread, and only once the states in flight and one more of the
    last one's size fit in `max_bytes` (one is always let through). Returns, in the jobs' order, each one's
    `CheckpointInfo` or what its write raised; when making a state raises, that job's entry is the error and the
    jobs after it are not started (the list is shorter). Nothing is raised: the caller registers what was written,
    then raises."""
    results: list[CheckpointInfo | BaseException] = []
    if len(jobs) <= 1 or max_parallel <= 1:
        for path, make in jobs:
            try:
                results.append(save_checkpoint(path, make()))
            except Exception as exc:  # noqa: BLE001 - handed to the caller, which registers the others first
                results.append(exc)
                if not isinstance(exc, CheckpointWriteError):
                    break
        return results
    futures: list[concurrent.futures.Future[CheckpointInfo]] = []
    sizes: dict[concurrent.futures.Future[CheckpointInfo], int] = {}
    unmade: BaseException | None = None
    with concurrent.futures.ThreadPoolExecutor(min(max_parallel, len(jobs)), "checkpoint") as pool:
        last = 0  # the size of the state made last: the next one's, as far as can be known before it is made
        for path, make in jobs:
            while sizes and sum(sizes.values()) + last > max_bytes:
                done, _ = concurrent.futures.wait(sizes, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    del sizes[future]
            try:
                state = make()
            except Exception as exc:  # noqa: BLE001 - see above: the writes in flight finish and are returned
                unmade = exc
                break
            future = pool.submit(save_checkpoint, path, state)
            futures.append(future)
            sizes[future] = last = _tensor_bytes(state.payload())
        concurrent.futures.wait(futures)
    for future in futures:
        failure = future.exception()
        results.append(failure if failure is not None else future.result())
    return results + ([unmade] if unmade is not None else [])


def _why(error: Exception) -> str:
    """What `torch.load` refused, in one line. For a pickle that reaches for code, torch says it in paragraphs: that
    weights_only refused the file, advice to load it without (not advice to take about a file another worker
    wrote), then the global it refused; that last line is kept. Otherwise the first sentence."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        found = [line.removeprefix("WeightsUnpickler error: ") for line in lines[1:]
                 if line.startswith("WeightsUnpickler error:")]
        found = found or [line for line in lines[1:] if not line.startswith(("(", "Check the documentation"))]
        said = "weights_only refused it" + (f": {found[0]}" if found else "")
    else:
        said = lines[0].split(". ", 1)[0] if lines else ""
    said = said.split(" Please use ", 1)[0]
    return said[:300] or type(error).__name__


def load_checkpoint(path: str | Path, sha256: str | None = None, map_location: str | torch.device = "cpu",
                    ) -> TrainState:
    """Read a checkpoint as data only. With `sha256`, a file that does not match is refused before it is parsed."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} " + ("is not a file" if path.exists() else "does not exist"))
    if sha256 is not None and sha256_of(path) != sha256:
        raise CheckpointError(f"checkpoint {path} does not match its recorded hash: refusing to load it")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated zip, pickle errors, disallowed globals: all untrustworthy
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(exc).__name__}: {_why(exc)})") from exc
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint {path} holds {type(payload).__name__}, not a training state")
    return TrainState.from_payload(payload)


def _is_write_failure(exc: RuntimeError) -> bool:
    """torch's zip writer reports a failed or short write as a bare RuntimeError: "[enforce fail at
    inline_container.cc:...] . unexpected pos ..." (a full disk) or "PytorchStreamWriter failed writing file ..."."""
    message = str(exc)
    return "inline_container" in message or "PytorchStreamWriter" in message


def _file_in_the_way(folder: Path) -> Path | None:
    """The closest of `folder` and the folders above it that exists, when it is no folder (a file put in its place)."""
    for candidate in (folder, *folder.parents):
        if candidate.exists() or candidate.is_symlink():
            return None if candidate.is_dir() else candidate
    return None


def _write_error(path: Path, exc: OSError | RuntimeError, size: int) -> CheckpointWriteError:
    """The machine fault behind a failed write, in one line. The OS's own errno when it gave one; torch's writer gives
    none: the disk was full if it has less free space (the temporary file gone) than the checkpoint's tensors take."""
    free = _free_bytes(path.parent)
    own = exc.errno if isinstance(exc, OSError) else None
    space = "free space unknown" if free is None else f"{_bytes(free)} free"
    code: int | None
    if own == errno.ENOSPC and _free_files(path.parent) == 0:  # the file system's inodes, not its bytes, ran out
        code, reason = errno.ENOSPC, f"no free inodes left on its file system (no new file can be made there; {space})"
    elif own == errno.ENOSPC or (own is None and free is not None and free < size):
        code, reason = errno.ENOSPC, f"no space left on device ({space}; the checkpoint needs at least {_bytes(size)})"
    elif own in (errno.EEXIST, errno.ENOTDIR) and (blocked := _file_in_the_way(path.parent)) is not None:
        code, reason = own, f"{blocked} is a file, not a folder"  # mkdir's "file exists" named neither
    elif own is not None:
        code, reason = own, f"{os.strerror(own).lower()} ({space})"  # read-only file system, I/O error, ...
    else:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        code = errno.EIO if isinstance(exc, RuntimeError) else None  # a short write that a full disk does not explain
        reason = f"the write failed: {first_line} ({space})"
    return CheckpointWriteError(code, f"cannot write checkpoint {path}: {reason}", str(path))


def _free_bytes(folder: Path) -> int | None:
    """Free space for an unprivileged writer on the file system of `folder` (or of its nearest existing parent)."""
    for candidate in (folder, *folder.parents):
        try:
            return shutil.disk_usage(candidate).free
        except FileNotFoundError:
            continue
        except OSError:
            return None
    return None


def _free_files(folder: Path) -> int | None:
    """Free inodes for an unprivileged writer on the file system of `folder` (or of its nearest existing parent); None
    where it cannot say (a file system that counts none reports 0 files in all: None too)."""
    for candidate in (folder, *folder.parents):
        try:
            stats = os.statvfs(candidate)
        except FileNotFoundError:
            continue
        except (OSError, AttributeError):
            return None
        return stats.f_favail if stats.f_files else None
    return None


def _tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in a nested payload: a lower bound of the file's size."""
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.numel()
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return 0
    # Only what may hold a tensor is followed: an RNG state is a tuple of 625 ints.
    return sum(_tensor_bytes(v) for v in value if isinstance(v, (torch.Tensor, dict, list, tuple)))


def _bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
