"""How does a study scale with worker processes, on SQLite and on PostgreSQL?

    python bench/scaling.py                      # 1, 2, 4, 8 workers on both backends; about 5 minutes
    python bench/scaling.py --workers 1 2 --trials 16

Each run is the real `sweep run STUDY --workers N` on short trials (the digits MLP, 100 steps, about 0.3 s each).
Throughput is measured from the storage's own timestamps, first trial start to last trial end, so process start-up
(importing torch in each worker) is left out. Report latency is the round trip of `trial.report` plus
`trial.should_prune` as each trial measured it (the `report_ms` user attr). A trial lost or failed by the storage is
any trial that is not COMPLETE. PostgreSQL runs on a private server on a unix socket started for the benchmark.
"""

from __future__ import annotations

import argparse
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
from tests.pg import postgres_available, postgres_server  # noqa: E402  (the same throwaway server the tests use)


def study_file(folder: Path, n_trials: int) -> Path:
    path = folder / "scaling.yaml"
    path.write_text(yaml.safe_dump({
        "name": "scaling", "n_trials": n_trials, "sampler": {"type": "random"}, "pruner": "none", "task": "digits",
        "fixed": {"max_steps": 100, "eval_every_steps": 10, "log_every_steps": 50, "batch_size": 32,
                  "model": {"hidden": 32}},
        "space": {"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}},
    }))
    return path


def run(folder: Path, storage: str, name: str, workers: int, n_trials: int) -> dict:
    path = study_file(folder, n_trials)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "sweep.cli", "run", str(path), "--storage", storage,
                           "--study-name", name, "--workers", str(workers)], capture_output=True, text=True)
    wall = time.perf_counter() - started
    trials = optuna.load_study(study_name=name, storage=storage).get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    begin = min(t.datetime_start for t in trials)
    end = max(t.datetime_complete for t in complete)
    latencies = sorted(ms for t in complete for ms in t.user_attrs.get("report_ms", []))
    return {
        "workers": workers,
        "trials_per_min": 60 * len(complete) / max((end - begin).total_seconds(), 1e-9),
        "p50": statistics.median(latencies),
        "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "lost": len(trials) - len(complete) + (n_trials - len(complete) if len(complete) < n_trials else 0),
        "locked": done.stderr.count("database is locked"),
        "exit": done.returncode,
        "wall": wall,
    }


def table(backend: str, rows: list[dict]) -> None:
    base = rows[0]["trials_per_min"]
    print(f"\n{backend}")
    print("| workers | trials/min | efficiency vs 1 | report p50 ms | report p99 ms | lost or failed | exit | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        efficiency = r["trials_per_min"] / (base * r["workers"])
        print(f"| {r['workers']} | {r['trials_per_min']:.0f} | {100 * efficiency:.0f}% | {r['p50']:.1f} | "
              f"{r['p99']:.1f} | {r['lost']} | {r['exit']} | {r['wall']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--trials", type=int, default=32)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = [run(folder, f"sqlite:///{folder / f'w{n}.db'}", "scaling", n, args.trials) for n in args.workers]
        table("SQLite (WAL, BEGIN IMMEDIATE, 60 s busy timeout)", rows)
        if postgres_available():
            with postgres_server() as url:
                rows = [run(folder, url, f"scaling-{n}", n, args.trials) for n in args.workers]
            table("PostgreSQL 15 (unix socket, same machine)", rows)
    print("\nThis machine has 2 cores: beyond 2 workers the trials compete for them, so trials/min flattens; "
          "the storage columns show whether the database, not the CPU, is the limit.")


if __name__ == "__main__":
    main()
