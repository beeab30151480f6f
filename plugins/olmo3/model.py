"""OLMo 3 as a composition of the shared parts (`nanocore.model_parts`): post-norm decoder layers,
qk-norm over the whole projections, and the window `layer_types` gives each layer.

Module and parameter names equal transformers' `Olmo3ForCausalLM`, so its state dict loads without
renaming (`model.layers.N.self_attn.q_norm.weight` is [heads * head_dim], and each layer has
`post_attention_layernorm` and `post_feedforward_layernorm`, no `input_layernorm`).
"""

from __future__ import annotations

from torch import nn

from nanocore.model_api import TPStyle
from nanocore.model_parts.attention import GroupedQueryAttention, SequenceSlot
from nanocore.model_parts.decoder import DecoderLM, PostNormDecoderLayer
from nanocore.model_parts.layers import ScaleInFloat32RMSNorm
from nanocore.model_parts.rotary import Rotary
from nanocore_plugins.olmo3.config import Olmo3Config


class Olmo3ForCausalLM(DecoderLM):
    """OLMo 3 causal LM: `forward(input_ids, kv_cache=None) -> logits[b, s, vocab_size]`."""

    config: Olmo3Config
    qk_norm = True  # over the whole projections (see make_attention)

    def __init__(self, config: Olmo3Config, **kwargs):
        super().__init__(config, **kwargs)
        self.model.norm = ScaleInFloat32RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_layer(self, layer_idx: int, self_attn: nn.Module, mlp: nn.Module) -> nn.Module:
        c = self.config
        return PostNormDecoderLayer(self_attn, mlp, lambda: ScaleInFloat32RMSNorm(c.hidden_size, c.rms_norm_eps))

    def make_attention(self, layer_idx: int, rotary: Rotary, sequence: SequenceSlot) -> nn.Module:
        c = self.config
        scaling = c.layer_rope_scaling(layer_idx)
        if scaling != c.rope_scaling:  # a windowed layer of a model whose full layers scale RoPE
            if not hasattr(self, "_plain_rotary"):
                self._plain_rotary = Rotary(c.head_size, c.rope_theta, None, c.max_position_embeddings)
            rotary = self._plain_rotary
        return GroupedQueryAttention(
            c.hidden_size,
            c.num_attention_heads,
            c.kv_heads,
            c.head_size,
            bias=c.attention_bias,
            layer_idx=layer_idx,
            rotary=rotary,
            sequence=sequence,
            qk_norm_eps=c.rms_norm_eps,
            qk_norm_width="all",
            norm_class=ScaleInFloat32RMSNorm,
            window=c.attention_window(layer_idx),
        )

    def attention_tp_plan(self, prefix: str) -> dict[str, TPStyle]:
        """Heads split over TP ranks, like LLaMA's; the config refuses tp > 1 until the norms over the
        whole projections are split too (no `head_norm`: these norms are not one weight per head)."""
        d = self.config.head_size
        return {
            f"{prefix}.q_proj": "colwise",
            f"{prefix}.k_proj": {"style": "colwise_kv", "head_dim": d},
            f"{prefix}.v_proj": {"style": "colwise_kv", "head_dim": d},
            f"{prefix}.o_proj": "rowwise",
        }
