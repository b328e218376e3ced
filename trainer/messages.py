"""An exception's message, read safely: a user's exception class whose `__str__` raises must not take down the code
that reports it (a worker filing the trial's reason, the storage's check of what failed, an out-of-memory test).
And a JSON line's numbers, written strictly (`strict_json`)."""

from __future__ import annotations

import difflib
import math
import re
import reprlib
from collections.abc import Iterable
from typing import Any

__all__ = ["did_you_mean", "error_words", "has_control", "message", "short_repr", "strict_json", "unreadable"]


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


# Words of other sweep tools (W&B sweeps, Ray Tune, Optuna's API and class names) for what sweep names otherwise: a
# study file written from habit is told sweep's word. Each maps to the candidates, the first of which that the place
# accepts is suggested (`max` is `high` in a range, `maximize` as a direction).
_OTHER_TOOLS: dict[str, tuple[str, ...]] = {
    "method": ("sampler",), "parameters": ("space",), "params": ("space",), "search_space": ("space",),
    "param_space": ("space",), "early_terminate": ("pruner",), "num_samples": ("n_trials",),
    "max_trials": ("n_trials",), "trials": ("n_trials",), "count": ("n_trials",), "goal": ("direction",),
    "mode": ("direction",), "min": ("low", "minimize"), "max": ("high", "maximize"), "lower": ("low",),
    "upper": ("high",), "values": ("choices",), "options": ("choices",), "q": ("step",), "maximise": ("maximize",),
    "minimise": ("minimize",), "loguniform": ("float",), "log_uniform": ("float",), "log_uniform_values": ("float",),
    "uniform": ("float",), "quniform": ("float",), "qloguniform": ("float",), "suggest_float": ("float",),
    "randint": ("int",), "qrandint": ("int",), "int_uniform": ("int",), "suggest_int": ("int",),
    "choice": ("categorical",), "grid_search": ("categorical",), "suggest_categorical": ("categorical",),
    "bayes": ("tpe",), "bayesian": ("tpe",), "min_iter": ("min_resource",), "max_iter": ("max_resource",),
    "eta": ("reduction_factor",), "lr": ("learning_rate",), "wd": ("weight_decay",), "bs": ("batch_size",),
    "num_workers": ("loader_workers",),
}
_WITH = {"loguniform": " with log: true", "log_uniform": " with log: true", "log_uniform_values": " with log: true",
         "qloguniform": " with log: true and step", "quniform": " with step", "qrandint": " with step",
         "grid_search": " with choices: [...]"}


_FALSE_FRIENDS = frozenset({"data"})  # `data` (a path, say) is not `data_loader` (a choice of loader)


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """`" (did you mean 'n_trials'?)"` for a close match among `options`, or '': another tool's word for it
    (`num_samples`, `loguniform`, `TPESampler`), the same name in other case or without `_`, a unique option whose
    first whole words the word is (`warmup` of `warmup_steps`, `n_startup` of `n_startup_trials`; not `data` of
    `data_loader`), or a close spelling."""
    options = [option for option in options if option != word]
    folded = word.lower().replace("-", "_")
    for target in _OTHER_TOOLS.get(folded, ()):
        if target in options:
            return f" (did you mean {target!r}{_WITH.get(folded, '')}?)"
    by_fold = {option.lower().replace("_", ""): option for option in options}
    for bare in (folded, re.sub(r"_?(sampler|pruner)$", "", folded)):  # Optuna's class names: TPESampler, ...
        if bare.replace("_", "") in by_fold:
            return f" (did you mean {by_fold[bare.replace('_', '')]!r}?)"
    begun = [option for option in options if len(folded) >= 4 and folded not in _FALSE_FRIENDS
             and option.lower().startswith(folded if folded.endswith("_") else f"{folded}_")]
    if len(begun) == 1:
        return f" (did you mean {begun[0]!r}?)"
    matches = difflib.get_close_matches(word, options, n=1, cutoff=0.75)
    return f" (did you mean {matches[0]!r}?)" if matches else ""
