from __future__ import annotations

import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer import ConfigError, TrainingConfig, load_task, train
from trainer.batched import train_batched
from trainer.tasks import Task, TaskError


def test_digits_is_the_real_data_set_with_a_fixed_split() -> None:
    task = load_task("digits")
    (xt, yt), (xv, _) = task.train, task.val
    assert len(xt) + len(xv) == 1797
    assert xt.shape[1] == 64 and xt.dtype == torch.float32 and 0.0 <= float(xt.min()) <= float(xt.max()) <= 1.0
    assert set(yt.tolist()) == set(range(10))
    again = load_task("digits")
    assert torch.equal(again.val[0], xv)  # the split does not depend on anything but split_seed
    assert not torch.equal(load_task("digits", {"split_seed": 1}).val[0], xv)


def test_charlm_reads_the_standard_library_source() -> None:
    task = load_task("charlm", {"context": 32, "max_chars": 50_000})
    x, y = task.train
    assert x.shape[1] == 32 and task.tokens_per_sample == 32
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    text = bytes(x[0].tolist()).decode("utf-8", errors="replace")
    assert text.isprintable() or "\n" in text
    result = train(TrainingConfig.from_dict({"task": "charlm", "task_args": {"context": 32, "max_chars": 50_000},
                                             "max_steps": 5, "batch_size": 8, "log_every_steps": 5,
                                             "model": {"d_model": 32, "n_layers": 1, "n_heads": 2}}), task)
    assert result.logs[0]["tokens_per_s"] == pytest.approx(result.logs[0]["samples_per_s"] * 32)


def test_model_keys_are_checked_against_the_task() -> None:
    task = load_task("digits")
    assert task.model_problems({"hidden": 8}) == []
    [(key, message)] = task.model_problems({"hiden": 8})
    assert key == "model.hiden" and "hidden" in message
    [(key, message)] = task.model_problems({"hidden": "wide"})
    assert key == "model.hidden" and "integer" in message
    with pytest.raises(ConfigError):
        task.model_config({"depth": 1.5})


def test_a_user_task_by_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_tasks.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn
        from trainer.tasks import Task

        def xor(n=256):
            g = torch.Generator().manual_seed(0)
            x = torch.randint(0, 2, (n, 2), generator=g).float()
            y = (x[:, 0] != x[:, 1]).long()
            return Task(name="xor", train=(x, y), val=(x, y), model_defaults={"hidden": 8},
                        build_model=lambda cfg: nn.Sequential(nn.Linear(2, cfg["hidden"]), nn.Tanh(),
                                                              nn.Linear(cfg["hidden"], 2)))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = TrainingConfig.from_dict({"task": "my_tasks:xor", "task_args": {"n": 128}, "max_steps": 300,
                                       "learning_rate": 0.05, "batch_size": 32, "model.hidden": 16})
    result = train(config)
    assert result.metrics["val_loss"] < 0.1


@pytest.mark.parametrize(
    ("name", "fragment"),
    [("mnist", "unknown task"), ("digitz", r"unknown task 'digitz' \(did you mean 'digits'\?\)"),
     ("no_such_module:f", "cannot import"), ("trainer.tasks:nothing", "no function")],
)
def test_unknown_tasks_are_refused_clearly(name: str, fragment: str) -> None:
    with pytest.raises(TaskError, match=fragment):
        load_task(name)


def test_unknown_task_argument_is_refused() -> None:
    with pytest.raises(TaskError, match="context"):
        load_task("digits", {"context": 3})


@pytest.mark.parametrize(("train_part", "message"), [
    ((torch.zeros(4, 2), torch.zeros(4), torch.ones(4)),
     "train must be (inputs, targets), two tensors with the sample on dimension 0; got a tuple of 3"),
    ({"x": torch.zeros(4, 2), "y": torch.zeros(4)}, "train must be (inputs, targets), two tensors with the sample on "
                                                    "dimension 0; got a dict"),
    (({"a": torch.zeros(4, 2)}, torch.zeros(4)), "train inputs must be a tensor (the sample on dimension 0), got dict"),
    ((torch.zeros(4, 2).numpy(), torch.zeros(4)), "train inputs must be a tensor (the sample on dimension 0), got "
                                                  "ndarray"),
    ((torch.zeros(4, 2), torch.zeros(5)), "train inputs and targets must hold the same number of samples "
                                          "(dimension 0), got (4, 2) and (5,)"),
    ((torch.zeros(4, 2), torch.tensor(1.0)), "got (4, 2) and ()"),
    ((torch.zeros(0, 2), torch.zeros(0)), "train holds no samples (inputs of shape (0, 2)); it needs at least one"),
])
def test_a_task_whose_data_is_not_two_tensors_is_refused_naming_what_it_got(train_part: object, message: str) -> None:
    """Data of another shape failed later, inside training, with a message about something else ('too many values
    to unpack', a batch size compared with a dict's number of keys)."""
    from trainer.tasks import Task

    with pytest.raises(ValueError, match=r"^task 'mine': ") as info:
        Task(name="mine", train=train_part, val=(torch.zeros(2, 2), torch.zeros(2)),  # type: ignore[arg-type]
             build_model=lambda cfg: torch.nn.Linear(2, 2))
    assert message in str(info.value)


def test_a_user_task_that_fails_to_build_is_refused_in_one_line_naming_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # `python -m trainer` printed the factory's traceback (an empty validation set made NaN losses before that).
    (tmp_path / "broken_tasks.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn
        from trainer.tasks import Task

        def empty_val():
            x, y = torch.zeros(8, 2), torch.zeros(8, dtype=torch.long)
            return Task(name="ev", train=(x, y), val=(x[:0], y[:0]), build_model=lambda cfg: nn.Linear(2, 2))

        def missing_file():
            open("/nonexistent/data.npy")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskError, match=r"^broken_tasks:empty_val raised ValueError: task 'ev': val holds no "
                                        r"samples"):
        load_task("broken_tasks:empty_val")
    with pytest.raises(FileNotFoundError, match=r"\[Errno 2\]"):  # its type kept: `sweep run` names it in one line
        load_task("broken_tasks:missing_file")


def test_metrics_the_task_declares_but_its_evaluation_leaves_out_are_named() -> None:
    # A study may choose a declared metric; a task returning another name failed every trial with KeyError.
    from trainer.tasks import Task

    digits = load_task("digits")
    task = Task(name="renamed", train=digits.train, val=digits.val, build_model=digits.build_model,
                model_defaults=digits.model_defaults, eval_metric_names=("accuracy",),
                eval_metrics=lambda out, y: {"acc": (out.argmax(-1) == y).float().sum()})
    config = TrainingConfig.from_dict({"max_steps": 2, "batch_size": 8, "eval_every_steps": 1})
    for run in (train, lambda c, t: train_batched([c], t)):  # alone and in a cohort
        with pytest.raises(ValueError, match=r"^task 'renamed': eval_metric_names declares accuracy, but "
                                             r"eval_metrics returned acc: return a sum per declared name$"):
            run(config, task)


@pytest.mark.parametrize(("names", "why"), [(("loss",), "'loss' is the trainer's own"),
                                             (("acc", "acc"), "a name appears twice")])
def test_a_metric_name_that_would_replace_another_is_refused(names: tuple[str, ...], why: str) -> None:
    # A task metric named `loss` became `val_loss` and silently replaced the task's loss: the study, its pruner and
    # fast-fail judged the user's number as if it were the loss.
    from trainer.tasks import Task

    digits = load_task("digits")
    with pytest.raises(ValueError, match=rf"^task 'clash': eval_metric_names {re.escape(str(names))}: {why}"):
        Task(name="clash", train=digits.train, val=digits.val, build_model=digits.build_model,
             model_defaults=digits.model_defaults, eval_metric_names=names,
             eval_metrics=lambda out, y: {name: (out.argmax(-1) == y).float().sum() for name in names})


def test_task_arguments_are_checked_against_the_functions_annotations(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # `val_fraction: x` failed inside the task with "'<' not supported between 'float' and 'str'"; an argument is
    # typed by its annotation (a default of 0 does not make `noise: float` an integer), and an unannotated one or
    # one of a type the config does not know (a list) is the function's to check.
    (tmp_path / "typed_tasks.py").write_text(textwrap.dedent("""
        from __future__ import annotations
        import torch
        from torch import nn
        from trainer.tasks import Task

        def noisy(noise: float = 0, subset: str | None = "all", sizes: list[int] | None = None, free=3):
            x, y = torch.zeros(8, 2), torch.zeros(8, dtype=torch.long)
            return Task(name="noisy", train=(x, y), val=(x, y), build_model=lambda cfg: nn.Linear(2, 2))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for args in ({"noise": 0.3}, {"noise": "1e-3"}, {"subset": None}, {"sizes": [1, 2]}, {"free": "anything"}):
        assert load_task("typed_tasks:noisy", args).name == "noisy"
    with pytest.raises(TaskError, match=r"^task 'typed_tasks:noisy': task_args.noise: expected a number, got 'x'$"):
        load_task("typed_tasks:noisy", {"noise": "x"})
    with pytest.raises(TaskError, match=r"^task 'digits': task_args.val_fraction: expected a number, got 'x'$"):
        load_task("digits", {"val_fraction": "x"})


def test_the_loss_gets_low_precision_outputs_in_float32_and_float64_or_complex_ones_as_they_are() -> None:
    # Every output was cast with .float(): a float64 model's loss lost its precision and a complex one its imaginary
    # part (with only a warning), so the loss and its gradient were wrong.
    from trainer.tasks.base import as_fp32

    for dtype, expected in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                            (torch.float32, torch.float32), (torch.float64, torch.float64),
                            (torch.complex64, torch.complex64), (torch.int64, torch.float32)):
        assert as_fp32(torch.ones(2, dtype=dtype)).dtype == expected, dtype
    precise = torch.tensor([1.0 + 1e-12], dtype=torch.float64)
    assert as_fp32(precise).item() == 1.0 + 1e-12


def test_a_task_drawing_its_data_from_the_global_generators_gets_the_same_data_each_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A factory that draws from numpy's (or torch's, or Python's) global generator unseeded built other data each
    # time: a worker builds its task more than once, and `sweep reproduce` failed for every trial ("differs first at
    # step 20"). The generators are seeded while it runs, and what the caller drew from them is left as it was.
    (tmp_path / "globalrng.py").write_text(
        "import random\nimport numpy as np\nimport torch\nfrom trainer.tasks import Task, load_task\n"
        "def noisy():\n"
        "    x = torch.tensor(np.random.normal(size=(40, 64)), dtype=torch.float32) + torch.randn(40, 64)\n"
        "    x += random.random()\n"
        "    digits = load_task('digits')\n"
        "    y = torch.randint(0, 10, (40,))\n"
        "    return Task(name='noisy', train=(x, y), val=(x, y), build_model=digits.build_model,\n"
        "                model_defaults=digits.model_defaults)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    np.random.seed(7)
    torch.manual_seed(7)
    expected = (np.random.random(), torch.rand(1).item())
    np.random.seed(7)
    torch.manual_seed(7)
    first, second = load_task("globalrng:noisy"), load_task("globalrng:noisy")
    assert torch.equal(first.train[0], second.train[0]) and torch.equal(first.train[1], second.train[1])
    assert (np.random.random(), torch.rand(1).item()) == expected  # the caller's draws go on as before


class _CastsItself(torch.nn.Module):
    """A model that takes float64 inputs on purpose: nothing to explain."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.float())


class _Float64(torch.nn.Module):
    """A float64 model by design, which casts its float32 inputs itself."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.double()).float()


@pytest.mark.parametrize("builder", [lambda cfg: torch.nn.Sequential(torch.nn.Linear(4, 3)),
                                     lambda cfg: torch.nn.Sequential(torch.nn.LazyLinear(3))], ids=["linear", "lazy"])
def test_inputs_of_another_dtype_than_the_model_are_refused_naming_the_task_both_dtypes_and_the_fix(builder) -> None:
    # numpy's float64 data with a float32 model failed every trial with "mat1 and mat2 must have the same dtype",
    # which names neither the task nor the fix.
    from trainer import Task

    x = torch.from_numpy(np.random.default_rng(0).normal(size=(64, 4)))  # float64
    y = torch.arange(64) % 3
    task = Task(name="np64", train=(x, y), val=(x, y), build_model=builder)
    config = TrainingConfig(max_steps=2, eval_every_steps=1, batch_size=8, device="cpu")
    with pytest.raises(TaskError, match=r"^task 'np64': its inputs are torch.float64 but its model's parameters are "
                                        r"torch.float32: make them the same .* \(e.g. inputs.float\(\)\) \(.*dtype"):
        train(config, task)
    fixed = Task(name="np64", train=(x.float(), y), val=(x.float(), y), build_model=builder)
    assert train(config, fixed).status == "completed"
    casting = Task(name="np64", train=(x, y), val=(x, y), build_model=lambda cfg: _CastsItself())
    assert train(config, casting).status == "completed"  # a model that casts its inputs itself is left alone
    # Another error of a model whose dtype differs from its inputs' is PyTorch's own, not a dtype hint.
    wrong_width = Task(name="np64", train=(x.float(), y), val=(x.float(), y), build_model=lambda cfg: _Float64(5))
    with pytest.raises(RuntimeError, match=r"^mat1 and mat2 shapes cannot be multiplied"):
        train(config, wrong_width)
    # Integer inputs (review: int8 data gave PyTorch's words alone, where float64 data was explained).
    small = Task(name="np64", train=((x * 10).to(torch.int8), y), val=((x * 10).to(torch.int8), y),
                 build_model=builder)
    with pytest.raises(TaskError, match=r"^task 'np64': its inputs are torch.int8 but its model's parameters are "
                                        r"torch.float32: .* \(inputs.float\(\), or an nn.Embedding first where they "
                                        r"are token ids\)"):
        train(config, small)
    # Token ids into an embedding are as they should be: a mismatch inside the model is PyTorch's to say (diff review).
    tokens = torch.arange(64) % 5
    inside = Task(name="np64", train=(tokens, y), val=(tokens, y), build_model=lambda cfg: _Float64Inside())
    with pytest.raises(RuntimeError, match="dtype") as raised:
        train(config, inside)
    assert not isinstance(raised.value, TaskError)


class _Float64Inside(torch.nn.Module):
    """Token ids into an embedding, then a float64 matrix of its own (its bug, not its inputs')."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4)
        self.register_buffer("mix", torch.ones(4, 3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x) @ self.mix


def _int_task(dtype: torch.dtype) -> object:
    from trainer import Task

    x = torch.from_numpy(np.random.default_rng(1).normal(size=(96, 4)).astype(np.float32))
    y = (x[:, 0] > 0).to(dtype)
    return Task(name="ints", train=(x[:64], y[:64]), val=(x[64:], y[64:]), model_defaults={"hidden": 8},
                build_model=lambda cfg: torch.nn.Sequential(torch.nn.Linear(4, cfg["hidden"]), torch.nn.ReLU(),
                                                            torch.nn.Linear(cfg["hidden"], 2)))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.bool])
def test_class_targets_of_any_integer_dtype_train_as_int64_ones_do_alone_and_batched(dtype: torch.dtype) -> None:
    # A user's task with int32 labels (numpy's default on some platforms) failed every trial with PyTorch's
    # "expected target dtype to be Long or Byte, but got Int"; in a cohort it was taken for a model vmap cannot batch.
    configs = [TrainingConfig(max_steps=12, eval_every_steps=4, batch_size=16, learning_rate=lr, device="cpu")
               for lr in (0.01, 0.05)]
    reference = [train(config, _int_task(torch.int64)) for config in configs]
    alone = [train(config, _int_task(dtype)) for config in configs]
    assert [r.evals for r in alone] == [r.evals for r in reference]
    stacked = train_batched(configs, task=_int_task(dtype))
    assert [r.evals for r in stacked] == [r.evals for r in reference]


def test_accuracy_leaves_out_targets_the_loss_ignores_and_is_unchanged_where_there_are_none() -> None:
    from trainer.tasks import accuracy_sum

    targets = torch.tensor([[1, 2, 0, -100, -100], [3, 3, 3, 3, 3], [-100] * 5])
    logits = torch.nn.functional.one_hot(targets.clamp(min=0), 4).float()  # right wherever a target counts
    logits[1, 0] = torch.tensor([1.0, 0, 0, 0])  # one wrong of five in the unpadded sample
    # Padded positions are not wrong answers (they were: 3 of 5 for a perfect model); a sample with no target
    # counted adds 0; an unpadded sample's value is the plain mean, as before.
    expected = torch.stack([torch.tensor(1.0), torch.tensor([0.0, 1, 1, 1, 1]).mean(), torch.tensor(0.0)]).sum()
    assert torch.equal(accuracy_sum(logits, targets)["accuracy"], expected)
    plain = torch.tensor([[0, 1], [1, 1]])
    assert accuracy_sum(torch.nn.functional.one_hot(plain, 2).float(), plain)["accuracy"].item() == 2.0
    # uint8 labels hold no -100: their class 156 (which -100 wraps to) counts like any other.
    bytes_ = torch.tensor([3, 156, 199, 156], dtype=torch.uint8)
    assert accuracy_sum(torch.nn.functional.one_hot(bytes_.long(), 200).float(), bytes_)["accuracy"].item() == 4.0


def test_accuracy_takes_targets_of_one_column_and_refuses_a_shape_that_cannot_match() -> None:
    # [N, 1] targets (a data frame's `df[["label"]]`) were compared with every prediction of the batch, [N, N]: a
    # study's val_accuracy was the class prior, with no error, while the loss (which flattens them) trained well.
    from trainer.tasks import accuracy_sum

    targets = torch.tensor([0, 1, 2, 2, 1])
    logits = torch.nn.functional.one_hot(torch.tensor([0, 1, 2, 0, 0]), 3).float()
    assert accuracy_sum(logits, targets[:, None])["accuracy"].item() == 3.0
    assert accuracy_sum(logits, targets)["accuracy"].item() == 3.0
    with pytest.raises(TaskError, match=r"^accuracy: the targets' shape \(5, 2\) does not match the model's "
                                        r"predictions \(5,\) \(its output \(5, 3\) less the class dimension\)$"):
        accuracy_sum(logits, torch.zeros(5, 2, dtype=torch.long))


def _tagging_task(loss: object = None) -> Task:
    """Token tagging: 12 sequences of 6 tokens, padded with -100 at the end; the last 4 validation rows all padding."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randint(1, 9, (24, 6), generator=generator)
    y = (x % 3).clone()
    lengths = torch.randint(1, 7, (24,), generator=generator)
    y[torch.arange(6)[None, :] >= lengths[:, None]] = -100
    y[20:] = -100
    if loss is not None:  # PyTorch's own cross entropy takes classes on dimension 1: one token per sample
        x, y = x[:, 0], y[:, 0]
    extra = {} if loss is None else {"loss": loss}
    return Task(name="tagging", train=(x[:12], y[:12]), val=(x[12:], y[12:]), model_defaults={"width": 8},
                build_model=lambda cfg: torch.nn.Sequential(torch.nn.Embedding(9, cfg["width"]),
                                                            torch.nn.Linear(cfg["width"], 3)), **extra)


@pytest.mark.parametrize("loss", [None, torch.nn.CrossEntropyLoss(), torch.nn.functional.cross_entropy])
def test_val_loss_is_the_mean_over_kept_targets_whatever_the_batch_size_and_padding_is_never_nan(loss: object) -> None:
    # Each batch's mean was weighted by its samples: val_loss changed with eval_batch_size on padded sequences, and a
    # batch of padding only (its mean NaN) made val_loss NaN, which fast-fail pruned in every trial at step 0.
    from trainer.evaluate import evaluate
    from trainer.precision import resolve_precision

    task = _tagging_task(loss)
    torch.manual_seed(0)
    model = task.build({})
    inputs, targets = task.val
    expected = torch.nn.functional.cross_entropy(model(inputs).reshape(-1, 3), targets.reshape(-1)).item()
    assert 0 < int((targets != -100).sum()) < targets.numel()
    precision = resolve_precision("off", torch.device("cpu"))
    for size in (1, 4, 5, 12):
        value = evaluate(model, task, task.val, size, precision)["val_loss"]
        assert value == pytest.approx(expected, rel=1e-6), size


def test_a_padded_task_trains_alone_and_batched_to_the_same_finite_values() -> None:
    configs = [TrainingConfig(max_steps=8, eval_every_steps=4, batch_size=4, eval_batch_size=4, learning_rate=lr,
                              device="cpu") for lr in (0.01, 0.1)]
    alone = [train(config, _tagging_task()) for config in configs]
    assert all(np.isfinite(metrics["val_loss"]) for r in alone for _, metrics in r.evals)
    assert [r.evals for r in train_batched(configs, task=_tagging_task())] == [r.evals for r in alone]


def test_a_builder_that_returns_no_module_is_refused_naming_the_task() -> None:
    task = Task(name="fn", train=(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)),
                val=(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)), build_model=lambda cfg: (lambda x: x))
    with pytest.raises(TaskError, match=r"^task 'fn': its build_model returned a function; expected a "
                                        r"torch.nn.Module"):
        task.build({})


def test_eval_metrics_may_give_python_numbers_for_a_model_whose_output_is_a_dict() -> None:
    class TwoHeads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"cls": self.body(x)}

    x, y = torch.randn(16, 4, generator=torch.Generator().manual_seed(0)), torch.arange(16) % 2
    task = Task(name="heads", train=(x, y), val=(x, y), build_model=lambda cfg: TwoHeads(),
                loss=lambda out, t: torch.nn.functional.cross_entropy(out["cls"], t),
                eval_metrics=lambda out, t: {"hits": float((out["cls"].argmax(-1) == t).sum())},
                eval_metric_names=("hits",))
    result = train(TrainingConfig(max_steps=2, eval_every_steps=2, batch_size=8, device="cpu"), task)
    assert 0.0 <= result.evals[-1][1]["val_hits"] <= 1.0


def test_a_task_module_whose_own_import_fails_names_what_to_install(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # It said to put the task module next to the study file, which it was: the missing one is its dependency.
    (tmp_path / "needs_dep.py").write_text("import not_a_package_xyz\n\ndef task():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskError, match=r"cannot import task module 'needs_dep': No module named 'not_a_package_xyz' "
                                        r"\(at needs_dep.py:1\); the module was found, and 'not_a_package_xyz', "
                                        r"which it imports, was not: install it in this environment$"):
        load_task("needs_dep:task")
    with pytest.raises(TaskError, match=r"a module of your own must be importable"):
        load_task("absent_module_xyz:task")


def test_a_target_beyond_the_model_s_classes_is_one_line_naming_the_task_alone_and_batched() -> None:
    # Alone it was PyTorch's "Target 2 is out of bounds."; in a cohort a gather's "index 2 is out of bounds for
    # dimension 2 with size 2": neither named the task or said what to change.
    def labelled(bad_at: int) -> Task:
        x, y = torch.randn(64, 4, generator=torch.Generator().manual_seed(0)), torch.arange(64) % 2
        y[bad_at] = 2
        return Task(name="two", train=(x, y), val=(x[:8], y[:8] % 2), model_defaults={"hidden": 8},
                    build_model=lambda cfg: torch.nn.Sequential(torch.nn.Linear(4, cfg["hidden"]), torch.nn.ReLU(),
                                                                torch.nn.Linear(cfg["hidden"], 2)))

    expected = (r"^task 'two': a target is class 2, and the model gives 2 classes \(0 to 1\): give the model one "
                r"output per class the targets hold")
    configs = [TrainingConfig(max_steps=40, batch_size=16, learning_rate=lr, device="cpu") for lr in (0.01, 0.02)]
    with pytest.raises(TaskError, match=expected):
        train(configs[0], labelled(50))
    with pytest.raises(TaskError, match=expected):
        train_batched(configs, task=labelled(50))


def test_an_index_error_in_a_user_s_own_loss_is_not_taken_for_a_target_beyond_the_classes() -> None:
    x, y = torch.randn(16, 4, generator=torch.Generator().manual_seed(0)), torch.randn(16, 1)
    task = Task(name="reg", train=(x, y), val=(x, y), build_model=lambda cfg: torch.nn.Linear(4, 2),
                loss=lambda out, t: torch.nn.functional.mse_loss(out[:, 0], t[:, 1]))
    with pytest.raises(IndexError, match="index 1 is out of bounds for dimension 1 with size 1"):
        train(TrainingConfig(max_steps=2, batch_size=8, device="cpu"), task)
