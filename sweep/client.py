"""The client a trial's command reports through: `from sweep import client; client.report(step, val_loss=...)`.

A study with `command: python train.py --lr {learning_rate}` runs the command once per trial. Its worker (which
owns every storage call) hands the process one end of a local socket pair, named by `SWEEP_REPORT_FD`; a report is
one JSON line down that socket, and the answer one line back: whether the trial must stop now (fast-fail or the
study's pruner decided, `--timeout` passed, the worker is stopping). So the same command works whatever the study's
storage is (SQLite, PostgreSQL), and the script needs no database driver, no Optuna and no torch: this module imports
only the standard library.

    from sweep import client

    config = client.config()                   # the trial's config (also in the command line, if it names keys)
    for step in range(...):
        ...
        if client.report(step, val_loss=loss):
            break                              # pruned: exit soon, or the worker kills the process group

Outside a study (the script run by hand) `report` only returns False, `save` does nothing and `config` returns {}
unless `SWEEP_CONFIG` is set, so a script needs no changes to run alone. `save(state)` and `load()` checkpoint
through the study's checkpoint service as a loop's `run.save` / `run.load` do (they import torch, when called). A
script that never reports still gets a result: its exit code, and the study's metric in the last line of its output
that is a JSON object holding it.
"""

from __future__ import annotations

import json
import math
import os
import select
import socket
import threading
from collections.abc import Mapping
from typing import Any

__all__ = ["ENV_CONFIG", "ENV_REPORT_FD", "ENV_START", "ENV_START_KIND", "ENV_START_SHA256", "ENV_START_STEP",
           "ENV_TRIAL", "config", "load", "report", "save", "start", "trial_number"]

ENV_REPORT_FD = "SWEEP_REPORT_FD"  # the file descriptor of this process's end of the worker's socket pair
ENV_TRIAL = "SWEEP_TRIAL"  # the trial's number
ENV_CONFIG = "SWEEP_CONFIG"  # the trial's config, as JSON
ENV_START = "SWEEP_START"  # a checkpoint to start from (a retry's or a donor's), when there is one
ENV_START_SHA256 = "SWEEP_START_SHA256"  # its hash, checked before it is read
ENV_START_KIND = "SWEEP_START_KIND"  # "resume" or "warm"
ENV_START_STEP = "SWEEP_START_STEP"  # the step it was saved at

_connection: socket.socket | None = None
# Lines the worker sent that no call has taken yet: answers to reports ("go", "stop") and to requests (JSON), kept
# apart, since a signal handler's save can be asked while a report waits for its answer (`_answer`).
_received = b""
_waiting: dict[bool, list[bytes]] = {False: [], True: []}
_stopped = False
_last: tuple[int, dict[str, float | str]] | None = None  # the latest report: its step and metrics
# One exchange with the worker at a time: threads of the script may report at once (an evaluation thread, a pool),
# and two threads reading the socket took each other's answers (one then waited for good) or each wrapped the
# descriptor in a socket of its own, whose collection closed it under the other (review). Re-entrant: a signal
# handler's save, run in the thread whose report waits for its answer, goes on (`_answer` keeps the two apart).
_exchange = threading.RLock()


def trial_number() -> int | None:
    """The trial this process runs, or None outside a study."""
    number = os.environ.get(ENV_TRIAL)
    return int(number) if number else None


def config() -> dict[str, Any]:
    """The trial's config as plain data (the study's fixed values, then the sampled ones, nested), or {}."""
    text = os.environ.get(ENV_CONFIG)
    return dict(json.loads(text)) if text else {}


def report(step: int, metrics: Mapping[str, float] | None = None, /, **values: float) -> bool:
    """Report metrics at `step` (one of them the study's metric); returns True when the trial must stop. Outside a
    study: False. Once told to stop, every later report returns True at once."""
    global _stopped, _last
    if _stopped:
        return True
    reported = {str(k): _number(v) for k, v in {**(metrics or {}), **values}.items()}  # checked outside a study too
    connection = _connect()
    if connection is None:
        return False
    step = whole_step(step)
    with _exchange:
        if _stopped:  # another thread was told meanwhile
            return True
        _last = (step, reported)
        message = {"step": step, "metrics": reported}
        connection.sendall(json.dumps(message).encode() + b"\n")
        answer = _answer(connection, request=False)
        _stopped = answer.strip() != b"go"  # "stop", or the worker has gone (an empty line): stop either way
        return _stopped


def save(state: Mapping[str, Any], step: int | None = None) -> bool:
    """Checkpoint `state` (tensors and plain values, as `state_dict()`s are) at `step` (default: the latest
    reported) into the study's checkpoint store, as a loop's `run.save` does; a retry of this trial starts from the
    newest one (`load`). Imports torch (only a script that saves pays for it). Returns whether it was saved: not
    outside a study, nor when the study's checkpoints are off or the worker has gone."""
    connection = _connect()
    if connection is None:
        return False
    at = int(step) if step is not None else _last[0] if _last is not None else 0
    where = _ask({"save": at})
    if not where or not where.get("path"):
        return False
    from trainer.checkpoint import save_checkpoint, user_checkpoint

    metrics = {k: float(v) for k, v in _last[1].items()} if _last is not None and _last[0] == at else None
    info = save_checkpoint(where["path"], user_checkpoint(at, state, config(), metrics))
    done = _ask({"saved": {"step": at, "path": str(info.path), "sha256": info.sha256, "size": info.size}})
    return bool(done and done.get("saved"))


def start() -> tuple[str | None, int]:
    """Where this trial starts: (None, 0) from scratch, ("resume", step) from its lineage's newest save (a retry),
    ("warm", step) from its nearest donor's (warm start on)."""
    kind = os.environ.get(ENV_START_KIND) or None
    if kind is None or not os.environ.get(ENV_START):
        return None, 0
    return kind, int(os.environ.get(ENV_START_STEP, "0"))


def load() -> dict[str, Any] | None:
    """The saved state to start from (see `start`), hash-checked and read with `weights_only`, or None. A resume
    also puts every RNG (python, numpy, torch) back where it was at that save."""
    path = os.environ.get(ENV_START)
    if not path:
        return None
    from trainer.checkpoint import load_checkpoint, restore_rng

    state = load_checkpoint(path, os.environ.get(ENV_START_SHA256) or None)
    if os.environ.get(ENV_START_KIND) == "resume":
        restore_rng(state.rng)
    return dict(state.user)


def _ask(message: Mapping[str, Any]) -> dict[str, Any] | None:
    """A request with a JSON answer; None when the worker has gone."""
    connection = _connect()
    assert connection is not None
    try:
        with _exchange:
            connection.sendall(json.dumps(message).encode() + b"\n")
            answer = _answer(connection, request=True)
    except OSError:
        return None
    return dict(json.loads(answer)) if answer.strip() else None


def _answer(connection: socket.socket, *, request: bool) -> bytes:
    """The next answer to a report ("go" or "stop") or, with `request`, to a request (a JSON object); empty when
    the worker has gone. Safe to call again from a signal handler while a call waits here (a SIGTERM handler that
    saves): each takes the answer of its own kind, and a waiting call looks again at least every 0.2 s."""
    global _received
    while True:
        if _waiting[request]:
            return _waiting[request].pop(0)
        if b"\n" in _received:
            line, _, _received = _received.partition(b"\n")
            _waiting[line.lstrip().startswith(b"{")].append(line)
            continue
        if select.select([connection], [], [], 0.2)[0]:
            data = connection.recv(1 << 16)
            if not data:
                return b""
            _received += data


LARGEST_STEP = 2**31 - 1  # the storage keeps a step in 32 bits (Optuna's intermediate values on PostgreSQL)


def whole_step(step: Any, what: str = "report") -> int:
    """A reported step as an int: a whole number from 0 to `LARGEST_STEP` (an int, or a float or numpy number holding
    one); anything else is a ValueError naming it, not a step silently cut to an int. (Review: a step of 3e9, samples
    counted, failed every trial on PostgreSQL with the storage's "integer out of range", and ran on SQLite.)"""
    try:
        whole = int(step)
        exact = not isinstance(step, (bool, str, bytes)) and float(step) == whole
    except (TypeError, ValueError, OverflowError):
        exact = False
    if not exact:
        text = repr(step)
        raise ValueError(f"{what}: the step must be a whole number, got {type(step).__name__} "
                         f"{text if len(text) <= 60 else text[:57] + '...'}")
    if whole < 0:
        raise ValueError(f"{what}: the step must be >= 0, got {whole}")
    if whole > LARGEST_STEP:
        raise ValueError(f"{what}: the step must be at most {LARGEST_STEP} (a study's storage keeps steps in 32 "
                         f"bits), got {whole}: count optimizer steps or evaluations, not samples or tokens")
    return whole


def _number(value: Any) -> float | str:
    """A float for JSON; NaN and the infinities as strings (JSON has none), which the worker reads back. A bool or a
    string is refused, as the loop's reports refuse them (float() takes both: a comparison's True would be 1.0)."""
    if isinstance(value, (bool, str, bytes)) or type(value).__name__ == "bool_":
        raise TypeError(f"sweep.client.report: expected a number, got {type(value).__name__} ({value!r})")
    number = as_float(value)
    return number if math.isfinite(number) else str(number)


def as_float(value: Any) -> float:
    """`float(value)`, where a number beyond a float's range (an int of 400 digits, a Fraction) is the infinity of its
    sign, as a float overflowing in arithmetic is: a metric that large diverged, and says so."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _connect() -> socket.socket | None:
    global _connection
    if _connection is not None:
        return _connection
    fd = os.environ.get(ENV_REPORT_FD)
    if not fd:
        return None
    with _exchange:  # one socket for the descriptor, whichever thread reports first
        if _connection is not None:
            return _connection
        try:
            _connection = socket.socket(fileno=int(fd))
        except OSError as exc:
            raise RuntimeError(
                f"sweep.client: the report channel ({ENV_REPORT_FD}={fd}) is not open in this process "
                f"({exc.strerror}): a launcher started it without passing that file descriptor on (subprocess "
                f"closes it unless told: pass_fds=[int(os.environ['{ENV_REPORT_FD}'])]); report from the process "
                "sweep started, or pass it on") from None
    return _connection
