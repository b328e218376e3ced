"""FastFailPruner through Optuna's public API: curve in, pruned step out."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import optuna
import pytest

from sweep.pruners import FastFailPruner

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
