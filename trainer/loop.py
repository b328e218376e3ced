"""The training loop. It reads top to bottom as a recipe: learning rate, forward, loss, backward, unscale, clip, step,
then log and evaluate at their intervals. Every decision (device, precision, optimizer, schedule) is made before the
loop; values are read back from the device only at log and eval intervals, never per step.

The trainer knows nothing of Optuna: it talks to whoever drives it through a `Reporter`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn

from trainer.config import TrainingConfig
from trainer.data import DeviceBatches
from trainer.evaluate import evaluate
from trainer.optim import build_optimizer, lr_at, set_lr
from trainer.precision import Precision, resolve_device, resolve_precision
from trainer.seeding import reproducibility_record, seed_everything
from trainer.tasks import Task, load_task

__all__ = ["NullReporter", "Reporter", "TrainResult", "accumulate_gradients", "optimizer_step", "train"]


class Reporter(Protocol):
    """How a driver (a sweep, a CLI) hears from training and tells it to stop."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Training metrics at a log interval: train_loss, lr, grad_norm, samples_per_s (and tokens_per_s)."""

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        """Validation metrics at an eval interval. Return True to stop training now."""


class NullReporter:
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        return False


@dataclass
class TrainResult:
    status: Literal["completed", "stopped"]
    steps: int
    metrics: dict[str, float]  # the last evaluation
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    logs: list[dict[str, float]] = field(default_factory=list)
    wall_time_s: float = 0.0
    reproducibility: dict[str, Any] = field(default_factory=dict)


def accumulate_gradients(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]], n_micro: int,
                         precision: Precision) -> torch.Tensor:
    """Forward and backward over `n_micro` micro-batches; returns their mean loss as a device tensor (no sync).

    Each micro-batch's loss is divided by `n_micro` so that the summed gradients equal those of one batch of
    `n_micro` times the size: the learning rate means the same whatever the accumulation.
    """
    total = torch.zeros((), device=next(model.parameters()).device)
    for x, y in micro_batches:
        with precision.autocast():
            out = model(x)
        loss = loss_fn(out.float(), y) / n_micro
        precision.scaler.scale(loss).backward()
        total += loss.detach()
    return total


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
                   clip_norm: float | None, want_norm: bool) -> torch.Tensor | None:
    """Unscale, clip, step, zero. Returns the pre-clip gradient norm when clipping or when asked (a device tensor)."""
    # Unscale first: clipping must compare the true gradient norm with the threshold, not the fp16-scaled one.
    precision.scaler.unscale_(optimizer)
    norm = None
    if clip_norm is not None:
        norm = nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    elif want_norm:
        norm = nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    precision.scaler.step(optimizer)  # skips the step if fp16 gradients overflowed
    precision.scaler.update()
    optimizer.zero_grad(set_to_none=True)  # set_to_none frees the memory and skips a memset
    return norm


def train(config: TrainingConfig, task: Task | None = None, reporter: Reporter | None = None) -> TrainResult:
    """Train one config. `task` defaults to `config.task`; pass one to reuse loaded data across runs."""
    started = time.perf_counter()
    task = task if task is not None else load_task(config.task, config.task_args)
    reporter = reporter if reporter is not None else NullReporter()
    device = resolve_device(config.device)
    seed_everything(config.seed, deterministic=config.deterministic)
    model = task.build_model(task.model_config(config.model)).to(device)
    optimizer = build_optimizer(model, config, device)
    precision = resolve_precision(config.mixed_precision, device)
    train_x, train_y = (t.to(device) for t in task.train)
    val = tuple(t.to(device) for t in task.val)
    batches = DeviceBatches(len(train_x), config.batch_size, config.seed, device)
    accum = config.gradient_accumulation_steps
    samples_per_step = config.batch_size * accum

    result = TrainResult("completed", 0, {}, reproducibility=reproducibility_record(
        config.seed, device, deterministic=config.deterministic))
    loss_sum = torch.zeros((), device=device)  # summed on the device, read back at log steps only
    steps_since_log, mark = 0, time.perf_counter()
    model.train()
    for step in range(config.max_steps):
        done = step + 1
        log_now = done % config.log_every_steps == 0 or done == config.max_steps
        eval_now = done % config.eval_every_steps == 0 or done == config.max_steps

        lr = lr_at(step, config)
        set_lr(optimizer, lr)
        micro = ((train_x[idx], train_y[idx]) for idx in (batches.next() for _ in range(accum)))
        loss_sum += accumulate_gradients(model, task.loss, micro, accum, precision)
        grad_norm = optimizer_step(model, optimizer, precision, config.gradient_clip_norm, want_norm=log_now)
        steps_since_log += 1

        if log_now:
            values = torch.stack([loss_sum / steps_since_log,
                                  grad_norm if grad_norm is not None else torch.zeros((), device=device)]).tolist()
            elapsed = max(time.perf_counter() - mark, 1e-9)
            record = {"step": done, "train_loss": values[0], "lr": lr, "grad_norm": values[1],
                      "samples_per_s": steps_since_log * samples_per_step / elapsed}
            if task.tokens_per_sample:
                record["tokens_per_s"] = record["samples_per_s"] * task.tokens_per_sample
            if device.type == "cuda":
                record["peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
            result.logs.append(record)
            reporter.log(done, record)
            loss_sum.zero_()
            steps_since_log, mark = 0, time.perf_counter()

        if eval_now:
            metrics = evaluate(model, task, val, config.eval_batch_size, precision)
            result.evals.append((done, metrics))
            result.metrics = metrics
            result.steps = done
            stop = reporter.report(done, metrics)
            mark = time.perf_counter()  # evaluation time is not training throughput
            if stop:
                result.status = "stopped"
                break
    result.steps = done if config.max_steps else 0
    result.wall_time_s = time.perf_counter() - started
    return result

