"""Ctrl-C and SIGTERM as requests, not as exceptions raised wherever the interpreter happens to be.

Python raises KeyboardInterrupt at an arbitrary bytecode, and one that lands in a weakref or garbage-collection
callback is printed and dropped ("Exception ignored in ..."): the trial then trains on as if nothing happened. So the
signal only records the request, and the worker raises it where stopping is clean: before the trial's next
optimizer step, or a user's loop's next report or log (`raise_pending`, called by the trial's reporter), and between
trials. A second signal of the same kind raises at once, for a worker stuck where no check comes.

A launcher (`sweep run --workers N`) passes a signal on to its workers as another one (`FORWARD`: a real-time signal
for each, SIGUSR1/SIGUSR2 where there are none), which only ever records the request. A terminal's Ctrl-C reaches the
whole process group, the launcher included, and the launcher cannot tell that from a signal sent to it alone: passing
on the same signal would be a worker's second one, raised at once wherever the worker happens to be. Only direct
signals count towards a second one: a forwarded request followed by the direct signal itself (a scheduler signalling
every process of a task) is still one request.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import NoReturn

__all__ = ["FORWARD", "Preempted", "caught_stop", "graceful_signals", "handled_by_trial", "hear_taken",
           "interrupted_at_start", "is_unmarked", "mark_unmarked", "raise_pending", "raise_stop", "raised_at_once",
           "record_forwarded", "sheltered", "stop_requested", "trial_code", "watched_handlers"]


class Preempted(BaseException):
    """SIGTERM: the machine is being taken away (a spot instance, a cluster's preemption). Like Ctrl-C, the running
    trial is marked and queued again; the retry resumes from its last checkpoint."""


def mark_unmarked(stop: BaseException) -> BaseException:
    """`stop` (KeyboardInterrupt, `Preempted`) honoured while the storage was unreachable: the running trials were
    left as they were, not marked and queued (the next run finds them lost). Returns `stop`."""
    stop.unmarked = True  # type: ignore[attr-defined]
    return stop


def is_unmarked(stop: BaseException) -> bool:
    """Whether `stop` left its running trials unmarked (`mark_unmarked`)."""
    return getattr(stop, "unmarked", False) is True


_pending: type[BaseException] | None = None  # the stop asked for, not raised yet
_direct: type[BaseException] | None = None  # ... when a direct signal (not a forwarded one) asked for it
_requested: type[BaseException] | None = None  # the stop asked for in this block, raised or not
_depth = 0  # graceful_signals blocks entered (the outermost one sets the handlers)
_raised = 0  # stops raised at once, by a second direct signal, in this block
_watch: tuple[int, int] | None = None  # (reader, wakeup fd set before) while a trial's own handlers are watched
_trial_handled = False  # the watched trial's code set a Ctrl-C or SIGTERM handler of its own (`handled_by_trial`)

# The signal a launcher sends its workers for each one it received (see the module's docstring): real-time signals
# where there are (no library a user's loop brings uses them; Lightning, say, takes SIGUSR1 for Slurm's requeue).
if hasattr(signal, "SIGRTMIN"):
    FORWARD: dict[int, int] = {signal.SIGINT: signal.SIGRTMIN + 1, signal.SIGTERM: signal.SIGRTMIN + 2}
else:  # macOS
    FORWARD = {signal.SIGINT: signal.SIGUSR1, signal.SIGTERM: signal.SIGUSR2}
_KINDS: dict[int, type[BaseException]] = {signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: Preempted}
_FORWARDED: dict[int, type[BaseException]] = {FORWARD[signum]: kind for signum, kind in _KINDS.items()}


def stop_requested() -> type[BaseException] | None:
    """The stop Ctrl-C or SIGTERM asked for (KeyboardInterrupt, `Preempted`), still to be honoured or being honoured,
    or None: a worker waiting for its storage stops waiting then, instead of holding a scheduler's grace period for
    its whole `storage_patience`."""
    return _requested


def raised_at_once() -> int:
    """How many stops a second signal has raised at once in this block: where one lands in a user's code that catches
    it (a loop's own `except KeyboardInterrupt`), the count tells the caller that it was asked to stop (`stop_requested`
    says how)."""
    return _raised


def raise_stop(since: int, noted: BaseException | None = None) -> None:
    """At a clean point of a user's code (its report or log), raise the stop it was asked for: a request not raised
    yet (`raise_pending`); `noted`, one raised into it before that its code caught and went on from; or a stop a
    second signal raised at once since `since` (`raised_at_once()` as the code began), which its code caught."""
    raise_pending()
    if noted is not None:
        raise type(noted)()
    if (caught := caught_stop(since)) is not None:
        raise caught


def caught_stop(since: int) -> BaseException | None:
    """The stop a second signal has raised at once since `since` (`raised_at_once()` as a user's code began), which
    that code may have caught, as an exception to raise; None if none was."""
    return (stop_requested() or KeyboardInterrupt)() if raised_at_once() != since else None


def _stop_behind(error: BaseException) -> BaseException | None:
    """The stop to raise in place of `error`, a trial's error while Ctrl-C or SIGTERM had asked to stop (the pending
    request, taken now; or the one raised before), or None when none had. A scheduler signals every process of a job:
    the trial's own processes (a DataLoader's workers) die of it and raise in the trial before its next clean point
    (review: the trial was stored as its config's failure, "DataLoader worker ... is killed by signal: Terminated",
    never retried). Such an error is the stop's doing, not the config's."""
    if isinstance(error, (KeyboardInterrupt, Preempted)) or (kind := _requested) is None:
        return None
    try:
        raise_pending()
    except (KeyboardInterrupt, Preempted) as pending:
        return pending
    return kind()


@contextlib.contextmanager
def _own_sigchld() -> Iterator[None]:
    """A trial's code, whose SIGCHLD handler ends with it. PyTorch's DataLoader sets one, once per process, that raises
    in the main thread wherever it is when a worker of a loader still alive dies: a SIGTERM to the whole job killed
    the workers of a loader the stopped trial's frames still held, and the handler raised in the middle of storing
    that trial's end (review: a traceback, exit 1 where 143 was due). Put back as it was when the trial ends, and
    PyTorch told to set it again for the next trial's loader."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGCHLD"):
        yield
        return
    before = signal.getsignal(signal.SIGCHLD)
    try:
        yield
    finally:
        try:
            if signal.getsignal(signal.SIGCHLD) is not before:
                signal.signal(signal.SIGCHLD, before if before is not None else signal.SIG_DFL)
                handling = sys.modules.get("torch.utils.data._utils.signal_handling")
                if handling is not None and hasattr(handling, "_SIGCHLD_handler_set"):
                    setattr(handling, "_SIGCHLD_handler_set", False)  # noqa: B010 - PyTorch's: its next loader sets it
        finally:
            _trial_handlers_ended()


@contextlib.contextmanager
def trial_code(passing: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Around a trial's code (or a cohort's): its SIGCHLD handler ends with it (`_own_sigchld`), and an error it
    raises once Ctrl-C or SIGTERM had asked to stop is that stop, raised from the error (`_stop_behind`). Errors of
    the `passing` types go through as they are (the storage gone, a timeout: each has its own way out)."""
    try:
        with _own_sigchld():
            yield
    except passing:
        raise
    except Exception as exc:  # raised by what the signal did to the trial's own processes, say
        if (stop := _stop_behind(exc)) is not None:
            raise stop from exc
        raise


@contextlib.contextmanager
def watched_handlers() -> Iterator[None]:
    """Around a user's code, which may set a Ctrl-C or SIGTERM handler of its own in place of the worker's (one that
    sets a flag its loop saves and returns on, say): a stop that reached that handler alone is still heard
    (`hear_taken`), through Python's wakeup fd, which every signal with a Python handler writes its number to,
    whoever's handler that is (review: the trial was stored complete at the step the loop returned on, and a
    preempted job exited 0). Only in the main thread, within `graceful_signals`; a wakeup fd set before is passed
    every byte, at the trial's reports and as it ends."""
    global _watch, _trial_handled
    if not _depth or _watch is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    reader, writer = os.pipe()
    for end in (reader, writer):
        os.set_blocking(end, False)
    try:
        previous = signal.set_wakeup_fd(writer, warn_on_full_buffer=False)
    except ValueError:  # no wakeup fd here: the trial's own handlers go unwatched, as before
        os.close(reader)
        os.close(writer)
        yield
        return
    _watch, _trial_handled = (reader, previous), False
    try:
        yield
    finally:
        try:
            hear_taken()
        finally:
            _watch = None
            signal.set_wakeup_fd(previous)
            os.close(reader)
            os.close(writer)


def hear_taken() -> None:
    """Read what the wakeup fd heard (`watched_handlers`): a Ctrl-C or SIGTERM (or a launcher's request) that the
    worker's handler did not record, the trial's own handler took. It is recorded as a request, raised at the trial's
    next clean point as any is (`stop_requested` says it came). Notes too whether the trial's code has set a handler
    of its own (`handled_by_trial`)."""
    global _pending, _requested, _trial_handled
    if _watch is None:
        return
    _trial_handled = _trial_handled or any(signal.getsignal(signum) is not _handler for signum in _KINDS)
    reader, previous = _watch
    heard = bytearray()
    with contextlib.suppress(BlockingIOError):
        while data := os.read(reader, 512):
            heard += data
    if not heard:
        return
    if previous != -1:
        with contextlib.suppress(OSError):
            os.write(previous, heard)
    _let_handlers_run()
    for signum in heard:
        kind = _KINDS.get(signum) or _FORWARDED.get(signum)
        if kind is not None and _requested is None:
            _pending = _requested = kind
            _trial_handled = True


def handled_by_trial() -> bool:
    """Whether the trial's code set a Ctrl-C or SIGTERM handler of its own while it was watched (seen at its reports
    and as it ended), or one took a stop in the worker's place: then its code may have heard a stop that was never
    raised into it (a flag its loop returns on), where code without one hears of it only at a report."""
    return _trial_handled


def _let_handlers_run() -> None:
    """Nothing: a call into Python code runs the handlers the interpreter has pending first, so a signal the worker's
    own handler is about to record is not taken for one the trial's handler took."""


# The signals `sheltered` defers: every one that may come from outside at any time. Not the ones a fault of the code
# itself raises where it is (a segfault, SIGPIPE at a write), nor the timers a process arms to interrupt whatever runs
# when they fire (a timeout's SIGALRM, pytest-timeout's; a profiler's): those still interrupt a hung write. Looked up
# with the C function `signal.getsignal` wraps, whose enum conversion costs an exception per handler (20 us a report).
_PASSED = {getattr(signal, name) for name in ("SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS", "SIGFPE", "SIGSEGV", "SIGPIPE",
                                              "SIGSYS", "SIGKILL", "SIGSTOP", "SIGALRM", "SIGVTALRM", "SIGPROF")
           if hasattr(signal, name)}
_SHELTERABLE: tuple[int, ...] = tuple(sorted(int(signum) for signum in signal.valid_signals() - _PASSED))
try:
    from _signal import getsignal as _getsignal  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # not CPython
    _getsignal = signal.getsignal
_Handler = Callable[[int, FrameType | None], object]
_sheltering = False  # inside `sheltered`
_held: dict[int, _Handler] = {}  # the handlers `sheltered` swapped for `_note`, not put back yet
_heard: dict[int, tuple[FrameType | None, _Handler]] = {}  # the signals `_note` took: the frame, the handler to call


def _note(signum: int, frame: FrameType | None) -> None:
    """`sheltered`'s stand-in for a handler: the signal, its frame and the handler it was for, kept for later."""
    if signum in _held:
        _heard.setdefault(signum, (frame, _held[signum]))


@contextlib.contextmanager
def sheltered() -> Iterator[None]:
    """Sweep's own bookkeeping inside a trial's code (a report's storage writes, a checkpoint's): a Python signal
    handler that the trial's code set runs after it, not in the middle of a storage transaction or a lock's hold.
    PyTorch's DataLoader sets one for SIGCHLD that raises in the main thread, wherever it is, once a worker of a live
    loader has died, which a scheduler's SIGTERM to the whole job does (CI: a preempted `sweep run` hung for good,
    silent, inside the stopped trial's last report); a loop's own handler may raise too (`sys.exit`). Each handler
    that is not the worker's own (which only records) is swapped for `_note`; once the handlers are back, each one
    whose signal came is called, once, in the order they came, with the frame it came in: one that raises does so
    at the end of the report, a clean point, as the trial's error (the last raised, the others its context), and
    none is skipped for it. A handler set meanwhile is kept. Only in the main thread, which alone runs Python's
    handlers. A handler that `sheltered` does not defer (a second Ctrl-C's, a timer's) may still raise while it puts
    the others back: what it left is put back as the next `sheltered` ends, or as the trial's code ends
    (`trial_code`). Not seen, and so undone: a `faulthandler.register(chain=True)` on a signal that has a Python
    handler (the C handler it puts in front is invisible from Python)."""
    global _sheltering
    if _sheltering or threading.current_thread() is not threading.main_thread():
        yield
        return
    found = {signum: handler for signum in _SHELTERABLE
             if callable(handler := _getsignal(signum)) and handler is not _handler and handler is not _note}
    _sheltering = True
    try:
        for signum, handler in found.items():  # a pending handler that raises here does so before the bookkeeping
            _held[signum] = handler  # first: a swap cut short is still put back
            signal.signal(signum, _note)
        yield
    finally:
        _sheltering = False
        _put_back()


def _put_back(*, call: bool = True) -> None:
    """Put back each handler `sheltered` holds (not one set since), whatever comes meanwhile: setting a handler first
    runs the handlers pending, and one that raises leaves it unset, so it is set again. Then (`call`) each handler
    whose signal `_note` took is called (or its note dropped); what the handlers raised is raised once all have
    run."""
    errors: list[BaseException] = []
    while _held:
        signum, handler = next(iter(_held.items()))
        try:
            if _getsignal(signum) is _note:
                signal.signal(signum, handler)
            _held.pop(signum, None)  # (a handler run meanwhile may have put it back through a shelter of its own)
        except BaseException as exc:  # noqa: BLE001 - raised below, once every handler is back
            errors.append(exc)
    while _heard:
        signum, (frame, handler) = next(iter(_heard.items()))
        try:
            if _heard.pop(signum, None) is not None and call:
                handler(signum, frame)
        except BaseException as exc:  # noqa: BLE001 - raised below, once every handler has run
            errors.append(exc)
    for before, after in itertools.pairwise(errors):
        after.__context__ = after.__context__ or before
    if errors:
        raise errors[-1]


def _trial_handlers_ended() -> None:
    """As a trial's code ends: what a `sheltered` cut short left is put back, its notes dropped (the code that set
    those handlers has ended); what a pending handler raises meanwhile (a timer's) is raised, as anywhere."""
    global _sheltering
    if _held or _heard or _sheltering:
        _sheltering = False
        _put_back(call=False)


def raise_pending() -> None:
    """Raise the interruption a signal asked for, once."""
    global _pending, _direct
    kind, _pending, _direct = _pending, None, None
    if kind is not None:
        raise kind()


def _handler(signum: int, frame: FrameType | None) -> None:
    global _pending, _direct, _requested
    if signum in _FORWARDED:  # a launcher passing one on: a request, however often it comes, never "asked twice"
        _pending = _pending or _FORWARDED[signum]
        _requested = _requested or _pending
        return
    kind = _KINDS[signum]
    if _direct is kind:  # asked twice, directly (Ctrl-C again): now
        global _raised
        _pending = _direct = None
        _raised += 1
        raise kind()
    _pending = _direct = _requested = kind


def record_forwarded() -> None:
    """In a worker that a launcher started, before its slow imports: a request its launcher passes on is recorded
    from now on (their default action would end the process without a word), and honoured once the run begins."""
    for signum in _FORWARDED:
        signal.signal(signum, _handler)


@contextlib.contextmanager
def graceful_signals() -> Iterator[None]:
    """SIGINT becomes KeyboardInterrupt and SIGTERM `Preempted`, raised by `raise_pending`, and so do their forwarded
    forms (`FORWARD`), which never raise at once; a request recorded before (`record_forwarded`) is kept. The
    handlers in place before are restored afterwards."""
    global _pending, _direct, _requested, _depth, _raised
    if _depth or threading.current_thread() is not threading.main_thread():
        # Inside another such block (`sweep run` around `run_study`), whose requests stay its own; or on another
        # thread, which no signal handler can be set from (signals reach the main thread only).
        yield
        return
    previous = {signum: signal.signal(signum, _handler) for signum in (*_KINDS, *_FORWARDED)}
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        for signum, before in previous.items():
            signal.signal(signum, before)
        _pending = _direct = _requested = None
        _raised = 0


def interrupted_at_start(*, preempted: bool = False) -> NoReturn:
    """A Ctrl-C (or SIGTERM) before the command began: one line, exit 130 (143)."""
    worker = os.environ.get("SWEEP_WORKER")
    what = "preempted (SIGTERM)" if preempted else "interrupted"
    sys.stderr.write(f"{'' if worker is None else f'[worker {worker}] '}{what} as the command started: nothing was "
                     "done.\n")
    raise SystemExit(143 if preempted else 130) from None
