"""Do the pruners decide well? Steps saved, best value kept, and good trials lost, per task with known ground truth.

    python bench/decisions.py                      # 4 to 6 minutes on 2 busy shared CPU cores
    python bench/decisions.py --cache /tmp/curves  # a rerun trains only the real configs it has not seen
    python bench/decisions.py --simulated-only     # the two simulated tasks only: seconds
    python bench/decisions.py --seeds 3 --trials 60 --real-steps 400
    python bench/decisions.py --live               # also runs the real tasks' arms for real: checks the replay

Tasks (each: 3 seeds of 40 TPE trials, the seed seeds the sampler; default settings for every arm, no per-task tuning):
- `two-phase` (simulated): a learning rate, a depth and a warmup fraction decide a curve. Deep networks learn in two
  phases (a drop to an intermediate plateau, a long sit there, then a second drop to the best values of the study);
  too small a learning rate never leaves chance (it creeps); too large a one diverges to NaN or explodes; a long
  warmup delays the start (with a bump). Values carry 3% noise.
- `late-divergence` (simulated): the same learners, but every learning rate above 0.1 is healthy until 40% of the
  budget and then explodes.
- `digits` (real training: the trainer on the digits MLP; learning rates up to 10, SGD or AdamW, width and depth).
- `blobs` (real training: the trainer on Gaussian clusters with a noise level, `max_noise` 2: the classes overlap,
  so the best loss is well above zero; learning rate, optimizer, width).

Arms: sweep's pruners by their study-file names, built as a study file builds them (`none`, `median`, `hyperband`,
`fastfail + median`, `fastfail + hyperband`, `fastfail + forecast`, `fastfail + leaders`) and asked as sweep's loop
asks them (every report before the last step; the step-0 evaluation and the loss guard's early evaluations only with
fast-fail on); and plain Optuna (`optuna median`, `optuna hyperband`: Optuna's `MedianPruner()` and
`HyperbandPruner()` with their defaults, in a plain objective run by `study.optimize` that reports each evaluation
after step 0 and raises `TrialPruned` when `should_prune()` says so, with no sweep code in between).

Ground truth: every config any arm samples is trained (or simulated) to the end without pruning, once, and its full
curve decides whether it would have finished in the arm's top quarter, whether it is bad, and when it diverged. The
arms replay those curves: training is deterministic (the study's seed seeds the sampler, not the training), so a
trial stopped at step s would have reported exactly the curve's values up to s, and its steps are s. `--live` checks
that on the real tasks: it runs every arm again for real, sweep's through sweep's own study loop
(`sweep.study.run_study` on an SQLite file, read back from the storage) and the plain ones with `trainer.train`
inside the objective, and prints every trial whose params, steps, state, value or prune rule differ from the replay.

Columns: total steps and how many fewer than no pruning and than plain Optuna's median; the best value's distance to
no pruning's best (mean over seeds, and the worst seed); how many trials that would have finished in the arm's top
quarter were pruned, and by which rule; the mean share of its budget a bad trial (diverged, or ended no better than
95% of its start) used, and a never-learner (never 10% better than its start, never diverged); how many steps a
trial that diverged after a healthy start (NaN/Inf or above 10x its start), and was still running then, ran after
the divergence, on average (in brackets, how many such trials).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.trial import TrialState

from sweep.components import build_pruner, pruner_name
from sweep.outcomes import ATTR_PRUNE, ATTR_STEPS
from sweep.pruners import FastFailPruner
from sweep.schema import Component

SWEEP_ARMS: dict[str, Any] = {
    "none": "none",
    "median": "median",
    "hyperband": "hyperband",
    "fastfail + median": {"type": "fastfail", "then": "median"},
    "fastfail + hyperband": {"type": "fastfail", "then": "hyperband"},
    "fastfail + forecast": {"type": "fastfail", "then": "forecast"},
    "fastfail + leaders": {"type": "fastfail", "then": "leaders"},
}
PLAIN_ARMS: dict[str, Callable[[], optuna.pruners.BasePruner]] = {
    "optuna median": optuna.pruners.MedianPruner,
    "optuna hyperband": optuna.pruners.HyperbandPruner,
}
ARMS = [*SWEEP_ARMS, *PLAIN_ARMS]
# Every study has this name: Hyperband assigns a trial's bracket by a hash of the study's name and the trial's number,
# so a generated name would make its decisions differ from run to run.
STUDY = "decisions-bench"
FAST_FAIL_RULES = {"nan", "inf", "explode", "plateau", "stuck"}
Curve = list[tuple[int, float]]
Params = dict[str, Any]


@dataclass
class Outcome:
    """One trial of one arm: its params, the steps it ran, its value (None: not completed), why it was pruned, and
    the truth (its full curve without pruning)."""

    params: Params
    steps: int
    value: float | None
    rule: str | None
    pruned: bool = False
    truth: Curve = field(default_factory=list)


@dataclass
class ArmRun:
    task: str
    arm: str
    seed: int
    max_steps: int
    outcomes: list[Outcome] = field(default_factory=list)


def params_key(params: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(params.items()))


# --- simulated tasks ------------------------------------------------------------------------------------------------
SIM_STEPS, SIM_EVERY = 1000, 20
SIM_GRID = list(range(0, SIM_STEPS + 1, SIM_EVERY))


def rng_for(params: Params, salt: str) -> np.random.Generator:
    key = salt + repr(sorted(params.items()))
    return np.random.default_rng(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))


def simulate(params: Params, late_divergence: bool = False) -> Curve:
    """The validation loss curve a config would produce over the whole budget (the ground truth)."""
    log_lr, depth, warmup = params["log_lr"], params["depth"], params["warmup"]
    rng = rng_for(params, "late" if late_divergence else "two-phase")
    initial = 2.3 * (1 + 0.01 * depth)
    final = 0.04 + 0.06 * (log_lr + 2.5) ** 2 + (0.12 if depth <= 2 else 0.0)
    tau = 60 * 10 ** (-0.5 * (log_lr + 2.5))  # smaller learning rates learn more slowly
    start = warmup * SIM_STEPS
    diverge_at = None
    if late_divergence and log_lr > -1:
        diverge_at = 0.4 * SIM_STEPS + rng.integers(0, 5) * SIM_EVERY
    elif log_lr > 0:
        diverge_at = 60 + 300 * (1 - log_lr)
    never = log_lr < -4.3

    def clean(s: int) -> float:
        if never:
            return initial - 0.12 * s / SIM_STEPS
        if s <= start:  # warmup: a bump, and no learning yet
            return initial + 0.3 * math.sin(math.pi * s / max(start, 1))
        t = s - start
        if depth <= 2:
            return final + (initial - final) * math.exp(-t / tau)
        plateau = initial - 0.35 * (initial - final)  # two phases: the first drop, a long sit, the second drop
        sit = min(650.0, 120 + 60 * depth * 10 ** (-0.3 * (log_lr + 2.5)))
        if t <= sit:
            return plateau + (initial - plateau) * math.exp(-t / tau)
        return final + (plateau - final) * math.exp(-(t - sit) / tau)

    curve = []
    for s in SIM_GRID:
        if diverge_at is not None and s >= diverge_at:
            curve.append((s, math.nan if not late_divergence else 40.0 * (1 + (s - diverge_at) / 100)))
            continue
        noise = 1 + (rng.uniform(-0.03, 0.03) if s else 0.0)
        curve.append((s, clean(s) * noise))
    return curve


def suggest_simulated(trial: optuna.Trial) -> Params:
    return {"log_lr": trial.suggest_float("log_lr", -5.0, 1.0), "depth": trial.suggest_int("depth", 1, 4),
            "warmup": trial.suggest_float("warmup", 0.0, 0.3)}


def sim_config(params: Params) -> dict[str, Any]:
    return {"max_steps": SIM_STEPS, "eval_every_steps": SIM_EVERY, "warmup_steps": int(params["warmup"] * SIM_STEPS)}


def asked(arm: str, curve: Curve, eval_every: int, max_steps: int) -> Curve:
    """What sweep's loop reports of a full curve for `arm`: the step-0 evaluation and the evaluations the loss guard
    brings forward between the regular ones only when fast-fail is on (the trainer makes neither otherwise)."""
    if is_fast_fail(arm):
        return curve
    return [(s, v) for s, v in curve if s and (s % eval_every == 0 or s == max_steps)]


def is_fast_fail(arm: str) -> bool:
    spec = SWEEP_ARMS.get(arm)
    return isinstance(spec, dict) and spec.get("type") == "fastfail"


@dataclass(frozen=True)
class Replay:
    """A task as the arms see it: how a trial samples its params, and the full curve and config of those params."""

    name: str
    suggest: Callable[[optuna.Trial], Params]
    curve: Callable[[Params], Curve]
    config: Callable[[Params], dict[str, Any]]  # max_steps, eval_every_steps, warmup_steps: what fast-fail reads


def run_sweep_arm(task: Replay, arm: str, seed: int, n_trials: int) -> ArmRun:
    """Sweep's pruner for `arm` (built from the study file's spec), asked as sweep's loop asks it
    (`sweep.objective.TrialReporter`): at every report before the last step; a pruned trial ran to its last report."""
    pruner = build_pruner(Component.model_validate(SWEEP_ARMS[arm]))
    study = optuna.create_study(study_name=STUDY, pruner=pruner, sampler=optuna.samplers.TPESampler(seed=seed))
    run: ArmRun | None = None
    for _ in range(n_trials):
        trial = study.ask()
        params = task.suggest(trial)
        config = task.config(params)
        max_steps = config["max_steps"]
        run = run or ArmRun(task.name, arm, seed, max_steps)
        trial.set_user_attr("config", config)
        truth = task.curve(params)
        series = asked(arm, truth, config["eval_every_steps"], max_steps)
        outcome = None
        for i, (step, value) in enumerate(series):
            trial.report(value, step)
            if step < max_steps and trial.should_prune():
                rule = pruner_name(pruner)
                if isinstance(pruner, FastFailPruner):
                    verdict = pruner.verdict(series[: i + 1], config, False, study)
                    rule = verdict.rule if verdict is not None else pruner_name(pruner.then)
                outcome = Outcome(params, step, None, rule, pruned=True)
                study.tell(trial, state=TrialState.PRUNED)
                break
        if outcome is None:
            final = series[-1][1]
            outcome = Outcome(params, max_steps, final if math.isfinite(final) else None, None)
            study.tell(trial, final if math.isfinite(final) else None,
                       state=None if math.isfinite(final) else TrialState.FAIL)
        outcome.truth = truth
        run.outcomes.append(outcome)
    assert run is not None
    return run


def run_plain_arm(task: Replay, arm: str, seed: int, n_trials: int) -> ArmRun:
    """Plain Optuna: an objective that reports each regular evaluation after step 0, asks `should_prune()` after
    each (the last one too) and raises `TrialPruned` when told; Optuna's pruner with its defaults."""
    outcomes: list[Outcome] = []

    def objective(trial: optuna.Trial) -> float:
        params = task.suggest(trial)
        config, truth = task.config(params), task.curve(params)
        outcomes.append(Outcome(params, config["max_steps"], None, None, truth=truth))
        for step, value in asked("plain", truth, config["eval_every_steps"], config["max_steps"]):
            trial.report(value, step)
            if trial.should_prune():
                outcomes[-1] = Outcome(params, step, None, arm, pruned=True, truth=truth)
                raise optuna.TrialPruned()
        final = truth[-1][1]
        outcomes[-1].value = final if math.isfinite(final) else None
        return final

    study = optuna.create_study(study_name=STUDY, pruner=PLAIN_ARMS[arm](),
                                sampler=optuna.samplers.TPESampler(seed=seed))
    study.optimize(objective, n_trials=n_trials)
    return ArmRun(task.name, arm, seed, task.config(outcomes[0].params)["max_steps"], outcomes)


def run_arm(task: Replay, arm: str, seed: int, n_trials: int) -> ArmRun:
    return (run_sweep_arm if arm in SWEEP_ARMS else run_plain_arm)(task, arm, seed, n_trials)


def simulated(name: str) -> Replay:
    late = name == "late-divergence"
    return Replay(name, suggest_simulated, lambda params: simulate(params, late), sim_config)


# --- real tasks: the trainer, through sweep's loop and through a plain Optuna objective ------------------------------
@dataclass(frozen=True)
class RealTask:
    """A built-in task, its search space (name: ("float", low, high) log-scaled, ("int", low, high) log-scaled, or
    ("cat", choices)) and its fixed values."""

    name: str
    args: dict[str, Any]
    space: dict[str, tuple[Any, ...]]

    def fixed(self, max_steps: int) -> dict[str, Any]:
        return {"max_steps": max_steps, "eval_every_steps": max(1, max_steps // 20), "log_every_steps": 5,
                "batch_size": 64, "scheduler": "cosine", "warmup_steps": 0}

    def sweep_space(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, (kind, *rest) in self.space.items():
            if kind == "cat":
                out[key] = {"type": "categorical", "choices": list(rest[0])}
            else:
                out[key] = {"type": kind, "low": rest[0], "high": rest[1], "log": True}
        return out

    def suggest(self, trial: optuna.Trial) -> Params:
        """The same space, sampled with Optuna's own calls."""
        out: Params = {}
        for key, (kind, *rest) in self.space.items():
            if kind == "cat":
                out[key] = trial.suggest_categorical(key, rest[0])
            elif kind == "int":
                out[key] = trial.suggest_int(key, rest[0], rest[1], log=True)
            else:
                out[key] = trial.suggest_float(key, rest[0], rest[1], log=True)
        return out

    def config(self, params: Mapping[str, Any], max_steps: int, **extra: Any) -> Any:
        from trainer.config import TrainingConfig

        return TrainingConfig.from_dict({**self.fixed(max_steps), "task": self.name, "task_args": dict(self.args),
                                         **extra, **params})


REAL_TASKS = {
    "digits": RealTask("digits", {}, {
        "learning_rate": ("float", 1e-4, 10.0), "optimizer": ("cat", ("sgd", "adamw")),
        "model.hidden": ("int", 32, 128), "model.depth": ("int", 1, 3)}),
    "blobs": RealTask("blobs", {"max_noise": 2.0}, {
        "learning_rate": ("float", 1e-4, 10.0), "optimizer": ("cat", ("sgd", "adamw")),
        "model.hidden": ("int", 4, 64)}),
}


def real_design(task: RealTask, n_trials: int, max_steps: int, pruner: Any, seed: int) -> dict[str, Any]:
    return {
        "name": STUDY, "n_trials": n_trials, "seed": seed, "sampler": {"type": "tpe", "seed": seed},
        "pruner": pruner, "max_repeated_failures": 0, "task": {"name": task.name, "args": task.args},
        "checkpoints": {"on_best": False, "artifacts": False},  # pruning decisions only: no checkpoint files
        "fixed": task.fixed(max_steps), "space": task.sweep_space(),
    }


class Recorder:
    """A trainer reporter that records `val_loss` and, with `trial`, reports it to plain Optuna and stops when told."""

    def __init__(self, trial: optuna.Trial | None = None) -> None:
        self.trial = trial
        self.series: Curve = []
        self.pruned = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        self.series.append((step, metrics["val_loss"]))
        if self.trial is None:
            return False
        self.trial.report(metrics["val_loss"], step)
        self.pruned = self.trial.should_prune()
        return self.pruned


class GroundTruth:
    """Every config trained to the end without pruning, once (the study seed seeds the sampler only: a config's
    curve is the same in every study), with fast-fail's step-0 evaluation and loss guard on and nothing stopping it:
    the curve sweep's loop reports with fast-fail on, and, at the regular evaluations, the one it reports without."""

    def __init__(self, task: RealTask, max_steps: int, cache: Path | None = None) -> None:
        self.task, self.max_steps, self.cache = task, max_steps, cache
        self.curves: dict[Any, Curve] = {}
        if cache is not None and cache.exists():
            for row in json.loads(cache.read_text()):
                self.curves[params_key(row["params"])] = [(s, v) for s, v in row["curve"]]
        self.loaded = len(self.curves)
        self.wall = 0.0
        self._data: Any = None

    def __call__(self, params: Params) -> Curve:
        key = params_key(params)
        if key not in self.curves:
            from trainer.loop import train  # torch only when a real task runs
            from trainer.tasks import load_task

            started = time.perf_counter()
            self._data = self._data or load_task(self.task.name, self.task.args)
            recorder = Recorder()
            train(self.task.config(params, self.max_steps, **{"fast_fail.enabled": True}), self._data, recorder)
            self.curves[key] = recorder.series
            self.wall += time.perf_counter() - started
        return self.curves[key]

    def save(self) -> None:
        if self.cache is not None:
            self.cache.write_text(json.dumps([{"params": dict(key), "curve": curve} for key, curve in
                                              self.curves.items()]))

    def replay(self) -> Replay:
        config = {"max_steps": self.max_steps, "eval_every_steps": self.task.fixed(self.max_steps)["eval_every_steps"],
                  "warmup_steps": 0}
        return Replay(self.task.name, self.task.suggest, self, lambda params: config)


def run_real_sweep(task: RealTask, arm: str, seed: int, n_trials: int, max_steps: int, folder: Path) -> ArmRun:
    """`--live`: sweep's own study loop (`sweep.study.run_study` on an SQLite file), read back from the storage."""
    from sweep.spec import parse_spec  # the trainer's imports (torch) only when a real task runs
    from sweep.study import open_study, run_study

    spec = parse_spec(real_design(task, n_trials, max_steps, SWEEP_ARMS[arm], seed), f"bench:{task.name}:{arm}")
    study = open_study(spec, f"sqlite:///{folder / f'{task.name}-{seed}-{ARMS.index(arm)}.db'}")
    run_study(study, spec)
    run = ArmRun(task.name, arm, seed, max_steps)
    for t in sorted(study.get_trials(), key=lambda t: t.number):
        reason = t.user_attrs.get(ATTR_PRUNE) or {}
        run.outcomes.append(Outcome(dict(t.params), int(t.user_attrs.get(ATTR_STEPS, 0)),
                                    t.value if t.state == TrialState.COMPLETE else None, reason.get("rule"),
                                    pruned=t.state == TrialState.PRUNED))
    return run


def run_real_plain(task: RealTask, arm: str, seed: int, n_trials: int, max_steps: int) -> ArmRun:
    """`--live`: plain Optuna around the trainer, with no sweep code between the study and `trainer.train`."""
    from trainer.loop import train
    from trainer.tasks import load_task

    data = load_task(task.name, task.args)
    run = ArmRun(task.name, arm, seed, max_steps)

    def objective(trial: optuna.Trial) -> float:
        params = task.suggest(trial)
        recorder = Recorder(trial)
        # The trainer's own fast-fail off: no step-0 evaluation and no loss guard, as in a user's plain loop.
        result = train(task.config(params, max_steps, **{"fast_fail.enabled": False}), data, recorder)
        if recorder.pruned:
            run.outcomes.append(Outcome(params, result.steps, None, arm, pruned=True))
            raise optuna.TrialPruned()
        value = result.metrics["val_loss"]
        run.outcomes.append(Outcome(params, result.steps, value if math.isfinite(value) else None, None))
        return value

    study = optuna.create_study(study_name=STUDY, pruner=PLAIN_ARMS[arm](),
                                sampler=optuna.samplers.TPESampler(seed=seed))
    study.optimize(objective, n_trials=n_trials)
    return run


def run_live(task: RealTask, arm: str, seed: int, n_trials: int, max_steps: int, folder: Path) -> ArmRun:
    if arm in SWEEP_ARMS:
        return run_real_sweep(task, arm, seed, n_trials, max_steps, folder)
    return run_real_plain(task, arm, seed, n_trials, max_steps)


def disagreements(live: ArmRun, replayed: ArmRun) -> list[str]:
    """Where the live run of an arm and its replay of the ground truth part: a trial's params, steps, state, value
    or prune rule. None when training is deterministic and the replay asks the pruner as the live loop does."""
    out = []
    if len(live.outcomes) != len(replayed.outcomes):
        out.append(f"{len(live.outcomes)} trials live, {len(replayed.outcomes)} replayed")
    for number, (a, b) in enumerate(zip(live.outcomes, replayed.outcomes)):
        same_value = (a.value is None) == (b.value is None) and (
            a.value is None or b.value is None or math.isclose(a.value, b.value, rel_tol=1e-5, abs_tol=1e-7))
        if params_key(a.params) != params_key(b.params) or (a.steps, a.pruned, a.rule) != (b.steps, b.pruned, b.rule) \
                or not same_value:
            out.append(f"trial {number}: live {a.params} {a.steps} steps, value {a.value}, rule {a.rule}; replayed "
                       f"{b.steps} steps, value {b.value}, rule {b.rule}")
    return [f"{live.task} seed {live.seed} {live.arm}: {line}" for line in out]


# --- scoring --------------------------------------------------------------------------------------------------------
def final_of(curve: Curve) -> float:
    value = curve[-1][1] if curve else math.inf
    return value if math.isfinite(value) else math.inf


def diverged(curve: Curve) -> bool:
    return divergence_onset(curve) is not None


def bad(curve: Curve) -> bool:
    """Diverged (a non-finite value, or above 10x its start), or ended no better than 95% of its start."""
    return not curve or diverged(curve) or final_of(curve) >= 0.95 * curve[0][1]


def never_learner(curve: Curve) -> bool:
    """Never diverged, and never 10% better than its start."""
    return bool(curve) and not diverged(curve) and min(v for _, v in curve) >= 0.9 * curve[0][1]


def divergence_onset(curve: Curve) -> int | None:
    """The first step at which a curve is non-finite or above 10x its start, if any."""
    start = curve[0][1] if curve else math.nan
    return next((s for s, v in curve if not math.isfinite(v) or v > 10 * start), None)


@dataclass
class Score:
    steps: int = 0
    none_steps: int = 0
    median_steps: int = 0
    gaps: list[float] = field(default_factory=list)  # best vs none's best, % per seed
    top_pruned: Counter[str] = field(default_factory=Counter)
    top: int = 0
    bad_share: list[float] = field(default_factory=list)
    never_share: list[float] = field(default_factory=list)
    after_onset: list[int] = field(default_factory=list)

    def add(self, run: ArmRun, none: ArmRun, median: ArmRun) -> None:
        self.steps += sum(o.steps for o in run.outcomes)
        self.none_steps += sum(o.steps for o in none.outcomes)
        self.median_steps += sum(o.steps for o in median.outcomes)
        best = min((o.value for o in run.outcomes if o.value is not None), default=math.inf)
        none_best = min((o.value for o in none.outcomes if o.value is not None), default=math.inf)
        self.gaps.append(100 * (best - none_best) / abs(none_best) if math.isfinite(best) else math.inf)
        finals = sorted(final_of(o.truth) for o in run.outcomes)
        bar = finals[max(0, len(finals) // 4 - 1)]
        top = [o for o in run.outcomes if final_of(o.truth) <= bar]
        self.top += len(top)
        self.top_pruned.update(o.rule or "?" for o in top if o.pruned)
        self.bad_share += [o.steps / run.max_steps for o in run.outcomes if bad(o.truth)]
        self.never_share += [o.steps / run.max_steps for o in run.outcomes if never_learner(o.truth)]
        self.after_onset += [o.steps - onset for o in run.outcomes
                             if (onset := divergence_onset(o.truth)) is not None and 0 < onset <= o.steps]

    @property
    def fast_fail_top_pruned(self) -> int:
        return sum(n for rule, n in self.top_pruned.items() if rule in FAST_FAIL_RULES)

    def row(self, arm: str) -> list[str]:
        rules = ", ".join(f"{rule} {n}" for rule, n in self.top_pruned.most_common())
        return [arm, str(self.steps), f"{self.none_steps / max(self.steps, 1):.2f}x",
                f"{self.median_steps / max(self.steps, 1):.2f}x",
                f"{np.mean(self.gaps):+.2f}% / {max(self.gaps):+.2f}%",
                f"{sum(self.top_pruned.values())}/{self.top}" + (f" ({rules})" if rules else ""),
                f"{100 * np.mean(self.bad_share):.1f}%" if self.bad_share else "n/a",
                f"{100 * np.mean(self.never_share):.1f}% ({len(self.never_share)})" if self.never_share else "n/a",
                f"{np.mean(self.after_onset):.0f} ({len(self.after_onset)})" if self.after_onset else "n/a"]


HEADER = ["arm", "total steps", "fewer than none", "fewer than optuna median", "best vs none (mean / worst seed)",
          "top-25% pruned (by rule)", "bad trials' budget used", "never-learners' budget used (trials)",
          "steps after divergence (trials)"]


def table(title: str, rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    line: Callable[[list[str]], str] = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    print(f"\n{title}\n{line(HEADER)}\n|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


def scores(runs: list[ArmRun], tasks: list[str]) -> dict[str, Score]:
    """Each arm's score over the runs of `tasks`, each run against the no-pruning and plain median runs of its task
    and seed."""
    out = {arm: Score() for arm in ARMS}
    index = {(r.task, r.seed, r.arm): r for r in runs}
    for run in runs:
        if run.task in tasks:
            out[run.arm].add(run, index[run.task, run.seed, "none"], index[run.task, run.seed, "optuna median"])
    return out


def targets(pooled: dict[str, Score], digits: dict[str, Score] | None) -> list[str]:
    """The issue's targets, each with the arm that comes nearest and whether it is met."""
    lines = []
    for arm in ("fastfail + median", "fastfail + hyperband", "fastfail + forecast", "fastfail + leaders"):
        s, median = pooled[arm], pooled["optuna median"]
        fewer, vs_median = s.none_steps / max(s.steps, 1), s.median_steps / max(s.steps, 1)
        gap, median_gap = float(np.mean(s.gaps)), float(np.mean(median.gaps))
        lines.append(f"{arm}: {fewer:.2f}x fewer steps than none (target >= 4x) with the best {gap:+.2f}% from none's "
                     f"(target within 1%): {'met' if fewer >= 4 and gap <= 1 else 'MISSED'}; "
                     f"{vs_median:.2f}x fewer than plain Optuna's median (target >= 1.5x at its best, "
                     f"{median_gap:+.2f}%): {'met' if vs_median >= 1.5 and gap <= median_gap + 1e-9 else 'MISSED'}; "
                     f"top-quarter finishers pruned by fast-fail: {s.fast_fail_top_pruned} (target 0)"
                     + (f"; digits never-learners' budget used {100 * np.mean(digits[arm].never_share):.1f}% "
                        "(target <= 10%)" if digits and digits[arm].never_share else ""))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=40, help="trials per study, every task")
    parser.add_argument("--real-steps", type=int, default=200, help="steps per trial on digits and blobs")
    parser.add_argument("--simulated-only", action="store_true")
    parser.add_argument("--cache", type=Path, help="a folder keeping the real tasks' ground-truth curves between runs "
                        "(keyed by task and steps): a rerun trains only configs it has not seen")
    parser.add_argument("--live", action="store_true", help="also run every real-task arm for real (sweep's study "
                        "loop, plain Optuna around the trainer) and check that the replay decided the same; slow")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)

    tasks = [simulated("two-phase"), simulated("late-divergence")]
    if args.cache is not None:
        args.cache.mkdir(parents=True, exist_ok=True)
    truths = [] if args.simulated_only else [
        GroundTruth(real, args.real_steps, args.cache and args.cache / f"{real.name}-{args.real_steps}.json")
        for real in REAL_TASKS.values()]
    if truths:
        import torch

        torch.set_num_threads(1)  # tiny models on a shared machine: one thread each is the fastest
    tasks += [truth.replay() for truth in truths]
    runs = [run_arm(task, arm, seed, args.trials) for task in tasks for seed in range(args.seeds) for arm in ARMS]
    for truth in truths:
        truth.save()

    names = [task.name for task in tasks]
    for name in names:
        per_task = scores(runs, [name])
        table(f"{name} ({args.seeds} seeds x {args.trials} trials)", [per_task[arm].row(arm) for arm in ARMS])
    pooled = scores(runs, names)
    table(f"pooled ({', '.join(names)})", [pooled[arm].row(arm) for arm in ARMS])
    print("\nTargets (pooled):")
    for line in targets(pooled, scores(runs, ["digits"]) if "digits" in names else None):
        print(f"- {line}")
    for truth in truths:
        print(f"\nGround truth, {truth.task.name}: {len(truth.curves)} configs x {truth.max_steps} steps trained to "
              f"the end ({len(truth.curves) - truth.loaded} in this run, {truth.wall:.0f} s; the rest from --cache); "
              "the arms replay their curves (a trial's steps are those up to the report at which its pruner stopped "
              "it)")
    if args.live:
        index = {(r.task, r.seed, r.arm): r for r in runs}
        problems = []
        with tempfile.TemporaryDirectory() as tmp:
            for truth in truths:
                for seed in range(args.seeds):
                    for arm in ARMS:
                        live = run_live(truth.task, arm, seed, args.trials, args.real_steps, Path(tmp))
                        problems += disagreements(live, index[truth.task.name, seed, arm])
        print(f"\nLive runs decide as the replay: {'yes, every trial' if not problems else 'NO'}")
        for line in problems:
            print(f"  {line}")


if __name__ == "__main__":
    main()
