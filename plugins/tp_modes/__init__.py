"""nanocore built-in plugin: tp_modes."""
