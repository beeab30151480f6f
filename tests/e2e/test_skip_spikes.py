"""`optimizer.skip_spikes` in training: a step whose loss is NaN, or spikes, updates nothing, at one
process and at dp2·tp2·pp2 (8 ranks), so the weights equal those of a run that never saw those
batches; skipped steps are logged; a run of bad batches stops with a message naming the last good
checkpoint.

A bad batch is inserted by a test plugin (`Poison`): at a poisoned step the data is read but not
advanced (the next step reads the same samples), and the output head's logits are multiplied by NaN or
by 1000 on the ranks that hold the head. So a run poisoned at k steps trains on the same batches, in
the same order, as an unpoisoned run of k fewer steps; with a constant learning rate both must end
with the same weights, bit for bit.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from nanocore import hookimpl
from nanocore.errors import TrainingError
from tests.helpers.distributed import run_ranks
from tests.helpers.training import _train, run_training, tiny_config

GUARD = {"enabled": True, "sigmas": 6.0, "min_history": 3, "max_consecutive": 3}


class Poison:
    """At the steps in `bad` ({step: "nan" | "spike"}) an extra batch whose logits are NaN or 1000x."""

    def __init__(self, bad: dict[int, str]):
        self.bad = bad
        self.step = 0

    @hookimpl
    def on_train_start(self, config, trainer):
        data, read = trainer.data, trainer.data.next_batch

        def next_batch(step: int):
            self.step = step
            batches = read(step)
            if step in self.bad:  # inserted: the data goes on as if these samples were not read
                data.consumed[data.names[data.stage_index(step)]] -= data.global_batch_size
            return batches

        data.next_batch = next_batch
        for name, module in trainer.engine.model.named_modules():
            if name.endswith("lm_head"):  # on the last pipeline stage only
                module.register_forward_hook(self.corrupt)

    def corrupt(self, module, inputs, output):
        kind = self.bad.get(self.step)
        if kind == "nan":
            return output * float("nan")
        if kind == "spike":
            return output * 1000.0
        return None


def config(tmp_path, steps: int, guard: dict | None = GUARD, **parallelism) -> dict:
    return tiny_config(
        tmp_path,
        parallelism=parallelism,
        tokens={"train_steps": steps, "batch_accumulation_per_replica": 2},
        optimizer={
            "learning_rate_scheduler": {"lr_warmup_steps": 0, "lr_decay_style": "constant"},
            **({"skip_spikes": guard} if guard else {}),
        },
        logging={"log_dir": str(tmp_path / "logs"), "loggers": ["console", "jsonl", "tensorboard"]},
    )


def _poisoned_rank(rank: int, world_size: int, raw: dict, bad: dict[int, str]) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    return _train(raw, world_size, (Poison(bad),))


def train(raw: dict, world_size: int, bad: dict[int, str]) -> dict:
    if world_size == 1:
        return run_training(raw, 1, (Poison(bad),))
    from tests.helpers.training import assemble

    results = run_ranks(world_size, _poisoned_rank, raw, bad, timeout=600)
    return {"losses": results[0]["losses"], "metrics": results[0]["metrics"], "weights": assemble(results)}


LAYOUTS = {"one_process": (1, {}), "dp2_tp2_pp2": (8, {"dp": 2, "tp": 2, "pp": 2})}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nan_and_spike_steps_update_nothing(tmp_path, layout):
    world_size, parallelism = LAYOUTS[layout]
    bad = {5: "nan", 8: "spike"}
    poisoned = train(config(tmp_path / "poisoned", 10, **parallelism), world_size, bad)
    clean = train(config(tmp_path / "clean", 8, **parallelism), world_size, {})
    assert poisoned["weights"].keys() == clean["weights"].keys()
    for name, tensor in clean["weights"].items():
        assert torch.equal(poisoned["weights"][name], tensor), f"{name} differs from the run that never saw them"
    rows = poisoned["metrics"]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    kept = [r["lm_loss"] for r in rows if r["step"] not in bad]
    assert kept == clean["losses"], "the accepted steps are the clean run's steps"
    assert rows[7]["lm_loss"] > 10 * rows[6]["lm_loss"] and rows[4]["grad_norm"] is None


@pytest.mark.slow
def test_skipped_steps_are_logged_to_every_logger(tmp_path, capfd, caplog):
    raw = config(tmp_path, 6)
    raw["logging"]["iteration_step_info_interval"] = 5
    train(raw, 1, {3: "nan"})
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped_steps"]) for r in rows] == [(3, 1), (5, 1), (6, 1)], "a skipped step always shows"
    assert rows[0]["lm_loss"] != rows[0]["lm_loss"], "its loss (NaN) is logged"
    assert "step 3 skipped, no update made: loss nan, gradient norm nan: not finite (1 in a row)" in caplog.text
    console = [line for line in capfd.readouterr().err.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in console] == ["step 3/6", "step 5/6", "step 6/6"], console
    assert "lm_loss nan" in console[0] and "skipped_steps 1" in console[0], console
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "logs" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/skipped_steps")] == [(3, 1), (5, 1), (6, 1)]


@pytest.mark.slow
def test_a_run_of_bad_batches_stops_with_the_last_good_checkpoint(tmp_path):
    raw = config(tmp_path, 12)
    raw["checkpoints"]["checkpoint_interval"] = 2
    with pytest.raises(TrainingError) as caught:
        train(raw, 1, {5: "nan", 6: "spike", 7: "nan"})
    message = str(caught.value)
    assert "3 steps in a row were skipped (optimizer.skip_spikes.max_consecutive), the last at step 7" in message
    assert f"the last good checkpoint is 6 in {tmp_path / 'checkpoints'}" in message


@pytest.mark.slow
def test_without_the_guard_a_nan_stops_the_run_before_any_update(tmp_path):
    with pytest.raises(TrainingError, match="loss is nan at step 4: training stopped before updating the weights"):
        train(config(tmp_path, 6, guard=None), 1, {4: "nan"})


@pytest.mark.slow
def test_a_guarded_run_resumes_with_its_window_and_count(tmp_path):
    """The guard's window of recent losses and norms and its skip count travel in the checkpoint: a run
    saved at step 6 (after skipping step 5) and resumed skips step 8's spike as the uninterrupted run
    does. A fresh window would hold one step at step 8, under `min_history`, and apply the spike."""
    bad = {5: "nan", 8: "spike"}
    whole = train(config(tmp_path / "whole", 10), 1, bad)
    first = config(tmp_path / "resumed", 6)
    first["checkpoints"]["checkpoint_interval"] = 6
    train(first, 1, bad)
    second = config(tmp_path / "resumed", 10)
    second["checkpoints"]["resume_checkpoint_path"] = str(tmp_path / "resumed" / "checkpoints" / "6")
    resumed = train(second, 1, bad)
    assert [r["skipped_steps"] for r in resumed["metrics"]] == [1, 2, 2, 2], "the count goes on from the checkpoint"
    assert resumed["losses"] == whole["losses"][6:]
    for name, tensor in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], tensor), f"{name} differs from the uninterrupted run"
