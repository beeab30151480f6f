"""Run the real trainer from a config dict, in this process or on N spawned gloo ranks.

Used by the parity and checkpoint tests: every run returns its per-step losses and the full
(unsharded) weights assembled from the pieces each rank would write to a checkpoint.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import attrs
import torch

from nanocore import hookimpl
from nanocore.config.checks import check_config
from nanocore.config.converter import structure_config
from nanocore.config.load import LoadedConfig
from nanocore.plugins import load_plugins
from nanocore.trainer import Trainer
from tests.helpers.distributed import run_ranks

TINY_MODEL = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 64,
    "max_position_embeddings": 64,
}


def tiny_config(tmp: Path, **sections: Any) -> dict:
    """A float32 tiny-LLaMA config on random tokens; `sections` override top-level sections (merged)."""
    config: dict[str, Any] = {
        "general": {"seed": 7, "project": "test", "run": "parity"},
        "model": {"model_config": dict(TINY_MODEL), "dtype": "float32", "init_method": {"std": 0.05}},
        "tokenizer": {"tokenizer_name_or_path": None},
        "tokens": {
            "sequence_length": 16,
            "train_steps": 10,
            "micro_batch_size": 1,
            "batch_accumulation_per_replica": 4,
        },
        "optimizer": {
            "learning_rate_scheduler": {"learning_rate": 3e-3, "lr_warmup_steps": 2, "min_decay_lr": 3e-4},
            "weight_decay": 0.01,
            "clip_grad": 1.0,
            "optimizer_factory": {"name": "adam_w", "torch_adam_is_fused": False},
        },
        "data_stages": [{"name": "stable", "start_training_step": 1, "data": {"dataset": None}}],
        "checkpoints": {"checkpoints_path": str(tmp / "checkpoints"), "save_final_state": False},
        "logging": {"log_dir": str(tmp / "logs"), "loggers": []},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            merged = copy.deepcopy(config[key])
            for k, v in value.items():
                if isinstance(v, dict) and isinstance(merged.get(k), dict):
                    merged[k] = {**merged[k], **v}
                else:
                    merged[k] = v
            config[key] = merged
        else:
            config[key] = value
    return config


class _MetricsRecorder:
    """Keeps every step's metrics row (what the loggers receive)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    @hookimpl
    def on_step_end(self, step, metrics, trainer):
        self.rows.append(dict(metrics))


def _train(raw: dict, world_size: int, extra_plugins: tuple = ()) -> dict:
    plugins = load_plugins()
    recorder = _MetricsRecorder()
    plugins.register_object(recorder, "test_metrics_recorder")
    for i, plugin in enumerate(extra_plugins):
        plugins.register_object(plugin, f"test_plugin_{i}")
    config = structure_config(raw, plugins.registries)
    check_config(config, plugins.registries, world_size)
    trainer = Trainer(LoadedConfig(config, plugins, None))
    try:
        losses = trainer.train()
        pieces = [(s.name, s.tensor.detach().cpu().clone(), s.placement) for s in trainer.engine.model_shards()]
        state_bytes = trainer.engine.optimizer.state_bytes()
        memory = {
            **attrs.asdict(trainer.engine.memory_estimate()),
            "grads_held_bytes": _gradient_bytes_held(trainer.engine),
            "params_held_bytes": _parameter_bytes_held(trainer.engine),
        }
    finally:
        trainer.close()
    # Shutting down must leave no process group alive: a live gloo group's threads outlive the run
    # into interpreter shutdown, where they abort the process at random.
    grid = trainer.engine.grid
    assert grid.live_groups() == 0, f"{grid.live_groups()} process group(s) outlived shutdown"
    return {"losses": losses, "pieces": pieces, "state_bytes": state_bytes, "metrics": recorder.rows, "memory": memory}


def _parameter_bytes_held(engine) -> int:
    """Bytes of parameter storage this rank keeps between steps (ZeRO-3: its rows; whole tensors are
    gone), counting each storage once."""
    storages = {}
    for p in engine.model.parameters():
        for t in (p.data, getattr(p, "zero3_shard", None)):
            if t is not None and t.numel():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _gradient_bytes_held(engine) -> int:
    """Bytes of gradients this rank keeps between steps: the engine's buffer plus any `.grad` outside it."""
    buffer = engine.data_parallel.grad_buffer
    held = buffer.numel() * buffer.element_size()
    base = buffer.untyped_storage().data_ptr()
    for p in engine.model.parameters():
        if p.grad is not None and p.grad.untyped_storage().data_ptr() != base:
            held += p.grad.numel() * p.grad.element_size()
    return held


def _rank_train(rank: int, world_size: int, raw: dict) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    return _train(raw, world_size)


def assemble(results: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's written pieces."""
    full: dict[str, torch.Tensor] = {}
    for result in results:
        for name, tensor, placement in result["pieces"]:
            if name not in full:
                full[name] = torch.full(placement.full_shape, float("nan"), dtype=tensor.dtype)
            full[name][placement.slices(tuple(tensor.shape))] = tensor
    for name, tensor in full.items():
        assert not torch.isnan(tensor).any(), f"{name} not fully covered by the written pieces"
    return full


def run_training(raw: dict, world_size: int = 1, extra_plugins: tuple = ()) -> dict:
    """Train; returns {'losses': rank 0's losses, 'weights': full tensors, 'ranks': per-rank results}.

    `extra_plugins` (objects with hook implementations) are registered in-process, one process only.
    """
    if world_size == 1:
        results = [_train(raw, 1, extra_plugins)]
    else:
        results = run_ranks(world_size, _rank_train, raw, timeout=600)
    return {
        "losses": results[0]["losses"],
        "metrics": results[0]["metrics"],
        "weights": assemble(results),
        "ranks": results,
    }


def train_in_process(raw: dict) -> tuple[list[float], list[torch.Tensor]]:
    """Losses of a one-process run, and its first batch's micro-batches."""
    plugins = load_plugins()
    config = structure_config(raw, plugins.registries)
    check_config(config, plugins.registries, 1)
    trainer = Trainer(LoadedConfig(config, plugins, None))
    try:
        first_batch = trainer.data.micro_batches(trainer.data.mixture(0), 0)
        return trainer.train(), first_batch
    finally:
        trainer.close()
