"""nanocore built-in plugin: optim."""
