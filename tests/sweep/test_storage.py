"""Opening storage and studies the way many workers do: at once, on a database nobody has created yet."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy

from sweep.outcomes import OWNER_ATTR
from sweep.spec import SPEC_ATTR, load_spec
from sweep.storage import ask_lock, make_storage, mask_url, sqlite_path, storage_refusal
from sweep.study import StudyMismatchError, open_study
from tests.conftest import TINY_STUDY, write_study

OPEN = "from sweep.storage import make_storage; make_storage({url!r})"


def test_processes_creating_a_new_sqlite_database_at_once_all_succeed(tmp_path: Path) -> None:
    # Without the retry in make_storage, about one process in four loses the race to create Optuna's tables.
    failures = []
    for round_ in range(6):
        url = f"sqlite:///{tmp_path / f'fresh{round_}.db'}"
        processes = [subprocess.Popen([sys.executable, "-c", OPEN.format(url=url)], stderr=subprocess.PIPE,
                                      text=True) for _ in range(3)]
        failures += [p.communicate(timeout=120)[1] for p in processes if p.wait(timeout=120) != 0]
    assert failures == []
    assert sqlite_path(f"sqlite:///{tmp_path}/fresh0.db") == tmp_path / "fresh0.db"


@pytest.mark.parametrize(("url", "path"), [
    ("sqlite:///study.db", "study.db"), ("sqlite:////abs/study.db", "/abs/study.db"),
    ("sqlite+pysqlite:///runs/mlflow.db", "runs/mlflow.db"), ("sqlite:///a.db?timeout=5", "a.db"),
    ("sqlite:///:memory:", None), ("sqlite:///:memory:?cache=shared", None),
    ("sqlite:///:memory:x.db", ":memory:x.db"), ("sqlite://", None), ("sqlite://host/a.db", None),
    ("postgresql+psycopg://u:p@127.0.0.1/db", None), ("file:///a.db", None)])
def test_sqlite_path_is_the_file_of_any_sqlite_url_and_none_for_the_rest(url: str, path: str | None) -> None:
    assert sqlite_path(url) == (None if path is None else Path(path))


def test_wal_is_on_so_readers_never_block_writers(tmp_path: Path) -> None:
    import sqlite3

    from sweep.storage import make_storage

    make_storage(f"sqlite:///{tmp_path / 'w.db'}")
    with sqlite3.connect(tmp_path / "w.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_opening_a_storage_with_a_heartbeat_warns_nothing(tmp_path: Path) -> None:
    # Optuna marks heartbeat_interval experimental and warned on every open: five times in a benchmark's output.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_storage(f"sqlite:///{tmp_path / 's.db'}", heartbeat_interval=10, grace_period=30)
    assert [str(w.message) for w in caught if issubclass(w.category, optuna.exceptions.ExperimentalWarning)] == []


def test_mask_url_hides_the_password() -> None:
    assert mask_url("postgresql+psycopg://bob:hunter2@127.0.0.1/db") == "postgresql+psycopg://bob:***@127.0.0.1/db"
    assert mask_url("sqlite:///x.db") == "sqlite:///x.db"


def test_a_study_another_worker_has_just_created_is_joined_not_refused(tmp_path: Path) -> None:
    spec, _ = load_spec(write_study(tmp_path, TINY_STUDY))
    url = f"sqlite:///{tmp_path / 'tiny.db'}"
    # The moment between another worker's create_study and its write of the study's definition:
    creator = optuna.create_study(study_name="tiny", storage=url)
    writer = threading.Timer(0.5, lambda: creator.set_user_attr(SPEC_ATTR, spec.stored()))
    writer.start()
    try:
        joined = open_study(spec, url)
    finally:
        writer.join()
    assert joined.study_name == "tiny" and joined.user_attrs[SPEC_ATTR] == spec.stored()
    other = optuna.create_study(study_name="not-ours", storage=url)  # never given a definition, and a trial: refused
    other.enqueue_trial({})
    with pytest.raises(StudyMismatchError, match="not created by sweep"):
        open_study(spec.model_copy(update={"name": other.study_name}), url)


def test_a_study_whose_creator_died_before_writing_its_definition_is_taken_on_the_rerun(tmp_path: Path) -> None:
    # `sweep run` killed between create_study and the write of the study's definition (milliseconds apart) left an
    # empty study that every rerun refused as "not created by sweep". Nothing in it to protect: the rerun takes it.
    spec, _ = load_spec(write_study(tmp_path, TINY_STUDY))
    url = f"sqlite:///{tmp_path / 'tiny.db'}"
    optuna.create_study(study_name="tiny", storage=url)  # what the killed run left
    taken = open_study(spec, url)
    assert taken.user_attrs[SPEC_ATTR] == spec.stored()
    assert OWNER_ATTR not in taken.user_attrs  # two workers taking it at once would write two owner ids
    assert open_study(spec, url).user_attrs[SPEC_ATTR] == spec.stored()  # and resumed as its own
    maximize = optuna.create_study(study_name="up", storage=url, direction="maximize")  # not what the file says
    with pytest.raises(StudyMismatchError, match="not created by sweep"):
        open_study(spec.model_copy(update={"name": maximize.study_name}), url)


def test_fixed_values_written_differently_but_equal_resume_the_study(tmp_path: Path) -> None:
    # YAML 1.1 reads `1e-4` (no dot) as a string; the trainer reads it as 0.0001. Same study either way.
    path = write_study(tmp_path, TINY_STUDY)
    path.write_text(path.read_text().replace("batch_size: 32", "batch_size: 32\n  weight_decay: 1e-4"))
    url = f"sqlite:///{tmp_path / 'tiny.db'}"
    open_study(load_spec(path)[0], url)
    path.write_text(path.read_text().replace("weight_decay: 1e-4", "weight_decay: 0.0001"))
    open_study(load_spec(path)[0], url)  # not refused
    path.write_text(path.read_text().replace("weight_decay: 0.0001", "weight_decay: 0.001"))
    with pytest.raises(StudyMismatchError, match="different fixed"):
        open_study(load_spec(path)[0], url)


@pytest.mark.parametrize(("before", "at_default", "changed", "refused"), [
    # Edits review: `task: digits` rewritten as `task: {name: digits, args: {val_fraction: 0.2}}` (its default) was
    # refused ("task.args.val_fraction: added"), where a fixed key written at its default is accepted.
    pytest.param("task: digits", "task: {name: digits, args: {val_fraction: 0.2}}",
                 ("val_fraction: 0.2", "val_fraction: 0.3"), r"different task \(task.args.val_fraction",
                 id="task-argument"),
    # Edits review: `fixed.model.depth: 2` (digits' default) added on a rerun was refused as "fixed.model: added".
    pytest.param("batch_size: 32", "batch_size: 32\n  model: {depth: 2}", ("depth: 2", "depth: 3"),
                 r"different fixed \(fixed.model", id="model-key"),
])
def test_a_key_written_at_its_default_or_left_out_resumes_the_study(tmp_path: Path, before: str, at_default: str,
                                                                     changed: tuple[str, str], refused: str) -> None:
    from trainer.tasks import load_task

    assert load_task("digits", {}).model_defaults["depth"] == 2
    path = write_study(tmp_path, TINY_STUDY)
    url = f"sqlite:///{tmp_path / 'tiny.db'}"
    open_study(load_spec(path)[0], url)
    path.write_text(path.read_text().replace(before, at_default))
    open_study(load_spec(path)[0], url)  # not refused
    path.write_text(path.read_text().replace(*changed))
    with pytest.raises(StudyMismatchError, match=refused):
        open_study(load_spec(path)[0], url)


def test_a_shared_block_reads_the_finished_trials_once_until_this_storage_writes_a_state(tmp_path: Path) -> None:
    # A cohort's step: every member's pruner reads the study's finished trials; in `shared_finished_reads` they share
    # the block's first read. Another worker's trial that finishes meanwhile is seen after the block (or once this
    # storage ends a trial itself); reads of running trials are never shared.
    from optuna.trial import TrialState

    from sweep.storage import Boundary, PatientStorage, make_storage

    url = f"sqlite:///{tmp_path / 's.db'}"
    storage = PatientStorage(make_storage(url), Boundary(60))
    mine = optuna.create_study(study_name="s", storage=storage)
    other = optuna.load_study(study_name="s", storage=make_storage(url))  # another worker, its own connection
    for _ in range(2):
        mine.tell(mine.ask(), 1.0)
    theirs, running = other.ask(), mine.ask()
    finished = (TrialState.COMPLETE, TrialState.PRUNED)
    with storage.shared_finished_reads():
        assert [t.number for t in mine.get_trials(deepcopy=False, states=finished)] == [0, 1]
        other.tell(theirs, 2.0)
        assert [t.number for t in mine.get_trials(deepcopy=False, states=finished)] == [0, 1]  # the block's read
        assert [t.number for t in mine.get_trials(deepcopy=True, states=(TrialState.COMPLETE,))] == [0, 1]
        everything = mine.get_trials(deepcopy=False)  # all states: not shared, read fresh
        assert [t.state for t in everything][2] == TrialState.COMPLETE
        mine.tell(running, 3.0)  # this storage ends a trial: the snapshot is dropped
        assert [t.number for t in mine.get_trials(deepcopy=False, states=finished)] == [0, 1, 2, 3]
        last = other.ask()
        other.tell(last, 4.0)
        assert len(mine.get_trials(deepcopy=False, states=finished)) == 4
    assert len(mine.get_trials(deepcopy=False, states=finished)) == 5  # after the block: fresh reads again


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_read_of_the_finished_trials_loads_no_running_trial_and_each_finished_one_once(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    # A pruner reads the study's finished trials at each evaluation. Through Optuna's cache, each such read loaded
    # every running trial of the study in full (to learn which had finished): with N workers, N trials' params, attrs
    # and every intermediate value, at each evaluation of each worker. Now: one narrow query, and only the trials
    # that finished since the last read are loaded. What it returns is what a fresh read gives.
    import sqlalchemy
    from optuna.trial import TrialState

    from sweep.storage import Boundary, PatientStorage, make_storage

    url = f"sqlite:///{tmp_path / 's.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    name = f"finished-{backend}"
    storage = PatientStorage(make_storage(url), Boundary(60))
    mine = optuna.create_study(study_name=name, storage=storage)
    other = optuna.load_study(study_name=name, storage=make_storage(url))  # other workers, their own connections
    running = [other.ask() for _ in range(4)]
    for trial in running:
        for step in range(50):
            trial.report(float(step), step)
        trial.set_user_attr("curve", list(range(200)))
    statements: list[str] = []
    sqlalchemy.event.listen(storage.backend.engine, "before_cursor_execute",
                            lambda *args: statements.append(args[2]) if args[2].lstrip().startswith("SELECT") else None)
    finished = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)

    def fresh() -> list[tuple[int, TrialState, Any, dict[int, float], dict[str, Any]]]:
        return [(t.number, t.state, t.value, t.intermediate_values, t.user_attrs)
                for t in optuna.load_study(study_name=name, storage=make_storage(url)).get_trials(states=finished)]

    def read() -> list[tuple[int, TrialState, Any, dict[int, float], dict[str, Any]]]:
        statements.clear()
        return [(t.number, t.state, t.value, t.intermediate_values, t.user_attrs)
                for t in mine.get_trials(deepcopy=False, states=finished)]

    assert read() == fresh() == []
    assert read() == [] and len(statements) == 1, statements  # nothing new: one narrow query
    assert "trial_intermediate_values" not in statements[0] and "trial_user_attributes" not in statements[0]
    other.tell(running[2], 2.0)
    other.tell(running[0], state=TrialState.PRUNED)
    assert read() == fresh() and [row[0] for row in read()] == [0, 2]
    assert len(statements) == 1, statements  # both were loaded by the read before: the ids alone again
    other.tell(running[1], state=TrialState.FAIL)
    assert read() == fresh() and [row[0] for row in read()] == [0, 1, 2]
    assert [t.number for t in mine.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))] == [2]
    copies = mine.get_trials(deepcopy=True, states=finished)
    copies[0].user_attrs["curve"].clear()  # a deep copy is the caller's own
    assert read() == fresh()


def test_an_ask_block_reads_the_trials_once_and_a_queued_or_claimed_trial_drops_the_read(tmp_path: Path) -> None:
    # One ask under the study's lock: the budget count, Optuna's look for a queued trial and the sampler's reads share
    # the block's first read, running trials included; a trial queued or claimed in the block is seen at once.
    from optuna.trial import TrialState

    from sweep.storage import Boundary, PatientStorage, make_storage

    url = f"sqlite:///{tmp_path / 's.db'}"
    storage = PatientStorage(make_storage(url), Boundary(60))
    mine = optuna.create_study(study_name="s", storage=storage)
    other = optuna.load_study(study_name="s", storage=make_storage(url))
    mine.tell(mine.ask(), 1.0)
    with storage.shared_ask_reads():
        assert [t.state for t in mine.get_trials(deepcopy=False)] == [TrialState.COMPLETE]
        other.ask()  # another worker's trial, asked meanwhile: not in the block's read
        assert len(mine.get_trials(deepcopy=False)) == 1
        assert mine.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) == []
        mine.enqueue_trial({"x": 1.0})  # queued here: the next read in the block must see it
        assert [t.state for t in mine.get_trials(deepcopy=False)] == [TrialState.COMPLETE, TrialState.RUNNING,
                                                                        TrialState.WAITING]
        claimed = mine.ask()  # takes the queued trial (a state written): the next read is fresh, and shared again
        assert claimed.number == 2
        assert [t.state for t in mine.get_trials(deepcopy=False)] == [TrialState.COMPLETE] + [TrialState.RUNNING] * 2
        other.ask()
        assert len(mine.get_trials(deepcopy=False)) == 3
        created = mine.ask()  # created here: it joins the block's read as a read would give it
        created.set_user_attr("k", 1)
        joined = mine.get_trials(deepcopy=False)[-1]
    assert len(mine.get_trials(deepcopy=False)) == 5  # after the block: fresh reads
    assert joined == mine.get_trials(deepcopy=False)[-1] and joined.number == created.number == 4
    assert joined.user_attrs == {"k": 1} and joined.datetime_start is not None


@pytest.mark.parametrize("sampler", ["tpe", "random", "cmaes", "gp", "qmc", "nsgaii", "bruteforce"])
def test_every_sampler_draws_in_an_ask_block_what_it_draws_reading_afresh(tmp_path: Path, sampler: str) -> None:
    # The worker asks each trial with all its keys (`study.ask(spec.distributions())`) inside one shared read of the
    # study. Some samplers read the trial they are sampling (brute force finds the params drawn so far there, and
    # failed "Should not reach" on a snapshot without it): the block's snapshot holds the new trial and what is
    # written to it. Each sampler, seeded, draws the same params trial after trial with the block and without.
    import warnings

    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from sweep.components import SAMPLERS
    from sweep.storage import Boundary, PatientStorage, make_storage

    space = {"lr": FloatDistribution(1e-4, 1e-1, log=True),
             "x": FloatDistribution(0.0, 1.0, step=0.25), "n": IntDistribution(1, 9, step=2),
             "act": CategoricalDistribution(["relu", "tanh"])}
    if sampler == "bruteforce":  # it enumerates: every float needs a step
        space["lr"] = FloatDistribution(0.01, 0.05, step=0.02)

    def draws(shared: bool) -> list[dict[str, object]]:
        url = f"sqlite:///{tmp_path / f'{shared}.db'}"
        storage = PatientStorage(make_storage(url), Boundary(60))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            study = optuna.create_study(study_name="s", storage=storage, sampler=SAMPLERS[sampler](seed=3))
            for _ in range(8):
                with storage.shared_ask_reads() if shared else contextlib.nullcontext():
                    trial = study.ask(space)
                params = dict(trial.params)
                study.tell(trial, float(params["x"]) + float(params["n"]) / 10 + (params["act"] == "tanh"))
        return [t.params for t in study.get_trials()]

    assert draws(True) == draws(False)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_trial_s_user_attrs_are_written_together_and_a_finished_trial_refuses_them(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    # The worker writes a trial's outcome attrs in one transaction (one multi-row upsert): each lands (an existing
    # key is overwritten), as another process reads them, and a trial another worker has finished meanwhile refuses
    # them as Optuna does.
    from sweep.storage import Boundary, PatientStorage, make_storage

    url = f"sqlite:///{tmp_path / 'a.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    storage = PatientStorage(make_storage(url), Boundary(60))
    study = optuna.create_study(study_name=f"attrs-{tmp_path.name}", storage=storage)
    trial = study.ask()
    trial.set_user_attr("outcome", "running")
    storage.set_trial_user_attrs(trial._trial_id, {"outcome": "complete", "steps": 40, "metrics": {"val_loss": 0.5}})
    seen = optuna.load_study(study_name=study.study_name, storage=make_storage(url)).get_trials()[0].user_attrs
    assert seen == {"outcome": "complete", "steps": 40, "metrics": {"val_loss": 0.5}}
    study.tell(trial, 1.0)
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        storage.set_trial_user_attrs(trial._trial_id, {"outcome": "lost"})
    assert optuna.load_study(study_name=study.study_name, storage=make_storage(url)).get_trials()[0].user_attrs[
        "outcome"] == "complete"


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_block_s_reports_and_attrs_are_one_write_and_a_trial_ended_elsewhere_drops_its_own(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    # A cohort's step: each member reports its evaluation, and its pruner judges it. In `deferred_writes` the values
    # and attrs of every member are written together at the block's end: another process sees none of them during the
    # block and all of them after (NaN and inf as Optuna stores them; a later write of the same key wins). A read or
    # other write on this storage meanwhile writes them first. A trial another worker failed meanwhile drops its
    # writes while the others land, and its own end is refused, as without the block.
    import math

    from optuna.trial import TrialState
    from sqlalchemy import event

    from sweep.storage import Boundary, PatientStorage, make_storage

    url = f"sqlite:///{tmp_path / 'd.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    storage = PatientStorage(make_storage(url), Boundary(60))
    study = optuna.create_study(study_name=f"deferred-{tmp_path.name}", storage=storage)
    other = optuna.load_study(study_name=study.study_name, storage=make_storage(url))
    a, b, c = study.ask(), study.ask(), study.ask()
    inserts: list[str] = []
    event.listen(storage.backend.engine, "before_cursor_execute",
                 lambda conn, cursor, statement, *rest: inserts.append(statement.split("(")[0].strip())
                 if statement.lstrip().upper().startswith("INSERT") else None)
    with storage.deferred_writes():
        a.report(0.5, 0)
        b.report(float("nan"), 0)
        c.report(float("inf"), 0)
        a.set_user_attr("cohort", {"id": "w:1", "member": 0})
        a.set_user_attr("cohort", {"id": "w:1", "member": 3})
        a.report(0.25, 10)
        assert not a.should_prune()  # the pruner judges the values Optuna keeps on the trial
        with storage.deferred_writes():  # nested: written with the outer block
            b.set_user_attr("train_curve", [[1, 2.0]])
        assert all(t.intermediate_values == {} and t.user_attrs == {} for t in other.get_trials())
        other._storage.set_trial_state_values(c._trial_id, TrialState.FAIL)  # another worker declares c lost
    assert inserts == ["INSERT INTO trial_intermediate_values", "INSERT INTO trial_user_attributes"]
    seen = {t.number: t for t in other.get_trials()}
    assert seen[0].intermediate_values == {0: 0.5, 10: 0.25}
    assert seen[0].user_attrs == {"cohort": {"id": "w:1", "member": 3}}
    assert math.isnan(seen[1].intermediate_values[0]) and seen[1].user_attrs == {"train_curve": [[1, 2.0]]}
    assert seen[2].intermediate_values == {} and seen[2].state == TrialState.FAIL
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):  # c's end, as the worker tells it
        storage.set_trial_user_attrs(c._trial_id, {"outcome": "complete"})

    inserts.clear()
    with storage.deferred_writes():
        b.report(0.75, 5)
        assert storage.get_trial(b._trial_id).intermediate_values[5] == 0.75  # a read writes them first
        b.report(0.5, 10)
        with pytest.raises(TypeError):  # not JSON: refused at the call, as Optuna refuses it
            b.set_user_attr("bad", object())
    assert inserts == ["INSERT INTO trial_intermediate_values"] * 2
    values = other.get_trials()[1].intermediate_values
    assert math.isnan(values.pop(0)) and values == {5: 0.75, 10: 0.5}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_an_ask_block_s_draws_are_one_write_at_its_end_and_an_incompatible_draw_is_refused_at_once(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    # A cohort's free slots are asked in one block under the study's lock. Each trial's params and TPE's shared
    # draw (constant liar: a system attr) were a transaction each: they are written together when the block ends,
    # still under the lock, and another worker finds them then. Optuna's `Trial` reads the trial it was given: from
    # the block's snapshot, not the database. A param of another kind than the study's is refused at the draw.
    from optuna.distributions import CategoricalDistribution, FloatDistribution
    from sqlalchemy import event

    from sweep.storage import Boundary, PatientStorage, make_storage

    url = f"sqlite:///{tmp_path / 'p.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    storage = PatientStorage(make_storage(url), Boundary(60))
    study = optuna.create_study(study_name=f"asked-{tmp_path.name}", storage=storage,
                                sampler=optuna.samplers.TPESampler(seed=1, n_startup_trials=2))
    other = optuna.load_study(study_name=study.study_name, storage=make_storage(url))
    space = {"lr": FloatDistribution(1e-4, 1e-1, log=True), "x": FloatDistribution(0.0, 1.0),
             "act": CategoricalDistribution(["relu", "tanh"])}
    for value in (0.3, 0.1):
        study.tell(study.ask(space), value)
    seen: list[str] = []
    event.listen(storage.backend.engine, "before_cursor_execute",
                 lambda conn, cursor, statement, *rest: seen.append(" ".join(statement.split()[:4])))
    event.listen(storage.backend.engine, "commit", lambda conn: seen.append("COMMIT"))
    with storage.shared_ask_reads():
        asked = [study.ask(space) for _ in range(3)]
        inside = list(seen)
        assert [t.params for t in other.get_trials()[2:]] == [{}, {}, {}]  # not written yet
    written = seen[len(inside):]
    assert not any(s.startswith("INSERT INTO trial_params") for s in inside)
    assert sum(s.startswith("INSERT INTO trials ") for s in inside) == 3
    assert written.count("COMMIT") == 1 and written[-1] == "COMMIT"
    assert sum(s.startswith("INSERT INTO trial_params") for s in written) == 9
    stored = {t.number: t for t in other.get_trials()}
    for trial in asked:
        assert stored[trial.number].params == trial.params and set(trial.params) == set(space)
        assert stored[trial.number].distributions == space
        assert any(key.startswith("tpe:relative_params") for key in stored[trial.number].system_attrs)

    def drawn(into: optuna.Study) -> None:
        into.ask({"act": FloatDistribution(0.0, 1.0)})  # "act" is categorical in this study

    with pytest.raises(ValueError), storage.shared_ask_reads():
        drawn(study)
    with pytest.raises(ValueError):  # as Optuna refuses it without the block
        drawn(other)
    assert all("act" not in t.params or isinstance(t.distributions["act"], CategoricalDistribution)
               for t in other.get_trials())


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_an_ask_block_s_draws_written_but_their_reply_lost_are_written_once_and_the_ask_goes_on(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    # The block's params are committed, then the connection drops before the reply (a network blip): the boundary
    # writes them again. They are there already, so the retry leaves them, as Optuna's own param write does, where
    # its insert broke the unique key and the worker died with a traceback (review, through a TCP proxy on PG).
    import sqlalchemy
    from sqlalchemy import event

    from sweep.storage import Boundary, PatientStorage, make_storage

    url = f"sqlite:///{tmp_path / 'lost.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    storage = PatientStorage(make_storage(url), Boundary(60))
    study = optuna.create_study(study_name=f"lost-reply-{tmp_path.name}", storage=storage,
                                sampler=optuna.samplers.TPESampler(seed=1, n_startup_trials=1))
    study.tell(study.ask({"x": optuna.distributions.FloatDistribution(0, 1)}), 0.5)
    inserted: list[str] = []
    lost: list[str] = []
    event.listen(storage.backend.engine, "before_cursor_execute", lambda conn, cursor, statement, *rest:
                 inserted.append(statement) if statement.startswith("INSERT INTO trial_params") else None)

    def reply_lost(session: Any) -> None:
        if inserted and not lost:
            lost.append("lost")
            raise sqlalchemy.exc.OperationalError("COMMIT", {}, ConnectionError("server closed the connection"))

    event.listen(storage.backend.scoped_session.session_factory, "after_commit", reply_lost)
    space = {"x": optuna.distributions.FloatDistribution(0, 1), "y": optuna.distributions.IntDistribution(1, 9)}
    with storage.shared_ask_reads():
        asked = [study.ask(space) for _ in range(2)]
    assert lost == ["lost"]  # the fault happened, after the commit
    other = optuna.load_study(study_name=study.study_name, storage=make_storage(url))
    stored = {t.number: t for t in other.get_trials()}
    for trial in asked:
        assert stored[trial.number].params == trial.params and set(trial.params) == {"x", "y"}
    study.tell(asked[0], 0.25)  # the worker goes on
    assert other.get_trials()[asked[0].number].value == 0.25


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_trials_start_beating_in_one_write_and_a_finished_one_refuses_it(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    # The trials asked for a cohort's free slots each get their heartbeat settings and their first beat, all in one
    # transaction (two per trial before); a trial another worker has finished meanwhile refuses it, and none of the
    # others is half-started.
    from sqlalchemy import event

    from sweep.storage import Boundary, PatientStorage, make_storage
    from sweep.worker import HEARTBEAT_ATTR, Beats

    url = f"sqlite:///{tmp_path / 'b.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    storage = PatientStorage(make_storage(url, heartbeat_interval=30), Boundary(60))
    study = optuna.create_study(study_name=f"beats-{tmp_path.name}", storage=storage)
    other = optuna.load_study(study_name=study.study_name, storage=make_storage(url))
    a, b, c, d = (study.ask() for _ in range(4))
    commits: list[int] = []
    event.listen(storage.backend.engine, "commit", lambda conn: commits.append(1))
    beats = Beats(storage)
    beats.add(a, b, a)
    assert len(commits) == 1 and beats.ids() == sorted([a._trial_id, b._trial_id])
    stored = {t.number: t for t in other.get_trials()}
    assert all(HEARTBEAT_ATTR in stored[t.number].system_attrs for t in (a, b))
    assert all(storage.heartbeat_age_s(t._trial_id) is not None for t in (a, b))
    other.tell(d.number, state=optuna.trial.TrialState.FAIL)  # another worker failed d as lost
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        beats.add(c, d)
    assert HEARTBEAT_ATTR not in other.get_trials()[c.number].system_attrs
    assert storage.heartbeat_age_s(c._trial_id) is None and c._trial_id not in beats.ids()


def test_a_worker_beats_for_all_its_trials_in_one_write_with_one_time(tmp_path: Path, postgres_url: str) -> None:
    # A dead worker's trials must go stale together, so that their retries are asked together and train in one cohort
    # again. Beaten one transaction each, their last beats differed (on SQLite by a second where the beats straddled
    # one), they were found lost one by one and a killed cohort's members were retried in cohorts of their own, the
    # last one alone (CI). PostgreSQL gives each transaction its own time: one write, one time.
    from sqlalchemy import event, text

    from sweep.worker import Worker

    spec, _ = load_spec(write_study(tmp_path, {**TINY_STUDY, "name": f"beat-{tmp_path.name}",
                                               "heartbeat_interval": 1, "heartbeat_grace_period": 30}))
    study = open_study(spec, postgres_url)
    worker = Worker(study, spec, storage_url=postgres_url, boundary=study._storage.boundary)
    engine = study._storage.backend.engine
    trials = [study.ask() for _ in range(3)]
    ids = tuple(t._trial_id for t in trials)

    def stamps() -> set[Any]:
        with engine.connect() as connection:
            return {row[0] for row in connection.execute(
                text("SELECT heartbeat FROM trial_heartbeats WHERE trial_id IN :ids").bindparams(
                    sqlalchemy.bindparam("ids", expanding=True)), {"ids": list(ids)})}

    commits: list[int] = []

    def committed(connection: Any) -> None:
        commits.append(1)

    with worker.beating() as beats:
        beats.add(*trials)  # their first beats, in one write
        first = stamps()
        event.listen(engine, "commit", committed)
        deadline = time.monotonic() + 120
        while not commits and time.monotonic() < deadline:  # the thread's beat (nothing else writes meanwhile)
            time.sleep(0.05)
    event.remove(engine, "commit", committed)
    assert commits, "the heartbeat thread never beat"
    beaten = stamps()
    assert len(beaten) == 1 and beaten != first, (beaten, first)


def test_trials_asked_together_are_drawn_and_counted_as_asked_one_by_one(tmp_path: Path) -> None:
    # A cohort asks its free slots' trials together (`Worker._ask_many`: one hold of the lock, one read of the study).
    # Seeded TPE draws the same params as asking them one after another (each sees the ones asked before it as
    # running: constant liar), and the budget stops the asking at n_trials exactly.
    from sweep.worker import Worker

    study_file = write_study(tmp_path, {**TINY_STUDY, "n_trials": 7, "seed": 5, "sampler": {"type": "tpe"}})
    spec, _ = load_spec(study_file)

    def drawn(together: bool) -> tuple[list[dict[str, Any]], bool, list[optuna.Trial]]:
        url = f"sqlite:///{tmp_path / f'{together}.db'}"
        study = open_study(spec, url)
        worker = Worker(study, spec, storage_url=url, boundary=study._storage.boundary)
        for _ in range(3):  # three finished trials: TPE's startup draws and then its model
            trial = worker._ask_next()[0]
            assert trial is not None
            study.tell(trial, trial.params["learning_rate"])
        if together:
            asked, spent, _ = worker._ask_many(6)
        else:
            asked, spent = [], False
            for _ in range(6):
                trial, spent, _ = worker._ask_next()
                if trial is not None:
                    asked.append(trial)
        return [t.params for t in asked], spent, worker._ask_many(2)[0]

    together, one_by_one = drawn(True), drawn(False)
    assert together[0] == one_by_one[0]
    # 3 told + 4 asked = n_trials: four of the six, and none after them (not spent: the last four still run)
    assert len(together[0]) == 4 and together[1:] == one_by_one[1:] == (False, [])


def test_a_gate_is_asked_under_the_lock_with_the_ask_s_read_of_the_study(tmp_path: Path) -> None:
    # A ramp cohort takes a member only while a startup trial is missing that no worker runs. Counted before the ask
    # and outside the study's lock, two workers both took the last one (review: 4 startup trials admitted where 3
    # were missing). The count is made again under the lock, with the ask's own read of the study: a trial another
    # worker asked a moment before is in it.
    from sweep.worker import Worker

    study_file = write_study(tmp_path, {**TINY_STUDY, "n_trials": 8})
    spec, _ = load_spec(study_file)
    url = f"sqlite:///{tmp_path / 'g.db'}"
    study = open_study(spec, url)
    worker = Worker(study, spec, storage_url=url, boundary=study._storage.boundary)
    seen: list[int] = []

    def gate(trials: list[optuna.trial.FrozenTrial]) -> bool:
        seen.append(len(trials))
        return sum(t.state == optuna.trial.TrialState.RUNNING for t in trials) < 2

    asked, spent, _ = worker._ask_many(4, gate=gate)
    assert len(asked) == 2 and not spent and seen == [0, 1, 2]
    optuna.load_study(study_name=study.study_name, storage=url).ask()  # another worker's, asked meanwhile
    study.tell(asked[0], 1.0)
    asked, _, _ = worker._ask_many(4, gate=gate)
    assert asked == [] and seen[-1] == 3  # one running here, one elsewhere: none more


@pytest.mark.slow
def test_a_worker_whose_lock_went_with_a_server_restart_withdraws_a_trial_beyond_the_budget(tmp_path: Path) -> None:
    """The budget lock on PostgreSQL is an advisory lock, which a server restart releases with its session: another
    worker can then count and ask while the first is still asking. The first sees its lock lost and, counted again,
    withdraws its trial instead of training one trial more than `n_trials`."""
    from optuna.trial import TrialState

    from sweep.outcomes import ATTR_WITHDRAWN, budget_counts
    from sweep.worker import Worker
    from tests.pg import PostgresServer, postgres_available

    if not postgres_available():
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    spec, _ = load_spec(write_study(tmp_path, {**TINY_STUDY, "n_trials": 1}))
    with PostgresServer() as server:
        first, second = (open_study(spec, server.url) for _ in range(2))
        a, b = (Worker(study, spec, storage_url=server.url, boundary=study._storage.boundary)
                for study in (first, second))
        with a._lock() as lost:  # the race, step by step
            assert not lost()
            server.restart("fast")  # every session ends, and the advisory lock with it
            taken, spent, _ = b._ask_next()  # b takes the lock and the budget's one trial
            assert taken is not None and not spent
            late = first.ask()  # a counted before b asked, and asks now
            assert lost()
        assert a._fence(late)[0] is None  # one trial beyond the budget: withdrawn
        trials = second.get_trials()
    withdrawn = trials[late.number]
    assert withdrawn.state == TrialState.FAIL and "beyond n_trials (1)" in withdrawn.user_attrs[ATTR_WITHDRAWN]
    assert trials[taken.number].state == TrialState.RUNNING
    assert budget_counts(trials) == (0, 1)  # b's trial alone holds the budget


WAITER = """
import sys
from sweep.storage import Boundary, ask_lock, open_engine
engine = open_engine(sys.argv[1])  # the worker's other engines, holding connections idle in their pools
held = []
while True:  # every slot the server has left
    try:
        held.append(engine.connect())
    except Exception:
        break
held.pop().invalidate()  # but one, for the lock's own session (free once its server process has exited)
for connection in held:
    connection.close()
with ask_lock(sys.argv[1], "slots", Boundary(120)):
    pass
"""


def test_a_worker_waiting_for_the_study_s_lock_leaves_its_holder_a_connection_slot(tmp_path: Path) -> None:
    """Found by review: three cohort workers on a server with 7 slots. The lock's holder, refused a slot to count and
    ask, waited; the workers waiting for the lock held their idle connections the whole time, and nothing moved until
    the holder's `storage_patience` ran out (the run exited 1 with every trial done). A waiter now gives back its idle
    connections at each turn of its wait."""
    import hashlib

    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError
    from sqlalchemy.pool import NullPool

    from tests.pg import PostgresServer, postgres_available

    if not postgres_available():
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    key = int.from_bytes(hashlib.sha256(b"sweep:slots").digest()[:8], "big", signed=True)
    with PostgresServer(max_connections=6) as server:
        engine = create_engine(server.url, poolclass=NullPool)
        lock = engine.connect()
        lock.execute(text("SELECT pg_advisory_lock(:key)"), {"key": key})
        lock.commit()
        waiter = subprocess.Popen([sys.executable, "-c", WAITER, server.url], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            deadline, refused = time.monotonic() + 120, 0
            while not lock.execute(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT "
                                        "granted")).scalar():  # the waiter waits: the server is full
                lock.commit()
                assert waiter.poll() is None and time.monotonic() < deadline, waiter.communicate()[1][-2000:]
                time.sleep(0.1)
            lock.commit()
            while True:  # the holder needs one more connection, to count and ask
                try:
                    with engine.connect() as more:
                        more.execute(text("SELECT 1"))
                    break
                except OperationalError as exc:
                    assert "too many clients" in str(exc), exc
                    refused += 1
                    assert time.monotonic() < deadline, "the waiter kept its idle connections"
                    time.sleep(0.2)
            lock.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
            lock.commit()
            assert waiter.wait(timeout=60) == 0, waiter.communicate()[1][-2000:]
            assert refused, "the server was never full: the test tested nothing"
        finally:
            waiter.kill()
            lock.close()
            engine.dispose()


def test_workers_joining_while_retries_are_queued_draw_different_configs(tmp_path: Path) -> None:
    """A joining worker's sampler seed comes from what the study held at its first ask. Three workers resuming a study
    with three retries queued each took a retry first, which left the trial count as it was: all three drew the same
    seed and then trained the same configs, three times each (found by killing a `--workers 3` run and resuming it)."""
    from sweep.worker import Worker

    spec, _ = load_spec(write_study(tmp_path, {**TINY_STUDY, "n_trials": 20, "sampler": {"type": "random"}}))
    url = f"sqlite:///{tmp_path / 'tiny.db'}"
    study = open_study(spec, url)
    for value in (0.05, 0.06):
        study.add_trial(optuna.trial.create_trial(params={"learning_rate": value}, distributions={
            "learning_rate": optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True)}, value=value))
    for value in (0.01, 0.02, 0.03):  # three retries, queued
        study.enqueue_trial({"learning_rate": value}, skip_if_exists=False)
    workers = [Worker(open_study(spec, url), spec, storage_url=url, boundary=study._storage.boundary)
               for _ in range(3)]
    retries = [w._ask_next()[0] for w in workers]  # each takes a queued retry first
    assert sorted(t.number for t in retries if t is not None) == [2, 3, 4]
    drawn = [w._ask_next()[0] for w in workers]
    values = [t.suggest_float("learning_rate", 1e-3, 1e-1, log=True) for t in drawn if t is not None]
    assert len(values) == 3 and len(set(values)) == 3, values


def test_a_file_lock_is_never_lost(tmp_path: Path) -> None:
    from sweep.storage import ask_lock

    with ask_lock(f"sqlite:///{tmp_path / 'x.db'}", "x") as lost:
        assert not lost()


def _taken_while_held(url: str, name: str, hold_s: float, holder_stale_after: float | None,
                      waiter_stale_after: float) -> tuple[float, list[str], bool]:
    """A holder takes the study's lock on a thread and keeps it `hold_s` seconds, doing nothing else; this thread
    waits for it. Returns how long the wait took, the warnings it gave, and whether the holder still had its lock
    when it let go."""
    import time

    from sweep.storage import ask_lock

    held, release, kept = threading.Event(), threading.Event(), []

    def holder() -> None:
        with ask_lock(url, name, stale_after=holder_stale_after) as lost:
            held.set()
            release.wait(hold_s)
            kept.append(not lost())

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(60)
        started = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ask_lock(url, name, stale_after=waiter_stale_after) as lost:
                waited = time.monotonic() - started
                assert not lost()
    finally:
        release.set()
        thread.join(60)
    return waited, [str(w.message) for w in caught], kept == [True]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_lock_held_past_the_grace_by_a_worker_that_does_not_answer_is_taken_over(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    """A worker paused (SIGSTOP, a suspended machine) while it held the study's lock stalled every other worker for as
    long as it stayed paused, with the failing of its own lost trials, which happens under the lock. A waiter now
    takes the lock over after the grace period, with a warning; the holder, when it comes back, finds it lost."""
    from sweep.storage import ask_lock

    url = f"sqlite:///{tmp_path / 'x.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    name = f"paused-{tmp_path.name}"
    # A holder that shows no life (no grace of its own) and answers nothing until released: waited for through the
    # grace period (past the wait's own one-second turns in PostgreSQL's queue), then taken.
    waited, messages, kept = _taken_while_held(url, name, 120, None, 1.5)
    assert waited >= 1.5, waited
    assert len(messages) == 1 and "held for" in messages[0] and "does not" in messages[0], messages
    assert not kept  # its lock is gone: what it asked is counted again (`Worker._fence`)
    # Once over, the lock works as before: taken, not lost, released.
    with ask_lock(url, name, stale_after=1.5) as lost:
        assert not lost()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_live_holder_slower_than_the_grace_keeps_the_lock_and_a_hung_one_loses_it(
        tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> None:
    """A healthy worker whose turn under the lock took longer than the grace period (a loaded machine opening a
    study, asking a cohort's trials) had its PostgreSQL session ended as "a worker that does not answer": its lock
    session sat idle while it worked on its others. A live holder now shows life for three periods; past that it
    is taken for hung and taken over as a paused one is."""
    from sweep.storage import LIFE_SHOWN_PERIODS

    url = f"sqlite:///{tmp_path / 'x.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    name = f"slow-{tmp_path.name}"
    waited, messages, kept = _taken_while_held(url, name, 5.0, 3.0, 3.0)  # alive all along, 5 s: kept
    assert waited >= 4.0 and kept and not messages, (waited, kept, messages)
    waited, messages, kept = _taken_while_held(url, name, 120, 3.0, 3.0)  # alive, but for ever: hung
    assert waited >= LIFE_SHOWN_PERIODS * 3.0 and not kept, (waited, kept)
    assert len(messages) == 1 and "held for" in messages[0], messages


def test_a_lock_held_briefly_is_waited_for_and_stays_its_holder_s(tmp_path: Path) -> None:
    import time
    import warnings

    from sweep.storage import ask_lock

    url = f"sqlite:///{tmp_path / 'x.db'}"
    held, holds = threading.Event(), []

    def holder() -> None:
        with ask_lock(url, "x") as lost:
            held.set()
            time.sleep(0.5)
            holds.append(lost())

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no takeover, so no warning
        with ask_lock(url, "x", stale_after=60) as lost:
            assert holds == [False] and not lost()
    thread.join(60)


def test_workers_passing_the_lock_file_among_themselves_never_take_it_over_from_each_other(tmp_path: Path) -> None:
    """A waiter timed its own wait: with several workers, one could wait past the grace period for its turn while
    every holder was healthy, and break a healthy holder's lock; after a real takeover, the other long waiters broke
    the new holder's lock one after another. A takeover now needs the same holder for the whole grace period."""
    import time

    from sweep.storage import ask_lock

    url = f"sqlite:///{tmp_path / 'x.db'}"
    lost_seen: list[bool] = []
    held, release = threading.Event(), threading.Event()

    def paused_holder() -> None:
        with ask_lock(url, "x") as lost:
            held.set()
            release.wait(120)
            lost_seen.append(("paused", lost()))  # type: ignore[arg-type]

    def busy_worker(until: float) -> None:
        while time.monotonic() < until:
            with ask_lock(url, "x", stale_after=1.0) as lost:
                time.sleep(0.15)
                lost_seen.append(lost())

    paused = threading.Thread(target=paused_holder)
    paused.start()
    assert held.wait(60)
    until = time.monotonic() + 6.0
    workers = [threading.Thread(target=busy_worker, args=(until,)) for _ in range(5)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    release.set()
    paused.join(60)
    assert lost_seen[-1] == ("paused", True)  # the paused one was taken over, once
    healthy = lost_seen[:-1]
    assert len(healthy) >= 5 and not any(healthy), healthy  # and no healthy holder ever lost its lock


def test_a_dropped_connection_is_transient_whatever_the_statement_s_parameters_say(postgres_url: str) -> None:
    """The messages that make an error final were searched in SQLAlchemy's whole text, parameters included: a trial's
    failure reason stored while the server restarted ("invalid lr value", "password ... does not exist") made the
    dropped connection final, and the worker crashed instead of waiting the outage out."""
    from sqlalchemy import create_engine, text

    from sweep.storage import bad_url_option, is_transient

    engine, other = create_engine(postgres_url), create_engine(postgres_url)
    try:
        with engine.connect() as connection, other.connect() as killer:
            pid = connection.execute(text("SELECT pg_backend_pid()")).scalar()
            killer.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            with pytest.raises(Exception) as raised:
                connection.execute(text("SELECT :reason"),
                                   {"reason": "ValueError: invalid lr value -1; password for x does not exist"})
        assert is_transient(raised.value) and bad_url_option(raised.value) is None
    finally:
        engine.dispose()
        other.dispose()


def test_a_standby_s_read_only_refusal_is_waited_out_and_a_denied_write_is_the_storage_s_refusal(
        postgres_url: str) -> None:
    """A failover leaves a worker on a standby until it is promoted ("cannot execute INSERT in a read-only
    transaction"): waited out as an outage, where it ended the worker with a traceback. A write the role may not
    make is final, and when a storage call raised it, it is the storage's refusal (the trial is retried, not
    counted), never a config's fault; the same error raised by a user's own code is not marked."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    from sweep.storage import Boundary, is_transient, storage_refusal

    engine = create_engine(postgres_url, poolclass=NullPool)  # each connect a new session
    try:
        with engine.connect() as connection:
            connection.execute(text("CREATE TABLE IF NOT EXISTS refusals (x integer)"))
            connection.commit()
            connection.execute(text("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"))
            connection.commit()  # the transactions after this one are read-only, as on a standby
            with pytest.raises(Exception) as read_only:
                connection.execute(text("INSERT INTO refusals VALUES (1)"))
        assert is_transient(read_only.value)
        with engine.connect() as connection:
            connection.execute(text("CREATE ROLE reader_only"))
            connection.commit()
            connection.execute(text("SET ROLE reader_only"))

            def insert() -> None:
                connection.execute(text("INSERT INTO refusals VALUES (1)"))

            with pytest.raises(Exception) as own:
                insert()
            assert not is_transient(own.value) and storage_refusal(own.value) is None  # not through the storage
            connection.rollback()
            connection.execute(text("SET ROLE reader_only"))
            with pytest.raises(Exception) as denied:
                Boundary(5.0).call(insert)
            refusal = storage_refusal(denied.value)
            assert refusal == ("the storage refused: InsufficientPrivilege: permission denied for table refusals",
                               "storage refused: InsufficientPrivilege"), refusal
            connection.rollback()
            # A value the column cannot hold (a loop's step counted in tokens, beyond a 4-byte integer) is the
            # trial's own: not the storage's refusal, or its retries would stop the worker, run after run.
            with pytest.raises(Exception) as too_large:
                Boundary(5.0).call(lambda: connection.execute(text("INSERT INTO refusals VALUES (3000000000)")))
            assert not is_transient(too_large.value) and storage_refusal(too_large.value) is None
    finally:
        engine.dispose()


@pytest.fixture
def silent_server() -> Any:
    """A TCP port on loopback that accepts connections and never says a word: a wedged database host."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                accepted.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for connection in accepted:
        connection.close()


@pytest.mark.parametrize("query", ["", "?connect_timeout=1"])
def test_a_postgresql_server_that_never_answers_fails_the_connection_instead_of_hanging(silent_server: int,
                                                                                       query: str) -> None:
    # libpq waits for a server's first answer forever unless told otherwise, and the worker with it: no outage
    # message, no storage_patience, no exit. A connection attempt now gives up (connect_timeout, 10 s unless the
    # URL says), which the worker's boundary treats as an outage.
    from sqlalchemy.exc import OperationalError

    from sweep.storage import engine_options, make_storage

    url = f"postgresql+psycopg://sweep:hunter2@127.0.0.1:{silent_server}/db{query}"
    assert engine_options(url)["connect_args"].get("connect_timeout") == (None if query else 10)  # the URL's wins
    outcome: list[BaseException] = []

    def connect() -> None:
        try:
            make_storage(url)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(180)  # generous on a loaded machine; without a timeout it never ends
    assert not thread.is_alive(), "still waiting for a server that never answers"
    assert len(outcome) == 1 and isinstance(outcome[0], OperationalError), outcome
    assert "timeout" in str(outcome[0]).lower()


def test_a_lock_file_that_cannot_be_opened_mid_run_is_the_storage_s_refusal(tmp_path: Path) -> None:
    # The database's folder made read-only (or removed) while a study runs: the worker's next ask could not open the
    # lock file, and its OSError came out of `sweep run` as a traceback. It is the storage's refusal: one line.
    (tmp_path / "s.db.lock").mkdir()  # a lock file no one can open, as in a read-only folder
    with pytest.raises(OSError) as info, ask_lock(f"sqlite:///{tmp_path / 's.db'}", "s"):
        pass
    refusal = storage_refusal(info.value)
    assert refusal is not None and refusal[0].startswith("the storage refused: cannot open the study's lock file "
                                                         f"{tmp_path / 's.db.lock'} (Is a directory)"), refusal


def test_releasing_idle_connections_closes_a_connection_in_use_once_it_is_given_back() -> None:
    # A worker refused a slot of a full server releases its idle connections, on every attempt: one in use then (the
    # study's lock held) must be closed by the next release once given back, not left open in a discarded pool until
    # the garbage collector finds it (the lock's engine then held two sessions).
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    from sweep.storage import release_idle_connections
    from tests.pg import PostgresServer

    with PostgresServer() as server:
        probe = create_engine(server.url, poolclass=NullPool)

        def sessions() -> int:
            with probe.connect() as connection:
                return connection.execute(text(
                    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
                    "AND pid <> pg_backend_pid()")).scalar_one()

        with ask_lock(server.url, "s"):
            assert sessions() == 1
            release_idle_connections()
        assert sessions() == 1  # given back: idle in its pool, as before
        with ask_lock(server.url, "s"):
            assert sessions() == 1  # the same connection, not a second one
        release_idle_connections()
        assert sessions() == 0


@pytest.mark.parametrize(("logger_name", "noise", "args"), [
    ("optuna.storages._rdb.storage", "Caught an error from sqlalchemy: (psycopg2.OperationalError) terminating "
     "connection due to administrator command\n[SQL: SELECT trials.trial_id ...]. Falling back to a slower "
     "alternative.", ()),
    # psycopg's own templates and arguments (`_pipeline.py`, `transaction.py`), as it logs them.
    ("psycopg", "error ignored terminating %r: %s", ("<psycopg.Pipeline [BAD]>", "the connection is lost")),
    ("psycopg.transaction", "error ignored in rollback of %s: %s", ("<psycopg.Transaction>", "the connection is lost")),
])
def test_a_library_s_line_about_a_dropped_connection_is_left_to_the_outage_line(
        tmp_path: Path, logger_name: str, noise: str, args: tuple[str, ...]) -> None:
    """Optuna's RDB storage logs a multi-line SQL dump when a read by trial ids fails; psycopg logs the failed
    cleanup of a pipeline or a rollback on a lost connection (both seen with pg_terminate_backend during a run).
    In a worker that is a dropped connection, which the storage wrapper says in one line. The libraries' other
    warnings still reach the user, psycopg's "error ignored" ones too where the error is not a lost connection."""
    import logging

    import psycopg

    from sweep.storage import make_storage

    make_storage(f"sqlite:///{tmp_path / 'quiet.db'}")
    logger = logging.getLogger(logger_name)
    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)  # whatever prints it (Optuna's handler, Python's last resort) is behind the filter
    try:
        logger.warning(noise, *(args[:-1] + (psycopg.OperationalError(args[-1]),) if args else ()))
        logger.warning("a warning of another kind")
        if args:
            logger.warning(noise, *args[:-1], ValueError("a bug in a user's own code"))
    finally:
        logger.removeHandler(handler)
    assert heard[0] == "a warning of another kind" and len(heard) == (2 if args else 1), heard


def test_a_full_disk_is_waited_out_with_a_line_that_says_to_free_space(tmp_path: Path) -> None:
    """SQLite's own "database or disk is full" (a real file whose page limit is reached): the worker waits, and its
    line says what ends the wait, since waiting alone does not; the write lands once there is room."""
    import sqlite3

    from sweep.storage import Boundary

    connection = sqlite3.connect(tmp_path / "full.db")
    connection.execute("CREATE TABLE t (b BLOB)")
    connection.commit()
    pages = connection.execute("PRAGMA page_count").fetchone()[0]
    connection.execute(f"PRAGMA max_page_count = {pages + 1}")
    lines: list[str] = []

    def notify(line: str) -> None:
        lines.append(line)
        connection.execute("PRAGMA max_page_count = 1000000")  # the operator frees space

    def write() -> int:
        connection.execute("INSERT INTO t VALUES (?)", (b"x" * 200_000,))
        connection.commit()
        return 1

    assert Boundary(patience_s=60, notify=notify, reached=True).call(write) == 1
    assert connection.execute("SELECT count(*) FROM t").fetchone()[0] == 1
    assert "database or disk is full" in lines[0] and "its disk is full: free space there" in lines[0], lines
    assert "is back" in lines[-1], lines


def test_a_role_out_of_its_own_connection_limit_is_named_not_the_servers_max_connections(postgres_url: str) -> None:
    # Found by review: a role's CONNECTION LIMIT (too many connections for role "...") was waited out with a line
    # telling the user to raise the server's max_connections, which would not help.
    from sqlalchemy import create_engine, text

    from sweep.storage import Boundary, StorageUnavailable

    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text("DROP ROLE IF EXISTS limited"))
        connection.execute(text("CREATE ROLE limited LOGIN CONNECTION LIMIT 1"))
    limited = create_engine(postgres_url.replace("postgres@", "limited@"))
    lines: list[str] = []
    try:
        with limited.connect():  # its one slot, taken
            with pytest.raises(StorageUnavailable):
                Boundary(0.5, notify=lines.append, reached=True).call(
                    lambda: create_engine(postgres_url.replace("postgres@", "limited@")).connect().close())
    finally:
        limited.dispose()
        with admin.connect() as connection:
            connection.execute(text("DROP ROLE limited"))
        admin.dispose()
    assert 'too many connections for role "limited"' in lines[0], lines
    assert "the role's CONNECTION LIMIT (ALTER ROLE ... CONNECTION LIMIT); raise it" in lines[0], lines
    assert "max_connections" not in lines[0], lines


def test_a_wait_for_the_study_s_lock_that_the_server_answers_is_not_taken_for_a_server_that_stopped(
        postgres_url: str) -> None:
    """Found by review: the watchdog for a server that stops answering (`sweep.unanswered`) timed the whole call, and
    waiting for the study's lock is one call of many one-second turns, each answered: a wait longer than
    `tcp_user_timeout` was cut as a server that stopped, with an outage line, and a short `storage_patience` then
    ended a healthy worker. A call is timed from the server's last answer."""
    import hashlib
    import time

    import psycopg
    from sqlalchemy import make_url

    from sweep.storage import Boundary

    name = f"held-{time.monotonic_ns()}"
    key = int.from_bytes(hashlib.sha256(f"sweep:{name}".encode()).digest()[:8], "big", signed=True)
    parsed = make_url(postgres_url)
    holder = psycopg.connect(dbname=parsed.database, user=parsed.username, host=parsed.query["host"], autocommit=True)
    heard: list[str] = []
    url = f"{postgres_url}&tcp_user_timeout=2000"
    boundary = Boundary(3, label="storage", notify=heard.append, reached=True)
    try:
        with ask_lock(url, name, boundary, stale_after=60):  # taken at once: the worker's connection is open
            pass
        holder.execute("SELECT pg_advisory_lock(%s)", (key,))
        release = threading.Timer(8.0, lambda: holder.execute("SELECT pg_advisory_unlock(%s)", (key,)))
        release.start()
        started = time.monotonic()
        with ask_lock(url, name, boundary, stale_after=60):
            waited = time.monotonic() - started
        release.join()
    finally:
        holder.close()
    assert waited >= 7.0 and not heard, (waited, heard)


_PAUSED_WORKER = """
import sys, time
from sqlalchemy import text
from sweep.storage import Boundary, open_engine
engine = open_engine(sys.argv[1])
boundary = Boundary(600, label="storage", notify=lambda line: print(line, flush=True), reached=True)
def query(seconds):
    with engine.connect() as connection:
        return connection.execute(text(f"SELECT pg_sleep({seconds}), 1")).scalar()
boundary.call(query, 0)
print("go", flush=True)
for _ in range(24):
    boundary.call(query, 0.5)
print("done", flush=True)
"""


def test_a_worker_paused_and_continued_does_not_take_its_own_pause_for_the_server_s(postgres_url: str) -> None:
    """Found by review: the watchdog's clock runs on while the worker's own process is stopped (Ctrl-Z, a frozen
    container), and on SIGCONT its thread cut the connections of a call whose answer was already waiting: an outage
    line for a server that was up throughout. A pause of the watchdog itself is not counted against the server."""
    import signal
    import time

    worker = subprocess.Popen([sys.executable, "-c", _PAUSED_WORKER, f"{postgres_url}&tcp_user_timeout=3000"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "go", worker.communicate()
        for _ in range(3):  # each pause long past the watchdog's bound, a call in flight across most of them
            time.sleep(1.3)
            worker.send_signal(signal.SIGSTOP)
            time.sleep(5)
            worker.send_signal(signal.SIGCONT)
        out, err = worker.communicate(timeout=240)
    finally:
        worker.kill()
    assert worker.returncode == 0 and out.strip().splitlines() == ["done"], out + err


def test_runs_on_many_databases_from_one_process_leave_no_server_sessions_behind(
        tmp_path: Path, postgres_url: str) -> None:
    """Found by review: each storage URL a process ran a study on (a notebook looping over databases, or over a
    URL option) kept an engine for the study's lock, holding a server session for good: 20 runs, 21 idle sessions,
    and the database could not be dropped. Now `run_study` closes the connections it leaves idle, and a process keeps
    lock engines for its few most recent URLs."""
    from sqlalchemy import text

    from sweep.storage import open_engine
    from sweep.study import run_study

    path = write_study(tmp_path, {**TINY_STUDY, "name": "notebook", "n_trials": 1})  # the server's other tests' too
    spec, _ = load_spec(path)
    admin = open_engine(postgres_url)

    def sessions() -> int:
        with admin.connect() as connection:
            return int(connection.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'notebook-run-%'")).scalar_one())

    def sessions_end() -> int:  # a session closed by its client leaves the server's view a moment later
        deadline = time.monotonic() + 60
        while (count := sessions()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return count

    for run in range(8):
        url = f"{postgres_url}&application_name=notebook-run-{run}"
        summary = run_study(open_study(spec, url), spec, storage_url=url)
        assert summary.budget_used == 1
        assert sessions_end() == 0, run
    admin.dispose()


@pytest.mark.parametrize("directions", [["minimize", "maximize"], ["maximize"]])
def test_run_study_refuses_a_study_whose_objectives_are_not_the_spec_s_before_any_trial(
        tmp_path: Path, directions: list[str]) -> None:
    """Found by review: `run_study` took any Optuna study. With two objectives every trial failed on Optuna's
    `Trial.report` and the run then blamed the code ("5 trials in a row failed the same way"); one to maximize with
    a spec minimizing val_loss ran its whole budget, and the study's best was its worst trial."""
    from sweep.study import run_study

    spec, _ = load_spec(write_study(tmp_path, TINY_STUDY))
    study = optuna.create_study(directions=directions, storage=f"sqlite:///{tmp_path / 'theirs.db'}")
    with pytest.raises(StudyMismatchError, match="objectives \\(minimize, maximize\\); sweep runs single-objective"
                       if len(directions) == 2 else "is to maximize, the spec's metric 'val_loss' to minimize"):
        run_study(study, spec)
    assert study.get_trials() == []


def test_a_study_in_an_in_memory_database_outlives_its_run(tmp_path: Path) -> None:
    """Found by review: closing the connections a run left idle closed an in-memory SQLite database's only one,
    and the study with it (`no such table: studies` at the next read)."""
    from sweep.study import run_study

    spec, _ = load_spec(write_study(tmp_path, {**TINY_STUDY, "n_trials": 2}))
    study = open_study(spec, "sqlite:///:memory:")
    assert run_study(study, spec).budget_used == 2
    assert len(study.trials) == 2 and study.best_value is not None


def test_a_worker_told_to_stop_while_its_storage_is_away_does_not_try_it_again_on_its_way_out() -> None:
    """PostgreSQL review: a SIGTERM while the server was stopped (SIGSTOP: every connection attempt waits out its
    connect_timeout) took 40 s to end the worker, past a launcher's 30 s grace: each call on its way out
    (registering and releasing its trials' checkpoints, marking them) tried the server once more. The first call
    that meets it away gives up; the calls after it do not try again while it was tried this recently."""
    import os
    import signal

    from sweep.signals import graceful_signals
    from sweep.storage import Boundary, StorageUnavailable

    tries = []

    def away() -> None:
        tries.append(time.monotonic())
        raise ConnectionError("connection timeout expired")

    boundary = Boundary(60, notify=lambda line: None, reached=True)
    with graceful_signals():
        os.kill(os.getpid(), signal.SIGTERM)  # recorded as a stop to honour, not raised at once
        for _ in range(4):
            with pytest.raises(StorageUnavailable, match="told to stop"):
                boundary.call(away)
    assert len(tries) == 1


def test_a_worker_waiting_for_the_last_trials_leaves_their_workers_connection_slots(tmp_path: Path) -> None:
    """Found by review: on a server short of connection slots, workers with no trial left held idle connections
    while they waited for the last one, whose worker got no slot for its heartbeats or its result; a waiting worker
    then failed that live trial as lost. A worker now gives back its idle connections at each turn of that wait, so
    between its looks at the study it holds none: seen here as a moment when no other session is open."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    from sweep.storage import release_idle_connections
    from tests.conftest import CLI_ENV
    from tests.pg import PostgresServer, postgres_available

    if not postgres_available():
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    with PostgresServer() as server:
        path = write_study(tmp_path, {**TINY_STUDY, "n_trials": 1, "storage": server.url, "heartbeat_interval": 1,
                                      "heartbeat_grace_period": 600})
        spec, _ = load_spec(path)
        study = open_study(spec, server.url)
        elsewhere = study.ask()  # the budget's one trial, running on another worker
        waiter = subprocess.Popen([sys.executable, "-m", "sweep.cli", "run", str(path)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**os.environ, **CLI_ENV})
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.extend(iter(waiter.stderr.readline, "")), daemon=True)
        reader.start()
        engine = create_engine(server.url, poolclass=NullPool)
        try:
            deadline = time.monotonic() + 240
            while not any("0/1 trials done" in line for line in said):  # it opened the study: it waits now
                assert waiter.poll() is None and time.monotonic() < deadline, "".join(said)[-2000:]
                time.sleep(0.2)
            release_idle_connections()  # this process's own (the study's storage): the waiter's are the test
            seen: list[int] = []
            deadline = time.monotonic() + 120
            while not seen or seen[-1]:  # its sessions, many times a turn of its wait (1 s)
                assert waiter.poll() is None and time.monotonic() < deadline, \
                    f"the waiting worker held a connection at each of {len(seen)} looks: {seen[-20:]}"
                with engine.connect() as probe:
                    seen.append(int(probe.execute(text(
                        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND datname = "
                        "current_database() AND pid <> pg_backend_pid()")).scalar() or 0))
                time.sleep(0.05)
            study.tell(elsewhere, 0.5)
            assert waiter.wait(timeout=120) == 0, "".join(said)[-2000:]
        finally:
            waiter.kill()
            engine.dispose()
