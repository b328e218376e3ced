"""Many workers on one study: SQLite on this machine, PostgreSQL as for many machines."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from tests.conftest import TINY_STUDY, run_cli, sweep_cli, write_study


def busy_study(folder: Path, n_trials: int, **fixed) -> Path:
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": n_trials, "heartbeat_interval": 1,
                                            "heartbeat_grace_period": 3,
                                            "checkpoints": {"store": str(folder / "checkpoints")}}
    document["fixed"] = {**document["fixed"], **fixed}
    return write_study(folder, document)


def check_exact(study: optuna.Study, n_trials: int) -> None:
    trials = study.get_trials()
    numbers = [t.number for t in trials]
    assert len(numbers) == len(set(numbers))
    finished = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(finished) == n_trials, [(t.number, t.state, t.user_attrs.get("fail_reason")) for t in trials]
    for trial in finished:  # no lost reports: every evaluation of every trial is in the storage
        handoff = trial.user_attrs.get("warm_start_from", {}).get("step", 0)  # a warm trial reports its own steps
        assert sorted(trial.intermediate_values) == [step for step in (10, 20) if step > handoff]
    # No worker replays another's random draws (a retry repeats its trial's params on purpose).
    drawn = [tuple(sorted(t.params.items())) for t in trials if "retry_of" not in t.user_attrs]
    assert len(drawn) == len(set(drawn)), drawn


def test_three_workers_share_a_sqlite_study_and_lose_nothing(tmp_path: Path) -> None:
    path = busy_study(tmp_path, 12)
    done = run_cli("run", path, "--workers", "3")
    assert done.returncode == 0, done.stderr
    workers = {line.split("]")[0] for line in done.stderr.splitlines() if line.startswith("[worker ")}
    assert workers == {"[worker 0", "[worker 1", "[worker 2"}  # all three trained
    check_exact(optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}"), 12)
    assert "locked" not in done.stderr


def test_three_workers_share_a_postgresql_study(tmp_path: Path, postgres_url: str) -> None:
    path = busy_study(tmp_path, 12)
    done = run_cli("run", path, "--workers", "3", "--storage", postgres_url, "--study-name", "pg-three")
    assert done.returncode == 0, done.stderr
    check_exact(optuna.load_study(study_name="pg-three", storage=postgres_url), 12)
    assert not (tmp_path / "tiny.db").exists()


def test_workers_short_of_postgresql_connection_slots_take_turns_and_say_why(tmp_path: Path) -> None:
    """Two workers need up to 8 connections and the server has 4, as many as one worker takes at its busiest (a
    worker now holds none idle from opening its storage, so 6 no longer ran short for sure): a worker refused a slot
    gives back the ones it holds idle (else each holds some and both wait for the other until their patience ends,
    with no trial trained), and the launcher holds none while its workers run. The waiting one names the limit, then
    finds the budget spent."""
    from tests.pg import PostgresServer

    path = busy_study(tmp_path, 6)
    document = yaml.safe_load(path.read_text()) | {"storage_patience": 240}
    write_study(tmp_path, document)
    with PostgresServer(max_connections=4) as server:
        done = run_cli("run", path, "--workers", "2", "--storage", server.url, "--study-name", "slots")
        assert done.returncode == 0, done.stderr
        assert "no free connection slot" in done.stderr and "max_connections" in done.stderr, done.stderr
        check_exact(optuna.load_study(study_name="slots", storage=server.url), 6)


def test_separate_commands_as_on_separate_machines(tmp_path: Path, postgres_url: str) -> None:
    path = busy_study(tmp_path, 10)  # checkpoints in one shared folder, as on a shared file system
    # One model shape for every trial, so that any finished trial can donate: with model.hidden searched over 25
    # sizes, whether two of 10 trials shared one was left to chance.
    document = yaml.safe_load(path.read_text())
    del document["space"]["model.hidden"]
    path.write_text(yaml.safe_dump(document | {"fixed": {**document["fixed"], "model": {"hidden": 16}}}))
    args = [sys.executable, "-m", "sweep.cli", "run", str(path), "--storage", postgres_url, "--study-name", "machines",
            "--set", "warm_start.max_distance=5.0"]
    processes = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=300) for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0], [err for _, err in outputs]
    study = optuna.load_study(study_name="machines", storage=postgres_url)
    check_exact(study, 10)
    warm = [t.user_attrs["warm_start_from"] for t in study.get_trials() if "warm_start_from" in t.user_attrs]
    assert warm  # donors found through the shared registry, their blobs through the shared folder
    assert all((tmp_path / "checkpoints" / "machines" / parent["uri"]).exists() for parent in warm)


def test_a_new_study_started_at_once_from_two_folders_runs_with_one_checkpoint_store(tmp_path: Path,
                                                                                       postgres_url: str) -> None:
    # Found by review: two machines' checkouts (two folders) starting a new study on one PostgreSQL server at the same
    # moment each found no checkpoint folder of the other's yet, and both ran, each with its own default store: a
    # later run from one folder took the other's checkpoint rows for missing files and deleted them. Each start
    # now compares and claims in one turn of the study's lock, so the second is refused (seen 6 times in 6 before).
    for attempt in range(3):
        name = f"twofolders{attempt}"
        folders = [tmp_path / f"{name}-{side}" for side in "ab"]
        starts = []
        for folder in folders:
            folder.mkdir()
            path = write_study(folder, copy.deepcopy(TINY_STUDY) | {"name": name, "n_trials": 2})
            starts.append([sys.executable, "-m", "sweep.cli", "run", str(path), "--storage", postgres_url])
        processes = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=folder) for args, folder in zip(starts, folders, strict=True)]
        errors = [p.communicate(timeout=300)[1] for p in processes]
        codes = [p.returncode for p in processes]
        assert sorted(codes) == [0, 2], errors
        refused = codes.index(2)
        lines = errors[refused].strip().splitlines()
        assert len(lines) == 1 and "checkpoints.store:" in lines[0] and "is not the store study" in lines[0], errors
        assert not (folders[refused] / "sweep-checkpoints").exists()
        study = optuna.load_study(study_name=name, storage=postgres_url)
        assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE] * 2


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


# Takes the study's lock as a worker does when it asks for a trial, then stops itself (SIGSTOP) while holding it: a
# worker paused on a suspended machine, its session to the database still open.
PAUSED_HOLDER = """
import os, signal, sys
from pathlib import Path
from sweep.storage import ask_lock
with ask_lock(sys.argv[1], sys.argv[2]):
    Path(sys.argv[3]).write_text("held")
    os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_worker_paused_while_it_holds_the_study_s_lock_stalls_nobody_past_the_grace_period(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    document = copy.deepcopy(TINY_STUDY) | {"name": f"paused{backend}", "heartbeat_interval": 1,
                                            "heartbeat_grace_period": 3}
    path = write_study(tmp_path, document)
    url = (f"sqlite:///{tmp_path / 'paused.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url"))
    assert sweep_cli("run", path, "--storage", url, "--n-trials", "1").returncode == 0  # the study and its tables
    flag = tmp_path / "held"
    holder = subprocess.Popen([sys.executable, "-c", PAUSED_HOLDER, url, document["name"], str(flag)])
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the holder never took the lock"
            time.sleep(0.05)
        done = sweep_cli("run", path, "--storage", url)  # waited forever, while the holder stayed paused
        assert done.returncode == 0, done.stderr
        assert "the study's lock" in done.stderr and "held for" in done.stderr, done.stderr
        trials = optuna.load_study(study_name=document["name"], storage=url).get_trials()
        assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    finally:
        holder.kill()
        holder.wait()


def signal_one_worker_mid_trial(folder: Path, signum: int) -> tuple[int, str, list[optuna.trial.FrozenTrial]]:
    """`sweep run --workers 2` on 6 trials, one worker sent `signum` once both train a sampled trial: the launcher's
    exit code and stderr, and the study's trials once it ended."""
    path = busy_study(folder, 6, max_steps=800, eval_every_steps=400, log_every_steps=400)
    db = folder / "tiny.db"
    parent = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path), "--workers", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        victim = None
        while victim is None and time.monotonic() < deadline:
            time.sleep(0.3)
            try:
                running = [t for t in optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()
                           if t.state == TrialState.RUNNING]
            except Exception:  # noqa: BLE001 - not created yet
                continue
            # Both trials sampled and training (a trial killed between its ask and its params has no config yet:
            # its retry draws one, and the comparison of params would mean nothing).
            if len(running) == 2 and all(t.params for t in running) and len(children(parent.pid)) == 2:
                victim = children(parent.pid)[0]
        assert victim is not None
        os.kill(victim, signum)
        _, stderr = parent.communicate(timeout=300)
    finally:
        parent.kill()
    return parent.returncode, stderr, optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()


def test_a_worker_killed_mid_trial_is_replaced_and_the_study_completes(tmp_path: Path) -> None:
    code, stderr, trials = signal_one_worker_mid_trial(tmp_path, signal.SIGKILL)
    assert code == 1 and "was killed by SIGKILL (exit code -9)" in stderr  # a worker died, it says...
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 6  # ...and the study still has all its trials
    [lost] = [t for t in trials if t.state == TrialState.FAIL]
    [retry] = [t for t in trials if t.user_attrs.get("retry_of") == lost.number]
    assert retry.state == TrialState.COMPLETE and retry.params == lost.params
    assert retry.user_attrs["retry_reason"] == "worker lost: no heartbeat"


def test_a_worker_preempted_alone_while_the_others_spend_the_budget_is_no_failed_run(tmp_path: Path) -> None:
    """Review: a SIGTERM to one worker of `--workers 2` (a node's job killed, a spot instance of several) queued its
    trial, which the other worker trained, and the study ended complete; the launcher still exited 1 ("worker 1
    exited with code 143"), so `sweep run ... && sweep best` stopped there. It now says which worker stopped and
    exits 0."""
    code, stderr, trials = signal_one_worker_mid_trial(tmp_path, signal.SIGTERM)
    assert code == 0, stderr
    assert re.search(r"^worker [01] stopped on a SIGTERM \(exit code 143\); the other worker spent the budget$",
                     stderr, re.MULTILINE), stderr
    assert "error:" not in stderr
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 6
    [preempted] = [t for t in trials if t.user_attrs.get("fail_reason") == "preempted (SIGTERM)"]
    [retry] = [t for t in trials if t.user_attrs.get("retry_of") == preempted.number]
    assert retry.state == TrialState.COMPLETE and retry.params == preempted.params


def test_sweep_stop_lets_workers_finish_their_trial_and_exit(tmp_path: Path) -> None:
    path = busy_study(tmp_path, 50, max_steps=300, eval_every_steps=100, log_every_steps=100)
    runner = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    db = tmp_path / "tiny.db"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.3)
        try:
            if any(t.state == TrialState.COMPLETE for t in
                   optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()):
                break
        except Exception:  # noqa: BLE001 - not created yet
            continue
    stopped = sweep_cli("stop", path)
    assert stopped.returncode == 0, stopped.stderr
    _, stderr = runner.communicate(timeout=120)
    assert runner.returncode == 0 and "stopped by `sweep stop`" in stderr
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()
    assert all(t.state == TrialState.COMPLETE for t in trials) and len(trials) < 50  # finished, none cut short
    resumed = sweep_cli("run", path, "--n-trials", str(len(trials) + 1))
    assert resumed.returncode == 0 and "stopped" not in resumed.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sweep_stop_given_while_a_run_starts_stops_it(tmp_path: Path, workers: str) -> None:
    # Found by review: a worker counted stops from when it began its loop (after torch's import and the study's
    # opening; a launcher's workers from when it started them), so a `sweep stop` given in a run's first seconds was
    # older than that, ignored, and the run trained its whole budget.
    from tests.e2e.test_cli import _started_catching_sigterm

    path = busy_study(tmp_path, 1, max_steps=300, eval_every_steps=100, log_every_steps=100)
    assert sweep_cli("run", path).returncode == 0  # the study exists: `sweep stop` has somewhere to write
    runner = _started_catching_sigterm("run", path, "--n-trials", "40", "--workers", workers)  # it has started
    stopped = sweep_cli("stop", path)
    assert stopped.returncode == 0, stopped.stderr
    stop_landed = time.time()
    _, stderr = runner.communicate(timeout=300)
    assert runner.returncode == 0, stderr
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").get_trials()
    assert all(t.state == TrialState.COMPLETE for t in trials), [t.state for t in trials]
    said = f"stopped by `sweep stop` with {len(trials)}/40 trials done; rerun the same command to continue."
    assert said in stderr, stderr
    # Stopped at its first boundary after the stop was written: the stop usually lands while torch imports, before
    # any trial (the worker's next check may race a stop written as it asks one, on a loaded machine: the one
    # trial allowed here; a stop taken for older than the run, as before, trained all 40).
    assert len([t for t in trials[1:] if t.datetime_start.timestamp() > stop_landed]) <= 1, trials


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stop_during_the_last_trials_does_not_ask_for_a_rerun_that_has_nothing_left(tmp_path: Path,
                                                                                       workers: int) -> None:
    # It said "rerun the same command to continue" (a launcher's workers: "the study resumes with the next `sweep
    # run`") with the whole budget done.
    path = busy_study(tmp_path, workers, max_steps=2000, eval_every_steps=10, log_every_steps=10)
    runner = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path), "--workers", str(workers)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # every trial of the budget is training
        time.sleep(0.2)
        try:
            trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").get_trials()
        except Exception:  # noqa: BLE001 - not created yet
            continue
        if len(trials) == workers and all(t.intermediate_values for t in trials):
            break
    assert sweep_cli("stop", path).returncode == 0
    _, stderr = runner.communicate(timeout=300)
    assert runner.returncode == 0, stderr
    spent = f"stopped by `sweep stop` with the budget spent ({workers}/{workers} trials done)."
    assert stderr.strip().splitlines()[-1] == spent, stderr
    # Said once, by the launcher: its workers' lines, each with its own count and advice, read as three stops (review).
    assert not any(line.startswith("[worker ") and "stopped by `sweep stop`" in line for line in stderr.splitlines())



@pytest.mark.parametrize("where", ["relative", "server default"])
def test_the_checkpoint_store_is_found_from_the_study_file_not_the_working_folder(
        tmp_path: Path, where: str, request: pytest.FixtureRequest) -> None:
    """A rerun or a worker started in another folder must find the same checkpoints (and tracking runs): a relative
    store, and a server database's default store, were relative to the working folder (a rerun from elsewhere found no
    resume point and its quick check deleted the rows it could not see)."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 1}
    args: list[str] = []
    if where == "relative":
        document["checkpoints"] = {"store": "ckpts"}
        document["tracking"] = {"tensorboard": {"dir": "tb"}, "mlflow": True}
        expected, tensorboard, mlflow = project / "ckpts" / "tiny", project / "tb" / "tiny", project / "tiny.mlflow.db"
    else:
        args = ["--storage", request.getfixturevalue("postgres_url")]
        document["tracking"] = {"tensorboard": True, "mlflow": True}
        expected, tensorboard = project / "sweep-checkpoints" / "tiny", project / "sweep-tensorboard" / "tiny"
        mlflow = project / "sweep-mlflow.db"
    path = write_study(project, document)
    done = sweep_cli("run", path, *args, cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert list(expected.glob("trial*.pt")), sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.pt"))
    assert (tensorboard / "trial-00000").is_dir() and mlflow.is_file()
    # The read commands find the same folder: `sweep check --repair` from elsewhere deleted the rows whose blobs it
    # looked for in the working folder.
    checked = sweep_cli("check", path, *args, "--repair", cwd=elsewhere)
    assert checked.returncode == 0 and "missing_blob" not in checked.stdout, checked.stdout + checked.stderr
    assert list(expected.glob("trial*.pt"))
    assert not any(elsewhere.iterdir())  # nothing written in the working folder

# A user's loop whose steps take seconds between checks: it marks each step's start and end in a folder.
NAPPING_LOOP = """
import time
from pathlib import Path


def main(config, run):
    for step in range(1, config["max_steps"] + 1):
        Path(config["marks"], f"{run.trial}-{step}-begin").touch()
        time.sleep(config["nap_s"])
        Path(config["marks"], f"{run.trial}-{step}-end").touch()
        if run.report(step, val_loss=1.0 / step):
            return
"""


@pytest.mark.parametrize(("target", "signum", "code", "reason"), [
    ("group", signal.SIGINT, 130, "interrupted"), ("launcher", signal.SIGTERM, 143, "preempted (SIGTERM)"),
    # SIGKILL of the launcher: its workers trained on for nobody (a rerun then added more); now its death reaches
    # them as its SIGTERM would (the launcher's stderr pipe, which they hold too, closes once they have ended).
    ("launcher", signal.SIGKILL, -signal.SIGKILL, "preempted (SIGTERM)")])
def test_a_signal_to_workers_and_their_launcher_stops_each_worker_at_its_next_check(
        tmp_path: Path, target: str, signum: int, code: int, reason: str) -> None:
    """A terminal's Ctrl-C reaches the launcher and its workers alike. The launcher passes it on to its workers too
    (for a signal sent to it alone, as SIGTERM here); a worker that already has the request must not take that for a
    second Ctrl-C, which raises at once, wherever the worker is (here: inside the user's step, whose end it would
    never mark)."""
    (tmp_path / "napper").mkdir()
    (tmp_path / "napper" / "__init__.py").write_text("")
    (tmp_path / "napper" / "train.py").write_text(NAPPING_LOOP)
    marks = tmp_path / "marks"
    marks.mkdir()
    path = write_study(tmp_path, {
        "name": "naps", "n_trials": 4, "sampler": {"type": "random"}, "pruner": "none", "loop": "napper.train:main",
        "fixed": {"max_steps": 50, "nap_s": 3.0, "marks": str(marks)},
        "space": {"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}}})
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    launcher = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path), "--workers", "2"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)  # its own process group, as a terminal gives it
    try:
        deadline = time.monotonic() + 180
        while len({mark.name.split("-")[0] for mark in marks.glob("*-1-begin")}) < 2:  # both workers mid-step
            assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()
            time.sleep(0.1)
        if target == "group":
            os.killpg(launcher.pid, signum)  # Ctrl-C: the whole group
        else:
            os.kill(launcher.pid, signum)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == code, stderr
    begun = {mark.name.removesuffix("-begin") for mark in marks.glob("*-begin")}
    ended = {mark.name.removesuffix("-end") for mark in marks.glob("*-end")}
    assert begun == ended, f"steps cut short: {sorted(begun - ended)}\n{stderr}"
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    trials = optuna.load_study(study_name="naps", storage=f"sqlite:///{tmp_path / 'naps.db'}").get_trials()
    interrupted = [t for t in trials if t.user_attrs.get("interrupted")]
    assert len(interrupted) == 2, stderr
    assert all(t.state == TrialState.FAIL and t.user_attrs["fail_reason"] == reason for t in interrupted)
    queued = [t for t in trials if t.state == TrialState.WAITING]
    assert sorted(t.user_attrs["retry_of"] for t in queued) == sorted(t.number for t in interrupted)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, route: str, server: subprocess.Popen) -> bytes:
    """GET from a local server, waiting up to a minute for it to come up (and failing if it died)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{route}", timeout=10) as response:
                return response.read()
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise
            time.sleep(0.3)


def listening_addresses(pid: int, port: int) -> set[str]:
    """The addresses that process `pid` listens on for TCP `port`, from the kernel's socket tables (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # a descriptor closed since the listing
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    addresses = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path("/proc/net") / table
        for row in path.read_text().splitlines()[1:] if path.exists() else []:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port and inode in inodes:  # 0A: LISTEN
                # The address is printed as 32-bit words in the machine's byte order.
                words = [bytes.fromhex(address[i:i + 8]) for i in range(0, len(address), 8)]
                packed = b"".join(w[::-1] if sys.byteorder == "little" else w for w in words)
                addresses.add(socket.inet_ntop(family, packed))
    return addresses


def test_the_dashboard_reading_a_live_sqlite_study_does_not_disturb_it(tmp_path: Path) -> None:
    pytest.importorskip("optuna_dashboard")
    path = busy_study(tmp_path, 2)
    assert sweep_cli("run", path).returncode == 0  # the study exists
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "sweep.cli", "dashboard", str(path), "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # its access log is long
    try:
        http_get(port, "/api/studies", server)
        workers = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path), "--workers", "3",
                                    "--n-trials", "14"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        reads = 0
        while workers.poll() is None:  # the dashboard reads every trial, over and over, while three workers write
            json.loads(http_get(port, "/api/studies/1?after=0", server))
            reads += 1
        _, stderr = workers.communicate(timeout=60)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert workers.returncode == 0, stderr
    assert reads >= 5 and "locked" not in stderr
    check_exact(optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}"), 14)


def test_dashboard_on_port_0_names_the_port_it_serves_on(tmp_path: Path) -> None:
    # Found by a fuzz of the commands' arguments: `--port 0` printed http://127.0.0.1:0/dashboard.
    pytest.importorskip("optuna_dashboard")
    optuna.create_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}")
    server = subprocess.Popen([sys.executable, "-m", "sweep.cli", "dashboard", str(tmp_path / "tiny.db"), "--port",
                               "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        line = server.stderr.readline()
        found = re.search(r"on http://127\.0\.0\.1:(\d+)/dashboard ", line)
        assert found is not None and int(found[1]) > 0, line
        [summary] = json.loads(http_get(int(found[1]), "/api/studies", server))["study_summaries"]
        assert summary["study_name"] == "tiny"
    finally:
        server.terminate()
        server.communicate(timeout=60)


def test_dashboard_serves_the_study_on_loopback(tmp_path: Path) -> None:
    pytest.importorskip("optuna_dashboard")
    document = copy.deepcopy(TINY_STUDY) | {"pruner": {"type": "threshold", "upper": 0.1, "n_warmup_steps": 15},
                                            "n_trials": 3, "warm_start": {"max_distance": 5.0, "handoff": 0.25}}
    document["fixed"] = {**document["fixed"], "max_steps": 40}  # pruned at step 20, after the handoff at 10
    document["space"] = {"learning_rate": document["space"]["learning_rate"]}  # one shape: every trial a donor
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 0
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "sweep.cli", "dashboard", str(path), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        get = lambda route: http_get(port, route, server)
        [summary] = json.loads(get("/api/studies"))["study_summaries"]
        assert summary["study_name"] == "tiny"
        detail = json.loads(get(f"/api/studies/{summary['study_id']}?after=0"))
        assert [t["state"] for t in detail["trials"]] == ["Pruned"] * 3
        for trial in detail["trials"]:
            attrs = {a["key"]: a["value"] for a in trial["user_attrs"]}
            # A warm trial reports only its own steps: its donor's value at the handoff (step 10) is not its own.
            own = [20] if "warm_start_from" in attrs else [10, 20]
            assert [v["step"] for v in trial["intermediate_values"]] == own
            assert "'rule': 'threshold'" in attrs["prune_reason"] or '"rule": "threshold"' in attrs["prune_reason"]
            assert "learning_rate" in attrs["config"] and "torch" in attrs["reproducibility"]
            assert "samples_per_s" in attrs["speed"]  # a slow configuration is visible
            if trial["number"] > 0:  # warm-start lineage: which trial, which step, how far
                assert '"trial": ' in attrs["warm_start_from"] and '"distance": ' in attrs["warm_start_from"]
            else:  # the cold trial's best checkpoint, downloadable from the dashboard (a warm trial pruned at its
                # starting point trained nothing of its own to upload)
                [artifact] = trial["artifacts"]
                blob = get(f"/artifacts/{summary['study_id']}/{trial['trial_id']}/{artifact['artifact_id']}")
                assert hashlib.sha256(blob).hexdigest() in attrs["checkpoint"]
        if not Path("/proc/net/tcp").exists():
            pytest.skip("no /proc/net/tcp to read the dashboard's bound address from (checked all but that)")
        # It listens on loopback only: bound to 127.0.0.1, not to 0.0.0.0 or :: (every address of this machine).
        assert listening_addresses(server.pid, port) == {"127.0.0.1"}
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_report_is_one_self_contained_html_file(tmp_path: Path) -> None:
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 6, "pruner": {"type": "fastfail", "then": "median"}}
    document["space"] = {**document["space"],
                         "learning_rate": {"type": "float", "low": 1e-3, "high": 200.0, "log": True}}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 0
    report = tmp_path / "report.html"
    done = sweep_cli("report", path, "-o", report)
    assert done.returncode == 0, done.stderr
    text = report.read_text()
    for section in ("Optimisation history", "Intermediate values", "Parameter importances", "Infeasible trials",
                    "Best trial"):
        assert f"<h2>{section}" in text
    assert "python -m trainer" in text and "Plotly.newPlot" in text
    assert "Not available" not in text  # every figure was drawn (a missing plotly would say so here)
    assert "<script src=" not in text  # nothing to fetch: plotly.js is inlined


def test_workers_import_the_loop_beside_the_study_not_a_same_named_module_in_the_working_folder(
        tmp_path: Path) -> None:
    """Found by review: `--workers N` started each worker as `python -m sweep.cli`, which puts the working folder
    first on sys.path; `sweep run ../b/study.yaml --workers 2` from a folder with its own `train.py` trained that one
    in every worker, while one process trained the `train.py` beside the study file: a best value from another
    project's code."""
    for folder, value in (("a", 0.5), ("b", 1.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "train.py").write_text(f"def main(config, run):\n    run.report(1, val_loss={value})\n")
    study = {"name": "beside", "n_trials": 4, "sampler": {"type": "random"}, "pruner": "none", "loop": "train:main",
             "checkpoints": False, "fixed": {"max_steps": 1, "eval_every_steps": 1},
             "space": {"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}}}
    path = write_study(tmp_path / "b", study)
    done = sweep_cli("run", path, "--workers", "2", cwd=tmp_path / "a")
    assert done.returncode == 0, done.stderr
    trials = optuna.load_study(study_name="beside", storage=f"sqlite:///{tmp_path / 'b' / 'beside.db'}").trials
    assert sorted(t.value for t in trials) == [1.0] * 4, [(t.number, t.value) for t in trials]


_FAST_CLOCK = """
import time
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + 600  # this machine's clock, ten minutes fast
time.time_ns = lambda: _time_ns() + 600_000_000_000
"""


def test_sweep_stop_reaches_a_worker_whose_machine_clock_runs_fast(tmp_path: Path, postgres_url: str) -> None:
    """Found by review: `sweep stop` stamped its request with the wall clock of the machine it ran on, and each
    worker compared that with its own machine's: a worker whose clock ran ten minutes fast took every stop of the
    next ten minutes for one given before it started, and trained its whole budget. The stop is stamped by the
    database server's clock now, and each worker reads it back on its own."""
    (tmp_path / "clock").mkdir()
    (tmp_path / "clock" / "sitecustomize.py").write_text(_FAST_CLOCK)
    document = copy.deepcopy(TINY_STUDY) | {"name": f"skew-{tmp_path.name}", "n_trials": 40, "checkpoints": False}
    document["fixed"] = {**document["fixed"], "max_steps": 300, "eval_every_steps": 100, "log_every_steps": 100}
    path = write_study(tmp_path, document)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "clock"),
                                                                     os.environ.get("PYTHONPATH")]))}
    runner = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path), "--storage", postgres_url],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        while not any(t.state == TrialState.COMPLETE for t in _trials(document["name"], postgres_url)):
            assert runner.poll() is None and time.monotonic() < deadline, runner.communicate()
            time.sleep(0.3)
        stopped = sweep_cli("stop", path, "--storage", postgres_url)
        assert stopped.returncode == 0, stopped.stderr
        _, stderr = runner.communicate(timeout=240)
    finally:
        runner.kill()
    assert runner.returncode == 0 and "stopped by `sweep stop`" in stderr, stderr
    assert len(_trials(document["name"], postgres_url)) < 40


def _trials(name: str, url: str) -> list[optuna.trial.FrozenTrial]:
    try:
        return optuna.load_study(study_name=name, storage=url).get_trials()
    except KeyError:  # not made yet
        return []
