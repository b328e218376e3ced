"""A user's command as a runner: `command: python train.py --lr {learning_rate} --hidden {model.hidden}`.

Each trial runs the command once, as a subprocess in its own process group (its own session), with:
- `{key}` in the command replaced by the trial's value of that dotted config key, as `str.format` would put it
  (`{learning_rate:.3e}`, `{name!r}`; each argument split first, as a shell would, so a value with spaces stays one
  argument; no shell runs);
- `SWEEP_CONFIG` (the config as JSON) and `SWEEP_TRIAL` in its environment, and `SWEEP_REPORT_FD`: its end of a
  local socket pair to the worker, through which `sweep.client.report` reports and hears whether to stop. The worker
  owns every storage call, so the same command works with SQLite and PostgreSQL storage;
- stdout and stderr together in one log file per trial (`log` on the trial; `sweep trials` shows it), kept in the
  study's checkpoint folder (`<store>/<study>/logs/`).

The trial ends when the process exits. Told to stop (pruned), the process hears "stop" (a report's answer); timed
out (`--timeout`) or stopped (Ctrl-C, SIGTERM to the worker), its whole group gets SIGTERM and the worker goes on
answering it (a handler that calls `sweep.client.save` is answered, and its checkpoint registered) until it exits;
either way, after `stop_grace_period` seconds the whole group is killed (SIGKILL). A timed-out or stopped trial is
then queued again, its retry resuming from the newest checkpoint. Its result: pruned if the pruner stopped it; failed
when it exited non-zero or was killed by a signal (the log's last lines in the reason); otherwise the last reported
value of the metric, or, for a script that never reports, the metric in the last line of its output that is a JSON
object holding it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import selectors
import shlex
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sweep.client import (
    ENV_CONFIG,
    ENV_REPORT_FD,
    ENV_START,
    ENV_START_KIND,
    ENV_START_SHA256,
    ENV_START_STEP,
    ENV_TRIAL,
    as_float,
    whole_step,
)
from sweep.objective import (
    Deadline,
    Start,
    TrialReporter,
    TrialRun,
    diverged_words,
    metric_value,
    store_config,
    trial_trackers,
)
from sweep.outcomes import (
    ATTR_CONFIRMS,
    ATTR_FAIL,
    ATTR_LOG,
    ATTR_METRICS,
    ATTR_PRUNE,
    ATTR_REPORT_MS,
    ATTR_REPRO,
    ATTR_STEPS,
    ATTR_STEPS_TRAINED,
    ATTR_WALL,
    Outcome,
    TimedOut,
    TrialResult,
)
from sweep.runners.loop import loop_seed, save_path, steps_trained, user_start
from sweep.schema import short_repr
from sweep.signals import Preempted, raise_pending
from trainer.checkpoint import CheckpointInfo, TrainState, WarmStart, save_checkpoint
from trainer.config import flatten
from trainer.distributed import signal_name
from trainer.seeding import command_record

if TYPE_CHECKING:

    from sweep.checkpoints import TrialCheckpointer

__all__ = ["CommandError", "CommandTrial", "command_line", "last_json_value"]

_FORMATTER = string.Formatter()
_POLL_S = 0.1
GUARD = Path(__file__).with_name("_guard.py")  # runs each command; ends its group when the worker dies first


class CommandError(ValueError):
    """A command that cannot be run as written: bad quoting, an unmatched brace, a `{key}` the config does not have,
    or a format spec its value does not take."""


def command_line(template: str, config: Mapping[str, Any]) -> list[str]:
    """The command's arguments for one trial: split as a shell would, then each `{key}` replaced by the value of that
    dotted key of `config`, as Python's `str.format` would put it: `{learning_rate:.3e}` with a format spec,
    `{name!r}` with a conversion. A value without either is written as JSON when it is true/false, null, a list or a
    mapping (`true`, not `True`). `{{` and `}}` stand for braces."""
    if "\0" in template:  # no argument of a process can hold one: every trial failed with "embedded null byte"
        raise CommandError(f"expected a command without NUL characters, got {short_repr(template)}")
    try:
        words = shlex.split(template)
    except ValueError as exc:
        raise CommandError(f"cannot split the command into arguments: {exc}") from None
    if not words:
        raise CommandError("expected a command to run, got an empty one")
    values = dict(flatten(config))
    for key, value in _mappings(config):  # `{opts}` for a whole mapping: written as JSON
        values.setdefault(key, value)
    return [_filled(word, values) for word in words]


def _mappings(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every mapping in `config` by its dotted key (`opts`, `model.extra`), nested ones too."""
    for key, value in config.items():
        if isinstance(value, Mapping):
            yield f"{prefix}{key}", dict(value)
            yield from _mappings(value, f"{prefix}{key}.")


def _filled(word: str, values: Mapping[str, Any]) -> str:
    try:
        parts = list(_FORMATTER.parse(word))
    except ValueError:  # "Single '}' encountered", "expected '}' before end of string"
        raise CommandError(f"unmatched brace in {short_repr(word)}: a placeholder is {{key}} or {{key:format}}; "
                           "write {{ and }} for a literal brace") from None
    text = []
    for literal, key, spec, conversion in parts:
        text.append(literal)
        if key is None:
            continue
        placeholder = "{" + key + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if key not in values:
            plain = key.replace(".", "_").replace("-", "_").isidentifier()  # else likely a literal brace: `{"a": 1}`
            raise CommandError(f"{placeholder} is not a key of the config (fixed or searched); known keys: "
                               f"{', '.join(sorted(values)) or 'none'}"
                               + ("" if plain else "; write {{ and }} for a literal brace"))
        if spec and "{" in spec:
            raise CommandError(f"{placeholder}: a placeholder inside a format spec is not supported; write the spec "
                               "out, such as {learning_rate:.3e}")
        value = values[key]
        if not spec and not conversion:
            text.append(json.dumps(value) if isinstance(value, (bool, type(None), list, dict)) else str(value))
        else:
            try:
                text.append(format(_FORMATTER.convert_field(value, conversion) if conversion else value, spec or ""))
            except (ValueError, TypeError, OverflowError):  # {x:c} of -5, {big:.3e} of a 401-digit int (review)
                raise CommandError(f"{placeholder}: expected a Python format spec such as {{{key}:.3f}} or "
                                   f"{{{key}:05d}} (and a conversion !s, !r or !a) that {key}'s value "
                                   f"{short_repr(value)} takes") from None
        if "\0" in text[-1]:  # (`!r` writes it as \x00: then it is no NUL)
            raise CommandError(f"{placeholder}: expected a value without NUL characters, which no argument of a "
                               f"command can hold, got {short_repr(value)}")
    return "".join(text)


_BREAK = re.compile(rb"\r\n|\r|\n")
LONGEST_LINE = 1 << 20  # bytes of a line kept from its end: a JSON line or an error's last words are far shorter


def _lines_backwards(log: Path, block: int = 1 << 16) -> Iterator[str]:
    """The log's lines (as `str.splitlines` splits them: a progress bar's carriage return too), last first, read
    block by block from its end: a log of gigabytes is never held whole. A line longer than `LONGEST_LINE` is given
    as its last `LONGEST_LINE` bytes, and the rest of it is passed over unread: the start of a line was carried
    from block to block and copied again with each, so that a progress bar written without a newline for hours (a
    log of 430 MB) held the worker for minutes after its command had exited, deaf to SIGTERM. Raises OSError when
    it cannot be read."""
    with open(log, "rb") as file:
        end = file.seek(0, os.SEEK_END)
        rest = b""  # the start of a line that may begin in the block before
        skipping = False  # inside a line too long to keep, whose end was given: until the break before it
        cut: list[Cut] = []  # that line's end, as given: told its first character once the break is found
        while end > 0:
            start = max(0, end - block)
            if start > 0:  # a "\r\n" across the blocks' boundary stays whole, in this block: one break, not two
                file.seek(start - 1)
                start -= file.read(2) == b"\r\n"
            file.seek(start)
            parts = _BREAK.split(file.read(end - start) + rest)
            end = start
            head = parts.pop(0) if end > 0 else b""
            if end == 0 and not parts:  # the file's first line, with no break before it
                parts, head = [head], b""
            if skipping:
                if not parts:  # no break in this block: still inside the long line
                    continue
                opening = parts.pop().lstrip()  # the long line's start, after the last break
                for line in cut:
                    line.first = opening[:1].decode("ascii", "replace")
                skipping = False
            for part in reversed(parts):
                yield from reversed(part.decode("utf-8", "replace").splitlines() or [""])
            rest = head
            if len(rest) > LONGEST_LINE:
                cut = [Cut(line) for line in rest[-LONGEST_LINE:].decode("utf-8", "replace").splitlines() or [""]]
                yield from reversed(cut)
                rest, skipping = b"", True


class Cut(str):
    """A line `_lines_backwards` gives by its last `LONGEST_LINE` bytes only. `first`: the first character of the
    whole line (after blanks), set once the reading has found its start (before the line before it is given)."""

    first: str | None = None


class LineTooLong(ValueError):
    """The log's last line that may hold the metric is longer than `LONGEST_LINE`: not read whole."""


class UnreadableLine(ValueError):
    """The log's last line that is a JSON object to look at, and names the metric, is not JSON (a script that writes
    its line by hand: `{"val_loss": nan}`): not passed over for an earlier line's value."""


def last_json_value(log: Path, metric: str) -> float | None:
    """The metric in the last line of the log that is a JSON object holding it (`last_json_numbers`), or None."""
    numbers = last_json_numbers(log, metric)
    return None if numbers is None else metric_value(numbers, metric)


def last_json_numbers(log: Path, metric: str) -> dict[str, float] | None:
    """The metric (and the line's val_loss, where it is a number) in the last line of the log that is a JSON object
    holding it, or None where its metric is not a number. `LineTooLong` where a line
    after every such line ends as a JSON object does but is too long to be read whole (users' code review: a final
    JSON line of 1.2 MB was passed over without a word, and an earlier line's value taken)."""
    too_long = LineTooLong(f"its output's last line that may be a JSON object holding {metric!r} is longer than "
                           f"the {LONGEST_LINE // 2**20} MiB sweep reads of one line; print {metric} in a shorter "
                           "line, or report it with `client.report`")
    pending: Cut | None = None  # a long line ending as a JSON object does, until its start is known
    try:
        for line in _lines_backwards(log):
            if pending is not None:
                if pending.first == "{":
                    raise too_long
                pending = None
            if isinstance(line, Cut) and line.strip().endswith("}"):
                pending = line
                continue
            line = line.strip()
            if not (line.startswith("{") and line.endswith("}")):
                continue
            try:
                found = json.loads(line)
            except ValueError as exc:
                if json.dumps(metric, ensure_ascii=False) not in line and json.dumps(metric) not in line:
                    continue
                # Review: `{"step": 100, "val_loss": nan}` after `{"step": 50, "val_loss": 0.5}` completed with 0.5.
                raise UnreadableLine(
                    f"its output's last line holding {metric!r} is not JSON ({exc}): {short_repr(line[:200])}; "
                    "print it with json.dumps (NaN and Infinity are its words), or report it with "
                    "`client.report`") from None
            if isinstance(found, dict) and metric in found:
                value = found[metric]  # a number; JSON's true, "0.42" or null is not one
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    return None
                # NaN when the line's val_loss is NaN or infinite, whatever the metric, as a report's (diff review:
                # a command's final line {"val_accuracy": 0.99, "val_loss": NaN} completed and was the best).
                loss = found.get("val_loss")
                numbers = {metric: as_float(value)}
                if isinstance(loss, (int, float)) and not isinstance(loss, bool):
                    numbers["val_loss"] = as_float(loss)
                return numbers
    except OSError:
        return None
    if pending is not None and pending.first == "{":  # the log's first line
        raise too_long
    return None


def _tail(log: Path, lines: int = 5) -> str:
    """The log's last `lines` lines (trailing blank ones left out), joined, at most 800 characters; "(no output)" for
    a command that printed nothing, so that a reason never ends in a bare colon."""
    kept: list[str] = []
    try:
        for line in _lines_backwards(log):
            if kept or line.strip():
                kept.append(line)
            if len(kept) == lines:
                break
    except OSError as exc:
        return f"(its log cannot be read: {exc.strerror or exc})"
    return " | ".join(reversed(kept)).strip()[-800:] or "(no output)"


def _interpreter_hint(argv: list[str], tail: str) -> str:
    """For a command whose Python has no sweep (`from sweep import client` failed): which interpreter ran it, and
    which one sweep runs in. `python` is the first on the worker's PATH, not sweep's own (a sweep installed with
    pipx, or run as .venv/bin/sweep without the environment activated)."""
    if "No module named 'sweep'" not in tail or not argv:
        return ""
    found = shutil.which(argv[0])
    ran = argv[0] if found in (None, argv[0]) else f"{argv[0]} ({found})"
    return (f" (the command ran {ran}, a Python without sweep installed; sweep runs in "
            f"{sys.executable}: name that interpreter in command:, or install sweep in the command's)")


class CommandTrial(TrialRun):
    """One trial of a user's command, from its params to its result."""

    def log_path(self) -> Path:
        folder = (self.checkpoints.store.folder if self.checkpoints is not None and self.checkpoints.store.artifacts
                  is None else Path(tempfile.gettempdir()) / f"sweep-{self.trial.study.study_name}")
        return folder / "logs" / f"trial{self.trial.number:05d}.log"

    def run(self) -> TrialResult:
        trial, spec = self.trial, self.spec
        assert spec.command is not None
        params = spec.suggest(trial)
        self.events.trial_started(trial.number, params)
        config = spec.user_config(params)
        store_config(trial, config)
        argv = command_line(spec.command, config)
        log = self.log_path()
        log.parent.mkdir(parents=True, exist_ok=True)
        trial.set_user_attr(ATTR_LOG, str(log))
        start, self.checkpointer = user_start(trial, spec, self.checkpoints, params, config)
        self.trackers = trial_trackers(spec, self.storage_url, trial, params, config, start.prior)
        reporter = TrialReporter(trial, spec, config, self.events, self.boundary, start.prior, deadline=self.deadline,
                                 judged=ATTR_CONFIRMS not in trial.user_attrs,  # a cold confirmation is never pruned
                                 trackers=self.trackers, answers_deadline=True, signals=False, curves=start.curves)
        started = time.perf_counter()
        # A trial's number runs once in a study: a log already there is an earlier study's (of the same name, its
        # database deleted), and its last JSON line must not become this trial's value.
        with _spawned(argv, config, trial.number, start, log, "wb", spec.stop_grace_period) as (process, ours):
            session = _Session(process, ours, reporter, self.deadline, spec.stop_grace_period, self.checkpointer)
            try:
                with self.boundary.no_wait():
                    code = session.wait()
            finally:
                _end_group(process, spec.stop_grace_period)  # whatever happened here: none of it outlives the trial
        reporter.flush()
        steps = max((step for step, _ in reporter.series), default=0)  # the highest: it may report out of order
        own = [step for step, _ in reporter.series[len(start.prior):]]  # after the lineage's, its own reports
        attrs: dict[str, Any] = {ATTR_STEPS: steps, ATTR_WALL: round(time.perf_counter() - started, 3),
                                 ATTR_STEPS_TRAINED: steps_trained(min(own, default=None), steps, start),
                                 ATTR_REPORT_MS: reporter.report_ms, ATTR_METRICS: session.metrics,
                                 ATTR_REPRO: command_record(argv, loop_seed(config) if "seed" in config else None)}
        if reporter.prune_reason is not None:
            return TrialResult(Outcome.PRUNED, None, {**attrs, ATTR_PRUNE: reporter.prune_reason})
        if code != 0:
            how = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
            tail = _tail(log)
            return TrialResult(Outcome.FAILED, None, {**attrs, ATTR_FAIL: f"the command {how}: {tail}"
                                                                          f"{_interpreter_hint(argv, tail)}"})
        try:
            numbers = session.metrics if reporter.series else last_json_numbers(log, spec.metric)
        except (LineTooLong, UnreadableLine) as exc:
            return TrialResult(Outcome.FAILED, None, {**attrs, ATTR_FAIL: f"the command exited with code 0, but {exc}"})
        value = reporter.series[-1][1] if reporter.series else (
            None if numbers is None else metric_value(numbers, spec.metric))
        if value is None:
            return TrialResult(Outcome.FAILED, None, {**attrs, ATTR_FAIL: f"the command reported no {spec.metric!r} "
                                                      f"and printed no JSON line holding it as a number: "
                                                      f"{_tail(log)}"})
        if not math.isfinite(value):
            return TrialResult(Outcome.FAILED, None,
                               {**attrs, ATTR_FAIL: f"diverged: {diverged_words(numbers or {}, spec.metric, value)} "
                                                    f"at step {steps}"})
        return TrialResult(Outcome.COMPLETE, value, attrs)


@contextlib.contextmanager
def _spawned(argv: list[str], config: Mapping[str, Any], number: int, start: Start, log: Path, mode: str,
             grace: float, cwd: Path | None = None) -> Iterator[tuple[subprocess.Popen[bytes], socket.socket]]:
    """The command started in a session of its own, its output in `log` (opened with `mode`), its config, trial
    number and start state in its environment; yields it and the worker's end of its report socket. The process
    yielded is the command's guard (`_guard.py`, the group's leader, exiting as the command does), which ends the
    group `grace` seconds after asking it to stop if this worker dies first."""
    ours, theirs = socket.socketpair()
    start_env = _start_env(start, log.with_suffix(".start.pt"))
    env = {**os.environ, ENV_REPORT_FD: str(theirs.fileno()), ENV_TRIAL: str(number), ENV_CONFIG: json.dumps(config),
           **start_env}
    try:
        with open(log, mode) as output, ours:
            try:
                guarded = [sys.executable, "-I", str(GUARD), str(os.getpid()), str(grace), *argv]
                process = subprocess.Popen(guarded, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=env, pass_fds=[theirs.fileno()], start_new_session=True, cwd=cwd)
            finally:
                theirs.close()
            yield process, ours
    finally:  # the start state's copy was the command's alone: gone with it
        if ENV_START in start_env:
            with contextlib.suppress(OSError):
                Path(start_env[ENV_START]).unlink()


def _start_env(start: Start, path: Path) -> dict[str, str]:
    """The state a retry or a warm-started trial starts from, handed to the command as a file of its own (the lineage's
    blob may be in an object store, or collected while the command runs)."""
    state = start.resume if start.resume is not None else start.warm.state if start.warm is not None else None
    if state is None:
        return {}
    info = save_checkpoint(path, state)
    return {ENV_START: str(info.path), ENV_START_SHA256: info.sha256, ENV_START_STEP: str(info.step),
            ENV_START_KIND: "resume" if start.resume is not None else "warm"}


class Reports(Protocol):
    """What a command's session reports to: a trial's `TrialReporter`, or `sweep reproduce`'s recorder."""

    metric: str
    series: list[tuple[int, float]]

    def report(self, step: int, metrics: Mapping[str, float]) -> bool: ...


def rerun_command(template: str, config: Mapping[str, Any], number: int, reports: Reports,
                  parent: TrainState | None, grace: float, folder: Path, cwd: Path | None = None) -> int:
    """A command trial again, for `sweep reproduce`: the same command line, config and environment (the donor's
    state when the trial was warm-started), in `cwd` (the folder the trial ran in), its reports to `reports` (which
    answers "stop" after the stored trial's last step), no checkpoints; its output in `folder/reproduce-NUMBER.log`.
    Returns its exit code."""
    argv = command_line(template, config)
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"reproduce-{number}.log"
    start = Start(warm=WarmStart(parent)) if parent is not None else Start()
    with _spawned(argv, config, number, start, log, "wb", grace, cwd) as (process, ours):
        session = _Session(process, ours, reports, None, grace, None)
        try:
            return session.wait()
        finally:
            _end_group(process, grace)


class _Session:
    """The worker's side of one command's socket: each report line goes to the study (`TrialReporter`) and is
    answered "go" or "stop"; a command told to stop that has not exited after the grace period is killed."""

    def __init__(self, process: subprocess.Popen[bytes], connection: socket.socket, reporter: Reports,
                 deadline: Deadline | None, grace: float, checkpointer: TrialCheckpointer | None) -> None:
        self.process, self.connection, self.reporter = process, connection, reporter
        self.checkpointer = checkpointer
        self.offered: set[str] = set()  # checkpoint paths handed out, the only ones registered back
        self.deadline, self.grace = deadline, grace
        self.buffer = b""
        self.metrics: dict[str, float] = {}  # the latest report's
        self.steps: set[int] = set()  # the steps this command reported
        self.stop_sent: float | None = None
        self.ending: BaseException | None = None  # Ctrl-C, SIGTERM to the worker or --timeout: raised once it exits
        self.open = True

    def wait(self) -> int:
        """Its exit code, once it has exited. Stopped (Ctrl-C or SIGTERM to the worker, `--timeout`), the command's
        group gets SIGTERM and is answered while it saves, and that stop is raised once it has exited (or was killed
        after the grace period); a second Ctrl-C raises at once, and the caller ends the group."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.connection, selectors.EVENT_READ)
            while True:
                self._stop_if_asked()
                try:
                    if self.open and selector.select(_POLL_S):
                        self._read()
                    elif not self.open:
                        time.sleep(_POLL_S)
                    code = self.process.poll()
                    if code is not None:
                        while self.open and selector.select(0):  # what it wrote just before exiting
                            self._read()
                except Exception:
                    if self.ending is not None:  # a stop was asked first: a line it half wrote as it died says less
                        raise self.ending from None
                    raise
                if code is not None:
                    if self.ending is not None:
                        raise self.ending
                    return code
                if self.stop_sent is not None and time.monotonic() - self.stop_sent > self.grace:
                    _kill_group(self.process, signal.SIGKILL)

    def _stop_if_asked(self) -> None:
        if self.ending is not None:
            return
        try:
            raise_pending()
        except (KeyboardInterrupt, Preempted) as exc:
            self.ending = exc
        if self.ending is None and self.deadline is not None and self.deadline.passed():
            self.ending = TimedOut()
        if self.ending is not None:  # as a preemption would: it may save, and is answered meanwhile
            _kill_group(self.process, signal.SIGTERM)
            self.stop_sent = self.stop_sent or time.monotonic()

    def _read(self) -> None:
        try:
            data = self.connection.recv(1 << 16)
        except OSError:  # reset: it died before reading an answer (ended by a stop, or on its own): its end
            data = b""
        if not data:
            self.open = False
            return
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            self._answer(line)

    def _answer(self, line: bytes) -> None:
        try:
            message = json.loads(line)
            if not isinstance(message, dict):
                raise ValueError(f"a JSON {type(message).__name__}, not an object")
        except ValueError as exc:
            text = line[:80].decode("utf-8", "replace")
            raise ValueError(f"the command sent a report line that is not sweep.client's ({exc}): {text!r}") from None
        if "save" in message or "saved" in message:
            self._reply(json.dumps(self._checkpoint(message)).encode())
            return
        self._stop_if_asked()
        stop = self.stop_sent is not None
        if not stop:
            metrics = {str(k): as_float(v) for k, v in dict(message["metrics"]).items()}
            if self.reporter.metric not in metrics:
                raise ValueError(f"client.report at step {message['step']}: the study's metric "
                                 f"{self.reporter.metric!r} is not among {sorted(metrics)}")
            step = whole_step(message["step"])
            if step in self.steps:  # the study keeps a step's first value, as a loop's `run.report` says
                warnings.warn(f"client.report: step {step} was reported already; its first value is kept",
                              stacklevel=1)
                self._reply(b"go")
                return
            self.steps.add(step)
            stop = self.reporter.report(step, metrics)
            self.metrics = metrics
            if stop:
                self.stop_sent = time.monotonic()
        self._reply(b"stop" if stop else b"go")

    def _reply(self, answer: bytes) -> None:
        with contextlib.suppress(OSError):  # it may have exited meanwhile
            self.connection.sendall(answer + b"\n")

    def _checkpoint(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """`{"save": step}` asks where the checkpoint at `step` goes (no path: checkpoints are off); `{"saved":
        {...}}` registers the file the command wrote there (`sweep.client.save`), as a loop's save is."""
        if self.checkpointer is None:
            return {"path": None, "saved": False}
        if "save" in message:
            step = int(message["save"])
            metrics = self.metrics if self.reporter.series and self.reporter.series[-1][0] == step else None
            path = str(save_path(self.checkpointer, step, metrics))
            self.offered.add(path)
            return {"path": path}
        saved = dict(message["saved"])
        if saved["path"] not in self.offered:
            raise ValueError(f"client.save registered {saved['path']!r}, which the worker did not hand out")
        step = int(saved["step"])
        metrics = self.metrics if self.reporter.series and self.reporter.series[-1][0] == step else None
        self.checkpointer.saved(CheckpointInfo(Path(saved["path"]), str(saved["sha256"]), int(saved["size"]), step),
                                metrics)
        return {"saved": True}


def _kill_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _end_group(process: subprocess.Popen[bytes], grace: float) -> None:
    """The trial's whole process group ends: asked with SIGTERM, then after `grace` seconds killed. The group is
    signalled even when its leader has exited (a child it started may still run)."""
    if process.poll() is None:
        _kill_group(process, signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(process, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)

