"""What the device reports at each log step: peak memory and, where NVML answers, utilisation.

Decided once before the loop: `device_stats(device)` returns a function that the loop calls at log steps. On a CPU it
returns nothing; on CUDA the peak memory allocated since the run started (`peak_mem_mb`: the counter is reset here,
so a worker process that trains many trials reports each trial's own peak, not the largest trial's so far) and, when
`torch.cuda.utilization` works here (it needs the `nvidia-ml-py` package), the share of the last sample period in
which a kernel ran on the GPU (`gpu_util_pct`, 0-100, every process on the GPU counted). Neither reads the device's
memory: no sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["device_stats"]


def device_stats(device: torch.device) -> Callable[[], dict[str, float]]:
    if device.type != "cuda":
        return dict
    torch.cuda.reset_peak_memory_stats(device)
    try:
        torch.cuda.utilization(device)  # a probe: no pynvml, or no NVML in a container, raises here and only here
        utilization = True
    except Exception:  # noqa: BLE001 (any failure means: not available here)
        utilization = False

    def stats() -> dict[str, float]:
        values = {"peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20}
        if utilization:
            values["gpu_util_pct"] = float(torch.cuda.utilization(device))
        return values

    return stats
