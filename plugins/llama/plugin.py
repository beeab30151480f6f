"""Registers the `llama` and `mixtral` model types."""

from __future__ import annotations

from nanocore import hookimpl
from nanocore.config.schema import ModelArgs
from nanocore.model_parts.decoder import build_decoder
from nanocore_plugins.llama import hf, mixtral_hf
from nanocore_plugins.llama.config import LlamaConfig, MixtralConfig
from nanocore_plugins.llama.mixtral import MixtralForCausalLM
from nanocore_plugins.llama.model import LlamaForCausalLM


def build(model_args: ModelArgs, *, vocab_multiple: int = 1) -> LlamaForCausalLM:
    """Build on the current default device (meta when called by an engine); parameters are not initialised."""
    return build_decoder(LlamaForCausalLM, model_args, vocab_multiple)


def build_mixtral(model_args: ModelArgs, *, vocab_multiple: int = 1) -> MixtralForCausalLM:
    """Build a Mixtral on the current default device (meta when called by an engine); parameters are not initialised."""
    return build_decoder(MixtralForCausalLM, model_args, vocab_multiple)


@hookimpl
def register_models(registry):
    registry.register(
        "llama",
        build,
        config_class=LlamaConfig,
        description="LLaMA 1/2/3 decoder (RMSNorm, RoPE, GQA, SwiGLU); transformers-compatible weight names",
        hf_architectures=hf.ARCHITECTURES,
        to_hf=hf.to_hf,
        from_hf=hf.from_hf,
        from_hf_selects_only=True,  # from_hf renames and drops tensors, never computes: they can be read lazily
    )
    registry.register(
        "mixtral",
        build_mixtral,
        config_class=MixtralConfig,
        description="Mixtral sparse mixture of experts on the LLaMA decoder (top-k router; optional shared "
        "experts, sigmoid bias-balanced routing, z-loss); transformers-compatible weight names",
        hf_architectures=mixtral_hf.ARCHITECTURES,
        to_hf=mixtral_hf.to_hf,
        from_hf=mixtral_hf.from_hf,
    )
