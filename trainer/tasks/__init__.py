"""Built-in tasks and the lookup of user tasks by import path."""

from __future__ import annotations

import contextlib
import inspect
import random
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from trainer.config import coerce
from trainer.imports import import_callable
from trainer.messages import did_you_mean
from trainer.tasks.arrays import arrays
from trainer.tasks.base import Task, TaskError, accuracy_sum, cross_entropy
from trainer.tasks.blobs import blobs
from trainer.tasks.charlm import charlm
from trainer.tasks.digits import digits

__all__ = ["BUILTIN_TASKS", "Task", "TaskError", "accuracy_sum", "argument_defaults", "argument_names", "cross_entropy",
           "load_task", "resolve_task_factory"]

BUILTIN_TASKS: dict[str, Callable[..., Task]] = {"digits": digits, "charlm": charlm, "blobs": blobs,
                                                 "arrays": arrays}


def resolve_task_factory(name: str) -> Callable[..., Task]:
    """A built-in task by name, or `package.module:function` for a user task."""
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]
    return import_callable(name, "task", BUILTIN_TASKS, TaskError)


@contextlib.contextmanager
def _seeded() -> Iterator[None]:
    """Python's, numpy's and torch's global generators seeded with 0 while a task factory runs, and put back after:
    a factory that draws its data from them unseeded (`np.random.normal(...)`) makes the same data each time it is
    called, in every process (a worker builds its task more than once, `sweep reproduce` again), and nothing else
    sees its draws."""
    python, legacy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(0)
        np.random.seed(0)
        torch.random.default_generator.manual_seed(0)  # not CUDA's: fork_rng puts back only the CPU's
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(legacy)


def argument_defaults(name: str) -> dict[str, Any] | None:
    """The keyword arguments of the task named `name` and their defaults (`inspect.Parameter.empty` for one it
    requires), or None when its function cannot be found or read (`load_task` says why)."""
    try:
        parameters = inspect.signature(resolve_task_factory(name)).parameters.values()
    except Exception:  # noqa: BLE001 - not found, not importable, no signature
        return None
    return {p.name: p.default for p in parameters
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


def argument_names(factory: Callable[..., Any]) -> list[str] | None:
    """The keyword arguments a task's function takes, in order; None when it takes any (**kwargs) or has no
    signature to read."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                      inspect.Parameter.KEYWORD_ONLY)]


def _unknown_argument(factory: Callable[..., Any], args: Mapping[str, Any]) -> str | None:
    """`"KEY: ..."` for the first of `args` that the task's function takes no argument of (with the closest name
    and those it takes), or None (it takes them all, or **kwargs, or it has no signature to read)."""
    names = argument_names(factory)
    if names is None:
        return None
    for key in sorted(set(args) - set(names)):
        hint = did_you_mean(key, names)  # `train_X` is `train_x` in other case (tasks review: it said `train_y`)
        return f"{key}: not an argument of the task{hint}; expected one of: {', '.join(names) or '(none)'}"
    return None


_TOO_BIG = ("array is too big", "Maximum allowed dimension exceeded", "Maximum allowed size exceeded")


def _too_big(name: str, exc: BaseException) -> TaskError:
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return TaskError(f"task {name!r}: its task_args ask for more memory than this machine has ({type(exc).__name__}"
                     f"{': ' + first if first else ''}); make the data smaller")


def load_task(name: str, args: Mapping[str, Any] | None = None) -> Task:
    factory = resolve_task_factory(name)
    args = dict(args or {})
    try:  # an argument the function annotates is checked (and converted: `1e-3` read as text) as config keys are
        hints = typing.get_type_hints(factory)
    except Exception:  # noqa: BLE001 - no hints, or hints that cannot be resolved: the call says what is wrong
        hints = {}
    for key in sorted(args.keys() & hints.keys() - {"return"}):
        try:
            ok, coerced, message = coerce(args[key], hints[key])
        except TypeError:  # an annotation the config's types do not cover (a list, a path): the function checks it
            continue
        if not ok:
            raise TaskError(f"task {name!r}: task_args.{key}: {message}")
        args[key] = coerced
    if (unknown := _unknown_argument(factory, args)) is not None:
        raise TaskError(f"task {name!r}: task_args.{unknown}")
    try:
        with _seeded():
            task = factory(**args)
    except TypeError as exc:  # an argument its signature did not tell of
        raise TaskError(f"task {name!r}: {exc}") from exc
    except TaskError:
        raise
    except ValueError as exc:  # the factory, or the Task it made, refused its arguments (one line, named); an OSError
        # (its data not found) keeps its type, and any other exception is a bug in the task, whose traceback says where
        first = (str(exc).strip().splitlines() or [""])[0]
        if first.startswith(_TOO_BIG):  # numpy's MemoryError, for an array no machine could hold (n: 2**63 - 1)
            raise _too_big(name, exc) from exc
        raise TaskError(f"{name} raised {type(exc).__name__}: {first}") from exc
    except MemoryError as exc:  # its arguments ask for more data than this machine holds (`blobs` with n: 1e11)
        raise _too_big(name, exc) from exc
    if not isinstance(task, Task):
        raise TaskError(f"task {name!r} returned {type(task).__name__}, expected trainer.tasks.Task")
    return task
