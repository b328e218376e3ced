"""What does tracking (`tracking:` in a study file) cost a trial, against tracking off?

    python bench/tracking_overhead.py            # digits MLP on the CPU, a log every 10 steps
    python bench/tracking_overhead.py --quick    # a smoke run: fewer steps and repeats

What is compared. The same `trainer.train` run, three ways: tracking off (the reporter holds no tracker, as
`TrialReporter` does then), TensorBoard on, MLflow on (each only when its package is installed). The trackers are the
ones a study uses (`sweep.tracking.open_trackers`, behind `Guarded`), fed by a reporter that forwards the trainer's
`log` and `report` calls to them, as `TrialReporter` does; MLflow writes to a SQLite store in a temporary folder,
TensorBoard to event files there. A short log interval (10 steps) makes the tracking work per step as large as a
study would normally see it.

What is timed. The whole run (training, evaluations, the trackers' writes, and closing them at the end: the hparams
session, MLflow's end of run), wall clock, per run. Runs alternate (off, on, on, off, ...) so that drifting noise hits
every arm alike; each arm's median over the repeats is reported, and the ratio is its median over tracking off's.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sweep.schema import StudySpec
from sweep.tracking import Guarded, open_trackers, tracking_problems
from trainer import TrainingConfig, load_task, train

BASE = {"name": "bench", "n_trials": 1, "task": "digits", "pruner": "none"}


class Forwarding:
    """The part of `TrialReporter` that tracking touches: each log and evaluation goes to every tracker."""

    def __init__(self, trackers: Sequence[Guarded]) -> None:
        self.trackers = list(trackers)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        for tracker in self.trackers:
            tracker.report(step, metrics)
        return False


def one_run(arm: dict[str, Any], config: TrainingConfig, task: Any, folder: Path, number: int) -> float:
    spec = StudySpec.model_validate({**BASE, "tracking": arm})
    started = time.perf_counter()
    trackers = open_trackers(spec, f"sqlite:///{folder / 'bench.db'}", "bench", number, {"learning_rate": 1e-3})
    result = train(config, task, Forwarding(trackers))
    for tracker in trackers:
        tracker.finish("complete", result.metrics["val_loss"], {"steps": result.steps})
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    steps, repeats = (300, 3) if args.quick else (2000, 7)
    config = TrainingConfig.from_dict({"task": "digits", "max_steps": steps, "log_every_steps": 10,
                                       "eval_every_steps": 100, "batch_size": 64, "fast_fail": {"enabled": False}})
    task = load_task("digits")
    arms: dict[str, dict[str, Any]] = {"off": {}}
    for name, arm in (("tensorboard", {"tensorboard": True}), ("mlflow", {"mlflow": True})):
        missing = tracking_problems(StudySpec.model_validate({**BASE, "tracking": arm}))
        if missing:
            print(f"{name}: skipped ({missing[0][1]})")
        else:
            arms[name] = arm
    times: dict[str, list[float]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as tmp:
        number = 0
        for repeat in range(repeats + 1):  # the first round warms up (imports, allocations) and is not counted
            order = list(arms) if repeat % 2 == 0 else list(reversed(arms))
            for name in order:
                elapsed = one_run(arms[name], config, task, Path(tmp), number)
                number += 1
                if repeat:
                    times[name].append(elapsed)
    print(f"digits MLP (64x2), batch 64, {steps} steps, a log every 10 and an evaluation every 100 steps; "
          f"{repeats} runs per arm, median; torch {torch.__version__}, {platform.processor() or platform.machine()}")
    base = statistics.median(times["off"])
    print(f"{'tracking':<12} {'s per run':>10} {'ms per log':>11} {'ratio vs off':>13}")
    for name, values in times.items():
        median = statistics.median(values)
        per_log = 1000 * (median - base) / (steps / 10)
        print(f"{name:<12} {median:>10.3f} {per_log:>11.3f} {median / base:>13.3f}")


if __name__ == "__main__":
    main()
