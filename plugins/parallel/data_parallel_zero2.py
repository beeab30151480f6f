"""Reduce-scattered gradients (ZeRO-2): each data-parallel rank keeps only its rows of every gradient.

The persistent buffer holds, per bucket, this rank's rows (`row_share`) of each of the bucket's
parameters, padded to the largest rank's share. During backward, autograd's fresh gradient of a
parameter is added into a bucket-sized staging buffer laid out rank-major (every rank's rows in
that rank's segment) and freed; a bucket of one parameter whose rows split evenly (the embedding,
the output head) reduces autograd's gradient itself, which is already laid out so. Once a bucket
has all its gradients of this backward, one `reduce_scatter_single` sums it over the replica group
and leaves each rank its own segment, which is added into the buffer. One reduction is in flight
at a time (the previous one completes when the next starts), so besides autograd's fresh gradients
a rank holds about two buckets of staging.

Unlike the replicated buffers (one all-reduce per step, in the last backward), every backward is
reduced: gradients of several micro-batches cannot be summed locally without keeping them whole.
Each micro-batch's reduce-scatter moves half the bytes of an all-reduce (DeepSpeed's ZeRO-2 does
the same).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from nanocore.engine_api import ReplicaGroup, TrainableParam
from nanocore.sharding import get_placement, reduce_scatter_single, row_share

from .data_parallel import BlockParameters, ReplicatedGradients


def full_shape(p: nn.Parameter) -> tuple[int, ...]:
    """The parameter's shape on this rank when whole (ZeRO-3 builds only its rows: `zero3_shape`)."""
    return tuple(getattr(p, "zero3_shape", p.shape))


class _ShardBucket:
    def __init__(self, params: list[nn.Parameter], group, size: int, rank: int):
        self.params, self.group, self.size, self.rank = params, group, size, rank
        shapes = [full_shape(p) for p in params]
        # elements per row (a 0-dim tensor is one row of one element)
        self.row_numel = [math.prod(s[1:]) if s and s[0] else (0 if s else 1) for s in shapes]
        # segments[q] = [(param index, start row, rows, offset within rank q's segment)]
        self.segments: list[list[tuple[int, int, int, int]]] = []
        totals = []
        for q in range(size):
            offset, segment = 0, []
            for i, shape in enumerate(shapes):
                start, rows = row_share(shape, size, q)
                if rows:
                    segment.append((i, start, rows, offset))
                    offset += rows * self.row_numel[i]
            self.segments.append(segment)
            totals.append(offset)
        self.width = max(totals)
        # places[i] = where parameter i's rows go in the rank-major staging buffer: (offset, start row, rows)
        self.places: list[list[tuple[int, int, int]]] = [[] for _ in params]
        for q, segment in enumerate(self.segments):
            for i, start, rows, at in segment:
                self.places[i].append((q * self.width + at, start, rows))
        # one parameter whose ranks' rows are equal: its gradient, flattened, is already laid out rank-major
        # and is reduced as it is, without a staging copy (an embedding's or output head's: the largest)
        self.direct = len(params) == 1 and size * self.width == math.prod(shapes[0]) and shapes[0] != ()
        self.staging: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self.handle = None
        self.pending: set[int] = set()
        self.view: torch.Tensor | None = None  # this rank's segment of the persistent buffer


class ShardedGradBuffers:
    """Like `GradBuffers`, but `p.main_grad` is this rank's rows (`rows[id(p)]`) of p's reduced gradient."""

    def __init__(
        self,
        params_by_chunk: list[list[nn.Parameter]],
        *,
        dtype: torch.dtype,
        device: torch.device,
        bucket_bytes: int,
        dp_size: int,
        replica_group: Callable[[nn.Parameter], tuple[object, int, int]],
    ):
        """`replica_group(p)` -> (group, size, this rank's index) of the ranks holding replicas of `p`."""
        self.dtype, self.device, self.dp_size = dtype, device, dp_size
        self.buckets: list[_ShardBucket] = []
        self.chunk_buckets: list[list[_ShardBucket]] = []
        self.bucket_of: dict[int, _ShardBucket] = {}
        self.index_in_bucket: dict[int, int] = {}
        self._hooks: list = []
        self.in_flight: list[_ShardBucket] = []
        self.rows: dict[int, tuple[int, int]] = {}  # id(p) -> (start, length) of p's rows in main_grad
        for chunk in params_by_chunk:
            kinds: dict[int, list[nn.Parameter]] = {}
            groups: dict[int, tuple[object, int, int]] = {}
            for p in reversed(chunk):  # roughly the order backward produces them
                group = replica_group(p)
                kinds.setdefault(id(group[0]), []).append(p)
                groups[id(group[0])] = group
            mine = []
            for key, params in kinds.items():
                current, size = [], 0
                for p in params:
                    nbytes = math.prod(full_shape(p)) * torch.finfo(dtype).bits // 8
                    if nbytes >= bucket_bytes and current:  # a parameter as large as a bucket is one of its own
                        mine.append(_ShardBucket(current, *groups[key]))
                        current, size = [], 0
                    current.append(p)
                    size += nbytes
                    if size >= bucket_bytes:
                        mine.append(_ShardBucket(current, *groups[key]))
                        current, size = [], 0
                if current:
                    mine.append(_ShardBucket(current, *groups[key]))
            self.chunk_buckets.append(mine)
            self.buckets.extend(mine)
        self.buffer = torch.zeros(sum(b.width for b in self.buckets), dtype=dtype, device=device)
        offset = 0
        for bucket in self.buckets:
            bucket.view = self.buffer[offset : offset + bucket.width]
            for i, p in enumerate(bucket.params):
                self.bucket_of[id(p)] = bucket
                self.index_in_bucket[id(p)] = i
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook))
            for i, start, rows, at in bucket.segments[bucket.rank]:
                p = bucket.params[i]
                piece = bucket.view[at : at + rows * bucket.row_numel[i]]
                shape = full_shape(p)
                p.main_grad = piece.view(()) if not shape else piece.view(rows, *shape[1:])
                self.rows[id(p)] = (start, rows)
            for p in bucket.params:
                if id(p) not in self.rows:  # this rank owns none of p's rows
                    shape = full_shape(p)
                    start, _ = row_share(shape, bucket.size, bucket.rank)
                    p.main_grad = bucket.view[:0].view(0, *shape[1:]) if shape else bucket.view[:0]
                    self.rows[id(p)] = (start, 0)
            offset += bucket.width

    def _hook(self, p: nn.Parameter) -> None:
        grad, p.grad = p.grad, None
        if grad is None:
            return
        bucket = self.bucket_of[id(p)]
        if bucket.handle is not None:  # reduced earlier in this backward (a parameter used by two chunks)
            self._complete(bucket)
        if bucket.staging is None and bucket.direct and grad.dtype == self.dtype and grad.is_contiguous():
            bucket.staging, bucket.pending = grad.view(-1), set()
            self._launch(bucket)
            return
        if bucket.staging is None:
            bucket.staging = torch.zeros(bucket.size * bucket.width, dtype=self.dtype, device=self.device)
            bucket.pending = {id(q) for q in bucket.params}
        i = self.index_in_bucket[id(p)]
        rows_of = grad.reshape(1) if grad.dim() == 0 else grad
        for base, start, rows in bucket.places[i]:
            piece = bucket.staging[base : base + rows * bucket.row_numel[i]]
            piece.view(rows, *rows_of.shape[1:]).add_(rows_of.narrow(0, start, rows))
        bucket.pending.discard(id(p))
        if not bucket.pending:
            self._launch(bucket)

    def _launch(self, bucket: _ShardBucket) -> None:
        # at most one reduction in flight: the one before is finished (and its staging freed) first,
        # so a backward holds about two buckets of staging, not the whole chunk's gradients
        for earlier in list(self.in_flight):
            self._complete(earlier)
        self.in_flight = [bucket]
        if bucket.size > 1:
            bucket.out = torch.empty(bucket.width, dtype=self.dtype, device=self.device)
            bucket.handle = reduce_scatter_single(bucket.out, bucket.staging, group=bucket.group, async_op=True)
        else:
            bucket.out, bucket.handle = bucket.staging, True

    def _complete(self, bucket: _ShardBucket) -> None:
        if bucket.handle is not True:
            bucket.handle.wait()
        if self.dp_size > 1:  # the loss is the mean over the global batch
            bucket.out.div_(self.dp_size)
        bucket.view.add_(bucket.out)
        bucket.staging = bucket.out = bucket.handle = None
        if bucket in self.in_flight:
            self.in_flight.remove(bucket)

    def start_step(self) -> None:
        self.buffer.zero_()
        self.in_flight = []
        for bucket in self.buckets:
            bucket.staging = bucket.out = bucket.handle = None

    def final_backward(self, chunk: int | None) -> None:
        """Every backward is reduced; nothing to prepare for the last one."""

    def after_backward(self, chunk: int) -> None:
        """`chunk`'s backward has run: reduce what it produced and free the staging buffers."""
        self._flush(self.chunk_buckets[chunk])

    def _flush(self, buckets: list[_ShardBucket]) -> None:
        # the same buckets in the same order on every rank (each rank ran the same backward)
        for bucket in buckets:
            if bucket.staging is not None and bucket.handle is None:
                self._launch(bucket)
        for bucket in buckets:
            if bucket.handle is not None:
                self._complete(bucket)

    def finish(self) -> None:
        self._flush(self.buckets)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.buckets.clear()
        self.chunk_buckets.clear()
        self.bucket_of.clear()


class ShardedGradients(ReplicatedGradients):
    """ZeRO-2: each replica keeps its rows of every reduced gradient (`ShardedGradBuffers`); parameters
    stay whole, and are saved and loaded as under replicated gradients."""

    block_parameters: BlockParameters | None = None

    def __init__(
        self, dense: ReplicaGroup, experts: ReplicaGroup, *, dtype: torch.dtype, device: torch.device, bucket_bytes: int
    ):
        super().__init__(dense, experts, dtype=dtype, device=device, bucket_bytes=bucket_bytes)
        self.sharded_grads: ShardedGradBuffers | None = None

    def build(self, chunk_params: list[list[nn.Parameter]], chunk_modules: list[list[list[nn.Module]]]) -> None:
        self.sharded_grads = ShardedGradBuffers(
            chunk_params,
            dtype=self.dtype,
            device=self.device,
            bucket_bytes=self.bucket_bytes,
            dp_size=self.dp_size,
            replica_group=self.replicas,
        )
        self.grad_buffer = self.sharded_grads.buffer

    def _sharded(self) -> ShardedGradBuffers:
        if self.sharded_grads is None:
            raise RuntimeError("data parallelism used before build()")
        return self.sharded_grads

    def start_step(self) -> None:
        self._sharded().start_step()

    def final_backward(self, chunk: int | None) -> None:
        self._sharded().final_backward(chunk)

    def after_backward(self, chunk: int) -> None:
        self._sharded().after_backward(chunk)

    def finish_step(self) -> None:
        self._sharded().finish()

    def trainable(self, name: str, p: nn.Parameter, writer: bool, dp: ReplicaGroup | None) -> TrainableParam:
        shape = full_shape(p)
        return TrainableParam(
            name,
            p,
            p.main_grad,
            get_placement(p),
            writer,
            len(shape) >= 2,
            dp,
            grad_rows=self._sharded().rows[id(p)],
            shape=shape,
        )

    def square_sums(self, dense: torch.Tensor, experts: torch.Tensor) -> None:
        """Each replica holds other rows: sum over the replicas of each kind."""
        for total, replicas in ((dense, self.dense), (experts, self.experts)):
            if replicas.size > 1:
                dist.all_reduce(total, group=replicas.group)

    def close(self) -> None:
        if self.sharded_grads is not None:
            self.sharded_grads.close()
        self.sharded_grads = None
