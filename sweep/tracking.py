"""Every trial's history where researchers already look: TensorBoard and MLflow (`tracking:` in the study file).

Optuna's storage keeps one value per evaluation; a tracker keeps the whole curve of each trial: what the trainer logs
at every log step (train loss, learning rate, gradient norm, throughput, curriculum level, device memory) and every
evaluation's metrics, then the trial's params, outcome and final value.

Fed by `sweep.objective.TrialReporter`'s `log` and `report` calls, which carry host floats the trainer has already
read back at its log and eval steps: a tracker adds no device sync, and the trainer knows nothing of it. With tracking
off the reporter holds no tracker at all. The libraries are optional extras (`sweep[tensorboard]`, `sweep[mlflow]`),
imported only when a study turns them on; `tracking_problems` refuses a study that asks for one not installed.

A tracker never fails a trial: `Guarded` catches whatever a backend raises, warns once for that trial, and drops the
backend for the rest of it (MLflow's own client has already retried a server that does not answer, with backoff).

Layout: TensorBoard runs are `ROOT/<study>/trial-NNNNN/` (ROOT: `tracking.tensorboard.dir`, else `NAME.tensorboard/`
next to the SQLite file), so TensorBoard pointed at ROOT groups them by study, then trial; `sweep tensorboard STUDY`
serves `ROOT/<study>`. The trial's params and final value are in TensorBoard's hparams view.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import math
import os
import posixpath
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote, urlsplit

from sweep.outcomes import ATTR_CONFIG, ATTR_FAIL, ATTR_REPRO, SPEC_ATTR, jsonable
from sweep.schema import TrackingSpec, short_repr
from sweep.urls import SQLITE_URL, mask_url, mask_urls, redact, sqlite_path, sqlite_url

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

    from sweep.schema import StudySpec

__all__ = ["Guarded", "MLflowTracker", "TensorBoardTracker", "Tracker", "end_lost_run", "mlflow_location",
           "open_trackers", "resolve_tracking", "study_tensorboard_folder", "tensorboard_root", "tracking_problems",
           "trial_run_name"]


class Tracker(Protocol):
    """One trial's history in one tracking backend."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """The trainer's metrics at a log step."""

    def report(self, step: int, metrics: Mapping[str, float]) -> None:
        """An evaluation's metrics."""

    def finish(self, outcome: str, value: float | None, attrs: Mapping[str, Any]) -> None:
        """The trial ended: its outcome (`sweep.outcomes.Outcome` value), its value (None unless complete) and the
        attrs stored with it (prune or fail reason, resolved config, reproducibility record, best checkpoint)."""


def trial_run_name(number: int) -> str:
    return f"trial-{number:05d}"


def tensorboard_root(tracking: TrackingSpec, storage_url: str | None) -> Path:
    """Where TensorBoard runs go, a folder per study inside: `tracking.tensorboard.dir`, else next to the SQLite file
    (`NAME.db` -> `NAME.tensorboard/`), else (a server database) `sweep-tensorboard/` in the working folder
    (`resolve_tracking` puts it next to the study file when there is one)."""
    if tracking.tensorboard.dir is not None:
        return Path(tracking.tensorboard.dir).expanduser()
    path = sqlite_path(storage_url) if storage_url is not None else None
    return path.with_suffix(".tensorboard") if path is not None else Path("sweep-tensorboard")



def resolve_tracking(spec: StudySpec, spec_path: Path | None, storage_url: str) -> StudySpec:
    """`spec` with its tracking folders independent of the working folder, as its checkpoint store is
    (`sweep.registry.resolve_store`): a relative `tracking.tensorboard.dir` is relative to the study file, and so is
    the file of a relative SQLite `tracking.mlflow.tracking_uri` (as the study's own SQLite storage is); with
    a server database the defaults (TensorBoard's folder, MLflow's SQLite store) go next to the study file. Workers
    and reruns started in other folders then write to the same runs."""
    if spec_path is None:
        return spec
    from sweep.registry import study_folder

    folder, server = study_folder(spec_path), sqlite_path(storage_url) is None
    tensorboard, mlflow = spec.tracking.tensorboard, spec.tracking.mlflow
    if tensorboard.enabled and tensorboard.dir is None and server:
        tensorboard = tensorboard.model_copy(update={"dir": str(folder / "sweep-tensorboard")})
    elif tensorboard.enabled and tensorboard.dir is not None and not Path(tensorboard.dir).expanduser().is_absolute():
        tensorboard = tensorboard.model_copy(update={"dir": str(folder / tensorboard.dir)})
    if mlflow.enabled and mlflow.tracking_uri is None and server:
        mlflow = mlflow.model_copy(update={"tracking_uri": sqlite_url(folder / 'sweep-mlflow.db')})
    elif mlflow.enabled and mlflow.tracking_uri is not None and \
            (found := SQLITE_URL.fullmatch(mlflow.tracking_uri)) and not found["path"].startswith("/"):
        # A path not from / (a `~` is a folder's name to SQLite, as in the study's own storage URL): the file's.
        file = sqlite_url(folder / unquote(found["path"])).removeprefix("sqlite:///")  # the folder's name as it is
        mlflow = mlflow.model_copy(update={"tracking_uri": f"{found['scheme']}{file}{found['query']}"})
    if tensorboard is spec.tracking.tensorboard and mlflow is spec.tracking.mlflow:
        return spec
    tracking = spec.tracking.model_copy(update={"tensorboard": tensorboard, "mlflow": mlflow})
    return spec.model_copy(update={"tracking": tracking})

def study_tensorboard_folder(study: Any, storage_url: str) -> Path:
    """The folder of a stored study's TensorBoard runs, from the spec kept on the study (`sweep tensorboard`)."""
    tracking = TrackingSpec.model_validate((study.user_attrs.get(SPEC_ATTR) or {}).get("tracking") or {})
    return tensorboard_root(tracking, storage_url) / study.study_name


def tracking_problems(spec: StudySpec) -> list[tuple[str, str]]:
    """A tracking backend the study turns on whose library is not installed, as `(key, message)`."""
    problems = []
    if spec.tracking.tensorboard.enabled and importlib.util.find_spec("tensorboard") is None:
        problems.append(("tracking.tensorboard", "needs the tensorboard package: pip install 'sweep[tensorboard]'"))
    if spec.tracking.mlflow.enabled and importlib.util.find_spec("mlflow") is None:
        problems.append(("tracking.mlflow", "needs the mlflow package: pip install 'sweep[mlflow]'"))
    return problems


def destination_problems(spec: StudySpec, storage_url: str | None = None) -> list[tuple[str, str]]:
    """Where tracking writes, once resolved (`resolve_tracking`), checked before anything is created: TensorBoard's
    folder for the study must be one that can be made (no part of it a file, nor over 255 bytes), and MLflow's SQLite
    store a file SQLite can use (not a folder, nor another kind of file); otherwise every trial would warn that its
    tracking was dropped, or wait on MLflow's retries. Any other MLflow tracking URI is MLflow's to judge (plugins add
    kinds of their own): its store is opened as a trial would open it (`mlflow_uri_problem`), which for a server
    makes a client without calling it, so a server that is down now is still the trials' warning, not a refusal (a
    database store would connect: it is left to the trials too)."""
    from sweep.schema import folder_problem, sqlite_file_problem

    problems = []
    tensorboard = spec.tracking.tensorboard
    if tensorboard.enabled:
        key = "tracking.tensorboard.dir" if tensorboard.dir is not None else "tracking.tensorboard"
        if problem := folder_problem(tensorboard_root(spec.tracking, storage_url) / spec.name, "TensorBoard needs"):
            problems.append((key, problem))
    if spec.tracking.mlflow.enabled:
        uri, _, _ = mlflow_location(spec.tracking, storage_url, spec.name)
        key = "tracking.mlflow.tracking_uri" if spec.tracking.mlflow.tracking_uri is not None else "tracking.mlflow"
        scheme, _, rest = uri.partition(":")
        scheme = scheme.split("+")[0].lower()  # sqlite+pysqlite:///FILE.db is SQLite's too
        file = sqlite_path(uri)  # with or without its driver's name: the same file
        if problem := sqlite_file_problem(uri if file is None else sqlite_url(file), study=False):
            problems.append((key, f"MLflow's store: {problem}"))
        elif scheme == "sqlite" and sqlite_path(f"sqlite:{rest}") is None:
            problems.append((key, "MLflow's SQLite store is sqlite:///FILE.db (three slashes, then the file's path; "
                                  f"four for an absolute path), got {short_repr(mask_url(uri))}"))
        elif (scheme not in _DATABASES and importlib.util.find_spec("mlflow") is not None
              and (problem := mlflow_uri_problem(uri))):  # not installed: `tracking_problems` says so
            problems.append((key, problem))
    return problems


# MLflow's database stores: connected to and migrated when made, so a database that is down now would be refused.
_DATABASES = {"sqlite", "postgresql", "postgres", "mysql", "mssql"}


# Tracking URIs MLflow takes as a store's name, not as a path (as its store registry does).
_NAMED_STORES = {"databricks", "databricks-uc", "uc"}


def mlflow_uri_problem(uri: str) -> str | None:
    """Why MLflow cannot track to `uri` (a scheme no installed store serves, a file store MLflow 3 refuses), found by
    making the store a trial's client would make; None when it can. Nothing is contacted: a server's store is a
    client of it. A file store (a path, `file:`) is made in a temporary folder instead, since making it makes its
    folder: whether MLflow takes file stores at all is what is judged, not that path (a trial finds out about it).
    The message is MLflow's first line, with the URI's secrets masked."""
    from mlflow import MlflowClient

    with tempfile.TemporaryDirectory() as scratch:
        file_store = urlsplit(uri).scheme in ("", "file") and uri not in _NAMED_STORES
        made = Path(scratch, "mlruns").as_uri() if file_store else uri
        try:
            MlflowClient(tracking_uri=made)._tracking_client.store  # noqa: B018, SLF001 - made on first use: made here
        except Exception as exc:  # noqa: BLE001 - whatever MLflow raises for a URI it cannot serve
            lines = str(exc).strip().splitlines()
            said = (lines[0] if lines else type(exc).__name__)[:1000]
            return redact(f"MLflow cannot track there: {said}", uri)
    return None


class TensorBoardTracker:
    """One trial's TensorBoard run, written with PyTorch's `SummaryWriter` (the event files TensorBoard reads).
    Tags: `train/<name>` for what the trainer logs, `eval/<name>` for evaluations, and, at the end, the hparams
    session (params, `state`) with `final/<metric>` (the trial's value, complete trials only) and `eval/<metric>`
    (its last evaluation) as the hparams view's metrics."""

    def __init__(self, folder: Path, params: Mapping[str, Any], metric: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        _quiet_writer_threads()
        self.params, self.metric = dict(params), metric
        # The writer queues events and a thread of its own writes them: nothing here waits on the disk per call.
        self.writer = SummaryWriter(log_dir=str(folder), max_queue=100, flush_secs=10)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            if name != "step":
                self.writer.add_scalar(f"train/{name}", float(value), step)

    def report(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(f"eval/{name}", float(value), step)

    def finish(self, outcome: str, value: float | None, attrs: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        final = f"final/{self.metric}"
        if value is not None and math.isfinite(value):
            self.writer.add_scalar(final, value, int(attrs.get("steps", 0)))
        params = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in self.params.items()}
        # The hparams session goes into this run's own folder (SummaryWriter.add_hparams would open a new run for it).
        experiment, start, end = hparams({**params, "state": outcome},
                                         {final: math.nan, f"eval/{self.metric}": math.nan})
        for summary in (experiment, start, end):
            self.writer.file_writer.add_summary(summary)  # type: ignore[attr-defined]
        self.writer.close()


_WRITER_THREADS_QUIET = False


def _quiet_writer_threads() -> None:
    """TensorBoard's writer thread re-raises a failed write (its folder replaced by a file, a full disk), and Python
    printed it as a traceback; the writer keeps the error and raises it into the trial's next call, where `Guarded`
    makes it the one warning. Its threads' exceptions are not printed again."""
    global _WRITER_THREADS_QUIET
    if _WRITER_THREADS_QUIET:
        return
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    printed = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not isinstance(args.thread, _AsyncWriterThread):
            printed(args)

    threading.excepthook = hook
    _WRITER_THREADS_QUIET = True


# MLflow's loggers that print each failed background batch, with its traceback: thousands of lines when the store
# breaks mid-run. The first failure drops the backend with one warning (`MLflowTracker._metrics`, `Guarded`).
_MLFLOW_FAILURE_LOGGERS = ("mlflow.store.db.utils", "mlflow.utils.async_logging.async_logging_queue")

# MLflow's own client retries a server that does not answer 7 times with a backoff factor of 2 (minutes per call);
# a trial should not wait that long on its tracking. Set these yourself to choose otherwise.
MLFLOW_RETRY_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                         "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
TAG_STUDY, TAG_ROLE, TAG_TRIAL, TAG_OWNER = "sweep.study", "sweep.role", "sweep.trial", "sweep.owner"
# (uri, experiment, study, owner) -> (experiment id, run id)
_STUDY_RUNS: dict[tuple[str, str, str, str | None], tuple[str, str]] = {}


def mlflow_location(tracking: TrackingSpec, storage_url: str | None, study_name: str) -> tuple[str, str, str | None]:
    """`(tracking URI, experiment, artifact location)`: `tracking.mlflow`'s, else a SQLite store next to the study's
    SQLite file (`NAME.db` -> `NAME.mlflow.db`, artifacts in `NAME.mlflow-artifacts/`), else (a server database)
    `sweep-mlflow.db` in the working folder. The experiment defaults to the study's name. None: the server's."""
    experiment = tracking.mlflow.experiment or study_name
    if tracking.mlflow.tracking_uri is not None:
        given = sqlite_path(tracking.mlflow.tracking_uri)  # a SQLite store: its artifacts beside it, not in ./mlruns
        beside = None if given is None else given.with_name(f"{given.stem}-artifacts").resolve().as_uri()
        return tracking.mlflow.tracking_uri, experiment, beside
    path = sqlite_path(storage_url) if storage_url is not None else None
    if path is not None:
        store, artifacts = path.with_suffix(".mlflow.db"), path.with_suffix(".mlflow-artifacts")
    else:
        store, artifacts = Path("sweep-mlflow.db"), Path("sweep-mlflow-artifacts")
    return sqlite_url(store.resolve()), experiment, artifacts.resolve().as_uri()


# Database tracking URIs (`postgresql://`, `mysql+pymysql://`, ...): MLflow's client retries one it cannot reach in a
# loop of its own (`create_sqlalchemy_engine_with_retry`, about 100 s; MLFLOW_HTTP_REQUEST_* bound only HTTP), in
# every trial. One bounded connection first drops the trial's tracking at once instead.
_DATABASE_SCHEMES = ("postgresql", "postgres", "mysql", "mariadb", "mssql", "oracle")
DATABASE_CONNECT_TIMEOUT_S = 10
# Each driver's name for its connect timeout (seconds), as SQLAlchemy passes `connect_args` on.
_TIMEOUT_KEYWORDS = {"psycopg2": "connect_timeout", "psycopg": "connect_timeout", "pymysql": "connect_timeout",
                     "mysqldb": "connect_timeout", "mysqlconnector": "connection_timeout",
                     "mariadbconnector": "connect_timeout", "pg8000": "timeout"}


class TrackingDatabaseUnreachable(ConnectionError):
    """The tracking URI's database did not take a connection."""


def _check_database(uri: str) -> None:
    """Raise TrackingDatabaseUnreachable unless a database tracking URI takes one connection within
    `DATABASE_CONNECT_TIMEOUT_S` (any other URI: nothing to check)."""
    scheme, _, driver = uri.partition(":")[0].lower().partition("+")
    if scheme not in _DATABASE_SCHEMES:
        return
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    driver = driver or {"postgresql": "psycopg2", "postgres": "psycopg2", "mysql": "mysqldb",
                        "mariadb": "mysqldb"}.get(scheme, "")
    keyword = _TIMEOUT_KEYWORDS.get(driver)
    if keyword is None:  # a driver whose connect timeout is not known here (async ones too): MLflow's to try
        return
    try:
        engine = sqlalchemy.create_engine(uri, poolclass=NullPool, connect_args={keyword: DATABASE_CONNECT_TIMEOUT_S})
    except (ImportError, sqlalchemy.exc.ArgumentError):  # the driver is missing or the URL odd: MLflow says so
        return
    try:
        try:
            with engine.connect():
                pass
        finally:
            engine.dispose()
    except Exception as exc:  # whatever the driver raises, in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise TrackingDatabaseUnreachable(f"the tracking database did not take a connection ({first}); MLflow "
                                          "would have retried it for about 100 s") from exc


@contextlib.contextmanager
def _store_turn(uri: str) -> Iterator[None]:
    """Workers of one machine take turns at a SQLite MLflow store's first use and at finding or making the study's
    run, under a lock file beside it: MLflow creates a new store's tables with its own migrations, and several
    workers starting at once ran them together ("duplicate column name: step"), dropping those trials' tracking;
    two of them could also each make a parent run. A server (http, a database) serves its clients itself."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_store(uri: str) -> None:
    """A new SQLite MLflow store is made in a file beside it and renamed into place once MLflow's migrations have
    run: they are not atomic, and a worker killed in them (seconds, on a busy machine) left a half-migrated store
    that every later trial's tracking failed on ("table _alembic_tmp_datasets already exists"). Called under the
    store's lock (`_store_turn`); what a killed build left beside it is removed."""
    from mlflow import MlflowClient

    path = sqlite_path(uri)
    if path is None or path.exists():
        return
    for stale in path.parent.glob(f".{path.name}.*.building*"):  # with SQLite's -journal, -wal, -shm
        stale.unlink(missing_ok=True)
    building = path.with_name(f".{path.name}.{os.getpid()}.building")
    try:
        MlflowClient(tracking_uri=sqlite_url(building))  # makes the store's tables, at its creation
        os.replace(building, path)
    finally:
        for left in (building, *(building.with_name(building.name + s) for s in ("-journal", "-wal", "-shm"))):
            left.unlink(missing_ok=True)


def _study_run(client: Any, uri: str, experiment: str, artifacts: str | None, study: str,
               owner: str | None) -> tuple[str, str]:
    """The experiment and the study's parent run, found (by its tags) or made; cached per process. `owner`: the id
    the study's database keeps (made at its creation): a study of the same name in another database, or one deleted
    and created again, has a parent run of its own, so that its trials' runs do not join the other's."""
    key = (uri, experiment, study, owner)
    if key not in _STUDY_RUNS:
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(
            experiment, artifact_location=artifacts)
        runs = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_STUDY}` = '{study}' and "
                                  f"tags.`{TAG_ROLE}` = 'study'", max_results=1000, order_by=["attributes.start_time"])
        mine = [r for r in runs if owner is None or r.data.tags.get(TAG_OWNER) == owner]
        if not mine and owner is not None:  # a study run made before owner tags: this study's, resumed
            mine = [r for r in runs if TAG_OWNER not in r.data.tags][:1]
            for run in mine:
                client.set_tag(run.info.run_id, TAG_OWNER, owner)
        tags = {TAG_STUDY: study, TAG_ROLE: "study", **({TAG_OWNER: owner} if owner is not None else {})}
        run_id = mine[0].info.run_id if mine else client.create_run(experiment_id, run_name=study,
                                                                    tags=tags).info.run_id
        _STUDY_RUNS[key] = (experiment_id, run_id)
    return _STUDY_RUNS[key]


class MLflowTracker:
    """One trial's MLflow run, nested under the study's run: params, every logged and evaluated metric per step
    (sent in the background: `log_batch(synchronous=False)`), and at the end tags for its state, prune or fail reason
    and best checkpoint, its final value as a metric, and its resolved config and reproducibility record as
    artifacts."""

    def __init__(self, tracking: TrackingSpec, storage_url: str | None, study: str, trial_number: int,
                 params: Mapping[str, Any], config: Mapping[str, Any], metric: str, owner: str | None = None) -> None:
        from mlflow import MlflowClient

        uri, experiment, artifacts = mlflow_location(tracking, storage_url, study)
        if uri.startswith(("http://", "https://")):
            for name, value in MLFLOW_RETRY_DEFAULTS.items():
                os.environ.setdefault(name, value)
        _check_database(uri)
        self.metric, self.config, self.trial_number = metric, dict(config), trial_number
        self.pending: list[Any] = []
        for name in _MLFLOW_FAILURE_LOGGERS:  # what they would print, `Guarded`'s one line says
            logging.getLogger(name).setLevel(logging.CRITICAL)
        with _store_turn(uri):  # a new store's tables are made by the client, at its creation
            _build_store(uri)
            self.client = MlflowClient(tracking_uri=uri)
            experiment_id, self.parent = _study_run(self.client, uri, experiment, artifacts, study, owner)
        parent = self.parent
        self.run_id = self.client.create_run(experiment_id, run_name=trial_run_name(trial_number), tags={
            "mlflow.parentRunId": parent, TAG_STUDY: study, TAG_ROLE: "trial", TAG_TRIAL: str(trial_number)},
        ).info.run_id
        self.renamed: dict[str, str] = {}  # metric and param names MLflow refuses, as they were logged
        self.client.log_batch(self.run_id, params=[_param(self._name(k), v) for k, v in params.items()])

    def _name(self, name: str) -> str:
        """`name` as MLflow takes it: each character it refuses (`@`, `(`, ...) an underscore, one warning a name."""
        if name in self.renamed:
            return self.renamed[name]
        logged = mlflow_name(name)
        if logged != name:
            warnings.warn(f"trial {self.trial_number}: MLflow refuses the name {name!r}; logged as {logged!r}",
                          stacklevel=3)
        self.renamed[name] = logged
        return logged

    def _metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        self._raise_failed()
        now = int(time.time() * 1000)
        batch = [Metric(self._name(name), float(value), now, step) for name, value in metrics.items()
                 if name != "step"]
        self.pending.append(self.client.log_batch(self.run_id, metrics=batch, synchronous=False))

    def _raise_failed(self) -> None:
        """The error of a batch sent in the background that has failed, raised now, at the trial's next call (not at
        its end, after every later batch failed too); the batches done are let go."""
        waiting = []
        for operation in self.pending:
            futures = getattr(operation, "_operation_futures", None)  # MLflow has no public "done" of its own
            if futures is None or not all(future.done() for future in futures):
                waiting.append(operation)
                continue
            for future in futures:
                if (exc := future.exception()) is not None:
                    self.pending = waiting
                    raise exc
        self.pending = waiting

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._metrics(step, metrics)

    def report(self, step: int, metrics: Mapping[str, float]) -> None:
        self._metrics(step, metrics)

    def finish(self, outcome: str, value: float | None, attrs: Mapping[str, Any]) -> None:
        failure: Exception | None = None
        for operation in self.pending:  # the metrics sent in the background: an error there surfaces here
            if operation is not None:
                try:
                    operation.wait()
                except Exception as exc:  # noqa: BLE001 - raised once the run is ended: never left RUNNING
                    failure = failure or exc
        try:
            self._end(outcome, value, attrs)
        finally:
            # The study's run ends with its latest trial (its end time moves on with each one): no worker knows
            # which trial is the study's last, and a run left RUNNING would look alive in MLflow's UI forever.
            self.client.set_terminated(self.parent, "FINISHED")
        if failure is not None:
            raise failure

    def _end(self, outcome: str, value: float | None, attrs: Mapping[str, Any]) -> None:
        """The run's tags, final value and files, then its end (its status from the trial's outcome)."""
        status = {"complete": "FINISHED", "pruned": "FINISHED", "failed": "FAILED"}.get(outcome, "KILLED")
        try:
            self._record(outcome, value, attrs)
        finally:
            self.client.set_terminated(self.run_id, status)

    def _record(self, outcome: str, value: float | None, attrs: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        tags = [RunTag("sweep.state", outcome)]
        for key in ("prune_reason", "fail_reason", "checkpoint"):
            if attrs.get(key) is not None:
                # As the dashboard shows it: NaN as "nan", valid JSON (integrations review: a bare NaN)
                tags.append(RunTag(f"sweep.{key}", json.dumps(jsonable(attrs[key]))[:5000]))
        self.client.log_batch(self.run_id, tags=tags)
        if value is not None and math.isfinite(value):
            self.client.log_metric(self.run_id, self._name(f"final_{self.metric}"), value,
                                   step=int(attrs.get("steps", 0)))
        self.client.log_dict(self.run_id, self.config, "config.json")
        if attrs.get("reproducibility") is not None:
            self.client.log_dict(self.run_id, dict(attrs["reproducibility"]), "reproducibility.json")



def end_lost_run(spec: StudySpec, storage_url: str | None, study_name: str, trial: FrozenTrial) -> None:
    """A trial found lost (its worker died): its MLflow run, which nobody will end, is ended as KILLED with the tags
    `sweep.state: lost` and its `sweep.fail_reason`, and the files every run carries (its config, its
    reproducibility record), as its worker would have ended it; not left RUNNING forever. TensorBoard keeps no state
    to end. Never raises: a warning."""
    if not spec.tracking.mlflow.enabled:
        return
    trial_number, attrs = trial.number, trial.user_attrs
    try:
        from mlflow import MlflowClient

        uri, experiment, _ = mlflow_location(spec.tracking, storage_url, study_name)
        with _store_turn(uri):
            client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return
        runs = client.search_runs([found.experiment_id], filter_string=(
            f"tags.`{TAG_STUDY}` = '{study_name}' and tags.`{TAG_ROLE}` = 'trial' and "
            f"tags.`{TAG_TRIAL}` = '{trial_number}' and attributes.status = 'RUNNING'"))
        for run in runs:
            client.set_tag(run.info.run_id, "sweep.state", "lost")
            if attrs.get(ATTR_FAIL) is not None:
                client.set_tag(run.info.run_id, "sweep.fail_reason", json.dumps(attrs[ATTR_FAIL], default=str)[:5000])
            if isinstance(attrs.get(ATTR_CONFIG), Mapping):
                client.log_dict(run.info.run_id, dict(attrs[ATTR_CONFIG]), "config.json")
            if isinstance(attrs.get(ATTR_REPRO), Mapping):
                client.log_dict(run.info.run_id, dict(attrs[ATTR_REPRO]), "reproducibility.json")
            client.set_terminated(run.info.run_id, "KILLED")
    except Exception as exc:  # noqa: BLE001 - tracking never takes a worker down
        first = mask_urls(str(exc).splitlines()[0]) if str(exc) else ""
        warnings.warn(f"trial {trial_number}: its MLflow run could not be ended as lost ({type(exc).__name__}: "
                      f"{first})", stacklevel=2)

def mlflow_name(name: str) -> str:
    """A metric or param name as MLflow takes it: alphanumerics, `_ - . : /` and spaces (MLflow's own rule), the
    rest an underscore each, and no path that normalises to another (`a//b`, `./a`, `/a`)."""
    cleaned = re.sub(r"[^/\w.\- :]", "_", name)
    if posixpath.normpath(cleaned) != cleaned or cleaned.startswith(("/", ".")) or cleaned in ("", "."):
        cleaned = "_" + re.sub(r"/+", "/", cleaned.lstrip("/.")).rstrip("/")
    if len(cleaned) > MLFLOW_NAME_LIMIT:  # MLflow refuses longer names: cut, with a digest of the whole name
        cleaned = f"{cleaned[:MLFLOW_NAME_LIMIT - 9].rstrip('/')}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    return cleaned


MLFLOW_NAME_LIMIT = 250  # MLflow's longest metric and param name


def _param(name: str, value: Any) -> Any:
    from mlflow.entities import Param

    return Param(name, str(value))


def _error_line(exc: BaseException) -> str:
    """`exc` as one line, with what raised it first where that is another error (a store's `MlflowException` over
    "attempt to write a readonly database"); a tracking URI it quotes may hold a password."""
    line = f"{type(exc).__name__}: {_first_line(exc)}"
    root, seen = exc, {id(exc)}
    while (below := root.__cause__ or (None if root.__suppress_context__ else root.__context__)) is not None \
            and id(below) not in seen:
        root = below
        seen.add(id(root))
    if root is not exc and str(root).strip():
        line += f"; caused by {type(root).__name__}: {_first_line(root)}"
    return mask_urls(line)


def _first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of `exc`'s message, cut to `limit` characters (urllib3's "Max retries exceeded" holds the whole
    request and the repr of its connection: a 450-character warning per trial, review); its cause says why."""
    said = str(exc).strip()
    first = mask_urls(said.splitlines()[0]) if said else ""  # before the cut: a URL cut short is not seen as one
    return first if len(first) <= limit else f"{first[:limit].rstrip()}..."


class Guarded:
    """A tracker that never fails the trial: the first error a backend raises is one warning, and the backend is
    dropped for the rest of the trial."""

    def __init__(self, name: str, trial_number: int, open_tracker: Any) -> None:
        self.name, self.number = name, trial_number
        self.dropped: Tracker | None = None  # dropped mid-trial: still ended at the trial's end, silently
        self.unreachable = False  # dropped because its server or store could not be reached: not ended
        self.inner: Tracker | None = None
        self.inner = self._call("start", open_tracker)

    def _call(self, what: str, function: Any, *args: Any) -> Any:
        try:
            return function(*args)
        except Exception as exc:  # noqa: BLE001 - a tracking backend never takes a trial down
            warnings.warn(f"trial {self.number}: {self.name} tracking dropped for this trial ({what} failed: "
                          f"{_error_line(exc)})", stacklevel=3)
            self.dropped, self.inner = self.inner, None
            self.unreachable = _unreachable(exc)
            return None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.inner is not None:
            self._call("log", self.inner.log, step, metrics)

    def report(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.inner is not None:
            self._call("report", self.inner.report, step, metrics)

    def finish(self, outcome: str, value: float | None, attrs: Mapping[str, Any]) -> None:
        if self.inner is not None:
            self._call("finish", self.inner.finish, outcome, value, attrs)
            self.inner = None
        elif self.dropped is not None:
            # Ended all the same, where its store still takes it (integrations review: an MLflow run dropped for one
            # metric name it refused stayed RUNNING forever, with no `sweep.state`); its warning was said already.
            # Not where it was dropped for a server that did not answer: each of the end's calls, and the wait for
            # every batch still queued, would wait out the timeout and the retries again (review: a server that
            # hung mid-trial held the trial's end two minutes after its warning).
            dropped, self.dropped = self.dropped, None
            if not self.unreachable:
                with contextlib.suppress(Exception):
                    dropped.finish(outcome, value, attrs)


def _unreachable(exc: BaseException) -> bool:
    """Whether `exc` comes from a connection that failed or timed out (an `OSError` in its chain: requests' errors
    are, and MLflow raises its own over them), not from an answer."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def open_trackers(spec: StudySpec, storage_url: str | None, study_name: str, trial_number: int,
                  params: Mapping[str, Any], config: Mapping[str, Any] | None = None,
                  owner: str | None = None) -> list[Guarded]:
    """The trial's trackers, one per backend the study turns on; none (an empty list) when tracking is off.
    `config`: the trial's resolved TrainingConfig (an MLflow artifact); `owner`: the study's id (`_study_run`)."""
    trackers = []
    if spec.tracking.tensorboard.enabled:
        folder = tensorboard_root(spec.tracking, storage_url) / study_name / trial_run_name(trial_number)
        trackers.append(Guarded("tensorboard", trial_number,
                                lambda: TensorBoardTracker(folder, params, spec.metric)))
    if spec.tracking.mlflow.enabled:
        trackers.append(Guarded("mlflow", trial_number, lambda: MLflowTracker(
            spec.tracking, storage_url, study_name, trial_number, params, config or {}, spec.metric, owner)))
    return trackers
