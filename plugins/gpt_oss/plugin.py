"""Registers the `gpt_oss` model type."""

from __future__ import annotations

from nanocore import hookimpl
from nanocore.config.schema import ModelArgs
from nanocore.model_parts.decoder import build_decoder
from nanocore_plugins.gpt_oss import hf
from nanocore_plugins.gpt_oss.config import GptOssConfig
from nanocore_plugins.gpt_oss.model import GptOssForCausalLM


def build(model_args: ModelArgs, *, vocab_multiple: int = 1) -> GptOssForCausalLM:
    """Build on the current default device (meta when called by an engine); parameters are not initialised."""
    return build_decoder(GptOssForCausalLM, model_args, vocab_multiple)


@hookimpl
def register_models(registry):
    registry.register(
        "gpt_oss",
        build,
        config_class=GptOssConfig,
        description="gpt-oss: attention sinks, alternating sliding-window and full layers, YaRN, a biased "
        "top-k router and biased experts with a clamped SwiGLU; converts to and from transformers' layout",
        hf_architectures=hf.ARCHITECTURES,
        to_hf=hf.to_hf,
        from_hf=hf.from_hf,
    )
