"""`sweep submit --slurm` on a real single-node Slurm 22.05 (tests/slurm.py) with the suite's PostgreSQL as the
storage: exact counts, no password anywhere Slurm keeps things, preemption and requeue, `sweep stop` and `sweep
status`. Each test prints its timeline (pytest -s)."""

from __future__ import annotations

import copy
import re
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.trial import FrozenTrial, TrialState

from sweep.launch import slurm
from sweep.urls import mask_url
from tests.conftest import TINY_STUDY, sweep_cli, write_study
from tests.slurm import SlurmCluster

pytestmark = pytest.mark.slow

PASSWORD = "pw-Zq81x-never-shown"  # trust authentication: the server never asks for it, but it is in the URL
LIBPQ_PASSWORD = "libpq-Kd93-never-shown"  # PGPASSWORD in the submitting shell: it must not reach Slurm either


class Timeline:
    def __init__(self, title: str) -> None:
        self.start, self.title = time.monotonic(), title
        print(f"\n{title}")

    def __call__(self, event: str) -> None:
        print(f"  {time.monotonic() - self.start:6.1f} s  {event}")


def wait_for(condition: Callable[[], Any], what: str, seen: Callable[[], object], patience_s: float = 300) -> Any:
    """Poll `condition` until it is true; fail with what was last seen after a generous deadline."""
    deadline = time.monotonic() + patience_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {patience_s:g} s; last seen: {seen()}")
        time.sleep(0.5)
    return result


def study_file(folder: Path, name: str, n_trials: int, checkpoint_every: int | None = None, **fixed: Any) -> Path:
    checkpoints = {"store": str(folder / "checkpoints"), "every_steps": checkpoint_every}
    document = copy.deepcopy(TINY_STUDY) | {"name": name, "n_trials": n_trials,
                                            "checkpoints": {k: v for k, v in checkpoints.items() if v is not None}}
    document["fixed"] = {**document["fixed"], **fixed}
    return write_study(folder, document)


def url_with_password(postgres_url: str) -> str:
    return postgres_url.replace("postgres@", f"postgres:{PASSWORD}@", 1)


def submit(cluster: SlurmCluster, path: Path, url: str, *args: str) -> str:
    done = sweep_cli("submit", path, "--slurm", "--storage", url, *args, cwd=path.parent,
                     env={"SLURM_CONF": str(cluster.conf), "PGPASSWORD": LIBPQ_PASSWORD})
    assert done.returncode == 0, done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    return done.stdout.strip()


def tasks(cluster: SlurmCluster, job: str) -> dict[str, dict[str, str]]:
    """Slurm's view of each array task: {task id: scontrol's fields}."""
    done = cluster.run("scontrol", "show", "job", "--oneliner", job, check=False)
    records = [dict(re.findall(r"(\w[\w/:]*)=(\S*)", line)) for line in done.stdout.splitlines() if line.strip()]
    return {record.get("ArrayTaskId", "?"): record for record in records}


def states(cluster: SlurmCluster, job: str) -> dict[str, str]:
    return {task: f"{record['JobState']} restarts={record['Restarts']}" for task, record in tasks(cluster, job).items()}


def finished(cluster: SlurmCluster, job: str) -> bool:
    found = tasks(cluster, job)
    return bool(found) and all(r["JobState"] in ("COMPLETED", "FAILED", "CANCELLED") for r in found.values())


def load(url: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=url)


def slurm_status(cluster: SlurmCluster, path: Path, url: str) -> str:
    done = sweep_cli("status", path, "--storage", url, env={"SLURM_CONF": str(cluster.conf)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def files_holding(folder: Path, secret: str) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file() and secret.encode() in path.read_bytes()]


def test_submitted_workers_finish_the_study_with_exact_counts_and_no_password_in_slurm(
        tmp_path: Path, postgres_url: str, slurm_cluster: SlurmCluster) -> None:
    url, name = url_with_password(postgres_url), "slurm_counts"
    path = study_file(tmp_path, name, 6)
    log = Timeline("3 workers, 6 trials")
    job = submit(slurm_cluster, path, url, "--workers", "3")
    log(f"submitted job array {job}")
    wait_for(lambda: all(r["JobState"] == "RUNNING" for r in tasks(slurm_cluster, job).values())
             and len(tasks(slurm_cluster, job)) == 3, "3 running tasks", lambda: states(slurm_cluster, job))
    log("3 array tasks running")
    # What Slurm keeps while the job runs: the submitting environment and the script in its state folder, `scontrol
    # show job`, the logs. (The environment is sbatch's whole one: SLURM_CONF came from the test's.)
    environments = list((slurm_cluster.folder / "state").rglob("environment"))
    assert environments and all(b"SLURM_CONF=" in p.read_bytes() for p in environments)
    shown = slurm_cluster.run("scontrol", "show", "job", "-dd", job).stdout
    script = slurm_cluster.run("scontrol", "write", "batch_script", f"{job}_0", "-").stdout
    assert "-m sweep run" in script and "SWEEP_STORAGE_URL_FILE" in script
    for secret in (PASSWORD, LIBPQ_PASSWORD):
        assert secret not in shown and secret not in script
        assert files_holding(slurm_cluster.folder, secret) == []  # state, spool, daemon logs
    wait_for(lambda: finished(slurm_cluster, job), "finished job", lambda: states(slurm_cluster, job))
    log("every array task finished")

    assert {r["JobState"] for r in tasks(slurm_cluster, job).values()} == {"COMPLETED"}
    assert optuna.get_all_study_names(url).count(name) == 1  # created once, before the submission
    trials = load(url, name).get_trials()
    assert sorted(t.number for t in trials) == list(range(6))  # exactly the budget, unique numbers, none lost
    assert all(t.state == TrialState.COMPLETE for t in trials)
    job_folder = tmp_path / f"{name}.slurm"
    logs = sorted(job_folder.glob(f"{job}_*.log"))
    assert len(logs) == 3
    storage_file = slurm.storage_file(job_folder, name, url)
    assert files_holding(job_folder, PASSWORD) == [storage_file]  # the one owner-only file
    assert files_holding(job_folder, LIBPQ_PASSWORD) == [storage_file]
    assert storage_file.stat().st_mode & 0o077 == 0
    assert files_holding(slurm_cluster.folder, PASSWORD) == []
    status = slurm_status(slurm_cluster, path, url)
    assert re.search(r"budget\s+│\s+6/6 trials", status) and "Slurm workers: done 3" in status
    assert all(str(path) in status for path in logs)  # where each worker's log is
    log(f"status: 6/6 trials complete, {len(logs)} logs, no password in Slurm's records")


def preempted(trial: FrozenTrial) -> bool:
    return trial.user_attrs.get("outcome") == "preempted"


STEPS = 2000


def test_a_requeued_task_and_a_warned_task_continue_the_study_and_resume_their_trials(
        tmp_path: Path, postgres_url: str, slurm_cluster: SlurmCluster) -> None:
    url, name = url_with_password(postgres_url), "slurm_preempt"
    # Trials long enough to be caught in the middle on a loaded machine, with a checkpoint every 50 steps.
    path = study_file(tmp_path, name, 2, checkpoint_every=50, max_steps=STEPS, eval_every_steps=50,
                      log_every_steps=50)
    log = Timeline("2 workers, 2 trials; one task requeued (scontrol requeuehold), one warned (scancel --signal USR1)")
    job = submit(slurm_cluster, path, url, "--workers", "2")
    log(f"submitted job array {job}")

    def both_past_a_checkpoint() -> bool:
        try:
            running = [t for t in load(url, name).get_trials() if t.state == TrialState.RUNNING]
        except KeyError:
            return False
        return len(running) == 2 and all(max(t.intermediate_values, default=0) >= 100 for t in running)

    wait_for(both_past_a_checkpoint, "2 running trials past step 100",
             lambda: [(t.number, t.state, sorted(t.intermediate_values)) for t in load(url, name).get_trials()])
    log("both trials past step 100")
    # As preemption with PreemptMode=REQUEUE (SIGTERM now), held in the queue so that the test sees it there.
    slurm_cluster.run("scontrol", "requeuehold", f"{job}_0")
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", f"{job}_1")  # the --signal warning before a time limit
    log("requeued task 0, sent task 1 the warning signal")

    def both_requeued_and_held() -> bool:
        """Task 1 requeues itself; it is held once seen queued (Slurm starts a requeued job only when its old
        credential has expired, tests/slurm.py: 20 s to do this)."""
        found = tasks(slurm_cluster, job)
        for task, record in found.items():
            if record["JobState"] == "PENDING" and record["Restarts"] == "1" and record["Priority"] != "0":
                slurm_cluster.run("scontrol", "hold", f"{job}_{task}")
        return len(found) == 2 and all(r["JobState"] == "PENDING" and r["Restarts"] == "1" and r["Priority"] == "0"
                                       for r in found.values())

    wait_for(both_requeued_and_held, "2 requeued tasks", lambda: states(slurm_cluster, job))
    log("both tasks back in the queue (Restarts=1), held")
    trials = load(url, name).get_trials()
    assert sum(preempted(t) for t in trials) == 2, [(t.number, t.state, t.user_attrs) for t in trials]
    status = slurm_status(slurm_cluster, path, url)
    assert "requeued 2" in status
    for task in ("0", "1"):
        slurm_cluster.run("scontrol", "release", f"{job}_{task}")
    wait_for(lambda: finished(slurm_cluster, job), "finished job", lambda: states(slurm_cluster, job))
    log("every array task finished")

    logs = "".join(f"--- {p.name}\n{p.read_text()}" for p in sorted((tmp_path / f"{name}.slurm").glob(f"{job}_*.log")))
    found = tasks(slurm_cluster, job)
    assert {(r["JobState"], r["Restarts"]) for r in found.values()} == {("COMPLETED", "1")}, (
        f"{[(k, r['JobState'], r['ExitCode'], r.get('Reason')) for k, r in found.items()]}\n{logs}"
        f"{slurm_cluster.log_tail(chars=6000)}")
    trials = load(url, name).get_trials()
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    stopped = [t for t in trials if preempted(t)]
    assert len(done) == 2 and len(stopped) == 2 and len(trials) == 4, [(t.number, t.state) for t in trials]
    for trial in stopped:  # no trial lost: each preempted one was trained again from its checkpoint
        [retry] = [t for t in done if t.user_attrs.get("retry_of") == trial.number]
        assert retry.params == trial.params
        resumed = retry.user_attrs["resumed_from"]
        assert resumed["trial"] == trial.number and resumed["step"] >= 100
        assert sorted(retry.intermediate_values)[-1] == STEPS
        log(f"trial {trial.number} preempted at step {max(trial.intermediate_values)}; retry {retry.number} "
            f"resumed from step {resumed['step']} and completed")
    assert logs.count("preempted (SIGTERM)") == 2 and PASSWORD not in logs


def test_stop_cancels_queued_tasks_and_lets_the_running_one_finish_its_trial(
        tmp_path: Path, postgres_url: str, slurm_cluster: SlurmCluster) -> None:
    url, name = url_with_password(postgres_url), "slurm_stop"
    path = study_file(tmp_path, name, 50, max_steps=100, eval_every_steps=50, log_every_steps=50)
    log = Timeline("3 tasks of 8 CPUs on an 8-CPU node: one runs, two wait; then sweep stop")
    job = submit(slurm_cluster, path, url, "--workers", "3", "--cpus-per-task", "8")
    wait_for(lambda: any(t.state == TrialState.COMPLETE for t in load(url, name).get_trials())
             if name in optuna.get_all_study_names(url) else False, "a complete trial",
             lambda: states(slurm_cluster, job))
    found = tasks(slurm_cluster, job)
    assert [r["JobState"] for r in found.values()].count("PENDING") >= 1, states(slurm_cluster, job)
    log(f"one task running, queued: {states(slurm_cluster, job)}")
    done = sweep_cli("stop", path, "--storage", url, env={"SLURM_CONF": str(slurm_cluster.conf)})
    assert done.returncode == 0, done.stderr
    assert f"cancelled the queued array tasks of Slurm job {job}" in done.stderr
    log("sweep stop")
    wait_for(lambda: finished(slurm_cluster, job), "finished job", lambda: states(slurm_cluster, job))
    log(f"job over: {states(slurm_cluster, job)}")
    found = tasks(slurm_cluster, job)  # the cancelled tasks are one record (Slurm drops their ids)
    assert sorted(r["JobState"] for r in found.values()) == ["CANCELLED", "COMPLETED"]
    [ran] = [r for r in found.values() if r["JobState"] == "COMPLETED"]
    assert ran["ExitCode"] == "0:0"  # it finished its trial and exited on the stop request
    trials = load(url, name).get_trials()
    assert trials and all(t.state == TrialState.COMPLETE for t in trials)  # nothing cut off, nothing lost
    assert len(trials) < 50
    assert "cancelled 2" in slurm_status(slurm_cluster, path, url)


def test_a_worker_that_cannot_start_is_shown_in_status_with_its_log(
        tmp_path: Path, postgres_url: str, slurm_cluster: SlurmCluster) -> None:
    url, name = url_with_password(postgres_url), "slurm_broken"
    path = study_file(tmp_path, name, 2)
    job = submit(slurm_cluster, path, url, "--workers", "1", "--sbatch=--hold")
    slurm.storage_file(tmp_path / f"{name}.slurm", name, url).unlink()  # as on a node that does not see the folder
    slurm_cluster.run("scontrol", "release", job)
    wait_for(lambda: finished(slurm_cluster, job), "finished job", lambda: states(slurm_cluster, job))
    status = slurm_status(slurm_cluster, path, url)
    assert "Slurm workers: failed 1" in status
    assert f"{job}_0 failed; the end of {tmp_path / f'{name}.slurm' / f'{job}_0.log'}:" in status
    assert "cannot read the storage URL its launcher left" in status  # the log's last lines, here


def test_a_log_folder_with_a_space_and_an_sbatch_value_with_words_reach_slurm_as_given(
        tmp_path: Path, postgres_url: str, slurm_cluster: SlurmCluster) -> None:
    """sbatch splits an `#SBATCH` line at whitespace and ends it at `#`: unquoted, a study folder with a space made
    sbatch refuse the job ("Invalid directive found in batch script: ace"), and a checked --sbatch value of two
    words did the same. A pasted directive's own comment stays one, and two spaces after an option's name go."""
    folder = tmp_path / "sp ace"
    folder.mkdir()
    url, name = url_with_password(postgres_url), "slurm_spaces"
    study_file(folder, name, 1)
    done = sweep_cli("submit", "sp ace/study.yaml", "--slurm", "--storage", url, "--workers", "1", "--sbatch=--hold",
                     "--sbatch=--comment=it's two words, issue#1 \"quoted\"",
                     "--sbatch=#SBATCH --nice=10   # lower priority", "--sbatch=--tmp  100", cwd=tmp_path,
                     env={"SLURM_CONF": str(slurm_cluster.conf), "PGPASSWORD": LIBPQ_PASSWORD})
    assert done.returncode == 0 and PASSWORD not in done.stdout + done.stderr, done.stderr
    job = done.stdout.strip()
    try:
        # The status command it names works from where it was typed (it said `sweep status study.yaml`), once the
        # password it masks is put back (it said nothing of the mask).
        assert (f"`sweep status 'sp ace/study.yaml' --storage {shlex.quote(mask_url(url))}` shows them (with the "
                "storage's password where it shows ***)") in done.stderr, done.stderr
        status = sweep_cli("status", "sp ace/study.yaml", "--storage", url, cwd=tmp_path)
        assert status.returncode == 0 and name in status.stdout, status.stderr
        shown = slurm_cluster.run("scontrol", "show", "job", job).stdout
        for field in ('Comment=it\'s two words, issue#1 "quoted"', "Nice=10 ", "MinTmpDiskNode=100M"):
            assert field in shown, shown
        assert f"StdOut={folder / f'{name}.slurm'}/" in shown, shown  # the folder with its space
        # The storage and the name given by --set are in it too (review: it named the file's, another study).
        other = sweep_cli("submit", "sp ace/study.yaml", "--slurm", "--set", f"storage={url}", "--set",
                          "name=slurm_spaces_set", "--workers", "1", "--sbatch=--hold", cwd=tmp_path,
                          env={"SLURM_CONF": str(slurm_cluster.conf), "PGPASSWORD": LIBPQ_PASSWORD})
        assert other.returncode == 0, other.stderr
        assert (f"`sweep status 'sp ace/study.yaml' --storage {shlex.quote(mask_url(url))} --study-name "
                "slurm_spaces_set` shows them") in other.stderr, other.stderr
        status = sweep_cli("status", "sp ace/study.yaml", "--storage", url, "--study-name", "slurm_spaces_set",
                           cwd=tmp_path)
        assert status.returncode == 0 and "slurm_spaces_set" in status.stdout, status.stderr
    finally:
        slurm_cluster.run("scancel", job, check=False)
        if "other" in locals() and other.stdout.strip():
            slurm_cluster.run("scancel", other.stdout.strip(), check=False)


@pytest.mark.parametrize("store", ["given", "default"])
def test_a_job_sbatch_refuses_leaves_nothing_behind(tmp_path: Path, slurm_cluster: SlurmCluster, store: str) -> None:
    """sbatch refuses the job (a partition the cluster does not have): exit 1 with sbatch's reason, and what the
    submit made for it goes again (the new SQLite study, its checkpoint folder, the job's folder with its storage
    file and script), so a corrected submit starts afresh. A folder that was there before stays. The default
    checkpoint folder beside the SQLite file was left behind, with the refused study's owner file (review)."""
    path = study_file(tmp_path, "slurm_refused", 2)
    if store == "default":
        document = yaml.safe_load(path.read_text())
        del document["checkpoints"]["store"]
        write_study(tmp_path, document)
    (tmp_path / "keep").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    done = sweep_cli("submit", path, "--slurm", "--partition", "nosuchpartition", "--set", "tracking.tensorboard=true",
                     cwd=tmp_path, env={"SLURM_CONF": str(slurm_cluster.conf)})
    assert done.returncode == 1, done.stderr
    assert "error: sbatch refused the job" in done.stderr and "artition" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    # The corrected submit starts afresh: nothing of the refused one (TensorBoard's folder claimed for the study it
    # made, say) stands in its way.
    done = sweep_cli("submit", path, "--slurm", "--sbatch=--hold", "--set", "tracking.tensorboard=true", cwd=tmp_path,
                     env={"SLURM_CONF": str(slurm_cluster.conf)})
    assert done.returncode == 0, done.stderr
    slurm_cluster.run("scancel", done.stdout.strip(), check=False)


def test_a_controller_that_does_not_answer_is_one_line_for_submit_status_and_stop(
        tmp_path: Path, slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: a hung sbatch ended `sweep submit` with a traceback (subprocess.TimeoutExpired) and left the new
    study's files behind; a hung scancel did the same to `sweep stop`, and a hung scontrol made `sweep status` blame
    the database. Each is one line naming the Slurm command, and a submit leaves nothing behind."""
    monkeypatch.setattr(slurm, "SBATCH_TIMEOUT_S", 3.0)
    monkeypatch.setattr(slurm, "QUERY_TIMEOUT_S", 3.0)
    env = {"SLURM_CONF": str(slurm_cluster.conf)}
    path = study_file(tmp_path, "slurm_hung", 2)
    before = sorted(p.name for p in tmp_path.iterdir())
    with slurm_cluster.controller_paused():
        done = sweep_cli("submit", path, "--slurm", cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr
    assert "sbatch did not answer within 3 s" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    done = sweep_cli("submit", path, "--slurm", "--sbatch=--hold", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip()
    try:
        with slurm_cluster.controller_paused():
            status = sweep_cli("status", path, cwd=tmp_path, env=env)
            stop = sweep_cli("stop", path, cwd=tmp_path, env=env)
        assert status.returncode == 0, status.stderr
        assert "note: the study has Slurm jobs, but scontrol did not answer within 3 s" in status.stderr, \
            status.stderr
        assert stop.returncode == 1, stop.stderr
        assert "error: could not cancel the queued Slurm tasks: scancel did not answer within 3 s" in stop.stderr, \
            stop.stderr
        assert "Traceback" not in status.stderr + stop.stderr
    finally:
        slurm_cluster.run("scancel", job, check=False)


def test_an_sbatch_that_submits_nothing_is_an_error_not_a_job(tmp_path: Path, slurm_cluster: SlurmCluster,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: with `--test-only` sbatch exits 0 and prints no job id; the study recorded an empty one, and `sweep
    status` (`scontrol show job ""`) listed every job of the cluster as the study's. Such options are refused before
    anything is made; a submit that still gets no job id says so."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    script = "#!/bin/bash\n#SBATCH --test-only\n#SBATCH --output=/dev/null\ntrue\n"
    with pytest.raises(slurm.SlurmError, match="sbatch submitted no job"):
        slurm.submit(script, f"sqlite:///{tmp_path / 'x.db'}", tmp_path / "job", study_name="nothing",
                     workdir=tmp_path)


def test_a_stop_outlasts_a_requeue_after_it(tmp_path: Path, postgres_url: str, slurm_cluster: SlurmCluster) -> None:
    """`sweep stop`, then the running task's time-limit warning: its worker checkpoints the trial and the task requeues
    itself. Started again, it trained on (a worker honoured only the stops given after its own start); now it counts
    the stop from its job's submission and exits at once, leaving the preempted trial for a later `sweep run`."""
    url, name = url_with_password(postgres_url), "slurm_stop_requeue"
    path = study_file(tmp_path, name, 3, checkpoint_every=50, max_steps=STEPS, eval_every_steps=50,
                      log_every_steps=50)
    log = Timeline("1 worker; sweep stop while its trial runs, then the time-limit warning (requeue)")
    job = submit(slurm_cluster, path, url, "--workers", "1")

    def running_past_a_checkpoint() -> bool:
        try:
            return any(t.state == TrialState.RUNNING and max(t.intermediate_values, default=0) >= 100
                       for t in load(url, name).get_trials())
        except KeyError:
            return False

    wait_for(running_past_a_checkpoint, "a running trial past step 100", lambda: states(slurm_cluster, job))
    done = sweep_cli("stop", path, "--storage", url, env={"SLURM_CONF": str(slurm_cluster.conf)})
    assert done.returncode == 0, done.stderr
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", f"{job}_0")
    log("sweep stop, then the warning signal")
    wait_for(lambda: tasks(slurm_cluster, job).get("0", {}).get("Restarts") == "1", "requeued task",
             lambda: states(slurm_cluster, job))
    log("the task requeued itself")
    wait_for(lambda: finished(slurm_cluster, job), "finished job", lambda: states(slurm_cluster, job))
    log(f"job over: {states(slurm_cluster, job)}")
    [record] = tasks(slurm_cluster, job).values()
    text = (tmp_path / f"{name}.slurm" / f"{job}_0.log").read_text()
    assert (record["JobState"], record["Restarts"], record["ExitCode"]) == ("COMPLETED", "1", "0:0"), text
    trials = load(url, name).get_trials()
    # The preempted trial and its retry, queued for the next run: nothing trained after the stop.
    assert [(t.state, preempted(t), t.user_attrs.get("retry_of")) for t in trials] == [
        (TrialState.FAIL, True, None), (TrialState.WAITING, False, 0)], [(t.number, t.state) for t in trials]
    assert text.count("preempted (SIGTERM)") == 1, text
    assert text.rstrip().endswith("[worker 0] stopped by `sweep stop` with 0/3 trials done; the study resumes with "
                                  "the next `sweep run` or `sweep submit`."), text  # why the requeued start ended


def test_a_log_folder_with_quotes_a_percent_and_a_hash_gets_every_task_s_log(
        tmp_path: Path, postgres_url: str, slurm_cluster: SlurmCluster) -> None:
    """sweep's own `--output` went into the script as written when the path held a quote: sbatch's quoting cut it,
    and the task failed with no log anywhere; a `%x` in the path was sbatch's job name."""
    folder = tmp_path / "it's \"%x\" #1"
    folder.mkdir()
    url, name = url_with_password(postgres_url), "slurm_quotes"
    path = study_file(folder, name, 2)
    job = submit(slurm_cluster, path, url, "--workers", "2")
    wait_for(lambda: finished(slurm_cluster, job), "finished job", lambda: states(slurm_cluster, job))
    logs = sorted(p.name for p in (folder / f"{name}.slurm").iterdir() if p.suffix == ".log")
    assert logs == [f"{job}_0.log", f"{job}_1.log"], (logs, slurm_cluster.log_tail(chars=3000))
    assert {r["JobState"] for r in tasks(slurm_cluster, job).values()} == {"COMPLETED"}
    assert sum(t.state == TrialState.COMPLETE for t in load(url, name).get_trials()) == 2
    assert "Slurm workers: done 2" in slurm_status(slurm_cluster, path, url)


def test_status_of_a_job_slurm_has_forgotten_names_each_task_s_log(
        tmp_path: Path, slurm_cluster: SlurmCluster) -> None:
    """Once Slurm forgets a finished job (MinJobAge, 300 s by default) and no accounting remembers it, `sweep status`
    showed one row "no longer known" and no log, though each task's log is in the job's folder."""
    from sweep.outcomes import SLURM_JOBS_ATTR

    path, url = study_file(tmp_path, "forgotten", 1), f"sqlite:///{tmp_path / 'forgotten.db'}"
    done = sweep_cli("run", path, "--storage", url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "forgotten.slurm"
    folder.mkdir()
    job = "987654321"  # never a job of this cluster: `scontrol show job` says "Invalid job id", as for a purged one
    for task in (0, 2):
        (folder / f"{job}_{task}.log").write_text(f"task {task}\n")
    load(url, "forgotten").set_user_attr(SLURM_JOBS_ATTR, [{"job_id": job, "tasks": 3, "log_dir": str(folder),
                                                            "submitted_at": 0.0}])
    status = slurm_status(slurm_cluster, path, url)
    compact = re.sub(r"[\s│]", "", status)  # a long path is folded over lines of the table
    for task in (0, 2):
        assert f"{job}_{task}unknown0{folder / f'{job}_{task}.log'}" in compact, status
    assert f"{job}_1unknown" in compact and "nolog" in compact, status
