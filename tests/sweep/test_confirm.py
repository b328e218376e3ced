"""Warm-started results told honestly: which warm trials a study confirms cold, which trial is its best, and what the
pruner judges of a warm trial. Real Optuna trials in a real SQLite study; the end-to-end run is in
tests/e2e/test_warmstart.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from sweep.confirm import confirmation_of, confirmations_due, lineage_label, study_best
from sweep.pruners import FastFailPruner

WARM = {"warm_start_from": {"study": "s", "trial": 0, "step": 50}, "steps": 100}


def _trials(tmp_path: Path, rows: list[tuple[float | None, dict[str, Any]]]) -> list[optuna.trial.FrozenTrial]:
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'c.db'}")
    for x, (value, attrs) in enumerate(rows):
        state = TrialState.COMPLETE if value is not None else TrialState.RUNNING
        study.add_trial(create_trial(state=state, value=value, params={"x": float(x)},
                                     distributions={"x": FloatDistribution(0, 100)}, user_attrs=attrs))
    return study.get_trials()


def test_the_best_warm_trials_are_due_once_each_and_the_best_is_cold(tmp_path: Path) -> None:
    trials = _trials(tmp_path, [(0.30, {}), (0.10, WARM), (0.20, WARM), (0.05, WARM), (0.25, {}),
                                (None, {"confirms": 3})])  # trial 3's confirmation is running
    assert [t.number for t in confirmations_due(trials, 2, maximize=False)] == [1]  # 3 is taken, 1 is next
    assert [t.number for t in confirmations_due(trials, 3, maximize=False)] == [1, 2]
    assert confirmations_due(trials, 0, maximize=False) == []
    assert [t.number for t in confirmations_due(trials, 2, maximize=True)] == [2, 1]
    assert confirmation_of(trials)[3].number == 5
    assert study_best(trials, maximize=False).number == 3  # without confirmation: the best value, warm or not
    assert study_best(trials, maximize=False, confirm=2).number == 4  # with: only values reached cold
    assert "not confirmed cold" in lineage_label(trials[1], trials)
    assert "cold confirmation trial #5 is running" in lineage_label(trials[3], trials)
    assert lineage_label(trials[0], trials) == ""


def test_a_confirmation_that_was_retried_is_the_latest_of_its_lineage(tmp_path: Path) -> None:
    trials = _trials(tmp_path, [(0.1, WARM), (0.4, {"confirms": 0}), (0.2, {"confirms": 0, "retry_of": 1})])
    assert confirmation_of(trials)[0].number == 2
    assert "cold from its own config: 0.2 (trial #2)" in lineage_label(trials[0], trials)


def test_fast_fail_judges_a_warm_trial_only_by_what_breaks() -> None:
    pruner = FastFailPruner(patience_steps=20, warmup_steps=0)
    config = {"max_steps": 200, "eval_every_steps": 10}
    flat = [(60 + 10 * i, 0.5) for i in range(6)]  # a warm trial's own reports: good, and level
    assert pruner.verdict(flat, config, maximize=False).rule == "plateau"  # a cold one this level is pruned
    assert pruner.verdict(flat, config, maximize=False, warm=True) is None  # its lineage has learned
    broken = [*flat, (120, math.nan)]
    assert pruner.verdict(broken, config, maximize=False, warm=True).rule == "nan"


def test_a_donor_of_another_study_is_named_with_its_study_and_a_retry_is_no_second_warm_start(tmp_path: Path) -> None:
    # `sweep trials` showed a from_studies donor's number alone (it read as this study's trial), and `sweep status`
    # counted a preempted warm trial and its retry as two warm starts.
    from sweep.results import donor_label, study_status

    other = {"warm_start_from": {"study": "last-week", "trial": 7, "step": 50}}
    trials = _trials(tmp_path, [(0.3, WARM), (0.2, other), (0.1, {**WARM, "retry_of": 0}), (0.4, {})])
    assert [donor_label(t, "s") for t in trials] == [0, "last-week#7", 0, None]
    url = f"sqlite:///{tmp_path / 'c.db'}"
    study = optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)
    assert study_status(study)["warm_started"] == 2
