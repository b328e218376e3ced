"""`sweep run --workers N`: N worker processes on this machine share one study.

Each worker is the same `sweep run` in its own process, so a worker that dies takes nothing else with it; the others
notice its trial's stale heartbeat and train its params again. On a GPU machine worker k sees only GPU k mod G
(round robin over the visible devices; more workers than GPUs put several small trials on each GPU). With
`resources.devices_per_trial: N`, worker k sees N GPUs, the k-th group of N (round robin too): W workers need W*N
GPUs to have devices of their own, and a trial cannot run on fewer than N.

The storage URL reaches the workers in their environment (`SWEEP_STORAGE_URL`), never on their command lines: any
local user can read a process's arguments (`ps`, /proc/PID/cmdline), and the URL may hold a password. A process's
environment is readable by its owner only.

Workers that a scheduler starts (`sweep submit --slurm`) get it from an owner-only file instead, named by
`SWEEP_STORAGE_URL_FILE`: a scheduler keeps the environment of each job it was given in its own records (Slurm's
state files, its accounting database), where its administrators and tools read them. See `write_storage_file`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from sweep.signals import FORWARD, raise_pending
from trainer.limits import usable_cores
from trainer.yaml_file import YamlFileError, read_text

if TYPE_CHECKING:
    from sweep.schema import StudySpec

__all__ = ["LAUNCHED_ENV", "LAUNCHER_ENV", "SECRET_ENV_NAMES", "STORAGE_ENV", "STORAGE_FILE_ENV", "WORKER_ENV",
           "arm_launcher_death", "device_groups", "gpus_problem", "prepare_process", "run_local_workers", "run_workers",
           "storage_from_environment", "visible_gpus", "worker_args", "write_storage_file"]

WORKER_ENV = "SWEEP_WORKER"  # set in each worker: its index, used to prefix its output
# Set in each worker: when its launcher started (time.time()). A `sweep stop` after that stops the worker, also one
# given while the worker was still starting (importing torch takes seconds).
LAUNCHED_ENV = "SWEEP_LAUNCHED_AT"
# Set in each worker: its launcher's pid. A worker ends (as preempted: its trials marked and queued again) when its
# launcher dies, even by SIGKILL, instead of training on for nobody while a rerun starts more (`arm_launcher_death`).
LAUNCHER_ENV = "SWEEP_LAUNCHER_PID"
STORAGE_ENV = "SWEEP_STORAGE_URL"  # the storage URL, handed to each worker (read by the worker's `sweep run`)
STORAGE_FILE_ENV = "SWEEP_STORAGE_URL_FILE"  # or the path of an owner-only file holding it (`write_storage_file`)
# Variables that hold a password by convention (libpq's, MLflow's): they travel in the file, never in a job's record.
SECRET_ENV_NAMES = ("PGPASSWORD", STORAGE_ENV, "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


_prepared: list[bool] = []


def prepare_worker() -> None:
    """In a worker a launcher started (`WORKER_ENV` set), before its slow imports and once: its launcher's forwarded
    requests are recorded from now on (`record_forwarded`), and its launcher's death reaches it as one
    (`arm_launcher_death`). Nothing elsewhere."""
    if os.environ.get(WORKER_ENV) is None or _prepared:
        return
    from sweep.signals import record_forwarded

    _prepared.append(True)
    record_forwarded()
    arm_launcher_death()


def arm_launcher_death() -> None:
    """In a worker a launcher started (`LAUNCHER_ENV`), before its slow imports: its launcher's death, by SIGKILL too,
    reaches it as the launcher's forwarded SIGTERM (a preemption: its running trials are marked and queued again).
    A launcher already gone is that request at once."""
    from trainer.lifetime import signal_on_parent_death

    launcher = os.environ.get(LAUNCHER_ENV, "")
    if launcher.isdigit() and not signal_on_parent_death(FORWARD[signal.SIGTERM], int(launcher)):
        os.kill(os.getpid(), FORWARD[signal.SIGTERM])


def write_storage_file(path: Path, url: str) -> None:
    """Write `url` for workers started elsewhere into `path`, readable and writable by its owner only (0600, like
    ~/.pgpass), with libpq's `PGPASSWORD` and MLflow's password and token when they are set: the workers'
    environment will not carry them."""
    secrets = {"url": url, "env": {name: os.environ[name] for name in SECRET_ENV_NAMES
                                   if name != STORAGE_ENV and name in os.environ}}
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # an existing file keeps its mode through O_CREAT; this one must not
    with os.fdopen(descriptor, "w") as handle:
        json.dump(secrets, handle)


def storage_from_environment() -> str | None:
    """In a worker: the storage URL its launcher handed over, from `STORAGE_ENV` or the file `STORAGE_FILE_ENV`
    names (whose libpq variables are set too), or None. The variable is removed: the trials' code never sees it.
    Raises OSError or ValueError for a file that cannot be read."""
    url = os.environ.pop(STORAGE_ENV, None)
    path = os.environ.get(STORAGE_FILE_ENV)
    if url is not None or not path:
        return url
    try:  # a regular file of bounded size: a FIFO there hung the worker past SIGTERM, /dev/zero filled its memory
        text = read_text(Path(path), what="storage file")
    except YamlFileError as exc:
        raise ValueError(f"{path}: {exc.problems[0][1]}") from None
    try:
        secrets = json.loads(text)
        url, extra = secrets["url"], secrets.get("env", {})
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a storage file written by sweep submit ({type(exc).__name__})") from None
    # Every value as sweep submit writes it: a string URL, and strings for the variables (a null is no password).
    if not isinstance(url, str) or not isinstance(extra, dict) or not all(
            isinstance(name, str) and isinstance(value, str) for name, value in extra.items()):
        raise ValueError(f"{path}: not a storage file written by sweep submit (expected \"url\": a string and "
                         "\"env\": a mapping of variable names to strings)")
    os.environ.update(extra)
    return url


def worker_args(study_file: Path, spec: StudySpec, *, timeout: float | None, overrides: Sequence[str]) -> list[str]:
    """The arguments of `sweep run` in a worker of a study that exists already: the study file, its name and budget
    (so that no worker creates another study), `--set` overrides but never `--set storage=...` (the URL goes by
    `STORAGE_ENV` or `STORAGE_FILE_ENV`, and may hold a password), nor a `--set` of the name or the budget, which the
    options give (a worker refuses both, as `sweep run` does)."""
    return [str(study_file), "--study-name", spec.name, "--n-trials", str(spec.n_trials),
            *(["--timeout", str(timeout)] if timeout else []),
            *(f"--set={item}" for item in overrides  # the name and budget go as the options above, with their values
              if item.partition("=")[0].strip() not in ("storage", "name", "n_trials"))]


def visible_gpus() -> list[str]:
    """The GPU ids a worker may be pinned to: CUDA_VISIBLE_DEVICES if set, else every device torch sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def prepare_process(spec: StudySpec) -> None:
    """Process-wide settings a worker needs before its first trial: cuBLAS reads its workspace setting once, at its
    first call, so a study that fixes or searches `deterministic` sets it now (the first trial may not be a
    deterministic one)."""
    if spec.fixed.get("deterministic") is True or "deterministic" in spec.space:
        from trainer.seeding import deterministic_cublas

        deterministic_cublas()


def worker_python() -> list[str]:
    """The interpreter a worker runs under, importing what this process imports. `python -m` puts the working
    folder first on `sys.path`, where a `sweep` command (a console script) has none: a `train.py` in the working
    folder would be the workers' task or loop, while this process took the one beside the study file. `-P` (Python
    3.11 and later) leaves it out, as here; the flag is the worker's alone (`PYTHONSAFEPATH` would reach a `command:`
    trial's `python train.py` and break its imports of the modules beside it)."""
    cwd_first = bool(sys.path) and sys.path[0] in ("", os.getcwd())
    return [sys.executable] if cwd_first or sys.version_info < (3, 11) else [sys.executable, "-P"]


def run_local_workers(study_file: Path, spec: StudySpec, url: str, n_workers: int, *, timeout: float | None,
                      overrides: Sequence[str]) -> list[int]:
    """`sweep run --workers N`: the same `sweep run` in N processes on this study's storage (the study exists
    already, so none of them creates it); returns their exit codes. The URL goes by environment (`STORAGE_ENV`), and
    a `--set storage=...` override stays off the workers' command lines: the URL it gave is that one."""
    return run_workers(worker_args(study_file, spec, timeout=timeout, overrides=overrides), n_workers,
                       env={STORAGE_ENV: url}, devices_per_worker=spec.resources.devices_per_trial)


def run_workers(run_args: Sequence[str], n_workers: int, *, grace_s: float = 30.0,
                env: Mapping[str, str] | None = None, devices_per_worker: int = 1) -> list[int]:
    """Start `sweep run RUN_ARGS` in `n_workers` processes, with `env` added to their environment, and wait for
    them; returns their exit codes.

    Ctrl-C reaches every worker from the terminal (one process group); each marks its running trial interrupted and
    exits. A worker still running `grace_s` seconds later is killed.
    """
    gpus = visible_gpus()
    groups = device_groups(gpus, n_workers, devices_per_worker)
    # Each worker's torch would start one compute thread per core: N workers then oversubscribe the CPU N times over,
    # and small models slow down several-fold. Split the cores instead, unless the user chose a thread count; a
    # data-parallel trial's ranks are processes too (they inherit the count), so each of them is given a share.
    threads = str(max(1, usable_cores() // (n_workers * devices_per_worker)))
    processes = []
    launched = os.environ.get(LAUNCHED_ENV) or repr(time.time())  # `sweep run`'s own start: a stop since then counts
    for index in range(n_workers):
        worker_env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, **os.environ, **(env or {}),
                      WORKER_ENV: str(index), LAUNCHED_ENV: launched, LAUNCHER_ENV: str(os.getpid())}
        if groups:
            worker_env["CUDA_VISIBLE_DEVICES"] = groups[index]
        processes.append(subprocess.Popen([*worker_python(), "-m", "sweep", "run", *run_args], env=worker_env))
    try:
        while any(process.poll() is None for process in processes):
            raise_pending()  # Ctrl-C or SIGTERM sent to this process alone: passed on below
            time.sleep(0.2)
        raise_pending()  # signalled with its workers, which exited first (still importing, say): 130 or 143, not 1
        return [process.returncode for process in processes]
    except KeyboardInterrupt as exc:
        _note_killed(exc, _stop(processes, grace_s), grace_s)
        raise
    except BaseException as exc:  # Preempted (SIGTERM) reaches only this process: pass it on
        _note_killed(exc, _stop(processes, grace_s, signal.SIGTERM), grace_s)
        raise


def _note_killed(exc: BaseException, killed: list[int], grace_s: float) -> None:
    """Tell the launcher's last line which workers were killed (their own lines never came): `exc.killed_workers`."""
    if killed:
        with contextlib.suppress(AttributeError):  # (an exception type with __slots__ takes no note)
            exc.killed_workers = (killed, grace_s)  # type: ignore[attr-defined]


def gpus_problem(gpus: int, per_trial: int, where: str = "--gpus-per-task") -> str | None:
    """What is wrong with G GPUs per Slurm task or pod (`where`: the option or the study file's key that gave it)
    for `resources.devices_per_trial` N, or None: a launcher runs G/N workers there, so G must be whole groups of a
    trial's devices (G = 0: one worker, its ranks on the CPU)."""
    if gpus % per_trial:
        return (f"{where}: expected a multiple of resources.devices_per_trial ({per_trial}): each worker "
                f"trains its trials on {per_trial} GPUs, got {gpus}")
    return None


def device_groups(gpus: Sequence[str], n_workers: int, per_worker: int) -> list[str]:
    """Each worker's CUDA_VISIBLE_DEVICES: `per_worker` of the visible `gpus`, the next group for each worker, round
    robin (empty on a machine without GPUs: any number of workers then runs, on the CPU). Raises ValueError when
    fewer GPUs are visible than one worker needs; warns when the workers must share them."""
    if not gpus:
        return []
    if len(gpus) < per_worker:
        raise ValueError(f"resources.devices_per_trial: {per_worker} needs {per_worker} GPUs per worker, but "
                         f"{len(gpus)} are visible ({','.join(gpus)})")
    if len(gpus) < n_workers * per_worker:
        print(f"warning: {n_workers} workers with {per_worker} GPUs each need {n_workers * per_worker} GPUs, "
              f"{len(gpus)} are visible: workers share GPUs", file=sys.stderr)
    groups = len(gpus) // per_worker
    return [",".join(gpus[(k % groups) * per_worker:(k % groups + 1) * per_worker]) for k in range(n_workers)]


def _stop(processes: list[subprocess.Popen], grace_s: float, signum: int = signal.SIGINT) -> list[int]:
    """Pass `signum` on to the workers still running, as its forwarded form: a worker that a terminal's Ctrl-C has
    reached already must not take this for a second Ctrl-C (`sweep.signals.FORWARD`). Kill any still running after
    `grace_s`; returns their indices."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(FORWARD[signal.Signals(signum)])
    deadline = time.monotonic() + grace_s
    killed = []
    for index, process in enumerate(processes):
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            killed.append(index)
    for index in killed:
        with contextlib.suppress(subprocess.TimeoutExpired):
            processes[index].wait(timeout=5)
    return killed
