"""What a pruner's read of the study's finished trials costs a worker at each evaluation, against the number of
trials other workers have running: through Optuna's cache (which loads every running trial in full, to learn which
have finished) and through `PatientStorage` (the ids of the finished trials, then only the ones not read before).
Both read the same SQLite study side by side in one run; each running trial has reported `--reports` values and
carries a curve attr, as a sweep trial does mid-run.

    python bench/finished_reads.py                      # 1, 8, 32 running trials, 200 finished
    python bench/finished_reads.py --running 1 64 --finished 1000
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

from sweep.storage import Boundary, PatientStorage, make_storage

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def per_read_ms(read: object, repeats: int) -> float:
    best = float("inf")
    for _ in range(3):  # the best of three rounds: the least disturbed by others on a shared machine
        started = time.perf_counter()
        for _ in range(repeats):
            read()  # type: ignore[operator]
        best = min(best, (time.perf_counter() - started) / repeats)
    return 1000 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--finished", type=int, default=200)
    parser.add_argument("--reports", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=50)
    options = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print(f"SQLite, {options.finished} finished trials, each running one with {options.reports} reports; "
          f"ms per read of the finished trials (best of 3 x {options.repeats})")
    print(f"{'running':>7} {'Optuna cache':>13} {'sweep':>7} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for running in options.running:
            url = f"sqlite:///{Path(tmp) / f'{running}.db'}"
            writer = optuna.create_study(study_name="s", storage=make_storage(url))
            for _ in range(options.finished):
                writer.tell(writer.ask(), 1.0)
            for _ in range(running):
                trial = writer.ask()
                for step in range(options.reports):
                    trial.report(float(step), step)
                trial.set_user_attr("curve", [[step, 1.0] for step in range(options.reports)])
            ours = PatientStorage(make_storage(url), Boundary(60))
            cached = optuna.storages._CachedStorage(make_storage(url))  # what Optuna wraps an RDB in
            study_id = ours.get_study_id_from_name("s")
            assert [t.number for t in ours.get_all_trials(study_id, deepcopy=False, states=FINISHED)] == \
                [t.number for t in cached.get_all_trials(study_id, deepcopy=False, states=FINISHED)]
            optuna_ms, sweep_ms = (per_read_ms(functools.partial(storage.get_all_trials, study_id, deepcopy=False,
                                                                 states=FINISHED), options.repeats)
                                   for storage in (cached, ours))
            print(f"{running:>7} {optuna_ms:>13.2f} {sweep_ms:>7.2f} {optuna_ms / sweep_ms:>5.1f}x")


if __name__ == "__main__":
    main()
