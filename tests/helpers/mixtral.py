"""A tiny Mixtral built and initialised the way an engine builds one, on one process (for the tests
of the `mixtral` model type and of its Hugging Face conversion)."""

from __future__ import annotations

import zlib

import torch

from nanocore.config.schema import ModelArgs
from nanocore_plugins.llama.config import MixtralConfig
from nanocore_plugins.llama.mixtral import MixtralForCausalLM
from nanocore_plugins.llama.plugin import build_mixtral


def tiny(**overrides) -> MixtralConfig:
    base = dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=61,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    return MixtralConfig(**{**base, **overrides})


def make(config: MixtralConfig, seed: int = 0, vocab_multiple: int = 1) -> MixtralForCausalLM:
    """A materialised model initialised like an engine does; norms perturbed so that tests see them."""
    with torch.device("meta"):
        model = build_mixtral(ModelArgs(model_config=config), vocab_multiple=vocab_multiple)
    model.to_empty(device="cpu")
    for name, p in model.named_parameters():
        model.init_parameter(name, p, torch.Generator().manual_seed(seed * 1000 + zlib.crc32(name.encode())))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return model.eval()
