"""What a tensor-parallel mode is: the contract between the TP layers of an engine and a TP-mode plugin.

A TP-mode plugin (`parallelism.tp_mode`) registers a factory that returns a `TPMode`. The engine's
parallel layers (column-parallel, row-parallel, vocab-parallel embedding) hold only their weight
shards and call the mode for everything that moves activations between ranks, so a new mode (a
different sequence sharding, an overlapped variant) needs no new layers.

`sequence_parallel` says how activations flow *between* blocks: replicated on every TP rank
(False: Megatron's ALL_REDUCE), or sharded along the sequence (dim 1) over the TP group (True:
REDUCE_SCATTER). Engines read it to know that replicated parameters (norms) then see 1/tp of the
tokens, so their gradients are summed over TP, that the sequence must split over tp, and that a
micro-batch's tokens are spread over the TP group (for statistics such as an MoE router's).

Built-in implementations: `nanocore_plugins.tp_modes` (`ALL_REDUCE`, `REDUCE_SCATTER`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeAlias, runtime_checkable

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None  # None (or a group of one rank) means no tensor parallelism

# (x [..., in], weight [out, in], bias [out] or None) -> [..., out]: what `F.linear` computes
LinearFunction: TypeAlias = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@runtime_checkable
class TPMode(Protocol):
    """How activations travel around the tensor-parallel layers. `group=None` or a group of one: no TP."""

    name: str
    sequence_parallel: bool  # activations between blocks are sharded along dim 1 over the TP group

    def column_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Group,
        async_communication: bool = False,
        linear: LinearFunction | None = None,
    ) -> torch.Tensor:
        """`weight` holds this rank's output rows; `x` is the layer input as it flows between blocks in
        this mode. Returns this rank's output columns for the whole (gathered) sequence. `linear`, when
        given (an FP8 recipe's, `nanocore.float8_api`), computes `x @ weight.T + bias` in place of
        `F.linear`; it is never given with `async_communication`."""
        ...

    def row_linear(
        self,
        x_local: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: Group,
        async_communication: bool = False,
        linear: LinearFunction | None = None,
    ) -> torch.Tensor:
        """`weight` holds this rank's input columns; `bias` is replicated and added once, after the
        reduction. Returns the output as it flows between blocks in this mode. `linear`: as in
        `column_linear` (called without the bias, which is added after the reduction)."""
        ...

    def after_embedding(self, y_partial: torch.Tensor, group: Group) -> torch.Tensor:
        """Combine the vocab-parallel embedding's partial rows (zeros for ids another rank holds)."""
        ...
