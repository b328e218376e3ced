"""What does the trainer cost over a minimal hand-written PyTorch loop?

    python bench/overhead.py            # digits and a tiny charlm on the CPU, studies/charlm.yaml's model on CUDA
    python bench/overhead.py --quick    # a smoke run: fewer steps and repeats

What is compared. `trainer.loop.train` against `hand_loop` below, a nanoGPT-style loop written for this comparison.
Both do the same work, step for step, and the script checks that they do by comparing their losses (bit for bit on
a CPU):
- the task's model, built after `torch.manual_seed(seed)`; the training set moved to the device once and batched
  there, in the same seeded per-epoch order (`trainer.data.permutation`), dropping each epoch's partial batch;
- AdamW with the trainer's parameter groups (weight decay on matrices only), fused on CUDA; the cosine schedule set
  before every step; gradient clipping where the config has it, else the gradient norm computed at log steps only;
- the same precision: fp32 on a CPU, bf16 autocast (and TF32 matmuls) on CUDA;
- the mean training loss and the gradient norm read back from the device at the same log steps, one evaluation of
  the whole validation set at the last step, no checkpoints. The trainer's fast-fail is off (the hand loop has none),
  except in the row that says so: there it is on, as in a study, and the ratio is what its guard costs.

What is timed. Steps per second in the steady state: from the first log step to the last, measured from outside by
the wall clock at each log call (the trainer's through its `Reporter.log`), so warm-up (first allocations, lazy
initialisation) and the final evaluation are left out of both. Runs alternate (ours, hand, hand, ours, ...) so that
drifting noise hits both sides alike; each side's median over the repeats is reported, and the ratio is the trainer's
time per step over the hand loop's (target <= 1.05). Imports torch and trainer only.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainer import Task, TrainingConfig, load_task, train
from trainer.data import permutation
from trainer.precision import resolve_device


@dataclass
class Case:
    name: str
    device: str
    task: str
    task_args: dict
    config: dict  # TrainingConfig values on top of the common ones
    steps: int
    log_every: int
    repeats: int
    fast_fail: bool = False  # the trainer's default in a study; the hand loop has nothing like it


def cases(quick: bool) -> list[Case]:
    """Log intervals divide the step counts, so both sides log at the same steps."""
    found = [
        Case("digits MLP (64x2), batch 64", "cpu", "digits", {}, {"batch_size": 64},
             steps=500 if quick else 2000, log_every=50 if quick else 250, repeats=3 if quick else 9),
        Case("digits MLP (64x2), batch 64, trainer with fast-fail on", "cpu", "digits", {}, {"batch_size": 64},
             steps=500 if quick else 2000, log_every=50 if quick else 250, repeats=3 if quick else 9,
             fast_fail=True),
        Case("tiny charlm (d=64, 2 layers, context 64), batch 16", "cpu", "charlm",
             {"context": 64, "max_chars": 300_000},
             {"batch_size": 16, "model": {"d_model": 64, "n_layers": 2, "n_heads": 4}},
             steps=60 if quick else 240, log_every=10 if quick else 40, repeats=3 if quick else 7),
    ]
    if torch.cuda.is_available():
        # studies/charlm.yaml's fixed values: the GPU showcase model (10.8M parameters).
        found.append(Case("charlm (d=384, 6 layers, context 256), batch 64, bf16", "cuda", "charlm",
                          {"context": 256, "max_chars": 4_000_000},
                          {"batch_size": 64, "gradient_clip_norm": 1.0, "min_lr_ratio": 0.1,
                           "model": {"d_model": 384, "n_layers": 6, "n_heads": 6}},
                          steps=100 if quick else 400, log_every=25 if quick else 50, repeats=2 if quick else 5))
    return found


def make_config(case: Case) -> TrainingConfig:
    return TrainingConfig.from_dict({
        "task": case.task, "task_args": case.task_args, "device": case.device, "max_steps": case.steps,
        "log_every_steps": case.log_every, "eval_every_steps": case.steps, "eval_batch_size": 256,
        "learning_rate": 1e-3, "warmup_steps": 0, "optimizer": "adamw", "scheduler": "cosine",
        "fast_fail": {"enabled": case.fast_fail}, "seed": 0, **case.config})


def cosine(step: int, config: TrainingConfig) -> float:
    floor = config.learning_rate * config.min_lr_ratio
    return floor + (config.learning_rate - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / config.max_steps)))


def hand_loop(config: TrainingConfig, task: Task, on_log: Callable[[int, float, float], None]) -> float:
    """A minimal loop doing the trainer's work (see the module docstring). Returns the final validation loss."""
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    model = task.build_model(task.model_config(config.model)).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.beta1, config.resolved_beta2),
                                  eps=config.eps, fused=device.type == "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else None
    x_all, y_all = (t.to(device) for t in task.train)
    n, b = len(x_all), config.batch_size
    epoch, cursor, perm = 0, 0, permutation(n, config.seed, 0, device)
    loss_sum = torch.zeros((), device=device)
    model.train()
    for step in range(config.max_steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine(step, config)
        if cursor + b > n:
            epoch, cursor = epoch + 1, 0
            perm = permutation(n, config.seed, epoch, device)
        idx = perm[cursor : cursor + b]
        cursor += b
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            out = model(x_all[idx])
        loss = task.loss(out.float(), y_all[idx])
        loss.backward()
        log_now = (step + 1) % config.log_every_steps == 0
        norm = None
        if config.gradient_clip_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.gradient_clip_norm)
        elif log_now:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        if log_now:
            mean_loss, grad_norm = torch.stack([loss_sum / config.log_every_steps, norm]).tolist()
            loss_sum.zero_()
            on_log(step + 1, mean_loss, grad_norm)
    model.eval()
    vx, vy = (t.to(device) for t in task.val)
    total = torch.zeros((), device=device)
    with torch.inference_mode():
        for start in range(0, len(vx), config.eval_batch_size):
            x, y = vx[start : start + config.eval_batch_size], vy[start : start + config.eval_batch_size]
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                out = model(x)
            total += task.loss(out.float(), y) * len(x)
    return total.item() / len(vx)


class Clock:
    """Wall-clock time and training loss at each log step, as the driver sees them."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.times: list[float] = []
        self.losses: list[float] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.tick(step, metrics["train_loss"], 0.0)

    def tick(self, step: int, loss: float, grad_norm: float) -> None:
        self.times.append(time.perf_counter())
        self.steps.append(step)
        self.losses.append(loss)

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        return False

    def steps_per_s(self) -> float:
        """Steady state: from the first log step to the last."""
        return (self.steps[-1] - self.steps[0]) / (self.times[-1] - self.times[0])


def run_ours(config: TrainingConfig, task: Task) -> Clock:
    clock = Clock()
    train(config, task, clock)
    return clock


def run_hand(config: TrainingConfig, task: Task) -> Clock:
    clock = Clock()
    hand_loop(config, task, clock.tick)
    return clock


def measure(case: Case) -> dict:
    config = make_config(case)
    try:
        task = load_task(case.task, case.task_args)
    except FileNotFoundError as exc:  # digits reads its data from scikit-learn's package
        return {"case": case.name, "device": case.device, "skipped": str(exc)}
    run_ours(config, task), run_hand(config, task)  # warm both once: caches, lazy initialisation, the allocator
    ours, hand = [], []
    for repeat in range(case.repeats):
        order = (run_ours, run_hand) if repeat % 2 == 0 else (run_hand, run_ours)
        for runner in order:
            clock = runner(config, task)
            (ours if runner is run_ours else hand).append(clock)
    ours_rate = statistics.median(c.steps_per_s() for c in ours)
    hand_rate = statistics.median(c.steps_per_s() for c in hand)
    a, b = ours[0].losses, hand[0].losses
    assert ours[0].steps == hand[0].steps, (ours[0].steps, hand[0].steps)
    drift = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
    return {"case": case.name, "device": case.device, "steps": case.steps, "repeats": case.repeats,
            "ours_steps_per_s": ours_rate, "hand_steps_per_s": hand_rate, "ratio": hand_rate / ours_rate,
            "losses_identical": a == b, "loss_max_rel_diff": drift}


def machine() -> str:
    parts = [f"{platform.machine()}, {torch.get_num_threads()} threads", f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        parts.insert(0, torch.cuda.get_device_name())
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer steps and repeats")
    parser.add_argument("--only", choices=["cpu", "cuda"], help="run only the cases on this device")
    args = parser.parse_args()
    rows = [measure(case) for case in cases(args.quick) if args.only in (None, case.device)]
    print(f"\nMachine: {machine()}\n")
    print("| case | device | steps | ours (steps/s) | hand-written (steps/s) | ratio (ours/hand time) | same losses |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['case']} | {r['device']} | skipped: {r['skipped']} | | | | |")
            continue
        same = "bit for bit" if r["losses_identical"] else f"max rel. diff {r['loss_max_rel_diff']:.1e}"
        print(f"| {r['case']} | {r['device']} | {r['steps']} x {r['repeats']} | {r['ours_steps_per_s']:.1f} | "
              f"{r['hand_steps_per_s']:.1f} | {r['ratio']:.3f} | {same} |")


if __name__ == "__main__":
    main()
