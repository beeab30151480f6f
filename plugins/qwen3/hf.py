"""Qwen3 / Qwen3-MoE <-> Hugging Face transformers' `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`:
the config mapping and the state dict rules. Parameter names are transformers' already (the experts
in transformers 5's fused layout); `from_hf` also reads the per-expert names of the checkpoints on
the Hub (`mlp.experts.J.gate_proj/up_proj/down_proj.weight`). A tied head is saved once, under the
embedding's name, as transformers does.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import attrs
import torch

from nanocore.errors import ConfigError
from nanocore.model_parts.hf import HEAD, IGNORED_SUFFIXES, hf_config_fields, read_decoder_fields, stack_experts
from nanocore_plugins.qwen3.config import Qwen3Config, Qwen3MoeConfig

log = logging.getLogger("nanocore")

ARCHITECTURES = ["Qwen3ForCausalLM"]
MOE_ARCHITECTURES = ["Qwen3MoeForCausalLM"]

# transformers' Qwen3Config defaults, used for keys a config.json leaves out.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "attention_dropout": 0.0,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
MOE_HF_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in HF_DEFAULTS.items() if k != "max_window_layers"},  # Qwen3-MoE has none
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_key_value_heads": 4,
    "head_dim": None,  # transformers' Qwen3-MoE: hidden_size / num_attention_heads unless set
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "norm_topk_prob": False,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "mlp_only_layers": [],
}
NOT_COPIED = ("num_key_value_heads", "bos_token_id", "eos_token_id", "rope_theta", "head_dim")
SAME_FIELDS = [k for k in HF_DEFAULTS if k not in NOT_COPIED]
MOE_SAME_FIELDS = [k for k in MOE_HF_DEFAULTS if k not in NOT_COPIED]
Z_LOSS_KEY = "router_z_loss_coef"  # nanocore's, kept by transformers as an unknown attribute
PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _to_hf(config: Qwen3Config, model_type: str, architectures: list[str], same_fields: list[str], state):
    problems = config.problems()
    if problems:
        raise ConfigError([f"model.model_config.{p}" for p in problems])
    hf_config = hf_config_fields(config, model_type, architectures, same_fields)
    if config.layer_types is not None:
        hf_config["layer_types"] = list(config.layer_types)
    hf_state = {name: t for name, t in state.items() if not (name == HEAD and config.tie_word_embeddings)}
    return hf_config, hf_state


def to_hf(config: Qwen3Config, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """nanocore config + full tensors (true vocabulary, a tied pair once) -> transformers config.json + state dict."""
    return _to_hf(config, "qwen3", ARCHITECTURES, SAME_FIELDS, state)


def to_hf_moe(config: Qwen3MoeConfig, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """As `to_hf`, for Qwen3-MoE (the z-loss coefficient travels as an extra key transformers ignores)."""
    hf_config, hf_state = _to_hf(config, "qwen3_moe", MOE_ARCHITECTURES, MOE_SAME_FIELDS, state)
    hf_config["mlp_only_layers"] = list(config.mlp_only_layers)
    if config.router_z_loss_coef:
        hf_config[Z_LOSS_KEY] = config.router_z_loss_coef
    return hf_config, hf_state


def _read(hf_config: dict[str, Any], defaults: dict[str, Any], same_fields: list[str]) -> dict[str, Any]:
    nullable = ("bos_token_id", "eos_token_id", "sliding_window", "pad_token_id", "head_dim")
    c = {**defaults, **{k: v for k, v in hf_config.items() if v is not None or k in nullable}}
    fields = read_decoder_fields(c, same_fields)
    fields["head_dim"] = c.get("head_dim")
    fields["layer_types"] = c.get("layer_types")
    return fields


def _default_layer_types(config: Qwen3Config) -> Qwen3Config:
    """transformers writes `layer_types` out even where it is its default pattern: kept null then, so
    that the config reads as a user would write it."""
    if config.layer_types is None:
        return config
    default = attrs.evolve(config, layer_types=None)
    return default if default.attention_layer_types == config.attention_layer_types else config


def _state(hf_state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    state = {k: v for k, v in hf_state.items() if not k.endswith(IGNORED_SUFFIXES)}
    if tied:
        state.pop(HEAD, None)  # one tensor for the tied pair, under the embedding's name
    return state


def from_hf(
    hf_config: dict[str, Any], hf_state: dict[str, torch.Tensor]
) -> tuple[Qwen3Config, dict[str, torch.Tensor]]:
    """transformers config.json + state dict -> `Qwen3Config` + the tensors `named_parameters()` lists."""
    config = _default_layer_types(Qwen3Config(**_read(hf_config, HF_DEFAULTS, SAME_FIELDS)))
    problems = config.problems()
    if problems:
        raise ConfigError([f"config.json: {p}" for p in problems])
    return config, _state(hf_state, config.tie_word_embeddings)


def from_hf_moe(
    hf_config: dict[str, Any], hf_state: dict[str, torch.Tensor]
) -> tuple[Qwen3MoeConfig, dict[str, torch.Tensor]]:
    """transformers config.json + state dict (fused or per-expert names) -> `Qwen3MoeConfig` + tensors."""
    if "num_local_experts" in hf_config:  # transformers 5 writes num_experts under this name
        hf_config = {**hf_config, "num_experts": hf_config["num_local_experts"]}
    fields = _read(hf_config, MOE_HF_DEFAULTS, MOE_SAME_FIELDS)
    fields["mlp_only_layers"] = list(fields["mlp_only_layers"] or [])
    fields[Z_LOSS_KEY] = float(hf_config.get(Z_LOSS_KEY) or 0.0)
    config = _default_layer_types(Qwen3MoeConfig(**fields))
    problems = config.problems()
    if problems:
        raise ConfigError([f"config.json: {p}" for p in problems])
    return config, fuse_per_expert(_state(hf_state, config.tie_word_embeddings))


def fuse_per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stack `mlp.experts.J.gate_proj/up_proj/down_proj.weight` (transformers 4's names) into
    `mlp.experts.gate_up_proj` (gate rows, then up rows) and `mlp.experts.down_proj`."""
    return stack_experts(
        state, PER_EXPERT, "{}.experts.{}.{}.weight", ("gate_proj", "up_proj", "down_proj"), "{}.experts"
    )
