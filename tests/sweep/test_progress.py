"""How a trial's end is described in `sweep run`'s lines and `sweep trials`, from what the trial holds."""

from __future__ import annotations

from optuna.trial import TrialState, create_trial

from sweep.progress import outcome_text


def test_trials_ended_by_another_tool_are_described_by_what_they_hold() -> None:
    # Found by review: plain Optuna's pruned trial read "pruned by ? at step ? (value=None)" though it had reports,
    # and its failed one "lost: worker lost: no heartbeat", though no worker of sweep's ever ran it.
    pruned = create_trial(state=TrialState.PRUNED, intermediate_values={3: 0.5, 7: 0.25}, params={}, distributions={})
    assert outcome_text(pruned) == "pruned at step 7 (value=0.25)"
    assert outcome_text(create_trial(state=TrialState.PRUNED, params={}, distributions={})) == "pruned"
    assert outcome_text(create_trial(state=TrialState.FAIL, params={}, distributions={})) == "failed"
    # One of sweep's (its config written as it started) failed without a reason: its worker was lost.
    lost = create_trial(state=TrialState.FAIL, params={}, distributions={}, user_attrs={"config": {}})
    assert outcome_text(lost) == "lost: worker lost: no heartbeat"
    ruled = create_trial(state=TrialState.PRUNED, intermediate_values={5: 9.0}, params={}, distributions={},
                         user_attrs={"prune_reason": {"rule": "explode", "step": 5, "value": 9.0}})
    assert outcome_text(ruled) == "pruned by explode at step 5 (value=9)"
