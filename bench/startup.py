"""How long `sweep --help`, `sweep status` and `sweep trials` take to start, against an older checkout, side by side.

    git worktree add /tmp/old 0975efd      # any older revision
    cd studies && sweep run quickstart.yaml --n-trials 2 >/dev/null; cd ..
    python bench/startup.py --before /tmp/old --study studies/quickstart.yaml

Each command runs in a fresh interpreter, alternating old and new, five times; the table gives the medians. The old
code is put first on PYTHONPATH, so both run in this virtual environment.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a checkout of the older revision")
    parser.add_argument("--study", required=True, help="a study file whose database exists")
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    study = os.path.abspath(options.study)
    cases = {"--help": ["--help"], "status": ["status", study], "trials": ["trials", study]}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(options.repeats):
        for label, path in (("before", os.path.abspath(options.before)), ("after", ROOT)):
            # Run from inside the checkout, with it first on PYTHONPATH: `python -m` puts the working folder first
            # on sys.path, so run from this project's root the "before" run would import this code instead.
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": path}
            for name, args in cases.items():
                started = time.perf_counter()
                done = subprocess.run([sys.executable, "-m", "sweep.cli", *args], env=env, capture_output=True,
                                      cwd=path)
                if done.returncode != 0:
                    sys.exit(f"{label} `sweep {' '.join(args)}` failed: {done.stderr.decode()[-500:]}")
                times.setdefault((name, label), []).append(time.perf_counter() - started)
    print("| command | before | after | speed-up |\n|---|---|---|---|")
    for name in cases:
        before, after = statistics.median(times[name, "before"]), statistics.median(times[name, "after"])
        print(f"| sweep {name} | {before:.2f} s | {after:.2f} s | {before / after:.1f}x |")


if __name__ == "__main__":
    main()
