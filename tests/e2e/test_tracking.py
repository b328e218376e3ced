"""Tracking (`tracking:` in the study file) after a real small study through the real CLI, read back with each
backend's own reader: TensorBoard's event-file reader, MLflow's client."""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from tests.conftest import CLI_ENV, ROOT, TINY_STUDY, run_cli, sweep_cli, write_study

LOGGED = ["curriculum_level", "grad_norm", "lr", "samples_per_s", "train_loss"]  # what the trainer logs on a CPU


def tracked_study(tmp_path: Path, tracking: dict[str, Any], **edits: Any) -> tuple[list[optuna.trial.FrozenTrial],
                                                                                   str]:
    document = copy.deepcopy(TINY_STUDY) | {"tracking": tracking, **edits}
    document["fixed"] = {**document["fixed"], "log_every_steps": 5}  # 4 log steps, 2 evaluations (+ step 0)
    done = sweep_cli("run", write_study(tmp_path, document))
    assert done.returncode == 0, done.stderr
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}")
    return study.get_trials(), done.stderr


def event_runs(folder: Path) -> dict[str, Any]:
    """Every run under `folder`, loaded by TensorBoard's own reader (the one its server uses)."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(folder))
    multiplexer.Reload()
    return {name: multiplexer.GetAccumulator(name) for name in multiplexer.Runs()}


def session_hparams(accumulator: Any) -> tuple[dict[str, Any], list[str]]:
    """The run's hparams session (params and their values) and the metrics the hparams view shows for it."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    params: dict[str, Any] = {}
    metrics: list[str] = []
    for content in accumulator.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            for name, value in data.session_start_info.hparams.items():
                kind = value.WhichOneof("kind")
                params[name] = getattr(value, kind)
        if data.HasField("experiment"):
            metrics = [m.name.tag for m in data.experiment.metric_infos]
    return params, metrics


def test_tensorboard_holds_every_trial_every_logged_step_params_and_final_values(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    trials, _ = tracked_study(tmp_path, {"tensorboard": True})
    runs = event_runs(tmp_path / "tiny.tensorboard")
    assert sorted(runs) == [f"tiny/trial-{t.number:05d}" for t in trials]  # grouped by study, then trial
    for trial in trials:
        run = runs[f"tiny/trial-{trial.number:05d}"]
        tags = run.Tags()["scalars"]
        for name in LOGGED:
            assert [e.step for e in run.Scalars(f"train/{name}")] == [5, 10, 15, 20], name
        assert [e.step for e in run.Scalars("train/train_loss")] == [5, 10, 15, 20]
        evals = {e.step: e.value for e in run.Scalars("eval/val_loss")}
        assert evals == pytest.approx(trial.intermediate_values, rel=1e-6)  # the same values the study stored
        assert "eval/val_accuracy" in tags
        params, metrics = session_hparams(run)
        assert params == pytest.approx({**trial.params, "state": "complete"})
        assert sorted(metrics) == ["eval/val_loss", "final/val_loss"]
        [final] = run.Scalars("final/val_loss")
        assert trial.state == TrialState.COMPLETE and final.value == pytest.approx(trial.value, rel=1e-6)
        assert final.step == 20


PICKY_TASK = """
import dataclasses
from trainer.tasks import load_task


def digits(**args):
    task = load_task("digits", args)
    build = task.build_model

    def picky(cfg):
        if cfg["hidden"] % 2:
            raise ValueError(f"hidden {cfg['hidden']} is odd, which this model refuses")
        return build(cfg)

    return dataclasses.replace(task, build_model=picky)
"""


def test_a_trial_that_fails_before_it_trains_has_its_tracking_run_too(tmp_path: Path) -> None:
    # Review: with warm start on, the model is built (for its shapes) before the trackers open; a config the model
    # refuses failed there, and its trial had no run in TensorBoard or MLflow, where every other trial has one.
    pytest.importorskip("tensorboard")
    (tmp_path / "picky.py").write_text(PICKY_TASK)
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 4, "task": "picky:digits", "tracking": {"tensorboard": True},
                                            "warm_start": {"max_distance": 1.0}}
    done = sweep_cli("run", write_study(tmp_path, document), pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").get_trials()
    assert {t.state for t in trials} == {TrialState.COMPLETE, TrialState.FAIL}  # seed 0: hidden 25, 21, 24, 30
    runs = event_runs(tmp_path / "tiny.tensorboard")
    assert sorted(runs) == [f"tiny/trial-{t.number:05d}" for t in trials]
    for trial in trials:
        params, _ = session_hparams(runs[f"tiny/trial-{trial.number:05d}"])
        assert params == pytest.approx({**trial.params, "state": trial.state.name.lower().replace("fail", "failed")})


def test_tracking_off_writes_no_tracking_files(tmp_path: Path) -> None:
    trials, _ = tracked_study(tmp_path, {})
    assert all(t.state == TrialState.COMPLETE for t in trials)
    written = {p.name for p in tmp_path.iterdir()}
    assert "tiny.tensorboard" not in written and "tiny.mlflow.db" not in written and "mlruns" not in written
    assert written >= {"study.yaml", "tiny.db", "tiny.checkpoints"}


def test_tracking_off_imports_neither_library(tmp_path: Path) -> None:
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 1})
    script = ("import sys\n"
              "from sweep.cli import app\n"
              f"try:\n    app(['run', {str(path)!r}])\n"
              "except SystemExit as exc:\n    assert exc.code == 0, exc.code\n"
              "print(sorted(m for m in ('tensorboard', 'mlflow', 'torch.utils.tensorboard') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **CLI_ENV, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_tracking_folder_that_is_a_file_is_refused_before_any_trial(tmp_path: Path) -> None:
    # It used to run every trial with one warning each ("tensorboard tracking dropped for this trial"): a folder that
    # can never be written is a mistake in the study file, refused as a checkpoint folder that cannot be made is.
    # What fails while trials run is still one warning per trial ("Never fails a trial", README).
    pytest.importorskip("tensorboard")
    (tmp_path / "blocked").write_text("a file where the folder should be\n")
    document = copy.deepcopy(TINY_STUDY) | {"tracking": {"tensorboard": {"dir": str(tmp_path / "blocked")}}}
    done = sweep_cli("run", write_study(tmp_path, document))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith("tracking.tensorboard.dir: " + str(tmp_path / "blocked") + " is a file; "
                                        "TensorBoard needs a folder there"), done.stderr
    assert not (tmp_path / "tiny.db").exists()


@pytest.mark.slow
def test_sweep_tensorboard_serves_the_study_s_runs_on_loopback(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    trials, _ = tracked_study(tmp_path, {"tensorboard": True})
    env = {**os.environ, **CLI_ENV, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "sweep.cli", "tensorboard", str(tmp_path / "tiny.db"),
                               "--port", "0"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                              env=env, cwd=tmp_path)
    try:
        assert server.stderr is not None
        seen = []
        while (line := server.stderr.readline()) and not (found := re.search(r"TensorBoard on (http://\S+/)", line)):
            seen.append(line)  # TensorBoard's own notes come first; pytest's timeout guards a silent server
        assert line and found, "".join(seen)
        url = found.group(1)
        assert url.startswith(("http://127.0.0.1:", "http://localhost:"))
        deadline, runs = time.monotonic() + 120, []
        while time.monotonic() < deadline:  # TensorBoard loads the event files in the background
            with urllib.request.urlopen(url + "data/runs", timeout=30) as response:
                runs = sorted(json.loads(response.read()))
            if len(runs) == len(trials):
                break
            time.sleep(0.5)
        assert runs == [f"trial-{t.number:05d}" for t in trials]
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_sweep_tensorboard_without_runs_is_a_one_line_error(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    tracked_study(tmp_path, {}, n_trials=1)
    done = sweep_cli("tensorboard", tmp_path / "tiny.db")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: no TensorBoard runs for study 'tiny' in {tmp_path / 'tiny.tensorboard' / 'tiny'}: its trials write "
        "them with tracking: {tensorboard: true} in the study file"]


def test_mlflow_holds_a_run_per_trial_under_the_study_s_run_with_every_step(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    trials, _ = tracked_study(tmp_path, {"mlflow": True}, n_trials=2)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'tiny.mlflow.db'}")
    experiment = client.get_experiment_by_name("tiny")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    [study_run] = [r for r in runs if r.data.tags.get("sweep.role") == "study"]
    assert study_run.info.run_name == "tiny" and study_run.info.status == "FINISHED"
    by_name = {r.info.run_name: r for r in runs if r.data.tags.get("sweep.role") == "trial"}
    assert sorted(by_name) == [f"trial-{t.number:05d}" for t in trials]
    for trial in trials:
        run = by_name[f"trial-{trial.number:05d}"]
        assert run.data.tags["mlflow.parentRunId"] == study_run.info.run_id
        assert run.data.params == {k: str(v) for k, v in trial.params.items()}
        for name in LOGGED:
            assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == [5, 10, 15, 20], name
        evals = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_loss")}
        assert evals == pytest.approx(trial.intermediate_values, rel=1e-6)
        assert run.data.metrics["final_val_loss"] == pytest.approx(trial.value, rel=1e-6)
        assert run.data.tags["sweep.state"] == "complete" and run.info.status == "FINISHED"
        checkpoint = json.loads(run.data.tags["sweep.checkpoint"])
        assert Path(checkpoint["uri"].removeprefix("file://")).name.startswith(f"trial{trial.number:05d}-step")
        artifacts = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / f"dl{trial.number}")))
        assert json.loads((artifacts / "config.json").read_text()) == trial.user_attrs["config"]
        assert json.loads((artifacts / "reproducibility.json").read_text()) == trial.user_attrs["reproducibility"]


@pytest.mark.parametrize(("uri", "folder"), [("sqlite:///ml/track.db", "ml"), ("sqlite+pysqlite:///ml/track.db", "ml"),
                                             ("sqlite:///~/ml/track.db", "~/ml")])
def test_a_relative_sqlite_mlflow_store_is_the_study_file_s_from_any_working_folder(tmp_path: Path, uri: str,
                                                                                    folder: str) -> None:
    # `tracking_uri: sqlite:///ml/track.db` was read from the working folder, where every other relative path of a
    # study file (its storage, checkpoint store, TensorBoard folder) follows the file: started elsewhere, the run was
    # refused for a missing folder, or its trials' runs went to another MLflow store. A driver's form and a `~`
    # (a folder's name to SQLite, as in the study's own storage URL) too.
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    (tmp_path / "study" / folder).mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 1, "tracking": {"mlflow": {"tracking_uri": uri}}}
    done = sweep_cli("run", write_study(tmp_path / "study", document), cwd=tmp_path / "elsewhere")
    assert done.returncode == 0, done.stderr
    assert not any((tmp_path / "elsewhere").iterdir())
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'study' / folder / 'track.db'}")
    experiment = client.get_experiment_by_name("tiny")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["tiny", "trial-00000"]


def test_a_study_deleted_and_created_again_never_mixes_with_the_old_one_s_runs(tmp_path: Path) -> None:
    """`rm tiny.db` to start over: the new study's trials took the old one's TensorBoard folders (two curves at
    every step of `trial-00000`, and the old params in its hparams view) and nested their MLflow runs under the old
    study's run. Now TensorBoard's folder is claimed like a checkpoint folder (refused, one line, nothing created),
    and MLflow gives the new study a run of its own."""
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from mlflow import MlflowClient

    tracked_study(tmp_path, {"mlflow": True, "tensorboard": True}, n_trials=1)
    for leftover in ("tiny.db", "tiny.db-wal", "tiny.db-shm", "tiny.db.lock"):
        (tmp_path / leftover).unlink(missing_ok=True)
    before = sorted(p.name for p in tmp_path.iterdir())
    done = sweep_cli("run", tmp_path / "study.yaml", "--set", "seed=7")
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: {tmp_path / 'study.yaml'}: tracking.tensorboard: the TensorBoard folder ") and \
        "holds the runs of another study named 'tiny'" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no database made
    trials, _ = tracked_study(tmp_path, {"mlflow": True}, n_trials=1, seed=7)  # MLflow alone: its own study run
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'tiny.mlflow.db'}")
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id])
    studies = [r for r in runs if r.data.tags.get("sweep.role") == "study"]
    assert len(studies) == 2 and len({r.data.tags["sweep.owner"] for r in studies}) == 2
    new = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}")
    [mine] = [r for r in studies if r.data.tags["sweep.owner"] == new.user_attrs["sweep.owner"]]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == mine.info.run_id]
    assert [r.data.params for r in children] == [{k: str(v) for k, v in trials[0].params.items()}]


def test_a_study_run_made_before_owner_tags_is_the_resumed_study_s(tmp_path: Path) -> None:
    """A study whose MLflow study run was made by a version without the `sweep.owner` tag, resumed: its trials go on
    under that run (a second study run was made), which is tagged from then on."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    tracked_study(tmp_path, {"mlflow": True}, n_trials=1)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'tiny.mlflow.db'}")
    experiment_id = client.get_experiment_by_name("tiny").experiment_id
    [study_run] = [r for r in client.search_runs([experiment_id]) if r.data.tags.get("sweep.role") == "study"]
    client.delete_tag(study_run.info.run_id, "sweep.owner")  # as an older version made it
    from sweep import tracking

    tracking._STUDY_RUNS.clear()  # the resume is another process, which has not found its study run yet
    trials, _ = tracked_study(tmp_path, {"mlflow": True}, n_trials=2)
    runs = client.search_runs([experiment_id])
    [again] = [r for r in runs if r.data.tags.get("sweep.role") == "study"]
    assert again.info.run_id == study_run.info.run_id and "sweep.owner" in again.data.tags
    assert sorted(r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == again.info.run_id) == [
        f"trial-{t.number:05d}" for t in trials]


def test_a_worker_killed_while_it_makes_the_mlflow_store_leaves_none_half_made(tmp_path: Path) -> None:
    """MLflow's migrations of a new SQLite store are not atomic: a worker killed in them left a half-migrated store
    on which every later trial's tracking failed ("table _alembic_tmp_datasets already exists"). The store is made
    beside its place and renamed into it: killed while it is made, there is no store yet, and the next run makes
    one and tracks every trial."""
    pytest.importorskip("mlflow")
    store = tmp_path / "tiny.mlflow.db"
    build = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from sweep.tracking import _build_store; "
             f"_build_store({f'sqlite:///{store}'!r})")
    process = subprocess.Popen([sys.executable, "-c", build])
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".tiny.mlflow.db.*.building")):
            assert process.poll() is None and time.monotonic() < deadline, "the store was never being made"
            time.sleep(0.005)
        time.sleep(0.05)  # into MLflow's migrations (a second or more here)
        process.kill()
    finally:
        process.wait()
    assert not store.exists() or process.returncode == 0  # killed in them: no store; else it was made whole
    trials, stderr = tracked_study(tmp_path, {"mlflow": True}, n_trials=2)
    assert "tracking dropped" not in stderr, stderr
    assert not list(tmp_path.glob(".tiny.mlflow.db.*"))  # the killed one's file went
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert sorted(r.info.run_name for r in runs if r.data.tags.get("sweep.role") == "trial") == [
        f"trial-{t.number:05d}" for t in trials]


def test_an_mlflow_server_that_does_not_answer_fails_no_trial_and_warns_once_per_trial(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    with socket.socket() as closed:  # a port that was free a moment ago: nothing listens there
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    os.environ.update({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0"})
    try:
        trials, stderr = tracked_study(tmp_path, {"mlflow": {"tracking_uri": f"http://me:s3cret@127.0.0.1:{port}"}})
    finally:
        for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"):
            os.environ.pop(name, None)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    warned = re.findall(r"trial (\d+): mlflow tracking dropped for this trial", stderr)
    assert sorted(map(int, warned)) == [0, 1, 2], stderr
    assert "s3cret" not in stderr
    # One readable line each: MLflow's words cut short, and what they come from (urllib3's whole request and the
    # repr of its connection made 450 characters).
    lines = [line for line in stderr.splitlines() if "tracking dropped" in line]
    assert all(len(line) < 400 for line in lines), lines
    stored = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").user_attrs
    assert "s3cret" not in json.dumps(stored)


@pytest.mark.parametrize("before", [0, 150, 165, 170, 400])
def test_a_tracker_s_error_cut_short_never_shows_a_password(before: int) -> None:
    """The warning cuts each error line at 200 characters; cut before the URLs were masked, a URL whose `@` fell
    past the cut was no longer read as one, and its password showed (review)."""
    from sweep.tracking import _error_line

    try:
        try:
            raise ConnectionRefusedError("http://bob:s3cretpassword@mlflow.example:5000 refused")
        except ConnectionRefusedError as cause:
            raise RuntimeError("y" * before + " API request to http://bob:s3cretpassword@mlflow.example:5000/api "
                               "failed") from cause
    except RuntimeError as exc:
        line = _error_line(exc)
    assert "s3cre" not in line and len(line) < 450, line


def test_an_mlflow_database_that_takes_no_connection_drops_each_trial_s_tracking_at_once(tmp_path: Path) -> None:
    # MLflow's client retried a database tracking URI it could not reach for about 100 s in every trial (its own
    # loop, which MLFLOW_HTTP_REQUEST_* does not bound); one bounded connection is tried first now.
    pytest.importorskip("mlflow")
    with socket.socket() as closed:  # a port that was free a moment ago: nothing listens there
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    trials, stderr = tracked_study(tmp_path, {"mlflow": {
        "tracking_uri": f"postgresql+psycopg://me:s3cret@127.0.0.1:{port}/runs"}})
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    warned = re.findall(r"trial (\d+): mlflow tracking dropped for this trial \(start failed: "
                        r"TrackingDatabaseUnreachable: the tracking database did not take a connection", stderr)
    assert sorted(map(int, warned)) == [0, 1, 2], stderr
    assert "s3cret" not in stderr


@pytest.mark.parametrize("uri", ["postgresql+pg8000://u:p@127.0.0.1:1/m", "postgresql+asyncpg://u:p@127.0.0.1:1/m",
                                 "http://127.0.0.1:1", "sqlite:///x.db", "file:///tmp/mlruns", "databricks"])
def test_a_tracking_uri_whose_connection_sweep_cannot_bound_is_left_to_mlflow(uri: str) -> None:
    # pg8000's connect() takes `timeout=`, not `connect_timeout=`: the check failed on its keyword and every trial's
    # tracking was dropped where MLflow would have worked.
    from sweep.tracking import _check_database

    _check_database(uri)  # nothing raised: not checked here


def test_a_tracking_uri_mlflow_cannot_serve_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    # It used to run every trial with one warning each ("mlflow tracking dropped for this trial"): a URI no MLflow
    # store serves is a mistake in the study file, refused as a TensorBoard folder that cannot be made is.
    pytest.importorskip("mlflow")
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {
        "tracking": {"mlflow": {"tracking_uri": "nosuchstore://me:s3cret@127.0.0.1/x"}}})
    done = sweep_cli("run", path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: {path}: tracking.mlflow.tracking_uri: MLflow cannot track there: "), lines
    assert "nosuchstore://me:***@127.0.0.1/x" in lines[0] and "s3cret" not in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.yaml"]


@pytest.mark.parametrize(("uri", "allow_file_store", "refused"), [
    ("sqlite+pysqlite:///m.mlflow.db", False, False), ("http://me:s3cret@127.0.0.1:1", False, False),
    ("databricks", False, False), ("file:./mlruns", True, False), ("./mlruns", True, False),
    ("./mlruns", False, True), ("sqlite://m.mlflow.db", False, True)])
def test_the_mlflow_uri_check_takes_what_mlflow_serves_and_creates_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uri: str, allow_file_store: bool, refused: bool) -> None:
    # Found by review: `sqlite+pysqlite:///` was refused as a SQLite URL without three slashes, and checking a file
    # store that MLflow was allowed to use made its folder even where the run was then refused.
    pytest.importorskip("mlflow")
    from sweep.spec import parse_spec
    from sweep.tracking import destination_problems

    monkeypatch.chdir(tmp_path)
    if allow_file_store:
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    else:
        monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    spec = parse_spec(copy.deepcopy(TINY_STUDY) | {"tracking": {"mlflow": {"tracking_uri": uri}}},
                      tmp_path / "study.yaml")
    problems = destination_problems(spec, f"sqlite:///{tmp_path / 'tiny.db'}")
    assert [key for key, _ in problems] == (["tracking.mlflow.tracking_uri"] if refused else []), problems
    assert "s3cret" not in repr(problems)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("form", ["task", "command"])
@pytest.mark.parametrize(("tracking", "key", "extra"), [
    ({"tensorboard": True}, "tracking.tensorboard", "tensorboard"),
    ({"mlflow": True}, "tracking.mlflow", "mlflow"),
    ({"mlflow": {"tracking_uri": "http://127.0.0.1:1"}}, "tracking.mlflow", "mlflow")])
def test_a_backend_that_is_not_installed_is_refused_before_anything_is_created(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tracking: dict[str, Any], key: str, extra: str,
        form: str) -> None:
    # A command's (or a loop's) study went on, each trial warning that its tracking was dropped; with a server's URI
    # the check of the URI raised ModuleNotFoundError.
    monkeypatch.setitem(sys.modules, extra, None)  # what importing it finds where it is not installed
    document = copy.deepcopy(TINY_STUDY) if form == "task" else {
        "name": "mine", "n_trials": 1, "command": f"{sys.executable} -c pass {{x}}",
        "space": {"x": {"type": "float", "low": 0, "high": 1}}}
    path = write_study(tmp_path, document | {"tracking": tracking})
    done = sweep_cli("run", path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {path}: {key}: needs the {extra} package: pip install 'sweep[{extra}]'"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.yaml"]


def test_a_pruned_trial_says_so_in_both_backends(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    # Every value above 0.1 at step 10 prunes (the threshold pruner); step 0 is never judged by it.
    trials, _ = tracked_study(tmp_path, {"tensorboard": True, "mlflow": True}, n_trials=1,
                              pruner={"type": "threshold", "upper": 0.1, "n_warmup_steps": 1})
    [trial] = trials
    assert trial.state == TrialState.PRUNED
    run = event_runs(tmp_path / "tiny.tensorboard")["tiny/trial-00000"]
    assert session_hparams(run)[0]["state"] == "pruned"
    assert "final/val_loss" not in run.Tags()["scalars"]  # a pruned trial has no value
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'tiny.mlflow.db'}")
    [mlflow_run] = client.search_runs([client.get_experiment_by_name("tiny").experiment_id],
                                      filter_string="tags.`sweep.role` = 'trial'")
    assert mlflow_run.data.tags["sweep.state"] == "pruned"
    assert json.loads(mlflow_run.data.tags["sweep.prune_reason"]) == trial.user_attrs["prune_reason"]
    assert "final_val_loss" not in mlflow_run.data.metrics


INTERRUPTING_TASK = '''
from pathlib import Path

import torch

from trainer.tasks import digits


class Interrupting(torch.nn.Module):
    """Ctrl-C at the 25th training step of the study's first trial, once (a marker file remembers)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.steps = inner, 0

    def forward(self, x):
        if self.training:
            self.steps += 1
            marker = Path(__file__).with_name("interrupted")
            if self.steps == 25 and not marker.exists():
                marker.write_text("once")
                raise KeyboardInterrupt
        return self.inner(x)


def task():
    t = digits()
    build = t.build_model
    t.build_model = lambda cfg: Interrupting(build(cfg))
    return t
'''


def test_a_retry_s_run_holds_its_lineage_s_evaluations_before_the_resume(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    (tmp_path / "itask.py").write_text(INTERRUPTING_TASK)
    document = copy.deepcopy(TINY_STUDY) | {"task": "itask:task", "n_trials": 1, "tracking": {"tensorboard": True}}
    document["fixed"] = {**document["fixed"], "max_steps": 40}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 130  # interrupted at step 25: queued again
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    first, retry = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").get_trials()
    assert retry.user_attrs["retry_of"] == first.number and retry.user_attrs["resumed_from"]["step"] == 20
    runs = event_runs(tmp_path / "tiny.tensorboard")
    evals = {e.step: e.value for e in runs[f"tiny/trial-{retry.number:05d}"].Scalars("eval/val_loss")}
    assert sorted(evals) == [10, 20, 30, 40]  # 10 and 20 from before the resume: one curve, as the study has it
    assert evals == pytest.approx(retry.intermediate_values, rel=1e-6)


def _start_tracker(barrier: Any, storage_url: str, number: int, results: Any) -> None:
    from sweep.schema import TrackingSpec
    from sweep.tracking import MLflowTracker

    barrier.wait()  # every worker's first trial starts at once, on a store nobody has made yet
    try:
        MLflowTracker(TrackingSpec.model_validate({"mlflow": True}), storage_url, "tiny", number, {"x": number},
                      {"x": number}, "val_loss")
        results.put("ok")
    except Exception as exc:  # noqa: BLE001 - what the worker would have warned about, dropping the trial's tracking
        results.put(f"{type(exc).__name__}: {exc}"[:300])


def test_workers_starting_at_once_on_a_new_mlflow_store_all_track_their_trials(tmp_path: Path) -> None:
    """MLflow makes a new SQLite store's tables with its own migrations on first use: three workers running them
    together failed ("duplicate column name: step") and dropped their trials' tracking, and two of them could each
    make the study's parent run. They take turns now."""
    pytest.importorskip("mlflow")
    import multiprocessing

    from mlflow import MlflowClient

    context = multiprocessing.get_context("spawn")  # fresh processes, as workers are
    barrier, results = context.Barrier(3), context.Queue()
    storage_url = f"sqlite:///{tmp_path / 'tiny.db'}"
    workers = [context.Process(target=_start_tracker, args=(barrier, storage_url, k, results)) for k in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    assert [results.get(timeout=10) for _ in workers] == ["ok"] * 3
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'tiny.mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert sorted(r.data.tags.get("sweep.role") for r in runs) == ["study", "trial", "trial", "trial"]


def test_a_lost_trial_s_mlflow_run_is_ended_as_lost_by_the_worker_that_finds_it(tmp_path: Path) -> None:
    """Its worker died (SIGKILL), so nobody ended its run: it stayed RUNNING forever in MLflow's UI. The worker that
    fails the trial as lost ends it (KILLED, `sweep.state: lost`); the retry logs to a run of its own."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 1, "heartbeat_interval": 1, "heartbeat_grace_period": 2,
                                            "tracking": {"mlflow": True}}
    document["fixed"] = {**document["fixed"], "max_steps": 3000, "eval_every_steps": 50, "log_every_steps": 50}
    path = write_study(tmp_path, document)
    worker = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**os.environ, **CLI_ENV})
    try:
        deadline = time.monotonic() + 180
        while True:  # until trial 0 has reported: its run exists and is RUNNING
            assert time.monotonic() < deadline and worker.poll() is None
            try:
                trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").trials
            except KeyError:
                trials = []
            if trials and len(trials[0].intermediate_values) > 1:
                break
            time.sleep(0.2)
    finally:
        worker.kill()
        worker.wait()
    time.sleep(3)  # its heartbeat is older than the grace period now
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'tiny.mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id],
                              filter_string="tags.`sweep.role` = 'trial'")
    by_trial = {r.data.tags["sweep.trial"]: r for r in runs}
    assert by_trial["0"].info.status == "KILLED" and by_trial["0"].data.tags["sweep.state"] == "lost"
    assert by_trial["1"].info.status == "FINISHED" and by_trial["1"].data.tags["sweep.state"] == "complete"
    # As its worker would have ended it: its reason and files (it had neither; `sweep trials` had the reason).
    lost = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").trials[0]
    assert json.loads(by_trial["0"].data.tags["sweep.fail_reason"]) == lost.user_attrs["fail_reason"]
    files = {f.path for f in client.list_artifacts(by_trial["0"].info.run_id)}
    expected = {"config.json"} | ({"reproducibility.json"} if "reproducibility" in lost.user_attrs else set())
    assert files == expected, files
    import mlflow.artifacts

    config = mlflow.artifacts.load_dict(f"{by_trial['0'].info.artifact_uri}/config.json")
    assert config == lost.user_attrs["config"]


@pytest.mark.parametrize("form", ["loop", "command"])
def test_a_users_loop_or_command_is_tracked_like_the_trainer(tmp_path: Path, form: str) -> None:
    """`tracking:` was ignored for `loop:` and `command:` studies, silently: every report and log a user's code
    makes now reaches TensorBoard and MLflow as the trainer's do."""
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from mlflow import MlflowClient

    (tmp_path / "mine.py").write_text(
        "import sys\n"
        "def main(config, run):\n"
        "    for step in (10, 20):\n"
        "        run.log(step, train_loss=2.0 / step)\n"
        "        run.report(step, val_loss=config['x'] + 1.0 / step)\n"
        "if __name__ == '__main__':\n"
        "    from sweep import client\n"
        "    x = float(sys.argv[1])\n"
        "    for step in (10, 20):\n"
        "        client.report(step, val_loss=x + 1.0 / step)\n")
    runs = {"loop": {"loop": "mine:main"}, "command": {"command": f"{sys.executable} mine.py {{x}}"}}[form]
    path = write_study(tmp_path, {"name": "mine", "n_trials": 2, "pruner": "none", **runs,
                                  "tracking": {"tensorboard": True, "mlflow": True},
                                  "space": {"x": {"type": "float", "low": 0, "high": 1}}})
    done = sweep_cli("run", path, cwd=tmp_path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "tracking dropped" not in done.stderr
    trials = optuna.load_study(study_name="mine", storage=f"sqlite:///{tmp_path / 'mine.db'}").get_trials()
    tensorboard = event_runs(tmp_path / "mine.tensorboard")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mine.mlflow.db'}")
    mlflow_runs = {r.data.tags["sweep.trial"]: r for r in client.search_runs(
        [client.get_experiment_by_name("mine").experiment_id], filter_string="tags.`sweep.role` = 'trial'")}
    for trial in trials:
        accumulator = tensorboard[f"mine/trial-{trial.number:05d}"]
        evals = {e.step: e.value for e in accumulator.Scalars("eval/val_loss")}
        assert evals == pytest.approx(trial.intermediate_values, rel=1e-6)
        run = mlflow_runs[str(trial.number)]
        assert run.data.tags["sweep.state"] == "complete" and run.info.status == "FINISHED"
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_loss")}
        assert history == pytest.approx(trial.intermediate_values, rel=1e-6)
        if form == "loop":
            assert [e.step for e in accumulator.Scalars("train/train_loss")] == [10, 20]


def test_metric_names_mlflow_refuses_are_logged_renamed_and_every_run_still_ends(tmp_path: Path) -> None:
    # One name MLflow refuses ("val_loss(ema)", "acc@1") failed the trial's whole batch of metrics in the background:
    # the trial's run and the study's were left RUNNING, without a single metric, tag or config.
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    (tmp_path / "named.py").write_text(
        "def main(config, run):\n"
        "    for step in (1, 2):\n"
        "        run.log(step, {'acc@1': 0.5 * step})\n"
        "        run.report(step, {'val_loss': 1.0 / step, 'val_loss(ema)': 2.0 / step})\n")
    path = write_study(tmp_path, {"name": "named", "n_trials": 1, "loop": "named:main", "pruner": "none",
                                  "tracking": {"mlflow": True}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "MLflow refuses the name 'val_loss(ema)'; logged as 'val_loss_ema_'" in done.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'named.mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("named").experiment_id])
    assert sorted(run.info.status for run in runs) == ["FINISHED", "FINISHED"]  # the study's run and the trial's
    [trial_run] = [run for run in runs if run.data.tags.get("sweep.state")]
    assert trial_run.data.tags["sweep.state"] == "complete"
    history = {name: [(m.step, m.value) for m in client.get_metric_history(trial_run.info.run_id, name)]
               for name in ("val_loss", "val_loss_ema_", "acc_1")}
    assert history == {"val_loss": [(1, 1.0), (2, 0.5)], "val_loss_ema_": [(1, 2.0), (2, 1.0)],
                       "acc_1": [(1, 0.5), (2, 1.0)]}


BREAKER = '''
import os, pathlib, shutil, time


def main(config, run):
    for step in range(1, 41):
        if step == 10:  # the tracking store broken under the running trial: a folder made a file, a database garbage
            target = pathlib.Path(config["break"])
            if target.is_dir():
                shutil.move(str(target), str(target) + ".aside")
                target.write_text("not a folder")
            else:
                target.rename(str(target) + ".aside")
                target.write_bytes(os.urandom(5000))
        run.report(step, val_loss=config["x"] + 1.0 / step)
        time.sleep(0.05)  # MLflow's batches are written in the background: their errors arrive meanwhile
    return config["x"]
'''


@pytest.mark.parametrize("backend", ["mlflow", "tensorboard"])
def test_a_tracking_store_broken_mid_trial_is_one_warning_naming_its_cause(tmp_path: Path, backend: str) -> None:
    """MLflow's loggers printed each failed background batch with its traceback (5,000 lines for one trial) and the
    warning named SQLAlchemy's autoflush note, not the cause; TensorBoard's writer thread printed its traceback."""
    if backend == "mlflow":
        pytest.importorskip("mlflow")
    (tmp_path / "breaker.py").write_text(BREAKER)
    tracking, target = ({"mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'runs.db'}"}}, tmp_path / "runs.db") \
        if backend == "mlflow" else ({"tensorboard": {"dir": str(tmp_path / "tb")}}, tmp_path / "tb" / "brk" /
                                     "trial-00000")
    path = write_study(tmp_path, {"name": "brk", "n_trials": 1, "loop": "breaker:main", "pruner": "none",
                                  "tracking": tracking, "fixed": {"max_steps": 40, "break": str(target)},
                                  "space": {"x": {"type": "float", "low": 0, "high": 1}}})
    done = run_cli("run", path, cwd=tmp_path)  # a process of its own: what its threads and loggers print
    assert done.returncode == 0, done.stderr
    [trial] = optuna.load_study(study_name="brk", storage=f"sqlite:///{tmp_path / 'brk.db'}").get_trials()
    assert trial.state == TrialState.COMPLETE
    warned = [line for line in done.stderr.splitlines() if "tracking dropped" in line]
    assert len(warned) == 1 and warned[0].startswith(f"warning: trial 0: {backend} tracking dropped"), done.stderr
    assert "Traceback" not in done.stderr and "ERROR" not in done.stderr, done.stderr
    if backend == "mlflow":
        assert "caused by OperationalError: attempt to write a readonly database" in warned[0], warned
    else:
        assert "Not a directory" in warned[0], warned


def test_an_mlflow_run_dropped_mid_trial_is_still_ended_with_its_state_and_valid_json_tags(tmp_path: Path) -> None:
    """Integrations review: a run dropped at a refused log (a metric name over MLflow's 250 characters) stayed
    RUNNING forever with no `sweep.state`; a prune reason holding NaN was a tag no JSON parser reads."""
    pytest.importorskip("mlflow")
    import math

    from mlflow import MlflowClient

    from sweep.schema import TrackingSpec
    from sweep.tracking import MLFLOW_NAME_LIMIT, Guarded, MLflowTracker, mlflow_name

    long_a, long_b = mlflow_name("m" * 300 + "a"), mlflow_name("m" * 300 + "b")
    assert len(long_a) == len(long_b) == MLFLOW_NAME_LIMIT and long_a != long_b

    class Refusing(MLflowTracker):
        def log(self, step: int, metrics: Mapping[str, float]) -> None:
            raise RuntimeError("refused by the server")

    uri = f"sqlite:///{tmp_path / 'r.db'}"
    tracking = TrackingSpec.model_validate({"mlflow": {"tracking_uri": uri}})
    guarded = Guarded("mlflow", 0, lambda: Refusing(tracking, None, "s", 0, {"x": 1}, {"x": 1}, "val_loss"))
    with pytest.warns(UserWarning, match=r"mlflow tracking dropped for this trial \(log failed: RuntimeError"):
        guarded.log(1, {"m" * 300: 1.0})
    guarded.report(10, {"val_loss": math.nan})  # dropped: nothing more is sent
    guarded.finish("pruned", None, {"steps": 10, "prune_reason": {"rule": "nan", "step": 10, "value": math.nan}})
    client = MlflowClient(tracking_uri=uri)
    [run] = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
             if r.data.tags.get("sweep.role") == "trial"]
    assert run.info.status == "FINISHED" and run.data.tags["sweep.state"] == "pruned"

    def strict(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    assert json.loads(run.data.tags["sweep.prune_reason"], parse_constant=strict)["value"] == "nan"


def test_an_mlflow_run_dropped_for_a_server_that_did_not_answer_is_not_waited_on_again(tmp_path: Path) -> None:
    """Review: a server that hung mid-trial dropped the trial's tracking with its warning, then held the trial's end
    two minutes: the dropped run's end waited on every queued batch and made six more calls, each waiting out the
    timeout and the retries. Such a run is let go; one dropped for an answer (a refused name) is still ended."""
    pytest.importorskip("mlflow")
    import requests
    from mlflow.exceptions import MlflowException

    from sweep.schema import TrackingSpec
    from sweep.tracking import Guarded, MLflowTracker

    ended: list[str] = []

    class Failing(MLflowTracker):
        error: Exception

        def log(self, step: int, metrics: Mapping[str, float]) -> None:
            raise self.error

        def finish(self, outcome: str, value: float | None, attrs: Mapping[str, Any]) -> None:
            ended.append(outcome)
            super().finish(outcome, value, attrs)

    def timed_out() -> Exception:  # as MLflow's http_request raises it
        try:
            raise requests.exceptions.ReadTimeout("HTTPConnectionPool(host='127.0.0.1'): Read timed out.")
        except requests.exceptions.Timeout as timeout:
            try:
                raise MlflowException("API request to http://127.0.0.1/api/2.0/mlflow/runs/log-batch failed with "
                                      "timeout exception") from timeout
            except MlflowException as exc:
                return exc

    uri = f"sqlite:///{tmp_path / 'r.db'}"
    tracking = TrackingSpec.model_validate({"mlflow": {"tracking_uri": uri}})
    for number, (error, outcome) in enumerate([(timed_out(), "complete"),
                                               (MlflowException("Invalid metric name"), "pruned")]):
        Failing.error = error
        guarded = Guarded("mlflow", number, lambda n=number: Failing(tracking, None, "s", n, {"x": 1}, {"x": 1},
                                                                     "val_loss"))
        with pytest.warns(UserWarning, match=r"mlflow tracking dropped for this trial \(log failed: "):
            guarded.log(1, {"val_loss": 1.0})
        guarded.finish(outcome, 0.5, {"steps": 10})
    assert ended == ["pruned"]  # the second only
