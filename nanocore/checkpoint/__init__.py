"""Checkpoint I/O: atomic step folders, sharded safetensors with placements, any-topology reload."""
