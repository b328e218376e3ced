"""The study file's schema: the typed `StudySpec` a YAML file becomes, and reading it (YAML, `--set` overrides,
types and ranges). Checks that need the trainer and the sampler and pruner constructors are `sweep.spec`'s; this
module is what commands that only read a study need (`status`, `trials`), and it imports no torch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import decimal
import math
import os
import re
import sys
import tempfile
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union
from urllib.parse import unquote, urlparse

from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from sweep.urls import SQLITE_URL, expand_home, mask_url, mask_urls, sqlite_path, sqlite_url
from trainer import yaml_file
from trainer.config import (
    FastFailConfig,
    TrainingConfig,
    clash,
    flatten,
    magnitude,
    nest,
    number_from_text,
    overrides_clash,
)
from trainer.messages import did_you_mean, has_control
from trainer.yaml_file import MAX_DEPTH, MAX_FILE_BYTES, MAX_VALUES, short_repr

__all__ = ["MAX_DEPTH", "MAX_FILE_BYTES", "MAX_VALUES", "CategoricalParam", "CheckpointPolicy", "Component",
           "FloatParam", "IntParam", "K8sSpec", "LaunchSpec", "MLflowSpec", "Param", "ResourcesSpec", "SlurmSpec",
           "StudyFileError", "StudySpec", "TaskSpec", "TensorBoardSpec", "TrackingSpec", "WarmStartSpec",
           "apply_overrides", "did_you_mean", "load_yaml", "long_name_problem", "name_problem", "read_document",
           "read_spec", "resolve_storage_url", "short_repr", "sqlite_file_problem", "sqlite_study_problem",
           "storage_url_problem", "store_url_problem", "validate_document", "with_options"]

FORMS = ("task", "loop", "command")  # what a trial runs: exactly one of them in a study file
_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class StudyFileError(Exception):
    """Bad input in a study file: every problem as `(key path, message)`, reported together."""

    def __init__(self, source: str | Path, problems: Sequence[tuple[str, str]]) -> None:
        self.source = str(source)
        self.problems = list(problems)
        super().__init__("\n".join(self.lines()))

    def lines(self, overridden: Collection[str] = ()) -> list[str]:
        """One line per problem. `overridden`: the keys `--set` gave, whose values (and those inside them) are the
        command line's, not the file's: their lines start `command line: --set KEY:`, as for a `--set` that does not
        parse."""
        def where(key: str, message: str) -> str:
            if any(key == k or key.startswith((f"{k}.", f"{k}[")) for k in overridden):
                return f"command line: --set {key}"
            inside = [k for k in overridden if key and k.startswith((f"{key}.", f"{key}["))]  # a range and its low
            # A searched key's fields are read together: `--set space.lr.type=int` makes the file's `low` wrong.
            inside += [k for k in overridden if k.startswith("space.") and k.rpartition(".")[2] in PARAM_FIELDS
                       and key.startswith(f"{k.rpartition('.')[0]}.") and k not in inside]
            # A searched key and a fixed one are one problem where one holds the other (both fixed and searched, a
            # searched key inside a fixed value), whichever of them --set gave, or a mapping that holds it.
            head, _, rest = key.partition(".")
            other = "fixed" if head == "space" else "space"
            inside += [k for k in overridden if head in ("space", "fixed") and k not in inside and rest and (
                k == other or (k.startswith(f"{other}.") and _holds(k.partition(".")[2], rest)))]
            return f"{self.source}: {key}{f' (with --set {inside[0]})' if inside else ''}" if key else self.source

        return [f"{where(key, message)}: {message}" for key, message in self.problems]


def _holds(one: str, other: str) -> bool:
    """Whether dotted key `one` is `other`, or one of them holds the other (`opt` and `opt.lr`)."""
    return one == other or other.startswith(f"{one}.") or one.startswith(f"{other}.")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


_ModelT = TypeVar("_ModelT", bound=_Model)


def _not_a_bool(value: Any) -> Any:
    """YAML's `true` is not 1: a number field refuses it (pydantic's lax mode would take it), and text that is not
    YAML's notation of a number (`1_000`, `" 0.5 "`, which float() takes)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {short_repr(value)}")
    if isinstance(value, str) and number_from_text(value) is None and _python_float(value):
        # Text float() takes that is not YAML's notation (`1_000`, `" 0.5 "`); other text is pydantic's to refuse.
        raise ValueError("Input should be a valid number (as YAML writes one: 1000, 1e3, 0.5), got "
                         f"{short_repr(value)}")
    return value


def _python_float(text: str) -> bool:
    """Whether float() reads `text` as a finite number (`'inf'` and `'nan'` are pydantic's to refuse, as not finite)."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


# A finite number: an int, a float or a string that reads as one (the YAML loader reads `1e-3` as a number itself:
# see `_exponent`); not a bool, not .inf or .nan (a range end of .inf fails every trial).
Number = Annotated[float, BeforeValidator(_not_a_bool), AllowInfNan(False)]
SEED_MAX = 2**32 - 1  # numpy's and therefore every Optuna sampler's limit


class FloatParam(_Model):
    type: Literal["float"]
    low: Number
    high: Number
    log: StrictBool = False
    step: Number | None = Field(None, gt=0)

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
    log: StrictBool = False
    step: StrictInt = Field(1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> IntParam:
        _check_range(self.low, self.high, self.log, None if self.step == 1 else self.step)
        return self

    def suggest(self, trial: Any, name: str) -> int:
        return trial.suggest_int(name, self.low, self.high, log=self.log, step=self.step)


def _plain_choice(value: Any) -> Any:
    """A categorical choice is a plain value: a number (finite), a string, true/false or null. One check, so a bad
    choice is one line (a union of types would report one per type)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value}")
    if isinstance(value, (list, dict)):  # layer sizes, say: the model must take a name for them
        raise ValueError(f"expected one plain value (a number, a string, true/false or null: Optuna keeps one per "
                         f"parameter), got {short_repr(value)}; to search among lists, give each a name (choices: "
                         f"['64', '128x128']), take a name in model_defaults too, and turn it into the list in "
                         f"build_model")
    if value is not None and not isinstance(value, (bool, int, float, str)):
        raise ValueError(f"expected a number, a string, true/false or null, got {short_repr(value)}")
    return value


Choice = Annotated[Any, AfterValidator(_plain_choice)]


class CategoricalParam(_Model):
    type: Literal["categorical"]
    choices: list[Choice] = Field(min_length=1)

    @model_validator(mode="after")
    def _distinct(self) -> CategoricalParam:
        """Optuna stores a choice as the index of the first choice equal to it, and to Python `0 == false` and
        `1 == 1.0`: a trial that trained with `false` would be stored, shown and sampled as `0`."""
        first: dict[Choice, int] = {}  # plain values hash alike where they compare equal (0, 0.0 and false)
        for j, choice in enumerate(self.choices):
            i = first.setdefault(choice, j)
            if i != j:
                same = "is listed twice" if type(self.choices[i]) is type(choice) else (
                    f"equals choices[{i}] ({short_repr(self.choices[i])}) to Optuna, which would store it as that")
                raise ValueError(f"choices[{j}]: {short_repr(choice)} {same}; expected distinct choices")
        return self

    def suggest(self, trial: Any, name: str) -> Any:
        return trial.suggest_categorical(name, self.choices)


def _check_range(low: float, high: float, log: bool, step: float | None) -> None:
    if low > high:
        raise ValueError(f"expected low <= high, got low={low}, high={high}")
    if log and low <= 0:
        raise ValueError(f"log: true needs low > 0, got low={low}")
    if log and step is not None:
        raise ValueError("log: true and step cannot be combined")
    whole = all(isinstance(v, int) for v in (low, high)) and (step is None or isinstance(step, int))
    if whole and max(abs(low), abs(high)) > 2**53:
        raise ValueError(f"expected integers within +-2^53 (Optuna keeps a parameter's value as a float), got "
                         f"low={_short_number(low)}, high={_short_number(high)}")
    try:
        width = float(high) - float(low)
    except OverflowError:
        width = math.inf
    if not math.isfinite(width):
        raise ValueError(f"the range from {_short_number(low)} to {_short_number(high)} is too wide to sample "
                         "(high - low overflows)")
    if step is None:
        return
    if whole:  # Optuna's own rule, in exact arithmetic: the range is narrowed to the last multiple of step
        remainder: Any = (high - low) % step
    else:
        try:  # Optuna counts a float range's steps in Python's decimals (28 digits): more raise InvalidOperation
            remainder = (decimal.Decimal(str(high)) - decimal.Decimal(str(low))) % decimal.Decimal(str(step))
        except decimal.InvalidOperation:
            raise ValueError(f"expected a step that divides high - low = {width:g} into fewer than 10^28 steps "
                             f"(Optuna counts them in 28 decimal digits), got step {_short_number(step)}") from None
    if remainder != 0:  # Optuna would narrow the range to the last multiple, with a warning
        last = high - remainder if whole else float(decimal.Decimal(str(high)) - remainder)
        raise ValueError(f"expected high - low to be a multiple of step, got high - low = {width:g} and step "
                         f"{_short_number(step)} (Optuna would sample up to {_short_number(last)} only)")


def _short_number(value: Any) -> str:
    """A number for a message: a whole number of hundreds of digits shortened."""
    if isinstance(value, int) and abs(value) >= 10**15:
        return f"{'-' if value < 0 else ''}{magnitude(abs(value))}"
    return str(value)


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

    every_steps: StrictInt | None = Field(None, ge=1)  # also save every this many steps (at log or eval steps)
    # also save at the first log or eval step once this many seconds (wall clock) have passed since the trial's last
    # checkpoint or its start: long trials on preemptible machines lose at most this much (plus one log interval)
    every_seconds: Number | None = Field(None, gt=0)
    on_best: StrictBool = True  # save at every evaluation that improves the trial's best value
    keep_top_k: StrictInt = Field(1, ge=1)  # per trial: the latest, plus the k best by the metric
    keep_top_trials: StrictInt | None = Field(None, ge=1)  # per study: only the k best finished trials keep some
    artifacts: StrictBool = True  # upload each finished trial's best checkpoint as an Optuna artifact (dashboard)
    store: Printable | None = None  # a folder every worker can read; default: NAME.checkpoints next to the SQLite file

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        """`checkpoints: false` (or YAML's `off`, `no`): trials write none; `true`: the defaults."""
        return ({} if value else {"on_best": False}) if isinstance(value, bool) else value

    @field_validator("store", mode="after")
    @classmethod
    def _store_url(cls, value: str | None) -> str | None:
        problem = None if value is None else store_url_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @property
    def enabled(self) -> bool:
        return self.on_best or self.every_steps is not None or self.every_seconds is not None


class WarmStartSpec(_Model):
    """Start each trial from the checkpoint of its nearest finished or pruned neighbour (see sweep.warmstart)."""

    def handoff_step(self, max_steps: int, eval_every_steps: int) -> int:
        """The evaluation step nearest below `handoff x max_steps`: every trial keeps a checkpoint there (0: none)."""
        return int(self.handoff * max_steps) // eval_every_steps * eval_every_steps

    enabled: StrictBool = True
    max_distance: Number = Field(0.3, gt=0)  # Euclidean, in the search space scaled to [0, 1] per key
    match: list[StrictStr] = []  # keys whose values must be equal besides those that change tensor shapes (inferred)
    inherit: Literal["weights", "weights+optimizer"] = "weights"
    handoff: Number = Field(0.5, gt=0, lt=1)  # a donor hands its state over at this fraction of its budget
    # Other studies in the same storage whose checkpoints may be donors too: sweep's studies, so names as `name` takes.
    from_studies: list[Annotated[StrictStr, AfterValidator(_study_name)]] = []
    confirm: StrictInt = Field(0, ge=0)  # the last K trials of the budget retrain the best K warm trials cold

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value

    def unknown_keys(self) -> list[str]:
        """`match` keys that are not `TrainingConfig` keys (for a `task` study; a `loop` or `command` names its own)."""
        return [key for key in self.match if not TrainingConfig.is_key(key)]


# Slurm's own syntax for what goes into `#SBATCH` lines: checked here so that nothing else can reach the script.
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(,[A-Za-z0-9_.\-]+)*$")  # partitions, accounts, QOS (comma lists)
# ASCII digits (`\d` takes any script's: '٩٠' reached the script, where sbatch refuses it).
# Slurm keeps a time limit in minutes, 32 bits: at most 99,999 days or 999,999,999 minutes (`1e308` was 309 digits).
_SLURM_TIME = re.compile(r"^(\d{1,5}-\d{1,2}(:\d{1,2}(:\d{1,2})?)?|\d{1,9}(:\d{1,2}(:\d{1,2})?)?)$", re.ASCII)
_SLURM_MEM = re.compile(r"^\d+[KMGT]$", re.ASCII)  # with its unit: a bare '16' is 16 MB to Slurm
_SBATCH_LINE = re.compile(r"^--?[A-Za-z][A-Za-z0-9\-]*([= ][^\n\r]*)?$")


def _matching(pattern: re.Pattern[str], expected: str) -> AfterValidator:
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"expected {expected}, got {short_repr(value)}")
        return value

    return AfterValidator(check)


SlurmName = Annotated[StrictStr, _matching(_SLURM_NAME, "a Slurm name (letters, digits, '_', '-', '.')")]
def _minutes_text(value: Any) -> Any:
    """`time: 90` is 90 minutes, as sbatch reads `--time=90`. (A memory size stays text: `mem: 16` would be 16 MB to
    Slurm, hardly what was meant; its unit is asked for.)"""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


SlurmTime = Annotated[StrictStr, BeforeValidator(_minutes_text),
                      _matching(_SLURM_TIME, "a Slurm time such as 90, 4:00:00 or 2-12:00:00")]
SlurmMem = Annotated[StrictStr, _matching(_SLURM_MEM, "a Slurm memory size with its unit (K, M, G or T) such as 16G "
                                                      "or 4000M")]

# Kubernetes' own names (RFC 1123), checked here so that nothing else reaches the manifest: a namespace is a DNS
# label, a Secret's name a DNS subdomain.
_K8S_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"


def _k8s_subdomain(value: str) -> str:
    if len(value) > 253:
        raise ValueError(f"expected a Kubernetes Secret name of at most 253 characters, got {len(value)}")
    return value


K8sNamespace = Annotated[StrictStr, _matching(re.compile(_K8S_LABEL), "a Kubernetes namespace (at most 63 "
                                              "lowercase letters, digits and '-', starting and ending with a letter "
                                              "or digit)")]
# A Kubernetes resource quantity (8Gi, 512Mi, 1.5G, 1e9) and a container image reference (no space or control
# character: a manifest would carry it into YAML as something else).
# No sign: a resource request is never negative (the API server refuses the manifest).
_K8S_QUANTITY = re.compile(r"\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?")
K8sQuantity = Annotated[StrictStr, _matching(_K8S_QUANTITY, "a Kubernetes quantity such as 8Gi, 512Mi or 2G")]
K8sImage = Annotated[StrictStr, _matching(re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]*"), "a container image reference "
                                          "such as registry.example.org/team/sweep:1.0 (no spaces)")]
K8sSecretName = Annotated[StrictStr, AfterValidator(_k8s_subdomain),
                          _matching(re.compile(rf"{_K8S_LABEL}(\.{_K8S_LABEL})*"), "a Kubernetes Secret name "
                                    "(lowercase letters, digits, '-' and '.', starting and ending with a letter or "
                                    "digit)")]


# sbatch options the batch script sets itself, and what each is for: given again in `launch.slurm.sbatch`, the later
# line would win in silence, and `sweep status` and `sweep stop` would count other tasks, read other logs, or lose
# preemption. Long names also match their abbreviations (sbatch takes any unambiguous prefix); short ones by letter.
_SWEEPS_SBATCH = {
    "array": "the array is one task per worker: launch.slurm.workers (--workers)",
    "output": "the logs go where `sweep status` reads them: launch.slurm.log_dir",
    "error": "errors go in each task's one log, whose end `sweep status` shows: launch.slurm.log_dir",
    "open-mode": "a requeued task appends to its log",
    "requeue": "preempted tasks are requeued to continue the study",
    "no-requeue": "preempted tasks are requeued to continue the study",
    "signal": "the warning before the time limit: launch.slurm.warning_s (--warning-s)",
    "export": "the workers need the submitting shell's environment (PATH, the virtual environment)",
    "time": "launch.slurm.time (--time), which is checked against warning_s",
    "gpus": "launch.slurm.gpus_per_task (--gpus-per-task), which decides the workers per task",
    "gpus-per-task": "launch.slurm.gpus_per_task (--gpus-per-task), which decides the workers per task",
    "gpus-per-node": "launch.slurm.gpus_per_task (--gpus-per-task), which decides the workers per task",
    "gpus-per-socket": "launch.slurm.gpus_per_task (--gpus-per-task), which decides the workers per task",
    "tres-per-task": "launch.slurm.gpus_per_task (--gpus-per-task), which decides the workers per task",
    "gres": "launch.slurm.gpus_per_task (--gpus-per-task), which decides the workers per task, and gpu_type for a "
            "GPU type (--gres=gpu:TYPE:G)",
    # What would make `sweep submit` report a job that does not run as the study's workers (review: --test-only
    # submitted nothing, and the study recorded an empty job id: `sweep status` then listed every job of the cluster).
    "test-only": "the job array is submitted; `sweep submit --dry-run` prints its script without submitting it",
    "wrap": "the job runs the batch script, the study's worker",
    "wait": "`sweep submit` returns once the job array is queued",
}
_SWEEPS_SHORT = {"a": "array", "o": "output", "e": "error", "t": "time", "G": "gpus", "W": "wait"}
_SHORT_FLAGS = set("HhOQsvVWk")  # sbatch's short options without an argument: `-Ho x` is `-H -o x`


def _sbatch_line(value: str) -> str:
    line = value.strip().removeprefix("#SBATCH").strip()
    if not _SBATCH_LINE.fullmatch(line):
        raise ValueError(f"expected one sbatch option such as --constraint=a100, got {short_repr(value)}")
    name = re.split(r"[= ]", line, maxsplit=1)[0]
    owned: str | None = None
    if name.startswith("--"):
        given = name[2:]
        owned = given if given in _SWEEPS_SBATCH else next(
            (own for own in _SWEEPS_SBATCH if len(given) >= 2 and own.startswith(given)), None)
        # sbatch takes the value without its quotes: `--gres="gpu:2"` is --gres=gpu:2 (review: it got past)
        value = re.sub(r"[\"']", "", line[len(name):]).lstrip("= ")
        if owned in ("gres", "tres-per-task") and not re.search(r"(^|,)\s*(gres/)?gpu\b", value):
            owned = None  # other generic resources (--gres=nvme:1, --tres-per-task=cpu=4) are the user's
    else:  # a cluster of short options: flags without an argument, then at most one that takes the rest
        for letter in name[1:]:
            owned = _SWEEPS_SHORT.get(letter)
            if owned is not None or letter not in _SHORT_FLAGS:
                break
    if owned is not None:
        shown = name if name == f"--{owned}" else f"{name} (--{owned})"
        raise ValueError(f"expected an option the batch script does not set itself, got {shown}, which sweep sets: "
                         f"{_SWEEPS_SBATCH[owned]}")
    return line


def slurm_seconds(value: str) -> int:
    """A Slurm time (`90`, `90:30`, `4:00:00`, `2-12`, `2-12:30`, `2-12:30:15`, as `_SLURM_TIME` checks it) in
    seconds; 0 is no limit."""
    days, _, clock = value.rpartition("-")
    parts = [int(part) for part in clock.split(":")]
    if days:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
    else:  # minutes, minutes:seconds, hours:minutes:seconds
        hours, minutes, seconds = ([0] * (3 - len(parts)) + parts) if len(parts) == 3 else (0, *(parts + [0])[:2])
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def _printable(value: str) -> str:
    """A path or URL with no control character: NUL made every command that resolved it a traceback ("embedded
    null byte"), a newline made a folder no listing shows as named, and a newline in `launch.slurm.log_dir` ended a
    line of the batch script, so that what followed it ran as a command."""
    if has_control(value):
        shown = mask_urls(value)  # a storage URL's password is never shown (`scheme:/user:pw@` too)
        raise ValueError(f"expected a path or URL without control characters (a newline, a tab, NUL), got "
                         f"{short_repr(shown)}")
    return value


Printable = Annotated[StrictStr, AfterValidator(_printable)]


def _folder_given(value: str) -> str:
    """A folder named: '' was taken for the default without a word (leave the key out for that)."""
    if not value.strip():
        raise ValueError(f"expected a folder, got {short_repr(value)}; leave the key out for the default")
    return value


class SlurmSpec(_Model):
    """`launch.slurm`: how `sweep submit --slurm` asks Slurm for the workers (see sweep.launch.slurm)."""

    # Array tasks, one `sweep run` worker each (G with gpus_per_task: G); Slurm's MaxArraySize is at most 4000001.
    workers: StrictInt = Field(1, ge=1, le=4_000_000)
    partition: SlurmName | None = None
    time: SlurmTime | None = None
    account: SlurmName | None = None
    qos: SlurmName | None = None
    mem: SlurmMem | None = None
    cpus_per_task: StrictInt | None = Field(None, ge=1, le=1_000_000)
    gpus_per_task: StrictInt = Field(0, ge=0, le=1024)  # G GPUs per array task, one worker pinned to each
    gpu_type: SlurmName | None = None  # with gpus_per_task: `--gres=gpu:TYPE:G` (a100, h100: the cluster's names)
    # Slurm's warning this many s before the time limit (at most); checked against `time` also when not given
    warning_s: StrictInt = Field(120, ge=1, le=65535, validate_default=True)
    log_dir: Annotated[Printable, AfterValidator(_folder_given)] | None = None  # default NAME.slurm next to the
    # study file; on a path every node sees
    sbatch: list[Annotated[StrictStr, AfterValidator(_sbatch_line)]] = []  # extra `#SBATCH` options, one each

    @field_validator("warning_s", mode="after")
    @classmethod
    def _warned_in_time(cls, value: int, info: ValidationInfo) -> int:
        """A time limit no longer than the warning would have Slurm warn each task as it starts: it would requeue
        itself over and over and train nothing."""
        limit = info.data.get("time")
        if limit is not None and 0 < (seconds := slurm_seconds(limit)) <= value:
            raise ValueError(f"expected fewer seconds than the time limit launch.slurm.time {limit} ({seconds} s), "
                             f"got {value}: each task would be warned as it starts and requeue itself, training "
                             "nothing; give a longer time, or a smaller warning_s")
        return value


class K8sSpec(_Model):
    """`launch.k8s`: the Indexed Job manifest of `sweep submit --k8s` (see sweep.launch.k8s)."""

    workers: StrictInt = Field(1, ge=1, le=100_000)  # an Indexed Job's completions: at most 10^5
    image: K8sImage | None = None  # an image with sweep installed; required, here or with --image
    namespace: K8sNamespace | None = None
    secret: K8sSecretName = "sweep-storage"  # the Secret whose key `url` holds the storage URL
    gpus_per_worker: StrictInt = Field(0, ge=0, le=1024)
    cpus_per_worker: Number | None = Field(None, ge=0.001, le=100_000)  # Kubernetes counts CPU in thousandths (1m)
    memory: K8sQuantity | None = None  # a Kubernetes quantity such as 8Gi
    grace_period_s: StrictInt = Field(120, ge=1, le=604_800)  # SIGTERM to SIGKILL when a pod is evicted or preempted


class LaunchSpec(_Model):
    """`launch`: defaults of `sweep submit`; its command-line options win."""

    slurm: SlurmSpec = Field(default_factory=lambda: SlurmSpec.model_validate({}))
    k8s: K8sSpec = Field(default_factory=lambda: K8sSpec.model_validate({}))


class ExecutionSpec(_Model):
    """How a worker runs its trials: one at a time, or `cohort` of them at once as one stacked model (`auto`: as many
    as the device's free memory holds). `ramp`: the first cohort holds only the trials the pruner waits for before it
    judges any (its `n_startup_trials`), so no more trials escape it than one at a time would let escape, at the cost
    of a partly empty device until they have completed (see sweep.cohort)."""

    cohort: Any = 1  # an int >= 1 or "auto": one check, so a bad value is one line
    ramp: StrictBool = False

    @field_validator("cohort", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int | str:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f"expected a number of trials (at least 1) or 'auto', got {short_repr(value)}")

    def cohort_size(self) -> int:
        """The cohort size; 0 for `auto`."""
        return 0 if self.cohort == "auto" else int(self.cohort)


class ResourcesSpec(_Model):
    """`resources`: what one trial takes. `devices_per_trial: N` trains each trial data-parallel on N devices (N
    processes, DDP; gloo on a CPU): the worker runs rank 0 and starts the other N-1 (see trainer.distributed).
    `collective_timeout_s`: how long a rank waits in a collective for one that neither answers nor closes its
    connection (a hung rank) before the trial fails."""

    devices_per_trial: StrictInt = Field(1, ge=1)
    collective_timeout_s: Number = Field(300.0, gt=0, le=604_800)  # at most a week


class TensorBoardSpec(_Model):
    """One TensorBoard run per trial: `DIR/<study>/trial-NNNNN/` (see sweep.tracking)."""

    enabled: StrictBool = True
    # Default: NAME.tensorboard/ next to the SQLite file (sweep-tensorboard/ for a server).
    dir: Annotated[StrictStr, Field(min_length=1), AfterValidator(_printable)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value


class MLflowSpec(_Model):
    """One MLflow run per trial, nested under one run for the study (see sweep.tracking)."""

    enabled: StrictBool = True
    # default: sqlite:///NAME.mlflow.db next to the SQLite file
    tracking_uri: Annotated[StrictStr, Field(min_length=1), AfterValidator(_printable)] | None = None
    experiment: Annotated[StrictStr, Field(min_length=1)] | None = None  # default: the study's name

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value

    @field_validator("experiment", mode="after")
    @classmethod
    def _experiment_name(cls, value: str | None) -> str | None:
        # MLflow refuses a blank name and one over 500 characters at every trial's start, each trial warning that
        # its tracking was dropped (review); a control character makes a name no UI shows as given.
        if value is not None and (not value.strip() or len(value) > MLFLOW_EXPERIMENT_LIMIT or has_control(value)):
            raise ValueError(f"expected an MLflow experiment's name: not blank, at most {MLFLOW_EXPERIMENT_LIMIT} "
                             f"characters, no control character, got {short_repr(value)}")
        return value


MLFLOW_EXPERIMENT_LIMIT = 500  # characters: MLflow's MAX_EXPERIMENT_NAME_LENGTH


class TrackingSpec(_Model):
    """Where every trial's logged metrics also go, besides the study's storage. Both off by default."""

    tensorboard: TensorBoardSpec = Field(default_factory=lambda: TensorBoardSpec.model_validate(False))
    mlflow: MLflowSpec = Field(default_factory=lambda: MLflowSpec.model_validate(False))


class StudySpec(_Model):
    """The validated study file. `source` is where it came from (not a key of the file)."""

    name: StrictStr
    description: StrictStr = ""
    storage: Printable | None = None
    storage_password_env: StrictStr | None = None  # the environment variable that holds the storage password
    direction: Literal["minimize", "maximize"] = "minimize"
    metric: StrictStr = "val_loss"
    n_trials: StrictInt = Field(ge=1, le=2**63 - 1)  # a count the storage holds in 64 bits
    timeout: Number | None = Field(None, gt=0)
    seed: StrictInt = Field(0, ge=0, le=SEED_MAX)
    sampler: Component = Field(default_factory=lambda: Component.model_validate("tpe"))
    pruner: Component = Field(default_factory=lambda: Component.model_validate({"type": "fastfail", "then": "median"}))
    max_repeated_failures: StrictInt = Field(5, ge=0)
    # At most a day of silence before a trial counts as lost (longer ones overflow the heartbeat thread's wait).
    heartbeat_interval: StrictInt = Field(10, ge=1, le=43_200)
    heartbeat_grace_period: StrictInt = Field(60, ge=2, le=86_400)
    storage_patience: Number = Field(600.0, gt=0)  # seconds a worker waits out an unreachable storage
    # seconds a `command` told to stop has before its group is killed: at most a day (1e308 read as "never": a command
    # that ignored SIGTERM then held --timeout and Ctrl-C forever, review)
    stop_grace_period: Number = Field(10.0, gt=0, le=86_400)
    checkpoints: CheckpointPolicy = Field(default_factory=lambda: CheckpointPolicy.model_validate({}))
    warm_start: WarmStartSpec = Field(default_factory=lambda: WarmStartSpec.model_validate({"enabled": False}))
    tracking: TrackingSpec = Field(default_factory=lambda: TrackingSpec.model_validate({}))
    execution: ExecutionSpec = Field(default_factory=lambda: ExecutionSpec.model_validate({}))
    # What each trial runs: exactly one of the built-in trainer's `task`, a user's `loop` function
    # (`package.module:function`, called as `main(config, run)`, see sweep.runners.loop) or a user's `command`.
    task: TaskSpec | None = None
    loop: StrictStr | None = None
    command: StrictStr | None = None
    fixed: dict[str, Any] = {}
    space: dict[str, Param] = {}
    launch: LaunchSpec = Field(default_factory=lambda: LaunchSpec.model_validate({}))
    # Last: its check reads the form and the execution, validated above.
    resources: ResourcesSpec = Field(default_factory=lambda: ResourcesSpec.model_validate({}))

    @field_validator("name", mode="after")
    @classmethod
    def _folder_name(cls, value: str) -> str:
        problem = name_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("metric", mode="after")
    @classmethod
    def _metric_name(cls, value: str) -> str:
        # A loop's or a command's metrics are its own, checked only as it reports: an empty name made every trial
        # fail, and the study, created with it, refused the corrected file (review).
        if not value.strip() or value != value.strip() or has_control(value):
            raise ValueError(f"expected a metric's name (val_loss, say): not empty, no surrounding spaces and no "
                             f"control character, got {short_repr(value)}")
        return value

    @field_validator("storage", mode="after")
    @classmethod
    def _storage_url(cls, value: str | None) -> str | None:
        problem = None if value is None else storage_url_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("storage_password_env", mode="after")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise ValueError(f"expected the name of an environment variable (letters, digits, _), got "
                             f"{short_repr(value)}")
        return value

    @field_validator("loop", mode="after")
    @classmethod
    def _loop_name(cls, value: str | None) -> str | None:
        if value is not None and not _FUNCTION.fullmatch(value):
            raise ValueError(f"expected package.module:function, got {short_repr(value)}")
        return value

    @model_validator(mode="after")
    def _one_form(self) -> StudySpec:
        given = [form for form in FORMS if getattr(self, form) is not None]
        if not given:  # reported as the missing `task` key it has always been (`_pydantic_problem`)
            raise PydanticCustomError("missing_form", "required key is missing (or give loop: package.module:function, "
                                      "or command: a command line)")
        if len(given) > 1:
            raise ValueError(f"expected exactly one of task, loop, command (what each trial runs), got "
                             f"{', '.join(given)}")
        return self

    @field_validator("resources", mode="after")
    @classmethod
    def _data_parallel(cls, value: ResourcesSpec, info: ValidationInfo) -> ResourcesSpec:
        n = value.devices_per_trial
        if n == 1:
            return value
        form = next((form for form in ("loop", "command") if info.data.get(form) is not None), None)
        if form is not None:
            raise ValueError(f"devices_per_trial: {n} trains the built-in trainer (task:) data-parallel; a {form} "
                             "study's trial runs as one process: use devices_per_trial: 1")
        execution = info.data.get("execution")
        if execution is not None and execution.cohort != 1:
            raise ValueError(f"devices_per_trial: {n} and execution.cohort: {execution.cohort} do not go together "
                             "(a cohort packs many trials onto one device, a data-parallel trial spreads one over "
                             "several): use one of them")
        searched = (info.data.get("space") or {}).get("batch_size")
        if isinstance(searched, IntParam) and (searched.low % n or (searched.low < searched.high and (
                searched.step % n or searched.log))):
            raise ValueError(f"devices_per_trial: {n} splits each global batch evenly between the ranks: the "
                             f"batch_size range [{searched.low}, {searched.high}] draws values that are not multiples "
                             f"of {n}; use a low that is one and step: {n} (not log: true)")
        if searched is not None:
            choices = getattr(searched, "choices", None) or []
            uneven = [c for c in choices if isinstance(c, int) and not isinstance(c, bool) and c % n]
            if uneven:
                raise ValueError(f"devices_per_trial: {n} splits each global batch evenly between the ranks: the "
                                 f"batch_size choices {uneven} are not multiples of {n}")
            return value
        default = next(f.default for f in dataclasses.fields(TrainingConfig) if f.name == "batch_size")
        batch = (info.data.get("fixed") or {}).get("batch_size", default)
        if isinstance(batch, int) and batch % n:
            raise ValueError(f"devices_per_trial: {n} splits each global batch evenly between the ranks: batch_size "
                             f"{batch} is not a multiple of {n}")
        return value

    @field_validator("fixed", mode="after")
    @classmethod
    def _nest_fixed(cls, value: dict[str, Any]) -> dict[str, Any]:
        """The fixed values nested (`model.hidden: 8` is `model: {hidden: 8}`), refused when two of them set the same
        value (`model: {hidden: 8}` and `model.hidden: 16`) or one sits inside another (`a: 1` and `a.b: 2`): one of
        them would silently be dropped."""
        if (problem := clash(value, "fixed.")) is not None:
            raise ValueError(problem)
        return nest(value)

    # ---------------------------------------------------------------------------------------------------------------
    @property
    def form(self) -> Literal["task", "loop", "command"]:
        """What each trial runs: the built-in trainer (`task`), a user's loop function, or a user's command."""
        return "loop" if self.loop is not None else "command" if self.command is not None else "task"

    def user_config(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The config a `loop` or `command` trial gets: the fixed values, then the sampled ones, nested as plain data
        (`model.hidden` becomes `{"model": {"hidden": ...}}`); keys of the user's own."""
        return nest({**flatten(self.fixed), **params})

    def fast_fail(self) -> dict[str, Any]:
        """The trainer's fast-fail settings, taken from the pruner so that the loop's checks and the pruner's
        decisions use the same rules; off when the pruner is not `fastfail`."""
        if self.pruner.type != "fastfail":
            return {"enabled": False}
        known = {f.name for f in dataclasses.fields(FastFailConfig)}
        return {"enabled": True, **{k: v for k, v in self.pruner.args.items() if k in known}}

    def base_config(self) -> dict[str, Any]:
        """Fixed values plus the task and the fast-fail settings, as dotted keys (a `task` study's)."""
        assert self.task is not None, "base_config is the built-in trainer's: a study with `task`"
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
        stored = self.model_dump(mode="json", exclude={"storage"})
        uri = stored["tracking"]["mlflow"]["tracking_uri"]
        if uri is not None:  # a server URI may hold a password too
            stored["tracking"]["mlflow"]["tracking_uri"] = mask_url(uri)
        return stored

    def identity(self) -> dict[str, Any]:
        """What makes two runs the same study; the rest (budget, sampler, pruner) may change between resumes."""
        stored = self.stored()
        return {key: stored[key] for key in ("direction", "metric", *FORMS, "fixed", "space")}


# ---------------------------------------------------------------------------------------------------------------------
# Reading a study file: bytes, then YAML (`trainer.yaml_file`, the rules `python -m trainer` reads its config by
# too), then the schema.

def read_text(path: Path) -> str:
    """The study file as text (`trainer.yaml_file.read_text`), its problems as a `StudyFileError`."""
    try:
        return yaml_file.read_text(path, "study file")
    except yaml_file.YamlFileError as exc:
        raise StudyFileError(exc.source, exc.problems) from None


def load_yaml(text: str, source: str | Path, prefix: str = "") -> Any:
    """YAML text as plain Python values, refused (`StudyFileError`, every problem a line) when its shape is not one a
    study file can have: see `trainer.yaml_file.load_yaml`. `prefix` is the key the text is the value of (`--set`)."""
    try:
        return yaml_file.load_yaml(text, source, prefix, "study file")
    except yaml_file.YamlFileError as exc:
        raise StudyFileError(exc.source, exc.problems) from None


def read_document(path: Path) -> dict[str, Any]:
    data = load_yaml(read_text(path), path)
    if data is None:
        raise StudyFileError(path, [("", "the file is empty; expected a mapping of study keys (name, n_trials, task, "
                                         "...)")])
    if not isinstance(data, dict):
        raise StudyFileError(path, [("", f"expected a mapping of study keys, got {type(data).__name__}")])
    return data


PARAM_FIELDS = frozenset({"type", "low", "high", "log", "step", "choices"})


# A study's sampler and pruner when its file names none (`StudySpec`'s defaults): `--set pruner.then.x=...` goes
# into these, as into a file that wrote them.
_COMPONENT_DEFAULTS: dict[str, dict[str, Any]] = {"sampler": {"type": "tpe"},
                                                  "pruner": {"type": "fastfail", "then": "median"}}


def override_key(item: str) -> str:
    """The key path of a `--set key.path=value` item, without spaces around its parts."""
    return ".".join(part.strip() for part in item.partition("=")[0].split("."))


def _make_room(fixed: dict[Any, Any], path: list[str]) -> None:
    """Before `--set fixed.<path>=...`: the file's `fixed` may spell a key dotted (`model.hidden: 32`, which the README
    allows), where the override's path is nested. A dotted key at or under the path goes (the override replaces it:
    it was refused as "both set model.hidden"); one above it (`curriculum.stages` when the path goes on inside it)
    is nested first, so the override lands inside its value."""
    for key in [k for k in fixed if isinstance(k, str) and "." in k]:
        split = [part.strip() for part in key.split(".")]
        if split[:len(path)] == path:
            del fixed[key]
        elif path[:len(split)] == split:
            node = fixed
            for part in split[:-1]:
                if not isinstance(node.setdefault(part, {}), dict):
                    break  # the file sets it both ways: its own problem, told as it is
                node = node[part]
            else:
                if split[-1] not in node:
                    node[split[-1]] = fixed.pop(key)


def apply_overrides(document: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`--set key.path=value`: the value is read as YAML (`3`, `1e-3`, `[a, b]`, `true`), as strictly as a file."""
    problems = []
    given: list[tuple[str, Any]] = []
    for item in overrides:
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:  # bytes the shell passed that are no UTF-8 text (Python keeps them as surrogates)
            shown = item.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            problems.append(("--set", f"expected UTF-8 text, got '{shown}'"))
            continue
        key, sep, raw = item.partition("=")
        if not sep or not key:
            problems.append(("--set", f"expected key=value, got {short_repr(item)}"))
            continue
        if any(not part.strip() for part in key.split(".")):
            problems.append((f"--set {key}", "expected a dotted key path like fixed.max_steps, with no empty part"))
            continue
        key = override_key(item)  # `--set 'n_trials =3'`: spaces around a key's parts are the shell's, not the key's
        try:
            value = load_yaml(raw, "command line", f"--set {key}") if raw else None
        except StudyFileError as exc:
            problems += [(where, message if "invalid YAML" not in message
                          else f"expected a YAML value, but {short_repr(raw)} is not one ({message})")
                         for where, message in exc.problems]
            continue
        given.append((key, copy.deepcopy(value)))  # as given: the document it goes into changes it
        node = document
        parts = key.split(".")
        if parts[0] == "space" and len(parts) > 1:
            # Space keys are dotted TrainingConfig names (`model.hidden`): the key is everything up to a
            # parameter's field (`space.model.hidden.low=4`), or all of it (`space.model.hidden={type: ...}`).
            field = parts[-1] if len(parts) > 2 and parts[-1] in PARAM_FIELDS else None
            parts = ["space", ".".join(parts[1:-1] if field else parts[1:]), *([field] if field else [])]
        if parts[0] == "fixed" and len(parts) > 1 and isinstance(document.get("fixed"), dict):
            _make_room(document["fixed"], parts[1:])
        *parents, leaf = parts
        if parents and parents[0] in _COMPONENT_DEFAULTS and parents[0] not in document:
            document[parents[0]] = copy.deepcopy(_COMPONENT_DEFAULTS[parents[0]])  # into the default, not instead
        for depth, part in enumerate(parents):
            if isinstance(node.get(part), str) and ((depth == 0 and part in _COMPONENT_DEFAULTS)
                                                    or (depth > 0 and part in ("then", "wrapped"))):
                node[part] = {"type": node[part]}  # `pruner: median` is `pruner: {type: median}`
            if depth == 1 and parents[0] == "tracking" and isinstance(node.get(part), bool):
                node[part] = {"enabled": node[part]}  # `tensorboard: true` is `tensorboard: {enabled: true}`
            if depth == 0 and part == "task" and isinstance(node.get(part), str):
                node[part] = {"name": node[part]}  # `task: digits` is `task: {name: digits}`
            if depth == 0 and part == "warm_start" and isinstance(node.get(part), bool):
                node[part] = {"enabled": node[part]}  # as `WarmStartSpec._shorthand` reads it
            if depth == 0 and part == "checkpoints" and isinstance(node.get(part), bool):
                node[part] = {} if node[part] else {"on_best": False}  # as `CheckpointPolicy._shorthand` reads it
            if part in node and not isinstance(node[part], dict):
                problems.append((f"--set {key}", f"{'.'.join(parents[:depth + 1])} is "
                                 f"{short_repr(node[part])}, not a mapping: it has no key {parts[depth + 1]!r}"))
                break
            node = node.setdefault(part, {})
        else:
            node[leaf] = value
    if not problems and (problem := overrides_clash(given)) is not None:  # the later would silently win (review)
        problems.append(("", problem))
    if problems:
        raise StudyFileError("command line", problems)
    return document


def read_spec(path: str | Path, overrides: Sequence[str] = ()) -> tuple[StudySpec, Path]:
    """Read, override and type-check a study file, without the checks that need the trainer (`sweep.spec.load_spec`
    adds them). Returns the spec and the file's resolved path.

    The file's folder becomes importable, as a script's is: a task or schedule named `my_project.tasks:spirals`
    is found in `my_project/` next to the study file, from any working folder."""
    path = Path(path)
    document = apply_overrides(read_document(path), overrides)
    document.setdefault("name", path.stem)
    spec = validate_document(document, path)
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)  # after the installed packages: a file there never shadows one of them
    return spec, path.resolve()


def with_options(model: _ModelT, given: Mapping[str, Any]) -> _ModelT:
    """`model` (a section of the study file) with the command-line options that were given (not None) put over it;
    raises StudyFileError naming each bad option as `--key-name`."""
    given = {key: value for key, value in given.items() if value is not None}
    try:
        type(model).model_validate(given)  # the options alone first: their problems are the command line's
    except ValidationError as exc:
        # (a problem of a key that was not given is the study file's defaults against the options: checked below)
        problems = [_pydantic_problem(error) for error in exc.errors()
                    if error["type"] != "missing" and (not error["loc"] or error["loc"][0] in given)]
        problems = [("--" + key.split(".")[0].split("[")[0].replace("_", "-"), message) for key, message in problems]
        if problems:
            raise StudyFileError("command line", problems) from None
    try:
        return type(model).model_validate({**model.model_dump(), **given})
    except ValidationError as exc:  # the options against the study file's (--time against its warning_s)
        problems = [_pydantic_problem(error) for error in exc.errors()]
        raise StudyFileError("command line", [(f"--{key.replace('_', '-')}" if key in given else
                                               f"{key} (the study file's, or its default)", message)
                                              for key, message in problems]) from None


def validate_document(document: Mapping[str, Any], source: str | Path) -> StudySpec:
    try:
        return StudySpec.model_validate(document)
    except ValidationError as exc:
        raise StudyFileError(source, [_pydantic_problem(error) for error in exc.errors()]) from None


_TAGS: dict[str, type[BaseModel]] = {"float": FloatParam, "int": IntParam, "categorical": CategoricalParam}
_SECTIONS: dict[str, type[BaseModel]] = {"checkpoints": CheckpointPolicy, "warm_start": WarmStartSpec,
                                         "task": TaskSpec, "launch": LaunchSpec, "tracking": TrackingSpec,
                                         "execution": ExecutionSpec, "resources": ResourcesSpec}
_SUBSECTIONS: dict[tuple[str, str], type[BaseModel]] = {("launch", "slurm"): SlurmSpec, ("launch", "k8s"): K8sSpec,
                                                        ("tracking", "tensorboard"): TensorBoardSpec,
                                                        ("tracking", "mlflow"): MLflowSpec}


def _known_keys(loc: Sequence[Any]) -> list[str]:
    """The keys a mapping at pydantic's location `loc` (of one of its keys) may have, for "did you mean"."""
    parent = [str(part) for part in loc[:-1] if not str(part).startswith(("function-", "tagged-union"))]
    model: type[BaseModel] | None = None
    if not parent:
        model = StudySpec
    elif parent[0] == "space" and len(parent) == 3:
        model = _TAGS.get(parent[2])
    elif len(parent) == 1:
        model = _SECTIONS.get(parent[0])
    elif len(parent) == 2:
        model = _SUBSECTIONS.get((parent[0], parent[1]))
    return list(model.model_fields) if model is not None else []


def _pydantic_problem(error: Mapping[str, Any]) -> tuple[str, str]:
    loc = [str(part) for part in error["loc"]
           if not (isinstance(part, str) and part in ("float", "int", "categorical", "function-after[_check()]"))]
    loc = [part for part in loc if not part.startswith(("function-", "tagged-union"))]
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "invalid_key" or (error["type"] == "string_type" and loc and loc[-1] == "[key]"):
        # A mapping's key that YAML read as a number (`2:`, `1.5:`): where it stands, sweep wants names.
        key = error.get("input", loc[-1])
        kind = "a boolean" if isinstance(key, bool) else "null" if key is None else "a number"
        where = [part for part in loc if part != "[key]"][:-1]
        return (f"{_dotted(where)}.{key}" if where else str(key)), (
            f"the key {key} is read as {kind} by YAML, not as a name; quote it ('{key}') if it is meant")
    if error["type"] == "missing_form":
        return "task", message
    if error["type"] == "extra_forbidden":
        known = _known_keys(error["loc"])
        message = ("unknown key" if loc[-1] else "unknown key '' (empty)") + did_you_mean(loc[-1], known) + (
            f"; expected one of: {', '.join(known)}" if known else "")
    elif error["type"] in ("union_tag_not_found", "union_tag_invalid"):  # a tagged union: the space's `type`
        field = str(error.get("ctx", {}).get("discriminator", "type")).strip("'")
        tags = re.findall(r"'([^']*)'", str(error.get("ctx", {}).get("expected_tags", ""))) or list(_TAGS)
        if error["type"] == "union_tag_not_found":
            given = set(error["input"]) if isinstance(error.get("input"), dict) else set()
            hint = ("; a list of values to choose from is type: categorical, choices: [...]"
                    if {"values", "choices", "grid_search", "options"} & given else
                    "; a range is type: float (or int), low: ..., high: ... (log: true for a log scale)"
                    if {"low", "high", "min", "max", "lower", "upper", "distribution"} & given else
                    f"; a key inside another is searched by its dotted name ({_first_range(loc[-1], error['input'])}"
                    ": {type: ...})" if given and loc[:1] == ["space"] and all(
                        isinstance(value, dict) for value in error["input"].values()) else "")
            return _dotted(loc), f"missing {field!r} (expected one of {', '.join(tags)}){hint}"
        tag = str(error["ctx"]["tag"])
        return _dotted([*loc, field]), (f"unknown {field} {short_repr(tag)}{did_you_mean(tag, tags)}; expected one "
                                        f"of {', '.join(tags)}")
    elif error["type"] in ("model_attributes_type", "model_type"):  # pydantic's "... or instance of ExecutionSpec"
        model = _model_named(str(error.get("ctx", {}).get("class_name", "")))
        message = (f"Input should be a valid dictionary (a mapping of keys){_shorthands(model)}, got "
                   f"{short_repr(error['input'])}")
        if error["input"] is None:  # `warm_start:` left empty is YAML's null
            message += "; an empty value is null" + (": write {} for the defaults" if _defaults(model) else "")
    elif error["type"] == "missing":
        message = "required key is missing"
    elif (error["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
          and isinstance(error.get("input"), float) and not math.isfinite(error["input"])):
        message = f"expected a finite number, got {error['input']!r}"  # not "greater than 0, got nan"
    elif "input" in error and error["type"] not in ("value_error",) and not isinstance(error["input"], dict):
        message = f"{message}, got {short_repr(error['input'])}"
        if error["type"] == "literal_error" and isinstance(error["input"], str):  # `direction: maximise`
            message += did_you_mean(error["input"], re.findall(r"'([^']*)'", str(error.get("ctx", {}).get(
                "expected", ""))))
    elif loc == ["metric"] and isinstance(error.get("input"), dict) and isinstance(error["input"].get("name"), str):
        goal = str(error["input"].get("goal", "minimize")).lower()  # W&B's `metric: {name: ..., goal: ...}`
        message = (f"{message}, got a mapping; write the metric's name, metric: {error['input']['name']}, and "
                   f"direction: {'maximize' if goal.startswith('max') else 'minimize'}")
    return _dotted(loc), message


def _model_named(class_name: str) -> type[BaseModel] | None:
    """The model of this module that pydantic's error names (`ctx.class_name`), or None."""
    found = [cls for cls in _subclasses(BaseModel) if cls.__module__ == __name__ and cls.__name__ == class_name]
    return found[0] if found else None


def _subclasses(cls: type[BaseModel]) -> list[type[BaseModel]]:
    direct: list[type[BaseModel]] = cls.__subclasses__()
    return [sub for child in direct for sub in (child, *_subclasses(child))]


def _shorthands(model: type[BaseModel] | None) -> str:
    """The shorter forms a section of the study file takes besides a mapping, as the words of its error: `tracking:
    {tensorboard: true}`, `checkpoints: false`, `pruner: median` (review: "got 1" named the mapping alone)."""
    if model is None:
        return ""
    forms = [words for sample, words in ((True, "true/false"), ("x", "a name")) if _takes(model, sample)]
    return f" or {' or '.join(forms)}" if forms else ""


def _takes(model: type[BaseModel], sample: Any) -> bool:
    """Whether `model` reads `sample` as a shorter form of itself: its "before" validator turns it into a mapping
    (a name that is not one of its choices still fails after that, on the name)."""
    try:
        model.model_validate(sample)
    except ValidationError as exc:
        return not any(error["type"] in ("model_attributes_type", "model_type") and not error["loc"]
                       for error in exc.errors())
    return True


def _defaults(model: type[BaseModel] | None) -> bool:
    """Whether `model` takes an empty mapping (every key has a default): `{}` is then worth suggesting."""
    if model is None:
        return False
    try:
        model.model_validate({})
    except ValidationError:
        return False
    return True


def _first_range(key: str, nested: Mapping[str, Any]) -> str:
    """The dotted name of the first range inside `nested` (`model: {hidden: {type: int, ...}}`: `model.hidden`),
    however deep; as deep as mappings go where none has a `type`."""
    path, node = [key], nested
    while isinstance(node, Mapping) and node and "type" not in node and all(
            isinstance(value, Mapping) for value in node.values()):
        first = sorted(node, key=str)[0]
        path, node = [*path, str(first)], node[first]
    return ".".join(path)


def _dotted(loc: Sequence[str]) -> str:
    """`['space', 'lr', 'choices', '1']` as `space.lr.choices[1]`."""
    text = ""
    for part in loc:
        part = part if len(part) <= 60 else part[:60] + "..."  # a key can be as long as the file
        text += f"[{part}]" if part.isdigit() and text else f".{part}" if text else part
    return text


# ---------------------------------------------------------------------------------------------------------------------
# Names, storage URLs and checkpoint stores, checked before anything is created.

_NAME = re.compile(r"^[\w.\-]+$")
MAX_NAME = 128


def _study_name(value: str) -> str:
    if problem := name_problem(value):
        raise ValueError(problem)
    return value


def name_problem(name: str) -> str | None:
    """What is wrong with a study name, or None. A name is a folder of the checkpoint store, so `.` and `..` (which
    would put blobs outside the study's folder) and names with slashes are refused."""
    if not name:
        return "expected a study name, got ''"
    if not _NAME.fullmatch(name):  # not `match`: its `$` let a name end in a newline
        return f"expected letters, digits, '_', '-' and '.' (the name is a folder), got {short_repr(name)}"
    if set(name) == {"."}:
        return f"{short_repr(name)} is not a folder of its own; choose a name with a letter or digit"
    if name.startswith("-"):
        return f"expected a name that does not start with '-' (it reads as an option), got {short_repr(name)}"
    if len(name) > MAX_NAME:
        return f"expected at most {MAX_NAME} characters (the name is a folder), got {len(name)}"
    return None


_OBJECT_STORES = ("s3", "gs")  # sweep.blobs.SCHEMES (not imported: it imports torch)


def store_url_problem(store: str) -> str | None:
    """What is wrong with `checkpoints.store` as written (a folder, `s3://bucket/prefix` or `gs://bucket/prefix`),
    or None. Whether the folder can be made is `sweep.spec.store_problems`'s."""
    if not store.strip():
        return "expected a folder, s3://bucket/prefix or gs://bucket/prefix, got ''"
    if "://" not in store:
        return None
    parsed = urlparse(store)
    if parsed.scheme not in _OBJECT_STORES:
        return f"expected a folder, s3://bucket/prefix or gs://bucket/prefix, got {short_repr(store)}"
    if not parsed.netloc:
        return f"expected {parsed.scheme}://bucket/prefix, with a bucket, got {short_repr(store)}"
    if not re.fullmatch(r"[A-Za-z0-9._-]+", parsed.netloc):  # no user, password or port: a bucket's name
        return (f"expected {parsed.scheme}://bucket/prefix, a bucket's name of letters, digits, '.', '_' and '-' "
                f"(credentials come from the environment, never the URL), got {short_repr(mask_url(store))}")
    return None


def storage_url_problem(url: str) -> str | None:
    """What is wrong with a storage URL before anything opens it, or None: empty, not a URL SQLAlchemy can read, an
    unknown database, or a database whose driver is not installed (named with the `pip install` that adds it)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    if not url.strip():
        return "expected a storage URL (sqlite:///FILE.db, postgresql+psycopg://USER@HOST/DB), got ''"
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return ("expected a storage URL like sqlite:///FILE.db or postgresql+psycopg://USER@HOST/DB, and this is "
                "not one (a password with '@', ':' or '/' must be percent-encoded)")
    try:
        dialect = parsed.get_dialect()
    except NoSuchModuleError:
        return (f"unknown storage {short_repr(parsed.drivername)}; expected sqlite:///FILE.db or "
                "postgresql+psycopg://USER@HOST/DB")
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_url_problem(url, parsed)
    if parsed.port is not None and not 1 <= parsed.port <= 65535:  # else found only once its host is looked up
        return f"expected a port from 1 to 65535, got {parsed.port} in {short_repr(mask_url(url))}"
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        if parsed.get_backend_name() == "postgresql":
            return (f"the PostgreSQL driver of {parsed.drivername!r} is not installed ({exc}): pip install "
                    "'sweep[postgres]' and use postgresql+psycopg://USER@HOST/DB")
        return f"the driver of {parsed.drivername!r} is not installed ({exc}): install it with pip"
    return None


def _sqlite_url_problem(url: str, parsed: Any) -> str | None:
    """A SQLite URL is `sqlite:///FILE.db` and nothing else: sweep finds the file from it (its lock and checkpoint
    folder go beside it), so no host, no query string, no `file:` URI, and a file, since a study in memory would
    vanish with the process."""
    expected = "expected sqlite:///FILE.db (three slashes, then the file's path; four for an absolute path)"
    if not url.startswith("sqlite:///") or parsed.host or parsed.username or parsed.port:
        database = parsed.database or ""
        if (not parsed.host and not database) or database == ":memory:":
            return (f"an in-memory SQLite database vanishes when the process ends, and the study with it; {expected}, "
                    f"got {short_repr(mask_url(url))}")
        return f"{expected}, got {short_repr(mask_url(url))}"
    database = parsed.database or ""
    if database.startswith("file:"):
        return f"{expected}, a path, not a file: URI, got {short_repr(mask_url(url))}"
    if "?" in url or parsed.query:
        return (f"{expected} without a query string (sweep opens the file itself), got "
                f"{short_repr(mask_url(url))}")
    if database in ("", ":memory:"):
        return (f"an in-memory SQLite database vanishes when the process ends, and the study with it; {expected}, "
                f"got {short_repr(mask_url(url))}")
    if database.endswith("/"):  # a folder's path: a file would be made with the folder's name, where none is
        return f"{expected}, not a folder's path (it ends in '/'), got {short_repr(mask_url(url))}"
    return None


NAME_MAX = 255  # bytes in one part of a path, on every common file system


def long_name_problem(path: str | Path) -> str | None:
    """What is wrong with a path one of whose parts is longer than a file system allows (every call on it fails with
    "File name too long"), or None."""
    for part in Path(path).parts:
        if len(os.fsencode(part)) > NAME_MAX:
            return (f"{short_repr(str(path))}: a part of the path is {len(os.fsencode(part))} bytes long, and file "
                    f"systems allow {NAME_MAX}")
    return None


def folder_creation_problem(path: Path, *, probe: bool = True) -> str | None:
    """Why no folder can be made in the existing folder `path`, or None: no write or search permission, or (with
    `probe`) what no check foresees (under /proc), found by making a folder of a name of its own there and taking it
    away again."""
    if _read_only_filesystem(path):
        return f"cannot create folders in {path}: it lies on a read-only filesystem"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"cannot create folders in {path}: permission denied"
    if probe:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".sweep-probe-", dir=path))
        except OSError as exc:
            return f"cannot create folders in {path}: {exc.strerror or exc}"
    return None


def folder_problem(folder: Path, needs: str) -> str | None:
    """Why `folder` cannot be made or used, or None: a name over 255 bytes, a part of its path a file (`needs` says
    what needs a folder there: "the checkpoints need"), or no folder can be made in the nearest one that exists."""
    if problem := long_name_problem(folder):
        return problem
    for path in (folder, *folder.resolve().parents):
        if path.exists():
            if not path.is_dir():
                return f"{path} is a file; {needs} a folder there"
            return folder_creation_problem(path, probe=path != folder)
    return None


def sqlite_file_problem(url: str, *, study: bool = True) -> str | None:
    """For a SQLite URL: what is wrong with its file before anything creates it, or None. The folder must exist;
    the path must not be a folder, nor a file that is not a SQLite database (it would not be written into), nor
    (with `study`, for a study's storage) a database of another program's tables."""
    if not url.startswith("sqlite:///") or (path := sqlite_path(url)) is None:  # nor an in-memory database
        return None
    if problem := long_name_problem(path):
        return problem
    if has_control(str(path)):  # a file no listing shows as it is named
        return f"the path {short_repr(str(path))} holds a control character; expected a printable file name"
    if path.is_dir():
        return f"{path} is a folder; expected a SQLite file such as {path / 'study.db'}"
    if path.exists() and not path.is_file():  # a named pipe or a device: opening it would wait, or never end
        return f"{path} is not a regular file (a named pipe or a device?); expected a SQLite file"
    if not path.parent.is_dir():
        above = next((p for p in path.parents if p.exists()), None)
        if above is not None and not above.is_dir():
            return f"{above} is a file, not a folder; give a SQLite file in a folder"
        return f"the folder {path.parent} does not exist; create it first, or give a SQLite file in an existing one"
    for suffix in ("-wal", "-shm", "-journal", ".lock"):  # SQLite's files beside it, and sweep's ask lock
        companion = path.with_name(path.name + suffix)
        if companion.exists() and not companion.is_file():
            return f"{companion} is not a file (a folder?), and the database's {suffix} file goes there; remove it"
    if path.is_file() and path.stat().st_size > 0:
        try:
            with open(path, "rb") as handle:
                header = handle.read(16)
        except OSError as exc:
            return f"cannot read {path}: {exc.strerror or exc}"
        if header != b"SQLite format 3\x00":
            return f"{path} is not a SQLite database; give a new or existing .db file"
        return _foreign_tables_problem(path) if study else None
    return None


OPTUNA_TABLES = {"studies", "trials", "version_info"}  # what makes a SQLite file a study database


def _sqlite_tables(path: Path, timeout: float = 5.0) -> set[str]:
    """The tables of the SQLite database at `path`, by a plain read (Optuna's storage would create its own tables in
    any file it opens); raises `sqlite3.Error` when it cannot be read. Opened for writing where it can be, though
    nothing is written: a study's database is in WAL mode, and a read-only connection, which cannot remove the -wal
    and -shm files it makes, left them beside the file of a command that then refused to run. Opened read-only
    where it cannot (a read-only file)."""
    import sqlite3

    def tables(mode: str) -> set[str]:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode={mode}", uri=True,
                                                timeout=timeout)) as connection:
            return {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

    return tables("ro" if path.is_file() and not os.access(path, os.W_OK) else "rw")


def sqlite_damage(path: Path) -> str | None:
    """Why the SQLite file at `path` is damaged (SQLite's `PRAGMA quick_check`, read-only), or None when it is sound
    or cannot be checked (missing, busy, unreadable): for a storage that failed to open, whose error may be Optuna's
    reading of a garbled page (a missing row, say) rather than SQLite's own word for it."""
    import sqlite3

    if not path.is_file():
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True,
                                                timeout=2)) as connection:
            found = [row[0] for row in connection.execute("PRAGMA quick_check(3)")]
    except sqlite3.OperationalError:  # busy, locked (2 s: the command fails already), unreadable: not known damaged
        return None
    except sqlite3.DatabaseError as exc:  # "database disk image is malformed", "file is not a database"
        return str(exc)
    if found == ["ok"]:
        return None
    said = [line for row in found for line in str(row).splitlines() if line.strip() and not line.startswith("***")]
    return said[0] if said else "database disk image is malformed"  # the first fault, not its "*** in main ***"


def _foreign_tables_problem(path: Path) -> str | None:
    """A SQLite database with tables, none of them Optuna's: another program's, which a study would be written into.
    A database busy with another worker's write is left to the storage, which waits for it."""
    import sqlite3

    try:
        tables = _sqlite_tables(path, timeout=10)
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc) or not os.access(path.parent, os.W_OK | os.X_OK) \
                or _full(path.parent):  # a full disk is waited out by the storage, with its line, as mid-run
            return None
        return f"{path} cannot be read as a SQLite database ({exc}); is the file damaged?"
    except sqlite3.DatabaseError as exc:
        return f"{path} cannot be read as a SQLite database ({exc}); is the file damaged?"
    if tables and not OPTUNA_TABLES <= tables and not _cut_short(path, tables):
        shown = ", ".join(sorted(tables)[:3]) + (", ..." if len(tables) > 3 else "")
        return (f"{path} is a SQLite database of another program (tables {shown}; no Optuna tables), and a study "
                "would be written into it; give a new or existing study .db file")
    return None


def _cut_short(path: Path, tables: set[str]) -> bool:
    """Whether the database holds only some of Optuna's own tables, all empty: a first run's creation of them cut
    short (a disk that filled as the first `studies` table was written). Optuna creates the rest when it opens it."""
    import sqlite3

    from optuna.storages._rdb.models import BaseModel  # (Optuna's tables, by name: no public list of them)

    columns = {name: set(table.columns.keys()) for name, table in BaseModel.metadata.tables.items()}
    columns["alembic_version"] = {"version_num"}
    if not tables <= set(columns):
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as connection:
            return all(  # Optuna's own table, column for column (another program's `studies` is not), and empty
                {row[1] for row in connection.execute(f'PRAGMA table_info("{table}")')} == columns[table]
                and connection.execute(f'SELECT 1 FROM "{table}" LIMIT 1').fetchone() is None for table in tables)
    except sqlite3.Error:
        return False


def sqlite_write_problem(url: str) -> str | None:
    """For a SQLite URL a study's workers will write: a read-only file, or a folder in which SQLite cannot create
    the file or its -wal and -shm companions (Optuna's error would be a failed commit, saying neither)."""
    path = sqlite_path(url)
    if path is None:
        return None
    if path.parent.is_dir() and _read_only_filesystem(path if path.exists() else path.parent):
        return f"cannot write {path}: it lies on a read-only filesystem, and the study's trials are written there; " \
               "give a SQLite file on a writable one, or copy it there"
    if path.is_file() and not os.access(path, os.R_OK | os.W_OK):
        return f"cannot write {path}: the file is read-only (permission denied), and the study's trials are written " \
               "there; make it writable (chmod u+w), or copy it"
    if path.parent.is_dir() and not os.access(path.parent, os.W_OK | os.X_OK):
        return f"cannot write {path}: its folder {path.parent} is not writable, and SQLite creates the file and its " \
               "-wal and -shm files there"
    return None


def _full(folder: Path) -> str | None:
    """What the file system of `folder` has run out of ("no space left", "no free inodes left"), or None."""
    try:
        stats = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    if stats.f_blocks and stats.f_bavail == 0:  # (one that counts no blocks has no limit: a tmpfs of size=0)
        return "no space left"
    return "no free inodes left" if stats.f_files and stats.f_favail == 0 else None


def _read_only_filesystem(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs (Windows): the access checks decide
        return False


def sqlite_study_problem(url: str) -> tuple[str, int] | None:
    """For a command that reads a study from an existing SQLite file: what is wrong with the file and the exit code
    (2: not a readable study database; 1: busy, run it again), or None. It must hold every table of Optuna's; it is
    opened read-only, since Optuna's storage would create its tables in any SQLite file (or an empty one) and so turn
    it into a study database, and those it lacks in a study database of another Optuna version (review: a read
    command wrote them into an Optuna 2.5 file, then refused it)."""

    try:
        problem = _sqlite_study_problem(url)
    except _Busy as busy:
        return str(busy), 1
    return None if problem is None else (problem, 2)


class _Busy(Exception):
    """The file is sound but another process holds it locked: the command may be run again."""


def _sqlite_study_problem(url: str) -> str | None:
    import sqlite3

    from optuna import __version__ as ours
    from optuna.storages._rdb import models  # the tables Optuna makes where they are missing

    if not url.startswith("sqlite:///") or (path := sqlite_path(url)) is None:  # nor an in-memory database
        return None
    if problem := sqlite_file_problem(url, study=False):
        return problem.replace("; give a new or existing .db file", "; give the .db file of a study")
    if path.stat().st_size == 0:
        return f"{path} is an empty file, not a study database; give the .db file of a study"
    try:
        tables = _sqlite_tables(path)
    except sqlite3.Error as exc:
        if not os.access(path.parent, os.W_OK | os.X_OK):  # the file is fine: SQLite writes its -shm beside it
            return (f"cannot read {path}: its folder {path.parent} is not writable, and SQLite writes its -wal and "
                    "-shm files beside the database; make the folder writable, or copy the .db to one that is")
        if isinstance(exc, sqlite3.OperationalError) and (full := _full(path.parent)):  # (a damaged file: below)
            return (f"cannot read {path} ({exc}): its file system has {full}, and SQLite writes its -wal and -shm "
                    "files beside the database; free some, or copy the .db to another file system")
        if isinstance(exc, sqlite3.OperationalError) and any(word in str(exc) for word in ("locked", "busy")):
            raise _Busy(f"cannot read {path} now: another process holds it locked ({exc}), a write under way or a "
                        "transaction left open (a stopped process, a sqlite3 shell); run the command again once it "
                        "ends") from None
        return f"{path} cannot be read as a SQLite database ({exc}); is the file damaged?"
    if not OPTUNA_TABLES <= tables:
        return (f"{path} is a SQLite database but not a study database (it has no Optuna tables); give the .db file "
                "of a study")
    if missing := sorted(set(models.BaseModel.metadata.tables) - tables):
        made_by = _sqlite_library_version(path)
        by = f"Optuna {made_by}'s" if made_by is not None else "a study database"
        return (f"{path} is {by} without tables Optuna {ours} reads ({', '.join(missing)}): "
                + ("open it with the Optuna version that made it" if made_by not in (None, ours) else
                   "were they dropped by hand or by another tool?"))
    return None


def _sqlite_library_version(path: Path) -> str | None:
    """The Optuna version that made the study database at `path` (its `version_info` row), read-only; None unknown."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True,
                                                timeout=5)) as connection:
            row = connection.execute("SELECT library_version FROM version_info LIMIT 1").fetchone()
    except sqlite3.Error:
        return None
    return str(row[0]) if row and row[0] is not None else None


def resolve_storage_url(spec: StudySpec, spec_path: Path | None, override: str | None = None) -> str:
    """`--storage` wins, then the file's `storage:`, then a SQLite file next to the study file. A relative SQLite path
    in the file is relative to the file, so a study runs the same from any working directory. A server URL without a
    password takes it from the environment variable `storage_password_env` names, when the file names one (raises
    `StudyFileError` when that variable is not set)."""
    if override:
        url = expand_home(override)
    elif spec.storage is None:
        folder = spec_path.parent if spec_path is not None else Path.cwd()
        return sqlite_url((folder / f"{spec.name}.db").resolve())
    elif (found := SQLITE_URL.fullmatch(url := expand_home(spec.storage))) and spec_path is not None:
        if not found["path"].startswith("/"):  # the folder's name as it is; a query (`?timeout=30`) stays one
            return sqlite_url((spec_path.parent / unquote(found["path"])).resolve(), like=url)
    return _with_password(url, spec, spec_path)


def _with_password(url: str, spec: StudySpec, spec_path: Path | None) -> str:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    name = spec.storage_password_env
    if name is None or url.startswith("sqlite"):
        return url
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return url  # refused with its own message where the URL is checked
    if parsed.password is not None:
        return url  # a password given in the URL itself (`--storage`) wins
    password = os.environ.get(name)
    if not password:
        raise StudyFileError(spec_path or "study", [("storage_password_env", f"the environment variable {name} is "
                                                    "not set or empty; export it with the storage password")])
    return parsed.set(password=password).render_as_string(hide_password=False)
