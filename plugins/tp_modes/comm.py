"""Tensor-parallel collectives along the sequence dimension that work on NCCL and on gloo.

Activations are [batch, seq, ...]; sequence parallelism shards dim 1. The fast collectives
(`all_gather_into_tensor`, `reduce_scatter_tensor`) work on dim 0, so these helpers move the rank
axis to the front or back with one copy. Older gloo builds lack the single-tensor collectives; on
gloo we fall back (list all-gather; all-reduce then slice) the first time one is refused. Every
function can run asynchronously and then returns a `Pending` whose `wait()` gives the result, so
callers overlap communication with a matmul the same way on every backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from nanocore.errors import ConfigError

# torch 2.13 renamed the single-tensor collectives; torch>=2.4 only has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Collectives this gloo build refused once; later calls go straight to the fallback.
_GLOO_UNSUPPORTED: set[str] = set()


class Pending:
    """An in-flight collective. `wait()` blocks until it is done and returns the finished tensor."""

    def __init__(self, work: dist.Work | None, finish: Callable[[], torch.Tensor]):
        self._work = work
        self._finish = finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._finish()


def group_size(group: dist.ProcessGroup | None) -> int:
    """TP size; `None` (no process group, or no TP) counts as 1 so single-process code runs unchanged."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _is_gloo(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"


def _try_gloo(name: str, group: dist.ProcessGroup | None, call: Callable[[], dist.Work | None]) -> bool | dist.Work:
    """Run `call`; on gloo a refusal marks `name` unsupported and returns False (use the fallback)."""
    if name in _GLOO_UNSUPPORTED and _is_gloo(group):
        return False
    try:
        return call()
    except (RuntimeError, NotImplementedError):
        if not _is_gloo(group):
            raise
        _GLOO_UNSUPPORTED.add(name)
        return False


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False) -> torch.Tensor | Pending:
    """Sum `x` in place over the group."""
    work = dist.all_reduce(x, group=group, async_op=async_op)
    return Pending(work, lambda: x) if async_op else x


def all_gather_chunks(x: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """Every rank's `x`, stacked on a new leading dim: [tp, *x.shape] (or a Pending of it)."""
    tp = group_size(group)
    x = x.contiguous()
    out = torch.empty((tp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _try_gloo("all_gather", group, lambda: _all_gather_single(out, x, group=group, async_op=async_op))
    if work is False:
        parts = list(out.chunk(tp))
        work = dist.all_gather(parts, x, group=group, async_op=async_op)

    def finish() -> torch.Tensor:
        return out.view(tp, *x.shape)

    return Pending(work, finish) if async_op else finish()


def merge_chunks(stacked: torch.Tensor) -> torch.Tensor:
    """[tp, b, s/tp, ...] -> [b, s, ...]: the gathered sequence shards side by side (a view when b == 1)."""
    tp, b, shard = stacked.shape[:3]
    return stacked.movedim(0, 1).reshape(b, tp * shard, *stacked.shape[3:])


def all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """Concatenate every rank's sequence shard: [b, s/tp, ...] -> [b, s, ...] (or a Pending of it)."""
    if not async_op:
        return merge_chunks(all_gather_chunks(x, group))
    pending = all_gather_chunks(x, group, async_op=True)
    return Pending(None, lambda: merge_chunks(pending.wait()))


def reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """Sum over the group and keep this rank's sequence shard: [b, s, ...] -> [b, s/tp, ...]."""
    tp = group_size(group)
    b, s = x.shape[0], x.shape[1]
    if s % tp:
        raise ConfigError(
            f"parallelism.tp_mode: REDUCE_SCATTER splits the sequence over tp={tp} ranks but got {s} tokens; "
            "use a multiple of tp (to generate, switch the model to ALL_REDUCE with set_tp_mode)"
        )
    shard = s // tp
    # [b, s, ...] -> [tp, b, s/tp, ...] so that rank i's part is contiguous block i.
    stacked = x.reshape(b, tp, shard, *x.shape[2:]).movedim(1, 0).contiguous()
    out = torch.empty((b, shard, *x.shape[2:]), dtype=x.dtype, device=x.device)
    flat_in = stacked.view(tp * b, shard, *x.shape[2:])
    work = _try_gloo(
        "reduce_scatter", group, lambda: _reduce_scatter_single(out, flat_in, group=group, async_op=async_op)
    )
    if work is False:
        # Old gloo: twice the traffic of a reduce-scatter, but correct and CPU-only.
        work = dist.all_reduce(stacked, group=group, async_op=async_op)
        rank = group_rank(group)

        def finish() -> torch.Tensor:
            return stacked[rank]

    else:

        def finish() -> torch.Tensor:
            return out

    return Pending(work, finish) if async_op else finish()
