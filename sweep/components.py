"""Samplers and pruners by name, their arguments checked against the constructor's signature before any trial:
the names, then each value against the parameter's annotation (a constructor keeps `n_startup_trials="abc"` without
a word, and every trial fails later), then the constructor's own checks."""

from __future__ import annotations

import collections.abc
import decimal
import inspect
import itertools
import math
import sys
import types
import typing
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import optuna

from sweep.forecast import ForecastPruner
from sweep.leaders import LeadersPruner
from sweep.pruners import FastFailPruner
from sweep.schema import CategoricalParam, Component, FloatParam, IntParam, StudyFileError, did_you_mean, short_repr
from trainer.config import number_from_text

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

    from sweep.schema import Param, StudySpec

__all__ = ["PRUNERS", "SAMPLERS", "build_pruner", "build_sampler", "component_problems", "pruner_name"]

SAMPLERS: dict[str, type[optuna.samplers.BaseSampler]] = {
    "tpe": optuna.samplers.TPESampler,
    "random": optuna.samplers.RandomSampler,
    "cmaes": optuna.samplers.CmaEsSampler,
    "gp": optuna.samplers.GPSampler,
    "qmc": optuna.samplers.QMCSampler,
    "nsgaii": optuna.samplers.NSGAIISampler,
    "bruteforce": optuna.samplers.BruteForceSampler,
}

PRUNERS: dict[str, type[optuna.pruners.BasePruner]] = {
    "median": optuna.pruners.MedianPruner,
    "percentile": optuna.pruners.PercentilePruner,
    "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
    "hyperband": optuna.pruners.HyperbandPruner,
    "wilcoxon": optuna.pruners.WilcoxonPruner,
    "threshold": optuna.pruners.ThresholdPruner,
    "patient": optuna.pruners.PatientPruner,
    "fastfail": FastFailPruner,
    "forecast": ForecastPruner,
    "leaders": LeadersPruner,
    "none": optuna.pruners.NopPruner,
}
# Pruners that wrap another: the argument in the study file, and the constructor's name for it.
WRAPPING = {"patient": ("wrapped", "wrapped_pruner"), "fastfail": ("then", "then")}


def _instantiate(where: str, registry: Mapping[str, type], kind: str, args: dict[str, Any],
                 extra: dict[str, Any] | None = None, renamed: Mapping[str, str] | None = None) -> Any:
    """`registry[kind](**args)`, every problem named by the study file's key under `where`. `renamed`: the study
    file's key for a constructor argument whose name it does not use (`wrapped` for `wrapped_pruner`)."""
    renamed = renamed or {}
    if kind not in registry:
        raise StudyFileError("", [(f"{where}.type", f"unknown {where} {short_repr(kind)}"
                                                    f"{did_you_mean(kind, registry)}; expected one of: "
                                                    + ", ".join(registry))])
    cls = registry[kind]
    accepted = {name: p for name, p in inspect.signature(cls).parameters.items()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    unknown = [name for name in args if name not in accepted]
    if unknown:
        if not accepted:
            raise StudyFileError("", [(f"{where}.{name}", f"unknown argument: {where} {kind!r} takes no arguments")
                                      for name in unknown])
        raise StudyFileError("", [(f"{where}.{name}", f"unknown argument of {cls.__name__}"
                                                      f"{did_you_mean(name, accepted)}; expected one of: "
                                                      + ", ".join(accepted)) for name in unknown])
    problems = []
    for name, value in list(args.items()):
        try:
            args[name] = _conform(value, _annotation(cls, accepted[name]))
        except _Mismatch as exc:
            cannot = "" if exc.givable else " (which a study file cannot give)"
            problems.append((f"{where}.{name}", f"{cls.__name__}'s {name} takes {exc}{cannot}, got "
                                                f"{short_repr(value)}"))
    for name, value in args.items():
        if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
            # Optuna's constructors store it; sampling then fails every trial, each counted as its config's fault
            # (malformed input review: TPE's n_ei_candidates of 10^30, "Python int too large to convert to C long").
            problems.append((f"{where}.{name}", f"{cls.__name__}'s {name} takes a 64-bit integer, got "
                                                f"{short_repr(value)}"))
            continue
        for (owner, argument), (low, strict) in _BOUNDS.items():
            if issubclass(cls, owner) and name == argument and isinstance(value, (int, float)) \
                    and not isinstance(value, bool) and (value <= low if strict else value < low):
                problems.append((f"{where}.{name}", f"{cls.__name__}'s {name} must be {'>' if strict else '>='} "
                                                    f"{low}, got {short_repr(value)}"))
    resources = [v for v in (args.get("min_resource"), args.get("max_resource"))
                 if isinstance(v, int) and not isinstance(v, bool)]
    if issubclass(cls, optuna.pruners.HyperbandPruner) and len(resources) == 2 and resources[0] > resources[1]:
        problems.append((f"{where}.min_resource", f"HyperbandPruner's min_resource ({resources[0]}) must be at most "
                                                  f"its max_resource ({resources[1]}); with it above, no bracket "
                                                  "prunes"))
    if problems:
        raise StudyFileError("", problems)
    kwargs = {**{k: v for k, v in (extra or {}).items() if k in accepted and k not in args}, **args}
    missing = [name for name, parameter in accepted.items() if parameter.default is parameter.empty
               and name not in kwargs]
    if missing:
        raise StudyFileError("", [(f"{where}.{renamed.get(name, name)}", f"required key is missing ({kind} needs "
                                   f"it{_WRAPPED_HINT if name in renamed else ''})") for name in missing])
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        for name, key in renamed.items():  # the constructor's own names are not the study file's
            message = message.replace(name, key)
        # Optuna's own check names its argument in words ("Seed must be between 0 and 2**32 - 1"): the key, when
        # the words name exactly one the file gave, and its value where they do not quote it.
        lowered = str(exc).lower()
        named = [name for name in args if name.lower() in lowered or name.replace("_", " ").lower() in lowered]
        named = [name for name in named if not any(name != other and name in other for other in named)]  # the longest
        if len(named) == 1:
            (name,) = named
            got = short_repr(args[name])
            message = message.removeprefix(f"{renamed.get(name, name)}: ")  # sweep's own pruners name it so
            message += "" if got in message else f" (got {got})"
            raise StudyFileError("", [(f"{where}.{renamed.get(name, name)}", f"{cls.__name__}: {message}")]) from exc
        raise StudyFileError("", [(where, f"{cls.__name__}: {message}")]) from exc


_WRAPPED_HINT = ": the pruner it wraps, a name or {type: median, ...}"

# Arguments Optuna's constructors take without checking, whose bad values would fail every trial at run time (a
# division by zero in Hyperband's brackets, an assertion in CMA-ES): (lowest value, whether it is excluded).
_BOUNDS: dict[tuple[type, str], tuple[float, bool]] = {
    (optuna.pruners.HyperbandPruner, "min_resource"): (1, False),
    (optuna.pruners.HyperbandPruner, "max_resource"): (1, False),
    (optuna.pruners.HyperbandPruner, "reduction_factor"): (2, False),
    (optuna.pruners.HyperbandPruner, "bootstrap_count"): (0, False),
    (optuna.samplers.CmaEsSampler, "popsize"): (2, False),  # 1 fails an assertion of cmaes' rank-one update
    (optuna.samplers.CmaEsSampler, "sigma0"): (0, True),
    (optuna.samplers.CmaEsSampler, "n_startup_trials"): (0, False),
    (optuna.samplers.TPESampler, "n_startup_trials"): (0, False),
    (optuna.samplers.TPESampler, "n_ei_candidates"): (1, False),
    (optuna.samplers.TPESampler, "prior_weight"): (0, False),
    (optuna.samplers.GPSampler, "n_startup_trials"): (0, False),
}


class _Mismatch(Exception):
    """A value that its parameter's annotation refuses; the message says what the parameter takes, and `givable`
    whether a study file could give it at all (a number can be written in YAML, a function cannot)."""

    def __init__(self, expected: str, givable: bool = True) -> None:
        super().__init__(expected)
        self.givable = givable


# Names Optuna's constructors annotate with but import only for type checkers.
_TYPING_NAMES: dict[str, Any] = {**vars(typing), "Callable": collections.abc.Callable, "np": np,
                                 "FrozenTrial": optuna.trial.FrozenTrial, "Study": optuna.Study,
                                 "TrialState": optuna.trial.TrialState,
                                 "BaseDistribution": optuna.distributions.BaseDistribution}


def _annotation(cls: type, parameter: inspect.Parameter) -> Any:
    """The parameter's annotation as a type, or Any when it cannot be read (then only the constructor checks)."""
    annotation = parameter.annotation
    if annotation is inspect.Parameter.empty:
        return Any
    if not isinstance(annotation, str):
        return annotation
    namespace = {**_TYPING_NAMES, **vars(sys.modules[cls.__module__])}
    try:
        return eval(annotation, namespace)  # an annotation of an installed library, not input
    except Exception:  # noqa: BLE001 - a name only a type checker sees
        return collections.abc.Callable if annotation.startswith("Callable") else Any


def _conform(value: Any, hint: Any) -> Any:
    """`value` as the parameter annotated `hint` takes it (a YAML string `1e-3` for a float becomes the float), or
    `_Mismatch` naming what it takes. What a YAML file cannot give (a function, an object) is refused by name."""
    origin = typing.get_origin(hint)
    if hint is Any or hint is object:
        return value
    if origin in (typing.Union, types.UnionType):
        refused = []
        for option in typing.get_args(hint):
            try:
                return _conform(value, option)
            except _Mismatch as exc:
                refused.append(exc)
        raise _Mismatch(" or ".join(dict.fromkeys(map(str, refused))), all(exc.givable for exc in refused))
    if hint is type(None) or hint is None:
        if value is None:
            return None
        raise _Mismatch("null")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch("true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch("an integer")
    if hint is float:
        number = _finite(value)
        if number is None:
            raise _Mismatch("a finite number")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        raise _Mismatch("a string")
    if origin is typing.Literal:
        if value in typing.get_args(hint):
            return value
        raise _Mismatch("one of " + ", ".join(map(repr, typing.get_args(hint))))
    if collections.abc.Callable in (origin, hint):
        raise _Mismatch("a function", givable=False)
    if origin in (list, tuple, collections.abc.Sequence):
        items = typing.get_args(hint)
        if not isinstance(value, list):
            raise _Mismatch("a list")
        item = items[0] if items and (origin is not tuple or (len(items) == 2 and items[1] is ...)) else Any
        return [_conform(element, item) for element in value]
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, dict):
            raise _Mismatch("a mapping")
        key, item = typing.get_args(hint) or (Any, Any)
        return {_conform(k, key): _conform(v, item) for k, v in value.items()}
    if isinstance(hint, type):
        if isinstance(value, hint):
            return value
        raise _Mismatch(f"a {hint.__name__} object", givable=False)
    return value  # an annotation this check does not read: the constructor decides


def _finite(value: Any) -> float | None:
    """A finite float from an int, a float or a number written as text (`trainer.config.NUMBER_TEXT`), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = number_from_text(value) if isinstance(value, str) else float(value)
    except OverflowError:
        return None
    if number is None:
        return None
    return number if math.isfinite(number) else None


def build_sampler(spec: StudySpec, joined_at: tuple[int, ...] = ()) -> optuna.samplers.BaseSampler:
    """The named sampler, seeded with the study's `seed` unless the file gives the sampler its own.

    `joined_at`: what the study held when this process asked for its first one: its trial count, and the number of
    queued (WAITING) trials where there are any. A process that joins a study with trials in it (a resume, a second
    worker, a machine that started a moment later) must not replay another process's random draws, or it trains the
    same configs again; its seed is derived from the seed and those counts. Processes joining one after another ask
    under the study's lock, and each first ask either adds a trial or takes a queued one (a retry), so no two of them
    see the same counts (the trial count alone stays put while workers take queued retries, and three workers
    resuming a study with three retries queued drew the same configs). A single process on a new study keeps the seed
    itself, so a seeded sweep is re-runnable."""
    args, seed = dict(spec.sampler.args), spec.sampler.args.get("seed", spec.seed)
    if joined_at and seed is not None:
        seed = int(np.random.SeedSequence([int(seed), *joined_at]).generate_state(1)[0])
        if "seed" in args:
            args["seed"] = seed
    return _instantiate("sampler", SAMPLERS, spec.sampler.type, args, {"seed": seed})


def unexplored_point(spec: StudySpec, fixed: Mapping[str, Any], trials: Sequence[FrozenTrial],
                     ) -> dict[str, Any] | None:
    """`bruteforce` in a cohort: a point of the grid with the cohort's shape keys at their `fixed` values that no
    trial in `trials` holds (running, finished or queued), drawn at random; None when every such point is taken.
    BruteForceSampler draws each key in turn among the branches still open given the keys drawn before it, so with a
    shape key fixed that comes later in the space it opens branches that are open only under the other shapes, and
    the cohort's members were copies of trials it had (3 of 9 trials, a 6-point grid). Seeded by the sampler's seed
    and the trial count, so a seeded study draws the same points again."""
    free = [key for key in spec.space if key not in fixed]
    grids = [_grid(spec.space[key]) for key in free]

    def point(values: Mapping[str, Any], keys: Sequence[str]) -> tuple[tuple[str, Any], ...]:
        return tuple((type(values.get(key)).__name__, values.get(key)) for key in keys)  # 1, 1.0, True: 3 choices

    shapes = point(fixed, list(fixed))
    taken = {point(t.params, free) for t in trials if point(t.params, list(fixed)) == shapes}
    seed = spec.sampler.args.get("seed", spec.seed)
    rng = np.random.default_rng(None if seed is None else [int(seed), len(trials)])
    total = math.prod(len(grid) for grid in grids)
    large = total > 100_000
    if large or 2 * len(taken) < total:
        # Most points open (or too many to list): drawn until an open one comes up, two draws on average, each open
        # point as likely as another, as when listed. Listing every point took 0.26 s per ask on a 99k-point grid.
        for _ in range(1000 if large else 64):
            values = [grid[rng.integers(len(grid))] for grid in grids]
            if point(dict(zip(free, values)), free) not in taken:
                return dict(zip(free, values))
        if large:
            return None
    open_points = [values for values in itertools.product(*grids)  # few open: every one listed, one drawn
                   if point(dict(zip(free, values)), free) not in taken]
    return dict(zip(free, open_points[rng.integers(len(open_points))])) if open_points else None


def _grid(param: Param) -> list[Any]:
    """A key's values as BruteForceSampler enumerates them: the choices, or the range from low in steps (in decimal
    arithmetic, as Optuna does, so that the floats are the ones its trials hold)."""
    if isinstance(param, CategoricalParam):
        return list(param.choices)
    if isinstance(param, IntParam):
        return list(range(param.low, param.high + 1, param.step))
    assert param.step is not None, "bruteforce: every float has a step (checked with the study file)"
    low, high = decimal.Decimal(str(float(param.low))), decimal.Decimal(str(float(param.high)))
    width = decimal.Decimal(str(float(param.step)))
    values = []
    while low <= high:
        values.append(float(low))
        low += width
    return values


def build_pruner(component: Component, where: str = "pruner") -> optuna.pruners.BasePruner:
    """The named pruner. `fastfail` wraps another with `then: {type: median, ...}`, `patient` with `wrapped:`."""
    args = component.args
    if component.type in WRAPPING:
        key, parameter = WRAPPING[component.type]
        inner = args.pop(key, None)
        if inner is not None:
            try:
                inner_component = Component.model_validate(inner)
            except ValueError:
                raise StudyFileError("", [(f"{where}.{key}", "expected a pruner name or {type: ...}, got "
                                                            f"{short_repr(inner)}")]) from None
            if inner_component.type == "fastfail":  # the trainer takes its settings from the outermost pruner only
                fix = ("give it once, with all its settings" if component.type == "fastfail" else
                       f"put it at the top: pruner: {{type: fastfail, then: {{type: {component.type}, ...}}}}")
                raise StudyFileError("", [(f"{where}.{key}", "fastfail must be the outermost pruner (its settings "
                                           "drive the trainer's own checks, which a wrapped one never reaches); "
                                           + fix)])
            args[parameter] = build_pruner(inner_component, f"{where}.{key}")
        renamed = {parameter: key} if parameter != key else {}
        return _instantiate(where, PRUNERS, component.type, args, renamed=renamed)
    return _instantiate(where, PRUNERS, component.type, args)


def component_problems(spec: StudySpec) -> list[tuple[str, str]]:
    """Every problem of the sampler's and the pruner's arguments, found by building both (quietly: Optuna labels some
    of them experimental, which is no news while a file is being checked)."""
    problems = _sampler_space_problems(spec)
    for build in (lambda: build_sampler(spec), lambda: build_pruner(spec.pruner)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                warnings.simplefilter("ignore", FutureWarning)  # deprecated arguments: said when the run builds it
                build()
        except StudyFileError as exc:
            problems += exc.problems
    return problems


def _sampler_space_problems(spec: StudySpec) -> list[tuple[str, str]]:
    """A search space the sampler cannot search, as Optuna documents it: `bruteforce` enumerates every point, so
    every float needs a step (Optuna fails each trial otherwise); `cmaes` searches float and int keys only
    (categorical ones are drawn at random, with a warning), so a space of categorical keys alone leaves it nothing."""
    kind = spec.sampler.type
    if kind == "bruteforce":
        continuous = [key for key, param in spec.space.items() if isinstance(param, FloatParam) and param.step is None]
        if continuous:
            return [("sampler", f"bruteforce tries every point of the search space, so each float needs a step, but "
                                f"{', '.join(f'space.{key}' for key in continuous)} has none; give it a step or use "
                                "another sampler (tpe, random)")]
    if kind == "cmaes" and spec.space and all(isinstance(param, CategoricalParam) for param in spec.space.values()):
        return [("sampler", "cmaes searches float and int keys only, and every key of the space is categorical (it "
                            "would draw them all at random); use tpe, random or bruteforce")]
    x0 = spec.sampler.args.get("x0")
    if kind == "cmaes" and isinstance(x0, dict):
        return _x0_problems(spec, x0)
    return []


def _x0_problems(spec: StudySpec, x0: dict[str, Any]) -> list[tuple[str, str]]:
    """CMA-ES's `x0`, its first mean: a value for every float and int key of the space, inside its range (Optuna
    asserts both in every trial it samples, which then fails)."""
    searched = {key: param for key, param in spec.space.items() if not isinstance(param, CategoricalParam)}
    problems = [(f"sampler.x0.{key}", "not a float or int key of the space; expected one of: "
                                      + (", ".join(searched) or "none")) for key in x0 if key not in searched]
    missing = [key for key in searched if key not in x0]
    if missing:
        problems.append(("sampler.x0", f"expected a value for every float and int key of the space, missing "
                                       f"{', '.join(missing)}"))
    for key, value in x0.items():
        param = searched.get(key)
        number = _finite(value)
        if param is None:
            continue
        if number is None:
            problems.append((f"sampler.x0.{key}", f"expected a number, got {short_repr(value)}"))
        elif not param.low <= number <= param.high:
            problems.append((f"sampler.x0.{key}", f"expected a value in space.{key}'s range [{param.low}, "
                                                  f"{param.high}], got {short_repr(value)}"))
    return problems


def pruner_name(pruner: optuna.pruners.BasePruner | None) -> str:
    """The study file's name for a pruner object (`median`), or its class name for one sweep does not name."""
    names: dict[type, str] = {cls: name for name, cls in PRUNERS.items()}
    return names.get(type(pruner), type(pruner).__name__)
