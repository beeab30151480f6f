"""Tiny OLMo 3 configs and models built and initialised the way an engine builds them, on one process."""

from __future__ import annotations

import zlib

import torch

from nanocore.config.schema import ModelArgs
from nanocore_plugins.olmo3.config import Olmo3Config
from nanocore_plugins.olmo3.plugin import build

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=4,  # three windowed layers, then a full one (transformers' default pattern)
    vocab_size=101,
    max_position_embeddings=64,
    sliding_window=5,  # far shorter than the test sequences: the window decides the logits
)


def tiny(**overrides) -> Olmo3Config:
    return Olmo3Config(**{**BASE, **overrides})


def make(config: Olmo3Config):
    with torch.device("meta"):
        model = build(ModelArgs(model_config=config))
    model.to_empty(device="cpu")
    for name, p in model.named_parameters():
        model.init_parameter(name, p, torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return model.eval()


# the parity tests' model: float32 runs of a few steps on one to eight ranks
TINY_OLMO3 = {
    "model_type": "olmo3",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "sliding_window": 6,
}
