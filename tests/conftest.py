from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.pg import postgres_available, postgres_server

ROOT = Path(__file__).resolve().parent.parent

TINY_STUDY: dict[str, Any] = {
    "name": "tiny",
    "n_trials": 3,
    "seed": 0,
    "sampler": {"type": "random"},
    "pruner": "none",
    "task": "digits",
    "fixed": {"max_steps": 20, "eval_every_steps": 10, "log_every_steps": 10, "batch_size": 32},
    "space": {
        "learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True},
        "model.hidden": {"type": "int", "low": 8, "high": 32},
    },
}


def write_study(folder: Path, document: dict[str, Any] | str, name: str = "study.yaml") -> Path:
    path = folder / name
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document, sort_keys=False))
    return path


def run_cli(*args: str | Path, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The real `sweep` command in a fresh interpreter."""
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "sweep.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env)


@pytest.fixture
def tiny_study(tmp_path: Path) -> Path:
    return write_study(tmp_path, TINY_STUDY)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A real PostgreSQL server for the whole session (unix socket only), one database."""
    if not postgres_available():
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    with postgres_server() as url:
        yield url
