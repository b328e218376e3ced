"""The marks around intentional read-backs, and the device metrics, cost nothing where there is no CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from trainer.device_stats import device_stats
from trainer.precision import allow_tf32
from trainer.sync import allowed_sync


def test_allowed_sync_is_a_no_op_that_never_initialises_cuda() -> None:
    code = ("import torch; from trainer.sync import allowed_sync\n"
            "with allowed_sync():\n    x = torch.ones(3).sum().item()\n"
            "@allowed_sync()\ndef f():\n    return 1\n"
            "assert f() == 1 and x == 3.0 and not torch.cuda.is_initialized()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


def test_allowed_sync_restores_the_mode_it_found() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: the sync debug mode is CUDA's")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with allowed_sync():
            assert torch.cuda.get_sync_debug_mode() == 0
        assert torch.cuda.get_sync_debug_mode() == 1
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_a_cpu_reports_no_device_metrics_and_keeps_its_matmul_precision() -> None:
    assert device_stats(torch.device("cpu"))() == {}
    before = torch.get_float32_matmul_precision()
    allow_tf32(torch.device("cpu"), deterministic=False)
    assert torch.get_float32_matmul_precision() == before
