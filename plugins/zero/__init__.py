"""nanocore built-in plugin: zero."""
