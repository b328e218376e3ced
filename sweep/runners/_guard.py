"""A trial's command, run as the child of this small process, which leads the trial's process group and ends the whole
group when the worker that started it dies without ending it (SIGKILL, out-of-memory kill, a machine's agent).

`python -I _guard.py PARENT_PID GRACE_S ARGV...`: the command runs with this process's environment, file descriptors
and standard streams; this process exits as the command did (its code, or the signal that killed it), so the worker
sees the command's own status. It answers nothing itself: SIGTERM and SIGINT sent to the group reach the command, which
decides; the worker's SIGKILL to the group ends both. Every second it checks that its parent is still the worker;
once it is not, the group is asked to stop (SIGTERM) and, after GRACE_S seconds, killed. A command that never reports
(so never notices its worker is gone) does not train on for nobody, holding a device and writing files a retry may
own.

Standard library only, and run with `-I`: it starts in a few tens of milliseconds and imports nothing of the
project.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable

POLL_S = 1.0


def main(argv: list[str]) -> int:
    parent, grace, command = int(argv[0]), float(argv[1]), argv[2:]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        # The command's to answer (it is in this group too); a Python handler, not SIG_IGN, so that the command does
        # not inherit an ignored signal through exec.
        signal.signal(sig, lambda *_: None)
    try:
        child = subprocess.Popen(command, close_fds=False)
    except OSError as exc:  # the shell's codes: 127 not found, 126 found but not runnable
        print(f"sweep: cannot run {command[0]!r}: {exc.strerror or exc}", flush=True)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    exited = _exit_watch(child)
    while (code := child.poll()) is None:
        exited(POLL_S)
        if child.poll() is None and os.getppid() != parent:  # the worker is gone: nobody reads its reports or result
            _end_group(child, grace)
            return 1
    if code < 0:  # killed by a signal: die of it too, so the worker names it
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):  # the command dumped its core if it was to: not this one too
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), -code)
        time.sleep(1.0)
        return 128 - code
    return code


def _exit_watch(child: subprocess.Popen[bytes]) -> Callable[[float], None]:
    """A wait of at most so many seconds that ends early when the child exits: on its pidfd (Linux), else polled."""
    try:
        pidfd = os.pidfd_open(child.pid)
    except (AttributeError, OSError):
        return lambda seconds: _wait_quietly(child, seconds)
    return lambda seconds: select.select([pidfd], [], [], seconds) and None


def _wait_quietly(child: subprocess.Popen[bytes], seconds: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(seconds)


def _end_group(child: subprocess.Popen[bytes], grace: float) -> None:
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.1)
    os.killpg(0, signal.SIGKILL)  # the command's own children too; this process with them


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
