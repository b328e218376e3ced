"""An exception's message, read safely: a user's exception class whose `__str__` raises must not take down the code
that reports it (a worker filing the trial's reason, the storage's check of what failed, an out-of-memory test)."""

from __future__ import annotations

__all__ = ["message", "unreadable"]


def message(exc: BaseException) -> str | None:
    """`str(exc)`, or None when its `__str__` raises (then `unreadable(exc)` says what it raised)."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - whatever a broken __str__ raises
        return None


def unreadable(exc: BaseException) -> str:
    """A note in place of the message of `exc`, whose `__str__` raises, naming what it raised."""
    try:
        str(exc)
    except Exception as broken:  # noqa: BLE001 - whatever a broken __str__ raises
        return f"(its message could not be read: its __str__ raised {type(broken).__name__})"
    return "(its message could not be read)"
