"""bench/decisions.py: its replay of ground-truth curves decides as sweep's real study loop and a plain Optuna
objective around the trainer do, its scores count what its columns say, and it runs to its targets."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import optuna
import pytest

from tests.conftest import ROOT

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_decisions", ROOT / "bench" / "decisions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


decisions = _load()


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["fastfail + median", "fastfail + leaders", "hyperband", "optuna median"])
def test_the_replay_decides_as_the_live_loops_do(arm: str, tmp_path: Path) -> None:
    """Real training on digits, 8 TPE trials x 40 steps: every trial's params, steps, state, value and prune rule
    are the same live (sweep's `run_study` on SQLite, or `study.optimize` around `trainer.train`) and replayed."""
    truth = decisions.GroundTruth(decisions.REAL_TASKS["digits"], 40)
    replayed = decisions.run_arm(truth.replay(), arm, 0, 8)
    live = decisions.run_live(truth.task, arm, 0, 8, 40, tmp_path)
    assert decisions.disagreements(live, replayed) == []
    assert len(live.outcomes) == 8
    assert any(o.pruned for o in live.outcomes), "nothing was pruned: the comparison would prove little"
    assert any(not o.pruned for o in live.outcomes)


def test_a_disagreement_is_reported() -> None:
    Outcome, ArmRun = decisions.Outcome, decisions.ArmRun
    live = ArmRun("digits", "median", 0, 40, [Outcome({"lr": 0.1}, 20, None, "median", pruned=True)])
    replayed = ArmRun("digits", "median", 0, 40, [Outcome({"lr": 0.1}, 40, 0.5, None)])
    assert len(decisions.disagreements(live, replayed)) == 1
    assert decisions.disagreements(live, live) == []


def test_the_score_counts_top_quarter_losses_by_rule_bad_trials_and_divergences() -> None:
    Outcome, ArmRun = decisions.Outcome, decisions.ArmRun

    def curve(final: float, diverge_at: int | None = None) -> list[tuple[int, float]]:
        values = [(s, 2.0 - (2.0 - final) * s / 100) for s in range(0, 101, 10)]
        return [(s, math.nan if diverge_at is not None and s >= diverge_at else v) for s, v in values]

    truths = [curve(0.1), curve(0.2), curve(0.5), curve(0.6), curve(0.7), curve(0.8), curve(1.99), curve(0.3, 40)]
    none = ArmRun("t", "none", 0, 100, [Outcome({"i": i}, 100, c[-1][1] if math.isfinite(c[-1][1]) else None, None,
                                                truth=c) for i, c in enumerate(truths)])
    arm = ArmRun("t", "fastfail + median", 0, 100, [
        Outcome({"i": 0}, 30, None, "plateau", pruned=True, truth=truths[0]),  # a top-quarter finisher, lost
        Outcome({"i": 1}, 100, 0.2, None, truth=truths[1]),
        *[Outcome({"i": i}, 20, None, "median", pruned=True, truth=truths[i]) for i in range(2, 6)],
        Outcome({"i": 6}, 10, None, "stuck", pruned=True, truth=truths[6]),  # a never-learner, at 10% of its budget
        Outcome({"i": 7}, 40, None, "nan", pruned=True, truth=truths[7]),  # stopped at the divergence
    ])
    score = decisions.Score()
    score.add(arm, none, none)
    assert score.steps == 30 + 100 + 4 * 20 + 10 + 40 and score.none_steps == 800
    assert score.top == 2 and dict(score.top_pruned) == {"plateau": 1} and score.fast_fail_top_pruned == 1
    assert score.gaps == [pytest.approx(100.0)]  # best 0.2 against none's 0.1
    assert score.never_share == [0.1] and sorted(score.bad_share) == [0.1, 0.4]
    assert score.after_onset == [0]


@pytest.mark.slow
def test_the_simulated_benchmark_runs_and_prints_its_tables_and_targets() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "decisions.py"), "--simulated-only", "--seeds", "1",
                             "--trials", "12"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    for title in ("two-phase (1 seeds x 12 trials)", "late-divergence", "pooled (two-phase, late-divergence)",
                  "Targets (pooled):"):
        assert title in result.stdout
    for arm in decisions.ARMS:
        assert f"| {arm} " in result.stdout
