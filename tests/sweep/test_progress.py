"""How a trial's end is described in `sweep run`'s lines and `sweep trials`, from what the trial holds."""

from __future__ import annotations

import io

from optuna.study import StudyDirection
from optuna.trial import TrialState, create_trial
from rich.console import Console

from sweep.progress import LiveProgress, outcome_text


def test_trials_ended_by_another_tool_are_described_by_what_they_hold() -> None:
    # Found by review: plain Optuna's pruned trial read "pruned by ? at step ? (value=None)" though it had reports,
    # and its failed one "lost: worker lost: no heartbeat", though no worker of sweep's ever ran it.
    pruned = create_trial(state=TrialState.PRUNED, intermediate_values={3: 0.5, 7: 0.25}, params={}, distributions={})
    assert outcome_text(pruned) == "pruned at step 7 (value=0.25)"
    assert outcome_text(create_trial(state=TrialState.PRUNED, params={}, distributions={})) == "pruned"
    assert outcome_text(create_trial(state=TrialState.FAIL, params={}, distributions={})) == "failed"
    # One of sweep's (its config written as it started) failed without a reason: told FAIL from outside (a worker
    # that fails a lost trial writes why in the same transaction); one an older sweep failed as lost, with its reason.
    told = create_trial(state=TrialState.FAIL, params={}, distributions={}, user_attrs={"config": {}})
    assert outcome_text(told) == "failed"
    lost = create_trial(state=TrialState.FAIL, params={}, distributions={},
                        user_attrs={"config": {}, "fail_reason": "worker lost: no heartbeat"})
    assert outcome_text(lost) == "lost: worker lost: no heartbeat"
    ruled = create_trial(state=TrialState.PRUNED, intermediate_values={5: 9.0}, params={}, distributions={},
                         user_attrs={"prune_reason": {"rule": "explode", "step": 5, "value": 9.0}})
    assert outcome_text(ruled) == "pruned by explode at step 5 (value=9)"


def test_the_live_line_shows_the_study_s_best_as_sweep_ranks_it_and_no_loss_a_loop_never_logged() -> None:
    # Found by review: with warm_start.confirm on, the live line's best was a warm trial's (its lineage's) value, while
    # the study's best (`sweep status`, the table after the run) is the best one trained cold; and a loop that logs no
    # train_loss read "loss nan".
    console = Console(file=io.StringIO(), width=200)
    warm = create_trial(state=TrialState.COMPLETE, value=0.1, params={}, distributions={},
                        user_attrs={"warm_start_from": {"trial": 0, "step": 10}})
    cold = create_trial(state=TrialState.COMPLETE, value=0.5, params={}, distributions={})
    for cold_only, best in ((True, 0.5), (False, 0.1)):
        progress = LiveProgress(console, 4, StudyDirection.MINIMIZE, live=False, cold_only=cold_only)
        progress.trial_finished(cold)
        progress.trial_finished(warm)
        assert progress.best == best
    progress.trial_log(3, 7, {"lr": 0.1})
    assert progress.current == "trial 3 step 7"
    progress.trial_log(3, 8, {"train_loss": 0.25})
    assert progress.current == "trial 3 step 8 loss 0.25"
