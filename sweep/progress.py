"""What `sweep run` shows while it works: a live line on a terminal, one line per finished trial elsewhere."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any, Protocol

from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console
from rich.live import Live
from rich.text import Text

from sweep.confirm import is_warm
from sweep.outcomes import ATTR_FAIL, LOST_REASON, Outcome, count_key, outcome_of
from trainer.yaml_file import printable

__all__ = ["Events", "LiveProgress", "NoEvents", "describe_outcome", "outcome_text"]


class Events(Protocol):
    """What a progress display hears while a study runs."""

    def trial_started(self, number: int, params: Mapping[str, Any]) -> None: ...
    def trial_log(self, number: int, step: int, metrics: Mapping[str, float]) -> None: ...
    def trial_finished(self, trial: FrozenTrial) -> None: ...


class NoEvents:
    def trial_started(self, number: int, params: Mapping[str, Any]) -> None:
        pass

    def trial_log(self, number: int, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def trial_finished(self, trial: FrozenTrial) -> None:
        pass


def describe_outcome(trial: FrozenTrial) -> str:
    """One line: the state and, for pruned and failed trials, why. The why is the trial's own text (a user's
    exception, as stored): its control characters are printed escaped, so that it cannot clear the terminal."""
    return printable(outcome_text(trial))


def outcome_text(trial: FrozenTrial, *, foreign: bool = False) -> str:
    """`describe_outcome` as stored, control characters and all (for `sweep trials`, whose formats escape them as
    they print). `foreign`:
    a trial of a study sweep did not create, whose failures carry no reason (plain Optuna's `catch`): "failed", not
    lost."""
    attrs = trial.user_attrs
    if trial.state == TrialState.FAIL and ATTR_FAIL not in attrs and (foreign or outcome_of(trial) == Outcome.FAILED):
        return "failed"  # another tool's failure (`outcome_of`): it gave no reason
    if trial.state == TrialState.COMPLETE:
        return f"complete value={trial.value:.6g}"
    if trial.state == TrialState.PRUNED:
        reason = attrs.get("prune_reason")
        reason = reason if isinstance(reason, dict) else {}  # another tool's attr of that name is not sweep's
        if "message" in reason:
            return f"pruned: {reason['message']}"
        if not isinstance(reason, dict) or "rule" not in reason:  # another tool's pruner: no reason kept
            last = max(trial.intermediate_values, default=None)
            return "pruned" if last is None else \
                f"pruned at step {last} (value={_num(trial.intermediate_values[last])})"
        return (f"pruned by {reason.get('rule', '?')} at step {reason.get('step', '?')} "
                f"(value={_num(reason.get('value'))})")
    if trial.state == TrialState.FAIL:
        # Every failure sweep records carries its reason; only Optuna's stale-trial check fails one without it.
        reason = str(attrs.get(ATTR_FAIL, LOST_REASON))
        outcome = outcome_of(trial)
        if outcome is None or outcome == Outcome.FAILED:
            return f"failed: {reason}"
        # Not the config's fault (interrupted, preempted, lost, the machine's): said so, as `outcome` says it.
        return reason if reason.startswith(outcome.value) else f"{outcome.value}: {reason}"
    return trial.state.name.lower()


class LiveProgress:
    """Counts by state, the best value so far, and the running trial's step and loss."""

    def __init__(self, console: Console, n_trials: int, direction: StudyDirection, done: int = 0,
                 best: float | None = None, live: bool | None = None, prefix: str = "",
                 cold_only: bool = False) -> None:
        """`cold_only`: the study's best is the best value reached cold (`warm_start.confirm` on, `study_best`)."""
        self.console = console
        self.cold_only = cold_only
        self.prefix = prefix
        self.n_trials = n_trials
        self.maximize = direction == StudyDirection.MAXIMIZE
        self.counts: Counter[str] = Counter()
        self.done = done
        self.best = best
        self.current: str = ""
        self.last: str = ""
        self.started = time.monotonic()
        self._live = Live(console=console, auto_refresh=True, refresh_per_second=4, transient=True) \
            if (console.is_terminal if live is None else live) else None

    def __enter__(self) -> LiveProgress:
        if self._live is not None:
            self._live.__enter__()
            self._refresh()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def _line(self) -> Text:
        best = "-" if self.best is None else f"{self.best:.6g}"
        counts = " ".join(f"{k} {v}" for k, v in sorted(self.counts.items())) or "none finished yet"
        return Text(f"trials {self.done}/{self.n_trials} · {counts} · best {best} · "
                    f"{time.monotonic() - self.started:.0f}s · {self.current or self.last}")

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._line())

    def trial_started(self, number: int, params: Mapping[str, Any]) -> None:
        self.current = f"trial {number} starting"
        self._refresh()

    def trial_log(self, number: int, step: int, metrics: Mapping[str, float]) -> None:
        loss = metrics.get("train_loss")  # a user's loop may log none
        self.current = f"trial {number} step {step}" + ("" if loss is None else f" loss {loss:.4g}")
        self._refresh()

    def trial_finished(self, trial: FrozenTrial) -> None:
        self.counts[count_key(trial)] += 1
        self.done += 1
        if trial.state == TrialState.COMPLETE and trial.value is not None and not (self.cold_only and is_warm(trial)):
            better = self.best is None or (trial.value > self.best if self.maximize else trial.value < self.best)
            self.best = trial.value if better else self.best
        self.last = f"last: trial {trial.number} {describe_outcome(trial)}"
        self.console.print(f"{self.prefix}trial {trial.number}: {describe_outcome(trial)}", highlight=False,
                           markup=False)
        self.current = ""
        self._refresh()


def _num(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
