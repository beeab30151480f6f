"""Gradient buffers and data-parallel reduction overlapped with backward.

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

import torch
import torch.distributed as dist
from torch import nn


class _Bucket:
    def __init__(self, params: list[nn.Parameter], view: torch.Tensor, group, group_size: int):
        self.params = params
        self.view = view
        self.group, self.group_size = group, group_size
        self.pending: set[int] = set()
        self.handle = None


class GradBuffers:
    sharded = False  # every rank holds whole reduced gradients (see sharded_grads for ZeRO-2)

    def __init__(
        self,
        params_by_chunk: list[list[nn.Parameter]],
        *,
        dtype: torch.dtype,
        device: torch.device,
        bucket_bytes: int,
        dp_group,
        dp_size: int,
        replica_group: Callable[[nn.Parameter], tuple[object, int]] | None = None,
    ):
        """`replica_group(p)` -> (group, size) of the ranks holding replicas of `p` (default: DP)."""
        self.dp_group, self.dp_size = dp_group, dp_size
        replica_group = replica_group or (lambda p: (dp_group, dp_size))
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
        self.dp_group = None
