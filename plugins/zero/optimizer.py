"""ZeRO stages 0 and 1 over the engine's reduced gradients.

Stage 0 keeps the optimizer state (and fp32 master weights, when parameters are bf16/fp16) on
every data-parallel rank. Stage 1 gives DP rank r only rows [a_r, b_r) of every parameter (its
first dimension split evenly): master weights and optimizer state exist for those rows alone, each
rank updates its rows, and the updated rows are exchanged. Because a row-slice of a parameter is a
rectangle of the full tensor, optimizer state is saved with its place in the full tensor, so a
checkpoint written at dp=2 loads at dp=4, or without ZeRO. The slots' placements carry the
parameter's vocabulary padding (`valid_rows`), so padding rows of state are never saved and load
as zeros, at any tp.

Stage 2 is stage 1 over gradients the engine reduce-scattered during backward: each rank's
gradient buffer holds only its own rows (`TrainableParam.grad_rows`), so no rank ever keeps a full
reduced gradient between steps. Stages 1 and 2 exchange the updated rows with one all-gather per
replica group and dtype, in pieces of about `EXCHANGE_BYTES` of parameters: each rank sends its
rows (padded to the largest rank's share), which is half the traffic of all-reducing a zero-padded
full buffer, and no buffer as large as the model is ever allocated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanocore.checkpoint.tensors import ShardedTensor, ShardReader
from nanocore.engine_api import ParamPiece, TrainableParam
from nanocore.errors import PluginError
from nanocore.sharding import Placement, all_gather_single, row_share

# Parameters per all-gather of updated rows: the exchange holds this rank's rows of them and every
# rank's (about this many bytes, plus one parameter), not a copy of the whole model.
EXCHANGE_BYTES = 32 * 2**20


class _Slot:
    """What the torch optimizer updates for one parameter: a master tensor and its gradient."""

    def __init__(self, t: TrainableParam, start: int, length: int, sharded: bool, dp):
        self.t, self.start, self.length, self.dp = t, start, length, dp
        whole = not sharded or (t.param_rows is None and t.param.dim() == 0)
        local_shape = tuple(t.param.shape)
        grad_is_rows = t.grad_rows is not None  # the engine reduce-scattered: `grad` holds these rows only
        if whole:
            self.placement, self.shape = t.placement, local_shape
            param_view, grad_view = t.param.data, t.grad
        elif t.param_rows is not None:  # ZeRO-3: the parameter is whole only while in use; its rows live here
            full_shape = t.shape
            self.placement, self.shape = t.placement.narrow(0, start, length, full_shape)
            param_view, grad_view = t.param_rows, t.grad
        else:
            self.placement, self.shape = t.placement.narrow(0, start, length, local_shape)
            param_view = t.param.data.narrow(0, start, length)
            grad_view = t.grad if grad_is_rows else t.grad.narrow(0, start, length)
        self.param_view = param_view
        # what an optimizer that distributes itself is told (nanocore.engine_api.ParamPiece)
        rows = None if whole else (start, length)
        self.piece = ParamPiece(t.name, t.placement, tuple(t.shape), rows, dp, t.model_parallel, t.hidden_matrix)
        # fp32 parameters are their own master; lower precision ones get an fp32 copy
        self.separate_master = param_view.dtype != torch.float32
        master = param_view.float().clone() if self.separate_master else param_view
        self.master = torch.nn.Parameter(master, requires_grad=False)
        self.grad_view = grad_view

    def load_grad(self) -> None:
        self.master.grad = self.grad_view if self.grad_view.dtype == torch.float32 else self.grad_view.float()

    def write_back(self) -> None:
        if self.separate_master:
            self.param_view.copy_(self.master.data)

    def refresh(self) -> None:
        if self.separate_master:
            self.master.data.copy_(self.param_view.float())


class ZeroOptimizer:
    def __init__(
        self,
        params: list[TrainableParam],
        build_optimizer: Callable[[list[dict], dict[torch.Tensor, ParamPiece]], torch.optim.Optimizer],
        dp,
        *,
        sharded: bool,
    ):
        self.dp, self.sharded = dp, sharded
        self.slots: list[_Slot] = []
        # the parameters whose updated rows are exchanged, per (replica group, dtype), in the same order on every rank
        self.exchanges: list[_RowExchange] = []
        by_group: dict[tuple[int, torch.dtype], list[TrainableParam]] = {}
        for t in params:
            group = t.dp or dp  # expert weights: the ranks holding the same experts
            if sharded and group.size > 1 and t.param_rows is None:  # ZeRO-3's next gather reads the rows
                by_group.setdefault((id(group), t.param.dtype), []).append(t)
            if t.grad_rows is not None:
                if not sharded:
                    raise PluginError(
                        "a replicated ZeRO stage got reduce-scattered gradients (TrainableParam.grad_rows)"
                    )
                start, length = t.grad_rows
                shape = t.shape
                if (start, length) != row_share(shape, group.size, group.rank):
                    raise PluginError(f"{t.name}: the engine's gradient rows {t.grad_rows} are not this rank's share")
                if len(shape) == 0 and length == 0:
                    continue  # a scalar is rank 0's to update; the others receive it in the exchange
            elif sharded and t.param.dim() > 0:
                start, length = row_share(tuple(t.param.shape), group.size, group.rank)
            else:
                start, length = 0, t.param.shape[0] if t.param.dim() else 1
            self.slots.append(_Slot(t, start, length, sharded, group))
        for ts in by_group.values():  # in pieces of about EXCHANGE_BYTES, so the buffers stay small
            piece: list[TrainableParam] = []
            size = 0
            for t in ts:
                piece.append(t)
                size += t.param.numel() * t.param.element_size()
                if size >= EXCHANGE_BYTES:
                    self.exchanges.append(_RowExchange(piece, t.dp or dp))
                    piece, size = [], 0
            if piece:
                self.exchanges.append(_RowExchange(piece, piece[0].dp or dp))
        # decayed or not, hidden matrices (Muon's) or not: optimizers other than Muon ignore the mark
        groups: list[dict] = []
        for matrix in (True, False):
            for decay in (True, False):
                params = [s.master for s in self.slots if s.t.hidden_matrix == matrix and s.t.weight_decay == decay]
                if params:
                    groups.append(
                        {"params": params, "hidden_matrix": matrix, **({} if decay else {"weight_decay": 0.0})}
                    )
        self.optimizer = build_optimizer(groups, {s.master: s.piece for s in self.slots})

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for slot in self.slots:
            slot.load_grad()
        self.optimizer.step()
        for slot in self.slots:
            slot.master.grad = None
            slot.write_back()
        for exchange in self.exchanges:
            exchange.run()

    # -- checkpoints ----------------------------------------------------------------------
    def _writes(self, slot: _Slot) -> bool:
        # a sharded stage's rows are each rank's own; a scalar (and a replicated stage's state) is rank 0's
        return slot.t.writer and ((self.sharded and slot.t.param.dim() > 0) or slot.dp.rank == 0)

    def state_shards(self) -> list[ShardedTensor]:
        out = []
        for slot in self.slots:
            if not self._writes(slot) or (slot.length == 0 and slot.t.param.dim() > 0):
                continue
            state = self.optimizer.state.get(slot.master, {})
            for key, value in state.items():
                if not torch.is_tensor(value):
                    continue
                if value.shape == slot.master.shape and value.dim() > 0:
                    out.append(ShardedTensor(f"{slot.t.name}::{key}", value, slot.placement))
                else:
                    out.append(ShardedTensor(f"{slot.t.name}::{key}", value.reshape(()), Placement.whole(())))
            if slot.separate_master:
                out.append(ShardedTensor(f"{slot.t.name}::master", slot.master.data, slot.placement))
        return out

    @torch.no_grad()
    def load_state(self, reader: ShardReader) -> None:
        state: dict[int, dict] = {}
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        for slot in self.slots:
            prefix = f"{slot.t.name}::"
            entry = {}
            for name in reader.names():
                if not name.startswith(prefix):
                    continue
                key = name[len(prefix) :]
                if reader.full_shape(name) and slot.placement.full_shape:  # shaped like the parameter
                    value = reader.read(name, slot.placement, slot.shape)
                else:
                    value = reader.read(name, Placement.whole(()), ())
                if key == "master":
                    slot.master.data.copy_(value)
                else:
                    entry[key] = value
            if entry:
                state[index[id(slot.master)]] = entry
        current = self.optimizer.state_dict()
        self.optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})

    def refresh_master_weights(self) -> None:
        for slot in self.slots:
            slot.refresh()

    def expected_state_bytes(self, states_per_element: int, matrix_states_per_element: int | None = None) -> int:
        """Bytes this rank holds once the optimizer keeps `states_per_element` fp32 tensors per element
        (AdamW: 2) of the rows it updates (`matrix_states_per_element` of hidden matrices' when given:
        Muon's 1), plus fp32 master copies of lower-precision parameters."""
        total = 0
        for slot in self.slots:
            if self.sharded and slot.t.param.dim() > 0 and slot.length == 0:
                continue
            numel = slot.master.numel()
            states = states_per_element
            if slot.t.hidden_matrix and matrix_states_per_element is not None:
                states = matrix_states_per_element
            total += numel * 4 * states + (numel * 4 if slot.separate_master else 0)
        return total

    def state_bytes(self) -> int:
        total = 0
        for slot in self.slots:
            for value in self.optimizer.state.get(slot.master, {}).values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
            if slot.separate_master:
                total += slot.master.numel() * slot.master.element_size()
        return total


class _RowExchange:
    """After a sharded step, every rank of a replica group gets every rank's updated rows: each sends
    its own rows of every parameter (`row_share`; padded to the largest rank's share) with one
    `all_gather_single` and copies the others' rows into place."""

    def __init__(self, params: list[TrainableParam], dp):
        self.dp = dp
        self.views = [t.param.data.reshape(1) if t.param.dim() == 0 else t.param.data for t in params]
        self.row_numel = [v[0].numel() if v.shape[0] else 0 for v in self.views]
        # shares[q][i] = (start, length) of rank q's rows of parameter i
        self.shares = [[row_share(tuple(t.param.shape), dp.size, q) for t in params] for q in range(dp.size)]
        totals = [sum(n * r for (_, n), r in zip(share, self.row_numel, strict=True)) for share in self.shares]
        self.width = max(totals)

    def run(self) -> None:
        dp, views = self.dp, self.views
        dtype, device = views[0].dtype, views[0].device
        send = torch.zeros(self.width, dtype=dtype, device=device)
        self._pack_or_unpack(send, dp.rank, pack=True)
        out = torch.empty(self.width * dp.size, dtype=dtype, device=device)
        all_gather_single(out, send, group=dp.group)
        for q in range(dp.size):
            if q != dp.rank:
                self._pack_or_unpack(out[q * self.width : (q + 1) * self.width], q, pack=False)

    def _pack_or_unpack(self, flat: torch.Tensor, q: int, *, pack: bool) -> None:
        offset = 0
        for view, (start, length), row in zip(self.views, self.shares[q], self.row_numel, strict=True):
            if length == 0:
                continue
            rows = view.narrow(0, start, length)
            piece = flat[offset : offset + length * row].view_as(rows)
            (piece if pack else rows).copy_(rows if pack else piece)
            offset += length * row
