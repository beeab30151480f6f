"""Data parallelism: where each replica's gradients (and under ZeRO-3 parameters) live, and how they
are reduced. One `DataParallel` strategy is chosen once from the ZeRO stage's registry entry
(`data_parallel_for`): replicated gradients (this module), reduce-scattered gradients
(`data_parallel_zero2`), parameters sharded at rest (`data_parallel_zero3`). The engine calls every
strategy the same way.

Replicated gradients (`GradBuffers`, ZeRO-0/1):

Every local parameter gets a `main_grad` view into one flat buffer (fp32 when
`accumulate_grad_in_fp32`). When the parameter dtype equals the buffer's, `param.grad` *is* that view
and autograd accumulates into it in place; otherwise a post-accumulate hook adds the fresh gradient
into the fp32 view and frees it. Buffers are cut into buckets per model chunk, in reverse
registration order (roughly the order backward produces them). On a chunk's last backward of the
step, each bucket's all-reduce starts as soon as all its gradients are final, overlapping with the
rest of backward.

Every gradient is divided by the data-parallel size (the loss is the mean over the global batch)
and summed over the ranks that hold a replica of its parameter: all of DP for most, the
expert-data-parallel group for expert weights under expert parallelism (`replica_group`); a bucket
holds parameters of one kind only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from nanocore.checkpoint.tensors import ShardedTensor, ShardReader
from nanocore.engine_api import ReplicaGroup, TrainableParam
from nanocore.sharding import Placement, get_placement

from .expert_parallel import is_expert

# (group, size, this rank's index) of the data-parallel ranks holding the same piece of a parameter


class BlockParameters(Protocol):
    """What the pipeline executor calls around each block when parameters are not always whole."""

    def gather(self, chunk: int, block: int) -> None: ...

    def prefetch(self, chunk: int, block: int) -> None: ...

    def release(self, chunk: int, block: int) -> None: ...


class DataParallel(Protocol):
    """Where parameters, gradients and their reduction live across data-parallel replicas."""

    grad_buffer: torch.Tensor  # every gradient element this rank holds (clipping scales it in place)
    block_parameters: BlockParameters | None  # handed to the pipeline executor; None: always whole

    def rows_at_rest(self, p: nn.Parameter) -> tuple[int, int] | None:
        """Rows of `p` to materialise on this rank; None: all of it."""

    def build(self, chunk_params: list[list[nn.Parameter]], chunk_modules: list[list[list[nn.Module]]]) -> None:
        """Create the gradient buffers (and ZeRO-3's gatherers) for the local model's chunks."""

    def start_step(self) -> None: ...

    def final_backward(self, chunk: int | None) -> None:
        """The next backward is `chunk`'s last of this step (None: the step's backwards are over)."""

    def after_backward(self, chunk: int) -> None: ...

    def end_pass(self) -> None:
        """After every executor run, train or eval, and also when it failed: parameters back at rest."""

    def finish_step(self) -> None:
        """After a training pass: every gradient reduction complete."""

    def trainable(self, name: str, p: nn.Parameter, writer: bool, dp: ReplicaGroup | None) -> TrainableParam: ...

    def square_sums(self, dense: torch.Tensor, experts: torch.Tensor) -> None:
        """Sum the squared gradient norms over the replicas that hold other rows of the gradients."""

    def saved_piece(self, t: TrainableParam) -> ShardedTensor | None:
        """The piece of `t` this rank writes to a checkpoint, if any."""

    def load(self, t: TrainableParam, reader: ShardReader) -> None: ...

    def held(self, p: nn.Parameter) -> torch.Tensor:
        """The tensor holding what this rank keeps of `p` between steps."""

    def close(self) -> None: ...


class ReplicatedGradients:
    """ZeRO-0/1: whole gradients on every replica, all-reduced in buckets during the last backward."""

    block_parameters: BlockParameters | None = None

    def __init__(
        self, dense: ReplicaGroup, experts: ReplicaGroup, *, dtype: torch.dtype, device: torch.device, bucket_bytes: int
    ):
        """The ranks holding a parameter are `dense` (data x context parallel) for most, `experts`
        (expert-data-parallel) for expert weights. Every gradient is divided by the dense size (the
        loss is the mean over the global batch)."""
        self.dense, self.experts = dense, experts
        self.dtype, self.device, self.bucket_bytes = dtype, device, bucket_bytes
        self.dp_size = dense.size
        self.grads: GradBuffers | None = None
        self.grad_buffer = torch.zeros(0, dtype=dtype, device=device)

    def replicas(self, p: nn.Parameter) -> tuple[object, int, int]:
        """(group, size, this rank's index) of the ranks holding the same piece of `p`."""
        r = self.experts if is_expert(p) else self.dense
        return r.group, r.size, r.rank

    def rows_at_rest(self, p: nn.Parameter) -> tuple[int, int] | None:
        return None

    def build(self, chunk_params: list[list[nn.Parameter]], chunk_modules: list[list[list[nn.Module]]]) -> None:
        self.grads = GradBuffers(
            chunk_params,
            dtype=self.dtype,
            device=self.device,
            bucket_bytes=self.bucket_bytes,
            dp_size=self.dp_size,
            replica_group=lambda p: self.replicas(p)[:2],
        )
        self.grad_buffer = self.grads.buffer

    def start_step(self) -> None:
        self._built().start_step()

    def final_backward(self, chunk: int | None) -> None:
        self._built().final_backward(chunk)

    def after_backward(self, chunk: int) -> None:
        self._built().after_backward(chunk)

    def end_pass(self) -> None:
        """Parameters are always whole."""

    def finish_step(self) -> None:
        self._built().finish()

    def _built(self) -> GradBuffers:
        if self.grads is None:
            raise RuntimeError("data parallelism used before build()")
        return self.grads

    def trainable(self, name: str, p: nn.Parameter, writer: bool, dp: ReplicaGroup | None) -> TrainableParam:
        return TrainableParam(name, p, p.main_grad, get_placement(p), writer, p.dim() >= 2, dp)

    def square_sums(self, dense: torch.Tensor, experts: torch.Tensor) -> None:
        """Every replica holds whole gradients: nothing to add."""

    def saved_piece(self, t: TrainableParam) -> ShardedTensor | None:
        """The first of the replicas writes the whole (local) parameter."""
        if not t.writer or self.replicas(t.param)[2] != 0:
            return None
        return ShardedTensor(t.name, t.param.detach(), t.placement, trained=t.param.requires_grad)

    def load(self, t: TrainableParam, reader: ShardReader) -> None:
        t.param.copy_(reader.read(t.name, t.placement, tuple(t.param.shape), dtype=t.param.dtype))

    def held(self, p: nn.Parameter) -> torch.Tensor:
        return p

    def close(self) -> None:
        if self.grads is not None:
            self.grads.close()
        self.grads = None


def real_elements(tensor: torch.Tensor, placement: Placement) -> int:
    """Elements of a parameter piece that are the model's, not vocabulary padding of this layout."""
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        return tensor.numel()
    rows = tensor.shape[0]
    return tensor.numel() // rows * placement.real_rows(rows)


def rows_placement(placement: Placement, shape: tuple[int, ...], rows: tuple[int, int]) -> Placement:
    """Placement of rows (start, length) of a local tensor of `shape` placed at `placement`."""
    if not shape:  # a scalar: rank 0's
        return placement
    start, length = rows
    return placement.narrow(0, start, length, shape)[0]


class _Bucket:
    def __init__(self, params: list[nn.Parameter], view: torch.Tensor, group, group_size: int):
        self.params = params
        self.view = view
        self.group, self.group_size = group, group_size
        self.pending: set[int] = set()
        self.handle = None


class GradBuffers:
    """Flat gradient buffers cut into buckets, all-reduced as they fill (see the module docstring)."""

    def __init__(
        self,
        params_by_chunk: list[list[nn.Parameter]],
        *,
        dtype: torch.dtype,
        device: torch.device,
        bucket_bytes: int,
        dp_size: int,
        replica_group: Callable[[nn.Parameter], tuple[object, int]],
    ):
        """`replica_group(p)` -> (group, size) of the ranks holding replicas of `p`."""
        self.dp_size = dp_size
        # within a chunk: parameters grouped by replica group (one kind per bucket), reverse order
        by_chunk = []
        for chunk in params_by_chunk:
            kinds: dict[int, list[nn.Parameter]] = {}
            groups: dict[int, tuple[object, int]] = {}
            for p in reversed(chunk):
                group = replica_group(p)
                kinds.setdefault(id(group[0]), []).append(p)
                groups[id(group[0])] = group
            by_chunk.append([(groups[k], ps) for k, ps in kinds.items()])
        order = [p for chunk in by_chunk for _, ps in chunk for p in ps]
        total = sum(p.numel() for p in order)
        self.buffer = torch.zeros(total, dtype=dtype, device=device)
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict[int, _Bucket] = {}
        self.chunk_of: dict[int, int] = {}
        self.sync_chunk: int | None = None  # chunk whose final backward is running
        self._hooks: list = []
        offset = 0
        for c, chunk in enumerate(by_chunk):
            for group, params in chunk:
                current: list[nn.Parameter] = []
                start = offset
                for p in params:
                    n = p.numel()
                    p.main_grad = self.buffer[offset : offset + n].view_as(p)
                    if p.dtype == dtype:
                        p.grad = p.main_grad
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))
                    self.chunk_of[id(p)] = c
                    current.append(p)
                    offset += n
                    if (offset - start) * self.buffer.element_size() >= bucket_bytes:
                        self._add_bucket(current, start, offset, group)
                        current, start = [], offset
                if current:
                    self._add_bucket(current, start, offset, group)

    def _add_bucket(self, params: list[nn.Parameter], start: int, end: int, group: tuple[object, int]) -> None:
        bucket = _Bucket(params, self.buffer[start:end], *group)
        self.buckets.append(bucket)
        for p in params:
            self.bucket_of[id(p)] = bucket

    def _hook(self, p: nn.Parameter) -> None:
        if p.grad is not None and p.grad is not p.main_grad:
            p.main_grad.add_(p.grad)
            p.grad = None
        if self.sync_chunk is None or self.chunk_of[id(p)] != self.sync_chunk:
            return
        bucket = self.bucket_of[id(p)]
        bucket.pending.discard(id(p))
        if not bucket.pending:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.handle is not None:
            return
        if self.dp_size > 1:
            bucket.view.div_(self.dp_size)
        if bucket.group_size > 1:
            bucket.handle = dist.all_reduce(bucket.view, group=bucket.group, async_op=True)
        else:
            bucket.handle = True

    def start_step(self) -> None:
        self.buffer.zero_()
        self.sync_chunk = None
        for bucket in self.buckets:
            bucket.pending = {id(p) for p in bucket.params}
            bucket.handle = None

    def final_backward(self, chunk: int | None) -> None:
        """The next backward is `chunk`'s last of this step: reduce its buckets as they fill."""
        self.sync_chunk = chunk

    def after_backward(self, chunk: int) -> None:
        """Buckets launch from the hooks; nothing to do when a backward ends."""

    def finish(self) -> None:
        """Wait for every reduction (launching those of parameters that got no gradient)."""
        self.sync_chunk = None
        for bucket in self.buckets:
            if bucket.handle is None:
                self._launch(bucket)
            if bucket.handle is not None and bucket.handle is not True:
                bucket.handle.wait()

    def close(self) -> None:
        """Remove the hooks: parameter -> hook -> buffers -> parameter is a cycle the garbage collector
        cannot see through (autograd holds the hooks), and it would keep the DP group alive."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.buckets.clear()
        self.bucket_of.clear()
