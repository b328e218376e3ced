"""The same study through the built-in trainer (`task: digits`) and through a user's loop function
(`loop: byo.digits_loop:main`, studies/byo/digits_loop.py: the digits MLP, AdamW, warmup then cosine, its own
checkpoints), side by side.

    python bench/loop_vs_task.py [--trials 8] [--steps 400] [--folder /tmp/loop-vs-task]

Both arms sample the same space with the same seeded sampler and pruner (fast-fail, then median) on a SQLite file;
what differs is who trains. The table: best value, trials by outcome, steps trained, wall time, and the median storage
round trip of a report (`report_ms`), which is the same reporter in both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import optuna

ROOT = Path(__file__).resolve().parent.parent


def document(form: str, trials: int, steps: int) -> dict[str, Any]:
    common: dict[str, Any] = {
        "name": f"side-by-side-{form}", "n_trials": trials, "seed": 0,
        "sampler": {"type": "tpe", "n_startup_trials": 4},
        "pruner": {"type": "fastfail", "then": {"type": "median", "n_startup_trials": 3, "n_warmup_steps": 100}},
        "space": {"learning_rate": {"type": "float", "low": 1e-4, "high": 0.3, "log": True},
                  "weight_decay": {"type": "float", "low": 1e-6, "high": 0.1, "log": True},
                  "model.hidden": {"type": "int", "low": 16, "high": 256, "log": True}},
    }
    fixed = {"max_steps": steps, "eval_every_steps": 50, "warmup_steps": 20, "batch_size": 64,
             "model": {"depth": 2}}
    if form == "task":
        return {**common, "task": "digits", "fixed": {**fixed, "optimizer": "adamw", "scheduler": "cosine",
                                                     "log_every_steps": 50, "device": "cpu"}}
    return {**common, "loop": "byo.digits_loop:main", "fixed": {**fixed, "device": "cpu"}}


def run(form: str, folder: Path, trials: int, steps: int) -> dict[str, Any]:
    from sweep.spec import parse_spec
    from sweep.study import open_study, run_study

    spec = parse_spec(document(form, trials, steps), f"{form} study")
    url = f"sqlite:///{folder / f'{form}.db'}"
    started = time.perf_counter()
    study = open_study(spec, url)
    run_study(study, spec, storage_url=url)
    wall = time.perf_counter() - started
    done = study.get_trials()
    states = {s: sum(t.state.name == s for t in done) for s in ("COMPLETE", "PRUNED", "FAIL")}
    report_ms = [ms for t in done for ms in t.user_attrs.get("report_ms", [])]
    return {"best": study.best_value, **states, "wall_s": wall,
            "steps": sum(int(t.user_attrs.get("steps_trained", t.user_attrs.get("steps", 0)) or 0) for t in done),
            "trial_s": statistics.median(t.user_attrs["wall_time_s"] for t in done),
            "report_ms": statistics.median(report_ms) if report_ms else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--folder", type=Path, default=None)
    options = parser.parse_args()
    folder = options.folder or Path(tempfile.mkdtemp(prefix="loop-vs-task-"))
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.db"):
        stale.unlink()
    sys.path.append(str(ROOT / "studies"))  # where the loop's package lies, as next to a study file
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    rows = {form: run(form, folder, options.trials, options.steps) for form in ("task", "loop")}
    print(f"{options.trials} trials of {options.steps} steps each, digits MLP, CPU\n")
    print("| runner | best val_loss | complete | pruned | failed | steps trained | median trial (s) | study wall (s) "
          "| median report_ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for form, row in rows.items():
        print(f"| {form} | {row['best']:.4f} | {row['COMPLETE']} | {row['PRUNED']} | {row['FAIL']} | {row['steps']} "
              f"| {row['trial_s']:.2f} | {row['wall_s']:.1f} | {row['report_ms']:.2f} |")


if __name__ == "__main__":
    main()
