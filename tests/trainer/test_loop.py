from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import trainer
import trainer.loop
from tests.trainer.support import SaveAt
from trainer import ConfigError, TrainingConfig, train
from trainer.data import DeviceBatches
from trainer.evaluate import evaluate
from trainer.loop import accumulate_gradients, optimizer_step
from trainer.precision import resolve_precision
from trainer.tasks import cross_entropy

CPU = torch.device("cpu")


def tiny(**values) -> TrainingConfig:
    base = {"max_steps": 30, "eval_every_steps": 10, "log_every_steps": 10, "batch_size": 32,
            "model": {"hidden": 16}, "learning_rate": 3e-3}
    return TrainingConfig.from_dict({**base, **values})


def test_accumulated_micro_batches_give_the_gradient_of_one_big_batch(digits) -> None:
    x, y = digits.train[0][:64], digits.train[1][:64]
    precision = resolve_precision("off", CPU)
    grads = []
    for n_micro in (1, 4):
        torch.manual_seed(0)
        model = digits.build_model(digits.model_config({}))
        chunks = zip(x.chunk(n_micro), y.chunk(n_micro))
        loss = accumulate_gradients(model, cross_entropy, chunks, n_micro, precision)
        grads.append(([p.grad.clone() for p in model.parameters()], loss))
    (one, loss_one), (four, loss_four) = grads
    for a, b in zip(one, four):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_one, loss_four)


def test_clipping_bounds_the_update_and_returns_the_unclipped_norm() -> None:
    torch.manual_seed(0)
    model = nn.Linear(10, 1)
    before = [p.detach().clone() for p in model.parameters()]
    (model(torch.randn(16, 10)) * 100).sum().backward()
    true_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    norm = optimizer_step(model, optimizer, resolve_precision("off", CPU), clip_norm=0.5, want_norm=True)
    step = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert norm.item() == pytest.approx(true_norm.item(), rel=1e-5)
    assert true_norm.item() > 0.5
    assert step.norm().item() == pytest.approx(0.5, rel=1e-4)
    assert all(p.grad is None for p in model.parameters())  # zeroed (to None) after the step


def test_mixed_precision_is_off_on_cpu_unless_asked() -> None:
    auto = resolve_precision("auto", CPU)
    assert auto.dtype is None and not auto.scaler.is_enabled()
    assert resolve_precision("bf16", CPU).dtype is torch.bfloat16
    assert resolve_precision("fp16", CPU).scaler.is_enabled()


def test_bf16_training_runs_on_cpu_when_asked(digits) -> None:
    result = train(tiny(mixed_precision="bf16"), digits)
    assert result.status == "completed" and result.metrics["val_loss"] < 2.3


def test_evaluation_leaves_no_gradients_and_restores_train_mode(digits) -> None:
    model = digits.build_model(digits.model_config({}))
    model.train()
    metrics = evaluate(model, digits, digits.val, 100, resolve_precision("off", CPU))
    assert set(metrics) == {"val_loss", "val_accuracy"}
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    model.eval()
    evaluate(model, digits, digits.val, 100, resolve_precision("off", CPU))
    assert not model.training  # it restores the mode it found


def curve(result) -> list[float]:
    return [r["train_loss"] for r in result.logs] + [m["val_loss"] for _, m in result.evals]


def test_same_config_and_seed_give_an_identical_loss_curve(digits) -> None:
    a, b = train(tiny(seed=3, model={"hidden": 16, "dropout": 0.1}), digits), \
        train(tiny(seed=3, model={"hidden": 16, "dropout": 0.1}), digits)
    assert curve(a) == curve(b)
    c = train(tiny(seed=4, model={"hidden": 16, "dropout": 0.1}), digits)
    assert curve(c) != curve(a)


def test_training_learns_and_logs_every_interval(digits) -> None:
    result = train(tiny(max_steps=200, eval_every_steps=100, log_every_steps=50, learning_rate=1e-2,
                        model={"hidden": 64}), digits)
    assert [r["step"] for r in result.logs] == [50, 100, 150, 200]
    assert [s for s, _ in result.evals] == [0, 100, 200]  # step 0: fast-fail's reference evaluation
    assert result.metrics["val_accuracy"] > 0.85
    assert all(r["samples_per_s"] > 0 and r["grad_norm"] > 0 for r in result.logs)
    assert result.reproducibility["seed"] == 0 and result.reproducibility["torch"] == torch.__version__


class Clock:
    """The loop's clock, advanced only by the work below: the throughput it measures is exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class Slow(nn.Module):
    """Each training forward takes `step_s` on the clock; each evaluation forward `eval_s`."""

    def __init__(self, inner: nn.Module, clock: Clock, step_s: float, eval_s: float) -> None:
        super().__init__()
        self.inner, self.clock, self.step_s, self.eval_s = inner, clock, step_s, eval_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.step_s if self.training else self.eval_s
        return self.inner(x)


class SlowSaveAt(SaveAt):
    def __init__(self, step: int, path: Path, clock: Clock, save_s: float) -> None:
        super().__init__(step, path)
        self.clock, self.save_s = clock, save_s

    def saved(self, info, metrics) -> None:
        self.clock.now += self.save_s
        super().saved(info, metrics)


def test_throughput_leaves_out_evaluations_and_checkpoints_wherever_they_fall(
        digits, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Logs every 10 steps; an evaluation at step 25 (inside an interval) and a checkpoint at step 10 (a log step).
    clock = Clock()
    monkeypatch.setattr(trainer.loop, "time", clock)
    task = dataclasses.replace(digits, build_model=lambda cfg: Slow(digits.build_model(cfg), clock, 0.005, 0.3))
    config = tiny(max_steps=40, log_every_steps=10, eval_every_steps=25, batch_size=32)
    result = train(config, task, checkpointer=SlowSaveAt(10, tmp_path / "ckpt.pt", clock, 0.4))
    rates = {r["step"]: r["samples_per_s"] for r in result.logs}
    assert sorted(rates) == [10, 20, 30, 40]
    # Every interval is 10 steps of 5 ms: 32 samples each. Restarting the clock after the evaluation at 25 gave
    # twice that at 30; the checkpoint after the log at 10 counted in the interval 11-20 gave a ninth of it.
    assert rates == pytest.approx({step: 32 / 0.005 for step in rates})


def test_gradient_accumulation_counts_samples_per_optimizer_step(digits) -> None:
    result = train(tiny(gradient_accumulation_steps=2, batch_size=16), digits)
    assert result.status == "completed" and result.steps == 30


class StopAtFirstReport:
    def __init__(self) -> None:
        self.logged: list[int] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.logged.append(step)

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        return step > 0


def test_reporter_can_stop_training(digits) -> None:
    reporter = StopAtFirstReport()
    result = train(tiny(max_steps=100), digits, reporter)
    assert result.status == "stopped" and result.steps == 10
    assert reporter.logged == [10]


TRAINER_DIR = str(Path(trainer.__file__).parent)


class SyncCounter(TorchFunctionMode):
    """Counts the trainer's own calls that copy a tensor's value to the host (each is a device sync on a GPU).

    torch's own optimizers read their CPU-side step counters with .item(); that is host memory, not a sync, so only
    calls made from the trainer's code count."""

    SYNCS = frozenset({"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.SYNCS and sys._getframe(1).f_code.co_filename.startswith(TRAINER_DIR):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("fast_fail", "expected"),
    [
        # 20 steps: one log and the final eval. 80 steps: 4 logs and 2 evals. One read-back each, nothing per step.
        (False, {20: 2, 80: 6}),
        # Fast-fail adds the step-0 evaluation and one flag read per check interval (the log interval) that is not
        # also an evaluation step: steps 20 and 60 of 80.
        (True, {20: 3, 80: 9}),
    ],
)
def test_no_host_device_sync_between_log_and_eval_intervals(digits, fast_fail: bool, expected: dict) -> None:
    digits.data_digest()  # the data's fingerprint (the reproducibility record's): read once per task, before any step
    counts = {}
    for max_steps in (20, 80):
        counter = SyncCounter()
        with counter:
            train(tiny(max_steps=max_steps, log_every_steps=20, eval_every_steps=40,
                       fast_fail={"enabled": fast_fail}), digits)
        counts[max_steps] = counter.count
    assert counts == expected


def test_batch_larger_than_the_data_is_refused(digits) -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        train(tiny(batch_size=100_000), digits)


def test_device_batches_cover_each_epoch_once_and_resume_exactly() -> None:
    batches = DeviceBatches(10, 3, seed=1, device=CPU)
    epoch = torch.cat([batches.next() for _ in range(3)])
    assert len(set(epoch.tolist())) == 9  # 3 full batches, the last partial one dropped
    state = batches.state_dict()
    expected = [batches.next().tolist() for _ in range(5)]
    resumed = DeviceBatches(10, 3, seed=1, device=CPU)
    resumed.load_state_dict(state)
    assert [resumed.next().tolist() for _ in range(5)] == expected
    assert DeviceBatches(10, 3, seed=2, device=CPU).next().tolist() != DeviceBatches(10, 3, seed=1, device=CPU) \
        .next().tolist()


# reduce-overhead: on a CPU inductor leaves the CUDA graphs out, but the mode still goes through (tests/trainer/
# test_cuda.py runs it with graphs).
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_compiled_run_saves_plain_weights_that_resume_without_compile(digits, tmp_path: Path, mode: str) -> None:
    from trainer.checkpoint import load_checkpoint

    compiled = train(tiny(compile=True, compile_mode=mode, max_steps=20), digits,
                     checkpointer=SaveAt(10, tmp_path / "c.pt"))
    eager = train(tiny(max_steps=20), digits)
    # The same computation, fused differently by inductor: equal to float rounding, not bit for bit.
    torch.testing.assert_close(curve(compiled), curve(eager), rtol=1e-4, atol=1e-5)
    state = load_checkpoint(tmp_path / "c.pt")
    assert not any(key.startswith("_orig_mod.") for key in state.model)
    digits.build_model(digits.model_config({"hidden": 16})).load_state_dict(state.model)  # strict: every key
    resumed = train(tiny(max_steps=20), digits, resume=state)
    assert resumed.status == "completed" and [r["step"] for r in resumed.logs] == [20]
    torch.testing.assert_close(resumed.logs[0]["train_loss"], compiled.logs[1]["train_loss"], rtol=1e-4, atol=1e-5)
