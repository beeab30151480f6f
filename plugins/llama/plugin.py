"""Registers the `llama` and `mixtral` model types."""

from __future__ import annotations

from nanocore import hookimpl
from nanocore.config.schema import ModelArgs
from nanocore.errors import ConfigError
from nanocore_plugins.llama import hf, mixtral_hf
from nanocore_plugins.llama.config import LlamaConfig, MixtralConfig
from nanocore_plugins.llama.mixtral import MixtralForCausalLM
from nanocore_plugins.llama.model import LlamaForCausalLM


def build(model_args: ModelArgs, *, vocab_multiple: int = 1) -> LlamaForCausalLM:
    """Build on the current default device (meta when called by an engine); parameters are not initialised."""
    return _build(LlamaForCausalLM, model_args, vocab_multiple)


def build_mixtral(model_args: ModelArgs, *, vocab_multiple: int = 1) -> MixtralForCausalLM:
    """Build a Mixtral on the current default device (meta when called by an engine); parameters are not initialised."""
    return _build(MixtralForCausalLM, model_args, vocab_multiple)


def _build(cls, model_args: ModelArgs, vocab_multiple: int):
    config = model_args.model_config
    problems = config.problems()
    if problems:
        raise ConfigError([f"model.model_config.{p}" for p in problems])
    init = model_args.init_method
    return cls(
        config,
        init_std=init.std,
        scale_output_init=init.scaling_method == "NUM_LAYERS",
        vocab_multiple=vocab_multiple,
    )


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
