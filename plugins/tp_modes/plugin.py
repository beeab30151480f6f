"""Built-in tensor-parallel modes: `ALL_REDUCE` (Megatron) and `REDUCE_SCATTER` (sequence parallel)."""

from __future__ import annotations

from nanocore import hookimpl
from nanocore_plugins.tp_modes.modes import AllReduceMode, ReduceScatterMode


def _check_sequence_parallel(config, args) -> list[str]:
    tp, seq = config.parallelism.tp, config.tokens.sequence_length
    cp = config.parallelism.context_parallel_size
    if cp > 1:
        if seq % (2 * cp) == 0 and tp > 1 and (seq // cp) % tp:
            return [
                f"tokens.sequence_length: REDUCE_SCATTER (sequence parallel) shards each context-parallel rank's "
                f"sequence_length / context_parallel_size = {seq // cp} tokens over tp={tp} ranks, so sequence_length "
                f"must be divisible by cp x tp = {cp * tp}; got {seq} (or use tp_mode: ALL_REDUCE)"
            ]
        return []
    if tp > 1 and seq % tp:
        return [
            f"tokens.sequence_length: REDUCE_SCATTER (sequence parallel) shards the sequence over tp={tp} ranks, "
            f"so sequence_length must be divisible by {tp}; got {seq} (or use tp_mode: ALL_REDUCE)"
        ]
    return []


@hookimpl
def register_tp_modes(registry):
    registry.register(
        "ALL_REDUCE",
        AllReduceMode,
        description="Megatron TP: replicated activations, all-reduce after row-parallel layers",
    )
    registry.register(
        "REDUCE_SCATTER",
        ReduceScatterMode,
        description="sequence parallel: sequence-sharded activations, all-gather / reduce-scatter around TP layers",
        check=_check_sequence_parallel,
    )
