"""Mixed precision, decided once before the loop. When it is off, the autocast context and the grad scaler are
disabled objects that do nothing, so the loop has no precision branches."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from trainer.config import DeviceUnavailable
from trainer.messages import message

__all__ = ["DeviceUnavailable", "Precision", "allow_tf32", "out_of_memory", "resolve_device", "resolve_precision"]


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
    """Whether `exc` is PyTorch running out of memory: its own error on CUDA, a RuntimeError of the CPU allocator."""
    text = message(exc) or ""  # a user's exception class whose __str__ is broken: no allocator's message
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in text or "out of memory" in text
