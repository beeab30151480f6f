"""LLaMA as a single-device causal LM that follows `nanocore.model_api`: the shared decoder
(`nanocore.model_parts.decoder.DecoderLM`) as it stands.

Module and parameter names equal Hugging Face transformers' `LlamaForCausalLM`, so its state dict
loads without renaming. There are no buffers: the engine materialises models from the meta device
and only knows parameters, so rotary tables are computed from the config on first use.
"""

from __future__ import annotations

from nanocore.model_parts.decoder import DecoderLM
from nanocore_plugins.llama.config import LlamaConfig


class LlamaForCausalLM(DecoderLM):
    """LLaMA causal LM: `forward(input_ids, kv_cache=None) -> logits[b, s, vocab_size]`."""

    config: LlamaConfig
