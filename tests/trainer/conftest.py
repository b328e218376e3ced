from __future__ import annotations

import pytest

from trainer import Task, load_task


@pytest.fixture(scope="module")
def digits() -> Task:
    """The digits task, loaded once per test module."""
    return load_task("digits")
