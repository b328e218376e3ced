"""LeadersPruner through Optuna's public API, on the curve table's families: which curves it stops, at which step,
and which it must leave alone because the study's leaders were no better at that point.

The study (`STUDY`): five two-phase learners that end best (down to 1.2 within 100 steps, sitting there until step
400 to 480, then the second drop) and five fast single-phase learners that end worse (0.3 to 0.7). The leaders are
the two-phase ones: at step s the bar is the worst of their running bests, and the allowance 10% of the way they
went (2.3 to about 0.05: 0.225).
"""

from __future__ import annotations

import math

import optuna
import pytest

from sweep.components import build_pruner
from sweep.leaders import LeadersPruner, running_best
from sweep.outcomes import ATTR_WARM_START
from sweep.pruners import FastFailPruner
from sweep.schema import Component, StudyFileError
from tests.sweep.test_pruners import NAN, pruned_step
from tests.trainer.test_fast_fail_rules import learner, noisy, shaped, staged, two_phase

optuna.logging.set_verbosity(optuna.logging.WARNING)

Curve = list[tuple[int, float]]
LEADERS = [two_phase(1.2, 400 + 20 * k, final=0.03) for k in range(5)]
OTHERS = [learner(0, 0.3 + 0.1 * k, rate=0.9) for k in range(5)]
STUDY = [*OTHERS, *LEADERS]
STUCK = shaped(lambda s: 2.3)
BUMP = shaped(lambda s: 2.3 + 0.4 * math.sin(math.pi * s / 200) if s <= 200 else two_phase(1.2, 600)[s // 10][1])


@pytest.mark.parametrize(("values", "config", "expected"), [
    # Left alone: nothing that ended well was better at any of their steps by more than the allowance.
    pytest.param(two_phase(1.2, 450, final=0.03), None, None, id="two-phase-on-its-plateau-as-long-as-the-leaders"),
    pytest.param(two_phase(1.3, 450, final=0.03), None, None, id="two-phase-on-a-slightly-higher-plateau"),
    pytest.param(noisy(two_phase(1.2, 450, final=0.03), 0.05, seed=3), None, None, id="noisy-two-phase"),
    pytest.param(learner(0, 0.02, rate=0.93), None, None, id="fast-learner-better-than-the-leaders"),
    pytest.param(BUMP, {"max_steps": 1000, "eval_every_steps": 10, "warmup_steps": 200}, None,
                 id="warmup-bump-counted-from-the-end-of-its-learning-rate-warmup"),
    pytest.param(learner(150, 0.03, rate=0.93), {"max_steps": 1000, "eval_every_steps": 10, "warmup_steps": 150},
                 None, id="slow-start-during-its-learning-rate-warmup"),
    # Stopped: at some step worse than every leader was there, by more than the allowance.
    pytest.param(STUCK, None, 30, id="never-learner"),
    pytest.param(learner(150, 0.03, rate=0.93), None, 30, id="slow-starter-slower-than-every-leader"),
    pytest.param(BUMP, None, 30, id="the-same-bump-without-its-warmup"),
    pytest.param(shaped(lambda s: 2.3 - 0.8 * (1 - 0.97 ** (s / 10))), None, 30, id="stalls-above-the-plateau"),
    pytest.param(two_phase(1.2, 700, final=0.03), None, 530,
                 id="limit-two-phase-sitting-longer-than-any-leader"),
    pytest.param([(0, 2.3), (10, 2.0), (20, NAN)], None, 20, id="nan"),
])
def test_leaders_on_the_curve_families(values: Curve, config: dict | None, expected: int | None) -> None:
    assert pruned_step(LeadersPruner(), values, history=STUDY, config=config) == expected


def test_a_curriculum_s_jumps_are_judged_against_leaders_that_met_the_same_stages() -> None:
    # Stage changes lift the loss by 2.5 at steps 250, 500 and 750 (a curriculum is a fixed value of the study, so
    # its leaders met the same stages): the running best of a trial on its plateau is compared with theirs.
    starts = (250, 500, 750)
    study = [staged(past, starts, 2.5) for past in STUDY]
    assert pruned_step(LeadersPruner(), staged(two_phase(1.2, 450, final=0.03), starts, 2.5), history=study) is None
    assert pruned_step(LeadersPruner(), staged(STUCK, starts, 2.5), history=study) == 30


def test_median_prunes_the_two_phase_learner_the_leaders_keep() -> None:
    # The table has teeth: the median of the study's values at each step is a fast learner's, below the plateau.
    assert pruned_step(optuna.pruners.MedianPruner(), two_phase(1.2, 450, final=0.03), history=STUDY) is not None


def test_the_leaders_are_the_best_completed_trials_and_not_warm_started_ones() -> None:
    # With fast learners as the leaders (the two-phase ones left out), the plateau is behind every one of them.
    assert pruned_step(LeadersPruner(), two_phase(1.2, 450, final=0.03), history=OTHERS * 2) == 130
    study = optuna.create_study(study_name="warm")
    for k, past in enumerate(STUDY):
        trial = study.ask()
        if past in LEADERS:
            trial.set_user_attr(ATTR_WARM_START, {"trial": k, "step": 0})
        for step, value in past:
            trial.report(value, step)
        study.tell(trial, past[-1][1])
    steps_and_bests = LeadersPruner().leaders(study, 1.0)[0]
    assert sorted(round(bests[-1], 3) for _, bests, _ in steps_and_bests) == [0.3, 0.4, 0.5, 0.6, 0.7]


def test_fewer_than_n_startup_trials_and_before_the_warmup_nothing_is_pruned() -> None:
    assert pruned_step(LeadersPruner(), STUCK, history=STUDY[:4]) is None
    assert pruned_step(LeadersPruner(n_startup_trials=4, n_leaders=2), STUCK, history=STUDY[:4]) is not None
    assert pruned_step(LeadersPruner(n_warmup_steps=300), STUCK, history=STUDY) == 300


def test_a_step_beyond_every_leader_s_first_report_is_not_judged() -> None:
    # Leaders that reported from step 100 on say nothing about step 50.
    late = [[(s, v) for s, v in past if s >= 100] for past in STUDY]
    assert pruned_step(LeadersPruner(), STUCK[:10], history=late) is None
    assert pruned_step(LeadersPruner(), STUCK, history=late) == 100


def test_leaders_mirror_for_maximized_metrics() -> None:
    flip = [[(s, -v) for s, v in past] for past in STUDY]
    assert pruned_step(LeadersPruner(), [(s, -v) for s, v in STUCK], "maximize", history=flip) == 30
    assert pruned_step(LeadersPruner(), [(s, -v) for s, v in two_phase(1.2, 450, final=0.03)], "maximize",
                       history=flip) is None


def test_the_margin_is_a_share_of_the_way_the_leaders_went() -> None:
    almost = shaped(lambda s: two_phase(1.2, 450, final=0.03)[s // 10][1] + 0.15)
    assert pruned_step(LeadersPruner(), almost, history=STUDY) is None  # 0.15 behind: within 10% of 2.25
    assert pruned_step(LeadersPruner(margin_pct=5), almost, history=STUDY) is not None


def test_running_best_ignores_non_finite_values() -> None:
    assert running_best([(0, NAN), (10, 2.0), (20, 2.5), (30, 1.0)]) == ([0, 10, 20, 30], [math.inf, 2.0, 2.0, 1.0])


def test_leaders_compose_with_fast_fail_and_are_registered() -> None:
    pruner = build_pruner(Component.model_validate({"type": "fastfail", "then": {"type": "leaders", "n_leaders": 3}}))
    assert isinstance(pruner, FastFailPruner) and isinstance(pruner, LeadersPruner) and pruner.n_leaders == 3
    assert pruned_step(pruner, two_phase(1.2, 450, final=0.03), history=STUDY) is None
    # Wrapped, it judges as it does alone on the same curves without the step-0 evaluation (which only fast-fail's
    # trials have): the leaders' way is measured from their first trained step, so the allowance is a little smaller.
    alone = build_pruner(Component.model_validate({"type": "leaders", "n_leaders": 3}))
    assert pruned_step(pruner, STUCK, history=STUDY) == pruned_step(alone, STUCK[1:], history=[c[1:] for c in STUDY])
    assert pruned_step(pruner, STUCK, history=STUDY) == 20
    with pytest.raises(StudyFileError, match="margin_pct"):
        build_pruner(Component.model_validate({"type": "leaders", "margin_pct": 100}))


def test_wrapped_in_fast_fail_a_trial_with_the_leaders_own_spiking_curve_is_kept() -> None:
    # The trainer's step-0 evaluation (made for fast-fail) is left out of the judged trial; it must be left out of
    # the leaders' curves too. Kept, the leaders' untrained 2.3 set a bar at steps 10 and 20 that their own early
    # spike to 3.0 (a learning-rate warmup's) missed, and a sixth trial with the leaders' exact curve was pruned.
    spiking = [(0, 2.3), *((s, 3.0 if s <= 20 else 2.3 - 1.8 * (s - 20) / 80) for s in range(10, 101, 10))]
    config = {"max_steps": 100, "eval_every_steps": 10}
    wrapped = build_pruner(Component.model_validate({"type": "fastfail", "then": {"type": "leaders"}}))
    assert pruned_step(wrapped, spiking, history=[spiking] * 5, config=config) is None
    alone = build_pruner(Component.model_validate({"type": "leaders"}))
    assert pruned_step(alone, spiking[1:], history=[spiking[1:]] * 5, config=config) is None
    # The view still prunes what the leaders alone prune: the same trial stuck at its spike.
    stuck = [*spiking[:3], *((s, 3.0) for s in range(30, 101, 10))]
    assert pruned_step(wrapped, stuck, history=[spiking] * 5, config=config) == 30
