"""Evaluation, apart from training so that evaluation strategies can change without touching the loop."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer.sync import allowed_sync
from trainer.tasks.base import as_fp32

if TYPE_CHECKING:
    from torch import nn

    from trainer.precision import Precision
    from trainer.tasks import Task

__all__ = ["evaluate"]


@torch.inference_mode()
def evaluate(model: nn.Module, task: Task, data: tuple[torch.Tensor, torch.Tensor], batch_size: int,
             precision: Precision) -> dict[str, float]:
    """Mean validation loss and the task's metrics over the whole validation set, read back in one sync."""
    was_training = model.training
    model.eval()  # dropout off, norms use running statistics
    inputs, targets = data
    n = len(inputs)
    loss_total = torch.zeros((), device=inputs.device)
    weight_total: torch.Tensor | int = 0  # what the batches' losses count for (`Task.loss_weight`)
    totals: dict[str, torch.Tensor] = {}
    for start in range(0, n, batch_size):
        x, y = inputs[start : start + batch_size], targets[start : start + batch_size]
        with precision.autocast():
            out = model(x)
        weight = task.loss_weight(y)
        loss_total += task.weighted(task.checked_loss(as_fp32(out), y), weight)
        weight_total = weight_total + weight
        if task.eval_metrics is not None:
            for name, value in task.checked_metrics(out, y).items():
                totals[name] = totals[name] + value if name in totals else value
    model.train(was_training)
    task.check_metrics(totals)
    with allowed_sync():  # the evaluation's one read-back
        values = torch.stack([loss_total / weight_total, *(v.float() / n for v in totals.values())]).tolist()
    return {f"val_{name}": value for name, value in zip(["loss", *totals], values)}
