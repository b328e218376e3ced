"""Curricula: schedule shapes, the sampler's guarantee (never above the level), exact resume, difficulty scores of the
built-in tasks, config validation, and fast-fail's fairness at stage changes (through `judge` and through the Optuna
pruner's public API)."""

from __future__ import annotations

import math
import textwrap
from itertools import pairwise
from pathlib import Path

import numpy as np
import optuna
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sweep.pruners import FastFailPruner
from tests.sweep.test_pruners import pruned_step as pruner_pruned_step
from tests.trainer.test_loop import SyncCounter
from trainer import ConfigError, TrainingConfig, load_task, train
from trainer.curriculum import CurriculumConfig, CurriculumSampler, difficulty_ranks, level_at, stage_starts
from trainer.data import DeviceBatches
from trainer.fast_fail import FastFailConfig, LossGuard, judge
from trainer.tasks.blobs import make_blobs
from trainer.tasks.charlm import unigram_surprisal

CPU = torch.device("cpu")
NAN = math.nan
optuna.logging.set_verbosity(optuna.logging.WARNING)


def curriculum(**values) -> CurriculumConfig:
    return TrainingConfig.from_dict({f"curriculum.{k}": v for k, v in values.items()}).curriculum


# ---------------------------------------------------------------------------------------------------------------------
# Schedules.

@pytest.mark.parametrize("schedule", ["linear", "exponential", "step"])
@pytest.mark.parametrize("start", [0.1, 0.5])
def test_rising_schedules_go_from_the_start_level_to_1_at_the_end_step_and_never_fall(schedule: str,
                                                                                     start: float) -> None:
    config = curriculum(schedule=schedule, start_level=start, end_fraction=0.5, stages=3)
    levels = [level_at(s, config, 1000) for s in range(1000)]
    assert levels[0] == pytest.approx(start)
    assert levels[499] < 1.0 and levels[500] == pytest.approx(1.0) and levels[999] == pytest.approx(1.0)
    assert all(b >= a for a, b in pairwise(levels))
    assert all(0.0 <= level <= 1.0 for level in levels)


def test_each_rising_schedule_has_its_own_shape_between_the_end_points() -> None:
    linear, exponential, step = (curriculum(schedule=name, start_level=0.25, end_steps=100, stages=3)
                                 for name in ("linear", "exponential", "step"))
    assert level_at(50, linear, 1000) == pytest.approx(0.625)  # halfway between 0.25 and 1
    assert level_at(50, exponential, 1000) == pytest.approx(0.5)  # the geometric mean: slow first, fast last
    assert {level_at(s, step, 1000) for s in range(1000)} == {0.25, 0.625, 1.0}  # exactly `stages` levels
    assert level_at(49, step, 1000) == 0.25 and level_at(50, step, 1000) == 0.625


def test_none_and_constant_do_not_move() -> None:
    none, constant = curriculum(schedule="none"), curriculum(schedule="constant", level=0.3)
    assert {level_at(s, none, 50) for s in range(50)} == {1.0}
    assert {level_at(s, constant, 50) for s in range(50)} == {0.3}
    assert stage_starts(none, 50) == () and stage_starts(constant, 50) == ()


def test_stage_changes_are_the_steps_where_the_level_jumps() -> None:
    assert stage_starts(curriculum(schedule="step", stages=4, end_fraction=0.75), 1000) == (250, 500, 750)
    # Smooth schedules add a little data every step: no sudden change of what the run sees.
    assert stage_starts(curriculum(schedule="linear", start_level=0.0), 1000) == ()
    assert stage_starts(curriculum(schedule="exponential", start_level=0.01), 1000) == ()


def test_a_user_schedule_by_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_schedules.py").write_text(textwrap.dedent("""
        def halfway(step, max_steps):
            return 0.3 if step < max_steps // 2 else 1.0

        def broken(step, max_steps):
            return 1.5
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = curriculum(schedule="my_schedules:halfway")
    assert [level_at(s, config, 10) for s in (0, 4, 5, 9)] == [0.3, 0.3, 1.0, 1.0]
    assert stage_starts(config, 10) == (5,)
    with pytest.raises(ValueError, match=r"returned 1.5 at step 0; a level must be in \[0, 1\]"):
        level_at(0, curriculum(schedule="my_schedules:broken"), 10)


@pytest.mark.parametrize(
    ("values", "key", "fragment"),
    [
        ({"curriculum.schedule": "cubic"}, "curriculum.schedule", "linear, exponential, step"),
        ({"curriculum.schedule": "no_such_module:f"}, "curriculum.schedule", "cannot import"),
        ({"curriculum.schedule": "math:nothing"}, "curriculum.schedule", "no function 'nothing'"),
        ({"curriculum.start_level": 1.5}, "curriculum.start_level", "[0, 1]"),
        ({"curriculum.level": -0.1}, "curriculum.level", "[0, 1]"),
        ({"curriculum.tolerance": 2}, "curriculum.tolerance", "[0, 1]"),
        ({"curriculum.end_fraction": 0}, "curriculum.end_fraction", "(0, 1]"),
        ({"curriculum.end_steps": 0}, "curriculum.end_steps", ">= 1"),
        ({"curriculum.stages": 1}, "curriculum.stages", "at least 2"),
        ({"curriculum.stages": 2.5}, "curriculum.stages", "expected an integer"),
        ({"curriculum.schedule": "exponential", "curriculum.start_level": 0}, "curriculum.start_level", "> 0"),
        ({"curriculum.end_steps": 2000, "max_steps": 1000}, "curriculum.end_steps", "at most max_steps (1000)"),
        ({"curriculum.speed": 2}, "curriculum.speed", "unknown key"),
        ({"curriculum": "linear"}, "curriculum", "expected a mapping"),
    ],
)
def test_bad_curriculum_values_name_the_key(values: dict, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainingConfig.from_dict(values)
    assert any(k == key and fragment in message for k, message in info.value.problems), info.value.problems


def test_curriculum_keys_are_dotted_config_keys() -> None:
    assert TrainingConfig.is_key("curriculum.schedule") and TrainingConfig.is_key("curriculum.stages")
    assert not TrainingConfig.is_key("curriculum") and not TrainingConfig.is_key("curriculum.speed")
    config = TrainingConfig().replace({"curriculum.schedule": "step", "curriculum.stages": 3})
    assert config.curriculum == CurriculumConfig(schedule="step", stages=3)
    assert TrainingConfig.from_dict(config.to_dict()) == config  # a stored trial config reads back


# ---------------------------------------------------------------------------------------------------------------------
# The sampler.

def test_ties_share_a_rank_and_the_order_is_easiest_first() -> None:
    order, ranks = difficulty_ranks(np.array([3.0, 1.0, 2.0, 1.0]))
    assert order.tolist() == [1, 3, 2, 0]
    assert ranks.tolist() == [0.0, 0.0, 0.5, 0.75]
    with pytest.raises(ValueError, match="finite"):
        difficulty_ranks(np.array([1.0, np.nan]))


schedules = st.sampled_from(["linear", "exponential", "step", "constant"])


@settings(max_examples=60, deadline=None)
@given(scores=st.lists(st.integers(0, 20), min_size=8, max_size=120), batch_size=st.integers(1, 8),
       schedule=schedules, start=st.floats(0.01, 1.0), level=st.floats(0.0, 1.0), tolerance=st.floats(0.0, 0.3),
       stages=st.integers(2, 6), max_steps=st.integers(1, 40), accum=st.integers(1, 3), seed=st.integers(0, 3))
def test_the_sampler_never_yields_a_sample_above_the_level(scores, batch_size, schedule, start, level, tolerance,
                                                           stages, max_steps, accum, seed) -> None:
    config = CurriculumConfig(schedule=schedule, start_level=start, level=level, tolerance=tolerance, stages=stages)
    scores = np.array(scores, dtype=float)
    n = len(scores)
    batch_size = min(batch_size, n)
    sampler = CurriculumSampler(config, max_steps, n, batch_size, seed, CPU, scores)
    # The difficulty of each sample, as the sampler compares it: the share of the set that is strictly easier.
    rank = {i: float((scores < scores[i]).sum()) / n for i in range(n)}
    easiest_batch = set(np.argsort(scores, kind="stable")[:batch_size].tolist())  # the pool is never below one batch
    for step in range(max_steps):
        allowed = level_at(step, config, max_steps) + tolerance
        for _ in range(accum):
            batch = sampler.next(step).tolist()
            assert len(batch) == len(set(batch)) == batch_size  # a batch never repeats a sample
            assert all(rank[i] <= allowed or i in easiest_batch for i in batch), (step, allowed, batch)
            if allowed >= 1.0:
                assert sampler.batches.pool == n  # at level 1: the whole set


def test_the_blobs_sampler_follows_the_true_noise_level() -> None:
    task = load_task("blobs")
    noise = task.difficulty_scores()
    config = curriculum(schedule="step", start_level=0.25, stages=4, end_fraction=0.75)
    sampler = CurriculumSampler(config, 400, len(noise), 32, 0, CPU, noise)
    quantile = {level: np.quantile(noise, level) for level in (0.25, 0.5, 0.75)}
    seen: dict[float, list[float]] = {}
    for step in range(400):
        level = sampler.level_at(step)
        batch_noise = noise[sampler.next(step).numpy()]
        seen.setdefault(level, []).extend(batch_noise.tolist())
        if level < 1:
            assert batch_noise.max() <= quantile[level] + 1e-12
    assert sorted(seen) == [0.25, 0.5, 0.75, 1.0]
    means = [float(np.mean(seen[level])) for level in sorted(seen)]
    assert means == sorted(means) and means[0] < 0.2 and means[-1] > 0.4  # easy first, then everything


def test_no_curriculum_gives_exactly_the_plain_shuffled_batches() -> None:
    sampler = CurriculumSampler(CurriculumConfig(), 50, 100, 16, 3, CPU)
    plain = DeviceBatches(100, 16, 3, CPU)
    assert all(torch.equal(sampler.next(step), plain.next()) for step in range(50))


def test_a_rising_level_reshuffles_once_per_batch_of_new_samples_not_every_step() -> None:
    n, batch = 1000, 50
    sampler = CurriculumSampler(curriculum(schedule="linear", start_level=0.0, end_fraction=1.0), 2000, n, batch, 0,
                                CPU, np.arange(n, dtype=float))
    pools = [sampler.pool_at(step) for step in range(2000)]
    assert pools[0] == batch and pools[-1] == n
    assert all(p % batch == 0 for p in pools) and len(set(pools)) == n // batch


@settings(max_examples=25, deadline=None)
@given(split=st.integers(0, 60), schedule=schedules, accum=st.integers(1, 2))
def test_a_resumed_sampler_continues_at_the_same_level_with_the_same_batches(split: int, schedule: str,
                                                                            accum: int) -> None:
    scores = np.random.default_rng(0).normal(size=200)
    config = CurriculumConfig(schedule=schedule, start_level=0.2, stages=3, level=0.6, end_fraction=0.5)

    def run(sampler: CurriculumSampler, steps: range) -> list[tuple[float, list[int]]]:
        return [(sampler.level_at(s), sampler.next(s).tolist()) for s in steps for _ in range(accum)]

    uninterrupted = run(CurriculumSampler(config, 80, 200, 16, 7, CPU, scores), range(80))
    first = CurriculumSampler(config, 80, 200, 16, 7, CPU, scores)
    head = run(first, range(split))
    state = first.state_dict()
    resumed = CurriculumSampler(config, 80, 200, 16, 7, CPU, scores)  # a fresh process, as after a crash
    resumed.load_state_dict(state)
    assert head + run(resumed, range(split, 80)) == uninterrupted
    if split:
        assert state["step"] == split - 1 and state["level"] == level_at(split - 1, config, 80)


def test_a_state_for_another_data_set_is_refused() -> None:
    state = CurriculumSampler(CurriculumConfig(), 10, 100, 16, 0, CPU).state_dict()
    with pytest.raises(ValueError, match="100 samples, this one has 90"):
        CurriculumSampler(CurriculumConfig(), 10, 90, 16, 0, CPU).load_state_dict(state)


# ---------------------------------------------------------------------------------------------------------------------
# Difficulty of the built-in tasks.

def test_blobs_difficulty_is_its_known_noise_level() -> None:
    task = load_task("blobs", {"n": 400, "val_fraction": 0.25})
    _, _, noise = make_blobs(400, 4, 8, 1.5, 0)
    np.testing.assert_array_equal(task.difficulty_scores(), noise[100:])


def test_digits_difficulty_is_deterministic_and_predicts_what_a_model_gets_wrong() -> None:
    task = load_task("digits")
    scores = task.difficulty_scores()
    assert scores.shape == (len(task.train[0]),)
    np.testing.assert_array_equal(scores, load_task("digits").difficulty_scores())
    # A briefly trained MLP gets the proxy's hardest tenth wrong more often than its easiest tenth.
    torch.manual_seed(0)
    model = task.build_model(task.model_config({"hidden": 32}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = task.train
    for _ in range(150):
        idx = torch.randint(0, len(x), (32,))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()
    with torch.no_grad():
        wrong = (model(x).argmax(1) != y).numpy()
    order = np.argsort(scores)
    tenth = len(order) // 10
    assert wrong[order[:tenth]].mean() < wrong[order[-tenth:]].mean()


def test_charlm_difficulty_is_the_rarity_of_a_windows_bytes() -> None:
    windows = np.array([list(b"e e e e "), list(b"e e e e "), list(b"~|~|e e ")], dtype=np.int64)
    scores = unigram_surprisal(windows)
    assert scores[0] == scores[1] < scores[2]
    task = load_task("charlm", {"context": 32, "max_chars": 50_000})
    assert task.difficulty_scores().shape == (len(task.train[0]),)


def test_a_task_without_difficulty_refuses_a_curriculum_by_name(digits_task_without_difficulty) -> None:
    with pytest.raises(ConfigError, match=r"curriculum\.schedule.*provides no per-sample difficulty"):
        train(TrainingConfig.from_dict({"max_steps": 5, "curriculum.schedule": "linear"}),
              digits_task_without_difficulty)
    result = train(TrainingConfig.from_dict({"max_steps": 5}), digits_task_without_difficulty)  # none: no scores
    assert result.status == "completed"


@pytest.fixture
def digits_task_without_difficulty():
    task = load_task("digits")
    task.difficulty = None
    return task


# ---------------------------------------------------------------------------------------------------------------------
# The loop.

def test_the_level_is_logged_with_the_other_metrics() -> None:
    config = TrainingConfig.from_dict({"task": "blobs", "max_steps": 80, "log_every_steps": 10, "eval_every_steps": 40,
                                       "curriculum.schedule": "step", "curriculum.stages": 3,
                                       "curriculum.start_level": 0.2, "curriculum.end_fraction": 0.5})
    result = train(config)
    assert result.status == "completed"
    assert [r["step"] for r in result.logs] == [10, 20, 30, 40, 50, 60, 70, 80]
    # The level of the last step before each log (step 39 is the 40th step, still at 0.6).
    assert [r["curriculum_level"] for r in result.logs] == pytest.approx([0.2, 0.2, 0.6, 0.6, 1, 1, 1, 1])
    plain = train(config.replace({"curriculum.schedule": "none"}))
    assert {r["curriculum_level"] for r in plain.logs} == {1.0}
    assert plain.metrics != result.metrics  # the curriculum changed what the run saw


@pytest.mark.parametrize("schedule", ["none", "linear", "step"])
def test_a_curriculum_adds_no_host_device_sync(schedule: str) -> None:
    # The same counts as test_loop's sync test: the level and the pool size are computed on the host from the step.
    task = load_task("digits")
    task.data_digest()  # the data's fingerprint (the reproducibility record's): read once per task, before any step
    counts = {}
    for max_steps in (20, 80):
        counter = SyncCounter()
        with counter:
            train(TrainingConfig.from_dict({"max_steps": max_steps, "log_every_steps": 20, "eval_every_steps": 40,
                                            "batch_size": 32, "model.hidden": 16, "fast_fail.enabled": False,
                                            "curriculum.schedule": schedule}), task)
        counts[max_steps] = counter.count
    assert counts == {20: 2, 80: 6}


# ---------------------------------------------------------------------------------------------------------------------
# Fast-fail at stage changes: through `judge`, and through the Optuna pruner's public API.

STEP_CURRICULUM = {"schedule": "step", "stages": 4, "start_level": 0.25, "end_fraction": 0.75}  # stages at 250/500/750
WITH = {"max_steps": 1000, "eval_every_steps": 10, "curriculum": STEP_CURRICULUM}
WITHOUT = {"max_steps": 1000, "eval_every_steps": 10}


def decay(start: float, until: int, rate: float = 0.99, first: int = 0) -> list[tuple[int, float]]:
    """Evaluations every 10 steps from `first` to `until` (exclusive), decaying from `start` by `rate` each."""
    return [(s, start * rate ** ((s - first) // 10)) for s in range(first, until, 10)]


HEALTHY_JUMP = decay(2.3, 260, 0.95) + [(260, 3.6), (270, 2.0), (280, 0.9)] + decay(0.6, 1010, first=290)
STALL_THEN_NEW_STAGE = ([(0, 2.3)] + [(s, 2.3 - 0.8 * s / 200) for s in range(10, 210, 10)] + [(s, 1.5) for s in
                        range(210, 260, 10)] + [(260, 1.8), (270, 1.7), (280, 1.6), (290, 1.55), (300, 1.52),
                                                (310, 1.5)] + decay(1.48, 1010, 0.985, first=320))
# (curve, fast-fail settings, pruned step with the step curriculum, pruned step without any; and, where they differ,
# the pruner's in a study with no finished trial: there a trial is near its initial value only within
# `near_initial_pct` (10%) of it, and the plateau curves below have left 35% of theirs behind, so plateau is the
# wrapped pruner's call, not fast-fail's)
STAGE_CASES = [
    pytest.param(HEALTHY_JUMP, {"loss_explosion_factor": 1.5}, None, 260, id="healthy-jump-at-a-stage-change"),
    pytest.param(STALL_THEN_NEW_STAGE, {"patience_steps": 100}, None, 300, (None, None),
                 id="stall-then-a-new-stage-learns"),
    pytest.param(decay(2.3, 400, 0.95) + [(400, 30.0)], {}, 400, 400, id="divergence-mid-stage"),
    pytest.param(decay(2.3, 260, 0.95) + [(260, NAN)], {}, 260, 260, id="nan-in-the-grace-period"),
    pytest.param(decay(2.3, 260, 0.95) + [(260, 30.0), (270, 31.0), (280, 32.0)], {}, 280, 260,
                 id="explosion-outlasting-the-grace-period"),
    pytest.param([(0, 2.3)] + [(s, 2.3 - 0.8 * s / 300) for s in range(10, 310, 10)] + [(s, 1.5) for s in
                 range(310, 500, 10)], {"patience_steps": 100}, 400, 400, (None, None),
                 id="real-plateau-within-a-stage"),
]


def first_verdict(series: list[tuple[int, float]], settings_: dict, config: dict) -> int | None:
    resolved = FastFailConfig(**settings_).resolved(config["max_steps"], config["eval_every_steps"])
    starts = stage_starts(CurriculumConfig(**config["curriculum"]), config["max_steps"]) if "curriculum" in config \
        else ()
    for i in range(len(series)):
        verdict = judge(series[: i + 1], resolved, stage_starts=starts)
        if verdict is not None:
            return verdict.step
    return None


def pruned_step(series: list[tuple[int, float]], settings_: dict, config: dict) -> int | None:
    return pruner_pruned_step(FastFailPruner(**settings_), series, config=config)


@pytest.mark.parametrize(("series", "settings_", "with_curriculum", "without", "in_a_study"), [
    pytest.param(*case.values, *(() if len(case.values) == 5 else (None,)), id=case.id) for case in STAGE_CASES])
def test_stage_changes_get_a_grace_period_but_divergence_is_still_caught(series, settings_, with_curriculum,
                                                                         without, in_a_study) -> None:
    assert first_verdict(series, settings_, WITH) == with_curriculum
    assert first_verdict(series, settings_, WITHOUT) == without
    expected = (with_curriculum, without) if in_a_study is None else in_a_study
    assert (pruned_step(series, settings_, WITH), pruned_step(series, settings_, WITHOUT)) == expected


def test_the_pruner_reads_the_curriculum_from_a_full_stored_trial_config() -> None:
    stored = TrainingConfig.from_dict({"max_steps": 1000, "eval_every_steps": 10,
                                       **{f"curriculum.{k}": v for k, v in STEP_CURRICULUM.items()}}).to_dict()
    assert pruned_step(HEALTHY_JUMP, {"loss_explosion_factor": 1.5}, stored) is None
    # An explicit grace of 0 turns the allowance off: the same jump is then an explosion.
    assert pruned_step(HEALTHY_JUMP, {"loss_explosion_factor": 1.5, "stage_grace_steps": 0}, stored) == 260


def test_the_loss_guard_holds_its_explosion_flag_during_a_grace_period_but_not_for_nan() -> None:
    config = FastFailConfig(stage_grace_steps=20).resolved(1000, 10)
    guard = LossGuard(config, CPU, stage_starts=(250,))
    guard.arm(2.3)
    guard.observe(torch.tensor(30.0), 260)
    guard.observe(torch.tensor(30.0), 270)
    assert not guard.tripped()
    guard.observe(torch.tensor(30.0), 271)
    assert guard.tripped()
    guard.reset()
    guard.observe(torch.tensor(math.nan), 255)
    guard.observe(torch.tensor(2.0), 256)  # NaN sticks until the check reads it
    assert guard.tripped()
    guard.reset()
    guard.observe(torch.tensor(math.inf), 255)
    assert guard.tripped()
    guard.reset()
    guard.observe(torch.tensor(2.0), 300)
    assert not guard.tripped()


def test_a_negative_grace_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="stage_grace_steps"):
        FastFailPruner(stage_grace_steps=-1)
