"""nanocore built-in plugin: schedules."""
