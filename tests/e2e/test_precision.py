"""bfloat16 parameters train with float32 gradient accumulation and float32 master weights."""

from __future__ import annotations

import math

import torch

from nanocore.config.checks import check_config
from nanocore.config.converter import structure_config
from nanocore.config.load import LoadedConfig
from nanocore.plugins import load_plugins
from nanocore.trainer import Trainer
from tests.helpers.training import tiny_config


def make_trainer(tmp_path, dtype: str, fp32_accumulation: bool) -> Trainer:
    raw = tiny_config(
        tmp_path,
        model={"dtype": dtype, "model_config": {"num_hidden_layers": 1}},
        tokens={"train_steps": 3, "batch_accumulation_per_replica": 2},
        optimizer={"accumulate_grad_in_fp32": fp32_accumulation},
    )
    plugins = load_plugins()
    config = structure_config(raw, plugins.registries)
    check_config(config, plugins.registries, 1)
    return Trainer(LoadedConfig(config, plugins, None))


def test_bfloat16_parameters_keep_float32_gradients_and_master_weights(tmp_path):
    trainer = make_trainer(tmp_path, "bfloat16", fp32_accumulation=True)
    params = list(trainer.engine.model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert {p.main_grad.dtype for p in params} == {torch.float32}
    masters = [slot.master for slot in trainer.engine.optimizer.slots]
    assert {m.dtype for m in masters} == {torch.float32}
    before = [m.detach().clone() for m in masters]
    slots = trainer.engine.optimizer.slots  # shutting down drops the engine's optimizer
    losses = trainer.train()
    trainer.close()
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # the bf16 parameters are the rounded fp32 masters, which moved
    for slot in slots:
        assert torch.equal(slot.param_view, slot.master.detach().to(torch.bfloat16))
    assert any(not torch.equal(old, slot.master) for slot, old in zip(slots, before, strict=True))


def test_bfloat16_without_fp32_accumulation_uses_bfloat16_gradients(tmp_path):
    trainer = make_trainer(tmp_path, "bfloat16", fp32_accumulation=False)
    assert {p.main_grad.dtype for p in trainer.engine.model.parameters()} == {torch.bfloat16}
    losses = trainer.train()
    trainer.close()
    assert all(math.isfinite(x) for x in losses)


def test_float32_parameters_are_their_own_master(tmp_path):
    trainer = make_trainer(tmp_path, "float32", fp32_accumulation=True)
    slots = trainer.engine.optimizer.slots
    assert all(slot.master.data_ptr() == slot.t.param.data_ptr() for slot in slots)
    assert all(p.grad is p.main_grad for p in trainer.engine.model.parameters())
    trainer.close()
