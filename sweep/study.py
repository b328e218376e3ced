"""Creating, loading and running the Optuna study described by a `StudySpec`.

The spec is stored on the study (user attr `sweep.spec`), so a study in a database describes itself: it can be
resumed, reproduced or inspected without the original file. `n_trials` is the study's total budget, not a count per
run: a rerun after an interruption finishes the remaining trials.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import math
import threading
import time
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import optuna
import sqlalchemy.exc
from optuna.trial import FrozenTrial, TrialState

from sweep.pruners import FastFailPruner
from sweep.blobs import CheckpointStore, artifact_store_for, is_object_url
from sweep.registry import Registry, default_store
from sweep.storage import ask_lock, make_storage, mask_url
from trainer.config import nest
from sweep.spec import SPEC_ATTR, Component, StudyFileError, StudySpec

__all__ = [
    "Events",
    "RunSummary",
    "StudyBrokenError",
    "StudyMismatchError",
    "budget_used",
    "build_pruner",
    "build_sampler",
    "component_problems",
    "mask_url",
    "open_study",
    "resolve_storage_url",
    "run_study",
]

# Trial user attrs written by sweep: one name for each thing, shown as-is in optuna-dashboard.
ATTR_CONFIG = "config"
ATTR_REPRO = "reproducibility"
ATTR_METRICS = "metrics"
ATTR_STEPS = "steps"
ATTR_WALL = "wall_time_s"
ATTR_FAIL = "fail_reason"
ATTR_PRUNE = "prune_reason"
ATTR_TRACEBACK = "traceback"
ATTR_INTERRUPTED = "interrupted"
ATTR_RETRY_OF = "retry_of"
ATTR_RETRY_REASON = "retry_reason"
ATTR_RESUMED_FROM = "resumed_from"
ATTR_WARM_START = "warm_start_from"  # {study, trial, step, distance, value, checkpoint_id, uri, sha256}
ATTR_STEPS_TRAINED = "steps_trained"  # steps this trial trained itself (a warm or resumed trial starts later)
ATTR_SPEED = "speed"  # the latest log's samples/s, tokens/s, peak device memory (MB), GPU utilisation (%)
ATTR_CHECKPOINT = "checkpoint"  # the trial's best checkpoint, uploaded as an Optuna artifact
ARTIFACTS_ATTR = "sweep.artifacts"  # study user attr: the folder of the artifact store (for sweep dashboard)
LOST = "worker lost: no heartbeat"  # the reason of a trial failed by the stale-trial check, and of its retry
ATTR_RETRY_DEPTH = "retry_depth"  # how many retries for a retryable error in a row led to this trial
STOP_ATTR = "sweep.stop_requested_at"  # study user attr set by `sweep stop`

# Failures that are not the config's: the trial is failed, its params are queued again (resuming from its last
# checkpoint), and it does not count towards n_trials. Anything else fails the trial for good: a config that cannot
# work (a bad value, out of memory) fails the same way again.
RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, sqlalchemy.exc.OperationalError,
                                                     sqlalchemy.exc.InterfaceError)
MAX_RETRIES = 2  # per lineage of retryable errors; lost workers and interruptions are always retried


class Preempted(BaseException):
    """SIGTERM: the machine is being taken away (a spot instance, a cluster's preemption). Like Ctrl-C, the running
    trial is marked and queued again; the retry resumes from its last checkpoint."""

SAMPLERS: dict[str, type[optuna.samplers.BaseSampler]] = {
    "tpe": optuna.samplers.TPESampler,
    "random": optuna.samplers.RandomSampler,
    "cmaes": optuna.samplers.CmaEsSampler,
    "gp": optuna.samplers.GPSampler,
    "qmc": optuna.samplers.QMCSampler,
    "nsgaii": optuna.samplers.NSGAIISampler,
    "bruteforce": optuna.samplers.BruteForceSampler,
}

PRUNERS: dict[str, type[optuna.pruners.BasePruner]] = {
    "median": optuna.pruners.MedianPruner,
    "percentile": optuna.pruners.PercentilePruner,
    "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
    "hyperband": optuna.pruners.HyperbandPruner,
    "wilcoxon": optuna.pruners.WilcoxonPruner,
    "threshold": optuna.pruners.ThresholdPruner,
    "patient": optuna.pruners.PatientPruner,
    "fastfail": FastFailPruner,
    "none": optuna.pruners.NopPruner,
}
# Pruners that wrap another: the argument in the study file, and the constructor's name for it.
WRAPPING = {"patient": ("wrapped", "wrapped_pruner"), "fastfail": ("then", "then")}


class StudyMismatchError(Exception):
    """The storage already holds a study of that name whose definition differs from the file."""


class StudyBrokenError(Exception):
    """Several trials in a row failed the same way: the code or the data is broken, not the configs."""


# ---------------------------------------------------------------------------------------------------------------------
# Samplers and pruners by name, their arguments checked against the constructor's signature.

def _instantiate(where: str, registry: Mapping[str, type], kind: str, args: dict[str, Any],
                 extra: dict[str, Any] | None = None) -> Any:
    if kind not in registry:
        raise StudyFileError("", [(f"{where}.type", f"unknown {where} {kind!r}; expected one of: "
                                                    + ", ".join(registry))])
    cls = registry[kind]
    accepted = {name: p for name, p in inspect.signature(cls).parameters.items()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    unknown = [name for name in args if name not in accepted]
    if unknown:
        raise StudyFileError("", [(f"{where}.{name}", f"unknown argument of {cls.__name__}; expected one of: "
                                                      + ", ".join(accepted)) for name in unknown])
    kwargs = {**{k: v for k, v in (extra or {}).items() if k in accepted and k not in args}, **args}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise StudyFileError("", [(where, f"{cls.__name__}: {exc}")]) from exc


def build_sampler(spec: StudySpec, joined_at: int = 0) -> optuna.samplers.BaseSampler:
    """The named sampler, seeded with the study's `seed` unless the file gives the sampler its own.

    `joined_at`: how many trials the study held when this process asked for its first one. A process that joins a
    study with trials in it (a resume, a second worker, a machine that started a moment later) must not replay the
    first process's random draws, or it trains the same configs again; its seed is derived from the seed and that
    count, which differs between processes joining one after another (they ask under the study's lock). A single
    process on a new study keeps the seed itself, so a seeded sweep is re-runnable."""
    args, seed = dict(spec.sampler.args), spec.sampler.args.get("seed", spec.seed)
    if joined_at and seed is not None:
        seed = int(np.random.SeedSequence([int(seed), joined_at]).generate_state(1)[0])
        if "seed" in args:
            args["seed"] = seed
    return _instantiate("sampler", SAMPLERS, spec.sampler.type, args, {"seed": seed})


def build_pruner(component: Component, where: str = "pruner") -> optuna.pruners.BasePruner:
    """The named pruner. `fastfail` wraps another with `then: {type: median, ...}`, `patient` with `wrapped:`."""
    args = component.args
    if component.type in WRAPPING:
        key, parameter = WRAPPING[component.type]
        inner = args.pop(key, None)
        if inner is not None:
            try:
                inner_component = Component.model_validate(inner)
            except ValueError as exc:
                raise StudyFileError("", [(f"{where}.{key}", f"expected a pruner name or {{type: ...}}: {exc}")]) \
                    from None
            args[parameter] = build_pruner(inner_component, f"{where}.{key}")
    return _instantiate(where, PRUNERS, component.type, args)


def component_problems(spec: StudySpec) -> list[tuple[str, str]]:
    problems = []
    for build in (lambda: build_sampler(spec), lambda: build_pruner(spec.pruner)):
        try:
            build()
        except StudyFileError as exc:
            problems += exc.problems
    return problems


# ---------------------------------------------------------------------------------------------------------------------
# Storage.

def resolve_storage_url(spec: StudySpec, spec_path: Path | None, override: str | None = None) -> str:
    """`--storage` wins, then the file's `storage:`, then a SQLite file next to the study file. A relative SQLite path
    in the file is relative to the file, so a study runs the same from any working directory."""
    if override:
        return override
    if spec.storage is None:
        folder = spec_path.parent if spec_path is not None else Path.cwd()
        return f"sqlite:///{(folder / f'{spec.name}.db').resolve()}"
    if spec.storage.startswith("sqlite:///") and spec_path is not None:
        path = spec.storage.removeprefix("sqlite:///")
        if path and not path.startswith("/") and path != ":memory:":
            return f"sqlite:///{(spec_path.parent / path).resolve()}"
    return spec.storage


def storage_for(spec: StudySpec, url: str) -> optuna.storages.RDBStorage:
    """The storage with the spec's heartbeat: a trial whose worker stops beating is failed and retried."""
    return make_storage(url, heartbeat_interval=spec.heartbeat_interval, grace_period=spec.heartbeat_grace_period,
                        stale_trial_callback=retry_lost_trial)


def retry_lost_trial(study: optuna.Study, trial: FrozenTrial) -> None:
    """Queue the params of a trial whose worker died (no heartbeat) so that another worker trains them."""
    _retry(study, trial, LOST)


def open_study(spec: StudySpec, storage: str | optuna.storages.BaseStorage) -> optuna.Study:
    """Create the study, or load it if it exists and has the same definition (task, fixed values, space, metric,
    direction). Budget, timeout, sampler and pruner may change between runs."""
    storage = storage_for(spec, storage) if isinstance(storage, str) else storage
    sampler, pruner = build_sampler(spec), build_pruner(spec.pruner)
    try:
        study = optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler, pruner=pruner)
    except KeyError:
        try:
            study = optuna.create_study(study_name=spec.name, storage=storage, sampler=sampler, pruner=pruner,
                                        direction=spec.direction)
        except optuna.exceptions.DuplicatedStudyError:  # another worker created it since we looked
            study = optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler, pruner=pruner)
        else:
            study.set_user_attr(SPEC_ATTR, spec.stored())
            return study
    stored = _stored_spec(study)
    if stored is None:
        raise StudyMismatchError(f"study {spec.name!r} exists but was not created by sweep; choose another name "
                                 "with --study-name")
    before = {key: stored.get(key) for key in spec.identity()}
    differences = [key for key, value in spec.identity().items()
                   if before[key] != value and not (key == "fixed" and _same_values(spec, before[key]))]
    if differences:
        raise StudyMismatchError(
            f"study {spec.name!r} already exists with a different {', '.join(differences)}; start a new study with "
            "--study-name NAME, or rerun with the original file")
    study.set_user_attr(SPEC_ATTR, spec.stored())  # the latest budget, sampler and pruner
    return study


def _same_values(spec: StudySpec, stored_fixed: Any) -> bool:
    """Fixed values written differently that mean the same (`1e-4`, which YAML reads as a string, and `0.0001`)."""
    try:
        stored = spec.model_copy(update={"fixed": nest(dict(stored_fixed or {}))})
        return stored.config_for({}).to_dict() == spec.config_for({}).to_dict()
    except Exception:  # noqa: BLE001 - values the trainer refuses cannot be the same as valid ones
        return False


def _stored_spec(study: optuna.Study, patience_s: float = 5.0) -> dict[str, Any] | None:
    """The definition the study was created with. A study that another worker has just created holds none for the
    moment between its creation and the write of its definition (workers on several machines start together), so an
    empty one is read again for a few seconds before it is taken for a study that sweep did not create."""
    deadline = time.monotonic() + patience_s
    while (stored := study.user_attrs.get(SPEC_ATTR)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return stored


def load_existing_study(storage_url: str, name: str | None) -> optuna.Study:
    """A study for reading: by name, or the only one in the storage."""
    storage = make_storage(storage_url)
    if name is None:
        names = optuna.get_all_study_names(storage)
        if len(names) != 1:
            found = ", ".join(names) if names else "none"
            raise KeyError(f"{mask_url(storage_url)} holds {len(names)} studies ({found}); name one with --study-name")
        name = names[0]
    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        names = optuna.get_all_study_names(storage)
        raise KeyError(f"no study named {name!r} in {mask_url(storage_url)}; it holds: "
                       f"{', '.join(names) if names else 'none'}") from None


# ---------------------------------------------------------------------------------------------------------------------
# Running.

def budget_counts(trials: list[FrozenTrial]) -> tuple[int, int]:
    """(trials that used up a unit of `n_trials`, trials running now).

    Finished and pruned trials count, and failed ones, unless the failure was not the config's: a trial interrupted
    by Ctrl-C or lost with its worker has a retry queued (a later trial whose `retry_of` names it), which counts in
    its place."""
    retried = {t.user_attrs.get(ATTR_RETRY_OF) for t in trials} - {None}
    used = running = 0
    for t in trials:
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            used += 1
        elif t.state == TrialState.FAIL and t.number not in retried:
            used += 1
        elif t.state == TrialState.RUNNING:
            running += 1
    return used, running


def budget_used(study: optuna.Study) -> int:
    return budget_counts(study.get_trials(deepcopy=False))[0]


def failure_signature(trial: FrozenTrial) -> str | None:
    """What makes two failures "the same way": the same exception and message, or NaN/Inf at the same step. A
    divergence at different steps, or an explosion, is a property of the configs and has no signature."""
    if trial.state == TrialState.FAIL and not trial.user_attrs.get(ATTR_INTERRUPTED):
        return str(trial.user_attrs.get(ATTR_FAIL, LOST))
    reason = trial.user_attrs.get(ATTR_PRUNE) or {}
    if trial.state == TrialState.PRUNED and reason.get("rule") in ("nan", "inf"):
        return f"{reason['rule']} at step {reason.get('step')}"
    return None


class Events(Protocol):
    """What a progress display hears while a study runs."""

    def trial_started(self, number: int, params: Mapping[str, Any]) -> None: ...
    def trial_log(self, number: int, step: int, metrics: Mapping[str, float]) -> None: ...
    def trial_finished(self, trial: FrozenTrial) -> None: ...


class NoEvents:
    def trial_started(self, number: int, params: Mapping[str, Any]) -> None:
        pass

    def trial_log(self, number: int, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def trial_finished(self, trial: FrozenTrial) -> None:
        pass


@dataclass
class RunSummary:
    ran: int  # trials this worker finished
    budget_used: int
    n_trials: int
    timed_out: bool = False
    exhausted: bool = False  # the sampler has tried every point of a finite search space
    stopped: bool = False  # `sweep stop` asked the workers to finish


def _artifact_store(study: optuna.Study, store: CheckpointStore) -> Any:
    """Beside the studies' checkpoint blobs; its place is kept on the study for `sweep dashboard`."""
    location = store.artifact_location
    if study.user_attrs.get(ARTIFACTS_ATTR) != location:
        study.set_user_attr(ARTIFACTS_ATTR, location)
    return artifact_store_at(location)


def artifact_store_at(location: str) -> Any:
    """Optuna's artifact store for a folder or an object-store URL."""
    if is_object_url(location):
        return artifact_store_for(location)
    Path(location).mkdir(parents=True, exist_ok=True)
    return optuna.artifacts.FileSystemArtifactStore(location)


def request_stop(study: optuna.Study) -> None:
    """Ask every worker running now to finish its current trial and exit; a later `sweep run` resumes."""
    study.set_user_attr(STOP_ATTR, time.time())


def _stop_requested(study: optuna.Study, since: float) -> bool:
    requested = study.user_attrs.get(STOP_ATTR)
    return requested is not None and requested > since


class _Heartbeat:
    """Beats for one running trial from a background thread, so a worker that dies stops beating."""

    def __init__(self, study: optuna.Study, trial: optuna.Trial) -> None:
        self.storage = study._storage  # noqa: SLF001 - Optuna has no public handle on a study's storage
        get_interval = getattr(self.storage, "get_heartbeat_interval", None)
        self.interval = get_interval() if get_interval is not None else None
        self.trial_id = trial._trial_id  # noqa: SLF001
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"heartbeat-{trial.number}")

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception:  # noqa: BLE001 - a storage blip: beat again next time rather than never again
                continue

    def __enter__(self) -> _Heartbeat:
        if self.interval:
            self.storage.record_heartbeat(self.trial_id)
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()


def run_study(study: optuna.Study, spec: StudySpec, *, n_trials: int | None = None, timeout: float | None = None,
              events: Events | None = None, storage_url: str | None = None) -> RunSummary:
    """Ask and tell until the study's budget is used (by this worker and any others), `timeout` seconds pass, or
    `sweep stop` asks to finish.

    Several workers (processes, machines) may run this on one study at once: counting the trials in flight and
    asking for a new one happen under `ask_lock`, so exactly `n_trials` trials are used. A trial whose worker died is
    failed once its heartbeat is stale and its params are queued again. A trial that raises becomes FAIL with its
    error stored and the study goes on. On Ctrl-C the running trial is marked interrupted, its params are queued for
    the next run, and KeyboardInterrupt propagates.
    """
    from sweep.objective import release_checkpoints, run_trial

    events = events if events is not None else NoEvents()
    n_trials = n_trials if n_trials is not None else spec.n_trials
    timeout = timeout if timeout is not None else spec.timeout
    started_wall, started, ran = time.time(), time.monotonic(), 0
    streak, streak_signature = 0, None  # how many of the latest trials failed the same way, and how
    lock = (lambda: ask_lock(storage_url, study.study_name)) if storage_url else contextlib.nullcontext
    registry = Registry(storage_url) if storage_url else None
    store = CheckpointStore(spec.checkpoints.store or default_store(storage_url), study.study_name) \
        if storage_url else None
    artifacts = _artifact_store(study, store) if store is not None and spec.checkpoints.artifacts else None
    summary = lambda **flags: RunSummary(ran, budget_used(study), n_trials, **flags)  # noqa: E731
    asked, adopted = False, set()  # adopted: trials this worker beat once for (see _adopt_silent_trials)
    while True:
        if timeout is not None and time.monotonic() - started >= timeout:
            return summary(timed_out=True)
        if _stop_requested(study, started_wall):
            return summary(stopped=True)
        with lock():
            optuna.storages.fail_stale_trials(study)
            trials = study.get_trials(deepcopy=False)
            if not asked and trials:  # joining a study others have sampled: draw other configs than theirs
                study.sampler = build_sampler(spec, joined_at=len(trials))
            asked = True
            used, running = budget_counts(trials)
            if used >= n_trials:
                return summary()
            trial = study.ask() if used + running < n_trials else None
        if trial is None:  # the last trials are running elsewhere; wait in case one of their workers dies
            _adopt_silent_trials(study, trials, spec.heartbeat_grace_period, adopted)
            time.sleep(spec.heartbeat_interval)
            continue
        try:
            with _Heartbeat(study, trial):
                outcome = run_trial(trial, spec, events, registry, store, artifacts)
        except (KeyboardInterrupt, Preempted) as exc:
            reason = "interrupted" if isinstance(exc, KeyboardInterrupt) else "preempted (SIGTERM)"
            _tell(study, trial, TrialState.FAIL, None, {ATTR_FAIL: reason, ATTR_INTERRUPTED: True})
            _retry(study, trial, reason)
            raise
        except Exception as exc:  # noqa: BLE001 - a failing trial must never take the study down
            outcome = (TrialState.FAIL, None, {ATTR_FAIL: f"{type(exc).__name__}: {exc}",
                                               ATTR_TRACEBACK: traceback.format_exc()[-4000:]})
            raised, retryable = True, isinstance(exc, RETRYABLE_ERRORS)
        else:
            raised = retryable = False
        state, value, attrs = outcome
        try:
            frozen, sampler_stopped = _tell(study, trial, state, value, attrs)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Another worker declared it lost (no heartbeat within the grace period: a paused machine, a storage
            # outage) and queued a retry, which trains it again. This worker goes on with the next trial.
            warnings.warn(f"trial {trial.number} was declared lost while this worker trained it (no heartbeat "
                          f"for {spec.heartbeat_grace_period} s); its retry trains it again", stacklevel=1)
            continue
        if retryable and trial.user_attrs.get(ATTR_RETRY_DEPTH, 0) < MAX_RETRIES:
            _retry(study, trial, f"retryable error: {attrs[ATTR_FAIL]}", error=True)  # resumes from its checkpoint
        elif raised and registry is not None:
            release_checkpoints(study, trial.number, spec, registry, artifacts, donor=False)
        ran += 1
        events.trial_finished(frozen)
        signature = failure_signature(frozen)
        streak = streak + 1 if signature is not None and signature == streak_signature else int(signature is not None)
        streak_signature = signature
        if spec.max_repeated_failures and streak >= spec.max_repeated_failures:
            raise StudyBrokenError(
                f"{streak} trials in a row failed the same way ({signature}); the code or the data is likely "
                f"broken, not the configs. Fix it and rerun, or raise max_repeated_failures.")
        if sampler_stopped:
            return summary(exhausted=True)


def _adopt_silent_trials(study: optuna.Study, trials: list[FrozenTrial], grace_s: float, adopted: set[int]) -> None:
    """A trial whose worker was stopped between asking for it and its first heartbeat (Ctrl-C while the sampler
    ran) stays RUNNING with no heartbeat, and Optuna's stale check never looks at it: the study would wait for it
    forever. One heartbeat on its behalf, once it is older than the grace period, makes it a trial that stopped
    beating, which the stale check then fails and retries. Once per trial: for a live trial the beat changes
    nothing, and a dead worker's trial is found stale one grace period later than it would have been."""
    record = getattr(study._storage, "record_heartbeat", None)  # noqa: SLF001 - see _Heartbeat
    if record is None:
        return
    now = datetime.datetime.now()
    for trial in trials:
        if trial.state == TrialState.RUNNING and trial.number not in adopted and trial.datetime_start is not None \
                and (now - trial.datetime_start).total_seconds() > grace_s:
            adopted.add(trial.number)
            with contextlib.suppress(Exception):
                record(trial._trial_id)  # noqa: SLF001


def _retry(study: optuna.Study, trial: optuna.Trial | FrozenTrial, reason: str, *, error: bool = False) -> None:
    """Queue the trial's params again; the retry resumes from the trial's last checkpoint (`sweep.objective`).
    `error`: a retryable error, of which a lineage gets `MAX_RETRIES` in a row; a lost worker or an interruption
    is no fault of the trial's, and starts the count again."""
    depth = trial.user_attrs.get(ATTR_RETRY_DEPTH, 0) + 1 if error else 0
    study.enqueue_trial(trial.params, user_attrs={ATTR_RETRY_OF: trial.number, ATTR_RETRY_REASON: reason,
                                                  ATTR_RETRY_DEPTH: depth})


def _tell(study: optuna.Study, trial: optuna.Trial, state: TrialState, value: float | None,
          attrs: Mapping[str, Any]) -> tuple[FrozenTrial, bool]:
    """Store the outcome. Returns the finished trial and whether the sampler asked the study to stop (the brute-force
    and grid samplers do once every point has been tried)."""
    for key, attr in attrs.items():
        trial.set_user_attr(key, _jsonable(attr))
    try:
        return study.tell(trial, value if state == TrialState.COMPLETE else None, state=state), False
    except RuntimeError as exc:
        # Samplers call Study.stop(), which only works inside study.optimize; tell() has stored the trial anyway.
        if "Study.stop" not in str(exc):
            raise
        return study.get_trials(deepcopy=False)[trial.number], True


def _jsonable(value: Any) -> Any:
    """User attrs are stored as JSON: NaN and Inf become the strings 'nan', 'inf', '-inf' (valid JSON that the
    dashboard can show), anything else unknown becomes its str()."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
