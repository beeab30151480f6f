"""Built-in tokenizers: `byte` (no files) and `hf` (a local tokenizer.json or tokenizer folder)."""

from __future__ import annotations

from nanocore import hookimpl
from nanocore_plugins.tokenizers.byte import build_byte_tokenizer
from nanocore_plugins.tokenizers.hf import load_hf_tokenizer


@hookimpl
def register_tokenizers(registry):
    registry.register(
        "byte", build_byte_tokenizer, description="UTF-8 bytes as tokens (ids 0-255) plus eos 256; needs no files"
    )
    registry.register(
        "hf",
        load_hf_tokenizer,
        description="a local tokenizer.json or a folder with one (Hugging Face tokenizers; no Hub downloads)",
    )
