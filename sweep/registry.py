"""The checkpoint registry: one row per checkpoint, in a table of the study's own database (SQLite or PostgreSQL).

The trainer writes the blobs (format, atomicity, hash); the registry records which study, trial and step each one is,
its metric, the trial's params, where the blob lives, its size and hash. Blobs live in a folder: next to the SQLite
file by default, or a shared path every worker can read when workers run on several machines.

The table is created on first use; several workers creating it at once is safe (the loser of the race finds it).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (Column, Float, Index, Integer, MetaData, String, Table, Text, create_engine, delete, insert,
                        select)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from sweep.storage import sqlite_path

__all__ = ["CheckpointRecord", "Registry", "default_store"]

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
    Index("ix_sweep_checkpoints_trial", "study", "trial_number", "step"),
    Index("ix_sweep_checkpoints_donors", "study", "shape_key", "value"),
)


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

    @classmethod
    def from_row(cls, row: Any) -> CheckpointRecord:
        values = dict(row._mapping)
        values["params"] = json.loads(values["params"])
        return cls(**values)


def default_store(storage_url: str, study: str) -> Path:
    """Next to the SQLite file (`NAME.db` -> `NAME.checkpoints/STUDY`); for a server database, the working folder."""
    path = sqlite_path(storage_url)
    base = path.with_suffix(".checkpoints") if path is not None else Path("sweep-checkpoints")
    return base / study


class Registry:
    def __init__(self, storage_url: str, engine: Engine | None = None) -> None:
        self.engine = engine if engine is not None else create_engine(
            storage_url, **({"connect_args": {"timeout": 60}} if storage_url.startswith("sqlite") else
                            {"pool_pre_ping": True}))
        for attempt in range(5):
            try:
                metadata.create_all(self.engine, checkfirst=True)
                break
            except DBAPIError as exc:  # another worker created it between our check and our CREATE
                if attempt == 4 or "already exists" not in str(exc).lower():
                    raise
                time.sleep(0.1 * (attempt + 1))

    def register(self, *, study: str, trial_number: int, step: int, value: float | None, params: dict[str, Any],
                 shape_key: str, uri: str, size: int, sha256: str) -> int:
        with self.engine.begin() as connection:
            result = connection.execute(insert(checkpoints).values(
                study=study, trial_number=trial_number, step=step, value=value,
                params=json.dumps(params, sort_keys=True, default=str), shape_key=shape_key, uri=uri, size=size,
                sha256=sha256, created_at=time.time()))
            return int(result.inserted_primary_key[0])

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

    def forget(self, ids: list[int]) -> None:
        if ids:
            with self.engine.begin() as connection:
                connection.execute(delete(checkpoints).where(checkpoints.c.id.in_(ids)))
