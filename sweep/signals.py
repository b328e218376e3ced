"""Ctrl-C and SIGTERM as requests, not as exceptions raised wherever the interpreter happens to be.

Python raises KeyboardInterrupt at an arbitrary bytecode, and one that lands in a weakref or garbage-collection
callback is printed and dropped ("Exception ignored in ..."): the trial then trains on as if nothing happened. So the
signal only records the request, and the worker raises it where stopping is clean: at the trial's next log or
evaluation step (`raise_pending`, called by the trial's reporter) and between trials. A second signal of the same kind
raises at once, for a worker stuck where no check comes.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

__all__ = ["Preempted", "graceful_signals", "raise_pending"]


class Preempted(BaseException):
    """SIGTERM: the machine is being taken away (a spot instance, a cluster's preemption). Like Ctrl-C, the running
    trial is marked and queued again; the retry resumes from its last checkpoint."""


_pending: type[BaseException] | None = None


def raise_pending() -> None:
    """Raise the interruption a signal asked for, once."""
    global _pending
    kind, _pending = _pending, None
    if kind is not None:
        raise kind()


@contextlib.contextmanager
def graceful_signals() -> Iterator[None]:
    """SIGINT becomes KeyboardInterrupt and SIGTERM `Preempted`, raised by `raise_pending`; the handlers in place
    before are restored afterwards."""
    global _pending
    kinds = {signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: Preempted}

    def handler(signum: int, frame: FrameType | None) -> None:
        global _pending
        kind = kinds[signal.Signals(signum)]
        if _pending is kind:  # asked twice: now
            _pending = None
            raise kind()
        _pending = kind

    previous = {signum: signal.signal(signum, handler) for signum in kinds}
    _pending = None
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)
        _pending = None
