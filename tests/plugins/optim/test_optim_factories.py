"""Optimizers built through the registry, the way the trainer builds them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nanocore.plugins import load_plugins


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))


def param_groups(model: nn.Module) -> list[dict]:
    # What the trainer does: matrices decay, norms and biases do not.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def build(registries, name: str, model: nn.Module, args=None, *, lr: float = 1e-2, weight_decay: float = 0.1):
    entry = registries.optimizer.get(name)
    args = args if args is not None else entry.config_class()
    return entry.factory(param_groups(model), args, lr=lr, weight_decay=weight_decay, device=torch.device("cpu"))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 30) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=gen)
    y = x[:, :1] * 2 - x[:, 1:2]
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], losses[-1]


@pytest.mark.parametrize("name", ["adam_w", "adamW", "adamw", "sgd"])
def test_optimizer_from_registry_trains_a_small_model(registries, name):
    model = tiny_model()
    args = registries.optimizer.get(name).config_class()
    if name == "sgd":
        args.momentum = 0.9
    optimizer = build(registries, name, model, args, lr=1e-2)
    first, last = train(model, optimizer)
    assert last < 0.5 * first


def test_adamw_aliases_resolve_to_adam_w(registries):
    for alias in ("adamW", "adamw"):
        assert registries.optimizer.canonical(alias) == "adam_w"
        assert registries.optimizer.get(alias) is registries.optimizer.get("adam_w")


@pytest.mark.parametrize("name", ["adam_w", "sgd"])
def test_weight_decay_skips_the_group_that_overrides_it(registries, name):
    model = tiny_model()
    optimizer = build(registries, name, model, lr=0.1, weight_decay=0.5)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.5, 0.0]
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: only weight decay moves a parameter
    optimizer.step()
    for p, old in zip(model.parameters(), before, strict=True):
        if p.ndim >= 2:
            torch.testing.assert_close(p.detach(), old * (1 - 0.1 * 0.5))
        else:
            torch.testing.assert_close(p.detach(), old)


def test_adamw_arguments_reach_torch(registries):
    args = registries.optimizer.get("adam_w").config_class(adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6)
    group = build(registries, "adam_w", tiny_model(), args, lr=3e-4).param_groups[0]
    assert group["betas"] == (0.8, 0.99)
    assert group["eps"] == 1e-6
    assert group["lr"] == 3e-4


def test_adamw_is_fused_when_asked_and_supported_on_cpu(registries):
    # torch >= 2.4 has fused AdamW kernels on CPU; the flag turns them off.
    fused = build(registries, "adam_w", tiny_model())
    assert fused.defaults["fused"] is True
    args = registries.optimizer.get("adam_w").config_class(torch_adam_is_fused=False)
    assert not build(registries, "adam_w", tiny_model(), args).defaults["fused"]


def test_fused_and_unfused_adamw_agree(registries):
    results = []
    for is_fused in (True, False):
        model = tiny_model()
        args = registries.optimizer.get("adam_w").config_class(torch_adam_is_fused=is_fused)
        train(model, build(registries, "adam_w", model, args), steps=5)
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)


def test_sgd_arguments_reach_torch(registries):
    args = registries.optimizer.get("sgd").config_class(momentum=0.9, nesterov=True)
    optimizer = build(registries, "sgd", tiny_model(), args, lr=0.1, weight_decay=0.01)
    assert isinstance(optimizer, torch.optim.SGD)
    group = optimizer.param_groups[0]
    assert (group["momentum"], group["nesterov"], group["dampening"], group["weight_decay"]) == (0.9, True, 0.0, 0.01)


def test_invalid_optimizer_arguments_are_reported_by_field(registries):
    adam = registries.optimizer.get("adam_w").config_class(adam_beta1=1.0, adam_eps=-1.0)
    problems = adam.check(None)
    assert any(p.startswith("adam_beta1:") for p in problems)
    assert any(p.startswith("adam_eps:") for p in problems)
    sgd = registries.optimizer.get("sgd").config_class(nesterov=True)
    assert [p.split(":")[0] for p in sgd.check(None)] == ["nesterov"]
    assert registries.optimizer.get("sgd").config_class(momentum=0.9, nesterov=True).check(None) == []


def test_every_optimizer_argument_is_documented(registries):
    import attrs

    for entry in registries.optimizer:
        for field in attrs.fields(entry.config_class):
            assert field.metadata.get("doc"), f"{entry.name}.{field.name} has no doc"


def test_yaml_optimizer_section_becomes_adamw_args(registries):
    from nanocore.config.converter import make_converter
    from nanocore.config.schema import OptimizerArgs

    raw = {"optimizer_factory": {"name": "adamW", "adam_beta1": 0.8, "torch_adam_is_fused": False}}
    factory = make_converter(registries).structure(raw, OptimizerArgs).optimizer_factory
    assert factory.name == "adam_w"
    assert factory.args == registries.optimizer.get("adam_w").config_class(adam_beta1=0.8, torch_adam_is_fused=False)
