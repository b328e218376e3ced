"""The study file's schema: the typed `StudySpec` a YAML file becomes, and reading it (YAML, `--set` overrides,
types and ranges). Checks that need the trainer and the sampler and pruner constructors are `sweep.spec`'s; this
module is what commands that only read a study need (`status`, `trials`), and it imports no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from trainer.config import FastFailConfig, TrainingConfig, flatten, nest

__all__ = ["CategoricalParam", "CheckpointPolicy", "Component", "FloatParam", "IntParam", "Param", "StudyFileError",
           "StudySpec", "TaskSpec", "WarmStartSpec", "apply_overrides", "read_document", "read_spec",
           "resolve_storage_url",
           "validate_document"]

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
    sampler: Component = Field(default_factory=lambda: Component.model_validate("tpe"))
    pruner: Component = Field(default_factory=lambda: Component.model_validate({"type": "fastfail", "then": "median"}))
    max_repeated_failures: int = Field(5, ge=0)
    heartbeat_interval: int = Field(10, ge=1)
    heartbeat_grace_period: int = Field(60, ge=2)
    storage_patience: float = Field(600.0, gt=0)  # seconds a worker waits out an unreachable storage
    checkpoints: CheckpointPolicy = Field(default_factory=lambda: CheckpointPolicy.model_validate({}))
    warm_start: WarmStartSpec = Field(default_factory=lambda: WarmStartSpec.model_validate({"enabled": False}))
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

def read_spec(path: str | Path, overrides: Sequence[str] = ()) -> tuple[StudySpec, Path]:
    """Read, override and type-check a study file, without the checks that need the trainer (`sweep.spec.load_spec`
    adds them). Returns the spec and the file's resolved path."""
    path = Path(path)
    document = apply_overrides(read_document(path), overrides)
    document.setdefault("name", path.stem)
    return validate_document(document, path), path.resolve()


def validate_document(document: Mapping[str, Any], source: str | Path) -> StudySpec:
    try:
        return StudySpec.model_validate(document)
    except ValidationError as exc:
        raise StudyFileError(source, [_pydantic_problem(error) for error in exc.errors()]) from None


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


def resolve_storage_url(spec: StudySpec, spec_path: Path | None, override: str | None = None) -> str:
    """`--storage` wins, then the file's `storage:`, then a SQLite file next to the study file. A relative SQLite path
    in the file is relative to the file, so a study runs the same from any working directory."""
    if override:
        return override
    if spec.storage is None:
        folder = spec_path.parent if spec_path is not None else Path.cwd()
        return f"sqlite:///{(folder / f'{spec.name}.db').resolve()}"
    if spec.storage.startswith("sqlite:///") and spec_path is not None:
        path = spec.storage.removeprefix("sqlite:///")
        if path and not path.startswith("/") and path != ":memory:":
            return f"sqlite:///{(spec_path.parent / path).resolve()}"
    return spec.storage
