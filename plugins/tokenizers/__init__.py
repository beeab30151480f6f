"""nanocore built-in plugin: tokenizers."""
