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

import importlib.util
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sweep.outcomes import SPEC_ATTR
from sweep.schema import TrackingSpec
from sweep.storage import sqlite_path

if TYPE_CHECKING:
    from sweep.schema import StudySpec

__all__ = ["Guarded", "TensorBoardTracker", "Tracker", "open_trackers", "study_tensorboard_folder", "tensorboard_root",
           "tracking_problems", "trial_run_name"]


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
    (`NAME.db` -> `NAME.tensorboard/`), else (a server database) `sweep-tensorboard/` in the working folder."""
    if tracking.tensorboard.dir is not None:
        return Path(tracking.tensorboard.dir).expanduser()
    path = sqlite_path(storage_url) if storage_url is not None else None
    return path.with_suffix(".tensorboard") if path is not None else Path("sweep-tensorboard")


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


class TensorBoardTracker:
    """One trial's TensorBoard run, written with PyTorch's `SummaryWriter` (the event files TensorBoard reads).
    Tags: `train/<name>` for what the trainer logs, `eval/<name>` for evaluations, and, at the end, the hparams
    session (params, `state`) with `final/<metric>` (the trial's value, complete trials only) and `eval/<metric>`
    (its last evaluation) as the hparams view's metrics."""

    def __init__(self, folder: Path, params: Mapping[str, Any], metric: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

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


class Guarded:
    """A tracker that never fails the trial: the first error a backend raises is one warning, and the backend is
    dropped for the rest of the trial."""

    def __init__(self, name: str, trial_number: int, open_tracker: Any) -> None:
        self.name, self.number = name, trial_number
        self.inner: Tracker | None = self._call("start", open_tracker)

    def _call(self, what: str, function: Any, *args: Any) -> Any:
        try:
            return function(*args)
        except Exception as exc:  # noqa: BLE001 - a tracking backend never takes a trial down
            first = str(exc).splitlines()[0] if str(exc) else ""
            warnings.warn(f"trial {self.number}: {self.name} tracking dropped for this trial ({what} failed: "
                          f"{type(exc).__name__}: {first})", stacklevel=3)
            self.inner = None
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


def open_trackers(spec: StudySpec, storage_url: str | None, study_name: str, trial_number: int,
                  params: Mapping[str, Any]) -> list[Guarded]:
    """The trial's trackers, one per backend the study turns on; none (an empty list) when tracking is off."""
    trackers = []
    if spec.tracking.tensorboard.enabled:
        folder = tensorboard_root(spec.tracking, storage_url) / study_name / trial_run_name(trial_number)
        trackers.append(Guarded("tensorboard", trial_number,
                                lambda: TensorBoardTracker(folder, params, spec.metric)))
    return trackers
