"""FastFailPruner's study-derived decisions through Optuna's public API: the reference it reads from the study's
finished trials, the stuck rule's patience that follows from them, and the same verdict when the objective asks why."""

from __future__ import annotations

import math

import optuna
import pytest

import sweep.pruners
from sweep.outcomes import ATTR_WARM_START
from sweep.pruners import FastFailPruner
from tests.sweep.test_pruners import curve, pruned_step
from tests.trainer.test_fast_fail_rules import HISTORY, STUCK_AFTER, learner, shaped, two_phase

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
    assert pruned_step(FastFailPruner(min_learners=4), FLAT, history=HISTORY[:4]) is not None
    assert pruned_step(FastFailPruner(learners_factor=None), FLAT, history=HISTORY) == 250


def test_the_learning_rate_warmup_starts_the_clock() -> None:
    bump = shaped(lambda s: 2.3 + 0.4 * math.sin(math.pi * s / 300) if s <= 300
                  else 0.05 + 2.25 * 0.97 ** ((s - 300) / 10))
    assert pruned_step(FastFailPruner(), bump, history=HISTORY, config={**CONFIG, "warmup_steps": 300}) is None
    assert pruned_step(FastFailPruner(), bump, history=HISTORY) == STUCK_AFTER


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
    monkeypatch.setattr(sweep.pruners, "study_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
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
