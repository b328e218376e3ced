"""This process's limits (`ulimit`), read and said in words. Standard library only: the commands that never import
torch (`sweep status`, `sweep trials`) name a limit a fault hit too, through `sweep.outcomes`."""

from __future__ import annotations

import math
import os
import resource

__all__ = ["OUT_OF_MEMORY_WORDS", "limit_words", "soft_limit", "usable_cores"]

# What an allocator's error says when memory ran out: PyTorch's (CUDA's, its CPU allocator's), and the operating
# system's (ENOMEM's text).
OUT_OF_MEMORY_WORDS = ("out of memory", "can't allocate memory")

_IN_KIB = {"RLIMIT_AS", "RLIMIT_DATA"}


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (what `taskset`, a container's cpuset or a Slurm job's
    cgroup leaves it), at most Slurm's `--cpus-per-task` where that is set, not the machine's count: on a 64-core node
    a job given 4 cores split 64 threads among its workers, oversubscribing its share 16 times over."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        cores = os.cpu_count() or 1
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    return max(1, min(cores, int(slurm)) if slurm.isascii() and slurm.isdigit() and int(slurm) > 0 else cores)


def soft_limit(name: str) -> float | None:
    """This process's soft limit `name` (`resource`'s RLIMIT_* name): `math.inf` where there is none, None where this
    system cannot say (no such limit)."""
    try:
        soft = resource.getrlimit(getattr(resource, name))[0]
    except (AttributeError, ValueError, OSError):
        return None
    return math.inf if soft == resource.RLIM_INFINITY else soft


def limit_words(name: str, option: str, what: str) -> str:
    """The soft limit `name` in words: "the open-files limit, ulimit -n, is 64" (memory in KiB, a file's size in
    bytes; "unlimited", or "reached" where this system cannot say)."""
    soft = soft_limit(name)
    shown = "reached" if soft is None else "unlimited" if soft == math.inf else (
        f"{int(soft) // 1024} KiB" if name in _IN_KIB else f"{int(soft)} bytes" if name == "RLIMIT_FSIZE"
        else str(int(soft)))
    return f"the {what} limit, ulimit {option}, is {shown}"
