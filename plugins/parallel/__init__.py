"""nanocore built-in plugin: parallel."""
