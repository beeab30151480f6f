"""Autograd functions for tensor parallelism: Megatron's f/g pairs and the overlapped linears.

Each forward collective has its conjugate in backward (identity <-> all-reduce, all-gather <->
reduce-scatter), which is what keeps the gradients of a sharded model equal to the dense ones.
The two `*Overlapped` functions fuse a column-parallel linear with its communication so that the
collective runs while a matmul that does not depend on it is computed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanocore_plugins.tp_modes.comm import all_gather_chunks, all_gather_seq, all_reduce, group_rank, reduce_scatter_seq

Group = dist.ProcessGroup | None


class CopyToTP(torch.autograd.Function):
    """Megatron's f: the input of a column-parallel layer is replicated, so its gradient is the sum
    of every rank's partial gradient (each rank only saw its slice of the output)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Autograd may hand the same gradient tensor to several consumers: never reduce it in place.
        return all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: a row-parallel layer yields partial sums; the replicated output's gradient
    is already complete on every rank, so backward is the identity."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        # x is a fresh matmul/embedding output that nothing else holds: reduce it in place.
        ctx.mark_dirty(x)
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class GatherFromSequence(torch.autograd.Function):
    """Sequence parallel's f: all-gather the sequence shards before a column-parallel layer; the
    backward reduce-scatter both sums the partial gradients and hands each rank its own shard."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterToSequence(torch.autograd.Function):
    """Sequence parallel's g: sum the partial outputs of a row-parallel layer (or the vocab-parallel
    embedding) and keep only this rank's sequence shard; backward all-gathers the shard gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_seq(grad.contiguous(), ctx.group), None


def _weight_grads(ctx, grad: torch.Tensor, x: torch.Tensor):
    grad_2d = grad.reshape(-1, grad.shape[-1])
    grad_weight = grad_2d.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
    grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_weight, grad_bias


class ColumnLinearOverlapped(torch.autograd.Function):
    """Column-parallel linear (ALL_REDUCE mode) whose backward all-reduce of the input gradient
    runs while the weight gradient is computed (Megatron's async tensor-model-parallel all-reduce)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group: Group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        pending = None
        if ctx.needs_input_grad[0]:
            pending = all_reduce(grad.matmul(weight), ctx.group, async_op=True)
        grad_weight, grad_bias = _weight_grads(ctx, grad, x)
        grad_input = pending.wait() if pending is not None else None
        return grad_input, grad_weight, grad_bias, None


class SequenceParallelColumnLinearOverlapped(torch.autograd.Function):
    """Column-parallel linear on a sequence-sharded input (REDUCE_SCATTER mode), with overlap.

    Forward: the all-gather of the input runs while this rank's own shard is multiplied.
    Backward: the input is gathered again (not kept from forward: that would cost tp times the
    activation memory) while the input gradient is computed, then the reduce-scatter of that
    gradient runs while the weight gradient is computed (Megatron's sequence-parallel linear).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group: Group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        pending = all_gather_chunks(x, group, async_op=True)
        own = F.linear(x, weight, bias)
        chunks = pending.wait()
        rank = group_rank(group)
        outputs = [own if i == rank else F.linear(chunk, weight, bias) for i, chunk in enumerate(chunks)]
        return torch.cat(outputs, dim=1)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        gathering = all_gather_seq(x, ctx.group, async_op=True)
        grad_input_full = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        x_full = gathering.wait()
        scattering = (
            reduce_scatter_seq(grad_input_full, ctx.group, async_op=True) if grad_input_full is not None else None
        )
        grad_weight, grad_bias = _weight_grads(ctx, grad, x_full)
        grad_input = scattering.wait() if scattering is not None else None
        return grad_input, grad_weight, grad_bias, None
