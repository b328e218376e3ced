"""Naming user code by import path, `package.module:function`: tasks and curriculum schedules."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["import_callable"]


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
        raise error(f"{what} {path!r}: module {module_name!r} has no function {attr!r}")
    return function
