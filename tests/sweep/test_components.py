"""`unexplored_point`: the open points of a bruteforce grid, as a cohort draws its members' and a worker checks that
the grid is not done."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import FloatDistribution, IntDistribution

from sweep.components import unexplored_point
from sweep.spec import parse_spec


def grid_spec(seed: int, lr_high: float = 0.3, warmup_high: int = 1) -> Any:
    return parse_spec({"name": "grid", "n_trials": 10, "sampler": "bruteforce", "task": "digits", "seed": seed,
                       "fixed": {"max_steps": 1000},
                       "space": {"learning_rate": {"type": "float", "low": 0.1, "high": lr_high, "step": 0.1},
                                 "warmup_steps": {"type": "int", "low": 0, "high": warmup_high}}},
                      Path("grid.yaml"))


def trained(learning_rate: float, warmup_steps: int) -> optuna.trial.FrozenTrial:
    return optuna.trial.create_trial(
        params={"learning_rate": learning_rate, "warmup_steps": warmup_steps},
        distributions={"learning_rate": FloatDistribution(0.1, 0.3, step=0.1),
                       "warmup_steps": IntDistribution(0, 1)}, value=1.0)


def test_the_point_drawn_is_open_and_each_open_point_comes_up() -> None:
    taken = [trained(0.1, 0), trained(0.2, 1)]  # 2 of 6 taken: drawn until an open one comes up
    drawn = {tuple(unexplored_point(grid_spec(seed), {}, taken).values()) for seed in range(60)}  # type: ignore[union-attr]
    assert drawn == {(0.1, 1), (0.2, 0), (0.3, 0), (0.3, 1)}


def test_the_last_open_point_is_found_and_a_full_grid_has_none() -> None:
    points = [(lr, w) for lr in (0.1, 0.2, 0.3) for w in (0, 1)]
    for left in points:  # 5 of 6 taken: every point listed
        taken = [trained(*p) for p in points if p != left]
        for seed in range(5):
            assert tuple(unexplored_point(grid_spec(seed), {}, taken).values()) == left  # type: ignore[union-attr]
    assert unexplored_point(grid_spec(0), {}, [trained(*p) for p in points]) is None
    # With a shape key fixed, only the points of those shapes count.
    assert unexplored_point(grid_spec(0), {"warmup_steps": 1}, [trained(0.1, 1), trained(0.2, 1)]) == \
        {"learning_rate": 0.3}


def test_a_point_of_a_large_grid_is_drawn_without_listing_the_grid() -> None:
    spec = grid_spec(0, lr_high=100.0, warmup_high=999)  # 1000 x 1000 points: too many to list
    point = unexplored_point(spec, {}, [])
    assert point is not None and 0 <= point["warmup_steps"] <= 999 and 0.1 <= point["learning_rate"] <= 100.0
