"""Fast-fail rules: notice a configuration that is going nowhere within a few percent of its budget.

The rules exist once, here, as a pure function of the values a trial has reported (`judge`). Three callers use it:
the sweep's Optuna pruner (on the values stored in the study, so every worker decides the same), the trainer when it
runs alone, and `LossGuard` in the loop (`trainer.fast_fail`), which decides *when* to look between evaluations
without syncing each step.

NaN policy: a NaN or an infinity (either sign) as the latest value is always a failure ("nan" / "inf"), from the very
first report, warmup or not. A value worse than the first one is not by itself a failure; it fails only once it is
`loss_explosion_factor` times the initial value (minimised metrics), or while the run is still near its initial value
(below) and shows no progress for `patience_steps` ("plateau") or stays there long after a study's learners left
theirs ("stuck").

Overfitting (off by default: `overfit_gap`): a run that has learned may still go wrong by memorising its training
set. "overfit" fails it when, for `overfit_patience_steps`, the validation value has been worse than the training
value by more than `overfit_gap` (in the metric's units), that gap has grown, and validation has not improved on its
best and is now worse than it (by `min_improvement_pct`). A run whose gap grows while its validation value still
improves is healthy (the usual shape of a good run) and is never failed by it. The training values come with the
validation ones (`train_series`: the training counterpart of the metric, `training_metric`, as last logged at or
before each evaluation); without them the rule is silent.

Safe by construction: "plateau" and "stuck" judge only a run that is still *near its initial value*: its best has
covered less than `near_initial_pct` percent of the way from its initial value to the best value the study has seen
(`StudyReference`, derived by `study_reference` from the study's finished curves that moved). A run that has left its
initial value, however slowly it goes on (a two-phase learner sitting on an intermediate plateau, a noisy or converged
curve), is never failed by these rules: comparing it with other runs is the wrapped pruner's job; nor is a run whose
best is already as good as the study's best (one that starts there and sits there would end among the study's best). In
a study none of whose trials has finished with a value (that moved), the way is measured to zero, the best a loss can
be: "near" means "improved by less than `near_initial_pct` percent of the initial value". Without a study (the trainer
alone), "near" means "improved by less than `learned_pct` percent of the initial value" (from an initial value of
exactly 0: not improved at all).
With fewer than `min_learners` learners "stuck" waits at least plateau's patience, and with none it is off.

Curricula: when a harder stage begins the run sees new data at once, and its loss may jump or stall for a while; that
is not a divergence. The steps at which stages begin are a function of the curriculum config alone
(`trainer.pacing.stage_starts`), so callers pass them in and `judge` stays a pure function: for
`stage_grace_steps` after each stage change the explosion and plateau rules hold off (NaN/Inf still fail at once), and
the plateau rule's patience counts from the latest stage change, since a new stage is a new start.

Nothing here imports torch: `trainer.config` holds a `FastFailConfig`, and the sweep's pruner judges stored values,
in processes that need not load torch. `trainer.fast_fail` adds the loop's on-device `LossGuard` and re-exports
all of this.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["DIVERGED", "TRAINING_METRICS", "FastFailConfig", "Rule", "StudyReference", "Verdict", "in_stage_grace",
           "judge", "latest_stage_start", "leave_step", "study_reference", "training_metric"]

Rule = Literal["nan", "inf", "explode", "plateau", "stuck", "overfit"]
DIVERGED: frozenset[str] = frozenset({"nan", "inf", "explode"})  # the rules that say a run diverged


@dataclass(frozen=True)
class FastFailConfig:
    """The fast-fail rules' settings. Steps are optimizer steps; `None` means "derived from max_steps"."""

    enabled: bool = True
    # Explosion: the latest value above this multiple of the initial value (minimised metrics only). None: off.
    loss_explosion_factor: float | None = 10.0
    # Plateau: no improvement of at least `min_improvement_pct` percent over the best within this many steps.
    # None: a quarter of max_steps, and at least three evaluation intervals. 0: off.
    patience_steps: int | None = None
    min_improvement_pct: float = 1.0
    # Without a study to compare with (the trainer alone, or no finished trial better than the run's start): a run
    # whose best has improved on its initial value by this percentage of it has learned, and plateau no longer
    # applies to it.
    learned_pct: float = 50.0
    # In a study: a run is still near its initial value while its best has covered less than this percentage of the
    # way from its initial value to the best value the study's finished trials reported. Only such a run can fail by
    # plateau or stuck; every other one is the wrapped pruner's to judge.
    near_initial_pct: float = 10.0
    # Stuck: a run still near its initial value `learners_factor` x the `learners_quantile` quantile of the steps the
    # study's learners took to leave theirs (counted from the end of its own learning-rate warmup) has not started
    # and will not. With fewer than `min_learners` finished trials that left their initial value, never sooner than
    # plateau's patience; with none (or plateau off and too few), off. None: off.
    learners_factor: float | None = 2.0
    learners_quantile: float = 0.9
    min_learners: int = 5
    # Grace period before the explosion and plateau rules apply. None: 2% of max_steps.
    warmup_steps: int | None = None
    # How often the loop reads its on-device NaN/explosion flag between evaluations. None: at every log step.
    check_every_n_steps: int | None = None
    # Grace period after each curriculum stage change, during which explosion and plateau do not apply.
    # None: two evaluation intervals, so that at least one evaluation of the new stage is seen before judging.
    stage_grace_steps: int | None = None
    # Overfitting: validation worse than training by more than this gap (the metric's units) for
    # `overfit_patience_steps`, the gap growing and validation getting worse. None: off (the default).
    overfit_gap: float | None = None
    # None: the plateau rule's patience (a quarter of max_steps, and at least three evaluation intervals).
    overfit_patience_steps: int | None = None

    def resolved(self, max_steps: int, eval_every_steps: int) -> FastFailConfig:
        """A copy with every `None` step count made concrete for a run of `max_steps`."""
        patience = max(max_steps // 4, 3 * eval_every_steps)
        return FastFailConfig(
            enabled=self.enabled,
            loss_explosion_factor=self.loss_explosion_factor,
            patience_steps=patience if self.patience_steps is None else self.patience_steps,
            min_improvement_pct=self.min_improvement_pct,
            learned_pct=self.learned_pct,
            near_initial_pct=self.near_initial_pct,
            learners_factor=self.learners_factor,
            learners_quantile=self.learners_quantile,
            min_learners=self.min_learners,
            warmup_steps=max_steps // 50 if self.warmup_steps is None else self.warmup_steps,
            check_every_n_steps=self.check_every_n_steps,
            stage_grace_steps=2 * eval_every_steps if self.stage_grace_steps is None else self.stage_grace_steps,
            overfit_gap=self.overfit_gap,
            overfit_patience_steps=patience if self.overfit_patience_steps is None else self.overfit_patience_steps,
        )

    def problems(self) -> list[tuple[str, str]]:
        """Invalid settings as `(key, message)`, keys relative to `fast_fail.`."""
        out = []
        if self.loss_explosion_factor is not None and self.loss_explosion_factor <= 1:
            out.append(("loss_explosion_factor", f"expected a factor > 1 or null, got {self.loss_explosion_factor}"))
        for name in ("patience_steps", "warmup_steps", "stage_grace_steps"):
            value = getattr(self, name)
            if value is not None and value < 0:
                out.append((name, f"expected >= 0 or null, got {value}"))
        if self.check_every_n_steps is not None and self.check_every_n_steps < 1:
            out.append(("check_every_n_steps", f"expected >= 1 or null, got {self.check_every_n_steps}"))
        if not 0 <= self.min_improvement_pct < 100:
            out.append(("min_improvement_pct", f"expected a percentage in [0, 100), got {self.min_improvement_pct}"))
        if self.learned_pct <= 0:
            out.append(("learned_pct", f"expected a percentage > 0, got {self.learned_pct}"))
        if not 0 < self.near_initial_pct <= 100:
            out.append(("near_initial_pct", f"expected a percentage in (0, 100], got {self.near_initial_pct}"))
        if self.learners_factor is not None and self.learners_factor < 1:
            out.append(("learners_factor", f"expected a factor >= 1 or null, got {self.learners_factor}"))
        if not 0 < self.learners_quantile <= 1:
            out.append(("learners_quantile", f"expected a quantile in (0, 1], got {self.learners_quantile}"))
        if self.min_learners < 1:
            out.append(("min_learners", f"expected >= 1, got {self.min_learners}"))
        if self.overfit_gap is not None and not (math.isfinite(self.overfit_gap) and self.overfit_gap >= 0):
            out.append(("overfit_gap", f"expected a gap >= 0 (the metric's units) or null, got {self.overfit_gap}"))
        if self.overfit_patience_steps is not None and self.overfit_patience_steps < 1:
            out.append(("overfit_patience_steps", f"expected >= 1 or null, got {self.overfit_patience_steps}"))
        return out


@dataclass(frozen=True)
class StudyReference:
    """What a study's finished trials say about a new one (`study_reference`).

    `best`: the best value any of them reported (None: none finite). `learners`: how many left their initial value
    (covered `near_initial_pct` of the way to `best`); `learners_step`: the `learners_quantile` quantile of the steps
    they took. `stuck_after`: steps after which a run still near its initial value is stuck (None: fewer than
    `min_learners` learners, or the rule is off)."""

    best: float | None = None
    learners: int = 0
    learners_step: int | None = None
    stuck_after: int | None = None


@dataclass(frozen=True)
class Verdict:
    """Why a trial failed: the rule, the step and value that triggered it, and the reference values."""

    rule: Rule
    step: int
    value: float
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"rule": self.rule, "step": self.step, "value": self.value, **self.detail}

    def message(self) -> str:
        if self.rule in ("nan", "inf"):
            return f"{self.rule} at step {self.step}"
        if self.rule == "explode":  # `of`: the curve it read, where that is not the study's metric (val_loss)
            of = f"{self.detail['of']} " if "of" in self.detail else ""
            start = (f"the value it took over at step {self.detail['handoff']}" if "handoff" in self.detail
                     else "initial")  # a warm trial's: its donor's at the handoff
            return (f"{of}exploded at step {self.step}: {self.value:.4g} > {self.detail['factor']:g} x {start} "
                    f"{self.detail['initial']:.4g}")
        if self.rule == "stuck":
            return (f"stuck at step {self.step}: best {self.detail['best']:.4g} still near initial "
                    f"{self.detail['initial']:.4g} after {self.detail['stuck_after']} steps; the study's learners "
                    f"left theirs within {self.detail['learners_step']} steps")
        if self.rule == "overfit":
            return (f"overfit at step {self.step}: {self.value:.4g} is {self.detail['gap']:.4g} worse than training "
                    f"({self.detail['train']:.4g}), above the gap {self.detail['overfit_gap']:g} since step "
                    f"{self.detail['since']}, while validation fell back from its best {self.detail['best']:.4g} "
                    f"(step {self.detail['best_step']})")
        return (f"plateau at step {self.step}: best {self.detail['best']:.4g} (step {self.detail['best_step']}) "
                f"not improved by {self.detail['min_improvement_pct']:g}% in {self.detail['patience_steps']} steps")


def _improved(value: float, best: float, pct: float, maximize: bool) -> bool:
    gain = value - best if maximize else best - value
    return gain > 0 and gain >= abs(best) * pct / 100.0


def _gain(start: float, value: float, maximize: bool) -> float:
    """How much better `value` is than `start` (negative: worse)."""
    return value - start if maximize else start - value


def _near_initial(initial: float, best: float, config: FastFailConfig, reference: StudyReference | None,
                  maximize: bool) -> bool:
    """Whether a run whose best so far is `best` is still near its `initial` value (module docstring)."""
    gain = _gain(initial, best, maximize)
    if reference is not None and reference.best is None:
        # A study none of whose trials has finished with a value: nothing yet says how far a run can get from its
        # start (on a noisy task the best runs end 20% below it), so the way is measured to zero, the best a loss can
        # be: near means less than `near_initial_pct`% of the way there, as against a study's best.
        return gain < abs(initial) * config.near_initial_pct / 100.0
    if reference is not None and reference.best is not None:
        if _gain(best, reference.best, maximize) <= 0:
            # As good as anything the study finished with (a run that starts there, and sits there): it would end
            # among the study's best, whatever its curve, so it is not going nowhere.
            return False
        return gain < _gain(initial, reference.best, maximize) * config.near_initial_pct / 100.0
    # The trainer alone: improved by less than `learned_pct`% of the initial value; from an initial value of
    # exactly 0 (an accuracy that starts at 0), not improved at all.
    return gain <= 0 if initial == 0 else gain < abs(initial) * config.learned_pct / 100.0


# The training metrics the trainer logs (`Reporter.log`) that have a validation counterpart.
TRAINING_METRICS = ("train_loss",)


def training_metric(metric: str) -> str | None:
    """The training counterpart of a validation metric (`val_loss` -> `train_loss`), or None when it has none."""
    return "train_" + metric.removeprefix("val_") if metric.startswith("val_") else None


def _overfit(finite: Sequence[tuple[int, float]], train_series: Sequence[tuple[int, float]],
             config: FastFailConfig, maximize: bool) -> Verdict | None:
    """The overfitting rule (module docstring) on the latest of `finite` validation values."""
    gap_limit, patience = config.overfit_gap, config.overfit_patience_steps
    if gap_limit is None or not patience or not train_series:
        return None
    train = {s: v for s, v in train_series if math.isfinite(v)}
    step, value = finite[-1]
    if step not in train:
        return None
    # The gap: how much worse validation is than training (validation below training, for a maximised metric).
    gaps = {s: (train[s] - v if maximize else v - train[s]) for s, v in finite if s in train}
    # Since when has the gap stayed above the limit, at every evaluation with a training value?
    since = None
    for s, _ in reversed(finite):
        if s in gaps:
            if gaps[s] <= gap_limit:
                break
            since = s
    if since is None:
        return None
    best_step, best = finite[0]
    for s, v in finite[1:]:
        if _gain(best, v, maximize) > 0:
            best_step, best = s, v
    # The window starts at the later of the two: the gap crossing the limit, validation's best.
    start = max(since, best_step)
    opening = min(s for s in gaps if s >= start)  # the window's first evaluation with a gap
    if step - start < patience or gaps[step] <= gaps[opening]:
        return None
    if not _improved(best, value, config.min_improvement_pct, maximize):  # worse than its best, by more than noise
        return None
    return Verdict("overfit", step, value, {"train": train[step], "gap": gaps[step], "overfit_gap": gap_limit,
                                            "since": since, "best": best, "best_step": best_step,
                                            "overfit_patience_steps": patience})


def _near_band(initial: float, config: FastFailConfig, reference: StudyReference, maximize: bool) -> float | None:
    """How far from its initial value a run is no longer near it, as `_near_initial` measures it in a study with
    a best value better than the run's start; None otherwise."""
    if reference.best is None:
        return None
    distance = _gain(initial, reference.best, maximize)
    return distance * config.near_initial_pct / 100.0 if distance > 0 else None


def _stuck_after(reference: StudyReference | None, config: FastFailConfig) -> int | None:
    """Steps after which a run still near its initial value is stuck (`config` resolved): the study's
    `stuck_after`; with fewer than `min_learners` learners, `learners_factor` x the steps the ones there are took,
    but never sooner than plateau's patience (a creeper, which plateau's `min_improvement_pct` misses, is then
    stopped where a flat run would be); None without learners, with the rule off, or with plateau off and too few
    learners."""
    if reference is None or config.learners_factor is None or reference.learners_step is None:
        return None
    assert config.warmup_steps is not None, "_stuck_after() needs a resolved config"
    if reference.stuck_after is not None:
        return max(reference.stuck_after, config.warmup_steps)
    if not config.patience_steps:
        return None
    return max(math.ceil(config.learners_factor * max(reference.learners_step, 1)), config.patience_steps,
               config.warmup_steps)


def leave_step(series: Sequence[tuple[int, float]], best: float, near_initial_pct: float,
               maximize: bool = False) -> int | None:
    """Steps a run took, from its first finite report, to cover `near_initial_pct` of the way from its initial
    value to `best`; None if it never did (or `best` is no better than its start)."""
    finite = [(s, v) for s, v in series if math.isfinite(v)]
    if not finite:
        return None
    start_step, initial = finite[0]
    threshold = _gain(initial, best, maximize) * near_initial_pct / 100.0
    if threshold <= 0:
        return None
    return next((s - start_step for s, v in finite[1:] if _gain(initial, v, maximize) >= threshold), None)


def _moved(series: Sequence[tuple[int, float]], config: FastFailConfig, maximize: bool) -> bool:
    """Whether a finished run's best improved on its initial value by more than noise: `min_improvement_pct`% of
    it (from an initial value of exactly 0: at all), as plateau counts an improvement."""
    finite = [v for _, v in series if math.isfinite(v)]
    if len(finite) < 2:
        return False
    return _improved(max(finite) if maximize else min(finite), finite[0], config.min_improvement_pct, maximize)


def _reached(series: Sequence[tuple[int, float]], maximize: bool) -> float:
    """How far a finished run got: the better of its second best value and its last one. Not its best alone (one
    glitch at one step would be it), not its last alone (a run that overfits ends near its start, and a
    never-learner's noise would then count as learning: review), not its second best alone (a run that improved
    only at its last report, or one of two, would have got nowhere: review)."""
    finite = [v for _, v in series if math.isfinite(v)]
    second = sorted(finite, reverse=maximize)[1]
    return max(second, finite[-1]) if maximize else min(second, finite[-1])


def study_reference(curves: Sequence[Sequence[tuple[int, float]]], config: FastFailConfig, *,
                    maximize: bool = False) -> StudyReference:
    """What finished trials' curves (`(step, value)` pairs each) say about the next run: the best value a run
    reached, and when a run still near its initial value is stuck: `learners_factor` x the `learners_quantile` quantile
    (nearest rank: never below it) of the steps the learners took to leave their initial values.

    "Reached": `_reached`, not a curve's most extreme value. One glitch in one finished trial (a reward reported
    1000 times too high at one step, a loss of -500 once) would otherwise be the study's best, and every later run
    that learned would be "near its start" beside it (pruned as stuck: review).

    Only curves that moved count (`_moved`): a never-learner's noise, 0.05% below its start, would otherwise be "the
    study's best", and every later run that wobbled as much would count as having left its start (a never-learner
    then ran its whole budget, and its retry too: review). A study whose finished runs all sat still knows no more
    than one with none finished."""
    curves = [series for series in curves if _moved(series, config, maximize)]
    values = [_reached(series, maximize) for series in curves]
    if not values:
        return StudyReference()
    best = max(values) if maximize else min(values)
    leaves = sorted(step for series in curves
                    if (step := leave_step(series, best, config.near_initial_pct, maximize)) is not None)
    if not leaves:
        return StudyReference(best=best)
    quantile = leaves[max(0, math.ceil(config.learners_quantile * len(leaves)) - 1)]
    stuck_after = None
    if config.learners_factor is not None and len(leaves) >= config.min_learners:
        stuck_after = math.ceil(config.learners_factor * max(quantile, 1))
    return StudyReference(best=best, learners=len(leaves), learners_step=quantile, stuck_after=stuck_after)


def latest_stage_start(step: int, stage_starts: Sequence[int]) -> int | None:
    """The latest stage change that the value reported at `step` has seen, or None.

    A reported step counts optimizer steps done; a stage that starts at (0-based) step `c` shapes the values reported
    from step `c + 1` on. `stage_starts` is sorted (a binary search: the loop asks at every step)."""
    i = bisect.bisect_left(stage_starts, step)
    return stage_starts[i - 1] if i else None


def in_stage_grace(step: int, stage_starts: Sequence[int], grace_steps: int) -> bool:
    """Whether a value reported at `step` falls within `grace_steps` after a curriculum stage change."""
    start = latest_stage_start(step, stage_starts)
    return start is not None and step - start <= grace_steps


def judge(series: Sequence[tuple[int, float]], config: FastFailConfig, *, maximize: bool = False,
          stage_starts: Sequence[int] = (), reference: StudyReference | None = None,
          lr_warmup_steps: int = 0, train_series: Sequence[tuple[int, float]] = ()) -> Verdict | None:
    """The fast-fail verdict on the latest of `(step, value)` pairs in step order, or None if the trial may go on.

    `config` must be `resolved()`. The initial value is the first finite one: with fast-fail on, the trainer reports
    an evaluation over the whole validation set before the first step, so it is not one noisy batch.
    `stage_starts` are the steps at which a curriculum's stages begin (`trainer.pacing.stage_starts`): the
    explosion and plateau rules give each change a grace period, and patience restarts at it.
    `reference`: what the study's finished trials say (`study_reference`); None: judged alone.
    `lr_warmup_steps`: the run's learning-rate warmup; the plateau and stuck clocks start after it (stuck's also
    after the run's latest value clear above its start, outside the near band: a spike), since a run
    whose learning rate is still ramping up may sit still or rise (a warmup bump) without being broken.
    `train_series`: `(step, training value)` at the evaluation steps, for the overfitting rule (off without them).
    """
    if not config.enabled or not series:
        return None
    step, value = series[-1]
    if math.isnan(value):
        return Verdict("nan", step, value)
    if math.isinf(value):
        return Verdict("inf", step, value)
    finite = [(s, v) for s, v in series if math.isfinite(v)]
    initial_step, initial = finite[0]
    assert config.warmup_steps is not None and config.patience_steps is not None, "judge() needs a resolved config"
    if step < config.warmup_steps or step == initial_step:
        return None
    # A new curriculum stage: the loss may jump while the model meets harder data. NaN/Inf were judged above.
    if in_stage_grace(step, stage_starts, config.stage_grace_steps or 0):
        return None
    stage_start = latest_stage_start(step, stage_starts)

    factor = config.loss_explosion_factor
    if factor is not None and not maximize and initial > 0 and value > factor * initial:
        return Verdict("explode", step, value, {"initial": initial, "factor": factor})

    # Overfitting judges a run that has learned, so it comes before the near-initial gate below.
    overfit = _overfit(finite, train_series, config, maximize)
    if overfit is not None:
        return overfit

    # Plateau and stuck judge only a run still near its initial value: one that has left it is learning, however
    # slowly or unevenly, and only a comparison with other runs (the wrapped pruner) may stop it.
    best_ever = max(v for _, v in finite) if maximize else min(v for _, v in finite)
    if not _near_initial(initial, best_ever, config, reference, maximize):
        return None
    clock = max(initial_step, lr_warmup_steps)

    stuck_after = _stuck_after(reference, config)
    if reference is not None and stuck_after is not None:
        # A run that rose clear above its start (an early spike of a large learning rate) was moving, not sitting
        # there: its stuck clock starts at its latest such value. Noise within the band does not restart it.
        band = _near_band(initial, config, reference, maximize)
        bumps = [s for s, v in finite if band is not None and _gain(initial, v, maximize) < -band]
        if step - max([clock, *bumps]) >= stuck_after:
            detail = {"best": best_ever, "initial": initial, "stuck_after": stuck_after,
                      "learners_step": reference.learners_step, "study_best": reference.best,
                      "learners": reference.learners}
            return Verdict("stuck", step, value, detail)

    if config.patience_steps:
        # Counted from the run's best, not from a spike's top: a never-learner's loss often spikes above its start
        # and comes back to sit there (digits with a large learning rate), and counting its way down as progress let
        # such runs use 12% of their budget where they used 9% (`bench/decisions.py`). The price, in the README: a
        # run that spikes and takes longer than the patience to get back below its start is a plateau.
        best, best_step = initial, initial_step
        for s, v in finite[1:]:
            if _improved(v, best, config.min_improvement_pct, maximize):
                best, best_step = v, s
        # Patience counts from the best value, the latest stage change or the end of warmup, whichever is later.
        since = max(best_step, clock if stage_start is None else max(clock, stage_start))
        if step - since >= config.patience_steps:
            detail = {"best": best, "best_step": best_step, "patience_steps": config.patience_steps,
                                      "min_improvement_pct": config.min_improvement_pct}
            if since != best_step:
                detail["since"] = since
            return Verdict("plateau", step, value, detail)
    return None
