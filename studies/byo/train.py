"""An existing training script, swept as it is: `command: python studies/byo/train.py --lr {learning_rate} ...`
(studies/command.yaml). It reads its arguments as before; the two lines that involve sweep are the import and
`client.report`, which does nothing when the script runs alone."""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from sweep import client
from trainer.tasks.digits import digits

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--eval-every", type=int, default=50)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
task = digits()
(x, y), (val_x, val_y) = task.train, task.val
model = task.build_model({**task.model_defaults, "hidden": args.hidden})
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
for step in range(1, args.steps + 1):
    index = torch.randint(len(x), (64,))
    loss = F.cross_entropy(model(x[index]), y[index])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if step % args.eval_every == 0:
        with torch.no_grad():
            val_loss = F.cross_entropy(model(val_x), val_y).item()
        print(json.dumps({"step": step, "val_loss": val_loss}), flush=True)
        if client.report(step, val_loss=val_loss):
            break  # pruned: the worker has what it needs
