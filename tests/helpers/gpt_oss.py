"""Tiny gpt-oss configs and models built and initialised the way an engine builds them, on one process."""

from __future__ import annotations

import zlib

import torch

from nanocore.config.schema import ModelArgs
from nanocore_plugins.gpt_oss.config import GptOssConfig
from nanocore_plugins.gpt_oss.plugin import build

YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16}  # fmt: skip
BASE = dict(
    hidden_size=64,
    intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=4,  # sliding, full, sliding, full (transformers' default pattern)
    vocab_size=101,
    max_position_embeddings=64,
    sliding_window=5,  # far shorter than the test sequences: the window decides the logits
    num_local_experts=6,
    num_experts_per_tok=2,
    swiglu_limit=0.8,  # small enough that the test inputs hit the clamps
)


def tiny(**overrides) -> GptOssConfig:
    return GptOssConfig(**{"rope_scaling": dict(YARN), **BASE, **overrides})


def make(config: GptOssConfig):
    with torch.device("meta"):
        model = build(ModelArgs(model_config=config))
    model.to_empty(device="cpu")
    for name, p in model.named_parameters():
        model.init_parameter(name, p, torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return model.eval()


# the parity tests' model: float32 runs of a few steps on one to eight ranks
TINY_GPT_OSS = {
    "model_type": "gpt_oss",
    "hidden_size": 32,
    "intermediate_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 4,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "sliding_window": 6,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.05,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "truncate": False},
}
