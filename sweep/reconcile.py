"""Reconciliation of one study's checkpoint bookkeeping (`sweep check STUDY [--repair]`).

Three records must agree: the registry table (a row per checkpoint: its blob's URI, size and SHA-256), the blob store
(the study's folder, or an object store), and the Optuna artifacts that the dashboard downloads (a trial's user attr
`checkpoint` names an artifact id in the store at the study's user attr `sweep.artifacts`). `check_study` lists
every disagreement as a `Problem` of one `ProblemKind`; with `repair=True` it also fixes what can be fixed and says
so on each problem. `quick_check` is the cheap part that `sweep run` runs when it opens a study: the blobs workers may
be sent to exist, or their rows go.

Safe while workers run: a worker writes its blob (a temporary, renamed into place) before it registers the row, and
retention deletes the row before the blob. So a row never legitimately names a missing file, and a file no row names
is either young (about to be registered) or an orphan; deleting a row some worker deleted meanwhile is a no-op.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import stat
import time
import warnings
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from sweep.blobs import (
    OWNER_FILE,
    BlobScope,
    CheckpointStore,
    artifact_store_at,
    delete_blob,
    is_object_url,
    local_copy,
)
from sweep.outcomes import ARTIFACTS_ATTR, ATTR_WARM_START, SPEC_ATTR
from sweep.outcomes import ATTR_CHECKPOINT as CHECKPOINT_ATTR
from sweep.registry import default_store
from trainer.checkpoint import sha256_of

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

    from sweep.registry import CheckpointRecord, Registry

__all__ = ["CheckReport", "Problem", "ProblemKind", "check_study", "quick_check", "store_location"]

ORPHAN_MIN_AGE_S = 60.0  # a younger unregistered file may be a worker's, about to be registered
STALE_TEMPORARY_S = 3600.0  # a temporary this old is a killed writer's leftover, not a write in progress


class ProblemKind(str, enum.Enum):
    """What disagrees, and what `repair` does about it."""

    MISSING_BLOB = "missing_blob"
    """A registry row names a blob that is not there, or a path or key outside its study's part of the store (such a
    file is never read or deleted: see `sweep.blobs.BlobScope`). Repair: the row is deleted (pinned or not)."""
    CORRUPT_BLOB = "corrupt_blob"
    """A row's blob is there but its size or SHA-256 is not what the row recorded. Repair: the row is deleted
    (pinned or not), and the file too unless a row whose hash it matches still names it."""
    ORPHAN_FILE = "orphan_file"
    """A file in the study's store folder that no row names and no worker is writing. Repair: the file is deleted."""
    DANGLING_ARTIFACT = "dangling_artifact"
    """A trial's `checkpoint` attr names an artifact the study's artifact store does not hold. Repair: the blob is
    uploaded again under the same id when a sound registered blob of that trial has the recorded SHA-256; otherwise it
    cannot be repaired (Optuna cannot edit a finished trial's attrs; `sweep dashboard` serves a note in its place)."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Problem:
    """One disagreement. `path_or_id`: the blob's URI or file path, or the artifact id. `repairable`: whether
    `repair=True` can fix it; `repaired`: whether this call did."""

    kind: ProblemKind
    detail: str
    path_or_id: str
    repaired: bool = False
    repairable: bool = True
    checkpoint_id: int | None = None  # the registry row, for the row kinds

    def __str__(self) -> str:
        state = " (repaired)" if self.repaired else "" if self.repairable else " (cannot be repaired)"
        return f"{self.kind}: {self.detail}{state}"


@dataclass
class CheckReport:
    """Every problem `check_study` found in one study, and notes on what it could not check."""

    study: str
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Blobs there that this process may not read (their permissions, another user's files on a share): whether they
    # are sound cannot be told, so each is a note, not a problem, and its row and file are kept, for a user who can
    # read them (a run passes such a checkpoint over and resumes from an older one).
    unreadable: int = 0

    @property
    def outstanding(self) -> list[Problem]:
        """The problems that `repair=True` would fix and that were not repaired."""
        return [p for p in self.problems if p.repairable and not p.repaired]

    @property
    def ok(self) -> bool:
        """Nothing is left to repair: no problem, or each one was repaired or never can be (a dangling artifact with
        no blob left to rebuild it from, which the dashboard already serves a note for)."""
        return not self.outstanding

    @property
    def repaired(self) -> list[Problem]:
        return [p for p in self.problems if p.repaired]

    def counts(self) -> dict[ProblemKind, int]:
        """How many problems of each kind, every kind listed (0 when none)."""
        found = Counter(p.kind for p in self.problems)
        return {kind: found[kind] for kind in ProblemKind}

    def of_kind(self, kind: ProblemKind) -> list[Problem]:
        return [p for p in self.problems if p.kind == kind]


UNREGISTERED = ".unregistered.json"  # beside a blob whose registry row waited for the storage (sweep.checkpoints)


def adopt_unregistered(registry: Registry, folder: Path, study: str, trials: Sequence[int] | None = None) -> int:
    """Register each blob of the study's `folder` whose registration waited in its worker's memory when that worker
    gave up on the storage (`storage_patience`): its row lies beside it, in a file named like the blob plus
    `UNREGISTERED`. A record is claimed by renaming it, so of several workers starting at once one registers it; a
    blob that is gone or does not match its record's hash is not registered (`sweep check` lists it). `trials`: only
    those trials' records (a retry's lineage, whose workers are gone). Returns how many were registered."""
    adopted = 0
    patterns = [f"*{UNREGISTERED}"] if trials is None else [f"trial{n:05d}-*{UNREGISTERED}" for n in trials]
    for record_path in sorted(path for pattern in patterns for path in folder.glob(pattern)):
        claimed = record_path.with_name(f"{record_path.name}.{os.getpid()}")
        try:
            record_path.rename(claimed)
        except OSError:
            continue  # another worker claimed it
        try:
            record = json.loads(claimed.read_text())
            blob = folder / str(record["uri"])
            sound = record.get("study") == study and blob.is_file() and sha256_of(blob) == record["sha256"]
        except (OSError, ValueError, KeyError, TypeError) as exc:  # not a record: `sweep check` lists the blob
            warnings.warn(f"{record_path}: not registered ({type(exc).__name__}: {exc})", stacklevel=2)
            claimed.unlink(missing_ok=True)
            continue
        try:
            if sound and record["uri"] not in {r.uri for r in registry.for_trial(study, int(record["trial_number"]))}:
                registry.register(**record)
                adopted += 1
        except BaseException:  # the storage away again, a signal: the record stays for the next worker
            with contextlib.suppress(OSError):
                claimed.rename(record_path)
            raise
        claimed.unlink(missing_ok=True)
    return adopted


def check_study(registry: Registry, store_location: str, study: optuna.Study, *, repair: bool = False,
                delete_orphans: bool = True,
                orphan_min_age_s: float = ORPHAN_MIN_AGE_S,
                stale_temporary_s: float = STALE_TEMPORARY_S) -> CheckReport:
    """Every disagreement between the registry rows of `study`, its blobs under `store_location` (a folder, or an
    `s3://` / `gs://` URL: the study's `checkpoints.store`) and its trials' checkpoint artifacts (see `ProblemKind`).

    Each blob is hashed: object-store blobs are downloaded one at a time to do so. The orphan scan lists the study's
    folder; an object store cannot be listed through Optuna's artifact stores, so it is skipped there with a note.
    With `repair`, rows go before files, and an artifact is rebuilt only from a blob this check found sound."""
    name = study.study_name
    report = CheckReport(name)
    scope = BlobScope(store_location)
    if repair and not is_object_url(store_location):  # checkpoints written in an outage: registered, not deleted
        adopt_unregistered(registry, CheckpointStore(store_location, name).folder, name)
    # The folder is listed before the rows are read: a file a worker registers in between is then known by its row.
    files = _listing(store_location, name, report)
    records = registry.for_study(name)
    sound = _check_blobs(registry, records, scope, report, repair)
    if not records and files and any(not _is_temporary(file.path) for file in files):
        # Checkpoints in the study's folder, and not one row of the study in this database: its study is a copy of
        # the one that wrote them (`optuna.copy_study` copies Optuna's tables, the owner id among the study's attrs,
        # and none of sweep's), or sweep's tables were lost. A study's own rows go only with their files (retention,
        # a repair), so the files are another database's: never judged from here (review: --repair on a copy
        # deleted the original's checkpoints as orphans).
        report.notes.append(f"{len(files)} files in {CheckpointStore(store_location, name).folder} were left alone: "
                            f"this database holds no checkpoint row of study {name!r}, so it is likely a copy of the "
                            "database that wrote them (optuna.copy_study copies no checkpoint registry); check the "
                            "study in that database instead")
        files = None
    # A warm trial's parent is never an orphan, row or none: `reproduce` loads it by the URI and hash the trial keeps
    # (review: a row an older sweep deleted left the parent to --repair, and the trial could no longer be replayed).
    trials = study.get_trials(deepcopy=False)
    parents = {found for trial in trials
               if isinstance(parent := trial.user_attrs.get(ATTR_WARM_START), dict) and parent.get("study") == name
               and isinstance(parent.get("uri"), str) and (found := scope.find(parent["uri"], name)) is not None}
    _check_orphans(files, records, scope, report, repair and delete_orphans, orphan_min_age_s, stale_temporary_s,
                   parents)
    if repair and not delete_orphans and report.of_kind(ProblemKind.ORPHAN_FILE):
        report.notes.append("files no row names were left in place: the store is named only by the database; give "
                            "the study file to let --repair delete them")
    _check_artifacts(study, trials, sound, scope, report, repair)
    return report


def store_location(study: optuna.Study, storage_url: str) -> str:
    """Where the study's blobs live: the stored study file's `checkpoints.store`, else beside the SQLite file."""
    return _location(study.user_attrs, storage_url)


def other_store_location(storage: optuna.storages.BaseStorage, study_name: str, storage_url: str) -> str | None:
    """`store_location` of another study of this storage (a `warm_start.from_studies` donor's), which may keep its
    blobs in another store than the study reading them; None when the storage holds no such study."""
    try:
        return _location(storage.get_study_user_attrs(storage.get_study_id_from_name(study_name)), storage_url)
    except (KeyError, AttributeError):  # no such study, or a definition damaged by hand: this study's store
        return None


def _location(user_attrs: dict[str, Any], storage_url: str) -> str:
    """A damaged stored definition (not a mapping) raises AttributeError: each command says so in one line."""
    stored = (user_attrs.get(SPEC_ATTR) or {}).get("checkpoints") or {}
    return str(stored.get("store") or default_store(storage_url))


def quick_check(registry: Registry, study_name: str, *, scope: BlobScope) -> list[Problem]:
    """Delete the rows a worker may be sent to whose blob is missing, so no worker is sent to a missing file: warm-start
    donors, pinned rows, and each unfinished trial's resume point (its latest row; when that one is missing, the
    next latest, and so on, since that is where a retry would resume). Returns what this call removed, as repaired
    `MISSING_BLOB` problems.

    Cheap, for `sweep run` opening a study: one registry query (`Registry.in_use`) and one stat per distinct local
    blob that matters (a running trial's older rows only once the later ones are missing); nothing is hashed (a
    corrupt blob is refused by its hash when loaded). Object-store blobs are not checked: Optuna's artifact stores
    have no existence check short of starting a download. With the study's `scope`, a row naming a blob outside its
    study's part of the store counts as missing (with a warning), and nothing outside is looked at."""
    present: dict[str, bool] = {}

    def missing(record: CheckpointRecord) -> bool:
        uri = scope.find_or_warn(record.uri, record.study, f"checkpoint {record.id} (trial "
                                 f"{record.trial_number}, step {record.step}) is dropped from the registry")
        if uri is None:
            return True
        if is_object_url(uri):
            return False
        if uri not in present:
            present[uri] = Path(uri).exists()
        return not present[uri]

    records = registry.in_use(study_name)
    broken = {r.id: r for r in records if (r.final != 0 or r.pinned) and missing(r)}
    running: dict[int, list[CheckpointRecord]] = {}
    for record in records:
        if record.final == 0:
            running.setdefault(record.trial_number, []).append(record)
    for rows in running.values():  # latest first, as `Registry.latest_for_trial` picks the resume point
        for record in sorted(rows, key=lambda r: (r.step, r.id), reverse=True):
            if not missing(record):
                break
            broken[record.id] = record
    removed = registry.forget_all_broken(sorted(broken))
    return [_missing(broken[i], repaired=True, path=scope.find(broken[i].uri, broken[i].study)) for i in removed]


@dataclass(frozen=True)
class _File:
    path: Path
    age_s: float


def _listing(store_location: str, study: str, report: CheckReport) -> list[_File] | None:
    """The files in the study's store folder with their ages, or None (with a note) for an object store."""
    if is_object_url(store_location):
        report.notes.append("orphan scan not supported for object stores: Optuna's artifact stores cannot list "
                            f"{store_location}")
        return None
    folder = CheckpointStore(store_location, study).folder
    if folder.is_symlink():
        # Not a folder sweep made: the scan would delete, as orphans, the files of wherever it leads (review: one
        # link in a shared store, and the next `check --repair` emptied a folder of the user's outside it).
        report.notes.append(f"orphan scan skipped: {folder} is a symbolic link (to {os.readlink(folder)}), not the "
                            "folder sweep made, so no file in it is deleted as an orphan")
        return None
    now, files = time.time(), []
    try:
        listed = list(folder.iterdir())
    except FileNotFoundError:
        listed = []
    except PermissionError as exc:  # each of its rows' blobs is a note of its own (`_check_blobs`)
        report.notes.append(f"orphan scan skipped: the folder {folder} cannot be listed ({exc.strerror})")
        return None
    with contextlib.suppress(FileNotFoundError):
        for path in listed:
            try:
                stat = path.lstat()
            except FileNotFoundError:  # renamed or deleted since the listing
                continue
            if path.name == OWNER_FILE or path.name.startswith(".sweep-owner-"):  # whose folder it is (sweep.blobs)
                continue
            if path.is_file() and not path.is_symlink() and UNREGISTERED not in path.name:  # a record, or a claimed one
                files.append(_File(path, now - stat.st_mtime))
    return files


def _check_blobs(registry: Registry, records: list[CheckpointRecord], scope: BlobScope, report: CheckReport,
                 repair: bool) -> list[CheckpointRecord]:
    """Rows whose blob is missing, outside the study's part of the store, or fails its size or hash; returns the rows
    whose blob is sound."""
    where = {r.id: scope.find(r.uri, r.study) for r in records}  # None: outside, never read or deleted
    # URI -> (size, sha256), None when missing, the error where it cannot be read; each blob once
    digests: dict[str, tuple[int, str] | OSError | None] = {}
    for uri in dict.fromkeys(where.values()):
        if uri is not None:
            digests[uri] = _digest(uri)
    outside = [r for r in records if where[r.id] is None]
    missing = [r for r in records if (uri := where[r.id]) is not None and digests[uri] is None]
    unreadable = [r for r in records if (uri := where[r.id]) is not None and isinstance(digests[uri], OSError)]
    corrupt = [r for r in records if (uri := where[r.id]) is not None and isinstance(found := digests[uri], tuple)
               and found != (r.size, r.sha256)]
    broken = {r.id for r in outside + missing + corrupt}
    sound = [r for r in records if r.id not in broken and not isinstance(digests.get(where[r.id] or ""), OSError)]
    # A row that went while its blob was read (retention, another worker's repair) is no problem any more.
    if repair:
        removed = still = set(registry.forget_all_broken(sorted(broken)))
        needed = {where[r.id] for r in sound}
        for uri in dict.fromkeys(where[r.id] for r in corrupt):
            if uri is not None and uri not in needed:
                try:
                    delete_blob(uri)
                except OSError as exc:  # its row is gone: a later check finds it an orphan
                    report.notes.append(f"{uri}: its row was forgotten, but the file cannot be deleted "
                                        f"({(exc.strerror or type(exc).__name__).lower()})")
    else:
        removed, still = set(), {r.id for r in registry.for_study(report.study)} if broken else set()
    report.problems += [Problem(
        ProblemKind.MISSING_BLOB, f"checkpoint {r.id} (trial {r.trial_number}, step {r.step}"
        f"{', pinned' if r.pinned else ''}): {r.uri} is outside the study's part of the store "
        f"({scope.area(r.study)}), so it was neither read nor deleted", r.uri, repaired=r.id in removed,
        checkpoint_id=r.id) for r in outside if r.id in still]
    missing = [r for r in missing if r.id in still]
    corrupt = [r for r in corrupt if r.id in still]
    report.problems += [_missing(r, repaired=r.id in removed, path=where[r.id]) for r in missing]
    for record in unreadable:
        error = digests[where[record.id] or ""]
        report.unreadable += 1
        report.notes.append(
            f"checkpoint {record.id} (trial {record.trial_number}, step {record.step}"
            f"{', pinned' if record.pinned else ''}): {where[record.id]} cannot be read "
            f"({getattr(error, 'strerror', None) or error}), so whether it is sound cannot be told; kept. Make it "
            "readable to this user, or run the check as its owner")
    for record in corrupt:
        found = digests[where[record.id] or ""]
        size, sha256 = found if isinstance(found, tuple) else (0, "")
        what = (f"{size} bytes where {record.size} were recorded" if size != record.size
                else f"SHA-256 {sha256[:12]}… where {record.sha256[:12]}… was recorded")
        path = where[record.id] or record.uri
        report.problems.append(Problem(
            ProblemKind.CORRUPT_BLOB, f"checkpoint {record.id} (trial {record.trial_number}, step {record.step}"
            f"{', pinned' if record.pinned else ''}): {path} holds {what}", path,
            repaired=record.id in removed, checkpoint_id=record.id))
    return sound


def _digest(uri: str) -> tuple[int, str] | OSError | None:
    """The blob's size and SHA-256, or None when it is not there (downloaded first from an object store); a folder
    at its path is no blob either. A local blob this process may not read: the error."""
    with local_copy(uri) as path:
        try:
            found = path.stat()
            return (found.st_size, sha256_of(path)) if stat.S_ISREG(found.st_mode) else None
        except FileNotFoundError:  # not there, or deleted between the stat and the read
            return None
        except PermissionError as exc:  # the file, or its folder, this process may not read
            return exc


def _missing(record: CheckpointRecord, *, repaired: bool, path: str | None) -> Problem:
    """`path`: where the row's blob should be (its URI resolved in the study's part of the store)."""
    shown = path or record.uri
    return Problem(ProblemKind.MISSING_BLOB, f"checkpoint {record.id} (trial {record.trial_number}, step "
                   f"{record.step}{', pinned' if record.pinned else ''}): {shown} is not there", shown,
                   repaired=repaired, checkpoint_id=record.id)


def _is_temporary(path: Path) -> bool:
    """`trainer.checkpoint.save_checkpoint` writes `.NAME.PID.tmp` beside NAME, then renames it to NAME."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


def _check_orphans(files: list[_File] | None, records: list[CheckpointRecord], scope: BlobScope,
                   report: CheckReport, repair: bool, min_age_s: float, stale_temporary_s: float,
                   parents: Collection[str] = ()) -> None:
    """Files no row names (`parents`: named by a warm trial instead, kept)."""
    if files is None:
        return
    named = {found for r in records if (found := scope.find(r.uri, r.study)) is not None} | set(parents)
    for file in files:
        if str(file.path.resolve()) in named:
            continue
        temporary = _is_temporary(file.path)
        if file.age_s < (stale_temporary_s if temporary else min_age_s):
            continue
        refused = _unlinked(file.path) if repair else None
        kind = "a temporary left by a writer that did not finish" if temporary else "no checkpoint row names it"
        report.problems.append(Problem(ProblemKind.ORPHAN_FILE, f"{file.path}: {kind} ({file.age_s / 60:.0f} min old)"
                                       + (f"; it cannot be deleted: {refused}" if refused else ""),
                                       str(file.path), repaired=repair and refused is None))


def _unlinked(path: Path) -> str | None:
    """Delete `path`; what refused it (files review: a read-only store's error was taken for the database's), or
    None."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        return (exc.strerror or type(exc).__name__).lower()
    return None


def _check_artifacts(study: optuna.Study, trials: Sequence[FrozenTrial], sound: list[CheckpointRecord],
                     scope: BlobScope, report: CheckReport, repair: bool) -> None:
    recorded = [(trial, trial.user_attrs[CHECKPOINT_ATTR]) for trial in trials
                if isinstance(trial.user_attrs.get(CHECKPOINT_ATTR), dict)
                and trial.user_attrs[CHECKPOINT_ATTR].get("artifact_id")]
    if not recorded:
        return
    # Always the checkpoint store's own artifact location (a repair writes there): the one the study records is
    # whatever whoever can write the database wrote, and an absolute path that a moved store no longer has.
    location = scope.artifact_location
    named = study.user_attrs.get(ARTIFACTS_ATTR)
    if isinstance(named, str) and named != location:
        report.notes.append(f"the study records its checkpoint artifacts in {named}; checked this checkpoint "
                            f"store's own, {location}")
    store = artifact_store_at(location, create=False)  # a check without --repair writes nothing
    for trial, attr in recorded:
        artifact_id = str(attr["artifact_id"])
        if _artifact_exists(store, artifact_id):
            continue
        sha256 = attr.get("sha256")
        source = next((r for r in sound if r.trial_number == trial.number and r.sha256 == sha256), None)
        where = f"trial {trial.number}'s checkpoint artifact {artifact_id} (step {attr.get('step')})"
        if source is None:
            report.problems.append(Problem(
                ProblemKind.DANGLING_ARTIFACT, f"{where} is not in {location}, and no sound registered checkpoint of "
                "the trial has its hash (the study's retention may have removed both); Optuna cannot edit a "
                "finished trial, and sweep dashboard serves a note in its place", artifact_id, repairable=False))
            continue
        uri = scope.find(source.uri, source.study)  # a sound row's: inside the scope
        if repair and uri is not None:
            _upload(store, location, artifact_id, uri)
        report.problems.append(Problem(
            ProblemKind.DANGLING_ARTIFACT, f"{where} is not in {location}; checkpoint {source.id} ({source.uri}) "
            f"has its hash{', uploaded again' if repair else ''}", artifact_id, repaired=repair and uri is not None,
            checkpoint_id=source.id))


def _artifact_exists(store: Any, artifact_id: str) -> bool:
    try:
        reader = store.open_reader(artifact_id)
    except optuna.artifacts.exceptions.ArtifactNotFound:
        return False
    reader.close()
    return True


def _upload(store: Any, location: str, artifact_id: str, uri: str) -> None:
    """Upload the blob at `uri` (found in the study's scope: `sound` rows only) as the artifact `artifact_id`."""
    if not is_object_url(location):
        Path(location).mkdir(parents=True, exist_ok=True)
    with local_copy(uri) as path, open(path, "rb") as handle:
        store.write(artifact_id, handle)
