"""The memory plan of a config: bytes per rank before anything is launched (the library half of
`nanocore plan`, also read by the start-of-run summary), and its predicted step time on a hardware
description (`nanocore plan --hardware`).

The engine plugin does the counting (registry entry extra `plan(config, registries, device) ->
MemoryPlan`, the record in nanocore.engine_api; see plugins/parallel/planner.py for the built-in
engine's formulas).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanocore.engine_api import MemoryPlan, TimePrediction
from nanocore.errors import PluginError

if TYPE_CHECKING:
    from nanocore.config.schema import Config
    from nanocore.hardware import Hardware
    from nanocore.registry import Registries


def plan_for(config: Config, registries: Registries, device: str, expert_load_factor: float = 1.0) -> MemoryPlan | None:
    """The engine's memory plan, or None when the engine plugin offers no planner. A load factor above 1
    (the busiest expert-parallel rank's routed tokens over the balanced share) is passed as the
    planner's `expert_load_factor` keyword."""
    entry = registries.parallel_engine.get(config.parallelism.engine)
    planner = entry.extras.get("plan")
    if planner is None:
        return None
    extra = {"expert_load_factor": expert_load_factor} if expert_load_factor != 1.0 else {}
    result = planner(config, registries, device=device, **extra)
    if not isinstance(result, MemoryPlan):
        raise PluginError(
            f"plugin {entry.plugin!r}: engine {entry.name!r}'s plan returned {type(result).__name__}, "
            "not a nanocore.engine_api.MemoryPlan"
        )
    return result


def predict_for(
    config: Config,
    registries: Registries,
    hardware: Hardware,
    device: str,
    expert_load_factor: float = 1.0,
    extra: str = "predict",
) -> TimePrediction | None:
    """The engine's predicted step time on `hardware`, or None when the engine offers no time model
    (registry entry extra `predict(config, registries, hardware, device, expert_load_factor)`).
    `extra="predict_bound"`: the engine's cheaper lower bound of that step, or None where it offers none."""
    entry = registries.parallel_engine.get(config.parallelism.engine)
    predictor = entry.extras.get(extra)
    if predictor is None:
        return None
    result = predictor(config, registries, hardware, device=device, expert_load_factor=expert_load_factor)
    if not isinstance(result, TimePrediction):
        raise PluginError(
            f"plugin {entry.plugin!r}: engine {entry.name!r}'s {extra} returned {type(result).__name__}, "
            "not a nanocore.engine_api.TimePrediction"
        )
    return result
