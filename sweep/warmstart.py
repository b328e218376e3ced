"""Warm start: a new trial starts from the checkpoint of its nearest finished or pruned neighbour.

A donor must be *compatible*: its model's tensors have the same names and shapes (the shape key is computed from the
model itself, built on the meta device, so every key that changes a shape is found without being listed), and it
has the same value for every key the study file lists under `warm_start.match`. Among compatible donors the nearest
wins, by Euclidean distance in the search space scaled to [0, 1] per key (log-scaled keys on the log scale; a
categorical mismatch counts as the full range, 1), within `max_distance`; ties go to the better value. The trial
loads the donor's weights (and its optimizer state with `inherit: weights+optimizer`) and continues from the donor's
step, so it trains only the rest of its budget.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sweep.blobs import delete_blob, load_blob
from sweep.registry import COORDS, CheckpointRecord
from sweep.schema import CategoricalParam
from trainer.checkpoint import CheckpointError, WarmStart
from trainer.config import flatten

if TYPE_CHECKING:
    from sweep.blobs import BlobScope
    from sweep.registry import Registry
    from sweep.schema import Param, StudySpec
    from trainer import Task, TrainingConfig

__all__ = ["Donor", "categorical_key", "coordinate", "coordinates", "distance", "donorless_studies", "find_donor",
           "must_match", "shape_key", "warm_start_from"]


@dataclass(frozen=True)
class Donor:
    record: CheckpointRecord
    distance: float

    def lineage(self) -> dict[str, Any]:
        """What the trial stores as `warm_start_from`: enough to find and check the parent again (reproduce)."""
        return {"study": self.record.study, "trial": self.record.trial_number, "step": self.record.step,
                "distance": round(self.distance, 6), "value": self.record.value, "checkpoint_id": self.record.id,
                "uri": self.record.uri, "sha256": self.record.sha256}


def coordinate(param: Param, value: Any) -> float | None:
    """A numeric key's value scaled to [0, 1] over its range (log-scaled keys on the log scale); None for
    categoricals, which are compared by equality."""
    if isinstance(param, CategoricalParam):
        return None
    low, high, x = float(param.low), float(param.high), float(value)
    if param.log:
        low, high, x = math.log(low), math.log(high), math.log(x)
    return 0.0 if high == low else (x - low) / (high - low)


def coordinates(space: Mapping[str, Param], params: Mapping[str, Any]) -> list[float | None]:
    """The first `COORDS` numeric coordinates in the space's order: the registry's indexed columns."""
    numeric = [coordinate(p, params[k]) for k, p in space.items() if not isinstance(p, CategoricalParam)
               and k in params]
    return numeric[:COORDS]


def distance(space: Mapping[str, Param], a: Mapping[str, Any], b: Mapping[str, Any], *,
             absent: float = 1.0) -> float:
    """Euclidean distance between two points of `space`; a key one side lacks counts as `absent` (the full range by
    default; 0 for another study's point, which fixed the keys it lacks)."""
    total = 0.0
    for key, param in space.items():
        if key not in a or key not in b:
            total += absent
        elif isinstance(param, CategoricalParam):
            total += 0.0 if a[key] == b[key] else 1.0
        else:
            total += (coordinate(param, a[key]) - coordinate(param, b[key])) ** 2  # type: ignore[operator]
    return math.sqrt(total)


def shape_key(config: TrainingConfig, task: Task) -> str:
    """A digest of the model's tensor names, shapes and dtypes: equal keys mean a checkpoint's weights load into
    this trial's model. Every key that changes a shape (width, depth, vocabulary, context) changes it."""
    # The shapes are a function of the task, its arguments and the model's settings: the cache is keyed by those (not
    # by the task object, whose id() a later object may reuse once the task cache lets it go).
    key = tuple(json.dumps(v, sort_keys=True, default=str) for v in (config.task, config.task_args, config.model))
    tensors = _signatures.get(key)
    if tensors is None:
        tensors = _signatures[key] = _build_signature(task, key[2])
    return hashlib.sha256(json.dumps(tensors).encode()).hexdigest()[:32]


def must_match(spec: StudySpec) -> list[str]:
    """Keys a donor must share besides its shapes: the study's `match` list, and the optimizer when its state is
    inherited (Adam's moments mean nothing to SGD)."""
    keys = list(spec.warm_start.match)
    if spec.warm_start.inherit == "weights+optimizer" and "optimizer" not in keys:
        keys.append("optimizer")
    return keys


_signatures: dict[tuple[str, ...], list[tuple[str, list[int], str]]] = {}


def _build_signature(task: Task, model_json: str) -> list[tuple[str, list[int], str]]:
    model = json.loads(model_json)
    try:
        with torch.device("meta"):  # shapes without memory or initialisation cost
            built = task.build(model)
    except Exception:  # noqa: BLE001 - a custom model that cannot be built on meta: build it for real
        built = task.build(model)
    return sorted((name, list(t.shape), str(t.dtype)) for name, t in built.state_dict().items())


# A finished trial's config (its `config` user attr) by study name and trial number, or None where it has none.
DonorConfigs = Callable[[str, int], "Mapping[str, Any] | None"]


def find_donor(registry: Registry, spec: StudySpec, study: str, params: Mapping[str, Any],
               config: TrainingConfig | Mapping[str, Any], key: str, handoff_step: int,
               donor_configs: DonorConfigs | None = None, exclude: Collection[int] = ()) -> Donor | None:
    """The nearest compatible checkpoint within `max_distance` at or before `handoff_step`, or None (of the nearest
    trial's checkpoints, the latest). One indexed query for this study (its coordinates in a box of half-width
    `max_distance`) and one for the `from_studies`, whose spaces may differ.

    The `match` keys are compared where the donor's params hold them; a key absent there was fixed in the donor's
    study: for this study, to the same value; for `from_studies`, the donor's stored config says which
    (`donor_configs`), and one that differs is no donor (review: an SGD study's trials handed their momentum to
    AdamW trials, which failed on it alone and ignored it in a cohort). `config`: the trial's `TrainingConfig`, or a
    user loop's config as plain data. `exclude`: checkpoint ids found unusable already."""
    values = flatten(config, free=()) if isinstance(config, Mapping) else flatten(config.to_dict(),
                                                                                 free=("model", "task_args"))
    match = {k: values.get(k, params.get(k)) for k in must_match(spec)}
    options = spec.warm_start
    radius = options.max_distance
    sign = -1.0 if spec.direction == "maximize" else 1.0
    best: Donor | None = None

    def consider(records: list[CheckpointRecord], absent: float = 1.0) -> None:
        nonlocal best
        for record in records:
            d = distance(spec.space, params, record.params, absent=absent)
            if d > radius or record.value is None or not math.isfinite(record.value) or record.id in exclude:
                continue
            if any(k in record.params and record.params[k] != v for k, v in match.items()):
                continue
            if record.study != study and _fixed_apart(record, match, donor_configs):
                continue
            rank = (d, -record.step, sign * record.value)
            if best is None or rank < (best.distance, -best.record.step, sign * best.record.value):  # type: ignore[operator]
                best = Donor(record, d)

    # This study: nearest first by the distance over the coordinate columns (a lower bound of the full distance),
    # a page at a time, until the best full distance found is no larger than the next page could hold. Within
    # max_distance < 1 a categorical mismatch is already too far, so the categorical values must match exactly.
    near = coordinates(spec.space, params)
    cat = categorical_key(spec.space, params) if radius < 1 else None
    offset = 0
    while True:
        page = registry.donor_candidates([study], key, before_step=handoff_step + 1, near=near, radius=radius,
                                         cat_key=cat, limit=PAGE, offset=offset)
        consider(page)
        if len(page) < PAGE or (best is not None and best.distance <= _partial(spec, params, page[-1].params)):
            break
        offset += PAGE
    others = [name for name in options.from_studies if name != study]
    if others:  # other studies' spaces may differ: their coordinate columns mean other things, and a key they fixed
        # is not compared (the README: keep such keys equal across the studies)
        consider(registry.donor_candidates(others, key, before_step=handoff_step + 1), absent=0.0)
    return best


PAGE = 64


def _fixed_apart(record: CheckpointRecord, match: Mapping[str, Any], donor_configs: DonorConfigs | None) -> bool:
    """Whether another study's donor fixed one of the `match` keys that its params do not hold to another value than
    this trial's, by the config it trained with."""
    unsampled = [k for k in match if k not in record.params]
    if not unsampled or donor_configs is None:
        return False
    stored = donor_configs(record.study, record.trial_number)
    if stored is None:
        return False
    values = flatten(stored)
    return any(k in values and values[k] != match[k] for k in unsampled)


def donorless_studies(registry: Registry, latest: int | None, names: Sequence[str]) -> dict[str, str]:
    """Which of `names` (other studies of this storage) can give this study no donor, each with why: a study keeps
    a checkpoint at its handoff step only when it runs with warm start on; without it, only its trials' latest and
    best checkpoints, which come after this study's handoff step. `latest`: `sweep.spec.latest_handoff_step` (None:
    any step)."""
    why = {}
    for name in names:
        earliest = registry.earliest_donor_step(name)
        if earliest is None:
            why[name] = "it has no checkpoint of a finished trial"
        elif latest is not None and earliest > latest:
            why[name] = (f"its earliest checkpoint is at step {earliest}, after this study's handoff (step {latest} "
                         "at the latest), and a study keeps a checkpoint at its handoff step only when it runs with "
                         "warm_start on: run it with warm_start (at the same handoff and max_steps) to make it a donor")
    return why


def categorical_key(space: Mapping[str, Param], params: Mapping[str, Any]) -> str:
    """A digest of the trial's categorical values, kept with each checkpoint for the lookup's equality filter."""
    values = sorted((k, params.get(k)) for k, p in space.items() if isinstance(p, CategoricalParam))
    return hashlib.sha256(json.dumps(values, default=str).encode()).hexdigest()[:32] if values else ""


def _partial(spec: StudySpec, a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """The distance over the coordinate columns alone (what the query orders by)."""
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(coordinates(spec.space, a), coordinates(spec.space, b))
                         if x is not None and y is not None))


def warm_start_from(registry: Registry, spec: StudySpec, study: str, trial_number: int, params: Mapping[str, Any],
                    config: TrainingConfig | Mapping[str, Any], key: str, handoff_step: int, *,
                    scope: BlobScope, donor_configs: DonorConfigs | None = None,
                    scope_of: Callable[[str], BlobScope] | None = None) -> tuple[WarmStart, Donor] | None:
    """Find, pin and load a donor. A donor whose blob is missing or fails its hash is skipped with a warning, and so
    is one whose row names a blob outside its study's part of the store (`scope`: that file is neither read nor
    deleted); the next nearest is tried. A donor collected between the lookup and the pin is looked up again. None:
    the trial starts cold. Donors of `from_studies` are read from their own study's part of its own store
    (`scope_of(name)`: it may keep its checkpoints elsewhere; without it, this store); such a donor that cannot be
    used is only skipped: its rows and files are that study's, never this one's to delete (review: a study reading
    another's donor in the wrong store deleted that study's pinned row, and changed its later trials)."""
    refused: set[int] = set()
    for _ in range(5):
        donor = find_donor(registry, spec, study, params, config, key, handoff_step, donor_configs, exclude=refused)
        if donor is None:
            return None
        if not registry.pin(donor.record.id):
            continue  # collected under us: look again
        record = donor.record
        own = record.study == study
        where = f"trial {trial_number}: not warm-starting from trial {record.trial_number} of study {record.study!r}"
        uri = (scope if own or scope_of is None else scope_of(record.study)).find_or_warn(record.uri, record.study,
                                                                                         where)
        if uri is None:
            if own:
                registry.forget_broken(record.id)  # the row only: the file it names is not ours to touch
            refused.add(record.id)
            continue
        try:
            state = load_blob(uri, record.sha256)
        except CheckpointError as exc:
            warnings.warn(f"{where}: {exc}", stacklevel=2)
            if own:
                registry.forget_broken(record.id)
                delete_blob(uri)  # nobody may use it, and no row names it any more
            refused.add(record.id)
            continue
        return WarmStart(state, optimizer=spec.warm_start.inherit == "weights+optimizer"), donor
    return None
