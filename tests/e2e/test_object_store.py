"""Checkpoints in an object store (`checkpoints.store: s3://bucket/prefix`), as for workers on several machines.

The S3 endpoint is moto's S3-compatible server, started on loopback for the test; sweep reaches it only through
boto3's standard environment (`AWS_ENDPOINT_URL`, credentials), as it would reach AWS or MinIO."""

from __future__ import annotations

import copy
import socket
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from sweep.outcomes import budget_counts
from tests.conftest import TINY_STUDY, run_cli, sweep_cli, write_study

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    boto3.client("s3").create_bucket(Bucket="ckpts")
    try:
        yield env
    finally:
        server.stop()


def test_checkpoints_live_in_the_object_store_and_warm_start_from_it(tmp_path: Path, s3_env: dict) -> None:
    document = copy.deepcopy(TINY_STUDY) | {"name": "remote", "n_trials": 4, "warm_start": {"max_distance": 5.0},
                                            "checkpoints": {"store": "s3://ckpts/sweeps"}}
    document["fixed"] = {**document["fixed"], "max_steps": 40, "model": {"hidden": 16}}
    document["space"] = {"learning_rate": document["space"]["learning_rate"]}
    path = write_study(tmp_path, document)
    done = sweep_cli("run", path)  # s3_env is in os.environ
    assert done.returncode == 0, done.stderr

    with sqlite3.connect(tmp_path / "remote.db") as connection:
        uris = [row[0] for row in connection.execute("SELECT uri FROM sweep_checkpoints")]
    assert uris and all(uri.startswith("s3://ckpts/sweeps/remote/trial") for uri in uris)
    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="ckpts")["Contents"]}
    assert {uri.removeprefix("s3://ckpts/") for uri in uris} <= keys  # every registered blob is in the bucket
    assert not (tmp_path / "remote.checkpoints" / "remote").exists()  # and none is left on this machine

    study = optuna.load_study(study_name="remote", storage=f"sqlite:///{tmp_path / 'remote.db'}")
    warm = [t for t in study.get_trials() if "warm_start_from" in t.user_attrs]
    assert warm and all(t.user_attrs["warm_start_from"]["uri"].startswith("s3://") for t in warm)
    assert study.user_attrs["sweep.artifacts"] == "s3://ckpts"
    artifact = study.get_trials()[0].user_attrs["checkpoint"]["artifact_id"]
    assert artifact in keys  # the dashboard's download, from the same bucket

    again = sweep_cli("reproduce", path, str(warm[-1].number))  # the parent comes back from the bucket
    assert again.returncode == 0, again.stderr


def test_an_object_store_without_credentials_costs_no_budget_and_stops_the_worker_saying_so(
        tmp_path: Path, s3_env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """No credentials: each trial failed as the config's fault ("NoCredentialsError"), counted in `n_trials`. It is
    the store's fault: the trials are retried, not counted, and the same fault three times in a row stops the worker
    with it; with credentials the next run spends the whole budget. A process of its own: boto3 keeps the credentials
    it found in the process."""
    document = copy.deepcopy(TINY_STUDY) | {"name": "nocreds", "n_trials": 2, "checkpoints": {"store": "s3://ckpts/x"}}
    document["fixed"] = {**document["fixed"], "max_steps": 10}
    path = write_study(tmp_path, document)
    # No credentials anywhere boto3 looks, and no instance metadata server to ask (nothing leaves this machine).
    with monkeypatch.context() as bare:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            bare.delenv(key)
        bare.setenv("AWS_EC2_METADATA_DISABLED", "true")
        bare.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        bare.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        done = run_cli("run", path)
    assert done.returncode == 1, done.stderr
    assert "NoCredentialsError" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "Fix it (the checkpoint store's credentials, bucket or endpoint)" in done.stderr, done.stderr
    study = optuna.load_study(study_name="nocreds", storage=f"sqlite:///{tmp_path / 'nocreds.db'}")
    trials = study.get_trials()
    failed = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    reason = "infrastructure: the checkpoint store's client failed: s3://ckpts: NoCredentialsError"
    assert len(failed) == 3 and all(t.user_attrs["fail_reason"].startswith(reason) for t in failed)
    assert budget_counts(trials)[0] == 0  # none of the budget spent: their retries wait
    done = run_cli("run", path)  # s3_env's credentials are back
    assert done.returncode == 0, done.stderr
    complete = [t for t in study.get_trials() if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 2
