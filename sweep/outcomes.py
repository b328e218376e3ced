"""How a trial ended, as one vocabulary, and what follows from it: its Optuna state, whether it counts towards
`n_trials`, whether its params are trained again. Also the names of everything sweep stores on a trial.

| outcome        | state    | counts | retried | meaning                                                       |
|----------------|----------|--------|---------|---------------------------------------------------------------|
| complete       | COMPLETE | yes    | no      | trained to `max_steps`                                        |
| pruned         | PRUNED   | yes    | no      | stopped by the pruner (fast-fail or the wrapped one)          |
| failed         | FAIL     | yes    | no      | the config's fault: it raised, ran out of memory, diverged    |
| interrupted    | FAIL     | no     | yes     | Ctrl-C                                                        |
| preempted      | FAIL     | no     | yes     | SIGTERM: a scheduler or a spot instance took the machine      |
| lost           | FAIL     | no     | yes     | its worker stopped beating (killed, machine gone)             |
| infrastructure | FAIL     | no     | yes     | the machine's fault: disk full, storage or folder gone        |

A retried trial's params are queued again; the retry (`retry_of` names the original) resumes from the newest
checkpoint of its lineage and counts in its place. Pure functions of stored trials: no storage access here.
"""

from __future__ import annotations

import enum
import errno
import math
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from trainer.config import DeviceUnavailable
from trainer.limits import (  # and `resource`, now: with no descriptor left, it cannot be
    OUT_OF_MEMORY_WORDS,
    limit_words,
    soft_limit,
)

__all__ = [
    "ATTR_CONFIG",
    "OBJECT_STORE_CLIENTS",
    "Fault",
    "ObjectStoreError",
    "Outcome",
    "TimedOut",
    "TrialResult",
    "budget_counts",
    "failure_reason",
    "failure_signature",
    "file_size_limit",
    "infrastructure_fault",
    "jsonable",
    "limit_reached",
    "lineage",
    "lost_in_a_cohort",
    "lost_in_a_row",
    "outcome_of",
    "process_limit",
    "retried_numbers",
]

# Trial user attrs written by sweep: one name for each thing, shown as-is in optuna-dashboard.
ATTR_CONFIG = "config"
ATTR_COHORT = "cohort"  # {id, size, member}: the cohort a trial trained in (sweep.cohort)
ATTR_REPRO = "reproducibility"
ATTR_METRICS = "metrics"
ATTR_STEPS = "steps"
ATTR_WALL = "wall_time_s"
ATTR_OUTCOME = "outcome"  # an `Outcome` value: why the trial ended, beyond Optuna's three states
ATTR_FAIL = "fail_reason"
ATTR_PRUNE = "prune_reason"
ATTR_TRACEBACK = "traceback"
ATTR_INTERRUPTED = "interrupted"
ATTR_RETRY_OF = "retry_of"
ATTR_RETRY_REASON = "retry_reason"
ATTR_RETRY_DEPTH = "retry_depth"  # infrastructure faults in a row that led to this trial
ATTR_RESUMED_FROM = "resumed_from"  # {trial, step}: the lineage's checkpoint this trial continued from
ATTR_WARM_START = "warm_start_from"  # {study, trial, step, distance, value, checkpoint_id, uri, sha256}
ATTR_STEPS_TRAINED = "steps_trained"  # steps this trial trained itself (a warm or resumed trial starts later)
ATTR_SPEED = "speed"  # the latest log's samples/s, tokens/s, peak device memory (MB), GPU utilisation (%)
ATTR_CHECKPOINT = "checkpoint"  # the trial's best checkpoint, uploaded as an Optuna artifact
ATTR_REPORT_MS = "report_ms"
ATTR_CONFIRMS = "confirms"  # on a cold confirmation trial: the number of the warm trial it retrains
ATTR_LINEAGE = "lineage"  # one readable line on where a warm trial's value came from (for optuna-dashboard)
ATTR_RANKS = "ranks"  # a data-parallel trial's ranks: {world, pids} while it trains; then each rank's stop step
ATTR_LOG = "log"  # a command trial's log file: its stdout and stderr
# Trial system attr: {interval, grace} of the worker that beats for it. Another worker judges its silence by the
# longer of that grace period and its own: a study file edited between runs may give two workers different ones.
HEARTBEAT_ATTR = "sweep.heartbeat"
# On a trial asked while the storage restarted, beyond `n_trials` (another worker asked too, its lock gone with the
# server's sessions): ended before it trained, and counted nowhere. The reason, as a sentence.
ATTR_WITHDRAWN = "withdrawn"
# [[step, value], ...]: the training counterpart of the metric at each evaluation, for fast-fail's overfitting rule
# (written only while that rule is on)
ATTR_TRAIN_CURVE = "train_curve"
# A trial's val_loss at its evaluations, where the study's metric is another (val_accuracy): fast-fail's NaN/Inf and
# explosion rules read it (`FastFailPruner.prune`), as they read the metric itself where that is the loss.
ATTR_LOSS_CURVE = "loss_curve"

SPEC_ATTR = "sweep.spec"  # study user attr: the study file as validated
OWNER_ATTR = "sweep.owner"  # study user attr: a random id made at creation, which its checkpoint folder records
ARTIFACTS_ATTR = "sweep.artifacts"  # study user attr: the folder of the artifact store (for sweep dashboard)
STOP_ATTR = "sweep.stop_requested_at"  # study user attr set by `sweep stop`
SLURM_JOBS_ATTR = "sweep.slurm_jobs"  # study user attr: the Slurm job arrays `sweep submit` started (job id, log dir)

LOST_REASON = "worker lost: no heartbeat"


class TimedOut(BaseException):
    """`--timeout` passed while a trial trained: it stops at its next evaluation, after a checkpoint there, and is
    queued again like an interrupted trial."""


class Outcome(str, enum.Enum):
    COMPLETE = "complete"
    PRUNED = "pruned"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    PREEMPTED = "preempted"
    LOST = "lost"
    INFRASTRUCTURE = "infrastructure"

    @property
    def state(self) -> TrialState:
        return {Outcome.COMPLETE: TrialState.COMPLETE, Outcome.PRUNED: TrialState.PRUNED}.get(self, TrialState.FAIL)

    @property
    def retried(self) -> bool:
        """Not the config's fault: its params are trained again, and it does not count towards `n_trials`."""
        return self in (Outcome.INTERRUPTED, Outcome.PREEMPTED, Outcome.LOST, Outcome.INFRASTRUCTURE)

    @property
    def donor(self) -> bool:
        """Its checkpoints may seed other trials (a failed trial's may be what made it fail)."""
        return self in (Outcome.COMPLETE, Outcome.PRUNED)


@dataclass
class TrialResult:
    """What a runner hands the worker: the outcome, the value (COMPLETE only) and the attrs to store."""

    outcome: Outcome
    value: float | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    fault: Fault | None = None  # INFRASTRUCTURE: the machine's fault, compared for repeats, and what fixes it

    @property
    def reason(self) -> str | None:
        return self.attrs.get(ATTR_FAIL)


def count_key(trial: FrozenTrial) -> str:
    """How a run counts a finished trial: `complete`, `pruned`, `fail` (its config failed), or the outcome of a trial
    that ended for a reason not its config's (`interrupted`, `preempted`, `lost`, `infrastructure`): a run whose
    trials were all stopped by its --timeout, Ctrl-C or a lost worker did not fail (`results.failed_run`)."""
    outcome = outcome_of(trial) if trial.state == TrialState.FAIL else None
    return outcome.value if outcome is not None and outcome.retried else trial.state.name.lower()


_OUTCOME_VALUES = frozenset(outcome.value for outcome in Outcome)




def outcome_of(trial: FrozenTrial) -> Outcome | None:
    """The outcome of a finished trial, also for trials stored before the `outcome` attr existed (or whose attr
    names none: a database edited by hand; then read from its state, as for those)."""
    stored = trial.user_attrs.get(ATTR_OUTCOME)
    if isinstance(stored, str) and stored in _OUTCOME_VALUES:
        return Outcome(stored)
    if trial.state == TrialState.COMPLETE:
        return Outcome.COMPLETE
    if trial.state == TrialState.PRUNED:
        return Outcome.PRUNED
    if trial.state != TrialState.FAIL:
        return None
    if trial.user_attrs.get(ATTR_INTERRUPTED):
        reason = str(trial.user_attrs.get(ATTR_FAIL, ""))
        return Outcome.PREEMPTED if reason.startswith("preempted") else Outcome.INTERRUPTED
    if ATTR_FAIL not in trial.user_attrs:
        # Another tool's failure in this study (plain Optuna's `optimize(catch=...)`), or a trial of sweep's told
        # FAIL from outside (optuna-dashboard, `Study.tell`): a worker that fails a lost trial writes why in the same
        # transaction (`PatientStorage.fail_lost_trial`). It was not lost; it failed, as decided (review: sweep
        # called such trials lost, wrote "worker lost" over them and trained their params again).
        return Outcome.FAILED
    if trial.user_attrs[ATTR_FAIL] == LOST_REASON:
        return Outcome.LOST  # failed as lost, by a worker of an older sweep that wrote no outcome
    return Outcome.FAILED


def retried_numbers(trials: Iterable[FrozenTrial]) -> set[int]:
    """The numbers of the trials that a later trial retries (its `retry_of`). Only a later trial retries an earlier
    one: a `retry_of` naming itself or a later trial (a database edited by hand) would let two failures each excuse
    the other, and the budget be spent twice."""
    return {origin for t in trials if isinstance(origin := t.user_attrs.get(ATTR_RETRY_OF), int)
            and not isinstance(origin, bool) and origin < t.number}


def budget_counts(trials: Iterable[FrozenTrial]) -> tuple[int, int]:
    """(trials that used up a unit of `n_trials`, trials running now).

    Completed and pruned trials count, and failed ones, unless the failure was not the config's: a trial
    interrupted, preempted, lost or failed by the machine has a retry queued (a later trial whose `retry_of` names
    it), which counts in its place. A withdrawn trial (`ATTR_WITHDRAWN`: asked beyond the budget in a server restart,
    never trained) counts nowhere."""
    trials = list(trials)
    retried = retried_numbers(trials)
    used = running = 0
    for t in trials:
        if ATTR_WITHDRAWN in t.user_attrs:
            continue
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            used += 1
        elif t.state == TrialState.FAIL and t.number not in retried:
            used += 1
        elif t.state == TrialState.RUNNING:
            running += 1
    return used, running


def lineage(trials: Mapping[int, FrozenTrial], number: int) -> list[int]:
    """The trial and the trials it retries, newest first: `number`, its `retry_of`, that one's, and so on."""
    chain: list[int] = []
    current: int | None = number
    while current is not None and current not in chain:
        chain.append(current)
        trial = trials.get(current)
        origin = None if trial is None else trial.user_attrs.get(ATTR_RETRY_OF)
        current = None if origin is None else int(origin)
    return chain


def lost_in_a_row(trials: Mapping[int, FrozenTrial], number: int) -> int:
    """How many of the last attempts of trial `number`'s lineage (it and the trials it retries), up to it, were lost
    in a row without getting further, while training alone: an attempt lost after reporting beyond every earlier
    attempt's furthest step starts the count again at 1; one that ended any other way (interrupted, preempted, the
    machine's fault) ends it. An attempt lost in a cohort of several (another member may have killed the process)
    or before it started (asked, waiting its turn: no config written) is not counted either way. A config that
    kills its worker (a segfault, the kernel's out-of-memory killer) is lost at the same point each time, while a
    machine that fails now and then lets each attempt get further."""
    furthest, streak = -1, 0
    for attempt in reversed(lineage(trials, number)):
        trial = trials.get(attempt)
        if trial is None:
            continue
        reached = max(trial.intermediate_values, default=-1)
        if outcome_of(trial) is Outcome.LOST:
            if ATTR_CONFIG in trial.user_attrs and not _in_a_cohort(trial):
                streak = 1 if reached > furthest else streak + 1
        else:
            streak = 0
        furthest = max(furthest, reached)
    return streak


def _in_a_cohort(trial: FrozenTrial) -> bool:
    """Whether the trial trained in a cohort of several (`ATTR_COHORT`): its worker process was the members'."""
    cohort = trial.user_attrs.get(ATTR_COHORT)
    size = cohort.get("size") if isinstance(cohort, dict) else None
    return isinstance(size, int) and size > 1


def lost_in_a_cohort(trials: Mapping[int, FrozenTrial], number: int) -> int:
    """How many attempts of trial `number`'s lineage were lost in a cohort of several: who killed that process, it
    or another member, cannot be told. Once is the machine's way (a preempted node, a killed job: retried in a
    cohort again); twice, and its retries train alone (sweep.cohort), where a loss is its own."""
    return sum(outcome_of(trial) is Outcome.LOST and _in_a_cohort(trial)
               for n in lineage(trials, number) if (trial := trials.get(n)) is not None)


# How a trial that ran out of memory says so (`trainer.precision.out_of_memory`, in its stored reason's words).
_OUT_OF_MEMORY = (*OUT_OF_MEMORY_WORDS, "MemoryError")  # a reason line's words, or a bare MemoryError's type
_SQL_DETAILS = re.compile(r"\s*(\[SQL: .*|\(Background on this error at: [^)]*\))$", re.DOTALL)


# A number in an error's message: a shape, a value, an index. A broken model or loop raises the same error for every
# config with the config's own numbers in it ("mat1 and mat2 shapes cannot be multiplied (64x143 and 128x10)").
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def failure_reason(trial: FrozenTrial) -> str:
    """A failed trial's reason as the study's stop line shows it: less what SQLAlchemy appends (the statement and its
    parameters, which differ per trial)."""
    return _SQL_DETAILS.sub("", str(trial.user_attrs.get(ATTR_FAIL)))


def failure_signature(trial: FrozenTrial, *, numbers: bool = False) -> str | None:
    """What makes two failures "the same way": the same exception and message but for the numbers in it (review: a
    loop's bug whose message held each trial's own value, or a model whose shapes fail for every width, failed all 200
    trials of a study, none "the same way"), or NaN/Inf at the same step. A divergence at different steps, an
    explosion, or running out of memory at different sizes is a property of the configs: its numbers are kept (a
    command's exit code too, and a command killed by SIGKILL, the out-of-memory killer's signal, keeps its log's), and
    a divergence before the end has no signature. `numbers`: every message's numbers are kept (once a trial of the
    study has trained, messages that differ in them are the configs' doing: "hidden 17 unsupported")."""
    outcome = outcome_of(trial)
    if outcome == Outcome.FAILED:
        said = failure_reason(trial)
        if numbers or said.startswith("diverged: ") or any(words in said for words in _OUT_OF_MEMORY):
            return said
        if said.startswith("the command "):  # its exit code or signal, then its log's last lines (diff review)
            how, colon, tail = said.partition(": ")
            return said if "SIGKILL" in how else how + colon + _NUMBER.sub("#", tail)  # SIGKILL: the OOM killer's
        return _NUMBER.sub("#", said)
    reason = trial.user_attrs.get(ATTR_PRUNE) or {}
    if outcome == Outcome.PRUNED and reason.get("rule") in ("nan", "inf"):
        return f"{reason['rule']} at step {reason.get('step')}"
    return None


# Errors of the machine, not of the config. Out of space or quota, a read-only filesystem and I/O errors are the
# machine's wherever they happen; a missing file or a refused permission only under the study's own folders (its
# checkpoint store, its database's folder): elsewhere it is a path the config names. Out of memory is never the
# machine's: it is a property of the config (its model and batch size), and the same config runs out again.
class ObjectStoreError(RuntimeError):
    """The checkpoint store's client (boto3, google-cloud-storage) failed on a call sweep made (`sweep.blobs`)."""


OBJECT_STORE_CLIENTS = ("botocore.", "boto3.", "s3transfer.", "google.auth.", "google.api_core.", "google.cloud.",
                         "google.resumable_media.")
_ANYWHERE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}
# EEXIST: a file where the study's folder must be (mkdir refuses it): not the config's doing.
_UNDER_OWN_FOLDERS = {errno.ENOENT, errno.ENOTDIR, errno.EEXIST, errno.EACCES, errno.EPERM, errno.ESTALE}


FOLDER_FIX = "free space, remount or recreate the folder"
# A limit of the process (`ulimit`) that a resource error hit, not the config's doing: errno, the limit's
# `resource` name, its `ulimit` option and what it counts.
_LIMITS = {errno.EMFILE: ("RLIMIT_NOFILE", "-n", "open-files"), errno.EFBIG: ("RLIMIT_FSIZE", "-f", "file-size")}
_NO_THREAD = "can't start new thread"  # CPython's words when the process or thread limit (`ulimit -u`) is reached


def process_limit(exc: BaseException) -> tuple[BaseException, str, str] | None:
    """The error in `exc`'s chain that a process limit caused, the limit in words and its `ulimit` option: too many
    open files (EMFILE; ENFILE, the system's), a file over the file-size limit (EFBIG), a thread that could not
    start (the process limit); None for any other error."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (*_LIMITS, errno.ENFILE) and not (
                error.errno == errno.EFBIG and soft_limit("RLIMIT_FSIZE") == math.inf):  # else the file system's cap
            name, option, what = _LIMITS.get(error.errno, ("", "-n", ""))
            said = limit_words(name, option, what) if name else "the system's open-files limit is reached"
            return error, said, option
        if isinstance(error, RuntimeError) and str(error).startswith(_NO_THREAD):  # CPython's own words, alone
            return error, limit_words("RLIMIT_NPROC", "-u", "process"), "-u"
        error = error.__cause__ or error.__context__
    return None


def limit_reached(exc: BaseException) -> Fault | None:
    """The fault when `exc`, or an error it was raised from, hit a process limit (`process_limit`); None for any
    other error. A limit is the machine's, not the config's: the same config trains where it is higher."""
    if (found := process_limit(exc)) is None:
        return None
    error, limit, option = found
    if isinstance(error, RuntimeError):
        return Fault(f"cannot start a thread ({limit})", "no thread: a process limit",
                     "raise that limit where the workers start (ulimit -u), or run fewer workers")
    assert isinstance(error, OSError)
    named = exc if isinstance(exc, OSError) and exc.filename is not None else error  # a checkpoint's own words
    said = str(named) if named.filename is None or str(named.filename) in str(named) \
        else f"{named.strerror}: {named.filename}"
    said = said.rsplit(" (", 1)[0] if said.endswith(" free)") else said  # not the space left: no disk's doing
    return Fault(f"{said} ({limit})", f"{errno.errorcode.get(error.errno or 0, 'limit')}: a process limit",
                 f"raise that limit where the workers start (ulimit {option}), or lower what the trials use")


def file_size_limit() -> str | None:
    """This process's file-size limit in words ("the file-size limit, ulimit -f, is 153600 bytes"), or None where
    it has none."""
    return None if soft_limit("RLIMIT_FSIZE") == math.inf else limit_words("RLIMIT_FSIZE", "-f", "file-size")


RANK_FIX = ("find what kills or stalls the trial's rank processes (the out-of-memory killer, a GPU fault, a batch "
            "system), or raise resources.collective_timeout_s if a rank is only slow")


@dataclass(frozen=True)
class Fault:
    """A fault of the machine: the one-line reason stored on the trial, its kind (the error in a folder, without
    the file: the same full disk fails each trial on another file) and what fixes it, said when the same kind stops
    the worker."""

    reason: str
    kind: str
    fix: str = FOLDER_FIX


def infrastructure_fault(exc: BaseException, own_folders: Iterable[str | PurePath] = ()) -> Fault | None:
    """The fault, with a reason naming the path (and, for a full disk, the space left there), when `exc`, or an error
    it was raised from, is a fault of the machine; None when it is the config's."""
    if (limit := limit_reached(exc)) is not None:
        return limit
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno is not None:
            path = None if error.filename is None else str(error.filename)
            own = path is not None and any(_under(path, folder) for folder in own_folders)
            if error.errno in _ANYWHERE or (error.errno in _UNDER_OWN_FOLDERS and own):
                if path is not None and path in (error.strerror or ""):  # a message of ours that names it already
                    text = str(error.strerror)
                else:
                    text = str(error) if path is None or path in str(error) else f"{error.strerror}: {path}"
                free = _free_space(path) if error.errno in (errno.ENOSPC, errno.EDQUOT) else ""
                folder = "" if path is None else str(PurePath(path).parent)
                return Fault(text + ("" if " free" in text else free),
                             f"{errno.errorcode.get(error.errno, error.errno)} in {folder}")
        if isinstance(error, ObjectStoreError):
            # The checkpoint store's client failed (no credentials, access denied, the endpoint unreachable, no such
            # bucket): the store's fault, never the config's. Its trial is retried, and the same fault three times
            # in a row stops the worker with it.
            cause = error.__cause__
            return Fault(f"the checkpoint store's client failed: {error}",
                         f"{type(cause).__name__ if cause is not None else 'error'} at the object store",
                         "the checkpoint store's credentials, bucket or endpoint")
        if isinstance(error, DeviceUnavailable):
            # `device: cuda` on a machine whose torch sees no GPU (no driver, a CPU-only torch, a node whose GPU
            # fell off the bus): the same config trains on a machine that has one, so the trial is retried there.
            return Fault(str(error), "device unavailable", "run the worker on a machine where torch sees that "
                         "device, or set device: auto")
        error = error.__cause__ or error.__context__
    return None


def _under(path: str, folder: str | PurePath) -> bool:
    try:
        return PurePath(path).is_relative_to(PurePath(folder))
    except ValueError:
        return False


def _free_space(path: str | None) -> str:
    if path is None:
        return ""
    folder = Path(str(path))
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return f" ({_size(free)} free)"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def jsonable(value: Any) -> Any:
    """User attrs are stored as JSON: NaN and Inf become the strings 'nan', 'inf', '-inf' (valid JSON that the
    dashboard can show), anything else unknown becomes its str()."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
