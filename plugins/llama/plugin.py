"""Registers the `llama` model type."""

from __future__ import annotations

from nanocore import hookimpl
from nanocore.config.schema import ModelArgs
from nanocore.errors import ConfigError
from nanocore_plugins.llama import hf
from nanocore_plugins.llama.config import LlamaConfig
from nanocore_plugins.llama.model import LlamaForCausalLM


def build(model_args: ModelArgs, *, vocab_multiple: int = 1) -> LlamaForCausalLM:
    """Build on the current default device (meta when called by an engine); parameters are not initialised."""
    config = model_args.model_config
    problems = config.problems()
    if problems:
        raise ConfigError([f"model.model_config.{p}" for p in problems])
    init = model_args.init_method
    return LlamaForCausalLM(
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
    )
