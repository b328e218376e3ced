"""Real faults under real workers: PostgreSQL restarted under three workers, one trial SIGKILLed and interrupted
again and again, a checkpoint folder and a SQLite file on a full filesystem, a corrupt newest checkpoint, a retry
that resumes at `max_steps`, and `sweep reproduce` of a trial trained by one of several workers.

Every test waits on conditions it reads from the storage (with deadlines far above the normal time) and then asserts
on what the storage holds: trial states, the `outcome` and `retry_of` of each trial, its intermediate values, the
checkpoint registry. The random moments are drawn from a seed that each failure message names
(`SWEEP_FAULT_SEED=N` replays it).
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import optuna
import pytest
import torch
from optuna.trial import FrozenTrial, TrialState

from sweep.outcomes import budget_counts
from tests.conftest import TINY_STUDY, another_user, run_cli, sweep_cli, write_study
from tests.pg import PostgresServer, postgres_available

T = TypeVar("T")

CLI_ENV = {"COLUMNS": "200"}  # wide enough that no message is wrapped

# One config, trained the same way every time: the random sampler over an empty space, every value fixed.
ONE_CONFIG: dict[str, Any] = {
    "n_trials": 1,
    "seed": 0,
    "sampler": {"type": "random"},
    "pruner": "none",
    "task": "digits",
    "heartbeat_interval": 1,
    "heartbeat_grace_period": 2,
    "fixed": {"max_steps": 400, "eval_every_steps": 40, "log_every_steps": 20, "batch_size": 64,
              "learning_rate": 0.01, "model": {"hidden": 64}},
    "space": {},
}


def one_config(name: str, **keys: Any) -> dict[str, Any]:
    document = copy.deepcopy(ONE_CONFIG) | {"name": name} | keys
    document["fixed"] = {**ONE_CONFIG["fixed"], **keys.get("fixed", {})}
    return document


def fault_rng() -> tuple[random.Random, int]:
    seed = int(os.environ.get("SWEEP_FAULT_SEED", random.randrange(2**32)))
    return random.Random(seed), seed


# ---------------------------------------------------------------------------------------------------------------------
# Processes and waiting.

def start_sweep(*args: str | Path, log: Path, env: dict[str, str] | None = None,
                as_user: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """`sweep ARGS` in a process of its own, its output (both streams) to `log`: a file never fills up the way a
    pipe nobody reads does. `env`: its whole environment (default: this process's). `as_user`: the command that
    runs it as another user (`another_user()`)."""
    with open(log, "ab") as handle:
        return subprocess.Popen([*as_user, sys.executable, "-m", "sweep.cli", *map(str, args)], stdout=handle,
                                stderr=subprocess.STDOUT, env={**(os.environ if env is None else env), **CLI_ENV})


def finish(process: subprocess.Popen[bytes], log: Path, timeout: float) -> int:
    """Its exit code; killed, with a failure that shows its output, if it has not ended within `timeout`."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"`sweep` did not end within {timeout} s; its output ends with:\n{tail(log)}")


def tail(log: Path, chars: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no output)"


def sweep_run(*args: str | Path, log: Path, timeout: float = 300, env: dict[str, str] | None = None,
              as_user: Sequence[str] = ()) -> int:
    return finish(start_sweep("run", *args, log=log, env=env, as_user=as_user), log, timeout)


def wait_for(what: str, probe: Callable[[], T], timeout: float, *, interval: float = 0.05,
             alive: subprocess.Popen[bytes] | None = None) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` and the last value seen when `timeout`
    passes, or at once when the process `alive` has ended (its result is then in the failure)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = probe()
        if seen:
            return seen
        if alive is not None and alive.poll() is not None:
            raise ProcessEnded(f"the process ended (exit code {alive.returncode}) before {what}; last seen: {seen!r}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout} s; last seen: {seen!r}")
        time.sleep(interval)


class ProcessEnded(Exception):
    pass


# ---------------------------------------------------------------------------------------------------------------------
# What the storage holds.

def sqlite_rows(db: Path, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Rows straight from the SQLite file, or [] while it or the table does not exist yet (or is busy)."""
    if not db.exists():
        return []
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as connection:
            return connection.execute(query, params).fetchall()
    except sqlite3.OperationalError:
        return []


def checkpoint_rows(db: Path) -> list[tuple[int, int, int, str]]:
    """(id, trial, step, uri) of every registered checkpoint, oldest step first."""
    return sqlite_rows(db, "SELECT id, trial_number, step, uri FROM sweep_checkpoints ORDER BY step, id")


def running_trials(db: Path) -> list[int]:
    return [n for (n,) in sqlite_rows(db, "SELECT number FROM trials WHERE state = 'RUNNING' ORDER BY number")]


def load_trials(storage: str, name: str) -> list[FrozenTrial]:
    return optuna.load_study(study_name=name, storage=storage).get_trials()


def retried_numbers(trials: list[FrozenTrial]) -> set[int]:
    return {int(t.user_attrs["retry_of"]) for t in trials if t.user_attrs.get("retry_of") is not None}


def counted(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """The trials that use up the budget: complete, pruned, and failed ones that no other trial retries (nor a trial
    withdrawn untrained: asked beyond the budget while the server restarted)."""
    retried = retried_numbers(trials)
    return [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
            or (t.state == TrialState.FAIL and t.number not in retried and "withdrawn" not in t.user_attrs)]


def descendants(trials: list[FrozenTrial], number: int) -> list[FrozenTrial]:
    """The trial and every retry of it, of its retries, and so on, in number order."""
    by_origin: dict[int, list[FrozenTrial]] = {}
    for t in trials:
        if t.user_attrs.get("retry_of") is not None:
            by_origin.setdefault(int(t.user_attrs["retry_of"]), []).append(t)
    found, todo = [], [number]
    while todo:
        current = todo.pop()
        found += [t for t in trials if t.number == current]
        todo += [t.number for t in by_origin.get(current, [])]
    return sorted(found, key=lambda t: t.number)


def eval_steps(first: int, every: int, max_steps: int) -> list[int]:
    return sorted({*range(first, max_steps, every), max_steps})


def summary(trials: list[FrozenTrial], most: int = 16) -> str:
    """One line per trial, for failure messages: what the storage held (the first and last few of many)."""
    lines = []
    shown = trials if len(trials) <= most else [*trials[: most - 4], *trials[-4:]]
    for t in shown:
        if len(trials) > most and t is trials[-4]:
            lines.append(f"  ... {len(trials) - most} more")
        attrs = {k: t.user_attrs.get(k) for k in ("outcome", "retry_of", "retry_reason", "resumed_from",
                                                  "fail_reason", "interrupted") if k in t.user_attrs}
        steps = sorted(t.intermediate_values)
        span = f"{steps[0]}..{steps[-1]} ({len(steps)})" if steps else "none"
        lines.append(f"  #{t.number} {t.state.name} value={t.value} steps={span} {attrs}")
    return "\n".join(lines)


def fault_row(scenario: str, trials: list[FrozenTrial], n_trials: int, crashed: int | str) -> None:
    """One row of the closing note's fault table, printed (`pytest -s` shows it): trials asked, counted towards
    n_trials, finished as complete or pruned, failed as lost / infrastructure / interrupted (each retried), workers
    crashed, and finished results lost (a trial that reported at max_steps whose line of retries did not complete)."""
    by_outcome = {name: sum(t.user_attrs.get("outcome") == name for t in trials)
                  for name in ("lost", "infrastructure", "interrupted", "preempted")}
    final = {t.number: max(t.intermediate_values) for t in trials if t.intermediate_values}
    top = max(final.values(), default=0)
    lost_results = sum(1 for t in trials if final.get(t.number) == top and t.state != TrialState.COMPLETE
                       and not any(d.state == TrialState.COMPLETE for d in descendants(trials, t.number)))
    print(f"FAULT-TABLE | {scenario} | asked {len(trials)} | counted {len(counted(trials))}/{n_trials} | "
          f"complete {sum(t.state == TrialState.COMPLETE for t in trials)} | "
          + " | ".join(f"{k} {v}" for k, v in by_outcome.items())
          + f" | running {sum(t.state == TrialState.RUNNING for t in trials)} | crashed workers {crashed} | "
          f"results lost {lost_results} |")


class Findings:
    """Every broken expectation of one test, reported together: a fault test that stops at the first one hides
    what else the storage got wrong."""

    def __init__(self, context: str) -> None:
        self.context = context
        self.problems: list[str] = []

    def expect(self, condition: object, message: str) -> None:
        if not condition:
            self.problems.append(message)

    def check(self) -> None:
        assert not self.problems, "\n".join([f"{len(self.problems)} problem(s):", *self.problems, self.context])


# ---------------------------------------------------------------------------------------------------------------------
# A small filesystem of our own.

def _mount_tmpfs(folder: Path, size: str) -> None:
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")


@contextlib.contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted on `folder`, unmounted at the end whatever happens. Skips unless root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    folder.mkdir(parents=True, exist_ok=True)
    _mount_tmpfs(folder, size)
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def resize(folder: Path, size: str) -> None:
    """Give the mounted tmpfs more (or less) room, its files kept: what freeing space looks like to sweep."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True, capture_output=True)


def used_bytes(folder: Path) -> int:
    stats = os.statvfs(folder)
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


# =====================================================================================================================
# 1. PostgreSQL restarted under three workers.

@pytest.mark.slow
def test_three_workers_ride_out_five_postgresql_restarts(tmp_path: Path) -> None:
    if not postgres_available():
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    rng, seed = fault_rng()
    # Long enough for five restarts on an idle machine too (24 trials once ended after four, exit 0, all sound).
    n_trials, max_steps, every = 36, 300, 50
    document = {
        "name": "restarts", "n_trials": n_trials, "seed": 0, "sampler": {"type": "random"}, "pruner": "none",
        "task": "digits", "heartbeat_interval": 1, "heartbeat_grace_period": 5,
        "checkpoints": {"every_steps": every, "on_best": False, "store": str(tmp_path / "checkpoints")},
        "fixed": {"max_steps": max_steps, "eval_every_steps": every, "log_every_steps": every, "batch_size": 64},
        "space": {"learning_rate": {"type": "float", "low": 1e-3, "high": 3e-2, "log": True},
                  "model.hidden": {"type": "int", "low": 16, "high": 64}},
    }
    path = write_study(tmp_path, document)
    log = tmp_path / "workers.log"
    with PostgresServer() as server:
        engine = create_engine(server.url, poolclass=NullPool)

        def progress() -> tuple[int, int] | None:
            """(evaluations reported, trials running), or None while the server is down or the tables missing."""
            try:
                with engine.connect() as connection:
                    reports = connection.execute(text("SELECT count(*) FROM trial_intermediate_values")).scalar()
                    running = connection.execute(text("SELECT count(*) FROM trials WHERE state = 'RUNNING'")).scalar()
                return int(reports or 0), int(running or 0)
            except Exception:  # noqa: BLE001 - down, restarting, or not created yet
                return None

        def training_past(reports: int) -> tuple[int, int] | None:
            now = progress()
            return now if now is not None and now[0] > reports and now[1] > 0 else None

        workers = start_sweep("run", path, "--storage", server.url, "--workers", "3", log=log)
        restarts: list[str] = []
        try:
            for _ in range(5):
                before = progress() or (0, 0)
                try:  # a restart lands while trials train: after a new evaluation, at a random moment after it
                    wait_for("new evaluation with trials running", partial(training_past, before[0]), 240,
                             interval=0.1, alive=workers)
                except ProcessEnded as exc:
                    pytest.fail(f"the study ended after {len(restarts)} of 5 restarts ({exc}); it must last longer "
                                f"(seed {seed}):\n{tail(log)}")
                time.sleep(rng.uniform(0.0, 1.0))
                down = rng.choice([0.0, 0.0, 1.0, 2.0, 3.0])
                server.restart("fast", down_s=down)
                restarts.append(f"{time.strftime('%H:%M:%S')} down {down} s")
            code = finish(workers, log, 600)
        finally:
            if workers.poll() is None:
                workers.kill()
        engine.dispose()
        trials = load_trials(server.url, "restarts")

    output = log.read_text(errors="replace")
    found = Findings(f"seed {seed}; restarts {restarts}; trials:\n{summary(trials)}\noutput ends with:\n"
                     f"{output[-3000:]}")
    found.expect(code == 0, f"`sweep run --workers 3` exited {code}: a worker crashed (no worker may)")
    found.expect(not [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)],
                 f"trials left running or waiting: "
                 f"{[t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]}")
    used = counted(trials)
    found.expect(len(used) == n_trials, f"{len(used)} trials counted, expected exactly {n_trials}: "
                                        f"{[t.number for t in used]}")
    not_complete = [(t.number, t.state.name, t.user_attrs.get("fail_reason")) for t in used
                    if t.state != TrialState.COMPLETE]
    found.expect(not not_complete, f"counted trials that did not complete (an outage is no config's fault): "
                                   f"{not_complete}")
    # each sampled config counts once, however often it was retried; a trial withdrawn untrained (asked beyond the
    # budget while the server restarted) is no sampled config and counts zero times
    roots = [t for t in trials if t.user_attrs.get("retry_of") is None and "withdrawn" not in t.user_attrs]
    withdrawn = [t for t in trials if "withdrawn" in t.user_attrs]
    found.expect(all(t.state == TrialState.FAIL and not t.intermediate_values and not descendants(trials, t.number)[1:]
                     for t in withdrawn),
                 f"a withdrawn trial trained or was retried: {[(t.number, t.state.name) for t in withdrawn]}")
    for root in roots:
        lineage = descendants(trials, root.number)
        in_budget = [t.number for t in lineage if t.number in {u.number for u in used}]
        found.expect(len(in_budget) == 1, f"lineage of #{root.number} counted {len(in_budget)} times: {in_budget}")
    curve = eval_steps(every, every, max_steps)
    for t in trials:
        if t.state == TrialState.COMPLETE:
            found.expect(sorted(t.intermediate_values) == curve,
                         f"#{t.number} is COMPLETE without its whole curve: steps {sorted(t.intermediate_values)}")
        if max_steps in t.intermediate_values:  # its training finished: the result must be kept
            final = t.intermediate_values[max_steps]
            kept = [d for d in descendants(trials, t.number) if d.state == TrialState.COMPLETE]
            found.expect(len(kept) == 1 and kept[0].value == final,
                         f"#{t.number} finished training (value {final} at step {max_steps}) but its lineage holds "
                         f"{[(d.number, d.value) for d in kept]} as COMPLETE: a finished result was lost")
    storage_lines = [line for line in output.splitlines() if "storage" in line.lower()]
    found.expect(any("back" in line.lower() for line in storage_lines)
                 and any(re.search(r"unreachable|down|lost|gone|away|wait", line.lower()) for line in storage_lines),
                 f"no worker said the storage went away and came back; lines naming the storage: {storage_lines[:10]}")
    fault_row("PostgreSQL restarted 5x (pg_ctl restart -m fast), 3 workers", trials, n_trials, int(code != 0))
    found.check()


# =====================================================================================================================
# 2. One trial, SIGKILLed and interrupted at random moments, rerun each time.

@pytest.mark.slow
def test_a_trial_killed_and_interrupted_again_and_again_ends_as_if_never_stopped(tmp_path: Path) -> None:
    rng, seed = fault_rng()
    document = one_config("lineage", checkpoints={"every_steps": 20, "on_best": False, "keep_top_k": 1})
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    reference_log = tmp_path / "reference.log"
    reference = start_sweep("run", write_study(reference_dir, document), log=reference_log)  # meanwhile
    path = write_study(tmp_path, document)
    db = tmp_path / "lineage.db"
    log = tmp_path / "runs.log"

    def newest() -> tuple[int, int] | None:
        """(step, trial) of the lineage's newest registered checkpoint."""
        rows = checkpoint_rows(db)
        return None if not rows else max((step, trial) for _, trial, step, _ in rows)

    def newest_from(step: int) -> tuple[int, int] | None:
        found = newest()
        return found if found is not None and found[0] >= step else None

    def snapshot() -> tuple[int, set[int], tuple[int, int] | None]:
        """(the highest number of a trial some run took up, the trials running, the newest checkpoint)."""
        rows = sqlite_rows(db, "SELECT number, state FROM trials")
        taken = max([n for n, state in rows if state != "WAITING"], default=-1)
        return taken, {n for n, state in rows if state == "RUNNING"}, newest()

    # (signal, moment): "mid" once the lineage has checkpointed further, "early" right after a new run took the
    # trial up (while it finds and loads the checkpoint to resume from, or its first steps after).
    schedule = [(signal.SIGKILL, "mid"), (signal.SIGINT, "mid"), (signal.SIGKILL, "early"), (signal.SIGINT, "early"),
                (signal.SIGKILL, "mid"), (signal.SIGINT, "early")]
    # Before each run: what `snapshot` saw. A trial that run takes up (a higher number than any taken before) must
    # resume from exactly the newest checkpoint then: one worker, nothing else trains meanwhile.
    before_runs: list[tuple[int, tuple[int, int] | None]] = []
    victims: dict[int, signal.Signals] = {}  # trial number -> the signal its process got while training it
    ended_early, events, codes = None, [], []
    try:
        for signum, moment in schedule:
            taken, running_before, at_start = snapshot()
            before_runs.append((taken, at_start))
            run = start_sweep("run", path, log=log)

            def taken_up(before: set[int] = running_before) -> list[int]:
                return [n for n in running_trials(db) if n not in before]

            try:
                if moment == "mid":
                    target = (at_start[0] if at_start else 0) + 20 * rng.randint(1, 3)
                    wait_for(f"checkpoint at step >= {target}", partial(newest_from, target), 240, alive=run)
                else:
                    wait_for("a trial taken up", taken_up, 240, alive=run)
                    time.sleep(rng.uniform(0.0, 0.4))
            except ProcessEnded as exc:
                ended_early = f"before {signum.name} at {moment}: {exc}"
                break
            busy = taken_up()
            run.send_signal(signum)
            code = finish(run, log, 120)
            events.append(f"{signum.name} at {moment} -> exit {code}, trial {busy}, newest {newest()}")
            codes.append((signum, code))
            if busy:
                victims[busy[-1]] = signum
        before_runs.append(snapshot()[::2])
        final_code = sweep_run(path, log=log, timeout=300)
        reference_code = finish(reference, reference_log, 300)
    finally:
        if reference.poll() is None:
            reference.kill()
    assert reference_code == 0, tail(reference_log)
    [expected] = load_trials(f"sqlite:///{reference_dir / 'lineage.db'}", "lineage")
    assert expected.state == TrialState.COMPLETE and len(expected.intermediate_values) == 10

    trials = load_trials(f"sqlite:///{db}", "lineage")
    found = Findings(f"seed {seed}; events {events}; before each run (highest trial taken, newest checkpoint) "
                     f"{before_runs}; trials:\n{summary(trials)}\noutput ends with:\n{tail(log, 3000)}")
    found.expect(ended_early is None, f"a run ended {ended_early}: the trial must train longer")
    found.expect(all(code == 130 for signum, code in codes if signum == signal.SIGINT),
                 f"an interrupted `sweep run` did not exit 130: {codes}")
    found.expect(final_code == 0, f"the last `sweep run` exited {final_code}")
    found.expect(not [t.number for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)],
                 "a trial was left running or waiting")
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    found.expect(len(complete) == 1, f"{len(complete)} COMPLETE trials, expected exactly one")
    found.expect(len(counted(trials)) == 1, f"{len(counted(trials))} trials counted, expected 1")
    found.expect({t.number for t in descendants(trials, 0)} == {t.number for t in trials},
                 "not every trial belongs to trial 0's lineage")
    if complete:
        got = complete[0]
        found.expect(got.intermediate_values == expected.intermediate_values,
                     f"#{got.number}'s curve differs from the uninterrupted run's: "
                     f"{sorted(got.intermediate_values.items())} vs {sorted(expected.intermediate_values.items())}")
        found.expect(got.value == expected.value, f"value {got.value} vs uninterrupted {expected.value}")
    resumed = [(t.number, t.user_attrs["resumed_from"]) for t in trials if "resumed_from" in t.user_attrs]
    steps = [r["step"] for _, r in resumed]
    found.expect(steps == sorted(steps), f"resumed_from went backwards: {resumed}")
    for t in trials:
        if t.number == 0:
            continue
        # The run that created this trial started after the newest checkpoint `then` was written; nothing else
        # trained meanwhile (one worker), so that is the checkpoint it must continue from.
        then = [n for last, n in before_runs if last < t.number][-1]
        trained = bool(t.intermediate_values) or t.state == TrialState.COMPLETE
        if then is not None and (trained or "resumed_from" in t.user_attrs):
            found.expect(t.user_attrs.get("resumed_from") == {"trial": then[1], "step": then[0]},
                         f"#{t.number} resumed from {t.user_attrs.get('resumed_from')}, but the lineage's newest "
                         f"checkpoint was trial {then[1]}'s at step {then[0]}")
    expected_outcomes = {signal.SIGKILL: "lost", signal.SIGINT: "interrupted"}
    for number, signum in victims.items():
        [t] = [t for t in trials if t.number == number]
        found.expect(t.user_attrs.get("outcome") == expected_outcomes[signum],
                     f"#{number} ({signum.name}) has outcome {t.user_attrs.get('outcome')!r}, expected "
                     f"{expected_outcomes[signum]!r}")
    for t in complete:
        found.expect(t.user_attrs.get("outcome") == "complete", f"#{t.number}: outcome {t.user_attrs.get('outcome')!r}")
    fault_row(f"one trial SIGKILLed/SIGINTed {len(events)}x, rerun each time", trials, 1, "-")
    found.check()


# =====================================================================================================================
# 3. A full filesystem: the checkpoint folder, then the SQLite file.

FULL_STORE_STUDY: dict[str, Any] = {
    "name": "fullstore", "n_trials": 3, "seed": 0, "sampler": {"type": "random"}, "pruner": "none", "task": "digits",
    "heartbeat_interval": 1, "heartbeat_grace_period": 2,
    "fixed": {"max_steps": 200, "eval_every_steps": 50, "log_every_steps": 50, "batch_size": 64,
              "model": {"hidden": 64}},
    "space": {"learning_rate": {"type": "float", "low": 1e-3, "high": 3e-2, "log": True}},
}


@pytest.mark.slow
def test_a_full_checkpoint_folder_stops_the_run_without_spending_the_budget(tmp_path: Path) -> None:
    store = tmp_path / "store"
    # A checkpoint of this model is about 130 KB: 300 KB holds two, and a trial writes four (keeping two).
    with tmpfs(store, "300k"):
        document = copy.deepcopy(FULL_STORE_STUDY) | {
            "checkpoints": {"every_steps": 50, "on_best": False, "keep_top_k": 1, "store": str(store)}}
        path = write_study(tmp_path, document)
        db = tmp_path / "fullstore.db"
        log = tmp_path / "first.log"
        run = start_sweep("run", path, log=log)
        try:  # it must stop by itself; a run that retries the same fault without end is stopped here
            wait_for("end of the run (or a runaway: more than 30 trials)",
                     lambda: run.poll() is not None or len(sqlite_rows(db, "SELECT number FROM trials")) > 30,
                     300, interval=0.2)
        finally:
            if run.poll() is None:
                run.kill()
        code = run.wait()
        first = log.read_text(errors="replace")
        trials = load_trials(f"sqlite:///{db}", "fullstore")
        found = Findings(f"trials:\n{summary(trials)}\noutput ends with:\n{first[-3000:]}")
        found.expect(code == 1, f"`sweep run` on a full checkpoint folder exited {code}, expected 1 "
                                f"({len(trials)} trials; -9: killed here, it did not stop by itself)")
        found.expect("Traceback" not in first, "a traceback was printed")
        found.expect(str(store) in first and "space" in first.lower(),
                     f"the message does not name the folder ({store}) and its space")
        found.expect(code == -9 or not [t.number for t in trials if t.state == TrialState.RUNNING],
                     "a trial was left RUNNING")
        infra = [t for t in trials if t.state == TrialState.FAIL]
        found.expect(infra, "no trial failed although the checkpoint folder is full")
        retried = retried_numbers(trials)
        for t in infra:
            reason = str(t.user_attrs.get("fail_reason", ""))
            found.expect(reason.startswith("infrastructure:") and str(store) in reason
                         and re.search(r"free|space", reason, re.IGNORECASE),
                         f"#{t.number}: fail_reason {reason!r} does not start with 'infrastructure:' naming the "
                         f"folder and its free space")
            found.expect(t.user_attrs.get("outcome") == "infrastructure",
                         f"#{t.number}: outcome {t.user_attrs.get('outcome')!r}")
            found.expect(t.number in retried, f"#{t.number} failed for good (no retry): it counts against n_trials")
        found.expect(not counted(trials) or all(t.state == TrialState.COMPLETE for t in counted(trials)),
                     f"counted trials that did not complete: {[t.number for t in counted(trials)]}")
        found.check()

        resize(store, "64m")
        log = tmp_path / "second.log"
        code = sweep_run(path, log=log, timeout=300)
        trials = load_trials(f"sqlite:///{db}", "fullstore")
        found = Findings(f"after freeing space; trials:\n{summary(trials)}\noutput ends with:\n{tail(log, 3000)}")
        found.expect(code == 0, f"the rerun exited {code}")
        found.expect(len(counted(trials)) == 3 and all(t.state == TrialState.COMPLETE for t in counted(trials)),
                     f"counted {[(t.number, t.state.name) for t in counted(trials)]}, expected 3 COMPLETE")
        found.expect(not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)],
                     "a trial was left running or waiting")
        for t in trials:
            if t.state == TrialState.COMPLETE:
                found.expect(sorted(t.intermediate_values) == [50, 100, 150, 200],
                             f"#{t.number} is COMPLETE without its whole curve: {sorted(t.intermediate_values)}")
        fault_row("checkpoint folder on a full tmpfs, then grown", trials, 3, 0)
        found.check()


def test_a_store_made_unusable_after_the_command_checked_it_stops_the_worker_with_one_line(tmp_path: Path) -> None:
    # Found by review: a store remounted read-only between the launcher's check and its workers' start was a
    # traceback from each worker ("OSError: [Errno 30] Read-only file system"). A file where the study's folder goes
    # refuses the folder the same way, and as root too.
    from sweep.spec import parse_spec
    from sweep.study import open_study, run_study
    from sweep.worker import InfrastructureError

    store = tmp_path / "blobs"
    spec = parse_spec(copy.deepcopy(TINY_STUDY) | {"checkpoints": {"store": str(store)}}, str(tmp_path / "s.yaml"))
    url = f"sqlite:///{tmp_path / 'tiny.db'}"
    study = open_study(spec, url)
    shutil.rmtree(store, ignore_errors=True)
    store.write_text("")
    with pytest.raises(InfrastructureError, match=r"^cannot make the checkpoints' folders: Not a directory: "
                                                  rf"{re.escape(str(store))}.*; fix the store \(checkpoints.store;"):
        run_study(study, spec, storage_url=url)
    assert study.get_trials() == []  # nothing asked, nothing counted


@pytest.mark.slow
def test_a_full_sqlite_filesystem_is_waited_out_then_the_worker_exits_and_a_rerun_finishes(tmp_path: Path) -> None:
    folder = tmp_path / "db"
    with tmpfs(folder, "64m"):
        document = copy.deepcopy(FULL_STORE_STUDY) | {
            "name": "fulldb", "n_trials": 6, "storage_patience": 5,
            "checkpoints": {"every_steps": 50, "on_best": False, "store": str(tmp_path / "checkpoints")}}
        document["fixed"] = {**document["fixed"], "max_steps": 200, "eval_every_steps": 20, "log_every_steps": 20}
        path = write_study(tmp_path, document)
        url = f"sqlite:///{folder / 'fulldb.db'}"
        log = tmp_path / "setup.log"
        code = sweep_run(path, "--storage", url, "--n-trials", "1", log=log, timeout=300)
        assert code == 0, tail(log)  # (exit 2 with "storage_patience" named: the key is not there yet)
        # Now leave the database a little room: enough to open and start, not enough for six trials' reports and
        # heartbeats (each transaction appends pages of 4 KB to the write-ahead log).
        resize(folder, str(used_bytes(folder) + 160 * 1024))
        log = tmp_path / "full.log"
        started = time.monotonic()
        code = sweep_run(path, "--storage", url, log=log, timeout=300)
        took = time.monotonic() - started
        output = log.read_text(errors="replace")
        trials = load_trials(url, "fulldb")
        found = Findings(f"took {took:.1f} s; trials:\n{summary(trials)}\noutput ends with:\n{output[-3000:]}")
        found.expect(code == 1, f"`sweep run` on a full database filesystem exited {code}, expected 1")
        found.expect("Traceback" not in output, "a traceback was printed")
        found.expect(re.search(r"full|space", output, re.IGNORECASE) and re.search(r"storage|database", output,
                                                                                    re.IGNORECASE),
                     "the message does not say the storage is full")
        found.expect(len(counted(trials)) < 6, "all six trials finished: the filesystem never filled up")
        found.expect(len(trials) > 1, "the filesystem was full before a trial started: leave the database more room")
        found.check()

        resize(folder, "64m")
        log = tmp_path / "rerun.log"
        code = sweep_run(path, "--storage", url, log=log, timeout=300)
        trials = load_trials(url, "fulldb")
        found = Findings(f"after freeing space; trials:\n{summary(trials)}\noutput ends with:\n{tail(log, 3000)}")
        found.expect(code == 0, f"the rerun exited {code}")
        found.expect(len(counted(trials)) == 6 and all(t.state == TrialState.COMPLETE for t in counted(trials)),
                     f"counted {[(t.number, t.state.name) for t in counted(trials)]}, expected 6 COMPLETE")
        found.expect(not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)],
                     "a trial was left running or waiting")
        fault_row("SQLite file on a full tmpfs, then grown", trials, len(counted(trials)), 0)
        found.check()


def fill(filler: Path) -> Path:
    """`filler`, a file that takes every free byte of its file system."""
    with open(filler, "wb") as handle:
        with contextlib.suppress(OSError):
            os.posix_fallocate(handle.fileno(), 0, shutil.disk_usage(filler.parent).free)
    return filler


def test_a_new_study_on_a_full_filesystem_leaves_no_empty_database_behind(tmp_path: Path) -> None:
    """Found by review: SQLite made the new study's file and could write nothing in it; the 0-byte file left behind
    made every later `sweep status` say "an empty file, not a study database" (exit 2), where a study never run is
    exit 1. The run says the disk is full, and leaves the folder as it found it."""
    from tests.conftest import sweep_cli

    folder = tmp_path / "db"
    with tmpfs(folder, "1m"):
        document = copy.deepcopy(FULL_STORE_STUDY) | {"name": "new", "n_trials": 1, "storage_patience": 3,
                                                      "checkpoints": False}
        path = write_study(tmp_path, document)
        url = f"sqlite:///{folder / 'new.db'}"
        fill(folder / "filler")
        log = tmp_path / "full.log"
        assert sweep_run(path, "--storage", url, log=log, timeout=300) == 1, tail(log)
        assert sorted(p.name for p in folder.iterdir()) == ["filler"], tail(log)
        shown = sweep_cli("status", "--storage", url, "--study-name", "new")
        assert shown.returncode == 1 and "no study database at" in shown.stderr, shown.stderr


def test_a_study_database_on_a_filesystem_already_full_is_not_called_damaged(tmp_path: Path) -> None:
    """Found by review: a healthy study database on a file system with no space left was "cannot be read as a SQLite
    database (disk I/O error); is the file damaged?", exit 2, from `sweep run` (which waits out a disk that fills
    mid-run), `status` and `check`. Now a run waits it out as an outage, and a reading command names the full file
    system; once there is room, the rerun finishes."""
    from tests.conftest import sweep_cli

    folder = tmp_path / "db"
    with tmpfs(folder, "16m"):
        document = copy.deepcopy(FULL_STORE_STUDY) | {"name": "filled", "n_trials": 1, "storage_patience": 3,
                                                      "checkpoints": False}
        path = write_study(tmp_path, document)
        url = f"sqlite:///{folder / 'filled.db'}"
        assert sweep_run(path, "--storage", url, log=tmp_path / "setup.log", timeout=300) == 0
        filler = fill(folder / "filler")
        assert shutil.disk_usage(folder).free == 0
        shown = sweep_cli("status", "--storage", url, "--study-name", "filled")
        assert shown.returncode != 0 and "damaged" not in shown.stderr, shown.stderr
        assert "its file system has no space left" in shown.stderr, shown.stderr
        log = tmp_path / "full.log"
        code = sweep_run(path, "--storage", url, "--n-trials", "2", log=log, timeout=300)
        assert code == 1 and "damaged" not in tail(log) and "unreachable" in tail(log), tail(log)
        assert "is that disk full or out of inodes?" in tail(log), tail(log)
        filler.unlink()
        code = sweep_run(path, "--storage", url, "--n-trials", "2", log=tmp_path / "rerun.log", timeout=300)
        assert code == 0, tail(tmp_path / "rerun.log")
        assert len(counted(load_trials(url, "filled"))) == 2


# =====================================================================================================================
# 4. A corrupt newest checkpoint.

def interrupted_after_four_checkpoints(path: Path, db: Path, log: Path) -> None:
    """`sweep run` of a one-trial study, interrupted (Ctrl-C) once its trial has four checkpoints registered."""
    run = start_sweep("run", path, log=log)
    try:
        wait_for("four checkpoints", lambda: len(checkpoint_rows(db)) >= 4, 240, alive=run)
        run.send_signal(signal.SIGINT)
        code = finish(run, log, 120)
    finally:
        if run.poll() is None:
            run.kill()
    assert code == 130, tail(log)


def rerun_resuming_trial_0(path: Path, db: Path, log: Path, older_step: int, what: str,
                           as_user: Sequence[str] = ()) -> Findings:
    """The rerun after trial 0's newest checkpoint was spoilt (`what`): it exits 0, and trial 0's one retry
    completes, resumed from trial 0's step `older_step`. The findings, for the caller's further expectations."""
    code = sweep_run(path, log=log, timeout=300, as_user=as_user)
    trials = load_trials(f"sqlite:///{db}", db.stem)  # the study is named as its SQLite file
    found = Findings(f"{what}; trials:\n{summary(trials)}\noutput ends with:\n{tail(log, 3000)}")
    found.expect(code == 0, f"the rerun exited {code}")
    retries = [t for t in trials if t.user_attrs.get("retry_of") == 0]
    found.expect(len(retries) == 1, f"{len(retries)} retries of trial 0")
    if retries:
        found.expect(retries[0].state == TrialState.COMPLETE, f"the retry is {retries[0].state.name}")
        found.expect(retries[0].user_attrs.get("resumed_from") == {"trial": 0, "step": older_step},
                     f"the retry resumed from {retries[0].user_attrs.get('resumed_from')}, expected trial 0's "
                     f"intact step {older_step}")
    return found


@pytest.mark.slow
def test_a_retry_skips_a_corrupt_newest_checkpoint_and_resumes_from_the_one_before(tmp_path: Path) -> None:
    document = one_config("corrupt", checkpoints={"every_steps": 40, "on_best": False, "keep_top_k": 100},
                          fixed={"max_steps": 400, "eval_every_steps": 40, "log_every_steps": 40})
    path = write_study(tmp_path, document)
    db = tmp_path / "corrupt.db"
    log = tmp_path / "run.log"
    interrupted_after_four_checkpoints(path, db, log)
    rows = [row for row in checkpoint_rows(db) if row[1] == 0]
    assert len(rows) >= 2, rows
    (_, _, older_step, _), (_, _, corrupt_step, corrupt_name) = rows[-2], rows[-1]
    corrupt_uri = str(tmp_path / "corrupt.checkpoints" / "corrupt" / corrupt_name)  # URIs: relative to the folder
    blob = bytearray(Path(corrupt_uri).read_bytes())
    for i in range(len(blob) // 2, len(blob) // 2 + 64):  # flip bytes in the middle: the hash no longer matches
        blob[i] ^= 0xFF
    Path(corrupt_uri).write_bytes(bytes(blob))

    found = rerun_resuming_trial_0(path, db, log, older_step,
                                   f"corrupted trial 0's step {corrupt_step} ({corrupt_uri})")
    still = [row for row in checkpoint_rows(db) if row[3] == corrupt_name]
    found.expect(not still, f"the corrupt checkpoint is still registered: {still}")
    found.expect(not Path(corrupt_uri).exists(), f"the corrupt file is still there: {corrupt_uri}")
    found.check()


@pytest.mark.slow
def test_a_retry_passes_over_a_newest_checkpoint_it_may_not_read_and_resumes_from_the_one_before() -> None:
    # Review: a checkpoint file the rerun's user may not read (mode 000, another user's file on a share) failed three
    # retries as the machine's fault and stopped the study, though an intact older checkpoint was there.
    folder = Path(tempfile.mkdtemp(prefix="sweep-unreadable-"))  # not under pytest's folder, which only root reads
    try:
        document = one_config("unreadable", checkpoints={"every_steps": 40, "on_best": False, "keep_top_k": 100},
                              fixed={"max_steps": 400, "eval_every_steps": 40, "log_every_steps": 40})
        path = write_study(folder, document)
        db, log = folder / "unreadable.db", folder / "run.log"
        as_user = another_user()
        interrupted_after_four_checkpoints(path, db, log)
        subprocess.run(["chmod", "-R", "a+rwX", str(folder)], check=True)  # sweep writes owner-only files
        rows = [row for row in checkpoint_rows(db) if row[1] == 0]
        (_, _, older_step, _), (_, _, locked_step, locked_name) = rows[-2], rows[-1]
        locked = folder / "unreadable.checkpoints" / "unreadable" / locked_name
        locked.chmod(0)
        found = rerun_resuming_trial_0(path, db, log, older_step, f"made trial 0's step {locked_step} unreadable",
                                       as_user=as_user)
        found.expect("Permission denied" in log.read_text(), "no warning names the checkpoint it could not read")
        found.expect(locked.exists(), "the unreadable checkpoint was deleted")
        found.check()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("edit", ["step past max_steps", "another config"])
def test_a_retry_passes_over_a_newest_checkpoint_that_is_another_run_s_and_resumes_from_the_one_before(
        tmp_path: Path, edit: str) -> None:
    # Review: a file put in the place of a checkpoint, with its hash registered (as a record adopted from beside a
    # file written in a storage outage is), loaded: a retry resumed from step 99999 of a 400-step trial (complete
    # with 0 steps trained), or from weights another config trained, and recorded that run's values as its own.
    import hashlib

    document = one_config("planted", checkpoints={"every_steps": 40, "on_best": False, "keep_top_k": 100},
                          space={"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}})
    document["fixed"] = {k: v for k, v in ONE_CONFIG["fixed"].items() if k != "learning_rate"}
    path = write_study(tmp_path, document)
    db = tmp_path / "planted.db"
    log = tmp_path / "run.log"
    interrupted_after_four_checkpoints(path, db, log)
    rows = [row for row in checkpoint_rows(db) if row[1] == 0]
    (_, _, older_step, _), (planted_id, _, planted_step, planted_name) = rows[-2], rows[-1]
    planted = tmp_path / "planted.checkpoints" / "planted" / planted_name
    payload = torch.load(planted, weights_only=True)
    if edit == "step past max_steps":
        payload["step"] = 99_999
    else:
        payload["config"]["learning_rate"] *= 2
    torch.save(payload, planted)
    data = planted.read_bytes()
    with contextlib.closing(sqlite3.connect(db)) as connection, connection:
        connection.execute("UPDATE sweep_checkpoints SET sha256 = ?, size = ? WHERE id = ?",
                           (hashlib.sha256(data).hexdigest(), len(data), planted_id))

    found = rerun_resuming_trial_0(path, db, log, older_step, f"planted trial 0's step {planted_step} ({edit})")
    found.expect("so it is not this trial's" in log.read_text(), "no warning names the checkpoint passed over")
    found.expect(not [row for row in checkpoint_rows(db) if row[1:3] == (0, planted_step)],
                 "the planted row is registered")
    found.check()


# =====================================================================================================================
# 5. Reproducing a trial that one of two workers trained.

@pytest.mark.slow
def test_reproduce_matches_a_trial_trained_by_one_of_two_workers(tmp_path: Path) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: workers and reproduce use the same thread count, which would test nothing")
    # A model wide enough that the thread count changes a matmul's rounding (digits, hidden 256, batch 128: one
    # thread and two differ in the 7th digit on a 2-core machine).
    document = one_config("pair", n_trials=2, fixed={"max_steps": 60, "eval_every_steps": 20, "log_every_steps": 20,
                                                     "batch_size": 128, "model": {"hidden": 256}},
                          space={"learning_rate": {"type": "float", "low": 1e-3, "high": 3e-2, "log": True}})
    del document["fixed"]["learning_rate"]  # searched: each worker trains its own
    path = write_study(tmp_path, document)
    log = tmp_path / "run.log"
    # The test process's own thread setting for reproduce: whatever torch picks with no variable set.
    default_threads = {key: value for key, value in os.environ.items()
                       if key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    code = finish(start_sweep("run", path, "--workers", "2", log=log, env=default_threads), log, 300)
    assert code == 0, tail(log)
    trials = load_trials(f"sqlite:///{tmp_path / 'pair.db'}", "pair")
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2, summary(trials)
    found = Findings(f"trials:\n{summary(trials)}")
    logs = {t.number: tmp_path / f"reproduce{t.number}.log" for t in trials}
    runs = {number: start_sweep("reproduce", path, str(number), log=logs[number], env=default_threads)
            for number in logs}  # side by side: each sets its own thread count
    for number, process in runs.items():
        code = finish(process, logs[number], 300)
        found.expect(code == 0, f"`sweep reproduce {number}` exited {code}: {tail(logs[number], 500).strip()}")
    for t in trials:
        record = t.user_attrs.get("reproducibility", {})
        found.expect(any("thread" in key for key in record), f"#{t.number}'s reproducibility record names no thread "
                                                             f"count: {sorted(record)}")
    found.check()


# =====================================================================================================================
# 6. A retry that resumes at max_steps.

@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_retry_resumed_at_max_steps_completes_with_its_whole_curve_and_reproduces(tmp_path: Path) -> None:
    """The original wrote its final checkpoint at max_steps and its worker died before telling the study. Timing
    that with a signal is luck, so the state is built: trial 0 trains the config to the end and gives the curve and
    the checkpoint; trial 1, asked through Optuna, reports that curve, gets a copy of that checkpoint registered as
    its own, beats once and goes silent, as a worker killed right after its last checkpoint leaves a trial. The
    budget then grows to 2, and `sweep run` must finish trial 1's lineage without training a step."""
    path = write_study(tmp_path, one_config("late", fixed={"max_steps": 200, "eval_every_steps": 50,
                                                           "log_every_steps": 50},
                                            checkpoints={"every_steps": 50, "on_best": False, "keep_top_k": 1}))
    db = tmp_path / "late.db"
    url = f"sqlite:///{db}"
    log = tmp_path / "run.log"
    assert sweep_run(path, log=log) == 0, tail(log)
    [finished] = load_trials(url, "late")
    assert sorted(finished.intermediate_values) == [50, 100, 150, 200], summary([finished])

    storage = optuna.storages.RDBStorage(url, heartbeat_interval=1, grace_period=2)
    lost = optuna.load_study(study_name="late", storage=storage).ask()
    lost.set_user_attr("config", finished.user_attrs["config"])
    for at, value in sorted(finished.intermediate_values.items()):
        lost.report(value, at)
    # Its final checkpoint: a copy of trial 0's blob, registered with trial 0's row as this trial's.
    [row] = sqlite_rows(db, "SELECT * FROM sweep_checkpoints WHERE trial_number = 0 AND step = 200")
    names = [column for (_, column, *_) in sqlite_rows(db, "PRAGMA table_info(sweep_checkpoints)")]
    values = dict(zip(names, row)) | {"trial_number": lost.number}
    del values["id"]
    folder = tmp_path / "late.checkpoints" / "late"  # registry URIs are relative to the study's folder
    blob = folder / f"trial{lost.number:05d}-step00000200.pt"
    shutil.copyfile(folder / values["uri"], blob)
    values["uri"] = blob.name
    with contextlib.closing(sqlite3.connect(db, timeout=60)) as connection, connection:
        connection.execute(f"INSERT INTO sweep_checkpoints ({', '.join(values)}) "
                           f"VALUES ({', '.join('?' * len(values))})", tuple(values.values()))
    storage.record_heartbeat(lost._trial_id)  # its worker beat once, then died

    code = sweep_run(path, "--n-trials", "2", log=log, timeout=300)
    trials = load_trials(url, "late")
    found = Findings(f"trials:\n{summary(trials)}\noutput ends with:\n{tail(log, 3000)}")
    found.expect(code == 0, f"`sweep run` exited {code}")
    retries = [t for t in trials if t.user_attrs.get("retry_of") == lost.number]
    found.expect(len(retries) == 1 and len(counted(trials)) == 2,
                 f"{len(retries)} retries of #{lost.number}, {len(counted(trials))} trials counted; expected 1 and 2")
    if retries:
        retry = retries[0]
        found.expect(retry.state == TrialState.COMPLETE and retry.value == finished.value,
                     f"the retry is {retry.state.name} with value {retry.value}, expected COMPLETE {finished.value}")
        found.expect(retry.user_attrs.get("resumed_from") == {"trial": lost.number, "step": 200},
                     f"resumed_from {retry.user_attrs.get('resumed_from')}")
        found.expect(retry.intermediate_values == finished.intermediate_values,
                     f"the retry's curve {sorted(retry.intermediate_values.items())} is not the whole curve "
                     f"{sorted(finished.intermediate_values.items())}")
        done = subprocess.run([sys.executable, "-m", "sweep.cli", "reproduce", str(path), str(retry.number)],
                              capture_output=True, text=True, timeout=300, env={**os.environ, **CLI_ENV})
        found.expect(done.returncode == 0, f"`sweep reproduce {retry.number}` exited {done.returncode}: "
                                           f"{(done.stdout + done.stderr).strip()[-500:]}")
    found.check()


# A user's loop whose steps take a second: the server can go down, and the signal come, between two reports.
NAPPING_LOOP = """
import time


def main(config, run):
    for step in range(1, config["max_steps"] + 1):
        time.sleep(config["nap_s"])
        if run.report(step, val_loss=1.0 / step):
            return
"""



def loop_study_on_postgresql(tmp_path: Path, loop: str, **document: Any) -> tuple[Path, dict[str, str]]:
    """A one-trial study of the user loop `loop` (the module `mine.py`), and the environment that imports it."""
    (tmp_path / "mine.py").write_text(loop)
    path = write_study(tmp_path, {"n_trials": 1, "sampler": {"type": "random"}, "pruner": "none", "loop": "mine:main",
                                  "heartbeat_interval": 1, "heartbeat_grace_period": 3,
                                  "space": {"x": {"type": "float", "low": 0, "high": 1}}, **document})
    return path, {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def until_its_first_report(server: PostgresServer, name: str, worker: subprocess.Popen[bytes]) -> None:
    def reporting() -> bool:
        try:
            trials = load_trials(server.url, name)
        except KeyError:  # not created yet
            return False
        return any(t.intermediate_values and t.state == TrialState.RUNNING for t in trials)

    wait_for("a first report", reporting, 120, interval=0.2, alive=worker)

def sigterm_while_down(server: PostgresServer, path: Path, name: str, log: Path,
                       env: dict[str, str] | None = None) -> None:
    """Run the study until its first report, stop the server, then SIGTERM the worker: it must exit 143 at once
    (not after its storage_patience of 300 s), its last line saying its trials could not be marked (it claimed
    they were queued again)."""
    worker = start_sweep("run", path, "--storage", server.url, log=log, env=env)
    try:
        until_its_first_report(server, name, worker)
        server.stop("fast")
        worker.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = finish(worker, log, timeout=120)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert code == 143, tail(log)
    assert time.monotonic() - started < 60
    last = tail(log).strip().splitlines()[-1]
    assert "could not be marked" in last and "queued again" not in last, last


def test_sigterm_while_postgresql_is_down_exits_143_at_once_and_the_next_run_retries_the_trial(
        tmp_path: Path) -> None:
    """A scheduler's grace period (Slurm's, a pod's) is far shorter than `storage_patience`: a worker told to stop
    while its storage is unreachable must not wait for the storage to mark its trial. It exits 143 at once; the
    trial, left running, is found lost by the next run and trained again."""
    if not postgres_available():
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    path, env = loop_study_on_postgresql(tmp_path, NAPPING_LOOP, name="away", storage_patience=300,
                                         fixed={"max_steps": 30, "nap_s": 0.5})
    log = tmp_path / "worker.log"
    with PostgresServer() as server:
        sigterm_while_down(server, path, "away", log, env)
        assert "trial 0 could not be marked" in tail(log) and "not waiting for it" in tail(log)
        server.start()
        assert sweep_run(path, "--storage", server.url, log=log, env=env) == 0, tail(log)
        lost, retry = load_trials(server.url, "away")
        assert lost.state == TrialState.FAIL and lost.user_attrs["outcome"] == "lost", lost.user_attrs
        assert retry.state == TrialState.COMPLETE and retry.user_attrs["retry_of"] == 0


def test_sigterm_to_a_cohort_while_postgresql_is_down_says_its_trials_were_left_for_the_next_run(
        tmp_path: Path) -> None:
    """The same for a cohort: its members cannot be marked while the storage is away, and the exit line must not
    claim they were queued again (it did); the next run finds both lost and retries each from its own checkpoint."""
    if not postgres_available():
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    document = copy.deepcopy(TINY_STUDY) | {
        "name": "awaycohort", "n_trials": 2, "execution": {"cohort": 2}, "storage_patience": 300,
        "heartbeat_interval": 1, "heartbeat_grace_period": 3, "checkpoints": {"every_steps": 50}}
    document["fixed"] |= {"max_steps": 5000, "eval_every_steps": 50, "log_every_steps": 50}
    path = write_study(tmp_path, document)
    log = tmp_path / "worker.log"
    with PostgresServer() as server:
        sigterm_while_down(server, path, "awaycohort", log)
        server.start()
        trials = load_trials(server.url, "awaycohort")
        assert [t.state for t in trials] == [TrialState.RUNNING] * 2  # left as they were, for the next run
        assert sweep_run(path, "--storage", server.url, log=log) == 0, tail(log)
        trials = load_trials(server.url, "awaycohort")
        lost = [t for t in trials if t.user_attrs.get("outcome") == "lost"]
        retries = [t for t in trials if "retry_of" in t.user_attrs]
        assert sorted(t.number for t in lost) == [0, 1], summary(trials)
        assert sorted(t.user_attrs["retry_of"] for t in retries) == [0, 1], summary(trials)
        assert all(t.state == TrialState.COMPLETE for t in retries), summary(trials)


def two_member_cohort(folder: Path, name: str, short: int, long: int, **extra: Any) -> Path:
    """A study of two trials trained as one cohort, `short` and `long` steps (seed 4 draws them in that order),
    evaluated and checkpointed every 50 steps into `folder / "checkpoints"`, waiting out a long outage."""
    document = copy.deepcopy(TINY_STUDY) | {
        "name": name, "n_trials": 2, "seed": 4, "execution": {"cohort": 2}, "storage_patience": 600,
        "heartbeat_interval": 1, "heartbeat_grace_period": 3,
        "checkpoints": {"every_steps": 50, "store": str(folder / "checkpoints")}, **extra}
    document["fixed"] |= {"eval_every_steps": 50, "log_every_steps": 50}
    del document["fixed"]["max_steps"]
    document["space"] |= {"max_steps": {"type": "categorical", "choices": [short, long]}}
    return write_study(folder, document)


def until_both_members_report(server: PostgresServer, name: str, worker: subprocess.Popen[bytes]) -> None:
    """Both members have joined the cohort (an outage that catches its refill asking for a trial waits, as an ask
    does)."""
    until_its_first_report(server, name, worker)
    wait_for("both members' first reports", lambda: sum(
        bool(t.intermediate_values) for t in load_trials(server.url, name)) == 2, 120, interval=0.2, alive=worker)


def test_a_cohort_trains_on_while_postgresql_is_down_and_stores_every_report_when_it_is_back(tmp_path: Path) -> None:
    """A lone trial trains on through an outage, its reports held; a cohort stopped instead, waiting for the storage
    at its next evaluation (its step's held reports were flushed by a read outside `no_wait`). Its members must train
    on, their checkpoints written meanwhile, a member that finishes during the outage (600 steps) be told once the
    server is back while the other (3000) trains on, and every held report be stored."""
    if not postgres_available():
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    path = two_member_cohort(tmp_path, "oncohort", 600, 3000)
    folder = tmp_path / "checkpoints" / "oncohort"
    log = tmp_path / "worker.log"

    def newest() -> int:
        steps = [int(m.group(1)) for p in folder.glob("trial*-step*.pt")
                 if (m := re.search(r"step(\d+)\.pt$", p.name))]
        return max(steps, default=0)

    with PostgresServer() as server:
        worker = start_sweep("run", path, "--storage", server.url, log=log)
        try:
            until_both_members_report(server, "oncohort", worker)
            server.stop("fast")
            at_stop = newest()
            # Each held registration is written beside its blob once (it was written again after every step, a
            # cohort's pace falling five-fold through an outage as they piled up).
            held = wait_for("a registration held beside its blob", lambda: {
                p: p.stat().st_ino for p in folder.glob("*.unregistered.json")}, 120, interval=0.2, alive=worker)
            wait_for("checkpoints 700 steps past the outage's start", lambda: newest() >= at_stop + 700, 180,
                     interval=0.2, alive=worker)
            assert worker.poll() is None, tail(log)
            assert {p: p.stat().st_ino for p in held} == held
            server.start()
            code = finish(worker, log, timeout=300)
        finally:
            if worker.poll() is None:
                worker.kill()
        assert code == 0, tail(log)
        trials = load_trials(server.url, "oncohort")
    short = min(trials, key=lambda t: t.params["max_steps"])
    assert sorted(t.params["max_steps"] for t in trials) == [600, 3000], summary(trials)
    output = tail(log, 100_000)  # the short one finished during the outage, and was told after it
    assert output.index("is unreachable") < output.index(f"trial {short.number}: complete"), output
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2, summary(trials)
    assert all(sorted(t.intermediate_values) == eval_steps(50, 50, t.params["max_steps"]) for t in trials), \
        summary(trials)
    assert all("retry_of" not in t.user_attrs for t in trials), summary(trials)


def test_a_cohort_member_that_finished_in_an_outage_stays_complete_when_the_timeout_ends_the_cohort(
        tmp_path: Path) -> None:
    """A member that finishes while the storage is away is told when it is back; a `--timeout` that ends the cohort
    before then must tell it as it ended (it was ended as interrupted, and queued again; found by review)."""
    if not postgres_available():
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    # Each step 0.05 s slower per member: the short member (150 steps) reports at step 50 and finishes seconds after
    # the server stops, long before the timeout (from the worker's start), on any machine.
    timeout = 60
    path = two_member_cohort(tmp_path, "cutcohort", 150, 1_000_000,
                             task={"name": "tests.e2e.ddp_tasks:slow", "args": {"sleep_s": 0.05}})
    log = tmp_path / "worker.log"
    with PostgresServer() as server:
        worker = start_sweep("run", path, "--storage", server.url, "--timeout", timeout, log=log,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
        try:
            # The timeout counts from the worker's start, just after it says what the study holds (seen here later).
            wait_for("the run's first line", lambda: "trials done" in tail(log), 120, interval=0.1, alive=worker)
            started = time.monotonic()
            until_both_members_report(server, "cutcohort", worker)
            server.stop("fast")
            wait_for("the short member's last checkpoint", lambda: list(
                (tmp_path / "checkpoints" / "cutcohort").glob("trial00000-step00000150.pt")), 120, interval=0.2,
                alive=worker)
            assert time.monotonic() - started < timeout, "the short member finished after the timeout"
            time.sleep(max(0.0, started + timeout + 5 - time.monotonic()))  # the cohort is ended, waiting to say so
            server.start()
            code = finish(worker, log, timeout=300)
        finally:
            if worker.poll() is None:
                worker.kill()
        assert code == 0, tail(log)
        trials = load_trials(server.url, "cutcohort")
    short, long = trials[:2]
    assert (short.params["max_steps"], long.params["max_steps"]) == (150, 1_000_000), summary(trials)
    assert short.state == TrialState.COMPLETE and short.user_attrs["outcome"] == "complete", summary(trials)
    assert sorted(short.intermediate_values) == eval_steps(50, 50, 150), summary(trials)
    assert long.user_attrs["outcome"] == "interrupted" and "--timeout" in long.user_attrs["fail_reason"]
    assert [t.user_attrs.get("retry_of") for t in trials[2:]] == [long.number], summary(trials)


# The same, saving its state at each step (what a retry resumes from).
SAVING_LOOP = """
import time


def main(config, run):
    state = run.load()
    for step in range(state["step"] + 1 if state else 1, config["max_steps"] + 1):
        time.sleep(config["nap_s"])
        if run.report(step, val_loss=1.0 / step):
            return
        run.save({"step": step})
"""


def test_checkpoints_written_while_postgresql_was_down_are_resumed_from_after_the_worker_gave_up(
        tmp_path: Path) -> None:
    """The storage stays down longer than `storage_patience`: the trial trains on and saves, its checkpoints'
    registrations wait in memory, and the worker exits 1 when the trial ends. Those registrations were lost with it:
    the retry started over from the last checkpoint registered before the outage. Each waits beside its blob now,
    and the next run registers it."""
    if not postgres_available():
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    path, env = loop_study_on_postgresql(tmp_path, SAVING_LOOP, name="outage", storage_patience=5,
                                         checkpoints={"store": str(tmp_path / "checkpoints")},
                                         fixed={"max_steps": 12, "nap_s": 0.5})
    log = tmp_path / "worker.log"
    with PostgresServer() as server:
        worker = start_sweep("run", path, "--storage", server.url, log=log, env=env)
        try:
            until_its_first_report(server, "outage", worker)
            server.stop("fast")
            code = finish(worker, log, timeout=180)  # trains to the end, then gives up on its storage
        finally:
            if worker.poll() is None:
                worker.kill()
        assert code == 1 and "storage_patience is 5 s" in tail(log), tail(log)
        assert list((tmp_path / "checkpoints" / "outage").glob("*.unregistered.json"))
        server.start()
        assert sweep_run(path, "--storage", server.url, log=log, env=env) == 0, tail(log)
        lost, retry = load_trials(server.url, "outage")
        assert lost.user_attrs["outcome"] == "lost" and retry.state == TrialState.COMPLETE
        assert retry.user_attrs["resumed_from"] == {"trial": 0, "step": 12}, retry.user_attrs
        assert retry.value == 1.0 / 12  # its last save's value: resumed at its end, it had no step left to report
    assert not list((tmp_path / "checkpoints" / "outage").glob("*.unregistered.json*"))
    # Registered late, they were trimmed as their worker would have trimmed them: keep_top_k 1 keeps the latest
    # (here also the best) of the trial's saves, one per step through the outage.
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "outage").glob("trial00000-*.pt")) == [
        "trial00000-step00000012.pt"]


def test_a_retry_copies_the_evaluations_whose_reports_were_lost_from_its_checkpoint(tmp_path: Path) -> None:
    # A worker that trained on through a storage outage held its reports in memory; killed before the storage came
    # back, they were lost, while its checkpoints (written meanwhile) hold every evaluation up to theirs. Its retry's
    # curve is whole again: the lost values come from the checkpoint it resumes from, equal to what was evaluated.
    from tests.conftest import TINY_STUDY, sweep_cli

    document = copy.deepcopy(TINY_STUDY) | {"n_trials": 1}
    document["fixed"] = {**document["fixed"], "max_steps": 40, "eval_every_steps": 5, "log_every_steps": 5}
    document["checkpoints"] = {"on_best": False, "every_steps": 20, "keep_top_k": 2, "artifacts": False}
    path = write_study(tmp_path, document)
    assert sweep_cli("run", path).returncode == 0
    url = f"sqlite:///{tmp_path / 'tiny.db'}"
    whole = optuna.load_study(study_name="tiny", storage=url).trials[0].intermediate_values
    assert sorted(whole) == list(range(5, 45, 5))
    # As the lost worker left it: its end stored (interrupted) long ago, no retry queued, none of its reports stored,
    # and its newest checkpoint the one at step 20 (the one at 40 never written).
    folder = tmp_path / "tiny.checkpoints" / "tiny"
    assert sorted(p.name for p in folder.glob("*.pt")) == ["trial00000-step00000020.pt", "trial00000-step00000040.pt"]
    (folder / "trial00000-step00000040.pt").unlink()
    with sqlite3.connect(tmp_path / "tiny.db") as db:
        db.execute("UPDATE trials SET state = 'FAIL', datetime_complete = datetime('now', '-1 hour') WHERE number = 0")
        db.execute("DELETE FROM trial_values")
        db.execute("DELETE FROM trial_intermediate_values")
        db.execute("UPDATE trial_user_attributes SET value_json = '\"interrupted\"' WHERE key = 'outcome'")
    rerun = sweep_cli("run", path)
    assert rerun.returncode == 0, rerun.stderr
    retry = optuna.load_study(study_name="tiny", storage=url).trials[1]
    assert retry.user_attrs["retry_of"] == 0 and retry.user_attrs["resumed_from"] == {"trial": 0, "step": 20}
    assert retry.intermediate_values == whole  # steps 5-15 from the checkpoint's history, 20 from its metrics


@pytest.mark.skipif(not postgres_available(), reason="PostgreSQL server binaries not installed")
@contextlib.contextmanager
def sweeper_role() -> Iterator[tuple[Any, str]]:
    """A throwaway server whose database a role `sweeper` owns: the admin's engine, and the URL the workers use."""
    from sqlalchemy import create_engine, text

    with PostgresServer() as server:
        admin = create_engine(server.url)
        with admin.begin() as connection:
            connection.execute(text("CREATE ROLE sweeper LOGIN"))
            connection.execute(text("ALTER DATABASE sweep OWNER TO sweeper"))
        try:
            yield admin, server.url.replace("postgres@", "sweeper@")
        finally:
            admin.dispose()


def test_a_table_the_worker_s_role_may_not_write_costs_no_budget_and_stops_the_worker_saying_so(
        tmp_path: Path) -> None:
    """The checkpoint registry refused the workers' role its writes (one role made the tables, the workers run as
    a more limited one): every trial failed as its config's fault, the whole budget went to configs that never
    trained, and `max_repeated_failures` never stopped it (SQLAlchemy's message holds each statement's parameters,
    so no two failures looked the same). The storage's refusal is the machine's fault: retried, not counted, and
    three in a row stop the worker with one line; once the right is granted back the next run spends the budget."""
    from sqlalchemy import text

    from tests.conftest import TINY_STUDY, sweep_cli

    with sweeper_role() as (admin, url):
        document = copy.deepcopy(TINY_STUDY) | {"name": "refused", "n_trials": 5}
        path = write_study(tmp_path, document)
        first = sweep_cli("run", path, "--storage", url, "--n-trials", "1")
        assert first.returncode == 0, first.stderr
        with admin.begin() as connection:
            connection.execute(text("REVOKE INSERT, UPDATE, DELETE ON sweep_checkpoints FROM sweeper"))
        refused = sweep_cli("run", path, "--storage", url)
        assert refused.returncode == 1, refused.stderr
        last = refused.stderr.strip().splitlines()[-1]
        assert "the storage refused: InsufficientPrivilege: permission denied for table sweep_checkpoints" in last, \
            refused.stderr
        assert "Traceback" not in refused.stderr and "Fix it (grant the storage's role its rights" in last, \
            refused.stderr
        trials = load_trials(url, "refused")
        failed = [t for t in trials if t.state == TrialState.FAIL]
        assert len(failed) == 3 and all(t.user_attrs["outcome"] == "infrastructure" for t in failed), summary(trials)
        assert budget_counts(trials)[0] == 1  # only the trial trained before the revoke
        with admin.begin() as connection:
            connection.execute(text("GRANT INSERT, UPDATE, DELETE ON sweep_checkpoints TO sweeper"))
        again = sweep_cli("run", path, "--storage", url)
        assert again.returncode == 0, again.stderr
        trials = load_trials(url, "refused")
        assert sum(t.state == TrialState.COMPLETE for t in trials) == 5, summary(trials)
        # A role that may not read Optuna's own tables: the storage cannot be opened, and the line says why in the
        # database's words, not as Optuna's wrapper puts it ("invalid data in the commit, e.g. exceeding max length").
        with admin.begin() as connection:
            connection.execute(text("REVOKE SELECT ON version_info FROM sweeper"))
        for command in (("status", "refused"), ("run", path)):
            opened = sweep_cli(*command, "--storage", url)
            assert opened.returncode == 1, opened.stderr
            line = opened.stderr.strip().splitlines()[-1]
            assert line.startswith("error: cannot open storage postgresql"), opened.stderr
            assert "the storage refused: InsufficientPrivilege: permission denied for table version_info" in line, \
                opened.stderr
            assert "invalid data" not in opened.stderr and "Traceback" not in opened.stderr, opened.stderr


@pytest.mark.skipif(not postgres_available(), reason="PostgreSQL server binaries not installed")
def test_statements_the_server_times_out_are_waited_out_then_named_as_its_statement_timeout(tmp_path: Path) -> None:
    """A role whose statement_timeout cancels sweep's statements (here: while a table is locked elsewhere) looked
    like a server that cannot be reached; the lines now name the timeout and where it is set."""
    from sqlalchemy import text

    from tests.conftest import TINY_STUDY, sweep_cli

    with sweeper_role() as (admin, url):
        document = copy.deepcopy(TINY_STUDY) | {"name": "timed", "n_trials": 3, "storage_patience": 3}
        path = write_study(tmp_path, document)
        first = sweep_cli("run", path, "--storage", url, "--n-trials", "1")
        assert first.returncode == 0, first.stderr
        with admin.begin() as connection:
            connection.execute(text("ALTER ROLE sweeper SET statement_timeout = '100ms'"))
        with admin.connect() as holder:
            holder.execute(text("BEGIN"))
            holder.execute(text("LOCK TABLE trials IN ACCESS EXCLUSIVE MODE"))
            timed = sweep_cli("run", path, "--storage", url)
            holder.execute(text("ROLLBACK"))
        assert timed.returncode == 1, timed.stderr
        assert "canceling statement due to statement timeout" in timed.stderr, timed.stderr
        assert "its statement_timeout" in timed.stderr.strip().splitlines()[-1], timed.stderr
        assert "Traceback" not in timed.stderr, timed.stderr
        again = sweep_cli("run", path, "--storage", url)  # the lock gone, the same timeout is no trouble
        assert again.returncode == 0, again.stderr
        assert sum(t.state == TrialState.COMPLETE for t in load_trials(url, "timed")) == 3


# Trains slowly; at step 10 it says so (a file) and waits for the test's go (another file) before it goes on.
PAUSES_AT_10 = """
import time
from pathlib import Path


def main(config, run):
    for step in range(1, 31):
        time.sleep(0.05)
        if step == 10:
            Path(config["folder"], "paused").touch()
            while not Path(config["folder"], "go").exists():
                time.sleep(0.05)
        if run.report(step, val_loss=1.0 / step):
            return
"""


@pytest.mark.skipif(not postgres_available(), reason="PostgreSQL server binaries not installed")
@pytest.mark.parametrize("change", ["password", "role dropped"])
def test_a_password_changed_or_a_role_dropped_while_the_worker_runs_stops_it_with_one_line(tmp_path: Path,
                                                                                          change: str) -> None:
    """Found by review: the role's password rotated mid-run (and its sessions ended) made the worker's next
    connection fail authentication, which is neither waited out nor a refusal it knew: `sweep run` ended with
    hundreds of traceback lines and Optuna's "invalid data in the commit". It is the storage refusing the worker;
    so is its role dropped ('role "worker" does not exist')."""
    from sqlalchemy import create_engine, text

    (tmp_path / "pauser.py").write_text(PAUSES_AT_10)
    # A dropped role is named so where the server trusts local connections; one that asks for a password says only
    # that authentication failed (a role's existence is no stranger's to learn).
    with PostgresServer(password="first-pw" if change == "password" else None) as server:
        url = server.url.replace("postgres@", "postgres:first-pw@") if change == "password" else server.url
        if change == "role dropped":
            with contextlib.closing(create_engine(url).connect()) as connection:
                connection.execute(text("CREATE ROLE worker LOGIN SUPERUSER"))
                connection.commit()
            admin_url, url = url, url.replace("postgres@", "worker@")
        path = write_study(tmp_path, {"name": "rotated", "n_trials": 2, "loop": "pauser:main", "pruner": "none",
                                      "fixed": {"max_steps": 30, "folder": str(tmp_path)},
                                      "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}}})
        env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        worker = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path), "--storage", url],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        try:
            deadline = time.monotonic() + 180
            while not (tmp_path / "paused").exists():
                assert worker.poll() is None and time.monotonic() < deadline, worker.communicate()
                time.sleep(0.05)
            if change == "password":
                admin = create_engine(url)
                with admin.begin() as connection:
                    connection.execute(text("ALTER ROLE postgres PASSWORD 'second-pw'"))
                    connection.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                                            "usename = 'postgres' AND pid <> pg_backend_pid()"))
            else:
                admin = create_engine(admin_url)
                with admin.begin() as connection:
                    connection.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                                            "usename = 'worker'"))
                    connection.execute(text("REASSIGN OWNED BY worker TO postgres"))
                    connection.execute(text("DROP OWNED BY worker"))
                    connection.execute(text("DROP ROLE worker"))
            admin.dispose()
            (tmp_path / "go").touch()
            _, stderr = worker.communicate(timeout=240)
        finally:
            worker.kill()
    assert worker.returncode == 1, stderr
    assert "Traceback" not in stderr and "invalid data" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    said = "password authentication failed" if change == "password" else 'role "worker" does not exist'
    assert "the storage refused" in last and said in last, stderr
    assert "first-pw" not in stderr and "second-pw" not in stderr


@pytest.mark.skipif(not postgres_available(), reason="PostgreSQL server binaries not installed")
def test_a_database_read_only_for_a_while_is_waited_out_on_fresh_connections(tmp_path: Path) -> None:
    """Found by review: a database made read-only for a while (a failover's standby until it is promoted; here
    `default_transaction_read_only`) was waited for on the pooled sessions opened while it was read-only, which stay
    so: the worker gave up after `storage_patience` though the database had long been writable again. Each
    read-only refusal now lets the pool's idle sessions go."""
    from sqlalchemy import create_engine, text

    document = copy.deepcopy(TINY_STUDY) | {"name": "standby", "n_trials": 4, "storage_patience": 60,
                                            "checkpoints": {"every_steps": 20}}
    document["fixed"] |= {"max_steps": 200, "eval_every_steps": 20, "log_every_steps": 20}
    path = write_study(tmp_path, document)
    with PostgresServer() as server:
        worker = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path), "--storage", server.url],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        admin = create_engine(server.url.replace("/sweep?", "/postgres?"), isolation_level="AUTOCOMMIT")
        try:
            deadline = time.monotonic() + 240
            while not any(t.state.is_finished() for t in _trials_if_any("standby", server.url)):
                assert worker.poll() is None and time.monotonic() < deadline, worker.communicate()
                time.sleep(0.1)
            with admin.connect() as connection:  # read-only, and every session of the study's database anew
                connection.execute(text("ALTER DATABASE sweep SET default_transaction_read_only = on"))
                connection.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                                        "datname = 'sweep'"))
            while "read-only transaction" not in server.log.read_text(errors="replace"):
                assert worker.poll() is None and time.monotonic() < deadline, worker.communicate()
                time.sleep(0.1)
            time.sleep(2)  # refused a while, new sessions among them
            with admin.connect() as connection:  # writable again, for new sessions
                connection.execute(text("ALTER DATABASE sweep SET default_transaction_read_only = off"))
            _, stderr = worker.communicate(timeout=240)
        finally:
            worker.kill()
            admin.dispose()
        # The worker met the refusals (the server's log names them; its own outage line names the first error of
        # the outage, which on a loaded machine may be the ended session instead) and went on within its patience.
        assert worker.returncode == 0, stderr
        assert budget_counts(_trials_if_any("standby", server.url)) == (4, 0)


@pytest.mark.skipif(not postgres_available(), reason="PostgreSQL server binaries not installed")
def test_a_command_whose_own_write_the_storage_refuses_says_so_in_one_line(tmp_path: Path, postgres_url: str) -> None:
    """Found by review: `sweep stop` on a database made read-only (a failover's standby) printed 131 lines of
    traceback ending in Optuna's "invalid data in the commit". A command's own call refused, or cut off, is one line
    naming the storage, exit 1; reading the study still works."""
    from sqlalchemy import create_engine, text

    url = postgres_url.replace("/sweep?", "/standby_stop?")
    admin = create_engine(postgres_url.replace("/sweep?", "/postgres?"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text("CREATE DATABASE standby_stop"))
        path = write_study(tmp_path, copy.deepcopy(TINY_STUDY) | {"name": "standby", "n_trials": 1})
        assert sweep_cli("run", path, "--storage", url).returncode == 0
        with admin.connect() as connection:
            connection.execute(text("ALTER DATABASE standby_stop SET default_transaction_read_only = on"))
        stopped = run_cli("stop", path, "--storage", url)
        assert stopped.returncode == 1, stopped.stderr
        lines = stopped.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: the storage postgresql+psycopg://"), stopped.stderr
        assert "read-only transaction" in lines[0] and "invalid data" not in lines[0], stopped.stderr
        status = run_cli("status", path, "--storage", url)
        assert status.returncode == 0 and "complete 1" in status.stdout, status.stderr
    finally:
        with admin.connect() as connection:
            connection.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                                    "datname = 'standby_stop'"))
            connection.execute(text("DROP DATABASE IF EXISTS standby_stop"))
        admin.dispose()


def _trials_if_any(name: str, url: str) -> list[FrozenTrial]:
    """The trials of study `name` in `url`, or none before the study exists."""
    try:
        return optuna.load_study(study_name=name, storage=url).get_trials()
    except KeyError:
        return []


@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(),
                    reason="needs a machine whose torch sees no GPU")
@pytest.mark.parametrize(("device", "cohort", "ranks"), [("cuda", 1, 1), ("cuda", 2, 1), ("mps", 1, 1), ("cuda", 1, 2)])
def test_a_worker_without_the_gpu_the_study_asks_for_costs_no_budget_and_stops_saying_so(
        tmp_path: Path, device: str, cohort: int, ranks: int) -> None:
    """`device: cuda` on a worker whose torch sees no GPU (a CPU-only torch, a node whose driver broke): each trial
    failed as its config's fault and was counted, so a cluster's one bad node spent the budget on configs that never
    trained. It is the machine's fault: the trials are retried (by a worker that has a GPU), not counted, and three
    in a row stop the worker with the reason and the fix. With two ranks a trial per device: rank 1 found it out,
    and its exit code 1 was read as the config's failure."""
    document = copy.deepcopy(TINY_STUDY) | {"name": "nogpu", "n_trials": 5, "execution": {"cohort": cohort},
                                            "resources": {"devices_per_trial": ranks}}
    document["fixed"] = {**document["fixed"], "device": device}
    done = sweep_cli("run", write_study(tmp_path, document))
    assert done.returncode == 1, done.stderr
    assert "3 trials in a row were stopped by the same fault of the machine" in done.stderr, done.stderr
    assert f"device '{device}' was asked for, but torch sees no" in done.stderr, done.stderr
    assert "set device: auto" in done.stderr, done.stderr
    trials = load_trials(f"sqlite:///{tmp_path / 'nogpu.db'}", "nogpu")
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(failed) == 3 and all(t.user_attrs["outcome"] == "infrastructure" for t in failed), summary(trials)
    assert budget_counts(trials)[0] == 0, summary(trials)  # none of the budget spent: their retries wait
    # Each has its line, the last one (the fault that stops the worker) too.
    assert all(f"trial {t.number}: infrastructure: " in done.stdout + done.stderr for t in failed), done.stdout


def test_a_config_that_kills_its_worker_is_failed_after_three_attempts_instead_of_retried_forever(
        tmp_path: Path) -> None:
    # Found by review: a config whose code killed its worker (a segfault, the out-of-memory killer, os._exit) was
    # found lost by the next run and retried from its checkpoint, which killed that worker too, and so on: every
    # rerun died, the budget stayed at 0/1 and no other config was ever tried.
    (tmp_path / "poison.py").write_text(
        "import os\n"
        "def main(config, run):\n"
        "    state = run.load()\n"
        "    for step in range(state['step'] + 10 if state else 10, 41, 10):\n"
        "        if step == 30:\n"
        "            os._exit(1)  # past the save at step 20: each retry resumes there and dies here again\n"
        "        run.report(step, val_loss=1.0 / step)\n"
        "        run.save({'step': step})\n")
    path = write_study(tmp_path, {"name": "poison", "n_trials": 1, "loop": "poison:main", "pruner": "none",
                                  "heartbeat_interval": 1, "heartbeat_grace_period": 2,
                                  "checkpoints": {"every_steps": 10}, "fixed": {"max_steps": 40}})
    storage = f"sqlite:///{tmp_path / 'poison.db'}"

    def trials() -> list[FrozenTrial]:
        return optuna.load_study(study_name="poison", storage=storage).get_trials()

    for attempt in range(3):  # each run finds the last attempt lost (once past the grace period) and retries it
        done = run_cli("run", path, cwd=tmp_path)
        assert done.returncode != 0 and len(trials()) == attempt + 1, done.stderr
        time.sleep(2.5)
    done = sweep_cli("run", path, cwd=tmp_path)  # the third loss in a row, no further than the first: not retried
    assert "trial 2 failed: worker lost 3 times in a row on this config without getting further" in done.stderr
    first, second, third = trials()
    assert [t.user_attrs["outcome"] for t in (first, second, third)] == ["lost", "lost", "failed"]
    assert third.user_attrs["retry_of"] == 1 and third.user_attrs["resumed_from"] == {"trial": 0, "step": 20}
    assert budget_counts([first, second, third]) == (1, 0)  # it counts as the budget's one trial: the study ended
    assert done.returncode == 0 and done.stderr.count("failed: worker lost") == 1, done.stderr
    again = sweep_cli("run", path, cwd=tmp_path)  # a rerun trains nothing
    assert again.returncode == 0 and "1/1 trials done" in again.stderr and len(trials()) == 3


@pytest.mark.skipif(not postgres_available(), reason="PostgreSQL server binaries not installed")
def test_a_server_that_stops_answering_is_an_outage_with_a_line_not_a_silent_wait(tmp_path: Path) -> None:
    """Found by review: a PostgreSQL server whose processes stopped (SIGSTOP, a frozen container, a server stuck on
    its disk) while its machine answers: the kernel acknowledges every packet, so no TCP timeout ends a call in
    flight, and the worker waited without a word for as long as the server hung, past `storage_patience`. A call
    unanswered for `tcp_user_timeout` now has its connections cut: one line names the outage, the worker waits out
    its patience and exits 1, and once the server answers again the next run finishes the budget."""
    document = copy.deepcopy(TINY_STUDY) | {"name": "frozen", "n_trials": 3, "storage_patience": 20}
    document["fixed"] |= {"max_steps": 200, "eval_every_steps": 20, "log_every_steps": 20}
    path = write_study(tmp_path, document)
    with PostgresServer() as server:
        url = f"{server.url}&tcp_user_timeout=5000"
        worker = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path), "--storage", url],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        stopped: list[int] = []
        try:
            deadline = time.monotonic() + 240
            while not any(t.state == TrialState.RUNNING and t.intermediate_values
                          for t in _trials_if_any("frozen", server.url)):
                assert worker.poll() is None and time.monotonic() < deadline, worker.communicate()
                time.sleep(0.1)
            stopped = server.pause()
            _, stderr = worker.communicate(timeout=240)
        finally:
            worker.kill()
            server.resume(stopped)
        assert worker.returncode == 1, stderr
        assert "Traceback" not in stderr, stderr
        said = r"is unreachable \(no answer to a call for \d+ s: a server process stopped or stuck"
        assert re.search(said, stderr), stderr
        assert "has been unreachable for" in stderr.strip().splitlines()[-1], stderr
        done = sweep_cli("run", path, "--storage", server.url)  # the left trial is found lost and retried
        assert done.returncode == 0, done.stderr
        assert budget_counts(_trials_if_any("frozen", server.url)) == (3, 0)
