"""A user's own training loop as a runner: `loop: my_project.train:main` in the study file.

    def main(config, run):
        run.seed_everything()                     # python, numpy, torch: the way the trainer seeds
        model = build(config["model"]).to(run.device)
        state = run.load()                        # None, or what `run.save` stored (a retry's, or a donor's)
        ...
        for step in range(start, config["max_steps"] + 1):
            ...
            if step % 50 == 0:
                run.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step})
                if run.report(step, {"val_loss": val}):
                    return                        # pruned (fast-fail or the study's pruner), or --timeout

`config` is the trial's resolved config as plain data: the study's `fixed` values, then the sampled ones, nested
(`model.hidden` becomes `config["model"]["hidden"]`); the keys are the user's own. `run` is a `Run`.

What the trial's result is: `main`'s return value when it is a number, or the study's metric in a mapping it returns;
otherwise the last value of the metric it reported. A trial told to stop is pruned, whatever `main` returns or
raises after that. A non-finite result fails the trial as diverged; an exception fails it (or, for a fault of the
machine, retries it), as for the built-in trainer. A report that returned True because `--timeout` passed, and a
Ctrl-C or SIGTERM that reached a report, stop the trial as interrupted (queued again, resumed from its newest
save) even when the loop catches the interruption or returns a value. So does one that no report raised into a loop
with a signal handler of its own (which took it, or passed it on to the worker's, and the loop saved and returned)
where the loop returned short of `max_steps`; the handlers the loop installs are put back when it returns.

Checkpoints go through the study's checkpoint service: a `run.save(state)` is written atomically to the study's
checkpoint store, hash-checked and registered, and read back with `torch.load(weights_only=True)` (so a state holds
tensors and plain values: a `state_dict()`, numbers, strings, lists, dicts). Each trial keeps its latest and its best
`keep_top_k` (by the metric reported at the saved step). A retry's `run.load()` returns its lineage's newest state
(and puts every RNG back where it was at that save); with `warm_start` on, a fresh trial's returns its nearest
donor's (same `match` keys, within `max_distance`: any step of the donor's, its newest there), and the loop decides
what to take from it (`run.start` says which).
"""

from __future__ import annotations

import contextlib
import decimal
import hashlib
import inspect
import json
import math
import numbers
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import optuna
import torch

from sweep.client import as_float, whole_step
from sweep.confirm import counted_from_0, warm_lineage
from sweep.objective import (
    Start,
    TrialReporter,
    TrialRun,
    diverged_words,
    metric_value,
    resume_lineage,
    store_config,
    trial_trackers,
    warm_start,
)
from sweep.outcomes import (
    ATTR_CONFIRMS,
    ATTR_FAIL,
    ATTR_LINEAGE,
    ATTR_METRICS,
    ATTR_PRUNE,
    ATTR_REPORT_MS,
    ATTR_REPRO,
    ATTR_SPEED,
    ATTR_STEPS,
    ATTR_STEPS_TRAINED,
    ATTR_WALL,
    ATTR_WARM_START,
    Outcome,
    TimedOut,
    TrialResult,
)
from sweep.signals import (
    FORWARD,
    Preempted,
    caught_stop,
    handled_by_trial,
    hear_taken,
    raise_pending,
    raised_at_once,
    sheltered,
    stop_requested,
    watched_handlers,
)
from trainer.checkpoint import TrainState, restore_rng, save_checkpoint, user_checkpoint
from trainer.imports import import_user_module, no_function
from trainer.loop import Reporter
from trainer.precision import resolve_device
from trainer.seeding import reproducibility_record, seed_everything
from trainer.yaml_file import short_repr

if TYPE_CHECKING:
    import optuna

    from sweep.checkpoints import CheckpointService, TrialCheckpointer
    from sweep.schema import StudySpec

__all__ = ["LoopError", "LoopTrial", "Run", "StopTrial", "load_loop", "loop_value", "save_path", "user_start"]

SHAPE_KEY = "loop"  # a loop's model is its own, not built by sweep: see `loop_shape_key`


def loop_shape_key(params: Mapping[str, Any]) -> str:
    """The shape key of a loop's or command's checkpoints, which sweep cannot find by building the model: the
    searched `model.*` keys' values (a donor must share them: `model.hidden` 8 and 10 would hand over weights that
    no `load_state_dict` takes), besides the study's `match` keys."""
    shaped = {key: params[key] for key in sorted(params) if key.startswith("model.")}
    if not shaped:
        return SHAPE_KEY
    return f"{SHAPE_KEY}:{hashlib.sha256(json.dumps(shaped, sort_keys=True, default=str).encode()).hexdigest()[:40]}"


class LoopError(ValueError):
    """A loop function that cannot be used as written (not importable, not callable), or a report it made wrong."""


class StopTrial(Exception):
    """Raised by `run.report` when the loop reports again after a report returned True (it was told to stop and went
    on). A loop may raise it too, to end early; either way the trial ends as the reports decided (pruned when told
    to stop)."""


def load_loop(name: str) -> Callable[..., Any]:
    """`package.module:function` imported, or `LoopError` in one line. It must take two arguments (config, run)."""
    module_name, _, function = name.partition(":")
    module = import_user_module(module_name, "loop", LoopError)
    found = getattr(module, function, None)
    if not callable(found):
        raise LoopError(no_function(module, module_name, function))
    if inspect.isgeneratorfunction(found) or inspect.iscoroutinefunction(found) or inspect.isasyncgenfunction(found):
        kind = "an async function" if inspect.iscoroutinefunction(found) else "a generator"
        raise LoopError(f"{name} is {kind}: calling it runs none of its body; expected a plain function "
                        "main(config, run) that trains, reports through run.report and returns")
    try:
        inspect.signature(found).bind(None, None)
    except TypeError:
        raise LoopError(f"{name} must take two arguments, (config, run)") from None
    except ValueError:
        pass  # a builtin without a signature: let the call say
    return found


class Run:
    """The handle a loop function gets: report, checkpoints, seed and device.

    - `report(step, metrics)` (or `report(step, val_loss=...)`): validation metrics at `step`, which must hold the
      study's metric. Returns True when the trial must stop (the pruner decided, or `--timeout` passed): return
      from the loop then. A report after that raises `StopTrial`. A step reported again is ignored (with a
      warning): the study keeps a step's first value.
    - `log(step, metrics)`: training metrics (shown live; `samples_per_s` and the like kept on the trial).
    - `save(state, step=None)`: a checkpoint of `state` at `step` (default: the latest reported step).
    - `load()`: the state to start from, or None (see `start`).
    - `start`: None (from scratch), "resume" (a retry: the lineage's newest save) or "warm" (a donor's save);
      `start_step`: the step that save was made at (0 from scratch).
    - `seed`: the trial's seed (the config's `seed`, else 0); `seed_everything()` seeds python, numpy and torch
      with it as the trainer does (the runner has done so once before calling the loop).
    - `device`: the config's `device` resolved (default "auto": cuda if available, else cpu); a worker pinned to a
      GPU sees only that one.
    - `config`, `trial`: the trial's config and number.
    """

    def __init__(self, config: dict[str, Any], reporter: Reporter, metric: str, *, seed: int, device: torch.device,
                 trial: int | None = None, initial: TrainState | None = None,
                 start: Literal["resume", "warm"] | None = None,
                 saver: Callable[[TrainState, Mapping[str, float] | None], None] | None = None) -> None:
        self.config, self.metric, self.seed, self.device, self.trial = config, metric, seed, device, trial
        self.start = start if initial is not None else None
        self.start_step = initial.step if initial is not None else 0
        self._reporter, self._initial, self._saver = reporter, initial, saver
        self.step = self.start_step  # the latest reported step
        # The highest step reached (a loop may report out of order): a resumed run's reached its save's already; a
        # warm one may count its steps from 0 (it took the donor's weights), so only what it reports counts.
        self.highest = self.start_step if self.start == "resume" else 0
        budget = config.get("max_steps")  # a loop's config may have none, or one of its own kind
        self.max_steps = budget if isinstance(budget, int) and not isinstance(budget, bool) else None
        self.metrics: dict[str, float] = {}  # the latest report's
        self.stopped = False  # a report returned True
        self.interrupted: BaseException | None = None  # Ctrl-C or SIGTERM that reached a report or a log
        self.at_once = raised_at_once()  # stops a second signal has raised at once, before this run began
        self.first_step: int | None = None  # this run's first report
        self._steps: set[int] = set()  # the steps this run has reported
        # One report at a time: a loop's threads may report (the reporter's queue of values for the storage is
        # not theirs to share; two threads popped one value and raised IndexError into the loop).
        self._reporting = threading.RLock()
        self._past_budget_warned = False

    def seed_everything(self, *, deterministic: bool = False) -> None:
        seed_everything(self.seed, deterministic=deterministic)

    def log(self, step: int, metrics: Mapping[str, Any] | None = None, /, **values: Any) -> None:
        floats = _floats({**(metrics or {}), **values})
        with self._noting_interruptions():
            self._reporter.log(step, floats)

    def report(self, step: int, metrics: Mapping[str, Any] | None = None, /, **values: Any) -> bool:
        if self.stopped:
            raise StopTrial(f"trial {self.trial}: run.report at step {step} after a report returned True (stop)")
        try:
            step = whole_step(step)
        except ValueError as exc:
            raise LoopError(f"run.{exc}") from None
        if metrics is not None and not isinstance(metrics, Mapping):
            raise LoopError(f"run.report at step {step}: expected the metrics as a mapping or as keywords "
                            f"(run.report({step}, {self.metric}=...)), got {type(metrics).__name__} "
                            f"{str(metrics)[:40]}")
        reported = _floats({**(metrics or {}), **values})
        if self.metric not in reported:
            raise LoopError(f"run.report at step {step}: the study's metric {self.metric!r} is not among "
                            f"{sorted(reported)}")
        with self._reporting:
            if step in self._steps:  # the study keeps a step's first value: the trial's value and the pruner's too
                warnings.warn(f"run.report: step {step} was reported already; its first value is kept", stacklevel=2)
                return self.stopped
            self._steps.add(step)
            budget = self.max_steps
            if budget is not None and step > budget and not self._past_budget_warned:
                self._past_budget_warned = True
                warnings.warn(f"trial {self.trial}: run.report at step {step} is past max_steps={budget}: fast-fail's "
                              f"rules scale with max_steps, so report the steps it counts (an epoch's number where "
                              f"max_steps counts epochs)", stacklevel=2)
            with self._noting_interruptions():
                stop = bool(self._reporter.report(step, reported))
            self.step, self.metrics = step, reported  # reported: an interruption raised above leaves it out
            self.highest = max(self.highest, step)
            if self.first_step is None:
                self.first_step = self.step
            self.stopped = self.stopped or stop
            return self.stopped

    @contextlib.contextmanager
    def _noting_interruptions(self) -> Iterator[None]:
        """A Ctrl-C or SIGTERM raised at a report is kept: a loop that catches it (or a thread of its that reported)
        still ends the trial as interrupted."""
        try:
            hear_taken()  # a stop its own signal handler took, which the reporter raises here as any other
            # Asked to stop, and the loop caught it and went on (a second Ctrl-C raised in its own code, or one
            # raised at an earlier report): stop here, at each report from now on (review: the trial trained its
            # whole budget on).
            if (stop := self.interrupted or caught_stop(self.at_once)) is not None:
                raise type(stop)()
            yield  # a request not raised yet is raised by the reporter, at this clean point
        except (KeyboardInterrupt, Preempted) as exc:
            self.interrupted = self.interrupted or exc
            raise

    def save(self, state: Mapping[str, Any], step: int | None = None) -> None:
        """Checkpoint `state` (tensors and plain values) at `step`, with every RNG's state. Without checkpoints (an
        in-memory study, or checkpoints off) nothing is written."""
        if self._saver is None:
            return
        try:
            at = self.step if step is None else whole_step(step, "save")
        except ValueError as exc:
            raise LoopError(f"run.{exc}") from None
        metrics = self.metrics if at == self.step and self.metrics else None
        with sheltered():  # the checkpoint's file and row, whole
            self._saver(user_checkpoint(at, state, self.config, metrics), metrics)

    def load(self) -> dict[str, Any] | None:
        """The saved state to start from, or None. A resume also puts every RNG back where it was at that save."""
        if self._initial is None:
            return None
        if self.start == "resume":
            restore_rng(self._initial.rng)
        return dict(self._initial.user)


def _unraised_stop(run: Run) -> BaseException | None:
    """The Ctrl-C or SIGTERM asked for (and not raised into the loop) by the time the loop returned, where the loop
    set a handler of its own (`handled_by_trial`: it may have heard the stop and returned early on it) and did not
    report its last step (`max_steps`), as an exception to raise; else None. A loop without `max_steps` has no last
    step: its trial is stopped, and its retry resumes from its newest save. A loop without a handler of its own hears
    of a stop only at a report, which raises it: one that returned without that had finished (diff review: a
    SIGTERM during its final save threw away a finished trial)."""
    kind = stop_requested()
    budget = run.max_steps
    if kind is None or not handled_by_trial() or (budget is not None and run.highest >= budget):
        return None
    return kind()


def _floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Metric values as floats (a 0-d tensor or a numpy number too); a value that is not one fails loudly."""
    out = {}
    for key, value in metrics.items():
        try:
            raw = value.item() if isinstance(value, torch.Tensor) else value
            if isinstance(raw, (bool, np.bool_, str, bytes)):  # float() takes them: a comparison's True would be 1.0
                raise TypeError
            out[str(key)] = as_float(raw)
        except (TypeError, ValueError, RuntimeError):
            raise LoopError(f"metric {key!r}: expected a number, got {type(value).__name__}"
                            + (f" ({value!r})" if isinstance(value, (bool, np.bool_, str)) else "")) from None
    return out


def loop_value(returned: Any, run: Run) -> float | None:
    """The trial's value: `main`'s return when it is a number (a tensor or array holding one number too), the metric
    of a mapping it returns, else the last reported value of the metric; None when there is none."""
    value = returned_value(returned, run.metric)
    if value is not None:
        return value
    return metric_value(run.metrics, run.metric) if run.metric in run.metrics else None


def returned_value(returned: Any, metric: str) -> float | None:
    """The value `main` returned, when it returned one (see `loop_value`). A mapping's metric counts as NaN when
    the mapping's `val_loss` is a number that is NaN or infinite, as a report's does (`metric_value`): a diverged
    trial returned as finished is still diverged (review: it completed, and could be the best)."""
    if isinstance(returned, Mapping) and metric in returned:
        value = _floats({metric: returned[metric]})[metric]
        loss = returned.get("val_loss") if metric != "val_loss" else None
        try:
            return metric_value({metric: value, **_floats({"val_loss": loss})}, metric) if loss is not None else value
        except LoopError:  # a val_loss that is not a number says nothing of the metric
            return value
    if isinstance(returned, (torch.Tensor, np.ndarray)):  # one number in it is that number; more are none
        count = returned.numel() if isinstance(returned, torch.Tensor) else returned.size
        returned = returned.item() if count == 1 else None
    # A Decimal is a number to `run.report` too (review: returned, it was "not a number", or dropped for the last
    # report)
    if isinstance(returned, (numbers.Real, np.number, decimal.Decimal)) and not isinstance(returned, (bool, np.bool_)):
        return _floats({metric: returned})[metric]
    return None


def _diverged_by_loss(returned: Any, metric: str) -> str | None:
    """What made a returned mapping's finite metric NaN (`returned_value`): its val_loss, NaN or infinite, said with
    the metric it returned; None where it was not that. Read as numbers are read (a tensor, numpy's, a 400-digit int:
    review, math.isfinite of that raised OverflowError, stored as the trial's failure)."""
    if not isinstance(returned, Mapping) or metric == "val_loss" or "val_loss" not in returned:
        return None
    try:
        numbers = _floats({"val_loss": returned["val_loss"], metric: returned[metric]})
    except LoopError:
        return None
    if math.isfinite(numbers["val_loss"]) or not math.isfinite(numbers[metric]):
        return None
    return f"val_loss {numbers['val_loss']} (with {metric} {numbers[metric]:g})"


def _several_numbers(returned: Any) -> bool:
    """Whether `main` returned what reads as several objectives' values (Optuna's multi-objective return): a tuple
    or list of two numbers or more, or a tensor or array of more than one."""
    if isinstance(returned, (torch.Tensor, np.ndarray)):
        return (returned.numel() if isinstance(returned, torch.Tensor) else returned.size) > 1
    return isinstance(returned, (tuple, list)) and len(returned) > 1 and all(
        isinstance(item, (numbers.Real, np.number, decimal.Decimal)) and not isinstance(item, (bool, np.bool_))
        for item in returned)


class LoopExit(RuntimeError):
    """The loop called `sys.exit` (or its argparse did, on arguments meant for `sweep`): that trial fails, the study
    goes on."""


def _quiet_stops_in_threads() -> None:
    """A thread of the loop whose report raised the trial's stop (Ctrl-C, SIGTERM: `Run._noting_interruptions`; the
    pruner's `StopTrial`) ends there, as the loop's main thread would: the trial's end is said in one line by the
    worker, not by Python's traceback of that thread (review: 15 lines of sweep's own `Preempted`). Signals reach
    only the main thread, so in any other these exceptions come from a report. Installed once, for the process."""
    previous = threading.excepthook
    if getattr(previous, "sweep_quiet_stops", False):
        return

    def hook(args: Any) -> None:
        if not (isinstance(args.exc_value, (KeyboardInterrupt, Preempted, StopTrial))
                and args.thread is not threading.main_thread()):
            previous(args)

    hook.sweep_quiet_stops = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def call_loop(function: Callable[..., Any], config: dict[str, Any], run: Run) -> Any:
    """Call the loop; a `StopTrial` it lets through is an ordinary end. `sys.exit` inside it fails the trial, as
    any exception does, instead of ending the worker with its trial left running. Signal handlers it installs are
    put back when it returns: the worker's own answer Ctrl-C and SIGTERM again between trials; a stop they took in
    its place while it ran is the trial's stop all the same (`watched_handlers`)."""
    _quiet_stops_in_threads()
    try:
        with _kept_signal_handlers():
            return function(config, run)
    except StopTrial:
        return None
    except SystemExit as exc:
        hint = " (argparse's parse_args() reads sweep's own command line: take the values from config)" \
            if exc.code == 2 else ""
        raise LoopExit(f"the loop called sys.exit({exc.code!r}){hint}") from exc


@contextlib.contextmanager
def _kept_signal_handlers() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # only the main thread can set them
        yield
        return
    signums = {signal.SIGINT, signal.SIGTERM, *FORWARD.values()}
    before = {signum: signal.getsignal(signum) for signum in signums}
    try:
        with watched_handlers():  # a stop they take in place of the worker's is still heard
            yield
    finally:
        for signum, handler in before.items():
            if handler is not None and signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)


class LoopTrial(TrialRun):
    """One trial of a user's loop function, from its params to its result; `release` hands its checkpoints back."""

    def run(self) -> TrialResult:
        trial, spec = self.trial, self.spec
        assert spec.loop is not None
        function = load_loop(spec.loop)
        params = spec.suggest(trial)
        self.events.trial_started(trial.number, params)
        config = spec.user_config(params)
        store_config(trial, config)
        start = self._start(params, config)
        self.trackers = trial_trackers(spec, self.storage_url, trial, params, config, start.prior)
        reporter = TrialReporter(trial, spec, config, self.events, self.boundary, start.prior, deadline=self.deadline,
                                 judged=ATTR_CONFIRMS not in trial.user_attrs,  # a cold confirmation is never pruned
                                 trackers=self.trackers, answers_deadline=True, curves=start.curves)
        seed, device = loop_seed(config), resolve_device(str(config.get("device", "auto")))
        initial = start.resume if start.resume is not None else start.warm.state if start.warm is not None else None
        run = Run(config, reporter, spec.metric, seed=seed, device=device, trial=trial.number, initial=initial,
                  start="resume" if start.resume is not None else "warm" if start.warm is not None else None,
                  saver=self._save if self.checkpointer is not None else None)
        seed_everything(seed)
        started = time.perf_counter()
        pruned_itself: optuna.TrialPruned | None = None
        with self.boundary.no_wait():  # the storage going away pauses nothing: the reports wait (see TrialReporter)
            try:
                returned = call_loop(function, config, run)
            except optuna.TrialPruned as exc:  # Optuna's idiom for a rule of the loop's own: pruned, not failed
                pruned_itself, returned = exc, None
            except Exception:
                if (run.interrupted is None and raised_at_once() == run.at_once and not reporter.timed_out
                        and reporter.prune_reason is None):
                    raise
                returned = None  # what it raised once told to stop (a StopTrial it wrapped, say) changes nothing
        if run.interrupted is None:
            # A second Ctrl-C raises at once, wherever the loop is: one that landed in its own code, which caught it,
            # still stops the trial (review: it completed at a step it never reached, and the run went on). So does
            # one that no report raised into it, where it returned short of its budget: its own signal handler took
            # it (or chained the worker's, as Lightning's does), and it returned early.
            run.interrupted = caught_stop(run.at_once) or _unraised_stop(run)
        if run.interrupted is not None:  # the loop caught it, or a thread of its reported
            raise_pending()  # the same stop, if not raised yet
            raise type(run.interrupted)()
        reporter.flush()
        if reporter.timed_out:  # it was told to stop for --timeout, and has saved what it chose to
            raise TimedOut()
        attrs: dict[str, Any] = {ATTR_REPRO: {**reproducibility_record(seed, device), "loop": spec.loop},
                                 ATTR_METRICS: run.metrics, ATTR_STEPS: run.highest,
                                 ATTR_STEPS_TRAINED: steps_trained(run.first_step, run.highest, start),
                                 ATTR_WALL: round(time.perf_counter() - started, 3), ATTR_REPORT_MS: reporter.report_ms,
                                 ATTR_SPEED: reporter.speed}
        parent = trial.user_attrs.get(ATTR_WARM_START)
        if start.warm is not None and isinstance(parent, dict):  # now it is known where the loop took it from
            attrs[ATTR_LINEAGE] = warm_lineage(parent, run.highest, attrs[ATTR_STEPS_TRAINED])
        elif start.resume is not None and isinstance(parent, dict):  # a warm lineage's retry: its whole lineage's
            reported = [step for step, _ in start.prior] + ([] if run.first_step is None else [run.first_step])
            from_0 = counted_from_0(min(reported, default=None), parent.get("step"))
            attrs[ATTR_LINEAGE] = warm_lineage(parent, run.highest, run.highest if from_0 else None)
        if reporter.prune_reason is not None:
            return TrialResult(Outcome.PRUNED, None, {**attrs, ATTR_PRUNE: reporter.prune_reason})
        if pruned_itself is not None:
            return TrialResult(Outcome.PRUNED, None, {**attrs, ATTR_PRUNE: _pruned_by_the_loop(pruned_itself, run)})
        value = loop_value(returned, run)
        if value is not None and returned_value(returned, spec.metric) is None and _several_numbers(returned):
            warnings.warn(f"trial {trial.number}: the loop returned several numbers ({short_repr(returned)}), and a "
                          f"sweep study has one objective: its value is the last reported {spec.metric!r}, "
                          f"{value:g}", stacklevel=1)
        if value is None and run.first_step is None and start.resume is not None:
            saved = start.resume.metrics  # resumed at its end: the value its last save holds
            value = metric_value(saved, spec.metric) if spec.metric in saved else None
        if value is None:
            what = (f"returned a mapping without it ({', '.join(map(str, returned)) or 'empty'})"
                    if isinstance(returned, Mapping) else "returned none" if returned is None else
                    f"returned a {type(returned).__name__} ({short_repr(returned)}), not a number")
            return TrialResult(Outcome.FAILED, None, {**attrs, ATTR_FAIL: f"the loop reported no {spec.metric!r} and "
                                                      f"{what}"})
        if not math.isfinite(value):
            if returned_value(returned, spec.metric) is None:
                reason = f"diverged: {diverged_words(run.metrics, spec.metric, value)} at step {run.step}"
            else:  # the reports may all have been finite: say where the value came from
                last = run.metrics.get(spec.metric)
                said = _diverged_by_loss(returned, spec.metric) or f"{spec.metric} {value}"
                reason = f"diverged: the loop returned {said}" + (
                    f" (its last report, at step {run.step}, was {last:g})" if isinstance(last, float) else "")
            return TrialResult(Outcome.FAILED, None, {**attrs, ATTR_FAIL: reason})
        return TrialResult(Outcome.COMPLETE, value, attrs)

    def _start(self, params: Mapping[str, Any], config: dict[str, Any]) -> Start:
        start, self.checkpointer = user_start(self.trial, self.spec, self.checkpoints, params, config)
        return start

    def _save(self, state: TrainState, metrics: Mapping[str, float] | None) -> None:
        checkpointer = self.checkpointer
        assert checkpointer is not None
        checkpointer.saved(save_checkpoint(save_path(checkpointer, state.step, metrics), state), metrics)


def _pruned_by_the_loop(exc: optuna.TrialPruned, run: Run) -> dict[str, Any]:
    """The prune reason of a loop that raised `optuna.TrialPruned` itself (a rule of its own, as in an Optuna
    objective): its words, at its latest report."""
    lines = str(exc).strip().splitlines()
    said = lines[0][:200] + ("..." if len(lines[0]) > 200 or len(lines) > 1 else "") if lines else ""
    if run.first_step is None:
        step, value, where = None, None, "before its first report"
    else:
        step, value, where = run.step, run.metrics.get(run.metric), f"at step {run.step}"
    return {"rule": "loop", "step": step, "value": value,
            "message": f"the loop raised TrialPruned {where}" + (f": {said}" if said else "")}


def save_path(checkpointer: TrialCheckpointer, step: int, metrics: Mapping[str, float] | None) -> Path:
    """Where a user's save at `step` goes: a user's loop saves when it chooses (the policy's `on_best` still tracks
    the trial's best; retention keeps the latest and the best `keep_top_k`)."""
    return checkpointer.path_for(step, metrics) or checkpointer.path_at(step)


def user_start(trial: optuna.Trial, spec: StudySpec, checkpoints: CheckpointService | None,
               params: Mapping[str, Any], config: Mapping[str, Any]) -> tuple[Start, TrialCheckpointer | None]:
    """Where a user's loop or command starts, as the trainer's trials do: a retry from its lineage's newest save,
    else (warm start on) a fresh trial from its nearest donor's newest save, else from scratch; and the trial's
    checkpointer (None: no checkpoints, its saves are dropped)."""
    if checkpoints is None or not spec.checkpoints.enabled:
        return Start(), None
    shape_key = loop_shape_key(params)
    checkpointer = checkpoints.checkpointer(trial.number, params, shape_key, 0)
    start = resume_lineage(trial, checkpoints, spec.metric, lambda step: True)
    if start is None and spec.warm_start.enabled and ATTR_CONFIRMS not in trial.user_attrs:  # confirmations: cold
        start = warm_start(trial, spec, checkpoints, params, config, shape_key, ANY_STEP)
    return start or Start(), checkpointer


ANY_STEP = 2**31 - 2  # a loop's donor hands over its newest save, whatever its step (the registry's step is an int32)


def steps_trained(first_step: int | None, highest: int, start: Start) -> int:
    """The steps a loop or command trained itself, from the first and highest steps it reported: after a resume,
    from the resumed step; after a warm start, from the donor's step if it went on from there (its first report is
    past it), else all of them (it took the donor's weights and counted its steps from the start)."""
    if first_step is None:
        return 0
    if start.resume is not None or (start.warm is not None and first_step > start.step):
        return max(0, highest - start.step)
    return highest


def loop_seed(config: Mapping[str, Any]) -> int:
    seed = config.get("seed", 0)
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else 0
