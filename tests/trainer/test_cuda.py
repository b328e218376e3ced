"""On a CUDA device: no host-device sync between log and eval steps, compile, CUDA graphs, the multi-tensor Lion, TF32
and the device's metrics.

Skipped where torch sees no CUDA device. The sync check is torch's own: from the first report on (after the setup,
which moves the data to the device once), `torch.cuda.set_sync_debug_mode("error")` makes every synchronising call
raise, except inside the trainer's marked read-backs (`trainer.sync.allowed_sync`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from tests.trainer.support import SaveAt
from trainer import TrainingConfig, load_task, train
from trainer.checkpoint import load_checkpoint
from trainer.precision import allow_tf32
from trainer.tasks import cross_entropy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CHARLM = {"task": "charlm", "task_args": {"context": 32, "max_chars": 50_000}, "batch_size": 8,
          "model": {"d_model": 32, "n_layers": 1, "n_heads": 2}}
DIGITS = {"task": "digits", "batch_size": 32, "model": {"hidden": 16, "dropout": 0.1}}


def cuda_config(**values) -> TrainingConfig:
    base = {"device": "cuda", "max_steps": 60, "eval_every_steps": 20, "log_every_steps": 10, "learning_rate": 3e-3}
    return TrainingConfig.from_dict({**base, **values})


class StrictAfterFirstReport:
    """Turns on the sync check at the first report (fast-fail's evaluation before step 1), and notes the mode at
    every log, to show the check was on while training ran."""

    def __init__(self) -> None:
        self.modes: list[int] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.modes.append(torch.cuda.get_sync_debug_mode())

    def report(self, step: int, metrics: Mapping[str, float]) -> bool:
        torch.cuda.set_sync_debug_mode("error")
        return False


@pytest.fixture()
def sync_check():
    yield StrictAfterFirstReport()
    torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("values", [
    DIGITS,
    CHARLM,
    {**CHARLM, "gradient_clip_norm": 1.0, "gradient_accumulation_steps": 2},
    {**DIGITS, "curriculum": {"schedule": "linear", "end_fraction": 0.5}},
    {**DIGITS, "data_loader": "dataloader", "loader_workers": 2},
    {**CHARLM, "optimizer": "lion", "weight_decay": 0.1},
    # fp16 (what `auto` picks on GPUs without bf16): GradScaler with fused AdamW, and with Lion's found_inf support
    {**DIGITS, "mixed_precision": "fp16"},
    {**CHARLM, "optimizer": "lion", "weight_decay": 0.1, "mixed_precision": "fp16"},
], ids=["digits", "charlm", "charlm-clip-accumulation", "digits-curriculum", "digits-dataloader", "charlm-lion",
        "digits-fp16", "charlm-lion-fp16"])
def test_no_sync_between_log_and_eval_steps(sync_check: StrictAfterFirstReport, values: dict) -> None:
    result = train(cuda_config(**values), reporter=sync_check)  # bf16 autocast: mixed_precision auto
    assert result.status == "completed" and result.steps == 60
    assert sync_check.modes == [2] * 6  # "error" at every log step


def test_the_sync_check_catches_a_read_back_in_a_step(sync_check: StrictAfterFirstReport) -> None:
    task = load_task("digits")

    def loss_that_syncs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy(logits, targets)
        loss.item()  # what the loop must never do between log steps
        return loss

    task.loss = loss_that_syncs
    with pytest.raises(RuntimeError, match="synchroniz"):
        train(cuda_config(**DIGITS), task, sync_check)


def test_multi_tensor_lion_matches_the_per_tensor_loop_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.optim
    from trainer.optim import Lion

    calls = 0
    multi_tensor = trainer.optim._lion_foreach

    def counted(*args, **kwargs) -> None:
        nonlocal calls
        calls += 1
        multi_tensor(*args, **kwargs)

    monkeypatch.setattr(trainer.optim, "_lion_foreach", counted)

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)).cuda()
              for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [Lion(m.parameters(), lr=1e-3, weight_decay=0.1, foreach=f) for m, f in zip(models, (False, None))]
    for _ in range(5):
        x = torch.randn(32, 64, device="cuda")
        for model, optimizer in zip(models, optimizers):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert optimizers[1].param_groups[0]["foreach"] is None and calls == 5  # the CUDA default is the multi-tensor one
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b)


def test_logs_carry_throughput_and_each_runs_own_peak_memory() -> None:
    import importlib.util

    big = train(cuda_config(**{**CHARLM, "batch_size": 64, "model": {"d_model": 256, "n_layers": 4, "n_heads": 4}},
                            max_steps=10))
    result = train(cuda_config(**CHARLM))  # in the same process, as a sweep worker's next trial
    nvml = importlib.util.find_spec("pynvml") is not None  # nvidia-ml-py: torch.cuda.utilization needs it
    for record in result.logs:
        assert record["tokens_per_s"] > 0 and record["peak_mem_mb"] > 0
        assert ("gpu_util_pct" in record) == nvml and 0 <= record.get("gpu_util_pct", 0) <= 100
    # The peak counter is reset at each run's start: not the bigger run's peak carried over.
    assert max(r["peak_mem_mb"] for r in result.logs) < 0.5 * big.logs[-1]["peak_mem_mb"]


def test_tf32_is_allowed_unless_deterministic() -> None:
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        allow_tf32(torch.device("cuda"), deterministic=False)
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
        allow_tf32(torch.device("cuda"), deterministic=True)
        assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


# Last: the two cold compiles take longest, so that a time limit cuts these, not the quick checks above.
def test_a_compiled_run_trains_and_its_checkpoint_resumes_without_compile(tmp_path: Path) -> None:
    compiled = train(cuda_config(**CHARLM, compile=True), checkpointer=SaveAt(30, tmp_path / "c.pt"))
    assert compiled.status == "completed" and compiled.metrics["val_loss"] < 5.0
    state = load_checkpoint(tmp_path / "c.pt")
    assert not any(key.startswith("_orig_mod.") for key in state.model)
    resumed = train(cuda_config(**CHARLM), resume=state)
    assert resumed.status == "completed" and resumed.steps == 60
    assert resumed.metrics["val_loss"] == pytest.approx(compiled.metrics["val_loss"], rel=0.05)


def test_cuda_graphs_replay_the_training_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo.utils import counters

    launches = 0
    replay = torch.cuda.CUDAGraph.replay

    def counted(graph: torch.cuda.CUDAGraph) -> None:  # the real replay, counted (no profiler: CUPTI and graphs
        nonlocal launches                                # have clashed on older CUDA)
        launches += 1
        replay(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counted)
    counters.clear()
    values = {**CHARLM, "gradient_accumulation_steps": 2}
    graphed = train(cuda_config(**values, compile=True, compile_mode="reduce-overhead"),
                    checkpointer=SaveAt(30, tmp_path / "g.pt"))
    # 60 steps of 2 micro-batches, a forward and a backward graph each: the first step warms up, the second records
    # and replays, every later one replays; 236 in all.
    assert launches >= 200, f"{launches} CUDA graph replays"
    assert counters["inductor"]["cudagraph_skips"] == 0
    eager = train(cuda_config(**values))
    assert graphed.status == "completed" and graphed.metrics["val_loss"] < 5.0
    assert graphed.metrics["val_loss"] == pytest.approx(eager.metrics["val_loss"], rel=0.05)
    state = load_checkpoint(tmp_path / "g.pt")
    resumed = train(cuda_config(**values), resume=state)  # without compile, and so without graphs
    assert resumed.metrics["val_loss"] == pytest.approx(graphed.metrics["val_loss"], rel=0.05)


@pytest.mark.parametrize("values", [DIGITS, CHARLM], ids=["digits", "charlm"])
def test_cohorts_train_batched_in_bf16_and_match_the_ordinary_loop(values: dict) -> None:
    """The first GPU run found every bf16 cohort failing (a custom operator's backward under autocast) and charlm never
    batched (vmap's rule for the fused attention kernel). Each member now trains batched, under the default bf16
    autocast, and ends near its solo run (bf16: close, not bit for bit)."""
    from trainer.batched import train_batched

    configs = [cuda_config(**{**values, "model": {**values["model"], "dropout": 0.0}}, seed=s,
                           learning_rate=1e-3 * (1 + s)) for s in range(3)]
    task = load_task(configs[0].task, configs[0].task_args)
    messages: list[str] = []
    results = train_batched(configs, task, say=messages.append)
    assert messages == [] and all(r.reproducibility.get("batched") for r in results)
    for config, batched in zip(configs, results, strict=True):
        solo = train(config, task)
        assert (solo.status, solo.steps) == (batched.status, batched.steps) == ("completed", 60)
        assert batched.metrics["val_loss"] == pytest.approx(solo.metrics["val_loss"], rel=0.05)
