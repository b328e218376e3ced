"""`TrainingConfig`: the one typed object that holds every knob of a training run and its default.

Nothing in the loop is hard-coded; a sweep drives training only through this object. Keys are addressed with dots
(`model.hidden`, `fast_fail.patience_steps`, `curriculum.schedule`), so a study file can fix or search any of them.

Validation collects every problem and raises them together as a `ConfigError`, each naming the key, what is allowed
and what it got.

Importing this module loads neither torch nor numpy (the sweep's command line reads configs without them), so it may
import only the standard library and the other torch-free modules: `trainer.pacing` (the curriculum's settings) and
`trainer.fast_fail_rules` (the fast-fail settings).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.fast_fail_rules import FastFailConfig
from trainer.messages import did_you_mean, short_repr
from trainer.pacing import CurriculumConfig

__all__ = [
    "NUMBER_TEXT",
    "ConfigError",
    "CurriculumConfig",
    "DeviceUnavailable",
    "FastFailConfig",
    "TrainingConfig",
    "coerce",
    "flatten",
    "nest",
    "number_from_text",
]

Check = Callable[[Any], "str | None"]


class DeviceUnavailable(RuntimeError):
    """The config names a device this machine does not have (`device: cuda` where torch sees no CUDA device): the
    machine's shortcoming, not the config's (the same config trains where there is one). Here, not beside
    `resolve_device`, so that the sweep can tell it without importing torch."""


class ConfigError(ValueError):
    """One or more invalid config values. `problems` holds `(dotted key, message)` pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{key}: {message}" for key, message in problems))


FLOAT32_MAX = 3.4028234663852886e38  # the largest float32; beyond it the learning rate cannot be a tensor's


# One optimizer step may not hold more micro-batches than this: a step is where a stop, a pruner or an evaluation can
# act, and a step of 10^12 micro-batches ran forever and could not be stopped (review).
MAX_ACCUMULATION = 65_536


def _range(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if isinstance(value, float) and not math.isfinite(value):
            return f"expected a finite number, got {short_repr(value)}"
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and (value >= high if high_open else value > high)
        if too_low or too_high:
            left = "(" if low_open else "["
            right = ")" if high_open else "]"
            lo = "-inf" if low is None else low
            hi = "inf" if high is None else high
            return f"expected a value in {left}{lo}, {hi}{right}, got {short_repr(value)}"
        return None

    return check


def _device(value: str) -> str | None:
    if re.fullmatch(r"auto|cpu|mps|cuda(:(0|[1-9][0-9]{0,3}))?", value):  # ASCII digits, no leading 0: torch's
        return None
    return f"expected 'auto', 'cpu', 'mps', 'cuda' or 'cuda:N', got {short_repr(value)}"


def _task_name(value: str) -> str | None:
    if re.fullmatch(r"[A-Za-z_]\w*", value) or re.fullmatch(r"[\w.]+:[A-Za-z_]\w*", value):
        return None
    return f"expected a built-in task name or 'package.module:function', got {short_repr(value)}"


def _f(default: Any, check: Check | None = None, doc: str = "") -> Any:
    """A field with an immutable default, its check and its documentation."""
    return field(default=default, metadata={"check": check, "doc": doc})


@dataclass(frozen=True)
class TrainingConfig:
    """Everything one training run needs. Defaults are safe for the built-in tasks on a CPU."""

    # What to train.
    task: str = _f("digits", _task_name, "built-in task (digits, charlm, blobs, arrays) or 'package.module:function'")
    task_args: dict[str, Any] = field(default_factory=dict, metadata={
        "doc": "keyword arguments for the task factory (data size, context, ...)"})
    model: dict[str, Any] = field(default_factory=dict, metadata={
        "doc": "keys handed to the task's model builder; the task lists what it accepts"})

    # Optimisation.
    optimizer: Literal["adam", "adamw", "sgd", "lion"] = _f("adamw")
    learning_rate: float = _f(1e-3, _range(0, FLOAT32_MAX, low_open=True),
                              "peak learning rate (at most float32's largest: the optimizers hold it as a tensor)")
    weight_decay: float = _f(0.0, _range(0),
                             "decoupled for adamw/lion; applied to matrices only, never to biases/norms")
    momentum: float = _f(0.9, _range(0, 1, high_open=True), "sgd only")
    nesterov: bool = _f(False, doc="sgd only; needs momentum > 0")
    beta1: float = _f(0.9, _range(0, 1, high_open=True), "adam/adamw/lion")
    beta2: float | None = _f(None, _range(0, 1, high_open=True), "adam/adamw (default 0.999) and lion (default 0.99)")
    eps: float = _f(1e-8, _range(0, low_open=True), "adam/adamw")

    # Learning-rate schedule: linear warmup, then the named decay.
    scheduler: Literal["cosine", "linear", "step", "none"] = _f("cosine")
    warmup_steps: int = _f(0, _range(0), "steps of linear warmup from 0 to learning_rate")
    min_lr_ratio: float = _f(0.0, _range(0, 1), "cosine/linear decay ends at learning_rate * min_lr_ratio")
    step_every: int | None = _f(None, _range(1), "step scheduler: decay every this many steps (default max_steps // 3)")
    step_gamma: float = _f(0.1, _range(0, 1, low_open=True), "step scheduler: multiply the rate by this")

    # Budget and batches.
    max_steps: int = _f(1000, _range(1), "optimizer steps")
    batch_size: int = _f(64, _range(1), "samples per micro-batch")
    gradient_accumulation_steps: int = _f(1, _range(1, MAX_ACCUMULATION), "micro-batches per optimizer step")
    gradient_clip_norm: float | None = _f(None, _range(0, low_open=True), "clip the global grad norm; off when null")
    mixed_precision: Literal["auto", "off", "bf16", "fp16"] = _f(
        "auto", doc="auto: bf16 on CUDA where supported, else fp16 with a grad scaler; off on CPU")

    # Curriculum: which samples each step may draw from, easiest first. Searchable like any other key.
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig, metadata={"doc": "see trainer.curriculum"})

    # Fast-fail: stop a run that is going nowhere (NaN/Inf, explosion, plateau). In a study the pruner decides.
    fast_fail: FastFailConfig = field(default_factory=FastFailConfig, metadata={"doc": "see trainer.fast_fail"})

    # Measurement.
    eval_every_steps: int = _f(100, _range(1))
    eval_batch_size: int = _f(1024, _range(1))
    log_every_steps: int = _f(50, _range(1))

    # Speed: how the data reaches the model, and how the model runs.
    data_loader: Literal["auto", "device", "dataloader"] = _f(
        "auto", doc="device: the training set is moved to the device once and batched there; dataloader: worker "
                    "processes gather batches on the host (memory-mapped data larger than RAM too); auto: device "
                    "unless, on CUDA, the training set needs more than half the free device memory")
    loader_workers: int = _f(2, _range(0, 512), "dataloader: worker processes gathering batches (0: the main "
                                                "process; at most 512, each a process of its own)")
    pin_memory: bool = _f(True, doc="dataloader on CUDA: pin host batches, so the copy to the device does not block")
    prefetch_factor: int = _f(2, _range(1, 1024), "dataloader: batches each worker prepares ahead (at most 1024: "
                                                  "DataLoader counts them out one by one at its start)")
    compile: bool = _f(False, doc="torch.compile the model; checkpoints hold the plain module's weights, loadable "
                                  "without it")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = _f(
        "default", doc="torch.compile's mode, with compile: true; reduce-overhead replays each training step's forward "
                       "and backward as CUDA graphs (on CUDA: for small static models, bound by kernel launches)")

    # Reproducibility and placement.
    seed: int = _f(0, _range(0, 2**32 - 1), "torch's and numpy's generators take 32 bits of it: 2**32 would "
                                          "train as 0 does")
    deterministic: bool = _f(False,
                             doc="torch.use_deterministic_algorithms and no TF32 matmuls; slower, and exact on GPU")
    device: str = _f("auto", _device, "auto: cuda if available, else cpu")

    # ---------------------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainingConfig:
        """Build from a nested or dotted mapping; every problem is collected into one `ConfigError`."""
        config, problems = _build(cls, nest(values), "")
        if problems:
            raise ConfigError(problems)
        return config

    def problems(self) -> list[tuple[str, str]]:
        """Problems that involve more than one key."""
        problems = []
        if self.warmup_steps > self.max_steps:
            problems.append(("warmup_steps", f"expected at most max_steps ({self.max_steps}), got {self.warmup_steps}"))
        if self.optimizer in ("adam", "adamw") and self.learning_rate / (1 - self.beta1) > FLOAT32_MAX:
            # Adam's step size, the learning rate over its bias correction, is at most learning_rate / (1 - beta1)
            # (the first step at the peak rate), computed as PyTorch computes it and handed to its kernel as a
            # float32: above float32's largest, a traceback ("value cannot be converted to type float without
            # overflow"; review).
            problems.append(("learning_rate", f"expected at most {FLOAT32_MAX * (1 - self.beta1):.4g} with optimizer "
                                              f"{self.optimizer!r} and beta1 {self.beta1:g} (Adam's largest step, "
                                              "learning_rate / (1 - beta1), must fit in float32), got "
                                              f"{self.learning_rate:g}"))
        if self.nesterov and (self.optimizer != "sgd" or self.momentum == 0):
            problems.append(("nesterov", "needs optimizer 'sgd' with momentum > 0"))
        if self.compile_mode != "default" and not self.compile:
            problems.append(("compile_mode", f"{self.compile_mode!r} needs compile: true"))
        end_steps = self.curriculum.end_steps
        if end_steps is not None and end_steps > self.max_steps:
            problems.append(("curriculum.end_steps",
                             f"expected at most max_steps ({self.max_steps}), got {end_steps}: the run would end "
                             "before seeing its whole training set; use end_fraction to scale with max_steps"))
        problem = self.curriculum.schedule_problem(self.max_steps)
        if problem is not None:
            problems.append(("curriculum.schedule", problem))
        return problems

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, overrides: Mapping[str, Any]) -> TrainingConfig:
        """A copy with dotted-key overrides applied (`{"model.hidden": 128}` merges into `model`)."""
        merged = flatten(self.to_dict(), free=("task_args", "model"))
        merged.update(flatten(overrides, free=("task_args", "model")))
        return TrainingConfig.from_dict(merged)

    @property
    def resolved_beta2(self) -> float:
        if self.beta2 is not None:
            return self.beta2
        return 0.99 if self.optimizer == "lion" else 0.999

    @classmethod
    def keys(cls) -> dict[str, str]:
        """Every top-level key with its documentation, for error messages and the README."""
        return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}

    @classmethod
    def is_key(cls, dotted: str) -> bool:
        """Whether `dotted` addresses a config value (`model.*` and `task_args.*` are free-form mappings)."""
        return _is_key(cls, dotted)


# ---------------------------------------------------------------------------------------------------------------------
# Dotted keys.

def nest(values: Mapping[str, Any]) -> dict[str, Any]:
    """`{"model.hidden": 64, "lr": 1}` -> `{"model": {"hidden": 64}, "lr": 1}`; nested mappings are merged."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        parts = str(key).split(".")
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        if isinstance(value, Mapping):
            existing = node.get(parts[-1])
            base = existing if isinstance(existing, dict) else {}
            node[parts[-1]] = {**base, **nest(value)}
        else:
            node[parts[-1]] = value
    return out


def clash(values: Mapping[str, Any], prefix: str = "") -> str | None:
    """Two keys of `values` (nested or dotted, as a file gives them) that set the same value (`model: {hidden: 8}`
    and `model.hidden: 16`), or one of which sits inside the other (`model: 3` and `model.hidden: 16`): nesting them
    would silently drop one. The message naming both (each with `prefix`, `fixed.` for a study file's), or None."""
    given: dict[str, str] = {}  # every value's dotted key: the key of `values` that sets it
    for key, item in values.items():
        for dotted, leaf in flatten({key: item}).items():
            if leaf == {}:  # an empty mapping sets nothing
                continue
            parts = dotted.split(".")
            clashes = [other for other in (dotted, *(".".join(parts[:i]) for i in range(1, len(parts))))
                       if other in given]
            clashes += [other for other in given if other.startswith(f"{dotted}.")]
            if clashes:
                other = clashes[0]
                keys = f"{prefix}{given[other]} and {prefix}{key}"
                if other == dotted:
                    return f"{keys} both set {dotted}; keep one of them"
                inner, outer = sorted((other, dotted), key=len, reverse=True)
                return f"{inner} is inside {outer} ({keys}), and a config cannot hold both; keep one of them"
            given[dotted] = key
    return None


def overrides_clash(overrides: Sequence[tuple[str, Any]]) -> str | None:
    """Two `--set` options, in the order given, where the later sets a value the earlier set too (`learning_rate`
    twice, `model.hidden=8` then `model={hidden: 4}`) or replaces a mapping the earlier set a key in
    (`model.hidden=8` then `model=3`): the later would silently win, where a file holding the same is refused. The
    message naming both, or None. A key set inside one an earlier option gave is the way to adjust it
    (`pruner=median` then `pruner.n_startup_trials=3`)."""
    given: list[tuple[str, str, Any]] = []  # (every dotted value an option set, that option's key and value)
    for key, value in overrides:
        if any(by == key and type(was) is type(value) and was == value for _, by, was in given):
            continue  # the same key with the same value again changes nothing
        leaves = [dotted for dotted, leaf in flatten({key: value}).items() if leaf != {}] if isinstance(
            value, Mapping) else [key]
        for dotted in leaves or [key]:
            for earlier, by, was in given:
                if by == key:
                    return f"{key} is set twice ({short_repr(was)} and {short_repr(value)}); keep one of them"
                if earlier == dotted:
                    return f"--set {by} and --set {key} both set {dotted}; keep one of them"
                if earlier.startswith(f"{key}."):
                    return f"--set {key} would replace {earlier}, which --set {by} set before it; keep one of them"
        given += [(dotted, key, value) for dotted in leaves or [key]]
    return None


def flatten(values: Mapping[str, Any], prefix: str = "", free: tuple[str, ...] = ()) -> dict[str, Any]:
    """The inverse of `nest`: nested mappings become dotted keys."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{dotted}.", free))
        elif isinstance(value, Mapping) and dotted in free:
            continue  # an empty free-form mapping adds nothing
        else:
            out[dotted] = value
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Building a (nested) config dataclass, checking types against the annotations.

def _build(cls: type, values: Mapping[str, Any], prefix: str) -> tuple[Any, list[tuple[str, str]]]:
    problems: list[tuple[str, str]] = []
    kwargs: dict[str, Any] = {}
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key not in fields:
            problems.append((f"{prefix}{key}", f"unknown key{did_you_mean(str(key), fields)}; expected one of: "
                                               f"{', '.join(sorted(fields))}"))
            continue
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, Mapping):
                problems.append((f"{prefix}{key}", f"expected a mapping, got {short_repr(value)}"))
                continue
            nested, nested_problems = _build(hints[key], value, f"{prefix}{key}.")
            problems += nested_problems
            kwargs[key] = nested
            continue
        ok, coerced, message = coerce(value, hints[key])
        if not ok:
            problems.append((f"{prefix}{key}", message))
            continue
        check = fields[key].metadata.get("check")
        refusal = check(coerced) if check is not None and coerced is not None else None
        if refusal:
            problems.append((f"{prefix}{key}", refusal))
            continue
        kwargs[key] = coerced
    if problems:
        return None, problems
    instance = cls(**kwargs)
    cross = getattr(instance, "problems", None)
    problems = [(f"{prefix}{key}", message) for key, message in (cross() if cross else [])]
    return (None if problems else instance), problems


def _is_key(cls: type, dotted: str) -> bool:
    head, _, rest = dotted.partition(".")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if head not in fields:
        return False
    hint = _hints(cls)[head]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return bool(rest) and _is_key(hint, rest)
    return not rest or head in ("model", "task_args")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A config class's annotations, resolved once (a study file's check builds a config per searched value, and
    resolving them is most of the time of each: 15 s for a list of 9000 choices)."""
    return typing.get_type_hints(cls)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is dict:
        return "a mapping"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


# A number written as text (`"1e-3"`, quoted): YAML's own notation, not Python's, which float() also takes (`1_000`,
# `" 0.5 "`, `"infinity"`): a key that takes numbers refuses those, as the README says of `1_000`.
NUMBER_TEXT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


def magnitude(whole: int) -> str:
    """A whole number of hundreds of digits, for a message: "about 10^400" (its text would fill the screen)."""
    return f"about 10^{int(abs(whole).bit_length() * math.log10(2))}"


def underflows(text: str, value: float) -> bool:
    """Whether a number written as `text` (`1e-400`) was read as 0 though its digits are not all zeros."""
    return value == 0 and any(digit in re.split("[eE]", text)[0] for digit in "123456789")


def number_from_text(value: str) -> float | None:
    """The float a numeric string (`NUMBER_TEXT`) reads as, or None."""
    return float(value) if NUMBER_TEXT.fullmatch(value) else None


def coerce(value: Any, tp: Any) -> tuple[bool, Any, str]:
    """`(ok, value, message)`: `value` checked against the annotation `tp`, converted where the config allows it
    (tasks check their `model` keys with it too). Ints are accepted for floats, and so are numbers written as text
    (`"1e-3"`, `NUMBER_TEXT`); an integer key takes integers only (`2.0` is refused, as the README says)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            ok, coerced, _ = coerce(value, option)
            if ok:
                return True, coerced, ""
        return False, value, f"expected {_describe(tp)}, got {short_repr(value)}"
    if origin is Literal:
        if value in typing.get_args(tp) and isinstance(value, str):
            return True, value, ""
        words = [word for word, read in (("off", False), ("on", True)) if value is read and word in typing.get_args(tp)]
        hint = f" (YAML reads an unquoted {words[0]} as {str(value).lower()}: write '{words[0]}')" if words else ""
        return False, value, f"expected {_describe(tp)}, got {short_repr(value)}{hint}"
    if tp is type(None):
        return (value is None), value, f"expected null, got {short_repr(value)}"
    if origin is dict or tp is dict:
        if isinstance(value, Mapping):
            return True, dict(value), ""
        return False, value, f"expected a mapping, got {short_repr(value)}"
    if tp in (list, tuple):  # a task's default of layer widths, say: a list or a tuple as its default is
        if isinstance(value, (list, tuple)):
            return True, tp(value), ""
        return False, value, f"expected a list, got {short_repr(value)}"
    if tp is bool:
        return isinstance(value, bool), value, f"expected true/false, got {short_repr(value)}"
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -2**63 <= value < 2**63:  # torch holds integers in 64 bits: a step count, a divisor, a seed
                shown = repr(value) if abs(value) < 10**30 else magnitude(value)
                return False, value, f"expected an integer that fits in 64 bits, got {shown}"
            return True, value, ""
        return False, value, f"expected an integer, got {short_repr(value)}"
    if tp is float:
        if isinstance(value, bool):
            return False, value, f"expected a number, got {short_repr(value)}"
        if isinstance(value, (int, float)):
            try:
                value = float(value)
            except OverflowError:  # a whole number of hundreds of digits
                return False, value, f"expected a number, got a whole number too large for a float ({magnitude(value)})"
        elif isinstance(value, str):
            number = number_from_text(value)
            if number is None:
                return False, value, f"expected a number, got {short_repr(value)}"
            if underflows(value, number):
                return (False, value,
                        f"expected a number, got {short_repr(value)}: too small for a 64-bit float (read as 0)")
            value = number
        else:
            return False, value, f"expected a number, got {short_repr(value)}"
        if math.isnan(value):
            return False, value, "expected a number, got nan"
        return True, value, ""
    if tp is str:
        return isinstance(value, str), value, f"expected a string, got {short_repr(value)}"
    raise TypeError(f"unsupported annotation {tp!r}")  # a bug in this module, not bad input
