"""A study file (YAML) becomes a validated, typed `StudySpec`.

Every problem is found before any trial runs, and all of them are reported together: each names the file, the key path
and what was expected. Unknown keys are refused, since a typo must not silently do nothing.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from pydantic import field_validator, model_validator

from trainer.config import ConfigError, TrainingConfig, flatten, nest
from trainer.fast_fail import FastFailConfig
from trainer.tasks import Task, TaskError, load_task

__all__ = ["StudyFileError", "StudySpec", "load_spec", "parse_spec"]

SPEC_ATTR = "sweep.spec"  # the study's user attr holding its own spec


class StudyFileError(Exception):
    """Bad input in a study file: every problem as `(key path, message)`, reported together."""

    def __init__(self, source: str | Path, problems: Sequence[tuple[str, str]]) -> None:
        self.source = str(source)
        self.problems = list(problems)
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        return [f"{self.source}: {key}: {message}" if key else f"{self.source}: {message}"
                for key, message in self.problems]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FloatParam(_Model):
    type: Literal["float"]
    low: float
    high: float
    log: bool = False
    step: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> FloatParam:
        _check_range(self.low, self.high, self.log, self.step)
        return self

    def suggest(self, trial: Any, name: str) -> float:
        return trial.suggest_float(name, self.low, self.high, log=self.log, step=self.step)


class IntParam(_Model):
    type: Literal["int"]
    low: StrictInt
    high: StrictInt
    log: bool = False
    step: StrictInt = Field(1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> IntParam:
        _check_range(self.low, self.high, self.log, None if self.step == 1 else self.step)
        return self

    def suggest(self, trial: Any, name: str) -> int:
        return trial.suggest_int(name, self.low, self.high, log=self.log, step=self.step)


Choice = Union[StrictBool, StrictInt, StrictFloat, StrictStr, None]


class CategoricalParam(_Model):
    type: Literal["categorical"]
    choices: list[Choice] = Field(min_length=1)

    def suggest(self, trial: Any, name: str) -> Any:
        return trial.suggest_categorical(name, self.choices)


def _check_range(low: float, high: float, log: bool, step: float | None) -> None:
    if low > high:
        raise ValueError(f"expected low <= high, got low={low}, high={high}")
    if log and low <= 0:
        raise ValueError(f"log: true needs low > 0, got low={low}")
    if log and step is not None:
        raise ValueError("log: true and step cannot be combined")


Param = Annotated[Union[FloatParam, IntParam, CategoricalParam], Field(discriminator="type")]


class Component(BaseModel):
    """A sampler or pruner: `type` names it, every other key is an argument of its constructor."""

    model_config = ConfigDict(extra="allow")
    type: str

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"type": value} if isinstance(value, str) else value

    @property
    def args(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class TaskSpec(_Model):
    name: str
    args: dict[str, Any] = {}

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value


class CheckpointPolicy(_Model):
    """When trials write checkpoints, how many each keeps, and where the blobs go."""

    every_steps: int | None = Field(None, ge=1)  # also save every this many steps (at log or eval steps)
    on_best: bool = True  # save at every evaluation that improves the trial's best value
    keep_top_k: int = Field(1, ge=1)  # per trial: the latest, plus the k best by the metric
    keep_top_trials: int | None = Field(None, ge=1)  # per study: only the k best finished trials keep checkpoints
    artifacts: bool = True  # upload each finished trial's best checkpoint as an Optuna artifact (dashboard download)
    store: str | None = None  # a folder every worker can read; default: NAME.checkpoints next to the SQLite file

    @property
    def enabled(self) -> bool:
        return self.on_best or self.every_steps is not None


class WarmStartSpec(_Model):
    """Start each trial from the checkpoint of its nearest finished or pruned neighbour (see sweep.warmstart)."""

    def handoff_step(self, max_steps: int, eval_every_steps: int) -> int:
        """The evaluation step nearest below `handoff x max_steps`: every trial keeps a checkpoint there (0: none)."""
        return int(self.handoff * max_steps) // eval_every_steps * eval_every_steps

    enabled: bool = True
    max_distance: float = Field(0.3, gt=0)  # Euclidean, in the search space scaled to [0, 1] per key
    match: list[str] = []  # keys whose values must be equal besides those that change tensor shapes (inferred)
    inherit: Literal["weights", "weights+optimizer"] = "weights"
    handoff: float = Field(0.5, gt=0, lt=1)  # a donor hands its state over at this fraction of its budget
    from_studies: list[str] = []  # other studies in the same storage whose checkpoints may be donors too

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value

    @field_validator("match", mode="after")
    @classmethod
    def _known_keys(cls, value: list[str]) -> list[str]:
        unknown = [key for key in value if not TrainingConfig.is_key(key)]
        if unknown:
            raise ValueError(f"expected TrainingConfig keys, got unknown {', '.join(map(repr, unknown))}")
        return value


class StudySpec(_Model):
    """The validated study file. `source` is where it came from (not a key of the file)."""

    name: str = Field(min_length=1, pattern=r"^[\w.\-]+$")
    description: str = ""
    storage: str | None = None
    direction: Literal["minimize", "maximize"] = "minimize"
    metric: str = "val_loss"
    n_trials: int = Field(ge=1)
    timeout: float | None = Field(None, gt=0)
    seed: int = Field(0, ge=0)
    sampler: Component = Component(type="tpe")
    pruner: Component = Component(type="fastfail", then="median")
    max_repeated_failures: int = Field(5, ge=0)
    heartbeat_interval: int = Field(10, ge=1)
    heartbeat_grace_period: int = Field(60, ge=2)
    checkpoints: CheckpointPolicy = CheckpointPolicy()
    warm_start: WarmStartSpec = WarmStartSpec(enabled=False)
    task: TaskSpec
    fixed: dict[str, Any] = {}
    space: dict[str, Param] = {}

    @field_validator("fixed", mode="after")
    @classmethod
    def _nest_fixed(cls, value: dict[str, Any]) -> dict[str, Any]:
        return nest(value)

    # ---------------------------------------------------------------------------------------------------------------
    def fast_fail(self) -> dict[str, Any]:
        """The trainer's fast-fail settings, taken from the pruner so that the loop's checks and the pruner's
        decisions use the same rules; off when the pruner is not `fastfail`."""
        if self.pruner.type != "fastfail":
            return {"enabled": False}
        known = {f.name for f in dataclasses.fields(FastFailConfig)}
        return {"enabled": True, **{k: v for k, v in self.pruner.args.items() if k in known}}

    def base_config(self) -> dict[str, Any]:
        """Fixed values plus the task and the fast-fail settings, as dotted keys."""
        return {**flatten(self.fixed, free=("model", "task_args")), "task": self.task.name,
                "task_args": dict(self.task.args),
                **{f"fast_fail.{k}": v for k, v in self.fast_fail().items()}}

    def config_for(self, params: Mapping[str, Any]) -> TrainingConfig:
        """The `TrainingConfig` of one trial: fixed values, then the sampled ones."""
        return TrainingConfig.from_dict({**self.base_config(), **params})

    def suggest(self, trial: Any) -> dict[str, Any]:
        """Sample every searched key through an Optuna trial; returns `{dotted key: value}`."""
        return {key: param.suggest(trial, key) for key, param in self.space.items()}

    def stored(self) -> dict[str, Any]:
        """The spec as it is kept on the study. The storage URL is left out: it may hold a password, and a study
        already knows where it lives."""
        return self.model_dump(mode="json", exclude={"storage"})

    def identity(self) -> dict[str, Any]:
        """What makes two runs the same study; the rest (budget, sampler, pruner) may change between resumes."""
        stored = self.stored()
        return {key: stored[key] for key in ("direction", "metric", "task", "fixed", "space")}


# ---------------------------------------------------------------------------------------------------------------------
# Loading.

def read_document(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise StudyFileError(path, [("", f"cannot read the study file: {exc.strerror or exc}")]) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise StudyFileError(path, [("", f"invalid YAML: {where}{problem}")]) from exc
    if not isinstance(data, dict):
        raise StudyFileError(path, [("", f"expected a mapping of study keys, got {type(data).__name__}")])
    return data


PARAM_FIELDS = frozenset({"type", "low", "high", "log", "step", "choices"})


def apply_overrides(document: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`--set key.path=value`: the value is read as YAML (`3`, `1e-3`, `[a, b]`, `true`)."""
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            problems.append(("--set", f"expected key=value, got {item!r}"))
            continue
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError as exc:
            problems.append((f"--set {key}", f"expected a YAML value, but {raw!r} is not one "
                             f"({str(exc).splitlines()[0]})"))
            continue
        node = document
        parts = key.split(".")
        if parts[0] == "space" and len(parts) > 1:
            # Space keys are dotted TrainingConfig names (`model.hidden`): the key is everything up to a
            # parameter's field (`space.model.hidden.low=4`), or all of it (`space.model.hidden={type: ...}`).
            field = parts[-1] if len(parts) > 2 and parts[-1] in PARAM_FIELDS else None
            parts = ["space", ".".join(parts[1:-1] if field else parts[1:]), *([field] if field else [])]
        *parents, leaf = parts
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    if problems:
        raise StudyFileError("command line", problems)
    return document


def load_spec(path: str | Path, overrides: Sequence[str] = (), *, check_trainer: bool = True) -> tuple[StudySpec, Path]:
    """Read, override and validate a study file. Returns the spec and the file's resolved path."""
    path = Path(path)
    document = apply_overrides(read_document(path), overrides)
    document.setdefault("name", path.stem)
    return parse_spec(document, path, check_trainer=check_trainer), path.resolve()


def parse_spec(document: Mapping[str, Any], source: str | Path, *, check_trainer: bool = True) -> StudySpec:
    try:
        spec = StudySpec.model_validate(document)
    except ValidationError as exc:
        raise StudyFileError(source, [_pydantic_problem(error) for error in exc.errors()]) from None
    if check_trainer:
        problems = trainer_problems(spec)
        if problems:
            raise StudyFileError(source, problems)
    return spec


def _pydantic_problem(error: Mapping[str, Any]) -> tuple[str, str]:
    loc = [str(part) for part in error["loc"]
           if not (isinstance(part, str) and part in ("float", "int", "categorical", "function-after[_check()]"))]
    loc = [part for part in loc if not part.startswith(("function-", "tagged-union"))]
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    elif error["type"] == "missing":
        message = "required key is missing"
    elif "input" in error and error["type"] not in ("value_error",) and not isinstance(error["input"], dict):
        message = f"{message}, got {error['input']!r}"
    return ".".join(loc), message


# ---------------------------------------------------------------------------------------------------------------------
# Checks that need the trainer: every fixed value, every searched key and each end of its range.

def trainer_problems(spec: StudySpec) -> list[tuple[str, str]]:
    from sweep.study import component_problems  # the sampler and pruner registries live with the study

    problems: list[tuple[str, str]] = []
    try:
        task = load_task(spec.task.name, spec.task.args)
    except (TaskError, ValueError, OSError) as exc:
        return [("task", str(exc))]

    for key in ("task", "task_args"):
        if key in spec.fixed:
            problems.append((f"fixed.{key}", "set the task and its arguments with the top-level `task:` key"))
    if "fast_fail" in spec.fixed:
        problems.append(("fixed.fast_fail", "configure fast-fail on the pruner: `pruner: {type: fastfail, ...}`"))
    if spec.heartbeat_grace_period < 2 * spec.heartbeat_interval:
        problems.append(("heartbeat_grace_period", f"expected at least twice heartbeat_interval "
                         f"({2 * spec.heartbeat_interval} s), but got {spec.heartbeat_grace_period}: a trial would "
                         "be declared lost while its worker still trains it"))
    base = spec.base_config()
    base_problems = _config_problems(base, task)
    problems += [(f"fixed.{key}", message) for key, message in base_problems]

    fixed_keys = set(flatten(spec.fixed, free=("model", "task_args")))
    for key, param in spec.space.items():
        where = f"space.{key}"
        if not TrainingConfig.is_key(key) or key in ("task", "task_args", "model") or key.startswith("fast_fail."):
            problems.append((where, "not a searchable TrainingConfig key; expected one of: "
                                    + ", ".join(k for k in TrainingConfig.keys()
                                                if k not in ("task", "task_args", "fast_fail"))
                                    + ", model.<key>, task_args.<key>"))
            continue
        if key in fixed_keys:
            problems.append((where, "is both fixed and searched; remove it from one of them"))
            continue
        if key.startswith("model.") and key.removeprefix("model.") not in task.model_defaults:
            problems.append((where, f"unknown key for task {task.name!r}; expected one of: "
                                    + ", ".join(f"model.{k}" for k in sorted(task.model_defaults))))
            continue
        if _expected_type(key, task) is int and isinstance(param, FloatParam):
            problems.append((f"{where}.type", f"{key} takes integers; use type: int"))
            continue
        candidates = ([("low", param.low), ("high", param.high)] if not isinstance(param, CategoricalParam)
                      else [(f"choices[{i}]", c) for i, c in enumerate(param.choices)])
        for label, value in candidates:
            for bad_key, message in _config_problems({**base, key: value}, task):
                if (bad_key, message) not in base_problems:  # caused by this value, not by the fixed ones
                    problems.append((f"{where}.{label}", message if bad_key == key else f"{bad_key}: {message}"))

    schedules = {spec.fixed.get("curriculum", {}).get("schedule", "none")}
    if "curriculum.schedule" in spec.space and isinstance(spec.space["curriculum.schedule"], CategoricalParam):
        schedules |= set(spec.space["curriculum.schedule"].choices)
    if schedules - {"none"} and task.difficulty is None:
        problems.append(("curriculum.schedule", f"task {task.name!r} gives no per-sample difficulty, so it cannot "
                                                "follow a curriculum; use schedule none or a task with difficulty"))
    if spec.warm_start.enabled and not spec.checkpoints.enabled:
        problems.append(("warm_start", "needs checkpoints to start from: set checkpoints.on_best or "
                                       "checkpoints.every_steps"))
    if spec.metric not in task.metric_names:
        problems.append(("metric", f"task {task.name!r} reports {', '.join(task.metric_names)}; got {spec.metric!r}"))
    problems += component_problems(spec)
    return _unique(problems)


def _config_problems(values: dict[str, Any], task: Task) -> list[tuple[str, str]]:
    try:
        config = TrainingConfig.from_dict(values)
    except ConfigError as exc:  # fast_fail.* values come from the pruner, whose own check reports them
        return [(key, message) for key, message in exc.problems if not key.startswith("fast_fail")]
    return task.model_problems(config.model)


def _expected_type(key: str, task: Task) -> type | None:
    """int when the key takes integers (so a float range for it is refused before any trial), else None."""
    head, _, rest = key.partition(".")
    if head == "model":
        default = task.model_defaults.get(rest)
        return type(default) if default is not None else None
    owner: type = TrainingConfig
    while True:  # walk nested config dataclasses: curriculum.stages
        hint = typing.get_type_hints(owner).get(head)
        if rest and dataclasses.is_dataclass(hint):
            owner, (head, _, rest) = hint, rest.partition(".")
            continue
        break
    options = typing.get_args(hint) or (hint,)
    return int if int in options else None


def _unique(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return list(dict.fromkeys(problems))
