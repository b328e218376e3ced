"""`sweep check [--repair]` through the real CLI: registry and disk made to disagree, then reconciled."""

from __future__ import annotations

import copy
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import TINY_STUDY, another_user, sweep_cli, write_study


def test_check_finds_deleted_and_corrupt_blobs_and_repair_makes_registry_and_disk_agree(tmp_path: Path) -> None:
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 3, "checkpoints": {"every_steps": 10, "keep_top_k": 2}}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 0
    db = tmp_path / "tiny.db"
    with sqlite3.connect(db) as connection:
        rows = connection.execute("SELECT id, uri FROM sweep_checkpoints ORDER BY id").fetchall()
    assert len(rows) >= 3
    folder = (tmp_path / "tiny.checkpoints" / "tiny").resolve()  # row URIs are relative to the study's folder
    (deleted_id, deleted), (corrupt_id, corrupt) = ((i, folder / uri) for i, uri in rows[:2])
    deleted.unlink()
    data = bytearray(Path(corrupt).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(corrupt).write_bytes(bytes(data))

    found = sweep_cli("check", path)
    assert found.returncode == 1, found.stdout + found.stderr
    assert f"{deleted}" in found.stdout and "missing_blob" in found.stdout
    assert f"{corrupt}" in found.stdout and "corrupt_blob" in found.stdout
    with sqlite3.connect(db) as connection:  # a check alone changes nothing
        assert connection.execute("SELECT count(*) FROM sweep_checkpoints").fetchone()[0] == len(rows)

    repaired = sweep_cli("check", path, "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    with sqlite3.connect(db) as connection:
        left = {row[0] for row in connection.execute("SELECT id FROM sweep_checkpoints")}
    assert deleted_id not in left and corrupt_id not in left and len(left) == len(rows) - 2
    assert not Path(corrupt).exists()
    again = sweep_cli("check", path)
    assert again.returncode == 0, again.stdout + again.stderr


def test_check_of_a_study_file_naming_another_store_than_the_study_ran_with_repairs_nothing(tmp_path: Path) -> None:
    # Found by review: a study run with `--set checkpoints.store=other`, then checked by its study file (whose store
    # is the default): every row looked missing, and --repair deleted them all. Moved (the store it ran with is gone),
    # the store the file names is the one checked.
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 2})
    assert sweep_cli("run", path, "--set", "checkpoints.store=other").returncode == 0
    db = tmp_path / "tiny.db"
    with sqlite3.connect(db) as connection:
        rows = connection.execute("SELECT count(*) FROM sweep_checkpoints").fetchone()[0]
    assert rows >= 2
    refused = sweep_cli("check", path, "--repair")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"checkpoints.store: {tmp_path / 'tiny.checkpoints'} is not the store study 'tiny' ran with " \
           f"({tmp_path / 'other'}" in refused.stderr, refused.stderr
    with sqlite3.connect(db) as connection:
        assert connection.execute("SELECT count(*) FROM sweep_checkpoints").fetchone()[0] == rows
    assert not (tmp_path / "tiny.checkpoints").exists()
    assert sweep_cli("check", db).returncode == 0  # the database names the store it ran with
    # A file that names an object store, while the folder the study ran with is there: refused in one line too (was
    # a traceback from the object store's client, which found no credentials).
    write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 2, "checkpoints": {"store": "s3://bucket/prefix"}})
    for args in ((), ("--repair",)):
        elsewhere = sweep_cli("check", path, *args)
        assert elsewhere.returncode == 2 and elsewhere.stdout == "", elsewhere.stdout + elsewhere.stderr
        assert elsewhere.stderr.startswith(f"error: {path}: checkpoints.store: s3://bucket/prefix is not the store")
        assert elsewhere.stderr.count("\n") == 1, elsewhere.stderr
        with sqlite3.connect(db) as connection:
            assert connection.execute("SELECT count(*) FROM sweep_checkpoints").fetchone()[0] == rows

    (tmp_path / "other").rename(tmp_path / "moved")  # moved, and the file edited to say where
    write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 2, "checkpoints": {"store": "moved"}})
    moved = sweep_cli("check", path)
    assert moved.returncode == 0, moved.stdout + moved.stderr
    # Moved to an object store this machine has no credentials for: one line from its client, nothing judged.
    write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 2, "checkpoints": {"store": "s3://bucket/prefix"}})
    no_credentials = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_PROFILE": None,
                      "AWS_EC2_METADATA_DISABLED": "true",  # never ask a cloud's metadata address: loopback only
                      "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none")}
    unreachable = sweep_cli("check", path, "--repair", env=no_credentials)
    assert unreachable.returncode == 1 and unreachable.stderr.count("\n") == 1, unreachable.stderr
    assert unreachable.stderr.startswith("error: checkpoint store s3://bucket/prefix: ")
    assert unreachable.stderr.rstrip().endswith("; nothing checked or repaired")
    with sqlite3.connect(db) as connection:
        assert connection.execute("SELECT count(*) FROM sweep_checkpoints").fetchone()[0] == rows


def test_a_study_folder_moved_is_checked_by_its_study_file_and_a_database_only_check_writes_nothing(
        tmp_path: Path) -> None:
    # Found by review: a study folder moved elsewhere, with a relative checkpoints.store (stored as the absolute path it
    # ran with), checked by its database alone: every row was "missing", --repair deleted them all although the files
    # lay in the moved folder, and the check itself made the old folder again (its artifact store's), after which the
    # study file was refused too ("not the store the study ran with").
    old = tmp_path / "A"
    old.mkdir()
    path = write_study(old, copy.deepcopy(TINY_STUDY) | {"n_trials": 2, "checkpoints": {"store": "ckpts"}})
    assert sweep_cli("run", path).returncode == 0
    with sqlite3.connect(old / "tiny.db") as connection:
        rows = connection.execute("SELECT count(*) FROM sweep_checkpoints").fetchone()[0]
    assert rows >= 2
    new = old.rename(tmp_path / "D")

    for args in ([], ["--repair"]):
        refused = sweep_cli("check", new / "tiny.db", *args)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"the checkpoint store study 'tiny' ran with, {old / 'ckpts'}, is not there" in refused.stderr, \
            refused.stderr
        assert not old.exists()  # nothing made where the study was
    with sqlite3.connect(new / "tiny.db") as connection:
        assert connection.execute("SELECT count(*) FROM sweep_checkpoints").fetchone()[0] == rows

    checked = sweep_cli("check", new / "study.yaml")  # the file's relative store: the moved folder
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert not old.exists()


def _as_another_user(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`sweep ARGS` run by a user who is not the files' owner (`another_user`)."""
    return subprocess.run([*another_user(), sys.executable, "-m", "sweep.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=600)


def test_check_lists_a_checkpoint_it_may_not_read_keeps_it_and_exits_1() -> None:
    # Review: one checkpoint file the checking user may not read ended `sweep check` with "cannot read the study ...
    # PermissionError ...; was the database edited by hand", blaming the database and checking nothing else.
    folder = Path(tempfile.mkdtemp(prefix="sweep-check-"))
    try:
        path = write_study(folder, copy.deepcopy(TINY_STUDY) | {"n_trials": 2})
        assert sweep_cli("run", path).returncode == 0
        subprocess.run(["chmod", "-R", "a+rwX", str(folder)], check=True)  # sweep writes owner-only files
        with sqlite3.connect(folder / "tiny.db") as connection:
            rows = connection.execute("SELECT id, trial_number, uri FROM sweep_checkpoints ORDER BY id").fetchall()
        assert len(rows) >= 2
        blobs = folder / "tiny.checkpoints" / "tiny"
        (locked_id, locked_trial, locked), deleted = ((i, n, blobs / uri) for i, n, uri in rows[:2])
        locked.chmod(0)
        deleted[2].unlink()
        for args, last in ((), "registry and disk disagree"), (("--repair",), "1 checkpoint could not be read, so "
                                                                            "it was not checked (see the notes above)"):
            found = _as_another_user("check", path, *args)
            assert found.returncode == 1, found.stdout + found.stderr
            shown = " ".join(found.stderr.split())  # as wrapped
            assert f"note: checkpoint {locked_id} (trial {locked_trial}, step " in shown, shown
            assert f"{locked.resolve()} cannot be read (Permission denied), so whether it is sound cannot be told; " \
                "kept" in shown, shown
            assert f"{deleted[2].resolve()} is not there" in found.stdout, found.stdout  # the others are checked
            assert last in found.stderr and "edited by hand" not in found.stderr, found.stderr
            assert locked.exists()
        with sqlite3.connect(folder / "tiny.db") as connection:  # the repair forgot the missing one's row alone
            assert connection.execute("SELECT id FROM sweep_checkpoints ORDER BY id").fetchall() == \
                [(locked_id,)] + [(row[0],) for row in rows[2:]]
        blobs.chmod(0)  # the whole folder: each row's blob is a note, and no file is taken for an orphan
        found = _as_another_user("check", path, "--repair")
        blobs.chmod(0o777)
        shown = " ".join(found.stderr.split())
        assert found.returncode == 1 and f"the folder {blobs.resolve()} cannot be listed (Permission denied)" in shown
        kept = [uri for _, _, uri in rows[:1] + rows[2:]]  # the rows the repair above left
        assert f"{len(kept)} checkpoint{'s' if len(kept) > 1 else ''} could not be read" in shown, shown
        assert sorted(p.name for p in blobs.iterdir() if p.suffix == ".pt") == sorted(kept)
        locked.chmod(0o600)
        assert sweep_cli("check", path).returncode == 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_check_of_a_copied_study_leaves_the_original_s_checkpoints_alone(tmp_path: Path) -> None:
    # Found by review: `optuna.copy_study` copies the study's owner id with its attrs and none of sweep's registry;
    # `sweep check --repair` on the copy took the original's checkpoints for orphans and deleted them.
    import os

    import optuna

    # (No dashboard artifacts: the copy's trials then record no checkpoint at all.)
    document = copy.deepcopy(TINY_STUDY) | {"name": "own", "n_trials": 2, "checkpoints": {
        "on_best": True, "artifacts": False, "store": str(tmp_path / "store")}}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 0
    copy_url = f"sqlite:///{tmp_path / 'copy.db'}"
    optuna.copy_study(from_study_name="own", from_storage=f"sqlite:///{tmp_path / 'own.db'}", to_storage=copy_url)
    blobs = sorted((tmp_path / "store" / "own").glob("*.pt"))
    assert blobs
    for blob in blobs:  # older than the orphan scan's minimum age (a younger file may be about to be registered)
        os.utime(blob, (blob.stat().st_mtime - 3600,) * 2)

    checked = sweep_cli("check", path, "--storage", copy_url, "--repair")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "were left alone: this database holds no checkpoint row of study 'own'" in checked.stdout + checked.stderr
    assert all(blob.exists() for blob in blobs)
    assert sweep_cli("check", path).returncode == 0  # the original: every row's blob is there


def test_check_reads_a_registry_an_older_sweep_wrote_without_changing_it(tmp_path: Path) -> None:
    # Found by review: a study run by a sweep from before warm start (its table without the warm-start columns)
    # failed `sweep check` with "no such column: sweep_checkpoints.final ... edited by hand or by another tool?".
    from sweep.registry import COORDS

    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 2, "checkpoints": {"on_best": True}})
    assert sweep_cli("run", path).returncode == 0
    newer = ["final", "pinned", "cat_key", *(f"c{i}" for i in range(COORDS))]
    with sqlite3.connect(tmp_path / "tiny.db") as db:  # the table as that version made it
        db.execute("DROP INDEX ix_sweep_checkpoints_donors")
        for column in newer:
            db.execute(f"ALTER TABLE sweep_checkpoints DROP COLUMN {column}")
        before = db.execute("SELECT * FROM sweep_checkpoints").fetchall()
    assert before
    checked = sweep_cli("check", path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "missing_blob 0, corrupt_blob 0, orphan_file 0" in checked.stderr
    with sqlite3.connect(tmp_path / "tiny.db") as db:  # a check without --repair writes nothing
        columns = [row[1] for row in db.execute("PRAGMA table_info(sweep_checkpoints)")]
        assert not set(newer) & set(columns) and db.execute("SELECT * FROM sweep_checkpoints").fetchall() == before


def test_a_repair_that_may_not_delete_an_orphan_says_so_and_blames_no_database() -> None:
    # Files review: on a read-only store, `check --repair` ended with "cannot read the study in sqlite:///...:
    # OSError: Read-only file system ...; was the database edited by hand", and said nothing of what it repaired.
    # Here the store's folder is read-only to the checking user: the orphan is listed, not deleted.
    import os
    import time

    folder = Path(tempfile.mkdtemp(prefix="sweep-check-"))
    try:
        path = write_study(folder, copy.deepcopy(TINY_STUDY) | {"n_trials": 1})
        assert sweep_cli("run", path).returncode == 0
        subprocess.run(["chmod", "-R", "a+rwX", str(folder)], check=True)
        blobs = folder / "tiny.checkpoints" / "tiny"
        stray = blobs / "stray.pt"
        stray.write_bytes(b"junk")
        os.utime(stray, (time.time() - 7200, time.time() - 7200))
        blobs.chmod(0o555)  # read-only for a user without root's privileges
        try:
            found = _as_another_user("check", path, "--repair")
        finally:
            blobs.chmod(0o777)
        shown = " ".join((found.stdout + found.stderr).split())
        assert found.returncode == 1, shown
        assert f"{stray.resolve()}: no checkpoint row names it (120 min old); it cannot be deleted: permission " \
            "denied" in shown, shown
        assert "edited by hand" not in shown and "Traceback" not in shown and stray.exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
