"""nanocore built-in plugin: loggers."""
