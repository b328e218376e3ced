"""Optimizers over stacked parameters: K members' tensors of one name stacked on dimension 0, each member with its own
hyperparameters as a [K] tensor.

Every update is a handful of tensor ops over the whole stack (no per-member Python loop, no read-back from the
device); a member's hyperparameters broadcast along its slice. The ops are chosen to compute, element for element,
what the single-model optimizers of `trainer.optim.build_optimizer` compute on a CPU (torch's single-tensor AdamW,
Adam and SGD, and our `Lion`): a scalar `alpha` of `add_` becomes an `addcmul` with the per-member tensor, a scalar
`value` of `addcdiv_` multiplies the numerator first, as torch's kernel does. `tests/trainer/test_batched.py` checks
them bit for bit against the single-model optimizers.

The per-member scalars that the single-model optimizers compute in Python (bias corrections, `1 - lr * decay`) are
computed the same way here, on the host, from the members' configs and step counts (`host_scalars`), for many steps
at once, and reach the device as one small table: the host knows them without reading anything back.

Weight decay applies to matrices only (a member's tensor of dim >= 2), as in `build_optimizer`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainer.batched_ops import per_member

if TYPE_CHECKING:
    from trainer.config import TrainingConfig

__all__ = ["COLUMNS", "OPTIMIZER_STATES", "ClipPlan", "StackedOptimizer", "clip_stacked", "host_scalars"]

# The state tensors each optimizer keeps per parameter, named as torch's (and our Lion's) state dicts name them.
OPTIMIZER_STATES: dict[str, tuple[str, ...]] = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq"),
                                                "sgd": ("momentum_buffer",), "lion": ("exp_avg",)}

# The rows of `host_scalars`' table, per member.
COLUMNS = ("lr", "neg_lr", "decay_factor", "weight_decay", "one_minus_beta1", "beta1", "beta2", "one_minus_beta2",
           "bias2_sqrt", "eps", "neg_step_size", "momentum", "nesterov")
_FREE = [0.0, -0.0, 1.0, 0.0, 0.1, 0.9, 0.999, 0.001, 1.0, 1e-8, -0.0, 0.0, 0.0]  # a free slot: nothing moves


def _row(config: TrainingConfig, lr: float, step: int) -> list[float]:
    """One member's scalars for its optimizer step number `step` (1-based, as torch's `state["step"]` after the
    increment), in Python floats exactly as the single-model optimizers compute them."""
    beta1, beta2, decay = config.beta1, config.resolved_beta2, config.weight_decay
    bias1 = 1 - beta1**step
    bias2 = 1 - beta2**step
    return [lr, -lr, 1 - lr * decay, decay, 1 - beta1, beta1, beta2, 1 - beta2, bias2**0.5, config.eps,
            -(lr / bias1), config.momentum if config.optimizer == "sgd" else 0.0, float(config.nesterov)]


def host_scalars(configs: Sequence[TrainingConfig | None], lrs: Sequence[Sequence[float]],
                 steps: Sequence[int], device: torch.device) -> torch.Tensor:
    """Every member's scalars for several steps ahead, as one [steps, len(COLUMNS), K] float32 tensor on `device`
    (what a Python scalar becomes in a float32 kernel): member `k`'s learning rates `lrs[k]` (one per step), its
    first optimizer step number `steps[k]`. A free slot (`None`) gets a zero learning rate. One transfer for all the
    steps: the optimizer takes step `i`'s [len(COLUMNS), K] slice, and the host computes nothing per step."""
    n = max((len(rates) for rates in lrs), default=0)
    rows = [[_row(config, lr, first + i) for i, lr in enumerate(rates)] if config is not None else [_FREE] * n
            for config, rates, first in zip(configs, lrs, steps)]
    table = torch.tensor(rows, dtype=torch.float64).to(torch.float32)  # [K, steps, columns]
    return table.permute(1, 2, 0).contiguous().to(device)


# torch's multi-tensor ops (private in name only; `torch.optim`'s foreach paths use them): one call for a list of
# tensors. On a CPU each runs the ordinary kernel on each tensor, broadcasting as the ordinary op does.
_foreach_mul_ = torch._foreach_mul_
_foreach_mul = torch._foreach_mul  # noqa: SLF001
_foreach_addcmul = torch._foreach_addcmul  # noqa: SLF001
_foreach_addcmul_ = torch._foreach_addcmul_
_foreach_lerp_ = torch._foreach_lerp_
_foreach_sqrt = torch._foreach_sqrt  # noqa: SLF001
_foreach_div_ = torch._foreach_div_
_foreach_add_ = torch._foreach_add_
_foreach_addcdiv_ = torch._foreach_addcdiv_


def _per_member(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A [K] tensor shaped to broadcast along each member's slice of a stacked [K, ...] tensor."""
    return value.view(-1, *([1] * (like.dim() - 1)))


@dataclass
class ClipPlan:
    """Gradient clipping per member: `max_norm` [K] (any value where `clip` is False) and `clip` [K] bool."""

    max_norm: torch.Tensor
    clip: torch.Tensor


def clip_stacked(grads: Sequence[torch.Tensor], plan: ClipPlan | None) -> torch.Tensor:
    """Each member's total gradient norm [K] (as `torch.nn.utils.get_total_norm`: the norm of the per-tensor norms),
    and, with a plan, its gradients scaled as `clip_grad_norm_` scales them: by `min(1, max_norm / (norm + 1e-6))`,
    only for the members that clip."""
    # Each member's slice is reduced as a whole single-model tensor (a row-wise reduction of the stack sums in
    # another order for large tensors): one multi-tensor call over every slice, then the norm of each member's norms.
    k = grads[0].shape[0]
    slices = [g[i] for i in range(k) for g in grads]
    norms = torch.stack(torch._foreach_norm(slices, 2)).view(k, len(grads))  # noqa: SLF001 (multi-tensor kernel)
    total = per_member("total_norm", lambda n: torch.linalg.vector_norm(n, 2, dim=1),
                       lambda n: torch.linalg.vector_norm(n, 2), norms)  # a row-wise norm may sum in another order
    if plan is not None:
        # `max_norm / (total_norm + 1e-6)` with a float max_norm is Tensor.__rtruediv__: a reciprocal, then a product
        coef = torch.clamp((total + 1e-6).reciprocal() * plan.max_norm, max=1.0)
        coef = torch.where(plan.clip, coef, torch.ones_like(coef))  # a member that does not clip is left as it is
        for g in grads:
            g.mul_(_per_member(coef, g))
    return total


class StackedOptimizer:
    """AdamW, Adam, SGD (momentum, Nesterov) or Lion over stacked parameters. State per parameter name, stacked like
    the parameters; zeros mean "no state yet" (for SGD's momentum buffer the first step then gives `buf = grad`, as
    torch's `grad.clone()` does)."""

    def __init__(self, kind: str, params: Mapping[str, torch.Tensor]) -> None:
        if kind not in OPTIMIZER_STATES:
            raise ValueError(f"unknown optimizer {kind!r}; expected one of {sorted(OPTIMIZER_STATES)}")
        self.kind = kind
        self.params = dict(params)
        self.state = {name: {key: torch.zeros_like(p) for key in OPTIMIZER_STATES[kind]}
                      for name, p in self.params.items()}

    def reset(self, slot: int) -> None:
        """A fresh member in `slot`: no moments yet."""
        for states in self.state.values():
            for tensor in states.values():
                tensor[slot].zero_()

    @torch.no_grad()
    def step(self, scalars: torch.Tensor) -> None:
        """One step; `scalars`: the members' [len(COLUMNS), K] slice of a `host_scalars` table."""
        names = [name for name, p in self.params.items() if p.grad is not None]
        shaped: dict[int, dict[str, torch.Tensor]] = {}  # the scalars viewed for each parameter rank, once a step
        for name in names:
            p = self.params[name]
            if p.dim() not in shaped:
                shaped[p.dim()] = dict(zip(COLUMNS, scalars.view(len(COLUMNS), -1, *([1] * (p.dim() - 1)))
                                           .unbind(0), strict=True))
        if self.kind in ("adam", "adamw"):
            self._adam(names, shaped)
            return
        update = {"sgd": self._sgd, "lion": self._lion}[self.kind]
        for name in names:
            p = self.params[name]
            assert p.grad is not None
            update(p, p.grad, self.state[name], shaped[p.dim()], decays=p.dim() - 1 >= 2)

    def _adam(self, names: list[str], shaped: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """AdamW or Adam on every parameter at once: each step below is one multi-tensor call over the parameters
        (on a CPU, torch runs the same per-tensor kernel for each, so the values are those of the per-tensor ops),
        a member's scalars broadcasting along its slice."""
        params = [self.params[name] for name in names]
        grads = [p.grad for p in params if p.grad is not None]  # every one (`names` has only those with a gradient)
        exp_avgs = [self.state[name]["exp_avg"] for name in names]
        exp_avg_sqs = [self.state[name]["exp_avg_sq"] for name in names]

        def m(key: str, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            return [shaped[t.dim()][key] for t in like]

        matrices = [i for i, p in enumerate(params) if p.dim() - 1 >= 2]  # weight decay applies to matrices only
        decayed = [params[i] for i in matrices]
        if decayed and self.kind == "adamw":
            _foreach_mul_(decayed, m("decay_factor", decayed))  # param.mul_(1 - lr * weight_decay)
        elif decayed:  # grad.add(param, alpha=weight_decay)
            coupled = _foreach_addcmul([grads[i] for i in matrices], decayed, m("weight_decay", decayed))
            for i, grad in zip(matrices, coupled, strict=True):
                grads[i] = grad
        _foreach_lerp_(exp_avgs, grads, m("one_minus_beta1", grads))
        _foreach_mul_(exp_avg_sqs, m("beta2", grads))  # then addcmul_(g, g, value=1 - beta2):
        _foreach_addcmul_(exp_avg_sqs, _foreach_mul(grads, m("one_minus_beta2", grads)), grads)
        denom = _foreach_sqrt(exp_avg_sqs)  # (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        _foreach_div_(denom, m("bias2_sqrt", denom))
        _foreach_add_(denom, m("eps", denom))
        # torch's kernel: param + (value * exp_avg) / denom
        _foreach_addcdiv_(params, _foreach_mul(exp_avgs, m("neg_step_size", exp_avgs)), denom)

    def _sgd(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
             s: Mapping[str, torch.Tensor], decays: bool) -> None:
        m = s.__getitem__  # the member scalars, already shaped to broadcast along each slice

        if decays:
            grad = torch.addcmul(grad, p, m("weight_decay"))
        buf = state["momentum_buffer"]
        buf.mul_(m("momentum")).add_(grad)  # momentum 0: buf = grad, the update of plain SGD
        update = torch.where(m("nesterov") > 0, torch.addcmul(grad, buf, m("momentum")), buf)
        p.addcmul_(update, m("neg_lr"))  # param.add_(update, alpha=-lr)

    def _lion(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
              s: Mapping[str, torch.Tensor], decays: bool) -> None:
        m = s.__getitem__  # the member scalars, already shaped to broadcast along each slice

        moment = state["exp_avg"]
        if decays:
            p.mul_(m("decay_factor"))
        # 1. the update is the sign of an interpolation between momentum and gradient,
        update = torch.addcmul(moment * m("beta1"), grad, m("one_minus_beta1")).sign_()
        p.addcmul_(update, m("neg_lr"))
        # 2. and the momentum itself is tracked with a slower beta.
        moment.mul_(m("beta2")).addcmul_(grad, m("one_minus_beta2"))
