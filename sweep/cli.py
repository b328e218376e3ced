"""`sweep`: the command line. Thin on purpose: parse, call library functions, print.

Exit codes: 0 success; 1 a runtime problem (storage unreachable, nothing to show, a run whose every finished trial
failed); 2 bad input (study file, arguments, a study that exists with a different definition, a file that is no study
database); 130 interrupted (Ctrl-C); 143 preempted (SIGTERM).

Each command imports the library it needs when it runs, not when this module loads: `sweep --help`, `status` and
`trials` never import torch, and `--help` not even Optuna.
"""

from __future__ import annotations

import contextlib
import csv
import io
import ipaddress
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import sys
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import yaml
from rich.console import Console
from rich.table import Column, Table
from typer.core import TyperGroup

from sweep.schema import (
    StudyFileError,
    folder_problem,
    long_name_problem,
    name_problem,
    override_key,
    read_spec,
    resolve_storage_url,
    sqlite_file_problem,
    sqlite_study_problem,
    sqlite_write_problem,
    storage_url_problem,
)
from sweep.signals import interrupted_at_start
from sweep.streams import guard_streams, output_failure
from sweep.urls import expand_home, mask_url, mask_urls, redact, sqlite_path, sqlite_url
from trainer.messages import has_control
from trainer.yaml_file import printable, short_repr

# click's exception classes, wherever this typer takes click from (its own vendored copy, or click itself).
_CLICK_ERROR: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class _Commands(TyperGroup):
    """The command group, with click's own usage errors (an unknown option or command, a value of the wrong type, a
    missing argument) as one line naming the command, like every other bad input, rather than a boxed panel."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: Any) -> Any:
        prog_name = "sweep"  # also as `python -m sweep.cli`: messages name the command users type
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        except _CLICK_ERROR as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # `sweep` alone: the help, as before
                exc.show()
            else:
                ctx = getattr(exc, "ctx", None)
                command = ctx.command_path if ctx is not None else "sweep"
                message = exc.format_message().rstrip('.')
                if type(exc).__name__ == "NoSuchOption" and re.fullmatch(r"-\d[\d.e+-]*", exc.option_name or ""):
                    message = (f"{exc.option_name}: a negative number is read as an option, and no option has that "
                               "name; trial numbers count from 0")  # `sweep reproduce study.yaml -1`
                err.print(f"error: {command}: {message} (see {command} --help)", markup=False)
            code = exc.exit_code
        except typer.Abort:
            err.print("error: aborted", markup=False)
            code = 1
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(cls=_Commands, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Hyperparameter sweeps for neural-network research: Optuna studies of PyTorch trials.")
# Piped output (a file, CI, `less`) has no width: let tables be as wide as they need rather than 80 columns, unless
# COLUMNS says how wide.
out = Console(highlight=False, emoji=False, markup=False,
              width=None if (sys.stdout is not None and sys.stdout.isatty()) or os.environ.get("COLUMNS") else 240)
err = Console(stderr=True, highlight=False, emoji=False, markup=False, soft_wrap=True)

StorageOpt = Annotated[Optional[str], typer.Option("--storage", help="Storage URL (sqlite:///file.db, "
                                                   "postgresql+psycopg://...); overrides the study file's.")]
NameOpt = Annotated[Optional[str], typer.Option("--study-name", help="Study name; overrides the study file's.")]
TrustOpt = Annotated[bool, typer.Option("--trust-task", help="Import the task (and curriculum schedule) the database "
                                        "names even when no study file on the command line names it: whoever can "
                                        "write the database chooses that code.")]


def _fail(lines: list[str] | str, code: int) -> typer.Exit:
    """Print each line as an error (any URL in it masked: a storage URL given where a study file, a study name or a
    target was expected is echoed back) and return the exit to raise."""
    for line in [lines] if isinstance(lines, str) else lines:
        err.print(f"error: {printable(mask_urls(line))}", markup=False)
    return typer.Exit(code)


def _protected_files(study_file: str | Path | None, url: str | None) -> list[Path]:
    """What an `-o` file must never be: the study file and the study's SQLite database with its companions (its
    write-ahead log, shared memory, rollback journal and sweep's ask lock)."""
    from sweep.urls import sqlite_path

    files = [Path(study_file)] if study_file and Path(study_file).is_file() else []
    database = sqlite_path(url) if url is not None else None
    if database is not None:
        files += [database, *(database.with_name(database.name + suffix)
                              for suffix in ("-wal", "-shm", "-journal", ".lock"))]
    return files


def _precious_kind(output: Path) -> str | None:
    """What an existing `-o` file is that no command's output may replace, or None: a SQLite database, or a study
    file (review: `sweep best s.db -o s.yaml` wrote a config over the study file it was given no word of)."""
    try:
        if not output.is_file():
            return None
        with output.open("rb") as handle:
            head = handle.read(1 << 20)
    except OSError:
        return None
    if head.startswith(b"SQLite format 3\x00"):
        return "a SQLite database"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return None
    # A study file by its top-level keys, whatever its name ends in (`sweep run` takes any) and even mid-edit (one
    # YAML cannot read yet); not a page (a report shows its study's definition).
    keys = ("name", "n_trials")
    if not text.lstrip().startswith("<") and all(re.search(rf"(?m)^{key}[ \t]*:", text) for key in keys):
        return "a study file"
    return None


def _output_problem(output: Path, protected: Sequence[Path] = ()) -> str | None:
    """What is wrong with `-o FILE` before anything is read or written, or None: a folder, '', a folder that does not
    exist or cannot be written, and the study's own files (writing there would destroy the study)."""
    if str(output) == ".":  # also what an empty `-o ''` becomes
        return "-o: '.' (or '') is the current folder; expected a file to write"
    if problem := long_name_problem(output):
        return f"-o: {problem}"
    if has_control(str(output)):  # `best`'s header would break out of its comment
        return f"-o: the path {short_repr(str(output))} holds a control character; expected a printable file name"
    if output.is_dir():
        return f"-o: {output} is a folder; expected a file to write, such as {output / 'out'}"
    resolved = output.resolve()
    for path in protected:
        same = resolved == path.resolve() or (output.exists() and path.exists() and os.path.samefile(output, path))
        if same:
            what = "the study file" if path.suffix in (".yaml", ".yml") else "the study's database"
            if path.name.endswith(("-wal", "-shm", "-journal", ".lock")):
                what = "a file of the study's database"
            return f"-o: {output} is {what}; writing there would destroy the study: choose another file"
    if (kind := _precious_kind(output)) is not None:  # the study file or database of a study not named as TARGET
        return f"-o: {output} is {kind}; writing there would destroy it: choose another file"
    folder = resolved.parent
    shown = output.parent if output.parent.resolve() == folder else f"{folder} (where the link {output} points)"
    if not folder.is_dir():
        above = next((p for p in [folder, *folder.parents] if p.exists()), None)
        if above is not None and not above.is_dir():
            return f"-o: {above} is a file, not a folder; expected a file to write in a folder"
        return f"-o: the folder {shown} does not exist; create it first"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"-o: cannot write {output}: the folder {shown} is not writable"
    if output.exists() and not os.access(output, os.W_OK):
        return f"-o: cannot write {output}: permission denied"
    return None


def _write_output(output: Path, text: str) -> None:
    """Write `-o FILE` whole or not at all: a temporary file beside it, then renamed over it (never a half-written
    file, nor a temporary one left behind). Through a symbolic link, the file it points to is written (the link
    stays a link); a FIFO or a device (`-o /dev/stdout`, `-o /dev/null`) is written to, never renamed over."""
    if output.exists() and (not output.is_file() or _a_stream(output)):
        try:  # appended: `-o /dev/stdout >> log.txt` keeps what the log held (its descriptor is in append mode)
            with output.open("a") as handle:
                handle.write(text)
        except OSError as exc:
            raise _fail(f"-o: cannot write {output}: {exc.strerror or exc}", 1) from None
        return
    if output.is_symlink():
        output = output.resolve()
    tmp: Path | None = None
    try:  # a name of its own, so that a file of the user's beside it (out.yaml.tmp) is never written over
        tmp = output.with_name(f".{output.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any new file
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
        tmp.replace(output)
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise _fail(f"-o: cannot write {output}: {exc.strerror or exc}", 1) from None


def _a_stream(output: Path) -> bool:
    """Whether `output` names one of this process's streams rather than a file: a path under /dev or /proc, or a
    link into them (`/dev/stdout` -> `/proc/self/fd/1`, which may stand for a regular file the shell opened)."""
    path = output.absolute()
    for _ in range(40):  # links followed one at a time: resolving would land on the file behind the descriptor
        if str(path).startswith(("/dev/", "/proc/")):
            return True
        if not path.is_symlink():
            return False
        path = (path.parent / os.readlink(path)).absolute()
    return False


def _quiet_optuna() -> None:
    """Libraries' messages that ask nothing of the user stay out of the way: Optuna's per-trial info lines, Alembic's
    migrations (MLflow's store announces its own too), and the "experimental" label of features sweep relies on (its
    artifacts, its pruners)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for name in ("alembic", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.showwarning = _show_warning


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    """A warning as one line for the user ("warning: ..."), not Python's two with a source path and line."""
    from sweep.workers import WORKER_ENV

    prefix = f"[worker {os.environ[WORKER_ENV]}] " if WORKER_ENV in os.environ else ""
    err.print(f"{prefix}warning: {message}", markup=False)


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """`name` set to `value` in os.environ for the block, and as it was afterwards."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@app.command()
def run(
    study_file: Annotated[str, typer.Argument(metavar="STUDY_FILE", help="The study file (YAML).")],
    storage: StorageOpt = None,
    n_trials: Annotated[Optional[int], typer.Option("--n-trials", help="The study's total budget (>= 1).")] = None,
    timeout: Annotated[Optional[float], typer.Option("--timeout", help="Stop this run after S seconds (> 0).")] = None,
    study_name: NameOpt = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a study-file key: "
                                                      "--set fixed.max_steps=200 --set n_trials=5.")] = None,
    workers: Annotated[int, typer.Option("--workers", help="Worker processes sharing the study; on a GPU "
                                         "machine each is pinned to a GPU, round robin.")] = 1,
    cohort: Annotated[Optional[str], typer.Option("--cohort", help="Trials each worker trains at once as one "
                                                  "stacked model (K, or auto); overrides execution.cohort.")] = None,
) -> None:
    """Create or resume the study and run trials until its n_trials are used. Exits 1 when every trial it finished
    failed."""
    from sweep.signals import Preempted, graceful_signals, stop_requested
    from sweep.workers import LAUNCHED_ENV

    # From the first line: a Ctrl-C or SIGTERM while torch imports and the study opens is a request, honoured once the
    # run begins (Python's own KeyboardInterrupt could land in a garbage-collection callback and be dropped, and the
    # run then trained its whole budget). So is a `sweep stop` given from now on (torch importing, the study opening,
    # a launcher's workers starting): the workers count from this moment, a launched one from its launcher's.
    began: list[bool] = []  # the run itself began (`_run_outcomes` says what became of its trials)
    with _environment(LAUNCHED_ENV, os.environ.get(LAUNCHED_ENV) or repr(time.time())), graceful_signals():
        from sweep.storage import StorageUnavailable  # Optuna's import: a Ctrl-C meanwhile is a request too

        try:
            _run(study_file, storage, n_trials, timeout, study_name, set_, workers, cohort, began)
        except (KeyboardInterrupt, Preempted, StorageUnavailable) as exc:  # asked twice, or while the storage was
            # waited for, outside the run itself (while it starts, or as it reports its end)
            stop = exc if not isinstance(exc, StorageUnavailable) else (kind() if (kind := stop_requested()) else None)
            worker = os.environ.get("SWEEP_WORKER")
            if stop is None and isinstance(exc, StorageUnavailable):  # gone too long: one line, as within the run
                raise _fail(f"{'' if worker is None else f'[worker {worker}] '}{exc}", 1) from None
            if stop is None:
                raise
            code, what = _stopped(stop)
            when = "" if began else " before the run began; no trial was started"
            err.print(f"{'' if worker is None else f'[worker {worker}] '}{what}{when}: rerun the same command to "
                      "continue.", markup=False)
            raise typer.Exit(code) from None


def _run(study_file: str, storage: str | None, n_trials: int | None, timeout: float | None, study_name: str | None,
         set_: list[str] | None, workers: int, cohort: str | None, began: list[bool]) -> None:
    from sweep import results
    from sweep.outcomes import budget_counts
    from sweep.signals import raise_pending
    from sweep.storage import release_idle_connections
    from sweep.workers import LAUNCHED_ENV, LAUNCHER_ENV, WORKER_ENV, run_local_workers, storage_from_environment

    if cohort is not None:  # the same as --set execution.cohort=K, so the local workers get it too
        if cohort != "auto" and not (cohort.isascii() and cohort.isdigit() and int(cohort) >= 1):
            raise _fail(f"--cohort: expected a whole number >= 1 or auto, got {cohort!r}", 2)
        set_ = [*(set_ or []), f"execution.cohort={json.dumps(cohort) if cohort == 'auto' else int(cohort)}"]

    worker = os.environ.get(WORKER_ENV)
    if worker is not None and storage is None:  # a launched worker: the URL comes by environment, never by argument
        try:
            storage = storage_from_environment()
        except (OSError, ValueError) as exc:
            raise _fail(f"cannot read the storage URL its launcher left: {exc}", 2) from None
    source = _study_file_argument(study_file)
    spec, url = _run_spec(source, storage, study_name, n_trials, timeout, workers, set_ or [])
    workers = min(workers, spec.n_trials)  # a worker beyond the budget would find no trial to train
    prefix = "" if worker is None else f"[worker {worker}] "
    # Where a URL with a bad option came from: the file's key, or the `--set` that replaced it (`--storage`: itself).
    overridden = any(item.partition("=")[0].strip() == "storage" for item in set_ or [])
    url_from = "" if storage or spec.storage != url else "--set storage: " if overridden else f"{source}: storage: "
    study = _open_for_run(spec, url, prefix, source, url_from)
    from sweep.launch.slurm import submitted_at

    if (submitted := submitted_at(study)) is not None:  # a task of the study's Slurm job: a stop since its submission
        os.environ[LAUNCHED_ENV] = repr(min(float(os.environ[LAUNCHED_ENV]), submitted))  # counts, requeued or not
    raise_pending()  # asked to stop while it started: no worker, no trial (`run` says so)
    with _run_outcomes(study, prefix, workers):
        began.append(True)
        if workers > 1:
            err.print(f"{workers} worker processes on this machine", markup=False)
            before, started = results.trial_states(study), float(os.environ[LAUNCHED_ENV])  # a stop since counts
            release_idle_connections()  # the workers need the server's connection slots; it reconnects after them
            launched = time.monotonic()  # not `started`: a Slurm task's may be its submission, long queued
            try:
                codes = run_local_workers(Path(study_file), spec, url, workers, timeout=timeout, overrides=set_ or [])
            except ValueError as exc:  # fewer GPUs than one trial needs
                raise _fail(str(exc), 2) from None
            _print_status(study)
            used, running = budget_counts(study.get_trials(deepcopy=False))
            # A worker preempted on its own (SIGTERM to it alone: 143, or its default death before its handler) while
            # the others spent the budget, its queued trial too: the study is done, and the run says so (review: a
            # lone preempted worker made a finished run exit 1, and `sweep run ... && sweep best` stop there).
            preempted = {k for k, code in enumerate(codes) if code in (143, -signal.SIGTERM)}
            lost = [f"worker {k} {_exit_words(code)}" for k, code in enumerate(codes)
                    if code != 0 and (k not in preempted or used < spec.n_trials or len(preempted) == len(codes))]
            if lost:
                raise _fail(lost, 1)
            others = "the other worker" if len(codes) - len(preempted) == 1 else "the other workers"
            for k in sorted(preempted):
                err.print(f"worker {k} stopped on a SIGTERM (exit code {codes[k]}); {others} spent the budget",
                          markup=False)
            stopped = results.stop_requested_since(study, started)
            if stopped:
                err.print(_stop_line(used, spec.n_trials))
            elif (limit := timeout if timeout is not None else spec.timeout) is not None and used < spec.n_trials \
                    and time.monotonic() - launched >= limit:  # the file's timeout, which the workers read too
                # The workers stopped at the timeout, each saying so for its trials: the line one process prints too.
                err.print(f"stopped by the timeout with {used}/{spec.n_trials} trials done; rerun to continue.")
            elif used + running < spec.n_trials:
                # Every worker ended well, neither stopped nor timed out, with budget no trial holds: a worker ends
                # so only when its sampler has tried every point (review: the line one process prints was missing).
                err.print(_exhausted_line(used, spec.n_trials))
            failed = None if stopped else results.failed_run(results.finished_since(study, before))
            if failed:
                raise _fail(failed, 1)
            return
        summary, counts = _run_here(study, spec, url, timeout, prefix, live=worker is None)
    if worker is not None:  # a local launcher's worker: its parent prints the summary once, and decides the exit code
        if LAUNCHER_ENV in os.environ:
            return
        if summary.stopped:  # a Slurm task has no parent to say it: its log does
            err.print(prefix + _stop_line(summary.budget_used, summary.n_trials, "the study resumes with the next "
                                          "`sweep run` or `sweep submit`"), markup=False)
        # A Slurm array task or a pod has no parent: it decides its own exit code, as one `sweep run` does (its
        # every trial failed: Slurm's FAILED, which `sweep status` shows with the log's end; it exited 0, "done").
        if not summary.stopped and (failed := results.failed_run(counts)):
            raise _fail(prefix + failed, 1)
        return
    _print_status(study)
    for flag, message in (("stopped", _stop_line(summary.budget_used, summary.n_trials)),
                          ("exhausted", _exhausted_line(summary.budget_used, summary.n_trials)),
                          ("timed_out", f"stopped by the timeout with {summary.budget_used}/{summary.n_trials} "
                                        "trials done; rerun to continue.")):
        if getattr(summary, flag):
            err.print(message)
    failed = None if summary.stopped else results.failed_run(counts)
    if failed:
        raise _fail(failed, 1)


def _exhausted_line(used: int, n_trials: int) -> str:
    return f"the sampler has tried every point of the search space; stopped with {used}/{n_trials} trials done."


def _stop_line(used: int, n_trials: int, resume: str = "rerun the same command to continue") -> str:
    """What a run that `sweep stop` ended says: how to continue, unless the budget is spent already."""
    if used >= n_trials:
        return f"stopped by `sweep stop` with the budget spent ({used}/{n_trials} trials done)."
    return f"stopped by `sweep stop` with {used}/{n_trials} trials done; {resume}."


def _study_file_argument(study_file: str) -> Path:
    """The study file argument as a path; '' is refused (as a path it would be the current folder)."""
    if not study_file:
        raise _fail("STUDY_FILE: expected a study file (YAML), got ''", 2)
    return Path(study_file)


def _run_spec(study_file: Path, storage: str | None, study_name: str | None, n_trials: int | None,
              timeout: float | None, workers: int, set_: list[str]) -> tuple[Any, str]:
    """The validated spec and the storage URL of `sweep run`, every problem of the options and the file reported
    together (exit 2), and nothing created before they are all fine."""
    from sweep.spec import InertPruner, RangeInFixed, load_spec, store_problems
    from sweep.workers import LAUNCHER_ENV

    warnings.showwarning = _show_warning  # the file's warnings, as one line each
    if LAUNCHER_ENV in os.environ:  # the launcher, which read the same file, said them
        warnings.simplefilter("ignore", RangeInFixed)
        warnings.simplefilter("ignore", InertPruner)
    problems = _option_problems(storage=storage, study_name=study_name, n_trials=n_trials, timeout=timeout,
                                workers=workers)
    for option, value, key in (("--study-name", study_name, "name"), ("--n-trials", n_trials, "n_trials"),
                               ("--timeout", timeout, "timeout"), ("--storage", storage, "storage")):
        if value is not None and key in (override_key(item) for item in set_):  # one would silently win (review)
            problems.append(f"--set {key} and {option} both set {key}; keep one of them")
    options_ok = not problems
    overrides = [*set_, *(_name_override(study_name) if options_ok else []),
                 *([f"n_trials={n_trials}"] if n_trials is not None and options_ok else [])]
    given = [override_key(item) for item in set_]  # a problem of theirs is the command line's

    def lines(found: list[tuple[str, str]]) -> list[str]:  # as the user gave them, named where they come from
        return StudyFileError(study_file, found).lines(given)

    try:
        spec, spec_path = load_spec(study_file, overrides)
    except StudyFileError as exc:  # the file's, or the command line's (a --set that does not parse)
        raise _fail([*problems, *exc.lines(given)], 2) from None
    if problems:
        raise _fail(problems, 2)
    try:
        url = resolve_storage_url(spec, spec_path, storage)
    except StudyFileError as exc:  # named as the user gave it, like the file's other problems
        raise _fail(lines(exc.problems), 2) from None
    from sweep.registry import resolve_store
    from sweep.tracking import destination_problems, resolve_tracking

    # Before anything is created: a SQLite file that cannot be one, a checkpoint folder that cannot be made.
    problem = sqlite_file_problem(url) or sqlite_write_problem(url)
    problems = ([] if problem is None else [f"--storage: {problem}"] if storage is not None
                else lines([("storage", problem)]))
    if problems and not (sqlite_path(url) or Path("x")).name:  # `.` or `/`: nothing can be named after it
        raise _fail(problems, 2)
    spec = resolve_tracking(resolve_store(spec, spec_path, url), spec_path, url)
    problems += lines(store_problems(spec, url) + destination_problems(spec, url))
    if problems:
        raise _fail(problems, 2)
    return spec, url


def _open_for_run(spec: Any, url: str, prefix: str, source: Path, url_from: str = "") -> Any:
    """Create or resume the study behind the storage boundary, whose outage lines go to stderr. A checkpoint folder
    another study of this name writes in is refused before any trial runs, and before a new study is created."""
    from sweep.blobs import claim_problem
    from sweep.checkpoints import store_folder_gone
    from sweep.outcomes import OWNER_ATTR
    from sweep.registry import default_store
    from sweep.signals import stop_requested
    from sweep.storage import StorageUnavailable, ask_lock, database_identity, in_rollback_mode
    from sweep.study import (
        StoreMismatchError,
        StudyMismatchError,
        open_study,
        refuse_another_tools_study,
        worker_storage,
    )
    from sweep.tracking import tensorboard_root
    from sweep.workers import prepare_process

    _OPENED[:] = [url]
    prepare_process(spec)
    _quiet_optuna()
    notify = lambda line: err.print(f"{prefix}{line}", markup=False)
    location = spec.checkpoints.store or default_store(url)

    tensorboard = tensorboard_root(spec.tracking, url) if spec.tracking.tensorboard.enabled else None
    tensorboard_key = f"tracking.tensorboard{'.dir' if spec.tracking.tensorboard.dir is not None else ''}"

    def refuse_a_folder_another_owns(exists: Callable[[], bool]) -> None:
        """A study about to be created owns no folder yet: one with an owner is another's. Asked again before
        refusing: a worker that created the study meanwhile has claimed the folder for it."""
        if spec.checkpoints.enabled and not exists() and (problem := _store_claim_problem(
                spec.name, None, location, url, claim=False)) and not exists():
            raise _fail(f"{prefix}{source}: checkpoints.store: {problem}", 2)
        if tensorboard is not None and not exists() and (problem := claim_problem(
                tensorboard, spec.name, None, claim=False, new=True, kind="tensorboard")) and not exists():
            raise _fail(f"{prefix}{source}: {tensorboard_key}: {problem}", 2)

    def refuse_folders(study: Any) -> None:
        """The study's checkpoint and TensorBoard folders, claimed for it, or the run refused: for a study that
        existed, before its latest definition is stored (`open_study`'s `before_update`)."""
        if spec.checkpoints.enabled and (gone := store_folder_gone(url, str(location), study.study_name,
                                                                  shlex.quote(str(source)),
                                                                  donors=spec.warm_start.enabled)):
            raise _fail(f"{prefix}{source}: {gone}", 1)  # before the claim makes the folder anew, empty
        if spec.checkpoints.enabled and (problem := _store_claim_problem(
                study.study_name, study.user_attrs.get(OWNER_ATTR), location, url, claim=True)):
            raise _fail(f"{prefix}{source}: checkpoints.store: {problem}", 2)
        if tensorboard is not None and (problem := claim_problem(
                tensorboard, study.study_name, study.user_attrs.get(OWNER_ATTR), claim=True, kind="tensorboard")):
            raise _fail(f"{prefix}{source}: {tensorboard_key}: {problem}", 2)

    if (database := sqlite_path(url)) is not None:
        refuse_a_folder_another_owns(database.exists)  # before the SQLite file is made
    made_here = database is not None and not database.exists()
    # On a server database the study is compared with the file and its folders claimed in one turn of the study's
    # lock: two workers opening a new study at once from two folders (two machines' checkouts on one PostgreSQL
    # server) each found no folder of the other's yet, both ran, each with its own checkpoint store, and a later run
    # from one took the other's checkpoint rows for missing files and deleted them. In turn, the second finds the
    # first's folder. (A SQLite file's default store is beside it, whichever folder a run starts in; its lock file
    # would be left beside a study this run then refuses.)
    with contextlib.ExitStack() as turn:
        try:
            if database is not None and not made_here and in_rollback_mode(database):
                refuse_another_tools_study(url, spec)  # read as it is: the worker's storage switches it to WAL
            storage = worker_storage(spec, url, notify=notify)
            if database is None:
                turn.enter_context(ask_lock(url, spec.name, storage.boundary,
                                            stale_after=spec.heartbeat_grace_period))
            refuse_a_folder_another_owns(lambda: _study_exists(storage, spec.name))
            study = open_study(spec, storage, url, before_update=refuse_folders)
            _OPENED_FILE[:] = [database_identity(url)]
        except StoreMismatchError as exc:
            raise _fail(f"{prefix}{source}: checkpoints.store: {exc}", 2) from None
        except StudyMismatchError as exc:
            raise _fail(f"{prefix}{source}: {exc}", 2) from None
        except typer.Exit:
            raise
        except Exception as exc:  # noqa: BLE001 - storage errors come in many types; show them without the password
            if made_here and database is not None:
                _drop_if_empty(database)  # a full disk: SQLite made the file and could write nothing in it (review)
            if isinstance(exc, StorageUnavailable) and (stop := stop_requested()) is not None:
                raise stop() from None  # told to stop while the storage was waited for: exits as told
            raise _storage_failure(url, exc, url_from) from None
        refuse_folders(study)  # a study just made: its folders claimed with it
    if not prefix:  # the launching process, not one of its workers
        from sweep.outcomes import budget_counts

        used = budget_counts(study.get_trials(deepcopy=False))[0]
        opened = f"study {spec.name!r} in {mask_url(url)}: {used}/{spec.n_trials} trials done"
        err.print(printable(opened), markup=False)  # a path's right-to-left override escaped, as in every line
        if spec.warm_start.enabled and spec.warm_start.from_studies:  # a typo there would silently give no donors
            from sweep.registry import Registry
            from sweep.spec import latest_handoff_step
            from sweep.warmstart import donorless_studies

            names = {s.study_name for s in study._storage.get_all_studies()}  # noqa: SLF001
            for name in spec.warm_start.from_studies:
                if name not in names:
                    err.print(f"warning: warm_start.from_studies: no study {name!r} in {mask_url(url)}, so it gives "
                              f"no donors (its studies: {', '.join(sorted(names))})", markup=False)
            found = [name for name in spec.warm_start.from_studies if name in names and name != spec.name]
            registry = Registry(url)
            try:
                for name, why in donorless_studies(registry, latest_handoff_step(spec), found).items():
                    err.print(f"warning: warm_start.from_studies: study {name!r} gives no donors so far: {why}",
                              markup=False)
            finally:
                registry.engine.dispose()
    return study


def _study_exists(storage: Any, name: str) -> bool:
    try:
        storage.get_study_id_from_name(name)
    except KeyError:
        return False
    return True


def _store_claim_problem(name: str, owner: str | None, location: str | Path, url: str, *,
                         claim: bool) -> str | None:
    """Whether the study's folder of the store belongs to another study of its name (`sweep.blobs.claim_problem`);
    `owner` None: a study not created yet, which any owner's folder is another's. The default folder of a SQLite
    file, named after it, is that file's (`default_folder_problem`): taken over from a study of the same file deleted
    to start over (`rm study.db`), refused to another database's study that pointed its `checkpoints.store` there,
    whichever of them ran first."""
    from sweep.blobs import claim_problem, default_folder_problem
    from sweep.registry import default_store
    from sweep.urls import sqlite_path

    if (database := sqlite_path(url)) is not None and Path(location).resolve() == Path(default_store(url)).resolve():
        return default_folder_problem(location, name, owner, str(Path(database).resolve()), claim=claim)
    return claim_problem(location, name, owner, claim=claim, new=owner is None)


def _stopped(stop: BaseException) -> tuple[int, str]:
    """The exit code and the word for a stop asked by a signal: Ctrl-C (KeyboardInterrupt) or SIGTERM (`Preempted`)."""
    return (130, "interrupted") if isinstance(stop, KeyboardInterrupt) else (143, "preempted (SIGTERM)")


@contextlib.contextmanager
def _run_outcomes(study: Any, prefix: str, workers: int = 1) -> Iterator[None]:
    """Ctrl-C and SIGTERM as requests the worker honours at a clean point, and how a run that ends early exits:
    130 interrupted, 143 preempted, 1 a broken study, a repeated fault of the machine or a storage gone too long."""
    from sweep.signals import Preempted, graceful_signals, is_unmarked, mark_unmarked, raised_at_once, stop_requested
    from sweep.storage import StorageUnavailable, storage_refusal
    from sweep.worker import InfrastructureError, StudyBrokenError

    launcher = workers > 1 and not prefix  # its workers print what became of their trials
    at_once = False
    try:
        with graceful_signals():
            try:
                yield
            except (KeyboardInterrupt, Preempted):
                at_once = raised_at_once() > 0
                raise
            except StorageUnavailable:
                stop = stop_requested()
                if stop is None:
                    raise
                raise mark_unmarked(stop()) from None  # told to stop while the storage was away: exits as told
    except (KeyboardInterrupt, Preempted) as exc:
        code, what = _stopped(exc)
        if launcher:
            fate = "each worker's lines above say what became of its running trials"
            if (killed := getattr(exc, "killed_workers", None)) is not None:
                numbers, grace = killed
                fate += (f"; worker{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))} did not exit "
                         f"within {grace:g} s and {'were' if len(numbers) > 1 else 'was'} killed: the next run finds "
                         "its running trials lost and retries them from their last checkpoint")
        elif is_unmarked(exc):
            fate = ("running trials could not be marked (the storage is unreachable): the next run finds them lost "
                    "and retries them from their last checkpoint")
        elif at_once:  # it may have landed while a trial's end was being stored, which it then cut short
            fate = ("running trials are marked and queued again; if the second "
                    f"{'Ctrl-C' if code == 130 else 'SIGTERM'}, which stops at once, cut short a trial's end as it "
                    "was stored, the next run finds that trial lost once heartbeat_grace_period has passed and "
                    "retries it from its last checkpoint")
        else:
            fate = "running trials are marked and queued again; they resume from their last checkpoint"
        err.print(f"{prefix}{what}: {fate}; rerun the same command to continue.", markup=False)
        raise typer.Exit(code) from None
    except (StudyBrokenError, InfrastructureError, StorageUnavailable) as exc:
        if not isinstance(exc, StorageUnavailable):
            _print_status(study)
        said = str(exc)
        if isinstance(exc, StudyBrokenError):  # the budget as the members that ended with the last one left it
            from sweep.outcomes import budget_counts

            with contextlib.suppress(Exception):
                said = exc.advice(budget_counts(study.get_trials(deepcopy=False))[0])
        raise _fail(f"{prefix}{said}", 1) from None
    except Exception as exc:  # a trial's end refused by the storage (a database dropped): one line, not a traceback
        refusal = storage_refusal(exc)
        if refusal is None:
            raise
        raise _fail(f"{prefix}{refusal[0]}; fix the storage, then rerun the same command: the trials left running "
                    "are found lost and retried", 1) from None


def _run_here(study: Any, spec: Any, url: str, timeout: float | None, prefix: str, *,
              live: bool) -> tuple[Any, dict[str, int]]:
    """The worker loop in this process, with a progress display (a live one on a terminal, lines for a worker).
    Returns the run's summary and its finished trials by state."""
    from sweep import results
    from sweep.progress import LiveProgress
    from sweep.study import run_study

    status_now = results.study_status(study)
    best = status_now["best"]
    progress = LiveProgress(err, spec.n_trials, study.direction, done=status_now["budget_used"],
                            best=None if best is None else best["value"], live=None if live else False, prefix=prefix,
                            cold_only=results.confirm_count(study) > 0)
    with progress:
        summary = run_study(study, spec, timeout=timeout, events=progress, storage_url=url)
    return summary, dict(progress.counts)


@app.command()
def submit(
    study_file_arg: Annotated[str, typer.Argument(metavar="STUDY_FILE", help="The study file (YAML), on a path "
                                                  "every node sees.")],
    slurm: Annotated[bool, typer.Option("--slurm", help="Submit the workers as a Slurm job array.")] = False,
    k8s: Annotated[bool, typer.Option("--k8s", help="Write a Kubernetes Indexed Job manifest (with -o).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the batch script; submit and create nothing.")
                       ] = False,
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="--k8s: the manifest to write "
                                                   "(default, or -: standard output).")] = None,
    workers: Annotated[Optional[int], typer.Option("--workers", help="Array tasks (--k8s: pods), one worker "
                                                   "each.")] = None,
    nodes: Annotated[Optional[int], typer.Option("--nodes", help="--slurm with --gpus-per-task G: array tasks, one "
                                                 "node's worth each (G workers, each pinned to its GPU); the same "
                                                 "count as --workers.")] = None,
    partition: Annotated[Optional[str], typer.Option("--partition")] = None,
    time_limit: Annotated[Optional[str], typer.Option("--time", help="Slurm time limit per task, e.g. 4:00:00.")
                          ] = None,
    account: Annotated[Optional[str], typer.Option("--account")] = None,
    qos: Annotated[Optional[str], typer.Option("--qos")] = None,
    mem: Annotated[Optional[str], typer.Option("--mem", help="Memory per task, e.g. 16G.")] = None,
    cpus_per_task: Annotated[Optional[int], typer.Option("--cpus-per-task")] = None,
    gpus_per_task: Annotated[Optional[int], typer.Option("--gpus-per-task", help="GPUs per array task (pod), "
                                                         "one worker pinned to each.")] = None,
    warning_s: Annotated[Optional[int], typer.Option("--warning-s", help="Slurm's warning signal this many "
                                                     "seconds before the time limit (default 120).")] = None,
    sbatch: Annotated[Optional[list[str]], typer.Option("--sbatch", help="An extra #SBATCH option, e.g. "
                                                        "--sbatch=--constraint=a100 (repeatable).")] = None,
    image: Annotated[Optional[str], typer.Option("--image", help="--k8s: a container image with sweep "
                                                 "installed.")] = None,
    storage: StorageOpt = None,
    study_name: NameOpt = None,
    n_trials: Annotated[Optional[int], typer.Option("--n-trials", help="The study's total budget (>= 1).")] = None,
    timeout: Annotated[Optional[float], typer.Option("--timeout", help="Stop each worker after S seconds.")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a study-file key.")] = None,
) -> None:
    """Launch the study's workers on a cluster: a Slurm job array (--slurm), or a Kubernetes Job manifest (--k8s)."""
    from sweep.schema import with_options

    if slurm == k8s:
        raise _fail("give one of --slurm (submit a job array) or --k8s (write a Job manifest)", 2)
    others = ({"--image": image, "--output": output} if slurm else
              {"--dry-run": dry_run or None, "--partition": partition, "--time": time_limit, "--account": account,
               "--qos": qos, "--mem": mem, "--cpus-per-task": cpus_per_task, "--warning-s": warning_s,
               "--sbatch": sbatch})
    if unused := [name for name, value in others.items() if value is not None]:
        this, other = ("--slurm", "--k8s") if slurm else ("--k8s", "--slurm")
        raise _fail(f"{', '.join(unused)}: {other}'s, not {this}'s (see sweep submit --help)", 2)
    if nodes is not None:
        if workers is not None or not slurm or gpus_per_task is None:
            raise _fail("--nodes: give it with --slurm and --gpus-per-task (G workers on each of N nodes), instead "
                        "of --workers", 2)
        workers = nodes
    study_file = _study_file_argument(study_file_arg)
    spec, url = _run_spec(study_file, storage, study_name, n_trials, timeout, 1, set_ or [])
    given: dict[str, Any] = {"workers": workers, "gpus_per_task" if slurm else "gpus_per_worker": gpus_per_task}
    if slurm:
        given |= {"partition": partition, "time": time_limit, "account": account, "qos": qos, "mem": mem,
                  "cpus_per_task": cpus_per_task, "warning_s": warning_s, "sbatch": sbatch or None}
    else:
        given |= {"image": image}
    try:
        options = with_options(spec.launch.slurm if slurm else spec.launch.k8s, given)
    except StudyFileError as exc:
        raise _fail(exc.lines(), 2) from None
    from sweep.workers import gpus_problem

    key = "gpus_per_task" if slurm else "gpus_per_worker"
    where = ("--gpus-per-task" if gpus_per_task is not None  # else the study file's (or its --set)
             else f"{study_file}: launch.{'slurm' if slurm else 'k8s'}.{key}")
    problem = gpus_problem(getattr(options, key), spec.resources.devices_per_trial, where)
    if problem is not None:
        raise _fail(problem, 2)
    if slurm and options.gpu_type is not None and not options.gpus_per_task:  # it was dropped: a job with no GPU
        raise _fail(f"{study_file}: launch.slurm.gpu_type: {short_repr(options.gpu_type)} needs a GPU count too: "
                    "give launch.slurm.gpus_per_task (or --gpus-per-task G) for --gres=gpu:TYPE:G", 2)
    from sweep.urls import url_secrets

    tracking_uri = spec.tracking.mlflow.tracking_uri
    secrets = url_secrets(tracking_uri) if tracking_uri is not None else []
    on_command_line = any(secret in item for item in set_ or [] for secret in secrets if secret)
    if secrets and (k8s or on_command_line):
        # --set values go on the workers' command line in the batch script, which Slurm keeps; --k8s puts the study
        # file in a ConfigMap. Whoever may read the job or the ConfigMap would see it. (A --slurm study file is
        # named by its path: the script does not carry its contents.)
        where = "the batch script (its --set values)" if slurm else "the manifest's ConfigMap"
        fix = ("keep it in the study file, which the batch script names by its path" if slurm else
               "keep the password out of the URI: an HTTP(S) server takes MLFLOW_TRACKING_USERNAME and "
               "MLFLOW_TRACKING_PASSWORD from the pods' environment (a Secret)")
        raise _fail(f"{study_file}: tracking.mlflow.tracking_uri: holds a password, which {where} would carry in "
                    f"plain text; {fix}", 2)
    spec_path = study_file.resolve()
    if output is not None and str(output) == "-":  # stdout, as without -o (review: a file named `-`, and the hint
        output = None  # `kubectl apply -f -` then read stdin), as for `best` and `report`
    if k8s and output is not None and (problem := _output_problem(output, _protected_files(study_file, url))):
        raise _fail(problem, 2)
    if slurm:
        # A command that works from here: the storage and the name as given on this command line, by --storage
        # and --study-name or by --set (review: `--set storage=...` was left out, and the hint read another study).
        overridden = {item.partition("=")[0].strip() for item in set_ or []}
        status = ["sweep", "status", os.path.relpath(spec_path) if spec_path.is_relative_to(Path.cwd()) else
                  str(spec_path), *(["--storage", mask_url(url)] if storage or "storage" in overridden else []),
                  *(["--study-name", spec.name] if study_name or "name" in overridden else [])]
        _submit_slurm(spec, spec_path, url, options, dry_run=dry_run, timeout=timeout, overrides=set_ or [],
                      status=shlex.join(status))
    else:
        _write_k8s(spec, spec_path, options, output, timeout=timeout, overrides=set_ or [])


def _submit_paths(url: str, spec: Any, folder: Path) -> list[tuple[Path, str]]:
    """What `sweep submit --slurm` will have made, if sbatch then refuses, that is this study's alone and did not
    exist before: the job's folder (the storage file and the batch script) and the study's folder in its store
    (`tree`: removed whole), a SQLite file this call creates with its companions (`file`; the companions of a file
    that exists are another process's too, and are never touched), and the store's folder (`empty`: removed only if
    nothing else was written there meanwhile)."""
    from sweep.urls import sqlite_path

    made = [(folder, "tree")]
    if (database := sqlite_path(url)) is not None and not database.exists():
        made += [(path, "file") for path in (database, *(database.with_name(database.name + suffix)
                                                          for suffix in ("-wal", "-shm", "-journal", ".lock")))]
    from sweep.registry import default_store

    store = spec.checkpoints.store or str(default_store(url))  # the default one (beside a SQLite file) too
    if spec.checkpoints.enabled and "://" not in store:
        made += [(Path(store) / spec.name, "tree"), (Path(store), "empty")]
    if spec.tracking.tensorboard.enabled:  # claimed for the new study (its owner file): a corrected submit is another
        from sweep.tracking import tensorboard_root

        root = tensorboard_root(spec.tracking, url)
        made += [(root / spec.name, "tree"), (root, "empty")]
    return [(path, how) for path, how in made if not path.exists() and not path.is_symlink()]


def _submit_slurm(spec: Any, spec_path: Path, url: str, options: Any, *, dry_run: bool, timeout: float | None,
                  overrides: list[str], status: str) -> None:
    from sweep.launch import slurm
    from sweep.urls import sqlite_path

    folder, workdir = slurm.job_folder(spec, spec_path, options), Path.cwd()
    for what, place in (("the study file's path", spec_path.resolve()), ("the working folder", workdir),
                       ("the job's folder (launch.slurm.log_dir)", folder)):
        if (problem := slurm.path_problem(place, logs=place == folder)) is not None:
            raise _fail(f"{short_repr(str(spec_path))}: {what} {short_repr(str(place))} {problem}", 2)
    if problem := folder_problem(folder, "the job's script, storage file and logs need"):
        key = "launch.slurm.log_dir" if options.log_dir else f"launch.slurm.log_dir (default: {folder.name} next to it)"
        raise _fail(f"{spec_path}: {key}: {problem}", 2)
    script = slurm.batch_script(spec, spec_path, options, url=url, folder=folder, workdir=workdir, timeout=timeout,
                                overrides=overrides)
    if (path := sqlite_path(url)) is not None:
        err.print(f"warning: SQLite storage {path}: every node must see this file on a shared filesystem, and "
                  "SQLite's locks are unreliable over NFS; use PostgreSQL for workers on many machines", markup=False)
    if dry_run:
        sys.stdout.write(script)
        return
    made = _submit_paths(url, spec, folder)
    try:
        slurm.check_tools()
        study = _open_for_run(spec, url, "", spec_path)  # created once, here: no array task creates another
        asked = time.time()  # a `sweep stop` from now on stops this job's tasks, however often they are requeued
        job_id = slurm.submit(script, url, folder, study_name=spec.name, workdir=workdir)
    except (slurm.SlurmError, OSError) as exc:
        # Nothing was submitted: what this call made for it goes again (a new SQLite study, its store, the job's
        # folder), so a corrected submit starts as this one did. What existed before stays.
        for path, how in made:
            with contextlib.suppress(OSError):
                shutil.rmtree(path) if how == "tree" else path.rmdir() if how == "empty" else path.unlink()
        raise _fail(str(exc) if isinstance(exc, slurm.SlurmError) else f"cannot write the job's files in {folder}: "
                    f"{exc.strerror or exc}", 1) from None
    slurm.record_job(study, job_id, options, folder, asked)
    masked = " (with the storage's password where it shows ***)" if mask_url(url) != url and "***" in status else ""
    err.print(f"submitted job array {job_id}: {options.workers} workers of study {spec.name!r}; logs in {folder}/; "
              f"`{status}` shows them{masked}", markup=False)
    sys.stdout.write(f"{job_id}\n")


def _write_k8s(spec: Any, spec_path: Path, options: Any, output: Path | None, *, timeout: float | None,
               overrides: list[str]) -> None:
    from sweep.launch import k8s

    if options.image is None:
        raise _fail("--image: required with --k8s (or launch.k8s.image in the study file): an image with sweep "
                    "installed", 2)
    text = k8s.job_manifest(spec, spec_path, options, timeout=timeout, overrides=overrides)
    if local := _pod_local_destinations(read_spec(spec_path, overrides)[0]):  # as written: not resolved here
        err.print(f"warning: in a pod, {', '.join(local)} would be written in the pod's own working folder (the study "
                  "file's folder there is read-only) and lost with the pod: give an object store (s3://, gs://), a "
                  "server, or a path on a volume every pod mounts", markup=False)
    if output is None:
        sys.stdout.write(text)
        return
    _write_output(output, text)
    err.print(f"wrote {output}: `kubectl apply -f {output}` after creating the Secret {options.secret!r} "
              "(see the README)", markup=False)


def _pod_local_destinations(spec: Any) -> list[str]:
    """What a study writes to a relative path (its defaults included), which in a Kubernetes pod is the pod's own
    disk: the checkpoint store, TensorBoard's folder, a SQLite MLflow store."""
    from sweep.urls import sqlite_path

    def relative(path: str | None) -> bool:
        return path is None or ("://" not in path and not Path(path).expanduser().is_absolute())

    local = []
    if spec.checkpoints.enabled and relative(spec.checkpoints.store):
        local.append("checkpoints.store")
    if spec.tracking.tensorboard.enabled and relative(spec.tracking.tensorboard.dir):
        local.append("tracking.tensorboard.dir")
    uri = spec.tracking.mlflow.tracking_uri
    if spec.tracking.mlflow.enabled and (uri is None or ((path := sqlite_path(uri)) is not None
                                                         and not path.is_absolute())):
        local.append("tracking.mlflow.tracking_uri")
    return local


def _open(target: str, storage: str | None, study_name: str | None, command: str = "COMMAND", *,
          output: Path | None = None) -> Any:
    """A study to read, from a study file, a SQLite .db file, or --storage with a name."""
    return _open_with_url(target, storage, study_name, command, output=output)[0]


MAX_LOCAL_WORKERS = 256  # processes on one machine; each holds a torch runtime (hundreds of MB)


def _option_problems(*, storage: str | None = None, study_name: str | None = None, n_trials: int | None = None,
                     timeout: float | None = None, workers: int = 1) -> list[str]:
    """The options' values that no command can use, one line each (typer checks only their types)."""
    problems = []
    if storage is not None and (problem := storage_url_problem(storage)):
        problems.append(f"--storage: {problem}")
    if study_name is not None and (problem := name_problem(study_name)):
        problems.append(f"--study-name: {problem}")
    if n_trials is not None and n_trials < 1:
        problems.append(f"--n-trials: expected at least 1 trial, got {n_trials}")
    elif n_trials is not None and n_trials >= 2**63:  # else blamed on the study file's n_trials, which it replaces
        problems.append(f"--n-trials: expected a count that fits in 64 bits (at most {2**63 - 1}), got {n_trials}")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        problems.append(f"--timeout: expected a number of seconds > 0, got {timeout:g}")
    if workers < 1:
        problems.append(f"--workers: expected at least 1 worker, got {workers}")
    elif workers > MAX_LOCAL_WORKERS:
        problems.append(f"--workers: expected 1 to {MAX_LOCAL_WORKERS} worker processes on this machine, got "
                        f"{workers} (for more, launch workers on several machines: `sweep submit`)")
    return problems


def _open_with_url(target: str, storage: str | None, study_name: str | None, command: str = "COMMAND", *,
                   output: Path | None = None) -> tuple[Any, str]:
    """The study and its storage URL. With `output` (the command's `-o FILE`), that file is checked first: it may
    not be the study file nor the study's database."""
    from_file = Path(target).suffix in (".yaml", ".yml")
    # A name given for a study file is its `name` (a folder, as `sweep run` would make it); one read from a database
    # is whatever the study was created with (a plain Optuna study may be named "my study").
    problems = _option_problems(storage=storage, study_name=study_name if from_file else None)
    if study_name == "" and not from_file:
        problems.append("--study-name: expected a study name, got ''")
    if not target and storage is None:
        problems.insert(0, "missing TARGET: a study file, a SQLite .db file, or --storage URL [--study-name NAME] "
                           f"(usage: sweep {command} [OPTIONS] TARGET)")
    if problems:
        raise _fail(problems, 2)
    path = Path(target) if target else None
    name = study_name
    if path is not None and (problem := long_name_problem(path)):
        raise _fail(problem, 2)
    if path is not None and path.suffix in (".yaml", ".yml"):
        try:
            spec, spec_path = read_spec(path, _name_override(study_name))  # its database, as `sweep run` named it
            url = resolve_storage_url(spec, spec_path, storage)
        except StudyFileError as exc:
            raise _fail(StudyFileError(target, exc.problems).lines(), 2) from None
        name = name or spec.name
    elif storage:
        url, name = expand_home(storage), name or (target or None)
    elif path is not None and path.exists():
        url = sqlite_url(path.resolve())  # checked below, as every SQLite file a command reads
    else:
        raise _fail(f"{target!r} is neither a study file nor a database; give a study file, a .db file, "
                    "or --storage URL [--study-name NAME]", 2)
    if output is not None and (problem := _output_problem(output, _protected_files(target, url))):
        raise _fail(problem, 2)
    if url.startswith("sqlite:///") and (file := sqlite_path(url)) is not None and not file.exists():
        raise _fail(f"no study database at {file}; run `sweep run` first", 1)
    if found := sqlite_study_problem(url):  # before Optuna's storage, which would create its tables in the file
        raise _fail(*found)
    _OPENED[:] = [url]
    _quiet_optuna()
    from sweep.storage import AmbiguousStudy, database_identity, load_existing_study

    _OPENED_FILE[:] = [database_identity(url)]

    try:
        study = load_existing_study(url, name)
    except AmbiguousStudy as exc:  # several studies there: which one is the user's to say
        raise _fail(str(exc.args[0]), 2) from None
    except KeyError as exc:
        raise _fail(str(exc.args[0]) if exc.args else f"study {name!r} not found in {mask_url(url)}", 1) from None
    except Exception as exc:  # noqa: BLE001 - as in `run`: one line, without the password
        raise _storage_failure(url, exc) from None
    if command in SINGLE_OBJECTIVE and len(directions := study.directions) > 1:  # another tool's study
        raise _fail(f"study {study.study_name!r} has {len(directions)} objectives "
                    f"({', '.join(d.name.lower() for d in directions)}); `sweep {command}` reads single-objective "
                    "studies: `sweep dashboard` shows this one", 2)
    if output is not None and (problem := _store_output_problem(output, study, url)):
        raise _fail(problem, 2)
    return study, url


SINGLE_OBJECTIVE = ("status", "best", "trials", "report", "reproduce")  # read a trial's one value


def _folder_name_problem(name: str) -> str | None:
    """Why a study's name, as another tool may have made it, names no folder of its own under a store or a tracking
    root (`..`, a slash: the folder would lie elsewhere, and `check --repair` would delete files there)."""
    from sweep.urls import plain_folder_name

    return None if plain_folder_name(name) else "its name is no folder's name (empty, '.', '..', or holding a slash)"


def _store_output_problem(output: Path, study: Any, url: str) -> str | None:
    """`-o` inside one of the study's own folders (known once the study is open): its checkpoint store (writing there
    would replace a checkpoint, or leave a file the store's check reports), its TensorBoard runs (an owner file
    written over made every rerun refuse the study: review), its MLflow artifacts, or a file of a Slurm job
    submitted for it (its script, its storage file, its tasks' logs: a storage file written over failed every
    requeued task)."""
    from sweep.blobs import is_object_url
    from sweep.launch.slurm import LOG_PATTERN, SCRIPT_FILE
    from sweep.outcomes import SLURM_JOBS_ATTR, SPEC_ATTR
    from sweep.reconcile import store_location
    from sweep.schema import TrackingSpec
    from sweep.tracking import mlflow_location, tensorboard_root

    target = output.resolve()
    folders: list[tuple[Path, str]] = []
    store = store_location(study, url)
    if not is_object_url(store):
        folders.append((Path(store), f"the study's checkpoint store {store}"))
    stored = study.user_attrs.get(SPEC_ATTR)
    tracking = (stored.get("tracking") if isinstance(stored, dict) else None) or {}
    with contextlib.suppress(Exception):  # another tool's attr that is no tracking spec protects nothing
        spec = TrackingSpec.model_validate(tracking)
        folders.append((tensorboard_root(spec, url) / study.study_name, "the study's TensorBoard folder"))
        artifacts = mlflow_location(spec, url, study.study_name)[2]
        if artifacts is not None and artifacts.startswith("file://"):
            folders.append((Path(urllib.parse.unquote(urllib.parse.urlsplit(artifacts).path)),
                            "the study's MLflow artifact folder"))
    for folder, what in folders:
        with contextlib.suppress(OSError, ValueError):
            resolved = folder.expanduser().resolve()
            if resolved == target or resolved in target.parents:
                return f"-o: {output} is inside {what}; writing there would damage the study: choose another file"
    jobs = study.user_attrs.get(SLURM_JOBS_ATTR)
    for job in jobs if isinstance(jobs, list) else []:
        log_dir = job.get("log_dir") if isinstance(job, dict) else None
        if not isinstance(log_dir, str) or target.parent != Path(log_dir).resolve():
            continue
        log_prefix = LOG_PATTERN.replace("%A", str(job.get("job_id"))).partition("%a")[0]
        if (target.name == SCRIPT_FILE or (target.name.startswith("storage-") and target.suffix == ".json")
                or target.name.startswith(log_prefix)):
            return (f"-o: {output} is a file of the study's Slurm job {job.get('job_id')} (its script, storage file "
                    "or a task's log); writing there would break the job: choose another file")
    return None


def _drop_if_empty(database: Path) -> None:
    """The SQLite file this command made, with what SQLite made beside it, when nothing could be written in it: a
    0-byte file left behind was read by every later `sweep status` as "an empty file, not a study database" (exit 2),
    where a study never run is exit 1."""
    with contextlib.suppress(OSError):
        if database.stat().st_size == 0:
            for suffix in ("", "-wal", "-shm", "-journal"):
                database.with_name(database.name + suffix).unlink(missing_ok=True)


def _storage_failure(url: str, exc: Exception, where: str = "") -> typer.Exit:
    """A storage that cannot be opened (unreachable, refused, damaged): one line, its password masked. An option of
    the URL that the driver calls invalid is bad input (exit 2); `where`: the file and key that gave the URL."""
    from optuna.exceptions import StorageInternalError

    from sweep.schema import sqlite_damage
    from sweep.storage import bad_url_option, error_line, refusal_line

    if (option := bad_url_option(exc)) is not None:
        return _fail(f"{where}storage URL {mask_url(url)}: {redact(option, url)}; fix the option in the URL", 2)
    if isinstance(exc, RuntimeError) and "compatible with the table schema" in str(exc):  # another Optuna's tables
        import optuna

        said = str(exc).split(". Please", 1)[0]  # not its advice: `optuna storage upgrade` would write the file
        return _fail(f"{where}cannot open storage {mask_url(url)}: its tables are of a schema Optuna "
                     f"{optuna.__version__} does not read ({said}); open it with the Optuna version that made it", 2)
    if (path := sqlite_path(url)) is not None and (damage := sqlite_damage(path)) is not None:
        # Damage past the pages the opening check reads: SQLite's "malformed", or Optuna's reading of a garbled
        # page ("Record does not exist"), said as the damaged file it is, bad input as a file cut short is (review)
        return _fail(f"{where}{path} cannot be read as a SQLite database ({redact(damage, url)}); is the file "
                     "damaged?", 2)
    if (refused := refusal_line(exc)) is not None:  # the role's rights or the database's state: the driver's words
        detail = refused
    elif isinstance(exc, StorageInternalError) and exc.__cause__ is not None:  # Optuna's "invalid data" wrapper
        detail = error_line(exc)
    else:
        first = str(exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {first[0] if first else ''}"
    return _fail(f"cannot open storage {mask_url(url)}: {redact(detail, url)}", 1)


Target = Annotated[str, typer.Argument(help="A study file, a SQLite .db file, or a study name with --storage.")]


def _print_status(study: Any) -> None:
    from sweep import results

    status = results.study_status(study)
    table = _PrintableTable(title=printable(f"study {status['study']}"), show_header=False)
    table.add_row("direction / metric", f"{status['direction']} {status['metric'] or '(unnamed)'}")
    if status["n_trials"] is None:  # a study sweep did not create: no budget to count against
        table.add_row("budget", f"{status['budget_used']} trials; no budget (study not created by sweep)")
    else:
        table.add_row("budget", f"{status['budget_used']}/{status['n_trials']} trials")
    states = ", ".join(f"{k} {v}" for k, v in status["states"].items()) or "no trials"
    grace = status["grace_period"]
    if isinstance(grace, (int, float)) and (gone := [s for s in status["silent"].values() if s > grace]):
        states += (f" ({len(gone)} running silent for {max(gone):.0f} s, past the {grace:g} s heartbeat grace "
                   "period: the worker is gone, and the next `sweep run` retries "
                   f"{'it' if len(gone) == 1 else 'them'} from the last checkpoint)")
    table.add_row("states", states)
    compute = f"{status['steps_trained']} steps trained"
    if status["warm_started"]:
        compute += f"; {status['warm_started']} trial{'s' if status['warm_started'] > 1 else ''} warm-started"
    table.add_row("compute", compute)
    if status["trials_per_hour"] is not None:
        cohorts = status["cohorts"]
        how = f" (in cohorts of {', '.join(map(str, cohorts))})" if cohorts else ""
        table.add_row("throughput", f"{status['trials_per_hour']:.0f} trials/hour{how}")
    best = status["best"]
    if best is None and status["states"].get("complete"):  # complete, yet none is the best: warm, unconfirmed
        table.add_row("best trial", f"none: {status['no_best']}")
    if best is not None:
        table.add_row("best trial", f"#{best['number']}  value {best['value']:.6g}")
        if best["lineage"]:
            table.add_row("  lineage", best["lineage"])
        for key, value in best["params"].items():
            table.add_row(f"  {key}", f"{value:.6g}" if isinstance(value, float) else str(value))
    for row in status["confirmations"]:
        cold = f"{row['cold_value']:.6g}" if row["cold_value"] is not None else row["cold_state"]
        warm = f"{row['warm_value']:.6g}" if row["warm_value"] is not None else "?"
        table.add_row("confirmed cold", f"warm #{row['warm']} {warm} -> cold #{row['cold']} {cold}")
    out.print(table)


@app.command()
def status(target: Target = "", storage: StorageOpt = None, study_name: NameOpt = None) -> None:
    """Counts by state, the budget used, the best trial, and the study's Slurm jobs with their logs."""
    study = _open(target, storage, study_name, "status")
    _print_status(study)
    _print_slurm(study)


def _print_slurm(study: Any) -> None:
    """The array tasks of the study's Slurm jobs: state, requeues, log; a failed one's last log lines."""
    from sweep.outcomes import SLURM_JOBS_ATTR

    if not study.user_attrs.get(SLURM_JOBS_ATTR):
        return
    from sweep.launch import slurm

    try:
        tasks = slurm.study_tasks(study)
    except slurm.SlurmError as exc:
        err.print(f"note: the study has Slurm jobs, but {exc}", markup=False)
        return
    counts = slurm.summary(tasks)
    table = Table("job", "state", "requeued", "exit", "log", title="Slurm workers: " +
                  ", ".join(f"{label} {n}" for label, n in counts.items()))
    for task in tasks:
        table.add_row(f"{task.job_id}_{task.task}", task.label, str(task.restarts), task.exit_code,
                      str(task.log or "") or (task.reason if task.reason != "None" else ""))
    out.print(table)
    for task in tasks:
        if task.failed and task.log is not None:
            out.print(f"{task.job_id}_{task.task} failed; the end of {task.log}:", markup=False)
            for line in slurm.log_tail(task.log):
                out.print(f"  {line}", markup=False)


@app.command()
def best(
    target: Target = "",
    storage: StorageOpt = None,
    study_name: NameOpt = None,
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Write the YAML here (-: stdout).")] = None,
    trust_task: TrustOpt = False,
) -> None:
    """The best trial's full TrainingConfig as YAML: `python -m trainer best.yaml` trains it again. For a `loop` or
    `command` study: its config as the loop got it (a command's with its command line)."""
    from sweep import results
    from sweep.confirm import is_warm
    from sweep.reproduce import UntrustedCode, refuse_untrusted_code

    if output is not None and str(output) == "-":  # stdout, as without -o (not a file named `-`)
        output = None
    if output is not None and output.suffix.lower() == ".json":
        raise _fail(f"-o: {output}: sweep best writes YAML, and python -m trainer reads a .json file as JSON; name "
                    f"it {output.with_suffix('.yaml').name}", 2)
    study = _open(target, storage, study_name, "best", output=output)
    try:
        config = results.best_config(study)
    except results.ForeignStudyError as exc:
        raise _fail(str(exc), 2) from None
    except results.NoCompleteTrial as exc:  # not any ValueError: an attr that is no JSON said only JSON's words
        raise _fail(str(exc), 1) from None
    from sweep.outcomes import SPEC_ATTR

    chosen = results.best_trial(study)
    assert chosen is not None  # best_config found one
    if (foreign := results.added_from_outside(study)) is not None:
        err.print(f"note: trial {foreign.number}'s value {foreign.value:.6g} is better, but it was added to the study "
                  f"from outside (Study.add_trial: it holds no config to train); trial {chosen.number} is the best "
                  "trial sweep ran", markup=False)
    stored = study.user_attrs.get(SPEC_ATTR, {})
    if stored.get("loop") is not None:  # the user's own config: nothing here runs it
        text = (f"# best trial of study {study.study_name!r}: its config, as {stored['loop']}(config, run) "
                "received it\n")
    elif stored.get("command") is not None:
        from sweep.runners.command import command_line

        threads = results.trial_threads(chosen)  # what a worker of --workers N gave the command
        env = "" if threads is None else f"OMP_NUM_THREADS={threads} "
        text = (f"# best trial of study {study.study_name!r}: its config; as a command line:\n"
                f"#   {env}{shlex.join(command_line(stored['command'], config))}\n")
    else:
        try:
            if not trust_task:  # the YAML is written to be run: `python -m trainer` would import what it names
                refuse_untrusted_code(config, _code_named_by(target), f"writing trial {chosen.number}'s config")
        except UntrustedCode as exc:
            raise _fail(str(exc), 2) from None
        again = results.retraining(chosen, config)
        config = again.config
        text = (f"# best trial of study {study.study_name!r}: {_code_path(config, target, output)}{again.env}"
                f"python -m trainer {shlex.quote(str(output or 'best.yaml'))}\n{again.comment}")
    if is_warm(chosen):  # a warm value: this config alone, trained cold, may not reach it
        lineage = results.lineage_label(chosen, study.get_trials(deepcopy=False))
        err.print(f"warning: trial {chosen.number}'s value {chosen.value:.6g} is a warm start's: {lineage}",
                  markup=False)
        text += f"# trial {chosen.number}, value {chosen.value:.6g}, {lineage}\n"
    text += yaml.safe_dump(config, sort_keys=False)
    if output is None:
        sys.stdout.write(text)
    else:
        _write_output(output, text)
        err.print(f"wrote {output}")


def _code_path(config: dict[str, Any], target: str, output: Path | None) -> str:
    """`PYTHONPATH=FOLDER ` for the header of `sweep best -o FILE` when the config names user code (a task, a
    schedule) that lives beside the study file or its database and FILE is written elsewhere: `python -m trainer`
    imports from the config file's folder, where that code is not. Else ''."""
    from sweep.reproduce import user_code

    if not user_code(config) or not target or not Path(target).is_file():
        return ""
    code_folder = Path(target).resolve().parent
    written_in = (output.resolve().parent if output is not None else Path.cwd().resolve())
    return "" if written_in == code_folder else f"PYTHONPATH={shlex.quote(str(code_folder))} "


@app.command()
def trials(
    target: Target = "",
    storage: StorageOpt = None,
    study_name: NameOpt = None,
    fmt: Annotated[str, typer.Option("--format", help="table, csv or json.")] = "table",
) -> None:
    """Every trial: state, value, params, steps, wall time, warm-start parent, speed, and why it was pruned or
    failed."""
    if fmt not in ("table", "csv", "json"):
        raise _fail(f"--format: expected table, csv or json, got {fmt!r}", 2)
    from sweep import results

    rows = results.trial_rows(_open(target, storage, study_name, "trials"))
    columns = list(dict.fromkeys(key for row in rows for key in row))
    if fmt == "json":  # strict JSON: a value that went infinite (a pruned trial's last report) is null, as jq wants
        from trainer.messages import strict_json

        sys.stdout.write(json.dumps(strict_json(rows), indent=1, default=str, allow_nan=False) + "\n")
    elif fmt == "csv":  # its text as stored, but control characters escaped: CSV quotes, it does not escape ESC
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=[printable(c) for c in columns])
        writer.writeheader()
        writer.writerows({printable(k): printable(v) if isinstance(v, str) else v for k, v in row.items()}
                         for row in rows)
        sys.stdout.write(buffer.getvalue())
    else:
        # A column no trial has a value in (no warm start, no cohort) is left out of the table, to leave its width
        # to the values; CSV and JSON keep every column.
        columns = [c for c in columns if any(row.get(c) not in (None, "") for row in rows)] or columns
        # A param's name is a study's own text, as stored; a cell too wide for a narrow terminal wraps, never cut.
        table = Table(*(Column(printable(c), overflow="fold") for c in columns))
        for row in rows:
            table.add_row(*(_cell(row.get(c)) for c in columns))
        out.print(table)


@app.command()
def stop(target: Target = "", storage: StorageOpt = None, study_name: NameOpt = None) -> None:
    """Ask every worker of the study to finish its current trial and exit; `sweep run` later resumes."""
    from sweep import results
    from sweep.worker import request_stop

    study = _open(target, storage, study_name, "stop")
    try:  # nothing is written into a study sweep did not create
        results.require_sweep_study(study, "ask its workers to stop (it has none)")
    except results.ForeignStudyError as exc:
        raise _fail(str(exc), 2) from None
    request_stop(study)
    err.print(f"asked the workers of study {study.study_name!r} to stop after their current trial")
    _cancel_queued(study)


def _cancel_queued(study: Any) -> None:
    """`sweep stop` on a study with Slurm jobs: their array tasks still in the queue are cancelled."""
    from sweep.outcomes import SLURM_JOBS_ATTR

    if not study.user_attrs.get(SLURM_JOBS_ATTR):
        return
    from sweep.launch import slurm

    try:
        jobs = slurm.cancel_queued(study)
    except slurm.SlurmError as exc:
        raise _fail(f"could not cancel the queued Slurm tasks: {exc}", 1) from None
    err.print(f"cancelled the queued array tasks of Slurm job {', '.join(jobs)}", markup=False)


@app.command()
def check(
    target: Target = "",
    storage: StorageOpt = None,
    study_name: NameOpt = None,
    repair: Annotated[bool, typer.Option("--repair", help="Fix what can be fixed: delete rows whose blob is missing "
                                         "or corrupt, delete files no row names, upload lost artifacts again.")
                ] = False,
) -> None:
    """Registry and disk agree? Lists every checkpoint row whose blob is missing or fails its hash, every file in the
    store that no row names, and every dashboard artifact that points nowhere; exit 1 while any --repair can fix is
    left."""
    from sweep.outcomes import OWNER_ATTR, ObjectStoreError
    from sweep.reconcile import check_study, store_location
    from sweep.registry import Registry, default_store
    from sweep.study import is_another_store

    study, url = _open_with_url(target, storage, study_name, "check")
    if (unnamed := _folder_name_problem(study.study_name)) is not None:
        raise _fail(f"study {study.study_name!r}: {unnamed}, so it has no folder of a checkpoint store to check; "
                    "nothing checked or repaired", 2)
    registry = Registry(url, create=repair)  # a check alone writes nothing, not even the registry's table
    # The store is the study file's when one is given. Named only by the database, a store other than the default
    # one beside it is not trusted to delete files in: whoever can write the database could point it anywhere.
    if target.endswith((".yaml", ".yml")):
        spec = _study_file_spec(target, url, study_name)
        location, trusted = str(spec.checkpoints.store or default_store(url)), True
        if is_another_store(study.study_name, ran_with := store_location(study, url), location):
            # Its rows name files in the store the study ran with (`--set checkpoints.store=...`, or a file edited
            # since): judged against another, every one would look missing, and --repair would delete them all. A
            # store moved (the one it ran with is gone) is checked where the file says.
            raise _fail(f"{target}: checkpoints.store: {location} is not the store study {study.study_name!r} ran "
                        f"with ({ran_with}, where its checkpoints' rows point); nothing checked or repaired. Check "
                        "that one: sweep check with the database instead of the study file, or set checkpoints.store "
                        "to it", 2)
    else:
        location = store_location(study, url)
        trusted = Path(location).resolve() == Path(default_store(url)).resolve() if "://" not in location else False
        if ("://" not in location and not (Path(location).resolve() / study.study_name).is_dir()
                and registry.for_study(study.study_name)):
            # Moved with its study (a folder copied elsewhere), or deleted: every row would look missing, and the
            # fix offered, --repair, would delete them all.
            raise _fail(f"{target}: the checkpoint store study {study.study_name!r} ran with, {location}, is not there "
                        "(moved or deleted?); nothing checked or repaired. Check with the study file, whose "
                        "checkpoints.store says where it is now (or, if its checkpoints are gone for good, --repair "
                        "with the study file forgets them)", 2)
    if claimed := _store_claim_problem(study.study_name, study.user_attrs.get(OWNER_ATTR), location, url,
                                       claim=False):
        raise _fail(f"{claimed}; nothing checked or repaired", 2)  # its files are the other study's, not orphans
    try:
        report = check_study(registry, location, study, repair=repair, delete_orphans=trusted)
    except ObjectStoreError as exc:  # its client's credentials, endpoint or bucket: one line, nothing judged
        raise _fail(f"checkpoint store {location}: {exc}; nothing checked or repaired", 1) from None
    for problem in report.problems:
        status = "repaired" if problem.repaired else "cannot be repaired" if not problem.repairable else "found"
        out.print(f"{problem.kind.value}: {problem.detail} [{status}]", markup=False)
    if registry.absent:
        report.notes.append("the database holds no checkpoint registry (no sweep_checkpoints table); `sweep check "
                            "--repair` creates it")
    for note in report.notes:
        err.print(f"note: {note}", markup=False)
    counts = ", ".join(f"{kind.value} {n}" for kind, n in report.counts().items())
    err.print(f"study {study.study_name!r}: {counts}", markup=False)
    if not report.ok:
        raise _fail("registry and disk disagree; run `sweep check --repair` to fix what can be fixed", 1)
    if unread := report.unreadable:
        raise _fail(f"{unread} checkpoint{'s' if unread > 1 else ''} could not be read, so "
                    f"{'they were' if unread > 1 else 'it was'} not checked (see the notes above)", 1)


@app.command()
def report(
    target: Target = "",
    storage: StorageOpt = None,
    study_name: NameOpt = None,
    output: Annotated[Path, typer.Option("-o", "--output", help="The HTML file to write (-: stdout).")] = Path(
        "report.html"),
) -> None:
    """One self-contained HTML file to share: history, intermediate values, importances, infeasible trials, best."""
    from sweep.report import render_report

    study = _open(target, storage, study_name, "report", output=None if str(output) == "-" else output)
    if str(output) == "-":  # stdout, not a file named `-`
        sys.stdout.write(render_report(study))
        return
    _write_output(output, render_report(study))
    err.print(f"wrote {output}")


@app.command()
def dashboard(
    target: Target = "",
    storage: StorageOpt = None,
    study_name: NameOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind; loopback unless you say otherwise.")] =
    "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535)] = 8080,
) -> None:
    """Start optuna-dashboard on the study's storage (reading it never blocks the workers)."""
    try:
        import optuna_dashboard
    except ImportError:
        raise _fail("optuna-dashboard is not installed: pip install 'sweep[dashboard]'", 1) from None
    study, url = _open_with_url(target, storage, study_name, "dashboard")
    if problem := _bind_problem(host, port):
        raise _fail(problem, 2)
    _warn_if_exposed(host, "read and edit the study")
    from sweep.outcomes import SPEC_ATTR
    from sweep.reconcile import store_location
    from sweep.storage import optuna_url
    from sweep.study import label_for_dashboard

    if isinstance(stored := study.user_attrs.get(SPEC_ATTR), dict):
        label_for_dashboard(study, stored)  # the metric's name and the readable definition, for older studies too
    spec = _study_file_spec(target, url, study_name)
    artifacts = dashboard_artifact_store(study, (spec.checkpoints.store if spec is not None else None)
                                         or store_location(study, url))
    port = port or _free_port(host)  # 0: any free one, named in the line below (the server's own says 0)
    shown = f"[{host}]" if ":" in host else host
    err.print(f"optuna-dashboard on http://{shown}:{port}/dashboard for {mask_url(url)} (Ctrl-C to stop)")
    try:
        optuna_dashboard.run_server(optuna_url(url), host=host, port=port, artifact_store=artifacts)
    except OSError as exc:  # taken between the check and the server's bind
        raise _fail(f"--host/--port: cannot serve on {host}:{port}: {exc.strerror or exc}", 1) from None


@app.command()
def tensorboard(
    target: Target = "",
    storage: StorageOpt = None,
    study_name: NameOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind; loopback unless you say otherwise.")] =
    "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="0: any free port (the address is "
                                      "printed).")] = 6006,
) -> None:
    """Start TensorBoard on the study's trials (tracking: {tensorboard: true}): one run per trial, params and final
    values in its hparams view."""
    try:
        from tensorboard import program
    except ImportError:
        raise _fail("tensorboard is not installed: pip install 'sweep[tensorboard]'", 1) from None
    from sweep.tracking import study_tensorboard_folder

    study, url = _open_with_url(target, storage, study_name, "tensorboard")
    if (problem := _folder_name_problem(study.study_name)) is not None:
        raise _fail(f"study {study.study_name!r}: {problem}, so it has no TensorBoard folder to show", 2)
    folder = study_tensorboard_folder(study, url)
    if not folder.is_dir():
        raise _fail(f"no TensorBoard runs for study {study.study_name!r} in {folder}: its trials write them with "
                    "tracking: {tensorboard: true} in the study file", 2)
    if problem := _bind_problem(host, port):
        raise _fail(problem, 2)
    _warn_if_exposed(host, "read the study's curves")
    board = program.TensorBoard()
    board.configure(argv=[None, "--logdir", str(folder), "--host", host, "--port", str(port)])
    try:
        served = board.launch()  # serves from a thread of its own; this one waits for Ctrl-C
    except (OSError, program.TensorBoardServerException) as exc:  # taken between the check and the server's bind
        message = getattr(exc, "msg", None) or getattr(exc, "strerror", None) or str(exc)
        raise _fail(f"--host/--port: cannot serve on {host}:{port}: {message}", 1) from None
    err.print(f"TensorBoard on {served} for study {study.study_name!r} ({folder}; Ctrl-C to stop)")
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            time.sleep(3600)


def _bind_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on `host:port`, before it starts (its own error is a long traceback): a name
    that does not resolve, an address that is not this machine's, a port in use. None when a socket binds there."""
    import errno
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        return f"--host: cannot resolve {host!r}: {getattr(exc, 'strerror', None) or exc}; expected an address or " \
               "a name of this machine (127.0.0.1 by default)"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: a port in TIME_WAIT is free
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"--port: {port} is in use on {host}; choose another port"
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"--host: {host} is not an address of this machine; expected one of its own (127.0.0.1 by " \
                       "default)"
            return f"--host/--port: cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def _free_port(host: str) -> int:
    """A port free on `host` now, as the system picks one for a bind to port 0."""
    import socket

    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.bind(address)
        return int(probe.getsockname()[1])


def _warn_if_exposed(host: str, what: str) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        err.print(f"warning: binding to {host}: anyone who can reach this machine can {what}")


def dashboard_artifact_store(study: Any, store: str) -> object | None:
    """The artifact store where the study's trials uploaded their best checkpoints, so the dashboard lists them: the
    checkpoint store's own (`BlobScope.artifact_location`). The location the study records is whatever whoever can
    write the database wrote, so a different one is not served (with a warning)."""
    from sweep.blobs import BlobScope, RetainedArtifacts, artifact_store_at, is_object_url
    from sweep.outcomes import ARTIFACTS_ATTR

    location = BlobScope(store).artifact_location
    recorded = study.user_attrs.get(ARTIFACTS_ATTR)
    if recorded is not None and recorded != location:
        err.print(f"warning: the study records its checkpoint artifacts in {recorded!r}, but its checkpoint store "
                  f"keeps them in {location!r}: serving only the store's", markup=False)
    if not (is_object_url(location) or Path(location).is_dir()):
        return None
    return RetainedArtifacts(artifact_store_at(location))


@app.command()
def reproduce(
    target: Annotated[str, typer.Argument(help="A study file, a SQLite .db file, or a study name with --storage.")],
    trial: Annotated[int, typer.Argument(help="The trial number.")],
    storage: StorageOpt = None,
    study_name: NameOpt = None,
    trust_task: TrustOpt = False,
) -> None:
    """Train one trial again from the storage alone and compare every reported value (a loop's or command's that
    reported none: its final value); exit 0 when identical."""
    from sweep import results
    from sweep.reconcile import other_store_location, store_location
    from sweep.reproduce import reproduce_trial
    from sweep.signals import Preempted, graceful_signals, raise_pending
    from sweep.study import is_another_store

    study, url = _open_with_url(target, storage, study_name, "reproduce")
    try:
        results.require_sweep_study(study, "train its trials again")
    except results.ForeignStudyError as exc:
        raise _fail(str(exc), 2) from None
    spec = _study_file_spec(target, url, study_name)
    if trust_task and spec is None and Path(target).is_file():
        # A study file makes its folder importable (`sweep run`); its database, beside it by default, does the same
        # once the code it names is trusted, so the task module next to both is found from any working folder.
        folder = str(Path(target).resolve().parent)
        if folder not in sys.path:
            sys.path.append(folder)  # after the installed packages: a file there never shadows one of them
    ran_with = store_location(study, url)
    store = (spec.checkpoints.store if spec is not None else None) or ran_with
    if is_another_store(study.study_name, ran_with, store):
        store = ran_with  # a study file edited since names another store: the one the study ran with is still there
    try:  # Ctrl-C or SIGTERM: a request, honoured at the replay's next step (`_Recorder`)
        with graceful_signals():
            comparison = reproduce_trial(study, trial, store=store, trusted=_code_named_by(target),
                                         trust_code=trust_task, store_of=lambda name: other_store_location(
                                             study._storage, name, url))  # noqa: SLF001 - the study's storage
            raise_pending()
    except (KeyError, ValueError) as exc:
        raise _fail(str(exc.args[0]) if exc.args else str(exc), 2) from None
    except (KeyboardInterrupt, Preempted) as exc:
        code, what = _stopped(exc)
        raise _fail(f"{what}: trial {trial} was not reproduced (nothing was written)", code) from None
    how = "bit for bit" if comparison.largest_difference == 0 else (
        f"within a relative {comparison.tolerance:g}: at most {comparison.largest_difference:.2g}")
    raised = "" if comparison.raised is None else f"; the replay raised {comparison.raised}"
    # A difference's likely cause (the trial's record against this run's), named with a difference
    since = f"; changed since the trial ran: {'; '.join(comparison.changed)}" if comparison.changed else ""
    if comparison.first_difference is not None:
        step, stored, again = comparison.first_difference
        where = "in its final value (it reported none)" if comparison.final_only else f"first at step {step}"
        replayed = "not reported by the replay" if again is None else f"reproduced {again!r}"
        raise _fail(f"trial {trial} differs {where}: stored {stored!r}, {replayed}{raised}{since}", 1)
    if comparison.final is not None and comparison.final_differs:
        stored, again = comparison.final
        replayed = "the replay ended without one" if again is None else f"reproduced {again!r}"
        raise _fail(f"trial {trial} differs in its value (what its loop returned, else its last report): stored "
                    f"{stored!r}, {replayed}{raised}{since}", 1)
    what = ("its final value (it reported none) identical" if comparison.final_only else
            f"{comparison.steps_compared} reported values{' and its value' if comparison.final else ''} identical")
    partial = ("" if comparison.unfinished is None else
               f"; trial {trial} is still running: only the values it has reported so far were compared"
               if comparison.unfinished == "running" else
               f"; trial {trial} ended {comparison.unfinished}: only the values it reported before it ended were "
               "compared")
    out.print(f"trial {trial} reproduced: {what} ({how}){partial}{raised}", markup=False, soft_wrap=True)


def _exit_words(code: int) -> str:
    """How a worker process ended, for a line: "exited with code 1", or "was killed by SIGSEGV (exit code -11)"
    (a negative code is the signal that ended it)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exited with code {code}"


def _name_override(study_name: str | None) -> list[str]:
    """`--study-name` as `sweep run` applies it to a study file: its `name`, and so its default database (`NAME.db`)
    and folders. A YAML string (JSON is YAML): `--study-name 2024` is the name "2024", not a number."""
    return [f"name={json.dumps(study_name)}"] if study_name else []


def _study_file_spec(target: str, url: str | None = None, study_name: str | None = None) -> Any:
    """The study file given on the command line (already read once by `_open`), or None for a database. With the
    storage `url`, its folders (checkpoints, tracking) resolved as `sweep run` resolves them: relative to the study
    file, not to the working folder, and named after `study_name` when one was given."""
    if Path(target).suffix not in (".yaml", ".yml"):
        return None
    spec, spec_path = read_spec(Path(target), _name_override(study_name))
    if url is None:
        return spec
    from sweep.registry import resolve_store
    from sweep.tracking import resolve_tracking

    return resolve_tracking(resolve_store(spec, spec_path, url), spec_path, url)


def _code_named_by(target: str) -> set[str]:
    """The user code (task, curriculum schedule) of the study file given on the command line: the user named it, so
    it may be imported. A database alone names none that is trusted."""
    from sweep.reproduce import code_in_study

    spec = _study_file_spec(target)
    return set() if spec is None else code_in_study(spec)


class _PrintableTable(Table):
    """A table whose rows are a study's own text (its params' names and values, as stored): control characters are
    printed escaped, as in every error line (a name holding ESC [2J cleared the terminal)."""

    def add_row(self, *cells: Any, **kwargs: Any) -> None:
        super().add_row(*(printable(cell) if isinstance(cell, str) else cell for cell in cells), **kwargs)


def _cell(value: object) -> str:
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else printable(str(value))  # a trial's text as stored


def main() -> None:
    from sweep.private import private_umask
    from sweep.workers import prepare_worker

    guard_streams()  # (done already when started as `sweep`)
    prepare_worker()  # a launcher's worker: its stop requests count from now, not only once torch is imported
    private_umask()  # what sweep writes is owner-only (see sweep.private)
    try:
        app()
    except KeyboardInterrupt:  # while typer builds the commands, before any runs (within one, typer exits 130 itself)
        interrupted_at_start()
    except SystemExit as exc:  # how typer ends every command
        if (lost := output_failure()) is not None and exc.code in (0, None):
            err.print(f"error: {lost}", markup=False)
            _leave_promptly(1)
            raise SystemExit(1) from None
        _leave_promptly(exc.code)
        raise
    except Exception as exc:
        from sweep.outcomes import limit_reached

        line, code = _storage_error(exc)
        if line is None and (limit := limit_reached(exc)) is not None:  # a thread the worker starts (review: a
            line, code = f"{limit.reason}: {limit.fix}", 1  # 60-line traceback under `ulimit -u`)
        if line is None and isinstance(exc, MemoryError):  # this process's own, not a trial's (a trial's fails it):
            from trainer.precision import memory_limit, out_of_memory_words  # under `ulimit -v`, say (review)

            fix = "raise that limit where sweep runs" if memory_limit() is not None else "free memory on this machine"
            line, code = f"{out_of_memory_words(exc)}; {fix}", 1
        if line is None:
            line, code = _unreadable(exc)
        if line is None:
            _leave_promptly(1)  # its traceback, exit 1
            raise
        err.print(f"error: {printable(line)}", markup=False)
        _leave_promptly(code)
        raise SystemExit(code) from None


EXIT_GRACE_S = 30.0  # how long a command may take to exit once done (SWEEP_EXIT_GRACE_S), the trials' leftovers too
SIGNALLED_EXIT_GRACE_S = 5.0  # ... once stopped by Ctrl-C or SIGTERM: a scheduler's grace is short


def _leave_promptly(code: object) -> None:
    """Exit with `code` within a grace period whatever a trial's code left behind (review): a thread that is not a
    daemon, which the interpreter waits for at exit, and a multiprocessing pool whose worker the SIGTERM killed, whose
    exit handler then waits forever on a lock that worker held. Both kept `sweep run` alive with its study done.
    A thread it waits for is named in a note; past the grace the process leaves with its code, saying so. Armed on
    every way `main` ends but a Ctrl-C before any command ran (nothing of a trial's is left then)."""
    import threading

    status = code if isinstance(code, int) else 0 if code is None else 1
    try:
        grace = float(os.environ.get("SWEEP_EXIT_GRACE_S", "")) if os.environ.get("SWEEP_EXIT_GRACE_S") else (
            SIGNALLED_EXIT_GRACE_S if status in (130, 143) else EXIT_GRACE_S)
    except ValueError:
        grace = EXIT_GRACE_S
    main = threading.main_thread()
    lingering = [t.name for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]
    # MLflow's own background logging (a tracking store that failed mid-run leaves its threads): sweep's, not the
    # trials' code's (integrations review)
    mlflow = [name for name in lingering if name.startswith("MLflow")]
    theirs = [name for name in lingering if not name.startswith("MLflow")]
    left_by = "MLflow" if mlflow and not theirs else "the trials' code"
    if theirs:
        err.print(f"note: the trials' code left {len(theirs)} thread{'s' if len(theirs) > 1 else ''} running "
                  f"({', '.join(map(printable, theirs))}; not daemon threads)"
                  f"{f' and MLflow its background logging ({len(mlflow)})' if mlflow else ''}: waiting up to "
                  f"{grace:g} s for {'them' if len(lingering) > 1 else 'it'} before exiting", markup=False)
    elif mlflow:
        err.print(f"note: MLflow's background logging is still running ({len(mlflow)} thread"
                  f"{'s' if len(mlflow) > 1 else ''}): waiting up to {grace:g} s for it before exiting", markup=False)

    def leave() -> None:
        with contextlib.suppress(Exception):
            err.print(f"note: exited {grace:g} s after the command ended, without waiting longer for what {left_by} "
                      "left running (a thread, a process pool)", markup=False)
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status)

    with contextlib.suppress(RuntimeError):  # no thread to be had (`ulimit -u`): exit as Python does
        timer = threading.Timer(grace, leave)
        timer.daemon = True
        timer.start()


# The commands that only read a study: an error they let out comes from what the database holds (a study edited by
# hand or by another tool: an attr of the wrong type, a row Optuna itself cannot read), and is one line.
_READS = frozenset({"status", "trials", "best", "report", "check", "reproduce"})


def _unreadable(exc: BaseException) -> tuple[str | None, int]:
    """An error a reading command let out, as one line (where it was raised, and how to see the traceback); `(None,
    0)` for any other command's, or with SWEEP_TRACEBACK set."""
    import traceback

    command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
    if command not in _READS or os.environ.get("SWEEP_TRACEBACK"):
        return None, 0
    url = _OPENED[0] if _OPENED else None
    where = "the study" if url is None else f"the study in {mask_url(url)}"
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ is not None else None
    at = f" (at {Path(frame.filename).name}:{frame.lineno})" if frame is not None else ""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return (f"sweep {command}: cannot read {where}: {type(exc).__name__}: {mask_urls(first)}{at}; was the database "
            "edited by hand or by another tool? (SWEEP_TRACEBACK=1 shows the traceback)", 1)


_OPENED: list[str] = []  # the storage URL the command opened, for an error it lets out (`_storage_error`)
_OPENED_FILE: list[Any] = []  # its SQLite file as opened (`database_identity`): deleted since, the error is that


def _storage_error(exc: BaseException) -> tuple[str | None, int]:
    """A storage error that a command let out, as one line and its exit code: a SQLite file damaged past the
    pages its opening reads (2: the input), or a call the storage refused (1: its state or the role's rights);
    `(None, 0)` for the rest, which stays a traceback (a bug is not hidden behind a line)."""

    from sweep.storage import (
        damaged_database,
        database_gone,
        error_chain,
        error_line,
        is_transient,
        refusal_line,
        storage_refusal,
    )

    url = _OPENED[0] if _OPENED else None
    path = None if url is None else sqlite_path(url)
    where = f"the storage {mask_url(url)}" if path is None and url is not None else str(path or "the storage")
    if (damage := damaged_database(exc)) is not None:
        return f"{where} cannot be read ({damage}); is the file damaged?", 2
    for error in error_chain(exc):
        if isinstance(error, (KeyError, ValueError)) and error.args and _GONE_RECORD.fullmatch(str(error.args[0])):
            # Optuna's words for a study's or a trial's row that is not there: another program deleted the study
            # (`optuna delete-study`, the dashboard) while this command used it.
            return (f"{where}: the study's rows are gone from the storage ({error.args[0]}): was the study deleted "
                    "while this command ran (`optuna delete-study`, the dashboard)? Nothing more of it can be stored",
                    1)
    refusal = storage_refusal(exc)
    if refusal is not None and (gone := database_gone(_OPENED_FILE[0] if _OPENED_FILE else None)) is not None:
        return gone, 1  # what the refusal then means ("no such table" of the new empty file SQLite made there)
    if refusal is not None:
        return f"{where}: {refusal[0]}", 1
    if url is None:
        return None, 0
    # A command's own call, made without a worker's `Boundary` (`sweep stop`'s write, `check --repair`'s deletes):
    # refused (a read-only standby, the role's rights) or cut off midway (the server restarted). Review: `sweep stop`
    # on a read-only database printed 131 lines ending in Optuna's "invalid data in the commit".
    if (refused := refusal_line(exc)) is not None:
        return f"{where}: {redact(refused, url)}; run the command again once the storage accepts it", 1
    if is_transient(exc):
        return (f"{where} failed during this command ({redact(error_line(exc), url)}); run it again once the storage "
                "is back"), 1
    return None, 0


_GONE_RECORD = re.compile(r"Record does not exist\.|No trial with trial id \d+ exists\.")


if __name__ == "__main__":
    main()
