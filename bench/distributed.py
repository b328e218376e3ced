"""What does a data-parallel trial cost per evaluation, and how far do its reported values stray from one rank's?

    python bench/distributed.py                  # 2 gloo ranks on the CPU
    python bench/distributed.py --quick          # a smoke run: fewer evaluations and steps
    python bench/distributed.py --device cuda    # 2 NCCL ranks, one GPU each (needs 2 GPUs)

1. The decision collective. With several ranks, every evaluation ends with one broadcast of rank 0's verdict
   (`trainer.distributed.ProcessGroup.verdict`): that is all a data-parallel trial adds to an evaluation. Two ranks
   (spawned here) evaluate the same model on the whole validation set, alternating an evaluation alone and an
   evaluation followed by the broadcast, `--evals` times each; the medians per evaluation are printed side by side,
   with the difference (the collective's cost) and the ratio. The guard's check (an all-reduce MAX, per fast-fail
   check interval) and the logged loss's all-reduce (per log step) are the same size and timed the same way.
2. The deviation. The same config trained on 1 rank and on 2 (this process as rank 0, a `python -m trainer.rank`
   child as rank 1: the sweep's own path); the largest relative difference of every reported value (each evaluation's
   val_loss and val_accuracy) and of every logged train_loss. Only the gradient all-reduce's order of summation
   differs, so the values agree to float rounding.
Imports torch and trainer only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainer import TrainingConfig, load_task, train
from trainer.distributed import ProcessGroup, free_port, local_ranks
from trainer.evaluate import evaluate
from trainer.loop import NullReporter, build_run

CONFIG: dict[str, Any] = {"task": "digits", "max_steps": 200, "eval_every_steps": 20, "log_every_steps": 20,
                          "batch_size": 64, "learning_rate": 0.02, "model": {"hidden": 64}}


def _overhead_rank(rank: int, port: int, device: str, evals: int, out: Any) -> None:
    torch.set_num_threads(1)  # two ranks share the cores: one thread each, no oversubscription
    group = ProcessGroup.join(rank, 2, init_method=f"tcp://127.0.0.1:{port}", device_type=device, timeout_s=120)
    config = TrainingConfig.from_dict({**CONFIG, "device": device})
    run = build_run(config, load_task("digits"), group)

    def evaluation() -> None:
        evaluate(run.model, run.task, run.val, config.eval_batch_size, run.precision)

    alone, with_verdict, verdict, agree, mean = [], [], [], [], []
    loss = torch.ones((), device=run.device)
    for _ in range(3):  # warm-up: first allocations, the group's first messages
        evaluation()
        group.verdict(False)
    for _ in range(evals):
        started = time.perf_counter()
        evaluation()
        alone.append(time.perf_counter() - started)
        started = time.perf_counter()
        evaluation()
        middle = time.perf_counter()
        group.verdict(False)
        with_verdict.append(time.perf_counter() - started)
        verdict.append(time.perf_counter() - middle)
        started = time.perf_counter()
        group.agree(False)
        agree.append(time.perf_counter() - started)
        started = time.perf_counter()
        group.mean(loss).item()
        mean.append(time.perf_counter() - started)
    if rank == 0:
        out.put({name: 1000 * statistics.median(values) for name, values in
                 (("eval_ms", alone), ("eval_verdict_ms", with_verdict), ("verdict_ms", verdict),
                  ("agree_ms", agree), ("mean_ms", mean))})
    group.finish()


def overhead(device: str, evals: int) -> dict[str, float]:
    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    port = free_port()
    ranks = [context.Process(target=_overhead_rank, args=(rank, port, device, evals, out)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
        if process.exitcode != 0:
            raise SystemExit(f"a rank of the overhead part exited with code {process.exitcode}")
    result: dict[str, float] = out.get()
    return result


def deviation(device: str, steps: int) -> dict[str, float]:
    config = TrainingConfig.from_dict({**CONFIG, "max_steps": steps, "device": device})
    one = train(config, reporter=NullReporter())
    with local_ranks(config, 2, timeout_s=300) as ranks:
        two = train(config, reporter=NullReporter(), ranks=ranks.group)

    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1e-12)

    evals = [rel(a[key], b[key]) for (_, a), (_, b) in zip(two.evals, one.evals) for key in b]
    logs = [rel(a["train_loss"], b["train_loss"]) for a, b in zip(two.logs, one.logs)]
    return {"evaluations": len(one.evals), "max_rel_eval": max(evals), "max_rel_train_loss": max(logs),
            "bitwise_equal_evals": sum(e == 0.0 for e in evals), "values": len(evals),
            "one_rank_s": one.wall_time_s, "two_ranks_s": two.wall_time_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="fewer evaluations and steps: a smoke run")
    parser.add_argument("--evals", type=int, default=None, help="evaluations timed per side (default 200; quick 20)")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs 2 GPUs, found " + str(torch.cuda.device_count()))
    evals = args.evals or (20 if args.quick else 200)
    steps = 40 if args.quick else 200
    backend = "nccl" if args.device == "cuda" else "gloo"
    samples = len(load_task('digits').val[0])
    print(f"torch {torch.__version__}, 2 ranks, {backend}, digits (hidden 64, eval set {samples} "
          "samples)")

    cost = overhead(args.device, evals)
    print(f"\n1. per evaluation, median of {evals} (ms)")
    print(f"{'evaluation alone':>28} {'evaluation + verdict':>22} {'verdict (broadcast)':>20} {'ratio':>7}")
    print(f"{cost['eval_ms']:>28.3f} {cost['eval_verdict_ms']:>22.3f} {cost['verdict_ms']:>20.3f} "
          f"{cost['eval_verdict_ms'] / cost['eval_ms']:>7.3f}")
    print(f"   same-size collectives: guard agree (all-reduce MAX) {cost['agree_ms']:.3f} ms per check, "
          f"logged-loss mean (all-reduce SUM) {cost['mean_ms']:.3f} ms per log step")

    dev = deviation(args.device, steps)
    print(f"\n2. 1 rank vs 2 ranks, {steps} steps, {dev['evaluations']} evaluations")
    print(f"   largest relative deviation: reported values {dev['max_rel_eval']:.2e} "
          f"({dev['bitwise_equal_evals']} of {dev['values']} bit for bit), logged train_loss "
          f"{dev['max_rel_train_loss']:.2e}")
    print(f"   wall time: 1 rank {dev['one_rank_s']:.2f} s, 2 ranks {dev['two_ranks_s']:.2f} s (a child's start "
          "included; tiny model: communication, not compute)")


if __name__ == "__main__":
    main()
