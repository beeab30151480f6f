"""The LR schedule (nanocore.lr_schedule) with each decay shape from the optim plugin."""

from __future__ import annotations

import io
import math

import pytest
import torch

from nanocore.config.schema import LRSchedulerArgs
from nanocore.errors import ConfigError
from nanocore.lr_schedule import LRSchedule
from nanocore.plugins import load_plugins

LR, MIN_LR = 1e-3, 1e-4
# remaining fraction at progress 0.5 for each shape, by formula
HALFWAY = {"cosine": 0.5, "linear": 0.5, "1-sqrt": 1 - math.sqrt(0.5), "constant": 1.0}


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


def schedule(registries, train_steps: int = 110, **kw) -> LRSchedule:
    args = LRSchedulerArgs(**{"learning_rate": LR, "min_decay_lr": MIN_LR, **kw})
    return LRSchedule.from_registry(args, train_steps, registries.lr_decay)


def test_registered_decay_shapes(registries):
    assert registries.lr_decay.names() == ["1-sqrt", "constant", "cosine", "linear"]


@pytest.mark.parametrize("style", sorted(HALFWAY))
def test_decay_shape_goes_from_one_to_zero(registries, style):
    fn = registries.lr_decay.get(style).factory
    values = [fn(i / 20) for i in range(21)]
    assert values[0] == 1.0
    assert values[-1] == (1.0 if style == "constant" else 0.0)
    assert all(a >= b for a, b in zip(values, values[1:], strict=False)), "decay must never increase the LR"
    assert fn(0.5) == pytest.approx(HALFWAY[style])


@pytest.mark.parametrize("style", sorted(HALFWAY))
def test_warmup_then_decay_at_key_steps(registries, style):
    # 10 warmup steps, decay over the remaining 100 steps: progress 0 at step 10, 1 at step 110.
    s = schedule(registries, lr_warmup_steps=10, lr_decay_style=style)
    end = LR if style == "constant" else MIN_LR
    assert s.lr_at(1) == pytest.approx(LR / 10)
    assert s.lr_at(5) == pytest.approx(LR / 2)
    assert s.lr_at(10) == pytest.approx(LR)
    assert s.lr_at(60) == pytest.approx(MIN_LR + (LR - MIN_LR) * HALFWAY[style])
    assert s.lr_at(110) == pytest.approx(end)
    assert s.lr_at(500) == pytest.approx(end)
    assert s.lr_at(11) <= LR


def test_cosine_values_match_the_formula_everywhere(registries):
    s = schedule(registries, lr_warmup_steps=10)
    for step in range(11, 111):
        expected = MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (step - 10) / 100))
        assert s.lr_at(step) == pytest.approx(expected)


def test_constant_warmup_uses_the_peak_lr(registries):
    s = schedule(registries, lr_warmup_steps=10, lr_warmup_style="constant", lr_decay_style="linear")
    assert [s.lr_at(k) for k in (1, 10)] == [pytest.approx(LR)] * 2
    assert s.lr_at(60) == pytest.approx((LR + MIN_LR) / 2)


def test_no_warmup_decays_from_step_one(registries):
    s = schedule(registries, train_steps=100, lr_decay_style="linear")
    assert s.lr_at(1) == pytest.approx(MIN_LR + (LR - MIN_LR) * 0.99)
    assert s.lr_at(100) == pytest.approx(MIN_LR)


def test_late_decay_start_and_short_decay_hold_then_floor(registries):
    # warmup 10, constant until step 50, linear decay over 20 steps, then the floor.
    s = schedule(registries, lr_warmup_steps=10, lr_decay_starting_step=50, lr_decay_steps=20, lr_decay_style="linear")
    assert s.lr_at(30) == pytest.approx(LR)
    assert s.lr_at(50) == pytest.approx(LR)
    assert s.lr_at(60) == pytest.approx((LR + MIN_LR) / 2)
    assert s.lr_at(70) == pytest.approx(MIN_LR)
    assert s.lr_at(110) == pytest.approx(MIN_LR)


def test_decay_start_without_length_ends_on_the_last_step(registries):
    s = schedule(registries, train_steps=100, lr_decay_starting_step=60, lr_decay_style="linear")
    assert s.lr_at(80) == pytest.approx((LR + MIN_LR) / 2)
    assert s.lr_at(99) > MIN_LR
    assert s.lr_at(100) == pytest.approx(MIN_LR)


def test_apply_sets_every_param_group(registries):
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1.0)
    s = schedule(registries, lr_warmup_steps=10)
    assert s.apply(optimizer, 5) == pytest.approx(LR / 2)
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(LR / 2)] * 2


def test_state_round_trip_through_a_weights_only_checkpoint(registries):
    s = schedule(registries, lr_warmup_steps=10)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    for step in range(1, 38):
        s.apply(optimizer, step)
    buffer = io.BytesIO()
    torch.save(s.state_dict(), buffer)
    buffer.seek(0)
    resumed = schedule(registries, lr_warmup_steps=10)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.step == 37
    assert resumed.lr_at(resumed.step + 1) == s.lr_at(38)


def test_unknown_decay_style_lists_the_installed_ones(registries):
    with pytest.raises(ConfigError, match="lr_decay_style: unknown lr decay 'cosin'.*did you mean 'cosine'"):
        schedule(registries, lr_decay_style="cosin")


def test_unknown_warmup_style_is_a_config_error(registries):
    with pytest.raises(ConfigError, match="lr_warmup_style"):
        schedule(registries, lr_warmup_style="exponential")
