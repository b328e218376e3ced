"""A throwaway PostgreSQL server for the tests: `initdb` into a temporary folder, listening only on a unix socket in
that folder (no TCP at all), trust authentication, stopped and deleted at the end. As root, the server runs as the
`postgres` system user, since PostgreSQL refuses to run as root."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["postgres_available", "postgres_server"]


def postgres_available() -> bool:
    return all(shutil.which(tool) for tool in ("initdb", "pg_ctl", "postgres"))


def _as_server_user(command: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return command
    return ["runuser", "-u", "postgres", "--", *command]


@contextmanager
def postgres_server(database: str = "sweep") -> Iterator[str]:
    """Yields an SQLAlchemy URL for a fresh database on a private server."""
    folder = Path(tempfile.mkdtemp(prefix="sweep-pg-"))
    data, socket_dir = folder / "data", folder / "socket"
    socket_dir.mkdir()
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        for path in (folder, socket_dir):
            os.chown(path, user.pw_uid, user.pw_gid)
    env = {**os.environ, "LC_ALL": "C"}
    run = lambda *cmd: subprocess.run(_as_server_user(list(cmd)), check=True, capture_output=True, env=env)  # noqa
    try:
        run("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        # listen_addresses='' : no TCP socket at all, only the unix socket in our own folder.
        options = f"-c listen_addresses='' -c unix_socket_directories={socket_dir} -c fsync=off " \
                  "-c max_connections=200 -c synchronous_commit=off"
        run("pg_ctl", "-D", str(data), "-o", options, "-l", str(folder / "log"), "-w", "-t", "60", "start")
        url = f"postgresql+psycopg://postgres@/{database}?host={socket_dir}"
        deadline = time.monotonic() + 30
        while True:
            done = subprocess.run(_as_server_user(["createdb", "-h", str(socket_dir), "-U", "postgres", database]),
                                  capture_output=True, env=env)
            if done.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"createdb failed: {done.stderr.decode()}")
            time.sleep(0.2)
        yield url
    finally:
        subprocess.run(_as_server_user(["pg_ctl", "-D", str(data), "-m", "immediate", "stop"]), capture_output=True,
                       env=env)
        shutil.rmtree(folder, ignore_errors=True)
