"""The two built-in tensor-parallel modes: ALL_REDUCE (Megatron) and REDUCE_SCATTER (sequence parallel).

A mode decides how activations travel between the parallel layers of
`nanocore_plugins.parallel.tensor_parallel`; the layers hold only weights and call the mode.
The contract is the core's `nanocore.tp_api.TPMode`; a third-party mode registers any object that
implements it.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from nanocore.tp_api import Group, LinearFunction
from nanocore_plugins.tp_modes.comm import group_size
from nanocore_plugins.tp_modes.functions import (
    ColumnLinearOverlapped,
    CopyToTP,
    GatherFromSequence,
    ReduceFromTP,
    ReduceScatterToSequence,
    SequenceParallelColumnLinearOverlapped,
)


class _SharedInput:
    """Remembers the last communicated input of a column-parallel layer.

    Single-device model code calls q/k/v (or gate/up) projections one by one on the same tensor;
    giving them the same f-op output means one all-gather in forward and one all-reduce or
    reduce-scatter in backward (their gradients add up before the collective), as a fused QKV
    layer would. The input is held weakly and the result only while the input lives (usually the
    length of one attention or MLP forward), so nothing outlives the autograd graph; that also
    keeps the sharing under activation recomputation, which does not save the gathered tensor.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._result: torch.Tensor | None = None

    def _forget(self, ref: weakref.ref) -> None:
        if self._key is not None and self._key[0] is ref:
            self._key = self._result = None

    def get(self, x: torch.Tensor, group: Group, make) -> torch.Tensor:
        if x.is_inference():  # inference tensors have no version counter to validate the cache with
            return make()
        key = (x._version, id(group), torch.is_grad_enabled())
        if self._key is not None and self._key[0]() is x and self._key[1:] == key:
            return self._result
        self._key = self._result = None
        result = make()
        self._key = (weakref.ref(x, self._forget), *key)
        self._result = result
        return result


class _CollectiveMode:
    """A `nanocore.tp_api.TPMode`. Both built-in modes share the layer arithmetic and differ only in their collectives:
    `_input_op` before a column-parallel matmul, `_overlapped_column` for its async form, and
    `_output_op` after a row-parallel matmul or the vocab-parallel embedding."""

    _input_op: type[torch.autograd.Function]
    _overlapped_column: type[torch.autograd.Function]
    _output_op: type[torch.autograd.Function]

    name = "?"
    sequence_parallel = False

    def __init__(self) -> None:
        self._shared = _SharedInput()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def column_linear(
        self, x, weight, bias, group: Group, async_communication: bool = False, linear: LinearFunction | None = None
    ) -> torch.Tensor:
        linear = linear or F.linear
        if group_size(group) == 1:
            return linear(x, weight, bias)
        if async_communication and torch.is_grad_enabled():
            return self._overlapped_column.apply(x, weight, bias, group)
        return linear(self._shared.get(x, group, lambda: self._input_op.apply(x, group)), weight, bias)

    def row_linear(
        self,
        x_local,
        weight,
        bias,
        group: Group,
        async_communication: bool = False,
        linear: LinearFunction | None = None,
    ) -> torch.Tensor:
        y = (linear or F.linear)(x_local, weight, None)
        if group_size(group) > 1:
            y = self._output_op.apply(y, group)
        return y + bias if bias is not None else y

    def after_embedding(self, y_partial: torch.Tensor, group: Group) -> torch.Tensor:
        return self._output_op.apply(y_partial, group) if group_size(group) > 1 else y_partial


class AllReduceMode(_CollectiveMode):
    """Megatron tensor parallelism: activations between blocks are replicated on every TP rank.

    Column-parallel layers take the replicated input as is (identity forward, all-reduce of the input
    gradient in backward); row-parallel layers all-reduce their partial outputs (identity backward).
    With `async_communication` the backward all-reduce of a column layer overlaps its weight-gradient
    matmul. The row layer's all-reduce is on the critical path either way, so it has no async form.
    """

    name = "ALL_REDUCE"
    sequence_parallel = False
    _input_op = CopyToTP
    _overlapped_column = ColumnLinearOverlapped
    _output_op = ReduceFromTP


class ReduceScatterMode(_CollectiveMode):
    """Sequence parallelism (Korthikanti et al.): activations between blocks are sharded along the
    sequence, so norms, residuals and dropout are computed on 1/tp of the tokens and stored once.

    Column-parallel layers all-gather the sequence first (reduce-scatter of the gradient in
    backward); row-parallel layers and the embedding reduce-scatter their partial outputs along the
    sequence (all-gather in backward). Same traffic as ALL_REDUCE (an all-reduce is a reduce-scatter
    plus an all-gather), less activation memory. The sequence length must be divisible by tp.
    With `async_communication` column layers overlap the gather with the local shard's matmul in
    forward, and the re-gather and reduce-scatter with the gradient matmuls in backward.
    """

    name = "REDUCE_SCATTER"
    sequence_parallel = True
    _input_op = GatherFromSequence
    _overlapped_column = SequenceParallelColumnLinearOverlapped
    _output_op = ReduceScatterToSequence
