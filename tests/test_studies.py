"""Every shipped study file is valid (checked as `sweep run` would, without running it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sweep.spec import load_spec

STUDIES = sorted((Path(__file__).resolve().parent.parent / "studies").rglob("*.yaml"))


def test_there_are_studies() -> None:
    assert {p.name for p in STUDIES} >= {"quickstart.yaml", "charlm.yaml"}


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.name)
def test_study_file_is_valid(path: Path) -> None:
    spec, _ = load_spec(path)
    assert spec.n_trials >= 1 and spec.space
