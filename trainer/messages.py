"""An exception's message, read safely: a user's exception class whose `__str__` raises must not take down the code
that reports it (a worker filing the trial's reason, the storage's check of what failed, an out-of-memory test).
And a JSON line's numbers, written strictly (`strict_json`)."""

from __future__ import annotations

import math
import re
import reprlib
from typing import Any

__all__ = ["error_words", "has_control", "message", "short_repr", "strict_json", "unreadable"]


def message(exc: BaseException) -> str | None:
    """`str(exc)`, or None when its `__str__` raises (then `unreadable(exc)` says what it raised)."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - whatever a broken __str__ raises
        return None


def error_words(exc: BaseException) -> str:
    """An error in one line: its type and its message's first line (at most 300 characters)."""
    lines = (message(exc) or "").strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


def unreadable(exc: BaseException) -> str:
    """A note in place of the message of `exc`, whose `__str__` raises, naming what it raised."""
    try:
        str(exc)
    except Exception as broken:  # noqa: BLE001 - whatever a broken __str__ raises
        return f"(its message could not be read: its __str__ raised {type(broken).__name__})"
    return "(its message could not be read)"


def strict_json(value: Any) -> Any:
    """`value` with NaN and infinities (a diverged run's metrics) as None, in its dicts, lists and tuples too:
    Python's `json.dumps` writes `NaN` and `Infinity`, which are not JSON and which jq, JavaScript and most other
    readers refuse."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value

_SHORT = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlevel = 60, 60, 2
_SHORT.maxlist = _SHORT.maxdict = _SHORT.maxtuple = _SHORT.maxset = 4


def short_repr(value: Any) -> str:
    """`repr(value)`, at most about 60 characters, in time bounded by that length (never the whole of a large value):
    an error line quotes a value from a file, which may be a 500 kB string."""
    return _SHORT.repr(value)


# C0 and C1 control characters and DEL: a newline, a tab, NUL, ESC (a terminal's escape sequences).
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def has_control(text: str) -> bool:
    """Whether `text` holds a control character: a path, a URL or a name that holds one cannot be written into a line
    (a batch script's, a YAML header's, an error's) as it is, and a folder so named lists as another."""
    return CONTROL.search(text) is not None
