"""`FastFailPruner`: the trainer's fast-fail rules as an Optuna pruner, composed with any other pruner."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from collections.abc import Callable, Container, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import optuna
from optuna.study import StudyDirection
from optuna.trial import TrialState

from sweep.outcomes import ATTR_LOSS_CURVE, ATTR_PRUNE, ATTR_TRAIN_CURVE, ATTR_WARM_START
from trainer.fast_fail_rules import DIVERGED, FastFailConfig, StudyReference, Verdict, judge, study_reference
from trainer.pacing import curriculum_from_dict, stage_starts

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

__all__ = ["FastFailPruner", "at_lineage_steps", "should_prune", "startup_trials"]

_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)

def _diverged(trial: FrozenTrial) -> bool:
    """Whether `trial` diverged: a NaN or an infinity among its reports or its loss curve, or fast-fail pruned it
    as diverged. A run that diverges may first run away in the metric's good direction (a log-likelihood loss of a
    collapsing variance: -1 to -2e7 within 300 steps, then -inf), and such values would set the study's best, the
    scale "near its initial value" is measured on: every later trial that merely learned would be "stuck"."""
    reason = trial.user_attrs.get(ATTR_PRUNE)
    if isinstance(reason, Mapping) and reason.get("rule") in DIVERGED:
        return True
    curve = trial.user_attrs.get(ATTR_LOSS_CURVE)
    losses = [pair[1] for pair in curve if isinstance(pair, (list, tuple)) and len(pair) == 2] \
        if isinstance(curve, (list, tuple)) else []  # written by sweep's reporter; anything else is someone else's
    return not all(isinstance(v, (int, float)) and math.isfinite(v) for v in [*trial.intermediate_values.values(),
                                                                               *losses])


class FastFailPruner(optuna.pruners.BasePruner):
    """Prune a trial whose values are NaN/Inf, have exploded, or never left their initial value; otherwise ask `then`.

    Guarantees (minimised metric; a maximised one mirrors them, without the explosion rule):

    - `nan`, `inf`: the latest value is NaN or an infinity of either sign; at any step, before the warmup and before
      `then` is asked.
    - `explode`: the latest value, after `warmup_steps` and outside a curriculum stage's grace, is above
      `loss_explosion_factor` x the initial value. A finite value worse than the first is not pruned for that alone.
    - `plateau` and `stuck` prune only a trial that is still *near its initial value*: its best so far has covered less
      than `near_initial_pct`% of the way from its initial value to the best value the study's finished (complete or
      pruned) trials reached (their second best values), those that diverged (a NaN or an infinity among their reports
      or their loss, or pruned as diverged: a run that diverges may first run away in the good direction) or never moved
      (best within `min_improvement_pct`% of their start: `study_reference`) excepted. A trial that has left its initial
      value is never pruned by fast-fail for going slowly, sitting on an intermediate plateau, being noisy or
      converging: that is `then`'s call, against the other trials. Until a trial has finished, "near" means "improved by
      less than `near_initial_pct`% of the initial value" (the way to zero). A trial whose best is as good as the best
      value the finished trials reported is never near its start (one that starts there and sits there would end among
      them), so while no finished trial has ended better than a trial's start, plateau and stuck leave it to `then`.
    - `plateau`: near its initial value, and no `min_improvement_pct`% improvement for `patience_steps`, counted from
      its best, the latest curriculum stage change or the end of its learning-rate warmup, whichever is latest.
    - `overfit` (off unless `overfit_gap` is set): validation worse than training by more than `overfit_gap` for
      `overfit_patience_steps` (None: the plateau patience), the gap growing, and validation worse than its best (by
      `min_improvement_pct`) with no new best in that window. A trial whose gap grows while validation still improves
      is never pruned by it. The training values are the trial's `train_curve` user attr (`TrialReporter` writes it
      only while the rule is on).
    - `stuck`: near its initial value `learners_factor` x the `learners_quantile` quantile of the steps the study's
      learners (finished trials that left their initial value, warm-started and diverged ones excepted) took to leave
      theirs, counted from the end of its own learning-rate warmup or from its latest value worse than its initial
      one by more than the near band (a spike: moving, not sitting): its patience follows from the study's own
      curves. Until `min_learners` finished trials have left their initial value, never sooner than plateau's
      patience (the floor; it then also stops a creeper, which plateau's `min_improvement_pct` misses); off before
      any has.

    Stateless: the rules (`trainer.fast_fail_rules.judge`) are applied to the intermediate values Optuna stores for the
    trial and to the study's finished trials, so the answer is the same in any worker, after a restart, on SQLite or
    PostgreSQL. The study's reference (`reference_for`) is computed once per number of finished trials.

    Step 0 is the trainer's reference evaluation before any training: fast-fail judges it for NaN/Inf only, and `then`
    is never asked there, so a pruner comparing trials does not prune on initial weights. Nor does `then` see it at
    later steps: it judges the trial's values from step 1 on, as it would with fast-fail off (a percentile pruner
    compares the trial's best value over all its steps, which the untrained model's value would otherwise be when
    the first steps are worse: a warmup bump, an early spike).

    `patience_steps=None` and `warmup_steps=None` are derived from the trial's `max_steps` and `eval_every_steps`
    (read from its `config` user attr): a quarter of the budget (at least three evaluations), and 2% of it.

    Curricula: the steps at which the trial's curriculum changes stage are computed from the same stored config
    (`trainer.curriculum.stage_starts`, a function of the config alone), so a loss that jumps or stalls when a harder
    stage begins gets `stage_grace_steps` (None: two evaluation intervals) before explosion and plateau apply again.

    Wrapping keeps the wrapped pruner's type: `FastFailPruner(then=HyperbandPruner())` is an instance of a subclass
    of both (`FastFailHyperbandPruner`), whose other methods and attributes are the wrapped instance's. Optuna
    decides some behaviours by the study's pruner type (with Hyperband, the sampler sees only the trial's bracket:
    `optuna.pruners._filter_study`), and they stay on.
    """

    then: optuna.pruners.BasePruner | None

    def __new__(cls, then: optuna.pruners.BasePruner | None = None, **settings: Any) -> FastFailPruner:
        # `FastFailPruner(then=X())` builds a `FastFail` + `X` subclass, so `isinstance(pruner, X)` holds.
        return object.__new__(cls if then is None else _wrapper_class(type(then)))

    def __init__(self, then: optuna.pruners.BasePruner | None = None, *, enabled: bool = True,
                 loss_explosion_factor: float | None = 10.0, patience_steps: int | None = None,
                 min_improvement_pct: float = 1.0, learned_pct: float = 50.0, near_initial_pct: float = 10.0,
                 learners_factor: float | None = 2.0, learners_quantile: float = 0.9, min_learners: int = 5,
                 warmup_steps: int | None = None, check_every_n_steps: int | None = None,
                 stage_grace_steps: int | None = None, overfit_gap: float | None = None,
                 overfit_patience_steps: int | None = None) -> None:
        self.config = FastFailConfig(enabled=enabled, loss_explosion_factor=loss_explosion_factor,
                                     patience_steps=patience_steps, min_improvement_pct=min_improvement_pct,
                                     learned_pct=learned_pct, near_initial_pct=near_initial_pct,
                                     learners_factor=learners_factor, learners_quantile=learners_quantile,
                                     min_learners=min_learners, warmup_steps=warmup_steps,
                                     check_every_n_steps=check_every_n_steps, stage_grace_steps=stage_grace_steps,
                                     overfit_gap=overfit_gap, overfit_patience_steps=overfit_patience_steps)
        problems = self.config.problems()
        if problems:
            raise ValueError("; ".join(f"{key}: {message}" for key, message in problems))
        self.then = then
        # (study name, finished trials) -> the study's reference; the latest one, for `verdict` without a study.
        self._reference: tuple[tuple[str, int], StudyReference] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # The subclass is made at run time: rebuild through the constructor, which makes it again.
        settings = {k: v for k, v in self.config.__dict__.items() if k != "check_every_n_steps" or v is not None}
        return (_rebuild, (self.then, settings))

    @property
    def then_name(self) -> str | None:
        return None if self.then is None else type(self.then).__name__

    def reference_for(self, study: optuna.Study) -> StudyReference:
        """What the study's finished trials say about the next one (`trainer.fast_fail_rules.study_reference`):
        recomputed only when the number of finished trials changes, so `should_prune` stays cheap."""
        finished = study.get_trials(deepcopy=False, states=_FINISHED)
        key = (study.study_name, len(finished))
        if self._reference is None or self._reference[0] != key:
            curves = [sorted(t.intermediate_values.items()) for t in finished
                      if t.intermediate_values and ATTR_WARM_START not in t.user_attrs and not _diverged(t)]
            maximize = study.direction == StudyDirection.MAXIMIZE
            self._reference = (key, study_reference(curves, self.config, maximize=maximize))
        return self._reference[1]

    def verdict(self, series: list[tuple[int, float]], config: Mapping[str, Any], maximize: bool,
                study: optuna.Study | None = None, train_series: Sequence[tuple[int, float]] = (), *,
                warm: bool = False, loss_series: Sequence[tuple[int, float]] = (),
                handoff: tuple[int, float] | None = None) -> Verdict | None:
        """The fast-fail verdict on a trial's reported `(step, value)` pairs; `config` is its TrainingConfig dict;
        `train_series`: the training counterpart's values at those steps (the overfitting rule).
        Without `study`, the reference of the study this pruner judged last (in `prune`) is used, if any.

        `warm`: the trial started from a donor's checkpoint, so its lineage has left its initial value whatever its
        own first report says: plateau and stuck do not apply (its own reports start after the handoff). `handoff`:
        its donor's step and value there (`handoff_point`), which an explosion is measured from, as the trainer's
        loss guard measures it from the donor's weights evaluated: a warm trial's first own value, taken as its
        start, made a fresh optimizer's bump above it an explosion, still below the lineage's untrained value
        (review: pruned as exploded, a warm trial that would have ended the study's best).

        `loss_series`: the trial's val_loss at its evaluations where the study's metric is another (`ATTR_LOSS_CURVE`):
        when the metric's own values give no verdict, a NaN/Inf or exploding loss does (`rule` nan, inf or explode,
        `of: val_loss`). A diverged trial's accuracy sits near chance, which no rule on the accuracy reads as
        divergence, and it ran its whole budget."""
        found = self._verdict(series, config, maximize, study, train_series)
        based = _from_handoff(series, handoff) if warm else None
        if warm and found is not None and (found.rule in ("plateau", "stuck")
                                           or (found.rule == "explode" and based is not None)):
            found = None
        if found is None and based is not None:
            again = self._verdict(based, config, maximize, study, ())
            if again is not None and again.rule == "explode":
                found = dataclasses.replace(again, detail={**again.detail, "handoff": handoff[0]})  # type: ignore[index]
        # A loss that diverged says more than a metric that stopped moving (a diverged trial's accuracy sits still),
        # and a warm trial's loss is judged even where its metric's plateau is not.
        if (found is None or found.rule in ("plateau", "stuck")) and loss_series:
            loss = self._verdict(sorted(loss_series), config, False, study, ())
            if loss is not None and loss.rule in DIVERGED:
                return dataclasses.replace(loss, detail={**(loss.detail or {}), "of": "val_loss"})
        return found

    def _verdict(self, series: list[tuple[int, float]], config: Mapping[str, Any], maximize: bool,
                 study: optuna.Study | None, train_series: Sequence[tuple[int, float]]) -> Verdict | None:
        max_steps = int(config.get("max_steps", 0))
        if max_steps > 0:
            resolved = self.config.resolved(max_steps, int(config.get("eval_every_steps", 1)))
        else:  # a trial not started by sweep: the derived rules have nothing to derive from
            resolved = FastFailConfig(**{**self.config.__dict__, "patience_steps": self.config.patience_steps or 0,
                                         "warmup_steps": self.config.warmup_steps or 0,
                                         "stage_grace_steps": self.config.stage_grace_steps or 0,
                                         "overfit_patience_steps": self.config.overfit_patience_steps or 0})
        if study is not None:
            reference: StudyReference | None = self.reference_for(study)
        else:
            reference = None if self._reference is None else self._reference[1]
        return judge(series, resolved, maximize=maximize, stage_starts=self.stage_starts(config, max_steps),
                     reference=reference, lr_warmup_steps=int(config.get("warmup_steps") or 0),
                     train_series=train_series)

    @staticmethod
    def stage_starts(config: Mapping[str, Any], max_steps: int) -> tuple[int, ...]:
        """Where the trial's curriculum changes stage. A curriculum the pruner cannot evaluate (a stored config from
        an older version, a user schedule that does not import here) counts as none: the trial itself fails on such
        a curriculum, with the real error, when it starts."""
        if max_steps <= 0:
            return ()
        try:
            return stage_starts(curriculum_from_dict(config.get("curriculum")), max_steps)
        except (TypeError, ValueError):
            return ()

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        series = sorted(trial.intermediate_values.items())
        if not series:
            return False
        maximize = study.direction == StudyDirection.MAXIMIZE
        train = [(int(s), float(v)) for s, v in trial.user_attrs.get(ATTR_TRAIN_CURVE, ())]
        loss = [(int(s), float(v)) for s, v in trial.user_attrs.get(ATTR_LOSS_CURVE, ())]
        if self.verdict(series, trial.user_attrs.get("config", {}), maximize, study, train,
                        warm=ATTR_WARM_START in trial.user_attrs, loss_series=loss,
                        handoff=handoff_point(trial.user_attrs)) is not None:
            return True
        if self.then is None or series[-1][0] == 0:
            return False
        if ATTR_WARM_START in trial.user_attrs and judges_by_rungs(self.then):
            return False  # see `judges_by_rungs`
        return self.then.prune(_StudyView(study, _as_judged), _as_judged(trial))  # type: ignore[arg-type]


# What the constructor takes is `__init__`'s signature (inspect would read `__new__`'s): the study file's arguments are
# checked against it (`sweep.components`).
_init = inspect.signature(FastFailPruner.__init__)
setattr(FastFailPruner, "__signature__", _init.replace(parameters=list(_init.parameters.values())[1:]))  # noqa: B010


def _without_reference(trial: FrozenTrial) -> FrozenTrial:
    """The trial as the wrapped pruner sees it: without the step-0 evaluation, which the trainer makes only for
    fast-fail. A percentile pruner compares a trial's best value over all its steps with the other trials' values at
    the latest step, and the untrained model's value can be better than the first steps' (a warmup bump, an early
    spike): it would shield the trial from a pruner that stops it when fast-fail is off."""
    if 0 not in trial.intermediate_values:
        return trial
    view = copy.copy(trial)
    view.intermediate_values = {step: value for step, value in trial.intermediate_values.items() if step != 0}
    return view


def _as_judged(trial: FrozenTrial) -> FrozenTrial:
    """The trial as a pruner fast-fail wraps sees it: without the step-0 evaluation, at its lineage's steps."""
    return at_lineage_steps(_without_reference(trial))


def handoff_point(attrs: Mapping[str, Any]) -> tuple[int, float] | None:
    """A warm trial's donor step and its value there (`warm_start_from`), where that value is a finite number."""
    parent = attrs.get(ATTR_WARM_START)
    if not isinstance(parent, Mapping):
        return None
    step, value = parent.get("step"), parent.get("value")
    if (not isinstance(step, int) or isinstance(step, bool) or not isinstance(value, (int, float))
            or isinstance(value, bool) or not math.isfinite(value)):
        return None
    return step, float(value)


def _from_handoff(series: list[tuple[int, float]],
                  handoff: tuple[int, float] | None) -> list[tuple[int, float]] | None:
    """A warm trial's reports after the value it took over (`handoff_point`), which stands first: at the donor's
    step, or just before the trial's first report where it counts its own steps from 0. None without a handoff
    value, or where the trial's first report is at the donor's step (its own evaluation of the donor's weights,
    its start as it is)."""
    if handoff is None or not series or series[0][0] == handoff[0]:
        return None
    step, value = handoff
    first = series[0][0]
    return [(step if step < first else first - 1, value), *series]


def at_lineage_steps(trial: FrozenTrial) -> FrozenTrial:
    """The trial with its reports at its lineage's steps. A user's loop or command may take a warm start's state and
    count its own steps from 0 (the README's example does): its report at step s follows the donor's d steps, and
    stands at d + s. Compared at s, with cold trials that had trained s steps, it set the median pruner's bar, and
    good cold trials were pruned by it (review: the study's best cold config, at 10% of its budget). The trainer's
    warm trials, and loops that count on from the donor's step, report past it: as they are. A first report at the
    donor's step is taken as going on from there too: a loop that evaluates the donor's weights before it trains
    makes one (diff review: shifted, its every later report was judged at twice its step, and a trial better than
    the cold ones at each step was pruned at its first own step); `should_prune` leaves that report unjudged. The
    README's loop after a donor pruned at its first evaluation reports there as well, and is then judged at its own
    steps, a little ahead of the cold trials: the lesser error."""
    parent = trial.user_attrs.get(ATTR_WARM_START)
    if not isinstance(parent, Mapping) or not trial.intermediate_values:
        return trial
    handoff = parent.get("step")
    if not isinstance(handoff, int) or min(trial.intermediate_values) >= handoff:
        return trial
    view = copy.copy(trial)
    view.intermediate_values = {step + handoff: value for step, value in trial.intermediate_values.items()}
    return view


def should_prune(trial: optuna.Trial, lineages: bool) -> bool:
    """`trial.should_prune()`; with `lineages` (warm start on, in a study of a loop or a command, whose warm trials may
    count their steps from 0), every trial's reports at its lineage's steps for a pruner of Optuna's or of the study
    file's own (`at_lineage_steps`; fast-fail puts the pruner it wraps at them itself)."""
    study = trial.study
    if not lineages or len(study.directions) > 1:
        return trial.should_prune()
    latest = trial._get_latest_trial()  # noqa: SLF001 - what `should_prune` judges: the trial as reported so far
    parent = latest.user_attrs.get(ATTR_WARM_START)
    if isinstance(parent, Mapping) and list(latest.intermediate_values) == [parent.get("step")]:
        # Its one report is at the donor's step: the donor's value, where it goes on from there and evaluated first
        # (or its own after as many steps, counted from 0): no trial is judged with no step of its own. Its next is.
        return False
    if isinstance(study.pruner, FastFailPruner):  # it puts the pruner it wraps at the lineages' steps itself
        return study.pruner.prune(study, latest)
    return study.pruner.prune(_StudyView(study, at_lineage_steps), at_lineage_steps(latest))  # type: ignore[arg-type]


def judges_by_rungs(pruner: optuna.pruners.BasePruner | None) -> bool:
    """Whether `pruner`, or one it wraps, is successive halving's (Hyperband's brackets are too). Such a pruner never
    judges a warm trial: its first report (the first step it trained itself, past the handoff) would be written into
    every rung below that step, where cold trials' rungs hold what they reached after far fewer updates, and cold
    trials would be pruned for being compared with it. Fast-fail's rules still judge it."""
    while pruner is not None:
        if isinstance(pruner, FastFailPruner):
            pruner = pruner.then
        elif isinstance(pruner, (optuna.pruners.SuccessiveHalvingPruner, optuna.pruners.HyperbandPruner)):
            return True
        else:
            pruner = getattr(pruner, "_wrapped_pruner", None)  # PatientPruner's
    return False


class _StudyView:
    """The study as a pruner sees it: every trial as the judged one is (`view`). Fast-fail's wrapped pruner sees each
    without the step-0 evaluation, so that it judges as it does with fast-fail off (no step 0 anywhere), and at its
    lineage's steps (`at_lineage_steps`). Its best trial too (Wilcoxon's safety compares the mean of the best trial's
    values with the judged trial's, and the untrained model's value in one of them only made the best trial look
    worse), and the trials `get_trials` gives (the leaders and forecast pruners read whole curves: the leaders'
    untrained value, kept, set a bar at the early steps that a trial with the leaders' own curve missed, and it was
    pruned; Optuna's median and percentile pruners read the completed trials' values at the judged trial's step)."""

    def __init__(self, study: optuna.Study, view: Callable[[FrozenTrial], FrozenTrial]) -> None:
        self._study, self._view = study, view

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        return [self._view(t) for t in self._study.get_trials(deepcopy=deepcopy, states=states)]

    @property
    def trials(self) -> list[FrozenTrial]:
        return self.get_trials()

    @property
    def best_trial(self) -> FrozenTrial:
        return self._view(self._study.best_trial)

    @property
    def best_trials(self) -> list[FrozenTrial]:
        return [self._view(t) for t in self._study.best_trials]


def startup_trials(pruner: optuna.pruners.BasePruner | None) -> int:
    """How many completed trials `pruner` waits for before it judges any trial: the `n_startup_trials` of Optuna's
    median and percentile pruners and of the forecast and leaders pruners, found through fast-fail's `then` and Optuna's
    `PatientPruner`; 0 for the others (fast-fail's own rules, Hyperband, successive halving and the threshold pruner
    judge from the first trial on)."""
    while pruner is not None:
        for name in ("_n_startup_trials", "n_startup_trials"):
            count = vars(pruner).get(name)
            if isinstance(count, int) and not isinstance(count, bool):
                return count
        pruner = vars(pruner).get("then") or vars(pruner).get("_wrapped_pruner")
    return 0


def _rebuild(then: optuna.pruners.BasePruner | None, settings: dict[str, Any]) -> FastFailPruner:
    return FastFailPruner(then, **settings)


_WRAPPERS: dict[type, type[FastFailPruner]] = {}
# Methods every pruner has, which the wrapper keeps as its own or as BasePruner's.
_OWN = {name for klass in (FastFailPruner, optuna.pruners.BasePruner, object) for name in vars(klass)}


def _forward(name: str) -> Callable[..., Any]:
    def forwarded(self: FastFailPruner, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.then, name)(*args, **kwargs)
    forwarded.__name__ = name
    return forwarded


def _delegate(self: FastFailPruner, name: str) -> Any:
    """Attributes the wrapper lacks are the wrapped instance's (`_n_brackets`, `_min_resource`...)."""
    then = self.__dict__.get("then")
    if then is None:
        raise AttributeError(name)
    return getattr(then, name)


def _wrapper_class(wrapped: type) -> type[FastFailPruner]:
    """`FastFailPruner` as a subclass of `wrapped` too: every method of `wrapped` but `prune` runs on the wrapped
    instance, so whatever Optuna asks of a pruner of that type (`_get_bracket_id`, `_create_bracket_study`) is
    answered from the wrapped pruner's own state. One class per wrapped class."""
    if issubclass(wrapped, FastFailPruner):
        return wrapped  # fast-fail around fast-fail: the outer one forwards to the inner one, which forwards on
    if wrapped not in _WRAPPERS:
        methods = {name: _forward(name) for klass in wrapped.__mro__ if klass not in (optuna.pruners.BasePruner, object)
                   for name, member in vars(klass).items()
                   if name not in _OWN and (inspect.isfunction(member) or isinstance(member, (classmethod,
                                                                                               staticmethod)))}
        name = f"FastFail{wrapped.__name__}"
        _WRAPPERS[wrapped] = type(name, (FastFailPruner, wrapped), {
            **methods, "__getattr__": _delegate, "__module__": __name__, "__qualname__": name,
            "__doc__": f"`FastFailPruner` wrapping a `{wrapped.__name__}`, and an instance of it."})
    return _WRAPPERS[wrapped]
