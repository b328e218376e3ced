"""Mixed precision, decided once before the loop. When it is off, the autocast context and the grad scaler are
disabled objects that do nothing, so the loop has no precision branches."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from trainer.config import DeviceUnavailable
from trainer.limits import OUT_OF_MEMORY_WORDS, limit_words, soft_limit
from trainer.messages import message

__all__ = ["DeviceUnavailable", "Precision", "allow_tf32", "host_memory_limit", "memory_limit", "out_of_memory",
           "out_of_memory_words", "resolve_device", "resolve_precision"]


@dataclass(frozen=True)
class Precision:
    device_type: str
    dtype: torch.dtype | None  # None: full fp32
    scaler: torch.amp.GradScaler

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    @property
    def name(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(f"device {name!r} was asked for, but torch sees no CUDA device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise DeviceUnavailable(f"device {name!r} was asked for, but torch sees {count} CUDA device"
                                f"{'' if count == 1 else 's'} (cuda:0 to cuda:{count - 1})")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceUnavailable(f"device {name!r} was asked for, but torch sees no MPS device (Apple silicon)")
    return device


def resolve_precision(mode: str, device: torch.device) -> Precision:
    """`auto`: bf16 autocast on CUDA where the GPU supports it, fp16 with a grad scaler where it does not, off
    elsewhere. `bf16`/`fp16` force that dtype on any device; `off` is fp32."""
    dtype: torch.dtype | None
    if mode == "auto":
        if device.type == "cuda":
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        else:
            dtype = None
    else:
        dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]
    # fp16 has too little range for small gradients: scale the loss up and the gradients back down.
    scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)
    return Precision(device.type, dtype, scaler)


def allow_tf32(device: torch.device, deterministic: bool) -> None:
    """On CUDA, let fp32 matmuls and convolutions use TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation):
    several times faster on Ampere and later, and below the noise of training. A `deterministic` run keeps full fp32
    so that its numbers do not depend on the GPU generation. A process-wide setting, made again by every run."""
    if device.type != "cuda":
        return
    torch.set_float32_matmul_precision("highest" if deterministic else "high")
    torch.backends.cudnn.allow_tf32 = not deterministic


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is running out of memory: PyTorch's own error on CUDA, a RuntimeError of its CPU allocator,
    Python's MemoryError (numpy's too)."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return True
    text = message(exc) or ""  # a user's exception class whose __str__ is broken: no allocator's message
    return any(words in text for words in OUT_OF_MEMORY_WORDS)


# The limits a process's memory may be under, as `resource` names them, with their `ulimit` option and what they count.
_MEMORY_LIMITS = (("RLIMIT_AS", "-v", "address-space"), ("RLIMIT_DATA", "-d", "data-size"))
def memory_limit() -> str | None:
    """This process's limit on its memory in words ("the address-space limit, ulimit -v, is 1000000 KiB"), or None
    where it has none: under one, host memory runs out at the limit (a MemoryError, the CPU allocator's error), not
    where the machine's memory ends."""
    for name, option, what in _MEMORY_LIMITS:
        if soft_limit(name) not in (None, math.inf):
            return limit_words(name, option, what)
    return None


def host_memory_limit(exc: BaseException) -> str | None:
    """This process's memory limit in words (`memory_limit`) when `exc` is host memory running out under one (Python's
    MemoryError, the CPU allocator's error): where it ran out. None for any other error, a GPU's memory too."""
    if isinstance(exc, MemoryError) or "can't allocate memory" in (message(exc) or ""):
        return memory_limit()
    return None


def out_of_memory_words(exc: BaseException) -> str:
    """`exc`, an error `out_of_memory` accepts, in one line: its type and first line ("out of memory" where it has
    none: a bare MemoryError), and the process's memory limit where host memory ran out under one."""
    lines = (message(exc) or "").strip().splitlines()
    said = f"{type(exc).__name__}: {lines[0][:300] if lines else 'out of memory'}"
    limit = host_memory_limit(exc)
    return said if limit is None else f"{said} ({limit})"
