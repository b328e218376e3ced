"""The training loop. It reads top to bottom as a recipe: learning rate, forward, loss, backward, unscale, clip, step,
then log and evaluate at their intervals. Every decision (device, precision, optimizer, schedule) is made before the
loop; values are read back from the device only at log and eval intervals, never per step.

The trainer knows nothing of Optuna: it talks to whoever drives it through a `Reporter`.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn

from trainer.checkpoint import CheckpointInfo, TrainState, WarmStart, capture_rng, restore_rng, save_checkpoint
from trainer.config import TrainingConfig
from trainer.curriculum import stage_starts
from trainer.data import build_batches
from trainer.device_stats import device_stats
from trainer.evaluate import evaluate
from trainer.fast_fail import FastFailConfig, LossGuard, Verdict, judge
from trainer.optim import build_optimizer, lr_at, set_lr
from trainer.precision import Precision, allow_tf32, resolve_device, resolve_precision
from trainer.seeding import reproducibility_record, seed_everything
from trainer.sync import allowed_sync
from trainer.tasks import Task, load_task

__all__ = ["Checkpointer", "FastFailReporter", "NullReporter", "Reporter", "TrainResult", "accumulate_gradients",
           "load_optimizer_moments", "optimizer_step", "train"]


class Reporter(Protocol):
    """How a driver (a sweep, a CLI) hears from training and tells it to stop."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Training metrics at a log interval: train_loss, lr, grad_norm, samples_per_s, curriculum_level (and
        tokens_per_s for sequence tasks; peak_mem_mb, and gpu_util_pct where NVML answers, on CUDA)."""

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        """Validation metrics at an eval interval. Return True to stop training now."""


class NullReporter:
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        return False


class FastFailReporter:
    """Applies the fast-fail rules locally, to `val_loss`: the decision maker when the trainer runs without a study.
    Wraps another reporter to pass its events on. `stage_starts`: where the run's curriculum changes stage."""

    def __init__(self, config: FastFailConfig, inner: Reporter | None = None, metric: str = "val_loss",
                 stage_starts: tuple[int, ...] = ()) -> None:
        self.config = config
        self.stage_starts = stage_starts
        self.inner = inner if inner is not None else NullReporter()
        self.metric = metric
        self.series: list[tuple[int, float]] = []
        self.verdict: Verdict | None = None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.inner.log(step, metrics)

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        stop = self.inner.report(step, metrics)
        self.series.append((step, metrics[self.metric]))
        self.verdict = judge(self.series, self.config, stage_starts=self.stage_starts)
        return stop or self.verdict is not None


@dataclass
class TrainResult:
    status: Literal["completed", "stopped"]
    steps: int
    metrics: dict[str, float]  # the last evaluation
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    logs: list[dict[str, float]] = field(default_factory=list)
    wall_time_s: float = 0.0
    reproducibility: dict[str, Any] = field(default_factory=dict)
    stop_reason: dict[str, Any] | None = None  # set when the trainer's own fast-fail rules stopped it


def accumulate_gradients(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]], n_micro: int,
                         precision: Precision) -> torch.Tensor:
    """Forward and backward over `n_micro` micro-batches; returns their mean loss as a device tensor (no sync).

    Each micro-batch's loss is divided by `n_micro` so that the summed gradients equal those of one batch of
    `n_micro` times the size: the learning rate means the same whatever the accumulation.
    """
    total = None
    for x, y in micro_batches:
        with precision.autocast():
            out = model(x)
        loss = loss_fn(out.float(), y)
        if n_micro > 1:  # dividing by 1 would only add two kernels (forward and backward) to every step
            loss = loss / n_micro
        precision.scaler.scale(loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    if total is None:
        raise ValueError("accumulate_gradients needs at least one micro-batch")
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
    # set_to_none frees the memory and skips a memset; with CUDA graphs it is needed too: the gradients then live in
    # the graphs' memory, which the next step's replay overwrites.
    optimizer.zero_grad(set_to_none=True)
    return norm


class Checkpointer(Protocol):
    """Where and when to write checkpoints; the trainer writes them (format, atomicity, what they hold)."""

    def path_for(self, step: int, metrics: Mapping[str, float] | None) -> Path | None:
        """Asked after every log and evaluation step (`metrics`: that evaluation's, else None). None: not now."""

    def saved(self, info: CheckpointInfo, metrics: Mapping[str, float] | None) -> None:
        """Told after a checkpoint is safely on disk."""


def train(config: TrainingConfig, task: Task | None = None, reporter: Reporter | None = None, *,
          resume: TrainState | None = None, warm_start: WarmStart | None = None,
          checkpointer: Checkpointer | None = None) -> TrainResult:
    """Train one config. `task` defaults to `config.task`; pass one to reuse loaded data across runs.

    With no `reporter`, the fast-fail rules decide locally (on val_loss); a sweep passes a reporter that asks the
    study's pruner instead. `resume` continues exactly from a checkpoint's state: the remaining steps reproduce the
    uninterrupted run loss for loss. `warm_start` starts from another run's weights (and optionally its optimizer
    state) at that run's step: this config's own schedule, seed and data order take over from there, and the
    starting point is evaluated and reported first.
    """
    if resume is not None and warm_start is not None:
        raise ValueError("pass resume (continue this run) or warm_start (start from another run), not both")
    started = time.perf_counter()
    task = task if task is not None else load_task(config.task, config.task_args)
    fast_fail = config.fast_fail.resolved(config.max_steps, config.eval_every_steps)
    stages = stage_starts(config.curriculum, config.max_steps)  # fast-fail gives each stage change a grace period
    local = FastFailReporter(fast_fail, stage_starts=stages) if reporter is None else None
    reporter = local if local is not None else reporter
    device = resolve_device(config.device)
    seed_everything(config.seed, deterministic=config.deterministic)
    allow_tf32(device, config.deterministic)
    model = task.build_model(task.model_config(config.model)).to(device)
    # The compiled module runs the training steps. `model`, whose parameters it shares, is what is evaluated (eval
    # shapes and inference mode would each cost a recompile) and saved: keys without `_orig_mod.`, loadable without it.
    forward = torch.compile(model, mode=config.compile_mode) if config.compile else model
    # CUDA graphs (the modes that use them) must be told where an optimizer step begins (once, not per micro-batch:
    # accumulated gradients must outlive the micro-batch), so that they may reuse the memory of the last step's
    # outputs; with no graphs the call would do nothing, and it is chosen here, not per step.
    graphs = config.compile_mode in ("reduce-overhead", "max-autotune") and device.type == "cuda"  # implies compile
    begin_step = torch.compiler.cudagraph_mark_step_begin if graphs else _nothing
    optimizer = build_optimizer(model, config, device)
    precision = resolve_precision(config.mixed_precision, device)
    val = tuple(t.to(device) for t in task.val)
    batches = build_batches(config, task, device)  # the curriculum's (or the whole set's) batches: on the device, or
    #                                                gathered by loader workers when the set does not fit there
    stats = device_stats(device)  # peak memory, GPU utilisation: nothing on a CPU
    accum = config.gradient_accumulation_steps
    samples_per_step = config.batch_size * accum
    guard = LossGuard(fast_fail, device, stages)
    check_every = fast_fail.check_every_n_steps or config.log_every_steps

    result = TrainResult("completed", 0, {}, reproducibility=reproducibility_record(
        config.seed, device, deterministic=config.deterministic))

    def evaluate_and_report(step: int, extra: Mapping[str, float] = {}) -> bool:
        metrics = evaluate(model, task, val, config.eval_batch_size, precision)
        result.evals.append((step, metrics))
        result.metrics, result.steps = metrics, step
        return reporter.report(step, {**metrics, **extra})

    loss_sum = torch.zeros((), device=device)  # summed on the device, read back at log steps only
    steps_since_log, first_step = 0, 0
    if resume is not None:
        model.load_state_dict(resume.model)
        optimizer.load_state_dict(resume.optimizer)
        precision.scaler.load_state_dict(resume.scaler)
        batches.load_state_dict(resume.data)
        restore_rng(resume.rng)
        loss_sum += float(resume.loop.get("loss_sum", 0.0))
        steps_since_log, first_step = int(resume.loop.get("steps_since_log", 0)), resume.step
        guard.threshold = resume.loop.get("guard_threshold")
        result.steps, result.metrics = resume.step, dict(resume.metrics)
    elif warm_start is not None or fast_fail.enabled:
        if warm_start is not None:
            model.load_state_dict(warm_start.state.model)  # strict: a donor of another shape is refused here too
            if warm_start.optimizer:
                load_optimizer_moments(optimizer, warm_start.state.optimizer)
            first_step = result.steps = warm_start.state.step
        # 0. Evaluate before the first step. Warm, that is the run's first report: the donor's value, on this run's
        #    validation set. With fast-fail on, it is a reference value over the whole validation set (not one noisy
        #    batch) for the explosion rule, and NaN in the data is caught before any training.
        stopped = evaluate_and_report(first_step)
        guard.arm(result.metrics["val_loss"])
        if stopped:
            return _finish(result, local, started, "stopped")

    @allowed_sync()  # saving reads the whole state back to the host
    def checkpoint(step: int, metrics: Mapping[str, float] | None) -> None:
        path = checkpointer.path_for(step, metrics) if checkpointer is not None else None
        if path is None:
            return
        state = TrainState(step=step, model=model.state_dict(), optimizer=optimizer.state_dict(),
                           scaler=precision.scaler.state_dict(), rng=capture_rng(), data=batches.state_dict(),
                           loop={"loss_sum": loss_sum.item(), "steps_since_log": steps_since_log,
                                 "guard_threshold": guard.threshold},
                           config=config.to_dict(), metrics=dict(result.metrics))
        checkpointer.saved(save_checkpoint(path, state), metrics)

    mark = time.perf_counter()  # the start of the log interval's training time
    settle = _synchronize(device) if device.type == "cuda" else _nothing

    @contextlib.contextmanager
    def paused() -> Iterator[None]:
        """Evaluation and checkpoint time is not training throughput: it is left out of the log interval it falls
        in, whether or not that interval ends at this step. The steps queued on the device finish first, inside the
        interval (evaluation would wait for them anyway)."""
        nonlocal mark
        settle()
        started_pause = time.perf_counter()
        try:
            yield
        finally:
            mark += time.perf_counter() - started_pause

    done = first_step
    status = "completed"
    model.train()
    for step in range(first_step, config.max_steps):
        done = step + 1
        log_now = done % config.log_every_steps == 0 or done == config.max_steps
        eval_now = done % config.eval_every_steps == 0 or done == config.max_steps

        begin_step()
        lr = lr_at(step, config)
        set_lr(optimizer, lr)
        micro = (batches.next(step) for _ in range(accum))
        step_loss = accumulate_gradients(forward, task.loss, micro, accum, precision)
        grad_norm = optimizer_step(model, optimizer, precision, config.gradient_clip_norm, want_norm=log_now)
        loss_sum += step_loss
        guard.observe(step_loss, done)  # on the device: no sync
        steps_since_log += 1

        if log_now:
            with allowed_sync():  # the log interval's one read-back
                values = torch.stack([loss_sum / steps_since_log,
                                      grad_norm if grad_norm is not None else torch.zeros((), device=device)]).tolist()
            elapsed = max(time.perf_counter() - mark, 1e-9)
            record = {"step": done, "train_loss": values[0], "lr": lr, "grad_norm": values[1],
                      "samples_per_s": steps_since_log * samples_per_step / elapsed,
                      "curriculum_level": batches.level_at(step)}  # a function of the step: no read-back
            if task.tokens_per_sample:
                record["tokens_per_s"] = record["samples_per_s"] * task.tokens_per_sample
            record.update(stats())
            result.logs.append(record)
            reporter.log(done, record)
            loss_sum.zero_()
            steps_since_log, mark = 0, time.perf_counter()

        # 1. Between evaluations, a NaN/Inf or exploding training loss trips the guard; reading it costs one sync per
        #    check interval. A tripped guard brings the next evaluation forward, and the reporter (the pruner)
        #    decides on its value, so there is one place of truth.
        tripped = fast_fail.enabled and not eval_now and done % check_every == 0 and guard.tripped()
        if eval_now or tripped:
            with allowed_sync():
                extra = {"train_loss": step_loss.item()} if tripped else {}
            with paused():
                stop = evaluate_and_report(done, extra)
            guard.reset()
            if stop and done < config.max_steps:  # at the last step there is nothing left to save
                status = "stopped"
                break
        if log_now or eval_now:
            with paused():
                checkpoint(done, result.metrics if eval_now else None)
    batches.close()  # a loader's workers stop here, not when the garbage collector gets to them
    result.steps = done
    return _finish(result, local, started, status)


def load_optimizer_moments(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Take another run's optimizer state (moments, step counts) but keep this run's hyperparameters:
    `Optimizer.load_state_dict` would also overwrite betas, weight decay and eps with the donor's."""
    own = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, settings in zip(optimizer.param_groups, own):
        group.update(settings)


def _nothing() -> None:
    pass


def _synchronize(device: torch.device) -> Callable[[], None]:
    def synchronize() -> None:
        with allowed_sync():  # only around evaluations and checkpoints, which read back anyway
            torch.cuda.synchronize(device)

    return synchronize


def _finish(result: TrainResult, local: FastFailReporter | None, started: float, status: str) -> TrainResult:
    result.status = status  # type: ignore[assignment]
    if status == "stopped" and local is not None and local.verdict is not None:
        result.stop_reason = local.verdict.as_dict()
    result.wall_time_s = time.perf_counter() - started
    return result
