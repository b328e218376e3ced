"""Naming user code by import path, `package.module:function`: tasks and curriculum schedules."""

from __future__ import annotations

import importlib
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from trainer.messages import did_you_mean, short_repr

__all__ = ["import_callable", "import_user_module", "no_function", "raised_at"]

# This package's own top-level names: a user's module of one of these names (a `trainer.py` beside the study) is
# hidden by them, since the import finds the installed package first.
_OURS = ("trainer", "sweep")


def no_function(module: Any, module_name: str, attr: str) -> str:
    """Why `module_name:attr` names no function, saying which file the import found: when that is this package's own
    module, the user's module of the same name is hidden by it."""
    where = getattr(module, "__file__", None)
    found = f"module {short_repr(module_name)}" + (f" ({where})" if where else "") + f" has no function {attr!r}"
    top = module_name.split(".")[0]
    if top in _OURS and (module_name == top or _another(top)):
        return (f"{found}: {top!r} is this package's own, and the import finds it before a module of yours of "
                f"that name; rename yours (my_{top}, say)")
    return found


def _another(top: str) -> bool:
    """Whether a folder on the import path other than this package's holds a module or package named `top`."""
    ours = Path(__file__).resolve().parent.parent
    for entry in sys.path:
        folder = Path(entry or ".").resolve()
        if folder != ours and ((folder / top).is_dir() or (folder / f"{top}.py").is_file()):
            return True
    return False


def import_callable(path: str, what: str, builtin: Iterable[str],
                    error: type[ValueError] = ValueError) -> Callable[..., Any]:
    """The function at `package.module:function`, or `error` naming what is missing (`what`: "task", "schedule")."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        raise error(f"unknown {what} {short_repr(path)}{did_you_mean(path, builtin)}; expected one of "
                    f"{', '.join(sorted(builtin))} or "
                    "'package.module:function'")
    module = import_user_module(module_name, what, error)
    function = getattr(module, attr, None)
    if not callable(function):
        raise error(f"{what} {short_repr(path)}: {no_function(module, module_name, attr)}")
    return function


def raised_at(exc: BaseException, *, users_only: bool = False) -> str:
    """Where `exc` was raised, as " (at file.py:LINE)": the innermost frame of the user's code, not the import
    machinery's nor a library's (`json.loads("{bad")` at import named decoder.py: review), nor this module's call;
    else the innermost library frame (a user's module installed in site-packages), or with `users_only` "" (an
    ImportError of a module that is not there was raised by no code of the user's). "" for a SyntaxError, whose
    message says its file and line itself, and where no frame is known."""
    if isinstance(exc, SyntaxError):
        return ""
    here = str(Path(__file__).resolve())
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<frozen ") and str(Path(f.filename).resolve()) != here]
    libraries = tuple({str(Path(p).resolve()) + "/" for key, p in sysconfig.get_paths().items()
                       if key in ("stdlib", "platstdlib", "purelib", "platlib")})
    own = [f for f in frames if not str(Path(f.filename).resolve()).startswith(libraries)]
    if not own and not users_only:
        own = frames
    return f" (at {Path(own[-1].filename).name}:{own[-1].lineno})" if own else ""


def import_user_module(module_name: str, what: str, error: type[ValueError] = ValueError) -> ModuleType:
    """A user's module (`what`'s: "task", "loop"), or `error` in one line: not found (where to put it), a module it
    imports not installed, or its own code failing as it ran (what it raised, and where: review, "importing it raised
    ZeroDivisionError" named no file)."""
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        ours = missing is not None and (module_name == missing or module_name.startswith(f"{missing}."))
        hint = ("; a module of your own must be importable: put it next to the study file (or the config file), "
                "or install it, or add its folder to PYTHONPATH") if ours else (
                f"; the module was found, and {missing!r}, which it imports, was not: install it in this "
                "environment") if missing is not None else ""
        # Raised by the module's own import of something missing (`from os import nope`): where, as for any error
        raise error(f"cannot import {what} module {short_repr(module_name)}: {exc}{raised_at(exc, users_only=True)}"
                    f"{hint}") from exc
    except (Exception, SystemExit) as exc:  # the module's own code failed as it ran (SyntaxError, a raise, exit())
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise error(f"cannot import {what} module {short_repr(module_name)}: importing it raised {type(exc).__name__}: "
                    f"{detail}{raised_at(exc)}") from exc
