"""LLaMA <-> Hugging Face transformers' `LlamaForCausalLM`: the config mapping and the state dict rules.

Parameter names already equal transformers' (see model.py), so the state dict passes through; what
changes is (1) the config and (2) the tied head: transformers saves no `lm_head.weight` when
`tie_word_embeddings` is set, and nanocore lists a tied pair once, under the embedding's name. The
vocabulary padding nanocore adds for tensor parallelism is a property of a layout: checkpoints hold
the true vocabulary (`vocab_parameters` in model.py), so nothing is dropped or added here.

The config.json fields every decoder shares are read and written by `nanocore.model_parts.hf`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from nanocore.errors import ConfigError
from nanocore.model_parts.hf import HEAD, IGNORED_SUFFIXES, hf_config_fields, read_decoder_fields
from nanocore_plugins.llama.config import LlamaConfig

log = logging.getLogger("nanocore")

ARCHITECTURES = ["LlamaForCausalLM"]

# transformers' LlamaConfig defaults, used for keys a config.json leaves out.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "head_dim": None,  # hidden_size / num_attention_heads
}
# Copied one to one between config.json and LlamaConfig.
SAME_FIELDS = [k for k in HF_DEFAULTS if k not in ("num_key_value_heads", "bos_token_id", "eos_token_id", "rope_theta")]


def to_hf(config: LlamaConfig, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """nanocore config + full tensors (true vocabulary, as `nanocore.hf_interop.checkpoint_state` reads
    them) -> transformers config.json + state dict."""
    problems = config.problems()
    if problems:
        raise ConfigError([f"model.model_config.{p}" for p in problems])
    hf_config = hf_config_fields(config, "llama", ARCHITECTURES, SAME_FIELDS)
    hf_config["mlp_bias"] = False
    hf_state: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == HEAD and config.tie_word_embeddings:
            continue  # transformers re-ties lm_head to the embedding on load
        hf_state[name] = tensor
    return hf_config, hf_state


def from_hf(
    hf_config: dict[str, Any], hf_state: dict[str, torch.Tensor]
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """transformers config.json + state dict -> nanocore `LlamaConfig` + the tensors `named_parameters()` lists."""
    # A null means transformers' default, except for token ids, where it means "none".
    nullable = ("bos_token_id", "eos_token_id")
    c = {**HF_DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None or k in nullable}}
    problems = _unsupported(c)
    fields = read_decoder_fields(c, SAME_FIELDS)
    if fields["head_dim"] is not None and fields["head_dim"] * c["num_attention_heads"] == c["hidden_size"]:
        fields["head_dim"] = None  # the derived size, written out by transformers: null, as nanocore writes it
    config = LlamaConfig(**fields)
    if not problems:
        problems = config.problems()
    if problems:
        raise ConfigError([f"config.json: {p}" for p in problems])
    state = {k: v for k, v in hf_state.items() if not k.endswith(IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        state.pop(HEAD, None)  # one tensor for the tied pair, under the embedding's name
    return config, state


def _unsupported(c: dict[str, Any]) -> list[str]:
    """config.json settings that change what the model computes and that nanocore's LLaMA lacks."""
    p = []
    if c.get("mlp_bias"):
        p.append("mlp_bias: true is not supported (nanocore's LLaMA MLP has no biases)")
    if c.get("attention_dropout"):
        log.warning("config.json: attention_dropout %s is ignored (nanocore has no dropout)", c["attention_dropout"])
    return p
