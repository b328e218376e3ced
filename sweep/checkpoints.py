"""The checkpoint service: the registry table, the blob store and the artifact store of one study, together.

It answers everything a trial's life asks of checkpoints: where a retry resumes (the newest intact checkpoint of its
whole lineage), which donor a warm start takes, when a trial saves (the study's policy) and where the blob goes,
what becomes of an ended trial's checkpoints (its best uploaded as a dashboard artifact, the rest released to
retention), and garbage collection: each trial keeps its latest plus its best k, and with `keep_top_trials` only the
study's best ended trials keep any. A checkpoint that some trial resumed or warm-started from is pinned in the
registry and never collected (`Registry.pin`), so a running trial never loses its parent, and reproduce can always
find it. Every registry call goes through the storage `Boundary`: an outage is waited out, or, while a trial trains,
its registrations wait in memory until the storage is back.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from sweep.blobs import BlobScope, CheckpointStore, artifact_store_at, delete_blob, load_blob, local_copy
from sweep.outcomes import ARTIFACTS_ATTR, ATTR_CHECKPOINT, ATTR_RETRY_OF, Outcome, lineage
from sweep.reconcile import UNREGISTERED, adopt_unregistered, other_store_location, quick_check
from sweep.registry import Registry, default_store
from sweep.signals import sheltered
from sweep.storage import StorageAway, StorageUnavailable, error_line, lock_wait, sqlite_path
from sweep.warmstart import Donor, DonorConfigs, categorical_key, coordinates, warm_start_from
from trainer.checkpoint import CheckpointError, CheckpointInfo, CheckpointWriteError, TrainState, WarmStart
from trainer.yaml_file import short_repr

if TYPE_CHECKING:
    from sweep.registry import CheckpointRecord
    from sweep.schema import CheckpointPolicy, StudySpec
    from sweep.storage import Boundary
    from trainer import TrainingConfig

__all__ = ["CheckpointService", "Resume", "TrialCheckpointer", "belongs_to", "collect_study", "ranked_trials",
           "retention_keeps"]


@dataclass(frozen=True)
class Resume:
    """Where a retry continues: the checkpoint's state, and which trial of the lineage wrote it."""

    state: TrainState
    trial: int
    step: int


def belongs_to(state: TrainState, params: Mapping[str, Any], max_steps: object = None) -> str | None:
    """Why a checkpoint that loads and matches its registered hash is not the retried trial's lineage's, or None. A
    row (or the record adopted beside a file written in an outage) names a file by its hash only, so a file put in
    its place (another study's, another trial's, one edited) loaded, and the retry recorded another run's values
    as its own (review). Every searched value its config holds must be the trial's, and the trainer's step within
    the trial's `max_steps` (a loop's steps are its own to count)."""
    if not state.user and isinstance(max_steps, int) and not isinstance(max_steps, bool) and state.step > max_steps:
        return f"its step {state.step} is past the trial's max_steps {max_steps}"
    for key, value in params.items():
        node: Any = state.config
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            if _differs(node, value):
                return f"it was trained with {key}={short_repr(node)}, this trial's is {short_repr(value)}"
    return None


def _differs(held: Any, value: Any) -> bool:
    """Whether a checkpoint's config value is not the trial's param: numbers by value (the config may hold an int
    as a float), text and flags exactly; anything else (a mapping the param expands into) is not judged."""
    if isinstance(held, bool) or isinstance(value, bool):
        return isinstance(held, bool) and isinstance(value, bool) and held != value
    if isinstance(held, (int, float)) and isinstance(value, (int, float)):
        return not (held == value or math.isclose(held, value, rel_tol=1e-9))
    return isinstance(held, str) and isinstance(value, str) and held != value


def folder_gone(registry: Registry, folder: Path, study_name: str, study_file: str = "STUDY.yaml", *,
                donors: bool = True) -> str | None:
    """Why the study's folder of a local store cannot be read while the registry names checkpoints in it that
    trials resume, warm-start or are reproduced from (a share not mounted, the folder deleted or replaced by a file):
    each would look missing, and forgetting them would retrain each retry from its first step once the folder is
    back (and `sweep reproduce` of a resumed trial would lose its start). None when it is there, or names none of
    those (the checkpoints of finished trials no trial resumed from, in a study that does not warm-start).
    `donors`: whether the study warm-starts (a finished trial's checkpoint is then a donor)."""
    if folder.is_dir():
        return None
    rows = [r for r in registry.in_use(study_name) if r.final == 0 or r.pinned or donors]
    if not rows:
        return None
    what = "not a folder" if folder.exists() else "not there"
    return (f"checkpoints.store: the study's folder {folder} is {what}, and the registry names {len(rows)} "
            "checkpoints in it that trials resume, warm-start or are reproduced from: mount or restore it, then "
            f"rerun; its rows are kept. If its checkpoints are gone for good, `sweep check {study_file} --repair` "
            "forgets them")


def store_folder_gone(storage_url: str, location: str, study_name: str, study_file: str, *,
                      donors: bool) -> str | None:
    """`folder_gone` for a study about to run, before its folder is claimed (which would make it anew, empty)."""
    from sweep.blobs import is_object_url

    if is_object_url(location):
        return None
    try:
        registry = Registry(storage_url)
    except Exception:  # noqa: BLE001 - the registry unreadable now: the worker's own check meets it, as a storage fault
        return None
    try:
        return folder_gone(registry, Path(location).resolve() / study_name, study_name, study_file, donors=donors)
    except Exception:  # noqa: BLE001 - as above
        return None
    finally:
        registry.engine.dispose()


class CheckpointService:
    """One study's checkpoints: registry, blob store and artifact store, behind the storage boundary."""

    def __init__(self, storage_url: str, spec: StudySpec, study: optuna.Study, boundary: Boundary) -> None:
        self.spec, self.study_name = spec, study.study_name
        self.maximize = spec.direction == "maximize"
        self.boundary = boundary
        self.registry: Registry = boundary.guard(boundary.call(Registry, storage_url,
                                                               lock_wait_s=lock_wait(spec.storage_patience)))
        self.store = CheckpointStore(spec.checkpoints.store or default_store(storage_url), study.study_name)
        self.storage_url, self.storage = storage_url, study._storage  # noqa: SLF001 - the study's (patient) storage
        self._scopes: dict[str, BlobScope] = {}  # `scope_of`: another study's part of its own store
        self.artifacts: Any = None
        if spec.checkpoints.artifacts:
            location = self.store.artifact_location
            if study.user_attrs.get(ARTIFACTS_ATTR) != location:
                study.set_user_attr(ARTIFACTS_ATTR, location)  # for `sweep dashboard`
            self.artifacts = artifact_store_at(location)
        database = sqlite_path(storage_url)
        # The study's own folders: a missing file or a refused permission there is the machine's fault.
        self.folders = [str(self.store.folder.parent)] + ([str(database.parent.resolve())] if database else [])

    def store_unavailable(self) -> str | None:
        """`folder_gone` for this study's store, while it runs (the folder gone since the run began)."""
        if self.store.artifacts is not None:  # an object store: no folder to miss
            return None
        return folder_gone(self.registry, self.store.folder, self.study_name, donors=self.spec.warm_start.enabled)

    def reconcile(self) -> list[Any]:
        """The cheap part of `sweep check`, run when a worker opens the study: rows among donors and resume points
        whose blob is gone are removed, so no trial is sent to a missing file."""
        return self.boundary.call(quick_check, self.registry, self.study_name, scope=self.store.scope)


    # -----------------------------------------------------------------------------------------------------------------
    # Starting a trial.

    def holds_any(self, trial_number: int) -> bool:
        """Whether the registry holds a checkpoint of this trial."""
        return bool(self.registry.for_trial(self.study_name, trial_number))

    def resume_point(self, lineage: Sequence[int], keep_steps: Sequence[int] = (),
                     accept: Callable[[TrainState], str | None] | None = None) -> Resume | None:
        """The newest checkpoint of the lineage (the trial being retried, the trial that one retried, ...) that loads
        and matches its hash. One that fails is removed (row and file) with a warning, and the next newest is
        tried. The one chosen is pinned; the lineage's other checkpoints are released to retention. Checkpoints the
        lineage wrote while the storage was away, whose rows died with a worker that gave up waiting, are registered
        first, from the record beside each (`sweep.reconcile.adopt_unregistered`), and trimmed to what the study's
        policy keeps of a trial (its latest, its best `keep_top_k`, `keep_steps`: the handoff), as their worker would
        have trimmed them had the storage answered. `accept(state)`: why a checkpoint that loads is not the
        lineage's (`belongs_to`), or None; one refused is passed over, as an unreadable one is."""
        if self.store.artifacts is None:  # checkpoints of the lineage written in an outage, not registered yet
            if adopt_unregistered(self.registry, self.store.folder, self.study_name, trials=lineage):
                self._trim_adopted(lineage, keep_steps)
        records = sorted((r for n in lineage for r in self.registry.for_trial(self.study_name, n)),
                         key=lambda r: (r.step, r.id), reverse=True)
        chosen: Resume | None = None
        for record in records:
            if not self.registry.pin(record.id):  # collected since the lookup
                continue
            where = f"not resuming from trial {record.trial_number}'s checkpoint at step {record.step}"
            uri = self.store.scope.find_or_warn(record.uri, record.study, where)
            if uri is None:
                self.registry.forget_broken(record.id)  # the row only: the file it names is not ours
                continue
            try:
                state = load_blob(uri, record.sha256)
            except (CheckpointError, PermissionError) as exc:  # this file alone, unless its folder is gone
                if (gone := self.store_unavailable()) is not None:  # the folder, not this file: the machine's fault
                    raise FileNotFoundError(errno.ENOENT, gone, str(self.store.folder)) from exc
                unread = isinstance(exc, PermissionError)  # it stays, unread; a broken one goes
                warnings.warn(f"{where}: {f'it cannot be read ({exc})' if unread else exc}; trying an older one",
                              stacklevel=2)
                self.registry.forget_broken(record.id)
                if not unread:
                    delete_blob(uri)
                continue
            if accept is not None and (why := accept(state)) is not None:  # loads, and is another run's
                warnings.warn(f"{where}: {why}, so it is not this trial's (a file put in its place); trying an older "
                              "one", stacklevel=2)
                self.registry.forget_broken(record.id)  # the row only: the file may be another study's
                continue
            chosen = Resume(state, record.trial_number, state.step)
            break
        for number in lineage:  # the lost trials' other checkpoints: collectable (the pinned one stays)
            self.registry.finish_trial(self.study_name, number, donor=False)
        return chosen

    def _trim_adopted(self, lineage: Sequence[int], keep_steps: Sequence[int]) -> None:
        policy = self.spec.checkpoints
        for number in lineage:
            records = self.registry.for_trial(self.study_name, number)
            if not records:
                continue
            keep = policy_keeps(records, policy.keep_top_k, keep_steps, self.maximize)
            gone = set(self.registry.forget([r.id for r in records if r.id not in keep]))
            kept = {r.uri for r in records if r.id not in gone}
            for record in records:
                if record.id in gone and record.uri not in kept:
                    _delete_in_scope(self.store.scope, record.uri, record.study)

    def warm_start(self, trial_number: int, params: Mapping[str, Any], config: TrainingConfig | Mapping[str, Any],
                   key: str, handoff: int,
                   donor_configs: DonorConfigs | None = None) -> tuple[WarmStart, Donor] | None:
        return warm_start_from(self.registry, self.spec, self.study_name, trial_number, params, config, key, handoff,
                               scope=self.store.scope, donor_configs=donor_configs, scope_of=self.scope_of)

    def scope_of(self, study_name: str) -> BlobScope:
        """Where `study_name`'s blobs lie: this study's own store, or, for another study of this storage (a
        `from_studies` donor's), the store that study ran with (its stored study file's), read once; this store
        where that study cannot be found."""
        if study_name == self.study_name:
            return self.store.scope
        if study_name not in self._scopes:
            location = other_store_location(self.storage, study_name, self.storage_url)
            self._scopes[study_name] = self.store.scope if location is None else BlobScope(location)
        return self._scopes[study_name]

    def checkpointer(self, trial_number: int, params: Mapping[str, Any], key: str, handoff: int) -> TrialCheckpointer:
        return TrialCheckpointer(self.registry, self.store, self.study_name, trial_number, params,
                                 self.spec.checkpoints, self.spec.metric, self.maximize, shape_key=key,
                                 coords=coordinates(self.spec.space, params),
                                 cat_key=categorical_key(self.spec.space, params),
                                 keep_steps=[handoff] if handoff else [])

    # -----------------------------------------------------------------------------------------------------------------
    # Ending a trial.

    def release(self, trial: optuna.Trial, outcome: Outcome, checkpointer: TrialCheckpointer | None) -> None:
        """The trial ended. First its best checkpoint becomes a dashboard artifact, if the study's retention would
        keep it: its checkpoints are not final yet, so no other worker's retention can delete them meanwhile, and a
        worker that drops the trial later finds the artifact to remove. Then they count for retention (and are
        warm-start donors if it completed or was pruned), and retention applies. A retried trial's checkpoints stay
        as they are: its retry resumes from them and releases them then.

        Bookkeeping after training never changes the trial's outcome: an error here is a warning."""
        if checkpointer is not None:
            with _cleanup(trial.number, "registering its checkpoints"):
                checkpointer.flush()  # what it saved while the storage was away: its retry may resume from it
        if outcome.retried:
            if checkpointer is not None:
                with _cleanup(trial.number, "releasing its checkpoints"):
                    self._released_by_retry(trial)
            return
        if checkpointer is not None:
            if outcome != Outcome.FAILED:
                with _cleanup(trial.number, "uploading its best checkpoint as an artifact"):
                    self._upload_best(trial, checkpointer, outcome)
        with _cleanup(trial.number, "releasing its checkpoints"):
            self.registry.finish_trial(self.study_name, trial.number, donor=outcome.donor)
            if outcome.donor and trial.user_attrs.get("retry_of") is not None:
                # A retry that ended well: its lineage's checkpoints (the handoff one, often, which a retry resumed
                # past does not write again) are this config's work too, and donors again.
                trials = {t.number: t for t in trial.study.get_trials(deepcopy=False)}
                for number in lineage(trials, trial.number)[1:]:
                    self.registry.finish_trial(self.study_name, number, donor=True)
            self.apply_retention(trial.study)

    def _released_by_retry(self, trial: optuna.Trial) -> None:
        """A trial declared lost while its worker trained on (a paused machine) may have registered checkpoints
        after a retry of its lineage ended well and released the lineage's rows: these came too late for that, and
        would stay a running trial's for good, never collected. They are released now as that retry released the
        rest."""
        trials = {t.number: t for t in trial.study.get_trials(deepcopy=False)}
        for frozen in trials.values():
            ended_well = frozen.state in (TrialState.COMPLETE, TrialState.PRUNED)
            if ended_well and frozen.user_attrs.get(ATTR_RETRY_OF) is not None \
                    and trial.number in lineage(trials, frozen.number)[1:]:
                self.registry.finish_trial(self.study_name, trial.number, donor=True)
                self.apply_retention(trial.study)
                return

    def _upload_best(self, trial: optuna.Trial, checkpointer: TrialCheckpointer, outcome: Outcome) -> None:
        best = checkpointer.best_record()
        keep = self.spec.checkpoints.keep_top_trials
        if self.artifacts is None or best is None:
            return
        if keep is not None and not retention_keeps(self.registry, self.study_name, trial.number, best.value,
                                                    not outcome.donor, keep, self.maximize):
            return
        uri = self.store.scope.find_or_warn(best.uri, best.study, f"trial {trial.number}: not uploading its best "
                                            "checkpoint as an artifact")
        if uri is None:
            return
        with local_copy(uri) as path:
            artifact_id = optuna.artifacts.upload_artifact(artifact_store=self.artifacts, file_path=str(path),
                                                           study_or_trial=trial,
                                                           mimetype="application/octet-stream")
        trial.set_user_attr(ATTR_CHECKPOINT, {"artifact_id": artifact_id, "step": best.step, "value": best.value,
                                              "sha256": best.sha256, "size": best.size})

    def apply_retention(self, study: optuna.Study) -> list[int]:
        """With `keep_top_trials`, only the study's best ended trials keep checkpoints, and a trial that loses them
        loses its dashboard artifact too (a copy of its best checkpoint), so the disk a study uses stays bounded.
        Optuna cannot edit a finished trial, so the dashboard still lists that artifact; `sweep dashboard` serves a
        note in its place (`sweep.blobs.RetainedArtifacts`). Returns the trials that lost checkpoints."""
        keep = self.spec.checkpoints.keep_top_trials
        if keep is None:
            return []
        dropped = collect_study(self.registry, self.study_name, keep, self.maximize, scope=self.store.scope)
        if self.artifacts is not None and dropped:
            wanted = set(dropped)
            for frozen in study.get_trials(deepcopy=False):
                recorded = frozen.user_attrs.get(ATTR_CHECKPOINT) if frozen.number in wanted else None
                if recorded is not None:
                    with contextlib.suppress(optuna.artifacts.exceptions.ArtifactNotFound):
                        self.artifacts.remove(recorded["artifact_id"])
        return dropped


@contextlib.contextmanager
def _cleanup(trial_number: int, what: str) -> Iterator[None]:
    """Checkpoint bookkeeping after training: an error here (the storage, the blob store) is a warning, never the
    trial's outcome. A trial that trained to the end is not recorded as failed, and a failing one never takes the
    study down; what was not released stays on disk, and `sweep check` finds it. The storage gone past
    `storage_patience` (or away where the caller does not wait) is no such error: the worker stops, with the trial
    untold and found lost, and its retry resumes from its checkpoints and releases them. Taken for a warning, the
    worker went on and its run exited 0, the trial was told complete with its rows never released (never a donor,
    never trimmed, no artifact), and neither a rerun nor `sweep check --repair` could release them (review)."""
    try:
        yield
    except (StorageUnavailable, StorageAway):
        raise
    except Exception as exc:  # noqa: BLE001 - see above
        warnings.warn(f"trial {trial_number}: {what} failed: {error_line(exc)}", stacklevel=3)  # one line



def _unregistered_path(blob: Path) -> Path:
    return blob.with_name(blob.name + UNREGISTERED)


def _write_unregistered(blob: Path, record: Mapping[str, Any]) -> None:
    """The registry row of `blob`, beside it, while the storage is away: the worker may give up waiting
    (`storage_patience`) with the row in memory, and the trial's retry registers it from here when it looks for its
    lineage's resume point (`sweep.reconcile.adopt_unregistered`; `sweep check --repair` too), so it resumes from
    the checkpoints written in the outage. Written atomically (temporary file, rename); a failure only warns."""
    target = _unregistered_path(blob)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(dict(record)))
        os.replace(temporary, target)
    except (OSError, TypeError, ValueError) as exc:
        temporary.unlink(missing_ok=True)
        warnings.warn(f"{blob}: its registration waits in memory only ({type(exc).__name__}: {exc})", stacklevel=3)

class TrialCheckpointer:
    """The trainer's `Checkpointer` for one trial: the policy (`every_steps`, `every_seconds`, `on_best`, the
    warm-start handoff step) decides at each log or eval step; the trainer writes, and `saved` registers.

    `clock`: seconds from any fixed point (`time.monotonic`); `every_seconds` counts from the trial's start (this
    object's creation) and from each checkpoint written, whatever the reason it was written."""

    def __init__(self, registry: Registry, store: CheckpointStore, study: str, trial_number: int,
                 params: Mapping[str, Any],
                 policy: CheckpointPolicy, metric: str, maximize: bool, shape_key: str = "",
                 coords: Sequence[float | None] = (), cat_key: str = "", keep_steps: Sequence[int] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry, self.store, self.study, self.number = registry, store, study, trial_number
        self.params, self.policy, self.metric, self.maximize = dict(params), policy, metric, maximize
        self.shape_key, self.coords, self.cat_key = shape_key, list(coords), cat_key
        self.keep_steps = set(keep_steps)  # always saved and kept: the warm-start handoff point
        self.best: float | None = None
        self.pending: list[dict[str, Any]] = []  # registrations the storage could not take yet
        self.deferred = False  # a cohort's member: registered with the others after each step (`register_together`)
        self.fresh = False  # a save since the last try to register (a cohort tries again only then)
        self._beside: set[str] = set()  # the pending registrations already written beside their blobs
        self.clock = clock
        self.last_saved_at = clock()

    def _improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return self.best is None or (value > self.best if self.maximize else value < self.best)

    def path_for(self, step: int, metrics: Mapping[str, float] | None) -> Path | None:
        periodic = self.policy.every_steps is not None and step % self.policy.every_steps == 0
        timed = (self.policy.every_seconds is not None
                 and self.clock() - self.last_saved_at >= self.policy.every_seconds)
        best = self.policy.on_best and metrics is not None and self._improves(metrics[self.metric])
        if best:
            self.best = metrics[self.metric]  # type: ignore[index]
        if not (periodic or timed or best or step in self.keep_steps):
            return None
        return self.path_at(step)

    def path_at(self, step: int) -> Path:
        """Where the trial's checkpoint at `step` goes, whatever the policy says (a user's loop saves when it
        chooses; retention keeps its latest and its best k). A `CheckpointWriteError` (the machine's fault) where the
        study's folder has vanished since the run wrote in it: not made anew, as it is not when a run starts."""
        path = self.store.local_path(f"trial{self.number:05d}-step{step:08d}.pt")
        if self.store.vanished():
            raise CheckpointWriteError(
                errno.ENOENT, f"cannot write checkpoint {path}: the study's folder {self.store.folder} is gone since "
                "this run wrote in it (deleted, or its share unmounted): mount or restore it, then rerun; if its "
                "checkpoints are gone for good, `sweep check STUDY.yaml --repair` forgets them", str(path))
        return path

    def saved(self, info: CheckpointInfo, metrics: Mapping[str, float] | None) -> None:
        """Register the blob. While the storage is away (the trial keeps training), the registration waits in
        memory and is made with the next one, or when the trial ends; the blob is on disk meanwhile."""
        with sheltered():  # a handler of the trial's code (PyTorch's for SIGCHLD) never raises mid-write
            self.last_saved_at = self.clock()
            value = None if metrics is None else metrics.get(self.metric)
            record = dict(study=self.study, trial_number=self.number, step=info.step, value=value,
                          params=self.params, shape_key=self.shape_key, uri=self.store.put(info.path), size=info.size,
                          sha256=info.sha256, coords=self.coords, cat_key=self.cat_key)
            self.pending.append(record)
            self.fresh = True
            if self.deferred:
                return  # registered with the cohort's other members after the step (`register_together`)
            try:
                self.flush()
            except StorageAway:
                self._beside_blobs()

    def flush(self) -> None:
        """Register what waits and trim the trial's checkpoints to what the policy keeps (its latest, its best
        `keep_top_k`, the handoff step), in one transaction (`Registry.register_and_trim`); then the files of the
        rows that went are deleted (the rows first: nobody is sent to a deleted file)."""
        if self.pending:
            self._registered(*self.registry.register_and_trim(self.pending, self._doomed))

    def _registered(self, records: list[CheckpointRecord], gone: list[int]) -> None:
        """The pending registrations were stored, and the trial's rows `gone` deleted: their files go too."""
        registered, self.pending = self.pending, []
        self._beside.clear()
        if self.store.artifacts is None:
            for pending in registered:
                _unregistered_path(self.store.local_path(str(pending["uri"]))).unlink(missing_ok=True)
        kept = {r.uri for r in records if r.id not in gone}
        for row in records:
            if row.id in gone and row.uri not in kept:
                if self.store.artifacts is None:  # its row went: nothing may register it again from beside it
                    _unregistered_path(self.store.local_path(row.uri)).unlink(missing_ok=True)
                _delete_in_scope(self.store.scope, row.uri, row.study)

    def _beside_blobs(self) -> None:
        """The storage is away: with a folder store, each pending registration is written beside its blob too."""
        if self.store.artifacts is None:
            for pending in self.pending:  # each once: an outage's registrations would be written again at every save
                if (uri := str(pending["uri"])) not in self._beside:
                    _write_unregistered(self.store.local_path(uri), pending)
                    self._beside.add(uri)

    def best_record(self) -> CheckpointRecord | None:
        """The trial's best checkpoint (its latest when none has a value), or None when it wrote none. Until
        the trial ends (`Registry.finish_trial`), no other worker's retention touches its checkpoints."""
        records = self.registry.for_trial(self.study, self.number)
        scored = best_first(records, self.maximize)
        return scored[0] if scored else max(records, key=lambda r: (r.step, r.id), default=None)

    def _doomed(self, records: list[CheckpointRecord]) -> list[int]:
        """The trial's checkpoints that its policy no longer keeps: all but its latest, its best `keep_top_k` and
        those at a kept step (the warm-start handoff)."""
        keep = policy_keeps(records, self.policy.keep_top_k, self.keep_steps, self.maximize)
        return [r.id for r in records if r.id not in keep]


def register_together(checkpointers: Sequence[TrialCheckpointer]) -> None:
    """What a cohort's members saved in a step (their checkpointers are `deferred`), registered and trimmed in one
    transaction (`Registry.register_and_trim_many`), where each checkpoint was one. While the storage is away, each
    registration waits in its checkpointer (and beside its blob, with a folder store), as a lone trial's does."""
    waiting = [c for c in checkpointers if c.pending]
    if not any(c.fresh for c in waiting):  # what waits from an outage is tried again with the next save, not each step
        return
    for checkpointer in waiting:
        checkpointer.fresh = False
    try:
        results = waiting[0].registry.register_and_trim_many([(c.pending, c._doomed) for c in waiting])  # noqa: SLF001
    except StorageAway:
        for checkpointer in waiting:
            checkpointer._beside_blobs()  # noqa: SLF001
        return
    for checkpointer, (records, gone) in zip(waiting, results):
        checkpointer._registered(records, gone)  # noqa: SLF001


def policy_keeps(records: Sequence[CheckpointRecord], keep_top_k: int, keep_steps: Collection[int],
                 maximize: bool) -> set[int]:
    """The ids of one trial's checkpoints its policy keeps: its latest, its best `keep_top_k` and those at a kept
    step (the warm-start handoff)."""
    if not records:
        return set()
    latest = max(records, key=lambda r: (r.step, r.id))
    return {latest.id, *(r.id for r in best_first(records, maximize)[:keep_top_k]),
            *(r.id for r in records if r.step in keep_steps)}


def best_first(records: Sequence[CheckpointRecord], maximize: bool) -> list[CheckpointRecord]:
    """The checkpoints with a finite value, best first."""
    sign = -1.0 if maximize else 1.0
    scored = [(sign * r.value, r) for r in records if r.value is not None and math.isfinite(r.value)]
    return [r for _, r in sorted(scored, key=lambda pair: pair[0])]


def ranked_trials(ranges: Mapping[int, tuple[float | None, float | None, bool]], maximize: bool) -> list[int]:
    """Trials best first by their best checkpointed value: those that completed or were pruned, then those that
    failed, each without any value last."""
    def key(number: int) -> tuple[bool, float]:
        low, high, failed = ranges[number]
        best = high if maximize else low
        return failed, math.inf if best is None else (-best if maximize else best)

    return sorted(ranges, key=key)


def retention_keeps(registry: Registry, study: str, trial_number: int, value: float | None, failed: bool,
                    keep_trials: int, maximize: bool) -> bool:
    """Whether `collect_study` would keep this trial's checkpoints were it to end now with its best `value`."""
    ranges = dict(registry.value_range_per_trial(study))
    finite = value if value is not None and math.isfinite(value) else None
    ranges[trial_number] = (finite, finite, failed)
    return trial_number in ranked_trials(ranges, maximize)[:keep_trials]


def collect_study(registry: Registry, study: str, keep_trials: int, maximize: bool, *,
                  scope: BlobScope | None = None) -> list[int]:
    """Keep checkpoints only for the study's `keep_trials` best ended trials (`ranked_trials`; pinned ones always
    stay). The rows go, then the blobs they named, those inside the study's part of the store (`scope`) only; without
    a `scope` no file is deleted.
    Returns the trials that lost checkpoints in this call (each trial is returned once: its rows are then gone)."""
    ranked = ranked_trials(registry.value_range_per_trial(study), maximize)
    dropped, uris = registry.forget_unpinned(study, ranked[keep_trials:])
    if scope is not None:
        for uri in uris:
            _delete_in_scope(scope, uri, study)
    return dropped


def _delete_in_scope(scope: BlobScope, uri: str, study: str) -> None:
    """Retention deletes a blob only where its study's blobs lie; a row naming anything else loses its row alone."""
    found = scope.find_or_warn(uri, study, f"study {study!r}: retention not deleting a checkpoint")
    if found is not None:
        delete_blob(found)
