"""nanocore built-in plugin: parallel3d."""
