"""Warm start through the real CLI on a real SQLite study: donors, lineage, handoff, reproduce, retention, artifacts."""

from __future__ import annotations

import copy
import hashlib
import sqlite3
import wsgiref.util
from pathlib import Path

import optuna
import optuna_dashboard
import pytest
import yaml
from optuna.trial import TrialState

from sweep.cli import dashboard_artifact_store
from tests.conftest import TINY_STUDY, sweep_cli, write_study


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
    done = sweep_cli("run", path)
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
        # Its reports start with the steps it trained itself: the donor's state at the handoff is the lineage's
        # value, not this trial's, so it is neither stored nor judged.
        assert min(trial.intermediate_values) == 30
        assert f"steps 0-20 trained with the config of trial #{donor.number}" in trial.user_attrs["lineage"]
        assert trial.user_attrs["steps_trained"] == 20 and trial.user_attrs["steps"] == 40
        assert (tmp_path / "warm.checkpoints" / "warm" / parent["uri"]).exists()  # relative to the study's folder
    with sqlite3.connect(tmp_path / "warm.db") as connection:
        pinned = {row[0] for row in connection.execute("SELECT id FROM sweep_checkpoints WHERE pinned = 1")}
    assert {t.user_attrs["warm_start_from"]["checkpoint_id"] for t in warm} <= pinned

    status = sweep_cli("status", path)
    assert f"{len(warm)} trials warm-started" in status.stdout  # and the compute the study trained itself
    assert f"{sum(t.user_attrs['steps_trained'] for t in trials.values())} steps trained" in status.stdout

    [replayed] = warm[-1:]
    again = sweep_cli("reproduce", path, str(replayed.number))
    assert again.returncode == 0, again.stderr
    assert "identical" in again.stdout
    # A study file edited since to name another store (found by review: "checkpoint .../moved/... does not exist"
    # while the parent lay intact where the study ran): the parent is read where the study ran, still there.
    original = path.read_text()
    path.write_text(original + "checkpoints: {store: moved}\n")
    again = sweep_cli("reproduce", path, str(replayed.number))
    assert again.returncode == 0 and "identical" in again.stdout, again.stderr
    path.write_text(original)
    parent_file = tmp_path / "warm.checkpoints" / "warm" / replayed.user_attrs["warm_start_from"]["uri"]
    parent_file.write_bytes(parent_file.read_bytes()[:-10])  # a damaged parent is refused, not loaded
    broken = sweep_cli("reproduce", path, str(replayed.number))
    assert broken.returncode != 0 and "warm-started" in broken.stderr


def test_study_retention_keeps_the_best_trials_and_every_parent(tmp_path: Path) -> None:
    path = warm_study(tmp_path, checkpoints={"keep_top_trials": 1})
    done = sweep_cli("run", path)
    assert done.returncode == 0 and "checkpoint" not in done.stderr, done.stderr  # no bookkeeping step failed
    trials = load(tmp_path).get_trials()
    parents = {t.user_attrs["warm_start_from"]["uri"] for t in trials if "warm_start_from" in t.user_attrs}
    best = min(trials, key=lambda t: t.value)
    with sqlite3.connect(tmp_path / "warm.db") as connection:
        rows = connection.execute("SELECT trial_number, uri, pinned FROM sweep_checkpoints").fetchall()
    assert {n for n, _, pinned in rows if not pinned} <= {best.number}  # others keep only what a trial started from
    assert parents <= {uri for _, uri, _ in rows}
    files = {p.name for p in (tmp_path / "warm.checkpoints" / "warm").glob("*.pt")}  # URIs: relative names
    assert files == {uri for _, uri, _ in rows}  # no orphan blobs, no rows without a blob
    # A trial that retention drops loses its artifact too (a copy of its best checkpoint): only the best keeps one.
    artifacts = {p.name for p in Path(load(tmp_path).user_attrs["sweep.artifacts"]).iterdir()}
    assert artifacts == {best.user_attrs["checkpoint"]["artifact_id"]}
    # Trials dropped after they finished are still listed (Optuna cannot edit a finished trial): through the real
    # dashboard app, `sweep dashboard`'s store serves a note for them instead of a server error.
    study = load(tmp_path)
    app = optuna_dashboard.wsgi(f"sqlite:///{tmp_path / 'warm.db'}", artifact_store=dashboard_artifact_store(
        study, str(tmp_path / "warm.checkpoints")))
    dropped = [t for t in trials if "checkpoint" in t.user_attrs and t.number != best.number]
    assert dropped  # seed 0: trials 0, 1 and 6 were each the best when they finished
    for trial in [best, *dropped]:
        status, body = get(app, f"/artifacts/{study._study_id}/{trial._trial_id}/"
                                f"{trial.user_attrs['checkpoint']['artifact_id']}")
        assert status.startswith("200")
        if trial is best:
            assert hashlib.sha256(body).hexdigest() == best.user_attrs["checkpoint"]["sha256"]
        else:
            assert body.startswith(b"sweep: this trial's checkpoint was deleted by the study's retention")


def get(app, path: str) -> tuple[str, bytes]:
    """One GET through a WSGI app, in process."""
    environ: dict = {"PATH_INFO": path}
    wsgiref.util.setup_testing_defaults(environ)
    answer: list[str] = []
    body = b"".join(app(environ, lambda status, headers, exc_info=None: answer.append(status)))
    return answer[0], body


UNSTABLE_TASK = """
import torch
from torch import nn
from trainer.tasks import digits


class BreaksAfter(nn.Module):
    \"\"\"After `after` training steps its output is NaN (the trial diverges) or it raises (the trial crashes).\"\"\"

    def __init__(self, inner, how, after):
        super().__init__()
        self.inner, self.how, self.after, self.calls = inner, how, after, 0

    def forward(self, x):
        out = self.inner(x)
        if self.training:
            self.calls += 1
            if self.calls > self.after:
                if self.how == "raise":
                    raise RuntimeError("the data loader's disk went away")
                return out * float("nan")
        return out


def task():
    t = digits()
    build = t.build_model

    def build_model(cfg):
        how = {16: "nan", 24: "raise"}.get(cfg["hidden"])
        return BreaksAfter(build(cfg), how, 25) if how else build(cfg)

    t.build_model = build_model
    return t
"""


def test_trials_that_diverge_or_crash_release_their_checkpoints_to_retention(tmp_path: Path) -> None:
    # They wrote checkpoints before they broke; those were never final, so no retention rule ever deleted them.
    (tmp_path / "unstable.py").write_text(UNSTABLE_TASK)
    document = copy.deepcopy(TINY_STUDY) | {
        "name": "warm", "task": "unstable:task", "n_trials": 3, "sampler": "bruteforce",
        "checkpoints": {"every_steps": 10, "keep_top_trials": 1}, "max_repeated_failures": 0,
        "space": {"model.hidden": {"type": "categorical", "choices": [8, 16, 24]}}}
    document["fixed"] = {**document["fixed"], "max_steps": 40, "eval_every_steps": 10, "learning_rate": 0.01}
    path = write_study(tmp_path, document)
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    trials = {t.params["model.hidden"]: t for t in load(tmp_path).get_trials()}
    assert trials[8].state == TrialState.COMPLETE
    assert trials[16].state == TrialState.FAIL and trials[16].user_attrs["fail_reason"].startswith("diverged")
    assert trials[24].state == TrialState.FAIL and "disk went away" in trials[24].user_attrs["fail_reason"]
    assert "checkpoint" not in done.stderr, done.stderr  # no bookkeeping step failed (each would warn)
    with sqlite3.connect(tmp_path / "warm.db") as connection:
        rows = connection.execute("SELECT trial_number, uri, final, value FROM sweep_checkpoints").fetchall()
    assert rows and all(final == 1 for _, _, final, _ in rows)  # every ended trial's checkpoints are final
    # keep_top_trials: 1 (nothing is pinned: warm start is off); failed trials rank after the completed one
    assert {n for n, *_ in rows} == {trials[8].number}
    files = {p.name for p in (tmp_path / "warm.checkpoints" / "warm").glob("*.pt")}  # URIs: relative names
    assert files == {uri for _, uri, _, _ in rows}
    artifacts = {p.name for p in Path(load(tmp_path).user_attrs["sweep.artifacts"]).iterdir()}
    assert artifacts == {trials[8].user_attrs["checkpoint"]["artifact_id"]}


def test_each_trial_uploads_its_best_checkpoint_as_an_optuna_artifact(tmp_path: Path) -> None:
    path = warm_study(tmp_path, n_trials=2, warm_start={"enabled": False})
    assert sweep_cli("run", path).returncode == 0
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


def test_confirm_retrains_the_best_warm_trials_cold_within_the_budget(tmp_path: Path) -> None:
    path = warm_study(tmp_path, warm_start={"max_distance": 1.0, "confirm": 2})
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    trials = load(tmp_path).get_trials()
    assert len(trials) == 8 and all(t.state == TrialState.COMPLETE for t in trials)  # counted in the budget
    confirmations = [t for t in trials if "confirms" in t.user_attrs]
    assert [t.number for t in confirmations] == [6, 7]  # the last two trials of the budget
    warm = sorted((t for t in trials if "warm_start_from" in t.user_attrs), key=lambda t: t.value)
    assert {t.user_attrs["confirms"] for t in confirmations} == {t.number for t in warm[:2]}  # the best two warm
    by_number = {t.number: t for t in trials}
    for cold in confirmations:
        original = by_number[cold.user_attrs["confirms"]]
        assert cold.params == original.params and "warm_start_from" not in cold.user_attrs
        assert min(cold.intermediate_values) == 10 and cold.user_attrs["steps_trained"] == 40  # from scratch
        assert cold.user_attrs["lineage"].startswith(f"cold confirmation of warm trial #{original.number}")

    # The study's best is the best value a trial reached cold; warm values are shown beside their confirmations.
    cold_best = min((t for t in trials if "warm_start_from" not in t.user_attrs), key=lambda t: t.value)
    status = sweep_cli("status", path)
    assert status.returncode == 0, status.stderr
    assert f"#{cold_best.number}  value {cold_best.value:.6g}" in status.stdout
    for cold in confirmations:
        original = by_number[cold.user_attrs["confirms"]]
        assert (f"warm #{original.number} {original.value:.6g} -> cold #{cold.number} {cold.value:.6g}"
                in status.stdout)
    best = sweep_cli("best", path)
    assert best.returncode == 0 and "warning" not in best.stderr, best.stderr
    assert f"learning_rate: {cold_best.user_attrs['config']['learning_rate']}" in best.stdout
    report = tmp_path / "report.html"
    assert sweep_cli("report", path, "-o", report).returncode == 0
    assert "Confirmed cold" in report.read_text()


@pytest.mark.parametrize("how", [[], ["--cohort", "2"]], ids=["alone", "cohort"])
def test_a_grid_that_runs_out_with_budget_left_still_confirms_its_best_warm_trials(tmp_path: Path,
                                                                                  how: list[str]) -> None:
    # Review: confirmations are queued for the budget's last trials, and a bruteforce grid ran out before them: the
    # study ended at 6 of 12 trials with its warm values never retrained cold, and said nothing of it.
    path = warm_study(tmp_path, n_trials=12, sampler="bruteforce", warm_start={"max_distance": 1.0, "confirm": 2})
    document = yaml.safe_load(path.read_text())
    document["space"]["learning_rate"] = {"type": "categorical", "choices": [0.003, 0.01, 0.03]}
    path.write_text(yaml.safe_dump(document))
    done = sweep_cli("run", path, *how)
    assert done.returncode == 0, done.stderr
    trials = load(tmp_path).get_trials()
    confirmations = [t for t in trials if "confirms" in t.user_attrs]
    warm = sorted((t for t in trials if "warm_start_from" in t.user_attrs), key=lambda t: t.value)
    assert len(warm) >= 2 and len(trials) == 8, [(t.number, t.params, t.user_attrs.get("confirms")) for t in trials]
    assert sorted(t.user_attrs["confirms"] for t in confirmations) == sorted(t.number for t in warm[:2])
    assert all(t.state == TrialState.COMPLETE and "warm_start_from" not in t.user_attrs for t in confirmations)
    assert "the sampler has tried every point of the search space; stopped with 8/12 trials done" in done.stderr
    again = sweep_cli("run", path, *how)  # nothing left to try or confirm
    assert again.returncode == 0 and "stopped with 8/12 trials done" in again.stderr, again.stderr
    assert len(load(tmp_path).get_trials()) == 8


def test_best_says_when_its_value_is_a_warm_start_s(tmp_path: Path) -> None:
    path = warm_study(tmp_path)
    assert sweep_cli("run", path).returncode == 0
    study = load(tmp_path)
    best = min(study.get_trials(), key=lambda t: t.value)
    assert "warm_start_from" in best.user_attrs  # seed 0: the best of this study is a warm trial
    done = sweep_cli("best", path)
    assert done.returncode == 0, done.stderr
    assert f"warning: trial {best.number}'s value" in done.stderr and "not confirmed cold" in done.stderr
    assert f"# trial {best.number}, value" in done.stdout  # the written YAML says so too
    status = sweep_cli("status", path)
    assert "lineage" in status.stdout and "its value belongs to this lineage" in status.stdout


def test_a_from_studies_name_the_storage_does_not_hold_is_named_in_a_warning(tmp_path: Path) -> None:
    # A typo in warm_start.from_studies silently gave no donors.
    path = warm_study(tmp_path, n_trials=1, warm_start={"enabled": True, "from_studies": ["warmm"]})
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    assert "warning: warm_start.from_studies: no study 'warmm' in sqlite:///" in done.stderr
    assert "so it gives no donors (its studies: warm)" in done.stderr


def test_a_preempted_trial_is_a_donor_again_once_its_retry_completes(tmp_path: Path) -> None:
    # The retry resumed past the handoff and wrote no handoff checkpoint of its own, and its lineage's stayed
    # marked "not a donor" after the retry completed: every preemption took a config out of the donor pool.
    import signal
    import subprocess
    import sys
    import time

    from tests.e2e.test_resume import checkpointed_steps, long_study

    path = long_study(tmp_path, n_trials=2, warm_start={"handoff": 0.2, "max_distance": 1.0},
                      space={"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}})
    db = tmp_path / "tiny.db"
    worker = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and max(checkpointed_steps(db, 0), default=0) <= 600:
            time.sleep(0.2)
        worker.send_signal(signal.SIGTERM)  # past its handoff (step 500), long before its end (3000)
        _, stderr = worker.communicate(timeout=120)
    finally:
        worker.kill()
    assert worker.returncode == 143, stderr
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    preempted, retry, fresh = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").trials
    assert preempted.user_attrs["fail_reason"].startswith("preempted") and retry.user_attrs["retry_of"] == 0
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["resumed_from"]["step"] > 500
    assert fresh.user_attrs["warm_start_from"]["trial"] == 0 and fresh.user_attrs["warm_start_from"]["step"] == 500


def test_a_from_studies_study_run_without_warm_start_is_named_in_a_warning_and_one_run_with_it_donates(
        tmp_path: Path) -> None:
    # A study run without warm_start keeps only its trials' latest and best checkpoints, all after this study's
    # handoff step: it silently gave no donors.
    storage = f"sqlite:///{tmp_path / 'shared.db'}"

    def run(name: str, n_trials: int, **warm_start: object) -> str:
        document = copy.deepcopy(TINY_STUDY) | {"name": name, "n_trials": n_trials, "storage": storage,
                                                **({"warm_start": warm_start} if warm_start else {})}
        document["fixed"] = {**document["fixed"], "max_steps": 40, "eval_every_steps": 10}
        done = sweep_cli("run", write_study(tmp_path, document, f"{name}.yaml"))
        assert done.returncode == 0, done.stderr
        return done.stderr

    def first_donor(name: str) -> object:
        return optuna.load_study(study_name=name, storage=storage).trials[0].user_attrs.get("warm_start_from")

    run("plain", 2)
    stderr = run("after-plain", 1, max_distance=1.0, from_studies=["plain"])
    assert ("warning: warm_start.from_studies: study 'plain' gives no donors so far: its earliest checkpoint is at "
            "step 40, after this study's handoff (step 20 at the latest)") in stderr
    assert "run it with warm_start" in stderr
    assert first_donor("after-plain") is None

    run("donor", 2, max_distance=1.0)
    stderr = run("after-donor", 1, max_distance=1.0, from_studies=["donor"])
    assert "gives no donors" not in stderr
    donor = first_donor("after-donor")
    assert isinstance(donor, dict) and donor["study"] == "donor" and donor["step"] == 20


def test_a_from_studies_donor_whose_study_fixed_another_optimizer_gives_no_optimizer_state(tmp_path: Path) -> None:
    # Review: with `inherit: weights+optimizer`, an SGD study's trials were donors to an AdamW study's (the optimizer,
    # fixed in both, is in neither's params): alone every trial failed on the momentum state (KeyError: 'step'), in a
    # cohort it was ignored. The donor's stored config says what its study fixed.
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    warm = {"max_distance": 1.0, "inherit": "weights+optimizer"}

    def run(name: str, optimizer: str, **extra: object) -> list[optuna.trial.FrozenTrial]:
        document = copy.deepcopy(TINY_STUDY) | {"name": name, "n_trials": 2, "storage": storage,
                                                "warm_start": {**warm, **extra}}
        document["fixed"] = {**document["fixed"], "max_steps": 40, "eval_every_steps": 10, "optimizer": optimizer,
                             "model": {"hidden": 16}}
        document["space"] = {"learning_rate": document["space"]["learning_rate"]}
        done = sweep_cli("run", write_study(tmp_path, document, f"{name}.yaml"))
        assert done.returncode == 0, done.stderr
        return optuna.load_study(study_name=name, storage=storage).get_trials()

    run("sgd", "sgd")
    adamw = run("adamw", "adamw", from_studies=["sgd"])
    assert [t.state for t in adamw] == [TrialState.COMPLETE] * 2
    assert not [t for t in adamw if (t.user_attrs.get("warm_start_from") or {}).get("study") == "sgd"]
    again = run("sgd-again", "sgd", from_studies=["sgd"])  # the same optimizer: a donor, as before
    assert (again[0].user_attrs.get("warm_start_from") or {}).get("study") == "sgd"


def test_a_from_studies_donor_in_its_own_store_is_read_there_and_never_deleted_by_the_reader(tmp_path: Path) -> None:
    # Review: the donor study kept its checkpoints in a store of its own (`checkpoints.store`; on a server database
    # each study file's folder has its own by default); the reading study looked for the blob in its store, found
    # nothing, and deleted the donor study's pinned row: that study's own later trials lost their donor.
    storage = f"sqlite:///{tmp_path / 'shared.db'}"

    def run(name: str, n_trials: int, **extra: object) -> list[optuna.trial.FrozenTrial]:
        document = copy.deepcopy(TINY_STUDY) | {"name": name, "n_trials": n_trials, "storage": storage, **extra}
        document["fixed"] = {**document["fixed"], "max_steps": 40, "eval_every_steps": 10}
        done = sweep_cli("run", write_study(tmp_path, document, f"{name}.yaml"))
        assert done.returncode == 0, done.stderr
        assert "not warm-starting" not in done.stderr, done.stderr
        return optuna.load_study(study_name=name, storage=storage).get_trials()

    def rows(study: str) -> list[tuple[int, int, int]]:
        with sqlite3.connect(tmp_path / "shared.db") as connection:
            return connection.execute("SELECT id, step, pinned FROM sweep_checkpoints WHERE study = ? ORDER BY id",
                                      (study,)).fetchall()

    run("donor", 2, warm_start={"max_distance": 1.0}, checkpoints={"store": "own-store"})
    before = rows("donor")
    assert (tmp_path / "own-store" / "donor").is_dir() and before
    [reader] = run("reader", 1, warm_start={"max_distance": 1.0, "from_studies": ["donor"]})
    assert reader.user_attrs["warm_start_from"]["study"] == "donor"
    assert [r[:2] for r in rows("donor")] == [r[:2] for r in before]
    done = sweep_cli("reproduce", str(tmp_path / "reader.yaml"), str(reader.number))
    assert done.returncode == 0, done.stderr

    # The donor's file gone from its store: the reader warns and starts cold; the row is the donor study's to drop.
    for blob in (tmp_path / "own-store" / "donor").glob("*.pt"):
        blob.unlink()
    document = copy.deepcopy(TINY_STUDY) | {"name": "reader-2", "n_trials": 1, "storage": storage,
                                            "warm_start": {"max_distance": 1.0, "from_studies": ["donor"]}}
    document["fixed"] = {**document["fixed"], "max_steps": 40, "eval_every_steps": 10}
    done = sweep_cli("run", write_study(tmp_path, document, "reader-2.yaml"))
    assert done.returncode == 0, done.stderr
    assert "not warm-starting from trial" in done.stderr and "of study 'donor'" in done.stderr
    assert [r[:2] for r in rows("donor")] == [r[:2] for r in before]


def test_a_warm_trial_s_parent_whose_row_is_gone_is_no_orphan_and_still_replays(tmp_path: Path) -> None:
    # Found by review: an older sweep resuming the study deleted a pinned donor's row (it could not resolve the newer
    # relative URI); `sweep check --repair` then deleted the donor's file as an orphan, and the warm trial could no
    # longer be reproduced. The trial keeps its parent's URI and hash: that file is never an orphan.
    import os

    path = warm_study(tmp_path, n_trials=3)
    assert sweep_cli("run", path).returncode == 0
    [warm] = [t for t in load(tmp_path).get_trials() if "warm_start_from" in t.user_attrs][:1]
    parent = warm.user_attrs["warm_start_from"]
    with sqlite3.connect(tmp_path / "warm.db") as connection:
        connection.execute("DELETE FROM sweep_checkpoints WHERE id = ?", (parent["checkpoint_id"],))
    folder = tmp_path / "warm.checkpoints" / "warm"
    for blob in folder.glob("*.pt"):  # older than the orphan scan's minimum age
        os.utime(blob, (blob.stat().st_mtime - 3600,) * 2)
    assert sweep_cli("check", path, "--repair").returncode == 0
    assert (folder / parent["uri"]).exists()
    again = sweep_cli("reproduce", path, str(warm.number))
    assert again.returncode == 0 and "identical" in again.stdout, again.stderr
