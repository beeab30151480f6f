"""Where this process stands in a launch: the variables torchrun (or a test's rank spawner) sets.

Read here only, so that one process, torchrun and the test helpers agree on the defaults: a process
started without a launcher is rank 0 of 1.
"""

from __future__ import annotations

import os

import attrs


@attrs.frozen
class LaunchEnv:
    """`RANK`, `WORLD_SIZE` and `LOCAL_RANK` of this process (0, 1 and 0 without a launcher)."""

    rank: int
    world_size: int
    local_rank: int


def launch_env() -> LaunchEnv:
    """The launch variables as they are now (read on every call: a rank spawner may set them late)."""
    return LaunchEnv(
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )
