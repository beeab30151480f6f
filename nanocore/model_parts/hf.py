"""config.json fields LLaMA-family decoders share with Hugging Face transformers, both ways (used by
the `to_hf` / `from_hf` of every model type built on `nanocore.model_parts.decoder`).

config.json is written in the long-standing form (`rope_theta` + `rope_scaling`, `torch_dtype`),
which transformers 4.x reads natively and 5.x converts to `rope_parameters`; both forms are read.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from nanocore.errors import ConfigError
from nanocore.model_parts.config import DecoderConfig

log = logging.getLogger("nanocore")

HEAD = "lm_head.weight"
# Buffers some old transformers versions saved with the weights: recomputed, never needed.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_config_fields(
    config: DecoderConfig, model_type: str, architectures: Sequence[str], same_fields: Sequence[str]
) -> dict[str, Any]:
    """The config.json fields the decoders share: `same_fields` copied one to one, then the ones
    named or computed differently."""
    return {
        "architectures": list(architectures),
        "model_type": model_type,
        **{key: getattr(config, key) for key in same_fields},
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_size,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "rope_theta": config.rope_theta,
        "rope_scaling": dict(config.rope_scaling) if config.rope_scaling else None,
        "attention_dropout": 0.0,
    }


def read_rope(c: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either transformers 4 keys or transformers 5's `rope_parameters`."""
    params = c.get("rope_parameters")
    if isinstance(params, dict):
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        theta = params.get("rope_theta", c["rope_theta"])
    else:
        scaling, theta = dict(c.get("rope_scaling") or {}), c["rope_theta"]
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("config.json: rope partial_rotary_factor != 1 is not supported by nanocore's decoders")
    scaling.pop("partial_rotary_factor", None)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, (scaling if kind != "default" else None)


def read_token_id(c: dict[str, Any], key: str) -> int:
    """nanocore keeps one token id; LLaMA 3.1 lists several end-of-sequence ids (the first is kept)."""
    value = c[key]
    if isinstance(value, list):
        if len(value) > 1:
            log.warning("config.json: %s %s: nanocore keeps the first, %s", key, value, value[0])
        value = value[0] if value else None
    if value is None:
        default = int(attrs.fields_dict(DecoderConfig)[key].default or 0)
        log.warning("config.json: %s is null; nanocore's decoder config needs a number and uses %s", key, default)
        return default
    return int(value)


def read_decoder_fields(c: dict[str, Any], same_fields: Sequence[str]) -> dict[str, Any]:
    """The `DecoderConfig` keyword arguments of config.json values `c` (transformers' defaults filled in)."""
    theta, scaling = read_rope(c)
    fields = {key: c[key] for key in same_fields}
    fields["num_key_value_heads"] = c["num_key_value_heads"]
    fields["bos_token_id"] = read_token_id(c, "bos_token_id")
    fields["eos_token_id"] = read_token_id(c, "eos_token_id")
    fields["rope_theta"] = float(theta)
    fields["rope_scaling"] = scaling
    return fields


def stack_experts(
    state: dict[str, torch.Tensor],
    pattern: re.Pattern[str],
    per_expert_name: str,
    names: tuple[str, str, str],
    fused_prefix: str,
) -> dict[str, torch.Tensor]:
    """Stack per-expert weights (transformers 4's layout) into the fused `experts.gate_up_proj`
    [E, 2I, H] (gate rows, then up rows) and `experts.down_proj` [E, H, I] of transformers 5.

    `pattern` matches a per-expert name with groups (layer prefix, expert id, which weight), which
    `per_expert_name.format(prefix, id, which)` writes back (for errors); `names` are the gate, up and
    down weights' names in it; the fused tensors are written under
    `fused_prefix.format(prefix)`. Other tensors pass through; a missing expert or weight is an error."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in state.items():
        if m := pattern.match(name):
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = tensor
        else:
            out[name] = tensor
    gate, up, down = names
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        missing = [per_expert_name.format(prefix, j, w) for j in ids for w in names if w not in by_expert[j]]
        if ids != list(range(len(ids))) or missing:
            gaps = missing or [f"{prefix}: expert ids {ids} are not 0..{len(ids) - 1}"]
            raise ConfigError([f"weights: missing {', '.join(gaps[:5])}"])
        fused = fused_prefix.format(prefix)
        out[f"{fused}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[j][gate], by_expert[j][up]], dim=0) for j in ids]
        )
        out[f"{fused}.down_proj"] = torch.stack([by_expert[j][down] for j in ids])
    return out
