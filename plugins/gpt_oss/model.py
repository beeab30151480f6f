"""gpt-oss as a composition of the shared parts (`nanocore.model_parts`): grouped-query attention
with biases, per-head sinks and the window `layer_types` gives each layer, and the sparse block in
every layer (`nanocore.model_parts.moe`: gpt-oss's routing, expert biases, clamped SwiGLU).

Names are transformers' `GptOssForCausalLM`'s except in the MLP, where nanocore's shared MoE block
names the router `mlp.gate` (transformers: `mlp.router`) and keeps the experts as [E, 2I, H] with
the gate rows first (transformers: [E, H, 2I], gate and up columns interleaved); `hf.py` converts.
"""

from __future__ import annotations

import torch
from torch import nn

from nanocore.model_api import init_normal
from nanocore.model_parts.attention import GroupedQueryAttention, SequenceSlot
from nanocore.model_parts.decoder import DecoderLayer
from nanocore.model_parts.layers import ScaleInFloat32RMSNorm
from nanocore.model_parts.moe import MoEDecoderLM, MoESpec
from nanocore.model_parts.rotary import Rotary
from nanocore_plugins.gpt_oss.config import GptOssConfig


class GptOssForCausalLM(MoEDecoderLM):
    """gpt-oss causal LM: `forward(input_ids, kv_cache=None) -> logits[b, s, vocab_size]`."""

    config: GptOssConfig

    def __init__(self, config: GptOssConfig, **kwargs):
        super().__init__(config, **kwargs)
        self.model.norm = ScaleInFloat32RMSNorm(config.hidden_size, config.rms_norm_eps)

    def sparse_block(self) -> MoESpec:
        return self.config.moe_spec()

    def make_layer(self, layer_idx: int, self_attn: nn.Module, mlp: nn.Module) -> nn.Module:
        c = self.config
        return DecoderLayer(self_attn, mlp, c.hidden_size, c.rms_norm_eps, norm_class=ScaleInFloat32RMSNorm)

    def make_attention(self, layer_idx: int, rotary: Rotary, sequence: SequenceSlot) -> nn.Module:
        c = self.config
        return GroupedQueryAttention(
            c.hidden_size,
            c.num_attention_heads,
            c.kv_heads,
            c.head_size,
            bias=c.attention_bias,
            layer_idx=layer_idx,
            rotary=rotary,
            sequence=sequence,
            window=c.attention_window(layer_idx),
            sinks=True,
        )

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """The MoE decoder's rules, plus transformers' for gpt-oss: sinks and the router bias normal(0, std)."""
        if name.endswith((".self_attn.sinks", ".mlp.gate.bias")):
            init_normal(tensor, self.init_std, generator)
            return
        super().init_parameter(name, tensor, generator)
