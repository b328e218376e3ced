"""Bring your own training loop: `loop: pkg.module:main` in a study file, `main(config, run)` in a package of the
user's (written by each test into its tmp_path, not part of the project), run through the real CLI and a real SQLite
storage; assertions read what the storage holds."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from sweep.confirm import lineage_label
from tests.conftest import communicate_or_explain, run_cli, sweep_cli, write_study

# A user's own loop: a tiny regression net, its own optimizer and checkpoints; config keys of its own (`eval_every`,
# `events`, and switches the tests use to make it crash, diverge or die).
USER_LOOP = '''
import json
import os
import signal
from pathlib import Path

import torch


def main(config, run):
    run.seed_everything()
    data = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=data)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    hidden = config["model"]["hidden"]
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    model = model.to(run.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["learning_rate"])
    first = 1
    state = run.load()
    if state is not None:
        model.load_state_dict(state["model"])  # a donor's weights, or the lineage's own
        if run.start == "resume":
            optimizer.load_state_dict(state["optimizer"])
            first = state["step"] + 1
    if config.get("events"):
        with open(config["events"], "a") as events:
            events.write(json.dumps({"trial": run.trial, "start": run.start, "step": run.start_step,
                                     "seed": run.seed, "device": str(run.device)}) + "\\n")
    for step in range(first, config["max_steps"] + 1):
        loss = torch.nn.functional.mse_loss(model(x.to(run.device)), y.to(run.device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % config["eval_every"]:
            continue
        value = float(loss.detach())
        if config.get("nan_after") is not None and step > config["nan_after"]:
            value = float("nan")
        if config.get("inf_after") is not None and step > config["inf_after"]:
            value = float("inf")
        if config.get("crash_at") == step:
            raise RuntimeError(f"boom at step {step}")
        stop = run.report(step, val_loss=value)
        run.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step})
        if config.get("kill_at") == step and not Path(config["marker"]).exists() \\
                and (run.start == "warm" or not config.get("kill_warm_only")):
            Path(config["marker"]).write_text("killed once")
            os.kill(os.getpid(), signal.SIGKILL)  # the worker dies mid-trial, after its save at this step
        if stop or (run.start == "warm" and config.get("warm_stop_at") == step):
            return
'''


def loop_study(tmp_path: Path, **changes: Any) -> Path:
    (tmp_path / "myproj").mkdir(exist_ok=True)
    (tmp_path / "myproj" / "__init__.py").write_text("")
    (tmp_path / "myproj" / "train.py").write_text(USER_LOOP)
    document: dict[str, Any] = {
        "name": "loopy", "n_trials": 2, "sampler": {"type": "random"}, "pruner": "none", "loop": "myproj.train:main",
        "fixed": {"max_steps": 20, "eval_every": 5, "model": {"hidden": 8}, "events": str(tmp_path / "events.jsonl")},
        "space": {"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}},
    }
    document.update(changes)
    return write_study(tmp_path, document)


def trials_of(path: Path, name: str = "loopy") -> list[optuna.trial.FrozenTrial]:
    storage = f"sqlite:///{path.parent / f'{name}.db'}"
    return optuna.load_study(study_name=name, storage=storage).get_trials()


def events(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]


def test_a_user_loop_trains_reports_checkpoints_and_reproduces(tmp_path: Path) -> None:
    path = loop_study(tmp_path)
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    trials = trials_of(path)
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    for trial in trials:
        assert sorted(trial.intermediate_values) == [5, 10, 15, 20]
        assert trial.value == trial.intermediate_values[20]  # nothing returned: the last reported value
        config = trial.user_attrs["config"]  # the user's own keys, nested, with the sampled value
        assert config["model"] == {"hidden": 8} and config["eval_every"] == 5
        assert config["learning_rate"] == trial.params["learning_rate"]
        record = trial.user_attrs["reproducibility"]
        assert record["loop"] == "myproj.train:main" and record["seed"] == 0 and record["torch"]
    assert [(e["start"], e["seed"], e["device"]) for e in events(tmp_path)] == [(None, 0, "cpu")] * 2
    checkpoints = list((tmp_path / "loopy.checkpoints" / "loopy").glob("trial*.pt"))
    assert checkpoints  # through the study's checkpoint store, kept by its retention

    again = sweep_cli("reproduce", path, "1", pythonpath=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "4 reported values and its value identical (bit for bit)" in again.stdout

    best = sweep_cli("best", path, "-o", tmp_path / "best.yaml", pythonpath=tmp_path)
    assert best.returncode == 0, best.stderr
    written = (tmp_path / "best.yaml").read_text()
    assert "myproj.train:main(config, run)" in written.splitlines()[0]
    winner = min(trials, key=lambda t: t.value if t.value is not None else math.inf)
    assert yaml.safe_load(written) == winner.user_attrs["config"]
    # Its keys are TrainingConfig keys too: `python -m trainer` would train the built-in model with them, silently.
    from trainer.__main__ import main as trainer_main

    assert trainer_main([str(tmp_path / "best.yaml")]) == 2
    # The report says so too: its best config is run again by `sweep reproduce`, not by `python -m trainer`.
    from sweep.report import render_report

    page = render_report(optuna.load_study(study_name="loopy", storage=f"sqlite:///{tmp_path / 'loopy.db'}"))
    assert f"sweep reproduce STUDY {winner.number}</code> runs it again" in page
    assert "python -m trainer" not in page


def test_reproduce_compares_what_a_loop_reported_before_its_own_error_and_names_the_error(tmp_path: Path) -> None:
    # A loop trial that failed by raising (its own exception, sys.exit) is compared on what it reported, as a
    # command's that exited non-zero; the replay's error was a traceback out of `sweep reproduce`. This loop, as
    # many do, never reads what `run.report` answers.
    (tmp_path / "raising.py").write_text(
        "class MyError(Exception):\n"
        "    pass\n\n\n"
        "def main(config, run):\n"
        "    for step in (1, 2, 3):\n"
        "        if step == 3 and config['end'] == 'raise':\n"
        "            raise MyError(f'custom failure at step {step}')\n"
        "        if step == 3:\n"
        "            raise SystemExit(3)\n"
        "        run.report(step, val_loss=config['x'] + 1.0 / step)\n")
    path = write_study(tmp_path, {"name": "raising", "n_trials": 2, "loop": "raising:main", "pruner": "none",
                                  "sampler": {"type": "bruteforce"}, "fixed": {"x": 0.5},
                                  "space": {"end": {"type": "categorical", "choices": ["raise", "exit"]}}})
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 1  # every trial of the run failed
    failed = trials_of(path, "raising")
    assert sorted(t.params["end"] for t in failed) == ["exit", "raise"]
    assert all(t.state.name == "FAIL" and sorted(t.intermediate_values) == [1, 2] for t in failed)
    for trial in failed:
        again = sweep_cli("reproduce", path, str(trial.number), pythonpath=tmp_path)
        assert again.returncode == 0, again.stdout + again.stderr
        error = "MyError" if trial.params["end"] == "raise" else "LoopExit"
        assert again.stdout.strip() == (  # it raised after it was told to stop (at its last stored step): its end
            f"trial {trial.number} reproduced: 2 reported values identical (bit for bit); trial {trial.number} ended "
            f"failed: only the values it reported before it ended were compared")
        assert "Traceback" not in again.stderr and error not in again.stdout

    # A loop that now raises where the trial went on: the first step it no longer reports differs, and the line
    # says why. One that raises once told to stop (as a pruned trial is, at its last stored step) stops its way.
    (tmp_path / "done").mkdir()
    done = loop_study(tmp_path / "done", n_trials=1)
    assert sweep_cli("run", done, pythonpath=tmp_path / "done").returncode == 0
    assert [t.state.name for t in trials_of(done)] == ["COMPLETE"]
    source = tmp_path / "done" / "myproj" / "train.py"
    source.write_text(source.read_text().replace('config.get("crash_at") == step', "step == 15"))
    broken = sweep_cli("reproduce", done, "0", pythonpath=tmp_path / "done")
    assert broken.returncode == 1 and broken.stderr.count("\n") == 1, broken.stdout + broken.stderr
    assert broken.stderr.startswith("error: trial 0 differs first at step 15: stored ")
    assert broken.stderr.rstrip().endswith(", not reported by the replay; the replay raised RuntimeError: boom at "
                                           "step 15")
    # A complete trial's replay that raises after its last report never gave the trial's value: it differs (it
    # passed, the value never compared; and the edit that made this loop raise matched no line of it).
    edited = source.read_text().replace("step == 15", "step == 25")
    guard = "        if stop or (run.start"
    raising = edited.replace(guard, f"        if step == 20:\n            raise SystemExit(3)\n{guard}")
    assert raising != edited
    source.write_text(raising)
    ended = sweep_cli("reproduce", done, "0", pythonpath=tmp_path / "done")
    assert ended.returncode == 1, ended.stdout + ended.stderr
    assert ended.stderr.startswith("error: trial 0 differs in its value (what its loop returned, else its last "
                                   "report): stored "), ended.stderr
    assert ended.stderr.rstrip().endswith(", the replay ended without one; the replay raised LoopExit: the loop "
                                          "called sys.exit(3)"), ended.stderr
    source.write_text(edited)
    again = sweep_cli("reproduce", done, "0", pythonpath=tmp_path / "done")
    assert again.stdout.strip() == "trial 0 reproduced: 4 reported values and its value identical (bit for bit)"


def test_ctrl_c_during_reproduce_is_an_interruption_even_when_the_loop_wraps_it_in_its_own_error(
        tmp_path: Path) -> None:
    # Found by review: a loop that catches what reaches it and raises its own error turned the Ctrl-C into a verdict
    # ("differs first at step N ... the replay raised RuntimeError: training aborted: KeyboardInterrupt()").
    from tests.e2e.test_cli import _started_catching_sigterm

    marker = tmp_path / "reported"
    (tmp_path / "wrapping.py").write_text(
        "import time\n"
        "from pathlib import Path\n\n\n"
        "def main(config, run):\n"
        "    try:\n"
        "        for step in range(1, 300):\n"
        "            run.report(step, val_loss=config['x'] + 1.0 / step)\n"
        "            Path(config['marker']).touch()\n"
        "            time.sleep(0.02)\n"
        "    except BaseException as exc:\n"
        "        raise RuntimeError(f'training aborted: {exc!r}') from exc\n")
    path = write_study(tmp_path, {"name": "wrapping", "n_trials": 1, "loop": "wrapping:main", "pruner": "none",
                                  "fixed": {"marker": str(marker)},
                                  "space": {"x": {"type": "float", "low": 0, "high": 1}}})
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 0
    marker.unlink()
    process = _started_catching_sigterm("reproduce", path, "0", cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        process.send_signal(signal.SIGINT)  # its replay has reported: the next report raises it into the loop
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stdout + stderr
    assert stderr.strip() == "error: interrupted: trial 0 was not reproduced (nothing was written)", stderr


def test_a_second_ctrl_c_that_the_loop_catches_during_reproduce_is_still_an_interruption(tmp_path: Path) -> None:
    # Found by review: the replay's loop caught the second Ctrl-C (raised at once, in its own code) and returned, and
    # the replay was judged: "trial 0 differs first at step 3 ... not reported by the replay", exit 1.
    arm = tmp_path / "arm"
    (tmp_path / "replayed.py").write_text(
        "import os, signal, time\n"
        "from pathlib import Path\n"
        "def main(config, run):\n"
        "    for step in range(1, 30):\n"
        "        try:\n"
        "            if step == 3 and Path(config['arm']).exists():\n"
        "                os.kill(os.getpid(), signal.SIGINT)\n"
        "                time.sleep(0.5)\n"
        "                os.kill(os.getpid(), signal.SIGINT)  # raises here, in the loop's own code\n"
        "                time.sleep(60)\n"
        "        except KeyboardInterrupt:\n"
        "            return 0.5\n"
        "        run.report(step, val_loss=config['x'] + 1.0 / step)\n"
        "    return 0.1\n")
    path = write_study(tmp_path, {"name": "replayed", "n_trials": 1, "loop": "replayed:main", "pruner": "none",
                                  "fixed": {"arm": str(arm)}, "space": {"x": {"type": "float", "low": 0, "high": 1}}})
    assert run_cli("run", path, cwd=tmp_path).returncode == 0
    arm.touch()
    done = run_cli("reproduce", path, "0", cwd=tmp_path)
    assert done.returncode == 130, done.stdout + done.stderr
    assert done.stderr.strip() == "error: interrupted: trial 0 was not reproduced (nothing was written)", done.stderr


def test_a_loop_that_catches_the_stop_at_each_report_stores_no_report_after_it(tmp_path: Path) -> None:
    # Found by review: one Ctrl-C, raised at the next report, caught there by the loop's own step-wise handling: the
    # reports after it went through, stored for steps the trial ran after it was told to stop.
    (tmp_path / "stepwise.py").write_text(
        "import os, signal, time\n"
        "def main(config, run):\n"
        "    for step in range(1, 50):\n"
        "        try:\n"
        "            if step == 3 and run.trial == 1:\n"
        "                os.kill(os.getpid(), signal.SIGINT)\n"
        "                time.sleep(0.5)\n"
        "            run.report(step, val_loss=1.0 / step)\n"
        "        except KeyboardInterrupt:\n"
        "            pass  # shrugged off: the next step goes on\n"
        "    return 0.1\n")
    path = write_study(tmp_path, {"name": "stepwise", "n_trials": 3, "loop": "stepwise:main", "pruner": "none"})
    stopped = second_trial_interrupted(path, "stepwise", first_value=0.1)
    assert sorted(stopped.intermediate_values) == [1, 2]


def test_reproduce_refuses_a_loop_only_the_database_names(tmp_path: Path) -> None:
    path = loop_study(tmp_path, n_trials=1)
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 0
    refused = sweep_cli("reproduce", tmp_path / "loopy.db", "0", pythonpath=tmp_path)
    assert refused.returncode == 2 and "only the database names" in refused.stderr
    trusted = sweep_cli("reproduce", tmp_path / "loopy.db", "0", "--trust-task", pythonpath=tmp_path)
    assert trusted.returncode == 0, trusted.stderr


def test_nan_after_a_good_start_is_pruned_within_one_report(tmp_path: Path) -> None:
    path = loop_study(tmp_path, n_trials=1, pruner="fastfail", space={},
                      fixed={"max_steps": 20, "eval_every": 5, "model": {"hidden": 8}, "nan_after": 5,
                             "learning_rate": 0.01})
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 0
    (trial,) = trials_of(path)
    assert trial.state.name == "PRUNED"
    assert list(trial.intermediate_values) == [5, 10] and math.isnan(trial.intermediate_values[10])
    assert trial.user_attrs["prune_reason"]["rule"] == "nan" and trial.user_attrs["prune_reason"]["step"] == 10


def test_trials_as_json_is_strict_json_where_a_pruned_trial_kept_an_infinite_value(tmp_path: Path) -> None:
    """Optuna keeps a pruned trial's last report as its value, infinity too: `sweep trials --format json` wrote it as
    `Infinity`, which is not JSON (jq and JavaScript refuse the whole output). It is null, as in the trainer's line."""
    path = loop_study(tmp_path, n_trials=1, pruner="fastfail", space={},
                      fixed={"max_steps": 20, "eval_every": 5, "model": {"hidden": 8}, "inf_after": 5,
                             "learning_rate": 0.01})
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 0
    (trial,) = trials_of(path)
    assert trial.state.name == "PRUNED" and trial.value == math.inf

    def refuse(constant: str) -> None:
        raise AssertionError(f"not JSON: {constant}")

    [row] = json.loads(sweep_cli("trials", path, "--format", "json").stdout, parse_constant=refuse)
    assert row["state"] == "pruned" and row["value"] is None


def test_a_crashing_loop_fails_its_trial_not_the_study(tmp_path: Path) -> None:
    path = loop_study(tmp_path, n_trials=2, max_repeated_failures=0,
                      fixed={"max_steps": 20, "eval_every": 5, "model": {"hidden": 8}, "crash_at": 10})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 1, done.stderr  # the study ran its budget; a run whose every trial failed exits 1
    assert done.stderr.strip().splitlines()[-1].startswith("error: every trial of this run failed (2 failed")
    trials = trials_of(path)
    assert [t.state.name for t in trials] == ["FAIL", "FAIL"]
    assert all(t.user_attrs["fail_reason"] == "RuntimeError: boom at step 10" for t in trials)
    assert all(list(t.intermediate_values) == [5] for t in trials)


def test_warm_start_hands_the_nearest_donors_state_to_the_loop(tmp_path: Path) -> None:
    path = loop_study(tmp_path, warm_start={"enabled": True, "max_distance": 5, "match": ["model.hidden"]})
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 0
    first, second = trials_of(path)
    assert "warm_start_from" not in first.user_attrs
    donor = second.user_attrs["warm_start_from"]
    assert donor["trial"] == 0 and donor["step"] == 20 and len(donor["sha256"]) == 64
    assert [(e["trial"], e["start"], e["step"]) for e in events(tmp_path)] == [(0, None, 0), (1, "warm", 20)]
    assert second.user_attrs["steps_trained"] == 20  # it took the weights and trained its own 20 steps
    # Where its value came from, as the dashboard (the attr) and `sweep best` / `sweep status` (lineage_label) say it.
    said = "warm: started from the state of trial #0 (study loopy) at its step 20, then trained 20 steps with its own"
    assert second.user_attrs["lineage"].startswith(said)
    assert lineage_label(second).startswith(said)
    # The loop took the donor's trained weights: five steps in, it is far below where the cold donor was then.
    assert second.intermediate_values[5] < first.intermediate_values[5] / 2
    again = sweep_cli("reproduce", path, "1", pythonpath=tmp_path)  # replayed from the same donor checkpoint
    assert again.returncode == 0, again.stderr


def test_a_warm_loop_that_counts_from_0_and_stops_early_is_credited_the_steps_it_reported(tmp_path: Path) -> None:
    # Found by review: a warm trial's highest step started at its donor's (20), so one that counts its own steps from
    # 0 and stopped at 10 (pruned, say) was stored as having reached and trained 20 steps: `sweep trials`, the
    # status's compute and its lineage said so.
    path = loop_study(tmp_path, warm_start={"enabled": True, "max_distance": 5, "match": ["model.hidden"]},
                      fixed={"max_steps": 20, "eval_every": 5, "model": {"hidden": 8}, "warm_stop_at": 10})
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 0
    first, second = trials_of(path)
    assert second.user_attrs["warm_start_from"]["step"] == 20 and sorted(second.intermediate_values) == [5, 10]
    assert (second.user_attrs["steps"], second.user_attrs["steps_trained"]) == (10, 10)
    assert "then trained 10 steps with its own" in second.user_attrs["lineage"]
    assert (first.user_attrs["steps"], first.user_attrs["steps_trained"]) == (20, 20)


@pytest.mark.parametrize("match", [["model.hidden"], []], ids=["listed", "searched-model-key"])
def test_a_different_match_key_is_no_donor(tmp_path: Path, match: list[str]) -> None:
    # Unlisted, a searched `model.*` key of a loop (whose model sweep does not build) still tells donors apart: the
    # README's own loop, warm-started, failed its trials on `load_state_dict` with a donor of another width.
    path = loop_study(tmp_path, warm_start={"enabled": True, "max_distance": 5, "match": match},
                      space={"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True},
                             "model.hidden": {"type": "categorical", "choices": [4, 8]}},
                      fixed={"max_steps": 10, "eval_every": 5, "events": str(tmp_path / "events.jsonl")},
                      n_trials=4)
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 0
    trials = trials_of(path)
    for trial in trials:
        donor = trial.user_attrs.get("warm_start_from")
        if donor is not None:
            assert trials[donor["trial"]].params["model.hidden"] == trial.params["model.hidden"]
    hidden = [t.params["model.hidden"] for t in trials]
    assert len(set(hidden)) == 2, f"the sampler drew one width only ({hidden}); the test needs both"


@pytest.mark.slow
def test_a_worker_killed_mid_trial_is_retried_from_the_loops_saved_state(tmp_path: Path) -> None:
    path = loop_study(tmp_path, n_trials=1, heartbeat_interval=1, heartbeat_grace_period=2, space={},
                      fixed={"max_steps": 20, "eval_every": 5, "model": {"hidden": 8}, "learning_rate": 0.01,
                             "kill_at": 10, "marker": str(tmp_path / "marker"),
                             "events": str(tmp_path / "events.jsonl")})
    killed = run_cli("run", path, cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    done = run_cli("run", path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lost, retry = trials_of(path)
    assert lost.state.name == "FAIL" and lost.user_attrs["fail_reason"] == "worker lost: no heartbeat"
    assert retry.state.name == "COMPLETE" and retry.user_attrs["retry_of"] == 0
    assert retry.user_attrs["resumed_from"] == {"trial": 0, "step": 10}
    assert [(e["trial"], e["start"], e["step"]) for e in events(tmp_path)] == [(0, None, 0), (1, "resume", 10)]
    # One continuous curve: the lost trial's reports up to its save, then the retry's own.
    assert sorted(retry.intermediate_values) == [5, 10, 15, 20]
    assert retry.intermediate_values[10] == lost.intermediate_values[10]
    assert retry.user_attrs["steps_trained"] == 10


@pytest.mark.slow
def test_a_warm_loop_trial_killed_and_retried_says_its_lineage_trained_all_its_own_steps(tmp_path: Path) -> None:
    # Review: a warm loop that counts its own steps from 0, killed at its step 10 and retried to 20, said "steps 0-20
    # trained with the config of trial #0, 20-20 with its own" (the dashboard's attr: none of its own) and "then
    # trained 10 steps with its own config" (status, best, report: the retry's part alone). Its lineage trained 20.
    path = loop_study(tmp_path, n_trials=2, heartbeat_interval=1, heartbeat_grace_period=2,
                      warm_start={"enabled": True, "max_distance": 5, "match": ["model.hidden"]},
                      fixed={"max_steps": 20, "eval_every": 5, "model": {"hidden": 8}, "kill_at": 10,
                             "kill_warm_only": True, "marker": str(tmp_path / "marker")})
    killed = run_cli("run", path, cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    done = run_cli("run", path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    _, lost, retry = trials_of(path)
    assert lost.user_attrs["warm_start_from"]["step"] == 20 and retry.user_attrs["retry_of"] == lost.number
    assert retry.user_attrs["resumed_from"] == {"trial": lost.number, "step": 10}
    said = "warm: started from the state of trial #0 (study loopy) at its step 20, then trained 20 steps with its own"
    assert retry.user_attrs["lineage"].startswith(said), retry.user_attrs["lineage"]
    assert lineage_label(retry).startswith(said), lineage_label(retry)


@pytest.mark.slow
def test_workers_share_a_loop_study(tmp_path: Path) -> None:
    path = loop_study(tmp_path, n_trials=4)
    done = run_cli("run", path, "--workers", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [t.state.name for t in trials_of(path)] == ["COMPLETE"] * 4
    seen = events(tmp_path)
    assert sorted(e["trial"] for e in seen) == [0, 1, 2, 3]  # each trial trained once, by one of the workers


def test_a_loop_that_ignores_stop_is_stopped_at_its_next_report(tmp_path: Path) -> None:
    (tmp_path / "stubborn.py").write_text(
        "def main(config, run):\n"
        "    for step in range(1, 100):\n"
        "        run.report(step, val_loss=float('nan') if step > 1 else 1.0)\n"
        "    return 0.0\n")
    path = write_study(tmp_path, {"name": "stubborn", "n_trials": 1, "loop": "stubborn:main"})
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 0
    (trial,) = trials_of(path, "stubborn")
    assert trial.state.name == "PRUNED" and list(trial.intermediate_values) == [1, 2]


def test_a_loop_may_return_its_value(tmp_path: Path) -> None:
    (tmp_path / "direct.py").write_text("def main(config, run):\n    return {'val_loss': config['x'] ** 2}\n")
    path = write_study(tmp_path, {"name": "direct", "n_trials": 3, "loop": "direct:main", "sampler": "random",
                                  "space": {"x": {"type": "float", "low": -1, "high": 1}}})
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 0
    for trial in trials_of(path, "direct"):
        assert trial.state.name == "COMPLETE" and trial.value == trial.params["x"] ** 2
    # It reported nothing: reproduce compares the value it returned.
    again = sweep_cli("reproduce", path, "2", pythonpath=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "trial 2 reproduced: its final value (it reported none) identical (bit for bit)" in again.stdout


def test_a_returned_mapping_whose_val_loss_is_nan_is_a_diverged_trial_whatever_the_metric(tmp_path: Path) -> None:
    # Review: a loop returning {"reward": 0.27, "val_loss": nan} completed with 0.27 and was the study's best, where
    # the same numbers reported were "diverged" (a model whose loss is not a number has no score worth keeping).
    (tmp_path / "rewarded.py").write_text(
        "def main(config, run):\n"
        "    run.report(1, reward=0.1, val_loss=1.0)\n"
        "    loss = {'nan': float('nan'), 'inf': float('inf'), 'fine': 0.5, 'text': 'n/a', 'huge': 10 ** 400}[\n"
        "        config['loss']]\n"
        "    return {'reward': 0.2 + len(config['loss']), 'val_loss': loss}\n")
    path = write_study(tmp_path, {"name": "rewarded", "n_trials": 5, "loop": "rewarded:main", "sampler": "bruteforce",
                                  "metric": "reward", "direction": "maximize", "max_repeated_failures": 0,
                                  "space": {"loss": {"type": "categorical",
                                                     "choices": ["nan", "inf", "fine", "text", "huge"]}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    trials = {t.params["loss"]: t for t in trials_of(path, "rewarded")}
    assert {k: t.state.name for k, t in trials.items()} == {"nan": "FAIL", "inf": "FAIL", "fine": "COMPLETE",
                                                             "text": "COMPLETE", "huge": "FAIL"}
    for loss in ("nan", "inf", "huge"):  # a 400-digit int is infinite, as read (it was an OverflowError of sweep's)
        assert trials[loss].user_attrs["fail_reason"].startswith("diverged: the loop returned val_loss "), \
            trials[loss].user_attrs
    assert trials["fine"].value == 4.2 and trials["text"].value == 4.2


def test_a_last_report_whose_val_loss_is_nan_names_it_in_the_diverged_reason(tmp_path: Path) -> None:
    # The reason named the metric ("reward is nan"), which the loop reported as 0.3.
    (tmp_path / "nanloss.py").write_text(
        "def main(config, run):\n"
        "    run.report(1, reward=0.1, val_loss=1.0)\n"
        "    run.report(2, reward=0.3, val_loss=float('nan'))\n")
    path = write_study(tmp_path, {"name": "nanloss", "n_trials": 1, "loop": "nanloss:main", "metric": "reward",
                                  "direction": "maximize", "max_repeated_failures": 0, "pruner": "none",
                                  "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 1 and "every trial of this run failed" in done.stderr, done.stderr
    [trial] = trials_of(path, "nanloss")
    assert trial.state.name == "FAIL"
    assert trial.user_attrs["fail_reason"] == "diverged: val_loss is nan (with reward 0.3) at step 2", trial.user_attrs


def test_a_loop_that_calls_sys_exit_fails_its_trial_and_the_study_goes_on(tmp_path: Path) -> None:
    # A train.py's main() that parses the command line: argparse exits on sweep's own arguments. That used to end the
    # worker with exit code 2 (read as bad input) and its trial left running.
    (tmp_path / "exits.py").write_text(
        "import argparse\n"
        "def main(config, run):\n"
        "    if config['x'] > 0:\n"
        "        argparse.ArgumentParser().parse_args()\n"
        "    return {'val_loss': config['x'] ** 2}\n")
    path = write_study(tmp_path, {"name": "exits", "n_trials": 4, "loop": "exits:main", "sampler": "bruteforce",
                                  "max_repeated_failures": 0,
                                  "space": {"x": {"type": "categorical", "choices": [-1.0, 1.0, -0.5, 0.5]}}})
    done = run_cli("run", path, cwd=tmp_path)  # sys.exit in a process of its own: nothing else to take down
    assert done.returncode == 0, done.stderr  # two trials completed
    trials = trials_of(path, "exits")
    assert sorted(t.state.name for t in trials) == ["COMPLETE", "COMPLETE", "FAIL", "FAIL"]
    for trial in trials:
        if trial.state.name == "FAIL":
            assert trial.user_attrs["fail_reason"].startswith("LoopExit: the loop called sys.exit(2) (argparse")
            assert trial.params["x"] > 0



def test_what_no_exception_class_catches_fails_its_trial_and_its_text_is_kept_short_and_printed_escaped(
        tmp_path: Path) -> None:
    # asyncio's CancelledError, GeneratorExit and a bare BaseException are no Exception: they went past the worker,
    # ended `sweep run` with a traceback and left the trial running (retried, and crashing the study again). So did an
    # exception whose __str__ raises. A 10 MB message was stored whole and printed whole, and a message holding a
    # terminal's escape sequence cleared the terminal of whoever ran `sweep run` or `sweep trials`.
    (tmp_path / "odd.py").write_text(
        "import asyncio\n"
        "class BadStr(Exception):\n"
        "    def __str__(self):\n"
        "        raise RuntimeError('str broke')\n"
        "def main(config, run):\n"
        "    mode = config['mode']\n"
        "    run.report(1, val_loss=0.5)\n"
        "    if mode == 'cancelled': raise asyncio.CancelledError()\n"
        "    if mode == 'genexit': raise GeneratorExit()\n"
        "    if mode == 'base': raise BaseException('bare')\n"
        "    if mode == 'badstr': raise BadStr()\n"
        "    if mode == 'huge': raise ValueError('y' * 1_000_000)\n"
        "    if mode == 'escape': raise ValueError('\\x1b[2J\\x1b]0;pwned\\x07 cleared')\n"
        "    return {'val_loss': 1.0}\n")
    modes = ["cancelled", "genexit", "base", "badstr", "huge", "escape", "fine"]
    path = write_study(tmp_path, {"name": "odd", "n_trials": len(modes), "loop": "odd:main", "sampler": "bruteforce",
                                  "max_repeated_failures": 0, "pruner": "none",
                                  "space": {"mode": {"type": "categorical", "choices": modes}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "\x1b" not in done.stderr and "\\x1b[2J" in done.stderr
    assert len(done.stderr) < 50_000
    trials = {t.params["mode"]: t for t in trials_of(path, "odd")}
    assert {m: t.state.name for m, t in trials.items()} == {m: "COMPLETE" if m == "fine" else "FAIL" for m in modes}
    reasons = {m: t.user_attrs["fail_reason"] for m, t in trials.items() if m != "fine"}
    assert reasons["cancelled"].startswith("CancelledError") and reasons["genexit"].startswith("GeneratorExit")
    assert reasons["base"] == "BaseException: bare"
    assert reasons["badstr"] == "BadStr: (its message could not be read: its __str__ raised RuntimeError)"
    assert len(reasons["huge"]) < 2100 and reasons["huge"].endswith("(998012 more characters)")
    assert all(t.user_attrs["outcome"] == "failed" for m, t in trials.items() if m != "fine")
    listed = sweep_cli("trials", path)
    assert listed.returncode == 0 and "\x1b" not in listed.stdout and "\\x1b[2J" in listed.stdout
    for mode in ("cancelled", "badstr"):  # replayed, each raises as its trial did, after the same report
        again = sweep_cli("reproduce", path, str(trials[mode].number), pythonpath=tmp_path)
        assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
        assert again.stdout.startswith(f"trial {trials[mode].number} reproduced: 1 reported values identical"), \
            again.stdout


def test_a_loop_that_returns_a_numpy_or_tensor_number_gives_the_trial_that_value(tmp_path: Path) -> None:
    # `main`'s return is the trial's value "when it is a number": a numpy float32 was ignored (the last report won).
    (tmp_path / "returns.py").write_text(
        "import numpy as np, torch\n"
        "KINDS = {'f32': np.float32, 'f64': np.float64, 'i64': np.int64, 'tensor': torch.tensor, 'int': int,\n"
        "         'array': np.array, 'vector': lambda v: torch.tensor([v, v])}\n"
        "def main(config, run):\n"
        "    run.report(1, val_loss=0.5)\n"
        "    return KINDS[config['kind']](3)\n")
    path = write_study(tmp_path, {"name": "returns", "n_trials": 7, "loop": "returns:main", "sampler": "bruteforce",
                                  "pruner": "none", "space": {"kind": {"type": "categorical",
                                                                       "choices": ["f32", "f64", "i64", "tensor",
                                                                                   "int", "array", "vector"]}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    # A 0-d array is its number; a tensor of two numbers is none (it failed the trial): the last report is the value.
    assert {t.params["kind"]: t.value for t in trials_of(path, "returns")} == {
        **dict.fromkeys(["f32", "f64", "i64", "tensor", "int", "array"], 3.0), "vector": 0.5}


def test_a_step_that_is_no_whole_number_or_a_return_that_is_no_number_fails_its_trial_saying_so(
        tmp_path: Path) -> None:
    # A step of 2.7 was cut to 2 (and a later 2.2 dropped as a duplicate), NaN was "cannot convert float NaN to
    # integer", a returned bool or list was "returned none"; a loop reporting out of step order was pruned by
    # fast-fail with the wrapped pruner's name as the reason (the explanation read the reports unsorted).
    (tmp_path / "odd.py").write_text(
        "def main(config, run):\n"
        "    mode = config['mode']\n"
        "    if mode == 'unordered':\n"
        "        for step, value in ((20, 1.0), (10, 0.5), (30, 0.9)):\n"
        "            if run.report(step, val_loss=value):\n"
        "                return\n"
        "    steps = {'fraction': 2.7, 'nan': float('nan'), 'negative': -1, 'text': '3'}\n"
        "    if mode in steps:\n"
        "        run.report(steps[mode], val_loss=0.5)\n"
        "    if mode in ('reports-bool', 'reports-text'):\n"
        "        run.report(1, val_loss=0.9)\n"
        "        run.report(2, val_loss=config['max_steps'] > 0 if mode == 'reports-bool' else '0.42')\n"
        "    if mode == 'reports-huge':\n"
        "        run.report(1, val_loss=10 ** 400)\n"
        "    if mode == 'reports-positional':\n"
        "        run.report(1, 0.5)\n"
        "    if mode == 'returns-nan':\n"
        "        run.report(10, val_loss=0.5)\n"
        "    return {'bool': True, 'list': [0.1], 'huge': 10 ** 400, 'returns-nan': float('nan')}.get(mode)\n")
    modes = ["unordered", "fraction", "nan", "negative", "text", "bool", "list", "reports-bool", "reports-text",
             "huge", "reports-huge", "reports-positional", "returns-nan"]
    path = write_study(tmp_path, {"name": "odd", "n_trials": len(modes), "loop": "odd:main", "sampler": "bruteforce",
                                  "max_repeated_failures": 0, "fixed": {"max_steps": 30},
                                  "space": {"mode": {"type": "categorical", "choices": modes}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert "Traceback" not in done.stderr
    reasons = {t.params["mode"]: t.user_attrs.get("fail_reason") or t.user_attrs.get("prune_reason")
               for t in trials_of(path, "odd")}
    assert reasons["fraction"] == "LoopError: run.report: the step must be a whole number, got float 2.7"
    assert reasons["nan"] == "LoopError: run.report: the step must be a whole number, got float nan"
    assert reasons["negative"] == "LoopError: run.report: the step must be >= 0, got -1"
    assert reasons["text"] == "LoopError: run.report: the step must be a whole number, got str '3'"
    assert reasons["bool"] == "the loop reported no 'val_loss' and returned a bool (True), not a number"
    assert reasons["list"] == "the loop reported no 'val_loss' and returned a list ([0.1]), not a number"
    assert reasons["unordered"]["rule"] == "plateau" and reasons["unordered"]["best_step"] == 10
    # A reported bool (a comparison by mistake) or string was float()ed: True completed the trial with 1.0.
    assert reasons["reports-bool"] == "LoopError: metric 'val_loss': expected a number, got bool (True)"
    assert reasons["reports-text"] == "LoopError: metric 'val_loss': expected a number, got str ('0.42')"
    # An int beyond a float's range was "OverflowError: int too large to convert to float": it is infinite, so
    # diverged, as any value that overflows.
    assert reasons["huge"] == "diverged: the loop returned val_loss inf", reasons["huge"]
    # A NaN returned after finite reports was "val_loss is nan at step 10", a step whose value was 0.5.
    assert reasons["returns-nan"] == "diverged: the loop returned val_loss nan (its last report, at step 10, was 0.5)"
    assert reasons["reports-huge"]["rule"] == "inf", reasons["reports-huge"]
    # A value where the metrics go was "TypeError: 'float' object is not a mapping".
    assert reasons["reports-positional"] == ("LoopError: run.report at step 1: expected the metrics as a mapping or "
                                             "as keywords (run.report(1, val_loss=...)), got float 0.5")


def test_a_step_reported_twice_keeps_its_first_value_for_the_pruner_the_value_and_reproduce(tmp_path: Path) -> None:
    # Optuna stores a step's first value; the trial's value was the last report, which the pruner never saw, and
    # `sweep reproduce` then found them different.
    (tmp_path / "twice.py").write_text(
        "def main(config, run):\n"
        "    for step in (10, 20):\n"
        "        run.report(step, val_loss=config['x'] + 1.0 / step + 1.0)\n"
        "        run.report(step, val_loss=config['x'] + 1.0 / step)\n")
    path = write_study(tmp_path, {"name": "twice", "n_trials": 1, "loop": "twice:main", "pruner": "none",
                                  "space": {"x": {"type": "float", "low": 0, "high": 1}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "warning: run.report: step 10 was reported already; its first value is kept" in done.stderr
    [trial] = trials_of(path, "twice")
    assert trial.value == trial.intermediate_values[20] == trial.params["x"] + 1.0 / 20 + 1.0
    again = sweep_cli("reproduce", path, "0", pythonpath=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr


def test_a_loop_that_reports_out_of_order_reproduces(tmp_path: Path) -> None:
    """The replay was told to stop at the stored last step, which this loop reports first: steps 1 and 2 were never
    reported again, and `sweep reproduce` said "reproduced nan". It now stops once every stored step is seen."""
    (tmp_path / "shuffled.py").write_text(
        "def main(config, run):\n"
        "    for step in (3, 1, 2):\n"
        "        if run.report(step, val_loss=config['x'] + 1.0 / step):\n"
        "            return\n")
    path = write_study(tmp_path, {"name": "shuffled", "n_trials": 1, "loop": "shuffled:main", "pruner": "none",
                                  "fixed": {"max_steps": 3}, "space": {"x": {"type": "float", "low": 0, "high": 1}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    [trial] = trials_of(path, "shuffled")
    assert sorted(trial.intermediate_values) == [1, 2, 3]
    assert trial.user_attrs["steps"] == 3  # the highest step it reported, not the last (2)
    again = sweep_cli("reproduce", path, "0", pythonpath=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.strip() == "trial 0 reproduced: 3 reported values and its value identical (bit for bit)"

@pytest.mark.parametrize(("edit", "expected"), [
    ({"loop": "direct:main"}, "expected exactly one of task, loop, command (what each trial runs), got task, loop"),
    ({"task": ...}, "task: required key is missing (or give loop: package.module:function, or command: a "),
    ({"task": ..., "loop": "no colon"}, "loop: expected package.module:function, got 'no colon'"),
    ({"task": ..., "loop": "nowhere_module:main"}, "loop: cannot import loop module 'nowhere_module': No module named "
                                                   "'nowhere_module'; a module of your own must be importable: put it"),
    # Where the module's own code failed (review: the line named no file, and told to move a module it had found).
    ({"task": ..., "loop": "exits_at_import:main"}, "loop: cannot import loop module 'exits_at_import': importing it "
                                                    "raised SystemExit: 0 (at exits_at_import.py:2)"),
    ({"task": ..., "loop": "needs_a_package:main"}, "loop: cannot import loop module 'needs_a_package': No module "
                                                    "named 'not_installed_xyz' (at needs_a_package.py:1); the module "
                                                    "was found, and 'not_installed_xyz'"),
    ({"task": ..., "loop": "direct:absent"}, "direct.py) has no function 'absent'"),
    # A `trainer.py` of the user's beside the study is hidden by this package's own `trainer`: the line says so.
    ({"task": ..., "loop": "trainer:main"}, "has no function 'main': 'trainer' is this package's own, and the "
                                            "import finds it before a module of yours of that name; rename yours"),
    ({"task": ..., "loop": "direct:one"}, "loop: direct:one must take two arguments, (config, run)"),
    ({"task": ..., "loop": "direct:gen"}, "loop: direct:gen is a generator: calling it runs none of its body"),
    ({"task": ..., "loop": "direct:co"}, "loop: direct:co is an async function: calling it runs none of its body"),
    ({"task": ..., "command": "python x.py --lr {lr}"}, "command: {lr} is not a key of the config"),
    ({"task": ..., "command": "python 'x.py"}, "command: cannot split the command into arguments"),
    ({"task": ..., "command": "no-such-program-here --x {x}"}, "command: 'no-such-program-here' is not an executable"),
])
def test_bad_loop_or_command_is_one_line_exit_2_and_nothing_created(tmp_path: Path, edit: dict[str, Any],
                                                                     expected: str) -> None:
    (tmp_path / "direct.py").write_text("def main(config, run):\n    return 1.0\n\ndef one(config):\n    pass\n\n"
                                        "def gen(config, run):\n    yield run.report(1, val_loss=1.0)\n\n"
                                        "async def co(config, run):\n    return 1.0\n")
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")  # it ended sweep, silently, exit 0
    (tmp_path / "needs_a_package.py").write_text("import not_installed_xyz\n")
    document: dict[str, Any] = {"name": "bad", "n_trials": 1, "task": "digits",
                                "space": {"x": {"type": "float", "low": 0, "high": 1}}}
    for key, value in edit.items():
        if value is ...:
            document.pop(key)
        else:
            document[key] = value
    path = write_study(tmp_path, document)
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: ") and expected in lines[0], done.stderr
    assert not (tmp_path / "bad.db").exists()


def test_timeout_stops_a_loop_at_its_next_report_and_queues_it_again(tmp_path: Path) -> None:
    (tmp_path / "slow.py").write_text(
        "import time\n"
        "def main(config, run):\n"
        "    for step in range(1, 10_000):\n"
        "        time.sleep(0.01)\n"
        "        if run.report(step, val_loss=1.0 / step):\n"
        "            return\n")
    path = write_study(tmp_path, {"name": "slow", "n_trials": 1, "loop": "slow:main", "pruner": "none"})
    started = time.monotonic()
    done = sweep_cli("run", path, "--timeout", "1", pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    trial, retry = trials_of(path, "slow")
    assert trial.state.name == "FAIL" and trial.user_attrs["fail_reason"].startswith("interrupted: --timeout")
    assert retry.state.name == "WAITING" and retry.user_attrs["retry_of"] == 0
    assert max(trial.intermediate_values) < 9_999
    assert time.monotonic() - started < 120  # a generous bound: the loop stopped at a report, long before its end



def test_a_mapping_of_the_users_keyed_by_numbers_reaches_the_loop_as_written(tmp_path: Path) -> None:
    """Below the study file's own keys a mapping may be the user's, keyed by numbers on purpose: it is not refused
    (a refusal of every key YAML reads as a number refused it), and reaches the loop. Its keys arrive as strings, as
    the config is stored as JSON (and `sweep best` and `reproduce` give it back)."""
    (tmp_path / "weighted.py").write_text(
        "def main(config, run):\n"
        "    weights = config['class_weights']\n"
        "    assert weights == {'0': 1.0, '1': 5.0}, weights\n"
        "    return weights['1'] + config['lr']\n")
    path = write_study(tmp_path, {"name": "weighted", "n_trials": 1, "loop": "weighted:main",
                                  "fixed": {"max_steps": 1, "class_weights": {0: 1.0, 1: 5.0}},
                                  "space": {"lr": {"type": "float", "low": 0.1, "high": 0.2}}})
    assert "class_weights:\n    0: 1.0\n" in path.read_text()  # unquoted: YAML reads them as numbers
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    [trial] = trials_of(path, "weighted")
    assert trial.state.name == "COMPLETE" and trial.value == 5.0 + trial.params["lr"]


def test_a_loop_told_to_stop_by_timeout_saves_there_and_its_retry_resumes_from_that_save(tmp_path: Path) -> None:
    # The report that saw --timeout pass raised instead of returning True: a loop that saves when told to stop (or
    # after its report, as the README's example does) lost that save, and its retry began from scratch.
    (tmp_path / "saver.py").write_text(
        "import time\n"
        "def main(config, run):\n"
        "    state = run.load()\n"
        "    first = state['step'] + 1 if state else 1\n"
        "    for step in range(first, config['max_steps'] + 1):\n"
        "        time.sleep(config['pause'])\n"
        "        if run.report(step, val_loss=1.0 / step):\n"
        "            run.save({'step': step})  # saves only when told to stop\n"
        "            return\n")
    path = write_study(tmp_path, {"name": "saver", "n_trials": 1, "loop": "saver:main", "pruner": "none",
                                  "fixed": {"max_steps": 300, "pause": 0.01}})
    assert sweep_cli("run", path, "--timeout", "1", pythonpath=tmp_path).returncode == 0
    timed_out, _ = trials_of(path, "saver")
    last = max(timed_out.intermediate_values)
    assert timed_out.user_attrs["fail_reason"].startswith("interrupted: --timeout") and last < 300
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    _, retry = trials_of(path, "saver")
    assert retry.state.name == "COMPLETE" and retry.user_attrs["resumed_from"] == {"trial": 0, "step": last}
    assert sorted(retry.intermediate_values) == list(range(1, 301))


def test_a_loop_that_catches_ctrl_c_or_installs_signal_handlers_still_lets_the_worker_stop(tmp_path: Path) -> None:
    # A loop that caught the KeyboardInterrupt its report raised completed at a step it never reported, and the
    # worker went on; handlers a loop installed (a library's, SIG_IGN here) stayed for the worker's whole life.
    (tmp_path / "catcher.py").write_text(
        "import os, signal\n"
        "def main(config, run):\n"
        "    if run.trial == 0:\n"
        "        signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "        run.report(1, val_loss=1.0)\n"
        "        return 1.0\n"
        "    try:\n"
        "        for step in range(1, 50):\n"
        "            if step == 3:\n"
        "                os.kill(os.getpid(), signal.SIGINT)\n"
        "            run.report(step, val_loss=1.0 / step)\n"
        "    except KeyboardInterrupt:\n"
        "        return 0.5  # the loop's own Ctrl-C handling\n"
        "    return 0.1\n")
    path = write_study(tmp_path, {"name": "catcher", "n_trials": 3, "loop": "catcher:main", "pruner": "none"})
    stopped = second_trial_interrupted(path, "catcher", first_value=1.0)
    assert sorted(stopped.intermediate_values) == [1, 2]


def second_trial_interrupted(path: Path, name: str, *, first_value: float) -> optuna.trial.FrozenTrial:
    """`sweep run` of a 3-trial loop study whose second trial is stopped by Ctrl-C: exit 130, the first trial
    complete, the second failed as interrupted (returned) and queued again, nothing after it."""
    done = run_cli("run", path, cwd=path.parent)
    assert done.returncode == 130, (done.returncode, done.stderr)
    first, stopped, retry = trials_of(path, name)
    assert first.state.name == "COMPLETE" and first.value == first_value
    assert stopped.state.name == "FAIL" and stopped.user_attrs["fail_reason"] == "interrupted"
    assert retry.state.name == "WAITING" and retry.user_attrs["retry_of"] == 1
    return stopped


@pytest.mark.parametrize("caught", ["returns", "goes on"])
def test_a_second_ctrl_c_that_the_loop_catches_still_stops_its_trial_and_the_run(tmp_path: Path, caught: str) -> None:
    # Found by review: a second Ctrl-C raises at once, wherever the process is; landing in the loop's own
    # `except KeyboardInterrupt`, the trial completed with what the loop returned and the run went on (exit 0); a
    # loop that caught it in its step and went on trained its whole budget before the trial was stopped.
    handled = ("        return 0.5  # the loop's own Ctrl-C handling\n" if caught == "returns" else
               "        pass  # shrugged off: the step goes on\n")
    (tmp_path / "twice.py").write_text(
        "import os, signal, time\n"
        "def main(config, run):\n"
        "  for step in range(1, 50):\n"
        "    try:\n"
        "        if step == 3 and run.trial == 1:\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "            time.sleep(0.5)\n"
        "            os.kill(os.getpid(), signal.SIGINT)  # raises here, in the loop's own code\n"
        "            time.sleep(60)\n"
        "    except KeyboardInterrupt:\n"
        f"{handled}"
        "    run.report(step, val_loss=1.0 / step)\n"
        "  return 0.1\n")
    path = write_study(tmp_path, {"name": "twice", "n_trials": 3, "loop": "twice:main", "pruner": "none"})
    stopped = second_trial_interrupted(path, "twice", first_value=0.1)
    assert max(stopped.intermediate_values, default=0) <= 2  # stopped at the step it was told in, not at the end


@pytest.mark.parametrize(("signum", "behaviour"), [("SIGTERM", "returns"), ("SIGTERM", "exits"),
                                                  ("SIGTERM", "goes on"), ("SIGTERM", "chains"),
                                                  ("SIGINT", "returns"), ("SIGINT", "chains")])
def test_a_stop_the_loop_s_own_signal_handler_takes_still_stops_its_trial_and_the_run(
        tmp_path: Path, signum: str, behaviour: str) -> None:
    """Found by review: a loop that sets its own SIGTERM handler (one that sets a flag the loop saves and returns on,
    as scripts written for a cluster's preemption do) took the signal in the worker's place: the trial was stored
    complete at the step the loop returned on, with that step's value, and the preempted job exited 0. So was one
    whose handler then calls the handler it found, as PyTorch Lightning's does. The stop is the trial's all the same,
    whatever the handler does: return early, exit, only note it, or chain the worker's and return early."""
    (tmp_path / "handler_loop.py").write_text(
        "import os, signal, sys\n"
        f"SIGNUM, BEHAVIOUR = signal.{signum}, {behaviour!r}\n"
        "def main(config, run):\n"
        "    asked = []\n"
        "    found = signal.getsignal(SIGNUM)\n"
        "    def on_signal(signum, frame):\n"
        "        asked.append(signum)\n"
        "        if BEHAVIOUR == 'exits':\n"
        "            sys.exit(0)\n"
        "        if BEHAVIOUR == 'chains' and callable(found):\n"
        "            found(signum, frame)\n"
        "    signal.signal(SIGNUM, on_signal)\n"
        "    for step in range(1, 50):\n"
        "        if step == 3 and run.trial == 1:\n"
        "            os.kill(os.getpid(), SIGNUM)  # a scheduler's preemption, or a Ctrl-C\n"
        "        if asked and BEHAVIOUR in ('returns', 'chains'):\n"
        "            run.save({'step': step})\n"
        "            return 1.0 / step\n"
        "        run.report(step, val_loss=1.0 / step)\n"
        "    return 0.02\n")
    path = write_study(tmp_path, {"name": "handlers", "n_trials": 3, "loop": "handler_loop:main", "pruner": "none"})
    done = run_cli("run", path, cwd=path.parent)
    assert done.returncode == (143 if signum == "SIGTERM" else 130), (done.returncode, done.stderr)
    first, stopped, retry = trials_of(path, "handlers")
    assert first.state.name == "COMPLETE" and first.value == 0.02
    assert stopped.state.name == "FAIL", (stopped.state, stopped.value, done.stderr)
    reason = stopped.user_attrs["fail_reason"]
    assert reason.startswith("preempted (SIGTERM)" if signum == "SIGTERM" else "interrupted"), reason
    assert sorted(stopped.intermediate_values) == [1, 2]
    assert retry.state.name == "WAITING" and retry.user_attrs["retry_of"] == 1


@pytest.mark.parametrize(("own_handler", "first"), [(False, 0), (True, 1)])
def test_a_loop_signalled_after_its_last_report_has_finished_and_is_stored_complete(
        tmp_path: Path, own_handler: bool, first: int) -> None:
    """A SIGTERM that comes after a loop's last report, while it saves and returns, finds the trial finished: it is
    stored complete, and the worker stops before the next one. Found by diff review: a finished trial was thrown
    away and trained again when the stop came during its final save (a loop that reports steps 0 to max_steps - 1,
    never max_steps itself): a loop without a handler of its own hears of a stop only at a report, so one that
    returned had finished. One with a handler of its own that reported max_steps had nothing left to do either."""
    module = f"late_signal_{own_handler}"
    (tmp_path / f"{module}.py").write_text(
        "import os, signal, time\n"
        "def main(config, run):\n"
        + ("    signal.signal(signal.SIGTERM, lambda signum, frame: None)\n" if own_handler else "")
        + f"    for step in range({first}, config['max_steps'] + {first}):\n"
        "        run.report(step, val_loss=1.0 / (step + 1))\n"
        "    if run.trial == 1:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's preemption, as the trial saves\n"
        "        time.sleep(0.2)\n"
        "    run.save({'step': config['max_steps']})\n"
        "    return 0.02\n")
    path = write_study(tmp_path, {"name": "late", "n_trials": 3, "loop": f"{module}:main", "pruner": "none",
                                  "fixed": {"max_steps": 5}})
    done = run_cli("run", path, cwd=path.parent)
    assert done.returncode == 143, (done.returncode, done.stderr)
    trials = trials_of(path, "late")
    assert [(t.state.name, t.value) for t in trials] == [("COMPLETE", 0.02), ("COMPLETE", 0.02)], done.stderr


def test_a_sigterm_raised_at_a_report_in_a_thread_of_the_loop_is_the_one_line_preemption_not_a_traceback(
        tmp_path: Path) -> None:
    # Review: the thread's report raised sweep's own `Preempted`, and Python printed that thread's traceback (15
    # lines) before the worker's one line; the trial was marked and retried as it should be.
    (tmp_path / "threaded.py").write_text(
        "import os, signal, threading\n"
        "def main(config, run):\n"
        "    def body():\n"
        "        for step in range(1, config['max_steps'] + 1):\n"
        "            if step == 3 and run.trial == 0:\n"
        "                os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's preemption\n"
        "            if run.report(step, val_loss=1.0 / step):\n"
        "                return\n"
        "    worker = threading.Thread(target=body)\n"
        "    worker.start()\n"
        "    worker.join()\n")
    path = write_study(tmp_path, {"name": "threaded", "n_trials": 2, "loop": "threaded:main", "pruner": "none",
                                  "fixed": {"max_steps": 50}})
    done = run_cli("run", path, cwd=path.parent)
    assert done.returncode == 143, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "Exception in thread" not in done.stderr, done.stderr
    trial = trials_of(path, "threaded")[0]
    assert trial.user_attrs["fail_reason"].startswith("preempted (SIGTERM)"), trial.user_attrs


def test_a_study_deleted_while_it_runs_ends_the_run_with_one_line(tmp_path: Path) -> None:
    # Found by review: another user's `optuna delete-study` during a run made each worker's next write a traceback
    # ("KeyError: 'No trial with trial id 106 exists.'").
    (tmp_path / "deleter.py").write_text(
        "import optuna\n"
        "def main(config, run):\n"
        "    run.report(1, val_loss=0.5)\n"
        "    if run.trial == 1:\n"
        f"        optuna.delete_study(study_name='gone', storage='sqlite:///{tmp_path / 'gone.db'}')\n"
        "    return 0.5\n")
    path = write_study(tmp_path, {"name": "gone", "n_trials": 3, "loop": "deleter:main", "pruner": "none"})
    env_path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    done = subprocess.run([sys.executable, "-m", "sweep.cli", "run", str(path)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300, env={**os.environ, "COLUMNS": "200", "PYTHONPATH": env_path})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"error: {tmp_path / 'gone.db'}: the study's rows are gone from the storage"), done.stderr


def test_a_second_ctrl_c_that_cuts_a_trials_end_short_says_so_and_the_next_run_retries_that_trial(
        tmp_path: Path) -> None:
    # Found by review: a second Ctrl-C that landed while a trial's end was stored left the trial running, and the line
    # said "running trials are marked and queued again". Here both land in the tell of trial 1's end.
    (tmp_path / "quick.py").write_text(
        "def main(config, run):\n"
        "    for step in range(1, 4):\n"
        "        run.report(step, val_loss=1.0 / step + config['lr'])\n"
        "    return 1.0 / 3 + config['lr']\n")
    (tmp_path / "cut.py").write_text(
        "import os, signal, sys\n"
        "import optuna\n"
        "real = optuna.study.Study.tell\n"
        "def tell(self, trial, *args, **kwargs):\n"
        "    number = trial if isinstance(trial, int) else trial.number\n"
        "    if number == 1:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        os.kill(os.getpid(), signal.SIGINT)  # the second: raised at once, here\n"
        "    return real(self, trial, *args, **kwargs)\n"
        "optuna.study.Study.tell = tell\n"
        "from sweep.cli import main\n"
        "sys.argv = ['sweep', 'run', sys.argv[1]]\n"
        "main()\n")
    path = write_study(tmp_path, {"name": "cut", "n_trials": 3, "loop": "quick:main", "pruner": "none",
                                  "heartbeat_interval": 1, "heartbeat_grace_period": 2,
                                  "space": {"lr": {"type": "float", "low": 0.0, "high": 1.0}}})
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, str(tmp_path / "cut.py"), str(path)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 130, done.stderr
    assert "cut short a trial's end as it was stored, the next run finds that trial lost" in done.stderr, done.stderr
    first, cut = trials_of(path, "cut")
    assert first.state.name == "COMPLETE" and cut.state.name == "RUNNING"  # as the line says
    time.sleep(3)  # its heartbeat goes stale
    again = run_cli("run", path, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    trials = trials_of(path, "cut")
    lost = trials[1]
    assert lost.state.name == "FAIL" and lost.user_attrs["fail_reason"] == "worker lost: no heartbeat"
    retry = next(t for t in trials if t.user_attrs.get("retry_of") == 1)
    assert retry.state.name == "COMPLETE" and retry.params == cut.params
    assert sum(t.state.name == "COMPLETE" for t in trials) == 3


def test_run_study_from_python_treats_ctrl_c_as_sweep_run_does_and_leaves_the_callers_state_as_it_was(
        tmp_path: Path) -> None:
    # Found by review: only the CLI made Ctrl-C a request. From a notebook or a script, the KeyboardInterrupt landed in
    # the loop's own `except KeyboardInterrupt`, the trial was stored complete at a step it never reached, and the run
    # went on; the caller's deterministic mode was off and its generators in a trial's state afterwards.
    (tmp_path / "py_catcher.py").write_text(
        "import os, signal\n"
        "def main(config, run):\n"
        "    run.seed_everything()\n"
        "    try:\n"
        "        for step in range(1, 50):\n"
        "            if step == 3 and run.trial == 0:\n"
        "                os.kill(os.getpid(), signal.SIGINT)\n"
        "            run.report(step, val_loss=1.0 / step)\n"
        "    except KeyboardInterrupt:\n"
        "        return 0.5  # the loop's own Ctrl-C handling\n"
        "    return 0.1\n")
    path = write_study(tmp_path, {"name": "pycatcher", "n_trials": 2, "loop": "py_catcher:main", "pruner": "none"})
    script = (
        "import json, random, sys, numpy, torch\n"
        "from sweep import load_spec, open_study, run_study\n"
        "from sweep.schema import resolve_storage_url\n"
        f"spec, path = load_spec({str(path)!r}); url = resolve_storage_url(spec, path, None)\n"
        "torch.use_deterministic_algorithms(True, warn_only=True)\n"
        "random.seed(7); numpy.random.seed(7); torch.manual_seed(7)\n"
        "try:\n"
        "    run_study(open_study(spec, url), spec, storage_url=url)\n"
        "    stopped = None\n"
        "except KeyboardInterrupt:\n"
        "    stopped = 'KeyboardInterrupt'\n"
        "draws = [random.random(), float(numpy.random.random()), torch.rand(1).item()]\n"
        "random.seed(7); numpy.random.seed(7); torch.manual_seed(7)\n"
        "summary = run_study(open_study(spec, url), spec, storage_url=url)  # the same process, resumed\n"
        "print(json.dumps({'stopped': stopped, 'kept': draws == [random.random(), float(numpy.random.random()),\n"
        "                  torch.rand(1).item()], 'deterministic': torch.are_deterministic_algorithms_enabled(),\n"
        "                  'warn_only': torch.is_deterministic_algorithms_warn_only_enabled()}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"stopped": "KeyboardInterrupt", "kept": True,
                                                        "deterministic": True, "warn_only": True}
    stopped, retry, second = trials_of(path, "pycatcher")
    assert stopped.state.name == "FAIL" and stopped.user_attrs["fail_reason"] == "interrupted"
    assert sorted(stopped.intermediate_values) == [1, 2]
    assert retry.user_attrs["retry_of"] == 0 and retry.state.name == "COMPLETE" and retry.value == 0.1
    assert second.state.name == "COMPLETE"


def test_a_loop_that_wraps_the_stop_in_its_own_exception_is_pruned_not_failed(tmp_path: Path) -> None:
    (tmp_path / "wrapping.py").write_text(
        "def main(config, run):\n"
        "    try:\n"
        "        for step in range(1, 100):\n"
        "            run.report(step, val_loss=float('nan') if step > 1 else 1.0)\n"
        "    except Exception as exc:\n"
        "        raise RuntimeError('training failed') from exc\n")
    path = write_study(tmp_path, {"name": "wrapping", "n_trials": 1, "loop": "wrapping:main"})
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 0
    (trial,) = trials_of(path, "wrapping")
    assert trial.state.name == "PRUNED" and list(trial.intermediate_values) == [1, 2]


def test_a_loop_that_raises_trial_pruned_itself_is_pruned_in_its_own_words(tmp_path: Path) -> None:
    # Optuna's idiom for a rule of the objective's own: each such trial was stored as failed ("TrialPruned: ..."),
    # and five in a row stopped the study as broken code (review).
    (tmp_path / "ownrule.py").write_text(
        "import optuna\n"
        "def main(config, run):\n"
        "    for step in range(1, 6):\n"
        "        run.report(step, val_loss=1.0 + config['x'] / step)\n"
        "        if step == 3 and config['x'] > 0.2:\n"
        "            raise optuna.TrialPruned(f\"my own rule: x {config['x']:.2f} too big\")\n")
    path = write_study(tmp_path, {"name": "ownrule", "n_trials": 6, "loop": "ownrule:main", "pruner": "none",
                                  "sampler": "random", "space": {"x": {"type": "float", "low": 0.3, "high": 1}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    trials = trials_of(path, "ownrule")
    assert [t.state.name for t in trials] == ["PRUNED"] * 6
    for trial in trials:
        assert list(trial.intermediate_values) == [1, 2, 3] and trial.value == 1.0 + trial.params["x"] / 3
        assert trial.user_attrs["prune_reason"]["message"] == \
            f"the loop raised TrialPruned at step 3: my own rule: x {trial.params['x']:.2f} too big"
    listed = sweep_cli("trials", path, "--format", "csv").stdout
    assert "pruned: the loop raised TrialPruned at step 3: my own rule" in listed and "failed" not in listed


def test_reports_past_max_steps_are_still_judged_and_warned_of(tmp_path: Path) -> None:
    # max_steps counts epochs, the loop reports its global batch step (epoch x 100): every report was at or past
    # max_steps, so none was judged, and a NaN at the second ran the trial to its end.
    (tmp_path / "pastmax.py").write_text(
        "def main(config, run):\n"
        "    for epoch in range(1, config['max_steps'] + 1):\n"
        "        if run.report(epoch * 100, val_loss=float('nan') if epoch >= 2 else 1.0 + config['x']):\n"
        "            return\n")
    path = write_study(tmp_path, {"name": "pastmax", "n_trials": 1, "loop": "pastmax:main", "pruner": "fastfail",
                                  "fixed": {"max_steps": 20}, "space": {"x": {"type": "float", "low": 0, "high": 1}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "run.report at step 100 is past max_steps=20" in done.stderr
    [trial] = trials_of(path, "pastmax")
    assert trial.state.name == "PRUNED" and list(trial.intermediate_values) == [100, 200]
    assert trial.user_attrs["prune_reason"]["rule"] == "nan"


def test_threads_of_a_loop_may_report_at_once(tmp_path: Path) -> None:
    # The reporter's queue of values for the storage was shared unlocked: two threads popped one value and raised
    # IndexError('pop from empty list') into the loop's threads.
    (tmp_path / "threaded.py").write_text(
        "import threading\n"
        "def main(config, run):\n"
        "    errors = []\n"
        "    def work(k):\n"
        "        try:\n"
        "            for i in range(25):\n"
        "                run.report(1 + 4 * i + k, val_loss=1.0 / (1 + 4 * i + k) + config['x'])\n"
        "        except Exception as exc:\n"
        "            errors.append(repr(exc))\n"
        "    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]\n"
        "    for t in threads: t.start()\n"
        "    for t in threads: t.join()\n"
        "    if errors:\n"
        "        raise RuntimeError(errors[0])\n")
    path = write_study(tmp_path, {"name": "threaded", "n_trials": 3, "loop": "threaded:main", "pruner": "none",
                                  "space": {"x": {"type": "float", "low": 0, "high": 1}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    trials = trials_of(path, "threaded")
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3, [t.user_attrs.get("fail_reason") for t in trials]
    assert all(sorted(t.intermediate_values) == list(range(1, 101)) for t in trials)


def test_a_complete_loop_trial_is_replayed_to_its_own_end_and_its_returned_value_compared(tmp_path: Path) -> None:
    """The replay of a complete trial was told to stop at its last report, so this loop took its pruned branch,
    which the trial never took; and the value it returned (not its last report) was never compared."""
    runs, branch = tmp_path / "runs.txt", tmp_path / "pruned-branch.txt"
    (tmp_path / "ends.py").write_text(
        "import pathlib\n"
        "def main(config, run):\n"
        "    history = []\n"
        "    for step in (5, 10, 15):\n"
        "        history.append(config['x'] + 1.0 / step)\n"
        "        if run.report(step, val_loss=history[-1]):\n"
        f"            pathlib.Path({str(branch)!r}).write_text('taken')\n"
        "            return None\n"
        f"    runs = pathlib.Path({str(runs)!r})\n"
        "    n = int(runs.read_text()) + 1 if runs.exists() else 1\n"
        "    runs.write_text(str(n))\n"
        "    return min(history) - 0.5 + (0.0 if n == 1 else 1.0)\n")
    path = write_study(tmp_path, {"name": "ends", "n_trials": 1, "loop": "ends:main", "pruner": "none",
                                  "fixed": {"max_steps": 15}, "space": {"x": {"type": "float", "low": 0, "high": 1}}})
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 0
    [trial] = trials_of(path, "ends")
    assert trial.value == pytest.approx(trial.intermediate_values[15] - 0.5)
    runs.unlink()
    again = sweep_cli("reproduce", path, "0", pythonpath=tmp_path)
    assert again.stdout.strip() == "trial 0 reproduced: 3 reported values and its value identical (bit for bit)", \
        again.stdout + again.stderr
    assert not branch.exists(), "the replay took the loop's pruned branch"
    differs = sweep_cli("reproduce", path, "0", pythonpath=tmp_path)  # this time the loop returns 1.0 more
    assert differs.returncode == 1
    assert differs.stderr.startswith(f"error: trial 0 differs in its value (what its loop returned, else its last "
                                     f"report): stored "
                                     f"{trial.value!r}, reproduced {trial.value + 1.0!r}"), differs.stderr


def test_a_retry_s_loss_rules_go_on_from_its_lineage_s_val_loss_curve(tmp_path: Path) -> None:
    # Found by review: with the study's metric an accuracy, fast-fail judges explosions on the val_loss curve kept
    # beside it; a retry's curve began at its resume step, so a spike of 4.0 was judged against 0.28 (its first
    # value there) instead of the lineage's first, 2.3, and a trial the uninterrupted run completes was pruned.
    (tmp_path / "spiky.py").write_text(
        "LOSS = [2.3, 1.0, 0.3, 0.28, 4.0, 0.3, 0.29, 0.28, 0.27, 0.26]\n"
        "def main(config, run):\n"
        "    state = run.load()\n"
        "    first = state['step'] + 10 if state else 10\n"
        "    for step in range(first, 101, 10):\n"
        "        i = step // 10 - 1\n"
        "        run.report(step, val_accuracy=0.1 + 0.08 * i, val_loss=LOSS[i])\n"
        "        run.save({'step': step})\n"
        "        if step == 30 and state is None and config['stop']:\n"
        "            raise KeyboardInterrupt  # as Ctrl-C would, after the save at step 30\n")
    document = {"name": "spiky", "n_trials": 1, "loop": "spiky:main", "pruner": "fastfail",
                "metric": "val_accuracy", "direction": "maximize", "checkpoints": {"every_steps": 10},
                "fixed": {"max_steps": 100, "eval_every_steps": 10, "stop": True},
                "space": {"x": {"type": "float", "low": 0, "high": 1}}}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path, pythonpath=tmp_path).returncode == 130
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    stopped, retry = trials_of(path, "spiky")
    assert stopped.state.name == "FAIL" and retry.user_attrs["resumed_from"] == {"trial": 0, "step": 30}
    assert retry.state.name == "COMPLETE", retry.user_attrs.get("prune_reason")
    assert retry.user_attrs["loss_curve"][:5] == [[10, 2.3], [20, 1.0], [30, 0.3], [40, 0.28], [50, 4.0]]


def test_a_loop_that_returns_several_objectives_is_warned_that_the_study_has_one(tmp_path: Path) -> None:
    """Found by review: a loop written for Optuna's multi-objective studies (`return loss, latency`) ran with its
    tuple silently ignored; its value is the last reported metric, and now one warning says so. A loop that returns
    something else (its model) is not warned of."""
    (tmp_path / "twoobj.py").write_text(
        "import torch\n"
        "def main(config, run):\n"
        "    run.report(1, val_loss=0.5 + config['x'])\n"
        "    return torch.nn.Linear(1, 1) if config['x'] > 2 else (0.001, 1.0 / (1 + config['x']))\n")
    path = write_study(tmp_path, {"name": "twoobj", "n_trials": 1, "loop": "twoobj:main",
                                  "space": {"x": {"type": "float", "low": 0, "high": 1}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    [trial] = trials_of(path, "twoobj")
    assert trial.state.name == "COMPLETE" and trial.value == trial.intermediate_values[1]
    assert ("trial 0: the loop returned several numbers ((0.001, " in done.stderr
            and "a sweep study has one objective: its value is the last reported 'val_loss'" in done.stderr)

    path = write_study(tmp_path, {"name": "model", "n_trials": 1, "loop": "twoobj:main",
                                  "space": {"x": {"type": "float", "low": 3, "high": 4}}}, "model.yaml")
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0 and "several numbers" not in done.stderr, done.stderr


LOADER_LOOP = '''
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset


def main(config, run):
    run.seed_everything()
    data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["learning_rate"])
    loader = DataLoader(data, batch_size=32, shuffle=True, num_workers=2, persistent_workers=True)
    step = 0
    while True:
        for x, y in loader:
            step += 1
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 5 == 0:
                if run.report(step, {"val_loss": loss.item()}):
                    return
                Path(config["reported"]).touch()
            if step >= config["max_steps"]:
                return
'''


def test_a_sigterm_to_the_whole_job_preempts_a_trial_whose_data_loader_workers_it_killed(tmp_path: Path) -> None:
    """Found by review: a scheduler's SIGTERM reaches every process of the job, the loop's DataLoader workers too;
    they die of it and the loop raises "DataLoader worker (pid N) is killed by signal: Terminated" before its next
    report. The trial was stored as its config's failure, never retried. It is preempted, and queued again."""
    (tmp_path / "loader_loop.py").write_text(LOADER_LOOP)
    reported = tmp_path / "reported"
    path = write_study(tmp_path, {
        "name": "loaders", "n_trials": 2, "sampler": {"type": "random"}, "pruner": "none", "loop": "loader_loop:main",
        "fixed": {"max_steps": 10_000_000, "reported": str(reported)},
        "space": {"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}}})
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONFAULTHANDLER": "1"}
    run = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)  # a job's own group
    try:
        deadline = time.monotonic() + 180
        while not reported.exists():
            assert time.monotonic() < deadline and run.poll() is None, run.communicate()
            time.sleep(0.05)
        os.killpg(run.pid, signal.SIGTERM)  # the scheduler: every process of the job, the loader's workers too
        _, stderr = communicate_or_explain(run, 120)
    finally:
        os.killpg(run.pid, signal.SIGKILL) if run.poll() is None else None
    assert run.returncode == 143, stderr
    trials = trials_of(path, "loaders")
    first = trials[0]
    assert first.state == optuna.trial.TrialState.FAIL, stderr
    assert first.user_attrs["fail_reason"].startswith("preempted (SIGTERM)"), first.user_attrs
    assert first.user_attrs.get("outcome") == "preempted", first.user_attrs
    queued = [t for t in trials if t.state == optuna.trial.TrialState.WAITING]
    assert [t.user_attrs.get("retry_of") for t in queued] == [0], [t.user_attrs for t in trials]


@pytest.mark.parametrize("preempted", [False, True])
def test_a_handler_of_the_loop_s_that_raises_during_a_report_s_write_raises_after_it(
        tmp_path: Path, preempted: bool) -> None:
    """CI: a preempted run whose DataLoader's workers the SIGTERM killed hung inside its trial's report. PyTorch's
    SIGCHLD handler raises wherever the main thread is; in the middle of a report's storage write it cut the write
    short. The signals here come in the middle of the write of step 3's value (a hook on the database's statements):
    the loop's handler raises once the report is stored, as the loop's error (or, preempted, the stop's)."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    module = f"raising_handler_{int(preempted)}"
    (tmp_path / f"{module}.py").write_text(
        "import signal\n"
        "ARMED = []\n"
        "def boom(signum, frame):\n"
        "    raise RuntimeError('DataLoader worker (pid 1) is killed by signal: Terminated.')\n"
        "def main(config, run):\n"
        "    signal.signal(signal.SIGUSR1, boom)\n"
        "    try:\n"
        "        for step in range(1, 6):\n"
        "            ARMED[:] = [step] if step == 3 else []\n"
        "            run.report(step, val_loss=1.0 / step)\n"
        "    finally:\n"
        "        signal.signal(signal.SIGUSR1, signal.SIG_DFL)\n"
        "    return 0.2\n")
    path = write_study(tmp_path, {"name": "raising", "n_trials": 1, "loop": f"{module}:main", "pruner": "none",
                                  "sampler": {"type": "random"}})

    def mid_write(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        loop = sys.modules.get(module)
        if loop is not None and loop.ARMED and "trial_intermediate_values" in statement \
                and statement.lstrip().upper().startswith("INSERT"):
            loop.ARMED.clear()
            if preempted:
                signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGUSR1)

    event.listen(Engine, "before_cursor_execute", mid_write)
    try:
        done = sweep_cli("run", path, pythonpath=tmp_path)
    finally:
        event.remove(Engine, "before_cursor_execute", mid_write)
    (trial, *retry) = trials_of(path, "raising")
    assert sorted(trial.intermediate_values) == [1, 2, 3], (trial.intermediate_values, done.stderr)  # stored whole
    assert trial.state == optuna.trial.TrialState.FAIL
    if preempted:
        assert done.returncode == 143, done.stderr
        assert trial.user_attrs["fail_reason"].startswith("preempted (SIGTERM)"), trial.user_attrs
        assert [t.user_attrs.get("retry_of") for t in retry] == [0]
    else:
        assert done.returncode == 1, done.stderr  # its only trial failed
        assert trial.user_attrs["fail_reason"] == (
            "RuntimeError: DataLoader worker (pid 1) is killed by signal: Terminated."), trial.user_attrs
        assert retry == []


def test_a_thread_the_loop_leaves_running_does_not_keep_sweep_run_from_exiting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a loop that starts a thread (not a daemon) and never ends it kept `sweep run` alive forever
    after the study was done and its summary printed, without a word. It names the thread and exits with the run's
    own code once the grace period (SWEEP_EXIT_GRACE_S) has passed."""
    (tmp_path / "threader.py").write_text(
        "import threading\n"
        "def main(config, run):\n"
        "    threading.Thread(target=threading.Event().wait, name='forgotten-waiter').start()\n"
        "    run.report(1, {'val_loss': config['learning_rate']})\n")
    path = write_study(tmp_path, {
        "name": "threads", "n_trials": 1, "sampler": {"type": "random"}, "pruner": "none", "loop": "threader:main",
        "space": {"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}}})
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("SWEEP_EXIT_GRACE_S", "2")
    done = run_cli("run", path, timeout=240)
    assert done.returncode == 0, done.stderr
    assert ("note: the trials' code left 1 thread running (forgotten-waiter; not daemon threads): waiting up to 2 s "
            "for it before exiting") in done.stderr, done.stderr
    assert "note: exited 2 s after the command ended" in done.stderr, done.stderr
    assert [t.state for t in trials_of(path, "threads")] == [optuna.trial.TrialState.COMPLETE]
    # Integrations review: MLflow's own background logging, left running by a tracking store that failed mid-run,
    # was blamed on "the trials' code".
    (tmp_path / "threader.py").write_text(
        "import threading\n"
        "def main(config, run):\n"
        "    threading.Thread(target=threading.Event().wait, name='MLflowAsyncLoggingStatusCheck_0').start()\n"
        "    run.report(1, {'val_loss': config['learning_rate']})\n")
    done = run_cli("run", path, "--n-trials", "2", timeout=240)
    assert done.returncode == 0 and "the trials' code" not in done.stderr, done.stderr
    assert ("note: MLflow's background logging is still running (1 thread): waiting up to 2 s for it before "
            "exiting") in done.stderr, done.stderr


BUMPS_AFTER_HANDOFF = '''import math
def main(config, run):
    every, last = config["eval_every_steps"], config["max_steps"]
    state = run.load()
    if state is None:  # cold: 2.3 down to 0.115, its newest save at step 100
        for step in range(every, last + 1, every):
            stop = run.report(step, {"val_loss": 2.2 * math.exp(-5 * step / last) + 0.1})
            if step <= 100:
                run.save({"step": step})
            if stop:
                return
    else:  # warm from step 100: its fresh optimizer bumps the loss, still below the lineage's start, then it is best
        for k, step in enumerate(range(state["step"] + every, last + 1, every)):
            if run.report(step, {"val_loss": [0.12, 1.5, 0.3, 0.06][min(k, 3)]}):
                return
'''


@pytest.mark.parametrize("bump", [1.5, 4.0])
def test_a_warm_trial_s_explosion_is_measured_from_the_value_it_took_over(tmp_path: Path, bump: float) -> None:
    """Review: a warm trial's first own value (0.12) was its explosion rule's start, so its fresh optimizer's bump to
    1.5, below the lineage's untrained 2.3, pruned it as exploded; it would have ended the study's best. The rule
    reads from the donor's value at the handoff (0.28 here), as the trainer's loss guard does: 1.5 is no explosion,
    4.0 (above 10 x 0.28) is."""
    (tmp_path / "bumps.py").write_text(BUMPS_AFTER_HANDOFF.replace("1.5, 0.3", f"{bump}, 0.3"))
    path = write_study(tmp_path, {"name": "bumps", "n_trials": 3, "seed": 0, "sampler": "random", "loop": "bumps:main",
                                  "pruner": {"type": "fastfail", "then": {"type": "median", "n_startup_trials": 50}},
                                  "warm_start": {"max_distance": 1.0},
                                  "fixed": {"max_steps": 200, "eval_every_steps": 20},
                                  "space": {"lr": {"type": "float", "low": 0.001, "high": 0.1}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    cold, *warm = trials_of(path, "bumps")
    assert cold.state.name == "COMPLETE" and "warm_start_from" not in cold.user_attrs
    assert warm and all(t.user_attrs["warm_start_from"]["step"] == 100 for t in warm)
    if bump == 1.5:
        assert [t.state.name for t in warm] == ["COMPLETE"] * len(warm), [t.user_attrs for t in warm]
        assert all(t.value == 0.06 for t in warm)
    else:
        assert [t.state.name for t in warm] == ["PRUNED"] * len(warm)
        reason = warm[0].user_attrs["prune_reason"]
        assert reason["rule"] == "explode" and reason["handoff"] == 100 and reason["step"] == 140, reason
        assert reason["message"].startswith("exploded at step 140: 4 > 10 x the value it took over at step 100 "), \
            reason


def test_a_returned_decimal_is_the_trial_s_value(tmp_path: Path) -> None:
    """Review: `run.report` takes a Decimal, but a Decimal returned was "not a number" (a loop that reported
    nothing failed) or dropped for the last report's value."""
    (tmp_path / "decimals.py").write_text(
        "import decimal\n"
        "def main(config, run):\n"
        "    if config['x'] > 0:\n"
        "        run.report(1, val_loss=2.0)\n"
        "    return decimal.Decimal('0.125')\n")
    path = write_study(tmp_path, {"name": "decimals", "n_trials": 2, "loop": "decimals:main", "sampler": "bruteforce",
                                  "pruner": "none", "space": {"x": {"type": "categorical", "choices": [0, 1]}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [(t.state.name, t.value) for t in trials_of(path, "decimals")] == [("COMPLETE", 0.125)] * 2


def test_a_step_beyond_32_bits_is_one_line_on_every_storage(tmp_path: Path) -> None:
    """Review: steps counted in samples (3e9) failed every trial on PostgreSQL with the storage's "integer out of
    range" and ran on SQLite; now the report is refused by its words on both."""
    (tmp_path / "samples.py").write_text(
        "def main(config, run):\n"
        "    run.report(1_000_000_000, val_loss=1.0)\n"
        "    run.report(3_000_000_000, val_loss=0.5)\n")
    path = write_study(tmp_path, {"name": "samples", "n_trials": 1, "loop": "samples:main", "pruner": "none",
                                  "max_repeated_failures": 0,
                                  "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}}})
    done = sweep_cli("run", path, pythonpath=tmp_path)
    assert done.returncode == 1, done.stderr
    [trial] = trials_of(path, "samples")
    assert trial.state.name == "FAIL" and trial.intermediate_values == {1_000_000_000: 1.0}
    assert "run.report: the step must be at most 2147483647 (a study's storage keeps steps in 32 bits), got " \
           "3000000000" in trial.user_attrs["fail_reason"], trial.user_attrs["fail_reason"]
