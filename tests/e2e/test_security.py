"""Through the real CLI: what whoever can write the database can no longer do, what `ps` shows of a storage URL, and
who may read the files a study writes."""

from __future__ import annotations

import copy
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from tests.conftest import CLI_ENV, TINY_STUDY, sweep_cli, write_study

MARKER_TASK = '''
import os
from pathlib import Path

from trainer.tasks import digits


def boom(**kwargs):
    """Harmless, but it leaves a mark: proof that sweep imported and called it."""
    Path(os.environ["SWEEP_TEST_MARKER"]).write_text("called")
    return digits(**kwargs)


def level(step, max_steps):
    Path(os.environ["SWEEP_TEST_MARKER"]).write_text("called")
    return 1.0
'''


def set_trial_attr(db: Path, number: int, key: str, change) -> None:
    """Rewrite one stored user attr of trial `number`, as anyone who can write the database could."""
    with sqlite3.connect(db) as connection:
        trial_id, value = connection.execute(
            "SELECT a.trial_id, a.value_json FROM trial_user_attributes a JOIN trials t ON a.trial_id = t.trial_id "
            "WHERE t.number = ? AND a.key = ?", (number, key)).fetchone()
        connection.execute("UPDATE trial_user_attributes SET value_json = ? WHERE trial_id = ? AND key = ?",
                           (json.dumps(change(json.loads(value))), trial_id, key))


@pytest.mark.parametrize(("field", "code"), [("task", "marker_task:boom"), ("schedule", "marker_task:level"),
                                             ("task", "os:system")])
def test_reproduce_and_best_import_only_code_the_user_named(tmp_path: Path, field: str, code: str) -> None:
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "marker_task.py").write_text(MARKER_TASK)
    marker = tmp_path / "marker"
    env = {"SWEEP_TEST_MARKER": str(marker)}
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 1})
    assert sweep_cli("run", path).returncode == 0
    db = tmp_path / "tiny.db"

    def plant(config: dict) -> dict:
        if field == "task":
            return config | {"task": code}
        return config | {"curriculum": {**config["curriculum"], "schedule": code}}

    set_trial_attr(db, 0, "config", plant)
    cli = lambda *args: sweep_cli(*args, env=env, pythonpath=tmp_path / "code")

    # Only the database names it: refused, before anything is imported.
    what = "task" if field == "task" else "curriculum schedule"
    for command in (["reproduce", db, "0"], ["best", db], ["reproduce", path, "0"]):  # the file names `digits`
        done = cli(*command)
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"would import and run {what} {code!r}, which only the database names" in done.stderr
        assert "--trust-task" in done.stderr and "Traceback" not in done.stderr
        assert not marker.exists()
    if code == "os:system":
        return

    # Named by the user: by the study file given on the command line, or by --trust-task. (A fresh interpreter for
    # the second: this one keeps the task it imported.)
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 1}
    if field == "task":
        document["task"] = code
    else:
        document["fixed"] = {**document["fixed"], "curriculum": {"schedule": code}}
    named = write_study(tmp_path, document, "named.yaml")
    # The task returns digits, so the trial reproduces; a schedule changes the data, so it ran and differs.
    replayed = 0 if field == "task" else 1
    by_file = cli("reproduce", named, "0")
    assert by_file.returncode == replayed, by_file.stderr
    assert marker.read_text() == "called"
    marker.unlink()
    trusted = subprocess.run([sys.executable, "-m", "sweep.cli", "reproduce", str(db), "0", "--trust-task"],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, **CLI_ENV, **env, "PYTHONPATH": str(tmp_path / "code")})
    assert trusted.returncode == replayed, trusted.stderr
    assert marker.read_text() == "called"
    marker.unlink()
    best = cli("best", db, "--trust-task")
    assert best.returncode == 0 and code in best.stdout
    assert cli("best", named).returncode == 0
    assert not marker.exists()  # `sweep best` writes the config; it never imports what it names


def test_reproduce_refuses_a_parent_checkpoint_outside_the_store(tmp_path: Path) -> None:
    document = copy.deepcopy(TINY_STUDY) | {"name": "warm", "n_trials": 2, "warm_start": {"max_distance": 1.0}}
    document["space"] = {"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 0
    with sqlite3.connect(tmp_path / "warm.db") as connection:
        [(lineage,)] = connection.execute("SELECT value_json FROM trial_user_attributes a JOIN trials t ON "
                                          "a.trial_id = t.trial_id WHERE t.number = 1 AND key = 'warm_start_from'")
    parent = tmp_path / "warm.checkpoints" / "warm" / json.loads(lineage)["uri"]
    outside = tmp_path / "elsewhere.pt"
    outside.write_bytes(parent.read_bytes())  # the very same checkpoint, hash and all: only its place is wrong
    set_trial_attr(tmp_path / "warm.db", 1, "warm_start_from", lambda value: value | {"uri": str(outside)})

    done = sweep_cli("reproduce", path, "1")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"warm-started from '{outside}', which is not inside study 'warm'" in done.stderr
    assert "refused, not read" in done.stderr and outside.exists()


def test_retention_never_deletes_a_file_a_row_names_outside_the_store(tmp_path: Path) -> None:
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 2, "checkpoints": {"every_steps": 10, "keep_top_trials": 1}}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 0
    victim = tmp_path / "precious.txt"
    victim.write_text("not a checkpoint, and not sweep's")
    with sqlite3.connect(tmp_path / "tiny.db") as connection:
        # A finished trial's row, ranked last (the worst value, minimizing): the next retention drops it.
        connection.execute(
            "INSERT INTO sweep_checkpoints (study, trial_number, step, value, params, shape_key, uri, size, sha256, "
            "created_at, final, pinned, cat_key) VALUES ('tiny', 1, 10, 1e9, '{}', 'k', ?, 1, ?, 0, 1, 0, '')",
            (str(victim), "0" * 64))
        connection.execute("UPDATE sweep_checkpoints SET final = 1 WHERE trial_number = 1")
    done = sweep_cli("run", path, "--n-trials", "3")
    assert done.returncode == 0, done.stderr
    assert "precious.txt" in done.stderr and "is not inside study 'tiny'" in done.stderr
    assert victim.read_text() == "not a checkpoint, and not sweep's"
    with sqlite3.connect(tmp_path / "tiny.db") as connection:
        assert connection.execute("SELECT count(*) FROM sweep_checkpoints WHERE uri = ?", (str(victim),)).fetchone() \
            == (0,)


# ---------------------------------------------------------------------------------------------------------------------
# Process arguments.

def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_workers_never_show_the_storage_password_on_their_command_lines(tmp_path: Path, postgres_url: str,
                                                                        form: str) -> None:
    if not Path("/proc/self/cmdline").exists():
        pytest.skip("no /proc: the test reads the workers' command lines there")
    password = "Sw33p-s3cret-pw"
    head, _, query = postgres_url.partition("?")  # postgresql+psycopg://postgres@/sweep?host=SOCKET
    # The test server trusts local connections and ignores the password: both forms connect.
    url = (head.replace("postgres@", f"postgres:{password}@") + "?" + query if form == "userinfo"
           else f"{postgres_url}&password={password}")
    document = copy.deepcopy(TINY_STUDY) | {"name": f"cmdline-{form}", "n_trials": 4, "storage": url}
    path = write_study(tmp_path, document)  # the password is in the file, not on any command line
    log = tmp_path / "run.log"
    with open(log, "w") as output:
        parent = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path), "--workers", "2"],
                                  stdout=output, stderr=subprocess.STDOUT, env={**os.environ, **CLI_ENV})
    seen: dict[int, str] = {}
    deadline = time.monotonic() + 120
    while parent.poll() is None and time.monotonic() < deadline:
        for pid in _children(parent.pid):
            if "-m sweep run" in (line := _cmdline(pid)):  # a worker (its launcher runs -m sweep.cli)
                seen[pid] = line
        if len(seen) == 2:
            break
        time.sleep(0.05)
    code = parent.wait(timeout=300)
    text = log.read_text()
    assert len(seen) == 2, f"saw {len(seen)} workers before the run ended (exit {code}): {text[-2000:]}"
    assert code == 0, text[-2000:]
    for line in seen.values():
        assert password not in line and "postgres" not in line, line  # no URL at all: it came by environment
    assert password not in text


# ---------------------------------------------------------------------------------------------------------------------
# File permissions.

def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_study_s_files_are_owner_only_whatever_the_login_umask(tmp_path: Path) -> None:
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 2, "checkpoints": {"every_steps": 10, "artifacts": True}}
    path = write_study(tmp_path, document)
    env = {**os.environ, **CLI_ENV}
    env.pop("SWEEP_UMASK", None)
    command = [sys.executable, "-m", "sweep.cli"]
    run = subprocess.Popen([*command, "run", str(path)], env=env, umask=0o022, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    wal, shm = tmp_path / "tiny.db-wal", tmp_path / "tiny.db-shm"
    modes: dict[str, int] = {}
    deadline = time.monotonic() + 120
    while run.poll() is None and time.monotonic() < deadline and len(modes) < 2:
        for name, file in (("wal", wal), ("shm", shm)):
            if name not in modes and file.exists():
                modes[name] = _mode(file)  # SQLite's own files, seen while the run holds them
        time.sleep(0.01)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr
    assert modes == {"wal": 0o600, "shm": 0o600}, f"saw {modes}"
    store = tmp_path / "tiny.checkpoints"
    files = [tmp_path / "tiny.db", tmp_path / "tiny.db.lock", *(p for p in store.rglob("*") if p.is_file())]
    folders = [store, *(p for p in store.rglob("*") if p.is_dir())]
    assert len(files) > 3 and any(p.name == "_artifacts" for p in folders)
    assert {str(p): _mode(p) for p in files} == {str(p): 0o600 for p in files}
    assert {str(p): _mode(p) for p in folders} == {str(p): 0o700 for p in folders}

    for args, written in ((["report", str(path), "-o", str(tmp_path / "report.html")], tmp_path / "report.html"),
                          (["best", str(path), "-o", str(tmp_path / "best.yaml")], tmp_path / "best.yaml")):
        subprocess.run([*command, *args], env=env, umask=0o022, check=True, capture_output=True)
        assert _mode(written) == 0o600, args

    # Shared on purpose, by name: SWEEP_UMASK is the umask used.
    shared = tmp_path / "shared"
    shared.mkdir()
    path = write_study(shared, copy.deepcopy(TINY_STUDY) | {"n_trials": 1})
    subprocess.run([*command, "run", str(path)], env={**env, "SWEEP_UMASK": "022"}, umask=0o077, check=True,
                   capture_output=True)
    assert _mode(shared / "tiny.db") == 0o644 and _mode(shared / "tiny.checkpoints") == 0o755


def test_the_dashboard_serves_artifacts_only_from_the_study_s_own_store(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import optuna

    from sweep.cli import dashboard_artifact_store

    store = tmp_path / "study.checkpoints"
    (store / "_artifacts").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    study = optuna.create_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'study.db'}")
    study.set_user_attr("sweep.artifacts", str(tmp_path / "elsewhere"))  # as whoever can write the database may
    served = dashboard_artifact_store(study, str(store))
    assert served is not None and Path(served.store._base_path) == store / "_artifacts"
    assert "serving only the store's" in capsys.readouterr().err

    study.set_user_attr("sweep.artifacts", str(store / "_artifacts"))  # what a worker records: no warning
    assert dashboard_artifact_store(study, str(store)) is not None
    assert capsys.readouterr().err == ""


def test_the_storage_password_comes_from_the_variable_the_study_file_names(tmp_path: Path) -> None:
    from tests.pg import PostgresServer, postgres_available

    if not postgres_available():
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    password = "n0t-in-any-file"
    with PostgresServer(password=password) as server:  # this server refuses a connection without the password
        document = copy.deepcopy(TINY_STUDY) | {"name": "pw-env", "n_trials": 4, "storage": server.url,
                                                "storage_password_env": "SWEEP_TEST_DB_PASSWORD"}
        path = write_study(tmp_path, document)
        env = {key: value for key, value in os.environ.items() if key not in ("PGPASSWORD", "SWEEP_TEST_DB_PASSWORD")}

        unset = subprocess.run([sys.executable, "-m", "sweep.cli", "run", str(path)], capture_output=True, text=True,
                               env={**env, **CLI_ENV}, timeout=300)
        assert unset.returncode == 2, unset.stderr
        assert unset.stderr == (f"error: {path}: storage_password_env: the environment variable SWEEP_TEST_DB_PASSWORD "
                                "is not set or empty; export it with the storage password\n")

        done = subprocess.run([sys.executable, "-m", "sweep.cli", "run", str(path), "--workers", "2"],
                              capture_output=True, text=True, timeout=300,
                              env={**env, **CLI_ENV, "SWEEP_TEST_DB_PASSWORD": password})
        assert done.returncode == 0, done.stderr[-2000:]
        assert password not in done.stdout + done.stderr
        status = subprocess.run([sys.executable, "-m", "sweep.cli", "status", str(path)], capture_output=True,
                                text=True, timeout=300, env={**env, **CLI_ENV, "SWEEP_TEST_DB_PASSWORD": password})
        assert status.returncode == 0 and "4/4" in status.stdout, status.stdout + status.stderr


@pytest.mark.parametrize("args", [
    ("status", "{url}"), ("trials", "{url}"), ("check", "{url}"), ("reproduce", "{url}", "0"), ("run", "{url}"),
    ("status", "tiny.db", "--study-name", "{url}"), ("run", "study.yaml", "--study-name", "{url}"),
    ("status", "{url}", "--storage", "sqlite:///tiny.db")])
def test_a_storage_url_given_where_a_file_or_a_name_was_expected_is_echoed_masked(tmp_path: Path,
                                                                                  args: tuple[str, ...]) -> None:
    # Found by a fuzz of the commands' arguments: the one line that refused it showed the password, as a study file
    # ('postgresql+psycopg:/me:s3cretpw@...', its `//` collapsed as a path's), a target or a study name.
    write_study(tmp_path, copy.deepcopy(TINY_STUDY))
    optuna.create_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}")
    url = "postgresql+psycopg://me:s3cretpw@127.0.0.1:1/db"
    done = sweep_cli(*(a.format(url=url) for a in args), cwd=tmp_path)
    assert done.returncode in (1, 2), done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "s3cretpw" not in done.stderr + done.stdout, done.stderr
    assert "me:***@127.0.0.1" in lines[0], lines
