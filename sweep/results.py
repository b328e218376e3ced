"""What a study holds, as plain data for the CLI's tables, CSV and JSON."""

from __future__ import annotations

from collections import Counter
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from sweep.outcomes import (
    ATTR_CONFIG,
    ATTR_SPEED,
    ATTR_STEPS,
    ATTR_STEPS_TRAINED,
    ATTR_WALL,
    ATTR_WARM_START,
    SPEC_ATTR,
    budget_counts,
)
from sweep.progress import describe_outcome

__all__ = ["best_config", "state_counts", "steps_trained", "study_status", "trial_rows"]


def state_counts(study: optuna.Study) -> dict[str, int]:
    counts = Counter(t.state.name.lower() for t in study.get_trials(deepcopy=False))
    return dict(sorted(counts.items()))


def _best(study: optuna.Study) -> FrozenTrial | None:
    try:
        return study.best_trial
    except ValueError:  # no complete trial yet
        return None


def study_status(study: optuna.Study) -> dict[str, Any]:
    spec = study.user_attrs.get(SPEC_ATTR, {})
    best = _best(study)
    trials = study.get_trials(deepcopy=False)
    return {
        "study": study.study_name,
        "direction": study.direction.name.lower(),
        "metric": spec.get("metric"),
        "n_trials": spec.get("n_trials"),
        "budget_used": budget_counts(trials)[0],
        "states": state_counts(study),
        "best": None if best is None else {"number": best.number, "value": best.value, "params": best.params,
                                           "warm_start_from": best.user_attrs.get(ATTR_WARM_START, {}).get("trial")},
        "steps_trained": steps_trained(trials),
        "warm_started": sum(ATTR_WARM_START in t.user_attrs for t in trials),
    }


def steps_trained(trials: list[FrozenTrial]) -> int:
    """The optimizer steps the study ran itself: a warm-started trial counts only the steps after its handoff."""
    return sum(int(t.user_attrs.get(ATTR_STEPS_TRAINED, t.user_attrs.get(ATTR_STEPS, 0)) or 0) for t in trials)


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    rows = []
    for trial in study.get_trials(deepcopy=False):
        row: dict[str, Any] = {"number": trial.number, "state": trial.state.name.lower(), "value": trial.value}
        row.update({f"params.{k}": v for k, v in trial.params.items()})
        row["steps"] = trial.user_attrs.get(ATTR_STEPS)
        row["wall_time_s"] = trial.user_attrs.get(ATTR_WALL)
        row["warm_start_from"] = trial.user_attrs.get(ATTR_WARM_START, {}).get("trial")
        row.update(trial.user_attrs.get(ATTR_SPEED, {}))  # samples/s (tokens/s), peak memory: the slow ones show
        row["outcome"] = describe_outcome(trial) if trial.state in (TrialState.PRUNED, TrialState.FAIL) else ""
        rows.append(row)
    return rows


def best_config(study: optuna.Study) -> dict[str, Any]:
    """The resolved `TrainingConfig` of the best trial, ready for `python -m trainer`. Raises ValueError if no trial
    has completed."""
    best = _best(study)
    if best is None:
        raise ValueError(f"study {study.study_name!r} has no complete trial yet")
    return best.user_attrs[ATTR_CONFIG]
