"""Opening the study's storage so that many workers can share it, and the one lock that makes the budget exact.

SQLite (one machine): the file is switched to write-ahead logging, so readers (optuna-dashboard, `sweep status`)
never block the workers, with `synchronous = NORMAL` (commits are not fsynced one by one; a killed process loses
nothing it committed, a power cut at most the last commits), and every transaction starts with `BEGIN IMMEDIATE`
under a 60 s busy timeout. Without that, two processes that both read and then write deadlock on the lock upgrade
and SQLite fails one of them at once with "database is locked", whatever the timeout: the error Optuna's FAQ warns
about.

PostgreSQL (many machines): Optuna's RDB storage as it is, with `pool_pre_ping` so a server restart does not fail the
next trial.

Outages: every call a worker makes to the storage (Optuna's and the checkpoint registry's) goes through one
`Boundary`, which alone decides what is transient (a lost connection, a server restarting, SQLite's disk full or
locked) and waits it out with backoff for up to `patience` seconds, printing one line when the storage goes away and
one when it is back. Everything else is final and raised as it is. A caller that must not wait (the reports of a
trial that keeps training) asks for `no_wait()` and gets `StorageAway` at once.

Budget: asking for a trial and counting the trials in flight happen under one lock (a lock file next to the SQLite
file, or a PostgreSQL advisory lock), so N workers finish exactly `n_trials` trials, never one more.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import fcntl
import hashlib
import json
import logging
import os
import random
import re
import sqlite3
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import optuna
import sqlalchemy.exc
from optuna.storages import BaseStorage
from optuna.study import StudyDirection
from optuna.study._frozen import FrozenStudy
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import create_engine, event, make_url, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, OperationalError

from sweep.outcomes import file_size_limit, process_limit
from sweep.signals import stop_requested
from sweep.unanswered import watch, watch_engine
from sweep.urls import mask_url, mask_urls, sqlite_path
from trainer.messages import message

__all__ = [
    "POSTGRESQL_CONNECT_ARGS",
    "AmbiguousStudy",
    "Boundary",
    "PatientStorage",
    "StorageAway",
    "StorageUnavailable",
    "ask_lock",
    "bad_url_option",
    "clock_offset",
    "database_gone",
    "database_identity",
    "engine_options",
    "in_rollback_mode",
    "is_transient",
    "load_existing_study",
    "make_storage",
    "mask_url",
    "never_lost",
    "optuna_url",
    "sqlite_path",
]

T = TypeVar("T")


SQLITE_LOCK_WAIT_S = 60.0  # how long one SQLite statement waits for another connection's lock before it fails


def lock_wait(patience_s: float) -> float:
    """How long a worker's SQLite statement waits for a lock: `SQLITE_LOCK_WAIT_S`, or the study's
    `storage_patience` when that is shorter. Each wait is one attempt of the `Boundary`, which retries a locked
    database until the patience is spent: with a 60 s wait, a patience of 8 s was spent only after two waits, 120 s
    (review)."""
    return min(SQLITE_LOCK_WAIT_S, patience_s)


def _serialise_sqlite(engine: Engine, lock_wait_s: float = SQLITE_LOCK_WAIT_S) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None  # let SQLAlchemy's BEGIN below be the only one
        dbapi_connection.execute(f"PRAGMA busy_timeout = {int(lock_wait_s * 1000)}")
        if dbapi_connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
            # A commit is then an append to the log, not an fsync: a killed worker loses nothing it committed, and a
            # power cut at most the last commits, never the file's integrity (SQLite's own advice for WAL).
            dbapi_connection.execute("PRAGMA synchronous = NORMAL")

    @event.listens_for(engine, "begin")
    def _begin(connection: Any) -> None:
        # Take the write lock at the start: a transaction that reads, then writes, cannot deadlock on an upgrade.
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def _running(session: Any, trial_ids: Sequence[int]) -> tuple[set[int], tuple[int, TrialState | None] | None]:
    """Which of `trial_ids` are running, by one read in `session`, and the first that is not (with its state; None
    where there is no such trial), or None."""
    from optuna.storages._rdb import models

    states = dict(session.query(models.TrialModel.trial_id, models.TrialModel.state)
                  .filter(models.TrialModel.trial_id.in_(trial_ids)).all())
    live = {i for i in trial_ids if i in states and not states[i].is_finished()}
    return live, next(((i, states.get(i)) for i in trial_ids if i not in live), None)


def _refuse(backend: optuna.storages.RDBStorage, trial_id: int, state: TrialState | None) -> None:
    """Optuna's error for a write to a trial that is not running (`_running`'s refusal), raised outside the
    transaction: its message reads the trial, in a session of its own."""
    if state is None:
        raise KeyError(f"No trial with trial id {trial_id} exists.")
    backend.check_trial_is_updatable(trial_id, state)


def in_rollback_mode(path: Path) -> bool:
    """Whether the SQLite file at `path` is a database that is not in write-ahead logging (its header's file format
    versions, bytes 18 and 19, are 2 in WAL), read without opening it as a database. False for anything else."""
    try:
        with path.open("rb") as handle:
            header = handle.read(20)
    except OSError:
        return False
    return len(header) == 20 and header.startswith(b"SQLite format 3\x00") and header[18:20] != b"\x02\x02"


def _use_wal(url: str, patience_s: float = 60.0) -> None:
    """Switch the SQLite file to write-ahead logging, which is persistent in the file: every later connection, the
    dashboard's too, uses it. Switching needs the file to itself, and when several processes open a new database at
    once, SQLite can refuse one of them at once ("database is locked") instead of waiting out the busy timeout: two
    connections each holding a read lock and wanting the write lock would otherwise wait for each other. So the
    refused one tries again, for up to `patience_s` seconds, the same patience as the busy timeout."""
    engine = create_engine(url, connect_args={"timeout": patience_s})
    deadline = time.monotonic() + patience_s
    try:
        while True:
            try:
                with engine.connect() as connection:
                    connection.execute(text("PRAGMA journal_mode=WAL"))
                return
            except OperationalError as exc:
                if "locked" not in str(exc).lower() or time.monotonic() > deadline:
                    raise
                time.sleep(random.uniform(0.05, 0.2))  # apart, so that the contenders do not meet again
    finally:
        engine.dispose()


# libpq's settings for a server that stops answering (a wedged host, a network that drops every packet): a
# connection attempt gives up after `connect_timeout` seconds, and an open connection whose peer is gone is found dead
# by TCP keepalives (when idle) or by data left unacknowledged for `tcp_user_timeout` ms (mid-query), instead of
# waiting forever; the worker then waits out `storage_patience` as for any outage. A setting the URL gives wins.
POSTGRESQL_CONNECT_ARGS = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10,
                           "keepalives_count": 3, "tcp_user_timeout": 60_000}


# Every engine sweep opens in this process (Optuna's, the checkpoint registry's, the lock's), so that a worker short of
# server connection slots can give back the ones it holds idle (`release_idle_connections`).
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()

# A worker holds at most this many connections to a server: Optuna's storage (the worker, and its heartbeat thread),
# the checkpoint registry and the study's lock.
CONNECTIONS_PER_WORKER = 4


def open_engine(url: str, *, lock_wait_s: float = SQLITE_LOCK_WAIT_S, **kwargs: Any) -> Engine:
    """`create_engine(url)` with sweep's options (`engine_options`), known to `release_idle_connections`."""
    engine = create_engine(url, **kwargs, **engine_options(url, lock_wait_s=lock_wait_s))
    _ENGINES.add(engine)
    watch_engine(engine, unanswered_after(url))
    return engine


def unanswered_after(url: str) -> float:
    """Seconds a storage call to `url` waits for an answer before its connections are cut (`sweep.unanswered`): the
    URL's `tcp_user_timeout` (ms) on PostgreSQL over libpq, or sweep's; 0 (never) elsewhere."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql" or not parsed.get_driver_name().startswith("psycopg"):
        return 0.0
    given = {key.lower(): value for key, value in parsed.query.items()}.get("tcp_user_timeout")
    try:
        return float(given if isinstance(given, str) else POSTGRESQL_CONNECT_ARGS["tcp_user_timeout"]) / 1000
    except ValueError:  # libpq refuses it when the first connection is made, in its own words
        return 0.0


def release_idle_connections() -> None:
    """Close the connections this process's engines hold idle in their pools. One in use stays open; given back, it
    waits in the same pool, for the next call to close it (`Engine.dispose` would leave it to the garbage collector,
    in a pool no longer the engine's). A launcher waiting on its workers, and a worker waiting for a connection slot
    of a full server, hold no idle one: otherwise workers that each hold some of the slots wait for each other
    forever."""
    for engine in list(_ENGINES):
        if not in_memory(engine):
            engine.pool.dispose()


def in_memory(engine: Engine) -> bool:
    """Whether `engine`'s database lives in its one connection (SQLite's `:memory:`): closing it deletes the study."""
    return engine.url.get_backend_name() == "sqlite" and (
        engine.url.database in (None, "", ":memory:") or engine.url.query.get("mode") == "memory")


# The server's words for a connection refused because all its slots are taken (PostgreSQL's `max_connections`,
# MySQL's `max_connections`): transient, but worth naming, since waiting alone may not end it.
_NO_SLOT = ("too many clients already", "remaining connection slots are reserved", "too many connections")


def _driver_says(exc: BaseException, phrases: Iterable[str]) -> bool:
    """Whether the database or its driver said one of `phrases` (lower case) in `exc` or an error it came from."""
    return any(any(words in _driver_message(error).lower() for words in phrases) for error in error_chain(exc))


def no_connection_slot(exc: BaseException) -> bool:
    return _driver_says(exc, _NO_SLOT)


def read_only(exc: BaseException) -> bool:
    """Whether the database refused a write as read-only (a standby, as a failover leaves it until its promotion)."""
    return _driver_says(exc, ("read-only transaction",))


# The database's words for a write refused because its disk is full (SQLite's, the OS's, PostgreSQL's "could not
# extend file"): transient, since freeing space ends it, but waiting alone does not, so the line says what to do.
_DISK_FULL = ("database or disk is full", "no space left on device", "could not extend file", "disk full")


def _outage_hint(exc: BaseException) -> str:
    """What the outage line adds for an outage that waiting alone may not end: no free connection slot, a full
    disk."""
    if no_connection_slot(exc):
        # PostgreSQL's own limits of a role or a database (ALTER ROLE/DATABASE ... CONNECTION LIMIT) say so.
        limit = next((f"the {owner}'s CONNECTION LIMIT (ALTER {owner.upper()} ... CONNECTION LIMIT)"
                      for owner in ("role", "database") if _driver_says(exc, (f"too many connections for {owner}",))),
                     "the server's max_connections")
        return (f" (no free connection slot: each sweep worker holds up to {CONNECTIONS_PER_WORKER} connections, so "
                f"N workers need up to {CONNECTIONS_PER_WORKER}N of {limit}; raise it or run fewer workers)")
    if _driver_says(exc, _DISK_FULL):
        return " (its disk is full: free space there, and the worker goes on by itself once the write succeeds)"
    if _driver_says(exc, ("disk i/o error",)):  # SQLite's word when its -shm file cannot grow on a full disk too
        return (" (SQLite could not read or write the file or its -wal and -shm files beside it: is that disk full or "
                f"out of inodes{_file_size_limit()}? The worker goes on by itself once it can)")
    for setting in ("statement", "lock"):
        if _driver_says(exc, (f"canceling statement due to {setting} timeout",)):
            return (f" (the server cancels statements that {'run' if setting == 'statement' else 'wait for a lock'} "
                    f"longer than its {setting}_timeout: a lock held elsewhere ends, but a timeout set for the role or "
                    "the database below what one of sweep's statements takes never does; raise it: ALTER ROLE ... "
                    f"SET {setting}_timeout = ...)")
    return ""


def _file_size_limit() -> str:
    """", or has it reached this process's limit (...)" where it has a file-size limit (SQLite's writes past it fail
    as I/O errors, which no waiting ends: the limit stays for the process's life), else ""."""
    limit = file_size_limit()
    return "" if limit is None else f", or has it reached this process's limit ({limit}, for as long as it runs)"


def engine_options(url: str, *, lock_wait_s: float = SQLITE_LOCK_WAIT_S) -> dict[str, Any]:
    """`create_engine`'s options for sweep's connections to `url`: SQLite waits up to `lock_wait_s` for a lock
    (`lock_wait`); a server's connections are checked before use (one that died with a restart is replaced) and, on
    PostgreSQL, bounded in time (`POSTGRESQL_CONNECT_ARGS`)."""
    if sqlite_path(url) is not None or url.startswith("sqlite"):
        return {"connect_args": {"timeout": lock_wait_s}}
    options: dict[str, Any] = {"pool_pre_ping": True}
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name().startswith("psycopg"):  # libpq's
        given = {key.lower() for key in parsed.query}
        if os.environ.get("PGCONNECT_TIMEOUT"):  # libpq's own variable for it: the user's choice too
            given.add("connect_timeout")
        options["connect_args"] = {k: v for k, v in POSTGRESQL_CONNECT_ARGS.items() if k not in given}
    return options


def optuna_url(url: str) -> str:
    """`url` as Optuna's RDBStorage must be given it to open `url` itself: it fills a `{SCHEMA_VERSION}` template by
    `str.format`, so a brace in a password or a path (`x{1}/study.db`) would raise, name a part of the password in
    the error, or open another file."""
    return url.replace("{", "{{").replace("}", "}}")


class _OutageNoise(logging.Filter):
    """A library's log line that a dropped connection causes, which `PatientStorage` already reports in one line and
    waits out: Optuna's RDB storage when a read by trial ids fails and it tries a plainer query ("Caught an error
    from sqlalchemy: ... Falling back to a slower alternative", a multi-line SQL dump); psycopg when the cleanup of a
    pipeline, a copy or a rollback fails on the lost connection ("error ignored terminating <psycopg.Pipeline [BAD]
    at 0x...>: the connection is lost", found with pg_terminate_backend during a run). `lost`: only where the error
    it logs is one of a connection (psycopg's `OperationalError`): any other is left to reach the user."""

    def __init__(self, *prefixes: str, lost: bool = False) -> None:
        super().__init__()
        self.prefixes, self.lost = prefixes, lost

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefixes):
            return True
        if not self.lost:
            return False
        psycopg = sys.modules.get("psycopg")
        error = record.args[-1] if isinstance(record.args, tuple) and record.args else None
        return psycopg is None or not isinstance(error, psycopg.OperationalError)


# A logger's filters see only the records logged on it by name, not its children's.
_OUTAGE_NOISE = {"optuna.storages._rdb.storage": _OutageNoise("Caught an error from sqlalchemy"),
                 "psycopg": _OutageNoise("error ignored ", lost=True),
                 "psycopg.transaction": _OutageNoise("error ignored ", lost=True)}


def _quiet_outage_noise() -> None:
    for name, noise in _OUTAGE_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OutageNoise) for f in logger.filters):
            logger.addFilter(noise)


def make_storage(url: str, *, heartbeat_interval: int | None = None, grace_period: int | None = None,
                 stale_trial_callback: Callable[[optuna.Study, optuna.trial.FrozenTrial], None] | None = None,
                 wal: bool = True, lock_wait_s: float = SQLITE_LOCK_WAIT_S) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage, made safe for several worker processes (see the module docstring). With a heartbeat,
    a RUNNING trial whose worker has not beaten for `grace_period` seconds is failed by `fail_stale_trials` and handed
    to `stale_trial_callback`. `wal` False: a SQLite file is read in whatever journal mode it has (a command that
    reads a study must not change the file: one that sweep made is in write-ahead logging already)."""
    _quiet_outage_noise()
    path = sqlite_path(url)
    engine_kwargs = engine_options(url, lock_wait_s=lock_wait_s)
    if wal and path is not None and path.parent.exists():
        _use_wal(url, lock_wait_s)
    for attempt in range(5):
        try:
            with warnings.catch_warnings():  # Optuna marks the heartbeat experimental; it is this storage's design
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = optuna.storages.RDBStorage(optuna_url(url), engine_kwargs=engine_kwargs,
                                                     heartbeat_interval=heartbeat_interval, grace_period=grace_period,
                                                     heartbeat_stale_trial_callback=stale_trial_callback)
            break
        except DBAPIError as exc:
            # Two processes opening a new database at once (workers on several machines, a dashboard) both create
            # Optuna's tables; the loser sees "already exists". The tables are there now: open it again.
            text_ = str(exc).lower()
            if attempt == 4 or not any(s in text_ for s in ("already exists", "duplicate key", "unique constraint")):
                raise
            time.sleep(0.2 * (attempt + 1))
    if path is not None:
        _serialise_sqlite(storage.engine, lock_wait_s)
        storage.engine.dispose()  # reconnect with the listeners above
    _ENGINES.add(storage.engine)
    watch_engine(storage.engine, unanswered_after(url))
    return storage


_OFFSETS: dict[str, float] = {}


def clock_offset(storage: BaseStorage) -> float:
    """Seconds the storage's clock runs ahead of this machine's: its server's, on PostgreSQL, which workers on many
    machines share. A wall time that a process on another machine compares (a `sweep stop`, a Slurm job's
    submission) is stored by the storage's clock and read back on this one's, whatever each machine's clock says.
    0 for SQLite (one machine's file) and wherever the server's clock cannot be read; measured once per process."""
    backend: Any = storage.backend if isinstance(storage, PatientStorage) else storage
    backend = getattr(backend, "_backend", backend)  # Optuna's cache in front of an RDB storage
    engine = getattr(backend, "engine", None)
    if not isinstance(engine, Engine) or engine.dialect.name != "postgresql":
        return 0.0
    key = engine.url.render_as_string(hide_password=True)
    if key not in _OFFSETS:
        def read() -> float:
            with engine.connect() as connection:
                before = time.time()
                server = connection.execute(text("SELECT EXTRACT(EPOCH FROM clock_timestamp())")).scalar()
                return float(server) - (before + time.time()) / 2  # type: ignore[arg-type]
        try:
            _OFFSETS[key] = storage.boundary.call(read) if isinstance(storage, PatientStorage) else read()
        except (sqlalchemy.exc.SQLAlchemyError, StorageUnavailable, StorageAway):  # read again next time
            return 0.0
    return _OFFSETS[key]


def never_lost() -> bool:
    return False


LOCK_WAIT_S = 1.0  # a PostgreSQL waiter's turn in the lock's queue before it looks at who holds the lock


@contextlib.contextmanager
def ask_lock(url: str, study_name: str, boundary: Boundary | None = None,
             stale_after: float | None = None) -> Iterator[Callable[[], bool]]:
    """Held while a worker counts the trials in flight and asks for a new one. Taking the PostgreSQL lock goes through
    the `boundary`; releasing it cannot fail for good: a connection that died released it with its session.

    Yields `lost()`: whether the lock may have been lost since it was taken. A PostgreSQL advisory lock belongs to
    its session, and a server restart ends every session, so another worker may have taken the lock (and asked for a
    trial) while this one was still counting and asking: `lost()` tells by whether the lock's own connection is still
    the session that took it (a connection never reconnects silently). A lock file is lost once another worker has
    replaced it (below).

    `stale_after` (the study's heartbeat grace period): a lock held that long by a worker that does not answer (a
    paused process or machine, one cut off from the network; its session stays open) would stall every other worker,
    and with them the failing of its own lost trials, which happens under this lock. A waiter takes it over, with one
    warning: on PostgreSQL it ends the holder's session once that session has been idle that long (the server's
    clock); a lock file it replaces by a new one after its stamp has stayed the same that long. Safe either way: the
    holder, when it comes back, finds its lock lost and counts what it asked against the budget again
    (`Worker._fence`). A holder that is alive but slow (a loaded machine opening a study, asking a cohort's trials)
    shows it while it holds the lock (`_showing_life`): its lock session runs a statement, its lock file is stamped
    again, a few times per period; for at most `LIFE_SHOWN_PERIODS` periods, after which a holder that still has it
    is taken for hung."""
    path = sqlite_path(url)
    if path is not None:
        lock_file = path.with_name(path.name + ".lock")
        handle = _take_file_lock(lock_file, stale_after)
        try:
            with _showing_life(lambda: _stamp(handle), stale_after):
                yield lambda: _file_lock_lost(lock_file, handle)
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()
        return
    if url.startswith("postgresql"):
        key = int.from_bytes(hashlib.sha256(f"sweep:{study_name}".encode()).digest()[:8], "big", signed=True)
        engine = _lock_engine(url)

        def acquire() -> Any:
            connection = engine.connect()
            try:
                _take_advisory_lock(connection, key, stale_after)
            except BaseException:
                connection.close()
                raise
            return connection

        connection = boundary.call(acquire) if boundary is not None else acquire()
        using = threading.Lock()  # the connection, between this thread and the one that shows life on it

        def lost() -> bool:
            try:
                with using:
                    connection.execute(text("SELECT 1"))
                    connection.commit()
            except Exception:  # noqa: BLE001 - any failure: the session that held the lock may be gone
                return True
            return False

        try:
            with _showing_life(lost, stale_after):
                yield lost
        finally:
            with contextlib.suppress(Exception):
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
                connection.commit()
            with contextlib.suppress(Exception):
                connection.close()
        return
    yield never_lost  # other backends: best effort


LIFE_SHOWN_PERIODS = 3  # how many stale periods a live holder of the study's lock keeps it from a takeover


@contextlib.contextmanager
def _showing_life(show: Callable[[], Any], stale_after: float | None) -> Iterator[None]:
    """`show()` called on a thread of its own, three times per `stale_after` seconds, while the block runs: the
    holder of the study's lock tells waiters it is alive (a paused process's threads are paused with it; a machine
    cut off reaches no server). Only for `LIFE_SHOWN_PERIODS` periods: a lock held longer than that is held by a hung
    worker, whose waiters take it over as from a paused one."""
    if stale_after is None:
        yield
        return
    done = threading.Event()

    def beat() -> None:
        until = time.monotonic() + LIFE_SHOWN_PERIODS * stale_after
        while not done.wait(stale_after / 3) and time.monotonic() < until:
            with contextlib.suppress(Exception):
                show()

    thread = threading.Thread(target=beat, name="sweep-lock-holder-alive", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _stamp(handle: Any) -> None:
    """Write the stamp that tells waiters which holder has the lock file, and since when it last showed life."""
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()} {time.time_ns()}\n")
    handle.flush()


def _take_file_lock(lock_file: Path, stale_after: float | None) -> Any:
    """The lock file, opened and locked (`flock`); replaced by a new one when one holder has held it for
    `stale_after` seconds. Each holder stamps the file as it takes it (its pid and the time), so a waiter measures
    how long the *same* holder has held it: workers passing the lock among themselves, however long one waiter
    waits for its turn, are never taken for a paused one, and waiters never take over from one another."""
    pause, warned, cant_replace = 0.001, False, False
    seen, since = None, time.monotonic()  # the holder's stamp last seen, and since when
    while True:
        try:
            handle = open(lock_file, "a+")  # returned open: `ask_lock` closes it
        except OSError as exc:  # the database's folder made read-only, or taken away: the storage's refusal
            limit = process_limit(exc)  # a process limit (`ulimit -n`), said as one (review)
            why = f"{exc.strerror or exc}" + ("" if limit is None else f": {limit[1]}")
            setattr(exc, _REFUSED, (f"the storage refused: cannot open the study's lock file {lock_file} ({why})",
                                    "storage refused: lock file"))
            raise
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            stamp = _stamp_of(lock_file)
            if stamp != seen:  # another holder (or another file) since the last look: its time starts now
                seen, since = stamp, time.monotonic()
            held = time.monotonic() - since
            if stale_after is not None and held >= stale_after and not cant_replace:
                holder = _flock_holder(lock_file)
                try:
                    replaced = _replace_if_still(lock_file, seen)
                except OSError as exc:  # a folder this worker cannot write in: wait, as without a takeover
                    cant_replace = True
                    warnings.warn(f"the study's lock {lock_file} has been held for {held:.0f} s by {holder}, which "
                                  f"does not release it, and cannot be replaced ({exc.strerror or exc}); waiting",
                                  stacklevel=4)
                    continue
                if replaced and not warned:
                    warnings.warn(f"the study's lock {lock_file} was held for {held:.0f} s by {holder} that does not "
                                  "release it (paused or hung); this worker took it over so that the study goes on "
                                  "(what that process asks when it comes back is counted against the budget again)",
                                  stacklevel=4)
                    warned = True
                seen, since = None, time.monotonic()
                continue
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            continue
        except BaseException:
            handle.close()
            raise
        if not _file_lock_lost(lock_file, handle):
            with contextlib.suppress(OSError):  # the stamp that tells waiters a new holder has it
                _stamp(handle)
            return handle
        handle.close()  # replaced between our open and our lock: lock the file there now


def _replace_if_still(lock_file: Path, seen: tuple[int, int, str] | None) -> bool:
    """Replace `lock_file` by a new, empty one if its stamp is still `seen` (the stale holder's). Waiters that decide
    together take turns on a second lock file and check again, so only the first replaces it: the others find the
    new file's stamp and start timing its holder. False when another waiter is at it, or the holder changed."""
    with open(lock_file.with_name(lock_file.name + ".takeover"), "a+") as turn:
        try:
            fcntl.flock(turn, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if _stamp_of(lock_file) != seen:
            return False
        replacement = lock_file.with_name(f"{lock_file.name}.{os.getpid()}.new")
        try:
            replacement.touch()
            os.replace(replacement, lock_file)  # a new file, a new lock: the holder's is the study's no more
        except OSError:
            with contextlib.suppress(OSError):
                replacement.unlink()
            raise
        return True


def _stamp_of(lock_file: Path) -> tuple[int, int, str] | None:
    """Which holder has the lock file: its inode and the stamp its holder wrote (None: none readable)."""
    try:
        with open(lock_file) as handle:
            status = os.fstat(handle.fileno())
            return status.st_ino, status.st_mtime_ns, handle.read(64)
    except OSError:
        return None


def _file_lock_lost(lock_file: Path, handle: Any) -> bool:
    """Whether `lock_file` is no longer the file `handle` locked (another worker replaced it: `_take_file_lock`)."""
    try:
        return os.stat(lock_file).st_ino != os.fstat(handle.fileno()).st_ino
    except OSError:
        return True


def _flock_holder(lock_file: Path) -> str:
    """Which process holds the lock on `lock_file`, as /proc/locks tells (Linux, this machine), for the warning."""
    with contextlib.suppress(OSError, ValueError):
        inode = os.stat(lock_file).st_ino
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
                return f"process {fields[4]}"
    return "another process"


def _take_advisory_lock(connection: Any, key: int, stale_after: float | None) -> None:
    """The study's advisory lock on `connection`'s session: waited for in the server's queue a second at a time
    (`lock_timeout`); between turns, a holder whose session has been idle for `stale_after` seconds has it ended.

    A waiter gives back the connections it holds idle at each turn (review): on a server short of slots, the holder
    may need one more to count and ask (its own idle ones given back when it was refused one), and waiters each
    holding idle ones stalled it, and so themselves, for the holder's whole `storage_patience`."""
    warned = False
    while True:
        connection.execute(text(f"SET lock_timeout = '{int(LOCK_WAIT_S * 1000)}ms'"))
        try:
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": key})
            connection.execute(text("SET lock_timeout = 0"))
            connection.commit()
            return
        except OperationalError as exc:
            if getattr(exc.orig, "sqlstate", None) != "55P03":  # lock_not_available: our turn ran out
                raise
            connection.rollback()
        release_idle_connections()  # this session, in use, stays
        if stale_after is None:
            continue
        holder = connection.execute(text(
            "SELECT a.pid, a.client_addr, EXTRACT(EPOCH FROM now() - a.state_change) FROM pg_locks l "
            "JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND l.classid = :high AND l.objid = :low AND l.objsubid = 1 AND a.state LIKE 'idle%' "
            "ORDER BY a.state_change"),
            {"high": (key >> 32) & 0xFFFFFFFF, "low": key & 0xFFFFFFFF}).first()
        connection.rollback()
        if holder is None or holder[2] is None or float(holder[2]) < stale_after:
            continue
        pid, address, idle = holder
        try:
            ended = connection.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar()
            connection.commit()
        except DBAPIError as exc:  # another role's session, and no right to end it: wait on, as before
            connection.rollback()
            ended, why = False, str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
        else:
            why = ""
        if not warned:
            where = f" from {address}" if address else ""
            did = ("its session was ended so that the study goes on (what that worker asks when it comes back is "
                   "counted against the budget again)") if ended else f"its session could not be ended ({why}); waiting"
            warnings.warn(f"the study's lock was held for {float(idle):.0f} s by a worker that does not answer "
                          f"(paused or cut off; PostgreSQL backend {pid}{where}): {did}", stacklevel=5)
            warned = True


_LOCK_ENGINES: dict[str, Engine] = {}  # by URL, the most recently used last
_LOCK_ENGINES_KEPT = 4  # a process that runs studies on many databases (a notebook) keeps a connection to so many


def _lock_engine(url: str) -> Engine:
    engine = _LOCK_ENGINES.pop(url, None) or open_engine(url, pool_size=1)
    _LOCK_ENGINES[url] = engine
    while len(_LOCK_ENGINES) > _LOCK_ENGINES_KEPT:
        _LOCK_ENGINES.pop(next(iter(_LOCK_ENGINES))).dispose()  # a lock it holds now stays held: only idle ones go
    return engine


# ---------------------------------------------------------------------------------------------------------------------
# The boundary: what is transient, and waiting it out.

class StorageUnavailable(RuntimeError):
    """The storage stayed unreachable for longer than the worker's patience."""


class StorageAway(RuntimeError):
    """The storage is unreachable right now, and the caller asked not to wait (`Boundary.no_wait`)."""


# Messages of errors that look like connection trouble but are final: a wrong database name, a refused login, a
# missing table. Waiting would not change them.
_FINAL_MESSAGES = ("does not exist", "authentication failed", "password", "no such table", "no such column",
                   "permission denied for", "syntax error", "could not translate host name",
                   "name or service not known", "nodename nor servname")
_SQLITE_TRANSIENT = ("locked", "busy", "disk", "full", "unable to open", "i/o")
# The driver's words for an option of the URL that no server will ever take (`?sslmode=bogus`, `?port=abc`, an unknown
# option): final, and the user's input, not the storage's state.
_BAD_OPTION = re.compile(r"invalid [a-z_]+ value|invalid connection option|invalid integer value|invalid port number"
                         r"|invalid uri query parameter|invalid value for parameter|bad value for [a-z_]+"
                         r"|unrecognized configuration parameter|missing \"=\" after", re.IGNORECASE)


def _driver_message(error: BaseException) -> str:
    """What the database or its driver said: for SQLAlchemy's wrapper, its original error's message, without the
    statement and the parameters it adds (a trial's reason stored as a parameter may say "password" or "invalid lr
    value" and must not make a dropped connection look final)."""
    if isinstance(error, sqlalchemy.exc.StatementError) and error.orig is not None:
        error = error.orig
    return message(error) or ""  # a user's exception class with a broken __str__, in a trial's chain: says nothing


def bad_url_option(exc: BaseException) -> str | None:
    """The driver's message when `exc`, or an error it was raised from, says an option of the storage URL is invalid;
    else None."""
    for error in error_chain(exc):
        if isinstance(error, sqlalchemy.exc.ArgumentError):  # SQLAlchemy's own reading of the URL refused it
            return str(error).strip().splitlines()[0]
        if isinstance(error, sqlalchemy.exc.DBAPIError) and error.connection_invalidated:
            return None
        for line in _driver_message(error).splitlines()[:1]:
            if found := _BAD_OPTION.search(line):
                return line[found.start():].strip()
    return None


def error_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the errors it was raised from (cause, else context), each once."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


_REFUSED = "_sweep_storage_refused"  # its (reason, kind): a storage call's database error that waiting would not end
# The database's state or the role's rights, not the values written: PostgreSQL's error classes (SQLSTATE 42501,
# 42P01, 3D000, 3F000, 25006) and SQLite's words. A value that does not fit a column (a step beyond a 4-byte integer,
# a key too long) or a broken constraint is not among them: those are the trial's own, and fail it for good.
_REFUSALS = ("InsufficientPrivilege", "UndefinedTable", "InvalidCatalogName", "InvalidSchemaName",
             "ReadOnlySqlTransaction")
_SQLITE_REFUSALS = ("readonly database", "no such table")
# What a new connection is told, with no error class of its own: the database or the role dropped, or the role's
# password changed (rotated while the worker ran: its URL holds the old one, and waiting would not bring it back).
_GONE = re.compile(r'(database|role) "[^"]*" does not exist|password authentication failed|authentication failed for '
                   r'user')


def _mark_refused(exc: Exception) -> None:
    """Mark `exc` with its refusal (`storage_refusal`) when a database said its state or the role's rights refuse
    the call."""
    if (refusal := _refusal(exc)) is not None:
        with contextlib.suppress(AttributeError, TypeError):
            setattr(exc, _REFUSED, refusal)


def _refusal(exc: BaseException) -> tuple[str, str] | None:
    for error in error_chain(exc):
        if isinstance(error, sqlalchemy.exc.DBAPIError) and error.orig is not None:
            name, message = type(error.orig).__name__, _driver_message(error)
            if name in _REFUSALS or _GONE.search(message) or (isinstance(error.orig, sqlite3.Error) and any(
                    words in message.lower() for words in _SQLITE_REFUSALS)):
                line = next((x.strip() for x in message.splitlines() if x.strip()), "")
                return mask_urls(f"the storage refused: {name}: {line}"[:300]), f"storage refused: {name}"
    return None


def refusal_line(exc: BaseException) -> str | None:
    """The line saying how the database refused `exc` or an error it was raised from (the role's rights, a table or
    the database gone, a read-only file: "the storage refused: InsufficientPrivilege: ..."), raised through a
    `Boundary` or not. None for any other error."""
    refused = _refusal(exc)
    return None if refused is None else refused[0]


def storage_refusal(exc: BaseException) -> tuple[str, str] | None:
    """`(reason, kind)` when `exc`, or an error it was raised from, is a call to the study's storage refused by the
    database's state or the role's rights, which waiting does not change: a role without the right to write a
    table, a table or the database dropped, SQLite's file read-only. The storage's fault, never a config's: its trial
    is retried, not counted, and the same refusal three times in a row stops the worker with it. None for anything
    else: a value the database refuses (the trial's own), and a user's own code failing on its own database (only
    errors raised through `Boundary.call` are marked)."""
    return next((getattr(error, _REFUSED) for error in error_chain(exc) if hasattr(error, _REFUSED)), None)


def damaged_database(exc: BaseException) -> BaseException | None:
    """The error in `exc`'s chain that is SQLite's word for a file damaged past what opening it read ("database
    disk image is malformed", "file is not a database", "file is encrypted"), or None: bad input, never a trial's
    config's fault, nor an outage that waiting ends."""
    return next((error for error in error_chain(exc) if isinstance(error, sqlite3.DatabaseError) and any(
        words in str(error).lower() for words in ("malformed", "not a database", "file is encrypted"))), None)


def is_transient(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is a storage fault that goes away by itself: a dropped or
    refused connection, a server restarting (Optuna wraps those in `StorageInternalError`, "invalid data in the
    commit"), SQLite locked or its disk full. Integrity errors, missing tables, a wrong database name or password
    are final."""
    for error in error_chain(exc):
        if isinstance(error, sqlalchemy.exc.DBAPIError) and error.connection_invalidated:
            return True  # the connection went: whatever the statement carried
        message = _driver_message(error).lower()
        if any(final in message for final in _FINAL_MESSAGES) or _BAD_OPTION.search(message):
            return False
        if "read-only transaction" in message:  # a standby, as a failover leaves it until it is promoted (`read_only`)
            return True
        if isinstance(error, sqlite3.OperationalError):
            return any(word in message for word in _SQLITE_TRANSIENT)
        if isinstance(error, sqlalchemy.exc.DBAPIError):
            if isinstance(error.orig, sqlite3.Error):  # SQLite's own error tells "locked" from "no such table"
                return isinstance(error.orig, sqlite3.OperationalError) and any(
                    word in str(error.orig).lower() for word in _SQLITE_TRANSIENT)
        if isinstance(error, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.DisconnectionError,
                              sqlalchemy.exc.TimeoutError,
                              sqlalchemy.exc.InterfaceError, ConnectionError, TimeoutError)):
            return True
        if type(error).__module__.startswith("psycopg") and type(error).__name__ in (
                "OperationalError", "InterfaceError", "AdminShutdown", "CannotConnectNow", "ConnectionTimeout"):
            return True
    return False


class Boundary:
    """Every storage call of a worker goes through `call`: transient errors are retried with backoff (0.2 s,
    doubling, at most 10 s apart) for up to `patience_s` seconds from the first failure, then
    `StorageUnavailable` is raised. `notify` hears one line when the storage goes away and one when it is back."""

    FIRST_CONTACT_S = 10.0  # a storage never reached yet is more likely a wrong URL than an outage
    RETRY_AWAY_S = 10.0  # while it is away, calls that must not wait try it at most this often

    def __init__(self, patience_s: float = 600.0, *, label: str = "the storage",
                 notify: Callable[[str], None] | None = None, reached: bool = False) -> None:
        self.patience_s, self.label = patience_s, label
        self.reached = reached  # whether any call has succeeded yet (or a launcher's had: the URL is right)
        self.notify = notify if notify is not None else _to_stderr
        self.down_since: float | None = None
        self.recovered_at: float | None = None  # when the storage last came back (time.monotonic)
        self.failed_at = 0.0  # when a call last met the storage away (time.monotonic)
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def available(self) -> bool:
        return self.down_since is None

    @contextlib.contextmanager
    def no_wait(self) -> Iterator[None]:
        """Calls in this block fail at once with `StorageAway` while the storage is unreachable."""
        before = getattr(self._local, "no_wait", False)
        self._local.no_wait = True
        try:
            yield
        finally:
            self._local.no_wait = before

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        delay = 0.2
        while True:
            if self._not_yet():
                raise StorageAway(f"{self.label} is unreachable")
            if self._stopping_while_away():
                raise StorageUnavailable(f"{self.label} is unreachable, and the worker was told to stop (Ctrl-C or "
                                         "SIGTERM): not waiting for it")
            try:
                with watch() as call:
                    result = fn(*args, **kwargs)
            except Exception as exc:
                if not is_transient(exc):
                    _mark_refused(exc)
                    raise
                if no_connection_slot(exc) or read_only(exc):
                    # No idle slot held while waiting for one: another worker may need it. And no session opened
                    # while the database was read-only (a standby until its promotion, `default_transaction_read_only`)
                    # is used again: it stays read-only after the database is writable again.
                    release_idle_connections()
                self.failed_at = time.monotonic()
                since = self._went_away(exc, call.cut_after)
                if getattr(self._local, "no_wait", False):
                    raise StorageAway(f"{self.label} is unreachable") from exc
                waited = time.monotonic() - since
                patience = self._patience()
                if stop_requested() and threading.current_thread() is threading.main_thread():
                    raise StorageUnavailable(f"{self.label} is unreachable, and the worker was told to stop (Ctrl-C "
                                             f"or SIGTERM): not waiting for it: {error_line(exc)}") from exc
                if waited >= patience:
                    what = f"storage_patience is {self.patience_s:g} s" if self.reached else "never reached yet"
                    raise StorageUnavailable(f"{self.label} has been unreachable for {waited:.0f} s ({what}): "
                                             f"{error_line(exc)}{_outage_hint(exc)}") from exc
                time.sleep(min(delay, max(0.0, patience - waited)))
                delay = min(delay * 2, 10.0)
                continue
            self.reached = True
            self._came_back()
            return result

    def _not_yet(self) -> bool:
        """Whether a call that must not wait is given up without trying: the storage is away and was last tried
        less than `RETRY_AWAY_S` ago. Each try may cost `connect_timeout` (a server that does not answer), which a
        trial's every report would otherwise spend out of its training."""
        return (self.down_since is not None and getattr(self._local, "no_wait", False)
                and time.monotonic() - self.failed_at < self.RETRY_AWAY_S)

    def _stopping_while_away(self) -> bool:
        """Whether a call of a worker told to stop is given up without trying: the storage is away and was last tried
        less than `RETRY_AWAY_S` ago. Its way out (registering and releasing its trials' checkpoints, marking them)
        is several calls, and against a server that does not answer each try costs `connect_timeout` (review: a
        SIGTERM during such an outage took 40 s to end the worker, past a launcher's or a scheduler's grace)."""
        return (self.down_since is not None and stop_requested() is not None
                and threading.current_thread() is threading.main_thread()
                and time.monotonic() - self.failed_at < self.RETRY_AWAY_S)

    def _patience(self) -> float:
        """How long an outage is waited out: a storage never reached yet gets the short first contact."""
        return self.patience_s if self.reached else min(self.patience_s, self.FIRST_CONTACT_S)

    def _went_away(self, exc: BaseException, unanswered_s: float | None = None) -> float:
        with self._lock:
            if self.down_since is None:
                self.down_since = time.monotonic()
                patience = self._patience()
                why = (f"(no answer to a call for {unanswered_s:.0f} s: a server process stopped or stuck while its "
                       "machine answers; its connections were cut, tcp_user_timeout)") if unanswered_s is not None \
                    else f"({error_line(exc)}){_outage_hint(exc)}"
                self.notify(f"{self.label} is unreachable {why}; waiting up to "
                            f"{patience:g} s for it to come back"
                            f"{'' if self.reached or patience == self.patience_s else ' (never reached yet)'}")
            return self.down_since

    def _came_back(self) -> None:
        if self.down_since is None:  # the common case: no lock taken
            return
        with self._lock:
            if self.down_since is not None:
                self.notify(f"{self.label} is back after {time.monotonic() - self.down_since:.0f} s")
                self.down_since, self.recovered_at = None, time.monotonic()

    def guard(self, target: T) -> T:
        """`target` with each of its methods called through this boundary."""
        return _Guarded(target, self)  # type: ignore[return-value]


class _Guarded:
    def __init__(self, target: Any, boundary: Boundary) -> None:
        self._target, self._boundary = target, boundary

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value):
            return value
        return lambda *args, **kwargs: self._boundary.call(value, *args, **kwargs)


def _beat_rows(session: Any, trial_ids: Sequence[int]) -> None:
    """A heartbeat for each of `trial_ids` in `session`'s transaction, all with its one time (as Optuna's
    `record_heartbeat` writes one)."""
    from optuna.storages._rdb import models

    now = session.execute(sqlalchemy.func.now()).scalar_one()
    for trial_id in trial_ids:
        beat = models.TrialHeartbeatModel.where_trial_id(trial_id, session, True)
        if beat is None:
            session.add(models.TrialHeartbeatModel(trial_id=trial_id, heartbeat=now))
        else:
            beat.heartbeat = now


def error_line(exc: BaseException) -> str:
    """The innermost cause's first line: a driver's message says more than Optuna's wrapper ("invalid data")."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    if exc.__context__ is not None and "current transaction is aborted" in _driver_message(exc):
        return error_line(exc.__context__)  # an earlier statement's error ended the transaction (Optuna read again)
    lines = _driver_message(exc).strip().splitlines()
    return mask_urls(f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300])


def _to_stderr(line: str) -> None:
    print(f"sweep: {line}", file=sys.stderr, flush=True)


_ENDED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)  # the states a trial never leaves
UPSERT_ROWS = 1000  # rows in one multi-row upsert (`PatientStorage._write_together`)


def _finished_only(states: Container[TrialState] | None) -> bool:
    """Whether a read of trials in `states` leaves out every trial that is not finished."""
    return states is not None and not any(s in states for s in TrialState if not s.is_finished())


class PatientStorage(BaseStorage):
    """Optuna's storage for a worker: every call goes through the `Boundary`. Optuna's study, trials, samplers and
    pruners call the storage for everything they do, so this one class puts all of them behind the boundary.

    The heartbeat settings are kept here rather than given to Optuna: sweep beats and checks for stale trials
    itself (`sweep.worker`), and Optuna would only warn that heartbeats belong to `Study.optimize`."""

    def __init__(self, backend: optuna.storages.RDBStorage, boundary: Boundary) -> None:
        self.backend, self.boundary = backend, boundary
        self.cached = optuna.storages._CachedStorage(backend)  # noqa: SLF001 - what Optuna wraps an RDB in itself
        self.heartbeat_interval = backend.heartbeat_interval
        self.grace_period = backend.grace_period
        self._shared = threading.local()  # `shared_finished_reads`: this thread's snapshot, by study id
        self._finished: dict[int, dict[int, FrozenTrial]] = {}  # `_read_finished`: study id -> trial id -> trial
        self._finished_lock = threading.Lock()

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.flush_deferred()  # what this thread deferred goes first: every call after it sees it
        return self.boundary.call(getattr(self.cached, name), *args, **kwargs)

    @contextlib.contextmanager
    def deferred_writes(self) -> Iterator[None]:
        """In this block, this thread's intermediate values and user attrs (`trial.report`, `set_user_attr`) are kept
        and written together, in one transaction, when the block ends (the outermost one, for nested blocks), or
        before this thread's next other call to the storage, whichever comes first: every read or write after them
        finds them stored, and a trial's values and attrs are stored before its end. A cohort opens one around each
        step: its members' reports at an evaluation are one commit, where each was one, and each member's pruner
        decides as it would alone (it judges the trial's own values, which Optuna keeps on the trial, against the
        study's finished trials, which these writes cannot change). A value that is not JSON is refused at the call,
        as Optuna refuses it. A trial that has ended meanwhile (another worker failed it as lost) drops its writes
        while the others are stored, and its own end (its outcome attrs, its state) is refused as it would be
        without a block. Inside `Boundary.no_wait`, a storage that is away keeps them waiting for the next call."""
        depth = getattr(self._shared, "deferring", 0)
        self._shared.deferring = depth + 1
        try:
            yield
        except BaseException:
            self._shared.deferring = depth
            if depth == 0:
                with contextlib.suppress(Exception):  # the error on its way out says more than this one
                    self.flush_deferred()
            raise
        self._shared.deferring = depth
        if depth == 0:
            with contextlib.suppress(StorageAway):  # kept: the next call writes them
                self.flush_deferred()

    def _defer(self, entries: list[tuple[str, int, Any, Any]]) -> bool:
        """Keep `entries` for `flush_deferred` when this thread is in a `deferred_writes` block."""
        if not getattr(self._shared, "deferring", 0):
            return False
        self._shared.__dict__.setdefault("deferred", []).extend(entries)
        return True

    def flush_deferred(self) -> None:
        """Write what this thread deferred (`deferred_writes`), in one transaction, through the boundary."""
        entries: list[tuple[str, int, Any, Any]] | None = getattr(self._shared, "deferred", None)
        if not entries:
            return
        self._shared.deferred = []
        try:  # a trial that ended meanwhile drops its writes; its own end is then refused, and says why
            self.boundary.call(self._write_together, entries, strict=False)
        except (StorageAway, StorageUnavailable):
            self._shared.deferred = entries + self._shared.deferred  # the storage is away: they wait, in order
            raise
        except Exception:
            trials = list(dict.fromkeys(trial_id for _, trial_id, _, _ in entries))
            if len(trials) == 1:
                raise
            # One trial's write is refused for good (a value the database cannot hold): each trial's are written
            # alone, so that the others land, and the first refusal is raised.
            failure: Exception | None = None
            for n, trial_id in enumerate(trials):
                try:
                    self.boundary.call(self._write_together, [e for e in entries if e[1] == trial_id], strict=False)
                except (StorageAway, StorageUnavailable):  # the trials not written yet wait, in order
                    left = set(trials[n:])
                    self._shared.deferred = [e for e in entries if e[1] in left] + self._shared.deferred
                    raise
                except Exception as exc:  # noqa: BLE001 - raised below, once the other trials are written
                    failure = failure or exc
            if failure is not None:
                raise failure from None

    @contextlib.contextmanager
    def writes_now(self) -> Iterator[None]:
        """In this block, this thread's writes are made at once and its reads are its own, as outside any
        `deferred_writes` or `shared_finished_reads` block (what was deferred is written first): for a trial that
        trains alone in the middle of a cohort's refill, whose reports the dashboard and its retry must see as it
        goes, and whose pruner must see the trials that finish while it trains."""
        self.flush_deferred()
        depth, snapshots = getattr(self._shared, "deferring", 0), getattr(self._shared, "snapshots", None)
        self._shared.deferring, self._shared.snapshots = 0, None
        try:
            yield
        finally:
            self._shared.deferring, self._shared.snapshots = depth, snapshots

    def take_refused(self) -> set[int]:
        """The trials whose deferred writes were dropped since the last call because they had ended (another
        worker failed them as lost): the cohort ends them too, as interrupted, and their retries train them."""
        refused: set[int] = getattr(self._shared, "refused", set())
        self._shared.refused = set()
        return refused

    @contextlib.contextmanager
    def shared_finished_reads(self) -> Iterator[None]:
        """In this block, this thread's reads of a study's *finished* trials (`get_all_trials` with `states` among
        complete, pruned and failed, as pruners read them: `study.get_trials(states=...)`) share one read of the
        storage, made at the first of them. A finished trial never changes, so the snapshot differs from a fresh
        read only by trials that finish during the block: a cohort opens one around each step, in which its own
        members report but none is told, so each member's pruner sees what it would have seen reading alone (other
        workers' trials that finish meanwhile are seen at the next step, as a lone trial sees them at its next
        report). A state written through this storage in the block drops the snapshot."""
        outer = getattr(self._shared, "snapshots", None)
        self._shared.snapshots = {} if outer is None else outer
        try:
            yield
        finally:
            self._shared.snapshots = outer

    @contextlib.contextmanager
    def shared_ask_reads(self) -> Iterator[None]:
        """In this block, this thread's reads of a study's trials in *any* states share one read of the storage,
        made at the first of them, until this storage writes a trial's state. For one ask under the study's lock
        (`Worker._ask_many`): the worker counts the budget, then Optuna looks for a queued trial and the sampler
        reads the trials two or three times more (the search space, then every trial, running ones included, for
        TPE's constant liar). Under the lock no other worker asks, so the block's first read already holds every
        trial asked before this one; another worker's trial that finishes meanwhile is seen at the next ask, as if
        this one had been asked a few milliseconds earlier. A trial this storage creates in the block joins the
        snapshot, and what it writes to it (params, attrs) is written to the snapshot's copy too, so the snapshot
        stays what a fresh read would give: a sampler may read the trial it samples (Optuna's brute-force sampler
        finds the params drawn so far there). A trial queued (`enqueue_trial`) or claimed (a state written) drops
        it.

        The block's own trials are read from the snapshot too (Optuna's `Trial` reads the trial it was just given:
        six queries), and their params and system attrs (TPE's constant liar shares its draws in one) are written
        together, in one transaction, when the block ends, where each was one: still under the lock, so another
        worker's ask finds them as before. A param is checked against the study's distributions of that name when
        it is drawn, as Optuna's write checks it, and any other call to the storage writes them first."""
        outer, outer_asked = getattr(self._shared, "everything", None), getattr(self._shared, "asked", None)
        self._shared.everything, self._shared.asked = {}, set()
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # the error on its way out says more than this one
                self.flush_deferred()
            raise
        else:
            with contextlib.suppress(StorageAway):  # kept: the next call writes them
                self.flush_deferred()
        finally:
            self._shared.everything, self._shared.asked = outer, outer_asked

    def _snapshot(self, study_id: int, states: Container[TrialState] | None) -> list[FrozenTrial] | None:
        everything: dict[int, list[FrozenTrial]] | None = getattr(self._shared, "everything", None)
        if everything is not None:
            if study_id not in everything:
                everything[study_id] = self._call("get_all_trials", study_id, deepcopy=False, states=None)
            # A new list each time, as a read gives: a sampler may pop from what it got (Optuna's brute force does).
            return [t for t in everything[study_id] if states is None or t.state in states]
        return self._finished_snapshot(study_id, states)

    def _mirror(self, trial_id: int, write: Callable[[FrozenTrial], None]) -> None:
        """Apply a write this storage made to `trial_id` to the ask block's snapshot's copy of it, if it has one."""
        everything: dict[int, list[FrozenTrial]] | None = getattr(self._shared, "everything", None)
        for trials in (everything or {}).values():
            for i in range(len(trials) - 1, -1, -1):  # the block's own new trial is the last one
                if trials[i]._trial_id == trial_id:  # noqa: SLF001 - a FrozenTrial's storage id
                    # A copy: a read with deepcopy=False may have handed out Optuna's cached object itself.
                    trials[i] = copy.deepcopy(trials[i])
                    write(trials[i])
                    return

    def _finished_snapshot(self, study_id: int, states: Container[TrialState] | None) -> list[FrozenTrial] | None:
        snapshots: dict[int, list[FrozenTrial]] | None = getattr(self._shared, "snapshots", None)
        if snapshots is None or states is None or not _finished_only(states):
            return None
        if study_id not in snapshots:  # no flush first (`get_all_trials`)
            snapshots[study_id] = self.boundary.call(self._read_finished, study_id)
        return [t for t in snapshots[study_id] if t.state in states]

    def _read_finished(self, study_id: int) -> list[FrozenTrial]:
        """The study's finished trials (complete, pruned, failed: states a trial never leaves), by number, as shared
        objects (`deepcopy=False`). Optuna's cache, to learn which trials have finished, reads every running trial of
        the study in full (params, attrs, every intermediate value) at each read, and a pruner reads the finished
        trials at each evaluation: with N workers on one database, each evaluation loaded N running trials (cProfile:
        4-5 ms of a lone trial's every evaluation on SQLite). A finished trial never changes, so this reads the ids
        of the finished trials (one narrow query) and, in full, only those it has not read before."""
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session

        with self._finished_lock:
            known = self._finished.get(study_id)
            if known is not None:
                with _create_scoped_session(self.backend.scoped_session) as session:
                    ids = {i for (i,) in session.query(models.TrialModel.trial_id)
                           .filter(models.TrialModel.study_id == study_id, models.TrialModel.state.in_(_ENDED))}
                new = ids - known.keys()
                fetched = self.backend._get_trials(  # noqa: SLF001 - Optuna's own read of some trials in full
                    study_id, states=_ENDED, included_trial_ids=new, trial_id_greater_than=max(ids)) if new else []
            else:  # the first read: all of them at once
                fetched = self.backend._get_trials(study_id, states=_ENDED, included_trial_ids=set(),  # noqa: SLF001
                                                   trial_id_greater_than=-1)
                self._finished[study_id] = known = {}
            known.update((t._trial_id, t) for t in fetched)  # noqa: SLF001 - a FrozenTrial's storage id
            if fetched:
                self._finished[study_id] = known = dict(sorted(known.items(), key=lambda item: item[1].number))
            return list(known.values())

    def _drop_snapshots(self) -> None:
        for kind in ("snapshots", "everything"):
            snapshots = getattr(self._shared, kind, None)
            if snapshots:
                snapshots.clear()

    # Writes.
    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        return self._call("create_new_study", directions, study_name)

    def delete_study(self, study_id: int) -> None:
        self._call("delete_study", study_id)
        with self._finished_lock:  # a study created next may get its id (SQLite reuses the highest), as Optuna's
            self._finished.pop(study_id, None)  # cache forgets it too

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call("set_study_user_attr", study_id, key, value)

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call("set_study_system_attr", study_id, key, value)

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        if template_trial is not None:  # a queued trial (`enqueue_trial`): the next ask must find it
            self._drop_snapshots()
        everything: dict[int, list[FrozenTrial]] | None = getattr(self._shared, "everything", None)
        if everything is not None and template_trial is None:  # a new row's number depends on no other's values:
            # the block's draws so far wait for its end (`shared_ask_reads`)
            trial_id: int = self.boundary.call(self.cached.create_new_trial, study_id, None)
        else:
            trial_id = self._call("create_new_trial", study_id, template_trial)
        if everything and study_id in everything:  # the ask block's new trial joins its snapshot, as read afresh
            everything[study_id].append(self._created(trial_id))
            self._shared.asked.add(trial_id)
        return trial_id

    def _asked(self, trial_id: int) -> FrozenTrial | None:
        """The ask block's snapshot's copy of `trial_id` when the block created it (what a read gives, with what
        the block deferred for it), else None."""
        found = self._asked_in(trial_id)
        return None if found is None else found[0]

    def _asked_in(self, trial_id: int) -> tuple[FrozenTrial, list[FrozenTrial]] | None:
        """`_asked`, with the snapshot of its study's trials."""
        if trial_id not in (getattr(self._shared, "asked", None) or ()):
            return None
        for trials in (getattr(self._shared, "everything", None) or {}).values():
            for trial in reversed(trials):
                if trial._trial_id == trial_id:  # noqa: SLF001 - a FrozenTrial's storage id
                    return trial, trials
        return None  # the snapshot was dropped (a state written, a trial queued): read afresh

    def _defer_asked(self, trial_id: int, entry: tuple[str, int, Any, Any]) -> bool:
        """Keep a write to a trial the ask block created for the block's end (`shared_ask_reads`)."""
        if self._asked(trial_id) is None:
            return False
        self._shared.__dict__.setdefault("deferred", []).append(entry)
        return True

    def _created(self, trial_id: int) -> FrozenTrial:
        """A trial this storage has just created, as Optuna's cache took it from the row the backend wrote (a copy):
        what a read would give, without the read's six queries. Read afresh where the cache holds no such entry."""
        cached = self.cached
        try:
            with cached._lock:  # noqa: SLF001 - `_CachedStorage` keeps each trial it creates, with no public read
                where = cached._trial_id_to_study_id_and_number.get(trial_id)  # noqa: SLF001
                info = cached._studies.get(where[0]) if where is not None else None  # noqa: SLF001
                trial = info.trials.get(where[1]) if info is not None and where is not None else None
                if trial is not None and trial._trial_id == trial_id:  # noqa: SLF001
                    return copy.deepcopy(trial)
        except AttributeError:  # another Optuna's cache
            pass
        return self._call("get_trial", trial_id)

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                        distribution: optuna.distributions.BaseDistribution) -> None:
        asked = self._asked_in(trial_id)
        if asked is not None:  # Optuna's check of the study's other trials, on the block's read of them
            for other in asked[1]:
                if param_name in other.distributions:
                    optuna.distributions.check_distribution_compatibility(other.distributions[param_name],
                                                                          distribution)
                    break
        if not self._defer_asked(trial_id, ("param", trial_id, param_name, (param_value_internal, distribution))):
            self._call("set_trial_param", trial_id, param_name, param_value_internal, distribution)

        def write(trial: FrozenTrial) -> None:
            trial.params[param_name] = distribution.to_external_repr(param_value_internal)
            trial.distributions[param_name] = distribution

        self._mirror(trial_id, write)

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        """Idempotent across a lost reply: when an attempt that failed had in fact been stored, the retry finds the
        trial finished already, in the state it was asked for, and that is success."""
        failed_once = False

        def attempt() -> bool:
            nonlocal failed_once
            try:
                return bool(self.cached.set_trial_state_values(trial_id, state, values))
            except optuna.exceptions.UpdateFinishedTrialError:
                if failed_once and self.backend.get_trial(trial_id).state == state:
                    return True
                raise
            except Exception:
                failed_once = True
                raise

        self.flush_deferred()
        self._drop_snapshots()
        return self.boundary.call(attempt)

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        if not self._defer([("value", trial_id, step, intermediate_value)]):
            self._call("set_trial_intermediate_value", trial_id, step, intermediate_value)
        self._mirror(trial_id, lambda trial: trial.intermediate_values.__setitem__(step, intermediate_value))

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        if not self._defer([("user", trial_id, key, json.dumps(value))]):
            self._call("set_trial_user_attr", trial_id, key, value)
        self._mirror(trial_id, lambda trial: trial.user_attrs.__setitem__(key, value))

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        if not self._defer_asked(trial_id, ("system", trial_id, key, json.dumps(value))):
            self._call("set_trial_system_attr", trial_id, key, value)
        self._mirror(trial_id, lambda trial: trial.system_attrs.__setitem__(key, value))

    def set_trial_user_attrs(self, trial_id: int, attrs: Mapping[str, Any]) -> None:
        """Several user attrs of a running trial in one transaction: Optuna writes each in a transaction of its own,
        and a trial's end writes about ten (`_write_together`). The same values written again by a retry after a lost
        reply change nothing. In a `deferred_writes` block, they wait with the block's other writes."""
        entries = [("user", trial_id, key, json.dumps(value)) for key, value in attrs.items()]
        if not self._defer(entries):
            self.flush_deferred()
            self.boundary.call(self._write_together, entries)
        self._mirror(trial_id, lambda trial: trial.user_attrs.update(attrs))

    def _write_together(self, entries: Sequence[tuple[str, int, Any, Any]], *, strict: bool = True) -> None:
        """Intermediate values (`("value", trial_id, step, value)`), user and system attrs (`("user" or "system",
        trial_id, key, value_json)`) and params (`("param", trial_id, name, (internal value, distribution))`) of
        running trials, in one transaction, with Optuna's checks made once for all: one read of the trials' states,
        then on SQLite and PostgreSQL one multi-row upsert per table (elsewhere, and for params, Optuna's own
        `_without_commit` writes, one by one). A later entry for the same step or key wins, as it would written
        one by one. A trial that does not exist or has ended refuses its entries (Optuna's error, raised once the
        others are stored; with `strict` False, its entries are dropped)."""
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session
        from sqlalchemy.dialects import postgresql, sqlite

        backend = self.backend
        insert = {"sqlite": sqlite.insert if sqlite3.sqlite_version_info >= (3, 24, 0) else None,
                  "postgresql": postgresql.insert}.get(backend.engine.name)
        values: dict[tuple[int, Any], Any] = {}
        attrs: dict[tuple[int, Any], Any] = {}
        systems: dict[tuple[int, Any], Any] = {}
        params: dict[tuple[int, Any], Any] = {}
        for kind, trial_id, key, value in entries:
            {"value": values, "user": attrs, "system": systems, "param": params}[kind][trial_id, key] = value
        refused: tuple[int, TrialState | None] | None = None
        with _create_scoped_session(backend.scoped_session) as session:
            ids = sorted({trial_id for _, trial_id, _, _ in entries})
            live, refused = _running(session, ids)
            values = {k: v for k, v in values.items() if k[0] in live}
            attrs = {k: v for k, v in attrs.items() if k[0] in live}
            systems = {k: v for k, v in systems.items() if k[0] in live}
            # A param already stored is a retry's of a write that landed (its commit's reply was lost with the
            # connection): Optuna's own param write ignores the duplicate row, so this one leaves it as well, where
            # the insert failed the whole transaction and the worker with it (review: a traceback).
            params = {k: v for k, v in params.items() if k[0] in live}
            stored_params = set(session.query(models.TrialParamModel.trial_id, models.TrialParamModel.param_name)
                                .filter(models.TrialParamModel.trial_id.in_({i for i, _ in params}))) \
                if params else set()
            for (trial_id, name), (internal, distribution) in params.items():
                if (trial_id, name) not in stored_params:
                    backend._set_trial_param_without_commit(  # noqa: SLF001 - Optuna's own write and checks
                        session, trial_id, name, internal, distribution)
            if insert is None:
                for (trial_id, step), value in values.items():
                    backend._set_trial_intermediate_value_without_commit(  # noqa: SLF001 - Optuna's own write
                        session, trial_id, step, value)
                for table, written in ((models.TrialUserAttributeModel, attrs),
                                       (models.TrialSystemAttributeModel, systems)):
                    for (trial_id, key), value_json in written.items():
                        backend._set_trial_attr_without_commit(  # noqa: SLF001 - Optuna's own write
                            session, table, trial_id, key, json.loads(value_json))
            else:
                stored = models.TrialIntermediateValueModel
                value_rows = [dict(zip(("trial_id", "step", "intermediate_value", "intermediate_value_type"),
                                       (trial_id, step, *stored.intermediate_value_to_stored_repr(value))))
                              for (trial_id, step), value in values.items()]
                # In statements of at most `chunk` rows: PostgreSQL takes at most 65535 parameters in one, SQLite
                # before 3.32 at most 999.
                chunk = UPSERT_ROWS if backend.engine.name != "sqlite" or sqlite3.sqlite_version_info >= (3, 32) \
                    else 999 // 4
                for start in range(0, len(value_rows), chunk):
                    rows = insert(stored).values(value_rows[start: start + chunk])
                    session.execute(rows.on_conflict_do_update(
                        index_elements=[stored.trial_id, stored.step],
                        set_={"intermediate_value": rows.excluded.intermediate_value,
                              "intermediate_value_type": rows.excluded.intermediate_value_type}))
                for model, written in ((models.TrialUserAttributeModel, attrs),
                                       (models.TrialSystemAttributeModel, systems)):
                    attr_rows = [{"trial_id": trial_id, "key": key, "value_json": value_json}
                                 for (trial_id, key), value_json in written.items()]
                    for start in range(0, len(attr_rows), chunk):
                        rows = insert(model).values(attr_rows[start: start + chunk])
                        session.execute(rows.on_conflict_do_update(index_elements=[model.trial_id, model.key],
                                                                   set_={"value_json": rows.excluded.value_json}))
        if not strict:
            dropped = {i for i in ids if i not in live}
            if dropped:
                self._shared.__dict__.setdefault("refused", set()).update(dropped)
        if refused is not None and strict:
            _refuse(backend, *refused)

    # Reads.
    def get_study_id_from_name(self, study_name: str) -> int:
        return self._call("get_study_id_from_name", study_name)

    def get_study_name_from_id(self, study_id: int) -> str:
        return self._call("get_study_name_from_id", study_id)

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self._call("get_study_directions", study_id)

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call("get_study_user_attrs", study_id)

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call("get_study_system_attrs", study_id)

    def get_all_studies(self) -> list[FrozenStudy]:
        return self._call("get_all_studies")

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        return self._call("get_trial_id_from_study_id_trial_number", study_id, trial_number)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        asked = self._asked(trial_id)
        return copy.deepcopy(asked) if asked is not None else self._call("get_trial", trial_id)

    def get_all_trials(self, study_id: int, deepcopy: bool = True,
                       states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        shared = self._snapshot(study_id, states)
        if shared is not None:
            return copy.deepcopy(shared) if deepcopy else shared
        if _finished_only(states):  # what this thread deferred is written to running trials: no need to write it first
            finished = [t for t in self.boundary.call(self._read_finished, study_id) if t.state in states]  # type: ignore[operator]
            return copy.deepcopy(finished) if deepcopy else finished
        return self._call("get_all_trials", study_id, deepcopy=deepcopy, states=states)

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        return self._call("get_best_trial", study_id)

    def remove_session(self) -> None:
        self.backend.remove_session()

    # Heartbeats and stale trials (sweep.worker), through the boundary too.
    def start_heartbeats(self, trial_ids: Sequence[int], key: str, settings: Mapping[str, Any]) -> None:
        """Each trial's heartbeat `settings` (a system attr under `key`) and its first beat, for all of them in one
        transaction (what this thread deferred is written first). A trial that has ended refuses them all, with
        Optuna's error, as its system attr's write would."""
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session

        backend = self.backend

        def write() -> None:
            refused: tuple[int, TrialState | None] | None = None
            with _create_scoped_session(backend.scoped_session, True) as session:
                _, refused = _running(session, trial_ids)
                if refused is None:
                    for trial_id in trial_ids:
                        backend._set_trial_attr_without_commit(  # noqa: SLF001 - Optuna's own write
                            session, models.TrialSystemAttributeModel, trial_id, key, dict(settings))
                    _beat_rows(session, trial_ids)
            if refused is not None:  # Optuna's error, raised outside the transaction (its message reads the trial)
                _refuse(backend, *refused)

        self.flush_deferred()
        self.boundary.call(write)
        for trial_id in trial_ids:
            self._mirror(trial_id, lambda trial: trial.system_attrs.__setitem__(key, dict(settings)))

    def beat(self, trial_ids: Sequence[int]) -> None:
        """One heartbeat for each of `trial_ids` (a worker's trials in flight: a cohort's members), all in one
        transaction with one time, straight to the database (a beat missed in an outage is the next one's job).
        A dead worker's trials then go stale together and are retried together: beaten one transaction each, they
        were stale up to a second apart (SQLite stores whole seconds), and a killed cohort's members were retried in
        cohorts of their own, the last one alone (CI). One write per beat, not one per member, too."""
        from optuna.storages._rdb.storage import _create_scoped_session

        with _create_scoped_session(self.backend.scoped_session, True) as session:
            _beat_rows(session, trial_ids)

    def record_heartbeat(self, trial_id: int) -> None:
        # A trial's liveness, in a table of its own: what this thread deferred need not go first.
        self.boundary.call(self.cached.record_heartbeat, trial_id)

    def stale_trial_ids(self, study_id: int) -> list[int]:
        if self.heartbeat_interval is None:
            return []
        self.flush_deferred()
        return self.boundary.call(self.backend._get_stale_trial_ids, study_id)  # noqa: SLF001

    def heartbeat_age_s(self, trial_id: int) -> float | None:
        """Seconds since the trial's last heartbeat, by the database's clock (as Optuna's stale check counts them),
        or None where it has none."""
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session

        def read() -> float | None:
            with _create_scoped_session(self.backend.scoped_session) as session:
                now = session.execute(sqlalchemy.func.now()).scalar()
                beat = session.query(models.TrialHeartbeatModel.heartbeat).filter(
                    models.TrialHeartbeatModel.trial_id == trial_id).scalar()
            if now is None or beat is None:
                return None
            return (now.replace(tzinfo=None) - beat.replace(tzinfo=None)).total_seconds()

        return self.boundary.call(read)

    def fail_lost_trial(self, trial_id: int, reason: str) -> bool:
        """Fail a trial whose worker stopped beating, with its reason. True for the one worker that failed it
        (several may find it stale at once). The state, the reason and the outcome change in one transaction, the
        trial's row locked (`_fail_as_lost`): a worker killed meanwhile leaves all of them or none, so a failed trial
        of sweep's with no outcome was ended by someone else (`Study.tell` from outside: `Worker._ended_from_outside`).
        Failing it after setting the reason would let a live trial that beats again carry a failure reason, and
        setting it after failing it left a moment where a lost trial looked told from outside (diff review)."""
        self.flush_deferred()
        self._drop_snapshots()
        if not self.boundary.call(self._fail_as_lost, trial_id, {"fail_reason": reason, "outcome": "lost"}):
            return False
        self._forget_finished(trial_id)
        return True

    def _fail_as_lost(self, trial_id: int, attrs: Mapping[str, Any]) -> bool:
        """FAIL a running trial and write its user `attrs`, in one transaction; False when it had finished."""
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session

        with _create_scoped_session(self.backend.scoped_session) as session:
            trial = models.TrialModel.find_or_raise_by_id(trial_id, session, for_update=True)
            if trial.state.is_finished():
                return False
            trial.state = TrialState.FAIL
            trial.datetime_complete = datetime.datetime.now()  # as Optuna's `set_trial_state_values` stamps it
            for key, value in attrs.items():
                row = models.TrialUserAttributeModel.find_by_trial_and_key(trial, key, session)
                if row is None:
                    row = models.TrialUserAttributeModel(trial_id=trial_id, key=key)
                    session.add(row)
                row.value_json = json.dumps(value)
        return True

    def record_lost(self, trial_id: int, reason: str, outcome: str = "lost") -> None:
        """Write why a failed trial ended (Optuna refuses attrs on finished trials): the reason and the outcome in
        one transaction, so a worker killed meanwhile leaves both or neither.
        `outcome` "failed": a lost trial that will not be retried (its worker died on it too often)."""
        self.flush_deferred()
        self.boundary.call(self._write_user_attrs, trial_id, {"fail_reason": reason, "outcome": outcome})

    def _write_user_attrs(self, trial_id: int, attrs: Mapping[str, Any]) -> None:
        """Write user attrs onto a finished trial, past Optuna (which refuses them): this process's read of the
        finished trials (`_read_finished`, which takes a finished trial for unchanging) then reads it again."""
        import json

        with self.backend.engine.begin() as connection:
            for key, value in attrs.items():
                updated = connection.execute(
                    text("UPDATE trial_user_attributes SET value_json = :v WHERE trial_id = :t AND key = :k"),
                    {"v": json.dumps(value), "t": trial_id, "k": key}).rowcount
                if not updated:
                    connection.execute(text("INSERT INTO trial_user_attributes (trial_id, key, value_json) "
                                            "VALUES (:t, :k, :v)"), {"v": json.dumps(value), "t": trial_id, "k": key})
        self._forget_finished(trial_id)  # once committed: a read before then would keep the old attrs again

    def _forget_finished(self, trial_id: int) -> None:
        with self._finished_lock:
            for known in self._finished.values():
                known.pop(trial_id, None)
        self._drop_snapshots()

    def trial_age_s(self, trial: FrozenTrial) -> float:
        if trial.datetime_start is None:
            return 0.0
        return (datetime.datetime.now() - trial.datetime_start).total_seconds()


class AmbiguousStudy(KeyError):
    """The storage holds several studies and none was named: the command needs --study-name (bad input)."""


def load_existing_study(storage_url: str, name: str | None) -> optuna.Study:
    """A study for reading (status, trials, report): by name, or the only one in the storage. Raises KeyError
    naming the studies there when there is no such study. The file is read in the journal mode it has."""
    storage = make_storage(storage_url, wal=False)
    if name is None:
        names = optuna.get_all_study_names(storage)
        if len(names) != 1:
            found = ", ".join(map(repr, names)) if names else "none"  # quoted: a name may be empty, or hold controls
            raise (AmbiguousStudy if names else KeyError)(f"{mask_url(storage_url)} holds {len(names)} studies "
                                                          f"({found}); name one with --study-name")
        name = names[0]
    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        names = optuna.get_all_study_names(storage)
        raise KeyError(f"no study named {name!r} in {mask_url(storage_url)}; it holds: "
                       f"{', '.join(map(repr, names)) if names else 'none'}") from None


def database_identity(url: str | None) -> tuple[Path, tuple[int, int]] | None:
    """A SQLite storage's file and its identity now (device, inode), or None (a server's storage, an in-memory
    one, a file that cannot be read)."""
    path = sqlite_path(url) if url else None
    if path is None:
        return None
    try:
        status = path.stat()
    except OSError:
        return None
    return path, (status.st_dev, status.st_ino)


def database_gone(opened: tuple[Path, tuple[int, int]] | None) -> str | None:
    """Why the SQLite file opened as `opened` (`database_identity`) is no longer the one at its path (deleted, or
    replaced by another file), in one line, or None: connections made before write on into the old file, which
    nothing reads again, and new ones into a new empty one (review: every trial after an `rm` of the database was
    printed as done, and all were lost)."""
    if opened is None:
        return None
    path, identity = opened
    try:
        status = path.stat()
    except FileNotFoundError:
        now, empty = None, True
    except OSError:
        return None  # cannot tell (a permission, an I/O error): the storage's own calls say what it is
    else:
        now, empty = (status.st_dev, status.st_ino), status.st_size == 0
    # A file deleted and made anew often gets its inode number back at once: an empty file tells it too (SQLite never
    # empties a database; the new one stays empty, its tables missing). Not a descriptor on the deleted file: a
    # process that ran a study before (a notebook, the tests) may hold an old file of that name from then.
    if now == identity and not empty:
        return None
    # Deleted, SQLite makes a new empty file at the path for the next connection: that reads as replaced.
    return (f"{path}: the study's database was deleted or replaced while this run had it open: what the run stored "
            "since then went with the old file, and the run stops; rerun to train those trials again")
