"""Registers the `gpt2` model type (entry point `gpt2` in the `nanocore` group)."""

from __future__ import annotations

from nanocore import hookimpl
from nanocore.config.schema import ModelArgs
from nanocore.errors import ConfigError
from nanocore_gpt2.config import GPT2Config
from nanocore_gpt2.model import GPT2LMHeadModel


def build(model_args: ModelArgs, *, vocab_multiple: int = 1) -> GPT2LMHeadModel:
    """Build on the current default device (meta when called by an engine); parameters are not initialised."""
    config = model_args.model_config
    problems = config.problems()
    if problems:
        raise ConfigError([f"model.model_config.{p}" for p in problems])
    init = model_args.init_method
    return GPT2LMHeadModel(
        config,
        init_std=init.std,
        scale_output_init=init.scaling_method == "NUM_LAYERS",
        vocab_multiple=vocab_multiple,
    )


@hookimpl
def register_models(registry):
    registry.register(
        "gpt2",
        build,
        config_class=GPT2Config,
        description="GPT-2 decoder (LayerNorm, learned positions, GELU MLP, biases); from the nanocore-gpt2 package",
    )
