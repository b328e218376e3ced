"""Do the pruners decide well? Compute saved, best value kept, and good trials lost, per task with known ground truth.

    python bench/decisions.py                      # about 3 minutes on 2 CPU cores
    python bench/decisions.py --seeds 3 --trials 60 --digits-trials 40
    python bench/decisions.py --no-digits          # the simulated tasks only: seconds

Tasks:
- `two-phase` (simulated): a learning rate, a depth and a warmup fraction decide a curve. Deep networks learn in two
  phases (a drop to an intermediate plateau, a long sit there, then a second drop to the best values of the study);
  too small a learning rate never leaves chance (it creeps); too large a one diverges to NaN or explodes; a long
  warmup delays the start (with a bump). Values carry 3% noise.
- `late-divergence` (simulated): the same learners, but every learning rate above 0.1 is healthy until 40% of the
  budget and then explodes.
- `digits` (real training, the trainer on the digits MLP; learning rates up to 10, SGD or AdamW).

The simulated tasks run TPE (seeded) through Optuna with each arm's pruner; the ground truth of every config is its
simulated full curve. Digits runs `sweep`'s own study loop with a random sampler, so every arm trains the same
configs and the no-pruning arm is the ground truth. Each arm uses the defaults (no per-task tuning): `fastfail` as the
study file builds it, Optuna's median and Hyperband with their own defaults.

Columns: total steps and how many fewer than no pruning; best value and its distance to no pruning's best; how many
trials that would have finished in the arm's top quarter were pruned (by a fast-fail rule in brackets); the mean
share of its budget a bad trial (diverged, or ended no better than 95% of its start) used; how many steps a trial
that diverged after a healthy start (NaN/Inf or above 10x its start) and was still running then ran after the
divergence, on average (in brackets, how many such trials).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.trial import TrialState

from sweep.components import build_pruner
from sweep.outcomes import ATTR_PRUNE, ATTR_STEPS
from sweep.pruners import FastFailPruner
from sweep.schema import Component

MEDIAN = "median"
ARMS: dict[str, Any] = {
    "none": "none",
    "median": MEDIAN,
    "hyperband": "hyperband",
    "fastfail + median": {"type": "fastfail", "then": MEDIAN},
    "fastfail + hyperband": {"type": "fastfail", "then": "hyperband"},
    "fastfail + forecast": {"type": "fastfail", "then": "forecast"},
}
FAST_FAIL_RULES = {"nan", "inf", "explode", "plateau", "stuck"}

MAX_STEPS, EVERY = 1000, 20
STEPS = list(range(0, MAX_STEPS + 1, EVERY))
Curve = list[tuple[int, float]]


# --- simulated tasks ------------------------------------------------------------------------------------------------
def rng_for(params: dict[str, Any], salt: str) -> np.random.Generator:
    key = salt + repr(sorted(params.items()))
    return np.random.default_rng(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))


def simulate(params: dict[str, Any], late_divergence: bool = False) -> Curve:
    """The validation loss curve a config would produce over the whole budget (the ground truth)."""
    log_lr, depth, warmup = params["log_lr"], params["depth"], params["warmup"]
    rng = rng_for(params, "late" if late_divergence else "two-phase")
    initial = 2.3 * (1 + 0.01 * depth)
    final = 0.04 + 0.06 * (log_lr + 2.5) ** 2 + (0.12 if depth <= 2 else 0.0)
    tau = 60 * 10 ** (-0.5 * (log_lr + 2.5))  # smaller learning rates learn more slowly
    start = warmup * MAX_STEPS
    diverge_at = None
    if late_divergence and log_lr > -1:
        diverge_at = 0.4 * MAX_STEPS + rng.integers(0, 5) * EVERY
    elif log_lr > 0:
        diverge_at = 60 + 300 * (1 - log_lr)
    never = log_lr < -4.3

    def clean(s: int) -> float:
        if never:
            return initial - 0.12 * s / MAX_STEPS
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
    for s in STEPS:
        if diverge_at is not None and s >= diverge_at:
            curve.append((s, math.nan if not late_divergence else 40.0 * (1 + (s - diverge_at) / 100)))
            continue
        noise = 1 + (rng.uniform(-0.03, 0.03) if s else 0.0)
        curve.append((s, clean(s) * noise))
    return curve


def suggest(trial: optuna.Trial) -> dict[str, Any]:
    return {"log_lr": trial.suggest_float("log_lr", -5.0, 1.0), "depth": trial.suggest_int("depth", 1, 4),
            "warmup": trial.suggest_float("warmup", 0.0, 0.3)}


@dataclass
class Outcome:
    """One trial of one arm: the steps it ran, its value (None: not completed), why it was pruned, and the truth."""

    steps: int
    value: float | None
    rule: str | None
    truth: Curve
    pruned: bool = False


@dataclass
class ArmRun:
    task: str
    arm: str
    seed: int
    outcomes: list[Outcome] = field(default_factory=list)
    wall: float = 0.0


def run_simulated(task: str, arm: str, pruner_spec: Any, seed: int, n_trials: int) -> ArmRun:
    late = task == "late-divergence"
    pruner = build_pruner(Component.model_validate(pruner_spec))
    study = optuna.create_study(study_name=f"{task}-{seed}", pruner=pruner,
                                sampler=optuna.samplers.TPESampler(seed=seed))
    run = ArmRun(task, arm, seed)
    started = time.perf_counter()
    for _ in range(n_trials):
        trial = study.ask()
        params = suggest(trial)
        config = {"max_steps": MAX_STEPS, "eval_every_steps": EVERY, "warmup_steps": int(params["warmup"] * MAX_STEPS)}
        trial.set_user_attr("config", config)
        truth = simulate(params, late)
        outcome = None
        for i, (step, value) in enumerate(truth):
            trial.report(value, step)
            if step and step < MAX_STEPS and trial.should_prune():
                rule = type(pruner).__name__
                if isinstance(pruner, FastFailPruner):
                    verdict = pruner.verdict(truth[: i + 1], config, False, study)
                    rule = verdict.rule if verdict is not None else type(pruner.then).__name__
                outcome = Outcome(step, None, rule, truth, pruned=True)
                study.tell(trial, state=TrialState.PRUNED)
                break
        if outcome is None:
            final = truth[-1][1]
            outcome = Outcome(MAX_STEPS, final if math.isfinite(final) else None, None, truth)
            study.tell(trial, final if math.isfinite(final) else None,
                       state=None if math.isfinite(final) else TrialState.FAIL)
        run.outcomes.append(outcome)
    run.wall = time.perf_counter() - started
    return run


# --- digits: the real trainer through sweep's own loop --------------------------------------------------------------
UNTRAINED = math.log(10)


def digits_design(n_trials: int, max_steps: int, pruner: Any, seed: int) -> dict[str, Any]:
    return {
        "name": "decisions-bench", "n_trials": n_trials, "seed": seed, "sampler": {"type": "random", "seed": seed},
        "pruner": pruner, "max_repeated_failures": 0, "task": "digits",
        "fixed": {"max_steps": max_steps, "eval_every_steps": 20, "log_every_steps": 5, "batch_size": 64,
                  "scheduler": "cosine", "warmup_steps": 0},
        "space": {
            "learning_rate": {"type": "float", "low": 1e-4, "high": 10.0, "log": True},
            "optimizer": {"type": "categorical", "choices": ["sgd", "adamw"]},
            "model.hidden": {"type": "int", "low": 32, "high": 128, "log": True},
            "model.depth": {"type": "int", "low": 1, "high": 3},
        },
    }


def run_digits(arms: dict[str, Any], seed: int, n_trials: int, max_steps: int) -> list[ArmRun]:
    from sweep.spec import parse_spec  # the trainer's imports (torch) only when digits runs
    from sweep.study import open_study, run_study

    runs: list[ArmRun] = []
    with tempfile.TemporaryDirectory() as tmp:
        for arm, pruner in arms.items():
            spec = parse_spec(digits_design(n_trials, max_steps, pruner, seed), f"bench:{arm}")
            study = open_study(spec, f"sqlite:///{Path(tmp) / (str(len(runs)) + '.db')}")
            started = time.perf_counter()
            run_study(study, spec)
            run = ArmRun("digits", arm, seed, wall=time.perf_counter() - started)
            for t in sorted(study.get_trials(), key=lambda t: t.number):
                reason = t.user_attrs.get(ATTR_PRUNE) or {}
                run.outcomes.append(Outcome(int(t.user_attrs.get(ATTR_STEPS, 0)),
                                            t.value if t.state == TrialState.COMPLETE else None,
                                            reason.get("rule"), sorted(t.intermediate_values.items()),
                                            pruned=t.state == TrialState.PRUNED))
            runs.append(run)
    truth = runs[0].outcomes  # the no-pruning arm trained every config to the end
    for run in runs:
        for outcome, full in zip(run.outcomes, truth):
            outcome.truth = full.truth
    return runs


# --- scoring --------------------------------------------------------------------------------------------------------
def final_of(curve: Curve) -> float:
    value = curve[-1][1] if curve else math.inf
    return value if math.isfinite(value) else math.inf


def bad(curve: Curve) -> bool:
    """Diverged (a non-finite value, or above 10x its start), or ended no better than 95% of its start."""
    if not curve:
        return True
    start = curve[0][1]
    return (any(not math.isfinite(v) or v > 10 * start for _, v in curve)
            or final_of(curve) >= 0.95 * start)


def divergence_onset(curve: Curve) -> int | None:
    """The first step at which a curve is non-finite or above 10x its start, if any."""
    start = curve[0][1] if curve else math.nan
    return next((s for s, v in curve if not math.isfinite(v) or v > 10 * start), None)


@dataclass
class Score:
    steps: int = 0
    none_steps: int = 0
    best: list[float] = field(default_factory=list)
    none_best: list[float] = field(default_factory=list)
    top_pruned: int = 0
    top_by_fast_fail: int = 0
    top: int = 0
    bad_share: list[float] = field(default_factory=list)
    after_onset: list[int] = field(default_factory=list)
    wall: float = 0.0

    def add(self, run: ArmRun, none: ArmRun, max_steps: int) -> None:
        self.steps += sum(o.steps for o in run.outcomes)
        self.none_steps += sum(o.steps for o in none.outcomes)
        self.best.append(min((o.value for o in run.outcomes if o.value is not None), default=math.inf))
        self.none_best.append(min((o.value for o in none.outcomes if o.value is not None), default=math.inf))
        finals = sorted(final_of(o.truth) for o in run.outcomes)
        bar = finals[max(0, len(finals) // 4 - 1)]
        top = [o for o in run.outcomes if final_of(o.truth) <= bar]
        self.top += len(top)
        self.top_pruned += sum(o.pruned for o in top)
        self.top_by_fast_fail += sum(o.pruned and o.rule in FAST_FAIL_RULES for o in top)
        self.bad_share += [o.steps / max_steps for o in run.outcomes if bad(o.truth)]
        self.after_onset += [o.steps - onset for o in run.outcomes
                             if (onset := divergence_onset(o.truth)) is not None and 0 < onset <= o.steps]
        self.wall += run.wall

    def row(self, arm: str) -> list[str]:
        gaps = [100 * (b - n) / abs(n) for b, n in zip(self.best, self.none_best) if math.isfinite(n) and n]
        return [arm, str(self.steps), f"{self.none_steps / max(self.steps, 1):.2f}x",
                " ".join(f"{b:.4f}" for b in self.best), f"{np.mean(gaps):+.2f}%" if gaps else "n/a",
                f"{self.top_pruned}/{self.top} ({self.top_by_fast_fail})",
                f"{100 * np.mean(self.bad_share):.1f}%" if self.bad_share else "n/a",
                f"{np.mean(self.after_onset):.0f} ({len(self.after_onset)})" if self.after_onset else "n/a",
                f"{self.wall:.1f}"]


def table(title: str, rows: list[list[str]]) -> None:
    header = ["arm", "total steps", "fewer than none", "best (per seed)", "best vs none", "top-25% pruned (fast-fail)",
              "bad trials' budget used", "steps after divergence (trials)", "wall s"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line: Callable[[list[str]], str] = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    print(f"\n{title}\n{line(header)}\n|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=40, help="trials per simulated study")
    parser.add_argument("--digits-trials", type=int, default=24)
    parser.add_argument("--digits-steps", type=int, default=400)
    parser.add_argument("--no-digits", action="store_true")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)

    runs: list[ArmRun] = []
    for task in ("two-phase", "late-divergence"):
        for seed in range(args.seeds):
            runs += [run_simulated(task, arm, spec, seed, args.trials) for arm, spec in ARMS.items()]
    if not args.no_digits:
        runs += run_digits(ARMS, 0, args.digits_trials, args.digits_steps)

    tasks = list(dict.fromkeys(r.task for r in runs))
    pooled = {arm: Score() for arm in ARMS}
    for task in tasks:
        scores = {arm: Score() for arm in ARMS}
        for run in (r for r in runs if r.task == task):
            none = next(r for r in runs if r.task == task and r.seed == run.seed and r.arm == "none")
            max_steps = args.digits_steps if task == "digits" else MAX_STEPS
            scores[run.arm].add(run, none, max_steps)
            pooled[run.arm].add(run, none, max_steps)
        seeds = len({r.seed for r in runs if r.task == task})
        table(f"{task} ({seeds} seed{'s' * (seeds > 1)})", [scores[arm].row(arm) for arm in ARMS])
    table("pooled", [pooled[arm].row(arm) for arm in ARMS])


if __name__ == "__main__":
    main()
