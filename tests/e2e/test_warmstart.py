"""Warm start through the real CLI on a real SQLite study: donors, lineage, handoff, reproduce, retention, artifacts."""

from __future__ import annotations

import copy
import hashlib
import sqlite3
from pathlib import Path

import optuna
from optuna.trial import TrialState

from tests.conftest import TINY_STUDY, run_cli, write_study


def warm_study(folder: Path, **extra) -> Path:
    document = copy.deepcopy(TINY_STUDY) | {"name": "warm", "n_trials": 8,
                                            "warm_start": {"max_distance": 1.0}, **extra}
    document["fixed"] = {**document["fixed"], "max_steps": 40, "eval_every_steps": 10}
    document["space"] = {"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True},
                         "model.hidden": {"type": "categorical", "choices": [16, 32]}}
    return write_study(folder, document)


def load(folder: Path) -> optuna.Study:
    return optuna.load_study(study_name="warm", storage=f"sqlite:///{folder / 'warm.db'}")


def test_trials_start_from_their_nearest_compatible_neighbour(tmp_path: Path) -> None:
    path = warm_study(tmp_path)
    done = run_cli("run", path)
    assert done.returncode == 0, done.stderr
    trials = {t.number: t for t in load(tmp_path).get_trials()}
    assert all(t.state == TrialState.COMPLETE for t in trials.values())
    warm = [t for t in trials.values() if "warm_start_from" in t.user_attrs]
    assert len(warm) >= 4  # each shape has a donor after its first trial
    for trial in warm:
        parent = trial.user_attrs["warm_start_from"]
        donor = trials[parent["trial"]]
        assert donor.params["model.hidden"] == trial.params["model.hidden"]  # never across shapes
        assert donor.datetime_complete <= trial.datetime_start  # only finished trials donate
        assert parent["step"] == 20  # the handoff: half of the 40-step budget
        # Its first report is the donor's state evaluated again: the donor's own value at that step.
        assert min(trial.intermediate_values) == 20
        assert abs(trial.intermediate_values[20] - donor.intermediate_values[20]) <= 1e-6
        assert trial.user_attrs["steps_trained"] == 20 and trial.user_attrs["steps"] == 40
        assert Path(parent["uri"]).exists()
    with sqlite3.connect(tmp_path / "warm.db") as connection:
        pinned = {row[0] for row in connection.execute("SELECT id FROM sweep_checkpoints WHERE pinned = 1")}
    assert {t.user_attrs["warm_start_from"]["checkpoint_id"] for t in warm} <= pinned

    status = run_cli("status", path)
    assert f"{len(warm)} trials warm-started" in status.stdout  # and the compute the study trained itself
    assert f"{sum(t.user_attrs['steps_trained'] for t in trials.values())} steps trained" in status.stdout

    [replayed] = warm[-1:]
    again = run_cli("reproduce", path, str(replayed.number))
    assert again.returncode == 0, again.stderr
    assert "identical" in again.stdout
    parent_file = Path(replayed.user_attrs["warm_start_from"]["uri"])
    parent_file.write_bytes(parent_file.read_bytes()[:-10])  # a damaged parent is refused, not loaded
    broken = run_cli("reproduce", path, str(replayed.number))
    assert broken.returncode != 0 and "warm-started" in broken.stderr


def test_study_retention_keeps_the_best_trials_and_every_parent(tmp_path: Path) -> None:
    path = warm_study(tmp_path, checkpoints={"keep_top_trials": 1})
    assert run_cli("run", path).returncode == 0
    trials = load(tmp_path).get_trials()
    parents = {t.user_attrs["warm_start_from"]["uri"] for t in trials if "warm_start_from" in t.user_attrs}
    best = min(trials, key=lambda t: t.value)
    with sqlite3.connect(tmp_path / "warm.db") as connection:
        rows = connection.execute("SELECT trial_number, uri, pinned FROM sweep_checkpoints").fetchall()
    assert {n for n, _, pinned in rows if not pinned} <= {best.number}  # others keep only what a trial started from
    assert parents <= {uri for _, uri, _ in rows}
    files = {str(p) for p in (tmp_path / "warm.checkpoints" / "warm").glob("*.pt")}
    assert files == {uri for _, uri, _ in rows}  # no orphan blobs, no rows without a blob


def test_each_trial_uploads_its_best_checkpoint_as_an_optuna_artifact(tmp_path: Path) -> None:
    path = warm_study(tmp_path, n_trials=2, warm_start={"enabled": False})
    assert run_cli("run", path).returncode == 0
    study = load(tmp_path)
    store = optuna.artifacts.FileSystemArtifactStore(study.user_attrs["sweep.artifacts"])
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'warm.db'}")
    for trial in study.get_trials():
        meta = optuna.artifacts.get_all_artifact_meta(trial, storage=storage)
        [artifact] = meta
        recorded = trial.user_attrs["checkpoint"]
        assert artifact.artifact_id == recorded["artifact_id"]
        target = tmp_path / f"download-{trial.number}.pt"
        optuna.artifacts.download_artifact(artifact_store=store, artifact_id=artifact.artifact_id,
                                           file_path=str(target))
        assert hashlib.sha256(target.read_bytes()).hexdigest() == recorded["sha256"]
        assert recorded["value"] == trial.value  # the best checkpoint is the trial's final best
