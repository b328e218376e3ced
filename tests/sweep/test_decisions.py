"""FastFailPruner's study-derived decisions through Optuna's public API: the reference it reads from the study's
finished trials, the stuck rule's patience that follows from them, and the same verdict when the objective asks why."""

from __future__ import annotations

import math
from typing import Any

import optuna
import pytest

import sweep.pruners
from sweep.components import build_pruner
from sweep.forecast import ForecastPruner, log_linear_forecast, value_at
from sweep.outcomes import ATTR_WARM_START
from sweep.pruners import FastFailPruner
from sweep.schema import Component, StudyFileError
from tests.sweep.test_pruners import NAN, curve, pruned_step
from tests.trainer.test_fast_fail_rules import HISTORY, STUCK_AFTER, learner, noisy, shaped, two_phase
from trainer.fast_fail_rules import StudyReference

optuna.logging.set_verbosity(optuna.logging.WARNING)

CONFIG = {"max_steps": 1000, "eval_every_steps": 10}
FLAT = shaped(lambda s: 2.3)


@pytest.mark.parametrize(("values", "expected"), [
    pytest.param(FLAT, STUCK_AFTER, id="never-learner-stuck-at-the-study-s-patience"),
    pytest.param(shaped(lambda s: 2.316 - 0.131 * s / 1000), STUCK_AFTER, id="creeper"),
    pytest.param(two_phase(1.2, 600), None, id="two-phase-learner"),
    pytest.param(learner(150, 0.06), None, id="slow-starter"),
])
def test_the_study_s_learners_set_the_patience(values: list[tuple[int, float]], expected: int | None) -> None:
    assert pruned_step(FastFailPruner(), values, history=HISTORY) == expected


def test_without_enough_learners_the_plateau_rule_is_the_floor() -> None:
    assert pruned_step(FastFailPruner(), FLAT, history=HISTORY[:4]) == 250
    # A creeper improves by more than 1% per patience, so plateau alone never stops it; with a few learners in the
    # study, stuck does, no sooner than plateau's patience; with none, nothing does.
    creeper = shaped(lambda s: 2.316 - 0.131 * s / 1000)
    assert pruned_step(FastFailPruner(), creeper, history=HISTORY[:4]) == 250
    assert pruned_step(FastFailPruner(), creeper, history=[[(s, 2.3) for s, _ in FLAT]] * 4) is None
    assert pruned_step(FastFailPruner(patience_steps=0), creeper, history=HISTORY[:4]) is None
    assert pruned_step(FastFailPruner(min_learners=4), FLAT, history=HISTORY[:4]) is not None
    assert pruned_step(FastFailPruner(learners_factor=None), FLAT, history=HISTORY) == 250


def test_the_learning_rate_warmup_starts_the_clock() -> None:
    bump = shaped(lambda s: 2.3 + 0.4 * math.sin(math.pi * s / 300) if s <= 300
                  else 0.05 + 2.25 * 0.97 ** ((s - 300) / 10))
    assert pruned_step(FastFailPruner(), bump, history=HISTORY, config={**CONFIG, "warmup_steps": 300}) is None
    assert pruned_step(FastFailPruner(), bump, history=HISTORY) == 250  # plateau: a run above its start is not stuck


def study_with(history: list[list[tuple[int, float]]], warm: bool = False,
               pruned: bool = False) -> optuna.Study:
    study = optuna.create_study(study_name="decisions")
    for past in history:
        trial = study.ask()
        if warm:
            trial.set_user_attr(ATTR_WARM_START, {"trial": 0, "step": 0})
        for step, value in past:
            trial.report(value, step)
        study.tell(trial, None if pruned else past[-1][1],
                   state=optuna.trial.TrialState.PRUNED if pruned else None)
    return study


def test_the_reference_reads_complete_and_pruned_trials_but_not_warm_started_ones() -> None:
    assert FastFailPruner().reference_for(study_with(HISTORY)).stuck_after == STUCK_AFTER
    assert FastFailPruner().reference_for(study_with(HISTORY, pruned=True)).stuck_after == STUCK_AFTER
    warm = FastFailPruner().reference_for(study_with(HISTORY, warm=True))
    assert warm.learners == 0 and warm.stuck_after is None


def test_the_reference_is_computed_once_per_number_of_finished_trials(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = sweep.pruners.study_reference

    def counted(*args: Any, **kwargs: Any) -> StudyReference:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep.pruners, "study_reference", counted)
    pruner = FastFailPruner()
    study = study_with(HISTORY)
    study.pruner = pruner
    for _ in range(2):
        trial = study.ask()
        trial.set_user_attr("config", CONFIG)
        for step, value in learner(0, 0.1)[:30]:
            trial.report(value, step)
            assert not trial.should_prune()
        study.tell(trial, 0.1)
    assert len(calls) == 2  # one per number of finished trials (10, then 11), not one per report


def test_the_objective_s_explanation_without_the_study_matches_the_decision() -> None:
    # The objective asks `verdict(series, config, maximize)` after should_prune() said yes: it gets the same verdict.
    pruner = FastFailPruner()
    study = study_with(HISTORY)
    study.pruner = pruner
    trial = study.ask()
    trial.set_user_attr("config", CONFIG)
    series = []
    for step, value in FLAT:
        trial.report(value, step)
        series.append((step, value))
        if trial.should_prune():
            break
    verdict = pruner.verdict(series, CONFIG, maximize=False)
    assert verdict is not None and verdict.rule == "stuck" and verdict.step == STUCK_AFTER
    assert "the study's learners left theirs within 100 steps" in verdict.message()


def test_a_wrapped_pruner_that_never_prunes_leaves_the_never_learner_to_fast_fail() -> None:
    assert pruned_step(FastFailPruner(then=optuna.pruners.NopPruner()), FLAT, history=HISTORY) == STUCK_AFTER
    assert pruned_step(FastFailPruner(then=optuna.pruners.NopPruner()), curve([2.3, 1.5, 1.2, 1.1]),
                       history=HISTORY) is None


# ForecastPruner: against HISTORY's completed trials (finals 0.05 to 0.8; the top quarter's bar, the 3rd best, 0.102).
TOP_TWO_PHASE = two_phase(1.2, 400, final=0.01)  # ends at 0.065: a top-quarter finisher


@pytest.mark.parametrize(("values", "history", "expected"), [
    pytest.param(learner(0, 0.03, rate=0.93), HISTORY, None, id="the-best-curve"),
    pytest.param(noisy(learner(0, 0.03, rate=0.93), 0.15), HISTORY, None, id="the-best-curve-noisy"),
    pytest.param(learner(0, 0.8, rate=0.93), HISTORY, 120, id="a-curve-like-the-worst-finisher"),
    pytest.param(two_phase(1.2, 350, final=0.01), [*HISTORY, TOP_TWO_PHASE], None,
                 id="two-phase-dropping-no-later-than-one-the-study-saw-end-well"),
    # The limit of any forecast: a two-phase learner whose drop comes later than any the study has seen looks like
    # a finished plateau, and is pruned (as its drop begins) although it would end in the top quarter (at 0.08).
    # Fast-fail never does that; the forecast is only as safe as the study's experience.
    pytest.param(two_phase(1.2, 450, final=0.01), [*HISTORY, TOP_TWO_PHASE], 470,
                 id="limit-two-phase-dropping-later-than-any-the-study-saw"),
    pytest.param(learner(0, 0.03, rate=0.93), HISTORY[:4], None, id="fewer-than-n-startup-trials"),
    pytest.param([(0, 2.3), (10, 2.0), (20, NAN)], HISTORY, 20, id="nan"),
])
def test_forecast_prunes_what_cannot_reach_the_top_quarter(values: list[tuple[int, float]],
                                                           history: list[list[tuple[int, float]]],
                                                           expected: int | None) -> None:
    assert pruned_step(ForecastPruner(n_startup_trials=5), values, history=history) == expected


def test_forecast_mirrors_for_maximized_metrics() -> None:
    flip = [[(s, -v) for s, v in past] for past in HISTORY]
    assert pruned_step(ForecastPruner(), [(s, -v) for s, v in learner(0, 0.8, rate=0.93)], "maximize",
                       history=flip) == 120
    assert pruned_step(ForecastPruner(), [(s, -v) for s, v in learner(0, 0.03, rate=0.93)], "maximize",
                       history=flip) is None


def test_forecast_composes_with_fast_fail_and_is_registered() -> None:
    pruner = build_pruner(Component.model_validate({"type": "fastfail", "then": {"type": "forecast",
                                                                                 "top_fraction": 0.5}}))
    assert isinstance(pruner, ForecastPruner) and pruner.top_fraction == 0.5
    assert pruned_step(pruner, FLAT, history=HISTORY) is not None
    with pytest.raises(StudyFileError, match="optimism"):
        build_pruner(Component.model_validate({"type": "forecast", "optimism": 0.5}))


def test_the_log_linear_forecast_is_optimistic_for_power_laws() -> None:
    for power in (0.3, 1.0, 2.0):
        values = [(s, 0.05 + 2.25 * (s / 10) ** -c) for s in range(10, 1001, 10) for c in [power]]
        for upto in (100, 300, 600):
            forecast = log_linear_forecast(value_at(values, upto), 1000)
            assert forecast is not None and forecast <= values[-1][1]


@pytest.mark.parametrize("then", [optuna.pruners.MedianPruner, optuna.pruners.PercentilePruner])
def test_the_wrapped_pruner_judges_the_trial_without_its_step_0_evaluation(then: Any) -> None:
    """Completed trials sit at 2.35 at step 10 (a warmup bump); the new trial is at 2.6 there, worse than all of
    them, which the wrapped pruner alone prunes. Fast-fail's step-0 evaluation (2.3, the untrained model) is better
    than 2.35 and must not shield it: the wrapped pruner would take it as the trial's best value."""
    args = {"percentile": 50.0} if then is optuna.pruners.PercentilePruner else {}
    finished = [[(0, 2.3), (10, 2.35), (20, 1.0 + i / 10)] for i in range(5)]
    decisions = []
    for pruner, first in ((then(**args), 10), (FastFailPruner(then(**args)), 0)):
        study = optuna.create_study(study_name="bump", pruner=pruner)
        for past in finished:
            trial = study.ask()
            for step, value in past if first == 0 else past[1:]:
                trial.report(value, step)
            study.tell(trial, past[-1][1])
        trial = study.ask()
        trial.set_user_attr("config", CONFIG)
        if first == 0:
            trial.report(2.3, 0)
            assert not trial.should_prune()
        trial.report(2.6, 10)
        decisions.append(trial.should_prune())
    assert decisions == [True, True]
