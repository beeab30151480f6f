"""Mixtral: LLaMA whose MLPs are sparse mixtures of SwiGLU experts, following `nanocore.moe_api`:
the shared decoder with every layer's MLP a `nanocore.model_parts.moe.SparseMoeBlock` (whose
docstring defines the auxiliary losses and the parameter names, transformers 5's).
"""

from __future__ import annotations

from nanocore.model_parts.moe import EXPERT_PARAMETERS, MoEDecoderLM, MoESpec, SparseMoeBlock
from nanocore_plugins.llama.config import MixtralConfig

# the names Mixtral's parts had before they became shared parts
MixtralSparseMoeBlock = SparseMoeBlock
__all__ = ["EXPERT_PARAMETERS", "MixtralForCausalLM", "MixtralSparseMoeBlock"]


class MixtralForCausalLM(MoEDecoderLM):
    """Mixtral causal LM: `forward(input_ids, kv_cache=None) -> logits[b, s, vocab_size]`; lists its
    MoE layers in `moe_layers`."""

    config: MixtralConfig

    def sparse_block(self) -> MoESpec:
        return self.config.moe_spec()
