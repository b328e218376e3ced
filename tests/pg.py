"""A throwaway PostgreSQL server for the tests: `initdb` into a temporary folder, listening only on a unix socket in
that folder (no TCP at all), trust authentication, stopped and deleted at the end. As root, the server runs as the
`postgres` system user, since PostgreSQL refuses to run as root.

`postgres_server()` yields a URL for the common case. Fault tests hold a `PostgresServer` instead, which can be
stopped, started and restarted (`pg_ctl restart -m fast`, as an operator or a failover would) under running workers;
the URL stays the same across restarts."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import TracebackType

__all__ = ["PostgresServer", "postgres_available", "postgres_server"]


def postgres_available() -> bool:
    return all(shutil.which(tool) for tool in ("initdb", "pg_ctl", "postgres"))


def _as_server_user(command: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return command
    return ["runuser", "-u", "postgres", "--", *command]


class PostgresServer:
    """A private server with one database. `url` is an SQLAlchemy URL over the unix socket in the server's folder.

    `restart(mode)` is `pg_ctl restart -m MODE`: "fast" (open sessions are terminated, the server shuts down cleanly
    and comes back), "smart" (waits for sessions to end) or "immediate" (like a crash: recovery on start). `down_s`
    keeps it stopped that long in between, for an outage longer than a restart. `stop` and `start` do the halves."""

    def __init__(self, database: str = "sweep", password: str | None = None, max_connections: int = 200) -> None:
        """With `password`, the server asks for it (scram-sha-256) instead of trusting every local connection; `url`
        then holds no password: give it the way a user would. `max_connections`: the server's connection slots (its
        superuser, which `url` logs in as, may take every one of them)."""
        self.database = database
        self.folder = Path(tempfile.mkdtemp(prefix="sweep-pg-"))
        self.data, self.socket_dir, self.log = self.folder / "data", self.folder / "socket", self.folder / "log"
        self.url = f"postgresql+psycopg://postgres@/{database}?host={self.socket_dir}"
        self._env = {**os.environ, "LC_ALL": "C", **({"PGPASSWORD": password} if password else {})}
        # listen_addresses='' : no TCP socket at all, only the unix socket in our own folder. fsync off (the machine
        # does not crash under a test, only the server does), synchronous_commit on: a commit the server acknowledged
        # is in its WAL, so `restart("immediate")` (a crash of the server) loses none, as on a production server.
        self._options = (f"-c listen_addresses='' -c unix_socket_directories={self.socket_dir} -c fsync=off "
                         f"-c max_connections={max_connections} -c superuser_reserved_connections=0 "
                         "-c synchronous_commit=on")
        self.socket_dir.mkdir()
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            for path in (self.folder, self.socket_dir):
                os.chown(path, user.pw_uid, user.pw_gid)
        auth = ["--auth=trust"]
        if password is not None:
            secret = self.folder / "pwfile"
            secret.write_text(password + "\n")
            if os.geteuid() == 0:
                os.chown(secret, pwd.getpwnam("postgres").pw_uid, pwd.getpwnam("postgres").pw_gid)
            auth = ["--auth=scram-sha-256", f"--pwfile={secret}"]
        try:
            self._run("initdb", "-D", str(self.data), "-U", "postgres", *auth, "-E", "UTF8", "--no-sync")
            self.start()
            self._create_database()
        except BaseException:
            self.close()
            raise

    def _run(self, *command: str) -> subprocess.CompletedProcess[bytes]:
        done = subprocess.run(_as_server_user(list(command)), capture_output=True, env=self._env)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:1])} failed ({done.returncode}): "
                               f"{done.stderr.decode(errors='replace')}{self.log_tail()}")
        return done

    def _create_database(self, patience_s: float = 30.0) -> None:
        deadline = time.monotonic() + patience_s
        while True:
            done = subprocess.run(_as_server_user(["createdb", "-h", str(self.socket_dir), "-U", "postgres",
                                                   self.database]), capture_output=True, env=self._env)
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"createdb failed: {done.stderr.decode(errors='replace')}")
            time.sleep(0.2)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return "\n" + self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self) -> None:
        """Start and wait until it accepts connections."""
        self._run("pg_ctl", "-D", str(self.data), "-o", self._options, "-l", str(self.log), "-w", "-t", "60",
                  "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop and wait until it is down."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self, mode: str = "fast", down_s: float = 0.0) -> None:
        """`pg_ctl restart -m MODE`; with `down_s`, a stop, that many seconds down, then a start."""
        if down_s > 0:
            self.stop(mode)
            time.sleep(down_s)  # the length of the outage is the fault itself, not a wait for something
            self.start()
            return
        self._run("pg_ctl", "-D", str(self.data), "-o", self._options, "-l", str(self.log), "-m", mode, "-w",
                  "-t", "60", "restart")

    def processes(self) -> list[int]:
        """The server's process ids: the postmaster's and its children's (backends, background workers)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = subprocess.run(["pgrep", "-P", str(postmaster)], capture_output=True, text=True).stdout.split()
        return [postmaster, *map(int, children)]

    def pause(self) -> list[int]:
        """Stop every process of the server (SIGSTOP), as a frozen container or a server stuck on its disk: its
        kernel still accepts connections and acknowledges what is sent, and nothing answers. Returns what
        `resume` takes."""
        stopped = self.processes()
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        return stopped

    def resume(self, stopped: list[int]) -> None:
        for pid in stopped:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def close(self) -> None:
        """Stop it (immediately) and delete its folder."""
        if self.data.exists():
            subprocess.run(_as_server_user(["pg_ctl", "-D", str(self.data), "-m", "immediate", "stop"]),
                           capture_output=True, env=self._env)
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


@contextmanager
def postgres_server(database: str = "sweep") -> Iterator[str]:
    """Yields an SQLAlchemy URL for a fresh database on a private server."""
    with PostgresServer(database) as server:
        yield server.url
