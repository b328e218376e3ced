"""`python -m trainer config.yaml [--set key=value ...]`: train one config, no study needed.

`python -m trainer a.yaml b.yaml c.yaml --batched`: train several configs together, those that share a batch
signature as one stacked model (`trainer.batched`), and print one JSON result line per config, in order.

`torchrun --nproc-per-node N -m trainer config.yaml`: train one config data-parallel on N processes (DDP; NCCL on
GPUs, one per process, gloo on a CPU; see trainer.distributed). `batch_size` is the global batch, split evenly
between the ranks; rank 0 alone prints.

The config file is a `TrainingConfig` as YAML or JSON (what `sweep best` prints). Progress goes to stderr as one line
per log and eval; the final result is printed to stdout as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from trainer.config import NUMBER_TEXT, ConfigError, TrainingConfig, clash, nest, overrides_clash
from trainer.distributed import RankEnvironmentError
from trainer.loop import NullReporter, TrainResult, train
from trainer.messages import error_words, strict_json
from trainer.precision import DeviceUnavailable, out_of_memory, out_of_memory_words, resolve_device
from trainer.tasks import TaskError
from trainer.yaml_file import INT_DIGITS, YamlFileError, load_yaml, printable, read_text, short_repr


class PrintReporter:
    """Prints every log and evaluation, after `prefix` (a `--batched` member's file); the fast-fail rules decide
    when to stop (`decides`: it does not)."""

    decides = False

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        print(f"{self.prefix}step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k != "step"),
              file=sys.stderr)

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        print(f"{self.prefix}eval {step}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()), file=sys.stderr)
        return False


# The first line `sweep best` writes for a study of the user's own loop or command (sweep.cli.best): its keys may all be
# TrainingConfig keys (learning_rate, max_steps), and training them here would train the built-in model instead.
_USER_CONFIG = re.compile(r"\A\ufeff?# best trial of study .*: its config[,;] ")


def _load(path: Path) -> dict[str, Any]:
    """The config file's values, read by the rules of a study file (`trainer.yaml_file`): a regular file of at most
    1 MiB of UTF-8 text, one YAML document of plain values, no duplicate keys, no alias bomb."""
    text = read_text(path, "config file")
    if _USER_CONFIG.match(text):
        raise ValueError("this is the config of a `loop:` or `command:` study's trial, as `sweep best` writes it; "
                         "python -m trainer trains the built-in trainer's configs only: give it to your own code, "
                         "or train the trial again with `sweep reproduce STUDY TRIAL`")
    data = _load_json(text) if path.suffix == ".json" else load_yaml(text, path, what="config file")
    if not isinstance(data, dict):
        raise ValueError("expected a mapping of TrainingConfig keys at the top level")
    return data


def _load_json(text: str) -> Any:
    """JSON by the same rules as YAML here: a key given twice is refused (json would keep the last silently), and
    nesting too deep to read is one error, not a RecursionError."""
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}; each key may appear once")
            seen[key] = value
        return seen

    def whole(digits: str) -> int:
        if len(digits.lstrip("-")) > INT_DIGITS:  # Python's own limit, whose message names neither line nor fix
            raise ValueError(f"invalid JSON: a whole number of {len(digits.lstrip('-'))} digits; expected a number "
                             f"of at most {INT_DIGITS} digits")
        return int(digits)

    try:
        return json.loads(text, object_pairs_hook=unique, parse_int=whole)
    except RecursionError:
        raise ValueError("invalid JSON: nested too deeply; expected a mapping of TrainingConfig keys") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}") from None




def _parse_set(items: list[str]) -> dict[str, Any]:
    """`--set key=value`: a number, a list or mapping in brackets, a quoted string, true, false or null is read as
    YAML, by the rules a config file's values are read by (`1e3` a whole number, `1e-400` refused); any other word
    is the string it spells (`mixed_precision=off`, `data=*.npy`), as a shell user means it. Raises
    `YamlFileError` (source: the command line) for a value that is not one."""
    out: dict[str, Any] = {}
    given: list[tuple[str, Any]] = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected key=value, got {item!r}")
        if any(not part.strip() for part in key.split(".")):
            raise ValueError(f"expected a dotted key path with no empty part (model.hidden=64), got {key!r}")
        parsed = raw[:1] in "[{\"'" or raw in ("true", "false", "null", "~") or NUMBER_TEXT.fullmatch(raw.strip())
        out[key] = load_yaml(raw, "command line", f"--set {key}", "config") if parsed else _number_or_word(raw)
        given.append((key, out[key]))
    if (problem := overrides_clash(given)) is not None:  # the later would silently win (review)
        raise ValueError(problem)
    return out


def _number_or_word(raw: str) -> Any:
    """A `--set` value that is no plain number: a number all the same where a config file would read one (`0x10`,
    `0o17`, `.inf`, `.nan`: review, `seed: 0x10` in the file was 16 and `--set seed=0x10` was refused as a string),
    else the string it spells."""
    try:
        value = load_yaml(raw, "command line", "--set", "config")
    except YamlFileError:
        return raw
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else raw


def _given_by(key: str, overrides: Mapping[str, Any]) -> str | None:
    """The `--set` key a problem's key lies under or above, if one gave it (`--set foo.bar=1` makes `foo`
    unknown)."""
    return next((given for given in overrides
                 if key == given or key.startswith(f"{given}.") or given.startswith(f"{key}.")), None)


def _overridden(values: Mapping[str, Any], overrides: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The config file's values (checked for keys that set one value twice) with each `--set` key set in them, as
    a nested mapping; a `--set` key inside a value of the file that is not a mapping is refused."""
    if (problem := clash(values)) is not None:
        raise ValueError(problem)
    nested = nest(values)
    for key, value in overrides.items():
        node, parts = nested, key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                outer = ".".join(parts[:depth + 1])
                raise ConfigError([(key, f"{outer} is {short_repr(child)} in {path}, not a mapping")])
            node = child
        existing = node.get(parts[-1])
        node[parts[-1]] = {**existing, **nest(value)} if isinstance(value, Mapping) and isinstance(
            existing, dict) else value
    return nested


class _Parser(argparse.ArgumentParser):
    """A usage error is one line, as every other error here."""

    def error(self, message: str) -> Any:
        print(printable(f"{self.prog}: {message} (see --help)"), file=sys.stderr)
        raise SystemExit(2)


def _config_path(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a config file (YAML or JSON), got {text!r}")
    return Path(text)


def _check_model(config: TrainingConfig) -> None:
    """A built-in task's model values that its builder refuses (`model.hidden: 0`, `model.activation: foo`), found
    before training by building the model on the meta device, as `sweep run` checks a study's (`ConfigError`). A
    user's task is not built here: its builder may do anything, and it meets its errors when it trains."""
    from trainer.tasks import BUILTIN_TASKS, load_task

    if config.task not in BUILTIN_TASKS:
        return
    problems = load_task(config.task, config.task_args).build_problems(config.model)
    if problems:
        raise ConfigError(problems)


class _NotMain(Exception):
    """A rank other than 0 finished: rank 0 prints the result."""


def _train_one(config: TrainingConfig) -> TrainResult:
    """Train one config: in this process, or as one rank of a torchrun group (WORLD_SIZE > 1 in the environment)."""
    from trainer.distributed import from_environment

    ranks = from_environment(device_type=resolve_device(config.device).type)
    try:
        result = train(config, reporter=PrintReporter() if ranks.is_main else NullReporter(), ranks=ranks)
    except BaseException:
        ranks.close()
        raise
    ranks.finish()
    if not ranks.is_main:
        raise _NotMain
    return result


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m trainer", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=_config_path, nargs="+",
                        help="TrainingConfig as YAML or JSON (several with --batched)")
    parser.add_argument("--batched", action="store_true", help="train the configs together as stacked cohorts")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a (dotted) key")
    args = parser.parse_args(argv)
    if len(args.config) > 1 and not args.batched:
        parser.error("several configs need --batched")
    try:  # a problem of the command line, not of a file
        overrides = _parse_set(args.set)
    except YamlFileError as exc:  # a ValueError too
        for key, message in exc.problems:
            print(printable(f"{key}: {message}" if key else f"--set: {message}"), file=sys.stderr)
        return 2
    except ValueError as exc:
        print(printable(str(exc) if str(exc).startswith("--set ") else f"--set: {exc}"), file=sys.stderr)
        return 2
    configs: list[TrainingConfig] = []
    refused: dict[str, None] = {}  # every file's problems, then exit 2 (review: only the first bad file was named)
    for path in args.config:
        try:
            values = _load(path)  # first: a path that cannot be read (a symlink loop, say) is one line from it
            folder = str(path.resolve().parent)  # importable, as a script's folder is (a study file's for sweep run)
            if folder not in sys.path:
                sys.path.append(folder)
            config = TrainingConfig.from_dict(_overridden(values, overrides, path))
            _check_model(config)
            configs.append(config)
        except (ConfigError, YamlFileError) as exc:
            for key, message in exc.problems:
                given = _given_by(key, overrides) if isinstance(exc, ConfigError) else None
                if given is None:
                    shown = f"{path}: {key}: {message}" if key else f"{path}: {message}"
                elif key == given or key.startswith(f"{given}."):
                    shown = f"--set {key}: {message}"
                else:  # the problem's key holds the one --set gave (`--set foo.bar=1`: `foo` is unknown)
                    shown = f"--set {given}: {key}: {message}"
                refused[printable(shown)] = None  # a --set's problem once, not once per file
        except (OSError, ValueError) as exc:
            refused[printable(f"{path}: {exc}")] = None
    if refused:
        print("\n".join(refused), file=sys.stderr)
        return 2
    failed: dict[int, Exception] = {}  # of several trained together, the ones whose training raised
    try:
        if args.batched:
            from trainer.batched import CohortMember, train_batched  # loads torch.func only when asked

            labels = [printable(str(path)) for path in args.config]
            results = train_batched([CohortMember(config, reporter=PrintReporter(f"{label}: "))
                                     for config, label in zip(configs, labels)], labels=labels, failed=failed)
        else:
            results = [_train_one(configs[0])]
    except (ConfigError, TaskError) as exc:
        print(printable(f"{_culprit(args.config, configs, _task_fails)}: {exc}"), file=sys.stderr)
        return 2
    except RankEnvironmentError as exc:  # torchrun's variables, set by hand and wrong
        print(printable(f"environment: {exc}"), file=sys.stderr)
        return 2
    except DeviceUnavailable as exc:  # the config's `device`, not a fault of the run: use auto or cpu here
        print(f"{_culprit(args.config, configs, _device_fails)}: device: {exc}; set device: auto (or cpu) to train "
              "on this machine", file=sys.stderr)
        return 2
    except _NotMain:
        return 0
    except (torch.OutOfMemoryError, RuntimeError, MemoryError) as exc:
        if not out_of_memory(exc):
            raise
        # The config's model and batch size do not fit this machine: one line, not PyTorch's traceback.
        files = ", ".join(map(str, args.config))  # of several trained together, their cohort ran out
        print(printable(f"{files}: out of memory: {out_of_memory_words(exc)} (a smaller model or batch_size fits)"),
              file=sys.stderr)
        return 1
    trained = iter(results)
    for index, path in enumerate(args.config):
        if index in failed:  # the others trained on: their lines follow, and the command exits 1
            error = failed[index]
            said = (f"out of memory: {out_of_memory_words(error)} (a smaller model or batch_size fits)"
                    if out_of_memory(error) else error_words(error))
            if not out_of_memory(error):  # a bug of the task's code, as alone: its traceback, then its line
                traceback.print_exception(error, file=sys.stderr)
            print(printable(f"{path}: failed: {said}"), file=sys.stderr)
            print(json.dumps(strict_json({"config": str(path), "status": "failed", "error": said}), allow_nan=False))
            continue
        result = next(trained)
        line = {"status": result.status, "steps": result.steps, "metrics": result.metrics,
                **({"stop_reason": result.stop_reason} if result.stop_reason else {}),
                "wall_time_s": round(result.wall_time_s, 3), "reproducibility": result.reproducibility}
        print(json.dumps(strict_json({"config": str(path), **line} if args.batched else line), allow_nan=False))
    return 1 if failed else 0



def _culprit(paths: list[Path], configs: list[TrainingConfig], fails: Callable[[TrainingConfig], bool]) -> str:
    """The file whose config raised, of several trained together: the first one that `fails` alone (its task
    loaded again, its device resolved), else all of them."""
    if len(paths) == 1:
        return str(paths[0])
    for path, config in zip(paths, configs):
        if fails(config):
            return str(path)
    return ", ".join(map(str, paths))


def _task_fails(config: TrainingConfig) -> bool:
    """Whether the config's task, or its model built for the config (on the meta device), raises: a user task's
    model keys are checked as its model is built (review: a typo in one file named every file)."""
    from trainer.batched import batch_signature
    from trainer.tasks import load_task

    try:
        batch_signature(config, load_task(config.task, config.task_args))
    except Exception:  # noqa: BLE001 - whatever it raises, this is the config that raised
        return True
    return False


def _device_fails(config: TrainingConfig) -> bool:
    try:
        resolve_device(config.device)
    except DeviceUnavailable:
        return True
    return False


def _interrupted(signum: int) -> int:
    """A Ctrl-C (or a SIGINT sent by hand) while the command ran: one line and the shell's code, not a traceback from
    wherever the step was. Nothing is written by `python -m trainer` itself, so there is nothing half-written."""
    print("python -m trainer: interrupted; the run was not finished (nothing of it was saved)", file=sys.stderr)
    return 128 + signum


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:
        code = _interrupted(signal.SIGINT)
    if os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):  # a torchrun rank, its group finished
        from trainer.distributed import exit_process

        exit_process(code)
    sys.exit(code)
