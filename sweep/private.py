"""Who may read what sweep writes. A study's files hold results that may be private (the database, checkpoints,
reports, lock files), so the `sweep` command creates them owner-only.

The rule: `sweep` runs with the user's umask plus every group and other bit (`umask | 0o077`: files 0600, folders
0700), unless `SWEEP_UMASK` gives the umask to use instead, in octal (`SWEEP_UMASK=027` lets the group read, `022`
lets everyone). A login's default umask (022) is not taken as a wish to share: sharing is asked for by name. Files
that exist already keep their modes.
"""

from __future__ import annotations

import os
import sys

__all__ = ["UMASK_ENV", "private_umask"]

UMASK_ENV = "SWEEP_UMASK"


def private_umask() -> int:
    """Set this process's umask by the rule above (its children inherit it: `--workers`, the trainer) and return the
    one it had. A `SWEEP_UMASK` that is not an octal number from 0 to 777, or that takes the owner's own rights, is
    ignored with a warning."""
    chosen = os.environ.get(UMASK_ENV)
    previous = os.umask(0o077)
    umask = previous | 0o077
    if chosen is not None:
        try:
            value = int(chosen, 8)
        except ValueError:
            value = -1
        if 0 <= value <= 0o777 and not value & 0o700:
            umask = value
        elif 0 <= value <= 0o777:  # 777, 700, 200: the study's own database made unreadable to its owner
            print(f"warning: {UMASK_ENV}={chosen!r} takes from the owner their own rights to the files sweep "
                  "creates (expected a umask whose first digit is 0, such as 077 or 027); files are created "
                  "owner-only", file=sys.stderr)
        else:
            print(f"warning: {UMASK_ENV}={chosen!r} is not an octal umask (such as 077 or 022); files are created "
                  "owner-only", file=sys.stderr)
    os.umask(umask)
    return previous
