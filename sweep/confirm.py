"""Warm-started results, told honestly.

A warm trial starts from a donor's checkpoint at the handoff step: its value belongs to its *lineage* (the donor's
config trained the inherited steps, its own config the rest), not to its config alone. Trained cold from that config,
it may never reach that value. So:

- every warm trial says so (`lineage_label`: in `sweep trials`, `sweep status`, `sweep best`, the report, and the
  trial's `lineage` user attr in optuna-dashboard);
- `warm_start.confirm: K` spends the last K trials of the budget retraining the best K warm trials cold, from their own
  configs (a *confirmation*: same params, no warm start, never pruned, user attr `confirms` naming the warm trial);
- with confirmation on, the study's best (`study_best`) is the best value a cold trial reached (a confirmation's
  included); a warm trial's own value is never the study's best.

Pure functions of the study's trials: the worker, the CLI and the report use the same ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from sweep.outcomes import (
    ATTR_CONFIRMS,
    ATTR_RESUMED_FROM,
    ATTR_RETRY_OF,
    ATTR_STEPS,
    ATTR_STEPS_TRAINED,
    ATTR_WARM_START,
)

__all__ = ["NO_COMPLETE_TRIAL", "confirmation_of", "confirmation_rows", "confirmations_due", "counted_from_0",
           "is_warm", "lineage_label", "lineage_own_steps", "no_best", "study_best", "warm_lineage", "warm_starts"]


def is_warm(trial: FrozenTrial) -> bool:
    """Whether the trial's value was reached from a donor's checkpoint (a confirmation never is). A `warm_start_from`
    that names no donor (edited by hand) says nothing of one: `sweep best` warned of a warm value, and its lineage
    was blank."""
    return isinstance(trial.user_attrs.get(ATTR_WARM_START), Mapping) and ATTR_CONFIRMS not in trial.user_attrs


def warm_starts(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """The trials that started from a donor's checkpoint, one per lineage: a retry carries its lineage's donor too
    and is no other warm start, unless its original had none (lost before its first checkpoint, then warm-started
    afresh) or another one."""
    by_number = {t.number: t for t in trials}
    starts = []
    for trial in filter(is_warm, trials):
        original = by_number.get(trial.user_attrs.get(ATTR_RETRY_OF))  # type: ignore[arg-type]
        if original is None or original.user_attrs.get(ATTR_WARM_START) != trial.user_attrs[ATTR_WARM_START]:
            starts.append(trial)
    return starts


def _complete(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    return [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None and math.isfinite(t.value)]


def _ranked(trials: Sequence[FrozenTrial], maximize: bool) -> list[FrozenTrial]:
    return sorted(trials, key=lambda t: (-t.value if maximize else t.value, t.number))  # type: ignore[operator]


def confirmation_of(trials: Sequence[FrozenTrial]) -> dict[int, FrozenTrial]:
    """Each confirmed warm trial's confirmation: the latest trial whose `confirms` names it (a retry of an
    interrupted confirmation carries the attr too, and the latest one is the one that finished)."""
    found: dict[int, FrozenTrial] = {}
    for trial in trials:
        target = trial.user_attrs.get(ATTR_CONFIRMS)  # an int; another tool's attr of that name is not sweep's
        if isinstance(target, int) and not isinstance(target, bool) and (
                target not in found or trial.number > found[target].number):
            found[target] = trial
    return found


def confirmations_due(trials: Sequence[FrozenTrial], k: int, maximize: bool) -> list[FrozenTrial]:
    """The best `k` complete warm trials that no trial confirms yet (none queued, running or finished), best first."""
    if k <= 0:
        return []
    best_warm = _ranked([t for t in _complete(trials) if is_warm(t)], maximize)[:k]
    confirmed = confirmation_of(trials)
    return [t for t in best_warm if t.number not in confirmed]


def study_best(trials: Sequence[FrozenTrial], maximize: bool, *, confirm: int = 0) -> FrozenTrial | None:
    """The study's best trial as sweep reports it. With `confirm` on, only trials trained cold count (confirmations
    included); without, the best complete trial, warm or not (its `lineage_label` says which)."""
    complete = _complete(trials)
    if confirm > 0:
        complete = [t for t in complete if not is_warm(t)]
    ranked = _ranked(complete, maximize)
    return ranked[0] if ranked else None


NO_COMPLETE_TRIAL = "no trial has completed yet"


def no_best(trials: Sequence[FrozenTrial], maximize: bool, *, confirm: int = 0) -> str:
    """Why the study has no best trial (`study_best` gave None), as a sentence: no trial has completed, or, with
    `confirm` on, none trained cold has while warm ones have (their values are not the study's best until confirmed)."""
    warm = _ranked([t for t in _complete(trials) if is_warm(t)], maximize) if confirm > 0 else []
    if not warm:
        return NO_COMPLETE_TRIAL
    top = warm[0]
    confirmation = confirmation_of(trials).get(top.number)
    why = ("awaits its cold confirmation" if confirmation is None or not confirmation.state.is_finished() else
           f"was not confirmed (its cold retrain, trial #{confirmation.number}, ended "
           f"{confirmation.state.name.lower()})")
    return (f"no trial trained cold has completed yet, and with warm_start.confirm on the study's best is a cold "
            f"value: {len(warm)} warm trial{'s' if len(warm) > 1 else ''} completed, the best #{top.number} (value "
            f"{top.value:.6g}, from its lineage), which {why}")


def warm_lineage(parent: Mapping[str, Any], last_step: object, own_steps: object = None) -> str:
    """Where a warm trial's value came from, given its `warm_start_from` attr, its last step and the steps it trained
    itself (when known: a loop may take the donor's state and count its own steps from 0)."""
    step = parent.get("step", "?")
    donor = f"trial #{parent.get('trial')}" + (f" (study {parent['study']})" if parent.get("study") else "")
    if isinstance(own_steps, int) and isinstance(last_step, int) and isinstance(step, int) \
            and last_step - own_steps < step:
        return (f"warm: started from the state of {donor} at its step {step}, then trained {own_steps} steps with "
                "its own config; its value belongs to this lineage, not to its config alone")
    return (f"warm: steps 0-{step} trained with the config of {donor}, {step}-{last_step} with its own; its value "
            "belongs to this lineage, not to its config alone")


def lineage_own_steps(trial: FrozenTrial, parent: Mapping[str, Any]) -> object:
    """The steps a warm trial's lineage trained with its own config, for `warm_lineage`. A retry's `steps_trained`
    are only its own part: it says the lineage's own steps where its loop took the donor's state and counted its
    steps from 0 (the lineage's first report at or below the handoff, and every step its own), and nothing where
    the lineage went on from the donor's step (its steps past the handoff are its own)."""
    if trial.user_attrs.get(ATTR_RESUMED_FROM) is None:
        return trial.user_attrs.get(ATTR_STEPS_TRAINED)
    last = trial.user_attrs.get(ATTR_STEPS)
    first = min(trial.intermediate_values, default=None)
    return last if isinstance(last, int) and counted_from_0(first, parent.get("step")) else None


def counted_from_0(first_report: int | None, handoff: object) -> bool:
    """Whether a warm lineage took its donor's state and counted its own steps from 0 (a user's loop may): its
    first report at or below the donor's step. One that went on from the donor's step reports past it."""
    return isinstance(handoff, int) and first_report is not None and first_report <= handoff


def lineage_label(trial: FrozenTrial, trials: Sequence[FrozenTrial] | None = None) -> str:
    """One line on where a trial's value came from: "" for a plain cold trial. With the study's `trials`, a warm
    trial's line says what its cold confirmation reached, or that it has none."""
    confirms = trial.user_attrs.get(ATTR_CONFIRMS)
    if isinstance(confirms, int) and not isinstance(confirms, bool):
        return f"cold confirmation of warm trial #{confirms}"
    parent = trial.user_attrs.get(ATTR_WARM_START)
    if not isinstance(parent, Mapping):
        return ""
    label = warm_lineage(parent, trial.user_attrs.get(ATTR_STEPS, "?"), lineage_own_steps(trial, parent))
    if trials is not None:
        label += "; " + _confirmation_text(confirmation_of(trials).get(trial.number))
    return label


def _confirmation_text(confirmation: FrozenTrial | None) -> str:
    if confirmation is None:
        return "not confirmed cold (warm_start.confirm: K retrains the best K warm trials cold)"
    if confirmation.state == TrialState.COMPLETE and confirmation.value is not None:
        return f"cold from its own config: {confirmation.value:.6g} (trial #{confirmation.number})"
    return f"cold confirmation trial #{confirmation.number} is {confirmation.state.name.lower()}"


def confirmation_rows(trials: Sequence[FrozenTrial]) -> list[dict[str, Any]]:
    """Each confirmed warm trial beside its cold retrain: warm number and value, cold number, state and value."""
    by_number = {t.number: t for t in trials}
    rows = []
    for warm_number, cold in sorted(confirmation_of(trials).items()):
        warm = by_number.get(warm_number)
        rows.append({"warm": warm_number, "warm_value": None if warm is None else warm.value,
                     "cold": cold.number, "cold_state": cold.state.name.lower(), "cold_value": cold.value})
    return rows
