"""FastFailPruner through Optuna's public API: curve in, pruned step out."""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from sweep.components import PRUNERS, build_pruner
from sweep.objective import TrialReporter
from sweep.outcomes import ATTR_WARM_START
from sweep.progress import NoEvents
from sweep.pruners import FastFailPruner
from sweep.schema import Component, StudyFileError
from sweep.spec import parse_spec
from sweep.storage import Boundary
from tests.conftest import TINY_STUDY

NAN, INF = math.nan, math.inf
optuna.logging.set_verbosity(optuna.logging.WARNING)

# Trials of max_steps=1000, evaluated every 10 steps: the plateau patience defaults to 250 steps, the warmup to 20.
CONFIG = {"max_steps": 1000, "eval_every_steps": 10}


def curve(values: Sequence[float], every: int = 10, start: int = 0) -> list[tuple[int, float]]:
    return [(start + i * every, v) for i, v in enumerate(values)]


def decaying(n: int, start: float = 2.3, rate: float = 0.97, floor: float = 0.0) -> list[float]:
    return [max(floor, start * rate**i) for i in range(n)]


rng = random.Random(0)
NOISY = [2.3 * 0.98**i * (1 + rng.uniform(-0.15, 0.15)) for i in range(101)]

CURVES = [
    pytest.param(curve([2.3, 2.0, 1.8, NAN, 1.0]), None, 30, id="nan-after-a-good-start"),
    pytest.param(curve([NAN]), None, 0, id="nan-at-step-0-before-warmup"),
    pytest.param(curve([2.3, 2.0, INF]), None, 20, id="plus-inf"),
    pytest.param(curve([2.3, 2.0, -INF]), None, 20, id="minus-inf"),
    pytest.param(curve(decaying(10) + [30.0]), None, 100, id="explosion-after-a-good-start"),
    pytest.param(curve([2.3, 40.0, 45.0, 50.0]), None, 20, id="explosion-waits-for-warmup"),
    pytest.param(curve([2.3, 2.0, 22.9]), None, None, id="below-the-explosion-factor"),
    pytest.param(curve([2.3] * 101), None, 250, id="flat-plateau"),
    pytest.param(curve([2.3 - 0.0005 * 10 * i for i in range(101)]), None, None, id="slow-but-steady"),
    pytest.param(curve([2.3] * 20 + decaying(81, 2.3, 0.97)), None, None, id="slow-start-then-learns"),
    pytest.param(curve(NOISY), None, None, id="noisy-but-improving"),
    pytest.param(curve(decaying(10, 2.3, 0.6) + [0.03 + 0.0001 * i for i in range(91)]), None, None,
                 id="converged-then-flat-is-not-a-failure"),
    pytest.param(curve([0.1] * 101), "maximize", 250, id="maximize-flat-plateau"),
    pytest.param(curve([0.1 + 0.008 * i for i in range(101)]), "maximize", None, id="maximize-learning"),
    pytest.param(curve([0.9, 0.1, 0.05, 0.05, 0.05, 0.05]), "maximize", None, id="maximize-has-no-explosion-rule"),
]


def pruned_step(pruner: optuna.pruners.BasePruner, values: list[tuple[int, float]], direction: str = "minimize",
                history: Sequence[list[tuple[int, float]]] = (), storage: str | None = None,
                config: dict | None = None) -> int | None:
    """Report `values` one by one through the public API; the step at which should_prune() first says yes."""
    # A fixed name: Hyperband assigns trials to brackets by hashing the study name.
    study = optuna.create_study(direction=direction, pruner=pruner, storage=storage, study_name="curve")
    # Successive halving (and so Hyperband) records each trial's rungs inside should_prune(): finished trials must
    # have asked. Other pruners read only the stored values, and asking costs Wilcoxon a test per step.
    ask = isinstance(pruner, (optuna.pruners.SuccessiveHalvingPruner, optuna.pruners.HyperbandPruner)) or (
        isinstance(pruner, FastFailPruner) and isinstance(pruner.then, (optuna.pruners.SuccessiveHalvingPruner,
                                                                         optuna.pruners.HyperbandPruner)))
    for past in history:  # finished trials for pruners that compare against others
        trial = study.ask()
        for step, value in past:
            trial.report(value, step)
            if ask:
                trial.should_prune()
        study.tell(trial, past[-1][1])
    trial = study.ask()
    trial.set_user_attr("config", CONFIG if config is None else config)  # the trial's stored TrainingConfig
    for step, value in values:
        trial.report(value, step)
        if trial.should_prune():
            return step
    return None


@pytest.mark.parametrize(("values", "direction", "expected"), CURVES)
def test_fast_fail_prunes_at_the_expected_step(values, direction, expected) -> None:
    assert pruned_step(FastFailPruner(), values, direction or "minimize") == expected


def test_explicit_settings_override_the_derived_ones() -> None:
    flat = curve([2.3] * 30)
    assert pruned_step(FastFailPruner(patience_steps=50, warmup_steps=0), flat) == 50
    assert pruned_step(FastFailPruner(patience_steps=0), curve([2.3] * 101)) is None  # plateau rule off
    assert pruned_step(FastFailPruner(loss_explosion_factor=None), curve(decaying(10) + [30.0])) is None
    assert pruned_step(FastFailPruner(enabled=False), curve([2.3, NAN])) is None


@pytest.mark.parametrize("bad", [{"loss_explosion_factor": 0.5}, {"patience_steps": -1},
                                 {"min_improvement_pct": 100}, {"check_every_n_steps": 0}])
def test_bad_settings_name_the_value(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        FastFailPruner(**bad)


# Finished trials that learn well, and a trial that does worse but has left its initial value: fast-fail has nothing
# against it (no NaN, no explosion, not near its initial value), so whatever prunes it is the wrapped pruner.
GOOD = [curve(decaying(31, 2.3, 0.9 - 0.01 * k), start=10) for k in range(6)]
WORSE = curve([2.3] + decaying(30, 1.9, 0.985), start=10)
RISING = curve([2.3, 2.0, 1.8, 1.9, 2.0, 2.1, 2.2], start=10)
WRAPPED = [
    pytest.param(lambda: optuna.pruners.MedianPruner(n_startup_trials=3), WORSE, id="median"),
    pytest.param(lambda: optuna.pruners.PercentilePruner(25.0, n_startup_trials=3), WORSE, id="percentile"),
    pytest.param(lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=10), WORSE, id="successive_halving"),
    pytest.param(lambda: optuna.pruners.HyperbandPruner(min_resource=10, max_resource=310, reduction_factor=2), WORSE,
                 id="hyperband"),
    pytest.param(lambda: optuna.pruners.WilcoxonPruner(p_threshold=0.1), WORSE, id="wilcoxon"),
    pytest.param(lambda: optuna.pruners.ThresholdPruner(upper=2.25), WORSE, id="threshold"),
    pytest.param(lambda: optuna.pruners.PatientPruner(None, patience=1), RISING, id="patient"),
]


@pytest.mark.parametrize(("inner", "bad"), WRAPPED)
def test_a_wrapped_pruner_decides_when_fast_fail_has_nothing_to_say(inner, bad) -> None:
    alone = pruned_step(inner(), bad, history=GOOD)
    assert alone is not None and alone > 0  # the scenario must make the wrapped pruner act
    assert pruned_step(FastFailPruner(then=inner()), bad, history=GOOD) == alone
    # ...and fast-fail stops a NaN at once, whatever the wrapped pruner thinks of it (most let it through).
    assert pruned_step(FastFailPruner(then=inner()), [(10, 1.0), (20, NAN)], history=GOOD) == 20


@pytest.mark.parametrize(("inner", "bad"), WRAPPED)
def test_a_wrapped_pruner_decides_as_if_no_trial_had_a_step_0_evaluation(inner, bad) -> None:
    # With fast-fail on every trial reports the untrained model's value at step 0, the finished ones too. The
    # wrapped pruner decides as it does with fast-fail off, where no trial has one: Wilcoxon's safety averaged the
    # best trial's values with its step-0 value in and then kept trials it prunes without it.
    alone = pruned_step(inner(), bad, history=GOOD)
    untrained = [[(0, 2.3), *good] for good in GOOD]
    assert pruned_step(FastFailPruner(then=inner()), [(0, 2.3), *bad], history=untrained) == alone


def test_wilcoxon_wrapped_judges_the_best_trial_without_its_step_0_evaluation() -> None:
    # A best trial that learned at once (0.10 from step 1) and a trial a little worse at every step: Wilcoxon alone
    # prunes it. The best trial's untrained value (2.3 at step 0) lifted its mean above the judged trial's, and
    # Wilcoxon's safety ("the best trial is not better on average") then kept the trial.
    best = [(step, 0.10 + 0.001 * step) for step in range(1, 11)]
    worse = [(step, value + 0.03) for step, value in best]
    alone = pruned_step(optuna.pruners.WilcoxonPruner(p_threshold=0.1), worse, history=[best])
    assert alone is not None
    wrapped = FastFailPruner(then=optuna.pruners.WilcoxonPruner(p_threshold=0.1))
    assert pruned_step(wrapped, [(0, 2.3), *worse], history=[[(0, 2.3), *best]]) == alone


def test_the_wrapped_pruner_is_not_asked_at_step_0() -> None:
    # ThresholdPruner alone prunes the untrained model's step-0 value; fast-fail never lets it decide there.
    assert pruned_step(optuna.pruners.ThresholdPruner(upper=1.0), curve([2.3])) == 0
    assert pruned_step(FastFailPruner(then=optuna.pruners.ThresholdPruner(upper=1.0)), curve([2.3])) is None


DECIDE_IN_ANOTHER_PROCESS = """
import json, sys, optuna
from sweep.pruners import FastFailPruner
study = optuna.load_study(study_name="s", storage=sys.argv[1])
pruner = FastFailPruner()
print(json.dumps({t.user_attrs["id"]: pruner.prune(study, t) for t in study.get_trials()}))
"""


def test_the_same_decisions_from_a_second_process_reading_the_same_sqlite_file(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="s", storage=storage, pruner=FastFailPruner())
    here = {}
    for param in CURVES:
        values, direction, _ = param.values
        if direction:
            continue
        trial = study.ask()
        trial.set_user_attr("config", CONFIG)
        trial.set_user_attr("id", param.id)
        here[param.id] = False
        for step, value in values:
            trial.report(value, step)
            if trial.should_prune():
                here[param.id] = True
                break
    done = subprocess.run([sys.executable, "-c", DECIDE_IN_ANOTHER_PROCESS, storage], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == here
    assert sum(here.values()) >= 5 and not all(here.values())


# Wrapping keeps the wrapped pruner's type. Optuna 5 tests a study's pruner type in one place:
# `optuna.pruners._filter_study` (`isinstance(study.pruner, HyperbandPruner)`), which hands the sampler a study of the
# trial's Hyperband bracket, in `Trial.__init__` (`before_trial`), `relative_params`, `_suggest` and `_tell`
# (`after_trial`); `_BracketStudy.get_trials` asserts the same of the pruner it was made by.
class Opaque(optuna.pruners.BasePruner):
    """A wrapper that hides the wrapped pruner's type, as `FastFailPruner` did before it kept it."""

    def __init__(self, inner: optuna.pruners.BasePruner) -> None:
        self.inner = inner

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return self.inner.prune(study, trial)


class PublicTrialsSampler(optuna.samplers.RandomSampler):
    """Samples from what `study.get_trials()` shows it, as a user's sampler may: the bracket study filters that
    (Optuna 5's own samplers read `study._get_trials`, which it does not)."""

    def sample_independent(self, study: optuna.Study, trial: optuna.trial.FrozenTrial, param_name: str,
                           param_distribution: optuna.distributions.BaseDistribution) -> float:
        seen = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        return -1 + (0.37 * len(seen) + (0.5 if param_name == "y" else 0)) % 2


def sampled_params(pruner: optuna.pruners.BasePruner, sampler: optuna.samplers.BaseSampler | None = None,
                   n_trials: int = 40) -> list[tuple[dict, str]]:
    """A study of a synthetic objective whose every curve leaves its initial value at once (so fast-fail has nothing
    to say), by default with a seeded TPE: the params each trial was given, and how it ended."""
    sampler = sampler or optuna.samplers.TPESampler(seed=1, n_startup_trials=5)
    study = optuna.create_study(study_name="wrap", pruner=pruner, sampler=sampler)

    def objective(trial: optuna.Trial) -> float:
        x, y = trial.suggest_float("x", -1, 1), trial.suggest_float("y", -1, 1)
        trial.set_user_attr("config", {"max_steps": 27, "eval_every_steps": 1})
        target = ((x - 0.3) ** 2 + (y + 0.2) ** 2) / 3
        for step in range(1, 28):
            value = target + (3 - target) * 0.3**step
            trial.report(value, step)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return value

    study.optimize(objective, n_trials=n_trials)
    return [(t.params, t.state.name) for t in study.trials]


def hyperband() -> optuna.pruners.HyperbandPruner:
    return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=27, reduction_factor=3)


def test_fast_fail_around_hyperband_samples_what_hyperband_alone_samples_with_tpe() -> None:
    alone = sampled_params(hyperband())
    assert {state for _, state in alone} == {"COMPLETE", "PRUNED"}  # Hyperband did act
    assert sampled_params(FastFailPruner(then=hyperband())) == alone
    # Optuna 5's TPE reads `study._get_trials`, which the bracket study does not filter: hiding the type changes
    # nothing for it today. Should this fail after an upgrade, per-bracket sampling has become live for TPE, and the
    # assertion above is the one that matters.
    assert sampled_params(Opaque(hyperband())) == alone


def test_fast_fail_around_hyperband_keeps_the_bracket_study_a_sampler_sees() -> None:
    alone = sampled_params(hyperband(), PublicTrialsSampler())
    assert sampled_params(FastFailPruner(then=hyperband()), PublicTrialsSampler()) == alone
    # The comparison can tell: a wrapper that hides the type shows the sampler the whole study.
    assert sampled_params(Opaque(hyperband()), PublicTrialsSampler()) != alone


def registered(name: str) -> optuna.pruners.BasePruner:
    """A pruner of each registered type, with the arguments it cannot do without."""
    if name == "patient":
        return optuna.pruners.PatientPruner(None, patience=1)
    if name == "threshold":
        return optuna.pruners.ThresholdPruner(upper=1.0)
    if name == "percentile":
        return optuna.pruners.PercentilePruner(25.0)
    return PRUNERS[name]()


@pytest.mark.parametrize("name", [name for name in PRUNERS if name != "fastfail"])
def test_fast_fail_is_an_instance_of_what_it_wraps(name: str) -> None:
    inner = registered(name)
    pruner = FastFailPruner(then=inner, patience_steps=50)
    assert isinstance(pruner, FastFailPruner) and isinstance(pruner, type(inner))
    assert type(pruner).__name__ == f"FastFail{type(inner).__name__}" and pruner.config.patience_steps == 50
    # Attributes are the wrapped instance's (every method but prune runs on it).
    for attribute, value in vars(inner).items():
        assert getattr(pruner, attribute) is value
    # One class per wrapped class; it pickles (as a constructor call) and nests.
    assert type(FastFailPruner(then=registered(name))) is type(pruner)
    copy = pickle.loads(pickle.dumps(pruner))
    assert type(copy) is type(pruner) and type(copy.then) is type(inner) and copy.config == pruner.config
    assert isinstance(FastFailPruner(then=pruner), type(inner))
    assert type(FastFailPruner()) is FastFailPruner and not isinstance(FastFailPruner(), type(inner))


def test_the_study_file_builds_the_wrapper_and_checks_its_arguments() -> None:
    pruner = build_pruner(Component.model_validate({"type": "fastfail", "patience_steps": 10,
                                                    "then": {"type": "hyperband", "min_resource": 5}}))
    assert isinstance(pruner, optuna.pruners.HyperbandPruner) and pruner._min_resource == 5
    with pytest.raises(StudyFileError, match="patience_steps"):
        build_pruner(Component.model_validate({"type": "fastfail", "patience_step": 10}))


def test_optuna_s_bracket_questions_are_answered_from_the_wrapped_hyperband_s_state() -> None:
    pruner = FastFailPruner(then=hyperband())
    sampled_params(pruner, n_trials=8)
    inner = pruner.then
    assert isinstance(inner, optuna.pruners.HyperbandPruner)
    assert inner._n_brackets == 4 and getattr(pruner, "_pruners") is inner._pruners  # noqa: B009 - via __getattr__
    assert "_pruners" not in vars(pruner)  # nothing of Hyperband's state was written on the wrapper


@pytest.mark.parametrize(("document", "startup"), [
    ({"type": "fastfail", "then": "median"}, 5),
    ({"type": "fastfail", "then": {"type": "percentile", "percentile": 30, "n_startup_trials": 2}}, 2),
    ({"type": "patient", "wrapped": {"type": "median", "n_startup_trials": 7}, "patience": 2}, 7),
    ({"type": "fastfail", "then": {"type": "forecast", "n_startup_trials": 4}}, 4),
    ({"type": "fastfail", "then": {"type": "leaders", "n_startup_trials": 6}}, 6),
    ({"type": "fastfail", "then": "hyperband"}, 0),
    ({"type": "fastfail"}, 0),
    ({"type": "none"}, 0),
])
def test_the_startup_a_cohort_ramps_through_is_the_wrapped_pruner_s(document: dict, startup: int) -> None:
    # `sweep.cohort`'s first cohort holds the completed trials the study's pruner waits for, found through wrappers.
    from sweep.pruners import startup_trials

    with pytest.warns() if document["type"] == "patient" else contextlib.nullcontext():
        pruner = build_pruner(Component.model_validate(document))
    assert startup_trials(pruner) == startup


@pytest.mark.parametrize("wrapped", [True, False])
@pytest.mark.parametrize("rungs", [
    pytest.param(lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3), id="sha"),
    pytest.param(lambda: optuna.pruners.HyperbandPruner(min_resource=1, max_resource=100, reduction_factor=3),
                 id="hyperband"),
])
def test_a_warm_trial_takes_no_rung_from_cold_trials_in_successive_halving(rungs, wrapped: bool) -> None:
    # A warm trial reports from the first step it trained itself (75, past a handoff at 50). Successive halving
    # wrote that value into every rung below 75, where cold trials hold their step-25 values, and then pruned at
    # its first rung a cold trial that ends best. Successive halving does not judge warm trials; fast-fail does.
    config = {"max_steps": 100, "eval_every_steps": 25}  # the last step is not judged: a trial there completes
    study = optuna.create_study(pruner=FastFailPruner(then=rungs()) if wrapped else rungs(), study_name="curve")

    def run(curve: list[tuple[int, float]], warm: bool = False) -> str:
        trial = study.ask()
        trial.set_user_attr("config", config)
        if warm:
            trial.set_user_attr(ATTR_WARM_START, {"trial": 1, "step": 50})
        reporter = TrialReporter(trial, parse_spec(TINY_STUDY, Path("study.yaml")), config, NoEvents(), Boundary(),
                                 inherited_until=50 if warm else None)
        for step, value in curve:
            if reporter.report(step, {"val_loss": value}):
                study.tell(trial, state=TrialState.PRUNED)
                return f"pruned at {step}"
        study.tell(trial, curve[-1][1])
        return "complete"

    assert run([(25, 1.20), (50, 0.63), (75, 0.49), (100, 0.47)]) == "complete"
    assert run([(25, 0.66), (50, 0.37), (75, 0.28), (100, 0.25)]) == "complete"
    assert run([(75, 0.28), (100, 0.26)], warm=True) == "complete"
    assert not any(key.startswith("completed_rung") for key in study.trials[2].system_attrs)
    assert run([(25, 0.64), (50, 0.36), (75, 0.25), (100, 0.22)]) == "complete"  # cold, ends best
    if wrapped:  # fast-fail still judges a warm trial: a NaN is stopped
        assert run([(75, NAN), (100, 0.3)], warm=True) == "pruned at 75"


def test_a_warm_trial_whose_accuracy_sits_still_is_pruned_when_its_loss_explodes(tmp_path: Path) -> None:
    # Plateau and stuck do not apply to a warm trial, but a val_loss that explodes does: the warm trial's stuck
    # verdict on its accuracy returned before its loss curve was read, and it ran its whole budget.
    from sweep.outcomes import ATTR_LOSS_CURVE

    study = optuna.create_study(direction="maximize", pruner=FastFailPruner(), storage=f"sqlite:///{tmp_path}/s.db")
    learner = study.ask()
    learner.set_user_attr("config", CONFIG)
    for step in range(0, 1001, 10):
        learner.report(0.1 + 0.8 * step / 1000, step)
    study.tell(learner, 0.9)
    pruned = {}
    for warm in (False, True):
        trial = study.ask()
        trial.set_user_attr("config", CONFIG)
        if warm:
            trial.set_user_attr(ATTR_WARM_START, {"trial": learner.number, "step": 500})
        losses = []
        for step in range(510, 1000, 10):
            losses.append([step, 0.5 if step < 800 else 50.0])
            trial.set_user_attr(ATTR_LOSS_CURVE, losses)
            trial.report(0.12, step)
            if trial.should_prune():
                pruned[warm] = step
                break
        study.tell(trial, state=TrialState.PRUNED)
    assert pruned[True] == 800
    # The cold one is stopped sooner (stuck at its start); at the explosion its reason names the loss.
    verdict = study.pruner.verdict([(s, 0.12) for s in range(510, 810, 10)], CONFIG, True, study,
                                   loss_series=[(s, 0.5 if s < 800 else 50.0) for s in range(510, 810, 10)])
    assert pruned[False] < 800 and verdict is not None and verdict.rule == "explode"
    assert verdict.detail is not None and verdict.detail["of"] == "val_loss"


@pytest.mark.parametrize("diverged", ["inf among its reports", "pruned as diverged"])
def test_a_trial_that_ran_away_before_it_diverged_does_not_make_the_learners_look_stuck(
        tmp_path: Path, diverged: str) -> None:
    """A minimised loss that can go negative (a log-likelihood, -1 to about -45 for the learners) and a trial that
    runs away downward (a collapsing variance: -1 to -2e7 in 300 steps) before it diverges. Its values set the study's
    best, the scale of "near its initial value": every later learner, 40 times its start's distance from 0 below
    it, was pruned as stuck at step 480, the best ones among them (review). A diverged trial's values now say
    nothing about how far a run gets: an infinity among them, or fast-fail's recorded verdict (a NaN in the loss
    of a study that reports another metric)."""
    from sweep.outcomes import ATTR_PRUNE

    def learner(end: float) -> list[tuple[int, float]]:
        return [(s, end + (-1 - end) * math.exp(-5 * s / 1000)) for s in range(0, 1001, 10)]

    study = optuna.create_study(pruner=FastFailPruner(), storage=f"sqlite:///{tmp_path / 's.db'}")
    first = study.ask()
    first.set_user_attr("config", CONFIG)
    for step, value in learner(-50.0):
        first.report(value, step)
    study.tell(first, -50.0)
    runaway = study.ask()
    runaway.set_user_attr("config", CONFIG)
    for step in range(0, 301, 10):
        runaway.report(-1 - 1e3 * (math.exp(step / 30) - 1), step)
    if diverged == "inf among its reports":
        runaway.report(-INF, 310)
    else:
        runaway.set_user_attr(ATTR_PRUNE, {"rule": "nan", "step": 300, "detail": {"of": "val_loss"}})
    study.tell(runaway, state=TrialState.PRUNED)
    for end in (-48.0, -44.0, -30.0):
        trial = study.ask()
        trial.set_user_attr("config", CONFIG)
        for step, value in learner(end):
            trial.report(value, step)
            assert not trial.should_prune(), (end, step, study.pruner.verdict(
                [(s, v) for s, v in learner(end) if s <= step], CONFIG, False, study))
        study.tell(trial, end)
    # A never-learner is still stopped as stuck, on the learners' scale.
    trial = study.ask()
    trial.set_user_attr("config", CONFIG)
    assert pruned_at(trial, [(s, -1.0 - 1e-4 * s) for s in range(0, 1001, 10)]) is not None


def test_a_never_learner_s_noise_is_no_yardstick_for_the_next_never_learner(tmp_path: Path) -> None:
    """The study's first finished trial never learned: pruned as a plateau, its best 0.06% below its start by
    noise. Its values set the study's best, and "near its initial value" became "within 10% of that 0.0013": a second
    never-learner that wobbled 0.04% below its start counted as having left it, ran 475 steps unjudged, and its
    retry ran the rest of the budget (a cohort study on PostgreSQL, review). A finished trial that never moved by more
    than plateau's `min_improvement_pct` says nothing about how far a run gets: the next never-learner is pruned at
    plateau's patience, as the first was."""
    wobble = [0.0, 0.0125, -0.0013, 0.0122, 0.0168, 0.0125, 0.0015, 0.0114, 0.0123, 0.0173, 0.0095, -0.0006]
    study = optuna.create_study(pruner=FastFailPruner(), storage=f"sqlite:///{tmp_path / 's.db'}")
    steps = {}
    for shift in (0.0, 0.0002):
        trial = study.ask()
        trial.set_user_attr("config", {"max_steps": 800, "eval_every_steps": 25})
        steps[shift] = pruned_at(trial, [(25 * i, 2.3125 + w + shift * (i > 0)) for i, w in enumerate(wobble * 3)])
        study.tell(trial, state=TrialState.PRUNED)
    assert steps == {0.0: 200, 0.0002: 200}


@pytest.mark.parametrize("maximize", [False, True])
def test_a_fine_tuning_study_s_slow_learner_that_ends_best_is_never_pruned(tmp_path: Path, maximize: bool) -> None:
    """A fine-tuning: fast trials gained 2-2.5% of their start within 100 of 1000 steps and stalled; a slow one creeps
    steadily to 3% and ends the study's best. A floor of `min_improvement_pct`% under "near its start" (tried
    against never-learners' noise) made it near its start at step 250, less than 1% better, and plateau pruned the
    study's best trial (review): leaving the start is measured on the study's own way, however short."""
    start = 0.80 if maximize else 2.0
    sign = 1 if maximize else -1
    study = optuna.create_study(direction="maximize" if maximize else "minimize", pruner=FastFailPruner(),
                                storage=f"sqlite:///{tmp_path / 's.db'}")
    for gain in (0.04, 0.045, 0.035, 0.05, 0.04, 0.042):  # fast: most of it by step 100
        curve = {s: start + sign * gain * start / 2 * (1 - 0.97 ** (s / 10)) for s in range(0, 1001, 10)}
        study.add_trial(optuna.trial.create_trial(value=curve[1000], intermediate_values=curve,
                                                  user_attrs={"config": {"max_steps": 1000, "eval_every_steps": 10}}))
    slow = study.ask()
    slow.set_user_attr("config", {"max_steps": 1000, "eval_every_steps": 10})
    curve = [(s, start + sign * 0.03 * start * s / 1000) for s in range(0, 1001, 10)]
    assert pruned_at(slow, curve[:-1]) is None
    study.tell(slow, curve[-1][1])
    assert study.best_trial.number == slow.number


@pytest.mark.parametrize("loss_curve", [None, [2.3, 2.1], "2.3", [[0, "x"]], {"0": 2.3}])
def test_a_finished_trial_s_odd_loss_curve_attr_leaves_the_pruner_working(tmp_path: Path, loss_curve: object) -> None:
    """Fast-fail reads every finished trial's `loss_curve` to leave diverged ones out of its yardstick: a value that
    sweep did not write there (a user's `set_user_attr`, a trial added by hand) raised TypeError in every later
    trial's `should_prune` (review)."""
    from sweep.outcomes import ATTR_LOSS_CURVE

    study = optuna.create_study(pruner=FastFailPruner(), storage=f"sqlite:///{tmp_path / 's.db'}")
    study.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED, intermediate_values={0: 2.3, 10: 1.0},
                                              user_attrs={ATTR_LOSS_CURVE: loss_curve, "config": CONFIG}))
    trial = study.ask()
    trial.set_user_attr("config", CONFIG)
    assert pruned_at(trial, [(0, 2.3), (10, NAN)]) == 10


def pruned_at(trial: optuna.Trial, values: list[tuple[int, float]]) -> int | None:
    for step, value in values:
        trial.report(value, step)
        if trial.should_prune():
            return step
    return None


def test_the_rule_that_pruned_is_read_from_the_pruner_s_own_read_of_the_study(tmp_path: Path) -> None:
    """Which rule pruned a trial was worked out after the decision, with a read of the study's finished trials of its
    own, outside the one read the decision shared and outside the wait for an outage: a connection dropped there (a
    PostgreSQL backend killed) failed the pruned trial as the machine's fault, and it was retried (review). The
    explanation now comes from the decision's read: one read of the finished trials per judged report."""
    from sqlalchemy import event

    from sweep.storage import PatientStorage, make_storage

    storage = PatientStorage(make_storage(f"sqlite:///{tmp_path / 's.db'}"), Boundary(60))
    study = optuna.create_study(storage=storage, pruner=FastFailPruner(then=optuna.pruners.MedianPruner(0, 0)),
                                study_name="reads")
    for _ in range(3):
        done = study.ask()
        done.set_user_attr("config", CONFIG)
        for step in range(0, 101, 10):
            done.report(1.0 - step / 200, step)
        study.tell(done, 0.5)
    trial = study.ask()
    trial.set_user_attr("config", CONFIG)
    reporter = TrialReporter(trial, parse_spec(TINY_STUDY, Path("study.yaml")), CONFIG, NoEvents(), storage.boundary,
                             signals=False)
    assert not reporter.report(0, {"val_loss": 1.0})
    reads: list[str] = []
    study_read = "FROM trials WHERE trials.study_id = ? AND "  # the finished trials' ids, or the trials in full
    event.listen(storage.backend.engine, "before_cursor_execute",
                 lambda conn, cursor, statement, *rest: reads.append(statement)
                 if study_read in " ".join(statement.split()) else None)
    assert reporter.report(10, {"val_loss": NAN})  # pruned: NaN
    assert reporter.prune_reason is not None and reporter.prune_reason["rule"] == "nan"
    assert len(reads) == 1, reads  # the study's trials, read once


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_warm_loop_trial_that_counts_its_steps_from_0_is_judged_and_judges_at_its_lineage_s_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrapped: bool) -> None:
    """Found by review: a user's loop that takes a warm start's state and counts its steps from 0 (the README's example
    does) reports at step 10 what its lineage reached after the donor's 100 steps and 10 more. The median pruner
    compared that with cold trials' step-10 values, and a cold trial better than every cold one that finished was
    pruned at 10% of its budget. Its reports stand at its lineage's steps (110) for every pruner's judgment."""
    (tmp_path / "lineage_loop.py").write_text("def main(config, run):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = parse_spec({"name": "lineages", "n_trials": 9, "loop": "lineage_loop:main", "warm_start": {"enabled": True},
                       "pruner": {"type": "fastfail", "then": "median"} if wrapped else "median"},
                      tmp_path / "study.yaml")
    median = optuna.pruners.MedianPruner(n_startup_trials=2)
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/lineages.db", study_name="lineages",
                                pruner=FastFailPruner(then=median, enabled=False) if wrapped else median)
    config = {"max_steps": 100}

    def run(values: dict[int, float], donor_step: int | None = None) -> str:
        trial = study.ask()
        trial.set_user_attr("config", config)
        if donor_step is not None:
            trial.set_user_attr(ATTR_WARM_START, {"trial": 0, "step": donor_step})
        reporter = TrialReporter(trial, spec, config, NoEvents(), Boundary())
        for step, value in values.items():
            if reporter.report(step, {"val_loss": value}):
                study.tell(trial, state=TrialState.PRUNED)
                return f"pruned at {step}"
        study.tell(trial, values[max(values)])
        return "complete"

    for _ in range(2):  # cold
        assert run({10: 0.50, 20: 0.40, 50: 0.35, 60: 0.30, 100: 0.20}) == "complete"
    for _ in range(3):  # warm, from a donor's step 100, counting from 0: far ahead at "step 10"
        assert run({10: 0.05, 20: 0.04, 100: 0.03}, donor_step=100) == "complete"
    # Cold, better than every cold one at its steps: judged with the cold ones alone.
    assert run({10: 0.45, 20: 0.35, 50: 0.30, 60: 0.25, 100: 0.15}) == "complete"
    # A warm trial whose first report is at its donor's step 50 (one that goes on from there and evaluates the
    # donor's weights first): that report is not judged (diff review: it was pruned there with no step of its own)
    # ...
    assert run({50: 0.9, 100: 0.2}, donor_step=50) == "complete"
    # ... and the next ones are judged at their own steps (diff review: shifted, its step 60 was judged at 110, and a
    # trial better than the cold ones at each step was pruned).
    assert run({50: 0.34, 60: 0.29, 100: 0.19}, donor_step=50) == "complete"
    # ... and one worse than the cold trials there is pruned as one.
    assert run({60: 0.9, 100: 0.9}, donor_step=50) == "pruned at 60"
    # One that counts from 0 after a donor's step 50 stands at steps 60...: judged there with the cold trials.
    assert run({10: 0.9, 100: 0.9}, donor_step=50) == "pruned at 10"
