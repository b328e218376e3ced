"""Cohorts against one trial at a time: the same study (digits, TPE, fast-fail then median), run with each cohort size
and each seed, side by side in one process; wall time to spend the budget, trials per hour (and the ratio to cohort
1), the steps trained (pruning decides how many) and steps per second, the best value and the trial that reached it.

    python bench/cohorts.py                                  # 64 trials x 300 steps, cohorts 1 8 32, seeds 0 1 2
    python bench/cohorts.py --trials 24 --steps 100 --cohorts 1 8 --seeds 0

Each run is a fresh SQLite study in a temporary folder, through the same worker loop `sweep run` uses. One thread
per process (`torch.set_num_threads(1)`), so the ratio is the engine's, not the thread pool's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import optuna
import torch
from optuna.trial import TrialState

from sweep.spec import parse_spec
from sweep.study import open_study, run_study


def document(trials: int, steps: int, seed: int, cohort: int) -> dict:
    return {
        "name": f"cohorts-{cohort}-{seed}", "n_trials": trials, "seed": seed, "sampler": "tpe",
        "pruner": {"type": "fastfail", "then": "median"}, "task": "digits", "execution": {"cohort": cohort},
        "fixed": {"max_steps": steps, "eval_every_steps": max(1, steps // 10), "log_every_steps": max(1, steps // 10),
                  "batch_size": 64, "model": {"hidden": 64}},
        "space": {"learning_rate": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
                  "weight_decay": {"type": "float", "low": 1e-6, "high": 1e-1, "log": True},
                  "warmup_steps": {"type": "int", "low": 0, "high": max(1, steps // 5)}},
    }


def run(trials: int, steps: int, seed: int, cohort: int, folder: Path) -> dict:
    spec = parse_spec(document(trials, steps, seed, cohort), folder / "study.yaml")
    url = f"sqlite:///{folder / f'{spec.name}.db'}"
    study = open_study(spec, url)
    started = time.perf_counter()
    run_study(study, spec, storage_url=url)
    wall = time.perf_counter() - started
    ended = study.get_trials(deepcopy=False)
    done = [t for t in ended if t.state == TrialState.COMPLETE]
    steps = sum(int(t.user_attrs.get("steps_trained", t.user_attrs.get("steps", 0)) or 0) for t in ended)
    best = min(done, key=lambda t: t.value) if done else None  # type: ignore[arg-type,return-value]
    return {"wall": wall, "per_hour": 3600 * trials / wall, "steps": steps, "steps_per_s": steps / wall,
            "best": None if best is None else best.value,
            "best_at": None if best is None else best.number}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--cohorts", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    options = parser.parse_args()
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows: dict[int, list[dict]] = {k: [] for k in options.cohorts}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in options.seeds:  # each seed runs every cohort size back to back: the machine's load is shared
            for cohort in options.cohorts:
                folder = Path(tmp) / f"{cohort}-{seed}"
                folder.mkdir()
                rows[cohort].append(run(options.trials, options.steps, seed, cohort, folder))
    base = statistics.median(r["per_hour"] for r in rows[options.cohorts[0]])
    print(f"digits, {options.trials} trials x {options.steps} steps, TPE, fast-fail then median, seeds "
          f"{options.seeds}, 1 thread")
    print(f"{'cohort':>6} {'wall s':>8} {'trials/h':>9} {'vs ' + str(options.cohorts[0]):>6} {'steps':>7} "
          f"{'steps/s':>8}  best per seed (at trial)")
    for cohort, results in rows.items():
        wall = statistics.median(r["wall"] for r in results)
        per_hour = statistics.median(r["per_hour"] for r in results)
        steps = statistics.median(r["steps"] for r in results)
        rate = statistics.median(r["steps_per_s"] for r in results)
        bests = ", ".join("-" if r["best"] is None else f"{r['best']:.4f} (#{r['best_at']})" for r in results)
        print(f"{cohort:>6} {wall:>8.1f} {per_hour:>9.0f} {per_hour / base:>6.2f}x {steps:>7.0f} {rate:>8.0f}  {bests}")


if __name__ == "__main__":
    main()
