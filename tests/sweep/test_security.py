"""Whoever can write the database is not trusted with the disk, and no password leaves a URL.

Blob scope: a registry row may only name a blob inside its study's part of the checkpoint store; retention, warm
start, `quick_check` and `sweep check --repair` refuse anything else with a warning, and never read or delete it.
Masking: every form a password takes in a storage URL. Trust: which user code a stored config may name.
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch

from sweep.blobs import BlobScope, CheckpointStore
from sweep.checkpoints import collect_study
from sweep.private import UMASK_ENV, private_umask
from sweep.reconcile import ProblemKind, check_study, quick_check
from sweep.registry import Registry
from sweep.reproduce import UntrustedCode, code_in_study, refuse_untrusted_code, user_code
from sweep.spec import parse_spec
from sweep.urls import mask_url, mask_urls, redact, url_secrets
from sweep.warmstart import categorical_key, coordinates, shape_key, warm_start_from
from tests.conftest import TINY_STUDY
from trainer import load_task
from trainer.checkpoint import TrainState, save_checkpoint

# ---------------------------------------------------------------------------------------------------------------------
# Passwords in URLs.

MASKED = [
    # (url, what is printed, the secret that must not appear)
    ("postgresql+psycopg://sweeper:secretpw@db.example:5432/sweeps",
     "postgresql+psycopg://sweeper:***@db.example:5432/sweeps", "secretpw"),
    # An unescaped `@` in the password: its tail must not pass for the host.
    ("postgresql+psycopg://sweeper:p@ss@db.example/sweeps", "postgresql+psycopg://sweeper:***@db.example/sweeps",
     "p@ss"),
    ("postgresql://u:a@b@cde@host/db", "postgresql://u:***@host/db", "b@cde"),
    # Percent-encoded, and with the characters a password may hold unescaped.
    ("postgresql+psycopg://sweeper:s%40cr%2Fet@host/db", "postgresql+psycopg://sweeper:***@host/db", "s%40cr"),
    ("postgresql://u:pa?ss#wd@host/db", "postgresql://u:***@host/db", "pa?ss"),
    ("postgresql://u:pa/ss:wd@host/db", "postgresql://u:***@host/db", "pa/ss"),
    # The query string, as libpq accepts it, in any case and spelling.
    ("postgresql+psycopg://sweeper@host/db?password=secretpw&sslmode=require",
     "postgresql+psycopg://sweeper@host/db?password=***&sslmode=require", "secretpw"),
    ("postgresql+psycopg://sweeper@host/db?sslmode=require&PassWord=secretpw",
     "postgresql+psycopg://sweeper@host/db?sslmode=require&PassWord=***", "secretpw"),
    ("postgresql+psycopg://sweeper@host/db?pass%77ord=secretpw", "postgresql+psycopg://sweeper@host/db?pass%77ord=***",
     "secretpw"),
    ("postgresql://host/db?sslpassword=keypw", "postgresql://host/db?sslpassword=***", "keypw"),
    ("postgresql+psycopg://postgres:pw1@/sweep?host=/tmp/pg&password=pw2",
     "postgresql+psycopg://postgres:***@/sweep?host=/tmp/pg&password=***", "pw2"),
    # A query value runs to the next `&` (SQLAlchemy hands the driver all of it): `#`, `;` and a space are the
    # password's, and so is the tail after them.
    ("postgresql+psycopg://u@127.0.0.1/db?password=ab#S3crXYZ", "postgresql+psycopg://u@127.0.0.1/db?password=***",
     "S3crXYZ"),
    ("postgresql+psycopg://u@h/db?password=ab;S3crXYZ&sslmode=require",
     "postgresql+psycopg://u@h/db?password=***&sslmode=require", "S3crXYZ"),
    ("postgresql+psycopg://u@h/db?password=ab S3crXYZ", "postgresql+psycopg://u@h/db?password=***", "S3crXYZ"),
    # Both at once, and a libpq key=value string.
    ("postgresql://u:pw1@host/db?password=pw2", "postgresql://u:***@host/db?password=***", "pw1"),
    ("host=db.example dbname=sweeps password='a secret' user=u", "host=db.example dbname=sweeps password=*** user=u",
     "secret"),
    # No password: nothing changes (an `@` in a SQLite path is no userinfo).
    ("sqlite:////data/a@b/study.db", "sqlite:////data/a@b/study.db", None),
    ("postgresql+psycopg://sweeper@host/db", "postgresql+psycopg://sweeper@host/db", None),
]


@pytest.mark.parametrize(("url", "shown", "secret"), MASKED)
def test_mask_url_hides_every_form_of_password(url: str, shown: str, secret: str | None) -> None:
    assert mask_url(url) == shown
    if secret is not None:
        assert secret not in mask_url(url)
        assert all(s not in mask_url(url) for s in url_secrets(url))


def test_redact_hides_the_pieces_a_driver_may_quote() -> None:
    url = "postgresql+psycopg://sweeper:p@ssw0rd@db.example/sweeps"
    # SQLAlchemy ends the userinfo at the first `@` and takes `ssw0rd@db.example` for the host.
    message = f'could not translate host name "ssw0rd@db.example" to address; url {url}'
    shown = redact(message, url)
    assert "ssw0rd" not in shown and "p@ss" not in shown
    assert shown == ('could not translate host name "***@db.example" to address; '
                     "url postgresql+psycopg://sweeper:***@db.example/sweeps")
    assert redact("no secret in this address", "postgresql://u:ss@host/db") == "no secret in this address"


def test_mask_urls_masks_urls_and_pairs_inside_free_text() -> None:
    reason = ("infrastructure: OperationalError: connection to postgresql://u:pw1@h/db?password=pw2 failed "
              "(dsn: host=h password=pw3)")
    shown = mask_urls(reason)
    assert not any(secret in shown for secret in ("pw1", "pw2", "pw3"))
    assert "postgresql://u:***@h/db?password=***" in shown
    # A URL masked already keeps the colon after it: "...password=***: connection refused", not "***connection".
    line = "cannot open storage postgresql://u@h/db?password=***: OperationalError: refused"
    assert mask_urls(line) == line and mask_urls(mask_urls(reason)) == shown


@pytest.mark.parametrize(("text", "shown"), [
    ("see 1postgresql://u:pw@h/db now", "see 1postgresql://u:***@h/db now"),  # a word's leading digits stay
    ("at 2postgresql:/me:pw@host/db", "at 2postgresql:/me:***@host/db"),
    ("x@y postgresql:/me:pw@a@host/db z", "x@y postgresql:/me:***@host/db z"),  # up to the word's last @
])
def test_mask_urls_finds_a_url_inside_a_word(text: str, shown: str) -> None:
    assert mask_urls(text) == shown


def test_mask_urls_reads_a_long_word_once() -> None:
    # Each letter of a word was tried as a URL's start and the rest of the word read from it: 200 kB took minutes.
    for text in ("x" * 300_000, "1a" * 150_000, "a:/b:" * 60_000, "x@" + "a:/b:" * 60_000, "@" * 300_000):
        started = time.monotonic()
        assert mask_urls(text) == text
        assert time.monotonic() - started < 60  # about 0.05 s; the old reading took hours

def test_blob_scope_of_a_folder_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    (store / "s").mkdir(parents=True)
    (store / "other").mkdir()
    outside = tmp_path / "victim.txt"
    outside.write_text("keep me")
    (store / "s" / "out-link.pt").symlink_to(outside)
    (store / "s" / "in-link.pt").symlink_to(store / "s" / "real.pt")
    (tmp_path / "alias").symlink_to(store)  # the store reached through a symlink is still the store
    scope = BlobScope(store)
    inside = str((store / "s" / "trial00000-step00000010.pt").resolve())
    cases: list[tuple[str, str, str | None]] = [
        (inside, "s", inside),  # an older row: an absolute path inside the store
        ("trial00000-step00000010.pt", "s", inside),  # relative to the study's folder
        (str(tmp_path / "alias" / "s" / "trial00000-step00000010.pt"), "s", inside),
        (str(store / "s" / "in-link.pt"), "s", str((store / "s" / "real.pt").resolve())),
        (str(outside), "s", None),  # absolute, elsewhere
        (str(store / "s" / ".." / ".." / "victim.txt"), "s", None),  # a `..` escape
        ("../../victim.txt", "s", None),
        (str(store / "s" / "out-link.pt"), "s", None),  # a symlink that leads out
        (str(store / "other" / "x.pt"), "s", None),  # another study's folder
        (str(store / "s"), "s", None),  # the folder itself
        ("s3://bucket/s/x.pt", "s", None),
        (str(store / "x.pt"), "..", None),  # a study name that is not one path segment
        (str(store / "s" / "x.pt"), "", None),
    ]
    for uri, study, expected in cases:
        assert scope.find(uri, study) == expected, (uri, study)


def test_blob_scope_of_an_object_store() -> None:
    scope = BlobScope("s3://ckpts/sweeps")
    cases: list[tuple[str, str | None]] = [
        ("s3://ckpts/sweeps/s/trial00000-step00000010.pt", "s3://ckpts/sweeps/s/trial00000-step00000010.pt"),
        ("trial00000-step00000010.pt", "s3://ckpts/sweeps/s/trial00000-step00000010.pt"),
        ("s3://other-bucket/sweeps/s/x.pt", None),
        ("gs://ckpts/sweeps/s/x.pt", None),
        ("s3://ckpts/sweeps/other/x.pt", None),
        ("s3://ckpts/sweeps/s/../other/x.pt", None),
        ("s3://ckpts/sweeps/s//x.pt", None),
        ("s3://user@ckpts/sweeps/s/x.pt", None),
        ("s3://ckpts/sweeps/s/x.pt?versionId=1", None),
        ("/etc/passwd", None),
        ("../other/x.pt", None),
    ]
    for uri, expected in cases:
        assert scope.find(uri, "s") == expected, uri


def tiny_state(step: int) -> TrainState:
    return TrainState(step=step, model={"w": torch.full((4,), float(step))}, optimizer={}, scaler={}, rng={}, data={})


def checkpoint_at(path: Path, step: int) -> dict[str, Any]:
    """A real checkpoint file at `path`: the registry columns that describe it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    info = save_checkpoint(path, tiny_state(step))
    return {"uri": str(path), "size": info.size, "sha256": info.sha256}


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    return Registry(f"sqlite:///{tmp_path / 'sweep.db'}")


def test_retention_never_deletes_a_file_outside_the_store(registry: Registry, tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store", "s")
    victim = checkpoint_at(tmp_path / "home" / "precious.pt", 10)  # a sound checkpoint, even: still not ours
    common = {"study": "s", "step": 10, "params": {}, "shape_key": "k"}
    registry.register(trial_number=0, value=0.1, **common, **checkpoint_at(store.local_path("t0.pt"), 10))
    registry.register(trial_number=1, value=0.5, **common, **victim)
    registry.register(trial_number=2, value=0.9, **common, **checkpoint_at(store.local_path("t2.pt"), 10))
    for number in range(3):
        registry.finish_trial("s", number)
    with pytest.warns(UserWarning, match=r"precious\.pt.*not inside study 's'"):
        dropped = collect_study(registry, "s", keep_trials=1, maximize=False, scope=store.scope)
    assert dropped == [1, 2]
    assert Path(victim["uri"]).exists()  # its row went, the file stays
    assert not store.local_path("t2.pt").exists() and store.local_path("t0.pt").exists()  # the store's own: deleted
    assert [r.trial_number for r in registry.for_study("s")] == [0]


def warm_spec() -> Any:
    document = copy.deepcopy(TINY_STUDY) | {"warm_start": {"max_distance": 0.5}}
    return parse_spec(document, "test.yaml")


@pytest.mark.parametrize("where", ["outside", "escape", "symlink", "inside"])
def test_warm_start_never_loads_a_donor_outside_the_store(registry: Registry, tmp_path: Path, where: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import sweep.warmstart

    spec, store = warm_spec(), CheckpointStore(tmp_path / "store", "s")
    elsewhere = checkpoint_at(tmp_path / "elsewhere" / "donor.pt", 10)
    donor = elsewhere
    if where == "escape":
        donor = {**elsewhere, "uri": str(store.folder / ".." / ".." / "elsewhere" / "donor.pt")}
    elif where == "symlink":
        store.folder.mkdir(parents=True)
        store.local_path("donor.pt").symlink_to(elsewhere["uri"])
        donor = {**elsewhere, "uri": str(store.local_path("donor.pt"))}
    elif where == "inside":
        donor = checkpoint_at(store.local_path("donor.pt"), 10)
    params = {"learning_rate": 0.01, "model.hidden": 16}
    config = spec.config_for(params)
    key = shape_key(config, load_task("digits", {}))
    registry.register(study="s", trial_number=0, step=10, value=0.5, params=params, shape_key=key,
                      coords=coordinates(spec.space, params), cat_key=categorical_key(spec.space, params), **donor)
    registry.finish_trial("s", 0)
    loaded: list[str] = []
    real_load = sweep.warmstart.load_blob
    monkeypatch.setattr(sweep.warmstart, "load_blob", lambda uri, sha: loaded.append(uri) or real_load(uri, sha))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = warm_start_from(registry, spec, "s", 1, params, config, key, 20, scope=store.scope)
    if where == "inside":
        assert started is not None and started[1].record.trial_number == 0
        assert loaded == [str(store.local_path("donor.pt").resolve())]
        return
    assert started is None and loaded == []  # never read
    assert any("not inside study 's'" in str(w.message) for w in caught)
    assert registry.for_study("s") == []  # the row goes, so no later trial is sent there
    assert Path(elsewhere["uri"]).exists()  # never deleted


def test_quick_check_and_check_repair_drop_rows_outside_the_store_and_leave_the_files(registry: Registry,
                                                                                       tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    study = optuna.create_study(study_name="s", storage=url)
    store = CheckpointStore(tmp_path / "store", "s")
    common = {"study": "s", "step": 10, "value": 0.5, "params": {}, "shape_key": "k"}
    victim = checkpoint_at(tmp_path / "victim.pt", 10)
    registry.register(trial_number=0, **common, **checkpoint_at(store.local_path("t0.pt"), 10))
    outside_id = registry.register(trial_number=1, **common, **victim)
    # Damaged, so that a repair that believed the row would delete the file.
    corrupt = {**victim, "uri": str(store.folder / ".." / ".." / "victim.pt"), "sha256": "0" * 64}
    escape_id = registry.register(trial_number=2, **common, **corrupt)
    registry.finish_trial("s", 0)
    registry.finish_trial("s", 2)

    report = check_study(registry, str(tmp_path / "store"), study)
    outside = [p for p in report.problems if "outside the study's part of the store" in p.detail]
    assert {p.checkpoint_id for p in outside} == {outside_id, escape_id}
    assert all(p.kind == ProblemKind.MISSING_BLOB for p in outside) and not report.ok
    repaired = check_study(registry, str(tmp_path / "store"), study, repair=True)
    assert repaired.ok and Path(victim["uri"]).exists()
    assert [r.trial_number for r in registry.for_study("s")] == [0]

    registry.register(trial_number=3, **common, **victim)  # a donor row (final) that quick_check looks at
    registry.finish_trial("s", 3)
    with pytest.warns(UserWarning, match="not inside study 's'"):
        removed = quick_check(registry, "s", scope=store.scope)
    assert [p.path_or_id for p in removed] == [victim["uri"]] and Path(victim["uri"]).exists()


def test_check_repair_deletes_no_orphan_where_the_study_folder_is_a_link_out_of_the_store(registry: Registry,
                                                                                          tmp_path: Path) -> None:
    # Whoever may write a shared store could replace a study's folder with a link to one of the user's own
    # (~/.ssh, say): the next `check --repair` deleted every file there older than a minute as an orphan.
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'sweep.db'}")
    home = tmp_path / "home"
    home.mkdir()
    precious = home / "precious.txt"
    precious.write_text("keep me")
    os.utime(precious, (time.time() - 3 * 3600,) * 2)
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "s").symlink_to(home)
    store = CheckpointStore(tmp_path / "store", "s")
    registry.register(trial_number=0, study="s", step=10, value=0.5, params={}, shape_key="k",
                      **checkpoint_at(store.local_path("t0.pt"), 10))
    report = check_study(registry, str(tmp_path / "store"), study, repair=True)
    assert precious.read_text() == "keep me"
    assert not report.of_kind(ProblemKind.ORPHAN_FILE)
    assert any("orphan scan skipped" in note and "symbolic link" in note for note in report.notes)
    # The study's own folder, with that file in it, is scanned: the file is an orphan there.
    (tmp_path / "store" / "s").unlink()
    home.rename(tmp_path / "store" / "s")
    repaired = check_study(registry, str(tmp_path / "store"), study, repair=True)
    assert [p.kind for p in repaired.problems] == [ProblemKind.ORPHAN_FILE]
    assert not (tmp_path / "store" / "s" / "precious.txt").exists()


# ---------------------------------------------------------------------------------------------------------------------
# Which user code a stored config may name.

@pytest.mark.parametrize(("config", "named"), [
    ({"task": "digits"}, {}),
    ({"task": "os:system"}, {"task 'os:system'": "os:system"}),
    ({"task": "digits", "curriculum": {"schedule": "linear"}}, {}),
    ({"task": "digits", "curriculum": {"schedule": "evil:level"}}, {"curriculum schedule 'evil:level'": "evil:level"}),
    ({"task": "digits", "curriculum.schedule": "evil:level"}, {"curriculum schedule 'evil:level'": "evil:level"}),
])
def test_user_code_is_what_a_stored_config_names_beyond_the_builtins(config: dict[str, Any],
                                                                     named: dict[str, str]) -> None:
    assert user_code(config) == named


def test_only_code_the_study_file_names_is_trusted() -> None:
    document = copy.deepcopy(TINY_STUDY) | {"task": "my_project.tasks:mine"}
    document["fixed"] = {**document["fixed"], "curriculum": {"schedule": "my_project.pacing:slow"}}
    spec = parse_spec(document, "test.yaml", check_trainer=False)  # the modules need not exist: nothing is imported
    trusted = code_in_study(spec)
    assert {"my_project.tasks:mine", "my_project.pacing:slow"} <= trusted
    refuse_untrusted_code({"task": "my_project.tasks:mine", "curriculum": {"schedule": "my_project.pacing:slow"}},
                          trusted, "reproducing trial 0")
    with pytest.raises(UntrustedCode, match=r"reproducing trial 0 would import and run task 'os:system'.*--trust-task"):
        refuse_untrusted_code({"task": "os:system"}, trusted, "reproducing trial 0")


# ---------------------------------------------------------------------------------------------------------------------
# File permissions.

@pytest.mark.parametrize(("user_umask", "setting", "expected"), [
    (0o022, None, 0o077),  # a login's default: owner-only anyway
    (0o002, None, 0o077),
    (0o027, None, 0o077),
    (0o077, None, 0o077),
    (0o022, "022", 0o022),  # shared on purpose, by name
    (0o077, "027", 0o027),
    (0o022, "rw-r--r--", 0o077),  # not octal: ignored with a warning
    (0o022, "1777", 0o077),
    (0o022, "777", 0o077),  # the owner's own rights taken (an unreadable database): ignored with a warning
    (0o022, "200", 0o077),
])
def test_sweep_creates_files_owner_only_unless_sweep_umask_says_otherwise(
        user_umask: int, setting: str | None, expected: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    if setting is None:
        monkeypatch.delenv(UMASK_ENV, raising=False)
    else:
        monkeypatch.setenv(UMASK_ENV, setting)
    before = os.umask(user_umask)
    try:
        assert private_umask() == user_umask
        (tmp_path / "file").touch()
        (tmp_path / "folder").mkdir()
        now = os.umask(0)
    finally:
        os.umask(before)
    assert now == expected
    assert (tmp_path / "file").stat().st_mode & 0o777 == 0o666 & ~expected
    assert (tmp_path / "folder").stat().st_mode & 0o777 == 0o777 & ~expected
    err = capsys.readouterr().err
    assert ("is not an octal umask" in err) == (setting in ("rw-r--r--", "1777"))
    assert ("takes from the owner their own rights" in err) == (setting in ("777", "200"))


def test_check_repair_uploads_artifacts_only_where_the_store_keeps_them(registry: Registry, tmp_path: Path) -> None:
    from sweep.outcomes import ARTIFACTS_ATTR, ATTR_CHECKPOINT

    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    study = optuna.create_study(study_name="s", storage=url)
    store = CheckpointStore(tmp_path / "store", "s")
    blob = checkpoint_at(store.local_path("t0.pt"), 10)
    registry.register(study="s", trial_number=0, step=10, value=0.5, params={}, shape_key="k", **blob)
    trial = study.ask()
    trial.set_user_attr(ATTR_CHECKPOINT, {"artifact_id": "dotfile", "sha256": blob["sha256"], "step": 10})
    study.tell(trial, 0.5)
    home = tmp_path / "home"
    home.mkdir()
    study.set_user_attr(ARTIFACTS_ATTR, str(home))  # as whoever writes the database would have it
    report = check_study(registry, str(tmp_path / "store"), study, repair=True)
    assert list(home.iterdir()) == []  # never written where the database points
    assert any(f"checked this checkpoint store's own, {store.artifact_location}" in note for note in report.notes)
    assert (Path(store.artifact_location) / "dotfile").exists()  # rebuilt where the store keeps its artifacts

    study.set_user_attr(ARTIFACTS_ATTR, store.artifact_location)
    again = check_study(registry, str(tmp_path / "store"), study, repair=True)
    assert again.ok and again.problems == [] and again.notes == []
