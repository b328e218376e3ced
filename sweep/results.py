"""What a study holds, as plain data for the CLI's tables, CSV and JSON."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from sweep.confirm import NO_COMPLETE_TRIAL, confirmation_rows, lineage_label, no_best, study_best, warm_starts
from sweep.outcomes import (
    ATTR_CONFIG,
    ATTR_CONFIRMS,
    ATTR_LOG,
    ATTR_OUTCOME,
    ATTR_REPRO,
    ATTR_RESUMED_FROM,
    ATTR_RETRY_OF,
    ATTR_SPEED,
    ATTR_STEPS,
    ATTR_STEPS_TRAINED,
    ATTR_WALL,
    ATTR_WARM_START,
    SPEC_ATTR,
    STOP_ATTR,
    budget_counts,
    count_key,
)
from sweep.progress import outcome_text
from sweep.storage import clock_offset

__all__ = ["ForeignStudyError", "best_config", "best_trial", "confirm_count", "failed_run", "finished_since",
           "lineage_label", "made_by_sweep", "no_best_line", "require_sweep_study", "state_counts", "steps_trained",
           "stop_requested_since", "study_status", "trial_rows", "trial_states", "trials_per_hour"]


class ForeignStudyError(Exception):
    """A command that needs what sweep stores on a study (its definition, each trial's config) was given an Optuna
    study that sweep did not create: bad input, not a broken study."""


def trial_states(study: optuna.Study) -> dict[int, TrialState]:
    """Each trial's state now, by number: what `finished_since` tells a run's own trials by."""
    return {trial.number: trial.state for trial in study.get_trials(deepcopy=False)}


def finished_since(study: optuna.Study, before: Mapping[int, TrialState]) -> Counter[str]:
    """The trials that finished since `before` was taken (new ones, and queued ones taken up), counted as
    `LiveProgress.counts` counts them (`outcomes.count_key`: `complete`, `pruned`, `fail`, or why a trial that is
    retried ended). A trial running then is another's."""
    return Counter(count_key(trial) for trial in study.get_trials(deepcopy=False)
                   if trial.state.is_finished() and before.get(trial.number) in (None, TrialState.WAITING))


def stop_requested_since(study: optuna.Study, since: float) -> bool:
    """Whether `sweep stop` asked the study's workers to stop after `since` (a time.time() of this machine; the stop
    is stored by the storage's clock, `request_stop`)."""
    requested = study.user_attrs.get(STOP_ATTR)
    return requested is not None and requested - clock_offset(study._storage) > since  # noqa: SLF001


def failed_run(counts: Mapping[str, int]) -> str | None:
    """What `sweep run` says, exiting 1, when every trial it finished failed: none complete or pruned, at least one
    failed. None otherwise (a run that found its budget spent finished none: nothing failed)."""
    failed = counts.get("fail", 0)
    if not failed or counts.get("complete", 0) or counts.get("pruned", 0):
        return None
    return (f"every trial of this run failed ({failed} failed, none complete or pruned); `sweep trials` shows each "
            "one's reason")


def made_by_sweep(study: optuna.Study) -> bool:
    """Whether sweep created the study: it stores the study's definition on it."""
    return SPEC_ATTR in study.user_attrs


def require_sweep_study(study: optuna.Study, doing: str) -> None:
    """Raise `ForeignStudyError` (saying what could not be done) unless sweep created the study."""
    if not made_by_sweep(study):
        reads = ("`sweep status` and `sweep trials`" if len(study.directions) == 1 else  # they read one objective
                 "`sweep dashboard`")
        raise ForeignStudyError(f"study {study.study_name!r} was not created by sweep (it holds no {SPEC_ATTR!r}), so "
                                f"sweep cannot {doing}; it reads such a study with {reads}")


def state_counts(study: optuna.Study) -> dict[str, int]:
    counts = Counter(t.state.name.lower() for t in study.get_trials(deepcopy=False))
    return dict(sorted(counts.items()))


def silent_running(study: optuna.Study) -> dict[int, float]:
    """Seconds since each running trial's worker last beat, by trial number, on the database's clock (as Optuna's
    stale-trial check reads it). A trial silent past the study's grace period has lost its worker: only a worker
    fails it (the next to open the study, which queues its retry); read commands write nothing. Empty when the
    storage keeps no heartbeats (a study not run by sweep, a storage that is no database) or cannot say."""
    import sqlalchemy
    from optuna.storages import RDBStorage
    from optuna.storages._rdb import models

    storage = study._storage  # noqa: SLF001 - Optuna has no public handle on a study's storage
    backend = getattr(storage, "_backend", storage)
    if not isinstance(backend, RDBStorage) or not any(t.state == TrialState.RUNNING
                                                      for t in study.get_trials(deepcopy=False)):
        return {}
    session = backend.scoped_session()
    try:
        now = session.execute(sqlalchemy.func.now()).scalar()
        rows = (session.query(models.TrialModel.number, models.TrialHeartbeatModel.heartbeat)
                .join(models.TrialHeartbeatModel, models.TrialHeartbeatModel.trial_id == models.TrialModel.trial_id)
                .filter(models.TrialModel.study_id == study._study_id)  # noqa: SLF001
                .filter(models.TrialModel.state == TrialState.RUNNING).all())
    except sqlalchemy.exc.SQLAlchemyError:
        return {}
    finally:
        session.rollback()
        backend.scoped_session.remove()
    if now is None:
        return {}
    now = now.replace(tzinfo=None)  # PostgreSQL's is aware, the stored beats are not (as Optuna compares them)
    return {number: max(0.0, (now - beat).total_seconds()) for number, beat in rows if beat is not None}


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """The study's best trial as sweep reports it (`sweep.confirm.study_best`): with `warm_start.confirm` on, the best
    trial trained cold; otherwise the best complete trial, warm or not. None while no trial has completed. In a
    study sweep made, only the trials it ran count (`ran_by_sweep`)."""
    return study_best(_ranked_trials(study), study.direction == StudyDirection.MAXIMIZE, confirm=confirm_count(study))


def no_best_line(study: optuna.Study) -> str:
    """Why `best_trial` is None (`sweep.confirm.no_best`), naming the complete trials that do not count where there
    are some (review: "no trial has completed yet" beside `complete 1`, a value of -inf, or a trial added from
    outside a study sweep made)."""
    ranked = _ranked_trials(study)
    line = no_best(ranked, study.direction == StudyDirection.MAXIMIZE, confirm=confirm_count(study))
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    if not complete or line != NO_COMPLETE_TRIAL:
        return line
    counted = {t.number for t in ranked}
    outside = sum(t.number not in counted for t in complete)
    infinite = sum(t.number in counted for t in complete)  # counted, complete, and still no best: not finite
    why = [f"{infinite} {'has a value that is' if infinite == 1 else 'have values that are'} not a finite number"
           if infinite else "",
           f"{outside} {'was' if outside == 1 else 'were'} not run by sweep (added from outside: not counted)"
           if outside else ""]
    return (f"no trial has completed with a value to rank: of {len(complete)} complete, "
            + " and ".join(filter(None, why)))


# What a worker of sweep writes on every trial it trains (its config, its outcome), or asks (a retry, a confirmation).
_RAN_MARKS = (ATTR_CONFIG, ATTR_OUTCOME, ATTR_RETRY_OF, ATTR_CONFIRMS, ATTR_WARM_START)


def ran_by_sweep(trial: FrozenTrial) -> bool:
    """Whether a worker of sweep trained the trial. A trial added to the study from outside (`Study.add_trial`, a
    baseline's known value) holds none of what a worker writes, its config first: nothing could train it again."""
    return any(key in trial.user_attrs for key in _RAN_MARKS)


def added_from_outside(study: optuna.Study) -> FrozenTrial | None:
    """The best complete trial added to a study sweep made from outside, when it beats every trial sweep ran (review:
    it became the study's best, and `sweep best`, which writes the best trial's config, refused the study); else
    None."""
    if not made_by_sweep(study):
        return None
    foreign = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE and not ran_by_sweep(t)]
    top = study_best(foreign, study.direction == StudyDirection.MAXIMIZE)
    ours = best_trial(study)
    if top is None or ours is None:
        return top
    return top if study_best([top, ours], study.direction == StudyDirection.MAXIMIZE) is top else None


def _ranked_trials(study: optuna.Study) -> list[FrozenTrial]:
    """The trials the study's best is chosen from: in a study sweep made, those it ran."""
    trials = study.get_trials(deepcopy=False)
    return [t for t in trials if ran_by_sweep(t)] if made_by_sweep(study) else trials


def confirm_count(study: optuna.Study) -> int:
    """The stored spec's `warm_start.confirm` (0 when off, or when what the storage holds is not a count)."""
    spec = study.user_attrs.get(SPEC_ATTR)
    warm_start = spec.get("warm_start") if isinstance(spec, dict) else None
    confirm = warm_start.get("confirm") if isinstance(warm_start, dict) else None
    return confirm if isinstance(confirm, int) and not isinstance(confirm, bool) and confirm > 0 else 0


def study_status(study: optuna.Study) -> dict[str, Any]:
    """The status of a study. `n_trials` is None for a study sweep did not create (`made_by_sweep` False): such a
    study has no budget, and its metric is the name Optuna holds for it, if any."""
    spec = study.user_attrs.get(SPEC_ATTR, {})
    best = best_trial(study)
    trials = study.get_trials(deepcopy=False)
    metric_names = study.metric_names
    return {
        "study": study.study_name,
        "made_by_sweep": made_by_sweep(study),
        "direction": study.direction.name.lower(),
        "metric": spec.get("metric", metric_names[0] if metric_names else None),
        "n_trials": spec.get("n_trials"),
        "budget_used": budget_counts(trials)[0],
        "states": state_counts(study),
        "silent": silent_running(study),
        "grace_period": spec.get("heartbeat_grace_period", 60) if spec else None,
        "best": None if best is None else {"number": best.number, "value": best.value, "params": best.params,
                                           "warm_start_from": donor_label(best, study.study_name),
                                           "lineage": lineage_label(best, trials)},
        "no_best": None if best is not None else no_best_line(study),
        "confirmations": confirmation_rows(trials),
        "steps_trained": steps_trained(trials),
        "warm_started": len(warm_starts(trials)),  # one per lineage
        "trials_per_hour": trials_per_hour(trials),
        "cohorts": cohort_sizes(trials),
    }


def cohort_sizes(trials: Sequence[FrozenTrial]) -> list[int]:
    """The cohort sizes the study's trials trained in, 1 among them when some trained alone beside others that
    trained in cohorts (a run with `--cohort 1`, a retry alone; review: the throughput read "in cohorts of 3" for a
    study whose first trials ran alone); empty when none trained in a cohort."""
    sizes = {size for t in trials if isinstance(c := t.user_attrs.get("cohort"), dict)
             and (size := _whole(c.get("size"))) is not None}
    if sizes and any(t.datetime_start is not None and t.state != TrialState.WAITING
                     and not isinstance(t.user_attrs.get("cohort"), dict) for t in trials):
        sizes.add(1)
    return sorted(sizes)


def donor_label(trial: FrozenTrial, study_name: str) -> int | str | None:
    """The trial a warm-started trial started from: its number, or `study#number` for another study's (from_studies)."""
    parent = trial.user_attrs.get(ATTR_WARM_START)
    if not isinstance(parent, dict):
        return None
    donor_study = parent.get("study")
    return parent.get("trial") if donor_study in (None, study_name) else f"{donor_study}#{parent.get('trial')}"


def trials_per_hour(trials: list[FrozenTrial]) -> float | None:
    """Trials finished per hour of the study's wall time, from the first trial's start to the last one's end (time
    between runs of the study counts too). Finished as the budget counts them: a trial interrupted, preempted or lost
    is trained again by its retry, so its time counts but not the trial. None before two trials have finished."""
    spans = [(t.datetime_start, t.datetime_complete) for t in trials
             if t.datetime_complete is not None and t.datetime_start is not None]
    finished = budget_counts(trials)[0]
    if finished < 2 or not spans:
        return None
    seconds = (max(end for _, end in spans) - min(start for start, _ in spans)).total_seconds()
    return 3600.0 * finished / seconds if seconds > 0 else None


def steps_trained(trials: list[FrozenTrial]) -> int:
    """The optimizer steps the study ran itself: a warm-started trial counts only the steps after its handoff, a
    retry those after the step it resumed from. An interrupted trial credited up to its last evaluation trained on
    to the checkpoint its retry resumed from: those steps count too (they were counted nowhere)."""
    by_number = {t.number: t for t in trials}
    total = sum(_steps_of(t) for t in trials)
    for trial in trials:
        resumed = trial.user_attrs.get(ATTR_RESUMED_FROM)
        if not isinstance(resumed, dict) or not isinstance(number := resumed.get("trial"), int):
            continue
        origin, step = by_number.get(number), resumed.get("step")
        if origin is not None and isinstance(step, int) and not isinstance(step, bool):
            total += max(0, step - (_start_of(origin) + _steps_of(origin)))
    return total


def _start_of(trial: FrozenTrial) -> int:
    """The step a trial's own training began at: its resume point, its donor's step, or 0."""
    resumed, handoff = (attr.get("step") if isinstance(attr := trial.user_attrs.get(key), dict) else None
                        for key in (ATTR_RESUMED_FROM, ATTR_WARM_START))
    if isinstance(resumed, int):
        return resumed
    if isinstance(handoff, int) and (not trial.intermediate_values or min(trial.intermediate_values) > handoff):
        return handoff  # it went on from its donor's step; one whose reports begin at or below it counted from 0
    return 0


def _steps_of(trial: FrozenTrial) -> int:
    """A trial's own steps: as it recorded them at its end, else (interrupted, preempted, lost, failed before it
    recorded them, or running) up to its last evaluation, from where it started: its resume point or its handoff."""
    recorded = _whole(trial.user_attrs.get(ATTR_STEPS_TRAINED))
    recorded = recorded if recorded is not None else _whole(trial.user_attrs.get(ATTR_STEPS))
    if recorded is not None or not trial.intermediate_values:
        return recorded or 0
    return max(0, int(max(trial.intermediate_values)) - _start_of(trial))


def _whole(value: Any) -> int | None:
    """A user attr that is sweep's count (steps): an int, else None. A study another tool made may hold attrs of
    these names with its own meanings (review: `steps: [100, 200]` and `cohort: "control"` made `sweep status` and
    `sweep trials` refuse the study)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """One row per trial: its text as stored (the table and the CSV escape control characters as they print them;
    JSON has its own escaping)."""
    rows = []
    foreign = not made_by_sweep(study)
    for trial in study.get_trials(deepcopy=False):
        row: dict[str, Any] = {"number": trial.number, "state": trial.state.name.lower(), "value": trial.value}
        params = trial.params
        if trial.state == TrialState.WAITING and isinstance(queued := trial.system_attrs.get("fixed_params"), dict):
            params = queued  # a queued retry's: Optuna holds them aside until a worker asks for it
        row.update({f"params.{k}": v for k, v in params.items()})
        row["steps"] = _whole(trial.user_attrs.get(ATTR_STEPS))
        if row["steps"] is None and trial.intermediate_values:  # not ended by itself: as far as its reports go
            row["steps"] = int(max(trial.intermediate_values))
        wall = trial.user_attrs.get(ATTR_WALL)
        row["wall_time_s"] = wall if isinstance(wall, (int, float)) and not isinstance(wall, bool) else None
        row["warm_start_from"] = donor_label(trial, study.study_name)
        row["confirms"] = _whole(trial.user_attrs.get(ATTR_CONFIRMS))  # a cold retrain of that warm trial
        cohort = trial.user_attrs.get("cohort")  # trained batched with others (sweep.cohort)
        cohort = cohort if isinstance(cohort, dict) else {}
        row["cohort"], row["cohort_size"] = cohort.get("id"), cohort.get("size")
        speed = trial.user_attrs.get(ATTR_SPEED)  # samples/s (tokens/s), peak memory: the slow ones show
        if isinstance(speed, dict):  # never in place of a column above (a database edited by hand)
            row.update({key: value for key, value in speed.items() if key not in row})
        row["outcome"] = outcome_text(trial, foreign=foreign) if trial.state in (TrialState.PRUNED,
                                                                                 TrialState.FAIL) else ""
        if ATTR_LOG in trial.user_attrs:  # a command's stdout and stderr
            row["log"] = trial.user_attrs[ATTR_LOG]
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Retraining:
    """How `python -m trainer` trains a trial's config again to the value the study holds: `config` with fast-fail
    off (the study judged the trial with its pruner; alone, fast-fail's own rules might stop it), under the torch
    thread count it ran with (`env`: CPU kernels sum in another order on another count), and a comment saying so."""

    config: dict[str, Any]
    env: str
    comment: str


def retraining(trial: FrozenTrial, config: Mapping[str, Any]) -> Retraining:
    again = copy.deepcopy(dict(config))
    notes = []
    fast_fail = again.get("fast_fail")
    if isinstance(fast_fail, dict) and fast_fail.get("enabled"):
        again["fast_fail"] = {**fast_fail, "enabled": False}
        notes.append("fast_fail is off: the study judged this trial with its pruner, and alone fast-fail's own rules "
                     "might stop it early")
    threads = trial_threads(trial)
    env = ""
    if threads is not None:
        env = f"OMP_NUM_THREADS={threads} "
        notes.append(f"it trained with {threads} torch thread{'s' if threads > 1 else ''}: on a CPU another count "
                     "sums in another order, and the last digits differ")
    return Retraining(again, env, "".join(f"# {note}\n" for note in notes))


def trial_threads(trial: FrozenTrial) -> int | None:
    """The torch thread count a trial trained with, from its reproducibility record: the trainer's own count, or
    (a command's, whose process is not the worker's) the OMP_NUM_THREADS it inherited; None when neither is known."""
    record = (trial.user_attrs.get(ATTR_REPRO) or {}).get("threads") or {}
    threads = record.get("intra_op", record.get("OMP_NUM_THREADS"))
    if isinstance(threads, str) and threads.isdigit():
        threads = int(threads)
    return threads if isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1 else None


class NoCompleteTrial(ValueError):
    """The study has no complete trial, so no best one."""


def best_config(study: optuna.Study) -> dict[str, Any]:
    """The resolved `TrainingConfig` of the best trial, ready for `python -m trainer`. Raises `NoCompleteTrial` if no
    trial has completed, and `ForeignStudyError` for a study (or a best trial) that sweep did not make."""
    require_sweep_study(study, "write its best trial's TrainingConfig")
    best = best_trial(study)
    if best is None:
        raise NoCompleteTrial(f"study {study.study_name!r}: {no_best_line(study)}")
    if ATTR_CONFIG not in best.user_attrs:
        raise ForeignStudyError(f"the best trial of study {study.study_name!r}, #{best.number}, holds no recorded "
                                f"config ({ATTR_CONFIG!r}): it was not run by sweep")
    return best.user_attrs[ATTR_CONFIG]
