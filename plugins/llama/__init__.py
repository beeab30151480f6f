"""nanocore built-in plugin: llama."""
