"""Warm start's parts: the normalised distance, the shape key, and the donor lookup against a real registry on SQLite
and on PostgreSQL (the same tests for both)."""

from __future__ import annotations

import copy
import math
import multiprocessing
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, inspect

from sweep.checkpoints import collect_study, retention_keeps
from sweep.registry import Registry
from sweep.spec import parse_spec
from sweep.warmstart import categorical_key, coordinates, distance, find_donor, shape_key
from tests.conftest import TINY_STUDY
from trainer import load_task

SPACE_DOC = {
    "learning_rate": {"type": "float", "low": 1e-4, "high": 1e-0, "log": True},
    "weight_decay": {"type": "float", "low": 0.0, "high": 0.1},
    "model.hidden": {"type": "int", "low": 8, "high": 32},
    "optimizer": {"type": "categorical", "choices": ["adamw", "sgd"]},
}


def make_spec(**warm: Any):
    document = copy.deepcopy(TINY_STUDY) | {"space": SPACE_DOC, "warm_start": {"max_distance": 0.3, **warm}}
    document["fixed"] = {**document["fixed"], "max_steps": 100, "eval_every_steps": 10}
    return parse_spec(document, "test.yaml")


def test_distance_is_euclidean_in_the_normalised_space() -> None:
    spec = make_spec()
    a = {"learning_rate": 1e-3, "weight_decay": 0.0, "model.hidden": 8, "optimizer": "adamw"}
    # log scale: 1e-3 -> 1e-2 is a quarter of the 1e-4..1 range, whatever the absolute difference
    assert distance(spec.space, a, {**a, "learning_rate": 1e-2}) == pytest.approx(0.25)
    assert distance(spec.space, a, {**a, "weight_decay": 0.05}) == pytest.approx(0.5)
    assert distance(spec.space, a, {**a, "optimizer": "sgd"}) == 1.0  # a categorical mismatch is the full range
    assert distance(spec.space, a, {k: v for k, v in a.items() if k != "weight_decay"}) == 1.0  # unknown: full
    both = {**a, "learning_rate": 1e-2, "weight_decay": 0.05}
    assert distance(spec.space, a, both) == pytest.approx(math.hypot(0.25, 0.5))
    assert coordinates(spec.space, a) == pytest.approx([0.25, 0.0, 0.0])  # numeric keys only, in space order


def test_the_shape_key_changes_with_shapes_and_only_with_shapes() -> None:
    spec = make_spec()
    digits = load_task("digits", {})
    key = lambda **params: shape_key(spec.config_for(params), digits)
    assert key(**{"model.hidden": 16}) == key(**{"model.hidden": 16, "learning_rate": 0.5, "optimizer": "sgd"})
    assert key(**{"model.hidden": 16}) != key(**{"model.hidden": 17})
    assert key(**{"model.hidden": 16}) != key(**{"model.hidden": 16, "model.depth": 3})
    assert key(**{"model.hidden": 16}) == key(**{"model.hidden": 16, "model.dropout": 0.5})  # no tensor changes



def test_the_shape_key_of_a_model_of_lazy_modules_is_its_eager_twins() -> None:
    """`nn.LazyLinear` has no shapes until a forward: the key is taken after the dry run every build makes."""
    import torch
    from torch import nn

    from trainer import TrainingConfig
    from trainer.tasks import Task

    digits = load_task("digits", {})
    builders = {"lazy": lambda cfg: nn.Sequential(nn.LazyLinear(cfg["hidden"]), nn.ReLU(), nn.LazyLinear(10)),
                "eager": lambda cfg: nn.Sequential(nn.Linear(64, cfg["hidden"]), nn.ReLU(),
                                                   nn.Linear(cfg["hidden"], 10))}
    keys = {}
    for name, build in builders.items():
        task = Task(name="mine", train=digits.train, val=digits.val, build_model=build, model_defaults={"hidden": 8})
        config = TrainingConfig.from_dict({"task": f"{name}:task", "model": {"hidden": 8}})
        keys[name] = shape_key(config, task)
    assert keys["lazy"] == keys["eager"]
    assert torch.get_default_device().type == "cpu"  # the meta build left the process as it was

def register(registry: Registry, study: str, spec, number: int, params: dict[str, Any], step: int, value: float,
             final: bool = True, key: str | None = None) -> int:
    digits = load_task("digits", {})
    key = key if key is not None else shape_key(spec.config_for(params), digits)
    checkpoint_id = registry.register(study=study, trial_number=number, step=step, value=value, params=params,
                                      shape_key=key, uri=f"/nowhere/{number}-{step}.pt", size=1, sha256="0" * 64,
                                      coords=coordinates(spec.space, params),
                                      cat_key=categorical_key(spec.space, params))
    if final:
        registry.finish_trial(study, number)
    return checkpoint_id


@pytest.fixture(params=["sqlite", "postgresql"])
def registry(request: pytest.FixtureRequest, tmp_path: Path) -> Registry:
    if request.param == "sqlite":
        return Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    return Registry(request.getfixturevalue("postgres_url"))


BASE = {"learning_rate": 1e-2, "weight_decay": 0.05, "model.hidden": 16, "optimizer": "adamw"}


def lookup(registry: Registry, spec, study: str, params: dict[str, Any], handoff: int = 50):
    config = spec.config_for(params)
    return find_donor(registry, spec, study, params, config, shape_key(config, load_task("digits", {})), handoff)


def test_the_nearest_compatible_finished_checkpoint_is_the_donor(registry: Registry) -> None:
    spec, study = make_spec(), f"s-{uuid.uuid4().hex[:8]}"
    near = register(registry, study, spec, 0, {**BASE, "weight_decay": 0.06}, 50, 1.0)  # distance 0.1
    register(registry, study, spec, 1, {**BASE, "weight_decay": 0.08}, 50, 0.1)  # 0.3 away: farther, though better
    register(registry, study, spec, 2, {**BASE, "model.hidden": 17}, 50, 0.1)  # nearer still, but another shape
    register(registry, study, spec, 3, BASE, 50, 0.1, final=False)  # distance 0, but its trial is still running
    register(registry, study, spec, 4, BASE, 60, 0.1)  # distance 0, but past the handoff step
    register(registry, f"{study}-other", spec, 5, BASE, 50, 0.1)  # another study: not asked for
    donor = lookup(registry, spec, study, BASE)
    assert donor is not None and donor.record.id == near and donor.distance == pytest.approx(0.1)
    assert donor.record.trial_number == 0 and donor.record.step == 50


def test_of_the_nearest_trial_the_latest_checkpoint_before_the_handoff(registry: Registry) -> None:
    spec, study = make_spec(), f"s-{uuid.uuid4().hex[:8]}"
    register(registry, study, spec, 0, BASE, 20, 0.5)
    latest = register(registry, study, spec, 0, BASE, 50, 0.9)
    assert lookup(registry, spec, study, BASE).record.id == latest


@pytest.mark.parametrize("change", [
    {"learning_rate": 1.0},  # log-scale distance 0.5 > 0.3
    {"optimizer": "sgd"},  # a categorical mismatch: 1
    {"model.hidden": 32},  # another shape: never a donor, at any distance
])
def test_no_donor_beyond_max_distance_or_of_another_shape(registry: Registry, change: dict[str, Any]) -> None:
    spec, study = make_spec(), f"s-{uuid.uuid4().hex[:8]}"
    register(registry, study, spec, 0, {**BASE, **change}, 50, 0.1)
    assert lookup(registry, spec, study, BASE) is None


def test_match_keys_and_inherited_optimizer_state_must_agree(registry: Registry) -> None:
    study = f"s-{uuid.uuid4().hex[:8]}"
    with_optimizer = make_spec(max_distance=2.0, inherit="weights+optimizer")
    register(registry, study, with_optimizer, 0, {**BASE, "optimizer": "sgd"}, 50, 0.1)
    assert lookup(registry, with_optimizer, study, BASE) is None  # Adam's moments mean nothing to SGD
    assert lookup(registry, make_spec(max_distance=2.0), study, BASE).record.trial_number == 0  # weights alone: fine
    matched = make_spec(max_distance=2.0, match=["weight_decay"])
    register(registry, study, matched, 1, {**BASE, "weight_decay": 0.0}, 50, 0.1)  # nearer, but another decay
    assert lookup(registry, matched, study, BASE).record.trial_number == 0
    assert lookup(registry, matched, study, {**BASE, "weight_decay": 0.0}).record.trial_number == 1


def test_from_studies_finds_donors_in_other_studies(registry: Registry) -> None:
    spec, study = make_spec(), f"s-{uuid.uuid4().hex[:8]}"
    register(registry, f"{study}-before", spec, 7, BASE, 50, 0.1)
    assert lookup(registry, spec, study, BASE) is None
    donor = lookup(registry, make_spec(from_studies=[f"{study}-before"]), study, BASE)
    assert donor is not None and (donor.record.study, donor.record.trial_number) == (f"{study}-before", 7)


def test_a_key_another_study_fixed_is_not_compared_for_its_donors(registry: Registry) -> None:
    # A donor study that fixed a key this one searches was never a donor: the key counted as the full range.
    study = f"s-{uuid.uuid4().hex[:8]}"
    before = make_spec()
    register(registry, f"{study}-before", before, 3, {k: v for k, v in BASE.items() if k != "weight_decay"}, 50, 0.1)
    donor = lookup(registry, make_spec(from_studies=[f"{study}-before"]), study, BASE)
    assert donor is not None and donor.record.trial_number == 3 and donor.distance == 0.0


def test_a_pinned_checkpoint_is_never_collected(registry: Registry) -> None:
    spec, study = make_spec(), f"s-{uuid.uuid4().hex[:8]}"
    pinned = register(registry, study, spec, 0, BASE, 50, 0.1)
    loose = register(registry, study, spec, 0, BASE, 60, 0.2)
    assert registry.pin(pinned)
    assert registry.forget([pinned, loose]) == [loose]
    assert [r.id for r in registry.for_trial(study, 0)] == [pinned]
    assert not registry.pin(loose)  # gone: a lookup that raced the collection looks again


def test_a_diverged_value_neither_donates_nor_ranks_a_trial(registry: Registry) -> None:
    # PostgreSQL stores NaN and sorts it above every number: a diverged checkpoint would be the "highest" value.
    spec, study = make_spec(), f"s-{uuid.uuid4().hex[:8]}"
    register(registry, study, spec, 0, BASE, 10, 0.2)
    diverged = register(registry, study, spec, 0, BASE, 20, float("nan"))
    register(registry, study, spec, 1, {**BASE, "weight_decay": 0.06}, 10, 0.9)
    assert [r.value for r in registry.for_trial(study, 0) if r.id == diverged] == [None]
    assert registry.value_range_per_trial(study) == {0: (0.2, 0.2, False), 1: (0.9, 0.9, False)}
    assert collect_study(registry, study, keep_trials=1, maximize=True) == [0]  # trial 1 is the better one
    assert registry.for_trial(study, 0) == [] and len(registry.for_trial(study, 1)) == 1
    assert collect_study(registry, study, keep_trials=1, maximize=True) == []  # each trial is dropped once


def test_failed_trials_count_for_retention_after_the_others_and_never_donate(registry: Registry) -> None:
    spec, study = make_spec(), f"s-{uuid.uuid4().hex[:8]}"
    register(registry, study, spec, 0, BASE, 40, 0.01, final=False)  # the best value, then it diverged
    registry.finish_trial(study, 0, donor=False)
    register(registry, study, spec, 1, {**BASE, "weight_decay": 0.06}, 40, 0.5)  # completed, 0.1 away
    register(registry, study, spec, 2, BASE, 40, float("nan"))  # completed, but its only value is NaN
    donor = lookup(registry, spec, study, BASE)
    assert donor is not None and donor.record.trial_number == 1  # not trial 0, though it is nearer and better
    assert retention_keeps(registry, study, 3, 0.4, False, 2, maximize=False)  # 2nd best, after trial 1
    assert not retention_keeps(registry, study, 3, 0.4, True, 1, maximize=False)  # failed: after trial 1
    # Ranked: trial 1 (completed, 0.5), trial 2 (completed, no value), then trial 0 (failed); keep 1.
    assert collect_study(registry, study, keep_trials=1, maximize=False) == [0, 2]
    assert [r.trial_number for r in registry.for_trial(study, 0) + registry.for_trial(study, 2)] == []


def _create_registry(url: str, barrier: Any, results: Any) -> None:
    barrier.wait()
    try:
        registry = Registry(url)
        registry.register(study="race", trial_number=0, step=1, value=1.0, params={}, shape_key="k", uri="u",
                          size=1, sha256="0" * 64)
        results.put("ok")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put(f"{type(exc).__name__}: {exc}")


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_several_processes_create_the_registry_at_once(backend: str, tmp_path: Path,
                                                      request: pytest.FixtureRequest) -> None:
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'race.db'}"
    else:
        base = request.getfixturevalue("postgres_url")
        name = f"race{uuid.uuid4().hex[:8]}"
        with create_engine(base, isolation_level="AUTOCOMMIT").connect() as connection:
            connection.exec_driver_sql(f"CREATE DATABASE {name}")
        url = base.replace("/sweep?", f"/{name}?")
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(6), context.Queue()
    workers = [context.Process(target=_create_registry, args=(url, barrier, results)) for _ in range(6)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert sorted(results.get(timeout=5) for _ in workers) == ["ok"] * 6
    engine = create_engine(url)
    assert "sweep_checkpoints" in inspect(engine).get_table_names()
    indexes = {ix["name"] for ix in inspect(engine).get_indexes("sweep_checkpoints")}
    assert {"ix_sweep_checkpoints_trial", "ix_sweep_checkpoints_donors"} <= indexes
    assert len(Registry(url).for_trial("race", 0)) == 6


def test_a_registry_from_an_earlier_version_is_upgraded_in_place(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    with create_engine(url).begin() as connection:  # the table as the first release wrote it, with one row
        connection.exec_driver_sql(
            "CREATE TABLE sweep_checkpoints (id INTEGER PRIMARY KEY AUTOINCREMENT, study VARCHAR(512) NOT NULL, "
            "trial_number INTEGER NOT NULL, step INTEGER NOT NULL, value FLOAT, params TEXT NOT NULL, "
            "shape_key VARCHAR(64) NOT NULL, uri TEXT NOT NULL, size INTEGER NOT NULL, sha256 VARCHAR(64) NOT NULL, "
            "created_at FLOAT NOT NULL)")
        connection.exec_driver_sql("CREATE INDEX ix_sweep_checkpoints_donors ON sweep_checkpoints (study, shape_key, "
                                   "value)")
        connection.exec_driver_sql("INSERT INTO sweep_checkpoints (study, trial_number, step, value, params, "
                                   "shape_key, uri, size, sha256, created_at) VALUES ('old', 0, 10, 1.0, '{}', '', "
                                   "'/x.pt', 1, 'h', 0)")
    registry = Registry(url)
    [old] = registry.for_trial("old", 0)
    assert old.step == 10 and not old.final and not old.pinned  # kept; not a donor
    spec, study = make_spec(), "new"
    register(registry, study, spec, 0, BASE, 50, 0.5)
    assert lookup(registry, spec, study, BASE).record.trial_number == 0
    columns = {ix["name"]: ix["column_names"] for ix in inspect(create_engine(url)).get_indexes("sweep_checkpoints")}
    assert "cat_key" in columns["ix_sweep_checkpoints_donors"]
    Registry(url)  # a second worker finds it upgraded


@pytest.mark.parametrize(("space", "latest"), [
    ({}, 20),  # fixed max_steps 40, handoff 0.5
    ({"max_steps": {"type": "categorical", "choices": [200, 800, 400]}}, 400),  # the largest choice, not the last
    ({"max_steps": {"type": "int", "low": 600, "high": 1000},
      "eval_every_steps": {"type": "int", "low": 240, "high": 260}}, 500),  # 250 hands off at 500; the ends less
])
def test_the_latest_handoff_step_bounds_every_trial_s(space: dict[str, Any], latest: int) -> None:
    # from_studies' warning of a study that gives no donors compared against the two ends of the ranges only, and
    # warned of a study that did donate (to a trial of the middle choice).
    from sweep.spec import latest_handoff_step
    from tests.conftest import TINY_STUDY

    document = copy.deepcopy(TINY_STUDY) | {"warm_start": {"max_distance": 0.5}}
    document["fixed"] = {**document["fixed"], "max_steps": 40}
    for key in space:
        document["fixed"].pop(key, None)
    document["space"] = {**document["space"], **space}
    assert latest_handoff_step(parse_spec(document, "study.yaml")) >= latest
