"""`sweep submit study.yaml --slurm`: the study's workers as one Slurm job array, written as a plain batch script.

Each array task runs the ordinary `sweep run` worker (sweep.worker) on the study's storage; the study exists before
the submission (the caller creates it), so no task creates another, and each exits when the budget is spent.

Why `sbatch` with a script we write, not submitit: the script is the contract with the cluster. Ours is one a user
could have written (`--dry-run` prints it; `scontrol write batch_script` shows the same), and preemption goes through
the path sweep already has for SIGTERM (checkpoint, mark the trial preempted, exit 143). submitit's script runs a
pickled function (its arguments, and so the storage URL, pickled on the shared disk), and it checkpoints and requeues
by a protocol of its own (USR2, `__submitit_checkpoint__`) that would duplicate ours.

Preemption and time limits:
- `--signal=B:USR1@S` asks Slurm for USR1, S seconds before the time limit, sent to the batch shell only; the
  script passes it on as SIGTERM to the worker, which checkpoints its trial, marks it preempted and exits 143, and
  then requeues its own array task (`scontrol requeue`): the task starts again later and continues the study, the
  preempted trial resuming from its checkpoint.
- A TERM from Slurm itself (preemption with PreemptMode=REQUEUE, `scontrol requeue`, `scancel`) reaches the worker
  directly; the script only waits for it. Slurm requeues what it preempts (`--requeue`); a cancelled task stays
  cancelled. A task killed without warning leaves a trial whose heartbeat stops; another worker retries it.

The storage URL may hold a password. sbatch sends its whole environment to the controller, which keeps it in its state
files (and, with accounting's job_env flag, in its database); so the URL is written to an owner-only file in the job
folder (`sweep.workers.write_storage_file`), the script and the environment name only that file, and the variables
that hold a password by convention (`PGPASSWORD`) are left out of sbatch's environment and go in the file too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, quote_plus

from sweep.outcomes import SLURM_JOBS_ATTR
from sweep.storage import clock_offset
from sweep.urls import mask_url, mask_urls, url_secrets
from sweep.workers import SECRET_ENV_NAMES, STORAGE_FILE_ENV, WORKER_ENV, worker_args, worker_python, write_storage_file
from trainer.messages import has_control
from trainer.yaml_file import short_repr

if TYPE_CHECKING:
    import optuna

    from sweep.schema import SlurmSpec, StudySpec

__all__ = ["SCRIPT_FILE", "SlurmError", "SlurmTask", "batch_script", "cancel_queued", "check_tools",
           "job_folder", "log_tail", "output_pattern", "path_problem", "record_job", "sbatch_directive", "storage_file",
           "study_tasks", "submit", "submitted_at", "summary", "task_count"]

SCRIPT_FILE = "submit.sbatch"
LOG_PATTERN = "%A_%a.log"  # array job id _ task id: one log per array task, appended to across requeues
_NO_VAL = "4294967294"  # Slurm's "no value" as an array task id
_FAILED = ("FAILED", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY", "TIMEOUT", "DEADLINE")


class SlurmError(Exception):
    """A Slurm command that is missing or failed: one line for the user."""


def storage_file(folder: Path, study_name: str, url: str) -> Path:
    """The owner-only file in the job folder that holds the storage URL (see the module's docstring), one per study
    and storage: two studies given one `log_dir`, or one study submitted to two storages, each keep their own (one
    `storage.json` for all sent every earlier job's tasks to the last submit's database, where they created their
    study anew). Named by a digest of the study's name and the URL without its password: nothing secret."""
    digest = hashlib.sha256(f"{study_name}\0{mask_url(url)}".encode()).hexdigest()[:12]
    return folder / f"storage-{digest}.json"


def job_folder(spec: StudySpec, spec_path: Path, options: SlurmSpec) -> Path:
    """Where the script, the storage file and the logs go: `launch.slurm.log_dir` (`~` expanded, as for the checkpoint
    store; relative to the study file) or NAME.slurm next to the study file. Every node must see it."""
    folder = Path(options.log_dir).expanduser() if options.log_dir else Path(f"{spec.name}.slurm")  # as the store
    return folder if folder.is_absolute() else (spec_path.parent / folder).resolve()


_SBATCH_SPECIAL = re.compile(r"[\s\\#]")


def sbatch_quoted(option: str) -> str:
    """One `#SBATCH` option as sbatch reads it back: sbatch splits a directive at whitespace and ends it at `#`, so
    a value holding either (a log folder with a space, a `--comment=two words`), or a backslash, goes in double
    quotes. A value the user quoted themselves so that sbatch reads it as one word (`--export=ALL,X="a b"`) is
    theirs, as written; one whose quotes sbatch would not (`--comment=it's`: "Unmatched `'`"; `--comment=say "hi"
    now`: split at its spaces) goes in double quotes, its own `"` and backslashes escaped, as sbatch reads them
    back (review). A trailing comment of a pasted directive (`--time=10   # ten minutes`) stays a comment, and the
    spaces after the option's name go."""
    found = re.fullmatch(r"(--?[A-Za-z][A-Za-z0-9\-]*)([= ]?)(.*)", option, re.DOTALL)
    assert found is not None, option  # the schema's `_SBATCH_LINE`, and sweep's own options
    name, sep, value = found.groups()
    value, comment = re.fullmatch(r"(.*?)((?:^|\s+)#.*)?", value.strip(), re.DOTALL).groups()  # type: ignore[union-attr]
    quoted = "\"" in value or "'" in value
    if (_one_word(value) if quoted else not _SBATCH_SPECIAL.search(value)):
        return f"{name}{sep}{value}{comment or ''}" if value else name
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'{name}{sep or "="}"{escaped}"{comment or ""}'


def _one_word(value: str) -> bool:
    """Whether sbatch reads `value` as one word: its quotes closed, no space or `#` outside them."""
    quote: str | None = None
    escaped = False
    for char in value:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif quote is not None:
            quote = None if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char.isspace() or char == "#":
            return False
    return quote is None and not escaped


def sbatch_directive(name: str, value: str) -> str:
    """One of sweep's own `#SBATCH` options, `--name=value`, whatever `value` holds: always in double quotes, with
    `"` and `\\` escaped (sbatch 22.05 reads a backslash as escaping the next character, in quotes too), so that a
    path with a quote, a space or a `#` reaches sbatch as it is. (`sbatch_quoted` leaves a user's own quotes alone.)"""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'{name}="{escaped}"'


def output_pattern(folder: Path) -> str:
    """`--output`'s value for one log per array task in `folder`: sbatch reads `%` as a replacement symbol in the
    whole path (a folder `runs-%x` would become `runs-sweep-NAME`), so the folder's own are doubled. A backslash
    would turn every replacement off (the logs would all be one file named `%A_%a.log`): `path_problem` refuses it."""
    return f"{str(folder).replace('%', '%%')}/{LOG_PATTERN}"


def path_problem(path: Path, *, logs: bool = False) -> str | None:
    """Why a batch script cannot name `path` (the job's folder, with `logs`; the working folder, the study file),
    or None."""
    text = str(path)
    if has_control(text):  # a newline would end a line of the script
        return "holds a control character, which the batch script cannot hold safely; expected a printable path"
    if logs and "\\" in text:
        return ("holds a backslash, which turns off sbatch's %A/%a in the log's path (every task would write one "
                "file); expected a path without one")
    return None


def batch_script(spec: StudySpec, spec_path: Path, options: SlurmSpec, *, url: str, folder: Path, workdir: Path,
                 timeout: float | None = None, overrides: Sequence[str] = (), python: str = sys.executable) -> str:
    """The batch script of one job array: plain, stable (no dates, nothing random: `--dry-run` prints it) and free of
    any secret."""
    for path in (folder, workdir, spec_path):  # the CLI refuses them first, in one line
        if (problem := path_problem(path, logs=path == folder)) is not None:
            raise ValueError(f"a batch script cannot hold the path {str(path)!r}: it {problem}")
    gpus, per_trial = options.gpus_per_task, spec.resources.devices_per_trial
    workers = gpus // per_trial  # one worker per `devices_per_trial` GPUs (sweep.workers.gpus_problem)
    flags = worker_python()[1:] if python == sys.executable else []  # after `cd WORKDIR`, as on this machine
    run = [python, *flags, "-m", "sweep", "run",
           *worker_args(spec_path, spec, timeout=timeout, overrides=overrides),
           *(["--workers", str(workers)] if workers > 1 else [])]
    # sweep's own options (the values are checked by the schema; the log folder is any path), then the user's.
    own = [f"--job-name=sweep-{spec.name}", f"--array=0-{options.workers - 1}",
           sbatch_directive("--output", output_pattern(folder)), "--open-mode=append", "--requeue",
           f"--signal=B:USR1@{options.warning_s}",
           *(f"--{key.replace('_', '-')}={value}" for key in ("partition", "time", "account", "qos", "mem",
                                                               "cpus_per_task")
             if (value := getattr(options, key)) is not None),
           *([f"--gres=gpu:{options.gpu_type + ':' if options.gpu_type else ''}{gpus}"] if gpus else [])]
    each = ("one worker" if not gpus else "1 GPU and its worker" if gpus == 1 else
            f"{gpus} GPUs, a worker on each" if per_trial == 1 else
            f"{gpus} GPUs, a worker on each {per_trial} (its trials data-parallel on them)")
    lines = [
        "#!/bin/bash",
        f"# Workers of study {spec.name!r}: {options.workers} array tasks, {each}; every worker is the ordinary",
        "# `sweep run` loop on the study's storage.",
        f"# Written by `sweep submit {spec_path.name} --slurm`; logs in {folder}/.",
        *(f"#SBATCH {option}" for option in own),
        *(f"#SBATCH {sbatch_quoted(option)}" for option in options.sbatch),
        "",
        "# The storage URL may hold a password: it is in this owner-only file, never in the script or the job's",
        "# environment (Slurm keeps both in its records).",
        f"export {STORAGE_FILE_ENV}={shlex.quote(str(storage_file(folder, spec.name, url)))}",
        f'export {WORKER_ENV}="$SLURM_ARRAY_TASK_ID"',
        f"cd {shlex.quote(str(workdir))}",
        "",
        "# Slurm's warning before the time limit (--signal) comes to this shell as USR1: the worker gets SIGTERM,",
        "# checkpoints its trial, marks it preempted and exits 143, and this task goes back in the queue to continue",
        "# the study. A TERM from Slurm itself (preemption, scancel, scontrol requeue) reaches the worker directly.",
        "trap 'preempted=1; kill -TERM \"$worker\"' USR1",
        "trap ':' TERM",
        f"{shlex.join(run)} &",
        "worker=$!",
        'while true; do wait "$worker"; code=$?; kill -0 "$worker" 2>/dev/null || break; done',
        'if [ "${preempted:-0}" = 1 ]; then',
        '    scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
        "fi",
        'exit "$code"',
        ""]
    return "\n".join(lines)


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SlurmError(f"{name} not found: run `sweep submit --slurm` on a machine with Slurm's commands (a login "
                         "node), or use --dry-run to see the script")
    return path


def check_tools() -> None:
    """Raise SlurmError unless sbatch, scontrol and scancel are on PATH (before the study is created)."""
    for name in ("sbatch", "scontrol", "scancel"):
        _tool(name)


def _clean_environment(url: str) -> dict[str, str]:
    """This process's environment for sbatch, which hands it to the job and keeps it in Slurm's records: without the
    variables that hold a password, nor any whose value holds one of the URL's secrets or theirs (review: with the
    password in PGPASSWORD, not in the URL, a DB_PASSWORD or DATABASE_URL holding it reached sbatch)."""
    secrets = set(url_secrets(url))
    for name in SECRET_ENV_NAMES:
        value = os.environ.get(name, "")
        if "://" in value:  # a storage URL (SWEEP_STORAGE_URL)
            secrets.update(url_secrets(value))
        elif value:  # a password or token as it is, and as a URL holds it
            secrets.update({value, quote(value, safe=""), quote_plus(value), quote(value)})
    # A password of a few characters is found inside unrelated values (PATH): those are kept, a value that is the
    # password is not, nor one that holds it where a URL or a keyword list does (`:pw@`, `password=pw`: review, a
    # variable holding the whole URL of a 3-character password reached sbatch).
    # A short one is taken where a value gives it to a key: after `:` or `=` (a quote and spaces between allowed:
    # `password='pw'`, JSON's `"password": "pw"`), up to the value's end or a separator.
    given = [re.compile(r"[:=]\s*['\"]?" + re.escape(secret) + r"(?=$|[@&\s;,'\"}\]])") for secret in secrets]
    # A list of absolute paths (PATH, PYTHONPATH, a virtual environment's folder) holds no password: one whose
    # letters a folder's name holds (PGPASSWORD=sweep, ~/sweep/.venv/bin) dropped PATH from the job (diff review).
    return {name: value for name, value in os.environ.items()
            if name not in SECRET_ENV_NAMES and value not in secrets
            and (_path_list(value) or (not any(secret in value for secret in secrets if len(secret) >= 4)
                                       and not any(pattern.search(value) for pattern in given)))}


def _path_list(value: str) -> bool:
    """Whether `value` is one or more absolute paths, `os.pathsep` between them."""
    parts = value.split(os.pathsep)
    return any(parts) and all(part.startswith("/") and "@" not in part and "=" not in part for part in parts if part)


SBATCH_TIMEOUT_S = 120.0  # how long sbatch may take to answer (a busy controller takes seconds)
QUERY_TIMEOUT_S = 60.0  # scontrol's and scancel's


def _run(argv: list[str], timeout: float, **options: Any) -> subprocess.CompletedProcess[str]:
    """A Slurm command's run; one that does not end within `timeout` seconds (a controller that does not answer) is
    a `SlurmError` naming it, not a traceback (review: a hung sbatch left a new study's files behind)."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **options)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{Path(argv[0]).name} did not answer within {timeout:g} s (is the Slurm controller "
                         "reachable?)") from None


def submit(script: str, url: str, folder: Path, *, study_name: str, workdir: Path) -> str:
    """Write the storage file and the script into `folder`, submit the script with sbatch and return the job id."""
    folder.mkdir(parents=True, exist_ok=True)
    write_storage_file(storage_file(folder, study_name, url), url)
    path = folder / SCRIPT_FILE
    path.write_text(script)
    done = _run([_tool("sbatch"), "--parsable", str(path)], SBATCH_TIMEOUT_S, cwd=workdir, env=_clean_environment(url))
    if done.returncode != 0:
        detail = mask_urls(done.stderr.strip()).splitlines()
        raise SlurmError(f"sbatch refused the job ({done.returncode}): {detail[-1] if detail else 'no message'}")
    job_id = done.stdout.strip().split(";")[0]
    if not job_id.isdigit():  # an option that submits nothing: no job to record, watch or cancel
        said = mask_urls((done.stdout.strip() or done.stderr.strip() or "nothing").splitlines()[-1])
        raise SlurmError(f"sbatch submitted no job (it printed {short_repr(said)} where a job id was expected)")
    return job_id


def record_job(study: optuna.Study, job_id: str, options: SlurmSpec, folder: Path, submitted_at: float) -> None:
    """Remember the job array on the study, for `sweep status` and `sweep stop` on any machine; `submitted_at` (a
    time.time() taken before sbatch was called) is when its tasks count a `sweep stop` from (`submitted_at`)."""
    jobs = list(study.user_attrs.get(SLURM_JOBS_ATTR, []))
    submitted_at += clock_offset(study._storage)  # noqa: SLF001 - by the storage's clock: tasks run on other machines
    jobs.append({"job_id": job_id, "tasks": options.workers, "log_dir": str(folder), "submitted_at": submitted_at})
    study.set_user_attr(SLURM_JOBS_ATTR, jobs)


def submitted_at(study: optuna.Study, environ: Mapping[str, str] = os.environ) -> float | None:
    """When the Slurm job array this process is a task of was submitted, if it is one of the study's: a `sweep stop`
    since then stops its tasks, also one that starts again later (requeued after its time-limit warning, preempted by
    Slurm, `scontrol requeue`), not only the tasks running at the time of the stop. None outside a job of the study
    (or while `sweep submit` has yet to record it)."""
    job = environ.get("SLURM_ARRAY_JOB_ID")
    if not job:
        return None
    times = [float(record["submitted_at"]) for record in study.user_attrs.get(SLURM_JOBS_ATTR, [])
             if isinstance(record, dict) and str(record.get("job_id")) == job
             and isinstance(record.get("submitted_at"), (int, float))]
    # By this machine's clock, as its own start is (stored by the storage's: the submitting machine's may differ).
    return None if not times else min(times) - clock_offset(study._storage)  # noqa: SLF001


@dataclasses.dataclass(frozen=True)
class SlurmTask:
    """One array task (or, while they wait together, several: `task` is then a range such as `1-2`)."""

    job_id: str
    task: str
    state: str  # Slurm's JobState: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...; UNKNOWN when Slurm forgot it
    restarts: int  # times it was requeued
    exit_code: str
    reason: str
    log: Path | None  # its log file, once it has started

    @property
    def failed(self) -> bool:
        return self.state in _FAILED or (self.state == "COMPLETED" and self.exit_code not in ("0:0", ""))

    @property
    def label(self) -> str:
        """queued, running, requeued (queued again after a preemption), failed, done, or Slurm's state."""
        if self.state == "PENDING":
            return "requeued" if self.restarts else "queued"
        if self.state == "REQUEUED":
            return "requeued"
        if self.failed:
            return "failed"
        return {"RUNNING": "running", "COMPLETED": "done", "COMPLETING": "finishing"}.get(self.state,
                                                                                         self.state.lower())


_PAIR = re.compile(r"(\w[\w/:]*)=(\S*)")


def _job_records(job_id: str) -> list[dict[str, str]]:
    """The job's array tasks as `scontrol show job` gives them; once the controller has forgotten the job (MinJobAge
    after its end, 300 s by default), as accounting (`sacct`) remembers them, where the cluster keeps it."""
    done = _run([_tool("scontrol"), "show", "job", "--oneliner", job_id], QUERY_TIMEOUT_S)
    if done.returncode == 0:
        return [dict(_PAIR.findall(line)) for line in done.stdout.splitlines() if line.strip()]
    # "Invalid job id": finished and purged, or submitted to another cluster
    return _accounted_records(job_id)


def _accounted_records(job_id: str) -> list[dict[str, str]]:
    """The job's array tasks from Slurm's accounting, in `scontrol`'s field names; [] without sacct or accounting."""
    sacct = shutil.which("sacct")
    if sacct is None:
        return []
    try:
        done = subprocess.run([sacct, "--jobs", job_id, "--array", "--allocations", "--noheader", "--parsable2",
                               "--format=JobID,State,ExitCode"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_sacct(job_id, done.stdout) if done.returncode == 0 else []


def parse_sacct(job_id: str, text: str) -> list[dict[str, str]]:
    """`sacct --parsable2 --format=JobID,State,ExitCode` lines of job array `job_id` (`123_4|FAILED|1:0`, `123_[5-7]
    |CANCELLED by 0|0:0`) as `scontrol`'s records; Slurm's accounting keeps no requeue count, so `Restarts` is 0."""
    records = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) < 3 or not fields[0].startswith(f"{job_id}_"):
            continue
        task = fields[0][len(job_id) + 1:].strip("[]")
        if not re.fullmatch(r"[\d,\-%]+", task):
            continue
        records.append({"ArrayTaskId": task, "JobState": (fields[1].split() or ["UNKNOWN"])[0],
                        "ExitCode": fields[2], "Restarts": "0", "Reason": "None"})
    return records


def _logged_tasks(job_id: str, folder: Path) -> dict[int, Path]:
    """The logs of job `job_id`'s array tasks left in `folder`, by task id."""
    found = {}
    with contextlib.suppress(OSError):
        for path in folder.glob(f"{glob.escape(job_id)}_*.log"):
            task = path.name[len(job_id) + 1:-len(".log")]
            if task.isdigit():
                found[int(task)] = path
    return found


def study_tasks(study: optuna.Study) -> list[SlurmTask]:
    """Every array task of the study's Slurm jobs as Slurm sees it now; a job Slurm no longer knows is one task of
    state UNKNOWN, with the logs left in its folder."""
    tasks = []
    for job in study.user_attrs.get(SLURM_JOBS_ATTR, []):
        job_id, folder = str(job["job_id"]), Path(job["log_dir"])
        records = _job_records(job_id)
        if not records:  # forgotten: each task that started left its log (what became of it is there)
            logged = _logged_tasks(job_id, folder)
            forgotten = "no longer known to Slurm (finished long ago?)"
            tasks += [SlurmTask(job_id, str(task), "UNKNOWN", 0, "", forgotten, log)
                      for task, log in sorted(logged.items())]
            if rest := _ranges(sorted(set(range(int(job["tasks"]))) - set(logged))):
                tasks.append(SlurmTask(job_id, rest, "UNKNOWN", 0, "", f"{forgotten}; no log", None))
            continue
        seen = {int(r["ArrayTaskId"]) for r in records if r.get("ArrayTaskId", "").isdigit()
                and r["ArrayTaskId"] != _NO_VAL}
        for record in records:
            task = record.get("ArrayTaskId", "0")
            if task == _NO_VAL:  # the tasks that never left the queue, once they are all cancelled: Slurm drops
                task = _ranges(sorted(set(range(int(job["tasks"]))) - seen))  # their ids, we know them
                if not task:
                    continue
            log = folder / f"{job_id}_{task}.log"
            tasks.append(SlurmTask(job_id, task, record.get("JobState", "UNKNOWN"), int(record.get("Restarts", 0)),
                                   record.get("ExitCode", ""), record.get("Reason", "None"),
                                   log if log.exists() else None))
    return sorted(tasks, key=lambda t: (t.job_id, int(re.split(r"\D", t.task)[0] or 0)))


def log_tail(path: Path, lines: int = 5) -> list[str]:
    """The last lines of a worker's log, with any URL's password masked."""
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - 8192))
            text = handle.read().decode(errors="replace")
    except OSError:
        return []
    return [mask_urls(line) for line in text.splitlines()[-lines:]]


def cancel_queued(study: optuna.Study) -> list[str]:
    """Cancel the array tasks of the study's jobs that wait in the queue (running ones finish their trial on `sweep
    stop`'s request); returns the job ids asked."""
    jobs = [str(job["job_id"]) for job in study.user_attrs.get(SLURM_JOBS_ATTR, [])]
    if jobs:
        done = _run([_tool("scancel"), "--state=PENDING", *jobs], QUERY_TIMEOUT_S)
        if done.returncode != 0 and "Invalid job id" not in done.stderr:
            raise SlurmError(f"scancel failed ({done.returncode}): {done.stderr.strip()}")
    return jobs


def _ranges(ids: Sequence[int]) -> str:
    """`[1, 2, 3, 5]` as Slurm writes it: `1-3,5`."""
    parts: list[str] = []
    for index in ids:
        if parts and index == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{index}"
        else:
            parts.append(str(index))
    return ",".join(parts)


def task_count(task: str) -> int:
    """How many array tasks an `ArrayTaskId` names: `3`, `1-2`, `0-9%4` (at most 4 at once), `1,3-4`."""
    count = 0
    for part in task.split("%")[0].split(","):
        low, _, high = part.partition("-")
        count += int(high) - int(low) + 1 if high else 1
    return count


def summary(tasks: Sequence[SlurmTask]) -> dict[str, int]:
    """Counts of array tasks by label (queued, running, requeued, failed, done, ...)."""
    counts: dict[str, int] = {}
    for task in tasks:
        counts[task.label] = counts.get(task.label, 0) + task_count(task.task)
    return counts
