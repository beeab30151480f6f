"""The built-in pipeline schedules (afab, 1f1b, interleaved, zb1p, zbv); `nanocore pipeline-sim` runs any on paper."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanocore import hookimpl
from nanocore.pipeline_api import PipelineSchedule
from nanocore_plugins.schedules.afab import AllForwardAllBackwardSchedule
from nanocore_plugins.schedules.interleaved import InterleavedOneFOneBSchedule
from nanocore_plugins.schedules.one_f_one_b import OneFOneBSchedule
from nanocore_plugins.schedules.zero_bubble import ZeroBubbleH1Schedule, ZeroBubbleVSchedule


def layout_check(schedule_class: type) -> Callable[[Any, Any], list[str]]:
    """The registry `check` extra: the schedule's own check on the config's pp, microbatches and chunks."""

    def check(config: Any, args: Any) -> list[str]:
        par = config.parallelism
        values = (par.pp, config.tokens.batch_accumulation_per_replica, par.pp_virtual_stages)
        if min(values) < 1:
            return []  # the core already reports values below 1
        return schedule_class().check(*values)

    return check


@hookimpl
def register_pipeline_schedules(registry):
    for cls, description in (
        (AllForwardAllBackwardSchedule, "all forwards, then all backwards (GPipe); holds m microbatches"),
        (OneFOneBSchedule, "one forward one backward (PipeDream-flush); holds <= pp microbatches"),
        (InterleavedOneFOneBSchedule, "Megatron's interleaved 1F1B over pp_virtual_stages chunks per rank"),
        (ZeroBubbleH1Schedule, "ZB-H1: 1F1B with split backwards, weight gradients fill the bubble; holds <= pp"),
        (ZeroBubbleVSchedule, "ZBV: 2 chunks per rank in a V, split backwards; near-zero bubble, holds <= pp"),
    ):
        registry.register(cls.name, _factory(cls), description=description, check=layout_check(cls))


def _factory(cls: type) -> Callable[[Any], PipelineSchedule]:
    def factory(config: Any) -> PipelineSchedule:
        return cls()

    factory.__doc__ = cls.__doc__
    return factory
