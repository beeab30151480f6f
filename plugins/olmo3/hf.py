"""OLMo 3 <-> Hugging Face transformers' `Olmo3ForCausalLM`: the config mapping and the state dict
rules. Parameter names are transformers' already. transformers 5 writes RoPE as `rope_parameters`
keyed by layer type (`full_attention`, `sliding_attention`); nanocore keeps one `rope_theta` and the
full layers' `rope_scaling`, and refuses a config.json whose windowed layers scale RoPE or whose two
layer types use different thetas (OLMo 3's checkpoints do neither).
"""

from __future__ import annotations

from typing import Any

import torch

from nanocore.errors import ConfigError
from nanocore.model_parts.hf import HEAD, IGNORED_SUFFIXES, hf_config_fields, read_decoder_fields, read_rope
from nanocore_plugins.olmo3.config import Olmo3Config, default_layer_types

ARCHITECTURES = ["Olmo3ForCausalLM"]

# transformers' Olmo3Config defaults, used for keys a config.json leaves out.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50304,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "use_cache": True,
    "pad_token_id": 1,
    "bos_token_id": None,
    "eos_token_id": 50279,
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rms_norm_eps": 1e-5,
    "sliding_window": 4096,
    "layer_types": None,
}
NOT_COPIED = ("num_key_value_heads", "bos_token_id", "eos_token_id", "rope_theta", "head_dim", "layer_types")
SAME_FIELDS = [k for k in HF_DEFAULTS if k not in NOT_COPIED]


def to_hf(config: Olmo3Config, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """nanocore config + full tensors (true vocabulary, a tied pair once) -> transformers config.json + state dict."""
    problems = config.problems()
    if problems:
        raise ConfigError([f"model.model_config.{p}" for p in problems])
    hf_config = hf_config_fields(config, "olmo3", ARCHITECTURES, SAME_FIELDS)
    hf_config["layer_types"] = config.attention_layer_types
    hf_state = {name: t for name, t in state.items() if not (name == HEAD and config.tie_word_embeddings)}
    return hf_config, hf_state


def _read_rope(c: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's per-layer-type `rope_parameters` -> the one-theta form `read_decoder_fields` reads."""
    params = c.get("rope_parameters")
    if not (isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params)):
        return c
    full = read_rope({"rope_parameters": params.get("full_attention") or {}, "rope_theta": c["rope_theta"]})
    sliding = read_rope({"rope_parameters": params.get("sliding_attention") or {}, "rope_theta": c["rope_theta"]})
    if sliding[1] is not None:
        raise ConfigError(
            "config.json: rope_parameters.sliding_attention: scaled RoPE on windowed layers is not supported"
        )
    if full[0] != sliding[0]:
        raise ConfigError(
            f"config.json: rope_parameters: full layers use rope_theta {full[0]}, windowed ones {sliding[0]}; "
            "nanocore's OLMo 3 has one rope_theta"
        )
    out = {k: v for k, v in c.items() if k != "rope_parameters"}
    out["rope_theta"], out["rope_scaling"] = full[0], full[1]
    return out


def from_hf(
    hf_config: dict[str, Any], hf_state: dict[str, torch.Tensor]
) -> tuple[Olmo3Config, dict[str, torch.Tensor]]:
    """transformers config.json + state dict -> `Olmo3Config` + the tensors `named_parameters()` lists."""
    nullable = ("bos_token_id", "eos_token_id", "pad_token_id", "head_dim", "num_key_value_heads", "layer_types")
    c = {**HF_DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None or k in nullable}}
    if c.get("num_key_value_heads") is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    fields = read_decoder_fields(_read_rope(c), SAME_FIELDS)
    head_dim = c.get("head_dim")
    if head_dim is not None and head_dim * c["num_attention_heads"] == c["hidden_size"]:
        head_dim = None  # the derived size: null, as nanocore writes it
    fields["head_dim"] = head_dim
    layer_types = c.get("layer_types")
    # The default pattern stays null, so the config round-trips as a user would write it.
    fields["layer_types"] = None if layer_types == default_layer_types(c["num_hidden_layers"]) else layer_types
    config = Olmo3Config(**fields)
    problems = config.problems()
    if problems:
        raise ConfigError([f"config.json: {p}" for p in problems])
    state = {k: v for k, v in hf_state.items() if not k.endswith(IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        state.pop(HEAD, None)  # one tensor for the tied pair, under the embedding's name
    return config, state
