"""The command's standard streams, made safe to write for a command that must not die of its output.

A `sweep run` whose progress goes into a pipe that closed (`sweep run ... 2>&1 | head`), a full disk (`> /dev/full`)
or a terminal that cannot show a character (`PYTHONIOENCODING=ascii`) stopped where it printed, after some trials,
silently and with exit 1; a reading command blamed the database for its own output's error. And with a stream closed
(`>&-`) the command failed as it loaded, while a file it opened could take the closed descriptor's number, where
anything printed would land in it.

So (`guard_streams`, once, as the command starts): a closed descriptor 0, 1 or 2 is opened on the null device; and
stdout and stderr write through `DroppingStream`, which keeps the first error a write meets (its `error`) and sends
the rest, and what the stream still buffers, to the null device: the command goes on and decides its exit code as
before (`output_failure` says whether its stdout's output was lost to anything but a reader that left).
A character the stream's encoding lacks is written as a backslash escape.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, TextIO

__all__ = ["DroppingStream", "guard_streams", "output_failure"]


class DroppingStream:
    """A text stream whose write errors are kept (`error`), not raised: the stream then writes to the null device."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.error: OSError | None = None

    def write(self, text: str) -> int:
        try:
            try:
                return self._stream.write(text)
            except UnicodeEncodeError:
                encoding = self._stream.encoding or "ascii"
                return self._stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
        except OSError as exc:
            self._broken(exc)
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self._broken(exc)

    def _broken(self, exc: OSError) -> None:
        self.error = self.error or exc
        try:  # what is written from now on, and what the stream still holds, goes nowhere (not raised again at exit)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, isatty, buffer, ...
        return getattr(self._stream, name)


def guard_streams() -> None:
    """Open the null device on a closed standard descriptor, and wrap stdout and stderr in `DroppingStream` (once)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
            if opened != fd:
                os.dup2(opened, fd)
                os.close(opened)
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        if getattr(sys, name) is None:  # closed as Python started: a stream on what is there now
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False, encoding="utf-8"))
    if not isinstance(sys.stdout, DroppingStream):
        sys.stdout = DroppingStream(sys.stdout)
    if not isinstance(sys.stderr, DroppingStream):
        sys.stderr = DroppingStream(sys.stderr)


def output_failure() -> str | None:
    """Why the command's output to stdout was lost, as one line; None when it was all written, or when its reader
    left (a pipe closed early, `| head`: it had read what it wanted)."""
    error = sys.stdout.error if isinstance(sys.stdout, DroppingStream) else None
    if error is None or error.errno == errno.EPIPE:
        return None
    return f"cannot write the output to stdout: {error.strerror or error}"
