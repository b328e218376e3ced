"""Warm-started results told honestly: which warm trials a study confirms cold, which trial is its best, and what the
pruner judges of a warm trial. Real Optuna trials in a real SQLite study; the end-to-end run is in
tests/e2e/test_warmstart.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from sweep.confirm import confirmation_of, confirmations_due, lineage_label, study_best
from sweep.outcomes import SPEC_ATTR
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


def test_the_last_slots_wait_for_a_running_warm_trial_before_choosing_what_to_confirm(tmp_path: Path) -> None:
    # With `--workers N` (or a cohort) the budget's last slots are asked while other trials still train. A warm trial
    # still running may end best among the warm ones: the confirmation waits for it instead of retraining a worse one
    # (and a trial that already reported without a donor started cold, so nothing waits for it).
    from sweep.spec import load_spec
    from sweep.study import open_study
    from sweep.worker import Worker
    from tests.conftest import TINY_STUDY, write_study

    document = {**TINY_STUDY, "n_trials": 4, "warm_start": {"max_distance": 1.0, "confirm": 1}}
    spec, _ = load_spec(write_study(tmp_path, document))

    def scene(name: str, running_attrs: dict[str, Any], reported: bool) -> tuple[Worker, optuna.Study, int]:
        url = f"sqlite:///{tmp_path / f'{name}.db'}"
        study = open_study(spec, url)
        worker = Worker(study, spec, storage_url=url, boundary=study._storage.boundary)
        for value, attrs in ((0.9, {}), (0.5, WARM)):  # a cold trial and a finished warm one
            trial = worker._ask_next()[0]
            assert trial is not None
            for key, attr in attrs.items():
                trial.set_user_attr(key, attr)
            study.tell(trial, value)
        running = worker._ask_next()[0]  # another worker's trial, still training
        assert running is not None
        for key, attr in running_attrs.items():
            running.set_user_attr(key, attr)
        if reported:
            running.report(0.7, 10)
        return worker, study, running.number

    worker, study, running = scene("warm", WARM, reported=True)
    assert worker._ask_next()[:2] == (None, False)  # the last slot waits for the running warm trial
    study.tell(running, 0.3)  # it ends the best warm trial
    confirmation = worker._ask_next()[0]
    assert confirmation is not None and confirmation.user_attrs["confirms"] == running

    worker, study, running = scene("undecided", {}, reported=False)  # started, not yet known to be cold or warm
    assert worker._ask_next()[:2] == (None, False)

    worker, study, running = scene("cold", {}, reported=True)  # it reported without a donor: cold, not waited for
    confirmation = worker._ask_next()[0]
    assert confirmation is not None and confirmation.user_attrs["confirms"] == 1


def test_a_confirmation_queued_twice_while_the_lock_was_lost_trains_once(tmp_path: Path) -> None:
    """Two workers inside the ask section at once (one came back after its lock was taken over) may both queue the
    confirmation of the same warm trial. The fence counted a queued trial as already in the budget and let both
    train; the one asked without the lock is now withdrawn before it trains, and the budget keeps its place."""
    from sweep.outcomes import ATTR_CONFIRMS, budget_counts
    from sweep.spec import load_spec
    from sweep.study import open_study
    from sweep.worker import Worker
    from tests.conftest import TINY_STUDY, write_study

    spec, _ = load_spec(write_study(tmp_path, {**TINY_STUDY, "n_trials": 3}))
    url = f"sqlite:///{tmp_path / 'twice.db'}"
    study = open_study(spec, url)
    worker = Worker(study, spec, storage_url=url, boundary=study._storage.boundary)
    params = {"learning_rate": 0.01, "model.hidden": 16}
    for _ in range(2):
        study.enqueue_trial(params, user_attrs={ATTR_CONFIRMS: 0})
    first, second = worker._ask_next()[0], worker._ask_next()[0]
    assert first is not None and second is not None
    kept, _, _ = worker._fence(second)
    assert kept is None  # withdrawn: its twin trains
    assert worker._fence(first)[0] is first  # the one left has no twin now
    states = {t.number: (t.state, t.user_attrs.get("withdrawn", "")) for t in study.get_trials()}
    assert states[second.number][0] == TrialState.FAIL and "as trial 0 was" in states[second.number][1]
    assert budget_counts(study.get_trials())[0] == 0  # a withdrawn trial spends no budget


def test_the_reports_best_so_far_line_passes_over_warm_values_when_the_study_confirms(tmp_path: Path) -> None:
    # With `warm_start.confirm` the report named the cold best while its history plot's best line ended on the warm
    # value the study had passed over: two bests in one file.
    import json
    import re

    from sweep.report import render_report

    warm = {**WARM, "warm_start_from": {"trial": 0, "step": 50}}
    cold = {"config": {}}  # what a worker writes on every trial it trains (a trial with none was added from outside)
    rows = [(0.30, cold), (0.10, warm), (0.20, cold), (0.05, warm), (0.40, {**cold, "confirms": 3})]
    _trials(tmp_path, rows)
    url = f"sqlite:///{tmp_path / 'c.db'}"
    study = optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)

    def best_line() -> tuple[str, list[float | None]]:
        page = render_report(study)
        found = re.search(r'"name":"(Best Value[^"]*)","x":\[[^\]]*\],"y":(\[[^\]]*\])', page)
        assert found is not None
        return found.group(1), json.loads(found.group(2))

    assert best_line() == ("Best Value", [0.30, 0.10, 0.10, 0.05, 0.05])  # no confirm: every complete trial counts
    study.set_user_attr(SPEC_ATTR, {"warm_start": {"confirm": 1}, "metric": "val_loss"})
    assert best_line() == ("Best Value (trained cold)", [0.30, 0.30, 0.20, 0.20, 0.20])
    assert "Best trial: #2" in render_report(study)  # the same best the line ends on


def test_a_warm_trial_that_ended_before_recording_its_steps_is_credited_what_it_reported(tmp_path: Path) -> None:
    # A warm loop that counts its own steps from 0 and failed at step 15 (its reports 5 and 10; its donor's step 20)
    # was credited 0 steps (its highest report less the donor's step); one that went on from the donor's step
    # (reports 25, 30) trained 10, and a retry resumed at its own step 10 (report 15) trained 5.
    from sweep.results import steps_trained

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")
    handoff = {"warm_start_from": {"trial": 0, "step": 20}}
    for attrs, reports in ((handoff, {5: 0.5, 10: 0.4}), (handoff, {25: 0.5, 30: 0.4}),
                           ({**handoff, "resumed_from": {"trial": 1, "step": 10}}, {15: 0.3})):
        study.add_trial(create_trial(state=TrialState.FAIL, user_attrs=attrs, intermediate_values=reports,
                                     params={}, distributions={}))
    assert [steps_trained([t]) for t in study.get_trials()] == [10, 10, 5]


def test_an_interrupted_trial_s_steps_up_to_its_retry_s_resume_point_are_counted(tmp_path: Path) -> None:
    # Interrupted between two evaluations: credited up to its last one (1000), it trained on to its checkpoint at
    # 1100, where its retry resumed and counted from. The 100 steps between were counted nowhere (`sweep status`
    # said 11900 steps trained for 12000). A retry that resumed from an older checkpoint adds nothing.
    from sweep.results import steps_trained

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")
    evaluations = {step: 1.0 / step for step in range(200, 1001, 200)}
    study.add_trial(create_trial(state=TrialState.FAIL, user_attrs={"outcome": "interrupted"},
                                 intermediate_values=evaluations, params={}, distributions={}))
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=0.1, params={}, distributions={},
                                 user_attrs={"resumed_from": {"trial": 0, "step": 1100}, "steps_trained": 1900}))
    assert steps_trained(study.get_trials()) == 3000
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=0.1, params={}, distributions={},
                                 user_attrs={"resumed_from": {"trial": 0, "step": 800}, "steps_trained": 2200}))
    assert steps_trained(study.get_trials()) == 3000 + 2200


def test_a_study_that_confirms_with_only_warm_trials_complete_says_why_it_has_no_best(tmp_path: Path) -> None:
    # Review: with `warm_start.confirm` on, every cold trial pruned and the confirmation failed, `sweep best` said
    # "no complete trial yet", the report "No trial has completed yet", and `sweep status` had no best row, beside
    # "complete 3".
    from sweep.confirm import no_best
    from sweep.report import render_report
    from sweep.results import NoCompleteTrial, best_config, study_status
    from tests.conftest import sweep_cli

    url = f"sqlite:///{tmp_path / 'c.db'}"
    study = optuna.create_study(study_name="w", storage=url)
    study.set_user_attr(SPEC_ATTR, {"warm_start": {"confirm": 1}, "metric": "val_loss", "n_trials": 4})
    warm = {**WARM, "warm_start_from": {"trial": 0, "step": 50}}
    for state, value, attrs in ((TrialState.PRUNED, None, {}), (TrialState.COMPLETE, 0.10, warm),
                                (TrialState.COMPLETE, 0.05, warm), (TrialState.FAIL, None, {"confirms": 2})):
        study.add_trial(create_trial(state=state, value=value, params={}, distributions={}, user_attrs=attrs))
    trials = study.get_trials()
    assert study_best(trials, maximize=False, confirm=1) is None
    line = no_best(trials, maximize=False, confirm=1)
    assert line.startswith("no trial trained cold has completed yet") and "the best #2 (value 0.05" in line
    assert "was not confirmed (its cold retrain, trial #3, ended fail)" in line
    assert no_best(trials, maximize=False) == "no trial has completed yet"  # without confirm: a best exists anyway
    assert "awaits its cold confirmation" in no_best(trials[:3], maximize=False, confirm=1)
    with pytest.raises(NoCompleteTrial, match="no trial trained cold has completed yet"):
        best_config(study)
    assert study_status(study)["no_best"] == line
    assert "No trial trained cold has completed yet" in render_report(study)
    shown = sweep_cli("status", "--storage", url, "--study-name", "w", cwd=tmp_path)
    assert shown.returncode == 0 and "none: no trial trained cold" in " ".join(shown.stdout.split()), shown.stdout
    refused = sweep_cli("best", "--storage", url, "--study-name", "w", cwd=tmp_path)
    assert refused.returncode == 1 and "no trial trained cold has completed yet" in refused.stderr, refused.stderr


def test_the_report_counts_a_retried_warm_trial_as_one_warm_start(tmp_path: Path) -> None:
    # Review: a warm trial lost and retried was two warm starts in the report ("4 of 6 trials started from a
    # neighbour's checkpoint, inheriting 16 steps"), where `sweep status` said 3.
    from sweep.report import render_report

    # Review: and a retry whose original was lost cold, before its first checkpoint, is a warm start of its own
    # (nothing to resume, so it took a donor): neither the report nor `sweep status` counted it.
    from sweep.results import study_status

    rows = [(0.3, {}), (None, WARM), (0.2, {**WARM, "retry_of": 1}), (0.1, WARM), (None, {}),
            (0.2, {**WARM, "retry_of": 4})]
    _trials(tmp_path, rows)
    url = f"sqlite:///{tmp_path / 'c.db'}"
    study = optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)
    assert "3 of 4 trials started from a neighbour's checkpoint (a retry counted with the trial it retries), " \
           "inheriting 150 steps" in render_report(study)
    assert study_status(study)["warm_started"] == 3


def test_a_retried_warm_loop_trial_s_lineage_counts_its_whole_lineage_s_own_steps(tmp_path: Path) -> None:
    # Review: a loop that took its donor's state at step 4 and counted its own steps from 0, lost at its step 2 and
    # retried to step 4: "then trained 2 steps with its own config" (the retry's part alone). Its lineage trained 4.
    from sweep.confirm import lineage_own_steps

    handoff = {"warm_start_from": {"trial": 0, "step": 4}}
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}")
    for reports, attrs in (({1: 0.5, 2: 0.4, 3: 0.3, 4: 0.2}, {}),  # counted from 0; its first two the lineage's
                           ({6: 0.3, 8: 0.2}, {})):  # went on from the donor's step 4
        study.add_trial(create_trial(state=TrialState.COMPLETE, value=0.2, params={}, distributions={},
                                     intermediate_values=reports,
                                     user_attrs={**handoff, **attrs, "resumed_from": {"trial": 1, "step": 2},
                                                 "steps": max(reports), "steps_trained": 2}))
    from_0, went_on = study.get_trials()
    assert lineage_own_steps(from_0, handoff["warm_start_from"]) == 4
    assert "then trained 4 steps with its own config" in lineage_label(from_0)
    assert lineage_own_steps(went_on, handoff["warm_start_from"]) is None
    assert lineage_label(went_on).startswith("warm: steps 0-4 trained with the config of trial #0, 4-8 with its own")


def test_a_warm_start_attr_that_names_no_donor_is_no_warm_start(tmp_path: Path) -> None:
    # Review: `warm_start_from` edited to 5 made `sweep best` warn "trial 1's value ... is a warm start's:" with
    # nothing after the colon, and mark its YAML warm.
    from sweep.confirm import is_warm

    trials = _trials(tmp_path, [(0.3, {"warm_start_from": 5}), (0.2, WARM)])
    assert [is_warm(t) for t in trials] == [False, True]
    assert lineage_label(trials[0]) == ""
