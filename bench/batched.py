"""Batched training versus the same configs one after another: trials per hour, values reached, deviation.

    python bench/batched.py [--ks 1 4 16 64] [--steps 300] [--tasks digits charlm]
    python bench/batched.py --deviation [--steps 500] [--threads 1 2]
    python bench/batched.py --device cuda --ks 1 16 64 256 --tasks digits charlm charlm-10m --solo-max 16

For each task and cohort size K: K configs (learning rate, weight decay, seed and schedule differing per member)
trained by `trainer.train` one after another in this process, then by `trainer.batched.train_batched` as one cohort.
Both sides run with one torch thread (a fair comparison on a shared CPU; said in the output), after a short warm-up
run of each. Prints trials/hour of each side, their ratio, the mean final val_loss, and the largest deviation of a
member's evaluations from its solo run (0.0: bit for bit).

On a GPU (`--device cuda`; bf16 autocast for the charlm tasks): the same table, with `--solo-max N` timing only the
first N configs one after another (a sequential run's time grows linearly with the number of trials, so its
trials/hour is measured on fewer), and for charlm tasks the stacked model's model-FLOPs utilisation: every member's
training tokens per second of the cohort's wall time (its evaluations and setup included, so a lower bound) times
FLOPs per token (`bench/gpu.py`'s count: 6 N + 12 L d T) over `--peak-tflops` (default 989, H100/H200 dense bf16).
Targets (issue 16): at least 30x the trials/hour for models of at most 10M parameters, at least 50% of the bf16 peak
on the stacked charlm (`charlm-10m`: studies/charlm.yaml's model, 10.8M parameters, batch 64, context 256).

`--deviation`: the exactness table instead. For every optimizer (AdamW, Adam, SGD, SGD with momentum, SGD Nesterov,
Lion) one cohort of members that cover every schedule (constant, warmup, cosine, linear, step) plus dropout, gradient
clipping and a curriculum, each trained by `trainer.train` alone, in the cohort, and in a cohort of one, on a CPU in
fp32 with the given intra-op thread counts. Prints, per member, the largest relative deviation from its solo run of
its evaluations (val_loss, val_accuracy), of its logged training loss and gradient norm, and of its final weights
(from the checkpoint each side writes at the last step), and of its values in the cohort from its values in a cohort
of one (0: bit for bit), then the largest of each column.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainer import TrainingConfig, TrainResult, load_task, train
from trainer.batched import CohortMember, train_batched
from trainer.checkpoint import load_checkpoint

TASKS: dict[str, dict[str, Any]] = {
    "digits": {"task": "digits", "model": {"hidden": 64}, "batch_size": 64},
    "charlm": {"task": "charlm", "task_args": {"context": 32, "max_chars": 200_000},
               "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "mlp_ratio": 2}, "batch_size": 16,
               "eval_batch_size": 256},
    # studies/charlm.yaml's model and batch (as bench/gpu.py's CHARLM), for the GPU: 10.8M parameters.
    "charlm-10m": {"task": "charlm", "task_args": {"context": 256, "max_chars": 4_000_000},
                   "model": {"d_model": 384, "n_layers": 6, "n_heads": 6}, "batch_size": 64, "eval_batch_size": 256,
                   "gradient_clip_norm": 1.0},
}


def configs(task: str, k: int, steps: int, device: str = "cpu") -> list[TrainingConfig]:
    schedules = ["cosine", "linear", "step", "none"]
    gpu = {"mixed_precision": "bf16"} if device != "cpu" and TASKS[task]["task"] == "charlm" else {}
    return [TrainingConfig.from_dict({**TASKS[task], **gpu, "max_steps": steps, "eval_every_steps": steps // 3,
                                      "log_every_steps": steps // 3, "seed": i, "learning_rate": 1e-3 * (1 + i % 7),
                                      "weight_decay": 0.01 * (i % 3), "scheduler": schedules[i % 4],
                                      "device": device, "fast_fail": {"enabled": False}}) for i in range(k)]


def flops_per_token(name: str) -> float:
    """bench/gpu.py's FLOPs per token of a charlm task's model (6 N + 12 L d T)."""
    from gpu import flops_per_token as count  # bench/gpu.py, next to this script

    return count(TASKS[name])[1]


def deviation(solo: list, batched: list) -> float:
    worst = 0.0
    for a, b in zip(solo, batched):
        for (_, ma), (_, mb) in zip(a.evals, b.evals):
            worst = max(worst, *(abs(ma[key] - mb[key]) for key in ma))
    return worst


# --deviation: the optimizers, each with its usual learning-rate scale, and one member per schedule or feature.
OPTIMIZERS = {"adamw": ({"optimizer": "adamw"}, 1.0), "adam": ({"optimizer": "adam"}, 1.0),
              "sgd": ({"optimizer": "sgd"}, 30.0), "sgd momentum": ({"optimizer": "sgd", "momentum": 0.9}, 10.0),
              "sgd nesterov": ({"optimizer": "sgd", "momentum": 0.9, "nesterov": True}, 10.0),
              "lion": ({"optimizer": "lion"}, 0.3)}
MEMBERS: dict[str, dict[str, Any]] = {
    "constant": {"scheduler": "none"},
    "warmup+cosine": {"scheduler": "cosine", "warmup_steps": 50},
    "linear": {"scheduler": "linear", "min_lr_ratio": 0.1},
    "step": {"scheduler": "step", "step_every": 100, "step_gamma": 0.5},
    "warmup+none, dropout": {"scheduler": "none", "warmup_steps": 20, "model": {"hidden": 64, "dropout": 0.2}},
    "cosine, clipping": {"scheduler": "cosine", "gradient_clip_norm": 0.5},
    "linear, curriculum": {"scheduler": "linear", "curriculum": {"schedule": "linear", "start_level": 0.3}},
}


def deviation_configs(optimizer: str, steps: int) -> list[TrainingConfig]:
    settings, scale = OPTIMIZERS[optimizer]
    every = max(1, steps // 10)
    return [TrainingConfig.from_dict({**TASKS["digits"], **settings, "max_steps": steps, "eval_every_steps": every,
                                      "log_every_steps": every, "seed": i, "learning_rate": 1e-3 * scale * (1 + i % 3),
                                      "weight_decay": 0.01 * (i % 3), "device": "cpu",
                                      "fast_fail": {"enabled": False}, **member})
            for i, member in enumerate(MEMBERS.values())]


class LastState:
    """A checkpointer that keeps the state at the last step in memory (`trainer.checkpoint` writes it to a file)."""

    def __init__(self, steps: int, folder: Path) -> None:
        self.steps, self.path = steps, folder / f"{id(self)}.pt"

    def path_for(self, step: int, metrics: Mapping[str, float] | None) -> Path | None:
        return self.path if step == self.steps else None

    def saved(self, info: Any, metrics: Mapping[str, float] | None) -> None:
        pass

    def weights(self) -> dict[str, torch.Tensor]:
        return load_checkpoint(self.path).model


def weights_relative(a: LastState, b: LastState) -> float:
    """The largest relative difference between two final weights, element by element."""
    wa, wb = a.weights(), b.weights()
    return max(float(((wa[k] - wb[k]).abs() / wa[k].abs().clamp(min=1e-12)).max()) for k in wa)


def relative(a: TrainResult, b: TrainResult) -> tuple[float, float]:
    """The largest relative deviation of b from a: in the evaluations, and in the logged train_loss and grad_norm."""
    def rel(x: float, y: float) -> float:
        return 0.0 if x == y else abs(x - y) / max(abs(x), abs(y), 1e-12)

    if [s for s, _ in a.evals] != [s for s, _ in b.evals] or len(a.logs) != len(b.logs):
        return math.inf, math.inf
    evals = max((rel(ma[key], mb[key]) for (_, ma), (_, mb) in zip(a.evals, b.evals) for key in ma), default=0.0)
    logs = max((rel(la[key], lb[key]) for la, lb in zip(a.logs, b.logs) for key in ("train_loss", "grad_norm")),
               default=0.0)
    return evals, logs


def deviation_table(steps: int, threads: list[int]) -> None:
    task = load_task("digits")
    print(f"{steps} steps per member, digits MLP (hidden 64, batch 64), CPU fp32; relative deviations, 0 = bit for bit")
    print(f"{'threads':>7} {'optimizer':13} {'member':22} {'evals vs solo':>14} {'logs vs solo':>13} "
          f"{'weights vs solo':>16} {'evals K vs 1':>13} {'logs K vs 1':>12}")
    worst = [0.0] * 5
    with tempfile.TemporaryDirectory() as folder:
        for count in threads:
            torch.set_num_threads(count)
            for optimizer in OPTIMIZERS:
                cohort = deviation_configs(optimizer, steps)
                kept = [(LastState(steps, Path(folder)), LastState(steps, Path(folder))) for _ in cohort]
                solo = [train(c, task, checkpointer=k[0]) for c, k in zip(cohort, kept, strict=True)]
                members = [CohortMember(c, checkpointer=k[1]) for c, k in zip(cohort, kept, strict=True)]
                together = train_batched(members, task, capacity=len(cohort))
                alone = train_batched(cohort, task, capacity=1)
                for name, a, b, c, (ka, kb) in zip(MEMBERS, solo, together, alone, kept, strict=True):
                    row = [*relative(a, b), weights_relative(ka, kb), *relative(c, b)]
                    worst = [max(w, r) for w, r in zip(worst, row)]
                    print(f"{count:7d} {optimizer:13} {name:22} {row[0]:14.3g} {row[1]:13.3g} {row[2]:16.3g} "
                          f"{row[3]:13.3g} {row[4]:12.3g}", flush=True)
    print(f"{'largest':>7} {'':13} {'':22} {worst[0]:14.3g} {worst[1]:13.3g} {worst[2]:16.3g} {worst[3]:13.3g} "
          f"{worst[4]:12.3g}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--steps", type=int, default=None, help="per trial (default 300; 500 with --deviation)")
    parser.add_argument("--tasks", nargs="+", default=["digits", "charlm"])
    parser.add_argument("--deviation", action="store_true", help="print the exactness table instead")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="with --deviation: thread counts")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--solo-max", type=int, default=None,
                        help="time at most this many configs one after another (default: all K)")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the chip's dense bf16 peak, for the MFU column (989: H100/H200 SXM)")
    args = parser.parse_args()
    if args.deviation:
        deviation_table(args.steps or 500, args.threads)
        return
    args.steps = args.steps or 300
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here")
    if not cuda:
        torch.set_num_threads(1)
        print(f"one torch thread on both sides; {args.steps} steps per trial")
    else:
        print(f"{torch.cuda.get_device_name()}; {args.steps} steps per trial; bf16 autocast for charlm")
    print(f"{'task':10} {'K':>4} {'solo trials/h':>14} {'batched trials/h':>17} {'ratio':>6} "
          f"{'val_loss solo':>14} {'val_loss batched':>17} {'max deviation':>14} {'MFU':>6}")
    for name in args.tasks:
        task = load_task(TASKS[name]["task"], TASKS[name].get("task_args"))
        # Warm both paths first (lazy initialisation, first allocations, CUDA kernels), so that neither side's first
        # timed run pays for it: the solo side runs first and would otherwise be charged alone.
        warm = configs(name, 2, 6, args.device)
        train(warm[0], task)
        train_batched(warm, task, capacity=2)
        per_token = flops_per_token(name) if cuda and TASKS[name]["task"] == "charlm" else None
        for k in args.ks:
            cohort = configs(name, k, args.steps, args.device)
            timed = cohort[: args.solo_max or k]
            started = time.perf_counter()
            solo = [train(c, task) for c in timed]
            solo_s = (time.perf_counter() - started) * k / len(timed)  # as if all K had run one after another
            started = time.perf_counter()
            batched = train_batched(cohort, task, capacity=k)
            batched_s = time.perf_counter() - started
            loss = [sum(r.metrics["val_loss"] for r in rs) / len(rs) for rs in (solo, batched[: len(timed)])]
            mfu = "n/a"
            if per_token is not None:
                tokens = k * args.steps * TASKS[name]["batch_size"] * TASKS[name]["task_args"]["context"]
                mfu = f"{100 * tokens / batched_s * per_token / (args.peak_tflops * 1e12):5.1f}%"
            print(f"{name:10} {k:4d} {k * 3600 / solo_s:14.0f} {k * 3600 / batched_s:17.0f} "
                  f"{solo_s / batched_s:6.2f} {loss[0]:14.4f} {loss[1]:17.4f} {deviation(solo, batched):14.3g} "
                  f"{mfu:>6}", flush=True)


if __name__ == "__main__":
    main()
