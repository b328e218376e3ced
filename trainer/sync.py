"""Host-device synchronisation, marked where the loop means it.

The loop reads values back from the device only at log and eval steps (and when saving a checkpoint). Each of those
read-backs runs inside `allowed_sync()`, so a check can hold the steps in between to none: under
`torch.cuda.set_sync_debug_mode("error")`, any other synchronising call raises. Without such a mode (the normal case),
and wherever CUDA is not in use, `allowed_sync()` does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["allowed_sync"]


@contextlib.contextmanager
def allowed_sync() -> Iterator[None]:
    """Suspend CUDA's sync debug mode for the block (an intentional read-back), restoring it after.

    Usable as a decorator too. Cheap: it asks whether CUDA was ever initialised before asking for the mode, so a CPU
    run never initialises CUDA here.
    """
    if not torch.cuda.is_initialized():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    if mode == 0:
        yield
        return
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
