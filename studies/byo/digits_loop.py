"""An existing PyTorch training loop, swept as it is: `loop: byo.digits_loop:main` (studies/loop.yaml).

What it took to make a plain loop sweepable: take `config` (the study's fixed and sampled values) instead of argparse,
call `run.report` at each evaluation (and return when it says stop), and `run.save` / `run.load` for checkpoints. The
data and the model here are the digits task's, so that this loop and the built-in trainer can be compared on the
same problem (bench/loop_vs_task.py); in your project they are your own.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from trainer.tasks.digits import digits


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        logits = model(x)
    model.train()
    return F.cross_entropy(logits, y).item(), (logits.argmax(-1) == y).float().mean().item()


def main(config: dict[str, Any], run: Any) -> None:
    run.seed_everything()
    task = digits()
    x, y = (t.to(run.device) for t in task.train)
    val_x, val_y = (t.to(run.device) for t in task.val)
    model = task.build_model({**task.model_defaults, **config["model"]}).to(run.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["learning_rate"],
                                  weight_decay=config["weight_decay"])
    max_steps, warmup = config["max_steps"], config["warmup_steps"]

    def lr_factor(step: int) -> float:
        # 1) linear warmup, 2) cosine decay to zero at max_steps
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, max_steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    batches = torch.Generator().manual_seed(run.seed)  # the data order travels in the checkpoint: exact resume
    step = 0
    state = run.load()  # a retry's own last save, or a warm start's donor (then only the weights are taken)
    if state is not None:
        model.load_state_dict(state["model"])
        if run.start == "resume":
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            batches.set_state(state["batches"])
            step = state["step"]
    while step < max_steps:
        step += 1
        index = torch.randint(len(x), (config["batch_size"],), generator=batches).to(run.device)
        loss = F.cross_entropy(model(x[index]), y[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % config["eval_every_steps"] and step != max_steps:
            continue
        val_loss, accuracy = evaluate(model, val_x, val_y)
        run.log(step, {"train_loss": loss.item(), "lr": schedule.get_last_lr()[0]})
        stop = run.report(step, {"val_loss": val_loss, "val_accuracy": accuracy})
        run.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "schedule": schedule.state_dict(), "batches": batches.get_state(), "step": step})
        if stop:
            return
