"""A worker SIGKILLed mid-trial: the trial is detected dead and retried from its own last checkpoint."""

from __future__ import annotations

import contextlib
import copy
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from sweep.outcomes import budget_counts
from tests.conftest import TINY_STUDY, sweep_cli, write_study


def checkpointed_steps(db: Path, trial: int) -> list[int]:
    try:
        with sqlite3.connect(db) as connection:
            return [row[0] for row in connection.execute(
                "SELECT step FROM sweep_checkpoints WHERE trial_number = ? ORDER BY step", (trial,))]
    except sqlite3.OperationalError:  # the table does not exist yet
        return []


def pause_outside_a_write(process: subprocess.Popen[str], db: Path) -> None:
    """SIGSTOP `process` at a moment it holds no write transaction on the SQLite file `db`. Stopped inside one (a
    heartbeat, a checkpoint's row), it would keep the file locked against every other worker for as long as it is
    stopped, as any SQLite writer frozen mid-transaction does: that is not the pause this test is about."""
    for _ in range(100):
        process.send_signal(signal.SIGSTOP)
        time.sleep(0.05)  # the signal has landed
        try:
            with contextlib.closing(sqlite3.connect(db, timeout=0)) as probe:
                probe.execute("BEGIN IMMEDIATE")  # refused while another connection holds the write lock
                probe.rollback()
            return
        except sqlite3.OperationalError:
            process.send_signal(signal.SIGCONT)
            time.sleep(0.1)
    pytest.fail("the worker held the database's write lock at every try")


def paused_while_another_worker_runs(path: Path, db: Path, trials: list[int], *args: str) -> tuple[Any, int, str]:
    """Run the study in a worker of its own (`sweep run PATH ARGS`), pause it once `trials` have a checkpoint, for
    longer than the grace period, while another `sweep run` of it runs to its end; then let it go on. Returns the
    other run's result, and the paused worker's exit code and stderr."""
    paused = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(checkpointed_steps(db, n) for n in trials):
            time.sleep(0.2)
        pause_outside_a_write(paused, db)
        time.sleep(3.5)  # past the grace period
        other = sweep_cli("run", path)
        paused.send_signal(signal.SIGCONT)
        _, stderr = paused.communicate(timeout=240)
    finally:
        paused.kill()
    return other, paused.returncode, stderr


def long_study(folder: Path, **keys) -> Path:
    """Trials long enough to be stopped mid-way, with a checkpoint every 100 steps."""
    document = copy.deepcopy(TINY_STUDY) | keys | {
        "checkpoints": {"every_steps": 100, "on_best": False, "keep_top_k": 1}}
    document["fixed"] = {**document["fixed"], "max_steps": 3000, "eval_every_steps": 500, "log_every_steps": 100}
    return write_study(folder, document)


def signal_after_a_checkpoint(path: Path, db: Path, signum: int) -> tuple[int, str]:
    """Run the study in a real worker process and signal it once trial 0 has a checkpoint at step 200 or later."""
    return after_a_checkpoint(path, db, lambda worker: worker.send_signal(signum), timeout=60)


def after_a_checkpoint(path: Path, db: Path, act: Callable[[subprocess.Popen[str]], object],
                       timeout: float) -> tuple[int, str]:
    """Run the study in a real worker process, `act` on it once trial 0 has a checkpoint at step 200 or later, and
    wait up to `timeout` seconds for it to exit: its exit code and stderr."""
    worker = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not [s for s in checkpointed_steps(db, 0) if s >= 200]:
            time.sleep(0.2)
        act(worker)
        _, stderr = worker.communicate(timeout=timeout)
    finally:
        worker.kill()
    return worker.returncode, stderr


def test_a_database_deleted_under_a_run_stops_it_before_a_trial_is_told_into_the_old_file(tmp_path: Path) -> None:
    # Review: after an `rm` of the SQLite file every trial went on being told into the deleted file (its connections
    # still held it) and printed as done, and all were lost; the run ended with "no such table: studies" at last.
    path = long_study(tmp_path, n_trials=3)
    db = tmp_path / "tiny.db"

    def delete(_: object) -> None:
        for name in ("tiny.db", "tiny.db-wal", "tiny.db-shm"):
            (tmp_path / name).unlink(missing_ok=True)

    code, stderr = after_a_checkpoint(path, db, delete, timeout=300)
    assert code == 1, stderr
    assert f"{db}: the study's database was deleted or replaced while this run had it open" in stderr, stderr
    assert "complete value=" not in stderr  # trial 0 was not printed as done, nor was another asked


def test_a_killed_trial_resumes_from_its_checkpoint_not_from_step_0(tmp_path: Path) -> None:
    path = long_study(tmp_path, n_trials=2, heartbeat_interval=1, heartbeat_grace_period=3)
    db = tmp_path / "tiny.db"
    signal_after_a_checkpoint(path, db, signal.SIGKILL)
    saved = max(checkpointed_steps(db, 0))
    assert saved >= 200
    assert optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").trials[0].state == TrialState.RUNNING

    time.sleep(3.5)  # the dead trial's heartbeat goes stale
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()
    dead = trials[0]
    assert dead.state == TrialState.FAIL
    [retry] = [t for t in trials if t.user_attrs.get("retry_of") == 0]
    assert retry.state == TrialState.COMPLETE and retry.params == dead.params
    resumed_at = retry.user_attrs["resumed_from"]["step"]
    assert resumed_at >= saved  # the latest checkpoint (a later one may have landed as the kill arrived)
    assert min(retry.intermediate_values) > 0  # it did not start over
    assert retry.user_attrs["steps"] == 3000
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 2
    with sqlite3.connect(db) as connection:  # the lost trial's checkpoints ended with it: donors, and collectable
        assert connection.execute("SELECT count(*) FROM sweep_checkpoints WHERE final = 0").fetchone() == (0,)


def test_a_retry_resumed_under_another_pruner_reproduces_and_its_lost_trial_says_what_was_compared(
        tmp_path: Path) -> None:
    # The lineage ran with fast-fail (an evaluation at step 0); the study is resumed with median alone, which the
    # README allows. The retry's curve starts with the lineage's step-0 value, which its own config does not make:
    # reproduce compares what the replay reports, and finds the retry exact.
    path = long_study(tmp_path, n_trials=1, heartbeat_interval=1, heartbeat_grace_period=3, pruner="fastfail")
    db = tmp_path / "tiny.db"
    signal_after_a_checkpoint(path, db, signal.SIGKILL)
    time.sleep(3.5)  # the dead trial's heartbeat goes stale
    document = yaml.safe_load(path.read_text()) | {"pruner": {"type": "median"}}
    write_study(tmp_path, document)
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    dead, retry = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()
    assert dead.user_attrs["outcome"] == "lost"
    assert retry.user_attrs["retry_of"] == 0 and 0 in retry.intermediate_values
    assert retry.user_attrs["config"]["fast_fail"]["enabled"] is False
    again = sweep_cli("reproduce", path, "1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"trial 1 reproduced: {len(retry.intermediate_values) - 1} reported values identical (bit for bit)" \
        in again.stdout, again.stdout
    lost = sweep_cli("reproduce", path, "0")
    assert lost.returncode == 0, lost.stdout + lost.stderr
    assert "trial 0 ended lost: only the values it reported before it ended were compared" in lost.stdout, lost.stdout


def test_a_worker_paused_past_the_grace_period_goes_on_when_its_trial_was_declared_lost(tmp_path: Path) -> None:
    # A paused VM or a storage outage: another worker fails the silent trial and queues its retry; when the paused
    # worker comes back and reports its trial, Optuna refuses to update a finished trial. That must not kill it.
    path = long_study(tmp_path, n_trials=2, heartbeat_interval=1, heartbeat_grace_period=2)
    db = tmp_path / "tiny.db"
    other, code, stderr = paused_while_another_worker_runs(path, db, [0])  # it fails trial 0 as lost, trains its
    assert other.returncode == 0, other.stderr  # retry and trial 1 or its own
    assert code == 0, stderr
    assert "trial 0 was declared lost while this worker trained it" in stderr
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()
    [retry] = [t for t in trials if t.user_attrs.get("retry_of") == 0]
    assert trials[0].state == TrialState.FAIL and retry.user_attrs["retry_reason"] == "worker lost: no heartbeat"
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 2
    listed = sweep_cli("trials", path, "--format", "csv").stdout
    # Its outcome, not "failed" (the config's fault): lost, as the README's state table says.
    assert "lost: worker lost: no heartbeat" in listed and "failed: worker" not in listed \
        and "unknown error" not in listed
    report = sweep_cli("report", path, "--output", str(tmp_path / "report.html"))
    assert report.returncode == 0, report.stderr
    assert "0 of 2 finished trials (0%) diverged or failed" in (tmp_path / "report.html").read_text()  # its retry
    # stands in for it
    # What the paused worker saved after it came back is released like the rest of its lineage: no row is left as a
    # running trial's, which retention would never collect.
    with sqlite3.connect(db) as connection:
        rows = connection.execute("SELECT trial_number, step, final FROM sweep_checkpoints").fetchall()
    assert rows and not [row for row in rows if row[2] == 0], rows


def test_a_paused_cohort_s_checkpoints_after_its_members_were_declared_lost_are_released(tmp_path: Path) -> None:
    # Found by fault injection: a cohort worker paused until the members' retries had finished (elsewhere) saved and
    # registered one more stretch's checkpoints when it came back, before it learnt its reports were refused. Those
    # rows stayed as a running trial's (final=0) for good: retention never collected them.
    path = long_study(tmp_path, n_trials=2, heartbeat_interval=1, heartbeat_grace_period=2)
    db = tmp_path / "tiny.db"
    other, code, stderr = paused_while_another_worker_runs(path, db, [0, 1], "--cohort", "2")  # it fails both
    assert other.returncode == 0, other.stderr  # members as lost and trains their retries to the end
    assert code == 0, stderr
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()
    assert [t.state for t in trials[:2]] == [TrialState.FAIL] * 2
    assert sorted(t.user_attrs.get("retry_of") for t in trials[2:]) == [0, 1]
    assert [t.state for t in trials[2:]] == [TrialState.COMPLETE] * 2
    with sqlite3.connect(db) as connection:
        rows = connection.execute("SELECT trial_number, step, final FROM sweep_checkpoints").fetchall()
    assert rows and not [row for row in rows if row[2] == 0], rows


def test_a_preempted_worker_queues_its_trial_which_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    path = long_study(tmp_path, n_trials=1)
    db = tmp_path / "tiny.db"
    # SIGTERM: what a scheduler sends before it takes the machine back
    returncode, stderr = signal_after_a_checkpoint(path, db, signal.SIGTERM)
    assert returncode == 143, stderr
    assert "preempted" in stderr
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()
    assert trials[0].state == TrialState.FAIL and trials[0].user_attrs["fail_reason"] == "preempted (SIGTERM)"
    assert trials[1].state == TrialState.WAITING and trials[1].user_attrs["retry_of"] == 0

    done = sweep_cli("run", path)  # no heartbeat to wait for: the trial was handed back, not lost
    assert done.returncode == 0, done.stderr
    retry = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()[1]
    assert retry.state == TrialState.COMPLETE and retry.params == trials[0].params
    assert retry.user_attrs["resumed_from"]["step"] >= 200 and min(retry.intermediate_values) > 0


def test_a_resume_point_whose_file_is_gone_is_said_and_the_retry_starts_over(tmp_path: Path) -> None:
    # Review: a checkpoint file deleted by hand (its row intact) was dropped from the registry with no word, and its
    # trial's retry trained from step 0; a damaged one was warned of.
    path = long_study(tmp_path, n_trials=1)
    db = tmp_path / "tiny.db"
    assert signal_after_a_checkpoint(path, db, signal.SIGTERM)[0] == 143
    files = sorted((tmp_path / "tiny.checkpoints" / "tiny").glob("trial00000-*.pt"))
    assert files
    for file in files:
        file.unlink()
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    n = len(files)
    assert f"warning: {n} checkpoint{'s' if n > 1 else ''} whose file is gone {'were' if n > 1 else 'was'} dropped " \
           "from the registry (checkpoint " in done.stderr, done.stderr
    assert "resumes from an older one or starts over" in done.stderr and str(files[-1]) in done.stderr, done.stderr
    retry = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()[1]
    assert retry.state == TrialState.COMPLETE and "resumed_from" not in retry.user_attrs


FLAKY_TASK = """
from pathlib import Path

from trainer.tasks import load_task

CALLS = Path(__file__).with_name("calls.txt")


def flaky_digits(**args):
    # 1st call: the study file's check; 2nd: trial 0 loses its (pretend) data server; 3rd: its retry meets a
    # config error; then fine.
    calls = len(CALLS.read_text()) if CALLS.exists() else 0
    CALLS.write_text("x" * (calls + 1))
    if calls == 1:
        raise ConnectionError("data server went away")
    if calls == 2:
        raise ValueError("this config cannot work")
    return load_task("digits", args)
"""


def test_retryable_errors_are_retried_and_config_errors_are_not(tmp_path: Path) -> None:
    (tmp_path / "flaky_tasks.py").write_text(FLAKY_TASK)
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 2, "task": "flaky_tasks:flaky_digits"}
    path = write_study(tmp_path, document)
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.FAIL, TrialState.COMPLETE]
    lost, broken, _ = trials
    assert "ConnectionError" in lost.user_attrs["fail_reason"]
    assert lost.user_attrs["outcome"] == "infrastructure" and broken.user_attrs["outcome"] == "failed"
    assert broken.user_attrs["retry_of"] == 0 and broken.params == lost.params  # retried: not the config's fault
    assert broken.user_attrs["retry_reason"].startswith("infrastructure: lost connection")
    assert "ValueError" in broken.user_attrs["fail_reason"]
    assert not [t for t in trials if t.user_attrs.get("retry_of") == 1]  # a config error is final


@pytest.mark.timeout(90)  # it used to wait forever: fail instead
def test_a_trial_orphaned_before_its_first_heartbeat_is_retried_not_waited_for(tmp_path: Path) -> None:
    # Ctrl-C while the sampler ran inside ask(): the trial is RUNNING and has never beaten. Optuna's stale check
    # only sees trials that beat once, so `sweep run` used to wait for it forever.
    from sweep.spec import load_spec
    from sweep.study import open_study

    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 2, "heartbeat_interval": 1, "heartbeat_grace_period": 2}
    path = write_study(tmp_path, document)
    db = tmp_path / "tiny.db"
    orphan = open_study(load_spec(path)[0], f"sqlite:///{db}").ask()  # never beats, never told
    time.sleep(2.5)  # older than the grace period
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()
    assert trials[orphan.number].state == TrialState.FAIL
    assert [t.user_attrs["retry_reason"] for t in trials if t.user_attrs.get("retry_of") == orphan.number] == \
        ["worker lost: no heartbeat"]
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 2


def test_a_trial_whose_worker_died_between_its_end_and_its_retry_is_queued_by_the_next_worker(tmp_path: Path) -> None:
    # Storing a trial's end and queuing its retry are two writes; a SIGKILL between them used to leave a failed trial
    # with no retry, counted against the budget and never trained. (Failing a lost trial and writing why are one
    # transaction now: a failed trial of sweep's with no reason was told FAIL from outside, and stays failed.)
    from sweep.spec import load_spec
    from sweep.study import open_study

    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 3, "heartbeat_interval": 1, "heartbeat_grace_period": 2}
    path = write_study(tmp_path, document)
    db = tmp_path / "tiny.db"
    study = open_study(load_spec(path)[0], f"sqlite:///{db}")
    preempted = study.ask()  # its worker told it preempted, then died before queuing the retry
    for key, value in {"outcome": "preempted", "fail_reason": "preempted (SIGTERM)", "interrupted": True}.items():
        preempted.set_user_attr(key, value)
    study.tell(preempted, state=TrialState.FAIL)
    told = study.ask()  # training (its config written), its worker dead, told FAIL from outside: a person's decision
    told.set_user_attr("config", {})
    study.tell(told, state=TrialState.FAIL)
    half = study.ask()  # failed as lost by an older sweep's worker (its reason, not its outcome), which then died
    half.set_user_attr("fail_reason", "worker lost: no heartbeat")
    study.tell(half, state=TrialState.FAIL)
    # Rerun at once: younger than the grace period, their retries may still be on the way (from a live worker), so
    # the run counts them as running and waits, instead of finding the budget spent; then it queues them itself.
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    trials = optuna.load_study(study_name="tiny", storage=f"sqlite:///{db}").get_trials()
    retries = {t.user_attrs["retry_of"]: t for t in trials if "retry_of" in t.user_attrs}
    assert sorted(retries) == [preempted.number, half.number]
    assert retries[preempted.number].user_attrs["retry_reason"] == "preempted (SIGTERM)"
    assert retries[half.number].user_attrs["retry_reason"] == "worker lost: no heartbeat"
    assert trials[half.number].user_attrs["outcome"] == "lost"
    assert "outcome" not in trials[told.number].user_attrs  # left as it was told: failed, counted
    assert budget_counts(trials) == (3, 0)  # the budget, exactly: the told trial and the two retries
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 2 and len(trials) == 5



def test_a_worker_with_a_shorter_grace_period_judges_another_s_trial_by_that_worker_s_own(tmp_path: Path) -> None:
    # Found by review: a rerun of an edited study file (heartbeat_interval 2, heartbeat_grace_period 5) failed the
    # live trial of a worker still running the old file (beats every 10 s, grace 60) as lost, and trained it twice.
    from sweep.spec import parse_spec
    from sweep.study import open_study
    from sweep.worker import Beats, Worker

    db = tmp_path / "tiny.db"
    url = f"sqlite:///{db}"
    old = parse_spec(copy.deepcopy(TINY_STUDY) | {"heartbeat_interval": 30, "heartbeat_grace_period": 120}, "a.yaml")
    edited = parse_spec(copy.deepcopy(TINY_STUDY) | {"heartbeat_interval": 1, "heartbeat_grace_period": 2}, "b.yaml")
    running = open_study(old, url)
    trial = running.ask()
    Beats(running._storage).add(trial)

    def silent_for(seconds: int) -> None:  # its last beat that long ago, by the database's clock
        with contextlib.closing(sqlite3.connect(db)) as connection, connection:
            connection.execute("UPDATE trial_heartbeats SET heartbeat = datetime('now', ?)", (f"-{seconds} seconds",))

    judge_study = open_study(edited, url)
    judge = Worker(judge_study, edited, storage_url=url, boundary=judge_study._storage.boundary)
    silent_for(10)  # within its own worker's 120 s: alive
    judge._fail_lost_trials()
    assert optuna.load_study(study_name="tiny", storage=url).trials[0].state == TrialState.RUNNING
    silent_for(130)  # past it: lost, and queued again
    judge._fail_lost_trials()
    lost, retry = optuna.load_study(study_name="tiny", storage=url).trials
    assert lost.state == TrialState.FAIL and lost.user_attrs["outcome"] == "lost"
    assert retry.state == TrialState.WAITING and retry.user_attrs["retry_of"] == 0


def test_a_run_refused_for_a_folder_another_study_owns_stores_none_of_its_edits(tmp_path: Path) -> None:
    """Edits review: a rerun refused (exit 2) because its TensorBoard folder holds the runs of another study of the
    same name had already stored its definition: the budget, sampler and tracking the user never ran, and `sweep
    tensorboard` then served the other study's runs as this one's."""
    pytest.importorskip("tensorboard")
    mine = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 1})
    assert sweep_cli("run", mine).returncode == 0
    other_folder = tmp_path / "other"
    other_folder.mkdir()
    other = write_study(other_folder, copy.deepcopy(TINY_STUDY) | {
        "n_trials": 1, "tracking": {"tensorboard": {"dir": str(tmp_path / "tb")}}})
    assert sweep_cli("run", other).returncode == 0  # its study, also named 'tiny', owns tb/tiny
    stored = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").user_attrs
    done = sweep_cli("run", mine, "--set", "n_trials=50", "--set", "sampler=qmc",
                     "--set", f"tracking.tensorboard={{dir: {tmp_path / 'tb'}}}")
    assert done.returncode == 2, done.stderr
    assert "tracking.tensorboard.dir: the TensorBoard folder" in done.stderr, done.stderr
    after = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}").user_attrs
    assert after == stored  # its definition as the last run that ran stored it


def test_a_loop_study_s_value_written_as_another_type_is_a_changed_definition(tmp_path: Path) -> None:
    """Edits review: `flag: 1` edited to `flag: true` (and choices [0, 1] to [false, true]) passed as the same
    definition, as Python's == has them, and the study's later trials got `true` where its first got `1`."""
    (tmp_path / "flagged.py").write_text("def main(config, run):\n    return float(config['opt'])\n")
    document = {"name": "flagged", "n_trials": 2, "sampler": "random", "pruner": "none", "checkpoints": False,
                "loop": "flagged:main", "fixed": {"max_steps": 3, "flag": 1, "rate": 1},
                "space": {"opt": {"type": "categorical", "choices": [0, 1]}}}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 0
    for edit in ({"fixed": {"max_steps": 3, "flag": True, "rate": 1}},
                 {"fixed": {"max_steps": 3, "flag": 1, "rate": 1.0}},
                 {"space": {"opt": {"type": "categorical", "choices": [False, True]}}}):
        write_study(tmp_path, document | edit | {"n_trials": 4})
        done = sweep_cli("run", path, pythonpath=tmp_path)
        assert done.returncode == 2, (edit, done.stderr)
        assert "already exists with a different" in done.stderr, done.stderr
    write_study(tmp_path, document | {"n_trials": 4})  # as it was, with more trials: taken
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
