"""Registers pipeline schedule `looped_bfs` (entry point `looped_bfs` in the `nanocore` group)."""

from __future__ import annotations

from typing import Any

from nanocore import hookimpl
from nanocore_looped_bfs.schedule import LoopedBFSSchedule


def check(config: Any, args: Any) -> list[str]:
    """The registry `check` extra: the schedule's own check on the config's pp, microbatches and chunks."""
    par = config.parallelism
    values = (par.pp, config.tokens.batch_accumulation_per_replica, par.pp_virtual_stages)
    if min(values) < 1:
        return []  # the core already reports values below 1; every other layout runs
    return LoopedBFSSchedule().check(*values)


def factory(config: Any) -> LoopedBFSSchedule:
    """`parallelism.pp_engine: looped_bfs`; works with any pp, microbatches and pp_virtual_stages."""
    return LoopedBFSSchedule()


@hookimpl
def register_pipeline_engines(registry):
    registry.register(
        LoopedBFSSchedule.name,
        factory,
        description=(
            "breadth-first looped: every microbatch through one chunk before the next; from nanocore-looped-bfs"
        ),
        check=check,
    )
