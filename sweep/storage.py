"""Opening the study's storage so that many workers can share it, and the one lock that makes the budget exact.

SQLite (one machine): the file is switched to write-ahead logging, so readers (optuna-dashboard, `sweep status`)
never block the workers, and every transaction starts with `BEGIN IMMEDIATE` under a 60 s busy timeout. Without
that, two processes that both read and then write deadlock on the lock upgrade and SQLite fails one of them at once
with "database is locked", whatever the timeout: the error Optuna's FAQ warns about.

PostgreSQL (many machines): Optuna's RDB storage as it is, with `pool_pre_ping` so a server restart does not fail the
next trial.

Budget: asking for a trial and counting the trials in flight happen under one lock (a lock file next to the SQLite
file, or a PostgreSQL advisory lock), so N workers finish exactly `n_trials` trials, never one more.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import random
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError

__all__ = ["ask_lock", "make_storage", "mask_url", "sqlite_path"]


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, for anything printed or stored."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return re.sub(r"(//[^:/@]*:)[^@]*@", r"\1***@", url)


def sqlite_path(url: str) -> Path | None:
    """The database file of a `sqlite:///` URL, or None for anything else."""
    if not url.startswith("sqlite:///") or url.endswith(":memory:"):
        return None
    return Path(url.removeprefix("sqlite:///"))


def _serialise_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None  # let SQLAlchemy's BEGIN below be the only one
        dbapi_connection.execute("PRAGMA busy_timeout = 60000")

    @event.listens_for(engine, "begin")
    def _begin(connection: Any) -> None:
        # Take the write lock at the start: a transaction that reads, then writes, cannot deadlock on an upgrade.
        connection.exec_driver_sql("BEGIN IMMEDIATE")


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


def make_storage(url: str, *, heartbeat_interval: int | None = None, grace_period: int | None = None,
                 stale_trial_callback: Callable[[optuna.Study, optuna.trial.FrozenTrial], None] | None = None,
                 ) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage, made safe for several worker processes (see the module docstring). With a heartbeat,
    a RUNNING trial whose worker has not beaten for `grace_period` seconds is failed by `fail_stale_trials` and handed
    to `stale_trial_callback`."""
    path = sqlite_path(url)
    engine_kwargs: dict[str, Any] = {}
    if path is not None:
        engine_kwargs["connect_args"] = {"timeout": 60}
        if path.parent.exists():
            _use_wal(url)
    else:
        engine_kwargs["pool_pre_ping"] = True
    for attempt in range(5):
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs,
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
        _serialise_sqlite(storage.engine)
        storage.engine.dispose()  # reconnect with the listeners above
    return storage


@contextlib.contextmanager
def ask_lock(url: str, study_name: str) -> Iterator[None]:
    """Held while a worker counts the trials in flight and asks for a new one."""
    path = sqlite_path(url)
    if path is not None:
        lock_file = path.with_name(path.name + ".lock")
        with open(lock_file, "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
        return
    if url.startswith("postgresql"):
        key = int.from_bytes(hashlib.sha256(f"sweep:{study_name}".encode()).digest()[:8], "big", signed=True)
        engine = _lock_engine(url)
        with engine.connect() as connection:
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": key})
            try:
                yield
            finally:
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
                connection.commit()
        return
    yield  # other backends: best effort


_LOCK_ENGINES: dict[str, Engine] = {}


def _lock_engine(url: str) -> Engine:
    if url not in _LOCK_ENGINES:
        _LOCK_ENGINES[url] = create_engine(url, pool_size=1, pool_pre_ping=True)
    return _LOCK_ENGINES[url]
