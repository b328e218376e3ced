"""sweep: hyperparameter sweeps with early pruning for neural-network research, on Optuna and PyTorch."""

from __future__ import annotations

from sweep.spec import StudyFileError, StudySpec, load_spec
from sweep.study import open_study, run_study

__all__ = ["StudyFileError", "StudySpec", "load_spec", "open_study", "run_study"]
