"""Ctrl-C and SIGTERM as requests, not as exceptions raised wherever the interpreter happens to be.

Python raises KeyboardInterrupt at an arbitrary bytecode, and one that lands in a weakref or garbage-collection
callback is printed and dropped ("Exception ignored in ..."): the trial then trains on as if nothing happened. So the
signal only records the request, and the worker raises it where stopping is clean: at the trial's next log or
evaluation step (`raise_pending`, called by the trial's reporter) and between trials. A second signal of the same kind
raises at once, for a worker stuck where no check comes.

A launcher (`sweep run --workers N`) passes a signal on to its workers as another one (`FORWARD`: SIGUSR1 for Ctrl-C,
SIGUSR2 for SIGTERM), which only ever records the request. A terminal's Ctrl-C reaches the whole process group, the
launcher included, and the launcher cannot tell that from a signal sent to it alone: passing on the same signal would
be a worker's second one, raised at once wherever the worker happens to be.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

__all__ = ["FORWARD", "Preempted", "graceful_signals", "raise_pending", "stop_requested"]


class Preempted(BaseException):
    """SIGTERM: the machine is being taken away (a spot instance, a cluster's preemption). Like Ctrl-C, the running
    trial is marked and queued again; the retry resumes from its last checkpoint."""


_pending: type[BaseException] | None = None
_requested = False  # a signal came in this block (`graceful_signals`), raised or not

# The signal a launcher sends its workers for each one it received (see the module's docstring).
FORWARD = {signal.SIGINT: signal.SIGUSR1, signal.SIGTERM: signal.SIGUSR2}


def stop_requested() -> bool:
    """Whether Ctrl-C or SIGTERM came (and is still to be honoured, or is being): a worker waiting for its storage
    stops waiting then, instead of holding a scheduler's grace period for its whole `storage_patience`."""
    return _requested


def raise_pending() -> None:
    """Raise the interruption a signal asked for, once."""
    global _pending
    kind, _pending = _pending, None
    if kind is not None:
        raise kind()


@contextlib.contextmanager
def graceful_signals() -> Iterator[None]:
    """SIGINT becomes KeyboardInterrupt and SIGTERM `Preempted`, raised by `raise_pending`, and so do their forwarded
    forms (`FORWARD`), which never raise at once; the handlers in place before are restored afterwards."""
    global _pending, _requested
    kinds: dict[int, type[BaseException]] = {signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: Preempted}
    forwarded: dict[int, type[BaseException]] = {FORWARD[signal.Signals(s)]: kind for s, kind in kinds.items()}

    def handler(signum: int, frame: FrameType | None) -> None:
        global _pending, _requested
        _requested = True
        if signum in forwarded:  # a launcher passing one on: a request, however often it comes
            _pending = _pending or forwarded[signum]
            return
        kind = kinds[signum]
        if _pending is kind:  # asked twice: now
            _pending = None
            raise kind()
        _pending = kind

    previous = {signum: signal.signal(signum, handler) for signum in (*kinds, *forwarded)}
    _pending, _requested = None, False
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)
        _pending, _requested = None, False
