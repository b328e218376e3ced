"""Storage URLs: what may be printed of them, and where a SQLite one's file is. Light on purpose (no Optuna), so
commands that only print can use it."""

from __future__ import annotations

import re
from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

__all__ = ["mask_url", "sqlite_path"]


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, for anything printed or stored."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return re.sub(r"(//[^:/@]*:)[^@]*@", r"\1***@", url)


def sqlite_path(url: str) -> Path | None:
    """The database file of a `sqlite:///` URL, or None for anything else."""
    if not url.startswith("sqlite:///") or url.endswith(":memory:"):
        return None
    return Path(url.removeprefix("sqlite:///"))
