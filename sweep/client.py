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

Outside a study (the script run by hand) `report` only returns False and `config` returns {} unless
`SWEEP_CONFIG` is set, so a script needs no changes to run alone. A script that never reports still gets a result:
its exit code, and the study's metric in the last line of its output that is a JSON object holding it.
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Mapping
from typing import Any

__all__ = ["ENV_CONFIG", "ENV_REPORT_FD", "ENV_TRIAL", "config", "report", "trial_number"]

ENV_REPORT_FD = "SWEEP_REPORT_FD"  # the file descriptor of this process's end of the worker's socket pair
ENV_TRIAL = "SWEEP_TRIAL"  # the trial's number
ENV_CONFIG = "SWEEP_CONFIG"  # the trial's config, as JSON

_connection: socket.socket | None = None
_answers: Any = None
_stopped = False


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
    global _stopped
    if _stopped:
        return True
    connection = _connect()
    if connection is None:
        return False
    message = {"step": int(step), "metrics": {str(k): _number(v) for k, v in {**(metrics or {}), **values}.items()}}
    connection.sendall(json.dumps(message).encode() + b"\n")
    answer = _answers.readline()
    _stopped = answer.strip() != b"go"  # "stop", or the worker has gone (an empty line): stop either way
    return _stopped


def _number(value: Any) -> float | str:
    """A float for JSON; NaN and the infinities as strings (JSON has none), which the worker reads back."""
    number = float(value)
    return number if math.isfinite(number) else str(number)


def _connect() -> socket.socket | None:
    global _connection, _answers
    if _connection is None:
        fd = os.environ.get(ENV_REPORT_FD)
        if not fd:
            return None
        _connection = socket.socket(fileno=int(fd))
        _answers = _connection.makefile("rb")
    return _connection
