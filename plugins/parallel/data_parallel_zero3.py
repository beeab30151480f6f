"""ZeRO-3: each data-parallel rank keeps only its rows of every trainable parameter between uses.

Each parameter keeps its full shape, but at rest its storage is resized to nothing and `zero3_shard`
holds this rank's rows (`row_share`, the cut the optimizer and the gradient buffers use). The
pipeline executor asks for a block's parameters before the block runs (`gather`: one all-gather per
parameter of every rank's rows, padded to the largest rank's share, straight into the parameter's
storage, regrown for it) and hands them back after its forward (`release`: the storage shrinks to
nothing again). A hook on the block's output gathers them again just before the block's backward;
each parameter is released as soon as autograd has accumulated its gradient (after which this
backward no longer needs it). The next block's gather is started while the current block runs
(prefetch), so at most two blocks are whole at a time.

Why the storage, and not `p.data = ...`: autograd keeps views of a block's weights for its backward
(a linear layer saves `weight.t()`). A view shares the parameter's storage, not its `.data`, so
swapping `.data` for an empty tensor left every forward's gathered weights alive through those views
until the backward (the whole model, on top of the re-gathered blocks: ZeRO-3 then held more than
ZeRO-1). Shrinking the storage frees them, and regrowing it before the backward gives the saved
views the same values again (torch's FSDP2 resizes storage for the same reason).

Where the rows split evenly over the ranks (the usual case) the all-gather's rank-major output *is*
the whole parameter, so a gather copies nothing; otherwise the rows are gathered into a buffer and
copied into place. Gradients are reduce-scattered as under ZeRO-2 (`ShardedGradBuffers`); the
optimizer steps the shards in place, so there is no exchange of updated rows: the next gather reads
them.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from torch import nn

from nanocore.checkpoint.tensors import ShardedTensor, ShardReader
from nanocore.engine_api import ReplicaGroup, TrainableParam
from nanocore.sharding import all_gather_single, row_share

from .data_parallel import rows_placement
from .data_parallel_zero2 import ShardedGradients


@attrs.define(eq=False)
class _Whole:
    """Where one parameter is whole: `buffer` (1-D, the parameter's storage: every rank's padded rows
    side by side when `in_place`, else exactly the parameter) and the layout of its all-gather."""

    param: nn.Parameter
    buffer: torch.Tensor
    group: object
    size: int
    padded_rows: int  # rows each rank sends
    row_numel: int  # elements per row (a 0-dim parameter is one row of one element)
    in_place: bool  # rank q's rows start at q * padded_rows: the all-gather's output is the parameter
    pending: tuple | None = None  # (work, out, send) of a prefetched all-gather

    def grow(self) -> None:
        storage = self.buffer.untyped_storage()
        nbytes = self.buffer.numel() * self.buffer.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    def shrink(self) -> None:
        self.buffer.untyped_storage().resize_(0)


def _whole(p: nn.Parameter, group: object, size: int) -> _Whole:
    shape = tuple(p.zero3_shape)
    shares = [row_share(shape, size, q) for q in range(size)]
    padded = max(rows for _, rows in shares)
    row_numel = (int(torch.Size(shape[1:]).numel()) if shape[0] else 0) if shape else 1
    in_place = all(start == q * padded for q, (start, _) in enumerate(shares))
    numel = int(torch.Size(shape).numel())
    length = padded * row_numel * size if in_place else numel
    buffer = torch.empty(length, dtype=p.dtype, device=p.device)
    return _Whole(p, buffer, group, size, padded, row_numel, in_place)


class ShardedParams:
    """Owns where ZeRO-3 parameters live; see the module docstring."""

    def __init__(
        self,
        chunk_modules: list[list[list[nn.Module]]],
        trainable: list[nn.Parameter],
        group_of: Callable[[nn.Parameter], tuple[object, int, int]],
    ):
        """`group_of(p)` -> (group, size, rank) of the data-parallel ranks holding replicas of `p`."""
        self.params: list[nn.Parameter] = []
        self.whole: dict[int, _Whole] = {}
        self.is_whole: set[int] = set()
        for p in trainable:
            group, size, rank = group_of(p)
            if hasattr(p, "zero3_shape"):  # built as rows only (build_local_model's rows_of)
                p.zero3_shard = p.data
            else:  # built whole: keep this rank's rows
                p.zero3_shape = tuple(p.shape)
                rows = p.data.reshape(1) if p.dim() == 0 else p.data
                start, length = row_share(p.zero3_shape, size, rank)
                p.zero3_shard = rows.narrow(0, start, length).clone()
                p.zero3_rows = (start, length)
            if p.zero3_rows != row_share(p.zero3_shape, size, rank):
                raise ValueError(f"ZeRO-3 rows {p.zero3_rows} of a {list(p.zero3_shape)} parameter are not this rank's")
            self.params.append(p)
            if size == 1:  # no other replica (experts at expert-data-parallel size 1): the rows are all of it
                p.data = p.zero3_shard.view(p.zero3_shape)
                continue
            whole = _whole(p, group, size)
            numel = int(torch.Size(p.zero3_shape).numel())
            p.data = whole.buffer[:numel].view(p.zero3_shape)  # shares the buffer's storage for good
            self.whole[id(p)] = whole
            self.is_whole.add(id(p))
        # per chunk, per block: the block's parameters, each gathered once (a tied pair is one)
        self.blocks: list[list[list[_Whole]]] = []
        for chunk in chunk_modules:
            row = []
            for modules in chunk:
                block: dict[int, _Whole] = {}
                for module in modules:
                    for q in module.parameters():
                        if id(q) in self.whole:
                            block.setdefault(id(q), self.whole[id(q)])
                row.append(list(block.values()))
            self.blocks.append(row)
        self._hooks = [self.whole[k].param.register_post_accumulate_grad_hook(self._release_one) for k in self.whole]
        for p in self.params:
            self._free(p)

    # -- at rest and whole ---------------------------------------------------------------
    def _free(self, p: nn.Parameter) -> None:
        if id(p) in self.is_whole:
            self.whole[id(p)].shrink()
            self.is_whole.discard(id(p))

    def _release_one(self, p: nn.Parameter) -> None:
        """Autograd has accumulated p's gradient: this backward needs p no more."""
        self._free(p)

    def gather(self, c: int, b: int) -> None:
        """Make block b of chunk c whole (waiting for its prefetch if one was started)."""
        for whole in self.blocks[c][b]:
            if whole.pending is None and id(whole.param) not in self.is_whole:
                whole.pending = self._start(whole)
            if whole.pending is not None:
                self._finish(whole)

    def prefetch(self, c: int, b: int) -> None:
        """Start gathering block b of chunk c (the next to run) without waiting."""
        if not (0 <= c < len(self.blocks) and 0 <= b < len(self.blocks[c])):
            return
        for whole in self.blocks[c][b]:
            if whole.pending is None and id(whole.param) not in self.is_whole:
                whole.pending = self._start(whole, async_op=True)

    def release(self, c: int, b: int) -> None:
        for whole in self.blocks[c][b]:
            self._free(whole.param)

    def release_all(self) -> None:
        for whole in self.whole.values():
            if whole.pending is not None:
                work = whole.pending[0]
                if work is not None:
                    work.wait()
                whole.pending = None
        for p in self.params:
            self._free(p)

    def _start(self, whole: _Whole, async_op: bool = False) -> tuple:
        p = whole.param
        shard = p.zero3_shard.reshape(-1)
        chunk = whole.padded_rows * whole.row_numel
        if shard.numel() != chunk:  # fewer rows than the largest share: pad
            send = torch.zeros(chunk, dtype=p.dtype, device=p.device)
            send[: shard.numel()].copy_(shard)
        else:
            send = shard
        if whole.in_place:
            whole.grow()
            out = whole.buffer
        else:
            out = torch.empty(chunk * whole.size, dtype=p.dtype, device=p.device)
        work = all_gather_single(out, send, group=whole.group, async_op=async_op)
        return (work if async_op else None), out, send  # send lives until the gather is done

    def _finish(self, whole: _Whole) -> None:
        work, out, _ = whole.pending
        whole.pending = None
        if work is not None:
            work.wait()
        if not whole.in_place:
            whole.grow()
            rows_of = whole.buffer.view(whole.param.zero3_shape or (1,))
            chunk = whole.padded_rows * whole.row_numel
            for q in range(whole.size):
                start, rows = row_share(tuple(whole.param.zero3_shape), whole.size, q)
                if rows:
                    piece = out[q * chunk : q * chunk + rows * whole.row_numel]
                    rows_of.narrow(0, start, rows).copy_(piece.view(rows, *rows_of.shape[1:]))
        self.is_whole.add(id(whole.param))

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.blocks.clear()


class ShardedParameters(ShardedGradients):
    """ZeRO-3: ZeRO-2's gradients, and each trainable parameter kept as this rank's rows between uses
    (`ShardedParams`, which the pipeline executor calls around every block); every replica saves and
    loads its own rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.params: ShardedParams | None = None

    def rows_at_rest(self, p: nn.Parameter) -> tuple[int, int] | None:
        if not p.requires_grad:  # frozen (a router's balancing bias): whole on every rank
            return None
        _, size, rank = self.replicas(p)
        return row_share(tuple(p.shape), size, rank)

    def build(self, chunk_params: list[list[nn.Parameter]], chunk_modules: list[list[list[nn.Module]]]) -> None:
        super().build(chunk_params, chunk_modules)
        trainable = [p for chunk in chunk_params for p in chunk]
        self.params = ShardedParams(chunk_modules, trainable, self.replicas)
        self.block_parameters = self.params

    def end_pass(self) -> None:
        if self.params is not None:
            self.params.release_all()

    def trainable(self, name: str, p: nn.Parameter, writer: bool, dp: ReplicaGroup | None) -> TrainableParam:
        """As under sharded gradients, plus the rows this rank holds of the parameter itself."""
        return attrs.evolve(super().trainable(name, p, writer, dp), param_rows=p.zero3_shard)

    def saved_piece(self, t: TrainableParam) -> ShardedTensor | None:
        """Every replica writes its own rows (frozen parameters are whole: the first replica writes)."""
        if t.param_rows is None or t.grad_rows is None:
            return super().saved_piece(t)
        if not t.writer or t.grad_rows[1] == 0:
            return None
        rows = t.param_rows.reshape(()) if not t.shape else t.param_rows
        return ShardedTensor(t.name, rows, rows_placement(t.placement, t.shape, t.grad_rows), trained=True)

    def load(self, t: TrainableParam, reader: ShardReader) -> None:
        """Read this rank's rows only."""
        if t.param_rows is None or t.grad_rows is None:
            return super().load(t, reader)
        if t.grad_rows[1] == 0:
            return None
        rows = t.param_rows.reshape(()) if not t.shape else t.param_rows
        placement = rows_placement(t.placement, t.shape, t.grad_rows)
        rows.copy_(reader.read(t.name, placement, tuple(rows.shape), dtype=rows.dtype))
        return None

    def held(self, p: nn.Parameter) -> torch.Tensor:
        return getattr(p, "zero3_shard", p)

    def close(self) -> None:
        if self.params is not None:
            self.params.close()
        self.params = self.block_parameters = None
        super().close()
