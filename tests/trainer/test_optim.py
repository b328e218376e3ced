from __future__ import annotations

import copy
import math
from itertools import pairwise

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from trainer.config import TrainingConfig
from trainer.optim import Lion, build_optimizer, lr_at

CPU = torch.device("cpu")


def config(**values) -> TrainingConfig:
    return TrainingConfig.from_dict({"max_steps": 100, "learning_rate": 1.0, **values})


def test_warmup_rises_linearly_to_the_peak() -> None:
    c = config(warmup_steps=10, scheduler="none")
    assert [lr_at(s, c) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lr_at(10, c) == 1.0 and lr_at(99, c) == 1.0


@pytest.mark.parametrize("scheduler", ["cosine", "linear"])
def test_decay_ends_at_min_lr_ratio(scheduler: str) -> None:
    c = config(warmup_steps=10, scheduler=scheduler, min_lr_ratio=0.1)
    assert lr_at(10, c) == pytest.approx(1.0)  # the peak right after warmup
    assert lr_at(100, c) == pytest.approx(0.1)  # the floor at max_steps
    values = [lr_at(s, c) for s in range(10, 101)]
    assert all(a >= b for a, b in pairwise(values))  # never rises
    midpoint = lr_at(55, c)
    assert midpoint == pytest.approx(0.55, abs=1e-9)  # cosine and linear both cross half-way at the midpoint


def test_cosine_and_linear_differ_between_the_ends() -> None:
    cos, lin = config(scheduler="cosine"), config(scheduler="linear")
    assert lr_at(25, cos) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))
    assert lr_at(25, lin) == pytest.approx(0.75)


def test_step_schedule_multiplies_by_gamma() -> None:
    c = config(scheduler="step", step_every=30, step_gamma=0.5)
    assert [lr_at(s, c) for s in (0, 29, 30, 59, 60, 99)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.125]


def test_weight_decay_skips_biases_and_norms() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    opt = build_optimizer(model, config(optimizer="adamw", weight_decay=0.1), CPU)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and len(plain["params"]) == 3


@pytest.mark.parametrize(
    ("values", "cls", "check"),
    [
        ({"optimizer": "sgd", "momentum": 0.5, "nesterov": True}, torch.optim.SGD,
         lambda g: g["momentum"] == 0.5 and g["nesterov"] is True),
        ({"optimizer": "adam", "beta1": 0.8}, torch.optim.Adam, lambda g: g["betas"] == (0.8, 0.999)),
        ({"optimizer": "adamw", "beta2": 0.95, "eps": 1e-6}, torch.optim.AdamW,
         lambda g: g["betas"] == (0.9, 0.95) and g["eps"] == 1e-6),
        ({"optimizer": "lion"}, Lion, lambda g: g["betas"] == (0.9, 0.99)),
    ],
)
def test_optimizer_builder_passes_the_config_through(values: dict, cls: type, check) -> None:
    opt = build_optimizer(nn.Linear(3, 2), config(**values), CPU)
    assert type(opt) is cls
    assert check(opt.param_groups[0])


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "lion"])
def test_every_optimizer_minimises_a_quadratic(name: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 1)
    opt = build_optimizer(model, config(optimizer=name, learning_rate=0.01), CPU)
    first = None
    for _ in range(200):
        loss = ((model(x) - y) ** 2).mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first


def lion_by_the_paper(p: torch.Tensor, m: torch.Tensor, lr: float, betas: tuple[float, float], decay: float) -> None:
    """Algorithm 2 of Chen et al. (2023) for one tensor: what both of our Lion's paths must compute."""
    beta1, beta2 = betas
    p.mul_(1 - lr * decay)
    p.add_((m * beta1 + p.grad * (1 - beta1)).sign(), alpha=-lr)
    m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


@pytest.mark.parametrize("foreach", [False, True], ids=["per-tensor", "foreach"])
def test_lion_computes_the_papers_update_bit_for_bit(foreach: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 1))
    frozen = nn.Parameter(torch.randn(3))  # no gradient: neither moved nor given state
    reference = [p.detach().clone() for p in model.parameters()]
    moments = [torch.zeros_like(p) for p in reference]
    opt = Lion([{"params": [model[0].weight, model[2].weight, frozen], "weight_decay": 0.1},
                {"params": [model[0].bias, model[1].weight, model[1].bias, model[2].bias], "weight_decay": 0.0}],
               lr=0.01, betas=(0.9, 0.99), foreach=foreach)
    decays = [0.1 if p.dim() >= 2 else 0.0 for p in model.parameters()]
    for _ in range(5):
        loss = (model(torch.randn(16, 6)) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p, r in zip(model.parameters(), reference):
            r.grad = p.grad.clone()
        for r, m, decay in zip(reference, moments, decays):
            lion_by_the_paper(r, m, 0.01, (0.9, 0.99), decay)
        before = frozen.detach().clone()
        opt.step()
        for p, r in zip(model.parameters(), reference):
            assert torch.equal(p.detach(), r)
        assert torch.equal(frozen.detach(), before) and frozen not in opt.state
    for p, m in zip(model.parameters(), moments):
        assert torch.equal(opt.state[p]["exp_avg"], m)


def test_lion_loads_a_state_saved_before_it_had_foreach() -> None:
    model = nn.Linear(3, 2)
    opt = Lion(model.parameters(), lr=0.01)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = opt.state_dict()
    for group in state["param_groups"]:
        del group["foreach"]
    again = Lion(model.parameters(), lr=0.01)
    again.load_state_dict(state)
    again.step()
    assert again.param_groups[0]["foreach"] is None


class CountItems(TorchFunctionMode):
    """Counts `Tensor.item` calls: each is a host-device sync on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.items = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.items += func is torch.Tensor.item
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("unscale_first", [True, False])  # the trainer unscales first, to clip
def test_lion_under_a_grad_scaler_decides_on_the_device_and_skips_overflowed_steps(unscale_first: bool) -> None:
    # fp16 (GPUs without bf16): GradScaler.step asks a plain optimizer's found_inf with .item() every step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    twin = copy.deepcopy(model)
    scaled, plain = (Lion(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, twin))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # a power of two: unscaling is exact
    for _ in range(3):
        x = torch.randn(16, 8)
        scaler.scale(model(x).square().mean()).backward()
        twin(x).square().mean().backward()
        if unscale_first:
            scaler.unscale_(scaled)
        with CountItems() as counter:
            scaler.step(scaled)
        scaler.update()
        plain.step()
        scaled.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        assert counter.items == 0
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a, b)  # the same step as without a scaler
    before = copy.deepcopy(model.state_dict()), copy.deepcopy(scaled.state_dict())
    scaler.scale(model(torch.randn(16, 8)).square().mean()).backward()
    model[0].weight.grad[0, 0] = float("inf")  # an fp16 overflow
    with CountItems() as counter:
        scaler.step(scaled)
    scaler.update()
    assert counter.items == 0 and scaler.get_scale() == 2.0**9
    for key, value in before[0].items():
        assert torch.equal(model.state_dict()[key], value)  # the step changed nothing
    for state, saved in zip(scaled.state_dict()["state"].values(), before[1]["state"].values()):
        assert torch.equal(state["exp_avg"], saved["exp_avg"])


def test_lion_skips_a_step_that_overflowed_on_two_devices() -> None:
    # GradScaler passes the sum of the devices' found_inf flags: 2.0 is one skipped step too, not a step backwards.
    model = nn.Linear(4, 2)
    optimizer = Lion(model.parameters(), lr=1e-2, weight_decay=0.1)
    model(torch.randn(3, 4)).sum().backward()
    before = copy.deepcopy(model.state_dict())
    optimizer.grad_scale, optimizer.found_inf = None, torch.tensor(2.0)
    optimizer.step()
    for key, value in before.items():
        assert torch.equal(model.state_dict()[key], value)
