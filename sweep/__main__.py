"""The `sweep` command's entry point (and `python -m sweep`), light on purpose: it imports the command line
(`sweep.cli`: typer, rich, YAML) only once it can answer a Ctrl-C or SIGTERM given while those imports run.

A Ctrl-C in the command's first few tenths of a second landed in whatever module was importing and printed a
traceback from deep inside typing or click, and a SIGTERM ended it without a word; nothing had started, so each is now
one line, and exit 130 or 143. A launcher's worker records its launcher's forwarded requests from here on, before
any slow import (`sweep.workers.prepare_worker`).
"""

from __future__ import annotations

import signal
from types import FrameType


class _TerminatedAtStart(BaseException):
    """SIGTERM while the command loads."""


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise _TerminatedAtStart()


def main() -> None:
    before = signal.getsignal(signal.SIGTERM)
    if before is signal.SIG_DFL:  # (one ignored, or handled by whoever embeds this, stays so)
        signal.signal(signal.SIGTERM, _terminated)
    try:
        from sweep.streams import guard_streams

        guard_streams()  # before anything prints, or opens a file that could take a closed stream's number
        from sweep.workers import prepare_worker

        prepare_worker()
        from sweep import cli
    except (KeyboardInterrupt, _TerminatedAtStart) as exc:
        from sweep.signals import interrupted_at_start

        interrupted_at_start(preempted=isinstance(exc, _TerminatedAtStart))
    finally:
        signal.signal(signal.SIGTERM, before)
    cli.main()


if __name__ == "__main__":
    main()
