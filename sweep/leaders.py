"""`LeadersPruner`: prune a trial that is, at some step, worse than every one of the study's leaders was there."""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING

import optuna
from optuna.trial import TrialState

from sweep.forecast import minimised
from sweep.outcomes import ATTR_WARM_START

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

__all__ = ["LeadersPruner", "running_best"]

Curve = list[tuple[int, float]]
Leader = tuple[list[int], list[float], int]  # steps, running bests, learning-rate warmup steps


def _lr_warmup(trial: FrozenTrial) -> int:
    """The trial's learning-rate warmup in steps, from the TrainingConfig sweep stores on it (0 without one)."""
    config = trial.user_attrs.get("config") or {}
    return int(config.get("warmup_steps") or 0) if isinstance(config, dict) else 0


def running_best(curve: Curve) -> tuple[list[int], list[float]]:
    """The steps of `curve` (minimised values, in step order) and its best finite value up to each (inf before the
    first finite one)."""
    steps, bests, best = [], [], math.inf
    for step, value in curve:
        if math.isfinite(value):
            best = min(best, value)
        steps.append(step)
        bests.append(best)
    return steps, bests


class LeadersPruner(optuna.pruners.BasePruner):
    """Prune a trial when its best value up to step s is worse than every one of the study's leaders had at s.

    The leaders are the `n_leaders` completed trials with the best final values. Each one's curve says how good a
    run that ends among the best was at each step; the worst of them at step s (the bar) is the most a trial can lag
    there and still be in their company. A trial whose best value so far is worse than the bar by more than
    `margin_pct` percent of the way the leaders went (the largest of their initial values minus their best ones) is
    pruned: nothing that ended well was ever that far behind at that point. Running bests (each curve's best value
    up to the step) are compared, which noise moves much less than single values. Steps are counted from the end of
    each trial's learning-rate warmup (`warmup_steps` of the `config` user attr sweep stores; 0 without one): a
    trial is compared at its step s with each leader at that leader's warmup + (s - its own warmup), and is not
    judged during its own warmup.

    Safe by construction for shapes the leaders share: a two-phase learner on its intermediate plateau is compared
    with leaders that sat on theirs at the same step (if the study's best trials learn in two phases), a slow starter
    with leaders that started as late. Its limit is the study's experience: a trial slower than every leader was, at
    some step, is pruned even if it would have caught up later. `margin_pct` is the allowance for that and for noise.

    Guard clauses, in order: no reported value; NaN or an infinity on the wrong side as the latest value (pruned, as
    Optuna's percentile pruner does); before `n_warmup_steps` or within its own learning-rate warmup; fewer than
    `n_startup_trials` completed trials; a step some leader has not reached (no value at or before it: a trial is
    never judged beyond the leaders' experience). A leader's value at step s is its latest report at or before s.
    Non-finite values of leaders are ignored. Warm-started trials are not leaders: their curves begin at a donor's
    step, not at their own start. A maximised metric is mirrored.

    Stateless apart from the leaders' running bests, cached per number of completed trials.
    """

    def __init__(self, n_leaders: int = 5, n_startup_trials: int = 5, n_warmup_steps: int = 0,
                 margin_pct: float = 10.0) -> None:
        if n_leaders < 1:
            raise ValueError(f"n_leaders must be >= 1, but got {n_leaders=}")
        if n_startup_trials < 1:
            raise ValueError(f"n_startup_trials must be >= 1, but got {n_startup_trials=}")
        if n_warmup_steps < 0:
            raise ValueError(f"n_warmup_steps must be >= 0, but got {n_warmup_steps=}")
        if not 0 <= margin_pct < 100:
            raise ValueError(f"margin_pct must be a percentage in [0, 100), but got {margin_pct=}")
        self.n_leaders = n_leaders
        self.n_startup_trials = n_startup_trials
        self.n_warmup_steps = n_warmup_steps
        self.margin_pct = margin_pct
        # (study name, completed trials) -> the leaders, and the way they went (the margin's scale).
        self._leaders: tuple[tuple[str, int], list[Leader], float] | None = None

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        sign, series = minimised(study, trial)
        if not series:
            return False
        step, latest = series[-1]
        if math.isnan(latest) or latest == math.inf:
            return True
        learning = step - _lr_warmup(trial)  # steps since its learning rate finished warming up
        if step < self.n_warmup_steps or learning < 0:
            return False
        leaders, way = self.leaders(study, sign)
        if not leaders:
            return False
        bar = -math.inf
        for steps, bests, warmup in leaders:
            i = bisect.bisect_right(steps, learning + warmup)
            if i == 0:
                return False  # a step this leader never reported at or before: beyond the study's experience
            bar = max(bar, bests[i - 1])
        if not math.isfinite(bar):
            return False
        own = min((v for _, v in series if math.isfinite(v)), default=math.inf)
        return own > bar + way * self.margin_pct / 100.0

    def leaders(self, study: optuna.Study, sign: float) -> tuple[list[Leader], float]:
        """The study's leaders (steps, running bests of `sign` x values, learning-rate warmup), and the largest way
        one went from its initial value to its best; no leaders while fewer than `n_startup_trials` trials completed."""
        completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        key = (study.study_name, len(completed))
        if self._leaders is None or self._leaders[0] != key:
            own = [t for t in completed if ATTR_WARM_START not in t.user_attrs and t.value is not None
                   and math.isfinite(t.value) and t.intermediate_values]
            best = sorted(own, key=lambda t: sign * float(t.value))[: self.n_leaders]  # type: ignore[arg-type]
            curves = [[(s, sign * v) for s, v in sorted(t.intermediate_values.items())] for t in best]
            chosen = [(*running_best(curve), _lr_warmup(t)) for t, curve in zip(best, curves)
                      ] if len(completed) >= self.n_startup_trials else []
            firsts = [next((v for _, v in curve if math.isfinite(v)), math.nan) for curve in curves]
            ways = [first - bests[-1] for first, (_, bests, _) in zip(firsts, chosen)]
            self._leaders = (key, chosen, max([w for w in ways if math.isfinite(w)], default=0.0))
        return self._leaders[1], self._leaders[2]
