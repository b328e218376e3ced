"""`sweep reproduce STUDY TRIAL`: train one trial again from what the storage holds and compare its reports.

The stored `config` user attr is the trial's whole `TrainingConfig` (fixed values, sampled params, seed, task), or a
user loop's config (rerun by calling the study's `loop` again, with a local recorder as its `run`'s reporter); a
warm-started trial also names its parent checkpoint (`warm_start_from`), which is loaded again. The rerun reports to
a local recorder, not to the study, and stops where the trial stopped (a pruned trial is replayed up to its last
report). It runs with the torch thread counts the trial recorded (`reproducibility.threads`): a worker of
`--workers N` trained with a share of the cores, and a sum over another number of threads rounds differently. On CPU
the values must match bit for bit; on a GPU within a relative tolerance, since cuBLAS and cuDNN kernels are not
deterministic unless `deterministic: true`. A data-parallel trial (`resources.devices_per_trial`) is replayed on
one rank, within `DATA_PARALLEL_TOLERANCE`.

What the database names is not trusted: whoever can write it could name any `module:function` as the task (or the
curriculum schedule), and reproducing imports and calls it. So only built-in tasks and schedules and those of the
study file given on the command line run; anything else needs `trust_code` (`--trust-task`). The parent checkpoint
is read only from inside its study's part of the checkpoint store (`sweep.blobs.BlobScope`).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
import torch
from optuna.trial import FrozenTrial, TrialState

from sweep.blobs import BlobScope, load_blob
from sweep.objective import metric_value, task_for
from sweep.outcomes import (
    ATTR_COHORT,
    ATTR_CONFIG,
    ATTR_OUTCOME,
    ATTR_RANKS,
    ATTR_REPRO,
    ATTR_RESUMED_FROM,
    ATTR_STEPS,
    ATTR_WARM_START,
    SPEC_ATTR,
)
from sweep.signals import Preempted, caught_stop, handled_by_trial, raise_stop, raised_at_once, stop_requested
from trainer import TrainingConfig, train
from trainer.checkpoint import CheckpointError, WarmStart
from trainer.messages import message, unreadable
from trainer.pacing import BUILTIN_SCHEDULES
from trainer.precision import resolve_device
from trainer.seeding import (
    THREAD_ENV,
    apply_threads,
    command_record,
    git_commit,
    reproducibility_record,
    seed_everything,
)
from trainer.tasks import BUILTIN_TASKS

if TYPE_CHECKING:
    from sweep.schema import StudySpec

__all__ = ["Comparison", "UntrustedCode", "code_in_study", "refuse_untrusted_code", "reproduce_trial",
           "user_code"]


class UntrustedCode(ValueError):
    """A stored config names user code (a task, a curriculum schedule) that only the database names."""


def user_code(config: Mapping[str, Any]) -> dict[str, str]:
    """The user code a stored `TrainingConfig` dict names, by what it is: `{"task": "pkg.mod:fn"}`, and
    `"curriculum schedule"` likewise; built-in names are left out. Nested and dotted spellings are both read, since
    the trainer accepts both."""
    curriculum = config.get("curriculum")
    found = {"task": [config.get("task")],
             "curriculum schedule": [config.get("curriculum.schedule"),
                                     curriculum.get("schedule") if isinstance(curriculum, Mapping) else None]}
    builtin = {"task": set(BUILTIN_TASKS), "curriculum schedule": set(BUILTIN_SCHEDULES)}
    return {f"{what} {value!r}": str(value) for what, values in found.items() for value in values
            if value is not None and value not in builtin[what]}


def code_in_study(spec: StudySpec) -> set[str]:
    """The user code a study file names, trusted because the user named the file: its task, and its curriculum
    schedule, fixed or among a searched key's choices."""
    from trainer.config import flatten

    if spec.task is None:  # a user's loop, or a user's command line
        return {name for name in (spec.loop, spec.command) if name is not None}
    names = {spec.task.name}
    fixed = flatten(spec.fixed, free=("model", "task_args"))
    if isinstance(fixed.get("curriculum.schedule"), str):
        names.add(fixed["curriculum.schedule"])
    searched = spec.space.get("curriculum.schedule")
    names.update(str(choice) for choice in getattr(searched, "choices", None) or ())
    return names


def refuse_untrusted_code(config: Mapping[str, Any], trusted: Collection[str], what: str) -> None:
    """Raise `UntrustedCode` when `config` names user code that is neither built in nor in `trusted`; `what` is the
    action that would run it ("reproducing trial 3")."""
    for label, name in user_code(config).items():
        if name not in trusted:
            raise UntrustedCode(
                f"{what} would import and run {label}, which only the database names (it is neither built in nor "
                "named by a study file given on the command line), and whoever can write the database chose it. "
                "Give the study file that defines the study instead of the database, or pass --trust-task if you "
                "trust whoever can write it")


@dataclass
class Comparison:
    trial: int
    steps_compared: int
    tolerance: float  # 0.0: bit for bit
    first_difference: tuple[int, float, float | None] | None  # (step, stored, reproduced; None: not reported)
    largest_difference: float = 0.0  # relative, over the values compared (0.0: every one bit for bit)
    final_only: bool = False  # a loop or command that never reported: its final value was compared
    # "running", or why a FAIL trial ended (its outcome: failed, interrupted, lost, ...): its reports so far were
    # compared, not a whole run
    unfinished: str | None = None
    raised: str | None = None  # the replay's own error ("MyError: ..."), raised after its first report
    # A complete loop trial's value (what `main` returned, else its last report), compared besides its reports:
    # (stored, reproduced; None: the replay gave none); None where there is no such value
    final: tuple[float, float | None] | None = None
    # What the trial's reproducibility record holds that this replay's does not: its data's fingerprint, library
    # versions, device, code commits, each "NAME THEN then, NOW now" (`changes_since`): a difference's likely cause
    changed: tuple[str, ...] = ()

    @property
    def final_differs(self) -> bool:
        if self.final is None:
            return False
        stored, again = self.final
        return again is None or not agree(stored, again, self.tolerance)

    @property
    def identical(self) -> bool:
        return self.first_difference is None and not self.final_differs and self.steps_compared > 0


class _Recorder:
    """What the replay reports. It is told to stop once it has reported the stored last step and every stored step
    it trains itself (`needed`: a loop may report out of order, 3 then 1 and 2), or a step beyond the last; with
    `last` None (a final value only), never."""

    def __init__(self, last: int | None, needed: Collection[int], metric: str) -> None:
        self.last, self.needed, self.metric = last, frozenset(needed), metric
        self.values: dict[int, float] = {}
        self.series: list[tuple[int, float]] = []  # what a command's session reads (sweep.runners.command.Reports)
        self.stopped = False  # told the replay to stop (its last stored step): what it raises after that is its end
        self.interrupted: BaseException | None = None  # Ctrl-C or SIGTERM raised into it, even if its code caught it
        self.raised: str | None = None  # the replay's own error ("MyError: ..."), raised after its first report
        self.at_once = raised_at_once()  # stops a second signal raised at once before the replay (sweep.signals)

    def poll(self, step: int) -> None:
        self._stop_if_asked()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._stop_if_asked()

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        self._stop_if_asked()
        self.values[step] = metric_value(metrics, self.metric)  # NaN with a non-finite val_loss, as the study stored
        done = self.last is not None and (step > self.last or (
            max(self.values) >= self.last and self.needed <= self.values.keys()))
        self.stopped = self.stopped or done
        return done

    def _stop_if_asked(self) -> None:
        """Ctrl-C or SIGTERM during the replay (`sweep.signals`), raised here, a clean point of the training loop:
        the main thread's only (a command's reports arrive on another). Noted too: a loop that catches it and
        raises its own error is still interrupted."""
        if threading.current_thread() is threading.main_thread():
            try:
                raise_stop(self.at_once, self.interrupted)
            except BaseException as exc:
                self.interrupted = self.interrupted or exc
                raise

    def caught(self) -> BaseException | None:
        """The stop the replay was asked for, if its code caught it (raised and noted here, or raised at once by a
        second signal in its own code), or was asked for and never raised into it where its code set a signal
        handler of its own (`sweep.signals.handled_by_trial`) and it returned before its last stored step (its
        handler heard the stop and it returned early)."""
        if self.interrupted is not None:
            return self.interrupted
        kind = stop_requested()
        early = kind() if kind is not None and handled_by_trial() and not self.stopped else None
        return caught_stop(self.at_once) or early


def agree(a: float, b: float, tolerance: float) -> bool:
    """Whether a replayed value `b` is the stored `a`: bit for bit at tolerance 0, else within `tolerance` of it,
    relative (NaN agrees with NaN only)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if tolerance == 0.0:
        return a == b
    # Relative, as promised; the absolute floor only keeps values at about 0 (an accuracy gap, a loss near its
    # minimum) from failing on rounding alone.
    return math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance * ABSOLUTE_FLOOR)


def _parent(trial: optuna.trial.FrozenTrial, scope: BlobScope) -> WarmStart | None:
    """A warm-started trial is replayed from the same parent checkpoint (pinned, so never collected), checked
    against the hash recorded when the trial started from it, and read only from inside its study's part of the
    store."""
    lineage = trial.user_attrs.get(ATTR_WARM_START)
    if lineage is None:
        return None
    uri = scope.find(str(lineage.get("uri")), str(lineage.get("study")))
    if uri is None:
        raise ValueError(f"trial {trial.number} was warm-started from {lineage.get('uri')!r}, which is not inside "
                         f"study {lineage.get('study')!r}'s part of the checkpoint store ({scope.location}): "
                         "refused, not read")
    try:
        state = load_blob(uri, lineage["sha256"])
    except CheckpointError as exc:
        raise ValueError(f"trial {trial.number} was warm-started from trial {lineage['trial']}'s checkpoint, which "
                         f"cannot be used: {exc}") from None
    return WarmStart(state, optimizer=lineage.get("inherit") == "weights+optimizer")


def _rerun_loop(name: str, config: dict[str, Any], recorder: _Recorder, parent: WarmStart | None, number: int,
                ) -> tuple[bool, float | None]:
    """A loop trial again, from its stored config (and its donor's state, if it was warm-started), reporting to
    `recorder`. Returns whether it asked for deterministic algorithms (the config's `deterministic`) and its value
    as the study takes it (`loop_value`)."""
    from sweep.runners.loop import Run, call_loop, load_loop, loop_seed, loop_value

    function = load_loop(name)
    seed = loop_seed(config)
    device = resolve_device(str(config.get("device", "auto")))
    run = Run(dict(config), recorder, recorder.metric, seed=seed, device=device, trial=number,
              initial=None if parent is None else parent.state, start=None if parent is None else "warm")
    seed_everything(seed)
    returned = call_loop(function, dict(config), run)  # its own error, a failed trial's too, is the caller's
    return bool(config.get("deterministic", False)), loop_value(returned, run)


def _error_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = (message(exc) or unreadable(exc)).strip().splitlines()  # a user's exception class's __str__ may raise
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@contextlib.contextmanager
def _replay(number: int, recorder: _Recorder) -> Iterator[None]:
    """The user's code replayed: an error it raises (a failed trial's own, `sys.exit`) ends the replay, and the
    values reported before it are compared, as a command's that exits non-zero; before its first report it is the
    whole answer, one line. Raised once the replay was told to stop (its last stored step), it is how the code
    stops, as for a pruned trial. Ctrl-C and SIGTERM stop the replay, also when the code caught them."""
    try:
        yield
    except BaseException as exc:  # whatever the user's code raises, as its trial took it (CancelledError too)
        if isinstance(exc, (KeyboardInterrupt, Preempted)):
            raise
        if (stop := recorder.caught()) is not None:  # a Ctrl-C its code caught and raised as its own error
            raise type(stop)() from None
        if recorder.stopped:  # told to stop, as a pruned trial is: how it stops is its own (TrialPruned, say)
            return
        recorder.raised = _error_line(exc)
        if not recorder.values:
            raise ValueError(f"trial {number}'s replay raised {recorder.raised} before its first report") from None
    if (stop := recorder.caught()) is not None:  # caught by its code, which went on or returned
        raise type(stop)()


@contextlib.contextmanager
def _threads_of(record: Mapping[str, Any]) -> Iterator[None]:
    """The trial's own torch thread counts for the rerun, and this process's back afterwards."""
    before = {"threads": {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads(),
                          **{name: os.environ.get(name) for name in THREAD_ENV}}}
    try:
        apply_threads(record)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    try:
        yield
    finally:
        apply_threads(before)


def _untrusted(number: int, doing: str) -> UntrustedCode:
    return UntrustedCode(f"reproducing trial {number} would {doing}, which only the database names, and whoever can "
                         "write the database chose it. Give the study file that defines the study instead, or pass "
                         "--trust-task if you trust whoever can write it")


ABSOLUTE_FLOOR = 1e-3  # of the tolerance: below tolerance * this, two values count as equal whatever their ratio
BATCHED_TOLERANCE = 1e-4  # relative: a cohort member replayed by the ordinary loop (sweep.cohort)
# relative: a data-parallel trial replayed on one rank: the gradient all-reduce sums in another order, a rounding
# that training grows (2.4e-7 after 200 steps on digits, bench/distributed.py; 2.7e-4 after 150 steps at a learning
# rate of 1e-2 in the quickstart study)
DATA_PARALLEL_TOLERANCE = 1e-3


def _trial(study: optuna.Study, number: Any) -> FrozenTrial | None:
    """Trial `number` of the study, read alone, or None where it has none (review: `get_trials` read every trial
    with every reported value, 7.7 s and 1 GB to replay one of 200 trials of 2,000 reports each)."""
    if not isinstance(number, int) or isinstance(number, bool):
        return None
    storage = study._storage  # noqa: SLF001 - Optuna has no public read of one trial by its number
    try:
        return storage.get_trial(storage.get_trial_id_from_study_id_trial_number(study._study_id, number))  # noqa: SLF001
    except KeyError:
        return None


def _lineage(study: optuna.Study, trial: FrozenTrial) -> list[FrozenTrial]:
    """`trial` and the trials it resumed from (`resumed_from`), each once, newest first."""
    found, current = [trial], trial
    while isinstance(resumed := current.user_attrs.get(ATTR_RESUMED_FROM), dict):
        previous = _trial(study, resumed.get("trial"))
        if previous is None or previous.number in {t.number for t in found}:
            break
        found.append(previous)
        current = previous
    return found


def _ranks(trial: FrozenTrial) -> int:
    """The ranks `trial` trained on: its reproducibility record's, or (a trial that ended before writing one:
    interrupted, preempted, failed) what its ranks' record says."""
    ranks = (trial.user_attrs.get(ATTR_REPRO) or {}).get("ranks")
    if ranks is None:
        ranks = (trial.user_attrs.get(ATTR_RANKS) or {}).get("world", 1)
    return ranks if isinstance(ranks, int) else 1


def reproduce_trial(study: optuna.Study, number: int, *, store: str, trusted: Collection[str] = (),
                    trust_code: bool = False, gpu_tolerance: float = 1e-3,
                    store_of: Callable[[str], str | None] | None = None) -> Comparison:
    """Train trial `number` again and compare its reports. `store`: the study's checkpoint store (a warm-started
    trial's parent is read from there only, or, for a parent of another study, `warm_start.from_studies`, from
    that study's store, `store_of(name)`, where it gives one). User code the stored config names runs only when it
    is in `trusted` (the study file's) or with `trust_code`; otherwise `UntrustedCode` is raised before anything is
    imported."""
    trial = _trial(study, number)
    if trial is None:
        raise KeyError(f"study {study.study_name!r} has no trial {number}")
    lineage = trial.user_attrs.get(ATTR_WARM_START)
    donor_study = lineage.get("study") if isinstance(lineage, dict) else None
    elsewhere = store_of(donor_study) if store_of is not None and isinstance(donor_study, str) \
        and donor_study != study.study_name else None
    parent_scope = BlobScope(elsewhere or store)
    stored_config = trial.user_attrs.get(ATTR_CONFIG)
    if not isinstance(stored_config, dict):
        raise ValueError(f"trial {number} has no stored config to train again (state {trial.state.name.lower()})")
    study_spec = study.user_attrs.get(SPEC_ATTR, {})
    metric = study_spec.get("metric", "val_loss")
    loop = study_spec.get("loop")
    command = study_spec.get("command")
    # A loop or command that never reported has its value from what the loop returned or the command printed last:
    # that one value is compared (at the trial's last step), the rerun left to run to its end.
    final_only = not trial.intermediate_values and trial.value is not None and (loop or command) is not None
    if not trial.intermediate_values and not final_only:
        raise ValueError(f"trial {number} reported no values while it trained (state {trial.state.name.lower()}), "
                         "so there is nothing to compare")
    last = int(trial.user_attrs.get(ATTR_STEPS) or 0)
    stored = {last: float(trial.value)} if final_only else dict(sorted(trial.intermediate_values.items()))  # type: ignore[arg-type]
    # A retry's reports up to the step it resumed from were copied from its lineage, which may have run under
    # another pruner (a study resumed with fast-fail switched off: the lineage's step-0 evaluation, which this
    # config does not make). Such a step is compared only where the replay reports it.
    inherited = (trial.user_attrs.get(ATTR_RESUMED_FROM) or {}).get("step", -1)
    # A complete trial of a user's code was never told to stop: its replay runs to its own end too, through the code
    # path the trial took (told to stop at its last report, a loop took its "pruned" branch).
    ran_out = final_only or (trial.state == TrialState.COMPLETE and (loop or command) is not None)
    recorder = _Recorder(None if ran_out else max(stored), [step for step in stored if step > inherited], metric)
    final: tuple[float, float | None] | None = None
    if command is not None:
        if not trust_code and command not in trusted:
            raise _untrusted(number, f"run the command {command!r}")
        from sweep.runners.command import last_json_value, rerun_command

        parent = _parent(trial, parent_scope)
        ran_in = (trial.user_attrs.get(ATTR_REPRO) or {}).get("workdir")  # its relative paths are from there
        cwd = Path(ran_in) if isinstance(ran_in, str) and Path(ran_in).is_dir() else None
        folder = Path(tempfile.mkdtemp(prefix="sweep-reproduce-"))
        with _threads_of(trial.user_attrs.get(ATTR_REPRO) or {}):  # its thread variables, for the command
            code = rerun_command(command, stored_config, number, recorder, None if parent is None else parent.state,
                                 float(study_spec.get("stop_grace_period", 10)), folder, cwd)
        log = folder / f"reproduce-{number}.log"
        if final_only:
            printed = last_json_value(log, metric) if code == 0 else None
            if printed is None:
                raise ValueError(f"trial {number}'s command exited with code {code} without printing its {metric} "
                                 f"as JSON; its output is in {log}")
            recorder.values[last] = printed
        elif code != 0 and not recorder.values:
            raise ValueError(f"trial {number}'s command exited with code {code} before its first report; its output "
                             f"is in {log}")
        shutil.rmtree(folder, ignore_errors=True)
        device = resolve_device(str(stored_config.get("device", "cpu")))
        deterministic = bool(stored_config.get("deterministic", False))
        data = None
    elif loop is not None:
        if not trust_code and loop not in trusted:
            raise _untrusted(number, f"import and run the loop {loop!r}")
        parent = _parent(trial, parent_scope)
        # What the config asks, and no value: where the replay raises after a report (`_replay`), it returned none.
        deterministic, value = bool(stored_config.get("deterministic", False)), None
        with _threads_of(trial.user_attrs.get(ATTR_REPRO) or {}), _replay(number, recorder):
            deterministic, value = _rerun_loop(loop, stored_config, recorder, parent, number)
        if final_only and value is not None:
            recorder.values[last] = value
        elif trial.state == TrialState.COMPLETE and not final_only:  # a replay that raised gave no value: differs
            final = (float(trial.value), value)  # type: ignore[arg-type]
        device, data = resolve_device(str(stored_config.get("device", "auto"))), None
    else:
        if not trust_code:  # before the config is parsed: parsing checks a user schedule by importing it
            refuse_untrusted_code(stored_config, trusted, f"reproducing trial {number}")
        config = TrainingConfig.from_dict(stored_config)
        parent = _parent(trial, parent_scope)
        with _threads_of(trial.user_attrs.get(ATTR_REPRO) or {}), _replay(number, recorder):
            task = task_for(config.task, config.task_args)  # its data missing is the replay's error, as before
            train(config, task, recorder, warm_start=parent)
        device, deterministic = resolve_device(config.device), config.deterministic
        data = task.data_digest()
    tolerance = 0.0 if device.type == "cpu" or deterministic else gpu_tolerance
    # The replay trains the whole run, also the steps its lineage trained before it resumed: each part's way of
    # training counts (a 1-rank retry of a 2-rank trial replays two ranks' steps on one).
    lineage = _lineage(study, trial)
    # (A member that never ended by its own hand, lost or killed, has no record saying so: its cohort attr does.)
    if any((t.user_attrs.get(ATTR_REPRO) or {}).get("batched") or ATTR_COHORT in t.user_attrs
           for t in lineage):  # trained in a cohort, replayed
        tolerance = max(tolerance, BATCHED_TOLERANCE)  # alone: stacked kernels may round differently
    if any(_ranks(t) > 1 for t in lineage):  # trained on several ranks, replayed on one
        tolerance = max(tolerance, DATA_PARALLEL_TOLERANCE)
    difference: tuple[int, float, float | None] | None = None
    largest, compared = 0.0, 0
    for step, value in stored.items():
        if step <= inherited and step not in recorder.values:
            continue
        compared += 1
        again = recorder.values.get(step)
        if again is None:  # the replay ended without reporting this step
            difference = (step, value, None)
            break
        if not agree(value, again, tolerance):
            difference = (step, value, again)
            break
        if value != again and math.isfinite(value) and math.isfinite(again):
            largest = max(largest, abs(value - again) / max(abs(value), abs(again)))
    unfinished = ("running" if trial.state == TrialState.RUNNING else
                  str(trial.user_attrs.get(ATTR_OUTCOME) or "failed") if trial.state == TrialState.FAIL else None)
    if final is not None and (again := final[1]) is not None and final[0] != again \
            and agree(final[0], again, tolerance):
        largest = max(largest, abs(final[0] - again) / max(abs(final[0]), abs(again)))
    if command is None:
        now = reproducibility_record(0, device, data=data)
    else:  # the command ran again in its own folder (`cwd`), whose commit counts
        # A folder gone since (moved, deleted): the command ran in this one instead, named with a difference.
        now = {**command_record([], None), "workdir": str(cwd) if cwd is not None else os.getcwd(),
               **({} if cwd is None else {"workdir_git_commit": git_commit(cwd)})}
    return Comparison(number, compared, tolerance, difference, largest, final_only, unfinished, recorder.raised,
                      final, changes_since(trial.user_attrs.get(ATTR_REPRO), now))


# What may change a replay's values, as a reproducibility record names it (`trainer.seeding`), and how to say so.
_RECORDED = {"data": "the task's data (fingerprint)", "torch": "torch", "numpy": "numpy", "python": "Python",
             "cuda": "CUDA", "cudnn": "cuDNN", "device": "device", "sweep_version": "sweep",
             "git_commit": "sweep's commit", "workdir": "the command's folder",
             "workdir_git_commit": "the command's folder's commit"}


def changes_since(stored: object, now: Mapping[str, Any]) -> tuple[str, ...]:
    """Each entry of the trial's reproducibility record (`stored`) that this process's record (`now`) holds
    otherwise, as "NAME THEN then, NOW now". An entry either record lacks or leaves None (a record written before it
    was kept, a loop's data) is not judged."""
    if not isinstance(stored, Mapping):
        return ()
    return tuple(f"{label} {stored[key]} then, {now[key]} now" for key, label in _RECORDED.items()
                 if stored.get(key) is not None and now.get(key) is not None and str(stored[key]) != str(now[key]))
