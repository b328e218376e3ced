"""The checkpoint registry: one row per checkpoint, in a table of the study's own database (SQLite or PostgreSQL).

The trainer writes the blobs (format, atomicity, hash); the registry records which study, trial and step each one is,
its metric, the trial's params, where the blob lives, its size and hash. Blobs live in a folder: next to the SQLite
file by default, or a shared path every worker can read when workers run on several machines.

The table is created on first use; several workers creating it at once is safe (the loser of the race finds it).

Warm start looks donors up here in one indexed query: same study, same shape key, finished, and inside a box around
the new trial's point in the normalised search space (the first `COORDS` numeric coordinates are columns, `c0` in
the index); the exact distance is then computed over the few rows that come back. A checkpoint some trial started
from is `pinned`: garbage collection never deletes it, so a warm-started trial can always be reproduced.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    and_,
    delete,
    func,
    insert,
    inspect,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from sweep.storage import SQLITE_LOCK_WAIT_S, open_engine, sqlite_path

if TYPE_CHECKING:
    from sweep.schema import StudySpec

__all__ = ["COORDS", "CheckpointRecord", "Registry", "default_store", "resolve_store", "study_folder"]

COORDS = 4  # normalised coordinates kept as indexed columns for the donor lookup's box

metadata = MetaData()
checkpoints = Table(
    "sweep_checkpoints", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("study", String(512), nullable=False),
    Column("trial_number", Integer, nullable=False),
    Column("step", Integer, nullable=False),
    Column("value", Float, nullable=True),
    Column("params", Text, nullable=False),
    Column("shape_key", String(64), nullable=False),
    Column("uri", Text, nullable=False),
    Column("size", Integer, nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("created_at", Float, nullable=False),
    # 0 while its trial runs; 1 once it completed or was pruned (a warm-start donor); 2 once it failed (diverged,
    # raised, or was lost and its retry took over): counted by retention, never a donor.
    Column("final", Integer, nullable=False, default=0),
    Column("pinned", Integer, nullable=False, default=0),  # 1 once a trial started from it: never collected
    Column("cat_key", String(32), nullable=False, default=""),  # digest of the trial's categorical values
    *(Column(f"c{i}", Float, nullable=True) for i in range(COORDS)),
    Index("ix_sweep_checkpoints_trial", "study", "trial_number", "step"),
    # Covering the whole donor filter, so the lookup reads the index alone and only its page of rows from the table.
    Index("ix_sweep_checkpoints_donors", "study", "shape_key", "final", "cat_key", *(f"c{i}" for i in range(COORDS)),
          "step", "value"),
)


_LOOKUP_ONLY = {"cat_key"}


@dataclass(frozen=True)
class CheckpointRecord:
    id: int
    study: str
    trial_number: int
    step: int
    value: float | None
    params: dict[str, Any]
    shape_key: str
    uri: str
    size: int
    sha256: str
    created_at: float
    final: int = 0
    pinned: int = 0

    @classmethod
    def from_row(cls, row: Any) -> CheckpointRecord:
        mapping = row._mapping  # noqa: SLF001 - SQLAlchemy's documented way to read a Row by column name
        values = {k: v for k, v in mapping.items() if k not in _LOOKUP_ONLY and not (k[0] == "c" and k[1:].isdigit())}
        values["params"] = json.loads(values["params"])
        return cls(**values)


def _row(*, study: str, trial_number: int, step: int, value: float | None, params: Mapping[str, Any], shape_key: str,
         uri: str, size: int, sha256: str, coords: Sequence[float | None] = (), cat_key: str = "") -> dict[str, Any]:
    """A checkpoint's row as `register` inserts it (a non-finite value is NULL)."""
    if value is not None and not math.isfinite(value):
        value = None
    columns = {f"c{i}": (coords[i] if i < len(coords) else None) for i in range(COORDS)}
    return dict(study=study, trial_number=trial_number, step=step, value=value,
                params=json.dumps(params, sort_keys=True, default=str), shape_key=shape_key, uri=uri, size=size,
                sha256=sha256, created_at=time.time(), final=0, pinned=0, cat_key=cat_key, **columns)


def default_store(storage_url: str) -> Path:
    """Next to the SQLite file (`NAME.db` -> `NAME.checkpoints/`, a folder per study inside); for a server
    database, `sweep-checkpoints/` in the working folder (`resolve_store` puts it next to the study file when there
    is one)."""
    path = sqlite_path(storage_url)
    return path.with_suffix(".checkpoints") if path is not None else Path("sweep-checkpoints")


def resolve_store(spec: StudySpec, spec_path: Path | None, storage_url: str) -> StudySpec:
    """`spec` with its checkpoint store a folder that does not depend on the working folder: a relative
    `checkpoints.store` is relative to the study file (as a SQLite storage path is), and a server database's default
    is `sweep-checkpoints/` next to the study file. A rerun or a worker started in another folder then finds the
    same checkpoints (it found none, and the quick check deleted the rows of the resume points it could not see).
    The study stores this folder, so commands given only a database find it too."""
    store = spec.checkpoints.store
    if spec_path is None or (store is not None and "://" in store):
        return spec
    if store is None:
        if sqlite_path(storage_url) is not None:
            return spec  # next to the SQLite file, wherever it is
        folder = study_folder(spec_path) / "sweep-checkpoints"
    else:
        given = Path(store).expanduser()  # `~/ckpts`: the home folder's, wherever it is named (not `./~/ckpts`)
        folder = given if given.is_absolute() else study_folder(spec_path) / given
        if str(folder) == store:
            return spec
    return spec.model_copy(update={"checkpoints": spec.checkpoints.model_copy(update={"store": str(folder)})})


def study_folder(spec_path: Path) -> Path:
    """The folder relative paths of a study are taken from: the study file's, unless it cannot be written (a
    Kubernetes pod mounts its study file read-only from a ConfigMap), then the working folder, as before."""
    folder = spec_path.resolve().parent
    return folder if os.access(folder, os.W_OK | os.X_OK) else Path.cwd()


class Registry:
    def __init__(self, storage_url: str, engine: Engine | None = None, *, create: bool = True,
                 lock_wait_s: float = SQLITE_LOCK_WAIT_S) -> None:
        """`create` False: for a command that only reads (`sweep check` without `--repair`): a database without the
        table (its rows are then none) or with an older one is left as it is. `lock_wait_s`: a worker's
        (`storage.lock_wait`)."""
        self.engine = engine if engine is not None else open_engine(storage_url, lock_wait_s=lock_wait_s)
        self.absent = False
        self.have: set[str] | None = None  # the table's columns, where an older sweep's may lack some (create False)
        if not create:
            self.absent = not inspect(self.engine).has_table(checkpoints.name)
            if not self.absent:
                self.have = {column["name"] for column in inspect(self.engine).get_columns(checkpoints.name)}
            return
        for attempt in range(5):
            try:
                metadata.create_all(self.engine, checkfirst=True)
                break
            except DBAPIError as exc:  # another worker created it between our check and our CREATE
                if attempt == 4 or "already exists" not in str(exc).lower():
                    raise
                time.sleep(0.1 * (attempt + 1))
        self._upgrade()

    def _upgrade(self) -> None:
        """A table written by an earlier version of sweep lacks the warm-start columns: add them (its rows become
        checkpoints that are not donors: not final, no coordinates) and rebuild the donor index over them. Safe when
        several workers upgrade at once: the loser finds the columns there."""
        have = {column["name"] for column in inspect(self.engine).get_columns(checkpoints.name)}
        missing = [column for column in checkpoints.columns if column.name not in have]
        if not missing:
            return
        defaults = {"final": " NOT NULL DEFAULT 0", "pinned": " NOT NULL DEFAULT 0", "cat_key": " NOT NULL DEFAULT ''"}
        try:
            with self.engine.begin() as connection:
                for column in missing:
                    kind = column.type.compile(dialect=self.engine.dialect)
                    connection.exec_driver_sql(f"ALTER TABLE {checkpoints.name} ADD COLUMN {column.name} {kind}"
                                               f"{defaults.get(column.name, '')}")
                donors = next(index for index in checkpoints.indexes if index.name == "ix_sweep_checkpoints_donors")
                connection.exec_driver_sql(f"DROP INDEX IF EXISTS {donors.name}")
                donors.create(connection)
        except DBAPIError:
            have = {column["name"] for column in inspect(self.engine).get_columns(checkpoints.name)}
            if any(column.name not in have for column in checkpoints.columns):
                raise

    def register(self, *, study: str, trial_number: int, step: int, value: float | None, params: dict[str, Any],
                 shape_key: str, uri: str, size: int, sha256: str, coords: Sequence[float | None] = (),
                 cat_key: str = "") -> int:
        """A non-finite value (a diverging trial's) is stored as NULL, as SQLite would store NaN anyway: such a
        checkpoint is never a donor and never ranks a trial (PostgreSQL would sort NaN above every number)."""
        with self.engine.begin() as connection:
            result = connection.execute(insert(checkpoints).values(_row(
                study=study, trial_number=trial_number, step=step, value=value, params=params, shape_key=shape_key,
                uri=uri, size=size, sha256=sha256, coords=coords, cat_key=cat_key)))
            key = result.inserted_primary_key
            assert key is not None  # an INSERT of one row always has it
            return int(key[0])

    def register_and_trim(self, records: Sequence[Mapping[str, Any]],
                          doomed: Callable[[list[CheckpointRecord]], Collection[int]],
                          ) -> tuple[list[CheckpointRecord], list[int]]:
        """Register one trial's `records` (`register`'s keywords) and trim that trial's checkpoints, in one
        transaction, where a checkpoint's registration, the read of its trial's rows and their trimming were three:
        `doomed` is given every row of the trial, the new ones among them, and names those to delete (pinned ones
        stay). Returns the trial's rows as `doomed` saw them, and the ids deleted."""
        return self.register_and_trim_many([(records, doomed)])[0]

    def register_and_trim_many(self, batches: Sequence[tuple[Sequence[Mapping[str, Any]],
                                                            Callable[[list[CheckpointRecord]], Collection[int]]]],
                               ) -> list[tuple[list[CheckpointRecord], list[int]]]:
        """`register_and_trim` for several trials (a cohort's members at one evaluation), in one transaction: one
        insert, one read of their rows, one delete. Each batch holds one trial's records."""
        trials: list[tuple[str, int] | None] = []
        for records, _ in batches:
            keys = {(r["study"], int(r["trial_number"])) for r in records}
            if len(keys) > 1:
                raise ValueError(f"register_and_trim takes one trial's checkpoints per batch, not {sorted(keys)}")
            trials.append(next(iter(keys), None))
        wanted = {key for key in trials if key is not None}
        if len(wanted) < sum(key is not None for key in trials):
            raise ValueError("register_and_trim_many takes each trial's checkpoints in one batch")
        if not wanted:
            return [([], []) for _ in batches]
        rows: dict[tuple[str, int], list[CheckpointRecord]] = {key: [] for key in wanted}
        with self.engine.begin() as connection:
            connection.execute(insert(checkpoints), [_row(**record) for records, _ in batches for record in records])
            for study in {study for study, _ in wanted}:
                numbers = sorted(n for s, n in wanted if s == study)
                for row in connection.execute(select(checkpoints).where(
                        checkpoints.c.study == study, checkpoints.c.trial_number.in_(numbers))
                        .order_by(checkpoints.c.id)):
                    record = CheckpointRecord.from_row(row)
                    rows[record.study, record.trial_number].append(record)
            doomed_ids = sorted({i for key, (_, doomed) in zip(trials, batches) if key is not None
                                 for i in doomed(rows[key])})
            gone = set(connection.execute(delete(checkpoints).where(checkpoints.c.id.in_(doomed_ids),
                                                                    checkpoints.c.pinned == 0)
                                          .returning(checkpoints.c.id)).scalars()) if doomed_ids else set()
        return [([], []) if key is None else (rows[key], sorted(r.id for r in rows[key] if r.id in gone))
                for key in trials]

    def finish_trial(self, study: str, trial_number: int, *, donor: bool = True) -> None:
        """The trial ended: its checkpoints count for the study's retention from now on, and when it completed or was
        pruned (`donor`) they may be warm-start donors. A failed trial's are not: they may lead to its failure."""
        with self.engine.begin() as connection:
            connection.execute(update(checkpoints).where(checkpoints.c.study == study,
                                                         checkpoints.c.trial_number == trial_number)
                               .values(final=1 if donor else 2))

    def donor_candidates(self, studies: Sequence[str], shape_key: str, *, before_step: int,
                         near: Sequence[float | None] = (), radius: float | None = None, cat_key: str | None = None,
                         limit: int | None = None, offset: int = 0) -> list[CheckpointRecord]:
        """Finished trials' scored checkpoints with this shape key, earlier than `before_step`: one indexed query.

        With `near` (coordinate columns `c{i}`; None entries unconstrained) and `radius`, only rows whose distance
        over those columns is within `radius` come back, nearest first, the later step first among equals: that
        partial distance never exceeds the full one, so a caller that finds a full distance below the last row's
        partial one has found the nearest. `cat_key`: only rows with these categorical values. The columns mean
        the same only within one study's search space."""
        conditions = [checkpoints.c.study.in_(list(studies)), checkpoints.c.shape_key == shape_key,
                      checkpoints.c.final == 1, checkpoints.c.value.is_not(None), checkpoints.c.step < before_step]
        if cat_key is not None:
            conditions.append(checkpoints.c.cat_key == cat_key)
        axes = [(checkpoints.c[f"c{i}"], q) for i, q in enumerate(near[:COORDS]) if q is not None]
        if axes and radius is not None:
            conditions += [column.between(q - radius, q + radius) for column, q in axes]  # the index's box
            partial = sum(((column - q) * (column - q) for column, q in axes), literal(0.0))
            conditions.append(partial <= radius * radius)
            # Rank inside the index, then read only the page's rows.
            page = (select(checkpoints.c.id).where(and_(*conditions))
                    .order_by(partial, checkpoints.c.step.desc(), checkpoints.c.id))
            if limit is not None:
                page = page.limit(limit).offset(offset)
            query = (select(checkpoints).where(checkpoints.c.id.in_(page.scalar_subquery()))
                     .order_by(partial, checkpoints.c.step.desc(), checkpoints.c.id))
        else:
            query = select(checkpoints).where(and_(*conditions))
            if limit is not None:
                query = query.order_by(checkpoints.c.id).limit(limit).offset(offset)
        with self.engine.connect() as connection:
            return [CheckpointRecord.from_row(row) for row in connection.execute(query)]

    def pin(self, checkpoint_id: int) -> bool:
        """Protect a checkpoint from garbage collection because a trial starts from it. False: it was collected
        in the meantime (look again)."""
        with self.engine.begin() as connection:
            result = connection.execute(update(checkpoints).where(checkpoints.c.id == checkpoint_id).values(pinned=1))
            return result.rowcount == 1

    def forget_broken(self, checkpoint_id: int) -> None:
        """A checkpoint whose blob is missing or corrupt: remove its row, pinned or not, so nobody tries it again."""
        with self.engine.begin() as connection:
            connection.execute(delete(checkpoints).where(checkpoints.c.id == checkpoint_id))

    def value_range_per_trial(self, study: str) -> dict[int, tuple[float | None, float | None, bool]]:
        """Each ended trial's lowest and highest checkpointed value, and whether it failed; the values are None for
        a trial whose checkpoints have none (written between evaluations, or NaN)."""
        query = (select(checkpoints.c.trial_number, func.min(checkpoints.c.value), func.max(checkpoints.c.value),
                        func.max(checkpoints.c.final))
                 .where(checkpoints.c.study == study, checkpoints.c.final != 0)
                 .group_by(checkpoints.c.trial_number))
        with self.engine.connect() as connection:
            return {int(n): (None if low is None else float(low), None if high is None else float(high), final == 2)
                    for n, low, high, final in connection.execute(query)}

    def forget_unpinned(self, study: str, trial_numbers: Sequence[int]) -> tuple[list[int], list[str]]:
        """Delete these finished trials' unpinned checkpoint rows. Returns the trials that lost rows, and the blob
        URIs no row points to any more (the caller deletes the files: rows first, so nobody is sent to a deleted
        file)."""
        if not trial_numbers:
            return [], []
        where = and_(checkpoints.c.study == study, checkpoints.c.trial_number.in_(list(trial_numbers)),
                     checkpoints.c.final != 0, checkpoints.c.pinned == 0)
        with self.engine.begin() as connection:
            doomed = connection.execute(delete(checkpoints).where(where)
                                        .returning(checkpoints.c.trial_number, checkpoints.c.uri)).all()
            if not doomed:
                return [], []
            uris = list(dict.fromkeys(uri for _, uri in doomed))
            still = set(connection.execute(select(checkpoints.c.uri).where(  # a URI is relative to its study's folder
                checkpoints.c.study == study, checkpoints.c.uri.in_(uris))).scalars())
        return sorted({int(n) for n, _ in doomed}), [uri for uri in uris if uri not in still]

    def latest_for_trial(self, study: str, trial_number: int) -> CheckpointRecord | None:
        """The trial's most advanced checkpoint, or None if it wrote none."""
        query = (select(checkpoints).where(checkpoints.c.study == study, checkpoints.c.trial_number == trial_number)
                 .order_by(checkpoints.c.step.desc(), checkpoints.c.id.desc()).limit(1))
        with self.engine.connect() as connection:
            row = connection.execute(query).first()
        return None if row is None else CheckpointRecord.from_row(row)

    def for_trial(self, study: str, trial_number: int) -> list[CheckpointRecord]:
        query = select(checkpoints).where(checkpoints.c.study == study, checkpoints.c.trial_number == trial_number)
        with self.engine.connect() as connection:
            return [CheckpointRecord.from_row(row) for row in connection.execute(query)]

    def forget(self, ids: list[int]) -> list[int]:
        """Delete these rows unless pinned; returns the ids actually deleted."""
        if not ids:
            return []
        with self.engine.begin() as connection:
            return list(connection.execute(delete(checkpoints).where(checkpoints.c.id.in_(ids),
                                                                     checkpoints.c.pinned == 0)
                                           .returning(checkpoints.c.id)).scalars())

    def earliest_donor_step(self, study: str) -> int | None:
        """The earliest step among the study's checkpoints that `donor_candidates` can return (a finished trial's,
        scored), or None when it has none."""
        query = select(func.min(checkpoints.c.step)).where(
            checkpoints.c.study == study, checkpoints.c.final == 1, checkpoints.c.value.is_not(None))
        with self.engine.connect() as connection:
            step = connection.execute(query).scalar()
        return None if step is None else int(step)

    def for_study(self, study: str) -> list[CheckpointRecord]:
        """Every checkpoint row of the study, pinned or not, in trial, step and id order (`sweep check`)."""
        if self.absent:
            return []
        # An older sweep's table, read as it is (review: "no such column: sweep_checkpoints.final"): the columns it
        # lacks read as their defaults (not final, not pinned).
        columns = [column for column in checkpoints.columns if self.have is None or column.name in self.have]
        query = (select(*columns).where(checkpoints.c.study == study)
                 .order_by(checkpoints.c.trial_number, checkpoints.c.step, checkpoints.c.id))
        with self.engine.connect() as connection:
            return [CheckpointRecord.from_row(row) for row in connection.execute(query)]

    def in_use(self, study: str) -> list[CheckpointRecord]:
        """The rows a worker may be sent to, in one query: warm-start donors (`final=1`), pinned rows, and every row
        of the trials that have not ended (`final=0`: the latest is the trial's resume point, and an earlier one
        becomes it when the later ones go). Not failed trials' unpinned rows. In trial, step and id order."""
        query = (select(checkpoints)
                 .where(checkpoints.c.study == study,
                        or_(checkpoints.c.final == 1, checkpoints.c.final == 0, checkpoints.c.pinned == 1))
                 .order_by(checkpoints.c.trial_number, checkpoints.c.step, checkpoints.c.id))
        with self.engine.connect() as connection:
            return [CheckpointRecord.from_row(row) for row in connection.execute(query)]

    def forget_all_broken(self, ids: Sequence[int]) -> list[int]:
        """Checkpoints whose blobs are missing or corrupt: remove their rows, pinned or not, so nobody is sent to
        them again. Returns the ids this call removed (a row another worker removed meanwhile is not among them)."""
        if not ids:
            return []
        with self.engine.begin() as connection:
            return sorted(connection.execute(delete(checkpoints).where(checkpoints.c.id.in_(list(ids)))
                                             .returning(checkpoints.c.id)).scalars())
