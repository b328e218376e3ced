"""`ForecastPruner`: prune a trial when even an optimistic forecast of its curve cannot reach the study's top."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import optuna
from optuna.study import StudyDirection
from optuna.trial import TrialState

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

__all__ = ["ForecastPruner", "minimised"]

Curve = list[tuple[int, float]]


def log_linear_forecast(curve: Curve, at: int) -> float | None:
    """The value at step `at` of a line in log(step) through the later half of `curve` (minimised values), never
    above the curve's best. Optimistic for a power law flattening towards its floor (v = a + b / step^c); not for an
    exponential before its time constant, whose fall still speeds up in log(step): `ForecastPruner` corrects it by
    how far off it was for the study's finished curves. None: fewer than three positive steps to fit."""
    points = [(s, v) for s, v in curve if s > 0 and math.isfinite(v)]
    if len(points) < 3:
        return None
    tail = points[len(points) // 2:] if len(points) >= 6 else points
    x = np.log([s for s, _ in tail])
    y = np.array([v for _, v in tail])
    slope, intercept = np.polyfit(x, y, 1) if np.ptp(x) > 0 else (0.0, float(y.mean()))
    best = min(v for _, v in points)
    return float(min(best, intercept + min(0.0, slope) * math.log(max(at, 1))))


def value_at(curve: Curve, step: int) -> Curve:
    """The curve as reported up to `step`."""
    return [(s, v) for s, v in curve if s <= step]


def minimised(study: optuna.Study, trial: FrozenTrial) -> tuple[float, list[tuple[int, float]]]:
    """The sign that makes the study's metric a loss (-1 when it is maximised), and `trial`'s reports times it, in
    step order: the curve the curve-reading pruners judge."""
    sign = -1.0 if study.direction == StudyDirection.MAXIMIZE else 1.0
    return sign, [(s, sign * v) for s, v in sorted(trial.intermediate_values.items())]


class ForecastPruner(optuna.pruners.BasePruner):
    """Prune a trial when an optimistic forecast of its final value cannot reach the study's current top.

    The forecast fits the trial's own curve (a line in log(step) through the later half of its reported values,
    extrapolated to its last step), then makes it more optimistic by what the study's finished curves teach: for each
    completed trial, the same forecast made from its values up to the same step, and how much better it actually
    ended. The largest such surprise, times `optimism`, is subtracted. A trial is pruned when that forecast is still
    worse than the `top_fraction` quantile of the completed trials' values (the k-th best, k = ceil(top_fraction x n),
    at least 1). So a curve that looks like one that ended well at this step — a two-phase learner on its intermediate
    plateau, once the study has seen one drop — is kept.

    Guard clauses, in order: no reported value; NaN, or an infinity on the wrong side, as the latest value (pruned,
    as Optuna's percentile pruner does); fewer than `n_startup_trials` completed trials; before `n_warmup_steps`;
    fewer than three positive steps to fit. Completed trials' non-finite values are ignored. The last step is the
    trial's `max_steps` (from its `config` user attr, set by sweep), else the longest completed trial's.

    Stateless apart from a cache of the study's surprises per step, dropped when a trial completes.
    """

    def __init__(self, n_startup_trials: int = 5, n_warmup_steps: int = 0, top_fraction: float = 0.25,
                 optimism: float = 1.5) -> None:
        if n_startup_trials < 1:
            raise ValueError(f"n_startup_trials must be >= 1, but got {n_startup_trials=}")
        if n_warmup_steps < 0:
            raise ValueError(f"n_warmup_steps must be >= 0, but got {n_warmup_steps=}")
        if not 0 < top_fraction <= 1:
            raise ValueError(f"top_fraction must be in (0, 1], but got {top_fraction=}")
        if optimism < 1:
            raise ValueError(f"optimism must be >= 1 (1: the largest surprise seen), but got {optimism=}")
        self.n_startup_trials = n_startup_trials
        self.n_warmup_steps = n_warmup_steps
        self.top_fraction = top_fraction
        self.optimism = optimism
        self._surprises: dict[tuple[int, int], float] = {}  # (step, max_steps) -> surprise, for one study state
        self._state: tuple[str, int] | None = None  # (study name, completed trials) the cache holds

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        sign, series = minimised(study, trial)
        if not series:
            return False
        step, latest = series[-1]
        if math.isnan(latest) or latest == math.inf:
            return True
        completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if len(completed) < self.n_startup_trials or step < self.n_warmup_steps:
            return False
        curves = [[(s, sign * v) for s, v in sorted(t.intermediate_values.items()) if math.isfinite(v)]
                  for t in completed]
        finals = sorted(sign * t.value for t in completed if t.value is not None and math.isfinite(t.value))
        if not finals:
            return False
        max_steps = int(trial.user_attrs.get("config", {}).get("max_steps", 0)) or max(
            (c[-1][0] for c in curves if c), default=step)
        own = log_linear_forecast(series, max_steps)
        if own is None:
            return False
        kth_best = finals[max(1, math.ceil(self.top_fraction * len(finals))) - 1]
        return own - self.optimism * self._surprise(study.study_name, curves, step, max_steps) > kth_best

    def _surprise(self, name: str, curves: list[Curve], step: int, max_steps: int) -> float:
        """The most a completed trial ended better than the forecast from its values up to `step`."""
        if self._state != (name, len(curves)):
            self._state, self._surprises = (name, len(curves)), {}
        key = (step, max_steps)
        if key not in self._surprises:
            surprises = [0.0]
            for curve in curves:
                forecast = log_linear_forecast(value_at(curve, step), max_steps)
                if forecast is not None and curve:
                    surprises.append(forecast - curve[-1][1])
            self._surprises[key] = max(surprises)
        return self._surprises[key]
