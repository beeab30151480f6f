"""gpt-oss <-> Hugging Face transformers' `GptOssForCausalLM`: the config mapping and the state dict
rules. The router is renamed (`mlp.router.` <-> `mlp.gate.`) and the experts converted between
transformers' layout and nanocore's (`nanocore.model_parts.moe.gpt_oss_experts_from_hf`); both
directions are bit-exact. The original openai checkpoints store MXFP4 expert blocks, which must be
dequantised (transformers does on load) before nanocore reads them.
"""

from __future__ import annotations

from typing import Any

import torch

from nanocore.errors import ConfigError
from nanocore.model_parts.hf import HEAD, IGNORED_SUFFIXES, hf_config_fields, read_decoder_fields
from nanocore.model_parts.moe import gpt_oss_experts_from_hf, gpt_oss_experts_to_hf
from nanocore_plugins.gpt_oss.config import YARN_DEFAULT, GptOssConfig, default_layer_types

ARCHITECTURES = ["GptOssForCausalLM"]

# transformers' GptOssConfig defaults, used for keys a config.json leaves out.
HF_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "rope_scaling": dict(YARN_DEFAULT),
    "attention_dropout": 0.0,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "use_cache": True,
    "layer_types": None,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
    "attention_bias": True,
}
NOT_COPIED = ("num_key_value_heads", "bos_token_id", "eos_token_id", "rope_theta", "rope_scaling", "head_dim")
SAME_FIELDS = [k for k in HF_DEFAULTS if k not in (*NOT_COPIED, "layer_types")]
Z_LOSS_KEY = "router_z_loss_coef"  # nanocore's, kept by transformers as an unknown attribute


def to_hf(config: GptOssConfig, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """nanocore config + full tensors (true vocabulary, a tied pair once) -> transformers config.json + state dict."""
    problems = config.problems()
    if problems:
        raise ConfigError([f"model.model_config.{p}" for p in problems])
    hf_config = hf_config_fields(config, "gpt_oss", ARCHITECTURES, SAME_FIELDS)
    hf_config["layer_types"] = config.attention_layer_types
    if config.router_z_loss_coef:
        hf_config[Z_LOSS_KEY] = config.router_z_loss_coef
    renamed = {name.replace(".mlp.gate.", ".mlp.router.", 1): t for name, t in state.items()}
    hf_state = {
        n: t for n, t in gpt_oss_experts_to_hf(renamed).items() if not (n == HEAD and config.tie_word_embeddings)
    }
    return hf_config, hf_state


def from_hf(
    hf_config: dict[str, Any], hf_state: dict[str, torch.Tensor]
) -> tuple[GptOssConfig, dict[str, torch.Tensor]]:
    """transformers config.json + state dict -> `GptOssConfig` + the tensors `named_parameters()` lists."""
    nullable = ("bos_token_id", "eos_token_id", "pad_token_id", "layer_types")
    c = {**HF_DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None or k in nullable}}
    if "rope_parameters" not in hf_config and "rope_scaling" not in hf_config:
        c["rope_parameters"] = {**YARN_DEFAULT, "rope_theta": c["rope_theta"]}
    fields = read_decoder_fields(c, SAME_FIELDS)
    fields["head_dim"] = c.get("head_dim")
    layer_types = c.get("layer_types")
    fields["layer_types"] = None if layer_types == default_layer_types(c["num_hidden_layers"]) else layer_types
    fields[Z_LOSS_KEY] = float(hf_config.get(Z_LOSS_KEY) or 0.0)
    config = GptOssConfig(**fields)
    problems = config.problems()
    if problems:
        raise ConfigError([f"config.json: {p}" for p in problems])
    state = {
        k.replace(".mlp.router.", ".mlp.gate.", 1): v for k, v in hf_state.items() if not k.endswith(IGNORED_SUFFIXES)
    }
    state = gpt_oss_experts_from_hf(state)
    if config.tie_word_embeddings:
        state.pop(HEAD, None)  # one tensor for the tied pair, under the embedding's name
    return config, state
