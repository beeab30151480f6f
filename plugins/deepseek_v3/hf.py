"""DeepSeek-V3 <-> Hugging Face transformers' `DeepseekV3ForCausalLM`: the config mapping and the
state dict rules. Parameter names are transformers' (fused experts); `from_hf` also reads the
per-expert names of the checkpoints on the Hub (`mlp.experts.J.gate_proj/up_proj/down_proj.weight`).
Multi-token prediction modules are layers `num_hidden_layers + k` there (transformers does not run
them) and `model.mtp.{k}` here.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from nanocore.errors import ConfigError
from nanocore.model_parts.hf import HEAD, IGNORED_SUFFIXES, hf_config_fields, read_decoder_fields, stack_experts
from nanocore_plugins.deepseek_v3.config import DeepseekV3Config

log = logging.getLogger("nanocore")

ARCHITECTURES = ["DeepseekV3ForCausalLM"]

# transformers' DeepseekV3Config defaults, used for keys a config.json leaves out.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "pad_token_id": None,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "rope_interleave": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
}
NOT_COPIED = ("num_key_value_heads", "bos_token_id", "eos_token_id", "rope_theta")
SAME_FIELDS = [k for k in HF_DEFAULTS if k not in NOT_COPIED]
NANOCORE_KEYS = (
    "router_bias_update_rate",
    "router_aux_loss_coef",
    "router_z_loss_coef",
    "mtp_loss_coef",
)  # kept and ignored there
PER_EXPERT = re.compile(r"^(model\.(?:layers|mtp)\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
MTP_NAME = re.compile(r"^model\.mtp\.(\d+)\.(.+)$")


def to_hf(config: DeepseekV3Config, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """nanocore config + full tensors (true vocabulary, a tied pair once) -> transformers config.json + state dict.
    MTP module k (`model.mtp.{k}.*`) is written as DeepSeek's checkpoints hold it, as layer
    num_hidden_layers + k with its own copies of the embedding and the output head."""
    problems = config.problems()
    if problems:
        raise ConfigError([f"model.model_config.{p}" for p in problems])
    hf_config = hf_config_fields(config, "deepseek_v3", ARCHITECTURES, SAME_FIELDS)
    hf_config["num_key_value_heads"] = config.num_attention_heads
    hf_config["num_nextn_predict_layers"] = config.num_nextn_predict_layers
    hf_config.update({key: getattr(config, key) for key in NANOCORE_KEYS})
    layers = config.num_hidden_layers
    head = state["model.embed_tokens.weight"] if config.tie_word_embeddings else state[HEAD]
    hf_state: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == HEAD and config.tie_word_embeddings:
            continue
        if m := MTP_NAME.match(name):
            name = f"model.layers.{layers + int(m[1])}.{m[2]}"
        hf_state[name] = tensor
    for k in range(config.num_nextn_predict_layers):
        # copies of their own, as DeepSeek's files hold them (safetensors refuses shared storage)
        hf_state[f"model.layers.{layers + k}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        hf_state[f"model.layers.{layers + k}.shared_head.head.weight"] = head.clone()
    return hf_config, hf_state


def from_hf(
    hf_config: dict[str, Any], hf_state: dict[str, torch.Tensor]
) -> tuple[DeepseekV3Config, dict[str, torch.Tensor]]:
    """transformers config.json + state dict (fused or per-expert names) -> `DeepseekV3Config` + tensors.
    Layers after the last (DeepSeek's MTP modules) become `model.mtp.{k}`; their embedding and head
    copies are dropped (nanocore ties them to the model's own)."""
    nullable = ("bos_token_id", "eos_token_id", "pad_token_id", "q_lora_rank")
    c = {**HF_DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None or k in nullable}}
    fields = read_decoder_fields(c, SAME_FIELDS)
    fields.pop("num_key_value_heads")
    fields.update({key: c[key] for key in NANOCORE_KEYS if key in c})
    layers = int(c["num_hidden_layers"])
    fields["num_nextn_predict_layers"] = int(c.get("num_nextn_predict_layers") or 0)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if (m := LAYER_NAME.match(name)) and int(m[1]) >= layers:
            k, rest = int(m[1]) - layers, m[2]
            if rest in ("embed_tokens.weight", "shared_head.head.weight"):
                continue  # copies of the model's embedding and head, which MTP shares
            name = f"model.mtp.{k}.{rest}"
        state[name] = tensor
    config = DeepseekV3Config(**fields)
    problems = config.problems()
    if problems:
        raise ConfigError([f"config.json: {p}" for p in problems])
    if config.tie_word_embeddings:
        state.pop(HEAD, None)
    return config, stack_experts(
        state, PER_EXPERT, "{}.experts.{}.{}.weight", ("gate_proj", "up_proj", "down_proj"), "{}.experts"
    )
