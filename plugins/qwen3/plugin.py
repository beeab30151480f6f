"""Registers the `qwen3` and `qwen3_moe` model types."""

from __future__ import annotations

from nanocore import hookimpl
from nanocore.config.schema import ModelArgs
from nanocore.model_parts.decoder import build_decoder
from nanocore_plugins.qwen3 import hf
from nanocore_plugins.qwen3.config import Qwen3Config, Qwen3MoeConfig
from nanocore_plugins.qwen3.model import Qwen3ForCausalLM, Qwen3MoeForCausalLM


def build(model_args: ModelArgs, *, vocab_multiple: int = 1) -> Qwen3ForCausalLM:
    """Build on the current default device (meta when called by an engine); parameters are not initialised."""
    return build_decoder(Qwen3ForCausalLM, model_args, vocab_multiple)


def build_moe(model_args: ModelArgs, *, vocab_multiple: int = 1) -> Qwen3MoeForCausalLM:
    """Build a Qwen3-MoE on the current default device; parameters are not initialised."""
    return build_decoder(Qwen3MoeForCausalLM, model_args, vocab_multiple)


@hookimpl
def register_models(registry):
    registry.register(
        "qwen3",
        build,
        config_class=Qwen3Config,
        description="Qwen3 decoder (LLaMA's, with RMSNorm on each query and key head, head_dim its own); "
        "transformers-compatible weight names",
        hf_architectures=hf.ARCHITECTURES,
        to_hf=hf.to_hf,
        from_hf=hf.from_hf,
        from_hf_selects_only=True,  # from_hf renames and drops tensors, never computes: they can be read lazily
    )
    registry.register(
        "qwen3_moe",
        build_moe,
        config_class=Qwen3MoeConfig,
        description="Qwen3-MoE: Qwen3's attention, fine-grained softmax-routed experts (dense layers where "
        "mlp_only_layers / decoder_sparse_step say); transformers-compatible weight names",
        hf_architectures=hf.MOE_ARCHITECTURES,
        to_hf=hf.to_hf_moe,
        from_hf=hf.from_hf_moe,
    )
