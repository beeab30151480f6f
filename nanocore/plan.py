"""The memory plan of a config: bytes per rank before anything is launched (the library half of
`nanocore plan`, also read by the start-of-run summary).

The engine plugin does the counting (registry entry extra `plan(config, registries, device) ->
dict`, see plugins/parallel/planner.py for the built-in engine's formulas).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanocore.config.schema import Config
    from nanocore.registry import Registries


def plan_for(config: Config, registries: Registries, device: str) -> dict[str, Any] | None:
    """The engine's memory plan, or None when the engine plugin offers no planner."""
    entry = registries.parallel_engine.get(config.parallelism.engine)
    planner = entry.extras.get("plan")
    return None if planner is None else planner(config, registries, device=device)
