"""The training loop. It reads top to bottom as a recipe: learning rate, forward, loss, backward, unscale, clip, step,
then log and evaluate at their intervals. Every decision (device, precision, optimizer, schedule) is made before the
loop; values are read back from the device only at log and eval intervals, never per step.

`train` in four parts: `build_run` (seed; device, model, optimizer, precision, batches), then where the steps begin
(`_restore` a checkpoint of this run, `_load_warm_start` another run's weights, and the step-0 evaluation), then the
loop itself (`_train_steps`), whose running values between log steps are a `LoopState` in a checkpoint.

The trainer knows nothing of Optuna: it talks to whoever drives it through a `Reporter`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import nn

from trainer.checkpoint import (
    CheckpointInfo,
    LoopState,
    TrainState,
    WarmStart,
    capture_rng,
    restore_rng,
    save_checkpoint,
)
from trainer.config import TrainingConfig
from trainer.curriculum import stage_starts
from trainer.data import DeviceData, LoaderData, build_batches
from trainer.device_stats import device_stats
from trainer.distributed import Ranks
from trainer.evaluate import evaluate
from trainer.fast_fail import FastFailConfig, LossGuard, Verdict, judge, training_metric
from trainer.fast_fail_rules import DIVERGED
from trainer.limits import usable_cores
from trainer.optim import build_optimizer, lr_at, set_lr
from trainer.precision import Precision, allow_tf32, resolve_device, resolve_precision
from trainer.seeding import kept_global_state, reproducibility_record, seed_everything
from trainer.sync import allowed_sync
from trainer.tasks import Task, load_task
from trainer.tasks.base import as_fp32

__all__ = ["Checkpointer", "FastFailReporter", "LoopState", "NullReporter", "Reporter", "Run", "Status", "TrainResult",
           "TrainingSeries", "accumulate_gradients", "build_run", "deciding", "ended", "load_optimizer_moments",
           "optimizer_step", "train"]

Status = Literal["completed", "stopped"]


class Reporter(Protocol):
    """How a driver (a sweep, a CLI) hears from training and tells it to stop."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Training metrics at a log interval: train_loss, lr, grad_norm, samples_per_s, curriculum_level (and
        tokens_per_s for sequence tasks; peak_mem_mb, and gpu_util_pct where NVML answers, on CUDA)."""

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        """Validation metrics at an eval interval. Return True to stop training now."""

    # Optional: `poll(step)`, called before each optimizer step, may raise to end the run there (a driver's Ctrl-C or
    # SIGTERM, honoured within a step, not at the next log step, which may be minutes of slow steps away: a
    # preempted job's grace period is shorter). See `_poller`.


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
        self.training = TrainingSeries(config, metric)
        self.verdict: Verdict | None = None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.inner.log(step, metrics)
        self.training.log(metrics)

    def poll(self, step: int) -> None:
        if (poll := _poller(self.inner)) is not None:
            poll(step)

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        stop = self.inner.report(step, metrics)
        self.series.append((step, metrics[self.metric]))
        self.training.pair(step)
        self.verdict = judge(self.series, self.config, stage_starts=self.stage_starts,
                             train_series=self.training.series)
        return stop or self.verdict is not None

    def resumed(self, history: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        """A resumed run's evaluations before its checkpoint: the rules judge the whole run, as if never stopped
        (review: judged from the first evaluation after the resume, a resumed run's "initial" value was a later one,
        and the loss-explosion rule stopped a run that, uninterrupted, completed)."""
        self.series = [(step, float(metrics[self.metric])) for step, metrics in history if self.metric in metrics]


class TrainingSeries:
    """The training counterpart of a validation metric (`training_metric`), paired with its evaluations for the
    overfitting rule: the value last logged at or before each evaluation step. Empty when the rule is off, so a run
    without it keeps nothing."""

    def __init__(self, config: FastFailConfig, metric: str) -> None:
        self.name = training_metric(metric) if config.enabled and config.overfit_gap is not None else None
        self.latest: float | None = None
        self.series: list[tuple[int, float]] = []

    def log(self, metrics: Mapping[str, float]) -> None:
        if self.name is not None and self.name in metrics:
            self.latest = float(metrics[self.name])

    def pair(self, step: int) -> tuple[int, float] | None:
        """Pair the latest training value with the evaluation at `step`; returns the pair (None: nothing yet)."""
        if self.name is None or self.latest is None:
            return None
        self.series.append((step, self.latest))
        return self.series[-1]


@dataclass
class TrainResult:
    status: Status
    steps: int
    metrics: dict[str, float]  # the last evaluation
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    logs: list[dict[str, float]] = field(default_factory=list)
    wall_time_s: float = 0.0
    reproducibility: dict[str, Any] = field(default_factory=dict)
    stop_reason: dict[str, Any] | None = None  # set when the trainer's own fast-fail rules stopped it


def accumulate_gradients(model: Callable[[torch.Tensor], torch.Tensor],
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]], n_micro: int,
                         precision: Precision,
                         defer_sync: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
                         ) -> torch.Tensor:
    """Forward and backward over `n_micro` micro-batches; returns their mean loss as a device tensor (no sync).

    Each micro-batch's loss is divided by `n_micro` so that the summed gradients equal those of one batch of
    `n_micro` times the size: the learning rate means the same whatever the accumulation. `defer_sync`: entered
    around every micro-batch but the last (DDP's `no_sync`: the ranks' gradients are averaged once per step, not
    once per micro-batch).
    """
    total = None
    for i, (x, y) in enumerate(micro_batches):
        with defer_sync() if i < n_micro - 1 else contextlib.nullcontext():
            with precision.autocast():
                out = model(x)
            loss = loss_fn(as_fp32(out), y)
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
        """Asked after every log and evaluation step (`metrics`: that evaluation's, else None). None: not now. A
        `CheckpointWriteError` where no checkpoint can be written there (the machine's fault, as a failed write)."""

    def saved(self, info: CheckpointInfo, metrics: Mapping[str, float] | None) -> None:
        """Told after a checkpoint is safely on disk."""


@dataclass
class Run:
    """What one run is made of, decided and built once before the loop: nothing in the loop picks a device, a
    precision or a data path. `build_run` makes one from a config."""

    config: TrainingConfig
    task: Task
    fast_fail: FastFailConfig  # resolved for this run's max_steps
    stages: tuple[int, ...]  # the steps at which the curriculum changes stage: fast-fail gives each a grace period
    device: torch.device
    model: nn.Module  # what is evaluated and saved
    forward: Callable[[torch.Tensor], torch.Tensor]  # what runs the training steps: `model`, compiled when asked
    begin_step: Callable[[], None]  # marks where an optimizer step begins, for CUDA graphs; does nothing without them
    optimizer: torch.optim.Optimizer
    precision: Precision
    val: tuple[torch.Tensor, torch.Tensor]  # on the device
    batches: DeviceData | LoaderData
    guard: LossGuard
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # a micro-batch's training loss (`padded_loss`)
    stats: Callable[[], dict[str, float]]  # the device's metrics at a log step (none on a CPU)
    settle: Callable[[], None]  # waits for the steps queued on the device (CUDA), else does nothing
    ranks: Ranks = field(default_factory=Ranks)  # the data-parallel group (trainer.distributed); one process: Ranks()
    # entered around each micro-batch but a step's last: DDP's no_sync with several ranks, else nothing
    defer_sync: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # a resumed run's evaluations before


def build_run(config: TrainingConfig, task: Task, ranks: Ranks | None = None) -> Run:
    """Seed, then build the model, optimizer, precision and batches of `config` on its device, in a fixed order: the
    model's initial weights come from the seeded RNG. With `ranks` (a data-parallel group), this rank's device, DDP
    around the model, and this rank's share of every global batch."""
    ranks = ranks if ranks is not None else Ranks()
    ranks.check_batch(config)
    fast_fail = config.fast_fail.resolved(config.max_steps, config.eval_every_steps)
    stages = stage_starts(config.curriculum, config.max_steps)
    device = ranks.device(resolve_device(config.device))
    seed_everything(config.seed, deterministic=config.deterministic)
    allow_tf32(device, config.deterministic)
    model = task.build(config.model, device)
    # The compiled module runs the training steps. `model`, whose parameters it shares, is what is evaluated (eval
    # shapes and inference mode would each cost a recompile) and saved: keys without `_orig_mod.`, loadable without it.
    # With several ranks DDP runs the steps (it averages the gradients in backward), compiled around it when asked.
    train_model = ranks.wrap(model)
    forward = torch.compile(train_model, mode=config.compile_mode) if config.compile else train_model
    # CUDA graphs (the modes that use them) must be told where an optimizer step begins (once, not per micro-batch:
    # accumulated gradients must outlive the micro-batch), so that they may reuse the memory of the last step's
    # outputs; with no graphs the call would do nothing, and it is chosen here, not per step.
    graphs = config.compile_mode in ("reduce-overhead", "max-autotune") and device.type == "cuda"  # implies compile
    optimizer = build_optimizer(model, config, device)
    precision = resolve_precision(config.mixed_precision, device)
    val_inputs, val_targets = task.val
    # The curriculum's (or the whole set's) batches: on the device, or gathered by loader workers when the set does
    # not fit there; with several ranks, this rank's slice of each.
    batches = build_batches(config, task, device, ranks.shard)
    loss = padded_loss(task, ranks) if ranks.world > 1 and holds_padding(task) else task.checked_loss
    return Run(config=config, task=task, fast_fail=fast_fail, stages=stages, device=device, model=model, loss=loss,
               forward=forward, begin_step=torch.compiler.cudagraph_mark_step_begin if graphs else _nothing,
               optimizer=optimizer, precision=precision, val=(val_inputs.to(device), val_targets.to(device)),
               batches=batches, stats=device_stats(device),  # peak memory, GPU utilisation: nothing on a CPU
               guard=LossGuard(fast_fail, device, stages),
               settle=_synchronize(device) if device.type == "cuda" else _nothing, ranks=ranks,
               defer_sync=ranks.defer_sync(train_model, compiled=config.compile))


def holds_padding(task: Task, rows: int = 65536) -> bool:
    """Whether the task's loss leaves some of its training targets out of its mean (cross entropy's -100 padding,
    `Task.loss_weight`): one pass over the targets, once per run, `rows` samples at a time (memory-mapped targets
    larger than memory are never read whole), until the first padding."""
    targets = task.train[1]
    for start in range(0, len(targets), rows):
        part = targets[start:start + rows]
        kept = task.loss_weight(part)
        if not isinstance(kept, torch.Tensor):  # a loss that counts every target: no padding to weigh
            return False
        if int(kept) != part.numel():
            return True
    return False


def padded_loss(task: Task, ranks: Ranks) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A data-parallel rank's training loss for a task with padding: the sum over its slice's kept targets, times the
    ranks, over the kept targets of the whole global batch (one small all-reduce per micro-batch, on the device).
    DDP averages the ranks' gradients, which makes the gradient of the global batch's mean over its kept targets,
    as one device computes it; each rank's own mean, averaged, weighed a slice with few kept targets as much as one
    with many (7e-3 relative off one device's values after 100 steps, with half the targets padding; review). The
    logged `train_loss`, the ranks' mean, is the global batch's mean too."""
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        kept = task.loss_weight(y)
        assert isinstance(kept, torch.Tensor)  # `holds_padding`: the loss counts its kept targets
        return Task.weighted(task.checked_loss(out, y), kept) * ranks.world / ranks.total(kept)

    return loss


def train(config: TrainingConfig, task: Task | None = None, reporter: Reporter | None = None, *,
          resume: TrainState | None = None, warm_start: WarmStart | None = None,
          checkpointer: Checkpointer | None = None, ranks: Ranks | None = None) -> TrainResult:
    """Train one config. `task` defaults to `config.task`; pass one to reuse loaded data across runs.

    With no `reporter`, or one whose `decides` attribute is False (it only shows the values), the fast-fail rules
    decide locally (on val_loss); a sweep passes a reporter that asks the study's pruner instead. `resume` continues
    exactly from a checkpoint's state: the remaining steps reproduce the uninterrupted run loss for loss.
    `warm_start` starts from another run's weights (and optionally its optimizer state) at that run's step: this
    config's own schedule, seed and data order take over from there, and the starting point is evaluated and
    reported first.

    `ranks`: this process's place in a data-parallel group (`trainer.distributed`); every rank calls `train` with the
    same config and start, only rank 0's `reporter` is asked and only rank 0's `checkpointer` writes (pass None on
    the others), and all ranks stop at the same step.
    """
    if resume is not None and warm_start is not None:
        raise ValueError("pass resume (continue this run) or warm_start (start from another run), not both")
    with kept_global_state(), _threads_of_run(resume):
        return _train(config, task, reporter, resume, warm_start, checkpointer, ranks)


@contextlib.contextmanager
def _threads_of_run(resume: TrainState | None) -> Iterator[None]:
    """A resumed run trains on the intra-op thread count its checkpoint was written with (a worker of `--workers N`
    runs on fewer than one alone, and a CPU sums in another order on another count), unless this machine has fewer
    cores; this process's count comes back afterwards."""
    before = torch.get_num_threads()
    wanted = None if resume is None else resume.loop.threads
    if wanted is None or wanted == before or wanted > usable_cores():
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train(config: TrainingConfig, task: Task | None, reporter: Reporter | None, resume: TrainState | None,
           warm_start: WarmStart | None, checkpointer: Checkpointer | None, ranks: Ranks | None) -> TrainResult:
    started = time.perf_counter()
    task = task if task is not None else load_task(config.task, config.task_args)
    run = build_run(config, task, ranks)
    reporter, local = deciding(reporter, run.fast_fail, run.stages)
    result = TrainResult("completed", 0, {}, reproducibility=reproducibility_record(
        config.seed, run.device, deterministic=config.deterministic, data=task.data_digest()))
    if run.ranks.world > 1:
        result.reproducibility["ranks"] = run.ranks.world
    try:
        # Where the steps begin: this run's checkpoint, another run's weights, or step 0.
        loop, first_step = LoopState(), 0
        if resume is not None:
            loop, first_step = _restore(run, resume), resume.step
            result.steps, result.metrics = resume.step, dict(resume.metrics)
            run.history = [e for e in resume.evals if e[0] <= resume.step]
            if local is not None:
                local.resumed(run.history)
        elif warm_start is not None or run.fast_fail.enabled:
            if warm_start is not None:
                _load_warm_start(run, warm_start)
                first_step = result.steps = warm_start.state.step
            # 0. Evaluate before the first step. Warm, that is the run's first report: the donor's value, on this run's
            #    validation set. With fast-fail on, it is a reference value over the whole validation set (not one
            #    noisy batch) for the explosion rule, and NaN in the data is caught before any training.
            stopped = _evaluate_and_report(run, reporter, result, first_step)
            run.guard.arm(result.metrics["val_loss"])
            if stopped:
                return _finish(result, local, started, "stopped")
        status = _train_steps(run, loop, first_step, reporter, result, checkpointer)
    except RuntimeError as exc:
        if (explained := task.explained(exc, run.model)) is None:
            raise
        raise explained from exc
    finally:
        run.batches.close()  # a loader's workers stop here, not when the garbage collector gets to them
    return _finish(result, local, started, status)


def _restore(run: Run, resume: TrainState) -> LoopState:
    """Continue where a checkpoint of this run left off: weights, optimizer, grad scaler, data position, every RNG and
    the fast-fail guard, exactly. Returns the loop's running values."""
    run.model.load_state_dict(resume.model)
    run.optimizer.load_state_dict(resume.optimizer)
    run.precision.scaler.load_state_dict(resume.scaler)
    run.batches.load_state_dict(resume.data)
    restore_rng(resume.rng)
    run.guard.threshold = resume.loop.guard_threshold
    return resume.loop


def _load_warm_start(run: Run, warm_start: WarmStart) -> None:
    """Another run's weights (strict: a donor of another shape is refused here too), and its optimizer moments when
    asked; this run's own hyperparameters, schedule, seed and data order stay."""
    run.model.load_state_dict(warm_start.state.model)
    if warm_start.optimizer:
        load_optimizer_moments(run.optimizer, warm_start.state.optimizer)


def _train_steps(run: Run, loop: LoopState, first_step: int, reporter: Reporter, result: TrainResult,
                 checkpointer: Checkpointer | None) -> Status:
    """The loop, from `first_step` to `max_steps`: "stopped" when the reporter stopped it early."""
    config, model, optimizer, precision, batches, guard = (run.config, run.model, run.optimizer, run.precision,
                                                          run.batches, run.guard)
    accum = config.gradient_accumulation_steps
    check_every = run.fast_fail.check_every_n_steps or config.log_every_steps
    interval = _LogInterval(loop, run.device, run.settle)
    poll = _poller(reporter)
    done = first_step
    model.train()
    for step in range(first_step, config.max_steps):
        if poll is not None:
            poll(step)
        done = step + 1
        log_now = done % config.log_every_steps == 0 or done == config.max_steps
        eval_now = done % config.eval_every_steps == 0 or done == config.max_steps

        run.begin_step()
        lr = lr_at(step, config)
        set_lr(optimizer, lr)
        micro = (batches.next(step) for _ in range(accum))
        step_loss = accumulate_gradients(run.forward, run.loss, micro, accum, precision, run.defer_sync)
        grad_norm = optimizer_step(model, optimizer, precision, config.gradient_clip_norm, want_norm=log_now)
        interval.add(step_loss)
        guard.observe(step_loss, done)  # on the device: no sync

        if log_now:
            record = _log_record(run, interval, step, lr, grad_norm)
            result.logs.append(record)
            reporter.log(done, record)
            interval.restart()

        # 1. Between evaluations, a NaN/Inf or exploding training loss trips the guard; reading it costs one sync per
        #    check interval. A tripped guard brings the next evaluation forward, and the reporter (the pruner)
        #    decides on its value, so there is one place of truth.
        #    With several ranks, the guard of any rank brings it forward on all (one small collective per check).
        tripped = run.fast_fail.enabled and not eval_now and done % check_every == 0 and \
            run.ranks.agree(guard.tripped())
        if eval_now or tripped:
            with allowed_sync():
                extra = {"train_loss": run.ranks.mean(step_loss).item()} if tripped else {}
            with interval.paused():
                stop = _evaluate_and_report(run, reporter, result, done, extra)
            guard.reset()
            if stop and done < config.max_steps:  # at the last step there is nothing left to save
                result.steps = done
                return "stopped"
        if log_now or eval_now:
            with interval.paused():
                _checkpoint(run, checkpointer, done, result.metrics if eval_now else None, interval, result)
    result.steps = done
    return "completed"


class _LogInterval:
    """The log interval under way: the training loss summed on the device (read back once, at the log step), the
    steps in that sum, and when its training time began."""

    def __init__(self, loop: LoopState, device: torch.device, settle: Callable[[], None]) -> None:
        self.loss_sum = torch.full((), loop.loss_sum, device=device)
        self.steps = loop.steps_since_log
        self.settle = settle
        self.began = time.perf_counter()

    def add(self, step_loss: torch.Tensor) -> None:
        self.loss_sum += step_loss
        self.steps += 1

    def restart(self) -> None:
        self.loss_sum.zero_()
        self.steps, self.began = 0, time.perf_counter()

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.began, 1e-9)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Evaluation and checkpoint time is not training throughput: it is left out of the log interval it falls
        in, whether or not that interval ends at this step. The steps queued on the device finish first, inside the
        interval (evaluation would wait for them anyway)."""
        self.settle()
        paused_at = time.perf_counter()
        try:
            yield
        finally:
            self.began += time.perf_counter() - paused_at

    def state(self, guard_threshold: float | None) -> LoopState:
        """What a checkpoint holds of the loop: reads the loss sum back from the device."""
        with allowed_sync():
            return LoopState(self.loss_sum.item(), self.steps, guard_threshold, torch.get_num_threads())


def _log_record(run: Run, interval: _LogInterval, step: int, lr: float,
                grad_norm: torch.Tensor | None) -> dict[str, float]:
    """The metrics of a log step, after optimizer step `step` (0-based): the interval's one read-back."""
    with allowed_sync():
        values = torch.stack([run.ranks.mean(interval.loss_sum) / interval.steps,  # the global batch's mean
                              grad_norm if grad_norm is not None else torch.zeros((), device=run.device)]).tolist()
    samples_per_s = interval.steps * run.config.batch_size * run.config.gradient_accumulation_steps / interval.elapsed()
    record = {"step": step + 1, "train_loss": values[0], "lr": lr, "grad_norm": values[1],
              "samples_per_s": samples_per_s,
              "curriculum_level": run.batches.level_at(step)}  # a function of the step: no read-back
    if run.task.tokens_per_sample:
        record["tokens_per_s"] = samples_per_s * run.task.tokens_per_sample
    record.update(run.stats())
    return record


def _poller(reporter: Reporter | None) -> Callable[[int], None] | None:
    """The reporter's optional `poll(step)` (see `Reporter`), or None."""
    poll = getattr(reporter, "poll", None)
    return poll if callable(poll) else None


def _evaluate_and_report(run: Run, reporter: Reporter, result: TrainResult, step: int,
                         extra: Mapping[str, float] | None = None) -> bool:
    """Evaluate on the whole validation set, record it and report it (with `extra`); True when the reporter says
    stop. With several ranks every rank evaluates (their weights are equal), rank 0 alone reports, and its verdict
    reaches the others: the evaluation's one collective."""
    metrics = evaluate(run.model, run.task, run.val, run.config.eval_batch_size, run.precision)
    result.evals.append((step, metrics))
    result.metrics, result.steps = metrics, step
    return run.ranks.verdict(run.ranks.is_main and reporter.report(step, {**metrics, **(extra or {})}))


@allowed_sync()  # saving reads the whole state back to the host
def _checkpoint(run: Run, checkpointer: Checkpointer | None, step: int, metrics: Mapping[str, float] | None,
                interval: _LogInterval, result: TrainResult) -> None:
    """Save the whole training state when the checkpointer asks for it at this step, and tell it where."""
    if checkpointer is None:
        return
    path = checkpointer.path_for(step, metrics)
    if path is None:
        return
    state = TrainState(step=step, model=run.model.state_dict(), optimizer=run.optimizer.state_dict(),
                       scaler=run.precision.scaler.state_dict(), rng=capture_rng(), data=run.batches.state_dict(),
                       loop=interval.state(run.guard.threshold), config=run.config.to_dict(),
                       metrics=dict(result.metrics), evals=[*run.history, *result.evals])
    checkpointer.saved(save_checkpoint(path, state), metrics)


def load_optimizer_moments(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
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


def deciding(reporter: Reporter | None, config: FastFailConfig,
             stage_starts: tuple[int, ...]) -> tuple[Reporter, FastFailReporter | None]:
    """The reporter a run reports to, and the fast-fail rules that decide for it here, if any: with no study (no
    reporter, or one that does not decide), the rules decide, passing every event on to `reporter`."""
    if reporter is None or not getattr(reporter, "decides", True):
        local = FastFailReporter(config, inner=reporter, stage_starts=stage_starts)
        return local, local
    return reporter, None


def ended(status: Status, local: FastFailReporter | None, result: TrainResult | None = None,
          ) -> tuple[Status, dict[str, Any] | None]:
    """How a run ended, and why where its own rules stopped it. A divergence found at the last evaluation, where
    stopping saves nothing, still ends it "stopped", with its reason, so that whoever reads the result can tell it
    from a run that finished well (review: a run whose last evaluation was NaN printed "completed", no reason); with
    fast-fail off too, from `result`'s last evaluation (its val_loss NaN or infinite: rule "nan" or "inf"; review:
    `sweep best -o` writes fast-fail off, and such a run printed "completed")."""
    verdict = None if local is None else local.verdict
    if status == "completed" and verdict is not None and verdict.rule in DIVERGED:
        status = "stopped"
    if status == "stopped" and verdict is not None:
        return status, verdict.as_dict()
    loss = None if result is None or status != "completed" else result.metrics.get("val_loss")
    if result is not None and isinstance(loss, float) and not math.isfinite(loss):
        return "stopped", {"rule": "nan" if math.isnan(loss) else "inf", "step": result.steps, "value": loss}
    return status, None


def _finish(result: TrainResult, local: FastFailReporter | None, started: float, status: Status) -> TrainResult:
    result.status, reason = ended(status, local, result)
    if reason is not None:
        result.stop_reason = reason
    result.wall_time_s = time.perf_counter() - started
    return result
