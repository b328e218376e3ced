"""What one `client.report` costs a command's training loop, and what part of it is the client's own.

    python bench/client_overhead.py [--reports 2000] [--folder /tmp/client-bench]

A script that only reports (no training) runs as the one trial of a `command` study, three ways:
- `alone`: the script run by hand, outside a study (`report` returns at once);
- `memory`: in a study on Optuna's in-memory storage, so the worker's side is the study's report and pruner alone;
- `sqlite`: in a study on a SQLite file (the default storage).
The script times each `report` call itself; the worker stores its own storage round trips on the trial
(`report_ms`). The client's own overhead (JSON, the socket round trip, the worker's reading) is the report's time
minus that storage time. Medians and 95th percentiles in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import optuna

SCRIPT = '''
import json
import sys
import time

from sweep import client

times = []
for step in range(1, {reports} + 1):
    started = time.perf_counter()
    client.report(step, val_loss=1.0 / step)
    times.append(time.perf_counter() - started)
print(json.dumps({{"times": times, "val_loss": 0.0}}))
'''


def quantile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def timings(log: str) -> list[float]:
    for line in reversed(log.splitlines()):
        if line.startswith('{"times"'):
            return [t * 1e6 for t in json.loads(line)["times"]]
    raise SystemExit(f"no timings in the script's output: {log[-500:]}")


def in_study(folder: Path, storage: str | None, reports: int) -> tuple[list[float], list[float]]:
    from sweep.schema import validate_document
    from sweep.study import open_study, run_study

    spec = validate_document({"name": f"bench-{storage is not None}", "n_trials": 1, "pruner": "none",
                              "command": f"{sys.executable} {folder / 'report.py'}"}, "bench")
    study = open_study(spec, storage or optuna.storages.InMemoryStorage())
    run_study(study, spec, storage_url=storage)
    trial = study.get_trials()[-1]
    assert trial.state.name == "COMPLETE", trial.user_attrs.get("fail_reason")
    return timings(Path(trial.user_attrs["log"]).read_text()), [ms * 1000 for ms in trial.user_attrs["report_ms"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reports", type=int, default=2000)
    parser.add_argument("--folder", type=Path, default=None)
    options = parser.parse_args()
    folder = options.folder or Path(tempfile.mkdtemp(prefix="client-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.py").write_text(SCRIPT.format(reports=options.reports))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEP_")}
    alone = subprocess.run([sys.executable, str(folder / "report.py")], capture_output=True, text=True, env=env,
                           check=True)
    rows: dict[str, tuple[list[float], list[float]]] = {"alone": (timings(alone.stdout), [])}
    rows["memory"] = in_study(folder, None, options.reports)
    (folder / "bench.db").unlink(missing_ok=True)
    rows["sqlite"] = in_study(folder, f"sqlite:///{folder / 'bench.db'}", options.reports)
    print(f"{options.reports} reports per run; microseconds per report\n")
    print("| storage | report (median) | report (p95) | of which storage (median) | client's own (median) |")
    print("|---|---|---|---|---|")
    for name, (client, storage) in rows.items():
        median = statistics.median(client)
        stored: Any = statistics.median(storage) if storage else 0.0
        print(f"| {name} | {median:.0f} | {quantile(client, 0.95):.0f} | {stored:.0f} | {median - stored:.0f} |")


if __name__ == "__main__":
    main()
