"""How much compute does each pruner save, and what does it cost? One study design, fixed seeds, five pruners.

    python bench/pruning.py                # 64 trials per arm, about 2.5 minutes on 2 CPU cores
    python bench/pruning.py --trials 40 --max-steps 400

The search space plants bad configurations: learning rates up to 10 with SGD or AdamW and no clipping blow up or
collapse to a constant guess. The random sampler draws the same configurations in every arm (its draws do not depend
on results), so arms differ only in what their pruner stopped. The no-pruning arm is the ground truth: a trial
*diverged* if an evaluation was NaN/Inf or above 10x the untrained loss, or it ended no better than an untrained
model (>= 95% of ln 10); the *best 25%* are its best finishers.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from sweep.spec import parse_spec
from sweep.study import open_study, run_study

UNTRAINED = math.log(10)  # cross entropy of a uniform guess over 10 digits
FAST_FAIL_RULES = {"nan", "inf", "explode", "plateau"}

# Fast-fail's plateau patience is set to 5% of the budget here (the default, a quarter of it, is made for studies
# whose configs may start slowly): a trial that has not improved its untrained loss by 1% after 25 of 500 steps has
# collapsed or is not learning.
FAST_FAIL = {"type": "fastfail", "patience_steps": 25}
MEDIAN = {"type": "median", "n_startup_trials": 5, "n_warmup_steps": 0}
ARMS: dict[str, Any] = {
    "no pruning": "none",
    "median": MEDIAN,
    "hyperband": {"type": "hyperband", "min_resource": 25, "reduction_factor": 3},
    "fast-fail": FAST_FAIL,
    "fast-fail + median": {**FAST_FAIL, "then": MEDIAN},
}


def design(n_trials: int, max_steps: int, pruner: Any) -> dict[str, Any]:
    return {
        "name": "pruning-bench",
        "n_trials": n_trials,
        "seed": 0,
        "sampler": {"type": "random", "seed": 0},
        "pruner": pruner,
        "max_repeated_failures": 0,
        "task": "digits",
        "fixed": {"max_steps": max_steps, "eval_every_steps": 25, "log_every_steps": 5, "batch_size": 64,
                  "scheduler": "cosine", "warmup_steps": 0},
        "space": {
            "learning_rate": {"type": "float", "low": 1e-3, "high": 10.0, "log": True},
            "optimizer": {"type": "categorical", "choices": ["sgd", "adamw"]},
            "momentum": {"type": "categorical", "choices": [0.0, 0.9]},
            "model.hidden": {"type": "int", "low": 32, "high": 128, "log": True},
            "model.depth": {"type": "int", "low": 1, "high": 2},
        },
    }


def run_arm(name: str, pruner: Any, n_trials: int, max_steps: int, folder: Path) -> dict[str, Any]:
    spec = parse_spec(design(n_trials, max_steps, pruner), f"bench:{name}")
    study = open_study(spec, f"sqlite:///{folder / (name.replace(' ', '_').replace('+', 'and') + '.db')}")
    started = time.perf_counter()
    run_study(study, spec)
    wall = time.perf_counter() - started
    trials = sorted(study.get_trials(), key=lambda t: t.number)
    return {"name": name, "trials": trials, "wall": wall}


def diverged(trial: optuna.trial.FrozenTrial) -> bool:
    """Infeasible, in the tuning playbook's sense: it blew up (NaN/Inf, or an evaluation above 10x the untrained
    loss) or trained its whole budget to end no better than an untrained model."""
    values = list(trial.intermediate_values.values())
    blew_up = any(not math.isfinite(v) or v > 10 * UNTRAINED for v in values)
    return trial.state == TrialState.FAIL or blew_up or (trial.value is not None and trial.value >= 0.95 * UNTRAINED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=500)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)

    with tempfile.TemporaryDirectory() as tmp:
        arms = [run_arm(name, pruner, args.trials, args.max_steps, Path(tmp)) for name, pruner in ARMS.items()]

    truth = arms[0]["trials"]
    bad = {t.number for t in truth if diverged(t)}
    finished = sorted((t for t in truth if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    top = {t.number for t in finished[: max(1, len(finished) // 4)]}
    best_truth = finished[0].value

    print(f"{args.trials} trials of digits, max_steps={args.max_steps}; {len(bad)} diverge without pruning "
          f"({100 * len(bad) / args.trials:.0f}%); no-pruning best value {best_truth:.4f}\n")
    header = ("pruner", "total steps", "vs none", "steps on diverged", "diverged budget used",
              "best value", "vs none", "top-25% pruned (by fast-fail)", "wall s")
    rows = []
    for arm in arms:
        trials = arm["trials"]
        steps = {t.number: int(t.user_attrs.get("steps", 0)) for t in trials}
        total = sum(steps.values())
        on_bad = sum(steps[n] for n in bad)
        share = sum(steps[n] / args.max_steps for n in bad) / max(1, len(bad))
        complete = [t.value for t in trials if t.state == TrialState.COMPLETE]
        best = min(complete) if complete else math.nan
        top_pruned = [t for t in trials if t.number in top and t.state == TrialState.PRUNED]
        by_fast_fail = [t for t in top_pruned if t.user_attrs.get("prune_reason", {}).get("rule") in FAST_FAIL_RULES]
        rows.append((arm["name"], f"{total}", f"{sum(int(t.user_attrs.get('steps', 0)) for t in truth) / total:.2f}x"
                     " fewer", f"{on_bad}", f"{100 * share:.1f}%", f"{best:.4f}",
                     f"{100 * (best - best_truth) / best_truth:+.2f}%",
                     f"{len(top_pruned)}/{len(top)} ({len(by_fast_fail)})",
                     f"{arm['wall']:.1f}"))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))
    print("\ndiverged budget used: the mean share of max_steps a diverged trial trained before it was stopped.")
    print("top-25% pruned: trials that finish among the best quarter without pruning, but were pruned here; in\n"
          "brackets, how many of those a fast-fail rule pruned (the rest are the wrapped or other pruner's).")


if __name__ == "__main__":
    main()
