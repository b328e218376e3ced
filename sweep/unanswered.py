"""Calls a database server never answers: a server process stopped (SIGSTOP, a frozen container) or stuck on its own
disk while its machine is up. Its kernel acknowledges every packet, so neither TCP keepalives nor `tcp_user_timeout`
ever end the wait, and libpq has no timeout of its own for a query in flight: without this, a worker waited without a
word for as long as the server hung, past any `storage_patience`.

Each storage call of the `Boundary` is timed here (`watch`), from its start or the server's last answer to it (a
call may be many statements). One that has waited `tcp_user_timeout` (the bound the kernel puts on a peer that stopped
acknowledging; 60 s unless the URL says otherwise; 0 turns this off) without an answer has every open
connection of that engine cut under it (`shutdown` of its socket): the call fails with a lost connection, which the
boundary waits out as any outage, on new connections that give up after `connect_timeout`, and names as a server that
did not answer. Only PostgreSQL's connections (psycopg, psycopg2) are watched; SQLite's calls wait on locks, not on a
peer.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

__all__ = ["Call", "watch", "watch_engine"]

_CHECK_EVERY_S = 1.0


class Call:
    """A storage call in flight on one thread; `cut_after` is set (to the seconds it had waited) when its server's
    connections were cut under it."""

    __slots__ = ("cut_after", "started")

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.cut_after: float | None = None


_lock = threading.Lock()
_calls: dict[int, Call] = {}  # thread ident -> its outermost call in flight
# Every open connection of a watched engine, with the seconds after which a call in flight cuts it.
_connections: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
_thread: threading.Thread | None = None


def watch_engine(engine: Engine, limit_s: float) -> None:
    """Watch `engine`'s connections from now on: a storage call that has waited `limit_s` seconds cuts them. A
    connection the engine already holds idle is let go (it is opened again, watched, when next needed)."""
    if limit_s <= 0 or engine.url.get_backend_name() != "postgresql":
        return

    @event.listens_for(engine, "connect")
    def _opened(dbapi_connection: Any, record: Any) -> None:
        with _lock:
            _connections[dbapi_connection] = limit_s

    # A statement answered, even with an error (a lock's turn ran out), is the server answering: a call made of
    # many of them (waiting for the study's lock a second at a time) is timed from its last answer.
    event.listen(engine, "after_cursor_execute", lambda *_: _answered())
    event.listen(engine, "handle_error", lambda *_: _answered())
    engine.pool.dispose()
    with _lock:
        if _thread is None:
            _start()


def _answered() -> None:
    call = _calls.get(threading.get_ident())
    if call is not None:
        call.started = time.monotonic()


@contextlib.contextmanager
def watch() -> Iterator[Call]:
    """Time the storage call made in this block (the outermost one, where calls nest)."""
    ident = threading.get_ident()
    with _lock:
        outer = _calls.get(ident)
        call = outer if outer is not None else Call()
        if outer is None:
            _calls[ident] = call
    try:
        yield call
    finally:
        if outer is None:
            with _lock:
                _calls.pop(ident, None)


def _start() -> None:
    global _thread
    _thread = threading.Thread(target=_patrol, name="sweep-unanswered-calls", daemon=True)
    _thread.start()


def _patrol() -> None:
    last = time.monotonic()
    while True:
        time.sleep(_CHECK_EVERY_S)
        now = time.monotonic()
        with _lock:
            if (overslept := now - last - _CHECK_EVERY_S) > _CHECK_EVERY_S:
                # This process was stopped (Ctrl-Z, SIGSTOP, a frozen container) or starved meanwhile: the time
                # was not the server's to answer in, and an answer may be waiting in the socket.
                for call in _calls.values():
                    call.started += overslept
            last = now
            waiting = [call for call in _calls.values() if call.cut_after is None]
            if not waiting:
                continue
            longest = now - min(call.started for call in waiting)
            doomed = [connection for connection, limit in _connections.items() if longest >= limit]
            if not doomed:
                continue
            for call in waiting:  # every call in flight waits on the same server
                if now - call.started >= min(_connections.get(c, float("inf")) for c in doomed):
                    call.cut_after = now - call.started
        for connection in doomed:
            _cut(connection)


def _cut(dbapi_connection: Any) -> None:
    """Shut the connection's socket down under whoever waits on it: its read ends at once, as if the server had
    closed it. The socket itself is closed by its connection's owner, as after any lost connection."""
    try:
        fd = dbapi_connection.fileno()  # psycopg and psycopg2 alike; raises on a closed connection
        sock = socket.socket(fileno=os.dup(fd))
    except Exception:  # noqa: BLE001 - closed meanwhile, or not a socket: nothing to cut
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()
