"""A user's command per trial: `command: python train.py --lr {learning_rate}` with `sweep.client` reporting back to
the worker, through the real CLI and a real SQLite storage (and PostgreSQL for the transport's independence from the
storage); scripts are written by each test into its tmp_path."""

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
import torch

from tests.conftest import run_cli, sweep_cli, write_study

ARGS_SCRIPT = '''
import argparse
import math

from sweep import client

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, required=True)
parser.add_argument("--hidden", type=int, required=True)
args = parser.parse_args()
for step in range(1, 6):
    loss = (math.log10(args.lr) + 2) ** 2 + 1.0 / step + args.hidden / 1000
    print(f"step {step} loss {loss}", flush=True)
    if client.report(step, val_loss=loss):
        break
'''

# Never reports: reads its config from the environment, prints a JSON line at the end (and other lines after it).
ENV_SCRIPT = '''
import json
import os

config = json.loads(os.environ["SWEEP_CONFIG"])
print(json.dumps({"val_loss": config["x"] ** 2, "trial": int(os.environ["SWEEP_TRIAL"])}))
print("done")
'''

NAN_SCRIPT = '''
import sys
from sweep import client

for step, value in enumerate([1.0, 0.9, 0.8, float("nan"), 0.5, 0.4], start=1):
    if client.report(step, val_loss=value):
        print(f"told to stop at step {step}", flush=True)
        sys.exit(0)
'''

CRASH_SCRIPT = '''
from sweep import client

client.report(1, val_loss=1.0)
raise RuntimeError("the data loader exploded")
'''

# Told to stop (NaN), it keeps sleeping, and so does a child it started: both are killed with the group.
STUBBORN_SCRIPT = '''
import os
import signal
import subprocess
import sys
import time

from sweep import client

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1], "w") as pids:
    pids.write(f"{os.getpid()} {child.pid}")
client.report(1, val_loss=1.0)
client.report(2, val_loss=float("nan"))
time.sleep(600)
'''


# Saves its state at each step through the client; on its first run it kills its worker (SIGKILL) after the save at
# step 3, as a machine that dies would. Its retry starts from that save.
RESUMING_SCRIPT = '''
import json
import os
import signal
import sys
from pathlib import Path

import torch

from sweep import client

marker, events = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
kind, at = client.start()
state = client.load()  # a resume also puts the RNGs back where they were at the save
weight = state["weight"] if state is not None else torch.zeros(3)
first = state["step"] + 1 if state is not None else 1
with events.open("a") as out:
    out.write(json.dumps({"trial": client.trial_number(), "start": kind, "step": at}) + "\\n")
for step in range(first, 7):
    weight = weight + torch.rand(3)  # the RNG was put back too: the resumed run draws what an unbroken one would
    client.report(step, val_loss=1.0 / step)
    assert client.save({"weight": weight, "step": step})
    if step == 3 and not marker.exists():
        marker.write_text("killed")
        guard = Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()
        os.kill(int(guard[1]), signal.SIGKILL)  # the worker: the parent of the guard that runs this command
        sys.exit(0)
print(json.dumps({"weight": weight.tolist()}))
'''


def command_study(tmp_path: Path, script: str, command: str, **changes: Any) -> Path:
    (tmp_path / "train.py").write_text(script)
    document: dict[str, Any] = {"name": "cmd", "n_trials": 1, "sampler": {"type": "random"},
                                "command": f"{sys.executable} {command}"}
    document.update(changes)
    return write_study(tmp_path, document)


def trials_of(path: Path, name: str = "cmd", storage: str | None = None) -> list[optuna.trial.FrozenTrial]:
    storage = storage or f"sqlite:///{path.parent / f'{name}.db'}"
    return optuna.load_study(study_name=name, storage=storage).get_trials()


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its parent counts as gone: it runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_a_script_reads_its_arguments_and_reports_through_the_client(tmp_path: Path) -> None:
    path = command_study(tmp_path, ARGS_SCRIPT, "train.py --lr {learning_rate} --hidden {model.hidden}",
                         n_trials=2, pruner="none", fixed={"model": {"hidden": 8}},
                         space={"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}})
    done = sweep_cli("run", path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for trial in trials_of(path):
        lr = trial.params["learning_rate"]
        expected = [(math.log10(lr) + 2) ** 2 + 1.0 / step + 8 / 1000 for step in range(1, 6)]
        assert trial.state.name == "COMPLETE"
        assert [trial.intermediate_values[step] for step in range(1, 6)] == pytest.approx(expected, rel=1e-12)
        assert trial.value == trial.intermediate_values[5]
        log = Path(trial.user_attrs["log"])
        assert log.read_text().splitlines()[0].startswith("step 1 loss ")
        # Its reproducibility record, as a loop's or a task's trial has one: what ran, where, with which code.
        record = trial.user_attrs["reproducibility"]
        assert record["command"] == [sys.executable, "train.py", "--lr", str(lr), "--hidden", "8"]
        assert record["workdir"] == str(tmp_path) and record["workdir_git_commit"] is None  # not a git work tree
        assert record["python"] and record["sweep_version"]
    rows = json.loads(sweep_cli("trials", path, "--format", "json").stdout)
    assert [Path(row["log"]).name for row in rows] == ["trial00000.log", "trial00001.log"]

    best = sweep_cli("best", path, "-o", tmp_path / "best.yaml")
    assert best.returncode == 0, best.stderr
    header = (tmp_path / "best.yaml").read_text().splitlines()[1]
    winner = min(trials_of(path), key=lambda t: t.value or math.inf)
    assert header == f"#   {sys.executable} train.py --lr {winner.params['learning_rate']} --hidden 8"
    refused = subprocess.run([sys.executable, "-m", "trainer", str(tmp_path / "best.yaml")], capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout
    assert refused.stderr.strip().splitlines() == [
        f"{tmp_path / 'best.yaml'}: this is the config of a `loop:` or `command:` study's trial, as `sweep best` "
        "writes it; python -m trainer trains the built-in trainer's configs only: give it to your own code, or "
        "train the trial again with `sweep reproduce STUDY TRIAL`"]

    # Reproduce runs the same command line again, in the folder it ran in (from any other: `python train.py` was
    # looked for in the working folder), and compares every reported value.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = sweep_cli("reproduce", path, str(winner.number), cwd=elsewhere)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"trial {winner.number} reproduced: 5 reported values identical (bit for bit)" in again.stdout
    (tmp_path / "train.py").write_text(ARGS_SCRIPT.replace("1.0 / step", "1.01 / step"))  # the script changed since
    changed = sweep_cli("reproduce", path, str(winner.number), cwd=tmp_path)
    assert changed.returncode == 1 and f"trial {winner.number} differs first at step 1" in changed.stderr


# Eight threads report at once, switching threads as often as the interpreter can (the races at their widest).
THREADS_SCRIPT = '''
import sys
import threading

from sweep import client

sys.setswitchinterval(1e-6)
start = threading.Barrier(8)


def reporter(k):
    start.wait()
    for i in range(25):
        client.report(k * 100 + i, val_loss=1.0 + k + i / 100)


threads = [threading.Thread(target=reporter, args=(k,)) for k in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("reported")
'''


def test_threads_of_a_script_that_report_at_once_each_get_their_answer(tmp_path: Path) -> None:
    # Two threads reading the report channel took each other's answers (one then waited for good: a trial that never
    # ended), or each wrapped its descriptor in a socket of its own, whose collection closed it under the other (the
    # script died, or exited 0 with most of its reports lost; review). One exchange at a time now. The worker's end
    # here answers each line at once, as fast as it can: the worker's own answers, slowed by its storage, hid the
    # races in most runs (review: 1 trial in 50 hung).
    import socket
    import threading

    for attempt in range(6):
        ours, theirs = socket.socketpair()
        script = subprocess.Popen([sys.executable, "-c", THREADS_SCRIPT], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "SWEEP_REPORT_FD": str(theirs.fileno())},
                                  pass_fds=[theirs.fileno()])
        theirs.close()
        lines: list[bytes] = []

        def answer(ours: socket.socket = ours, lines: list[bytes] = lines) -> None:
            received = b""
            while data := ours.recv(1 << 16):
                received += data
                while b"\n" in received:
                    line, _, received = received.partition(b"\n")
                    lines.append(line)
                    ours.sendall(b"go\n")

        server = threading.Thread(target=answer, daemon=True)
        server.start()
        try:
            output, _ = script.communicate(timeout=120)
        finally:
            if script.poll() is None:
                script.kill()
                script.wait()
            ours.close()
        assert script.returncode == 0 and output.strip() == "reported", (attempt, script.returncode, output)
        steps = sorted(json.loads(line)["step"] for line in lines)
        assert steps == sorted(k * 100 + i for k in range(8) for i in range(25)), attempt


def test_a_script_that_never_reports_gets_its_last_json_line(tmp_path: Path) -> None:
    path = command_study(tmp_path, ENV_SCRIPT, "train.py", n_trials=3,
                         space={"x": {"type": "float", "low": -1, "high": 1}})
    assert sweep_cli("run", path, cwd=tmp_path).returncode == 0
    for trial in trials_of(path):
        assert trial.state.name == "COMPLETE" and trial.value == trial.params["x"] ** 2
        assert not trial.intermediate_values
    # Reproduced by its final value, the only one it gave; a script changed since is told apart.
    again = sweep_cli("reproduce", path, "1", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "trial 1 reproduced: its final value (it reported none) identical (bit for bit)" in again.stdout
    script = (tmp_path / "train.py").read_text()
    (tmp_path / "train.py").write_text(script.replace('config["x"] ** 2', 'config["x"] ** 2 + 1e-9'))
    changed = sweep_cli("reproduce", path, "1", cwd=tmp_path)
    assert changed.returncode == 1 and "differs in its final value (it reported none)" in changed.stderr

    # The study again from scratch (its database deleted, its trials' logs left), with a script that prints nothing:
    # an earlier study's last JSON line is not this trial's value.
    for leftover in tmp_path.glob("cmd.db*"):
        leftover.unlink()
    (tmp_path / "train.py").write_text("print('no metric here')\n")
    again = sweep_cli("run", path, cwd=tmp_path)
    assert again.returncode == 1, again.stderr
    assert [t.state.name for t in trials_of(path)] == ["FAIL"] * 3
    assert all("reported no 'val_loss'" in t.user_attrs["fail_reason"] for t in trials_of(path))



def test_a_step_a_script_reports_twice_keeps_its_first_value(tmp_path: Path) -> None:
    script = ("from sweep import client\n"
              "for step in (1, 2):\n"
              "    client.report(step, val_loss=10.0 + step)\n"
              "    client.report(step, val_loss=float(step))\n")
    path = command_study(tmp_path, script, "train.py", pruner="none",
                         space={"x": {"type": "float", "low": 0, "high": 1}})
    done = sweep_cli("run", path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    [trial] = trials_of(path)
    assert trial.intermediate_values == {1: 11.0, 2: 12.0} and trial.value == 12.0
    for step in (1, 2):  # said, as a loop's `run.report` says it
        assert f"warning: client.report: step {step} was reported already; its first value is kept" in done.stderr


def test_nan_after_a_good_start_is_pruned_within_one_report(tmp_path: Path) -> None:
    path = command_study(tmp_path, NAN_SCRIPT, "train.py", pruner="fastfail")
    assert sweep_cli("run", path, cwd=tmp_path).returncode == 0
    (trial,) = trials_of(path)
    assert trial.state.name == "PRUNED"
    assert list(trial.intermediate_values) == [1, 2, 3, 4] and math.isnan(trial.intermediate_values[4])
    assert trial.user_attrs["prune_reason"]["rule"] == "nan"
    assert "told to stop at step 4" in Path(trial.user_attrs["log"]).read_text()


def test_a_crashing_script_fails_its_trial_with_its_exit_code_and_log(tmp_path: Path) -> None:
    path = command_study(tmp_path, CRASH_SCRIPT, "train.py", n_trials=2, max_repeated_failures=0)
    done = sweep_cli("run", path, cwd=tmp_path)
    assert done.returncode == 1, done.stderr  # both trials ran; a run whose every trial failed exits 1
    assert "error: every trial of this run failed (2 failed" in done.stderr
    for trial in trials_of(path):
        assert trial.state.name == "FAIL" and list(trial.intermediate_values) == [1]
        reason = trial.user_attrs["fail_reason"]
        assert reason.startswith("the command exited with code 1: ") and "the data loader exploded" in reason
        assert "Traceback" in Path(trial.user_attrs["log"]).read_text()


def test_a_script_run_by_a_python_without_sweep_fails_saying_which_interpreter_ran_it(tmp_path: Path) -> None:
    """`command: python train.py` runs the first python on PATH, which need not be sweep's (pipx, or .venv/bin/sweep
    without the environment activated): `from sweep import client` failed with a bare ModuleNotFoundError. Here a
    Python without its site-packages stands in for another interpreter."""
    path = command_study(tmp_path, "from sweep import client\n", "-S train.py", n_trials=1)
    done = sweep_cli("run", path, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    [trial] = trials_of(path)
    reason = trial.user_attrs["fail_reason"]
    assert reason.startswith("the command exited with code 1: ") and "No module named 'sweep'" in reason, reason
    assert reason.endswith(f"(the command ran {sys.executable}, a Python without sweep installed; "
                           f"sweep runs in {sys.executable}: name that interpreter in command:, or install sweep in "
                           "the command's)"), reason


def test_a_script_that_ignores_stop_is_killed_with_its_group_after_the_grace_period(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    path = command_study(tmp_path, STUBBORN_SCRIPT, f"train.py {pids}", stop_grace_period=1)
    started = time.monotonic()
    done = sweep_cli("run", path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 300  # far below the 600 s the script would sleep
    (trial,) = trials_of(path)
    assert trial.state.name == "PRUNED" and list(trial.intermediate_values) == [1, 2]
    leader, child = map(int, pids.read_text().split())
    deadline = time.monotonic() + 60
    while not (gone(leader) and gone(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(leader) and gone(child), (leader, child)


# Never reports (so never hears that its worker is gone) and starts a child: a plain script printing its result at the
# end. Ignores SIGTERM, as some training scripts' handlers in effect do.
SILENT_SCRIPT = '''
import os
import signal
import subprocess
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(sys.argv[1], "w") as pids:
    pids.write(f"{os.getpid()} {child.pid}")
time.sleep(600)
print('{"val_loss": 0.5}')
'''


def test_a_command_whose_worker_is_killed_does_not_run_on_for_nobody(tmp_path: Path) -> None:
    """SIGKILL of the worker (the out-of-memory killer, a scheduler) leaves nobody to end the command's group. A command
    that reports would fail at its next report; one that never reports trained on to its end, holding its device and
    writing files its retry may own. Its group is now ended (TERM, then KILL after the grace period), its child too."""
    pids = tmp_path / "pids"
    path = command_study(tmp_path, SILENT_SCRIPT, f"train.py {pids}", stop_grace_period=1)
    worker = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path)], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not pids.exists() or not pids.read_text():
            assert worker.poll() is None and time.monotonic() < deadline, "the command never started"
            time.sleep(0.05)
        command, child = map(int, pids.read_text().split())
        assert not gone(command) and not gone(child)
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 120
    while not (gone(command) and gone(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(command) and gone(child), (command, child)


def test_bad_report_from_a_script_fails_the_trial(tmp_path: Path) -> None:
    script = "from sweep import client\nclient.report(1, accuracy=0.5)\n"
    path = command_study(tmp_path, script, "train.py")
    assert sweep_cli("run", path, cwd=tmp_path).returncode == 1  # its only trial failed
    (trial,) = trials_of(path)
    assert trial.state.name == "FAIL"
    assert "the study's metric 'val_loss' is not among ['accuracy']" in trial.user_attrs["fail_reason"]


@pytest.mark.parametrize(("script", "reason"), [
    ("from sweep import client\nclient.report(2.5, val_loss=0.5)\n",
     "ValueError: report: the step must be a whole number, got float 2.5"),
    ("import os, socket\nsocket.socket(fileno=int(os.environ['SWEEP_REPORT_FD'])).sendall(b'step 1 loss 0.5\\n')\n",
     "ValueError: the command sent a report line that is not sweep.client's (Expecting value: line 1 column 1 "
     "(char 0)): 'step 1 loss 0.5'"),
    ("import os, socket\nsocket.socket(fileno=int(os.environ['SWEEP_REPORT_FD'])).sendall(b'[1, 0.5]\\n')\n",
     "the command sent a report line that is not sweep.client's (a JSON list, not an object)"),
])
def test_a_report_sweep_cannot_read_fails_the_trial_naming_it(tmp_path: Path, script: str, reason: str) -> None:
    # A step of 2.5 was cut to 2; a line written to the report socket by hand failed with a bare JSONDecodeError.
    path = command_study(tmp_path, script, "train.py")
    done = sweep_cli("run", path, cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr  # its only trial failed
    (trial,) = trials_of(path)
    assert trial.state.name == "FAIL" and reason in trial.user_attrs["fail_reason"]


def test_the_client_outside_a_study_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(ARGS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEP_")}
    done = subprocess.run([sys.executable, "train.py", "--lr", "0.01", "--hidden", "8"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 5  # every step ran: report() said go on


@pytest.mark.slow
def test_a_command_whose_worker_is_killed_is_retried_from_its_saved_state(tmp_path: Path) -> None:
    marker, events = tmp_path / "marker", tmp_path / "events.jsonl"
    path = command_study(tmp_path, RESUMING_SCRIPT, f"train.py {marker} {events}", heartbeat_interval=1,
                         heartbeat_grace_period=2, pruner="none")
    killed = run_cli("run", path, cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    done = run_cli("run", path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lost, retry = trials_of(path)
    assert lost.state.name == "FAIL" and lost.user_attrs["fail_reason"] == "worker lost: no heartbeat"
    assert retry.state.name == "COMPLETE" and retry.user_attrs["resumed_from"] == {"trial": 0, "step": 3}
    assert sorted(retry.intermediate_values) == [1, 2, 3, 4, 5, 6] and retry.value == 1.0 / 6
    # Its own steps, 4 to 6: the compute counted the lost trial's 3 again (found by review: 490 for 400).
    assert retry.user_attrs["steps_trained"] == 3 and retry.user_attrs["steps"] == 6
    status = run_cli("status", path, cwd=tmp_path)
    assert "6 steps trained" in status.stdout, status.stdout
    starts = [json.loads(line) for line in events.read_text().splitlines()]
    assert starts == [{"trial": 0, "start": None, "step": 0}, {"trial": 1, "start": "resume", "step": 3}]
    # The same weights as six unbroken steps from the same seed: state and RNG both came back.
    torch.manual_seed(0)
    expected = torch.zeros(3)
    for _ in range(6):
        expected = expected + torch.rand(3)
    resumed = json.loads(Path(retry.user_attrs["log"]).read_text().strip().splitlines()[-1])["weight"]
    assert resumed == pytest.approx(expected.tolist(), abs=0)


def test_commands_report_the_same_with_postgresql_storage(tmp_path: Path, postgres_url: str) -> None:
    path = command_study(tmp_path, NAN_SCRIPT, "train.py", name="cmd_pg", pruner="fastfail", storage=postgres_url,
                         checkpoints={"store": str(tmp_path / "store")})
    done = sweep_cli("run", path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (trial,) = trials_of(path, "cmd_pg", storage=postgres_url)
    assert trial.state.name == "PRUNED" and list(trial.intermediate_values) == [1, 2, 3, 4]
    assert Path(trial.user_attrs["log"]).is_relative_to(tmp_path / "store")


@pytest.mark.parametrize("last", ["true", '"0.42"'])
def test_a_json_line_whose_metric_is_no_number_is_not_the_trials_value(tmp_path: Path, last: str) -> None:
    """A script's last JSON line holding the metric as `true` or a string: float() took them (true completed the
    trial with 1.0); they are no number, as null is not."""
    script = f"print('{{\"val_loss\": 0.9}}')\nprint('{{\"val_loss\": {last}}}')\n"
    path = command_study(tmp_path, script, "train.py", n_trials=1)
    done = sweep_cli("run", path, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    [trial] = trials_of(path)
    assert trial.state.name == "FAIL" and "reported no 'val_loss'" in trial.user_attrs["fail_reason"]


@pytest.mark.parametrize("how", ["printed", "reported"])
def test_a_last_json_line_whose_val_loss_is_nan_is_a_diverged_trial_whatever_the_metric(tmp_path: Path,
                                                                                        how: str) -> None:
    """Diff review: a command's final line {"val_accuracy": 0.99, "val_loss": NaN} completed with 0.99 and was the
    study's best, where the same numbers reported, or returned by a loop, are diverged. Its reason named the metric
    ("val_accuracy is nan"), which was 0.99: it names the val_loss, printed or reported."""
    script = ("import json, sys\n"
              "from sweep import client\n"
              "loss = float(sys.argv[1]) if sys.argv[1] != 'diverged' else float('nan')\n"
              "numbers = {'val_accuracy': 0.99 if loss != loss else 0.6, 'val_loss': loss}\n"
              + ("print(json.dumps(numbers))\n" if how == "printed" else "client.report(7, **numbers)\n"))
    path = command_study(tmp_path, script, "train.py {loss}", n_trials=2, sampler={"type": "bruteforce"},
                         metric="val_accuracy", direction="maximize", max_repeated_failures=0, pruner="none",
                         space={"loss": {"type": "categorical", "choices": ["0.3", "diverged"]}})
    done = sweep_cli("run", path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    trials = {str(t.params["loss"]): t for t in trials_of(path)}
    assert trials["0.3"].state.name == "COMPLETE" and trials["0.3"].value == 0.6
    assert trials["diverged"].state.name == "FAIL"  # with fast-fail on, its nan rule prunes a NaN reported
    step = 0 if how == "printed" else 7
    assert trials["diverged"].user_attrs["fail_reason"] == \
        f"diverged: val_loss is nan (with val_accuracy 0.99) at step {step}", trials["diverged"].user_attrs


# Saves only when it is asked to stop, from its SIGTERM handler (the usual way a script meets a preemption); writes
# `ready` once it has reported a few steps.
SAVES_ON_SIGTERM = '''
import signal
import sys
import time
from pathlib import Path

from sweep import client

state = client.load()
first = state["step"] + 1 if state is not None else 1
done = first - 1  # the last step trained and reported: what a save holds (a signal may land inside the next one)


def on_term(signum, frame):
    client.save({"step": done}, done)
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
for step in range(first, 301):
    time.sleep(0.02)
    client.report(step, val_loss=1.0 / step)
    done = step
    if step == 3:
        Path(sys.argv[1]).write_text("ready")
'''


@pytest.mark.parametrize("stop", ["sigterm", "timeout"])
def test_a_command_stopped_by_sigterm_or_timeout_saves_from_its_handler_and_its_retry_resumes_there(
        tmp_path: Path, stop: str) -> None:
    # The worker stopped answering the script's socket once it was stopped: the handler's save blocked, the script
    # was killed after the grace period and its retry started from scratch.
    ready = tmp_path / "ready"
    path = command_study(tmp_path, SAVES_ON_SIGTERM, f"train.py {ready}", pruner="none", stop_grace_period=60)
    if stop == "timeout":
        assert sweep_cli("run", path, "--timeout", "1", cwd=tmp_path).returncode == 0
        reason = "interrupted: --timeout"
    else:
        worker = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path)], cwd=tmp_path,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 240
        while not ready.exists() and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=240)
        assert worker.returncode == 143, stderr
        reason = "preempted"
    stopped, _ = trials_of(path)
    assert stopped.user_attrs["fail_reason"].startswith(reason), stopped.user_attrs["fail_reason"]
    last = max(stopped.intermediate_values)
    assert 1 <= last < 300
    done = sweep_cli("run", path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    _, retry = trials_of(path)
    assert retry.state.name == "COMPLETE" and retry.user_attrs["resumed_from"]["step"] >= last - 1
    assert sorted(retry.intermediate_values) == list(range(1, 301))
    # The start state handed to the retry was the command's alone: gone with it.
    assert not list(Path(retry.user_attrs["log"]).parent.glob("*.start.pt"))


# Reports a step every 20 ms and dies at once on SIGTERM (no handler), with a report in flight.
DIES_ON_SIGTERM = '''
import sys
import time
from pathlib import Path

from sweep import client

for step in range(1, 601):
    time.sleep(0.02)
    client.report(step, val_loss=1.0 / step)
    if step == 3:
        Path(sys.argv[1]).write_text("ready")
'''


@pytest.mark.parametrize(("sent", "code", "reason"), [(signal.SIGINT, 130, "interrupted"),
                                                      (signal.SIGTERM, 143, "preempted")])
def test_a_stop_that_lands_between_reports_ends_the_trial_as_stopped_not_as_a_lost_connection(
        tmp_path: Path, sent: int, code: int, reason: str) -> None:
    # The worker ends the command's group, which dies before it reads the answer to its last report: the next read of
    # its socket raised ConnectionResetError, which left the wait before the stop was raised. The trial was filed as
    # the machine's fault ("lost connection"), the stop was forgotten and `sweep run` went on to the next trials,
    # exit 0.
    ready = tmp_path / "ready"
    path = command_study(tmp_path, DIES_ON_SIGTERM, f"train.py {ready}", pruner="none", n_trials=2)
    worker = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path)], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not ready.exists() and worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.send_signal(sent)
    _, stderr = worker.communicate(timeout=240)
    assert worker.returncode == code, stderr
    trial, *others = trials_of(path)
    assert trial.user_attrs["outcome"] == reason and trial.user_attrs["fail_reason"].startswith(reason), \
        trial.user_attrs
    assert [t.state.name for t in others] == ["WAITING"]  # its retry, queued; no other trial started


@pytest.mark.parametrize(("sent", "named"), [("signal.SIGRTMIN + 3", "SIGRTMIN+3"), ("signal.SIGKILL", "SIGKILL")])
def test_a_command_killed_by_a_signal_fails_naming_it_with_its_log(tmp_path: Path, sent: str, named: str) -> None:
    # SIGKILL (the out-of-memory killer's) has no handler the guard running the command could reset: it failed with
    # its own traceback, and the trial read "exited with code 1".
    script = f"import os, signal\nprint('about to go')\nos.kill(os.getpid(), {sent})\n"
    path = command_study(tmp_path, script, "train.py", pruner="none")
    assert sweep_cli("run", path, cwd=tmp_path).returncode == 1
    (trial,) = trials_of(path)
    assert trial.user_attrs["fail_reason"] == f"the command was killed by {named}: about to go"


def test_the_last_json_line_is_found_from_the_end_of_a_long_log_across_its_blocks(tmp_path: Path) -> None:
    # The log was read whole into memory (a script that prints gigabytes took the worker with it); now it is read
    # block by block from its end, lines split as before (a progress bar's carriage return too).
    from sweep.runners.command import _tail, last_json_value

    log = tmp_path / "trial.log"
    with log.open("wb") as out:
        out.write(b'{"val_loss": 0.25}\n' + "épöch 1\r".encode() * 40_000 + b'{"val_loss": 0.5}\rloading ')
        out.write("é".encode() * 100_000 + b"\n" + b"done\n\n")
    assert last_json_value(log, "val_loss") == 0.5
    assert _tail(log, 2).endswith("é | done") and len(_tail(log, 2)) == 800
    assert last_json_value(log, "accuracy") is None
    assert last_json_value(tmp_path / "missing.log", "val_loss") is None
    # An integer beyond a float's range is infinite (the trial diverged), not an OverflowError failing the trial.
    (tmp_path / "huge.log").write_text('{"val_loss": 1' + "0" * 400 + "}\n")
    assert last_json_value(tmp_path / "huge.log", "val_loss") == math.inf
    # A command that printed nothing: its failure reason says so, never ends in a bare colon.
    (tmp_path / "empty.log").write_bytes(b"\n\n")
    assert _tail(tmp_path / "empty.log") == "(no output)"


def test_a_line_longer_than_any_kept_is_given_by_its_end_and_the_rest_of_it_is_not_read(tmp_path: Path) -> None:
    # A progress bar written for hours without a newline was one line: its start was carried from block to block
    # and copied again with each (quadratic: a 430 MB log held the worker for minutes after the command exited, deaf
    # to SIGTERM). Carriage returns now end lines as they read, and a line too long is kept by its end.
    from sweep.runners.command import LONGEST_LINE, _lines_backwards, _tail, last_json_value

    log = tmp_path / "trial.log"
    with log.open("wb") as out:
        out.write(b"started\n" + b"#" * (3 * LONGEST_LINE + 12345) + b"end of bar\n" + b"Traceback: boom\n")
    lines = list(_lines_backwards(log))
    assert lines == ["", "Traceback: boom", "#" * (LONGEST_LINE - len("end of bar")) + "end of bar", "started"]
    assert _tail(log, 2).endswith("end of bar | Traceback: boom")
    with log.open("wb") as out:
        out.write(b'{"val_loss": 0.25}\n' + "".join(f"\r{i:>8}/100000 loss=0.1" for i in range(100_000)).encode())
    assert last_json_value(log, "val_loss") == 0.25
    assert _tail(log, 1) == "99999/100000 loss=0.1"
    # Users' code review: a last JSON line too long to read whole was passed over, and an earlier line's value taken
    # without a word. It is named instead; a long line that is no JSON object's end is still passed over.
    from sweep.runners.command import LineTooLong

    with log.open("wb") as out:
        out.write(b'{"val_loss": 9.0}\n' + json.dumps({"val_loss": 0.33, "per_sample": [0.5] * 250_000}).encode()
                  + b"\n")
    with pytest.raises(LineTooLong, match="longer than the 1 MiB sweep reads of one line; print val_loss"):
        last_json_value(log, "val_loss")
    with log.open("ab") as out:
        out.write(b'{"val_loss": 0.5}\n')  # a shorter line after it: the last one holding the metric
    assert last_json_value(log, "val_loss") == 0.5
    for first in (b"", b"started\n"):  # the long line first in the log, or after another
        log.write_bytes(first + b'  {"val_loss": 0.33, "per_sample": "' + b"5" * (3 * LONGEST_LINE) + b'"}')
        with pytest.raises(LineTooLong):
            last_json_value(log, "val_loss")
    # Diff review: a long line that only ends as JSON does (a progress bar ending in "{done}") is no JSON line.
    log.write_bytes(b'{"val_loss": 0.5}\nprogress ' + b"x" * 1_200_000 + b" {done}\n")
    assert last_json_value(log, "val_loss") == 0.5


def test_lines_read_backwards_in_blocks_of_any_size_are_the_log_s_lines(tmp_path: Path) -> None:
    # A "\r\n" whose "\r" ended one block and "\n" began the next was two breaks: a blank line in a failed
    # command's reason, and one real line lost from its end.
    import random

    from sweep.runners.command import _lines_backwards

    rng = random.Random(0)
    log = tmp_path / "trial.log"
    for case in range(400):
        data = bytes(rng.choice(b"ab\r\n") for _ in range(rng.randrange(0, 40)))
        log.write_bytes(data)
        expected = list(reversed(data.decode().splitlines()))
        for block in (1, 2, 3, 5, 64):
            got = [line for line in _lines_backwards(log, block=block)]
            # A final break gives one empty last line, as `bytes.split` does; nothing else may differ.
            if data.endswith((b"\r", b"\n")):
                assert got[0] == "", (case, data, block, got)
                got = got[1:]
            assert got == expected, (case, data, block, got)


def test_a_process_a_launcher_started_without_the_report_channel_is_told_how_to_pass_it_on(tmp_path: Path) -> None:
    # A launcher's child (subprocess closes inherited descriptors by default) crashed on "Bad file descriptor".
    script = ("import subprocess, sys\n"
              "code = 'from sweep import client; client.report(1, val_loss=0.5)'\n"
              "sys.exit(subprocess.run([sys.executable, '-c', code]).returncode)\n")
    path = command_study(tmp_path, script, "train.py", pruner="none")
    assert sweep_cli("run", path, cwd=tmp_path).returncode == 1
    (trial,) = trials_of(path)
    assert "the report channel (SWEEP_REPORT_FD=" in trial.user_attrs["fail_reason"]
    assert "pass_fds=[int(os.environ['SWEEP_REPORT_FD'])]" in trial.user_attrs["fail_reason"]


def test_a_placeholder_for_a_whole_mapping_is_written_as_json(tmp_path: Path) -> None:
    # `{model}` was "not a key of the config", though the README writes a mapping as JSON.
    script = ("import json, sys\nmodel = json.loads(sys.argv[1])\n"
              "print(json.dumps({'val_loss': model['hidden'] / 100}))\n")
    path = command_study(tmp_path, script, "train.py {model}", pruner="none", fixed={"model": {"hidden": 8}})
    done = sweep_cli("run", path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (trial,) = trials_of(path)
    assert trial.value == 0.08


def test_a_command_reproduces_and_is_written_out_under_the_thread_count_its_worker_gave_it(tmp_path: Path) -> None:
    # Found by review: a worker of --workers 2 gives its command OMP_NUM_THREADS=1; the replay ran with the
    # reproducer's own count, so `sweep reproduce` said a command trial differs in its last digits, and `sweep best`
    # wrote its command line without the variable. This script's value shows the count it was given.
    script = ("import os\nfrom sweep import client\n"
              "client.report(1, val_loss=1.0 / int(os.environ.get('OMP_NUM_THREADS', '7')))\n")
    path = command_study(tmp_path, script, "train.py", pruner="none")
    assert sweep_cli("run", path, cwd=tmp_path, env={"OMP_NUM_THREADS": "1"}).returncode == 0  # as a worker's
    (trial,) = trials_of(path)
    assert trial.value == 1.0 and trial.user_attrs["reproducibility"]["threads"]["OMP_NUM_THREADS"] == "1"
    again = sweep_cli("reproduce", path, "0", cwd=tmp_path, env={"OMP_NUM_THREADS": None})
    assert again.returncode == 0, again.stderr
    best = sweep_cli("best", path, cwd=tmp_path, env={"OMP_NUM_THREADS": None})
    assert best.returncode == 0 and f"#   OMP_NUM_THREADS=1 {sys.executable} train.py\n" in best.stdout, best.stdout


def test_a_command_replayed_after_its_folder_moved_names_the_folder_it_ran_in_instead(tmp_path: Path) -> None:
    """Found by review: a command's folder gone (moved, deleted) since its trial ran, `sweep reproduce` ran the
    `train.py` of the working folder instead, and a difference it found listed nothing as changed."""
    (tmp_path / "project").mkdir()
    script = "from sweep import client\nclient.report(1, val_loss={value})\n"
    path = command_study(tmp_path / "project", script.format(value=1.0), "train.py", pruner="none")
    assert sweep_cli("run", path, cwd=path.parent).returncode == 0
    moved = tmp_path / "moved"
    path.parent.rename(moved)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "train.py").write_text(script.format(value=2.0))
    again = sweep_cli("reproduce", moved / path.name, "0", "--trust-task", cwd=tmp_path / "elsewhere")
    assert again.returncode == 1, again.stderr
    assert f"the command's folder {path.parent} then, {tmp_path / 'elsewhere'} now" in again.stderr, again.stderr


@pytest.mark.parametrize("last", ["nan", "inf", "9" * 5000])
def test_a_last_line_holding_the_metric_that_is_not_json_fails_the_trial(tmp_path: Path, last: str) -> None:
    """Review: a script that writes its JSON by hand printed `{"step": 100, "val_loss": nan}` (or a number beyond
    Python's 4300 digits) last; that line was passed over and the trial completed with an earlier line's 0.5."""
    lines = ['{"step": 50, "val_loss": 0.5}', '{"step": 100, "val_loss": ' + last + '}',
             '{"note": done}']  # a later line that is not JSON and holds no metric: passed over
    script = "".join(f"print({line!r})\n" for line in lines)
    path = command_study(tmp_path, script, "train.py", pruner="none", max_repeated_failures=0)
    done = sweep_cli("run", path, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    [trial] = trials_of(path)
    assert trial.state.name == "FAIL", trial.user_attrs
    reason = trial.user_attrs["fail_reason"]
    assert reason.startswith("the command exited with code 0, but its output's last line holding 'val_loss' is not "
                             "JSON ("), reason


def test_a_last_line_not_json_is_found_for_a_metric_named_in_any_script(tmp_path: Path) -> None:
    """Diff review: with a metric named `val_точность` the unreadable last line was passed over (its name was looked
    for as JSON's ASCII escapes) and the trial completed with the earlier 0.5."""
    lines = ['{"step": 1, "val_точность": 0.5}', '{"step": 2, "val_точность": nan}']
    script = "".join(f"print({line!r})\n" for line in lines)
    path = command_study(tmp_path, script, "train.py", pruner="none", max_repeated_failures=0, metric="val_точность")
    done = sweep_cli("run", path, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    [trial] = trials_of(path)
    assert trial.state.name == "FAIL", trial.user_attrs
    assert "last line holding 'val_точность' is not JSON" in trial.user_attrs["fail_reason"], trial.user_attrs
