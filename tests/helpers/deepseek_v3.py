"""Tiny DeepSeek-V3 configs and models built and initialised the way an engine builds them, on one
process (for the tests of the `deepseek_v3` model type and its conversion)."""

from __future__ import annotations

import zlib

import torch

from nanocore.config.schema import ModelArgs
from nanocore_plugins.deepseek_v3.config import DeepseekV3Config
from nanocore_plugins.deepseek_v3.plugin import build

BASE = dict(
    hidden_size=48,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_attention_heads=4,
    num_hidden_layers=3,
    vocab_size=101,
    max_position_embeddings=64,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    q_lora_rank=20,
    kv_lora_rank=24,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,  # narrower than a query/key head (20)
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def tiny(**overrides) -> DeepseekV3Config:
    return DeepseekV3Config(**{**BASE, **overrides})


def make(config: DeepseekV3Config):
    with torch.device("meta"):
        model = build(ModelArgs(model_config=config))
    model.to_empty(device="cpu")
    for name, p in model.named_parameters():
        model.init_parameter(name, p, torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return model.eval()


# the parity and checkpoint tests' model: float32 runs of 10 steps on one to eight ranks
TINY_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 6,
    "router_bias_update_rate": 0.01,
}
