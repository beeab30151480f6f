"""Registers the built-in 3D engine (`parallelism.engine: 3d`) and its config checks."""

from __future__ import annotations

import torch

from nanocore import hookimpl
from nanocore.config import Config

from .engine import Engine3D


def check(config: Config, _args: object, registries=None) -> list[str]:
    par, problems = config.parallelism, []
    if par.expert_parallel_size > 1:
        problems.append(
            f"parallelism.expert_parallel_size: {par.expert_parallel_size} needs a model plugin that provides "
            "experts; the 3d engine runs dense models only (set it to 1)"
        )
    return problems


def check_blocks(config: Config, model_entry) -> list[str]:
    par = config.parallelism
    chunks = par.pp * par.pp_virtual_stages
    if chunks <= 1:
        return []
    try:
        with torch.device("meta"):
            model = model_entry.factory(config.model, vocab_multiple=1)
        blocks = len(model.pipeline_blocks())
    except Exception:  # the model's own check reports a broken model config
        return []
    if blocks < chunks:
        return [
            f"parallelism: pp x pp_virtual_stages = {chunks} pipeline chunks but the model has only {blocks} "
            "pipeline blocks (embedding, each decoder layer, head); add layers or lower pp / pp_virtual_stages"
        ]
    return []


@hookimpl
def register_parallel_engines(registry):
    registry.register(
        "3d",
        Engine3D,
        description="data x tensor x pipeline parallelism (gloo on CPU, NCCL on GPU)",
        check=check,
        check_model=check_blocks,
    )
