"""The README's first command: the quickstart study runs to completion and leaves a study plain Optuna reads."""

from __future__ import annotations

import shutil
from pathlib import Path

import optuna
from optuna.trial import TrialState

from tests.conftest import ROOT, sweep_cli


def test_quickstart_runs_to_completion(tmp_path: Path) -> None:
    study_file = tmp_path / "quickstart.yaml"
    shutil.copy(ROOT / "studies" / "quickstart.yaml", study_file)  # its database lands next to the copy
    done = sweep_cli("run", study_file)
    assert done.returncode == 0, done.stderr
    study = optuna.load_study(study_name="quickstart", storage=f"sqlite:///{tmp_path / 'quickstart.db'}")
    states = [t.state for t in study.trials]
    assert len(states) == 24 and TrialState.FAIL not in states and TrialState.RUNNING not in states
    assert states.count(TrialState.COMPLETE) >= 5
    assert study.best_value < 0.15  # digits MLPs reach ~0.05 validation loss
