"""Naming user code by import path, `package.module:function`: tasks and curriculum schedules."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["import_callable", "no_function"]

# This package's own top-level names: a user's module of one of these names (a `trainer.py` beside the study) is
# hidden by them, since the import finds the installed package first.
_OURS = ("trainer", "sweep")


def no_function(module: Any, module_name: str, attr: str) -> str:
    """Why `module_name:attr` names no function, saying which file the import found: when that is this package's own
    module, the user's module of the same name is hidden by it."""
    where = getattr(module, "__file__", None)
    found = f"module {module_name!r}" + (f" ({where})" if where else "") + f" has no function {attr!r}"
    if module_name in _OURS:
        return (f"{found}: {module_name!r} is this package's own, and the import finds it before a module of yours "
                "of that name; rename yours (my_trainer.py, say)")
    return found


def import_callable(path: str, what: str, builtin: Iterable[str],
                    error: type[ValueError] = ValueError) -> Callable[..., Any]:
    """The function at `package.module:function`, or `error` naming what is missing (`what`: "task", "schedule")."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        raise error(f"unknown {what} {path!r}; expected one of {', '.join(sorted(builtin))} or "
                    "'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = ("; a module of your own must be importable: put it next to the study file (or the config file), "
                "or install it, or add its folder to PYTHONPATH") if isinstance(exc, ModuleNotFoundError) else ""
        raise error(f"cannot import {what} module {module_name!r}: {exc}{hint}") from exc
    except (Exception, SystemExit) as exc:  # the module's own code failed as it ran (SyntaxError, a raise, exit())
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise error(f"cannot import {what} module {module_name!r}: importing it raised {type(exc).__name__}: "
                    f"{detail}") from exc
    function = getattr(module, attr, None)
    if not callable(function):
        raise error(f"{what} {path!r}: {no_function(module, module_name, attr)}")
    return function
