"""ZeRO-3: each data-parallel rank keeps only its rows of every trainable parameter between uses.

At rest a parameter's `.data` is an empty tensor and `shard` holds this rank's rows
(`row_share`, the cut the optimizer and the gradient buffers use). The pipeline executor asks for a
block's parameters before the block runs (`gather`: one all-gather of every rank's rows of the
block's parameters, padded to the largest rank's share) and hands them back after its forward
(`release`). A hook on the block's output gathers them again just before the block's backward; each
parameter is released as soon as autograd has accumulated its gradient (after which this backward
no longer needs it). The next block's gather is started while the current block runs (prefetch),
so at most two blocks are whole at a time.

Gradients are reduce-scattered as under ZeRO-2 (`ShardedGradBuffers`); the optimizer steps the
shards in place, so there is no exchange of updated rows: the next gather reads them.
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


class _BlockGather:
    """One block's parameters of one replica group, each gathered by its own all-gather of every
    rank's rows padded to the largest share: where the shares line up with the padding (rows divisible
    by the group size, the usual case) the gathered buffer *is* the whole parameter, so a gather
    allocates the block once and copies nothing; otherwise the rows are copied out of it."""

    def __init__(self, params: list[nn.Parameter], size: int, rank: int, group):
        self.params, self.size, self.rank, self.group = params, size, rank, group
        self.row_numel = [_rows_view_numel(p) for p in params]
        self.padded_rows: list[int] = []  # rows each rank sends of each parameter
        self.in_place: list[bool] = []  # rank q's rows start at q * padded_rows: the buffer is the tensor
        for p in params:
            shares = [row_share(tuple(p.zero3_shape), size, q) for q in range(size)]
            padded = max(rows for _, rows in shares)
            self.padded_rows.append(padded)
            self.in_place.append(all(start == q * padded for q, (start, _) in enumerate(shares)))
        self.pending = None  # the (work, out, send) of each parameter's prefetched all-gather


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _rows_view_numel(p: nn.Parameter) -> int:
    shape = p.zero3_shape
    if not shape:
        return 1
    return int(torch.Size(shape[1:]).numel()) if shape[0] else 0


class ShardedParams:
    """Owns where ZeRO-3 parameters live; see the module docstring."""

    def __init__(
        self,
        chunk_modules: list[list[list[nn.Module]]],
        trainable: list[nn.Parameter],
        group_of: Callable[[nn.Parameter], tuple[object, int, int]],
    ):
        """`group_of(p)` -> (group, size, rank) of the data-parallel ranks holding replicas of `p`."""
        self.empty: dict[tuple, torch.Tensor] = {}
        wanted = {id(p) for p in trainable}
        self.params: list[nn.Parameter] = []
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
            p.zero3_whole = False
            self.params.append(p)
        # per chunk, per block: one gather per replica group (expert weights have their own)
        self.blocks: list[list[list[_BlockGather]]] = []
        for chunk in chunk_modules:
            row = []
            for modules in chunk:
                params, ids = [], set()
                for module in modules:
                    for p in module.parameters():
                        if id(p) in wanted and id(p) not in ids:
                            ids.add(id(p))
                            params.append(p)
                by_group: dict[int, list[nn.Parameter]] = {}
                groups: dict[int, tuple] = {}
                for p in params:
                    g = group_of(p)
                    by_group.setdefault(id(g[0]), []).append(p)
                    groups[id(g[0])] = g
                row.append([_BlockGather(ps, groups[k][1], groups[k][2], groups[k][0]) for k, ps in by_group.items()])
            self.blocks.append(row)
        self._hooks = [p.register_post_accumulate_grad_hook(self._release_one) for p in self.params]
        for p in self.params:
            self._free(p)

    # -- at rest and whole ---------------------------------------------------------------
    def _free(self, p: nn.Parameter) -> None:
        key = (p.dtype, p.device)
        if key not in self.empty:
            self.empty[key] = torch.empty(0, dtype=p.dtype, device=p.device)
        p.data = self.empty[key]
        p.zero3_whole = False

    def _release_one(self, p: nn.Parameter) -> None:
        """Autograd has accumulated p's gradient: this backward needs p no more."""
        self._free(p)

    def gather(self, c: int, b: int) -> None:
        """Make block b of chunk c whole (waiting for its prefetch if one was started)."""
        for gather in self.blocks[c][b]:
            self._finish(gather, self._start(gather) if gather.pending is None else gather.pending)
            gather.pending = None

    def prefetch(self, c: int, b: int) -> None:
        """Start gathering block b of chunk c (the next to run) without waiting."""
        if not (0 <= c < len(self.blocks) and 0 <= b < len(self.blocks[c])):
            return
        for gather in self.blocks[c][b]:
            if gather.pending is None and not all(p.zero3_whole for p in gather.params):
                gather.pending = self._start(gather, async_op=True)

    def release(self, c: int, b: int) -> None:
        for gather in self.blocks[c][b]:
            for p in gather.params:
                self._free(p)

    def release_all(self) -> None:
        for row in self.blocks:
            for block in row:
                for gather in block:
                    if gather.pending is not None:
                        for work, _, _ in gather.pending:
                            if work is not None:
                                work.wait()
                        gather.pending = None
        for p in self.params:
            self._free(p)

    def _start(self, gather: _BlockGather, async_op: bool = False) -> list:
        started = []
        for p, padded, per_row in zip(gather.params, gather.padded_rows, gather.row_numel, strict=True):
            shard = p.zero3_shard.reshape(-1)
            if shard.numel() != padded * per_row:  # fewer rows than the largest share: pad
                send = torch.zeros(padded * per_row, dtype=p.dtype, device=p.device)
                send[: shard.numel()].copy_(shard)
            else:
                send = shard
            if gather.size == 1:
                started.append((None, send, send))
                continue
            out = torch.empty(padded * per_row * gather.size, dtype=p.dtype, device=p.device)
            work = all_gather_single(out, send, group=gather.group, async_op=async_op)
            started.append((work if async_op else None, out, send))  # send lives until the gather is done
        return started

    def _finish(self, gather: _BlockGather, started: list) -> None:
        for i, (p, (work, out, _)) in enumerate(zip(gather.params, started, strict=True)):
            if work is not None:
                work.wait()
            if p.zero3_whole:
                continue
            shape, numel = p.zero3_shape, _numel(p.zero3_shape)
            if gather.in_place[i]:
                p.data = out[:numel].view(shape)
            else:
                full = torch.empty(shape, dtype=p.dtype, device=p.device)
                rows_of = full.reshape(1) if full.dim() == 0 else full
                chunk = gather.padded_rows[i] * gather.row_numel[i]
                for q in range(gather.size):
                    start, rows = row_share(tuple(shape), gather.size, q)
                    if rows:
                        piece = out[q * chunk : q * chunk + rows * gather.row_numel[i]]
                        rows_of.narrow(0, start, rows).copy_(piece.view(rows, *rows_of.shape[1:]))
                p.data = full
            p.zero3_whole = True

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
