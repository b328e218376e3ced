"""Batched training versus the same configs one after another: trials per hour, values reached, deviation.

    python bench/batched.py [--ks 1 4 16 64] [--steps 300] [--tasks digits charlm]

For each task and cohort size K: K configs (learning rate, weight decay, seed and schedule differing per member)
trained by `trainer.train` one after another in this process, then by `trainer.batched.train_batched` as one cohort.
Both sides run with one torch thread (a fair comparison on a shared CPU; said in the output), after a short warm-up
run of each. Prints trials/hour of each side, their ratio, the mean final val_loss, and the largest deviation of a
member's evaluations from its solo run (0.0: bit for bit).
"""

from __future__ import annotations

import argparse
import time

import torch

from trainer import TrainingConfig, load_task, train
from trainer.batched import train_batched

TASKS = {
    "digits": {"task": "digits", "model": {"hidden": 64}, "batch_size": 64},
    "charlm": {"task": "charlm", "task_args": {"context": 32, "max_chars": 200_000},
               "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "mlp_ratio": 2}, "batch_size": 16,
               "eval_batch_size": 256},
}


def configs(task: str, k: int, steps: int) -> list[TrainingConfig]:
    schedules = ["cosine", "linear", "step", "none"]
    return [TrainingConfig.from_dict({**TASKS[task], "max_steps": steps, "eval_every_steps": steps // 3,
                                      "log_every_steps": steps // 3, "seed": i, "learning_rate": 1e-3 * (1 + i % 7),
                                      "weight_decay": 0.01 * (i % 3), "scheduler": schedules[i % 4],
                                      "device": "cpu", "fast_fail": {"enabled": False}}) for i in range(k)]


def deviation(solo: list, batched: list) -> float:
    worst = 0.0
    for a, b in zip(solo, batched):
        for (_, ma), (_, mb) in zip(a.evals, b.evals):
            worst = max(worst, *(abs(ma[key] - mb[key]) for key in ma))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tasks", nargs="+", default=["digits", "charlm"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"one torch thread on both sides; {args.steps} steps per trial")
    print(f"{'task':8} {'K':>4} {'solo trials/h':>14} {'batched trials/h':>17} {'ratio':>6} "
          f"{'val_loss solo':>14} {'val_loss batched':>17} {'max deviation':>14}")
    for name in args.tasks:
        task = load_task(TASKS[name]["task"], TASKS[name].get("task_args"))
        # Warm both paths first (lazy initialisation, first allocations), so that neither side's first timed run
        # pays for it: the solo side runs first and would otherwise be charged alone.
        warm = configs(name, 2, 6)
        train(warm[0], task)
        train_batched(warm, task, capacity=2)
        for k in args.ks:
            cohort = configs(name, k, args.steps)
            started = time.perf_counter()
            solo = [train(c, task) for c in cohort]
            solo_s = time.perf_counter() - started
            started = time.perf_counter()
            batched = train_batched(cohort, task, capacity=k)
            batched_s = time.perf_counter() - started
            loss = [sum(r.metrics["val_loss"] for r in rs) / k for rs in (solo, batched)]
            print(f"{name:8} {k:4d} {k * 3600 / solo_s:14.0f} {k * 3600 / batched_s:17.0f} "
                  f"{solo_s / batched_s:6.2f} {loss[0]:14.4f} {loss[1]:17.4f} {deviation(solo, batched):14.3g}",
                  flush=True)


if __name__ == "__main__":
    main()
