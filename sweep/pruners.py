"""`FastFailPruner`: the trainer's fast-fail rules as an Optuna pruner, composed with any other pruner."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import optuna
from optuna.study import StudyDirection

from trainer.fast_fail_rules import FastFailConfig, Verdict, judge
from trainer.pacing import curriculum_from_dict, stage_starts

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

__all__ = ["FastFailPruner"]


class FastFailPruner(optuna.pruners.BasePruner):
    """Prune a trial whose values are NaN/Inf, have exploded, or have stopped improving; otherwise ask `then`.

    Stateless: the rules (`trainer.fast_fail.judge`) are applied to the intermediate values Optuna stores for the
    trial, so the answer is the same in any worker, after a restart, on SQLite or PostgreSQL.

    NaN policy: a NaN or an infinity (either sign) as the latest reported value prunes at once, at any step, before
    the warmup and before `then` is asked. A finite value worse than the first is not pruned for that alone: it must
    exceed `loss_explosion_factor` x the initial value (minimised metrics; the explosion rule does not apply to
    maximised ones), or show no `min_improvement_pct` improvement for `patience_steps` while the trial has not yet
    improved its initial value by `learned_pct`.

    Step 0 is the trainer's reference evaluation before any training: fast-fail judges it for NaN/Inf only, and `then`
    is never asked there, so a pruner comparing trials does not prune on initial weights.

    `patience_steps=None` and `warmup_steps=None` are derived from the trial's `max_steps` and `eval_every_steps`
    (read from its `config` user attr): a quarter of the budget (at least three evaluations), and 2% of it.

    Curricula: the steps at which the trial's curriculum changes stage are computed from the same stored config
    (`trainer.curriculum.stage_starts`, a function of the config alone), so a loss that jumps or stalls when a harder
    stage begins gets `stage_grace_steps` (None: two evaluation intervals) before explosion and plateau apply again.
    """

    def __init__(self, then: optuna.pruners.BasePruner | None = None, *, enabled: bool = True,
                 loss_explosion_factor: float | None = 10.0, patience_steps: int | None = None,
                 min_improvement_pct: float = 1.0, learned_pct: float = 50.0, warmup_steps: int | None = None,
                 check_every_n_steps: int | None = None, stage_grace_steps: int | None = None) -> None:
        self.config = FastFailConfig(enabled=enabled, loss_explosion_factor=loss_explosion_factor,
                                     patience_steps=patience_steps, min_improvement_pct=min_improvement_pct,
                                     learned_pct=learned_pct, warmup_steps=warmup_steps,
                                     check_every_n_steps=check_every_n_steps,
                                     stage_grace_steps=stage_grace_steps)
        problems = self.config.problems()
        if problems:
            raise ValueError("; ".join(f"{key}: {message}" for key, message in problems))
        self.then = then

    @property
    def then_name(self) -> str | None:
        return None if self.then is None else type(self.then).__name__

    def verdict(self, series: list[tuple[int, float]], config: Mapping[str, Any], maximize: bool) -> Verdict | None:
        """The fast-fail verdict on a trial's reported `(step, value)` pairs; `config` is its TrainingConfig dict."""
        max_steps = int(config.get("max_steps", 0))
        if max_steps > 0:
            resolved = self.config.resolved(max_steps, int(config.get("eval_every_steps", 1)))
        else:  # a trial not started by sweep: the derived rules have nothing to derive from
            resolved = FastFailConfig(**{**self.config.__dict__, "patience_steps": self.config.patience_steps or 0,
                                         "warmup_steps": self.config.warmup_steps or 0,
                                         "stage_grace_steps": self.config.stage_grace_steps or 0})
        return judge(series, resolved, maximize=maximize, stage_starts=self.stage_starts(config, max_steps))

    @staticmethod
    def stage_starts(config: Mapping[str, Any], max_steps: int) -> tuple[int, ...]:
        """Where the trial's curriculum changes stage. A curriculum the pruner cannot evaluate (a stored config from
        an older version, a user schedule that does not import here) counts as none: the trial itself fails on such
        a curriculum, with the real error, when it starts."""
        if max_steps <= 0:
            return ()
        try:
            return stage_starts(curriculum_from_dict(config.get("curriculum")), max_steps)
        except (TypeError, ValueError):
            return ()

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        series = sorted(trial.intermediate_values.items())
        if not series:
            return False
        maximize = study.direction == StudyDirection.MAXIMIZE
        if self.verdict(series, trial.user_attrs.get("config", {}), maximize) is not None:
            return True
        if self.then is None or series[-1][0] == 0:
            return False
        return self.then.prune(study, trial)
