"""A child process's lifetime tied to its parent's, without torch (a launcher's worker arms it before its slow
imports)."""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["signal_on_parent_death"]


def signal_on_parent_death(signum: int, parent: int) -> bool:
    """Have the kernel send this process `signum` when its parent exits (Linux's `PR_SET_PDEATHSIG`; elsewhere
    nothing is armed). Returns False when the parent is no longer `parent`, the process that started this one: it
    died before the signal was armed, and the kernel will never send it."""
    if not sys.platform.startswith("linux"):
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signum)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return True
    return os.getppid() == parent
