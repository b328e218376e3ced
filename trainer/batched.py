"""Batched training: K configs that share a batch signature trained as one stacked model, each as if alone.

A cohort holds K slots. Each slot's parameters are one row of stacked tensors (`torch.func.stack_module_state`'s
layout); one step runs every slot's forward and backward at once (`vmap(functional_call(template, ...))`) and one
stacked optimizer update (`trainer.batched_optim`). Everything else is per member, as in the ordinary loop:

- its own init seed (the model is built under the member's seed, exactly as `build_run` builds it) and its own
  dropout generator, continuing the global RNG the single run would use;
- its own data order and curriculum (`build_sampler` under its own seed and max_steps);
- its own learning-rate schedule (`lr_at`, planned on the host a stretch of steps ahead), weight decay, betas, eps,
  momentum, Nesterov,
  gradient-clipping norm (each member clipped by its own norm), max_steps;
- its own step counter: a member that joins at global step G counts from its own 0 (or from its checkpoint's step);
  members join only at evaluation boundaries (global steps that are multiples of the shared `eval_every_steps`),
  so evaluations line up and run as one vmapped pass;
- its own loss guard, evaluations, logs, reporter, fast-fail verdict, checkpoints and `TrainResult`.

Members never mix: vmapped ops work on each slice alone, a member's loss is computed on its own rows, and the
backward of the summed losses gives each member the gradient of its own loss. A member that diverges (NaN/Inf)
changes no other member's numbers; it is stopped by its own guard, like a single run.

On a CPU in fp32 each member's values are those of `trainer.train` for the same config, bit for bit, on any number of
threads and in a cohort of any size: evaluations, logged losses and gradient norms, weights and optimizer moments (the
tests and `bench/batched.py --deviation` check it). The linear layers and dropout are swapped for exact stacked
versions (`trainer.batched_ops`; a matrix product whose batched kernel sums in another order than the single model's
on this thread count runs once per member), the loss is computed per member on its own rows (its logged mean summed
in `nll_loss`'s order, `nll_mean`), and the stacked optimizers reproduce torch's single-tensor updates, clipping
included.

Speed: a small model's step is dominated by the cost of each call, not by arithmetic, so the hot path makes a fixed
number of calls whatever K is. A plain MLP (a chain of Linear, activation and Dropout layers, read from its fx trace)
runs on the stacked tensors directly (`StackedChain`), skipping vmap's and the custom operators' dispatch; the
built-in cross-entropy losses are computed for all members in one stacked call; the optimizer's per-member scalars
reach the device as one table per stretch; nothing is read back except at log, guard-check and evaluation steps.
The host plans stretches: from one step at which any member logs, evaluates, checks its guard or ends (or the cohort
reaches an evaluation boundary) to the next, every member does nothing but train, so its learning rates, optimizer
scalars and batch indices for the whole stretch are computed at once and sent as one table each, and the per-member
bookkeeping (losses into the log interval, the guard's running maximum, logs, evaluations) runs once at the
stretch's end. Still done once per member per step: dropout's draws from the member's own generator (a member's
masks must come from its generator in its single run's order and sizes).

A member's checkpoint is the plain single-model checkpoint of `trainer.checkpoint`: a batched run can be resumed or
warm-started by the ordinary loop and the other way round.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import math
import os
import random
import sys
import time
import types
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.batched_ops import dropout_rates, member_randomness, prepare_template, stacked_attention, stacked_chain
from trainer.batched_optim import OPTIMIZER_STATES, ClipPlan, StackedOptimizer, clip_stacked, host_scalars
from trainer.checkpoint import CheckpointWriteError, LoopState, TrainState, WarmStart, save_checkpoints
from trainer.config import ConfigError, DeviceUnavailable, TrainingConfig
from trainer.curriculum import CurriculumSampler, build_sampler, stage_starts
from trainer.data import choose_data_loader
from trainer.fast_fail import FastFailConfig, in_stage_grace
from trainer.loop import Checkpointer, FastFailReporter, Reporter, TrainResult, deciding, ended, train
from trainer.optim import build_optimizer, lr_at
from trainer.precision import allow_tf32, out_of_memory, resolve_device, resolve_precision
from trainer.seeding import kept_global_state, reproducibility_record, seed_everything
from trainer.sync import allowed_sync
from trainer.tasks import Task, TaskError, cross_entropy, load_task
from trainer.tasks.arrays import class_cross_entropy
from trainer.tasks.base import as_fp32, out_of_classes

__all__ = ["Cohort", "CohortMember", "MemberFailures", "NotBatchable", "available_memory", "batch_problem",
           "batch_signature", "max_cohort_size", "train_batched"]

MEMORY_SAFETY = 0.7  # a cohort may plan on this share of the free memory; the rest is for the allocator and the OS
MAX_STRETCH = 256  # the most steps whose learning rates and batches are planned at once


# ---------------------------------------------------------------------------------------------------------------------
# What may share a cohort.

# What every module holds (its parameters, buffers, submodules, hooks, keyed by a process-wide counter): the module's
# machinery, not its settings.
_MODULE_MACHINERY = frozenset(vars(nn.Module()))


def _static_attributes(model: nn.Module) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """Each module's type and settings: every attribute of its own but dropout rates, which may differ per member (an
    activation function kept as an attribute, a list of sizes, a mode string...), private ones too (review: a
    `self._temperature` set from the config gave every member the first member's, without a word). Two members whose
    modules differ in any of them cannot share one template, whose modules are the first member's."""
    out = []
    for name, module in model.named_modules():
        plain = sorted((k, _setting(v)) for k, v in vars(module).items()
                       if k not in _MODULE_MACHINERY and not (type(module) is nn.Dropout and k == "p"))
        out.append((name, type(module).__name__, plain))
    return out


def _setting(value: Any, depth: int = 0) -> str:
    """A module's attribute as the signature compares it, the same in every process: plain values by their repr,
    containers by their items, functions by their qualified name with what they close over and their defaults,
    tensors by their dtype and shape (their values are the model's business: `_plain_tensors` refuses a model that
    keeps tensors outside its parameters and buffers), any other object by its type."""
    if depth > 4:
        return "..."
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                                           torch.Size, enum.Enum)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"tensor({value.dtype!s}, {list(value.shape)})"
    if isinstance(value, np.generic):
        return repr(value.item())
    if isinstance(value, np.ndarray):
        digest = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()[:16]
        return f"ndarray({value.dtype}, {list(value.shape)}, {digest})"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(_setting(v, depth + 1) for v in value)})"
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({', '.join(sorted(_setting(v, depth + 1) for v in value))})"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_setting(k, depth + 1)}: {_setting(v, depth + 1)}" for k, v in value.items()) + "}"
    if isinstance(value, nn.Module):  # a module kept outside the module tree: its type (its settings are its own)
        return f"module {type(value).__module__}.{type(value).__qualname__}"
    if isinstance(value, functools.partial):
        return (f"partial({_setting(value.func, depth + 1)}, {_setting(value.args, depth + 1)}, "
                f"{_setting(value.keywords, depth + 1)})")
    if callable(value) and not (hasattr(value, "__dict__") and not isinstance(value, (types.FunctionType,
                                                                                       types.MethodType, type))):
        name = f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', type(value).__qualname__)}"
        code = getattr(value, "__code__", None)
        if isinstance(code, types.CodeType):  # two lambdas of one line differ by their code, not their name
            name += f" {_code_key(code)}"
        closed = []
        for cell in getattr(value, "__closure__", None) or ():
            try:
                closed.append(cell.cell_contents)
            except ValueError:  # an empty cell
                closed.append(None)
        extra = [v for v in (tuple(closed), getattr(value, "__defaults__", None) or (),
                             getattr(value, "__kwdefaults__", None) or {}) if v]
        owner = getattr(value, "__self__", None)  # a bound method: whose
        if owner is not None and not isinstance(owner, (type, types.ModuleType)):
            extra.append(owner)
        return f"<{name}{''.join(' ' + _setting(v, depth + 1) for v in extra)}>"
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if hasattr(value, "__dict__"):  # an object of settings (a namespace, a dataclass, a callable object): its fields
        return f"{kind}({_setting(vars(value), depth + 1)})"
    return kind


def _code_key(code: types.CodeType) -> str:
    """A function's code, the same in every process: where it is, what it runs, the names and constants it uses."""
    consts = tuple(_code_key(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    text = f"{code.co_filename}:{code.co_firstlineno}:{code.co_code.hex()}:{code.co_names}:{consts}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plain_tensors(model: nn.Module) -> str | None:
    """The first attribute of a module that holds a tensor outside its parameters and buffers (`self.scale =
    torch.tensor(...)`, a private one too, a list of tensors), as `module.attribute`, or None. A cohort's template
    would give every member the first member's tensor there. Lists of the module's own parameters (an RNN's
    `_flat_weights`) are its parameters."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}

    def holds(value: Any, depth: int = 0) -> bool:
        if isinstance(value, torch.Tensor):
            return id(value) not in own
        if depth >= 4:
            return False
        if isinstance(value, (tuple, list, set, frozenset)):
            return any(holds(v, depth + 1) for v in value)
        if isinstance(value, Mapping):
            return any(holds(v, depth + 1) for v in value.values())
        if hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type, types.FunctionType,
                                                                types.MethodType, types.ModuleType)):
            return holds(vars(value), depth + 1)  # an object of settings: a namespace, a dataclass
        return False

    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key not in _MODULE_MACHINERY and holds(value):
                return f"{name}.{key}" if name else key
    return None


def _meta_model(config: TrainingConfig, task: Task) -> nn.Module:
    try:
        with torch.device("meta"):  # shapes without memory or initialisation cost, as warm start's shape key
            return task.build(config.model)
    except Exception:  # noqa: BLE001 - a custom model that cannot be built on meta: build it for real
        return task.build(config.model)


def batch_signature(config: TrainingConfig, task: Task) -> str:
    """A digest of what members of one cohort must share: task and task args, the model's tensor names, shapes and
    dtypes and its modules' settings (from the model built on the meta device), optimizer kind, precision, batch size,
    accumulation, evaluation interval and batch size, device and determinism. Everything else may differ."""
    model = _meta_model(config, task)
    device = resolve_device(config.device)
    shared = {
        "task": config.task, "task_args": config.task_args,
        "tensors": sorted((n, list(t.shape), str(t.dtype))
                          for n, t in {**dict(model.named_buffers()), **model.state_dict()}.items()),
        "modules": _static_attributes(model),
        "optimizer": config.optimizer, "precision": resolve_precision(config.mixed_precision, device).name,
        "batch_size": config.batch_size, "accumulation": config.gradient_accumulation_steps,
        "eval_every_steps": config.eval_every_steps, "eval_batch_size": config.eval_batch_size,
        "device": str(device), "deterministic": config.deterministic,
    }
    return hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()[:32]


def batch_problem(config: TrainingConfig, task: Task) -> str | None:
    """Why `config` cannot be trained batched (the ordinary loop then trains it), or None. Checks the settings, then
    tries one vmapped forward and backward of the model: anything vmap cannot batch (BatchNorm in training mode,
    random ops other than `nn.Dropout`, in-place updates of buffers) fails there, not later with a wrong answer."""
    return _settings_problem(config, task) or _model_problem(config, task)


def _settings_problem(config: TrainingConfig, task: Task) -> str | None:
    device = resolve_device(config.device)
    if config.compile:
        return "compile: true is not batched (the stacked model runs eagerly)"
    if resolve_precision(config.mixed_precision, device).name == "fp16":
        return "fp16 needs a grad scaler per member; use bf16 or fp32 to batch"
    if choose_data_loader(config, task, device) != "device":
        return "the training set is read by loader workers (data_loader: dataloader), which the cohort does not use"
    return None


def _problem_probed(config: TrainingConfig, task: Task, signature: str, probes: dict[str, str | None]) -> str | None:
    """`batch_problem`, with the model probe run once per batch signature (`probes`, filled here): configs of one
    signature build the same model but for its values and dropout rates, which the probe does not depend on."""
    problem = _settings_problem(config, task)
    if problem is None and signature not in probes:
        probes[signature] = _model_problem(config, task)
    return problem or probes[signature]


def _model_problem(config: TrainingConfig, task: Task) -> str | None:
    device = resolve_device(config.device)
    model = task.build(config.model, device)
    for name, module in model.named_modules():
        if isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)):  # noqa: SLF001
            return f"module {name or 'model'} is {type(module).__name__}: {_BATCH_NORM_DRIFT}"
        if isinstance(module, nn.modules.conv._ConvNd):  # noqa: SLF001
            return (f"module {name or 'model'} is {type(module).__name__}: vmap batches a convolution by folding "
                    "the members into its groups, which sums in another order than the model alone (its values "
                    "would drift from the trial's own)")
    for name, param in model.named_parameters():
        if not param.requires_grad:
            return f"parameter {name} is frozen (requires_grad=False), and the cohort's optimizer trains every one"
        if param.dtype != torch.float32:
            return f"parameter {name} is {str(param.dtype).removeprefix('torch.')}; cohorts stack float32 parameters"
    held = _plain_tensors(model)
    if held is not None:
        return (f"module attribute {held} holds a tensor that is neither a parameter nor a buffer, and a cohort would "
                "give every member the first member's (register it with `register_buffer` to batch)")
    x, y = task.train
    idx = torch.arange(min(len(x), config.batch_size))
    try:
        before, settings = dict(model.named_buffers()), _static_attributes(model)
        with torch.no_grad(), _BatchNormSeen() as seen:
            model(x[idx].to(device))  # a buffer replaced in forward is lost under vmap (the stacked ones stay)
        if seen.found:  # written by hand (`F.batch_norm` in a module of the user's own)
            return f"the model calls batch_norm in training mode: {_BATCH_NORM_DRIFT}"
        with torch.no_grad():
            model.eval()
            model(task.val[0][:config.eval_batch_size].to(device))
            model.train()
        replaced = [name for name, b in model.named_buffers() if before.get(name) is not b]
        if replaced:
            return (f"buffer {replaced[0]} is replaced by forward (`self.{replaced[0].rpartition('.')[2]} = ...`), "
                    "and a cohort keeps only what is updated in place (`.copy_()`, `.mul_()`)")
        changed = _changed_setting(settings, _static_attributes(model))
        if changed is not None:
            return (f"forward changes module attribute {changed}, and a cohort runs one forward for all its members "
                    "(keep such state in a buffer updated in place)")
        template = prepare_template(model)
        params = {n: p.detach().unsqueeze(0).clone().requires_grad_() for n, p in model.named_parameters()}
        buffers = {n: b.detach().unsqueeze(0).clone() for n, b in model.named_buffers()}
        # Dropout layers are the engine's own (each member draws from its own generator, inside the vmap rule); the
        # probe turns them off, so that vmap's randomness check finds any other random op in the model.
        generator = torch.Generator(device=device).manual_seed(0)
        with member_randomness([[0.0] * len(dropout_rates(model))], [generator]):
            out = vmap(_forward(template), randomness="error")(params, buffers, x[idx].to(device).unsqueeze(0))
        if not isinstance(out, torch.Tensor):
            return f"the model returns a {type(out).__name__}, and a cohort stacks models that return one tensor"
        rng = _rng_states(device)
        try:
            loss = task.checked_loss(as_fp32(out[0]), y[idx].to(device))
        except TaskError as exc:  # the task's loss breaks its contract for every config: alone, the trial fails so
            return str(exc)
        except Exception as exc:
            # The loss's own check refuses this config's outputs: the config's error, which fails it alone in a
            # cohort as alone (cohort review: "vmap cannot batch this model" was said, and the whole run trained one
            # trial at a time). The model is judged with a stand-in loss.
            if out_of_memory(exc):
                raise
            loss = as_fp32(out[0]).sum()
        else:
            if not all(torch.equal(a, b) for a, b in zip(rng, _rng_states(device))):
                return ("the task's loss draws random numbers, and a cohort computes its members' losses one after "
                        "another from one generator (each member would draw other numbers than alone)")
        loss.backward()
        template.eval()  # the evaluation's forward: every member on one shared batch, in eval mode
        with torch.no_grad():
            vmap(_forward(template), in_dims=(0, 0, None), randomness="error")(
                params, buffers, task.val[0][:config.eval_batch_size].to(device))
    except Exception as exc:  # whatever vmap refuses, the ordinary loop trains
        if out_of_memory(exc):  # no answer: the machine's memory ran out (a process limit, say), not vmap's rules
            raise
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"vmap cannot batch this model ({type(exc).__name__}: {first_line})"
    return None


_BATCH_NORM_DRIFT = (
    "vmap's batch_norm backward sums in another order than the model alone, and a gradient that is zero alone (the "
    "bias of the layer before it) becomes rounding noise that Adam scales up to whole steps: the members' values "
    "would drift from the trials' own")


class _BatchNormSeen(TorchDispatchMode):
    """Records whether a forward runs batch_norm in training mode (input statistics: BatchNorm, InstanceNorm, or
    `F.batch_norm` called by a module of the user's own), which the class check cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.found = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        if "batch_norm" in name and "no_update" not in name:  # (input, weight, bias, running_mean, running_var,
            # training, ...), but `_batch_norm_with_update` is training's own, with the momentum there
            training = True if "with_update" in name else args[5] if len(args) > 5 else kwargs.get("training")
            self.found = self.found or training is True
        return func(*args, **kwargs)


def _changed_setting(before: list[tuple[str, str, list[tuple[str, str]]]],
                     after: list[tuple[str, str, list[tuple[str, str]]]]) -> str | None:
    """The first module attribute (`module.attribute`) that differs between two `_static_attributes`, or None."""
    olds, news = ({name: dict(plain) for name, _, plain in side} for side in (before, after))
    for name in [*olds, *(n for n in news if n not in olds)]:
        old, new = olds.get(name, {}), news.get(name, {})
        for key in sorted(old.keys() | new.keys()):
            if old.get(key) != new.get(key):
                return f"{name}.{key}" if name else key
    return None


def _stacked_cross_entropy(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every member's `F.cross_entropy` (mean over its rows) at once: out [K, ..., C], y [K, ...] -> the losses [K]
    to differentiate, and each row's log-probability of its target [K, rows] (detached) for the logged value. The
    log-softmax is row by row as in the single model, and the gradient of each member's mean is `-1/rows` at its
    targets, as `nll_loss`'s backward gives, so the parameters follow the single run bit for bit. The mean itself is
    summed in another order than `nll_loss` sums it; `nll_mean` sums the rows as `nll_loss` does, for the logs."""
    k, classes = out.shape[0], out.shape[-1]
    logp = torch.log_softmax(out.reshape(k, -1, classes), dim=-1)
    picked = logp.gather(-1, y.reshape(k, -1, 1).long()).squeeze(-1)
    return -picked.mean(1), picked.detach()


def nll_mean(picked: torch.Tensor) -> torch.Tensor:
    """`nll_loss`'s mean over the last dimension of `picked` (the log-probabilities of the targets), summed in the
    order of its CPU kernel (ATen's `nll_loss_out_frame`), so that a logged training loss is the single run's to the
    bit: a cascade of float32 partial sums, where level 0 subtracts one row after another and is added into level 1
    after every 16th row (counting from row 0, which therefore goes up alone), level 1 into level 2 after every 256th,
    and so on; at the end the levels are added from 0 up, and the sum divided by the number of rows."""
    rows = picked.shape[-1]
    if rows > 16**6:
        raise ValueError(f"nll_mean sums at most 16**6 rows (7 levels of 16), but got {rows}")
    zero = torch.zeros_like(picked[..., 0])
    top = zero - picked[..., 0]  # row 0, carried up to the last level at once
    rest = picked[..., 1:]
    full = (rows - 1) // 16 * 16
    chunks = rest[..., :full].unflatten(-1, (-1, 16)) if full else rest[..., :0].unsqueeze(-1)
    items = torch.zeros_like(chunks[..., 0])
    for t in range(chunks.shape[-1]):
        items = items - chunks[..., t]
    level = zero
    for t in range(full, rows - 1):  # the rows after the last full chunk stay in level 0
        level = level - rest[..., t]
    levels = [level]
    while len(levels) < 7:  # each higher level adds the sums of the one below, 16 at a time
        count = items.shape[-1] // 16 * 16
        partial = zero
        for t in range(count, items.shape[-1]):
            partial = partial + items[..., t]
        levels.append(partial)
        grouped = items[..., :count].unflatten(-1, (-1, 16)) if count else items[..., :0].unsqueeze(-1)
        items = torch.zeros_like(grouped[..., 0])
        for t in range(grouped.shape[-1]):
            items = items + grouped[..., t]
    total = zero
    for value in [*levels, top]:  # std::accumulate over the 8 levels, from 0
        total = total + value
    return total / rows


# The task losses with a stacked form (the others run once per member on its own rows).
STACKED_LOSSES: dict[Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    cross_entropy: _stacked_cross_entropy, class_cross_entropy: _stacked_cross_entropy}


def _forward(template: nn.Module) -> Callable[..., torch.Tensor]:
    def forward(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        with stacked_attention():
            return functional_call(template, (params, buffers), (x,))

    return forward


# ---------------------------------------------------------------------------------------------------------------------
# Memory.

def available_memory(device: torch.device) -> int:
    """Free bytes on `device`: CUDA's free memory and what this process's caching allocator holds unused (trials
    trained before leave their blocks cached, which the driver counts as taken), else the host's available RAM
    (/proc/meminfo's MemAvailable, else the physical pages the OS reports free)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + max(0, cached)
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


class NotBatchable(RuntimeError):
    """The model did what a cohort cannot batch where its probe (`batch_problem`) did not see it."""


# The training forward runs under vmap's "same" randomness (the members' dropout draws from each member's generator
# inside its own rule), so a random op the probe's forward never reached would draw once for every member.
_RANDOM_LATER = ("the model drew random numbers in a training step outside nn.Dropout, which the check of its first "
                "forward did not see (a random op reached only later): a cohort would give every member the same "
                "draws; train it without a cohort, or draw through nn.Dropout")


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    """The global generators' states that a task's own code draws from on `device`."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def member_bytes(config: TrainingConfig, task: Task) -> int:
    """An estimate of one member's memory: parameters, gradients and optimizer state, the temporaries of the update
    (two more copies), and the activations one training step saves for backward (measured on one batch under the
    config's precision, as training runs it: bf16 autocast saves about half of what fp32 saves; each storage once,
    the parameters themselves left out), doubled for the backward's own temporaries."""
    device = resolve_device(config.device)
    model = task.build(config.model, device)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            saved[0] += storage.nbytes()
        return t

    x, y = task.train
    idx = torch.arange(min(len(x), config.batch_size))
    with resolve_precision(config.mixed_precision, device).autocast(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x[idx].to(device))
        task.loss(as_fp32(out), y[idx].to(device))
    states = len(OPTIMIZER_STATES[config.optimizer])
    return param_bytes * (2 + states + 2) + 2 * saved[0] + 2 * out.numel() * out.element_size()


def max_cohort_size(config: TrainingConfig, task: Task, free: int | None = None) -> int:
    """The largest cohort of `config`'s signature that fits `MEMORY_SAFETY` of the free memory (at least 1)."""
    device = resolve_device(config.device)
    free = available_memory(device) if free is None else free
    return max(1, int(free * MEMORY_SAFETY) // max(1, member_bytes(config, task)))


# ---------------------------------------------------------------------------------------------------------------------
# The cohort.

@dataclass
class CohortMember:
    """One config in a cohort, with what the ordinary `train` would take besides it."""

    config: TrainingConfig
    reporter: Reporter | None = None
    resume: TrainState | None = None
    warm_start: WarmStart | None = None
    checkpointer: Checkpointer | None = None


@dataclass
class _Slot:
    """A member's running state in its slot."""

    id: int
    member: CohortMember
    reporter: Reporter
    local: FastFailReporter | None
    fast_fail: FastFailConfig
    stages: tuple[int, ...]
    sampler: CurriculumSampler
    generator: torch.Generator
    rates: list[float]
    result: TrainResult
    started: float
    done: int = 0  # the member's own optimizer steps done
    optimizer_steps: int = 0  # what Adam's bias correction counts (a warm start's donor count goes on)
    steps_since_log: int = 0
    threshold: float | None = None
    trained_began: float = 0.0  # the cohort's training clock (`Cohort.trained_s`) at the member's last log
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # a resumed member's evaluations before

    @property
    def config(self) -> TrainingConfig:
        return self.member.config


@dataclass
class _Stretch:
    """The steps planned at once by `Cohort._plan`, on the device, and how far the cohort is through them."""

    length: int
    scalars: torch.Tensor  # [length, len(COLUMNS), K]: the optimizer's per-member scalars, step by step
    indices: torch.Tensor  # [length, accumulation, K, batch_size]: each member's batch indices
    lrs: list[list[float]]  # [length][K]: the learning rates as `lr_at` gives them, for the logs
    samplers: dict[int, dict[str, Any]]  # slot -> its sampler's state before the stretch
    dones: dict[int, int]  # slot -> its member's steps done before the stretch
    watched: torch.Tensor | None  # [K] bool: whose guard watches its loss (None: nobody's)
    explosion: torch.Tensor  # [length, K] bool: whose guard applies the explosion rule at each step
    position: int = 0


class Cohort:
    """K slots of one batch signature, trained as one stacked model. Add members (`add`) at evaluation boundaries,
    remove them (`remove`) at any step, advance all of them by one step (`step`), or `run` until every slot is free.
    `results[id]` holds each member's `TrainResult` once it has finished, stopped or been removed. `probes`: the
    answers of `batch_problem`'s model probe by signature, when the caller has them already."""

    def __init__(self, task: Task, like: TrainingConfig, capacity: int,
                 probes: dict[str, str | None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"a cohort needs capacity >= 1, but got {capacity=}")
        self.task = task
        self.like = like
        self.signature = batch_signature(like, task)
        self.capacity = capacity
        self.device = resolve_device(like.device)
        self.precision = resolve_precision(like.mixed_precision, self.device)
        seed_everything(like.seed, deterministic=like.deterministic)
        allow_tf32(self.device, like.deterministic)
        shell = task.build(like.model, self.device)  # the layout; its values are not used
        self.shell = shell
        self.template = prepare_template(shell)
        # "same": the member dropout's own draws (from each member's generator, on the stacked tensor) run inside
        # vmap's rule; `batch_problem` has checked with "error" that the model draws nothing else.
        self.forward = vmap(_forward(self.template), randomness="same")
        self.eval_forward = vmap(_forward(self.template), in_dims=(0, 0, None), randomness="error")
        # A plain MLP skips vmap (`StackedChain`: the same kernels, a fraction of the per-call cost), in fp32 and
        # under bf16 autocast alike (its linear layers cast their inputs as autocast casts `F.linear`'s).
        self.chain = stacked_chain(shell)
        self.params = {n: torch.zeros(capacity, *p.shape, dtype=p.dtype, device=self.device, requires_grad=True)
                       for n, p in shell.named_parameters()}
        self.buffers = {n: torch.zeros(capacity, *b.shape, dtype=b.dtype, device=self.device)
                        for n, b in shell.named_buffers()}
        self.optimizer = StackedOptimizer(like.optimizer, self.params)
        self.train_x, self.train_y = (t.to(self.device) for t in task.train)
        # The stacked cross entropy gathers each row's target: class indices only (no ignore_index -100 rows, which
        # F.cross_entropy leaves out of the mean; those run the task's loss member by member, as alone).
        plain = not (self.train_y.is_floating_point() or self.train_y.is_complex()) and bool((self.train_y >= 0).all())
        self.stacked_loss = STACKED_LOSSES.get(task.loss) if plain else None
        self.val = tuple(t.to(self.device) for t in task.val)
        self.slots: list[_Slot | None] = [None] * capacity
        self.results: dict[int, TrainResult] = {}
        self.step_count = 0  # global steps run
        # Seconds spent training (forward, backward, optimizer step), evaluations, checkpoints and refills left out:
        # what a log's samples_per_s is measured over, as the ordinary loop's (review: an interval that held an
        # evaluation read 5-15x slower). `_trained_until`: where the last step's host work ended.
        self.trained_s = 0.0
        self._trained_until: float | None = None
        self._ids = 0
        self._loss_sum = torch.zeros(capacity, device=self.device)
        self._worst = torch.full((capacity,), -math.inf, device=self.device)
        self._idle_batch = torch.arange(like.batch_size, device=self.device)
        self._order = self._optimizer_order()
        self._clip: ClipPlan | None = None
        self._stretch: _Stretch | None = None
        self._pending: list[torch.Tensor] = []  # what the losses of the steps since the last `_settle` are read from
        # What each member's own loss or metrics raised in this step (by member id): it fails alone (`MemberFailures`).
        self._raised: dict[int, Exception] = {}
        self._probes = {} if probes is None else probes  # batch_problem's model probe, run once per signature
        self._records: dict[bool, dict[str, Any]] = {}

    # -- membership ----------------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> list[int]:
        return [i for i, slot in enumerate(self.slots) if slot is None]

    @property
    def active(self) -> list[int]:
        return [i for i, slot in enumerate(self.slots) if slot is not None]

    def at_boundary(self) -> bool:
        """Whether a member may join now: at a multiple of the shared evaluation interval."""
        return self.step_count % self.like.eval_every_steps == 0

    def add(self, member: CohortMember | TrainingConfig) -> int:
        """Start a member in a free slot, its parameters and optimizer state set in place; returns its id. Its
        step-0 (or warm-start) evaluation runs now when fast-fail is on, as in `train`."""
        member = member if isinstance(member, CohortMember) else CohortMember(member)
        config = member.config
        if not self.at_boundary():
            raise ValueError(f"members join at evaluation boundaries (multiples of eval_every_steps="
                             f"{self.like.eval_every_steps}), but the cohort is at step {self.step_count}")
        if not self.free_slots:
            raise ValueError(f"the cohort's {self.capacity} slots are all taken")
        if member.resume is not None and member.warm_start is not None:
            raise ValueError("pass resume (continue this run) or warm_start (start from another run), not both")
        signature = batch_signature(config, self.task)
        if signature != self.signature:
            raise ValueError("this config's batch signature differs from the cohort's (task, model shapes, optimizer, "
                             "precision, batch size, accumulation, evaluation interval or device)")
        problem = _problem_probed(config, self.task, signature, self._probes)
        if problem is not None:
            raise ValueError(f"this config cannot be batched: {problem}; train it with trainer.train")
        index = self.free_slots[0]
        self._stretch = None  # a boundary ends a stretch: the next one is planned with the new member
        # Built as `build_run` builds it: seed, then the model from the seeded RNG; what the RNG holds after that is
        # what the single run's dropout draws from.
        seed_everything(config.seed, deterministic=config.deterministic)
        model = self.task.build(config.model, self.device)
        if _static_attributes(model) != _static_attributes(self.shell):
            raise ValueError("this config's modules differ from the cohort's in a setting other than dropout")
        generator = torch.Generator(device=self.device)
        if self.device.type == "cuda":
            generator.set_state(torch.cuda.get_rng_state(self.device))
        else:
            generator.set_state(torch.get_rng_state())
        fast_fail = config.fast_fail.resolved(config.max_steps, config.eval_every_steps)
        stages = stage_starts(config.curriculum, config.max_steps)
        reporter, local = deciding(member.reporter, fast_fail, stages)
        if config.deterministic not in self._records:  # the same for every member but the seed
            self._records[config.deterministic] = reproducibility_record(
                config.seed, self.device, deterministic=config.deterministic, data=self.task.data_digest())
        result = TrainResult("completed", 0, {}, reproducibility={**self._records[config.deterministic],
                                                                  "seed": config.seed, "batched": True})
        slot = _Slot(id=self._ids, member=member, reporter=reporter, local=local, fast_fail=fast_fail, stages=stages,
                     sampler=build_sampler(config, self.task, self.device), generator=generator,
                     rates=dropout_rates(model), result=result, started=time.perf_counter(),
                     trained_began=self.trained_s)
        self._ids += 1
        for name, b in model.named_buffers():  # a state dict leaves non-persistent buffers out: its model's own
            self.buffers[name][index].copy_(b)
        self._load_model(index, model.state_dict())
        self.optimizer.reset(index)
        self._loss_sum[index] = 0.0
        self._worst[index] = -math.inf
        self.slots[index] = slot
        self._clip = None
        try:
            if member.resume is not None:
                self._restore(index, slot, member.resume)
                slot.history = [e for e in member.resume.evals if e[0] <= member.resume.step]
                if slot.local is not None:
                    slot.local.resumed(slot.history)
                if slot.done >= config.max_steps:  # checkpointed at its last step: nothing is left to train, as alone
                    self._finish(index, "completed")
            elif member.warm_start is not None or fast_fail.enabled:
                if member.warm_start is not None:
                    self._load_model(index, member.warm_start.state.model)
                    if member.warm_start.optimizer:
                        slot.optimizer_steps = self._load_optimizer(index, member.warm_start.state.optimizer)
                    slot.done = result.steps = member.warm_start.state.step
                stopped = self._evaluate_and_report([index], slot.done)[0]
                if slot.id in self._raised:  # its step-0 evaluation raised: it fails to start, as alone
                    raise self._raised.pop(slot.id)
                self._arm(slot, result.metrics["val_loss"])
                if stopped:
                    self._finish(index, "stopped")
        except BaseException:  # a member that failed to start (its task's metrics raise at step 0) holds no slot
            if self.slots[index] is slot:
                self.slots[index] = None
            raise
        return slot.id

    def remove(self, member_id: int) -> TrainResult:
        """Take a member out now, at any step; its slot is free for the next boundary. Its result says "stopped"."""
        for index, slot in enumerate(self.slots):
            if slot is not None and slot.id == member_id:
                slot.result.steps = slot.done
                return self._finish(index, "stopped")
        raise KeyError(f"no member {member_id} in this cohort")

    @torch.no_grad()
    def shrink(self) -> None:
        """Drop the free slots, at an evaluation boundary: the members left train on as a smaller stacked model
        (their parameters, optimizer state and loss sums moved along, in their order), where the free slots would
        go on training on an idle batch at the full size's cost. For a cohort that takes no member now (the budget
        is spent or in flight, the study stops, a cohort drains): its tail costs what its members need. Each
        member's numbers are those it has at any cohort size (bit for bit on a CPU). A cohort with no member keeps
        its size."""
        keep = self.active
        if len(keep) == self.capacity or not keep:
            return
        self._resize(keep, len(keep))

    @torch.no_grad()
    def grow(self, slots: int) -> None:
        """Add `slots` free slots, at an evaluation boundary (a cohort shrunk by `shrink` that takes a member
        again: a retry queued after the budget was in flight)."""
        if slots < 1:
            raise ValueError(f"a cohort grows by at least one slot, but got {slots=}")
        self._resize(list(range(self.capacity)), self.capacity + slots)

    def _resize(self, keep: list[int], capacity: int) -> None:
        """The slots `keep`, in order, then free slots up to `capacity`: every stacked tensor made anew."""
        if not self.at_boundary() or self._pending:
            raise ValueError(f"a cohort changes its size at evaluation boundaries (multiples of eval_every_steps="
                             f"{self.like.eval_every_steps}), but it is at step {self.step_count}")
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        added = capacity - len(keep)

        def resized(t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
            kept = t.detach().index_select(0, index)
            if added == 0:
                return kept
            return torch.cat([kept, torch.full((added, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)])

        # Every tensor made before any is replaced: a resize that runs out of memory leaves the cohort as it was.
        params = {n: resized(p).requires_grad_(True) for n, p in self.params.items()}
        buffers = {n: resized(b) for n, b in self.buffers.items()}
        state = {n: {k: resized(t) for k, t in s.items()} for n, s in self.optimizer.state.items()}
        loss_sum, worst = resized(self._loss_sum), resized(self._worst, -math.inf)
        self.params, self.buffers, self._loss_sum, self._worst = params, buffers, loss_sum, worst
        self.optimizer.params, self.optimizer.state = dict(params), state
        self.slots = [self.slots[i] for i in keep] + [None] * added
        self.capacity = capacity
        self._stretch = None
        self._clip = None

    # -- the loop ------------------------------------------------------------------------------------------------
    def run(self, on_boundary: Callable[[Cohort], None] | None = None,
            failed: dict[int, Exception] | None = None) -> dict[int, TrainResult]:
        """Step until every slot is free. `on_boundary(self)` is called at each evaluation boundary (after the
        step's evaluations), where it may `add` members to free slots or `remove` any. A member whose own training
        raised (`MemberFailures`) is removed and its error entered in `failed` by member id, the others train on;
        without `failed`, the first such error raises."""
        while self.active:
            try:
                self.step()
            except MemberFailures as failures:  # alone, each would have raised its own
                if failed is None:
                    raise next(iter(failures.failures.values())) from failures
                for member_id, exc in failures.failures.items():
                    self.remove(member_id)
                    del self.results[member_id]
                    failed[member_id] = exc
            if on_boundary is not None and self.at_boundary():
                on_boundary(self)
        return self.results

    def step(self) -> None:
        """One optimizer step of every member: forward, loss, backward, clip, step, with the learning rates and
        batches planned for the stretch (`_plan`); then, at the stretch's last step, each member's logs, guard,
        evaluations and checkpoints at its own intervals."""
        began = time.perf_counter()
        if self._stretch is None or self._stretch.position == self._stretch.length:
            self._stretch = self._plan()
        stretch = self._stretch
        i = stretch.position
        last = i == stretch.length - 1
        slots = self.slots
        self._pending.extend(self._accumulate(stretch.indices[i]))
        logging = last and any(s is not None and self._log_now(s) for s in slots)
        plan = self._clip_plan()
        norm = clip_stacked([p.grad for p in self.params.values() if p.grad is not None],
                            plan) if logging or plan is not None else None
        self.optimizer.step(stretch.scalars[i])
        for p in self.params.values():
            p.grad = None
        stretch.position += 1
        self.step_count += 1
        for s in slots:
            if s is not None:
                s.done += 1
                s.optimizer_steps += 1
                s.steps_since_log += 1
        settled = self._settle() if last else None
        self._trained_until = time.perf_counter()
        self.trained_s += self._trained_until - began
        unwritten = self._after_step(stretch.lrs[i], norm, settled) if settled is not None else {}
        raised, self._raised = self._raised, {}
        if raised or unwritten:
            raise MemberFailures({**unwritten, **raised}, raised=raised.keys())

    def _plan(self) -> _Stretch:
        """The host's work for the steps up to the next one at which any member logs, evaluates, checks its guard or
        ends, or the cohort reaches an evaluation boundary (at most `MAX_STRETCH`): each member's learning rates
        (`lr_at`), optimizer scalars and batch indices, sent to the device in one table each. Between two such
        steps a member does nothing but train, so nothing planned is wasted, and at the stretch's end each
        member's sampler stands where its single run's would."""
        every = self.like.eval_every_steps
        length = min(MAX_STRETCH, every - self.step_count % every,
                     *(self._until_event(s) for s in self.slots if s is not None))
        accum = self.like.gradient_accumulation_steps
        lrs, firsts, indices, samplers, dones = [], [], [], {}, {}
        idle = self._idle_batch.expand(length * accum, -1)
        for k, s in enumerate(self.slots):
            if s is None:
                lrs.append([0.0] * length)
                firsts.append(1)
                indices.append(idle)
                continue
            lrs.append([lr_at(s.done + i, s.config) for i in range(length)])
            firsts.append(s.optimizer_steps + 1)
            samplers[k], dones[k] = s.sampler.state_dict(), s.done
            indices.append(torch.stack([s.sampler.next(s.done + j // accum) for j in range(length * accum)]))
        configs = [s.config if s is not None else None for s in self.slots]
        stacked = torch.stack(indices, 1).view(length, accum, self.capacity, -1)
        watched, explosion = self._guard_masks(length)
        return _Stretch(length=length, scalars=host_scalars(configs, lrs, firsts, self.device), indices=stacked,
                        lrs=[list(step) for step in zip(*lrs, strict=True)], samplers=samplers, dones=dones,
                        watched=watched, explosion=explosion)

    @staticmethod
    def _until_event(slot: _Slot) -> int:
        """Steps until the member's next log, evaluation, guard check or end (at least 1)."""
        config = slot.config
        periods = [config.log_every_steps, config.eval_every_steps]
        if slot.fast_fail.enabled:
            periods.append(slot.fast_fail.check_every_n_steps or config.log_every_steps)
        return max(1, min(config.max_steps - slot.done, *(p - slot.done % p for p in periods)))

    def _guard_masks(self, length: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """For each step of a stretch, which members' guards watch their loss at all ([K] bool, or None when none
        does) and which of them apply the explosion rule then ([length, K] bool), as `LossGuard.observe` decides."""
        watched = [s is not None and s.fast_fail.enabled for s in self.slots]
        if not any(watched):
            return None, torch.zeros(length, self.capacity, dtype=torch.bool, device=self.device)
        rows = []
        for i in range(length):
            rows.append([s is not None and on and s.threshold is not None
                         and s.done + i + 1 >= (s.fast_fail.warmup_steps or 0)
                         and not in_stage_grace(s.done + i + 1, s.stages, s.fast_fail.stage_grace_steps or 0)
                         for s, on in zip(self.slots, watched, strict=True)])
        return (torch.tensor(watched, device=self.device), torch.tensor(rows, dtype=torch.bool, device=self.device))

    def _accumulate(self, indices: torch.Tensor) -> list[torch.Tensor]:
        """Forward and backward of every member over its micro-batches (`indices`: [accumulation, K, batch]);
        returns, per micro-batch, what its losses are read from (see `_settle`): each member's loss [K], or with a
        stacked loss the log-probabilities of the targets [K, rows]."""
        accum = len(indices)
        out_losses: list[torch.Tensor] = []
        rates = [s.rates if s is not None else [] for s in self.slots]
        generators = [s.generator if s is not None else None for s in self.slots]
        for idx in indices:
            x, y = self.train_x[idx], self.train_y[idx]
            drawn = _rng_states(self.device) if self.chain is None else None
            with self.precision.autocast(), member_randomness(rates, generators):
                out = (self.chain(self.params, x, training=True) if self.chain is not None
                       else self.forward(self.params, self.buffers, x))
            if drawn is not None and not all(map(torch.equal, drawn, _rng_states(self.device))):
                raise NotBatchable(_RANDOM_LATER)
            # Each member's loss on its own rows (a vmapped loss sums in another order); the backward of their sum
            # gives each member the gradient of its own loss.
            if self.stacked_loss is not None:
                try:
                    losses, picked = self.stacked_loss(as_fp32(out), y)
                except RuntimeError as exc:
                    if (explained := out_of_classes(exc, self.task.name, out.shape[-1], gathered=True)) is not None:
                        raise explained from exc
                    raise
                out_losses.append(picked)
            else:
                losses = torch.stack([self._member_loss(k, out[k], y[k]) for k in range(self.capacity)])
                out_losses.append(losses.detach())
            if accum > 1:
                losses = losses / accum
            total = losses.sum()
            if total.requires_grad:  # (not when every member's loss raised and no output carries a gradient)
                total.backward()
        return out_losses

    def _member_loss(self, k: int, out: Any, y: torch.Tensor) -> torch.Tensor:
        """Slot `k`'s loss on its own rows. One that raises (the task's loss fails for this member's outputs: a
        check of its own, a value out of range) is that member's error alone: recorded, and a zero that gives its
        parameters no gradient stands in, so the step goes on for the others unchanged. Running out of memory is
        the cohort's size, and raises."""
        try:
            return self.task.loss(as_fp32(out), y)
        except Exception as exc:
            if _cohorts_error(exc):
                raise
            slot = self.slots[k]
            if slot is not None:
                self._raised.setdefault(slot.id, exc)
            return (as_fp32(out) * 0).sum() if isinstance(out, torch.Tensor) and out.is_floating_point() else (
                torch.zeros((), device=self.device))

    def _settle(self) -> torch.Tensor:
        """Account for the steps trained since the last call: each member's loss at each step, as the single run
        computes it (`nll_mean` for a stacked loss; divided by the accumulation and summed micro-batch after
        micro-batch), added to its log interval's sum step after step, and seen by its guard. Runs at a stretch's
        end (and when a member's state is taken), on all those steps at once. Returns the last step's losses [K]."""
        stretch = self._stretch
        assert stretch is not None
        accum = self.like.gradient_accumulation_steps
        pending, self._pending = self._pending, []
        if not pending:
            return torch.zeros(self.capacity, device=self.device)
        values = torch.stack(pending)
        losses = nll_mean(values) if self.stacked_loss is not None else values  # [steps * accum, K]
        losses = losses.view(-1, accum, self.capacity)
        if accum > 1:
            losses = losses / accum
        step_losses = losses[:, 0]
        for m in range(1, accum):
            step_losses = step_losses + losses[:, m]
        for step_loss in step_losses:  # the single run's interval sum: one addition per step, in order
            self._loss_sum += step_loss
        begin = stretch.position - len(step_losses)
        if stretch.watched is not None:
            self._observe(step_losses, stretch.watched, stretch.explosion[begin: stretch.position])
        return step_losses[-1]

    def _after_step(self, lrs: list[float], norm: torch.Tensor | None,
                    step_loss: torch.Tensor) -> dict[int, CheckpointWriteError]:
        """The stretch's last step: each member's logs, guard, evaluations, checkpoints and end, at its own
        intervals; a member whose training raised in the stretch does none of them (it fails). Returns the members
        whose checkpoint could not be written (`_checkpoint`)."""
        live = [s is not None and s.id not in self._raised for s in self.slots]
        logs = [i for i, s in enumerate(self.slots) if s is not None and live[i] and self._log_now(s, after=True)]
        if logs:
            self._log(logs, lrs, norm)
        evals = [i for i, s in enumerate(self.slots) if s is not None and live[i] and self._eval_now(s)]
        checks = [i for i, s in enumerate(self.slots)
                  if s is not None and live[i] and i not in evals and s.fast_fail.enabled
                  and s.done % (s.fast_fail.check_every_n_steps or s.config.log_every_steps) == 0]
        tripped: dict[int, float] = {}
        if checks:
            with allowed_sync():  # one read-back for every member that checks its guard now
                worst, losses = self._worst.tolist(), step_loss.tolist()
            for i in checks:
                slot = self.slots[i]
                assert slot is not None
                value = worst[i]
                if math.isnan(value) or value == math.inf or (slot.threshold is not None and value > slot.threshold):
                    tripped[i] = losses[i]
        due = evals + list(tripped)
        if due:
            stops = self._evaluate_and_report(due, None, tripped)
            for i in due:
                self._worst[i] = -math.inf
            for i, stop in zip(due, stops):
                slot = self.slots[i]
                assert slot is not None
                if stop and slot.done < slot.config.max_steps:
                    slot.result.steps = slot.done
                    self._finish(i, "stopped")
        unwritten = self._checkpoint([i for i in sorted(set(logs) | set(evals))
                                      if (s := self.slots[i]) is not None and s.id not in self._raised], evals)
        for i, slot in enumerate(self.slots):
            if (slot is not None and slot.id not in unwritten and slot.id not in self._raised
                    and slot.done >= slot.config.max_steps):
                slot.result.steps = slot.done
                self._finish(i, "completed")
        return unwritten

    @staticmethod
    def _log_now(slot: _Slot, after: bool = False) -> bool:
        done = slot.done if after else slot.done + 1
        return done % slot.config.log_every_steps == 0 or done == slot.config.max_steps

    @staticmethod
    def _eval_now(slot: _Slot) -> bool:
        return slot.done % slot.config.eval_every_steps == 0 or slot.done == slot.config.max_steps

    def _clip_plan(self) -> ClipPlan | None:
        if self._clip is None:
            norms = [s.config.gradient_clip_norm if s is not None else None for s in self.slots]
            if all(n is None for n in norms):
                return None
            self._clip = ClipPlan(torch.tensor([n or 1.0 for n in norms], device=self.device),
                                  torch.tensor([n is not None for n in norms], device=self.device))
        return self._clip

    def _observe(self, step_losses: torch.Tensor, watched: torch.Tensor, explosion: torch.Tensor) -> None:
        """Every member's guard over several steps ([steps, K]) at once: a running maximum of the training loss
        where the explosion rule applies, else of `loss - loss` (0, or NaN for a NaN/Inf loss), as
        `LossGuard.observe` keeps it step by step (a maximum does not depend on the order)."""
        seen = torch.where(explosion, step_losses, step_losses - step_losses)
        seen = torch.where(watched, seen, torch.full_like(seen, -math.inf))
        torch.maximum(self._worst, seen.amax(0), out=self._worst)

    def _log(self, logs: list[int], lrs: list[float], norm: torch.Tensor | None) -> None:
        steps = torch.tensor([max(1, s.steps_since_log) if s is not None else 1 for s in self.slots],
                             dtype=torch.float32, device=self.device)
        with allowed_sync():  # the interval's one read-back, for every member that logs now
            means = (self._loss_sum / steps).tolist()
            norms = norm.tolist() if norm is not None else [0.0] * self.capacity
        if self._trained_until is not None:  # the read-back waited for the steps' queued work (a GPU's): training
            self.trained_s += time.perf_counter() - self._trained_until
            self._trained_until = None
        for i in logs:
            slot = self.slots[i]
            assert slot is not None
            config = slot.config
            samples_per_s = (slot.steps_since_log * config.batch_size * config.gradient_accumulation_steps
                             / max(self.trained_s - slot.trained_began, 1e-9))
            record = {"step": slot.done, "train_loss": means[i], "lr": lrs[i], "grad_norm": norms[i],
                      "samples_per_s": samples_per_s, "curriculum_level": slot.sampler.level_at(slot.done - 1)}
            if self.task.tokens_per_sample:
                record["tokens_per_s"] = samples_per_s * self.task.tokens_per_sample
            slot.result.logs.append(record)
            slot.reporter.log(slot.done, record)
            self._loss_sum[i] = 0.0
            slot.steps_since_log, slot.trained_began = 0, self.trained_s

    # -- evaluation ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _evaluate(self, indices: list[int]) -> list[dict[str, float]]:
        """Each listed member's evaluation over the whole validation set, as `trainer.evaluate` computes it: one
        vmapped forward per validation batch for all of them, the loss and metrics per member, one read-back."""
        where = torch.tensor(indices, device=self.device)
        params = {n: p.detach().index_select(0, where) for n, p in self.params.items()}
        buffers = {n: b.index_select(0, where) for n, b in self.buffers.items()}
        inputs, targets = self.val
        n = len(inputs)
        members = [slot.id if (slot := self.slots[i]) is not None else -1 for i in indices]
        loss_totals = [torch.zeros((), device=self.device) for _ in indices]
        weight_total: torch.Tensor | int = 0  # what the batches' losses count for (`Task.loss_weight`)
        totals: list[dict[str, torch.Tensor]] = [{} for _ in indices]
        self.template.eval()
        try:
            size = self.like.eval_batch_size
            for start in range(0, n, size):
                x, y = inputs[start: start + size], targets[start: start + size]
                with self.precision.autocast():
                    out = (self.chain(params, x, training=False, shared=True) if self.chain is not None
                           else self.eval_forward(params, buffers, x))
                weight = self.task.loss_weight(y)
                weight_total = weight_total + weight
                for j, member in enumerate(members):
                    if member in self._raised:
                        continue
                    try:  # a member whose own loss or metrics raise fails alone (`_member_loss`)
                        loss_totals[j] += self.task.weighted(self.task.loss(as_fp32(out[j]), y), weight)
                        if self.task.eval_metrics is not None:
                            for name, value in self.task.checked_metrics(out[j], y).items():
                                totals[j][name] = totals[j][name] + value if name in totals[j] else value
                    except Exception as exc:
                        if _cohorts_error(exc):
                            raise
                        self._raised[member] = exc
        finally:
            self.template.train()
        if self.chain is None:  # what the forward wrote into its buffers in place (an observer's running maximum)
            for name, buffer in self.buffers.items():  # is kept, as the model alone keeps it: they were copies
                buffer.index_copy_(0, where, buffers[name])
        kept = [j for j, member in enumerate(members) if member not in self._raised]
        if not kept:
            return [{} for _ in indices]
        for j in kept:
            try:
                self.task.check_metrics(totals[j])
            except Exception as exc:
                if _cohorts_error(exc):
                    raise
                self._raised[members[j]] = exc
        kept = [j for j in kept if members[j] not in self._raised]
        if not kept:
            return [{} for _ in indices]
        rows = torch.stack([torch.stack([loss_totals[j] / weight_total, *(v.float() / n for v in totals[j].values())])
                            for j in kept])
        with allowed_sync():
            values = rows.tolist()
        names = ["loss", *totals[kept[0]]]
        out_rows: list[dict[str, float]] = [{} for _ in indices]
        for j, row in zip(kept, values):
            out_rows[j] = {f"val_{name}": v for name, v in zip(names, row)}
        return out_rows

    def _evaluate_and_report(self, indices: list[int], step: int | None,
                             extra: Mapping[int, float] | None = None) -> list[bool]:
        stops = []
        for i, metrics in zip(indices, self._evaluate(indices)):
            slot = self.slots[i]
            assert slot is not None
            if slot.id in self._raised:  # its evaluation raised: it fails, unreported (`MemberFailures`)
                stops.append(False)
                continue
            at = slot.done if step is None else step
            slot.result.evals.append((at, metrics))
            slot.result.metrics, slot.result.steps = metrics, at
            more = {"train_loss": extra[i]} if extra and i in extra else {}
            stops.append(bool(slot.reporter.report(at, {**metrics, **more})))
        return stops

    def _arm(self, slot: _Slot, initial: float) -> None:
        factor = slot.fast_fail.loss_explosion_factor
        if slot.fast_fail.enabled and factor is not None and math.isfinite(initial) and initial > 0:
            slot.threshold = factor * initial

    def _finish(self, index: int, status: str) -> TrainResult:
        slot = self.slots[index]
        assert slot is not None
        result = slot.result
        result.status, reason = ended("stopped" if status == "stopped" else "completed", slot.local, result)
        if reason is not None:
            result.stop_reason = reason
        result.wall_time_s = time.perf_counter() - slot.started
        self.results[slot.id] = result
        self.slots[index] = None
        self._clip = None
        return result

    # -- state in and out: the plain single-model formats --------------------------------------------------------
    def _optimizer_order(self) -> list[str]:
        """The parameter names in the order `build_optimizer` numbers them in its state dict."""
        names = {id(p): n for n, p in self.shell.named_parameters()}
        optimizer = build_optimizer(self.shell, self.like, self.device)
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]

    @torch.no_grad()
    def _load_model(self, index: int, state: Mapping[str, torch.Tensor]) -> None:
        self.shell.load_state_dict(state)  # strict: a state of another shape is refused, as by the ordinary loop
        for name, p in self.shell.named_parameters():
            self.params[name][index].copy_(p)
        for name, b in self.shell.named_buffers():
            if name in state:  # a non-persistent buffer is the member's own model's (`add`), as the loop's
                self.buffers[name][index].copy_(b)

    @torch.no_grad()
    def _load_optimizer(self, index: int, state: Mapping[str, Any]) -> int:
        """A single-model optimizer state dict into `index`'s slices; returns its step count (0 when it has none)."""
        count = 0
        for number, values in state["state"].items():
            name = self._order[int(number)]
            for key, tensor in values.items():
                if key == "step":
                    count = int(tensor)
                elif tensor is not None and key in self.optimizer.state[name]:
                    self.optimizer.state[name][key][index].copy_(tensor)
        return count

    def _restore(self, index: int, slot: _Slot, resume: TrainState) -> None:
        self._load_model(index, resume.model)
        slot.optimizer_steps = self._load_optimizer(index, resume.optimizer) or resume.step
        slot.sampler.load_state_dict(resume.data)
        rng = resume.rng
        if self.device.type == "cuda" and "cuda" in rng:
            slot.generator.set_state(rng["cuda"][self.device.index or 0])
        else:
            slot.generator.set_state(rng["torch"])
        slot.done = slot.result.steps = resume.step
        slot.result.metrics = dict(resume.metrics)
        slot.threshold = resume.loop.guard_threshold
        self._loss_sum[index] = resume.loop.loss_sum
        slot.steps_since_log = resume.loop.steps_since_log

    @torch.no_grad()
    def member_state(self, member_id: int) -> TrainState:
        """A member's whole training state as the ordinary loop's checkpoint holds it."""
        if self._pending:  # in the middle of a stretch: its losses so far go into the interval's sum first
            self._settle()
        index = next(i for i, s in enumerate(self.slots) if s is not None and s.id == member_id)
        slot = self.slots[index]
        assert slot is not None
        config = slot.config
        for name, p in self.shell.named_parameters():
            p.copy_(self.params[name][index])
        for name, b in self.shell.named_buffers():
            b.copy_(self.buffers[name][index])
        model = {k: v.detach().clone() for k, v in self.shell.state_dict().items()}
        optimizer = build_optimizer(self.shell, config, self.device)
        names = {n: p for n, p in self.shell.named_parameters()}
        if slot.optimizer_steps > 0:
            for name in self._order:
                p = names[name]
                values = {k: t[index].clone() for k, t in self.optimizer.state[name].items()}
                if config.optimizer in ("adam", "adamw"):
                    values["step"] = torch.tensor(float(slot.optimizer_steps))
                if config.optimizer == "sgd" and config.momentum == 0:
                    values = {}
                if values:
                    optimizer.state[p] = values
        with allowed_sync():
            loss_sum = float(self._loss_sum[index])
        return TrainState(step=slot.done, model=model, optimizer=optimizer.state_dict(),
                          scaler=self.precision.scaler.state_dict(), rng=self._member_rng(slot),
                          data=self._sampler_state(index, slot),
                          loop=LoopState(loss_sum, slot.steps_since_log, slot.threshold, torch.get_num_threads()),
                          config=config.to_dict(), metrics=dict(slot.result.metrics),
                          evals=[*slot.history, *slot.result.evals])

    def _sampler_state(self, index: int, slot: _Slot) -> dict[str, Any]:
        """The member's data position after the steps it has done. Its sampler has drawn the whole stretch's
        batches ahead; in the middle of a stretch, its state before the stretch is advanced by the steps done."""
        stretch = self._stretch
        if stretch is None or stretch.position == stretch.length or index not in stretch.samplers:
            return slot.sampler.state_dict()
        sampler = build_sampler(slot.config, self.task, self.device)
        sampler.load_state_dict(stretch.samplers[index])
        accum = self.like.gradient_accumulation_steps
        for j in range(stretch.position * accum):
            sampler.next(stretch.dones[index] + j // accum)
        return sampler.state_dict()

    def _member_rng(self, slot: _Slot) -> dict[str, Any]:
        """What `capture_rng` would hold in the single run: python and numpy as seeded (training draws none), and
        the torch generator that its dropout draws from."""
        seed = slot.config.seed
        numpy_state = np.random.RandomState(seed % 2**32).get_state(legacy=False)
        state: dict[str, Any] = {
            "python": random.Random(seed).getstate(),
            "numpy": {"kind": numpy_state["bit_generator"],
                      "keys": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                      "pos": int(numpy_state["state"]["pos"]), "has_gauss": int(numpy_state["has_gauss"]),
                      "cached": float(numpy_state["gauss"])},
            "torch": slot.generator.get_state() if self.device.type == "cpu" else torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            cuda = torch.cuda.get_rng_state_all()
            if self.device.type == "cuda":
                cuda[self.device.index or 0] = slot.generator.get_state()
            state["cuda"] = cuda
        return state

    def _checkpoint(self, indices: list[int], evals: list[int]) -> dict[int, CheckpointWriteError]:
        """The listed members' checkpoints that their policies ask for now, written together (`save_checkpoints`),
        then registered one by one in order. Returns the members whose checkpoint could not be written (by id):
        each ends as its trial alone would, while the others go on. Any other failure (making a member's state:
        out of memory, say) is the cohort's, raised after every checkpoint written is registered."""
        jobs: list[tuple[Path, Callable[[], TrainState]]] = []
        owners: list[tuple[int, Any, Mapping[str, float] | None]] = []
        unwritten: dict[int, CheckpointWriteError] = {}
        for i in indices:
            slot = self.slots[i]
            assert slot is not None
            checkpointer = slot.member.checkpointer
            metrics = slot.result.metrics if i in evals else None
            try:  # a checkpointer may refuse the path itself: the machine's fault, as a failed write
                path = None if checkpointer is None else checkpointer.path_for(slot.done, metrics)
            except CheckpointWriteError as exc:
                unwritten[slot.id] = exc
                continue
            if path is not None:
                jobs.append((Path(path), functools.partial(self.member_state, slot.id)))
                owners.append((slot.id, checkpointer, metrics))
        failed: BaseException | None = None
        for (member_id, owner, values), info in zip(owners, save_checkpoints(jobs)):
            if isinstance(info, CheckpointWriteError):
                unwritten[member_id] = info
            elif isinstance(info, BaseException):
                failed = failed or info
            else:
                owner.saved(info, values)
        if failed is not None:
            raise failed
        return unwritten


def _cohorts_error(exc: Exception) -> bool:
    """Whether an error a member's own loss or metrics raised is not that member's alone: running out of memory
    (the cohort's size), or the task's code or the config at fault for every member (`TaskError`, `ConfigError`)."""
    return out_of_memory(exc) or isinstance(exc, (TaskError, ConfigError))


class MemberFailures(Exception):
    """Raised by `Cohort.step` when some members failed alone (`failures`: by member id, what raised): their own
    loss or metrics raised (`raised`: those ids; each is its config's error, as alone), or their checkpoints could
    not be written (a full disk, a path that is a folder: one fault of the machine). The step is complete and every
    other member went on unchanged; the failed members are still in their slots: `remove` them and end each as its
    trial alone would end."""

    def __init__(self, failures: Mapping[int, Exception], raised: Collection[int] = ()) -> None:
        super().__init__("; ".join(f"member {m}: {exc}" for m, exc in failures.items()))
        self.failures = dict(failures)
        self.raised = frozenset(raised)


# ---------------------------------------------------------------------------------------------------------------------
# Many configs: group by signature, batch what can be batched, train the rest alone.

@kept_global_state()
def train_batched(members: Sequence[CohortMember | TrainingConfig], task: Task | None = None, *,
                  capacity: int | None = None, say: Callable[[str], None] | None = None,
                  labels: Sequence[str] | None = None,
                  failed: dict[int, Exception] | None = None) -> list[TrainResult]:
    """Train every member; results in the order given. Members that share a batch signature train together, up to
    `capacity` at a time (default: as many as fit the free memory; a larger request is cut, with a message); a
    finished member's slot is refilled from the queue at the next evaluation boundary. A member that cannot be
    batched (`batch_problem`) is trained by the ordinary loop, with a message. `say` receives the messages
    (default: stderr); `labels` name the members in them (their files; default `config I`, from 0).

    An error of training raises, unless `failed` is given: then a member trained alone that raises is entered
    there by its index, and so is every member of a cohort whose step raised that had not finished (one stacked
    model: the error is all of theirs), and the other members train on. The results then hold only the members
    that did not fail, in the order given. The config's own mistakes (`ConfigError`, `TaskError`, a device this
    machine lacks) raise whatever `failed` is: they are the input's, not a member's training's."""
    say = say if say is not None else (lambda message: print(message, file=sys.stderr))
    named = list(labels) if labels is not None else [f"config {i}" for i in range(len(members))]
    items = [m if isinstance(m, CohortMember) else CohortMember(m) for m in members]
    tasks: dict[str, Task] = {}
    groups: dict[str, list[int]] = {}
    probes: dict[str, str | None] = {}
    results: dict[int, TrainResult] = {}
    alone: list[tuple[int, str, Task]] = []  # trained by the ordinary loop once every member's config is known good
    for i, item in enumerate(items):
        key = json.dumps([item.config.task, item.config.task_args], sort_keys=True, default=str)
        member_task = task if task is not None else tasks.get(key) or tasks.setdefault(
            key, load_task(item.config.task, item.config.task_args))
        try:  # its model is built here first (on the meta device): a task that cannot build it for this config
            signature = batch_signature(item.config, member_task)
            problem = _problem_probed(item.config, member_task, signature, probes)
        except (ConfigError, TaskError, DeviceUnavailable):
            raise
        except Exception as exc:  # ...fails this member alone, as `train` would (review: a traceback, none trained)
            if failed is None:
                raise
            failed[i] = exc
            continue
        if problem is not None:
            alone.append((i, problem, member_task))
            continue
        groups.setdefault(f"{key}/{signature}", []).append(i)
    # After every member's config was checked: a later member's mistake (a model key its task does not know, a device
    # this machine lacks) threw away what the ones trained alone before it had trained (review).
    for i, problem, member_task in alone:
        item = items[i]
        say(f"{named[i]}: not batched, trained alone: {problem}")
        try:
            results[i] = train(item.config, member_task, item.reporter, resume=item.resume,
                               warm_start=item.warm_start, checkpointer=item.checkpointer)
        except (ConfigError, TaskError, DeviceUnavailable):
            raise
        except Exception as exc:
            if failed is None:
                raise
            failed[i] = exc
    for indices in groups.values():
        first = items[indices[0]].config
        key = json.dumps([first.task, first.task_args], sort_keys=True, default=str)
        group_task = task if task is not None else tasks[key]
        waiting = list(indices)
        while waiting:
            done: dict[int, TrainResult] = {}
            started: set[int] = set()
            try:
                fits = max_cohort_size(first, group_task)  # a dry run: a model's error is raised here too
                size = min(len(waiting), capacity or len(waiting))
                if size > fits:
                    say(f"a cohort of {size} does not fit the free memory; training {fits} at a time")
                    size = fits
                _run_queue(group_task, [items[i] for i in waiting], waiting, size, probes, done, started, failed)
            except (ConfigError, TaskError, DeviceUnavailable):
                raise
            except Exception as exc:
                if failed is None:
                    raise
                # The members the cohort was training, not those still queued: they go on in a cohort of their own.
                # An error before any started (the stacked model's) is every member's, as is one that left none to
                # blame (no progress to make).
                hit = ([i for i in waiting if i in started and i not in done and i not in failed]
                       or [i for i in waiting if i not in done and i not in failed])
                failed.update((i, exc) for i in hit)
            results.update(done)
            waiting = [i for i in waiting if i not in done and (failed is None or i not in failed)]
    return [results[i] for i in range(len(items)) if i in results]


def _run_queue(task: Task, members: list[CohortMember], indices: list[int], size: int,
               probes: dict[str, str | None], done: dict[int, TrainResult], started: set[int],
               failed: dict[int, Exception] | None = None) -> None:
    """Train `members` (the inputs `indices`) in one cohort of `size`, refilled from the queue; each result enters
    `done` by its input index as the cohort finishes it (before an error of a later step), and each member enters
    `started` as it is added (before an error of its own start). A member whose own training raised enters `failed`
    by its input index, and the others train on (without `failed`, its error raises)."""
    cohort = Cohort(task, members[0].config, size, probes)
    queue = list(zip(indices, members))
    placed: dict[int, int] = {}  # member id -> input index

    def refill(c: Cohort) -> None:
        while queue and c.free_slots:
            index, member = queue.pop(0)
            started.add(index)
            try:
                placed[c.add(member)] = index
            except Exception as exc:
                # Its own start failed (its step-0 evaluation raised): it alone fails, holding no slot, and the
                # members training go on (diff review: they were failed with it). The cohort's size running out of
                # memory, or the input's mistakes, stay the cohort's.
                if failed is None or _cohorts_error(exc) or isinstance(exc, DeviceUnavailable):
                    raise
                failed[index] = exc
        if not queue and c.active and len(c.active) <= c.capacity // 2:  # the tail: half the slots train nothing
            c.shrink()

    def run() -> None:
        own: dict[int, Exception] | None = {} if failed is not None else None
        try:
            cohort.run(on_boundary=refill, failed=own)
        finally:
            done.update((placed[member_id], result) for member_id, result in cohort.results.items())
            if failed is not None and own:
                failed.update((placed[member_id], exc) for member_id, exc in own.items())

    refill(cohort)
    run()
    while queue:  # every member stopped before the first boundary: start the next ones
        refill(cohort)
        run()
