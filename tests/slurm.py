"""A throwaway single-node Slurm cluster for the tests, like tests/pg.py's PostgreSQL: Debian's Slurm 22.05
(`apt-get install slurm-wlm munge`; `.ci/run` installs them where it can), every file in a temporary folder.

- `munged` runs as the `munge` user with the machine's key (`/etc/munge/munge.key`, made by the package) on a socket
  of its own in that folder, so it neither needs nor disturbs a system munged.
- `slurmctld -i` and `slurmd` run as root from a `slurm.conf` in that folder (state, spool, logs and pid files
  there too), on two free TCP ports; one node (this machine's short hostname) with 8 CPUs whatever the machine has
  (`SlurmdParameters=config_overrides`), so three one-CPU array tasks run at once on a small machine.
- Clients find it through `SLURM_CONF`, which `env` holds: pass it to every `sbatch`/`squeue`/`sweep submit`.

Only root can run slurmd (it starts jobs as their users), so anything else is a skip with the reason, as is a
machine without the binaries. `close()` stops the daemons (their pids, not by name) and deletes the folder."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

__all__ = ["SlurmCluster", "slurm_unavailable"]

_DAEMONS = ("munged", "slurmctld", "slurmd")
_CLIENTS = ("sbatch", "squeue", "scontrol", "scancel")
MUNGE_KEY = Path("/etc/munge/munge.key")


def _find(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/usr/local/sbin:/sbin")


def slurm_unavailable() -> str | None:
    """Why no test cluster can start here, or None."""
    missing = [tool for tool in (*_DAEMONS, *_CLIENTS) if _find(tool) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "a test Slurm cluster needs root (slurmd starts jobs as their users)"
    if not MUNGE_KEY.exists():
        return f"no munge key at {MUNGE_KEY}: mungekey --create"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SlurmCluster:
    """A running single-node cluster. `env` is os.environ plus `SLURM_CONF`; `run(*args)` runs a Slurm client."""

    def __init__(self, cpus: int = 8, kill_wait_s: int = 30) -> None:
        reason = slurm_unavailable()
        if reason:
            raise RuntimeError(reason)
        self.folder = Path(tempfile.mkdtemp(prefix="sweep-slurm-"))
        os.chmod(self.folder, 0o755)  # munged (another user) must reach its folder inside
        self.conf = self.folder / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.node = socket.gethostname().split(".")[0]
        self._processes: list[subprocess.Popen[bytes]] = []
        try:
            self._start_munge()
            self._write_conf(cpus, kill_wait_s)
            self._start("slurmctld", "-D", "-i", "-f", str(self.conf))
            self._start("slurmd", "-D", "-f", str(self.conf))
            self._wait_idle()
        except BaseException:
            self.close()
            raise

    # -- the daemons ----------------------------------------------------------------------------------------------
    def _start_munge(self) -> None:
        munge = self.folder / "munge"
        munge.mkdir()
        os.chmod(munge, 0o755)  # munged: clients (every user) must reach its socket; only munge writes here
        user = pwd.getpwnam("munge")
        os.chown(munge, user.pw_uid, user.pw_gid)
        self.munge_socket = munge / "munge.socket"
        command = ["runuser", "-u", "munge", "--", str(_find("munged")), "--foreground",
                   f"--socket={self.munge_socket}", f"--key-file={MUNGE_KEY}", f"--pid-file={munge / 'munged.pid'}",
                   f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"]
        self._processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        self._wait(lambda: self.munge_socket.exists(), "munged's socket", munge / "munged.log")

    def _write_conf(self, cpus: int, kill_wait_s: int) -> None:
        for name in ("state", "spool"):
            (self.folder / name).mkdir()
        self.conf.write_text("\n".join([
            "ClusterName=sweeptest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            # A requeued job starts again only once its old credential has expired (slurmd refuses to launch a job
            # id it has revoked: "already killed", the job then FAILED); 20 s instead of 120 s keeps the tests short.
            f"AuthInfo=socket={self.munge_socket},cred_expire=20",
            "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MinJobAge=3600",  # finished jobs stay visible to `scontrol show job` for the test's whole length
            f"KillWait={kill_wait_s}",
            f"StateSaveLocation={self.folder / 'state'}",
            f"SlurmdSpoolDir={self.folder / 'spool'}",
            f"SlurmctldPidFile={self.folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.folder / 'slurmctld.log'}",
            f"SlurmdLogFile={self.folder / 'slurmd.log'}",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=4000 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            ""]))

    def _start(self, *command: str) -> None:
        self._processes.append(subprocess.Popen([str(_find(command[0])), *command[1:]], env=self.env,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def _wait_idle(self, patience_s: float = 120.0) -> None:
        def idle() -> bool:
            done = self.run("sinfo", "-h", "-o", "%t", check=False) if _find("sinfo") else \
                self.run("scontrol", "show", "node", self.node, check=False)
            return done.returncode == 0 and "idle" in done.stdout.lower()

        self._wait(idle, "an idle node", self.folder / "slurmd.log", patience_s)

    def _wait(self, condition: object, what: str, log: Path, patience_s: float = 60.0) -> None:
        deadline = time.monotonic() + patience_s
        while not condition():  # type: ignore[operator]
            for process in self._processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args[0]} exited with {process.returncode} while waiting for "
                                       f"{what}: {self.log_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {patience_s:g} s: {self.log_tail(log)}")
            time.sleep(0.2)

    def log_tail(self, log: Path | None = None, chars: int = 3000) -> str:
        paths = [log] if log else [self.folder / "slurmctld.log", self.folder / "slurmd.log"]
        text = ""
        for path in paths:
            try:
                text += f"\n--- {path.name}\n" + path.read_text(errors="replace")[-chars:]
            except OSError:
                pass
        return text

    # -- clients ----------------------------------------------------------------------------------------------------
    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(_find(command[0]) or command[0]), *command[1:]], env=self.env,
                              capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr}")
        return done

    @contextlib.contextmanager
    def controller_paused(self) -> Iterator[None]:
        """slurmctld stopped (SIGSTOP) while the block runs: a controller that takes connections and answers none,
        as one that hangs; it goes on (SIGCONT) after."""
        pid = int((self.folder / "slurmctld.pid").read_text())
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def close(self) -> None:
        """Cancel what is left of the jobs (slurmstepd would outlive slurmd), stop the daemons (slurmd and slurmctld
        first, munged last) and delete the folder."""
        if len(self._processes) == len(_DAEMONS) and all(p.poll() is None for p in self._processes):
            self.run("scancel", f"--user={pwd.getpwuid(os.geteuid()).pw_name}", check=False)
            deadline = time.monotonic() + 60
            while self.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for process in reversed(self._processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self._processes.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
