"""nanocore built-in plugin: data."""
