"""Where checkpoint blobs live: a folder (next to the SQLite file, or shared by every machine), or an object store
(`s3://bucket/prefix`, `gs://bucket/prefix`) through Optuna's artifact stores, so no storage client is hand-written.

The trainer always writes a checkpoint to a local file (atomically, with its hash); an object store then receives
it and the local copy goes. A blob is named by its URI in the registry: a path, or `s3://...`/`gs://...`, so any
worker can read or delete it knowing nothing but the URI. Object-store credentials and endpoints come from the
environment, as the cloud's own client reads them (`AWS_*`, `AWS_ENDPOINT_URL` for S3-compatible servers).
"""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlparse

import optuna

from trainer.checkpoint import TrainState, load_checkpoint

__all__ = ["CheckpointStore", "RetainedArtifacts", "artifact_store_at", "artifact_store_for", "delete_blob",
           "is_object_url", "load_blob", "local_copy"]

SCHEMES = ("s3", "gs")


def is_object_url(location: str) -> bool:
    return urlparse(location).scheme in SCHEMES


def _split(url: str) -> tuple[str, str, str]:
    parsed = urlparse(url)
    if parsed.scheme not in SCHEMES or not parsed.netloc:
        raise ValueError(f"expected s3://bucket/prefix or gs://bucket/prefix, but got {url!r}")
    return parsed.scheme, parsed.netloc, parsed.path.strip("/")


def artifact_store_for(url: str) -> Any:
    """Optuna's artifact store for `s3://bucket` or `gs://bucket` (boto3 / google-cloud-storage must be installed)."""
    scheme, bucket, _ = _split(url)
    if scheme == "s3":
        return optuna.artifacts.Boto3ArtifactStore(bucket)
    return optuna.artifacts.GCSArtifactStore(bucket)


def artifact_store_at(location: str) -> Any:
    """Optuna's artifact store for a folder or an object-store URL (where trials' best checkpoints are uploaded for
    the dashboard)."""
    if is_object_url(location):
        return artifact_store_for(location)
    Path(location).mkdir(parents=True, exist_ok=True)
    return optuna.artifacts.FileSystemArtifactStore(location)


class CheckpointStore:
    """One study's blobs. `local_path(name)` is where the trainer writes; `put(path)` files it and returns its URI."""

    def __init__(self, location: str | Path, study: str) -> None:
        self.location, self.study = str(location), study
        if is_object_url(self.location):
            scheme, self.bucket, prefix = _split(self.location)
            self.prefix = f"{prefix}/{study}" if prefix else study
            self.scheme, self.artifacts = scheme, artifact_store_for(self.location)
            self.folder = Path(tempfile.mkdtemp(prefix="sweep-outbox-"))  # written here, uploaded, removed
        else:
            # Absolute: the registry keeps each blob's path, which must name the same file from any working folder
            # (`sweep reproduce` run elsewhere, a retry started from another directory).
            self.artifacts = None
            self.folder = Path(self.location).resolve() / study

    @property
    def artifact_location(self) -> str:
        """Where trials' dashboard artifacts go: beside the studies' blobs."""
        if self.artifacts is not None:
            return f"{self.scheme}://{self.bucket}"
        return str((self.folder.parent / "_artifacts").resolve())

    def local_path(self, name: str) -> Path:
        return self.folder / name

    def put(self, path: Path) -> str:
        if self.artifacts is None:
            return str(path)
        key = f"{self.prefix}/{path.name}"
        with open(path, "rb") as handle:
            self.artifacts.write(key, handle)
        path.unlink(missing_ok=True)
        return f"{self.scheme}://{self.bucket}/{key}"


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
    """The checkpoint a registry URI names, wherever it lies, checked against its hash (`weights_only`); raises
    `trainer.checkpoint.CheckpointError` when it is missing, damaged or not what was recorded."""
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
        Path(uri).unlink(missing_ok=True)
        return
    _, _, key = _split(uri)
    with contextlib.suppress(optuna.artifacts.exceptions.ArtifactNotFound):
        artifact_store_for(uri).remove(key)
