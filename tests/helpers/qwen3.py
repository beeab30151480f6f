"""Tiny Qwen3 / Qwen3-MoE configs and models built and initialised the way an engine builds them, on
one process (for the tests of the `qwen3` and `qwen3_moe` model types and their conversions)."""

from __future__ import annotations

import zlib

import torch

from nanocore.config.schema import ModelArgs
from nanocore_plugins.qwen3.config import Qwen3Config, Qwen3MoeConfig
from nanocore_plugins.qwen3.plugin import build, build_moe

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # not hidden / heads: Qwen3's head size is its own
    num_hidden_layers=2,
    vocab_size=101,
    max_position_embeddings=32,
)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)


def tiny(**overrides) -> Qwen3Config:
    return Qwen3Config(**{**BASE, **overrides})


def tiny_moe(**overrides) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**{**BASE, **MOE, **overrides})


def make(config):
    with torch.device("meta"):
        model = (build_moe if isinstance(config, Qwen3MoeConfig) else build)(ModelArgs(model_config=config))
    model.to_empty(device="cpu")
    for name, p in model.named_parameters():
        model.init_parameter(name, p, torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return model.eval()


# the parity and checkpoint tests' models: float32 runs of 10 steps on one to eight ranks
TINY_QWEN3 = {
    "model_type": "qwen3",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12,  # its own head size: neither hidden / heads nor a divisor of hidden
    "num_hidden_layers": 4,
    "vocab_size": 64,
    "max_position_embeddings": 64,
}
TINY_QWEN3_MOE = {
    **TINY_QWEN3,
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "norm_topk_prob": True,
    "mlp_only_layers": [0],  # a dense layer first, split over TP like LLaMA's MLP
    "router_aux_loss_coef": 0.05,
}
