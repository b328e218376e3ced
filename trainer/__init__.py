"""The PyTorch trainer: one `TrainingConfig` in, one trained model and its metrics out. Imports torch and numpy only.

The names below are imported on first use (PEP 562), not with the package: `import trainer.config` must stay cheap
and torch-free (the sweep's command line reads configs and study files without loading torch), and Python imports a
package's `__init__` before any of its modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import ConfigError, TrainingConfig
    from trainer.loop import NullReporter, Reporter, TrainResult, train
    from trainer.tasks import Task, load_task

__all__ = ["ConfigError", "NullReporter", "Reporter", "Task", "TrainResult", "TrainingConfig", "load_task", "train"]

_HOMES = {
    "ConfigError": "trainer.config",
    "TrainingConfig": "trainer.config",
    "NullReporter": "trainer.loop",
    "Reporter": "trainer.loop",
    "TrainResult": "trainer.loop",
    "train": "trainer.loop",
    "Task": "trainer.tasks",
    "load_task": "trainer.tasks",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
