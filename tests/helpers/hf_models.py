"""Tiny random Hugging Face transformers LLaMA folders (float32, safetensors), written into a test's tmp dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_HF_LLAMA: dict[str, Any] = {
    "vocab_size": 67,  # odd: tensor parallelism pads it, and the padding must disappear on export
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "initializer_range": 0.2,  # large enough for varied greedy continuations
}


def save_hf_llama(folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides: Any) -> Path:
    """A random `LlamaForCausalLM` saved with `save_pretrained`; norm weights are random too, so that a
    mapping mistake anywhere changes the logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_HF_LLAMA, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.2, 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()  # float32 files load as float32
