"""Qwen3 and Qwen3-MoE as compositions of the shared parts (`nanocore.model_parts`): the decoder
with qk-norm on, and for Qwen3-MoE the sparse block on the layers its config makes sparse.

Module and parameter names equal transformers' `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` (the
latter with transformers 5's fused experts), so their state dicts load without renaming.
"""

from __future__ import annotations

from nanocore.model_parts.decoder import DecoderLM
from nanocore.model_parts.moe import MoEDecoderLM, MoESpec
from nanocore_plugins.qwen3.config import Qwen3Config, Qwen3MoeConfig


class Qwen3ForCausalLM(DecoderLM):
    """Qwen3 causal LM: `forward(input_ids, kv_cache=None) -> logits[b, s, vocab_size]`."""

    config: Qwen3Config
    qk_norm = True


class Qwen3MoeForCausalLM(MoEDecoderLM):
    """Qwen3-MoE causal LM; lists its sparse layers in `moe_layers`."""

    config: Qwen3MoeConfig
    qk_norm = True

    def sparse_block(self) -> MoESpec:
        return self.config.moe_spec()

    def is_sparse_layer(self, layer_idx: int) -> bool:
        return self.config.is_sparse_layer(layer_idx)
