"""Built-in tasks and the lookup of user tasks by import path."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from trainer.tasks.base import Task, accuracy_sum, cross_entropy
from trainer.tasks.blobs import blobs
from trainer.tasks.charlm import charlm
from trainer.tasks.digits import digits

__all__ = ["BUILTIN_TASKS", "Task", "TaskError", "accuracy_sum", "cross_entropy", "load_task", "resolve_task_factory"]

BUILTIN_TASKS: dict[str, Callable[..., Task]] = {"digits": digits, "charlm": charlm, "blobs": blobs}


class TaskError(ValueError):
    """A task that cannot be found or built; the message names the task."""


def resolve_task_factory(name: str) -> Callable[..., Task]:
    """A built-in task by name, or `package.module:function` for a user task."""
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]
    module_name, sep, attr = name.partition(":")
    if not sep:
        raise TaskError(f"unknown task {name!r}; expected one of {sorted(BUILTIN_TASKS)} or 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(f"cannot import task module {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TaskError(f"task {name!r}: module {module_name!r} has no function {attr!r}")
    return factory


def load_task(name: str, args: Mapping[str, Any] | None = None) -> Task:
    factory = resolve_task_factory(name)
    try:
        task = factory(**dict(args or {}))
    except TypeError as exc:  # an unknown task_args key
        raise TaskError(f"task {name!r}: {exc}") from exc
    if not isinstance(task, Task):
        raise TaskError(f"task {name!r} returned {type(task).__name__}, expected trainer.tasks.Task")
    return task
