"""Optimizers and the learning-rate schedule, each a function of the config."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, overload

import torch

if TYPE_CHECKING:
    from trainer.config import TrainingConfig

__all__ = ["Lion", "build_optimizer", "lr_at", "set_lr"]


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of an interpolated momentum.

    torch ships no Lion. Weight decay is decoupled, as in AdamW. Typical learning rates are 3-10x smaller than AdamW's.

    `foreach` (default: on for CUDA parameters, as in torch's own optimizers): each line of the update is one
    multi-tensor kernel over all of a group's parameters: 6 or 7 (with weight decay) launches per group and step
    instead of that many per tensor, which is what a launch-bound sweep-sized model pays for on a GPU. On a CPU the
    per-tensor loop is faster (each tensor's passes stay in cache), so it is the default there. Both compute the same
    numbers, bit for bit.

    Under fp16's `GradScaler` it takes the scaler's `found_inf` on the device, as torch's fused optimizers do
    (`_step_supports_amp_scaling`): a step whose gradients overflowed leaves parameters and momentum as they were,
    without the per-step `.item()` that the scaler otherwise needs to decide whether to call `step` at all.
    """

    _step_supports_amp_scaling = True  # GradScaler.step then sets `grad_scale` and `found_inf` for the step

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, foreach: bool | None = None) -> None:
        if lr <= 0:
            raise ValueError(f"Lion needs lr > 0, but got {lr=}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay, "foreach": foreach})

    def __setstate__(self, state: dict) -> None:  # load_state_dict: a state saved before `foreach` existed
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("foreach", None)

    @overload  # torch.optim.Optimizer.step's two forms: without a closure, and with one whose loss it returns
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads, moments = [p.grad for p in params], [self._momentum(p) for p in params]
            lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
            grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
            if grad_scale is not None or found_inf is not None:  # inside GradScaler.step (fp16)
                _lion_scaled(params, grads, moments, lr, beta1, beta2, decay, grad_scale, found_inf)
                continue
            foreach = group["foreach"] if group["foreach"] is not None else all(p.is_cuda for p in params)
            update = _lion_foreach if foreach else _lion_per_tensor
            update(params, grads, moments, lr, beta1, beta2, decay)
        return loss

    def _momentum(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["exp_avg"]


def _lion_per_tensor(params: list[torch.Tensor], grads: list[torch.Tensor], moments: list[torch.Tensor], lr: float,
                     beta1: float, beta2: float, decay: float) -> None:
    for p, grad, moment in zip(params, grads, moments):
        if decay:
            p.mul_(1 - lr * decay)
        # 1. the update is the sign of an interpolation between momentum and gradient,
        p.add_(moment.mul(beta1).add_(grad, alpha=1 - beta1).sign_(), alpha=-lr)
        # 2. and the momentum itself is tracked with a slower beta.
        moment.mul_(beta2).add_(grad, alpha=1 - beta2)


def _lion_foreach(params: list[torch.Tensor], grads: list[torch.Tensor], moments: list[torch.Tensor], lr: float,
                  beta1: float, beta2: float, decay: float) -> None:
    """`_lion_per_tensor`, each line one multi-tensor kernel. torch names these kernels with an underscore only (its
    own optimizers' foreach paths call them the same way); there is no public name to use instead."""
    if decay:
        torch._foreach_mul_(params, 1 - lr * decay)
    update = torch._foreach_mul(moments, beta1)  # noqa: SLF001 (a multi-tensor kernel, see _lion_foreach)
    torch._foreach_add_(update, grads, alpha=1 - beta1)
    torch._foreach_sign_(update)
    torch._foreach_add_(params, update, alpha=-lr)
    torch._foreach_mul_(moments, beta2)
    torch._foreach_add_(moments, grads, alpha=1 - beta2)


def _lion_scaled(params: list[torch.Tensor], grads: list[torch.Tensor], moments: list[torch.Tensor], lr: float,
                 beta1: float, beta2: float, decay: float, grad_scale: torch.Tensor | None,
                 found_inf: torch.Tensor | None) -> None:
    """The Lion step under a GradScaler, decided on the device: gradients divided by `grad_scale` (None: already
    unscaled), and every change multiplied by `keep` (0 when `found_inf`), so that an overflowed step changes nothing.
    Non-finite gradients become 0 first: only in a step that is discarded anyway, and `0 * inf` would be NaN."""
    device = params[0].device
    # found_inf is a sum over the devices the gradients are on: 2 when two overflowed, still one skipped step.
    keep = 1 - found_inf.to(device).clamp(max=1) if found_inf is not None else torch.ones((), device=device)
    grads = [torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for g in grads]
    if grad_scale is not None:
        torch._foreach_mul_(grads, grad_scale.to(device).double().reciprocal().float())
    if decay:
        torch._foreach_mul_(params, 1 - lr * decay * keep)
    update = torch._foreach_mul(moments, beta1)  # noqa: SLF001 (a multi-tensor kernel, see _lion_foreach)
    torch._foreach_add_(update, grads, alpha=1 - beta1)
    torch._foreach_sign_(update)
    torch._foreach_mul_(update, -lr * keep)
    torch._foreach_add_(params, update)
    drift = torch._foreach_sub(grads, moments)  # noqa: SLF001 (momentum += (1 - beta2) * keep * (grad - momentum))
    torch._foreach_mul_(drift, (1 - beta2) * keep)
    torch._foreach_add_(moments, drift)


def build_optimizer(model: torch.nn.Module, config: TrainingConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer named by the config. Weight decay applies to matrices (dim >= 2) only: decaying biases and norm
    gains towards zero hurts and is not what a searched `weight_decay` should mean."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    # Fused kernels exist for CUDA tensors only; they run the whole update in one launch.
    fused = {"fused": True} if device.type == "cuda" else {}
    name = config.optimizer
    if name == "sgd":
        return torch.optim.SGD(groups, lr=config.learning_rate, momentum=config.momentum, nesterov=config.nesterov,
                               **fused)
    if name in ("adam", "adamw"):
        cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return cls(groups, lr=config.learning_rate, betas=(config.beta1, config.resolved_beta2), eps=config.eps,
                   **fused)
    if name == "lion":
        return Lion(groups, lr=config.learning_rate, betas=(config.beta1, config.resolved_beta2))
    raise ValueError(f"unknown optimizer {name!r}")  # TrainingConfig already refused it


def lr_at(step: int, config: TrainingConfig) -> float:
    """The learning rate for optimizer step `step` (0-based): a pure function, so a schedule can be searched,
    resumed and replayed from the step count alone.

    1. linear warmup from lr/warmup to lr over `warmup_steps`;
    2. then decay over the remaining steps: cosine or linear down to lr * min_lr_ratio at `max_steps`,
       or a step decay by `step_gamma` every `step_every` steps, or none.
    """
    peak = config.learning_rate
    if step < config.warmup_steps:
        return peak * (step + 1) / config.warmup_steps
    if config.scheduler == "none":
        return peak
    since = step - config.warmup_steps
    if config.scheduler == "step":
        every = config.step_every or max(1, config.max_steps // 3)
        return peak * config.step_gamma ** (since // every)
    span = max(1, config.max_steps - config.warmup_steps)
    progress = min(1.0, since / span)
    floor = peak * config.min_lr_ratio
    if config.scheduler == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak - (peak - floor) * progress  # linear


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
