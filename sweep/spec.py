"""A study file (YAML) becomes a validated, typed `StudySpec`.

Every problem is found before any trial runs, and all of them are reported together: each names the file, the key path
and what was expected. Unknown keys are refused, since a typo must not silently do nothing. The schema and reading
are `sweep.schema`'s; this module adds the checks that need the trainer (every fixed value, every searched key and
each end of its range, the task, the metric) and the sampler's and pruner's constructors.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import shutil
import typing
import warnings
from collections.abc import Iterator, Mapping, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

from sweep.components import component_problems
from sweep.outcomes import SPEC_ATTR
from sweep.schema import (
    PARAM_FIELDS,
    CategoricalParam,
    Component,
    FloatParam,
    IntParam,
    StudyFileError,
    StudySpec,
    did_you_mean,
    folder_problem,
    long_name_problem,
    read_spec,
    short_repr,
    validate_document,
)
from sweep.tracking import tracking_problems
from trainer.config import ConfigError, TrainingConfig, coerce, flatten
from trainer.fast_fail_rules import TRAINING_METRICS, training_metric
from trainer.messages import has_control, message, unreadable
from trainer.tasks import BUILTIN_TASKS, Task, TaskError, argument_names, load_task, resolve_task_factory
from trainer.tasks.base import first_unfinite

__all__ = ["SPEC_ATTR", "Component", "StudyFileError", "StudySpec", "load_spec", "parse_spec",
           "store_problems", "trainer_problems"]


def load_spec(path: str | Path, overrides: Sequence[str] = (), *, check_trainer: bool = True) -> tuple[StudySpec, Path]:
    """Read, override and validate a study file. Returns the spec and the file's resolved path."""
    spec, resolved = read_spec(path, overrides)
    if check_trainer:
        _raise_problems(spec, Path(path))
    return spec, resolved


def parse_spec(document: Mapping[str, Any], source: str | Path, *, check_trainer: bool = True) -> StudySpec:
    spec = validate_document(document, source)
    if check_trainer:
        _raise_problems(spec, source)
    return spec


def _raise_problems(spec: StudySpec, source: str | Path) -> None:
    problems = trainer_problems(spec)
    if problems:
        raise StudyFileError(source, problems)


# ---------------------------------------------------------------------------------------------------------------------
# Checks that need the trainer: every fixed value, every searched key and each end of its range.

def trainer_problems(spec: StudySpec) -> list[tuple[str, str]]:
    if spec.form != "task":
        return _unique(user_form_problems(spec))
    assert spec.task is not None
    problems: list[tuple[str, str]] = []
    unknown = spec.warm_start.unknown_keys()
    if unknown:
        known = [f.name for f in dataclasses.fields(TrainingConfig)]

        def hint(key: str) -> str:  # the first part is a TrainingConfig key: `task_arg.noise` is `task_args.noise`
            head, dot, rest = key.partition(".")
            close = difflib.get_close_matches(head, known, n=1, cutoff=0.75)
            return f" (did you mean {close[0] + dot + rest!r}?)" if close else ""

        problems.append(("warm_start.match", "expected TrainingConfig keys, got unknown "
                         f"{', '.join(repr(key) + hint(key) for key in unknown)}"))
    # A searched task argument the file gives no fixed value (a required one: `arrays`' `classes`) is built with
    # its range's first end here, as each end is below (tasks review: "missing 1 required positional argument").
    required = _required_arguments(spec.task.name)
    searched = {key.removeprefix("task_args."): _first_value(param) for key, param in spec.space.items()
                if key.startswith("task_args.") and key.removeprefix("task_args.") in required
                and key.removeprefix("task_args.") not in spec.task.args}
    try:
        task = load_task(spec.task.name, {**spec.task.args, **searched})
    except TaskError as exc:
        if os.environ.get("SWEEP_TRACEBACK") and exc.__cause__ is not None:  # its module's own code failed
            raise
        return [("task", str(exc))]
    except (ValueError, OSError) as exc:  # the task's own function refused its arguments or found no data
        return [("task", f"{spec.task.name} raised {type(exc).__name__}: {exc}")]
    except (Exception, SystemExit) as exc:  # a bug in a user's task function (or its sys.exit): one line, where
        if os.environ.get("SWEEP_TRACEBACK"):
            raise
        return [("task", _raised_line(spec.task.name, exc))]

    for key in spec.warm_start.match:  # the task's model keys and arguments, as for a searched key
        name = key.split(".")[1] if key.count(".") >= 1 else ""
        if key.startswith("model.") and not task.model_default(key.removeprefix("model."))[0]:
            known = [f"model.{k}" for k in task.model_keys()]
            problems.append(("warm_start.match", f"unknown key {short_repr(key)} for task {task.name!r}"
                             f"{did_you_mean(key, known)}; expected one of: {', '.join(known)}"))
        elif key.startswith("task_args.") and (message := _task_arg_problem(spec.task.name, name)):
            problems.append(("warm_start.match", message))
    for key in ("task", "task_args"):
        if key in spec.fixed:
            problems.append((f"fixed.{key}", "set the task and its arguments with the top-level `task:` key"))
    if "fast_fail" in spec.fixed:
        problems.append(("fixed.fast_fail", "configure fast-fail on the pruner: `pruner: {type: fastfail, ...}`"))
    problems += _heartbeat_problems(spec)
    problems += _direction_problems(spec)
    if ranges := _ranges_in_fixed(spec.fixed):  # the configs built below would each say "expected a number"
        return problems + ranges
    base = spec.base_config()
    builtin = spec.task.name in BUILTIN_TASKS  # a user's model builder may do anything: not called here
    if not builtin and (message := _unfinite_validation(task)):  # the built-in tasks check their own data
        problems.append(("task", message))
    base_problems = _config_problems(base, task, builtin)
    problems += [(f"fixed.{key}", message) for key, message in base_problems]
    default_batch = TrainingConfig.__dataclass_fields__["batch_size"].default
    if "batch_size" not in spec.space and all(key != "batch_size" for key, _ in base_problems) \
            and (message := _batch_size_problem(base.get("batch_size", default_batch), task)):
        given = "batch_size" in base
        problems.append(("fixed.batch_size", message if given else f"{message} (the default); set a smaller one"))

    fixed_keys = set(flatten(spec.fixed, free=FREE_MAPPINGS))
    alone: list[str] = []  # the searched keys each of whose values the trainer takes with the fixed ones
    drawable = {key: extremes[0][1] for key, param in spec.space.items()
                if key.startswith("model.") and task.model_default(key.removeprefix("model."))[0]
                and (isinstance(param, CategoricalParam) or _no_numbers(key, task) is None)  # else refused by type
                and (extremes := _extremes(param))}
    for key, param in spec.space.items():
        where = f"space.{key}"
        if not TrainingConfig.is_key(key) or key in ("task", "task_args", "model") or key.startswith("fast_fail."):
            searchable = [k for k in TrainingConfig.keys() if k not in ("task", "task_args", "fast_fail", "model")
                          and TrainingConfig.is_key(k)]
            problems.append((where, "not a searchable TrainingConfig key"
                                    + did_you_mean(key, [*searchable, *(f"model.{k}" for k in task.model_keys())])
                                    + "; expected one of: " + ", ".join(searchable) + ", model.<key>, task_args.<key>"))
            continue
        if key in fixed_keys:
            problems.append((where, f"is both fixed (fixed.{key}) and searched; remove it from one of them"))
            continue
        if any(bad_key in FREE_MAPPINGS and key.startswith(f"{bad_key}.") for bad_key, _ in base_problems):
            continue  # inside `fixed.model: abc`, refused already; as a mapping, it and `model.dropout` go together
        conflicts = _conflict_problems(spec, fixed_keys, key)
        if conflicts:
            problems += conflicts
            continue
        if key.startswith("model.") and not task.model_default(key.removeprefix("model."))[0]:
            known = [f"model.{k}" for k in task.model_keys()]
            problems.append((where, f"unknown key for task {task.name!r}{did_you_mean(key, known)}; expected one of: "
                                    + ", ".join(known)))
            continue
        if key.startswith("task_args.") and (message := _task_arg_problem(spec.task.name,
                                                                            key.split(".")[1])):
            problems.append((where, message))
            continue
        if key.count(".") == 1 and key.startswith("task_args.") and isinstance(param, FloatParam) \
                and _task_arg_type(spec.task.name, key.split(".")[1]) is int:
            problems.append((f"{where}.type", f"{key} takes integers (the task's function says `int`); use type: int"))
            continue
        if key.count(".") == 1 and key.startswith("task_args."):  # each end of its range builds the task, as fixed
            ends = ([("low", param.low), ("high", param.high)] if not isinstance(param, CategoricalParam)
                    else [(f"choices[{i}]", c) for i, c in enumerate(param.choices)])
            for label, value in ends[:4]:  # a task may read its data each time: the ends, or the first choices
                try:
                    load_task(spec.task.name, {**spec.task.args, **searched, key.split(".")[1]: value})
                except (TaskError, ValueError, OSError) as exc:  # no data there (a file missing) too
                    problems.append((f"{where}.{label}", str(exc)))
        if _expected_type(key, task) is int and isinstance(param, FloatParam):
            problems.append((f"{where}.type", f"{key} takes integers; use type: int"))
            continue
        if not isinstance(param, CategoricalParam) and (takes := _no_numbers(key, task)) is not None:
            problems.append((f"{where}.type", f"{key} takes {takes[0]}, not a range of {param.type}s; use {takes[1]}"))
            continue
        found = len(problems)
        for drawn, value in _candidates(param):
            if drawn is None and len(problems) > found:
                break  # an end is refused already: the values next to it would say the same again
            at = _at(where, drawn, value)
            # A value between the ends is tried with the other searched model keys at values they draw (their
            # first extreme), not at the task's defaults, which the study may never use (4 heads where it searches
            # 1 or 2): their combinations are `_pair_problems`'.
            values = {**base, **(drawable if drawn is None else {}), key: value}
            refused = [(bad_key, message) for bad_key, message in _config_problems(values, task, builtin,
                                                                                  key.startswith("model."))
                       if (bad_key, message) not in base_problems]  # caused by this value, not by the fixed ones
            problems += [(at, message if bad_key == key else f"{bad_key}: {message}") for bad_key, message in refused]
            if key == "batch_size" and all(bad_key != key for bad_key, _ in refused) \
                    and (message := _batch_size_problem(value, task)):
                problems.append((at, message))
        if isinstance(param, CategoricalParam) and len(problems) == found:
            problems += _same_once_read(where, param, _hint(key, task))
        if len(problems) == found:
            alone.append(key)
    problems += _pair_problems(spec, alone, base, base_problems, task, builtin)

    curriculum = spec.fixed.get("curriculum")  # not a mapping: refused with the fixed values' problems
    schedule = curriculum.get("schedule", "none") if isinstance(curriculum, dict) else "none"
    schedules = {schedule if isinstance(schedule, str) else "none"}  # not a name: refused with the fixed values'
    # Named where the schedule comes from, as every other key (and so mapped to the --set that gave it), and not
    # said again of a schedule refused already (review: "curriculum.schedule", after "expected one of ...").
    where = "fixed.curriculum.schedule"
    if any(key in (where, "fixed.curriculum") for key, _ in problems):
        schedules = {"none"}
    searched_schedule = spec.space.get("curriculum.schedule")
    if isinstance(searched_schedule, CategoricalParam) and not any(key.startswith("space.curriculum.schedule")
                                                          for key, _ in problems):
        named = {c for c in searched_schedule.choices if isinstance(c, str)} - {"none"}
        where = "space.curriculum.schedule" if named and not schedules - {"none"} else where
        schedules |= named
    if schedules - {"none"} and task.difficulty is None:
        problems.append((where, f"task {task.name!r} gives no per-sample difficulty, so it cannot follow a "
                                "curriculum; use schedule none or a task with difficulty"))
    problems += _warm_start_problems(spec)
    if spec.metric not in task.metric_names:
        problems.append(("metric", f"task {task.name!r} reports {', '.join(task.metric_names)}; "
                                   f"got {short_repr(spec.metric)}"))
    if spec.fast_fail().get("overfit_gap") is not None and training_metric(spec.metric) not in TRAINING_METRICS:
        problems.append(("pruner.overfit_gap", f"the overfitting rule compares the metric with its training "
                                               f"counterpart; the trainer logs {', '.join(TRAINING_METRICS)}, so it "
                                               f"needs metric val_loss, got {short_repr(spec.metric)}"))
    problems += component_problems(spec)
    problems += [problem for problem in _rung_problems(spec) if problem[0] not in {key for key, _ in problems}]
    for where, said in _inert_pruners(spec):  # a short run's (a smoke test's) pruner: said, not refused
        warnings.warn(f"{where}: {said}", InertPruner, stacklevel=2)
    problems += tracking_problems(spec)
    return _unique(problems)


PARAM_NAME_LIMIT = 512  # characters: Optuna's trial_params.param_name, VARCHAR(512) on a server database


def user_form_problems(spec: StudySpec) -> list[tuple[str, str]]:
    """A `loop` or `command` study: its keys are the user's own, so only what sweep itself needs is checked: the loop
    function imports and is callable, a command's `{placeholders}` are keys of the config, no key is both fixed and
    searched, and the study-level settings."""
    problems: list[tuple[str, str]] = []
    if spec.loop is not None:
        from sweep.runners.loop import LoopError, load_loop

        try:
            load_loop(spec.loop)
        except LoopError as exc:
            if os.environ.get("SWEEP_TRACEBACK") and exc.__cause__ is not None:  # its module's own code failed
                raise
            problems.append(("loop", str(exc)))
    if spec.command is not None:
        from sweep.runners.command import CommandError, command_line

        # Each placeholder's format spec is tried on both ends of its range and on every choice ('auto' among
        # numbers takes no `.3f`).
        low = _example_values(spec, 0)
        configs = [spec.user_config(low), _example_config(spec, -1)] + [
            spec.user_config({**low, key: choice}) for key, param in spec.space.items()
            if isinstance(param, CategoricalParam) for choice in param.choices[1:-1]]
        try:
            argv = command_line(spec.command, configs[0])
            for config in configs[1:]:
                command_line(spec.command, config)
        except CommandError as exc:
            problems.append(("command", str(exc)))
        else:
            if shutil.which(argv[0]) is None:
                problems.append(("command", f"{short_repr(argv[0])} is not an executable on PATH nor a path to one "
                                            "(from the folder `sweep run` runs in)"))
    # A loop's or command's config is its own: an empty mapping (`model: {}`) holds no key a searched one could
    # conflict with, and the searched `model.hidden` goes into it.
    fixed_keys = {key for key, value in flatten(spec.fixed).items() if not (isinstance(value, Mapping) and not value)}
    for where, key in [*(("space", k) for k in spec.space), *(("fixed", k) for k in sorted(fixed_keys))]:
        if any(not part.strip() for part in str(key).split(".")):  # review: the loop got {'': 2}, `best` wrote `? ''`
            problems.append((f"{where}.{key}" if key else where, f"expected a key with no empty part (a name, or a "
                             f"dotted path such as model.hidden), got {short_repr(key)}"))
    for key in spec.space:
        if has_control(key) or len(key) > PARAM_NAME_LIMIT:  # review: PostgreSQL refused it mid-ask, a traceback
            problems.append((f"space.{key}", f"expected a key of at most {PARAM_NAME_LIMIT} characters and no control "
                                             f"character (a study's storage keeps a searched key's name in "
                                             f"{PARAM_NAME_LIMIT}, without NUL), got {short_repr(key)}"))
        if key in fixed_keys:
            problems.append((f"space.{key}", f"is both fixed (fixed.{key}) and searched; remove it from one of them"))
        problems += _conflict_problems(spec, fixed_keys, key)
    problems += _max_steps_problems(spec)
    problems += _heartbeat_problems(spec)
    problems += _direction_problems(spec)
    for where, said in _ranges_in_fixed(spec.fixed):  # the loop's or command's own value, maybe: said, not refused
        warnings.warn(f"{where}: {said}, or ignore this if the trials sample from it themselves", RangeInFixed,
                      stacklevel=2)
    problems += _warm_start_problems(spec)
    problems += component_problems(spec)
    problems += tracking_problems(spec)  # a loop's and a command's reports are tracked too
    return problems


def _raised_line(name: str, exc: BaseException) -> str:
    """What a task's function raised while the study was checked: its type, first line and where it was raised."""
    import traceback

    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ is not None else None
    at = f" (at {Path(frame.filename).name}:{frame.lineno}; SWEEP_TRACEBACK=1 shows the traceback)" if frame else ""
    if isinstance(exc, SystemExit):
        return f"{name} called sys.exit({exc.code!r}) while its task was built{at}"
    first = ((message(exc) or unreadable(exc)).strip().splitlines() or [""])[0][:300]
    return f"{name} raised {type(exc).__name__}: {first}{at}"


def _unfinite_validation(task: Task) -> str | None:
    """A user's task whose validation inputs or targets hold NaN or infinity: every trial's first evaluation would
    be NaN, and each trial pruned for it as if its config diverged (review: nothing named the data)."""
    for what, tensor in zip(("inputs", "targets"), task.val):
        if (sample := first_unfinite(tensor)) is not None:
            return (f"task {task.name!r}: its validation {what} hold NaN or infinity (sample {sample}): every trial's "
                    "evaluation would be NaN, and each trial pruned as if its config diverged; clean the data or "
                    "leave those samples out")
    return None


FREE_MAPPINGS = ("model", "task_args")  # fixed mappings whose keys a study may search one by one


def _batch_size_problem(value: Any, task: Task) -> str | None:
    """A batch larger than the task's training set: every trial would fail at its first batch."""
    size = len(task.train[1])
    if isinstance(value, int) and not isinstance(value, bool) and value > size:
        return f"expected at most the training set size of task {task.name!r} ({size}), got {value}"
    return None


def _task_arg_problem(name: str, argument: str) -> str | None:
    """A searched `task_args.X` that the task's function does not take (fixed ones are checked by calling it)."""
    names = argument_names(resolve_task_factory(name))  # None: any, or no signature to read (a trial finds out)
    if names is None or argument in names:
        return None
    return (f"task {name!r} takes no argument {short_repr(argument)}{did_you_mean(argument, names)}; expected one of: "
            + (", ".join(names) or "(none)"))


def _conflict_problems(spec: StudySpec, fixed_keys: set[str], key: str) -> list[tuple[str, str]]:
    """A searched key that holds, or sits inside, a fixed key or another searched one (`a` and `a.b`): a trial's
    config can hold only one of them, and the other would silently be dropped."""
    pairs = [(f"space.{other}" if other in spec.space else f"fixed.{other}", other, key)
             for other in [*fixed_keys, *spec.space] if other.startswith(f"{key}.")]  # `a` searched, `a.b` given
    parts = key.split(".")
    pairs += [(f"fixed.{outer}", key, outer) for outer in (".".join(parts[:depth]) for depth in range(1, len(parts)))
              if outer in fixed_keys]  # `a` fixed, `a.b` searched (both searched: found above, from `a`)
    return [(f"space.{key}", f"conflicts with {where}: {inner} is inside {outer}, and a config cannot hold both; "
                             "remove one of them") for where, inner, outer in pairs]


_STEP_KEYS = {"max_steps": (1, "expected a positive integer (the number of steps a trial trains)"),
              "eval_every_steps": (1, "expected a positive integer (the steps between evaluations)"),
              "warmup_steps": (0, "expected a whole number >= 0 (the learning rate's warmup, in steps)")}


def _max_steps_problems(spec: StudySpec) -> list[tuple[str, str]]:
    """A `loop` or `command` study's `max_steps` is the user's, but sweep reads it too (the pruners' and fast-fail
    rules' budget, the last step of a trial): when given, a positive integer. `eval_every_steps` and `warmup_steps`
    too where a pruner reads them (fastfail, leaders): whole numbers (`20.0` is one). The built-in trainer checks
    the other two itself."""
    keys = dict(_STEP_KEYS)
    if (spec.loop is None and spec.command is None) or not _pruners(spec.pruner) & {"fastfail", "leaders"}:
        keys = {"max_steps": _STEP_KEYS["max_steps"]}
    problems = []
    for name, (least, expected) in keys.items():
        values = [(f"fixed.{name}", value) for key, value in flatten(spec.fixed).items() if key == name]
        param = spec.space.get(name)
        if isinstance(param, FloatParam):
            problems.append((f"space.{name}.type", f"{name} takes integers; use type: int"))
            continue
        if isinstance(param, CategoricalParam):
            values += [(f"space.{name}.choices[{i}]", choice) for i, choice in enumerate(param.choices)]
        elif param is not None:
            values.append((f"space.{name}.low", param.low))
        whole = (int,) if name == "max_steps" else (int, float)
        problems += [(where, f"{expected}, got {short_repr(value)}") for where, value in values
                     if isinstance(value, bool) or not isinstance(value, whole) or value < least
                     or (isinstance(value, float) and not value.is_integer())]
    return problems


def _pruners(component: Any) -> set[str]:
    """The pruner's type and those it wraps (`then:`, `wrapped:`), as far as the file spells them out."""
    return {kind for _, kind, _ in _pruner_components(component) if isinstance(kind, str)}


class RangeInFixed(UserWarning):
    """A loop's or command's fixed value shaped as a search range: maybe the trials' own, maybe meant for `space:`."""


def _ranges_in_fixed(fixed: Mapping[str, Any], prefix: str = "fixed.") -> list[tuple[str, str]]:
    """A search range written under `fixed:` (`weight_decay: {type: float, low: 1e-6, high: 0.1}`): a fixed value is
    passed as it is, so a loop's or command's trials got the mapping itself (found by review), and the built-in
    trainer's check said only "expected a number"."""
    found = []
    for key, value in fixed.items():
        if not isinstance(value, Mapping):
            continue
        if value.get("type") in ("float", "int", "categorical") and set(value) <= PARAM_FIELDS and (
                {"low", "high"} <= set(value) or "choices" in value):
            found.append((f"{prefix}{key}", f"a search range (type: {value['type']}) under fixed:, whose values "
                          "are passed to the trials as they are: move it under space: as "
                          f"{prefix.removeprefix('fixed.')}{key} to search it"))
        else:
            found += _ranges_in_fixed(value, f"{prefix}{key}.")
    return found


def _heartbeat_problems(spec: StudySpec) -> list[tuple[str, str]]:
    if spec.heartbeat_grace_period >= 2 * spec.heartbeat_interval:
        return []
    return [("heartbeat_grace_period", f"expected at least twice heartbeat_interval ({2 * spec.heartbeat_interval} "
             f"s), but got {spec.heartbeat_grace_period}: a trial would be declared lost while its worker still "
             "trains it")]


# What a metric's name says of its direction, from its words (split at anything but letters and digits: `val_loss`,
# `val/acc`, `loss/val`, `eval-accuracy`, `mean_accuracy`, `episode_reward_mean`): lower is better for a loss or an
# error, higher for a score. Only a name made of such words and qualifiers (a split, a statistic, a number) says
# it: `loss_reduction`, `time_to_accuracy`, `neg_loss` or `top1_error` say nothing, and are taken as given.
_LOSS_WORDS = re.compile(r"loss|nll|perplexity|ppl|mse|rmse|mae|error|err|cer|wer")
_SCORE_WORDS = re.compile(r"acc|accuracy|top[15]|f1|auc|auroc|m?ap\d*|bleu|rouge\w*|m?iou|dice|r2|precision|recall"
                          r"|reward|return|psnr|ssim|ndcg\w*")
_QUALIFIERS = re.compile(r"val|valid|validation|train|training|eval|evaluation|test|dev|mean|avg|average|final|best|"
                         r"last|total|overall|epoch|step|episode|macro|micro|weighted|top|at|\d+")


def _metric_kind(name: str) -> str | None:
    """"loss" (lower is better), "score" (higher is better) or None, as the metric's name says."""
    words = [word for word in re.split(r"[^0-9a-z]+", name.lower()) if word]
    if not words or words[0].isdigit():  # `1-accuracy`: one minus a score, an error
        return None
    loss = any(_LOSS_WORDS.fullmatch(word) for word in words)
    score = any(_SCORE_WORDS.fullmatch(word) for word in words) or (
        "top" in words and words[words.index("top") + 1:words.index("top") + 2] in (["1"], ["5"]))  # top_1
    if loss == score or not all(_LOSS_WORDS.fullmatch(word) or _SCORE_WORDS.fullmatch(word)
                                or _QUALIFIERS.fullmatch(word) for word in words):
        return None
    return "loss" if loss else "score"


def _direction_problems(spec: StudySpec) -> list[tuple[str, str]]:
    """`direction: maximize` of a loss: the study would keep the worst trials, and fast-fail would prune the ones
    whose loss falls as not improving. Almost always a `metric:` forgotten (the default is val_loss). And the
    default direction, minimize, of a score such as `val_accuracy`: almost always a `direction:` forgotten, and
    fast-fail's rules would take a rising accuracy for an explosion (a minimised score stays, given explicitly)."""
    fast_fail = "fastfail" in _pruners(spec.pruner)
    kind = _metric_kind(spec.metric)
    if spec.direction == "minimize" and "direction" not in spec.model_fields_set and kind == "score":
        pruned = ", and fast-fail would prune the ones that learn" if fast_fail else ""
        return [("direction", f"minimize (the default) with metric {short_repr(spec.metric)} keeps the trials whose "
                              f"score is lowest{pruned}; set direction: maximize (or direction: minimize if the "
                              "lowest is what you want)")]
    if spec.direction != "maximize" or kind != "loss":
        return []
    given = "" if "metric" in spec.model_fields_set else " (the default metric)"
    pruned = ", and fast-fail would prune the ones whose loss falls" if fast_fail else ""
    return [("direction", f"maximize with metric {short_repr(spec.metric)}{given} keeps the trials whose loss is "
                          f"highest{pruned}; name what to maximise with metric: (val_accuracy, say), or minimize the "
                          "loss")]


def _warm_start_problems(spec: StudySpec) -> list[tuple[str, str]]:
    if not spec.warm_start.enabled:
        return []
    if not spec.checkpoints.enabled:
        return [("warm_start", "needs checkpoints to start from: set checkpoints.on_best, checkpoints.every_steps or "
                 "checkpoints.every_seconds")]
    if spec.warm_start.confirm >= spec.n_trials:
        return [("warm_start.confirm", f"expected fewer than n_trials ({spec.n_trials}): the confirmations are the "
                 f"last trials of the budget, after the search, but got {spec.warm_start.confirm}")]
    if spec.loop is not None or spec.command is not None:
        if "handoff" in spec.warm_start.model_fields_set:  # it would do nothing
            return [("warm_start.handoff", f"a {'loop' if spec.loop is not None else 'command'} study's warm trial "
                     "starts from its donor's newest save (run.load()), whatever its step; handoff is the built-in "
                     "trainer's: remove it")]
    else:  # the built-in trainer hands over at an evaluation step
        for end in (0, -1):
            try:
                config = TrainingConfig.from_dict(_example_config(spec, end))
            except ConfigError:  # reported by the config's own check
                return []
            if spec.warm_start.handoff_step(config.max_steps, config.eval_every_steps) == 0:
                latest = int(spec.warm_start.handoff * config.max_steps)  # the last step a handoff may be at
                needed = config.eval_every_steps / config.max_steps
                # A handoff is below 1: where the first evaluation is the budget's end, only evaluating sooner helps
                # (review: "at least 1" was offered, which the key refuses).
                remedy = (f"a handoff of at least {needed:.3g}, or evaluations more often" if needed < 1 else
                          f"eval_every_steps of at most {latest}" if latest >= 1 else
                          "a larger max_steps: this one leaves no step before the end to hand over at")
                return [("warm_start.handoff", f"{spec.warm_start.handoff:g} x max_steps ({config.max_steps}) is "
                         f"below the first evaluation (eval_every_steps {config.eval_every_steps}), so no trial would "
                         f"keep a checkpoint to hand over and warm start would never happen; expected {remedy}")]
    return []


def latest_handoff_step(spec: StudySpec) -> int | None:
    """No step a warm trial of this study takes its donor's state at is later than this: `handoff` x the largest
    `max_steps` (the handoff is the evaluation step at or below that fraction of a trial's budget). None for a `loop`
    or `command` study (a donor's newest save, any step)."""
    budget = largest_budget(spec)
    return None if budget is None else int(spec.warm_start.handoff * budget)


def largest_budget(spec: StudySpec) -> int | None:
    """The largest `max_steps` a trial of this built-in-trainer study can have; None for a `loop` or `command` study
    (the budget is the user's) or where none is known."""
    if spec.loop is not None or spec.command is not None:
        return None
    param = spec.space.get("max_steps")
    if isinstance(param, CategoricalParam):
        budgets = [c for c in param.choices if isinstance(c, int) and not isinstance(c, bool)]
    elif param is not None:
        budgets = [int(param.high)]
    else:
        try:
            budgets = [TrainingConfig.from_dict(_example_config(spec, 0)).max_steps]
        except ConfigError:
            budgets = []
    return max(budgets) if budgets else None


# The pruners that judge no step below their `n_warmup_steps` (Optuna's and sweep's own).
_WARMUP_PRUNERS = frozenset({"median", "percentile", "threshold", "leaders", "forecast"})


def _rung_problems(spec: StudySpec) -> list[tuple[str, str]]:
    """Successive halving's or Hyperband's `min_resource` at or above every trial's `max_steps` (which Hyperband's
    `max_resource: auto` becomes): no trial is judged at the first rung (at its last step a trial completes, its
    pruner not asked), so the pruner never prunes, without a word; and Hyperband's `max_resource` laying out a
    bracket whose first rung is there, which leaves that bracket's trials unjudged."""
    budget = largest_budget(spec)
    if budget is None:
        return []
    problems: list[tuple[str, str]] = []
    for where, kind, args in _pruner_components(spec.pruner):
        low = args.get("min_resource")
        if kind in ("hyperband", "successive_halving") and isinstance(low, int) and not isinstance(low, bool) \
                and low >= budget:
            problems.append((f"{where}.min_resource", f"{low} is not below every trial's max_steps ({budget}): no "
                                                      "trial would be judged at the first rung (at its last step a "
                                                      "trial completes), and nothing would be pruned; expected under "
                                                      f"{budget}"))
        elif kind == "successive_halving" and (late := _late_first_rung(args, budget)) is not None:
            problems.append((f"{where}.min_early_stopping_rate", late))
        elif kind == "hyperband" and (top := _top_bracket_rung(args)) is not None and top[0] >= budget:
            # Hyperband lays out its brackets up to `max_resource`: the trials of one whose first rung is at or past
            # every trial's last step are never judged (review: max_resource 1000, max_steps 60, a fifth of them).
            first, eta, low = top
            limit = low
            while limit < budget:  # the smallest min_resource x eta^k at or past the budget, counted exactly
                limit *= eta
            problems.append((f"{where}.max_resource", f"{args['max_resource']} gives Hyperband a bracket whose first "
                                                       f"rung is step {first}, not below every trial's max_steps "
                                                       f"({budget}): its trials would never be judged; expected "
                                                       f"under {limit} (min_resource x reduction_factor^k), or auto"))
    return problems


def _late_first_rung(args: Mapping[str, Any], budget: int) -> str | None:
    """What is wrong with successive halving's `min_early_stopping_rate` putting its first rung (min_resource x
    reduction_factor ^ rate; `auto`'s min_resource is 1 at the least) at or past every trial's last step, or None
    (malformed input review: 3 left the pruner silent, and 10^30 held a worker's CPU and 20 GB in Optuna's power)."""
    def whole(value: Any) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    auto = args.get("min_resource", "auto") == "auto"
    rate, eta = whole(args.get("min_early_stopping_rate", 0)), whole(args.get("reduction_factor", 4))
    low = 1 if auto else whole(args.get("min_resource"))
    if rate is None or eta is None or low is None or rate < 1 or eta < 2 or low < 1 or low >= budget:
        return None  # malformed (Optuna's constructor says so), or `min_resource`'s own problem
    rung, most = low, 0
    while rung * eta < budget:  # the highest rate whose rung is below the budget, counted exactly
        rung, most = rung * eta, most + 1
    if rate <= most:
        return None
    first = "min_resource (auto: 1 at the least)" if auto else str(low)
    return (f"{short_repr(rate)} puts the first rung at step {first} x reduction_factor {eta} ^ "
            f"{short_repr(rate)}, not below every trial's max_steps ({budget}): no trial would be judged, and "
            f"nothing would be pruned; expected at most {most}")


def _pruner_components(component: Any, where: str = "pruner") -> Iterator[tuple[str, Any, Mapping[str, Any]]]:
    """A pruner (`spec.pruner`, or a name) and each it wraps (`then:`, `wrapped:`): where it is written, its type and
    arguments."""
    if component is None:
        return
    if isinstance(component, str):
        yield where, component, {}
        return
    kind = getattr(component, "type", None) or (component.get("type") if isinstance(component, dict) else None)
    args = getattr(component, "args", None) or (component if isinstance(component, dict) else {})
    yield where, kind, args
    if isinstance(args, dict):
        for key in ("then", "wrapped"):
            yield from _pruner_components(args.get(key), f"{where}.{key}")


class InertPruner(UserWarning):
    """A pruner of the study that can judge none of its trials: a warmup past the last evaluation before a trial's
    last step. Said, not refused: a short run of a study (`--set fixed.max_steps=50`, a smoke test) leaves its pruner
    nothing to do."""


def _inert_pruners(spec: StudySpec) -> list[tuple[str, str]]:
    """A warmup no trial of this study gets past (review: such a pruner ran the study to the end and pruned nothing,
    without a word): `n_warmup_steps` (median, percentile, threshold, leaders, forecast) past the last evaluation
    before the last step of the longest trial (its last step is never judged: the trial completes there); Wilcoxon's
    `n_startup_steps` (2 at least) past the number of those evaluations. Wrapped ones too."""
    budget = largest_budget(spec)
    if budget is None:
        return []
    every = _evaluation_every(spec)
    # The last step a trial is asked about: its last evaluation before its last step (unknown with eval_every_steps
    # searched: the step before its last, at most).
    asked = None if every is None else (budget - 1) // every
    last = budget - 1 if every is None else (asked or 0) * every
    judged = (f"evaluations every {every} steps, the last step, {budget}, completing the trial" if every is not None
              else f"the last step, {budget}, completes the trial")
    found: list[tuple[str, str]] = []
    for where, kind, args in _pruner_components(spec.pruner):
        if asked == 0 and kind not in ("fastfail", "none", "wilcoxon", "patient", None):
            # No evaluation between a trial's start and its last step (README walk: quickstart with max_steps 50 and
            # an evaluation every 50 said nothing, where the README says a smoke test is told).
            found.append((where, f"{kind} will prune nothing: a trial is evaluated at its start and at its last step "
                                 f"only ({judged}); evaluate more often (fixed.eval_every_steps) for it to judge"))
            continue
        warmup = args.get("n_warmup_steps")
        if kind in _WARMUP_PRUNERS and isinstance(warmup, int) and not isinstance(warmup, bool) and warmup > last >= 1:
            found.append((f"{where}.n_warmup_steps", f"{warmup} is past the last step a trial is judged at ({last}: "
                                                     f"{judged}): {kind} will prune nothing; set it to at most "
                                                     f"{last} for it to judge"))
        startup = args.get("n_startup_steps", 2) if kind == "wilcoxon" else None  # Optuna's default: 2
        if isinstance(startup, int) and not isinstance(startup, bool) and asked is not None \
                and max(2, startup) > asked:
            # Wilcoxon compares a trial with the best one on the steps both reported, and judges no trial with fewer
            # of them than n_startup_steps, nor fewer than 2
            reported = (f"{asked} evaluation{'s' if asked != 1 else ''} a trial reports before its last step (one "
                        f"every eval_every_steps, of max_steps {budget}): wilcoxon will prune nothing")
            if asked >= 2:
                found.append((f"{where}.n_startup_steps", f"{startup} is more than the {reported}; set it to at "
                                                          f"most {asked} for it to judge"))
            else:
                found.append((f"{where}.n_startup_steps" if "n_startup_steps" in args else where,
                              f"Wilcoxon judges a trial once it has reported 2 evaluations, more than the "
                              f"{reported}; evaluate more often (fixed.eval_every_steps) for it to judge"))
    return found


def _evaluation_every(spec: StudySpec) -> int | None:
    """The study's `eval_every_steps`; None where it is searched or unknown."""
    if "eval_every_steps" in spec.space:
        return None
    try:
        every = TrainingConfig.from_dict(_example_config(spec, 0)).eval_every_steps
    except ConfigError:
        return None
    return every if every >= 1 else None


def _top_bracket_rung(args: Mapping[str, Any]) -> tuple[int, int, int] | None:
    """Hyperband's largest bracket's first rung, as Optuna lays the brackets out (`floor(log_eta(max / min)) + 1`
    brackets, bracket k's first rung at `min_resource * eta**k`), with eta and min_resource; None where the
    arguments are not numbers that decide it (`max_resource: auto`, or ones refused elsewhere)."""
    high, low, eta = args.get("max_resource"), args.get("min_resource", 1), args.get("reduction_factor", 3)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (high, low, eta)) or low < 1 or eta < 2 \
            or high < low:
        return None
    return low * eta ** math.floor(math.log(high / low, eta)), eta, low


def _example_config(spec: StudySpec, end: int) -> dict[str, Any]:
    """A user's config with every searched key at the low end of its range or its first choice (`end` 0), or at the
    high end or its last choice (-1)."""
    return spec.user_config(_example_values(spec, end))


def _example_values(spec: StudySpec, end: int) -> dict[str, Any]:
    """`_example_config`'s searched values."""
    return {key: param.choices[end] if isinstance(param, CategoricalParam) else param.low if end == 0 else param.high
            for key, param in spec.space.items()}


def _config_problems(values: dict[str, Any], task: Task, builtin: bool, model: bool = True) -> list[tuple[str, str]]:
    """What the trainer refuses in `values`; `model=False`: not the model's values (a key that is not `model.*`
    changes nothing the model builder reads, and building a large model on the meta device takes tens of ms)."""
    try:
        config = TrainingConfig.from_dict(values)
    except ConfigError as exc:  # fast_fail.* values come from the pruner, whose own check reports them
        return [(key, _suggest(key, message)) for key, message in exc.problems if not key.startswith("fast_fail")]
    if not model:
        return []
    check = task.build_problems if builtin else task.model_problems
    return [(key, _suggest(key, message)) for key, message in check(config.model)]


def _same_once_read(where: str, param: CategoricalParam, hint: Any) -> list[tuple[str, str]]:
    """Two choices that the key reads as one value (`[1, "1.0"]` for a float: a number written as text is taken):
    Optuna keeps them apart, so the sampler would split its draws between them while every trial trains the same."""
    if hint is None:
        return []
    first: dict[Any, int] = {}
    for j, choice in enumerate(param.choices):
        ok, read, _ = coerce(choice, hint)
        if not ok:
            continue
        try:
            i = first.setdefault(read, j)
        except TypeError:  # a value no dict holds (a mapping default's)
            continue
        if i != j:
            return [(f"{where}.choices[{j}]", f"{short_repr(choice)} is read as {short_repr(read)}, as choices[{i}] "
                     f"({short_repr(param.choices[i])}) is; expected distinct choices")]
    return []


def _candidates(param: FloatParam | IntParam | CategoricalParam) -> list[tuple[str | None, Any]]:
    """The values of a searched key the trainer is asked about before any trial runs: every categorical choice; a
    range's ends and, where it draws steps (an int range, a float range with `step`), the values next to them
    (labelled None), so that a rule of divisibility (`d_model` by `n_heads`, a batch by the ranks) is met by every
    draw, not only by the ends."""
    if isinstance(param, CategoricalParam):
        return [(f"choices[{i}]", choice) for i, choice in enumerate(param.choices)]
    ends: list[tuple[str | None, Any]] = [("low", param.low), ("high", param.high)]
    if param.step is None or (param.log and isinstance(param, FloatParam)):
        return ends
    if param.log:  # an int range on the log scale draws every integer in it
        inner: list[Any] = [param.low + 1, param.high - 1]
    else:  # the grid's second point and its last but one, counted as Optuna counts them (exactly, for floats)
        low, step = Decimal(str(param.low)), Decimal(str(param.step))
        last = int((Decimal(str(param.high)) - low) // step)
        kind = int if isinstance(param, IntParam) else float
        inner = [kind(low + step), kind(low + step * (last - 1))]
    seen = {param.low, param.high}
    for value in inner:
        if param.low < value < param.high and value not in seen:
            seen.add(value)
            ends.append((None, value))  # no key of the file names it
    return ends


def _at(where: str, label: str | None, value: Any) -> str:
    """Where a searched value is named: by its key in the file (`space.x.low`), or as a drawn value between the ends,
    which no key names."""
    return f"{where} (drawn value {value})" if label is None else f"{where}.{label}"


def _required_arguments(name: str) -> set[str]:
    """The arguments a task's function takes with no default (none where it cannot be found or read: `load_task`
    then says why)."""
    import inspect

    from trainer.tasks import argument_defaults

    return {key for key, default in (argument_defaults(name) or {}).items() if default is inspect.Parameter.empty}


def _first_value(param: FloatParam | IntParam | CategoricalParam) -> Any:
    """A value the searched key may take: its range's smaller end, or its first choice."""
    extremes = _extremes(param)
    return extremes[0][1] if extremes else param.choices[0] if isinstance(param, CategoricalParam) else param.low


def _extremes(param: FloatParam | IntParam | CategoricalParam) -> list[tuple[str | None, Any]]:
    """A searched key's smallest and largest values, the ones a rule between two keys (`warmup_steps` at most
    `max_steps`) is met or broken by first; none for choices that are not all numbers."""
    if not isinstance(param, CategoricalParam):
        return [("low", param.low), ("high", param.high)]
    numbers = [(i, c) for i, c in enumerate(param.choices) if isinstance(c, (int, float)) and not isinstance(c, bool)]
    if len(numbers) != len(param.choices) or len(numbers) < 2:
        return []
    low, high = min(numbers, key=lambda n: n[1]), max(numbers, key=lambda n: n[1])
    return [(f"choices[{low[0]}]", low[1]), (f"choices[{high[0]}]", high[1])]


def _pair_problems(spec: StudySpec, keys: list[str], base: dict[str, Any], base_problems: list[tuple[str, str]],
                   task: Task, builtin: bool) -> list[tuple[str, str]]:
    """Two searched keys whose values the trainer takes one by one but not together (`warmup_steps` up to 50 with
    `max_steps` from 20; `model.d_model` and `model.n_heads` both searched): their extremes are tried in pairs, and
    the first pair refused is named. Only the trainer's own checks when neither key is a model key."""
    problems: list[tuple[str, str]] = []
    for i, first in enumerate(keys):
        for second in keys[i + 1:]:
            model = first.startswith("model.") and second.startswith("model.")
            # Two model keys meet in a rule of divisibility (heads and width), which the values between the ends
            # break as often as the ends: each is tried at every value `_candidates` tries it at alone.
            values = _candidates if model else _extremes
            pair = next(((a_label, a, b_label, b, found[0]) for a_label, a in values(spec.space[first])
                         for b_label, b in values(spec.space[second])
                         if (found := [p for p in _config_problems({**base, first: a, second: b}, task, builtin, model)
                                       if p not in base_problems])), None)
            if pair is not None:
                a_label, a, b_label, b, (bad_key, message) = pair
                with_first = f"{first} {a}" + ("" if a_label is None else f" (space.{first}.{a_label})")
                problems.append((_at(f"space.{second}", b_label, b), f"with {with_first}, {bad_key}: {message}"))
    return problems


def _suggest(key: str, message: str) -> str:
    """The trainer's "unknown key; expected one of: a, b" with a "did you mean" for the closest of them."""
    head, found, options = message.partition("; expected one of: ")
    if not found or not head.startswith("unknown key") or "(did you mean" in head:  # the trainer's own hint, once
        return message
    return f"{head}{did_you_mean(key.rpartition('.')[2], options.split(', '))}{found}{options}"


def store_problems(spec: StudySpec, storage_url: str) -> list[tuple[str, str]]:
    """Whether the study's checkpoint folder can be made where it goes (`checkpoints.store`, or next to the SQLite
    file), checked before anything is created: no part of it may be a file, and its nearest existing folder must
    be writable. An object store is not contacted here."""
    from sweep.registry import default_store

    store = spec.checkpoints.store
    if store is not None and "://" in store:
        return [("checkpoints.store", problem)] if (problem := _object_store_client_problem(store)) else []
    folder = Path(store).expanduser() if store is not None else default_store(storage_url)
    which = "checkpoints.store" if store is not None else "checkpoints.store (default: next to the SQLite file)"
    artifacts = folder / "_artifacts"  # every study's dashboard copies (`sweep.blobs.artifact_store_at`)
    if long_name_problem(folder / spec.name) is None and (artifacts.exists() or artifacts.is_symlink()) \
            and not artifacts.is_dir():
        return [(which, f"{artifacts} is a file; the dashboard's checkpoint copies need a folder there")]
    problem = folder_problem(folder / spec.name, "the checkpoints need")
    return [] if problem is None else [(which, problem)]


_OBJECT_STORE_CLIENTS = {"s3": ("boto3", "boto3", "'sweep[s3]'"),
                         "gs": ("google.cloud.storage", "google-cloud-storage", "'sweep[gs]'")}


def _object_store_client_problem(store: str) -> str | None:
    """An object store whose client library is not installed (Optuna's artifact store imports it when the first
    trial starts, with a traceback), before anything is created; the store itself is not contacted."""
    import importlib.util

    scheme = store.partition("://")[0]
    if scheme not in _OBJECT_STORE_CLIENTS:
        return None
    module, package, extra = _OBJECT_STORE_CLIENTS[scheme]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package (google, google.cloud) missing
        found = False
    return None if found else f"{scheme}:// needs {package}, which is not installed: pip install {extra}"


def _expected_type(key: str, task: Task) -> type | None:
    """int when the key takes integers (so a float range for it is refused before any trial), else None."""
    hint = _hint(key, task)
    if key.startswith("model."):
        return hint
    options = typing.get_args(hint) or (hint,)
    return int if int in options else None


def _hint(key: str, task: Task) -> Any:
    """The type a key takes: a model key's default's, else what TrainingConfig annotates it with, through its nested
    config dataclasses (curriculum.stages); None for a key it does not name (or a model key defaulting to None)."""
    head, _, rest = key.partition(".")
    if head == "model":
        default = task.model_default(rest)[1]
        return type(default) if default is not None else None
    owner: Any = TrainingConfig
    while True:
        hint = typing.get_type_hints(owner).get(head)
        if rest and isinstance(hint, type) and dataclasses.is_dataclass(hint):
            owner, (head, _, rest) = hint, rest.partition(".")
            continue
        return hint


def _no_numbers(key: str, task: Task) -> tuple[str, str] | None:
    """What a key takes when that is no number (a name among some, true or false) and how to search it, said for a
    range searched on it; None when it takes numbers, or its type is not known."""
    hint = _hint(key, task)
    if hint is None:
        return None
    if typing.get_origin(hint) is typing.Literal:
        values = typing.get_args(hint)
        if any(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            return None
        shown = ", ".join(repr(v) for v in values)
        return f"one of {shown}", f"type: categorical, choices: [{shown}]"
    options = set(typing.get_args(hint) or (hint,)) - {type(None)}
    if options == {bool}:
        return "true or false", "type: categorical, choices: [true, false]"
    if options == {str}:
        return "a name", "type: categorical, with the names as choices"
    return None


def _task_arg_type(task_name: str, arg: str) -> type | None:
    """int when the task's function annotates `arg` as an integer (a float range for it would fail every trial that
    draws a fraction), else None."""
    try:
        hint = typing.get_type_hints(resolve_task_factory(task_name)).get(arg)
    except Exception:  # noqa: BLE001 - no hints, or hints that cannot be resolved: the task's call says what is wrong
        return None
    options = typing.get_args(hint) or (hint,)
    return int if int in options and float not in options else None


def _unique(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return list(dict.fromkeys(problems))
