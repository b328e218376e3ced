from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import traceback
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import pytest
import yaml

from sweep.signals import FORWARD
from tests.pg import postgres_available, postgres_server
from tests.slurm import SlurmCluster, slurm_unavailable

ROOT = Path(__file__).resolve().parent.parent

TINY_STUDY: dict[str, Any] = {
    "name": "tiny",
    "n_trials": 3,
    "seed": 0,
    "sampler": {"type": "random"},
    "pruner": "none",
    "task": "digits",
    "fixed": {"max_steps": 20, "eval_every_steps": 10, "log_every_steps": 10, "batch_size": 32},
    "space": {
        "learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True},
        "model.hidden": {"type": "int", "low": 8, "high": 32},
    },
}


def changed(**edits: Any) -> dict[str, Any]:
    """TINY_STUDY with edits by key path (`space__learning_rate__low=...`, `__` between keys); a value of ... deletes
    the key."""
    document = copy.deepcopy(TINY_STUDY)
    for dotted, value in edits.items():
        *parents, leaf = dotted.split("__")
        node = document
        for part in parents:
            node = node.setdefault(part, {})
        if value is ...:
            node.pop(leaf)
        else:
            node[leaf] = value
    return document


def declare_lost(storage: Any, trial_id: int) -> None:
    """What another worker of the study writes on a trial it finds lost (`PatientStorage.fail_lost_trial`, in one
    transaction): the reason and the outcome, and FAIL. A FAIL alone is a tell from outside (optuna-dashboard)."""
    from optuna.trial import TrialState

    from sweep.outcomes import LOST_REASON

    storage.set_trial_user_attr(trial_id, "fail_reason", LOST_REASON)
    storage.set_trial_user_attr(trial_id, "outcome", "lost")
    storage.set_trial_state_values(trial_id, TrialState.FAIL)


def write_study(folder: Path, document: dict[str, Any] | str, name: str = "study.yaml") -> Path:
    path = folder / name
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document, sort_keys=False))
    return path


def communicate_or_explain(process: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """`process.communicate(timeout)`; past the timeout, an AssertionError that says where the process was: its
    signal masks (a SIGTERM blocked or ignored, from /proc), the processes of its session (when it leads one) and,
    from Python's faulthandler (set PYTHONFAULTHANDLER=1 in its environment), every thread's traceback, dumped by the
    SIGABRT that ends it. A hang seen once in CI, never here, then leaves more than a timeout to go on."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        masks = ""
        with contextlib.suppress(OSError):
            masks = " ".join(line.strip() for line in Path(f"/proc/{process.pid}/status").read_text().splitlines()
                             if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")))
        with contextlib.suppress(OSError, subprocess.SubprocessError):  # its session's processes (DataLoader workers)
            masks += "\n" + subprocess.run(["ps", "-o", "pid,ppid,stat,wchan:24,args", "--sid", str(process.pid)],
                                           capture_output=True, text=True, timeout=30).stdout
        process.send_signal(signal.SIGABRT)
        try:
            out, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        raise AssertionError(f"no exit within {timeout:g} s ({masks}); its output:\n{out}\n{err}") from None


CLI_ENV = {"COLUMNS": "200"}


def run_cli(*args: str | Path, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The real `sweep` command in a fresh interpreter: for what needs a process of its own (signals, --workers,
    several commands at once, process-wide settings). Everything else uses `sweep_cli`, which skips the seconds of
    importing torch and optuna again."""
    env = {**os.environ, **CLI_ENV}
    return subprocess.run([sys.executable, "-m", "sweep.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env)


@dataclasses.dataclass
class CliResult:
    """What `run_cli` returns, the fields the tests read: exit code and the two streams as text."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


# The warning filters of a fresh `python` (no -W, no PYTHONWARNINGS): the CLI's own warnings print to its stderr.
_FRESH_WARNING_FILTERS: list[tuple[Literal["default", "ignore"], type[Warning], str]] = [
    ("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, ""),
    ("ignore", PendingDeprecationWarning, ""), ("ignore", ImportWarning, ""), ("ignore", ResourceWarning, "")]
_WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM, *FORWARD.values())


class _CurrentStderr(io.TextIOBase):
    """Whatever sys.stderr is at the time of the write: the runner's stream while a command runs."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@functools.cache
def _cli_module() -> ModuleType:
    """sweep.cli as a process with piped output and CLI_ENV has it.

    Its rich Consoles are made at import, from the output they find then (a terminal or a pipe, and its width); a test
    module that imported sweep.cli under `pytest -s` on a terminal would leave them colouring and wrapping for that
    terminal. So it is imported again once, with piped output; not at every call, which would mix a newer sweep.cli
    with the sweep modules already loaded when the files change during a session."""
    saved = dict(os.environ)
    os.environ.update(CLI_ENV)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return importlib.reload(importlib.import_module("sweep.cli"))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def sweep_cli(*args: str | Path, cwd: Path | None = None, env: Mapping[str, str | None] | None = None,
              pythonpath: Path | None = None) -> CliResult:
    """The real `sweep` command (sweep.cli's typer app, through typer's CliRunner) in this process.

    It sees what `run_cli`'s fresh interpreter sees: `cwd` as its working folder, CLI_ENV and `env` in os.environ (a
    None value removes the variable), `pythonpath` in front of sys.path (for a task module written by the test), piped
    (not terminal) output, and Python's default warning filters. Its warnings and Optuna's log lines land in its
    stderr, and an exception it lets out is a traceback there and exit code 1, as from a process. Everything it
    changes for the whole process is put back afterwards: os.environ, the working folder, sys.path and the modules
    imported from `pythonpath`, logger levels and warning filters. A signal handler left installed fails the test.
    """
    from typer.testing import CliRunner

    argv = [str(arg) for arg in args]
    saved_environ, saved_cwd, saved_path = dict(os.environ), os.getcwd(), list(sys.path)
    saved_signals = {signum: signal.getsignal(signum) for signum in _WATCHED_SIGNALS}
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    saved_levels = {logger: logger.level for logger in loggers}
    # Optuna's handler was made at its import and holds the stderr of that moment; a fresh process's is its own.
    to_stderr = [handler for logger in loggers for handler in logger.handlers
                 if type(handler) is logging.StreamHandler and handler.stream in (sys.stderr, sys.__stderr__)]
    saved_streams = {handler: handler.stream for handler in to_stderr}
    try:
        for key, value in {**CLI_ENV, **(env or {})}.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if cwd is not None:
            os.chdir(cwd)
        if pythonpath is not None:
            sys.path.insert(0, str(pythonpath))
            importlib.invalidate_caches()
        for handler in to_stderr:
            handler.setStream(_CurrentStderr())
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(_FRESH_WARNING_FILTERS):
                warnings.filterwarnings(action, category=category, module=module)
            warnings.showwarning = _show_warning
            result = CliRunner().invoke(_cli_module().app, argv, prog_name="python -m sweep.cli",
                                        catch_exceptions=True)
    finally:
        for handler, stream in saved_streams.items():
            handler.setStream(stream)
        for logger, level in saved_levels.items():
            logger.setLevel(level)
        if pythonpath is not None:
            for module_name, imported in list(sys.modules.items()):
                if Path(getattr(imported, "__file__", None) or "/").is_relative_to(pythonpath):
                    del sys.modules[module_name]
        sys.path[:] = saved_path
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_environ)
        left = {signum: signal.getsignal(signum) for signum in _WATCHED_SIGNALS}
        for signum, previous in saved_signals.items():
            signal.signal(signum, previous)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    assert left == saved_signals, f"`sweep {' '.join(argv)}` left signal handlers installed: {left}"
    return CliResult(argv, result.exit_code, result.stdout, stderr)


@pytest.fixture
def tiny_study(tmp_path: Path) -> Path:
    return write_study(tmp_path, TINY_STUDY)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A real PostgreSQL server for the whole session (unix socket only), one database."""
    if not postgres_available():
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    with postgres_server() as url:
        yield url


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A real single-node Slurm 22.05 cluster for the whole session (tests/slurm.py); its `env` holds SLURM_CONF."""
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    with SlurmCluster() as cluster:
        yield cluster


def another_user() -> list[str]:
    """The command prefix that runs a process as a user who owns none of the files (uid 1000 in a user namespace:
    CI runs as root, whom no file's permissions stop); skips the test where this machine cannot make one."""
    prefix = ["unshare", "--user", "--map-user=1000"]
    if shutil.which("unshare") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("no user namespaces here (unshare --user)")
    return prefix


@pytest.fixture(autouse=True)
def signals_left_as_found() -> Iterator[None]:
    """Every test leaves this process's signal mask and its stop handlers as it found them: every later subprocess
    inherits the mask (a SIGTERM blocked there never reaches a run a test preempts, which then trains on, silent),
    and an in-process run sets and restores handlers of its own. (SIGCHLD is PyTorch's once a DataLoader with
    workers has run in this process, for the process's life, as in any other.)"""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    handlers = {signum: signal.getsignal(signum) for signum in _WATCHED_SIGNALS}
    yield
    now = {signum: signal.getsignal(signum) for signum in _WATCHED_SIGNALS}
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask, "the test left signals blocked"
    assert now == handlers, f"the test left signal handlers changed: {now} (were {handlers})"
