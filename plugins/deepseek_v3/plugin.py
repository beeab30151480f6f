"""Registers the `deepseek_v3` model type."""

from __future__ import annotations

from nanocore import hookimpl
from nanocore.config.schema import ModelArgs
from nanocore.model_parts.decoder import build_decoder
from nanocore_plugins.deepseek_v3 import hf
from nanocore_plugins.deepseek_v3.config import DeepseekV3Config
from nanocore_plugins.deepseek_v3.model import DeepseekV3ForCausalLM


def build(model_args: ModelArgs, *, vocab_multiple: int = 1) -> DeepseekV3ForCausalLM:
    """Build on the current default device (meta when called by an engine); parameters are not initialised."""
    return build_decoder(DeepseekV3ForCausalLM, model_args, vocab_multiple)


@hookimpl
def register_models(registry):
    registry.register(
        "deepseek_v3",
        build,
        config_class=DeepseekV3Config,
        description="DeepSeek-V3 decoder (multi-head latent attention; sigmoid-scored, group-limited, bias-balanced "
        "experts with shared experts; dense first layers); transformers-compatible weight names",
        hf_architectures=hf.ARCHITECTURES,
        to_hf=hf.to_hf,
        from_hf=hf.from_hf,
    )
