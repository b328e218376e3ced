"""Samplers and pruners by name, their arguments checked against the constructor's signature before any trial."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import optuna

from sweep.pruners import FastFailPruner
from sweep.schema import Component, StudyFileError

if TYPE_CHECKING:
    from sweep.schema import StudySpec

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
    "none": optuna.pruners.NopPruner,
}
# Pruners that wrap another: the argument in the study file, and the constructor's name for it.
WRAPPING = {"patient": ("wrapped", "wrapped_pruner"), "fastfail": ("then", "then")}


def _instantiate(where: str, registry: Mapping[str, type], kind: str, args: dict[str, Any],
                 extra: dict[str, Any] | None = None) -> Any:
    if kind not in registry:
        raise StudyFileError("", [(f"{where}.type", f"unknown {where} {kind!r}; expected one of: "
                                                    + ", ".join(registry))])
    cls = registry[kind]
    accepted = {name: p for name, p in inspect.signature(cls).parameters.items()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    unknown = [name for name in args if name not in accepted]
    if unknown:
        raise StudyFileError("", [(f"{where}.{name}", f"unknown argument of {cls.__name__}; expected one of: "
                                                      + ", ".join(accepted)) for name in unknown])
    kwargs = {**{k: v for k, v in (extra or {}).items() if k in accepted and k not in args}, **args}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise StudyFileError("", [(where, f"{cls.__name__}: {exc}")]) from exc


def build_sampler(spec: StudySpec, joined_at: int = 0) -> optuna.samplers.BaseSampler:
    """The named sampler, seeded with the study's `seed` unless the file gives the sampler its own.

    `joined_at`: how many trials the study held when this process asked for its first one. A process that joins a
    study with trials in it (a resume, a second worker, a machine that started a moment later) must not replay the
    first process's random draws, or it trains the same configs again; its seed is derived from the seed and that
    count, which differs between processes joining one after another (they ask under the study's lock). A single
    process on a new study keeps the seed itself, so a seeded sweep is re-runnable."""
    args, seed = dict(spec.sampler.args), spec.sampler.args.get("seed", spec.seed)
    if joined_at and seed is not None:
        seed = int(np.random.SeedSequence([int(seed), joined_at]).generate_state(1)[0])
        if "seed" in args:
            args["seed"] = seed
    return _instantiate("sampler", SAMPLERS, spec.sampler.type, args, {"seed": seed})


def build_pruner(component: Component, where: str = "pruner") -> optuna.pruners.BasePruner:
    """The named pruner. `fastfail` wraps another with `then: {type: median, ...}`, `patient` with `wrapped:`."""
    args = component.args
    if component.type in WRAPPING:
        key, parameter = WRAPPING[component.type]
        inner = args.pop(key, None)
        if inner is not None:
            try:
                inner_component = Component.model_validate(inner)
            except ValueError as exc:
                raise StudyFileError("", [(f"{where}.{key}", f"expected a pruner name or {{type: ...}}: {exc}")]) \
                    from None
            args[parameter] = build_pruner(inner_component, f"{where}.{key}")
    return _instantiate(where, PRUNERS, component.type, args)


def component_problems(spec: StudySpec) -> list[tuple[str, str]]:
    problems = []
    for build in (lambda: build_sampler(spec), lambda: build_pruner(spec.pruner)):
        try:
            build()
        except StudyFileError as exc:
            problems += exc.problems
    return problems


def pruner_name(pruner: optuna.pruners.BasePruner | None) -> str:
    """The study file's name for a pruner object (`median`), or its class name for one sweep does not name."""
    names: dict[type, str] = {cls: name for name, cls in PRUNERS.items()}
    return names.get(type(pruner), type(pruner).__name__)
