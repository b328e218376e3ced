"""`sweep check`'s library: the registry, the blob store and the Optuna artifacts of a study against each other.

Real parts only: a tiny study trained in-process on SQLite and on PostgreSQL, real checkpoint files, real damage (a
deleted blob, flipped bytes, a stray file, a removed artifact), then what the registry and the disk hold."""

from __future__ import annotations

import copy
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest
import torch

from sweep.blobs import BlobScope, CheckpointStore
from sweep.reconcile import ARTIFACTS_ATTR, CHECKPOINT_ATTR, ProblemKind, check_study, quick_check
from sweep.registry import CheckpointRecord, Registry
from tests.conftest import TINY_STUDY
from trainer.checkpoint import TrainState, save_checkpoint, sha256_of

MISSING, CORRUPT, ORPHAN, DANGLING = (ProblemKind.MISSING_BLOB, ProblemKind.CORRUPT_BLOB, ProblemKind.ORPHAN_FILE,
                                      ProblemKind.DANGLING_ARTIFACT)


@pytest.fixture(params=["sqlite", "postgresql"])
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'sweep.db'}"
    return str(request.getfixturevalue("postgres_url"))


def write(path: Path, data: bytes, age_s: float) -> Path:
    """A file last written `age_s` seconds ago."""
    path.write_bytes(data)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    path.write_bytes(bytes(data))  # the same size: only the hash tells


def tiny_state(step: int) -> TrainState:
    return TrainState(step=step, model={"w": torch.full((4,), float(step))}, optimizer={}, scaler={}, rng={}, data={})


def save_and_register(registry: Registry, store: CheckpointStore, trial: int, step: int) -> CheckpointRecord:
    info = save_checkpoint(store.local_path(f"trial{trial:05d}-step{step:08d}.pt"), tiny_state(step))
    checkpoint_id = registry.register(study=store.study, trial_number=trial, step=step, value=1.0 / step,
                                      params={"learning_rate": 0.01}, shape_key="k", uri=store.put(info.path),
                                      size=info.size, sha256=info.sha256)
    [record] = [r for r in registry.for_trial(store.study, trial) if r.id == checkpoint_id]
    return record


def blob(store: CheckpointStore, record: CheckpointRecord) -> Path:
    """Where a row's blob lies: its URI is relative to the study's folder of the store."""
    found = store.scope.find(record.uri, record.study)
    assert found is not None, record.uri
    return Path(found)


def found(problems: list) -> set[tuple[ProblemKind, str]]:
    return {(p.kind, p.path_or_id) for p in problems}


@dataclass
class Ran:
    study: optuna.Study
    registry: Registry
    store: str  # the study's checkpoints.store

    @property
    def artifacts(self) -> Path:
        return Path(self.study.user_attrs[ARTIFACTS_ATTR])

    def rows(self, trial: int) -> list[CheckpointRecord]:
        return self.registry.for_trial(self.study.study_name, trial)

    def artifact(self, trial: int) -> dict:
        return self.study.trials[trial].user_attrs[CHECKPOINT_ATTR]


@pytest.fixture
def ran(storage_url: str, tmp_path: Path) -> Ran:
    """A real tiny study of 3 trials, each keeping checkpoints at steps 10 and 20, the best one also an artifact."""
    from sweep.spec import parse_spec
    from sweep.study import open_study, run_study

    store = str(tmp_path / "blobs")
    document = copy.deepcopy(TINY_STUDY) | {"name": f"check-{uuid.uuid4().hex[:8]}",
                                            "checkpoints": {"store": store, "every_steps": 10, "keep_top_k": 2}}
    spec = parse_spec(document, "study.yaml")
    study = open_study(spec, storage_url)
    run_study(study, spec, storage_url=storage_url)
    done = Ran(optuna.load_study(study_name=study.study_name, storage=storage_url), Registry(storage_url), store)
    assert all(len(done.rows(n)) == 2 for n in range(3)), "each trial keeps its two checkpoints"
    assert all(CHECKPOINT_ATTR in t.user_attrs for t in done.study.trials), "each uploads its best as an artifact"
    return done


def test_check_finds_every_disagreement_and_repair_fixes_what_it_can(ran: Ran) -> None:
    source = {n: next(r for r in ran.rows(n) if r.sha256 == ran.artifact(n)["sha256"]) for n in range(3)}
    folder = CheckpointStore(ran.store, ran.study.study_name).folder
    assert check_study(ran.registry, ran.store, ran.study).problems == []  # what a run leaves agrees with itself

    # Trial 0 loses the blob its artifact was made from, and the artifact: nothing is left to rebuild it from.
    (folder / source[0].uri).unlink()
    (ran.artifacts / ran.artifact(0)["artifact_id"]).unlink()
    # Trial 1 loses its artifact, whose blob is still registered and sound; and its other blob, which is pinned.
    (ran.artifacts / ran.artifact(1)["artifact_id"]).unlink()
    [pinned] = [r for r in ran.rows(1) if r.id != source[1].id]
    assert ran.registry.pin(pinned.id)
    (folder / pinned.uri).unlink()
    # Trial 2's best blob is damaged.
    flip_bytes(folder / source[2].uri)
    # Files no row names: an old stray, a killed writer's temporary; and two that are left alone: a file a worker
    # may be about to register, a temporary being written now.
    stray = write(folder / "stray.pt", b"x", 3600)
    leftover = write(folder / ".trial00007-step00000010.pt.4242.tmp", b"half", 7200)
    fresh = write(folder / "trial00009-step00000010.pt", b"renamed into place, not registered yet", 5)
    writing = write(folder / ".trial00009-step00000020.pt.4243.tmp", b"being written", 5)
    rows_before = ran.registry.for_study(ran.study.study_name)

    report = check_study(ran.registry, ran.store, ran.study)
    assert found(report.problems) == {
        (MISSING, str(folder / source[0].uri)), (MISSING, str(folder / pinned.uri)),
        (CORRUPT, str(folder / source[2].uri)),
        (ORPHAN, str(stray)), (ORPHAN, str(leftover)),
        (DANGLING, ran.artifact(0)["artifact_id"]), (DANGLING, ran.artifact(1)["artifact_id"])}
    assert report.counts() == {MISSING: 2, CORRUPT: 1, ORPHAN: 2, DANGLING: 2}
    assert {p.checkpoint_id for p in report.problems if p.kind in (MISSING, CORRUPT)} == {
        source[0].id, pinned.id, source[2].id}
    assert not report.ok and not report.repaired
    [lost] = [p for p in report.of_kind(DANGLING) if not p.repairable]
    assert lost.path_or_id == ran.artifact(0)["artifact_id"]
    assert len(report.outstanding) == 6
    assert ran.registry.for_study(ran.study.study_name) == rows_before  # a check alone changes nothing
    assert stray.exists() and leftover.exists() and (folder / source[2].uri).exists()

    repaired = check_study(ran.registry, ran.store, ran.study, repair=True)
    assert found(repaired.problems) == found(report.problems)
    assert {(p.kind, p.path_or_id) for p in repaired.problems if not p.repaired} == {
        (DANGLING, ran.artifact(0)["artifact_id"])}  # Optuna cannot edit a finished trial's attrs
    assert repaired.ok and repaired.outstanding == []
    left = {r.id for r in ran.registry.for_study(ran.study.study_name)}
    assert left == {r.id for r in rows_before} - {source[0].id, pinned.id, source[2].id}
    assert not (folder / source[2].uri).exists()  # the corrupt file goes with its row
    assert not stray.exists() and not leftover.exists()
    assert fresh.exists() and writing.exists()
    restored = ran.artifacts / ran.artifact(1)["artifact_id"]
    assert sha256_of(restored) == ran.artifact(1)["sha256"]  # uploaded again under the same id

    again = check_study(ran.registry, ran.store, ran.study, repair=True)
    assert again.ok and found(again.problems) == {(DANGLING, ran.artifact(0)["artifact_id"])}
    assert quick_check(ran.registry, ran.study.study_name, scope=BlobScope(ran.store)) == []


@pytest.fixture
def registry(storage_url: str) -> Registry:
    return Registry(storage_url)


def test_a_folder_in_place_of_a_blob_is_a_missing_blob_left_where_it_is(ran: Ran) -> None:
    # `sweep check` ended in a traceback (IsADirectoryError), and a retry resuming from it failed as its config's fault.
    from sweep.blobs import load_blob
    from trainer.checkpoint import CheckpointError

    folder = CheckpointStore(ran.store, ran.study.study_name).folder
    record = ran.rows(0)[0]
    (folder / record.uri).unlink()
    (folder / record.uri).mkdir()
    with pytest.raises(CheckpointError, match="is not a file"):
        load_blob(str(folder / record.uri), record.sha256)
    report = check_study(ran.registry, ran.store, ran.study)
    assert (MISSING, str(record.id)) in {(p.kind, str(p.checkpoint_id)) for p in report.problems}
    check_study(ran.registry, ran.store, ran.study, repair=True)
    assert record.id not in {r.id for r in ran.rows(0)}
    assert (folder / record.uri).is_dir()  # not sweep's to remove


def test_quick_check_removes_only_rows_in_use_whose_blob_is_missing(registry: Registry, tmp_path: Path) -> None:
    name = f"quick-{uuid.uuid4().hex[:8]}"
    store = CheckpointStore(tmp_path / "blobs", name)
    other = CheckpointStore(tmp_path / "blobs", f"{name}-other")
    donor_gone, donor_kept, donor_corrupt = (save_and_register(registry, store, n, 10) for n in (0, 1, 2))
    for n in (0, 1, 2):
        registry.finish_trial(name, n)
    # Trial 3 runs and lost both its blobs: its latest, then the one a retry would fall back to.
    lost_old, lost_latest = save_and_register(registry, store, 3, 10), save_and_register(registry, store, 3, 20)
    # Trial 4 runs and lost only an older blob: its resume point is there, the older row is nobody's business.
    running_old, running_latest = save_and_register(registry, store, 4, 10), save_and_register(registry, store, 4, 20)
    failed_pinned, failed = save_and_register(registry, store, 5, 10), save_and_register(registry, store, 5, 20)
    registry.finish_trial(name, 5, donor=False)
    assert registry.pin(failed_pinned.id)  # a retry resumed from it: reproduce replays from it
    elsewhere = save_and_register(registry, other, 0, 10)
    registry.finish_trial(other.study, 0)
    for record in (donor_gone, lost_old, lost_latest, running_old, failed_pinned, failed, elsewhere):
        blob(store, record).unlink()  # one scope for the whole store: `elsewhere` lies in its own study's folder
    flip_bytes(blob(store, donor_corrupt))  # existence only: the loader refuses it by its hash

    removed = quick_check(registry, name, scope=store.scope)
    assert {p.checkpoint_id for p in removed} == {donor_gone.id, lost_latest.id, lost_old.id, failed_pinned.id}
    assert all(p.kind == MISSING and p.repaired for p in removed)
    assert {r.id for r in registry.for_study(name)} == {donor_kept.id, donor_corrupt.id, running_old.id,
                                                        running_latest.id, failed.id}
    assert registry.latest_for_trial(name, 3) is None  # a retry of trial 3 starts over instead of failing to load
    assert [r.id for r in registry.for_study(other.study)] == [elsewhere.id]  # another study's rows: not asked
    assert quick_check(registry, name, scope=store.scope) == []


@pytest.mark.parametrize(("name", "age_s", "orphan"), [
    ("stray.pt", 3600, True),
    ("stray.pt", 5, False),  # a worker may be about to register it
    (".trial00001-step00000010.pt.4242.tmp", 600, False),  # being written
    (".trial00001-step00000010.pt.4242.tmp", 7200, True),  # left by a writer that was killed
    ("notes.tmp", 600, True),  # not the trainer's temporary
])
def test_which_unregistered_files_are_orphans(tmp_path: Path, name: str, age_s: float, orphan: bool) -> None:
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    registry, study = Registry(url), optuna.create_study(study_name="s", storage=url)
    store = CheckpointStore(tmp_path / "blobs", "s")
    registered = save_and_register(registry, store, 0, 10)
    os.utime(blob(store, registered), (time.time() - 3600,) * 2)  # registered: never an orphan, however old
    path = write(store.folder / name, b"x", age_s)
    (store.folder / "sub").mkdir()  # folders are not the trainer's
    assert found(check_study(registry, str(tmp_path / "blobs"), study).problems) == (
        {(ORPHAN, str(path))} if orphan else set())
    check_study(registry, str(tmp_path / "blobs"), study, repair=True)
    assert path.exists() is not orphan and blob(store, registered).exists()


def test_an_empty_or_absent_study_folder_is_clean(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    report = check_study(Registry(url), str(tmp_path / "nowhere"), optuna.create_study(study_name="s", storage=url))
    assert report.ok and report.problems == [] and report.notes == []
    assert report.counts() == dict.fromkeys(ProblemKind, 0)


def test_object_stores_are_checked_through_optuna_artifact_stores(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
                           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(key, value)
        boto3.client("s3").create_bucket(Bucket="ckpts")
        url = f"sqlite:///{tmp_path / 'sweep.db'}"
        registry, study = Registry(url), optuna.create_study(study_name="s", storage=url)
        store = CheckpointStore("s3://ckpts/sweeps", "s")
        kept, gone = save_and_register(registry, store, 0, 10), save_and_register(registry, store, 0, 20)
        registry.finish_trial("s", 0)
        boto3.client("s3").delete_object(Bucket="ckpts", Key=gone.uri.removeprefix("s3://ckpts/"))
        study.set_user_attr(ARTIFACTS_ATTR, "s3://ckpts")
        trial = study.ask()
        trial.set_user_attr(CHECKPOINT_ATTR, {"artifact_id": "missing-artifact", "step": 10, "value": 0.1,
                                              "sha256": kept.sha256, "size": kept.size})
        study.tell(trial, 0.1)

        assert quick_check(registry, "s", scope=store.scope) == []  # no cheap existence check: left to the loader
        report = check_study(registry, "s3://ckpts/sweeps", study)
        assert found(report.problems) == {(MISSING, gone.uri), (DANGLING, "missing-artifact")}
        assert report.notes == ["orphan scan not supported for object stores: Optuna's artifact stores cannot list "
                                "s3://ckpts/sweeps"]
        assert check_study(registry, "s3://ckpts/sweeps", study, repair=True).ok
        assert [r.id for r in registry.for_study("s")] == [kept.id]
        body = boto3.client("s3").get_object(Bucket="ckpts", Key="missing-artifact")["Body"].read()
        assert len(body) == kept.size
        assert check_study(registry, "s3://ckpts/sweeps", study).problems == []
    finally:
        server.stop()
