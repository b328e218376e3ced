"""Where checkpoint blobs live: a folder (next to the SQLite file, or shared by every machine), or an object store
(`s3://bucket/prefix`, `gs://bucket/prefix`) through Optuna's artifact stores, so no storage client is hand-written.

The trainer always writes a checkpoint to a local file (atomically, with its hash); an object store then receives
it and the local copy goes. A blob is named by its URI in the registry: a path relative to the study's folder of the
store, or `s3://...`/`gs://...`.
Object-store credentials and endpoints come from the environment, as the cloud's own client reads them (`AWS_*`,
`AWS_ENDPOINT_URL` for S3-compatible servers).

A registry row is only as trustworthy as whoever can write the database, so no URI is read or deleted as it stands:
`BlobScope.find` first checks that it names a blob inside its study's part of the store (the folder
`STORE/STUDY/`, symlinks resolved, or keys under `PREFIX/STUDY/` in the store's bucket) and refuses anything else.
New rows name their blob relative to `STORE/STUDY/` (rows written before, with absolute paths, are still read
when they lie inside): the registry names no machine's mount point, and a store copied or mounted elsewhere along with
its database still works.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlparse

import optuna

from sweep.outcomes import OBJECT_STORE_CLIENTS, ObjectStoreError
from sweep.urls import plain_folder_name
from trainer.checkpoint import TrainState, load_checkpoint
from trainer.yaml_file import short_repr

__all__ = ["OWNER_FILE", "BlobScope", "CheckpointStore", "RetainedArtifacts", "artifact_store_at",
           "artifact_store_for", "claim_problem", "delete_blob", "is_object_url", "load_blob", "local_copy"]

OWNER_FILE = ".sweep-owner.json"  # in STORE/STUDY/: which study (by the id its database keeps) owns the folder

SCHEMES = ("s3", "gs")


def is_object_url(location: str) -> bool:
    return urlparse(location).scheme in SCHEMES


def _split(url: str) -> tuple[str, str, str]:
    parsed = urlparse(url)
    if parsed.scheme not in SCHEMES or not parsed.netloc:
        raise ValueError(f"expected s3://bucket/prefix or gs://bucket/prefix, but got {url!r}")
    return parsed.scheme, parsed.netloc, parsed.path.strip("/")


def artifact_store_for(url: str) -> Any:
    """Optuna's artifact store for `s3://bucket` or `gs://bucket` (boto3 / google-cloud-storage must be installed),
    whose client's failures come out as `ObjectStoreError`."""
    scheme, bucket, _ = _split(url)
    with _client_faults(f"{scheme}://{bucket}"):
        store = (optuna.artifacts.Boto3ArtifactStore(bucket) if scheme == "s3"
                 else optuna.artifacts.GCSArtifactStore(bucket))
    return _ObjectStore(store, f"{scheme}://{bucket}")


@contextlib.contextmanager
def _client_faults(where: str) -> Iterator[None]:
    try:
        yield
    except ObjectStoreError:
        raise
    except Exception as exc:  # the client's own errors, of its own many types
        if not type(exc).__module__.startswith(OBJECT_STORE_CLIENTS):
            raise
        lines = str(exc).strip().splitlines()
        raise ObjectStoreError(f"{where}: {type(exc).__name__}: {lines[0] if lines else ''}") from exc


class _ObjectStore:
    """An object store's artifact store, as Optuna's: what its client raises (no credentials, access denied, no such
    bucket, the endpoint unreachable) is an `ObjectStoreError`, which the worker treats as the machine's fault, not
    the trial's config's. Only these calls are: a user's own code using the same client is never mistaken for it."""

    def __init__(self, store: Any, where: str) -> None:
        self.store, self.where = store, where

    def open_reader(self, artifact_id: str) -> BinaryIO:
        with _client_faults(self.where):
            return self.store.open_reader(artifact_id)

    def write(self, artifact_id: str, content_body: BinaryIO) -> None:
        with _client_faults(self.where):
            self.store.write(artifact_id, content_body)

    def remove(self, artifact_id: str) -> None:
        with _client_faults(self.where):
            self.store.remove(artifact_id)


def artifact_store_at(location: str, *, create: bool = True) -> Any:
    """Optuna's artifact store for a folder or an object-store URL (where trials' best checkpoints are uploaded for
    the dashboard). `create`: make the folder now (False for a look that writes nothing: its first write makes it)."""
    if is_object_url(location):
        return artifact_store_for(location)
    if create:
        Path(location).mkdir(parents=True, exist_ok=True)
    return _FolderArtifacts(location)


class _FolderArtifacts(optuna.artifacts.FileSystemArtifactStore):
    """Optuna's folder store, which makes its folder again when it is gone (the store removed while the study runs:
    every later trial's artifact failed, and the dashboard showed none), and removes what a write that failed left
    (a full disk left a truncated copy that nothing named, its space never given back)."""

    def write(self, artifact_id: str, content_body: BinaryIO) -> None:
        Path(self._base_path).mkdir(parents=True, exist_ok=True)
        try:
            super().write(artifact_id, content_body)
        except BaseException:
            with contextlib.suppress(OSError):
                (Path(self._base_path) / artifact_id).unlink(missing_ok=True)
            raise


class BlobScope:
    """Which blobs the registry rows of a store may name: for a folder store, files inside `LOCATION/STUDY/` (after
    resolving symlinks and `..`); for an object store, keys under `PREFIX/STUDY/` in its own bucket, with no empty,
    `.` or `..` segment. A study name that is not one plain path segment has no blobs at all."""

    def __init__(self, location: str | Path) -> None:
        self.location = str(location)
        self.object = is_object_url(self.location)
        if self.object:
            self.scheme, self.bucket, self.prefix = _split(self.location)
        else:
            self.root = Path(self.location).resolve()

    @property
    def artifact_location(self) -> str:
        """Where the store's trials upload their dashboard artifacts: `_artifacts` beside the studies' folders, or
        the store's bucket."""
        if self.object:
            return f"{self.scheme}://{self.bucket}"
        return str((self.root / "_artifacts").resolve())

    def area(self, study: str) -> str:
        """Where `study`'s blobs may lie, for messages."""
        if self.object:
            return f"{self.scheme}://{self.bucket}/{self._key_base(study)}/"
        return f"{self.root / study}/"

    def _key_base(self, study: str) -> str:
        return f"{self.prefix}/{study}" if self.prefix else study

    def find(self, uri: str, study: str) -> str | None:
        """The URI to read or delete (a resolved absolute path, or a full object URL) when `uri` names a blob inside
        `study`'s part of the store; None for anything else (a path elsewhere, a `..` escape, a symlink that leads
        out, another bucket or scheme, a key outside the study's prefix)."""
        if not plain_folder_name(study):
            return None
        return self._find_object(uri, study) if self.object else self._find_file(uri, study)

    def _find_file(self, uri: str, study: str) -> str | None:
        if is_object_url(uri) or "://" in uri:
            return None
        try:
            base = (self.root / study).resolve()
            path = Path(uri) if Path(uri).is_absolute() else base / uri
            resolved = path.resolve()  # symlinks followed: where a read or an unlink would really go
        except (OSError, RuntimeError, ValueError):  # a symlink loop, a name too long, a NUL
            return None
        if resolved == base or not resolved.is_relative_to(base):
            return None
        return str(resolved)

    def _find_object(self, uri: str, study: str) -> str | None:
        if is_object_url(uri):
            try:
                scheme, bucket, key = _split(uri)
            except ValueError:
                return None
            if (scheme, bucket) != (self.scheme, self.bucket) or urlparse(uri).query or urlparse(uri).fragment:
                return None
        elif "://" in uri or uri.startswith("/"):
            return None
        else:
            key = f"{self._key_base(study)}/{uri}"
        base = self._key_base(study) + "/"
        if not key.startswith(base) or any(part in ("", ".", "..") for part in key[len(base):].split("/")):
            return None
        return f"{self.scheme}://{self.bucket}/{key}"

    def find_or_warn(self, uri: str, study: str, doing: str) -> str | None:
        """`find`, with a warning when the URI is refused: `doing` says what was about to happen ("not loading
        trial 3's checkpoint at step 10")."""
        found = self.find(uri, study)
        if found is None:
            warnings.warn(f"{doing}: {uri!r} is not inside study {study!r}'s part of the checkpoint store "
                          f"({self.area(study)}), so it is neither read nor deleted: the row names a path outside it, "
                          "or the file there is a link out of it (whoever can write the database or the folder made "
                          "it so)", stacklevel=3)
        return found


class CheckpointStore:
    """One study's blobs. `local_path(name)` is where the trainer writes; `put(path)` files it and returns its URI."""

    def __init__(self, location: str | Path, study: str) -> None:
        self.location, self.study = str(location), study
        self.scope = BlobScope(self.location)
        if is_object_url(self.location):
            scheme, self.bucket, prefix = _split(self.location)
            self.prefix = f"{prefix}/{study}" if prefix else study
            self.scheme, self.artifacts = scheme, artifact_store_for(self.location)
            self.folder = Path(tempfile.mkdtemp(prefix="sweep-outbox-"))  # written here, uploaded, removed
        else:
            # Resolved: the trainer's files land in the same folder from any working directory.
            self.artifacts = None
            self.folder = Path(self.location).resolve() / study
        self._seen = self.artifacts is None and self.folder.is_dir()

    def vanished(self) -> bool:
        """Whether the study's folder of a local store was there and is not now (deleted, or a share unmounted, while
        the run writes in it). Writing there would make it anew, without its owner file, for another study of the
        same name to claim, and its `sweep check --repair` to empty (files review)."""
        if self.artifacts is not None:
            return False
        if self.folder.is_dir():
            self._seen = True
            return False
        return self._seen

    @property
    def artifact_location(self) -> str:
        """Where trials' dashboard artifacts go: beside the studies' blobs."""
        return self.scope.artifact_location

    def local_path(self, name: str) -> Path:
        return self.folder / name

    def put(self, path: Path) -> str:
        """File a blob the trainer wrote at `local_path(name)`; returns the URI its registry row keeps: for a folder,
        the name relative to the study's folder (`BlobScope.find` resolves it), so a store moved or mounted elsewhere
        with its database keeps working; for an object store, the full `s3://`/`gs://` URL."""
        if self.artifacts is None:
            return path.relative_to(self.folder).as_posix()
        key = f"{self.prefix}/{path.name}"
        with open(path, "rb") as handle:
            self.artifacts.write(key, handle)
        path.unlink(missing_ok=True)
        return f"{self.scheme}://{self.bucket}/{key}"


def claim_problem(location: str | Path, study: str, owner: str | None, *, claim: bool = True,
                  new: bool = False, kind: str = "checkpoints") -> str | None:
    """Why the study's folder of a local store belongs to another study of the same name (another database: two
    PostgreSQL databases, or a database recreated, pointed at one default `sweep-checkpoints/` folder), or None.
    The folder's owner file holds the id its study's database keeps (`owner`, made when the study was created);
    with `claim`, a folder without one is claimed for this study (created atomically: one of two workers racing
    wins, the other reads the winner's id). Sharing a folder, their blobs would overwrite each other's (the same
    names) and each study's `sweep check --repair` would delete the other's as orphans. A study created before
    owner ids existed (`owner` None) and object stores are not checked. `new`: the study is not created yet, so a
    folder with any owner is another study's (checked before creating it, so that nothing is left half-made).
    `kind`: "checkpoints", or "tensorboard" for the study's folder of TensorBoard runs, claimed the same way
    (TensorBoard shows every run in it as the study's)."""
    if (owner is None and not new) or is_object_url(str(location)):
        return None
    folder = Path(location).expanduser().resolve() / study
    for _ in range(2):
        try:
            found = _mark(folder)
        except ValueError as exc:  # it is there, and says nothing: whose the folder is cannot be told
            return _unreadable_mark(folder, exc)
        except (OSError, AttributeError):
            return None  # unreadable or not ours to judge: no claim either way
        if found is None:
            if not claim:
                return None
            if _write_mark(folder, {"study": study, "owner": owner}, replace=False):
                return None
            continue  # another worker claimed it first: read theirs
        if found.get("owner") == owner:
            return None
        return _taken(folder, study, kind)
    return None


def default_folder_problem(location: str | Path, study: str, owner: str | None, database: str, *,
                           claim: bool) -> str | None:
    """`claim_problem` for a SQLite file's default folder (`NAME.checkpoints/`), whose mark also names the file
    (`database`, its resolved path). The folder is that file's: a mark of another study of the file (one deleted to
    start over, `rm study.db`) is taken over with `claim`, never refused; a mark of another database's study (one
    that pointed `checkpoints.store` here) is refused, here and in `sweep check`, whichever ran first (the file's
    own study was not refused there, took the folder, and its `check --repair` deleted the other's blobs as
    orphans). `owner` None: the study is not created yet."""
    folder = Path(location).expanduser().resolve() / study
    try:
        found = _mark(folder)
    except ValueError as exc:
        return _unreadable_mark(folder, exc)
    except (OSError, AttributeError):
        return None
    if found is not None and found.get("owner") == owner:
        return None
    if found is not None and found.get("database") != database:
        return _taken(folder, study, "checkpoints")
    if claim and owner is not None:
        _write_mark(folder, {"study": study, "owner": owner, "database": database}, replace=True)
    return None


def _mark(folder: Path) -> dict[str, Any] | None:
    """The folder's owner file, or None where it has none. Raises ValueError where it is there but cannot be read
    (garbled, not a file, or the worker may not read it: whose the folder is cannot be told), OSError where the
    folder itself cannot be looked into."""
    path = folder / OWNER_FILE
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if os.path.lexists(path):
            raise ValueError(exc.strerror or type(exc).__name__) from exc
        raise
    if not isinstance(found, dict):
        raise ValueError("not an owner file")
    return found


def _write_mark(folder: Path, mark: dict[str, Any], *, replace: bool) -> bool:
    """Write the folder's owner file atomically: `replace`, over any; else only where there is none (False: another
    worker's came first). A folder that cannot be written is left as it is (True: the run's own checks tell it)."""
    handle = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".sweep-owner-", delete=False) as handle:
            json.dump(mark, handle)
        if replace:
            os.replace(handle.name, folder / OWNER_FILE)
        else:
            os.link(handle.name, folder / OWNER_FILE)
    except FileExistsError:
        return False
    except OSError:
        return True
    finally:
        if handle is not None:
            with contextlib.suppress(OSError):
                os.unlink(handle.name)
    return True


def _unreadable_mark(folder: Path, exc: ValueError) -> str:
    """An owner file that is there but holds no owner (edited, or overwritten: sweep writes it whole, atomically), or
    that this worker may not read. Taken for none, it let another database's study of this name write and `--repair`
    in the folder, deleting this study's checkpoints as orphans (review)."""
    return (f"the owner file {folder / OWNER_FILE} is unreadable ({short_repr(str(exc))}), so whose the folder is "
            "cannot be told: restore it, or, if the folder holds this study's checkpoints alone, delete the file "
            "(the next run writes it again)")


def _taken(folder: Path, study: str, kind: str) -> str:
    if kind == "tensorboard":
        return (f"the TensorBoard folder {folder} holds the runs of another study named {study!r} (in another "
                f"database, or one deleted and created again): TensorBoard would show their curves as this "
                f"study's. Set tracking.tensorboard.dir to a folder of this study's own, or, if that study is "
                f"gone, remove the folder")
    return (f"the checkpoint folder {folder} belongs to another study named {study!r} (in another database, or "
            f"one deleted and created again): sharing it, each would overwrite and delete the other's "
            f"checkpoints. Set checkpoints.store to a folder of this study's own, or, if that study is gone, "
            f"remove the folder")


class RetainedArtifacts:
    """An artifact store as the dashboard sees it: a trial's checkpoint artifact that the study's retention removed
    (`checkpoints.keep_top_trials`) downloads as a one-line note saying so, where the dashboard would answer a
    server error. Everything else goes to the store as it is."""

    NOTE = (b"sweep: this trial's checkpoint was deleted by the study's retention (checkpoints.keep_top_trials): "
            b"only the best trials keep theirs\n")

    def __init__(self, store: Any) -> None:
        self.store = store

    def open_reader(self, artifact_id: str) -> BinaryIO:
        try:
            return self.store.open_reader(artifact_id)
        except optuna.artifacts.exceptions.ArtifactNotFound:
            return io.BytesIO(self.NOTE)

    def write(self, artifact_id: str, content_body: BinaryIO) -> None:
        self.store.write(artifact_id, content_body)

    def remove(self, artifact_id: str) -> None:
        self.store.remove(artifact_id)


def load_blob(uri: str, sha256: str | None) -> TrainState:
    """The checkpoint at `uri` (as `BlobScope.find` returned it: never a registry row's URI as it stands), checked
    against its hash (`weights_only`); raises `trainer.checkpoint.CheckpointError` when it is missing, damaged or not
    what was recorded."""
    with local_copy(uri) as path:
        return load_checkpoint(path, sha256=sha256)


@contextlib.contextmanager
def local_copy(uri: str) -> Iterator[Path]:
    """A local file holding the blob: the path itself, or a temporary download that is removed afterwards (a
    missing object yields a path that does not exist, which the loader refuses like a missing file)."""
    if not is_object_url(uri):
        yield Path(uri)
        return
    _, _, key = _split(uri)
    folder = Path(tempfile.mkdtemp(prefix="sweep-blob-"))
    target = folder / Path(key).name
    try:
        try:
            reader = artifact_store_for(uri).open_reader(key)
        except optuna.artifacts.exceptions.ArtifactNotFound:
            yield target
            return
        with reader, open(target, "wb") as handle:
            shutil.copyfileobj(reader, handle)
        yield target
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def delete_blob(uri: str) -> None:
    if not is_object_url(uri):
        if not Path(uri).is_dir():  # a folder at a blob's path is not sweep's to remove
            Path(uri).unlink(missing_ok=True)
        return
    _, _, key = _split(uri)
    with contextlib.suppress(optuna.artifacts.exceptions.ArtifactNotFound):
        artifact_store_for(uri).remove(key)
