"""Lion (`optimizer_factory.name: lion`): the paper's update by hand, its arguments from the config, and
ZeRO-1 over dp2 equal to one process (Lion is elementwise: a row shard updates as the whole would)."""

from __future__ import annotations

import pytest
import torch

from nanocore.config.converter import structure_config
from nanocore.plugins import load_plugins
from tests.helpers import parity
from tests.helpers.training import run_training, tiny_config


def test_three_steps_equal_the_papers_update_by_hand():
    registries = load_plugins().registries
    entry = registries.optimizer.get("lion")
    p = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    optimizer = entry.factory([{"params": [p]}], entry.config_class(lion_beta1=0.8, lion_beta2=0.9),
                              lr=0.1, weight_decay=0.5, device=torch.device("cpu"))  # fmt: skip
    grads = [torch.tensor([1.0, -2.0, 0.5, 0.0]), torch.tensor([-3.0, 1.0, 0.5, 0.0]), torch.tensor([0.2, 0.1, -4, 1])]
    theta, m = p.detach().clone(), torch.zeros(4)
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
        c = 0.8 * m + 0.2 * g
        theta = theta * (1 - 0.1 * 0.5) - 0.1 * torch.sign(c)
        m = 0.9 * m + 0.1 * g
        torch.testing.assert_close(p.detach(), theta, rtol=0, atol=1e-7)
    # step 2's first element: c = 0.8 * 0.1 - 0.2 * 3 < 0, so the momentum's sign lost to the gradient's
    assert len(optimizer.state[p]) == 1  # one state tensor per parameter (the planner counts 1)


def lion_config(tmp, **sections) -> dict:
    raw = tiny_config(tmp, **sections)
    raw["optimizer"]["optimizer_factory"] = {"name": "lion"}  # AdamW's keys out
    raw["optimizer"]["learning_rate_scheduler"]["learning_rate"] = 1e-3
    return raw


def test_the_config_section_reaches_lion(tmp_path):
    registries = load_plugins().registries
    raw = lion_config(tmp_path)
    raw["optimizer"]["optimizer_factory"]["lion_beta2"] = 0.95
    args = structure_config(raw, registries).optimizer.optimizer_factory.args
    assert (args.lion_beta1, args.lion_beta2) == (0.9, 0.95)
    assert registries.optimizer.get("lion").extras["states_per_element"](args) == 1


@pytest.mark.slow
def test_dp2_zero1_trains_like_one_process(tmp_path):
    """10 steps, parity's tolerances (tests/helpers/parity.py). A sign flips only where the interpolated
    momentum is within rounding of zero, which these tiny runs never meet (a flip would show as 2 lr)."""
    one = run_training(lion_config(tmp_path / "one"))
    dp2 = lion_config(tmp_path / "dp2", parallelism={"dp": 2}, optimizer={"zero_stage": 1},
                      tokens={"batch_accumulation_per_replica": 2})  # fmt: skip
    parity.assert_matches(run_training(dp2, 2), one)
