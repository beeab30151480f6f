"""Python logging for nanocore's commands: rank-tagged lines, quieter on ranks other than 0."""

from __future__ import annotations

import logging

from nanocore.launch_env import launch_env


def rank() -> int:
    """This process's global rank as the launcher set it (0 without torchrun)."""
    return launch_env().rank


def setup_logging(level: str = "info", replica_level: str = "warning") -> None:
    """`level` on rank 0, `replica_level` on the other ranks."""
    this = rank()
    chosen = level if this == 0 else replica_level
    logging.basicConfig(
        level=getattr(logging, chosen.upper(), logging.INFO),
        format=f"[%(asctime)s rank{this}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
