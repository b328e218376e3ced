"""The real `sweep` command, end to end, against a real SQLite file."""

from __future__ import annotations

import contextlib
import copy
import csv
import io
import json
import os
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from sweep.spec import load_spec
from sweep.study import definition_note, open_study
from tests.conftest import TINY_STUDY, changed, run_cli, sweep_cli, write_study


def load(path: Path, name: str = "tiny") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{path}")


def test_a_tiny_study_lands_in_sqlite_and_reads_back_with_plain_optuna(tiny_study: Path) -> None:
    done = sweep_cli("run", tiny_study)
    assert done.returncode == 0, done.stderr
    assert "trial 2: complete" in done.stderr and "3/3 trials" in done.stdout
    study = load(tiny_study.parent / "tiny.db")  # the default storage: a SQLite file next to the study file
    trials = study.get_trials()
    assert [t.number for t in trials] == [0, 1, 2]
    assert all(t.state == TrialState.COMPLETE for t in trials)
    for trial in trials:
        assert sorted(trial.intermediate_values) == [10, 20]
        assert trial.value == trial.intermediate_values[20] == trial.user_attrs["metrics"]["val_loss"]
        config = trial.user_attrs["config"]
        assert config["learning_rate"] == trial.params["learning_rate"]
        assert config["model"]["hidden"] == trial.params["model.hidden"] and config["max_steps"] == 20
        assert trial.user_attrs["steps"] == 20 and trial.user_attrs["wall_time_s"] > 0
        assert trial.user_attrs["reproducibility"]["seed"] == 0
    spec = study.user_attrs["sweep.spec"]
    assert spec["space"]["learning_rate"]["log"] is True and "storage" not in spec


def test_rerun_finishes_the_budget_instead_of_adding_to_it(tiny_study: Path) -> None:
    assert sweep_cli("run", tiny_study, "--n-trials", "3").returncode == 0
    done = sweep_cli("run", tiny_study, "--n-trials", "5")
    assert done.returncode == 0, done.stderr
    assert "3/5 trials done" in done.stderr
    assert sweep_cli("run", tiny_study, "--n-trials", "5").returncode == 0  # nothing left to do
    trials = load(tiny_study.parent / "tiny.db").get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3, 4]
    assert all(t.state == TrialState.COMPLETE for t in trials)


def test_best_config_retrains_to_the_same_value(tiny_study: Path) -> None:
    assert sweep_cli("run", tiny_study).returncode == 0
    # A name the shell would split and expand (review: the header's command line held it unquoted).
    best_yaml = tiny_study.parent / "my best $(touch pwned).yaml"
    done = sweep_cli("best", tiny_study, "-o", best_yaml)
    assert done.returncode == 0, done.stderr
    study = load(tiny_study.parent / "tiny.db")
    text = best_yaml.read_text()
    assert yaml.safe_load(text)["learning_rate"] == study.best_params["learning_rate"]
    # The header's command, pasted into a shell, trains this file.
    command = text.splitlines()[0].split(": ", 1)[1].replace("python ", f"{shlex.quote(sys.executable)} ", 1)
    trained = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120, cwd=tiny_study.parent)
    assert not (tiny_study.parent / "pwned").exists()
    assert trained.returncode == 0, trained.stderr
    # Bit for bit on CPU: the same config and seed reproduce the stored value exactly.
    assert json.loads(trained.stdout)["metrics"]["val_loss"] == study.best_value


def test_best_config_of_a_pruned_study_run_by_workers_says_how_to_retrain_it_to_the_same_value(tmp_path: Path) -> None:
    # Found by review: the workers ran on one torch thread each, `python -m trainer` on the machine's count (the last
    # digits differed), and fast-fail's own rules, on in the exported config, may stop alone the trial the study's
    # pruner let complete. The header names the thread count, and the config has fast-fail off.
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 4, "pruner": {"type": "fastfail", "then": "median"}}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path, "--workers", "2").returncode == 0
    done = sweep_cli("best", path, "-o", tmp_path / "best.yaml")
    assert done.returncode == 0, done.stderr
    study = load(tmp_path / "tiny.db")
    threads = study.best_trial.user_attrs["reproducibility"]["threads"]["intra_op"]
    text = (tmp_path / "best.yaml").read_text()
    assert f": OMP_NUM_THREADS={threads} python -m trainer " in text.splitlines()[0], text
    assert "# fast_fail is off: the study judged this trial with its pruner" in text
    assert yaml.safe_load(text)["fast_fail"]["enabled"] is False
    trained = subprocess.run([sys.executable, "-m", "trainer", str(tmp_path / "best.yaml")], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    assert trained.returncode == 0, trained.stderr
    assert json.loads(trained.stdout)["metrics"]["val_loss"] == study.best_value
    report = sweep_cli("report", path, "-o", tmp_path / "report.html")
    assert report.returncode == 0, report.stderr
    assert f"OMP_NUM_THREADS={threads} python -m trainer best.yaml" in (tmp_path / "report.html").read_text()


def test_a_report_of_a_study_with_no_complete_trial_prints_no_optuna_log_lines(tmp_path: Path) -> None:
    # "[W ...] There are no complete trials." and "Study instance does not contain completed trials." came before
    # "wrote report.html": the figures that cannot be drawn yet say so in the report itself.
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 1, "max_repeated_failures": 0}
    document["fixed"] = {**document["fixed"], "learning_rate": 1e30}  # diverges: no trial completes
    document["space"] = {k: v for k, v in document["space"].items() if k != "learning_rate"}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 1
    report = sweep_cli("report", path, "-o", tmp_path / "report.html")
    assert report.returncode == 0 and report.stderr.strip() == f"wrote {tmp_path / 'report.html'}", report.stderr


def test_status_says_when_a_running_trial_s_worker_has_been_silent_past_the_grace_period(tiny_study: Path) -> None:
    """Every worker gone (a node died, a Slurm task killed): `sweep status` said "running 1" for as long as nobody
    ran the study again. It now says the trial's worker is gone and that the next run retries it; read commands
    still write nothing (only a worker fails a lost trial). The database's clock is moved, not the test's."""
    assert sweep_cli("run", tiny_study, "--n-trials", "1").returncode == 0
    db = tiny_study.parent / "tiny.db"
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}")
    trial = optuna.load_study(study_name="tiny", storage=storage).ask()
    storage.record_heartbeat(trial._trial_id)
    done = sweep_cli("status", tiny_study)
    assert done.returncode == 0 and "complete 1, running 1" in done.stdout, done.stdout
    assert "silent" not in done.stdout  # beating now: nothing to say
    with contextlib.closing(sqlite3.connect(db)) as connection, connection:
        connection.execute("UPDATE trial_heartbeats SET heartbeat = datetime(heartbeat, '-300 seconds')")
    before = db.read_bytes()
    done = sweep_cli("status", tiny_study)
    assert done.returncode == 0, done.stderr
    # 300 s, and the seconds the run and this read took since the heartbeat (a loaded machine's: 301 s was seen)
    assert re.search(r"running 1 \(1 running silent for 3[0-9]{2} s, past the 60 s heartbeat grace period: the worker "
                     r"is gone, and the next `sweep run` retries it from the last checkpoint\)",
                     " ".join(done.stdout.split())), done.stdout
    assert db.read_bytes() == before
    storage.engine.dispose()


def test_trials_shows_a_queued_retry_s_params(tiny_study: Path) -> None:
    """A retry waiting for a worker showed blank params: Optuna holds a queued trial's params aside (its
    `fixed_params`) until it is asked. `sweep trials` shows them, as the trial will train them."""
    assert sweep_cli("run", tiny_study, "--n-trials", "1").returncode == 0
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tiny_study.parent / 'tiny.db'}")
    [done] = study.get_trials()
    study.enqueue_trial(done.params, user_attrs={"retry_of": done.number})  # as a worker queues a retry
    rows = json.loads(sweep_cli("trials", tiny_study, "--format", "json").stdout)
    assert rows[1]["state"] == "waiting"
    assert {k.removeprefix("params."): v for k, v in rows[1].items() if k.startswith("params.")} == done.params


def test_status_and_trials_in_every_format(tiny_study: Path) -> None:
    assert sweep_cli("run", tiny_study).returncode == 0
    db = tiny_study.parent / "tiny.db"
    status = sweep_cli("status", db)
    assert status.returncode == 0 and "complete 3" in status.stdout and "best trial" in status.stdout
    rows = list(csv.DictReader(io.StringIO(sweep_cli("trials", tiny_study, "--format", "csv").stdout)))
    assert [r["state"] for r in rows] == ["complete"] * 3 and "params.model.hidden" in rows[0]
    assert all(float(r["samples_per_s"]) > 0 for r in rows)  # a slow configuration shows in the table
    as_json = json.loads(sweep_cli("trials", "--storage", f"sqlite:///{db}", "tiny", "--format", "json").stdout)
    assert [r["number"] for r in as_json] == [0, 1, 2]
    assert "params.learning_rate" in sweep_cli("trials", tiny_study).stdout
    assert sweep_cli("trials", tiny_study, "--format", "xml").returncode == 2
    missing = sweep_cli("status", tiny_study.parent / "nothing.db")
    assert missing.returncode == 2 and "neither a study file nor a database" in missing.stderr


def test_pruned_trials_carry_their_reason(tmp_path: Path) -> None:
    document = copy.deepcopy(TINY_STUDY) | {"pruner": {"type": "threshold", "upper": 0.0}}
    path = write_study(tmp_path, document)
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    assert "pruned by threshold at step 10" in done.stderr
    for trial in load(tmp_path / "tiny.db").get_trials():
        assert trial.state == TrialState.PRUNED
        assert trial.user_attrs["prune_reason"]["rule"] == "threshold"
        assert trial.user_attrs["prune_reason"]["step"] == 10
        assert trial.user_attrs["steps"] == 10
    assert "pruned by threshold" in sweep_cli("trials", path).stdout


def test_a_failing_trial_is_recorded_and_the_study_goes_on(tmp_path: Path) -> None:
    (tmp_path / "fragile.py").write_text(
        "from trainer.tasks import digits\n"
        "def task():\n"
        "    t = digits()\n"
        "    build = t.build_model\n"
        "    def build_model(cfg):\n"
        "        if cfg['hidden'] > 20:\n"
        "            raise RuntimeError('CUDA out of memory (simulated by a real exception)')\n"
        "        return build(cfg)\n"
        "    t.build_model = build_model\n"
        "    return t\n")
    document = copy.deepcopy(TINY_STUDY) | {
        "task": "fragile:task", "n_trials": 4, "sampler": "bruteforce",
        "space": {"model.hidden": {"type": "categorical", "choices": [8, 64]},
                  "optimizer": {"type": "categorical", "choices": ["adam", "sgd"]}}}
    path = write_study(tmp_path, document)
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    trials = load(tmp_path / "tiny.db").get_trials()
    by_state = {s: [t for t in trials if t.state == s] for s in (TrialState.COMPLETE, TrialState.FAIL)}
    assert len(by_state[TrialState.COMPLETE]) == 2 and len(by_state[TrialState.FAIL]) == 2
    for trial in by_state[TrialState.FAIL]:
        assert trial.params["model.hidden"] == 64
        assert trial.user_attrs["fail_reason"] == "RuntimeError: CUDA out of memory (simulated by a real exception)"
        assert "build_model" in trial.user_attrs["traceback"]
    assert "failed: RuntimeError" in done.stderr


def test_a_trial_out_of_memory_under_a_memory_limit_says_the_limit(tmp_path: Path) -> None:
    """Review: under `ulimit -v` a trial that ran out of memory failed as "MemoryError: " (Python's bare error has no
    words), or as the CPU allocator's words alone, and the limit that set where memory ends went unsaid; the
    trainer's command line said the same. A real limit on real processes: the address space capped at 8 GiB, one
    weight of the config's model needs 16 GiB (it fails with or without the limit on this machine; the limit is
    what the line must name)."""
    import resource

    limit = 8 << 30
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard != resource.RLIM_INFINITY and hard < limit:
        pytest.skip("this machine's hard address-space limit is below the test's")

    def capped() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))

    def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=tmp_path,
                              timeout=300, env={**os.environ, "NO_COLOR": "1"}, preexec_fn=capped)

    document = changed(n_trials=2, fixed__model={"hidden": 65536})
    del document["space"]["model.hidden"]
    path = write_study(tmp_path, document)
    done = run("-m", "sweep.cli", "run", path)
    assert done.returncode == 1, done.stderr  # every trial failed
    words = f"(the address-space limit, ulimit -v, is {limit // 1024} KiB)"
    trials = load(tmp_path / "tiny.db").get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL] * 2
    for trial in trials:
        reason = trial.user_attrs["fail_reason"]
        assert reason.startswith("RuntimeError: ") and "can't allocate memory" in reason, reason
        assert reason.endswith(words), reason
    assert "failed: RuntimeError: " in done.stderr and words in done.stderr
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(trials[0].user_attrs["config"]))
    alone = run("-m", "trainer", "config.yaml")
    assert alone.returncode == 1
    lines = alone.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config.yaml: out of memory: RuntimeError: "), alone.stderr
    assert words in lines[0]
    import torch

    from trainer.precision import host_memory_limit, out_of_memory, out_of_memory_words

    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:  # Python's own error, which has no words
        assert out_of_memory(MemoryError()) and out_of_memory_words(MemoryError()) == "MemoryError: out of memory"
        assert host_memory_limit(MemoryError()) is None
    # Diff review: only host memory runs out at the limit; an error that only says so, or a GPU's, is not its doing.
    # (A limit far above what this process maps, for the calls alone.)
    resource.setrlimit(resource.RLIMIT_AS, (1 << 50, hard))
    try:
        host = host_memory_limit(MemoryError())
        others = [host_memory_limit(error) for error in (
            ValueError("batch rejected: the model ran out of memory budget"),
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))]
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert host == f"the address-space limit, ulimit -v, is {(1 << 50) // 1024} KiB"
    assert others == [None, None, None]


@pytest.mark.parametrize("how", [[], ["--cohort", "2"], ["--workers", "2"]], ids=["alone", "cohort", "workers"])
def test_a_rerun_of_a_finished_grid_trains_no_copy_of_its_points(tmp_path: Path, how: list[str]) -> None:
    """Every point of a bruteforce grid trained, a rerun with budget left drew a copy of a finished point (Optuna's
    sampler stops the study only once a trial is told), trained it and spent a trial of the budget, each time.
    With `--workers`, neither the run that tried the last point nor the rerun said why it stopped short (review)."""
    document = copy.deepcopy(TINY_STUDY) | {
        "n_trials": 3, "sampler": "bruteforce", "pruner": "none",
        "space": {"learning_rate": {"type": "categorical", "choices": [0.003, 0.01, 0.03]}}}
    path = write_study(tmp_path, document)
    first = sweep_cli("run", path, "--n-trials", "4", *how)
    assert first.returncode == 0, first.stderr
    assert "the sampler has tried every point of the search space; stopped with 3/4 trials done" in first.stderr
    for _ in range(2):
        done = sweep_cli("run", path, "--n-trials", "5", *how)
        assert done.returncode == 0, done.stderr
        assert "the sampler has tried every point of the search space; stopped with 3/5 trials done" in done.stderr
        assert "trial 3" not in done.stderr, done.stderr
    trials = load(tmp_path / "tiny.db").get_trials()
    assert sorted(t.params["learning_rate"] for t in trials) == [0.003, 0.01, 0.03]


def test_a_changed_definition_is_refused_on_resume(tiny_study: Path) -> None:
    assert sweep_cli("run", tiny_study, "--n-trials", "1").returncode == 0
    done = sweep_cli("run", tiny_study, "--set", "space.learning_rate.high=0.5")
    assert done.returncode == 2
    assert "already exists with a different space" in done.stderr and "--study-name" in done.stderr
    assert done.stderr.startswith(f"error: {tiny_study}: study 'tiny' already exists"), done.stderr  # which file
    assert "(space.learning_rate.high: stored 0.1, now 0.5)" in done.stderr, done.stderr  # which key, both values
    assert sweep_cli("run", tiny_study, "--set", "space.learning_rate.high=0.5", "--study-name", "wider",
                   "--n-trials", "1").returncode == 0


def test_a_timeout_on_a_study_whose_budget_is_spent_does_not_ask_for_a_rerun(tiny_study: Path) -> None:
    # Found by review: the timeout was checked before the budget, and the run said "stopped by the timeout with 3/3
    # trials done; rerun to continue", where a rerun has nothing to do.
    assert sweep_cli("run", tiny_study).returncode == 0
    done = sweep_cli("run", tiny_study, "--timeout", "0.001")
    assert done.returncode == 0 and "stopped by the timeout" not in done.stderr, done.stderr


def test_a_value_accepted_as_the_same_is_not_blamed_on_a_later_change(tiny_study: Path) -> None:
    # Found by review: `--set fixed.seed=0` (the default, so the same study) was stored as the study's definition, and
    # the next change's refusal listed "fixed.seed: removed", which the user never wrote.
    assert sweep_cli("run", tiny_study, "--n-trials", "1").returncode == 0
    assert sweep_cli("run", tiny_study, "--n-trials", "1", "--set", "fixed.seed=0").returncode == 0
    done = sweep_cli("run", tiny_study, "--set", "fixed.max_steps=21")
    assert done.returncode == 2, done.stderr
    assert "(fixed.max_steps: stored 20, now 21)" in done.stderr and "seed" not in done.stderr, done.stderr


def test_a_rerun_with_another_checkpoint_store_is_refused_and_deletes_no_checkpoint(tmp_path: Path) -> None:
    # Found by review: a rerun whose checkpoints.store was another folder (`--set`, an edited file, the study file
    # run from another folder on a server database) took every checkpoint row for a missing file and deleted it, in
    # silence: interrupted trials then started over, and warm-started ones could no longer be reproduced. Moved (the
    # folder it ran with is gone), the study goes on from where the file says.
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 2}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 0
    db = tmp_path / "tiny.db"

    def rows() -> list[tuple[int, str]]:
        with contextlib.closing(sqlite3.connect(db)) as connection:
            return connection.execute("SELECT id, uri FROM sweep_checkpoints ORDER BY id").fetchall()

    before = rows()
    assert before
    refused = sweep_cli("run", path, "--n-trials", "3", "--set", "checkpoints.store=other")
    assert refused.returncode == 2, refused.stderr
    assert (f"{path}: checkpoints.store: {tmp_path / 'other'} is not the store study 'tiny' ran with "
            f"({tmp_path / 'tiny.checkpoints'}") in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    # Edits review: its advice (move the study's folder) left the dashboard's copies behind, and `check` exited 1.
    assert refused.stderr.rstrip().endswith("then run `sweep check --repair` to copy its checkpoints' dashboard "
                                            "artifacts there"), refused.stderr
    assert rows() == before and len(load(db).get_trials()) == 2 and not (tmp_path / "other").exists()

    (tmp_path / "tiny.checkpoints").rename(tmp_path / "moved")
    write_study(tmp_path, document | {"checkpoints": {"store": "moved"}})
    moved = sweep_cli("run", path, "--n-trials", "3")
    assert moved.returncode == 0, moved.stderr
    assert set(before) <= set(rows()) and len(load(db).get_trials()) == 3
    assert sweep_cli("check", db).returncode == 0


def test_storage_password_is_never_printed(tiny_study: Path) -> None:
    done = sweep_cli("run", tiny_study, "--storage", "postgresql+psycopg://alice:s3cr3t@127.0.0.1:1/sweep")
    assert done.returncode == 1
    assert "s3cr3t" not in done.stderr + done.stdout
    assert "alice:***@127.0.0.1" in done.stderr


def test_ctrl_c_marks_the_trial_and_the_next_run_continues(tmp_path: Path) -> None:
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 2}
    document["fixed"] = {**document["fixed"], "max_steps": 4000, "eval_every_steps": 50, "log_every_steps": 50}
    path = write_study(tmp_path, document)
    db = tmp_path / "tiny.db"
    process = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until trial 0 has reported at least once
            if db.exists():
                try:
                    trials = load(db).get_trials()
                except Exception:  # noqa: BLE001 - the study or its tables may not exist yet
                    trials = []
                if trials and trials[0].intermediate_values:
                    break
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert "rerun the same command to continue" in stderr
    first, queued = load(db).get_trials()
    assert first.state == TrialState.FAIL and first.user_attrs["interrupted"] is True
    assert queued.state == TrialState.WAITING and queued.user_attrs["retry_of"] == 0

    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    trials = load(db).get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    assert trials[1].params == first.params and trials[1].user_attrs["retry_of"] == 0


# A real SIGINT (or INTERRUPT_SIGNAL), sent by the process to itself as it starts importing one module
# (INTERRUPT_AT_IMPORT): a Ctrl-C given at that moment of the command's start, a moment a test can choose.
_INTERRUPT_AT_IMPORT = """import os, signal, sys
class _Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("INTERRUPT_AT_IMPORT"):
            sys.meta_path.remove(self)
            os.kill(os.getpid(), int(os.environ.get("INTERRUPT_SIGNAL", signal.SIGINT)))
        return None
sys.meta_path.insert(0, _Interrupt())
"""


@pytest.mark.parametrize(("module", "signum", "code", "line"), [
    ("typer", signal.SIGINT, 130, "interrupted as the command started: nothing was done."),
    ("typer", signal.SIGTERM, 143, "preempted (SIGTERM) as the command started: nothing was done."),
    ("optuna", signal.SIGINT, 130, "interrupted before the run began; no trial was started")])
def test_a_ctrl_c_as_the_command_starts_is_one_line_not_a_traceback(tmp_path: Path, module: str, signum: int,
                                                                     code: int, line: str) -> None:
    """A Ctrl-C in `sweep run`'s first few tenths of a second printed a traceback from deep inside typing or click
    (typer being imported), and a little later ended the command without a word (Optuna being imported, before the
    run's own handling of signals began); a SIGTERM as it started ended it without a word."""
    path = write_study(tmp_path, TINY_STUDY)
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(_INTERRUPT_AT_IMPORT)
    env = {**os.environ, "INTERRUPT_AT_IMPORT": module, "INTERRUPT_SIGNAL": str(int(signum)),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "hook"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "sweep", "run", str(path)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    # the code, or killed by the SIGINT itself: CPython does that when a Ctrl-C landed in code a C library ran itself
    assert done.returncode in (code, -signum), done.stderr
    assert "Traceback" not in done.stderr and line in done.stderr, done.stderr
    assert not (tmp_path / "tiny.db").exists() or not load(tmp_path / "tiny.db").get_trials()


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler of its own for `signum` (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _started_catching_sigterm(*args: str | Path, cwd: Path | None = None) -> subprocess.Popen[str]:
    """`sweep ARGS` in a process of its own, returned once it has a SIGTERM handler (sweep's: Python has none)."""
    process = subprocess.Popen([sys.executable, "-m", "sweep.cli", *map(str, args)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=cwd)
    deadline = time.monotonic() + 120
    while not _catches(process.pid, signal.SIGTERM):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"`sweep {' '.join(map(str, args))}` never caught SIGTERM: {process.communicate()}")
        time.sleep(0.005)
    return process


def test_a_sigterm_while_the_run_starts_is_honoured_before_any_trial_with_one_line(tmp_path: Path) -> None:
    # Found by review: until the worker loop began (seconds of importing torch and opening the study), Python's own
    # handling applied: a Ctrl-C could land in a garbage-collection callback and be dropped (the run then trained its
    # whole budget and exited 0), and a SIGTERM ended it without a word, leaving a database without its study. The
    # signal is a request from the command's first line: the handler is there before torch is loaded.
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 2})
    process = _started_catching_sigterm("run", path)
    try:
        torch_loaded = "libtorch" in Path(f"/proc/{process.pid}/maps").read_text()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert not torch_loaded  # caught from the start, not only once the run began
    assert process.returncode == 143, stderr
    # No trial ran, and the line says so (it said "running trials are marked and queued again").
    assert stderr.strip().splitlines()[-1] == ("preempted (SIGTERM) before the run began; no trial was started: rerun "
                                               "the same command to continue."), stderr
    assert not [t for t in load(tmp_path / "tiny.db").get_trials() if t.state.is_finished()]
    assert sweep_cli("run", path).returncode == 0


def _reported_step_0(path: Path) -> bool:
    """Whether the study in `path` exists and a trial of it has reported step 0."""
    try:
        return any(0 in t.intermediate_values for t in load(path).get_trials())
    except KeyError:  # the file, not the study yet
        return False


def test_a_sigterm_between_two_log_steps_is_honoured_at_the_next_optimizer_step(tmp_path: Path) -> None:
    # Found by review: a stop was honoured only at the trial's next log or evaluation step, minutes of slow steps
    # away (charlm on a CPU took 71 s), past a preempted job's grace period: killed there, the trial was lost, not
    # marked. Here the next log step is 10^8 steps away.
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 1}
    del document["pruner"]  # the default pruner: the trial reports step 0 before its first step
    document["fixed"] |= {"max_steps": 10**8, "eval_every_steps": 10**8, "log_every_steps": 10**8}
    path = write_study(tmp_path, document)
    process = _started_catching_sigterm("run", path, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not _reported_step_0(tmp_path / "tiny.db"):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)  # after its last check at a report: training now
        _, stderr = process.communicate(timeout=240)
    finally:
        process.kill()
    assert process.returncode == 143, stderr
    stopped, retry = load(tmp_path / "tiny.db").get_trials()
    assert stopped.state == TrialState.FAIL and stopped.user_attrs["fail_reason"] == "preempted (SIGTERM)"
    assert retry.state == TrialState.WAITING and retry.user_attrs["retry_of"] == 0


def test_a_sigterm_while_the_storage_is_waited_for_at_the_start_exits_143_not_as_a_storage_error(
        tmp_path: Path) -> None:
    # Found by review: a worker preempted while it waited for its storage at its start (Slurm, Kubernetes) exited 1,
    # "cannot open storage ... told to stop", as if the storage were broken.
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 1})
    process = _started_catching_sigterm("run", path, "--storage", "postgresql+psycopg://nobody@127.0.0.1:1/none")
    try:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == ("preempted (SIGTERM) before the run began; no trial was started: rerun "
                                               "the same command to continue."), stderr


def test_ctrl_c_during_reproduce_is_one_line(tmp_path: Path) -> None:
    # Found by review: a Ctrl-C during `sweep reproduce` printed a 19-line traceback (or one from a finalizer).
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 1}
    document["fixed"] = {**document["fixed"], "max_steps": 3000, "eval_every_steps": 100, "log_every_steps": 100}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 0
    process = _started_catching_sigterm("reproduce", path, "0")  # its replay is starting: Ctrl-C is a request now
    try:
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stdout + stderr
    assert stderr.strip() == "error: interrupted: trial 0 was not reproduced (nothing was written)", stderr
    assert "reproduced:" not in stdout


def test_optuna_dashboard_reads_the_study(tiny_study: Path) -> None:
    optuna_dashboard = pytest.importorskip("optuna_dashboard")
    from wsgiref.util import setup_testing_defaults

    assert sweep_cli("run", tiny_study).returncode == 0
    app = optuna_dashboard.wsgi(f"sqlite:///{tiny_study.parent / 'tiny.db'}")

    def get(path: str) -> dict:
        environ: dict = {"PATH_INFO": path, "QUERY_STRING": "after=0"}
        setup_testing_defaults(environ)
        status = []
        body = b"".join(app(environ, lambda s, h, *a: status.append(s)))
        assert status[0].startswith("200"), status
        return json.loads(body)

    [summary] = get("/api/studies")["study_summaries"]
    assert summary["study_name"] == "tiny"
    detail = get(f"/api/studies/{summary['study_id']}")
    assert len(detail["trials"]) == 3
    assert {t["state"] for t in detail["trials"]} == {"Complete"}
    assert all(len(t["intermediate_values"]) == 2 for t in detail["trials"])
    assert any(attr["key"] == "config" for attr in detail["trials"][0]["user_attrs"])
    # The metric by its name, not "Objective 0"; the definition readable in the study's note, not one JSON line.
    assert detail["objective_names"] == ["val_loss"]
    note = detail["note"]["body"]
    assert note.startswith("## Study definition") and "\n  learning_rate:\n    type: float\n" in note
    assert note == definition_note(load(tiny_study.parent / "tiny.db").user_attrs["sweep.spec"])


def test_a_study_created_before_gets_its_metric_name_and_note_when_opened(tmp_path: Path) -> None:
    pytest.importorskip("optuna_dashboard")
    from optuna_dashboard import get_note

    spec, _ = load_spec(write_study(tmp_path, TINY_STUDY))
    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = optuna.create_study(study_name="tiny", storage=url)  # as sweep created studies before: the spec attr only
    old.set_user_attr("sweep.spec", spec.stored())
    assert old.metric_names is None and get_note(old) == ""
    versions = len(system_attrs(url))

    study = open_study(spec, url)
    assert study.metric_names == ["val_loss"] and get_note(study) == definition_note(spec.stored())
    versions_after = len(system_attrs(url))
    open_study(spec, url)  # unchanged: no new note version
    assert len(system_attrs(url)) == versions_after > versions


def system_attrs(url: str) -> dict:
    study = optuna.load_study(study_name="tiny", storage=url)
    return study._storage.get_study_system_attrs(study._study_id)


def test_a_study_that_searches_deterministic_fixes_cublas_before_its_first_trial(tmp_path: Path) -> None:
    # torch reads CUBLAS_WORKSPACE_CONFIG once per process, at the first cuBLAS call: a worker whose first trial is
    # not deterministic would otherwise leave its later deterministic trials without it.
    (tmp_path / "envtask.py").write_text(
        "import os\n"
        "from trainer.tasks import digits\n"
        "def task():\n"
        "    t = digits()\n"
        "    build = t.build_model\n"
        "    def build_model(cfg):\n"
        "        with open(os.path.join(os.path.dirname(__file__), 'seen.txt'), 'a') as f:\n"
        "            f.write(os.environ.get('CUBLAS_WORKSPACE_CONFIG', 'unset') + '\\n')\n"
        "        return build(cfg)\n"
        "    t.build_model = build_model\n"
        "    return t\n")
    document = copy.deepcopy(TINY_STUDY) | {"task": "envtask:task", "n_trials": 1,
                                            "space": {"deterministic": {"type": "categorical", "choices": [False]}}}
    path = write_study(tmp_path, document)
    done = sweep_cli("run", path, env={"CUBLAS_WORKSPACE_CONFIG": None}, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = (tmp_path / "seen.txt").read_text().split()
    assert seen and set(seen) == {":4096:8"}


def test_a_resumed_study_draws_new_configs_and_a_fresh_one_keeps_its_seed(tmp_path: Path) -> None:
    document = copy.deepcopy(TINY_STUDY) | {"sampler": {"type": "tpe"}}
    first, again = tmp_path / "first", tmp_path / "again"
    for folder in (first, again):
        folder.mkdir()
        write_study(folder, document)
    assert sweep_cli("run", first / "study.yaml", "--n-trials", "2").returncode == 0
    assert sweep_cli("run", first / "study.yaml", "--n-trials", "4").returncode == 0  # a resume joins the study
    assert sweep_cli("run", again / "study.yaml", "--n-trials", "2").returncode == 0
    resumed = [t.params for t in load(first / "tiny.db").get_trials()]
    fresh = [t.params for t in load(again / "tiny.db").get_trials()]
    assert resumed[:2] == fresh  # seeded: a new study samples the same configs every time
    assert resumed[2] not in resumed[:2] and resumed[3] not in resumed[:2]  # not the first run's draws again


@pytest.mark.parametrize("password", ["secretpw", "Ab{secretpw}Cd"])
@pytest.mark.parametrize("command", ["status", "trials", "best", "report"])
def test_read_commands_on_an_unreachable_storage_give_one_line_without_the_password(command: str,
                                                                                    password: str) -> None:
    """A brace in the password: Optuna fills a template in the URL by str.format, which raised KeyError('secretpw'),
    printed as `error: secretpw`."""
    url = f"postgresql+psycopg://sweeper:{password}@127.0.0.1:1/nothing"  # loopback, a port nothing listens on
    done = sweep_cli(command, "--storage", url, "--study-name", "any")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "secretpw" not in done.stdout + done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.strip()]
    assert line.startswith("error: cannot open storage postgresql+psycopg://sweeper:***@127.0.0.1:1/nothing: ")


def test_a_study_in_a_folder_whose_name_holds_braces_runs_and_reads(tmp_path: Path) -> None:
    """Optuna's URL template (`str.format`) made `x{depth}/` fail every command (KeyError: 'depth'), after leaving an
    empty database there."""
    folder = tmp_path / "x{depth}"
    folder.mkdir()
    study = write_study(folder, copy.deepcopy(TINY_STUDY) | {"n_trials": 1})
    done = sweep_cli("run", study)
    assert done.returncode == 0, done.stderr
    done = sweep_cli("trials", folder / "tiny.db", "--format", "json")
    assert done.returncode == 0, done.stderr
    assert [row["state"] for row in json.loads(done.stdout)] == ["complete"]
    assert {"study.yaml", "tiny.checkpoints", "tiny.db", "tiny.db.lock"} <= {p.name for p in folder.iterdir()}


def test_every_command_finds_a_study_run_under_another_name_from_its_study_file(tiny_study: Path) -> None:
    """The README's way to change a study's definition is a new study (`--study-name`), which `sweep run` puts in its
    own database (`other.db`, as `name: other` would). The other commands looked for it in the file's own name's
    database, so not even `sweep stop` reached its workers."""
    assert sweep_cli("run", tiny_study, "--n-trials", "1", "--study-name", "other").returncode == 0
    assert (tiny_study.parent / "other.db").exists() and not (tiny_study.parent / "tiny.db").exists()
    done = sweep_cli("trials", tiny_study, "--study-name", "other", "--format", "json")
    assert done.returncode == 0, done.stderr
    assert [row["state"] for row in json.loads(done.stdout)] == ["complete"]
    for command in ("status", "check", "stop"):
        done = sweep_cli(command, tiny_study, "--study-name", "other")
        assert done.returncode == 0, (command, done.stderr)


@pytest.mark.parametrize(("option", "said"), [("sslmode=bogus", 'invalid sslmode value: "bogus"'),
                                              ("fancy=1", 'invalid connection option "fancy"'),
                                              ("port=abc", "non-integer port")])
def test_an_option_of_the_storage_url_no_server_takes_is_bad_input_at_once(
        tiny_study: Path, option: str, said: str) -> None:
    """It was taken for an outage: `storage_patience` seconds of waiting, then exit 1 with two long lines."""
    url = f"postgresql+psycopg://sweeper:secretpw@127.0.0.1:1/nothing?{option}"
    for args in (("run", tiny_study, "--storage", url), ("status", "--storage", url, "--study-name", "any")):
        done = sweep_cli(*args)
        assert done.returncode == 2, done.stderr
        [line] = [line for line in done.stderr.splitlines() if line.strip()]
        assert line.startswith("error: storage URL postgresql+psycopg://sweeper:***@127.0.0.1:1/nothing?"), line
        assert said in line and "secretpw" not in done.stdout + done.stderr and "waiting" not in line, line
    assert not list(tiny_study.parent.glob("*.db"))


def test_a_wrong_study_name_names_the_studies_there(tiny_study: Path) -> None:
    assert sweep_cli("run", tiny_study, "--n-trials", "1").returncode == 0
    done = sweep_cli("status", tiny_study.parent / "tiny.db", "--study-name", "tinny")
    assert done.returncode == 1
    assert "error: no study named 'tinny' in sqlite:///" in done.stderr and "it holds: 'tiny'" in done.stderr
    # A database of two studies with none named: which one is the user's to say (bad input, exit 2).
    database = tiny_study.parent / "tiny.db"
    assert sweep_cli("run", tiny_study, "--n-trials", "1", "--study-name", "other",
                     "--storage", f"sqlite:///{database}").returncode == 0
    done = sweep_cli("status", database)
    assert done.returncode == 2
    assert "holds 2 studies ('tiny', 'other')" in done.stderr and "name one with --study-name" in done.stderr
    # Names quoted as Python writes them: an empty one is seen, a right-to-left override cannot turn the line around.
    for odd in ("", "\u202eevil"):
        optuna.create_study(study_name=odd, storage=f"sqlite:///{database}")
    done = sweep_cli("status", database)
    assert "holds 4 studies ('tiny', 'other', '', '\\u202eevil')" in done.stderr, done.stderr
    assert "\u202e" not in done.stderr


def test_a_database_of_another_optuna_schema_is_one_line_and_left_as_it_is(tiny_study: Path) -> None:
    # Optuna's own words came through, exit 1: "The runtime optuna version 5.1.0 is no longer compatible with the
    # table schema (set up by optuna 5.1.0). Please try updating optuna", advice that would rewrite the file.
    import sqlite3

    assert sweep_cli("run", tiny_study, "--n-trials", "1").returncode == 0
    database = tiny_study.parent / "tiny.db"
    with contextlib.closing(sqlite3.connect(database)) as connection:
        connection.execute("UPDATE alembic_version SET version_num = 'v9.9.9.a'")
        connection.commit()
    before = database.read_bytes()
    for args in (("status", database), ("run", tiny_study)):
        done = sweep_cli(*args)
        assert done.returncode == 2, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert "its tables are of a schema Optuna" in line and "Please" not in line, line
    assert database.read_bytes() == before


def test_a_study_folder_moved_elsewhere_keeps_its_checkpoints(tmp_path: Path) -> None:
    # The registry names each blob relative to the study's folder of the store, never a machine's absolute path: a
    # database and its checkpoint folder copied or mounted elsewhere (another machine, a new home) still agree.
    (tmp_path / "a").mkdir()
    path = write_study(tmp_path, TINY_STUDY | {"n_trials": 2})
    done = sweep_cli("run", path, "--storage", "sqlite:///rel.db", cwd=tmp_path / "a")
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(tmp_path / "a" / "rel.db") as connection:
        uris = [row[0] for row in connection.execute("SELECT uri FROM sweep_checkpoints")]
    assert uris and all("/" not in uri and (tmp_path / "a" / "rel.checkpoints" / "tiny" / uri).exists()
                        for uri in uris)
    (tmp_path / "a").rename(tmp_path / "moved")
    check = sweep_cli("check", tmp_path / "moved" / "rel.db", "--study-name", "tiny")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "missing_blob 0, corrupt_blob 0, orphan_file 0, dangling_artifact 0" in check.stderr, check.stderr


def test_too_many_local_workers_are_refused_before_anything_starts(tiny_study: Path) -> None:
    """`--workers 100000` started hundreds of worker processes (each a torch runtime) on a 2-core machine."""
    done = sweep_cli("run", tiny_study, "--workers", "100000")
    assert done.returncode == 2
    [line] = [line for line in done.stderr.splitlines() if line.strip()]
    assert "--workers: expected 1 to 256 worker processes on this machine, got 100000" in line
    assert sorted(p.name for p in tiny_study.parent.iterdir()) == ["study.yaml"]  # nothing created


def test_no_more_local_workers_than_the_budget_are_started(tiny_study: Path) -> None:
    done = sweep_cli("run", tiny_study, "--n-trials", "2", "--workers", "6")
    assert done.returncode == 0, done.stderr
    assert "2 worker processes on this machine" in done.stderr  # not 6: four would find no trial to train
    trials = load(tiny_study.parent / "tiny.db").get_trials()
    assert len(trials) == 2 and all(t.state.name == "COMPLETE" for t in trials)


def test_a_set_value_that_is_no_utf8_text_gets_one_line(tiny_study: Path) -> None:
    """Bytes that are no UTF-8 reach Python's argv as surrogates, which the YAML parser cannot take (a traceback)."""
    done = sweep_cli("run", tiny_study, "--set", "description=\udcff")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.strip()]
    assert line == r"error: command line: --set: expected UTF-8 text, got 'description=\xff'"
    assert sorted(p.name for p in tiny_study.parent.iterdir()) == ["study.yaml"]


def test_a_run_whose_every_trial_failed_exits_1_and_a_spent_budget_still_exits_0(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("def main(config, run):\n    raise ValueError('no data here')\n")
    path = write_study(tmp_path, {"name": "broken", "n_trials": 2, "loop": "broken:main", "sampler": "random",
                                  "space": {"x": {"type": "float", "low": 0, "high": 1}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: every trial of this run failed (2 failed, none complete or pruned); `sweep trials` shows each one's "
        "reason")
    assert [t.state for t in load(tmp_path / "broken.db", "broken").get_trials()] == [TrialState.FAIL] * 2
    again = sweep_cli("run", path, pythonpath=tmp_path)  # a resume with the budget spent runs (and fails) nothing
    assert again.returncode == 0, again.stderr


def test_a_slurm_task_or_pod_whose_every_trial_failed_exits_1(tmp_path: Path) -> None:
    # Review: a worker with no launcher above it (a Slurm array task, a pod: `SWEEP_WORKER` set by its script) left
    # the exit code to a parent that does not exist, and exited 0: Slurm's COMPLETED, `sweep status` "done", the
    # pod succeeded.
    (tmp_path / "broken.py").write_text("def main(config, run):\n    raise ValueError('no data here')\n")
    path = write_study(tmp_path, {"name": "broken", "n_trials": 2, "loop": "broken:main", "sampler": "random",
                                  "space": {"x": {"type": "float", "low": 0, "high": 1}}})
    done = sweep_cli("run", path, pythonpath=tmp_path, env={"SWEEP_WORKER": "3", "SWEEP_LAUNCHER_PID": None})
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: [worker 3] every trial of this run failed (2 failed")


def test_local_workers_whose_every_trial_failed_exit_1(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("def main(config, run):\n    raise ValueError('no data here')\n")
    path = write_study(tmp_path, {"name": "broken", "n_trials": 2, "loop": "broken:main", "sampler": "random",
                                  "space": {"x": {"type": "float", "low": 0, "high": 1}}})
    done = sweep_cli("run", path, "--workers", "2", pythonpath=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: every trial of this run failed (2 failed")
    assert "exited with code" not in done.stderr  # each worker exits 0: the parent judges the run as a whole


def _random_bytes(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 20)


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _other_sqlite(path: Path) -> None:
    with contextlib.closing(sqlite3.connect(path)) as connection:
        connection.execute("CREATE TABLE notes (body TEXT)")
        connection.commit()


def _damaged_sqlite(path: Path) -> None:
    path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 200)


def _plain_optuna(path: Path) -> None:
    study = optuna.create_study(study_name="plain", storage=f"sqlite:///{path}")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)


def _older_optuna(path: Path) -> None:
    """A study database as Optuna 2.5 left it: no heartbeat table, its versions."""
    _plain_optuna(path)
    with contextlib.closing(sqlite3.connect(path)) as connection:
        connection.execute("DROP TABLE trial_heartbeats")
        connection.execute("UPDATE alembic_version SET version_num = 'v2.4.0.a'")
        connection.execute("UPDATE version_info SET library_version = '2.5.0'")
        connection.commit()


def _table_dropped(path: Path) -> None:
    _plain_optuna(path)
    with contextlib.closing(sqlite3.connect(path)) as connection:
        connection.execute("DROP TABLE trial_values")
        connection.commit()


@pytest.mark.parametrize("command", ["status", "best", "trials", "report", "reproduce", "stop"])
@pytest.mark.parametrize(("make", "expected"), [
    (_random_bytes, "is not a SQLite database"), (_empty, "is an empty file, not a study database"),
    (_other_sqlite, "is a SQLite database but not a study database"),
    (_damaged_sqlite, "cannot be read as a SQLite database"),
    # Review: Optuna's storage wrote the tables it missed into these files, then refused the first (and read the
    # second as a study with no values).
    (_older_optuna, f"is Optuna 2.5.0's without tables Optuna {optuna.__version__} reads (trial_heartbeats): open "
                    "it with the Optuna version that made it"),
    (_table_dropped, f"is Optuna {optuna.__version__}'s without tables Optuna {optuna.__version__} reads "
                     "(trial_values): were they dropped by hand or by another tool?")])
def test_a_file_that_is_no_study_database_is_refused_by_read_commands_and_left_as_it_was(
        tmp_path: Path, command: str, make: Any, expected: str) -> None:
    """Optuna's storage creates its tables in any SQLite file: a read command must not turn one into a study."""
    db = tmp_path / "x.db"
    make(db)
    before = db.read_bytes()
    done = sweep_cli(command, db, *(["0"] if command == "reproduce" else []), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {db} ") and expected in line, line
    assert db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.db"]  # no -wal, no report.html


def test_a_study_database_another_process_holds_locked_is_busy_not_damaged(tmp_path: Path) -> None:
    """Review: a transaction another program left open made `sweep status` call the file damaged, exit 2."""
    db = tmp_path / "x.db"
    _plain_optuna(db)
    before = db.read_bytes()
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as holder:
        holder.execute("BEGIN EXCLUSIVE")
        holder.execute("UPDATE studies SET study_name = study_name")
        done = sweep_cli("status", db, cwd=tmp_path)
        holder.execute("ROLLBACK")
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: cannot read {db} now: another process holds it locked") and "damaged" not in line
    assert "run the command again once it ends" in line, line
    assert db.read_bytes() == before
    done = sweep_cli("status", db, cwd=tmp_path)
    assert done.returncode == 0 and "plain" in done.stdout, done.stderr


@pytest.mark.parametrize("command", ["status", "best", "trials", "report", "reproduce"])
def test_read_commands_on_a_missing_database_create_nothing(tmp_path: Path, command: str) -> None:
    trial = ["0"] if command == "reproduce" else []  # reproduce's study name is its TARGET
    by_name = ["x", *trial] if trial else ["--study-name", "x"]
    for args in ([command, tmp_path / "missing.db", *trial],
                 [command, *by_name, "--storage", f"sqlite:///{tmp_path / 'missing.db'}"]):
        done = sweep_cli(*args, cwd=tmp_path)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert "missing.db" in line, line
        assert list(tmp_path.iterdir()) == []


def test_a_study_database_in_a_folder_that_is_not_writable_says_so(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite writes its -shm beside a WAL database even to read it: in a read-only folder the read fails, and the
    line says the folder is not writable (the file is fine), not that the file may be damaged."""
    import os

    folder = tmp_path / "ro"
    folder.mkdir()
    db = folder / "theirs.db"
    optuna.create_study(study_name="theirs", storage=f"sqlite:///{db}")
    with contextlib.closing(sqlite3.connect(db)) as connection:
        connection.execute("PRAGMA journal_mode=WAL")
    folder.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: the refusal SQLite and the folder give a user, simulated
        real_access, real_connect = os.access, sqlite3.connect
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != folder and real_access(path, mode))

        def connect(database: Any, *args: Any, **kwargs: Any) -> Any:
            if "?mode=" in str(database):  # the check's read, read-only or not: SQLite's -shm cannot be made
                raise sqlite3.OperationalError("attempt to write a readonly database")
            return real_connect(database, *args, **kwargs)

        monkeypatch.setattr(sqlite3, "connect", connect)
    try:
        done = sweep_cli("status", db, cwd=tmp_path)
    finally:
        folder.chmod(0o755)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line == (f"error: cannot read {db}: its folder {folder} is not writable, and SQLite writes its -wal and "
                    "-shm files beside the database; make the folder writable, or copy the .db to one that is"), line


@pytest.mark.parametrize("command", ["best", "report"])
def test_an_output_in_a_folder_that_is_not_writable_is_one_line_and_nothing_is_written(
        tmp_path: Path, command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    optuna.create_study(study_name="theirs", storage=f"sqlite:///{tmp_path / 'theirs.db'}")
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: the folder's refusal to a user, simulated
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != folder and real_access(path, mode))
    try:
        done = sweep_cli(command, "theirs.db", "-o", folder / "out", cwd=tmp_path)
    finally:
        folder.chmod(0o755)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: -o: cannot write {folder / 'out'}: the folder {folder} is "
                                                "not writable"]
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("command", ["best", "report"])
def test_an_output_that_is_a_fifo_or_a_link_is_written_through_never_replaced(tmp_path: Path, command: str) -> None:
    """`-o /dev/stdout`, `-o /dev/null` or a FIFO is written to, and a link's target is written (the link stays):
    renaming a temporary file over them replaced them (run as root, `-o /dev/null` replaced the machine's
    /dev/null with a regular file)."""
    import os
    import stat
    import threading

    write_study(tmp_path, TINY_STUDY)
    assert sweep_cli("run", "study.yaml", cwd=tmp_path).returncode == 0
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()  # a FIFO's writer waits for a reader: this one reads until the writer closes it
    done = sweep_cli(command, "study.yaml", "-o", fifo, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert stat.S_ISFIFO(fifo.lstat().st_mode), "the FIFO was replaced by a file"
    reader.join(timeout=120)
    assert received and received[0].strip(), "nothing came through the FIFO"

    target = tmp_path / "kept" / "out.txt"
    target.parent.mkdir()
    link = tmp_path / "latest"
    link.symlink_to(target)
    done = sweep_cli(command, "study.yaml", "-o", link, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and target.read_bytes()[:60] == received[0][:60]  # (best's header names its path)
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.txt"]  # no temporary file left beside it


@pytest.mark.parametrize("module", ['raise RuntimeError("boom at import")\n', "import sys\nsys.exit(3)\n"],
                         ids=["raises", "exits"])
def test_a_task_module_that_fails_at_import_is_refused_in_one_line_creating_nothing(tmp_path: Path,
                                                                                     module: str) -> None:
    name = f"broken_task_{'raises' if 'raise' in module else 'exits'}"
    (tmp_path / f"{name}.py").write_text(module)
    write_study(tmp_path, {**TINY_STUDY, "task": f"{name}:task"})
    done = sweep_cli("run", "study.yaml", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    raised = (f"RuntimeError: boom at import (at {name}.py:1)" if "raise" in module
              else f"SystemExit: 3 (at {name}.py:2)")
    assert line == f"error: study.yaml: task: cannot import task module '{name}': importing it raised {raised}", line
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == [f"{name}.py", "study.yaml"]


@pytest.mark.parametrize("where", ["inputs", "targets"])
def test_a_user_task_whose_validation_data_holds_nan_is_refused_before_any_trial(tmp_path: Path, where: str) -> None:
    """Found by review: one NaN in a user's task's validation data made every trial's first evaluation NaN, each
    trial pruned as if its config had diverged, and nothing named the data."""
    name = f"nan_val_{where}"
    (tmp_path / f"{name}.py").write_text(
        "import dataclasses\n"
        "from trainer.tasks import blobs\n"
        "def task():\n"
        "    base = blobs()\n"
        "    x, y = base.val[0].clone(), base.val[1].clone().float()\n"
        f"    {'x[3, 1]' if where == 'inputs' else 'y[3]'} = float('nan')\n"
        "    return dataclasses.replace(base, name='mine', val=(x, y), loss=lambda out, target: "
        "(out[:, 0] - target).pow(2).mean())\n")
    write_study(tmp_path, {**TINY_STUDY, "task": f"{name}:task"})
    done = sweep_cli("run", "study.yaml", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line == (f"error: study.yaml: task: task 'mine': its validation {where} hold NaN or infinity (sample 3): "
                    "every trial's evaluation would be NaN, and each trial pruned as if its config diverged; clean "
                    "the data or leave those samples out"), line
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == [f"{name}.py", "study.yaml"]


def test_an_output_in_the_checkpoint_store_or_under_a_file_is_refused_and_a_users_tmp_file_is_kept(
        tmp_path: Path) -> None:
    """`-o` onto a checkpoint blob replaced it (`sweep check` then found it corrupt); `-o f/r.html` with `f` a file
    said the folder did not exist; `-o best.yaml` wrote over, then removed, the user's `best.yaml.tmp`."""
    write_study(tmp_path, TINY_STUDY)
    assert sweep_cli("run", "study.yaml", cwd=tmp_path).returncode == 0
    blob = next((tmp_path / "tiny.checkpoints" / "tiny").glob("*.pt"))
    before = blob.read_bytes()
    for command in ("best", "report"):
        done = sweep_cli(command, "study.yaml", "-o", blob, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert line.startswith(f"error: -o: {blob} is inside the study's checkpoint store "), line
    assert blob.read_bytes() == before
    assert sweep_cli("check", "study.yaml", cwd=tmp_path).returncode == 0

    (tmp_path / "f").write_text("a file\n")
    done = sweep_cli("report", "study.yaml", "-o", "f/r.html", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: -o: {tmp_path / 'f'} is a file, not a folder; expected a "
                                                "file to write in a folder"]

    (tmp_path / "best.yaml.tmp").write_text("my notes\n")
    assert sweep_cli("best", "study.yaml", "-o", "best.yaml", cwd=tmp_path).returncode == 0
    assert (tmp_path / "best.yaml.tmp").read_text() == "my notes\n"
    assert (tmp_path / "best.yaml").read_text().startswith("# best trial of study 'tiny'")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".best.yaml")]  # no temporary file left


def test_an_output_in_the_study_s_tracking_folders_or_its_slurm_job_s_files_is_refused(tmp_path: Path) -> None:
    """Review: `sweep report -o NAME.tensorboard/NAME/.sweep-owner.json` wrote HTML over the owner file (every rerun
    was then refused), and `-o` replaced a TensorBoard event file, an MLflow artifact and a Slurm job's storage file
    (every requeued task failed), exit 0: only the checkpoint store was protected."""
    write_study(tmp_path, changed(tracking={"tensorboard": True, "mlflow": True}))
    assert sweep_cli("run", "study.yaml", cwd=tmp_path).returncode == 0
    board = tmp_path / "tiny.tensorboard" / "tiny"
    job = tmp_path / "tiny.slurm"
    job.mkdir()
    for name in ("submit.sbatch", "storage-0123abcd.json", "4242_0.log"):
        (job / name).write_text(f"{name}\n")
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}")
    study.set_user_attr("sweep.slurm_jobs", [{"job_id": "4242", "tasks": 1, "log_dir": str(job),
                                              "submitted_at": time.time()}])
    owned = [board / ".sweep-owner.json", next(board.rglob("events.out.tfevents.*")),
             next(p for p in (tmp_path / "tiny.mlflow-artifacts").rglob("*") if p.is_file())]
    slurm = [job / name for name in ("submit.sbatch", "storage-0123abcd.json", "4242_0.log")]
    for path in owned + slurm:
        before = path.read_bytes()
        for command in ("best", "report"):
            done = sweep_cli(command, "study.yaml", "-o", path, cwd=tmp_path)
            assert done.returncode == 2, done.stderr
            [line] = done.stderr.strip().splitlines()
            if command == "best" and path.suffix == ".json":  # refused as a YAML file named .json first
                continue
            assert line.startswith(f"error: -o: {path} is "), line
            assert ("Slurm job 4242" if path in slurm else "inside the study's ") in line, line
        assert path.read_bytes() == before
    assert sweep_cli("run", "study.yaml", "--n-trials", "4", cwd=tmp_path).returncode == 0  # its owner file intact
    done = sweep_cli("report", "study.yaml", "-o", job / "report.html", cwd=tmp_path)  # a file of the user's there
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("command", ["dashboard", "tensorboard"])
def test_a_server_that_cannot_listen_is_one_line_before_it_starts(tmp_path: Path, command: str) -> None:
    """A port in use or a host that is not this machine's: one line naming the option (both servers' own errors were
    60-line tracebacks)."""
    import socket

    pytest.importorskip("optuna_dashboard" if command == "dashboard" else "tensorboard")
    document = {**TINY_STUDY, "n_trials": 1, "tracking": {"tensorboard": True}}
    write_study(tmp_path, document)
    assert sweep_cli("run", "study.yaml", cwd=tmp_path).returncode == 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = sweep_cli(command, "study.yaml", "--port", str(port), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: --port: {port} is in use on 127.0.0.1; choose another port"]
    done = sweep_cli(command, "study.yaml", "--host", "no such host!", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: --host: cannot resolve 'no such host!': "), line


def test_a_read_only_database_is_refused_before_the_run_saying_so(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """It was Optuna's "StorageInternalError: An exception is raised during the commit ... e.g. exceeding max
    length", which says neither the file nor why."""
    import os

    write_study(tmp_path, {**TINY_STUDY, "n_trials": 1})
    assert sweep_cli("run", "study.yaml", cwd=tmp_path).returncode == 0
    db = tmp_path / "tiny.db"
    db.chmod(0o444)
    if os.geteuid() == 0:  # root writes any file: the file's refusal to a user, simulated
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: (Path(path) != db or not mode & os.W_OK)
                            and real_access(path, mode))
    before = db.read_bytes()
    try:
        done = sweep_cli("run", "study.yaml", "--n-trials", "2", cwd=tmp_path)
    finally:
        db.chmod(0o644)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: study.yaml: storage: cannot write {db}: the file is read-only (permission denied), and the study's "
        "trials are written there; make it writable (chmod u+w), or copy it"]
    assert db.read_bytes() == before


def test_an_output_to_dev_stdout_appended_to_a_log_keeps_the_log(tmp_path: Path) -> None:
    """`sweep best -o /dev/stdout >> log.txt`: /dev/stdout stands for the log file the shell opened in append mode;
    renaming a temporary file over it replaced the log, losing what it held."""
    write_study(tmp_path, {**TINY_STUDY, "n_trials": 1})
    assert sweep_cli("run", "study.yaml", cwd=tmp_path).returncode == 0
    log = tmp_path / "log.txt"
    log.write_text("earlier line\n")
    with log.open("a") as appended:
        done = subprocess.run([sys.executable, "-m", "sweep.cli", "best", "study.yaml", "-o", "/dev/stdout"],
                              stdout=appended, stderr=subprocess.PIPE, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier line" and lines[1].startswith("# best trial of study 'tiny'"), lines


def test_a_checkpoint_folder_another_database_s_study_of_that_name_owns_is_refused(tmp_path: Path) -> None:
    # Two databases (two PostgreSQL databases behind one default `sweep-checkpoints/`, or here two SQLite files with
    # one `checkpoints.store`) holding a study of one name: the second would overwrite the first's blobs (the same
    # names) and its `sweep check --repair` would delete them as orphans. It is refused before any trial runs.
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 1, "checkpoints": {"store": "shared", "artifacts": False}}
    path = write_study(tmp_path, document)
    first = sweep_cli("run", path, "--storage", f"sqlite:///{tmp_path / 'a.db'}")
    assert first.returncode == 0, first.stderr
    folder = tmp_path / "shared" / "tiny"
    blobs = {p.name: p.read_bytes() for p in folder.glob("*.pt")}
    assert blobs
    second = sweep_cli("run", path, "--storage", f"sqlite:///{tmp_path / 'b.db'}")
    assert second.returncode == 2
    line = second.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {path}: checkpoints.store: the checkpoint folder {folder.resolve()} belongs to "
                           "another study named 'tiny'"), line
    assert {p.name: p.read_bytes() for p in folder.glob("*.pt")} == blobs  # untouched
    assert not (tmp_path / "b.db").exists()  # refused before anything was made: no study half-created
    # A study of that name that b.db holds already (its checkpoints elsewhere) is refused the shared folder too.
    own = write_study(tmp_path, document | {"checkpoints": {"store": "own", "artifacts": False}}, "own.yaml")
    assert sweep_cli("run", own, "--storage", f"sqlite:///{tmp_path / 'b.db'}").returncode == 0
    second = sweep_cli("run", path, "--storage", f"sqlite:///{tmp_path / 'b.db'}")  # and it ran with its own store
    assert second.returncode == 2 and f"is not the store study 'tiny' ran with ({tmp_path / 'own'}" in second.stderr, \
        second.stderr
    assert len(optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'b.db'}").trials) == 1
    refused = sweep_cli("check", path, "--storage", f"sqlite:///{tmp_path / 'b.db'}", "--repair")
    assert refused.returncode == 2 and "nothing checked or repaired" in refused.stderr
    assert {p.name: p.read_bytes() for p in folder.glob("*.pt")} == blobs
    # Its own study goes on with it: a rerun, and a check that does not take the owner file for an orphan.
    again = sweep_cli("run", path, "--storage", f"sqlite:///{tmp_path / 'a.db'}", "--n-trials", "2")
    assert again.returncode == 0, again.stderr
    checked = sweep_cli("check", path, "--storage", f"sqlite:///{tmp_path / 'a.db'}")
    assert checked.returncode == 0 and "orphan_file 0" in checked.stderr, checked.stdout + checked.stderr


def test_a_sqlite_file_s_default_checkpoint_folder_is_refused_to_another_database_s_study(tmp_path: Path) -> None:
    # The default folder beside a SQLite file (tiny.checkpoints/) was never marked as its study's: a study of that
    # name in another database, its checkpoints.store pointed there, ran, wrote blobs of the same names, and its
    # `sweep check --repair` deleted the first study's checkpoints as orphans.
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 1})
    assert sweep_cli("run", path).returncode == 0
    folder = tmp_path / "tiny.checkpoints" / "tiny"
    blobs = {p.name: p.read_bytes() for p in folder.glob("*.pt")}
    assert blobs
    other = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {
        "n_trials": 1, "storage": "sqlite:///other.db", "checkpoints": {"store": "tiny.checkpoints"}}, "other.yaml")
    refused = sweep_cli("run", other)
    assert refused.returncode == 2, refused.stderr
    assert f"checkpoints.store: the checkpoint folder {folder.resolve()} belongs to another study named 'tiny'" \
        in refused.stderr.strip().splitlines()[-1], refused.stderr
    assert not (tmp_path / "other.db").exists()
    repair = sweep_cli("check", other, "--repair")  # no such study in other.db: nothing to repair, nothing deleted
    assert repair.returncode != 0 and {p.name: p.read_bytes() for p in folder.glob("*.pt")} == blobs
    # Its own file's study goes on with it; a file deleted to start over takes its default folder back.
    assert sweep_cli("run", path, "--n-trials", "2").returncode == 0
    (tmp_path / "tiny.db").unlink()
    again = sweep_cli("run", path)
    assert again.returncode == 0, again.stderr
    assert sweep_cli("run", other).returncode == 2


def test_a_sqlite_file_s_study_is_refused_its_default_folder_where_another_database_s_study_ran_first(
        tmp_path: Path) -> None:
    # The other order: another database's study wrote into tiny.checkpoints/ first. The file's own study took the
    # folder over without a word, and its `check --repair` would have deleted the other's blobs as orphans.
    other = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {
        "n_trials": 1, "storage": "sqlite:///other.db", "checkpoints": {"store": "tiny.checkpoints"}}, "other.yaml")
    assert sweep_cli("run", other).returncode == 0
    folder = tmp_path / "tiny.checkpoints" / "tiny"
    blobs = {p.name: p.read_bytes() for p in folder.glob("*.pt")}
    assert blobs
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 1})
    refused = sweep_cli("run", path)
    assert refused.returncode == 2 and "belongs to another study named 'tiny'" in refused.stderr, refused.stderr
    assert not (tmp_path / "tiny.db").exists()
    assert {p.name: p.read_bytes() for p in folder.glob("*.pt")} == blobs
    assert sweep_cli("run", other, "--n-trials", "2").returncode == 0  # the folder stays the other study's


@pytest.mark.parametrize("damage", ["garbled", "a folder"])
def test_a_garbled_owner_file_refuses_the_folder_to_every_study_until_it_is_restored_or_deleted(
        tmp_path: Path, damage: str) -> None:
    # Review: an owner file that no longer parses was taken for none: another database's study of this name wrote
    # into the folder, and its `sweep check --repair` deleted this study's checkpoints (a pinned one too) as orphans.
    # So was one there that cannot be read at all (a folder in its place here; one the worker may not read, EACCES,
    # takes the same path, which a test run as root cannot show).
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 1})
    assert sweep_cli("run", path).returncode == 0
    folder = tmp_path / "tiny.checkpoints" / "tiny"
    blobs = {p.name: p.read_bytes() for p in folder.glob("*.pt")}
    assert blobs
    mark = folder / ".sweep-owner.json"
    if damage == "garbled":
        mark.write_text("{garbage")
    else:
        mark.unlink()
        mark.mkdir()
    other = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {
        "n_trials": 1, "storage": "sqlite:///other.db", "checkpoints": {"store": "tiny.checkpoints"}}, "other.yaml")
    for command in (("run", other), ("check", path, "--repair"), ("run", path, "--n-trials", "2")):
        refused = sweep_cli(*command)
        assert refused.returncode == 2, refused.stderr
        assert f"the owner file {folder.resolve() / '.sweep-owner.json'} is unreadable" in refused.stderr, \
            refused.stderr
    assert {p.name: p.read_bytes() for p in folder.glob("*.pt")} == blobs and not (tmp_path / "other.db").exists()
    if damage == "garbled":  # the folder is this study's alone: the next run marks it again
        mark.unlink()
    else:
        mark.rmdir()
    assert sweep_cli("run", path, "--n-trials", "2").returncode == 0
    assert json.loads(mark.read_text())["study"] == "tiny"


def test_a_sqlite_file_damaged_where_only_a_trial_s_write_reaches_ends_the_run_and_fails_no_trial(
        tmp_path: Path) -> None:
    """Files review: damage in a page only a running trial writes (its heartbeats) failed that trial as its
    config's fault ("StorageInternalError ... malformed"), counted in n_trials, and every rerun burned one more. The
    run ends with the damaged file's line (exit 2) and the trial is left running: found lost, retried once the
    file is fixed, never counted."""
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 2, "heartbeat_interval": 1,
                                                               "heartbeat_grace_period": 2})
    assert sweep_cli("run", path).returncode == 0
    db = tmp_path / "tiny.db"
    with contextlib.closing(sqlite3.connect(db)) as connection:
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        [(root,)] = connection.execute("SELECT rootpage FROM sqlite_master WHERE name = 'trial_heartbeats'").fetchall()
        [(size,)] = connection.execute("PRAGMA page_size").fetchall()
    data = bytearray(db.read_bytes())
    data[(root - 1) * size:root * size] = bytes(size)  # the whole page zeroed, as `dd if=/dev/zero` leaves it
    db.write_bytes(bytes(data))
    for _ in range(2):
        done = run_cli("run", path, "--n-trials", "3")
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines()[-1] == (
            f"error: {db} cannot be read (database disk image is malformed); is the file damaged?"), done.stderr
    with contextlib.closing(sqlite3.connect(db)) as connection:
        states = [state for (state,) in connection.execute("SELECT state FROM trials ORDER BY number")]
    assert "FAIL" not in states, states  # nothing counted against the budget


def test_a_damaged_sqlite_file_of_the_trial_s_own_fails_that_trial_not_the_run(tmp_path: Path) -> None:
    """Diff review: once a damaged study database ended the run, any "malformed" SQLite error a trial raised did,
    naming the study's sound database, where it is the trial's own data the trial's code reads: its config's error."""
    data = tmp_path / "data.sqlite"
    with contextlib.closing(sqlite3.connect(data)) as connection:
        connection.execute("CREATE TABLE t (x INTEGER, pad TEXT)")
        connection.executemany("INSERT INTO t VALUES (?, ?)", [(i, "x" * 50) for i in range(5000)])
        connection.commit()
    raw = bytearray(data.read_bytes())
    raw[4096::7] = bytes([0xAB]) * len(raw[4096::7])
    data.write_bytes(bytes(raw))
    (tmp_path / "reads_data.py").write_text(
        "import sqlite3\n\n"
        "def main(config, run):\n"
        f"    sqlite3.connect({str(data)!r}).execute('SELECT sum(x) FROM t').fetchall()\n"
        "    run.report(1, 1.0)\n")
    document = {"name": "own", "n_trials": 2, "seed": 0, "sampler": {"type": "random"}, "pruner": "none",
                "loop": "reads_data:main", "max_repeated_failures": 0, "fixed": {"max_steps": 1},
                "space": {"x": {"type": "float", "low": 0, "high": 1}}}
    path = write_study(tmp_path, document)
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 1 and "is the file damaged" not in done.stderr, done.stderr  # every trial failed: 1
    assert done.stderr.count("failed: DatabaseError: database disk image is malformed") == 2, done.stderr
    with contextlib.closing(sqlite3.connect(tmp_path / "own.db")) as connection:
        assert [s for (s,) in connection.execute("SELECT state FROM trials ORDER BY number")] == ["FAIL", "FAIL"]


@pytest.mark.parametrize(("table", "fill"), [("trial_values", 0), ("studies", 0xAA), ("version_info", 0xAA)])
def test_a_sqlite_file_damaged_past_its_first_pages_is_one_line_from_every_command(
        tmp_path: Path, table: str, fill: int) -> None:
    """Damage that the opening check does not read (it reads the schema) came out of every command as a 120-line
    traceback ending in Optuna's "invalid data in the commit". Found by review: a page Optuna reads as it opens the
    storage, garbled, was "cannot open storage ...: DatabaseError: database disk image is malformed" (or `run`'s
    "KeyError: 'Record does not exist.'") with exit 1, where a file cut short is "is the file damaged?", exit 2."""
    path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"n_trials": 3})
    assert sweep_cli("run", path).returncode == 0
    db = tmp_path / "tiny.db"
    with contextlib.closing(sqlite3.connect(db)) as connection:  # the page that holds the table's rows
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page in the file itself
        [(root,)] = connection.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchall()
        [(size,)] = connection.execute("PRAGMA page_size").fetchall()
    data = bytearray(db.read_bytes())
    start = (root - 1) * size
    data[start + 8:start + size] = bytes([fill]) * (size - 8)  # its cells gone or garbled, its header kept
    db.write_bytes(bytes(data))
    before = db.read_bytes()
    for command in (("status", db), ("trials", db), ("best", db), ("run", path)):
        done = run_cli(*command)  # a process of its own: this one's SQLite connections cache the pages as they were
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (command, done.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and "tiny.db" in lines[0], (command, done.stderr)
        assert "cannot be read" in lines[0] and lines[0].endswith("; is the file damaged?"), lines
    assert db.read_bytes() == before  # nothing written into the damaged file


def test_a_sqlite_error_that_is_no_damage_is_not_called_damage() -> None:
    """Only a damaged file is "is the file damaged?" (exit 2); a broken constraint or a closed connection is a bug
    or a race, and stays a traceback with its cause."""
    from sweep.cli import _storage_error

    for error in (sqlite3.IntegrityError("UNIQUE constraint failed: trials.number"),
                  sqlite3.ProgrammingError("Cannot operate on a closed database.")):
        assert _storage_error(error) == (None, 0)
    line, code = _storage_error(sqlite3.DatabaseError("database disk image is malformed"))
    assert code == 2 and line is not None and line.endswith("is the file damaged?")


def test_a_database_on_a_read_only_filesystem_is_refused_naming_the_filesystem(tmp_path: Path) -> None:
    """A read-only mount (a finished job's data, a snapshot) was called "permission denied", with chmod as the fix."""
    import shutil

    write_study(tmp_path, {**TINY_STUDY, "n_trials": 1})
    assert sweep_cli("run", "study.yaml", cwd=tmp_path).returncode == 0
    view = tmp_path / "view"
    view.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "--bind", "-o", "ro", str(tmp_path), str(view)],
                                                       capture_output=True).returncode != 0:
        pytest.skip("no read-only bind mount here (it needs root)")
    try:
        import gc

        gc.collect()  # the first run's engines, closed now: their last connection's checkpoint of the WAL is not this
        before = (view / "tiny.db").read_bytes()  # run's write (found as a flaky failure in CI)
        done = sweep_cli("run", "study.yaml", "--n-trials", "2", cwd=view)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"error: study.yaml: storage: cannot write {view / 'tiny.db'}: it lies on a read-only filesystem, and the "
            "study's trials are written there; give a SQLite file on a writable one, or copy it there",
            "error: study.yaml: checkpoints.store (default: next to the SQLite file): cannot create folders in "
            f"{view / 'tiny.checkpoints' / 'tiny'}: it lies on a read-only filesystem"]
        assert (view / "tiny.db").read_bytes() == before
    finally:
        subprocess.run(["umount", "--lazy", str(view)], check=True)


def test_one_study_moved_out_of_a_store_it_shares_with_another_goes_on_from_its_new_folder(tmp_path: Path) -> None:
    # Found by review: two studies in one store folder, one study's folder moved to another store as the refusal
    # said: the rerun was refused for good (the old store still held the other study), and a database-only
    # `check --repair` deleted the moved study's rows. Each study's own folder in the store is what is looked at.
    base = copy.deepcopy(TINY_STUDY) | {"n_trials": 1, "checkpoints": {"store": "ck"}}
    a = write_study(tmp_path, base | {"name": "a"}, "a.yaml")
    b = write_study(tmp_path, base | {"name": "b"}, "b.yaml")
    assert sweep_cli("run", a, "--storage", f"sqlite:///{tmp_path / 'a.db'}").returncode == 0
    assert sweep_cli("run", b, "--storage", f"sqlite:///{tmp_path / 'b.db'}").returncode == 0
    (tmp_path / "ck2").mkdir()
    (tmp_path / "ck" / "a").rename(tmp_path / "ck2" / "a")
    refused = sweep_cli("check", tmp_path / "a.db", "--repair")  # the database alone names the old store
    assert refused.returncode == 2 and "is not there (moved or deleted?)" in refused.stderr, refused.stderr
    write_study(tmp_path, base | {"name": "a", "checkpoints": {"store": "ck2"}}, "a.yaml")
    done = sweep_cli("run", a, "--storage", f"sqlite:///{tmp_path / 'a.db'}", "--n-trials", "2")
    assert done.returncode == 0, done.stderr
    with contextlib.closing(sqlite3.connect(tmp_path / "a.db")) as connection:
        assert {n for (n,) in connection.execute("SELECT trial_number FROM sweep_checkpoints")} == {0, 1}
    # Its dashboard artifact stayed in the old store's `_artifacts/`: rebuilt in the new one from its sound blob.
    repaired = sweep_cli("check", tmp_path / "a.db", "--repair")
    assert repaired.returncode == 0 and "dangling_artifact" in repaired.stdout, repaired.stdout + repaired.stderr
    with contextlib.closing(sqlite3.connect(tmp_path / "a.db")) as connection:
        assert {n for (n,) in connection.execute("SELECT trial_number FROM sweep_checkpoints")} == {0, 1}
    assert sweep_cli("check", tmp_path / "a.db").returncode == 0
    assert sweep_cli("check", b, "--storage", f"sqlite:///{tmp_path / 'b.db'}").returncode == 0


def test_a_store_under_the_home_folder_is_the_home_folder_s_from_any_working_folder(tmp_path: Path) -> None:
    # Found by review: `store: ~/ck` wrote blobs to a folder literally named `~` in the working folder (the owner file
    # went to the real home), so a rerun from another folder lost its checkpoints' rows without a word.
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    (work / "elsewhere").mkdir(parents=True)
    path = write_study(work, copy.deepcopy(TINY_STUDY) | {"n_trials": 1, "checkpoints": {"store": "~/ck"}})
    assert sweep_cli("run", path, cwd=work, env={"HOME": str(home)}).returncode == 0
    assert list((home / "ck" / "tiny").glob("*.pt"))
    again = sweep_cli("run", path, "--n-trials", "2", cwd=work / "elsewhere", env={"HOME": str(home)})
    assert again.returncode == 0, again.stderr
    assert not list(tmp_path.rglob("~"))
    with contextlib.closing(sqlite3.connect(work / "tiny.db")) as connection:
        assert {n for (n,) in connection.execute("SELECT trial_number FROM sweep_checkpoints")} == {0, 1}


def test_a_key_holding_a_terminal_escape_sequence_is_printed_escaped(tmp_path: Path) -> None:
    # Found by review: values were quoted with their escapes, keys printed raw: a study file could retitle or clear
    # the terminal of whoever ran it. Every error line is printed with its control characters escaped.
    study = tmp_path / "study.yaml"
    study.write_text('name: t\nn_trials: 1\ntask: digits\n"\\e]0;pwned\\a": 1\n')
    done = sweep_cli("run", study)
    assert done.returncode == 2, done.stderr
    assert "\x1b" not in done.stderr and "\x07" not in done.stderr, repr(done.stderr)
    assert "study.yaml: \\x1b]0;pwned\\x07: unknown key" in done.stderr, done.stderr
    assert not (tmp_path / "t.db").exists()



def test_a_sqlite_storage_under_the_home_folder_opens_the_home_folder_s_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sqlite:///~/studies/x.db` is the home folder's file, as a checkpoint store's `~/ckpts` is (SQLAlchemy opened
    a folder named `~` in the working folder, and the run refused it as missing), in a study file, in `--storage`
    and in a reading command's `--storage`."""
    home = tmp_path / "home"
    (home / "studies").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    path = write_study(tmp_path, changed(n_trials=1, storage="sqlite:///~/studies/tiny.db"))
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    assert (home / "studies" / "tiny.db").is_file() and not (tmp_path / "work" / "~").exists()
    for args in (["--storage", "sqlite:///~/studies/tiny.db", "--n-trials", "2"], []):
        done = sweep_cli("run", path, *args)
        assert done.returncode == 0, done.stderr
    shown = sweep_cli("status", "--storage", "sqlite:///~/studies/tiny.db", "--study-name", "tiny")
    assert shown.returncode == 0 and "2/1 trials" in shown.stdout, shown.stdout + shown.stderr  # the file's budget


@pytest.mark.parametrize("storage", [None, "sqlite:///tiny.db"])
@pytest.mark.parametrize("folder", ["exp%41", "what?", "a%20b"])
def test_a_study_in_a_folder_whose_name_reads_as_url_escapes_keeps_all_its_files_there(
        tmp_path: Path, folder: str, storage: str | None) -> None:
    """Found by review: the default storage's URL was the folder's path as written, and SQLAlchemy decodes `%41`
    and ends the path at `?`: a study in `exp%41/` put its database in `expA/` (an existing folder) and its lock and
    checkpoints in `exp%41/`, and `sweep status` then found no study there."""
    (tmp_path / "expA").mkdir()
    (tmp_path / "a b").mkdir()
    (tmp_path / folder).mkdir()
    path = write_study(tmp_path / folder, changed(n_trials=1, checkpoints={"every_steps": 10},
                                                  **({"storage": storage} if storage else {})))
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    assert (path.parent / "tiny.db").is_file(), sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert not any((tmp_path / other / "tiny.db").exists() for other in ("expA", "a b", "what"))
    assert list((path.parent / "tiny.checkpoints").rglob("*.pt")), done.stdout
    shown = sweep_cli("status", path)
    assert shown.returncode == 0 and "1/1" in shown.stdout, shown.stdout + shown.stderr


def _sweep(args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`sweep ARGS` in a shell (for its redirections), as a user types it."""
    return subprocess.run(f"{shlex.quote(sys.executable)} -m sweep {args}", shell=True, capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **env}, timeout=300)


def test_the_command_s_output_streams_never_stop_it_nor_are_blamed_on_the_database(tmp_path: Path) -> None:
    """Found by review: a reading command whose stdout was a full disk, or could not encode the table's `…`, said
    the database could not be read ("was the database edited by hand?"); `sweep run` with stdout on a full disk
    printed a traceback after its trials; with stdout closed every command failed as it loaded (`best -o FILE` too,
    which needs no stdout); `best -o -` wrote a file named `-`; and the trials table kept columns empty in every row."""
    path = write_study(tmp_path, changed(n_trials=2))
    assert sweep_cli("run", path).returncode == 0
    if Path("/dev/full").exists():
        for command in ("status study.yaml", "trials study.yaml", "best study.yaml", "run study.yaml"):
            done = _sweep(f"{command} > /dev/full", tmp_path)
            assert done.returncode == 1, (command, done.stderr)
            assert "error: cannot write the output to stdout: No space left on device" in done.stderr, done.stderr
            assert "Traceback" not in done.stderr and "cannot read the study" not in done.stderr, done.stderr
    done = _sweep("trials study.yaml", tmp_path, PYTHONIOENCODING="ascii", COLUMNS="300")
    assert done.returncode == 0 and "number" in done.stdout, done.stderr
    done = _sweep("best study.yaml -o best.yaml >&-", tmp_path)
    assert done.returncode == 0 and (tmp_path / "best.yaml").is_file(), done.stderr
    done = _sweep("best study.yaml -o -", tmp_path)
    assert done.returncode == 0 and yaml.safe_load(done.stdout)["task"] == "digits", done.stderr
    assert not (tmp_path / "-").exists()
    shown = sweep_cli("trials", path)
    assert shown.returncode == 0 and "warm_start_from" not in shown.stdout and "cohort" not in shown.stdout
    listed = sweep_cli("trials", path, "--format", "csv")
    assert "warm_start_from" in listed.stdout.splitlines()[0]  # CSV keeps its columns


def test_a_run_whose_progress_reader_left_trains_its_whole_budget(tmp_path: Path) -> None:
    """Found by review: `sweep run ... 2>&1 | head -2` stopped the run at the first line written after `head` left,
    silently, with exit 1 and trials untrained."""
    path = write_study(tmp_path, changed(n_trials=4))
    process = subprocess.Popen([sys.executable, "-m", "sweep", "run", str(path)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    assert process.stderr is not None
    process.stderr.readline()  # the first line, then the reader leaves
    process.stderr.close()
    assert process.wait(timeout=300) == 0
    assert [t.state for t in load(tmp_path / "tiny.db").get_trials()] == [TrialState.COMPLETE] * 4


def test_a_database_whose_first_run_was_cut_short_is_finished_not_refused(tmp_path: Path) -> None:
    """Found by review: a first run that gave up on a full disk left a database holding only Optuna's `studies`
    table, and every rerun refused it as "a SQLite database of another program". Optuna's tables, all empty, are a
    creation cut short: the rerun creates the rest. A `studies` table with rows is another program's still."""
    from optuna.storages._rdb.models import BaseModel
    from sqlalchemy import create_engine

    path = write_study(tmp_path, changed(n_trials=1))
    engine = create_engine(f"sqlite:///{tmp_path / 'tiny.db'}")
    BaseModel.metadata.tables["studies"].create(engine)
    engine.dispose()
    done = sweep_cli("run", path)
    assert done.returncode == 0, done.stderr
    assert load(tmp_path / "tiny.db").get_trials()[0].state == TrialState.COMPLETE

    for rows, columns in ((["(1, 'their own')"], "study_id INTEGER, study_name TEXT"), ([], "id INTEGER, title TEXT")):
        folder = tmp_path / f"theirs{len(rows)}"  # theirs: a row in it, or columns of their own (review: empty)
        folder.mkdir()
        path = write_study(folder, changed(n_trials=1))
        with contextlib.closing(sqlite3.connect(folder / "tiny.db")) as connection:
            connection.execute(f"CREATE TABLE studies ({columns})")
            for row in rows:
                connection.execute(f"INSERT INTO studies VALUES {row}")
            connection.commit()
        done = sweep_cli("run", path)
        assert done.returncode == 2 and "a SQLite database of another program" in done.stderr, done.stderr
        with contextlib.closing(sqlite3.connect(folder / "tiny.db")) as connection:
            assert [row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] \
                == ["studies"]  # nothing written into it


def test_the_run_s_opening_line_escapes_a_right_to_left_override_in_its_storage_path(tmp_path: Path) -> None:
    """Input review: `storage: sqlite:///a\u202eb.db` was accepted and the `study ... in ...` line printed the override
    raw (the text after it read reversed); every other line escapes it."""
    write_study(tmp_path, changed(n_trials=1))
    done = sweep_cli("run", "study.yaml", "--storage", "sqlite:///a\u202eb.db", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "\u202e" not in done.stderr and "in sqlite:///a\\u202eb.db: 0/1 trials done" in done.stderr, done.stderr


def test_a_study_whose_complete_trials_do_not_count_says_why_it_has_no_best(tmp_path: Path) -> None:
    """Review: `sweep status` printed "no trial has completed yet" beside `complete 1` (a value of -inf), and `sweep
    best` said the same of a sweep study whose one complete trial was added from outside."""
    from optuna.trial import create_trial

    plain = tmp_path / "plain.db"
    study = optuna.create_study(study_name="plain", storage=f"sqlite:///{plain}")
    study.add_trial(create_trial(value=float("-inf"), params={}, distributions={}))
    done = sweep_cli("status", plain, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "no trial has completed with a value to rank: of 1 complete, 1 has a value that is not a finite number" \
        in " ".join(done.stdout.split()), done.stdout

    path = write_study(tmp_path, changed(n_trials=1))
    made = open_study(load_spec(path)[0], f"sqlite:///{tmp_path / 'tiny.db'}")  # as `sweep run` makes it
    made.add_trial(create_trial(value=0.5, params={}, distributions={}))
    done = sweep_cli("best", path, cwd=tmp_path)
    assert done.returncode == 1
    assert "error: study 'tiny': no trial has completed with a value to rank: of 1 complete, 1 was not run by " \
           "sweep (added from outside: not counted)" in done.stderr, done.stderr


def test_another_tool_s_study_whose_attrs_share_sweep_s_names_is_read(tmp_path: Path) -> None:
    """Review: a plain Optuna study whose trials hold their own `cohort: "control"` and `steps: [100, 200]` made
    `sweep trials` and `sweep status` refuse it ("cannot read the study... edited by hand?")."""
    db = tmp_path / "theirs.db"
    study = optuna.create_study(study_name="theirs", storage=f"sqlite:///{db}")

    from sweep import outcomes

    names = {value for key, value in vars(outcomes).items() if key.startswith("ATTR_") and isinstance(value, str)}
    odd: list[Any] = ["x", [1, "x"], {"size": "big", "step": "s", "trial": "t"}, 0.5, True, -3]

    def objective(trial: optuna.Trial) -> float:
        for name in names | {"cohort", "interrupted", "speed"}:  # each of sweep's names, with another tool's value
            trial.set_user_attr(name, odd[trial.number])
        trial.report(0.5, 1)
        x = trial.suggest_float("x", 0, 1)
        if trial.number == 1:
            raise optuna.TrialPruned()
        if trial.number == 2:
            raise ValueError("theirs")
        return x

    study.optimize(objective, n_trials=len(odd), catch=(ValueError,))
    for args in (["status"], ["trials"], ["trials", "--format", "csv"], ["trials", "--format", "json"],
                 ["report", "-o", str(tmp_path / "r.html")]):
        done = sweep_cli(*args[:1], db, *args[1:], cwd=tmp_path)
        assert done.returncode == 0, (args, done.stderr)
    rows = json.loads(sweep_cli("trials", db, "--format", "json", cwd=tmp_path).stdout)
    assert [r["cohort"] for r in rows] == [None] * len(odd)


def test_a_word_s_own_invisible_characters_are_shown_as_they_are(tmp_path: Path) -> None:
    """Diff review: escaping what shows as nothing also escaped a Persian word's zero-width non-joiner and a
    no-break space in the trials' CSV and table, where a zero-width space (no word's own) is escaped."""
    (tmp_path / "words.py").write_text("def main(config, run):\n    return float(len(config['word']))\n")
    words = ["می\u200cخواهم", "café\u00a0noir", "zero\u200bwidth"]
    path = write_study(tmp_path, {"name": "words", "n_trials": 3, "loop": "words:main", "sampler": "bruteforce",
                                  "pruner": "none", "space": {"word": {"type": "categorical", "choices": words}}})
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 0
    done = sweep_cli("trials", path, "--format", "csv", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert words[0] in done.stdout and words[1] in done.stdout, done.stdout
    assert "zero\\u200bwidth" in done.stdout and words[2] not in done.stdout, done.stdout
