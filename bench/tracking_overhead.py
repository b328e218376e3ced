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
session, MLflow's end of run), per run, two ways: the process's CPU time (every thread's, so the trackers' background
writers count too; steady on a machine shared with other work) and the wall clock. Torch uses one thread, so that
CPU time is comparable between arms. Runs alternate (off, on, on, off, ...) so that drifting noise hits every arm
alike; each arm's median over the repeats is reported, and the ratio is its median over tracking off's.
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


def one_run(arm: dict[str, Any], config: TrainingConfig, task: Any, folder: Path, number: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run."""
    spec = StudySpec.model_validate({**BASE, "tracking": arm})
    started, cpu = time.perf_counter(), time.process_time()
    trackers = open_trackers(spec, f"sqlite:///{folder / 'bench.db'}", "bench", number, {"learning_rate": 1e-3})
    result = train(config, task, Forwarding(trackers))
    for tracker in trackers:
        tracker.finish("complete", result.metrics["val_loss"], {"steps": result.steps})
    return time.perf_counter() - started, time.process_time() - cpu


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    steps, repeats = (300, 3) if args.quick else (1000, 5)
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
    torch.set_num_threads(1)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as tmp:
        number = 0
        for repeat in range(repeats + 1):  # the first round warms up (imports, allocations) and is not counted
            order = list(arms) if repeat % 2 == 0 else list(reversed(arms))
            for name in order:
                elapsed = one_run(arms[name], config, task, Path(tmp), number)
                print(f"  round {repeat} {name}: {elapsed[0]:.3f} s wall, {elapsed[1]:.3f} s CPU", flush=True)
                number += 1
                if repeat:
                    times[name].append(elapsed)
    print(f"digits MLP (64x2), batch 64, {steps} steps, a log every 10 and an evaluation every 100 steps; "
          f"{repeats} runs per arm, median; torch {torch.__version__}, {platform.processor() or platform.machine()}")
    cpu_base = statistics.median(c for _, c in times["off"])
    wall_base = statistics.median(w for w, _ in times["off"])
    # "extra CPU s": the arm's median minus tracking off's, for the whole run: opening and closing the trial's run
    # (MLflow: creating it, params, tags, artifacts, end) and its steps/10 log steps and steps/100 evaluations.
    print(f"{'tracking':<12} {'CPU s/run':>10} {'extra CPU s':>12} {'CPU ratio':>10} {'wall s/run':>11} "
          f"{'wall ratio':>11}")
    for name, values in times.items():
        cpu = statistics.median(c for _, c in values)
        wall = statistics.median(w for w, _ in values)
        print(f"{name:<12} {cpu:>10.3f} {cpu - cpu_base:>12.3f} {cpu / cpu_base:>10.3f} {wall:>11.3f} "
              f"{wall / wall_base:>11.3f}")


if __name__ == "__main__":
    main()
