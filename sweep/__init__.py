"""sweep: hyperparameter sweeps with early pruning for neural-network research, on Optuna and PyTorch.

The names below load their modules on first use, so `import sweep` (and `sweep --help`) costs neither torch nor
Optuna's import time.
"""

from __future__ import annotations

import importlib

# Not typing's TYPE_CHECKING: importing typing here took milliseconds of the `sweep` command's start before its entry
# point could answer a Ctrl-C (sweep/__main__.py), which then printed a traceback.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from sweep.spec import StudyFileError, StudySpec, load_spec
    from sweep.study import open_study, run_study

__all__ = ["StudyFileError", "StudySpec", "load_spec", "open_study", "run_study"]

_HOMES = {"StudyFileError": "sweep.schema", "StudySpec": "sweep.schema", "load_spec": "sweep.spec",
          "open_study": "sweep.study", "run_study": "sweep.study"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'sweep' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
