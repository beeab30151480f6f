"""Shared test helpers (multi-process rank spawning lives in `tests.helpers.distributed`)."""
