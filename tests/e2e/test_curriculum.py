"""A curriculum study through the real `sweep` command, into a real SQLite file."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import optuna
from optuna.trial import TrialState

from tests.conftest import ROOT, TINY_STUDY, sweep_cli, write_study
from trainer import TrainingConfig


def test_the_shipped_curriculum_study_runs_end_to_end_and_each_trial_trains_its_schedule(tmp_path: Path) -> None:
    study_file = tmp_path / "curriculum.yaml"
    shutil.copy(ROOT / "studies" / "curriculum.yaml", study_file)  # the database lands next to it, in tmp_path
    # The shipped file, shrunk to one learning rate and one seed: one short trial per schedule.
    done = sweep_cli("run", study_file, "--set", "fixed.max_steps=40", "--set", "fixed.eval_every_steps=20",
                   "--set", "fixed.log_every_steps=20", "--set", "space.learning_rate.choices=[0.01]",
                   "--set", "space.seed.choices=[0]")
    assert done.returncode == 0, done.stderr
    study = optuna.load_study(study_name="curriculum", storage=f"sqlite:///{tmp_path / 'curriculum.db'}")
    trials = study.get_trials()
    assert len(trials) == 4 and all(t.state == TrialState.COMPLETE for t in trials), [t.state for t in trials]
    assert {t.params["curriculum.schedule"] for t in trials} == {"none", "linear", "exponential", "step"}
    for trial in trials:
        config = TrainingConfig.from_dict(trial.user_attrs["config"])  # the stored config reads back whole
        assert config.curriculum.schedule == trial.params["curriculum.schedule"]
        assert config.curriculum.start_level == 0.2 and config.curriculum.end_fraction == 0.5  # from `fixed`
        assert sorted(trial.intermediate_values) == [0, 20, 40]  # fast-fail's step-0 reference, then every 20
        assert trial.value == trial.intermediate_values[40]
    # Different curricula saw different data: the final values differ.
    assert len({t.value for t in trials}) == 4


def test_bad_curriculum_keys_are_refused_before_any_trial_runs(tmp_path: Path) -> None:
    document = copy.deepcopy(TINY_STUDY)
    document["fixed"] = {**document["fixed"], "curriculum": {"stages": 1}}
    document["space"] = {"curriculum.schedule": {"type": "categorical", "choices": ["linear", "cubic"]},
                         "curriculum.pace": {"type": "float", "low": 0.1, "high": 0.5}}
    path = write_study(tmp_path, document)
    done = sweep_cli("run", path)
    assert done.returncode == 2, done.stderr
    assert "fixed.curriculum.stages: expected at least 2" in done.stderr
    assert "space.curriculum.schedule.choices[1]: expected one of none, constant, linear" in done.stderr
    assert "space.curriculum.pace: not a searchable TrainingConfig key" in done.stderr
    assert "trial 0" not in done.stderr  # refused before any trial started


def test_a_searched_curriculum_parameter_reaches_the_trial(tmp_path: Path) -> None:
    document = copy.deepcopy(TINY_STUDY) | {"task": "blobs", "n_trials": 2, "sampler": {"type": "bruteforce"}}
    document["fixed"] = {**document["fixed"], "curriculum": {"schedule": "step"}}
    document["space"] = {"curriculum.stages": {"type": "int", "low": 2, "high": 3}}
    path = write_study(tmp_path, document)
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").get_trials()
    assert sorted(t.user_attrs["config"]["curriculum"]["stages"] for t in trials) == [2, 3]
    assert all(t.user_attrs["config"]["curriculum"]["schedule"] == "step" for t in trials)
