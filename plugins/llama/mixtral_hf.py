"""Mixtral <-> Hugging Face transformers' `MixtralForCausalLM`: the config mapping and the state dict rules.

nanocore's names are transformers 5's (fused experts: `mlp.experts.gate_up_proj` [E, 2I, H], gate
rows first, and `mlp.experts.down_proj` [E, H, I]), which `to_hf` writes as they are. `from_hf` also
reads the per-expert names of the checkpoints on the Hub (transformers 4):
`model.layers.N.block_sparse_moe.gate.weight` and `block_sparse_moe.experts.J.w1/w3/w2.weight`
(gate [I, H], up [I, H], down [H, I]). As for LLaMA, a tied head is saved once, under the embedding.

Options beyond Mixtral (shared experts, sigmoid routing) and LLaMA's attention biases have no
transformers Mixtral equivalent: `to_hf` refuses them by name. The router z-loss coefficient only
shapes training; it travels in config.json as an extra key transformers keeps and ignores.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from nanocore.errors import ConfigError
from nanocore.model_parts.hf import HEAD, IGNORED_SUFFIXES, hf_config_fields, read_decoder_fields, stack_experts
from nanocore_plugins.llama.config import MixtralConfig

log = logging.getLogger("nanocore")

ARCHITECTURES = ["MixtralForCausalLM"]

# transformers' MixtralConfig defaults, used for keys a config.json leaves out.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "use_cache": True,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "rope_theta": 1e6,
    "sliding_window": None,
    "num_experts_per_tok": 2,
    "num_local_experts": 8,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}
# Copied one to one between config.json and MixtralConfig.
SAME_FIELDS = [k for k in HF_DEFAULTS if k not in ("num_key_value_heads", "bos_token_id", "eos_token_id", "rope_theta")]
Z_LOSS_KEY = "router_z_loss_coef"  # nanocore's, kept by transformers as an unknown attribute

CLASSIC_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
CLASSIC_GATE = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")


def to_hf(config: MixtralConfig, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """nanocore config + full tensors (true vocabulary, a tied pair once) -> transformers config.json + state dict."""
    problems = config.problems()
    if config.num_shared_experts:
        problems.append(
            f"num_shared_experts: {config.num_shared_experts} shared experts have no equivalent in transformers' "
            "MixtralForCausalLM; only num_shared_experts: 0 converts"
        )
    if config.scoring_func != "softmax":
        problems.append(
            f"scoring_func: {config.scoring_func} routing has no equivalent in transformers' MixtralForCausalLM "
            "(softmax only)"
        )
    if config.attention_bias:
        problems.append("attention_bias: transformers' MixtralForCausalLM has no attention biases")
    if problems:
        raise ConfigError([f"model.model_config.{p}" for p in problems])
    hf_config = hf_config_fields(config, "mixtral", ARCHITECTURES, SAME_FIELDS)
    hf_config["router_jitter_noise"] = 0.0
    if config.router_z_loss_coef:
        hf_config[Z_LOSS_KEY] = config.router_z_loss_coef
    hf_state = {name: t for name, t in state.items() if not (name == HEAD and config.tie_word_embeddings)}
    return hf_config, hf_state


def from_hf(
    hf_config: dict[str, Any], hf_state: dict[str, torch.Tensor]
) -> tuple[MixtralConfig, dict[str, torch.Tensor]]:
    """transformers config.json + state dict (fused or per-expert names) -> `MixtralConfig` + the
    tensors `named_parameters()` lists."""
    nullable = ("bos_token_id", "eos_token_id", "sliding_window", "pad_token_id")
    c = {**HF_DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None or k in nullable}}
    problems = _unsupported(c)
    fields = read_decoder_fields(c, SAME_FIELDS)
    fields[Z_LOSS_KEY] = float(c.get(Z_LOSS_KEY) or 0.0)
    config = MixtralConfig(**fields)
    if not problems:
        problems = config.problems()
    if problems:
        raise ConfigError([f"config.json: {p}" for p in problems])
    state = fuse_classic_experts({k: v for k, v in hf_state.items() if not k.endswith(IGNORED_SUFFIXES)})
    if config.tie_word_embeddings:
        state.pop(HEAD, None)
    return config, state


def fuse_classic_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename `block_sparse_moe.gate` to `mlp.gate` and stack `block_sparse_moe.experts.J.w1/w3/w2`
    into `mlp.experts.gate_up_proj` (w1 rows, then w3 rows) and `mlp.experts.down_proj` (w2)."""
    renamed = {}
    for name, tensor in state.items():
        m = CLASSIC_GATE.match(name)
        renamed[f"{m[1]}.mlp.gate.weight" if m else name] = tensor
    return stack_experts(
        renamed, CLASSIC_EXPERT, "{}.block_sparse_moe.experts.{}.{}.weight", ("w1", "w3", "w2"), "{}.mlp.experts"
    )


def _unsupported(c: dict[str, Any]) -> list[str]:
    """config.json settings that change what the model computes and that nanocore's Mixtral lacks."""
    p = []
    head_dim = c.get("head_dim")
    if head_dim is not None and head_dim * c["num_attention_heads"] != c["hidden_size"]:
        p.append(
            f"head_dim: {head_dim} x num_attention_heads {c['num_attention_heads']} != hidden_size {c['hidden_size']}; "
            "nanocore's Mixtral needs head_dim = hidden_size / num_attention_heads"
        )
    if c.get("attention_dropout"):
        log.warning("config.json: attention_dropout %s is ignored (nanocore has no dropout)", c["attention_dropout"])
    if c.get("router_jitter_noise"):
        # Training-time noise only: the converted weights compute the same; training continues without it.
        log.warning("config.json: router_jitter_noise %s is dropped (nanocore has no jitter)", c["router_jitter_noise"])
    return p
