"""Does warm start pay, and is its donor lookup fast?

    python bench/warmstart.py                    # both parts; about 3 minutes on 2 CPU cores
    python bench/warmstart.py --trials 24 --lookups 100 --checkpoints 2000   # quicker

1. Same study, same seeds, warm start off and on: the digits MLP, a random sampler (so both arms train exactly the
   same configurations in the same order: a paired comparison), no pruner. Reported: total training steps (what each
   trial trained itself; a warm trial starts at its donor's handoff step), the steps the warm study needed to reach
   the best value the cold study found, and each study's best value at equal compute (the smaller of the two totals).
2. Donor lookup latency (`sweep.warmstart.find_donor`: one indexed query plus the distance over what comes back)
   with N registered checkpoints of one shape (the worst case: the shape key filters nothing) in a 4-key space, on
   SQLite and on PostgreSQL (a private server on a unix socket). Target: median under 10 ms at N = 10,000.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from sweep.registry import Registry, checkpoints  # noqa: E402
from sweep.spec import parse_spec  # noqa: E402
from sweep.warmstart import categorical_key, coordinates, find_donor, shape_key  # noqa: E402
from tests.pg import postgres_available, postgres_server  # noqa: E402  (the same throwaway server the tests use)
from trainer import load_task  # noqa: E402

SPACE = {
    "learning_rate": {"type": "float", "low": 1e-3, "high": 3e-2, "log": True},
    "weight_decay": {"type": "float", "low": 0.0, "high": 0.1},
    "beta1": {"type": "float", "low": 0.8, "high": 0.95},
    "model.hidden": {"type": "categorical", "choices": [32, 64]},
}


def document(n_trials: int, warm: bool, max_distance: float) -> dict:
    return {"name": "bench", "n_trials": n_trials, "seed": 0, "sampler": {"type": "random"}, "pruner": "none",
            "task": "digits", "warm_start": {"enabled": warm, "max_distance": max_distance, "handoff": 0.5},
            "fixed": {"max_steps": 400, "eval_every_steps": 50, "log_every_steps": 50, "batch_size": 32},
            "space": SPACE}


def run_study(folder: Path, n_trials: int, warm: bool, max_distance: float) -> list[optuna.trial.FrozenTrial]:
    folder.mkdir()
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(document(n_trials, warm, max_distance)))
    subprocess.run([sys.executable, "-m", "sweep.cli", "run", str(path)], check=True, capture_output=True)
    study = optuna.load_study(study_name="bench", storage=f"sqlite:///{folder / 'bench.db'}")
    return sorted((t for t in study.get_trials() if t.state == TrialState.COMPLETE), key=lambda t: t.number)


def curve(trials: list[optuna.trial.FrozenTrial]) -> list[tuple[int, float]]:
    """(cumulative steps trained, best value so far) after each trial, in trial order."""
    spent, best, points = 0, float("inf"), []
    for trial in trials:
        spent += trial.user_attrs["steps_trained"]
        best = min(best, trial.value)
        points.append((spent, best))
    return points


def best_within(points: list[tuple[int, float]], budget: int) -> float:
    return min((best for spent, best in points if spent <= budget), default=float("nan"))


def paired(n_trials: int, max_distance: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        cold = run_study(Path(tmp) / "cold", n_trials, False, max_distance)
        cold_s = time.perf_counter() - started
        started = time.perf_counter()
        warm = run_study(Path(tmp) / "warm", n_trials, True, max_distance)
        warm_s = time.perf_counter() - started
    cold_curve, warm_curve = curve(cold), curve(warm)
    cold_total, warm_total = cold_curve[-1][0], warm_curve[-1][0]
    target = cold_curve[-1][1]
    reached = next((spent for spent, best in warm_curve if best <= target), None)
    equal = min(cold_total, warm_total)
    n_warm = sum("warm_start_from" in t.user_attrs for t in warm)
    print(f"\n## Warm start off vs on: {n_trials} trials, digits MLP, 400 steps each, random sampler (same configs), "
          f"handoff at 50%, max_distance {max_distance}\n")
    print("| study | warm trials | total steps | best | steps to reach the cold best | best at equal compute "
          f"({equal} steps) | wall s |")
    print("|---|---|---|---|---|---|---|")
    cold_reach = next(spent for spent, best in cold_curve if best <= target)
    print(f"| cold | 0 | {cold_total} | {target:.4f} | {cold_reach} | {best_within(cold_curve, equal):.4f} | "
          f"{cold_s:.1f} |")
    reach = "not reached" if reached is None else f"{reached} ({cold_reach / reached:.2f}x fewer)"
    print(f"| warm | {n_warm} | {warm_total} ({cold_total / warm_total:.2f}x fewer) | {warm_curve[-1][1]:.4f} | "
          f"{reach} | {best_within(warm_curve, equal):.4f} | {warm_s:.1f} |")


def lookup_latency(url: str, label: str, n_checkpoints: int, n_lookups: int) -> tuple[str, float, float]:
    spec = parse_spec(document(1, True, 0.3), "bench")
    digits = load_task("digits", {})
    rng = random.Random(0)

    def point() -> dict:
        return {"learning_rate": 10 ** rng.uniform(-3, -1.523), "weight_decay": rng.uniform(0, 0.1),
                "beta1": rng.uniform(0.8, 0.95), "model.hidden": 64}

    key = shape_key(spec.config_for(point()), digits)
    registry = Registry(url)
    with registry.engine.begin() as connection:  # bulk insert: the benchmark measures lookups, not inserts
        rows = []
        for i in range(n_checkpoints):
            params = point()
            coords = coordinates(spec.space, params)
            rows.append({"study": "bench", "trial_number": i // 4, "step": 50 * (1 + i % 4), "value": rng.random(),
                         "params": json.dumps(params), "shape_key": key, "uri": f"/x/{i}.pt",
                         "size": 1, "sha256": "0" * 64, "created_at": time.time(), "final": 1, "pinned": 0,
                         "cat_key": categorical_key(spec.space, params),
                         **{f"c{j}": (coords[j] if j < len(coords) else None) for j in range(4)}})
        connection.execute(checkpoints.insert(), rows)
    with registry.engine.connect() as connection:  # fresh statistics, as PostgreSQL's autovacuum would keep them
        connection.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("ANALYZE sweep_checkpoints")
    times, found = [], 0
    for _ in range(n_lookups):
        params = point()
        config = spec.config_for(params)
        started = time.perf_counter()
        donor = find_donor(registry, spec, "bench", params, config, key, 200)
        times.append(1000 * (time.perf_counter() - started))
        found += donor is not None
    times.sort()
    print(f"| {label} | {n_checkpoints} | {n_lookups} | {statistics.median(times):.2f} | "
          f"{times[int(0.99 * (len(times) - 1))]:.2f} | {found}/{n_lookups} |")
    registry.engine.dispose()
    return label, statistics.median(times), times[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--max-distance", type=float, default=0.3)
    parser.add_argument("--checkpoints", type=int, default=10_000)
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--skip-study", action="store_true")
    args = parser.parse_args()
    if not args.skip_study:
        paired(args.trials, args.max_distance)
    print("\n## Donor lookup latency (one shape, 4-key space, max_distance 0.3)\n")
    print("| storage | checkpoints | lookups | median ms | p99 ms | donor found |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        lookup_latency(f"sqlite:///{Path(tmp) / 'lookup.db'}", "SQLite", args.checkpoints, args.lookups)
    if postgres_available():
        with postgres_server() as url:
            lookup_latency(url, "PostgreSQL 15", args.checkpoints, args.lookups)
    else:
        print("| PostgreSQL | skipped: initdb/pg_ctl not on PATH | | | | |")


if __name__ == "__main__":
    main()
