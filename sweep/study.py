"""Creating or loading the Optuna study a `StudySpec` describes, and running it.

The spec is stored on the study (user attr `sweep.spec`), so a study in a database describes itself: it can be
resumed, reproduced or inspected without the original file. `n_trials` is the study's total budget, not a count per
run: a rerun after an interruption finishes the remaining trials. The loop itself is `sweep.worker.Worker`'s.
"""

from __future__ import annotations

import json
import os
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import yaml

from sweep.blobs import is_object_url
from sweep.components import PRUNERS, SAMPLERS, build_pruner, build_sampler
from sweep.objective import task_for
from sweep.outcomes import OWNER_ATTR, SPEC_ATTR, budget_counts
from sweep.registry import default_store
from sweep.schema import StudySpec, resolve_storage_url
from sweep.signals import graceful_signals
from sweep.storage import (
    Boundary,
    PatientStorage,
    load_existing_study,
    lock_wait,
    make_storage,
    mask_url,
    release_idle_connections,
)
from sweep.worker import Events, InfrastructureError, Preempted, RunSummary, StudyBrokenError, Worker, request_stop
from trainer.config import nest
from trainer.seeding import kept_global_state
from trainer.yaml_file import short_repr

__all__ = ["PRUNERS", "SAMPLERS", "Events", "InfrastructureError", "Preempted", "RunSummary", "StudyBrokenError",
           "StudyMismatchError", "budget_used", "definition_note",
           "label_for_dashboard", "load_existing_study", "mask_url", "open_study",
           "refuse_another_tools_study", "request_stop", "resolve_storage_url", "run_study", "worker_storage"]


class StudyMismatchError(Exception):
    """The storage already holds a study of that name whose definition differs from the file."""


class StoreMismatchError(StudyMismatchError):
    """The file's `checkpoints.store` is another folder than the one the study ran with, which still exists."""


def worker_storage(spec: StudySpec, url: str, *, notify: Callable[[str], None] | None = None) -> PatientStorage:
    """The storage a worker uses: every call behind one `Boundary` that waits out an outage for the study's
    `storage_patience`, with the study's heartbeat settings."""
    # A launcher's worker (`sweep run --workers N`, a Slurm array task, a Kubernetes pod: SWEEP_WORKER is set) runs
    # with a URL its launcher or `sweep submit` has reached: an outage at its start is waited out for the whole
    # storage_patience, not the short first-contact limit that tells a wrong URL early.
    boundary = Boundary(spec.storage_patience, label=f"storage {mask_url(url)}", notify=notify,
                        reached=os.environ.get("SWEEP_WORKER") is not None)
    backend = boundary.call(make_storage, url, heartbeat_interval=spec.heartbeat_interval,
                            grace_period=spec.heartbeat_grace_period, lock_wait_s=lock_wait(spec.storage_patience))
    return PatientStorage(backend, boundary)


def open_study(spec: StudySpec, storage: str | optuna.storages.BaseStorage,
               storage_url: str | None = None,
               before_update: Callable[[optuna.Study], None] | None = None) -> optuna.Study:
    """Create the study, or load it if it exists and has the same definition (task, fixed values, space, metric,
    direction). Budget, timeout, sampler and pruner may change between runs; the checkpoint store only to a folder
    the study's checkpoints were moved to (`StoreMismatchError`; `storage_url`, or `storage` given as one, says
    where the default store is). `before_update`: the caller's last checks of an existing study, which may refuse the
    run (raise) before its latest definition is written (edits review: a run refused after it, for a TensorBoard
    folder another study owns, had stored its budget, sampler and tracking)."""
    storage_url = storage if isinstance(storage, str) else storage_url
    storage = worker_storage(spec, storage) if isinstance(storage, str) else storage
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
            study.set_user_attr(OWNER_ATTR, uuid.uuid4().hex)  # its checkpoint folder is claimed with it (sweep.blobs)
            study.set_user_attr(SPEC_ATTR, spec.stored())
            label_for_dashboard(study, spec.stored())
            return study
    stored = _stored_spec(study)
    if stored is None and _unlabelled(study, spec):
        # Created, and its creator gone before it wrote the definition (killed, Ctrl-C, the storage lost in those
        # milliseconds): nothing in it to protect, and every rerun would be refused. Taken as this file's. No owner
        # id is written: two workers taking it at once would write two, and one of them would then be refused its
        # checkpoint folder for good; a study without one is not checked for it (as one made before owner ids).
        study.set_user_attr(SPEC_ATTR, spec.stored())
        label_for_dashboard(study, spec.stored())
        stored = spec.stored()
    stored = stored if stored is not None else study.user_attrs.get(SPEC_ATTR)  # another worker took it meanwhile
    if stored is None:
        raise StudyMismatchError(_NOT_SWEEPS.format(name=spec.name))
    if not isinstance(stored, dict):
        raise StudyMismatchError(f"study {spec.name!r} holds a damaged definition (its user attr {SPEC_ATTR!r} is "
                                 f"{short_repr(stored)}, not a mapping: edited by hand or by another tool?); nothing "
                                 "was run. Restore the database, or choose another name with --study-name")
    # A key missing there reads as "added" rather than "stored null" (where the file's value is not null either).
    before = {key: stored.get(key, None if value is None else _ABSENT) for key, value in spec.identity().items()}
    exact = spec.task is None  # a loop's or a command's config reaches its code as written: 1, 1.0 and true differ
    differences = [key for key, value in spec.identity().items()
                   if not _same_json(before[key], value, exact, in_fixed=key == "fixed")
                   and not (key == "fixed" and before[key] is not _ABSENT and _same_values(spec, before[key]))
                   and not (key == "task" and _same_task(before[key], value))]
    if differences:
        identity = spec.identity()
        changes = [change for key in differences for change in _changes(key, before[key], identity[key], exact)]
        shown = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
        raise StudyMismatchError(
            f"study {spec.name!r} already exists with a different {', '.join(differences)} ({shown}); start a new "
            "study with --study-name NAME, or rerun with the original file")
    if storage_url is not None and (moved := _another_store(spec, stored, storage_url)) is not None:
        raise StoreMismatchError(moved)
    latest = spec.stored()  # the latest budget, sampler and pruner
    if "fixed" in stored and latest["fixed"] != stored["fixed"]:
        latest["fixed"] = stored["fixed"]  # the same values written otherwise: what later runs are compared with
    if not spec.checkpoints.enabled and isinstance(stored.get("checkpoints"), dict):
        latest["checkpoints"]["store"] = stored["checkpoints"].get("store")  # where the rows still point
    if before_update is not None:
        before_update(study)
    study.set_user_attr(SPEC_ATTR, latest)
    label_for_dashboard(study, latest)
    return study


def _same_json(a: Any, b: Any, exact: bool, *, in_fixed: bool = False, in_list: bool = False) -> bool:
    """Whether two stored values are the same value: a bool is never a number (`true` and `1`, `[0, 1]` and `[false,
    true]` were one definition to Python's ==, and a study's later trials got `true` where its first got `1`: edits
    review). With `exact` (a loop's or a command's study, whose code gets the values as written), an int is not a
    float either where the value reaches its code: a fixed value, a categorical choice (`1` and `1.0`, which a
    command's `{x}` writes apart); a range's bounds (`low: 0` and `low: 0.0`) stay one value."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b and (not (exact and (in_fixed or in_list)) or type(a) is type(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[key], b[key], exact, in_fixed=in_fixed, in_list=in_list)
                                            for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_json(x, y, exact, in_fixed=in_fixed, in_list=True)
                                        for x, y in zip(a, b))
    return bool(a == b)


_NOT_SWEEPS = "study {name!r} exists but was not created by sweep; choose another name with --study-name"


def refuse_another_tools_study(url: str, spec: StudySpec) -> None:
    """`StudyMismatchError` where the SQLite file at `url` holds a study of `spec`'s name that sweep did not create,
    found by reading the file as it is: opening a worker's storage switches the file to write-ahead logging, and a
    run refused must leave another tool's file as it found it (edits review: its journal mode changed)."""
    storage = make_storage(url, wal=False)
    try:
        try:
            study = optuna.load_study(study_name=spec.name, storage=storage)
        except KeyError:
            return
        if _stored_spec(study, patience_s=0.0) is None and not _unlabelled(study, spec):
            raise StudyMismatchError(_NOT_SWEEPS.format(name=spec.name))
    finally:
        storage.engine.dispose()


def is_another_store(name: str, before: str, now: str) -> bool:
    """Whether the store `now` names is not the one study `name` ran with (`before`), while that one still holds the
    study's folder: opened or checked there, its rows would all look missing. An object store is another whenever
    its URL differs (its rows hold its URLs)."""
    if is_object_url(before):  # its rows are the object store's URLs: no move to tell
        return before.rstrip("/") != now.rstrip("/")
    # The stored store as its blobs were written: a `~` there, stored before it meant the home folder, was a folder
    # named `~` in the working folder.
    if not is_object_url(now) and Path(now).expanduser().resolve() == Path(before).resolve():
        return False
    return (Path(before).resolve() / name).is_dir()  # else moved, or it never wrote one


def _another_store(spec: StudySpec, stored: dict[str, Any], storage_url: str) -> str | None:
    """Why the file's checkpoint store cannot be the study's: its checkpoints' rows name files, relative to the
    store the study ran with, that the other folder does not hold. Opened there, the worker's quick check would
    take every row for a missing file and delete it (warm-start donors and resume points too), and the study's
    trials would start over. None when it is the same folder, or when the study's folder in it is gone (moved: the
    file says where it went). An object store the study ran with is another whenever its URL differs (its rows hold
    its URLs)."""
    if not spec.checkpoints.enabled:
        return None
    before = str(((stored.get("checkpoints") or {}).get("store")) or default_store(storage_url))
    now = str(spec.checkpoints.store or default_store(storage_url))
    if not is_another_store(spec.name, before, now):
        return None
    # The store's `_artifacts/` (the dashboard's copies) is every study's there: what the move leaves behind is
    # uploaded again by `check --repair` (edits review: the message's advice left a check that exited 1).
    move = "" if is_object_url(before) or is_object_url(now) else (
        f", or move its folder {spec.name!r} to the new store, then run `sweep check --repair` to copy its "
        "checkpoints' dashboard artifacts there")
    return (f"{now} is not the store study {spec.name!r} ran with ({before}, where its checkpoints' rows point; "
            "opened with another, every one would be taken for a missing file and deleted). Set checkpoints.store to "
            f"it{move}")


def _changes(key: str, stored: Any, now: Any, exact: bool = False) -> list[str]:
    """Where two definitions differ, by dotted key: `fixed.max_steps: stored 5, now 6` (`_same_json`'s `exact`)."""
    if isinstance(stored, dict) and isinstance(now, dict):
        return [change for part in dict.fromkeys([*stored, *now])
                if part not in stored or part not in now
                or not _same_json(stored[part], now[part], exact, in_fixed=key.split(".")[0] == "fixed")
                for change in _changes(f"{key}.{part}", stored.get(part, _ABSENT), now.get(part, _ABSENT), exact)]
    if stored is _ABSENT or now is _ABSENT:
        return [f"{key}: {'added' if stored is _ABSENT else 'removed'}"]
    return [f"{key}: stored {_short(stored)}, now {_short(now)}"]


_ABSENT = object()  # a key one definition has and the other has not (null is a value)


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def label_for_dashboard(study: optuna.Study, stored: dict[str, Any]) -> None:
    """What optuna-dashboard shows of a sweep study: the metric's name, not "Objective 0", and the study's
    definition as readable YAML in the study's note (the `sweep.spec` attr holds the same as one JSON line). A study
    created before this existed gets both the next time a worker or `sweep dashboard` opens it. The note needs
    optuna-dashboard installed; it is written only when it changed, so reopening adds no note versions."""
    if study.metric_names is None:
        with warnings.catch_warnings():  # "experimental" since Optuna 3.2; the dashboard reads it
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names([str(stored.get("metric") or "value")])
    try:
        from optuna_dashboard import get_note, save_note
    except ImportError:
        return
    body = definition_note(stored)
    if get_note(study) != body:
        save_note(study, body)


def definition_note(stored: dict[str, Any]) -> str:
    """The study's note: a summary line, then the definition as YAML (the storage URL is never part of it)."""
    summary = (f"{stored.get('direction', 'minimize')} **{stored.get('metric', 'value')}** over "
               f"{stored.get('n_trials', '?')} trials; task `{stored.get('task', '?')}`")
    definition = yaml.safe_dump(stored, sort_keys=False, default_flow_style=False, allow_unicode=True)
    return (f"## Study definition (sweep)\n\n{summary}\n\n```yaml\n{definition}```\n\n"
            "Written by sweep from the study file; `sweep run` with the same definition resumes this study.\n")


def run_study(study: optuna.Study, spec: StudySpec, *, n_trials: int | None = None, timeout: float | None = None,
              events: Events | None = None, storage_url: str | None = None) -> RunSummary:
    """Run trials of `study` in this process until its budget is used (see `sweep.worker.Worker`).

    As `sweep run` does, from a notebook or a script too: on the main thread, Ctrl-C and SIGTERM are requests the
    running trials honour at their next optimizer step or a loop's next report (marked interrupted, queued again),
    then raised to the caller (KeyboardInterrupt, `sweep.signals.Preempted`); a second Ctrl-C raises at once.
    Python's, numpy's and torch's global generators and torch's determinism switches are the caller's again
    afterwards, and the database connections it leaves idle are closed (a notebook's process holds no server session
    between runs, nor one per database it ran on)."""
    directions = [direction.name.lower() for direction in study.directions]
    if directions != [spec.direction]:  # a study `open_study` did not open: every trial would fail, or rank wrongly
        raise StudyMismatchError(
            f"study {study.study_name!r} " + (f"has {len(directions)} objectives ({', '.join(directions)}); sweep runs "
                                              "single-objective studies" if len(directions) != 1 else
                                              f"is to {directions[0]}, the spec's metric {spec.metric!r} to "
                                              f"{spec.direction}") + ": open it with sweep.open_study(spec, url)")
    storage = study._storage  # noqa: SLF001 - Optuna has no public handle on a study's storage
    boundary = storage.boundary if isinstance(storage, PatientStorage) else Boundary(spec.storage_patience)
    with graceful_signals(), kept_global_state():
        try:
            worker = Worker(study, spec, storage_url=storage_url, boundary=boundary, events=events,
                            n_trials=n_trials, timeout=timeout)
            if worker.cohort_size != 1 and spec.task is not None:  # 0: as many as the device's memory holds
                from sweep.cohort import CohortLoop

                return CohortLoop(worker, worker.cohort_size).run(worker.begin())
            return worker.run()
        finally:
            release_idle_connections()


def budget_used(study: optuna.Study) -> int:
    return budget_counts(study.get_trials(deepcopy=False))[0]


def _same_values(spec: StudySpec, stored_fixed: Any) -> bool:
    """Fixed values written differently that mean the same (`1e-4`, which YAML reads as a string, and `0.0001`; a
    key written at its default and left out, the model's keys at the task's defaults too: edits review, `model.depth:
    2` on digits was refused as "fixed.model: added")."""
    try:
        stored = spec.model_copy(update={"fixed": nest(dict(stored_fixed or {}))})
        theirs, ours = stored.config_for({}).to_dict(), spec.config_for({}).to_dict()
        if theirs == ours:
            return True
        if {key for key in {*theirs, *ours} if theirs.get(key) != ours.get(key)} != {"model"}:
            return False
        task = task_for(ours["task"], ours["task_args"] or {})
        return task.model_config(theirs["model"] or {}) == task.model_config(ours["model"] or {})
    except Exception:  # noqa: BLE001 - values the trainer refuses cannot be the same as valid ones
        return False


def _same_task(stored: Any, task: Any) -> bool:
    """One task written with an argument at its default and without it (`args: {val_fraction: 0.2}`, the default:
    edits review, refused as "task.args.val_fraction: added", where a fixed key at its default is accepted)."""
    import inspect

    from trainer.tasks import argument_defaults

    if not (isinstance(stored, dict) and isinstance(task, dict)) or stored.get("name") != task.get("name"):
        return False
    arguments = argument_defaults(str(task["name"]))
    if arguments is None:  # a task that cannot be found or read now: not known to be the same
        return False
    defaults = {key: default for key, default in arguments.items() if default is not inspect.Parameter.empty}
    return {**defaults, **(stored.get("args") or {})} == {**defaults, **(task.get("args") or {})}


def _unlabelled(study: optuna.Study, spec: StudySpec) -> bool:
    """An empty study with the file's direction and no definition: no trial, no attr but the owner id sweep writes
    first, nothing of Optuna's. What a `sweep run` killed between creating a study and writing its definition
    leaves (an empty study of plain Optuna's looks the same, and holds nothing either)."""
    return (not study.get_trials(deepcopy=False) and set(study.user_attrs) <= {OWNER_ATTR}
            and not study._storage.get_study_system_attrs(study._study_id)  # noqa: SLF001 - no public reader
            and not study._is_multi_objective() and study.direction.name.lower() == spec.direction)  # noqa: SLF001


def _stored_spec(study: optuna.Study, patience_s: float = 5.0) -> dict[str, Any] | None:
    """The definition the study was created with. A study that another worker has just created holds none for the
    moment between its creation and the write of its definition (workers on several machines start together), so an
    empty one is read again for a few seconds before it is taken for a study that sweep did not create."""
    deadline = time.monotonic() + patience_s
    while (stored := study.user_attrs.get(SPEC_ATTR)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return stored


