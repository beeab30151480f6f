"""Registers ZeRO stages '0' (replicated optimizer state), '1' (state sharded over data parallel) and
'2' (state and reduced gradients sharded: the engine reduce-scatters gradients during backward) and
'3' (parameters sharded too: the engine gathers each pipeline block's parameters around its use)."""

from __future__ import annotations

from nanocore import hookimpl

from .optimizer import EXCHANGE_BYTES, ZeroOptimizer


def replicated(params, build_optimizer, dp):
    return ZeroOptimizer(params, build_optimizer, dp, sharded=False)


def sharded(params, build_optimizer, dp):
    return ZeroOptimizer(params, build_optimizer, dp, sharded=True)


@hookimpl
def register_zero_stages(registry):
    registry.register("0", replicated, description="optimizer state replicated on every data-parallel rank")
    registry.register(
        "1",
        sharded,
        description="optimizer state and fp32 master weights sharded over data parallel",
        shards_optimizer_state=True,
        exchange_buffer_bytes=EXCHANGE_BYTES,  # the all-gather of updated rows, per piece (memory planner)
    )
    registry.register(
        "2",
        sharded,
        description="ZeRO-1 plus gradients reduce-scattered during backward: each rank keeps only its rows",
        shards_optimizer_state=True,
        shards_gradients=True,
        exchange_buffer_bytes=EXCHANGE_BYTES,
    )
    registry.register(
        "3",
        sharded,
        description="ZeRO-2 plus parameters sharded at rest: each pipeline block's gathered around its use",
        shards_optimizer_state=True,
        shards_gradients=True,
        shards_parameters=True,
    )
