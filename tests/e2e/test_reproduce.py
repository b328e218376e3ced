"""`sweep reproduce`: a trial trains again from the storage alone, bit for bit on CPU."""

from __future__ import annotations

import contextlib
import copy
import sqlite3
from pathlib import Path

from tests.conftest import TINY_STUDY, run_cli, sweep_cli, write_study


def test_reproduce_passes_on_an_untouched_trial_and_fails_on_a_tampered_one(tmp_path: Path) -> None:
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 2, "pruner": {"type": "fastfail", "then": "median"}}
    document["fixed"] = {**document["fixed"], "model": {"dropout": 0.1}}  # randomness in training, seeded
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 0

    done = sweep_cli("reproduce", path, "1")
    assert done.returncode == 0, done.stderr
    assert "trial 1 reproduced: 3 reported values identical (bit for bit)" in done.stdout  # steps 0, 10, 20

    with sqlite3.connect(tmp_path / "tiny.db") as db:  # tamper with one stored value, as a bad merge might
        db.execute("UPDATE trial_intermediate_values SET intermediate_value = intermediate_value + 1e-6 "
                   "WHERE step = 10 AND trial_id = (SELECT trial_id FROM trials WHERE number = 1)")
    done = sweep_cli("reproduce", path, "1")
    assert done.returncode == 1
    assert "trial 1 differs first at step 10" in done.stderr
    assert "changed since" not in done.stderr  # the same data, libraries and machine: nothing else named
    assert sweep_cli("reproduce", path, "7").returncode == 2  # no such trial


def test_a_trial_whose_loss_diverged_reproduces_when_its_metric_is_another(tmp_path: Path) -> None:
    # The study stores its metric as NaN once the same evaluation's val_loss is not finite (accuracy still counts an
    # argmax of NaN logits); reproduce applies the same rule to the rerun, which is then identical.
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 1, "metric": "val_accuracy", "direction": "maximize"}
    document["fixed"] = {**document["fixed"], "optimizer": "sgd", "momentum": 0.9, "scheduler": "none"}
    document["space"] = {"learning_rate": {"type": "float", "low": 1e29, "high": 1e30, "log": True}}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 1  # its one trial failed: diverged
    with sqlite3.connect(tmp_path / "tiny.db") as db:
        stored = db.execute("SELECT step, intermediate_value_type FROM trial_intermediate_values").fetchall()
    assert sorted(stored) == [(10, "NAN"), (20, "NAN")]
    done = sweep_cli("reproduce", path, "0")
    assert done.returncode == 0, done.stderr
    assert "trial 0 reproduced: 2 reported values identical (bit for bit)" in done.stdout


def test_a_tolerance_is_relative_as_stated() -> None:
    from sweep.reproduce import agree

    # Found by review: an absolute part as large as the tolerance passed a cohort member's 0.13039 against 0.13048
    # (7e-4 relative) "within a relative 1e-4", and a GPU's val_loss of 0.05 against 0.0509 within 1e-3.
    assert not agree(0.13039, 0.13048, 1e-4)
    assert not agree(0.05, 0.0509, 1e-3)
    assert agree(0.13039, 0.13039 * (1 + 5e-5), 1e-4) and agree(2.5, 2.5 * (1 - 9e-4), 1e-3)
    assert agree(0.0, 1e-9, 1e-4)  # a value at about 0 is not failed on rounding alone
    assert not agree(0.1, 0.1 + 1e-12, 0.0) and agree(float("nan"), float("nan"), 0.0)


def test_a_replay_that_differs_names_what_changed_since_the_trial_ran(tmp_path: Path) -> None:
    import json

    import numpy as np
    import torch

    from trainer.tasks import load_task
    from trainer.tasks.digits import load_digits_arrays

    x, y = load_digits_arrays()
    files = {"train_x": x[:1400], "train_y": y[:1400], "val_x": x[1400:], "val_y": y[1400:]}
    for key, array in files.items():
        np.save(tmp_path / f"{key}.npy", array)
    args = {**{key: str(tmp_path / f"{key}.npy") for key in files}, "classes": 10}
    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 1, "task": {"name": "arrays", "args": args}}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 0
    with sqlite3.connect(tmp_path / "tiny.db") as db:
        (record,) = db.execute("SELECT value_json FROM trial_user_attributes WHERE key = 'reproducibility'").fetchone()
    then = json.loads(record)["data"]
    assert isinstance(then, str) and len(then) == 16

    done = sweep_cli("reproduce", path, "0")
    assert done.returncode == 0, done.stderr

    # The user's file changes under the study (one pixel of every image), and the record says the trial ran on an
    # older torch: a replay that differs names both, in the record's order. (A process of its own: this one keeps
    # the task it loaded, as a worker does.)
    edited = files["train_x"].copy()
    edited[:, 3] += 1.0
    np.save(tmp_path / "train_x.npy", edited)
    with sqlite3.connect(tmp_path / "tiny.db") as db:
        db.execute("UPDATE trial_user_attributes SET value_json = ? WHERE key = 'reproducibility'",
                   (json.dumps({**json.loads(record), "torch": "2.4.0"}),))
    done = run_cli("reproduce", path, "0")
    assert done.returncode == 1
    now = load_task("arrays", args).data_digest()
    assert now != then
    assert (f"; changed since the trial ran: the task's data (fingerprint) {then} then, {now} now; torch 2.4.0 then, "
            f"{torch.__version__} now") in done.stderr
    # Its data gone altogether: the replay's own error, not the database's (review: "cannot read the study ... was
    # the database edited by hand", exit 1, once the task was loaded outside the replay).
    (tmp_path / "val_y.npy").unlink()
    gone = run_cli("reproduce", path, "0")
    assert gone.returncode == 2 and "trial 0's replay raised FileNotFoundError" in gone.stderr, gone.stderr


def test_a_trial_killed_before_its_end_is_replayed_on_the_threads_it_trained_with(tmp_path: Path) -> None:
    # A trial that never ended by its own hand (lost, killed) had no reproducibility record: its replay ran on this
    # process's thread count, not the worker's (one, for a worker of `--workers 2` on two cores), and differed in the
    # last digits with nothing named (review). Its threads are stored as it starts now.
    import os
    import signal
    import subprocess
    import sys
    import time

    import torch

    document = copy.deepcopy(TINY_STUDY) | {"name": "killed", "n_trials": 1, "pruner": "none"}
    document["fixed"] = {**document["fixed"], "max_steps": 100_000, "eval_every_steps": 20, "log_every_steps": 20,
                         "warmup_steps": 30, "curriculum": {"start_level": 0.2, "end_fraction": 0.5,
                                                            "schedule": "step", "stages": 3}}
    path = write_study(tmp_path, document)
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        run = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path)], stdout=out,
                               stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 300
        reported = 0
        while reported < 3:  # steps 0, 20 and 40 stored
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
            if (tmp_path / "killed.db").exists():
                with contextlib.closing(sqlite3.connect(tmp_path / "killed.db", timeout=30)) as db:
                    try:
                        reported = db.execute("SELECT COUNT(*) FROM trial_intermediate_values").fetchone()[0]
                    except sqlite3.OperationalError:  # its tables not made yet
                        reported = 0
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # another count than the trial's, as a shell's on this machine
    try:
        done = sweep_cli("reproduce", path, "0")
    finally:
        torch.set_num_threads(before)
    assert done.returncode == 0, done.stderr
    assert "trial 0 reproduced:" in done.stdout and "identical (bit for bit)" in done.stdout
