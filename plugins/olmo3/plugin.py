"""Registers the `olmo3` model type."""

from __future__ import annotations

from nanocore import hookimpl
from nanocore.config.schema import ModelArgs
from nanocore.model_parts.decoder import build_decoder
from nanocore_plugins.olmo3 import hf
from nanocore_plugins.olmo3.config import Olmo3Config
from nanocore_plugins.olmo3.model import Olmo3ForCausalLM


def build(model_args: ModelArgs, *, vocab_multiple: int = 1) -> Olmo3ForCausalLM:
    """Build on the current default device (meta when called by an engine); parameters are not initialised."""
    return build_decoder(Olmo3ForCausalLM, model_args, vocab_multiple)


@hookimpl
def register_models(registry):
    registry.register(
        "olmo3",
        build,
        config_class=Olmo3Config,
        description="OLMo 3 decoder: sliding-window and full layers (layer_types), post-norm blocks, "
        "RMSNorm over the whole query and key projections; transformers-compatible weight names",
        hf_architectures=hf.ARCHITECTURES,
        to_hf=hf.to_hf,
        from_hf=hf.from_hf,
        from_hf_selects_only=True,  # from_hf drops tensors, never computes: they can be read lazily
    )
