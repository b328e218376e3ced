"""Trials larger than one device: `resources.devices_per_trial: 2` on this CPU, gloo, through the real CLI and a
real SQLite file. Each trial starts a child rank, so these are few and marked slow."""

from __future__ import annotations

import copy
import os
import signal
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from tests.conftest import TINY_STUDY, sweep_cli, write_study

pytestmark = pytest.mark.slow


def ddp_study(folder: Path, **extra: Any) -> Path:
    document = copy.deepcopy(TINY_STUDY) | {"name": "ddp", "resources": {"devices_per_trial": 2}, **extra}
    return write_study(folder, document)


def load(folder: Path) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="ddp", storage=f"sqlite:///{folder / 'ddp.db'}").get_trials()


def alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie, dead but not yet reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def rank_children(parent: int) -> list[int]:
    """The `python -m trainer.rank` processes whose parent is `parent`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"trainer.rank" in cmdline:
            found.append(int(entry.name))
    return found


def test_a_study_with_two_ranks_per_trial_finishes_with_exact_counts(tmp_path: Path) -> None:
    path = ddp_study(tmp_path)
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    trials = load(tmp_path)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3, [(t.user_attrs.get("fail_reason"),
                                                                      t.user_attrs.get("ranks")) for t in trials]
    for trial in trials:
        ranks = trial.user_attrs["ranks"]
        assert ranks["world"] == 2
        # Both ranks trained the whole budget; rank 0 reported every evaluation.
        assert [(r["rank"], r["status"], r["steps"]) for r in ranks["ranks"]] == [(0, "completed", 20),
                                                                                (1, "completed", 20)]
        assert sorted(trial.intermediate_values) == [10, 20]
        assert trial.user_attrs["reproducibility"]["ranks"] == 2
        assert len(ranks["pids"]) == 1 and not alive(ranks["pids"][0])  # the child is gone, not orphaned


def test_two_workers_with_two_ranks_each_share_a_study_exactly(tmp_path: Path) -> None:
    from tests.conftest import run_cli

    path = ddp_study(tmp_path, n_trials=4)
    done = run_cli("run", path, "--workers", "2")
    assert done.returncode == 0, done.stderr
    trials = load(tmp_path)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4  # n_trials exact, none lost
    split = str(max(1, (os.cpu_count() or 1) // 4))  # the cores split over 2 workers x 2 ranks, unless set by hand
    assert {t.user_attrs["reproducibility"]["threads"]["OMP_NUM_THREADS"] for t in trials} == {
        os.environ.get("OMP_NUM_THREADS", split)}
    for trial in trials:
        assert [(r["status"], r["steps"]) for r in trial.user_attrs["ranks"]["ranks"]] == [("completed", 20)] * 2
        assert not any(alive(pid) for pid in trial.user_attrs["ranks"]["pids"])


def test_nan_on_one_rank_prunes_the_trial_on_both_at_the_same_step(tmp_path: Path) -> None:
    path = ddp_study(tmp_path, n_trials=1, pruner="fastfail", task={"name": "tests.e2e.ddp_tasks:poisoned",
                                                                    "args": {"rank": 1, "step": 12}},
                     fixed={**TINY_STUDY["fixed"], "max_steps": 40, "log_every_steps": 5})
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    (trial,) = load(tmp_path)
    assert trial.state == TrialState.PRUNED, trial.user_attrs
    reason = trial.user_attrs["prune_reason"]
    ranks = {r["rank"]: (r["status"], r["steps"]) for r in trial.user_attrs["ranks"]["ranks"]}
    # Rank 1's 12th step went NaN; the gradient all-reduce spread it; the guard brought the evaluation forward to the
    # next check (step 15), where rank 0 reported and the pruner pruned; rank 1 stopped there too.
    assert ranks == {0: ("stopped", reason["step"]), 1: ("stopped", reason["step"])}
    assert 12 <= reason["step"] < 20, reason
    assert max(trial.intermediate_values) == reason["step"]


def test_a_rank_that_fails_on_its_own_fails_the_trial_without_a_retry(tmp_path: Path) -> None:
    path = ddp_study(tmp_path, n_trials=2, max_repeated_failures=0,
                     task={"name": "tests.e2e.ddp_tasks:broken_child"})
    done = sweep_cli("run", path)
    assert done.returncode == 1, done.stderr  # failing trials never take the study down; all failed: exit 1 at the end
    trials = load(tmp_path)
    assert [t.state for t in trials] == [TrialState.FAIL] * 2  # the config's fault: counted, not retried
    for trial in trials:
        assert trial.user_attrs["outcome"] == "failed" and "retry_of" not in trial.user_attrs
        assert trial.user_attrs["fail_reason"] == "rank 1 exited with code 1: RuntimeError: this rank's data is missing"
        assert trial.user_attrs["ranks"]["failed_rank"] == 1
        assert not any(alive(pid) for pid in trial.user_attrs["ranks"]["pids"])


def test_a_rank_that_ends_itself_with_code_0_mid_run_is_named_and_fails_the_trial(tmp_path: Path) -> None:
    """Review: a rank whose task's code called sys.exit(0) mid-run failed the trial with gloo's "Connection closed by
    peer" (its source path and all), naming no rank."""
    path = ddp_study(tmp_path, n_trials=1, max_repeated_failures=0, task={"name": "tests.e2e.ddp_tasks:exiting_child"})
    done = sweep_cli("run", path)
    assert done.returncode == 1, done.stderr
    [trial] = load(tmp_path)
    assert trial.state == TrialState.FAIL and trial.user_attrs["outcome"] == "failed", trial.user_attrs
    assert trial.user_attrs["fail_reason"].startswith("rank 1 ended (exit code 0) before the run did"), \
        trial.user_attrs["fail_reason"]
    assert trial.user_attrs["ranks"]["failed_rank"] == 1 and "retry_of" not in trial.user_attrs
    assert not any(alive(pid) for pid in trial.user_attrs["ranks"]["pids"])


def test_a_rank_killed_in_every_trial_stops_the_worker_with_advice_about_ranks(tmp_path: Path) -> None:
    # Three trials in a row lose a rank the same way: a fault of the machine, and the worker stops saying what to
    # look at, not the full disk's advice.
    path = ddp_study(tmp_path, n_trials=4, task={"name": "tests.e2e.ddp_tasks:killed_child"})
    done = sweep_cli("run", path)
    assert done.returncode == 1, done.stderr
    assert ("3 trials in a row were stopped by the same fault of the machine, not of their configs: rank 1 was killed "
            "by SIGKILL. Fix it (find what kills or stalls the trial's rank processes") in done.stderr, done.stderr
    assert "free space" not in done.stderr
    trials = load(tmp_path)
    assert [t.user_attrs["outcome"] for t in trials if t.state.is_finished()] == ["infrastructure"] * 3


def test_sigkill_of_rank_1_fails_the_trial_and_its_retry_resumes_on_two_ranks(tmp_path: Path) -> None:
    from tests.e2e.test_faults import checkpoint_rows, finish, start_sweep, wait_for

    path = ddp_study(tmp_path, n_trials=1, task={"name": "tests.e2e.ddp_tasks:slow", "args": {"sleep_s": 0.02}},
                     checkpoints={"every_steps": 20},
                     resources={"devices_per_trial": 2, "collective_timeout_s": 60},
                     storage_password_env="TEAM_DB_SECRET",  # a server URL's password (unused by SQLite)
                     fixed={**TINY_STUDY["fixed"], "max_steps": 200, "eval_every_steps": 20, "log_every_steps": 20})
    db, log = tmp_path / "ddp.db", tmp_path / "run.log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "PGPASSWORD": "sekret-of-the-storage",
           "TEAM_DB_SECRET": "named-sekret"}
    worker = start_sweep("run", path, log=log, env=env)
    try:
        wait_for("a checkpoint at step 40", lambda: any(step >= 40 for _, _, step, _ in checkpoint_rows(db)), 300,
                 alive=worker)
        (child,) = wait_for("rank 1's process", lambda: rank_children(worker.pid), 60, alive=worker)
        environ = Path(f"/proc/{child}/environ").read_bytes()
        assert b"RANK=1" in environ and b"sekret" not in environ  # the child never sees a password
        os.kill(child, signal.SIGKILL)
        assert finish(worker, log, 600) == 0, log.read_text()[-3000:]
    finally:
        if worker.poll() is None:
            worker.kill()
    trials = load(tmp_path)
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE]
    killed, retry = trials
    assert killed.user_attrs["outcome"] == "infrastructure"
    assert "rank 1 was killed by SIGKILL" in killed.user_attrs["fail_reason"]
    assert retry.user_attrs["retry_of"] == 0
    assert retry.user_attrs["resumed_from"]["trial"] == 0 and retry.user_attrs["resumed_from"]["step"] >= 40
    assert [(r["status"], r["steps"]) for r in retry.user_attrs["ranks"]["ranks"]] == [("completed", 200)] * 2
    assert sorted(retry.intermediate_values) == list(range(20, 220, 20))  # one curve, the lineage's
    assert not rank_children(worker.pid) and not any(alive(p) for p in retry.user_attrs["ranks"]["pids"])


def test_two_rank_checkpoints_warm_start_trials_on_two_ranks_and_on_one_and_reproduce(tmp_path: Path) -> None:
    fixed = {**TINY_STUDY["fixed"], "max_steps": 40, "eval_every_steps": 10}
    space = {"learning_rate": TINY_STUDY["space"]["learning_rate"]}  # one shape: every finished trial is a donor
    path = ddp_study(tmp_path, n_trials=2, warm_start={"max_distance": 10.0}, fixed=fixed, space=space)
    assert (done := sweep_cli("run", path)).returncode == 0, done.stderr
    # The same study, on one rank now: its next trial's donor is a checkpoint that rank 0 of two wrote.
    again = sweep_cli("run", path, "--n-trials", "3", "--set", "resources.devices_per_trial=1")
    assert again.returncode == 0, again.stderr
    trials = load(tmp_path)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert [t.user_attrs.get("reproducibility", {}).get("ranks", 1) for t in trials] == [2, 2, 1]
    for warm in trials[1:]:  # on 2 ranks (the child read the donor's file) and on 1
        donor = warm.user_attrs["warm_start_from"]
        assert donor["trial"] in (0, 1) and donor["step"] == 20 and min(warm.intermediate_values) == 30
    assert trials[2].user_attrs["warm_start_from"]["trial"] in (0, 1)  # a 2-rank donor for a 1-rank trial
    ranks = trials[1].user_attrs["ranks"]["ranks"]
    assert [(r["status"], r["steps"]) for r in ranks] == [("completed", 40)] * 2
    # Replayed on one rank, a 2-rank warm trial reports the same values within the data-parallel tolerance.
    replay = sweep_cli("reproduce", path, "1")
    assert replay.returncode == 0, replay.stdout + replay.stderr


@pytest.mark.parametrize(("signum", "outcome", "reason"), [(signal.SIGTERM, "preempted", "preempted (SIGTERM)"),
                                                           (signal.SIGINT, "interrupted", "interrupted")])
def test_a_signalled_worker_ends_its_ranks_and_the_trial_resumes_on_two_ranks(tmp_path: Path, signum: int,
                                                                              outcome: str, reason: str) -> None:
    from tests.e2e.test_faults import checkpoint_rows, finish, start_sweep, wait_for

    path = ddp_study(tmp_path, n_trials=1, task={"name": "tests.e2e.ddp_tasks:slow", "args": {"sleep_s": 0.02}},
                     checkpoints={"every_steps": 20},
                     fixed={**TINY_STUDY["fixed"], "max_steps": 200, "eval_every_steps": 20, "log_every_steps": 20})
    db, log = tmp_path / "ddp.db", tmp_path / "run.log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    worker = start_sweep("run", path, log=log, env=env)
    try:
        wait_for("a checkpoint at step 40", lambda: any(step >= 40 for _, _, step, _ in checkpoint_rows(db)), 300,
                 alive=worker)
        (child,) = wait_for("rank 1's process", lambda: rank_children(worker.pid), 60, alive=worker)
        worker.send_signal(signum)  # the worker alone (its child rank runs in a session of its own)
        code = finish(worker, log, 120)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert code == (143 if signum == signal.SIGTERM else 130), log.read_text()[-3000:]
    assert not alive(child)  # the worker ended its rank: no orphan left training
    killed, queued = load(tmp_path)
    assert (killed.user_attrs["outcome"], killed.user_attrs["fail_reason"]) == (outcome, reason)
    assert queued.state == TrialState.WAITING and queued.user_attrs["retry_of"] == 0

    assert finish(start_sweep("run", path, log=log, env=env), log, 600) == 0, log.read_text()[-3000:]
    retry = load(tmp_path)[1]
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["resumed_from"]["step"] >= 40
    assert [(r["status"], r["steps"]) for r in retry.user_attrs["ranks"]["ranks"]] == [("completed", 200)] * 2


def test_a_one_rank_retry_of_a_two_rank_trial_reproduces_within_the_data_parallel_tolerance(tmp_path: Path) -> None:
    # Found by review: a 2-rank trial interrupted, its retry run on one rank (`--set resources.devices_per_trial=1`,
    # which the README allows) resumed from the 2-rank checkpoint; `sweep reproduce` replays the whole run on one rank
    # but judged it exactly (the retry's own attrs say one rank), and failed at the first step (relative 1e-7).
    from tests.e2e.test_faults import checkpoint_rows, finish, start_sweep, wait_for

    path = ddp_study(tmp_path, n_trials=1, task={"name": "tests.e2e.ddp_tasks:slow", "args": {"sleep_s": 0.05}},
                     checkpoints={"every_steps": 10},
                     fixed={**TINY_STUDY["fixed"], "max_steps": 80, "eval_every_steps": 10, "log_every_steps": 10})
    db, log = tmp_path / "ddp.db", tmp_path / "run.log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    worker = start_sweep("run", path, log=log, env=env)
    try:
        wait_for("a checkpoint at step 20", lambda: any(step >= 20 for _, _, step, _ in checkpoint_rows(db)), 300,
                 alive=worker)
        worker.send_signal(signal.SIGINT)
        assert finish(worker, log, 120) == 130, log.read_text()[-3000:]
    finally:
        if worker.poll() is None:
            worker.kill()
    done = sweep_cli("run", path, "--set", "resources.devices_per_trial=1")
    assert done.returncode == 0, done.stderr
    killed, retry = load(tmp_path)
    assert killed.user_attrs["ranks"]["world"] == 2 and retry.user_attrs["resumed_from"]["step"] >= 20
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["reproducibility"].get("ranks", 1) == 1
    replay = sweep_cli("reproduce", path, "1")
    assert replay.returncode == 0, replay.stdout + replay.stderr


@pytest.mark.parametrize(("signum", "outcome", "stopped"), [(signal.SIGTERM, "preempted", False),
                                                            (signal.SIGINT, "interrupted", False),
                                                            (signal.SIGTERM, "preempted", True)],
                         ids=["sigterm", "sigint", "sigterm-rank-stopped"])
def test_a_signal_while_rank_0_waits_in_a_collective_for_a_hung_rank_is_honoured_at_once(
        tmp_path: Path, signum: int, outcome: str, stopped: bool) -> None:
    # Rank 0 blocked in gloo runs no Python signal handler until the collective returns, after its timeout (15
    # minutes here): a batch system's grace period would run out first. The signal ends the ranks at once instead.
    # A rank stopped by SIGSTOP kept the SIGTERM pending, and the worker waited the whole timeout (found by review):
    # it is continued to take it, and killed if it has not ended 5 s later.
    from tests.e2e.test_faults import finish, start_sweep, wait_for

    marker = tmp_path / "hung"
    path = ddp_study(tmp_path, n_trials=1, task={"name": "tests.e2e.ddp_tasks:hung_child",
                                                 "args": {"marker": str(marker), "step": 25}},
                     resources={"devices_per_trial": 2, "collective_timeout_s": 900},
                     fixed={**TINY_STUDY["fixed"], "max_steps": 200, "eval_every_steps": 20, "log_every_steps": 20})
    log = tmp_path / "run.log"
    worker = start_sweep("run", path, log=log, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        wait_for("rank 1 to stop answering", marker.exists, 300, alive=worker)
        (child,) = wait_for("rank 1's process", lambda: rank_children(worker.pid), 60, alive=worker)
        time.sleep(2)  # rank 0 reaches its next collective and waits there
        if stopped:
            os.kill(child, signal.SIGSTOP)
        worker.send_signal(signum)
        code = finish(worker, log, 300)  # well within the collective's 900 s
    finally:
        if worker.poll() is None:
            worker.kill()
    assert code == (143 if signum == signal.SIGTERM else 130), log.read_text()[-3000:]
    assert not alive(child)
    killed, queued = load(tmp_path)
    assert killed.user_attrs["outcome"] == outcome, killed.user_attrs.get("fail_reason")
    assert queued.state == TrialState.WAITING and queued.user_attrs["retry_of"] == 0


def test_a_hung_rank_does_not_outlive_its_sigkilled_worker(tmp_path: Path) -> None:
    # A rank stuck in code of its own runs no collective that would notice rank 0's death: the parent-death signal
    # ends it with its worker.
    from tests.e2e.test_faults import start_sweep, wait_for

    marker = tmp_path / "hung"
    path = ddp_study(tmp_path, n_trials=1, task={"name": "tests.e2e.ddp_tasks:hung_child",
                                                 "args": {"marker": str(marker), "step": 5}},
                     resources={"devices_per_trial": 2, "collective_timeout_s": 900})
    worker = start_sweep("run", path, log=tmp_path / "run.log",
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        wait_for("rank 1 to stop answering", marker.exists, 300, alive=worker)
        (child,) = wait_for("rank 1's process", lambda: rank_children(worker.pid), 60, alive=worker)
    finally:
        worker.kill()
        worker.wait()
    wait_for("the hung rank to end with its worker", lambda: not alive(child), 60)


def test_sweep_stop_lets_the_two_rank_trial_finish_and_starts_no_other(tmp_path: Path) -> None:
    """`sweep stop` from another process: the trial in flight ends on both ranks at its last step, no child rank
    outlives it, and no further trial starts."""
    from tests.e2e.test_faults import checkpoint_rows, finish, start_sweep, wait_for

    # 7 s of steps after the first checkpoint: the stop, given in-process, lands before the trial ends on a loaded
    # machine (a stop that landed after it would let the next trial be asked, as it should).
    path = ddp_study(tmp_path, n_trials=4, task={"name": "tests.e2e.ddp_tasks:slow", "args": {"sleep_s": 0.07}},
                     checkpoints={"every_steps": 20},
                     fixed={**TINY_STUDY["fixed"], "max_steps": 120, "eval_every_steps": 20, "log_every_steps": 20})
    db, log = tmp_path / "ddp.db", tmp_path / "run.log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    worker = start_sweep("run", path, log=log, env=env)
    try:
        wait_for("a checkpoint at step 20", lambda: any(step >= 20 for _, _, step, _ in checkpoint_rows(db)), 300,
                 alive=worker)
        (child,) = wait_for("rank 1's process", lambda: rank_children(worker.pid), 60, alive=worker)
        assert sweep_cli("stop", path).returncode == 0
        code = finish(worker, log, 300)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert code == 0, log.read_text()[-3000:]
    assert not alive(child)
    trials = load(tmp_path)
    assert [t.state for t in trials] == [TrialState.COMPLETE]  # the one in flight finished; none other was asked
    assert [(r["status"], r["steps"]) for r in trials[0].user_attrs["ranks"]["ranks"]] == [("completed", 120)] * 2


def test_a_rank_s_failure_is_named_by_its_exception_not_by_the_advice_after_it() -> None:
    """DDP's unused-parameter error ends with several lines of advice; the trial's reason was the last of them ("In
    addition, you can set the environment variable ..."), which says nothing about what went wrong."""
    from trainer.distributed import RankFailed

    tail = ("[rank1]: Traceback (most recent call last):\n"
            '[rank1]:   File "loop.py", line 3, in step\n'
            "[rank1]: RuntimeError: Expected to have finished reduction in the prior iteration before starting a new "
            "one. This error indicates that your module has parameters that were not used in producing loss. You "
            "can enable unused parameter detection by passing the keyword argument `find_unused_parameters=True` to "
            "`torch.nn.parallel.DistributedDataParallel`, and by making sure all `forward` function outputs "
            "participate in calculating loss.\n"
            "[rank1]: Parameter indices which did not receive grad for rank 1: 2 3\n"
            "[rank1]:  In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or "
            "DETAIL to print out information about which particular parameters did not receive gradient\n")
    # Its own advice names an option sweep does not take, and was cut at 300 characters in the middle of it (review).
    assert str(RankFailed(1, 1, tail)) == ("rank 1 exited with code 1: RuntimeError: the model has parameters its loss "
                                           "does not use, which DDP cannot train on several ranks: leave them out of "
                                           "the model, or give them a part in the loss")
    assert str(RankFailed(1, 1, "no exception here\nits last line")) == "rank 1 exited with code 1: its last line"


def test_every_rank_imports_the_task_beside_the_study_not_a_same_named_module_in_the_working_folder(
        tmp_path: Path) -> None:
    """Found by review: ranks 1 and up started as `python -m trainer.rank`, which puts the working folder before the
    PYTHONPATH they are given (rank 0's sys.path): with a same-named task module in the working folder and beside the
    study, rank 0 trained on the one and the other ranks on the other, in one group, and nothing said so."""
    module = ("import os\nfrom pathlib import Path\nfrom trainer.tasks import digits\n"
              "with open(Path(__file__).parent.parent / 'seen.txt', 'a') as seen:\n"
              "    seen.write(f\"{Path(__file__).parent.name} {os.environ.get('RANK', '0')}\\n\")\n"
              "def task():\n    return digits()\n")
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "shadowed.py").write_text(module)
    path = ddp_study(tmp_path / "b", n_trials=1, task="shadowed:task", checkpoints=False)
    done = sweep_cli("run", path, cwd=tmp_path / "a")
    assert done.returncode == 0, done.stderr
    seen = set((tmp_path / "seen.txt").read_text().split("\n")) - {""}
    assert {line.split()[0] for line in seen} == {"b"} and {line.split()[1] for line in seen} >= {"0", "1"}, seen
