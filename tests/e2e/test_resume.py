"""Exact resume: N steps, a crash, a resume to 2N gives the losses of an uninterrupted 2N-step run."""

from __future__ import annotations

import json

import pytest
import torch

from nanocore import hookimpl
from nanocore.errors import TrainingError
from tests.helpers.training import run_training, tiny_config


class Crash(Exception):
    pass


class CrashAfter:
    """Simulates a killed job: raises after step `step` has finished (and been checkpointed)."""

    def __init__(self, step: int):
        self.step = step

    @hookimpl
    def on_step_end(self, step, metrics, trainer):
        if step == self.step:
            raise Crash(step)


def two_stage_config(tmp, checkpoints=None, **overrides):
    stages = [
        {"name": "warm", "start_training_step": 1, "data": {"dataset": None, "seed": 1}},
        {"name": "main", "start_training_step": 4, "data": {"dataset": None, "seed": 2}},
    ]
    return tiny_config(
        tmp,
        data_stages=stages,
        tokens={"train_steps": 8, "batch_accumulation_per_replica": 2},
        checkpoints={"checkpoint_interval": 2, **(checkpoints or {})},
        **overrides,
    )


def test_resume_reproduces_uninterrupted_losses_across_a_stage_switch(tmp_path):
    full = run_training(two_stage_config(tmp_path / "full"))
    assert len(full["losses"]) == 8

    interrupted = two_stage_config(tmp_path / "resumed")
    with pytest.raises(Crash):
        run_training(interrupted, extra_plugins=(CrashAfter(4),))  # crash right after the switch at step 4
    ckpts = tmp_path / "resumed" / "checkpoints"
    assert (ckpts / "latest.txt").read_text().strip() == "4"
    meta = json.loads((ckpts / "4" / "meta.json").read_text())
    assert meta["data"]["consumed_samples"] == {"warm": 6, "main": 2}

    interrupted["checkpoints"]["resume_checkpoint_path"] = str(ckpts)
    resumed = run_training(interrupted)
    assert resumed["losses"] == full["losses"][4:], "resumed losses must equal the uninterrupted run exactly"
    for name, tensor in full["weights"].items():
        assert torch.equal(resumed["weights"][name], tensor), name


def test_resume_from_a_step_folder_without_optimizer_state_differs(tmp_path):
    """load_optimizer: false really skips the optimizer state (so the default really restores it)."""
    full = run_training(two_stage_config(tmp_path / "full"))
    config = two_stage_config(tmp_path / "full")
    config["checkpoints"].update(
        resume_checkpoint_path=str(tmp_path / "full" / "checkpoints" / "4"), load_optimizer=False
    )
    config["checkpoints"]["checkpoints_path"] = str(tmp_path / "other")
    resumed = run_training(config)
    assert resumed["losses"][0] == full["losses"][4]  # same weights and data at step 5's forward
    assert resumed["losses"][1:] != full["losses"][5:]


class PoisonWeights:
    """Makes the model produce NaN from step `step` on, like a diverging run."""

    def __init__(self, step: int):
        self.step = step

    @hookimpl
    def on_step_end(self, step, metrics, trainer):
        if step == self.step:
            with torch.no_grad():
                next(trainer.engine.model.parameters()).fill_(float("nan"))


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_checkpoint(tmp_path):
    config = two_stage_config(tmp_path)
    with pytest.raises(TrainingError) as err:
        run_training(config, extra_plugins=(PoisonWeights(5),))
    message = str(err.value)
    assert "loss is nan at step 6" in message
    assert "last good checkpoint is 4" in message
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest.txt").read_text().strip() == "4"
    assert sorted(p.name for p in ckpts.iterdir()) == [".nanocore-lock", "2", "4", "latest.txt"]


def test_save_initial_state_writes_step_0_and_load_lr_scheduler_false_restarts_the_schedule(tmp_path):
    config = two_stage_config(tmp_path / "a", checkpoints={"checkpoint_interval": 4, "save_initial_state": True})
    run_training(config)
    ckpts = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".nanocore-lock", "0", "4", "8", "latest.txt"]
    assert json.loads((ckpts / "0" / "meta.json").read_text())["step"] == 0

    def lrs_after_resume(tmp, **checkpoints) -> list[float]:
        rows: list[float] = []

        class RecordLR:
            @hookimpl
            def on_step_end(self, step, metrics, trainer):
                rows.append(metrics["lr"])

        cfg = two_stage_config(tmp, checkpoints={"resume_checkpoint_path": str(ckpts / "4"), **checkpoints})
        run_training(cfg, extra_plugins=(RecordLR(),))
        return rows

    kept = lrs_after_resume(tmp_path / "b")
    restarted = lrs_after_resume(tmp_path / "c", load_lr_scheduler=False)
    lr = tiny_config(tmp_path)["optimizer"]["learning_rate_scheduler"]["learning_rate"]
    assert len(kept) == len(restarted) == 4
    assert restarted[:2] == [lr / 2, lr]  # a fresh 2-step warmup after the resume
    assert kept[0] < lr and kept != restarted  # the loaded schedule continues its decay
