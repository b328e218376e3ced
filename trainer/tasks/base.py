"""What a study trains: a model builder, training and validation tensors, a loss, and the metrics of an evaluation."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from trainer.config import ConfigError, coerce

__all__ = ["Task", "TaskError", "accuracy_sum", "as_fp32", "cross_entropy", "first_unfinite", "materialize",
           "out_of_classes"]


def first_unfinite(samples: torch.Tensor, as_float32: bool = False) -> int | None:
    """The first sample (dimension 0) of floating or complex `samples` that holds NaN or infinity, or None, read 16M
    values at a time (a memory-mapped set is never copied whole). Floats are read as float32, which holds float8,
    float16 and bfloat16 exactly (float8 has no `isfinite` of its own); float64 too with `as_float32` (what a float32
    model reads: past its range is infinity), else as float64."""
    if not (samples.dtype.is_floating_point or samples.dtype.is_complex):
        return None
    step = max(1, (1 << 24) // max(1, math.prod(samples.shape[1:])))
    for start in range(0, len(samples), step):
        rows = samples[start:start + step]
        if not rows.dtype.is_complex and (as_float32 or rows.dtype != torch.float64):
            rows = rows.float()
        bad = ~torch.isfinite(rows).reshape(len(rows), -1).all(1)
        if bool(bad.any()):
            return start + int(bad.nonzero()[0])
    return None


def as_fp32(out: Any) -> Any:
    """A model's output for the loss: one tensor in float32 (autocast leaves it in bf16 or fp16), unless it is
    float64 or complex (cast, a model of that type would lose precision or its imaginary part); anything else (a
    tuple, a dict, a model-output object) as the model returned it, for a `loss=` of the task's own to take."""
    if isinstance(out, torch.Tensor) and out.dtype != torch.float64 and not out.is_complex():
        return out.float()
    return out


def materialize(model: nn.Module, inputs: torch.Tensor) -> nn.Module:
    """`model` with every lazy module's tensors created: PyTorch's dry run, one forward of the first sample of
    `inputs` (on the model's device), in eval mode and without gradients (no dropout draw), each module's mode put
    back afterwards. The initialisation then draws from the seeded RNG right after the model is built, wherever it is
    built. A model without lazy modules is returned untouched."""
    if not any(isinstance(m, LazyModuleMixin) and m.has_uninitialized_params() for m in model.modules()):
        return model
    device = next(iter(model.parameters())).device
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            model(inputs[:1].to(device))
    finally:
        for module, training in modes.items():
            module.train(training)
    return model


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every position: works for [B, C] (classes) and [B, T, V] (tokens)."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model returned a {type(logits).__name__}, and the default loss (cross entropy) takes one "
                        "tensor of logits: return a tensor from forward, or give the Task a loss= that takes what "
                        "the model returns")
    if targets.is_floating_point():  # a regression task's targets (PyTorch said "expected target dtype to be Long")
        raise TypeError(f"the default loss (cross entropy) takes class indices, and the targets are {targets.dtype}: "
                        "for a regression task give the Task a loss= such as torch.nn.functional.mse_loss (as "
                        "loss=lambda out, y: mse_loss(out.squeeze(-1), y) for one output per sample)")
    if targets.dtype not in (torch.int64, torch.uint8):  # int32, int16, bool: what numpy and files often hold
        targets = targets.long()  # (PyTorch said "expected target dtype to be Long or Byte, but got Int")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


IGNORE_INDEX = -100  # cross entropy's `ignore_index`: a target left out of the loss (padding), and of the accuracy


def accuracy_sum(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample accuracy summed over the batch (the evaluation divides by the number of samples). For sequences,
    a sample's accuracy is the mean over its positions whose target is not `IGNORE_INDEX` (-100, which the default
    loss leaves out too: padding); a sample whose every target is -100 counts as 0."""
    predicted = logits.argmax(-1)
    if targets.shape != predicted.shape:  # [N, 1] against [N] compared every target with every prediction
        if targets.numel() != predicted.numel():
            raise TaskError(f"accuracy: the targets' shape {tuple(targets.shape)} does not match the model's "
                            f"predictions {tuple(predicted.shape)} (its output {tuple(logits.shape)} less the class "
                            "dimension)")
        targets = targets.reshape(predicted.shape)
    correct = (predicted == targets).float()
    # Only a signed dtype holds -100 (uint8's 156 compares equal to it, and is a class like any other).
    kept = targets != IGNORE_INDEX if targets.is_signed() else torch.ones_like(targets, dtype=torch.bool)
    correct, kept = correct.reshape(correct.shape[0], -1), kept.reshape(correct.shape[0], -1)
    counted = (correct * kept).sum(1) / kept.sum(1).clamp(min=1)
    # Where no target is ignored, the plain mean, to the bit as it always was (no read-back to choose: a select).
    return {"accuracy": torch.where(kept.all(1), correct.mean(1), counted).sum()}


# How PyTorch refuses tensors of two dtypes: "mat1 and mat2 must have the same dtype, but got Double and Float",
# "expected scalar type Float but found Double", "Input type (double) and bias type (float) should be the same".
_DTYPE_MISMATCH = re.compile(r"same dtype|scalar type \w+ but found|Input type \(\w+\) and \w+ type \(\w+\)")


class TaskError(ValueError):
    """A task that cannot be found, built or used as it is (its loss not one number); the message names the task."""


# How PyTorch refuses a class index the logits do not have: cross entropy's ("Target 2 is out of bounds.") and a
# gather's, as a cohort's stacked cross entropy takes it ("index 2 is out of bounds for dimension 2 with size 2").
_OUT_OF_CLASSES = re.compile(r"Target (-?\d+) is out of bounds")
_GATHER_OUT_OF_BOUNDS = re.compile(r"index (-?\d+) is out of bounds for dimension")


def out_of_classes(exc: BaseException, task: str, classes: int, *, gathered: bool = False) -> TaskError | None:
    """PyTorch's refusal of a target beyond the model's classes as one line naming the task, or None for any other
    error. `gathered`: the error of a gather of the targets' log-probabilities (a cohort's stacked cross entropy),
    whose words any indexing error also has. (On a GPU the kernel's assertion ends the process instead.)"""
    found = (_GATHER_OUT_OF_BOUNDS if gathered else _OUT_OF_CLASSES).search(str(exc))
    if found is None:
        return None
    target = found.group(1)
    return TaskError(f"task {task!r}: a target is class {target}, and the model gives {classes} classes (0 to "
                     f"{classes - 1}): give the model one output per class the targets hold (-100 is padding, left "
                     "out)")


DIGEST_ELEMENTS = 1 << 22  # `Task.data_digest`: at most this many elements of each tensor


def _sampled(tensor: torch.Tensor, runs: int = 64) -> Iterator[torch.Tensor]:
    """`tensor` flattened, or, above `DIGEST_ELEMENTS` elements, that many of them: `runs` evenly spaced runs of
    consecutive samples (dimension 0), each cut to its share. Reads only those samples: no copy of the whole."""
    if tensor.numel() <= DIGEST_ELEMENTS:
        yield tensor.reshape(-1)
        return
    share = DIGEST_ELEMENTS // runs
    rows = len(tensor)
    take = max(1, share // max(1, tensor[0].numel()))  # samples per run
    for run in range(runs):
        start = (rows - take) * run // (runs - 1)
        yield tensor[start:start + take].reshape(-1)[:share]


def _raw_bytes(flat: torch.Tensor) -> bytes:
    """A 1-d tensor's elements as bytes, on the host (any dtype: bfloat16 and the float8 types have no numpy type,
    so their bits are read as integers of their size)."""
    flat = flat.cpu().contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    elif flat.is_floating_point() and flat.element_size() < 4:
        flat = flat.view(torch.int8 if flat.element_size() == 1 else torch.int16)
    elif flat.is_complex():
        flat = torch.view_as_real(flat)
    return flat.numpy().tobytes()


@dataclass
class Task:
    """A training problem.

    `train` and `val` are `(inputs, targets)` tensors with the sample on dimension 0; the trainer moves them to the
    device once and batches them there. `build_model` receives `model_defaults` updated with the config's `model`
    mapping: the defaults name every key the builder accepts, so a typo in a study file is refused before training.
    A default that is a non-empty mapping names the keys it accepts the same way, and is updated key by key
    (`model.enc.width` changes `width` and keeps `enc`'s other defaults); an empty one takes any mapping as given.
    `eval_metrics` returns sums over a batch; the evaluation divides by the number of samples and prefixes `val_`.
    `difficulty` scores each training sample for curricula (higher is harder; only the order matters), as a tensor or
    array, or as a function that computes them: it is called once, and only when a curriculum is on.
    """

    name: str
    train: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor]
    build_model: Callable[[dict[str, Any]], nn.Module]
    model_defaults: Mapping[str, Any] = field(default_factory=dict)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    eval_metrics: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]] | None = None
    eval_metric_names: tuple[str, ...] = ()
    tokens_per_sample: int = 0  # > 0 for sequence tasks: the trainer then reports tokens/s
    difficulty: torch.Tensor | np.ndarray | Callable[[], torch.Tensor | np.ndarray] | None = None
    _scores: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _digest: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = list(self.eval_metric_names)
        if "loss" in names or len(set(names)) != len(names):
            raise ValueError(f"task {self.name!r}: eval_metric_names {tuple(names)}: "
                             + ("'loss' is the trainer's own (val_loss: the task's loss over the validation set), "
                                "and its value would replace it; name the metric otherwise" if "loss" in names
                                else "a name appears twice; each metric once"))
        for part in ("train", "val"):
            value = getattr(self, part)
            if not (isinstance(value, (tuple, list)) and len(value) == 2):
                got = f"a {type(value).__name__} of {len(value)}" if isinstance(value, (tuple, list)) \
                    else f"a {type(value).__name__}"
                raise ValueError(f"task {self.name!r}: {part} must be (inputs, targets), two tensors with the sample "
                                 f"on dimension 0; got {got}")
            for what, tensor in zip(("inputs", "targets"), value):
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"task {self.name!r}: {part} {what} must be a tensor (the sample on dimension 0), "
                                     f"got {type(tensor).__name__}: pack other data into tensors, or write a loop: "
                                     "function (README, From your train.py)")
            if value[0].dim() == 0 or value[1].dim() == 0 or len(value[0]) != len(value[1]):
                raise ValueError(f"task {self.name!r}: {part} inputs and targets must hold the same number of "
                                 f"samples (dimension 0), got {tuple(value[0].shape)} and {tuple(value[1].shape)}")
            if len(value[0]) == 0:
                raise ValueError(f"task {self.name!r}: {part} holds no samples (inputs of shape "
                                 f"{tuple(value[0].shape)}); it needs at least one")

    def checked_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`loss(out, y)`, refused (`TaskError`) unless it is one number: a loss with `reduction="none"` returns one
        per row, which PyTorch's backward refuses without naming the loss. Its shape is known on the host: no
        sync."""
        try:
            loss = self.loss(out, y)
        except (IndexError, RuntimeError) as exc:
            if isinstance(out, torch.Tensor) and out.dim() > 0 and (
                    explained := out_of_classes(exc, self.name, out.shape[-1])) is not None:
                raise explained from exc
            raise
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else \
                f"a {type(loss).__name__}"
            raise TaskError(f"task {self.name!r}: its loss returned {what}; expected one number, a 0-d tensor (a "
                            "mean over the batch: reduction='mean')")
        return loss

    def loss_weight(self, targets: torch.Tensor) -> torch.Tensor | int:
        """What one validation batch's loss counts for in `val_loss`: its number of samples; for cross entropy (the
        default loss, `F.cross_entropy`, or an unweighted `nn.CrossEntropyLoss` taking the mean) on signed integer
        targets, its number of targets that are not ignored (padding, -100). `val_loss` is then the mean over every
        kept target whatever the batch size (a batch's mean weighted by its samples was not), and a batch of
        padding only, whose mean is NaN, counts for nothing (fast-fail pruned every trial at step 0 for it). On the
        device: no sync."""
        loss = self.loss
        if loss is cross_entropy or loss is F.cross_entropy:
            ignore: int | None = IGNORE_INDEX
        elif isinstance(loss, nn.CrossEntropyLoss) and loss.reduction == "mean" and loss.weight is None:
            ignore = loss.ignore_index
        else:
            ignore = None
        if ignore is None or targets.is_floating_point() or not targets.is_signed():
            return len(targets)
        return (targets != ignore).sum()

    @staticmethod
    def weighted(loss: torch.Tensor, weight: torch.Tensor | int) -> torch.Tensor:
        """`loss * weight`, 0 where the weight is 0 (the NaN mean of a batch with nothing kept)."""
        if isinstance(weight, int):
            return loss * weight
        return torch.where(weight > 0, loss * weight, torch.zeros_like(loss))

    def checked_metrics(self, out: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """`eval_metrics(out, y)`, refused (`TaskError`, naming `eval_metrics`) unless it is a mapping of names to one
        number each (a 0-d tensor, or a Python number): a bare tensor or a per-sample tensor failed deep in the
        evaluation without naming it. Shapes are known on the host: no sync."""
        assert self.eval_metrics is not None
        returned = self.eval_metrics(out, y)
        if not isinstance(returned, Mapping):
            raise TaskError(f"task {self.name!r}: its eval_metrics returned a {type(returned).__name__}; expected a "
                            "mapping of each metric's name to its sum over the batch, such as {'accuracy': "
                            "(out.argmax(-1) == y).sum()}")
        metrics = {}
        for name, value in returned.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = torch.tensor(float(value), device=y.device)  # (`out` may be a dict or a tuple)
            if not isinstance(name, str) or not isinstance(value, torch.Tensor) or value.dim() != 0:
                got = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else
                       f"a {type(value).__name__}")
                raise TaskError(f"task {self.name!r}: its eval_metrics returned {got} for {name!r}; expected a name "
                                "and one number, the metric's sum over the batch (a 0-d tensor)")
            metrics[name] = value
        return metrics

    def check_metrics(self, returned: Iterable[str]) -> None:
        """Refuse an evaluation whose `eval_metrics` left out a metric `eval_metric_names` declares (a study may
        have chosen it), naming both."""
        got = list(returned)
        missing = [name for name in self.eval_metric_names if name not in got]
        if missing:
            raise ValueError(f"task {self.name!r}: eval_metric_names declares {', '.join(missing)}, but eval_metrics "
                             f"returned {', '.join(got) or 'nothing'}: return a sum per declared name")

    @property
    def metric_names(self) -> tuple[str, ...]:
        """Every metric an evaluation produces."""
        return ("val_loss", *(f"val_{name}" for name in self.eval_metric_names))

    def data_digest(self) -> str | None:
        """A fingerprint of the task's data for the reproducibility record (computed once, then kept): SHA-256 over
        each of the four tensors' dtype, shape and contents. A tensor of more than `DIGEST_ELEMENTS` elements is
        fingerprinted by that many in evenly spaced runs of whole samples: a memory-mapped set larger than RAM costs
        a few megabytes read, not a pass over it, and a change outside those samples goes unseen (a file replaced by
        another almost always shows; one value edited in a large one may not). `sweep reproduce` names a changed
        fingerprint when a replay differs. None for data that cannot be read as one block of elements (a sparse
        tensor, say)."""
        if self._digest is None:
            digest = hashlib.sha256()
            try:
                for tensor in (*self.train, *self.val):
                    digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
                    for part in _sampled(tensor.detach()):
                        digest.update(_raw_bytes(part))
            except (RuntimeError, TypeError, ValueError):
                return None
            self._digest = digest.hexdigest()[:16]
        return self._digest

    def difficulty_scores(self) -> np.ndarray | None:
        """One finite score per training sample as a host array (computed on first use, then kept), or None when the
        task has none. A wrong shape or a non-finite score is a ValueError naming the task."""
        if self.difficulty is None:
            return None
        if self._scores is None:
            raw = self.difficulty() if callable(self.difficulty) else self.difficulty
            scores = raw.detach().cpu().numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
            scores = scores.astype(np.float64, copy=False)
            n = len(self.train[0])
            if scores.shape != (n,):
                raise ValueError(f"task {self.name!r}: difficulty must hold one score per training sample, shape "
                                 f"({n},), but got shape {scores.shape}")
            if not np.isfinite(scores).all():
                raise ValueError(f"task {self.name!r}: {int((~np.isfinite(scores)).sum())} difficulty scores are "
                                 "not finite")
            self._scores = scores
        return self._scores

    def model_problems(self, model: Mapping[str, Any]) -> list[tuple[str, str]]:
        """Unknown keys and values of the wrong type in a `model` mapping, as `(dotted key, message)` pairs; inside
        a default that is a non-empty mapping too."""
        return self._mapping_problems(model, self.model_defaults, "")

    def _mapping_problems(self, given: Mapping[str, Any], defaults: Mapping[str, Any],
                          prefix: str) -> list[tuple[str, str]]:
        problems = []
        for key, value in given.items():
            if key not in defaults:
                allowed = ", ".join(f"{prefix}{k}" for k in sorted(defaults)) or "none"
                problems.append((f"model.{prefix}{key}", f"unknown key for task {self.name!r}; expected one of: "
                                                         f"{allowed}"))
                continue
            default = defaults[key]
            if _keyed(default) and isinstance(value, Mapping):
                problems += self._mapping_problems(value, default, f"{prefix}{key}.")
                continue
            ok, _, message = _model_value(value, default)
            if not ok:
                problems.append((f"model.{prefix}{key}", message))
        return problems

    def model_default(self, key: str) -> tuple[bool, Any]:
        """`(known, default)` for a model key as a study names it without `model.` (`hidden`, `enc.width` inside a
        mapping default); a key inside a default that is an empty mapping is known, with no default (None)."""
        node: Any = self.model_defaults
        for part in key.split("."):
            if isinstance(node, Mapping) and not node and node is not self.model_defaults:
                return True, None  # a free-form mapping: whatever it holds
            if not isinstance(node, Mapping) or part not in node:
                return False, None
            node = node[part]
        return True, node

    def model_keys(self) -> list[str]:
        """Every model key a study may name, dotted, without `model.`: the defaults' keys, and the keys inside
        those of them that are non-empty mappings."""
        def keys(defaults: Mapping[str, Any], prefix: str) -> list[str]:
            out = []
            for key, value in defaults.items():
                out.append(f"{prefix}{key}")
                if _keyed(value):
                    out += keys(value, f"{prefix}{key}.")
            return out
        return sorted(keys(self.model_defaults, ""))

    def build_problems(self, model: Mapping[str, Any]) -> list[tuple[str, str]]:
        """What the model builder itself refuses in `model` (a dropout of 1.5, say), found by building the model on
        the meta device (no memory, no initialisation), as `(dotted key, message)` pairs; only the `ValueError` and
        `TypeError` that modules raise for bad arguments count. For the built-in tasks, whose builders have no side
        effects: a user's builder may do anything, so it is first called when a trial starts."""
        problems = self.model_problems(model)
        if problems:
            return problems
        try:
            with torch.device("meta"):
                self.build_model(self.model_config(model))
        except (ValueError, TypeError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            keys = [k for k in model if k in first] or sorted(model)
            return [(f"model.{keys[0]}" if keys else "model", f"task {self.name!r} cannot build its model: {first}")]
        except (RuntimeError, OverflowError) as exc:  # a tensor's size beyond what PyTorch can count
            if isinstance(exc, RuntimeError) and "overflow" not in str(exc):
                raise
            sizes = {k: abs(v) for k, v in model.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            key = max(sizes, key=sizes.__getitem__) if sizes else None  # the largest number made the largest tensor
            return [(f"model.{key}" if key else "model", f"task {self.name!r} cannot build its model: a tensor's "
                     f"size overflows{f' with {key}={model[key]!r}' if key else ''}; expected a model far smaller")]
        return []

    def explained(self, error: RuntimeError, model: nn.Module) -> TaskError | None:
        """PyTorch's refusal of inputs whose dtype is not the model's (numpy's float64 data and a float32 model, or
        int8 data: "mat1 and mat2 must have the same dtype", which names neither) as a `TaskError` naming the task,
        both dtypes and the fix; None when they are the same (another error)."""
        said = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if type(error) is not RuntimeError or not _DTYPE_MISMATCH.search(said):  # PyTorch's own words, nothing else
            return None
        inputs = self.train[0]
        params = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        if params is None or params == inputs.dtype:
            return None
        if not inputs.is_floating_point() and any(isinstance(m, (nn.Embedding, nn.EmbeddingBag))
                                                  for m in model.modules()):
            return None  # token ids, as they should be: the mismatch is inside the model (diff review)
        fix = "e.g. inputs.float()" if inputs.is_floating_point() else \
            "inputs.float(), or an nn.Embedding first where they are token ids"
        return TaskError(f"task {self.name!r}: its inputs are {inputs.dtype} but its model's parameters are "
                         f"{params}: make them the same in the task's factory ({fix}) ({said})")

    def build(self, model: Mapping[str, Any], device: torch.device | str | None = None) -> nn.Module:
        """The model for the config's `model` mapping, moved to `device` (None: where the builder put it, the meta
        device under `torch.device("meta")`), its lazy modules (`nn.LazyLinear`, ...) given their shapes by
        `materialize`: every caller (the loops, the batched engine, warm start's shape key) sees the same tensors."""
        built = self.build_model(self.model_config(model))
        if not isinstance(built, nn.Module):
            raise TaskError(f"task {self.name!r}: its build_model returned a {type(built).__name__}; expected a "
                            "torch.nn.Module (the model for the config's model mapping)")
        built = built.to(device) if device is not None else built
        try:
            return materialize(built, self.train[0])
        except RuntimeError as exc:
            if (explained := self.explained(exc, built)) is None:
                raise
            raise explained from exc

    def model_config(self, model: Mapping[str, Any]) -> dict[str, Any]:
        """The defaults updated with `model`, with a `ConfigError` for anything the builder does not accept."""
        problems = self.model_problems(model)
        if problems:
            raise ConfigError(problems)
        return _merged(self.model_defaults, model)


def _keyed(default: Any) -> bool:
    """Whether a model default names the keys it takes (a non-empty mapping), rather than being one value."""
    return isinstance(default, Mapping) and bool(default)


def _merged(defaults: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """`defaults` updated with `given`, key by key inside the defaults that are non-empty mappings (each a copy:
    a builder that changes its config changes no default)."""
    merged: dict[str, Any] = {}
    for key, default in defaults.items():
        if key not in given:
            merged[key] = _merged(default, {}) if _keyed(default) else default
        elif _keyed(default) and isinstance(given[key], Mapping):
            merged[key] = _merged(default, given[key])
        else:
            merged[key] = _model_value(given[key], default)[1]
    return merged


_CHECKED_TYPES = (bool, int, float, str, list, tuple, dict)


def _model_value(value: Any, default: Any) -> tuple[bool, Any, str]:
    """`value` for a model key whose default is `default`: checked against the default's type where it is a plain
    value, a list or a mapping; taken as given where the default is None or of a type of the task's own."""
    if default is None or type(default) not in _CHECKED_TYPES:
        return True, value, ""
    return coerce(value, type(default))
