"""Cohorts against one trial at a time: the same study (digits, TPE, fast-fail then median), run with each cohort size
and each seed, side by side in one process. Prints, per cohort size (medians over the seeds, ratios to the first
size): wall time to spend the budget, trials per hour, the steps trained and the trials pruned (pruning decides how
many steps are trained), the best value and the trial that reached it per seed; then how sampling in cohorts changes
the search: the best value after the first N trials (by trial number, the order the sampler asked them in) per seed,
and whether each size's final best lies within the seed-to-seed spread of one trial at a time. Beside the wall time,
the process's CPU time and its ratio: on a machine others share, the wall-time ratio moves with their load from one
run to the next, the CPU-time ratio much less (it leaves out waiting, fsync's too).

    python bench/cohorts.py                                  # 64 trials x 300 steps, cohorts 1 8 32, seeds 0 1 2
    python bench/cohorts.py --trials 24 --steps 100 --cohorts 1 8 --seeds 0
    python bench/cohorts.py --ramp                           # execution.ramp: the pruner's startup trials first
    python bench/cohorts.py --hidden 512 --cohorts 1 16      # a model whose arithmetic dominates a step

Each run is a fresh SQLite study in a temporary folder, through the same worker loop `sweep run` uses. One thread
per process (`torch.set_num_threads(1)`), so the ratio is the engine's and the study's, not the thread pool's. A
short warm-up study (untimed) first pays the one-time costs (imports, the batched engine's first trace). Each seed runs
every size back to back, in an order rotated from seed to seed, so a load that drifts on a shared machine spreads
over the sizes.
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


def document(trials: int, steps: int, seed: int, cohort: int, task: str = "digits",
             model: tuple[int, int, int] = (384, 6, 6), context: int = 256, ramp: bool = False,
             hidden: int = 64) -> dict:
    if task == "charlm":  # studies/charlm.yaml's model and fixed settings, its space less the dropout choice
        d_model, n_layers, n_heads = model
        every = max(1, steps // 4)
        return {
            "name": f"cohorts-charlm-{cohort}-{seed}", "n_trials": trials, "seed": seed, "sampler": "tpe",
            "pruner": {"type": "fastfail", "then": "median"}, "execution": {"cohort": cohort, "ramp": ramp},
            "task": {"name": "charlm", "args": {"context": context, "max_chars": 1_000_000}},
            "fixed": {"max_steps": steps, "eval_every_steps": every, "log_every_steps": every, "batch_size": 64,
                      "eval_batch_size": 64, "gradient_clip_norm": 1.0, "optimizer": "adamw", "scheduler": "cosine",
                      "min_lr_ratio": 0.1, "model": {"d_model": d_model, "n_layers": n_layers, "n_heads": n_heads}},
            "space": {"learning_rate": {"type": "float", "low": 1e-4, "high": 3e-3, "log": True},
                      "warmup_steps": {"type": "int", "low": 0, "high": max(1, steps // 5)},
                      "weight_decay": {"type": "float", "low": 1e-3, "high": 0.3, "log": True},
                      "beta2": {"type": "categorical", "choices": [0.95, 0.99, 0.999]}},
        }
    return {
        "name": f"cohorts-{cohort}-{seed}", "n_trials": trials, "seed": seed, "sampler": "tpe",
        "pruner": {"type": "fastfail", "then": "median"}, "task": "digits",
        "execution": {"cohort": cohort, "ramp": ramp},
        "fixed": {"max_steps": steps, "eval_every_steps": max(1, steps // 10), "log_every_steps": max(1, steps // 10),
                  "batch_size": 64, "model": {"hidden": hidden}},
        "space": {"learning_rate": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
                  "weight_decay": {"type": "float", "low": 1e-6, "high": 1e-1, "log": True},
                  "warmup_steps": {"type": "int", "low": 0, "high": max(1, steps // 5)}},
    }


def run(trials: int, steps: int, seed: int, cohort: int, folder: Path, marks: list[int], **task: object) -> dict:
    spec = parse_spec(document(trials, steps, seed, cohort, **task), folder / "study.yaml")  # type: ignore[arg-type]
    url = f"sqlite:///{folder / f'{spec.name}.db'}"
    study = open_study(spec, url)
    started, cpu_started = time.perf_counter(), time.process_time()
    run_study(study, spec, storage_url=url)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    ended = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    done = [t for t in ended if t.state == TrialState.COMPLETE and t.value is not None]
    trained = sum(int(t.user_attrs.get("steps_trained", t.user_attrs.get("steps", 0)) or 0) for t in ended)
    best = min(done, key=lambda t: float(t.value)) if done else None  # type: ignore[arg-type]
    after = {n: min((float(t.value) for t in done if t.number < n), default=None) for n in marks}  # type: ignore[arg-type]
    return {"wall": wall, "cpu": cpu, "per_hour": 3600 * len(ended) / wall, "per_cpu_hour": 3600 * len(ended) / cpu,
            "steps": trained, "steps_per_s": trained / wall,
            "pruned": sum(t.state == TrialState.PRUNED for t in ended), "best": None if best is None else best.value,
            "best_at": None if best is None else best.number, "after": after}


def _value(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--cohorts", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--task", choices=["digits", "charlm"], default="digits",
                        help="charlm: studies/charlm.yaml's 10.8M-parameter transformer (the GPU figure of issue 17)")
    parser.add_argument("--charlm-model", type=int, nargs=3, default=[384, 6, 6],
                        metavar=("D_MODEL", "LAYERS", "HEADS"))
    parser.add_argument("--charlm-context", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64, help="digits: the MLP's width (512: a model whose "
                                                               "arithmetic, not the per-step overhead, sets the pace)")
    parser.add_argument("--ramp", action="store_true", help="execution.ramp: the first cohort holds only the median "
                                                            "pruner's startup trials")
    options = parser.parse_args()
    task = {"task": options.task, "model": tuple(options.charlm_model), "context": options.charlm_context,
            "ramp": options.ramp, "hidden": options.hidden}
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sizes: list[int] = options.cohorts
    marks = sorted({max(1, options.trials * q // 4) for q in (1, 2, 3, 4)})
    rows: dict[int, list[dict]] = {k: [] for k in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        for k in sorted({1, max(sizes)} | {min(2, max(sizes))}):  # untimed: imports, the engine's first trace
            folder = Path(tmp) / f"warm-{k}"
            folder.mkdir()
            run(min(4, options.trials), 10, 0, k, folder, marks, **task)
        for turn, seed in enumerate(options.seeds):
            order = sizes[turn % len(sizes):] + sizes[:turn % len(sizes)]
            for cohort in order:
                folder = Path(tmp) / f"{cohort}-{seed}"
                folder.mkdir()
                rows[cohort].append(run(options.trials, options.steps, seed, cohort, folder, marks, **task))
    base = statistics.median(r["per_hour"] for r in rows[sizes[0]])
    cpu_base = statistics.median(r["per_cpu_hour"] for r in rows[sizes[0]])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"{options.task} on {device}, {options.trials} trials x {options.steps} steps, TPE, fast-fail then median, "
          f"seeds {options.seeds}, 1 thread{', ramp' if options.ramp else ''}; medians over the seeds")
    print(f"{'cohort':>6} {'wall s':>8} {'trials/h':>9} {'vs ' + str(sizes[0]):>6} {'steps':>7} {'steps/s':>8} "
          f"{'pruned':>6} {'cpu s':>6} {'vs ' + str(sizes[0]) + ' cpu':>9}  best per seed (at trial)")
    for cohort, results in rows.items():
        wall = statistics.median(r["wall"] for r in results)
        per_hour = statistics.median(r["per_hour"] for r in results)
        steps = statistics.median(r["steps"] for r in results)
        rate = statistics.median(r["steps_per_s"] for r in results)
        pruned = statistics.median(r["pruned"] for r in results)
        cpu = statistics.median(r["cpu"] for r in results)
        per_cpu_hour = statistics.median(r["per_cpu_hour"] for r in results)
        bests = ", ".join(f"{_value(r['best'])} (#{r['best_at']})" for r in results)
        print(f"{cohort:>6} {wall:>8.1f} {per_hour:>9.0f} {per_hour / base:>5.2f}x {steps:>7.0f} {rate:>8.0f} "
              f"{pruned:>6.0f} {cpu:>6.1f} {per_cpu_hour / cpu_base:>8.2f}x  {bests}")
    reference = [r["best"] for r in rows[sizes[0]] if r["best"] is not None]
    low, high = (min(reference), max(reference)) if reference else (None, None)
    print(f"\nbest value after the first N trials, per seed; spread of cohort {sizes[0]}'s final best over the seeds: "
          f"{_value(low)} .. {_value(high)}")
    print(f"{'cohort':>6} " + " ".join(f"{'N=' + str(n):>24}" for n in marks) + "  final best (median) vs the spread")
    for cohort, results in rows.items():
        cells = [", ".join(_value(r["after"][n]) for r in results) for n in marks]
        finals = [r["best"] for r in results if r["best"] is not None]
        median = statistics.median(finals) if finals else None
        slack = 1e-4 * max(abs(low or 0.0), abs(high or 0.0))  # as printed: a last-digit difference is "within"
        verdict = ("-" if median is None or low is None or high is None else
                   "within" if low - slack <= median <= high + slack else "better" if median < low else "worse")
        print(f"{cohort:>6} " + " ".join(f"{c:>24}" for c in cells) + f"  {_value(median)} {verdict}")


if __name__ == "__main__":
    main()
