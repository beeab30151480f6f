"""ZeRO stages 0 and 1 over the engine's reduced gradients.

Stage 0 keeps the optimizer state (and fp32 master weights, when parameters are bf16/fp16) on
every data-parallel rank. Stage 1 gives DP rank r only rows [a_r, b_r) of every parameter (its
first dimension split evenly): master weights and optimizer state exist for those rows alone, each
rank updates its rows, and the updated rows are exchanged. Because a row-slice of a parameter is a
rectangle of the full tensor, optimizer state is saved with its place in the full tensor, so a
checkpoint written at dp=2 loads at dp=4, or without ZeRO. The slots' placements carry the
parameter's vocabulary padding (`valid_rows`), so padding rows of state are never saved and load
as zeros, at any tp.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from nanocore.checkpoint.tensors import ShardedTensor, ShardReader
from nanocore.engine_api import TrainableParam
from nanocore.sharding import Placement, shard_range


class _Slot:
    """What the torch optimizer updates for one parameter: a master tensor and its gradient."""

    def __init__(self, t: TrainableParam, start: int, length: int, sharded: bool, dp):
        self.t, self.start, self.length, self.dp = t, start, length, dp
        whole = not sharded or t.param.dim() == 0
        local_shape = tuple(t.param.shape)
        if whole:
            self.placement, self.shape = t.placement, local_shape
            param_view, grad_view = t.param.data, t.grad
        else:
            self.placement, self.shape = t.placement.narrow(0, start, length, local_shape)
            param_view, grad_view = t.param.data.narrow(0, start, length), t.grad.narrow(0, start, length)
        self.param_view = param_view
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
        build_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
        dp,
        *,
        sharded: bool,
    ):
        self.dp, self.sharded = dp, sharded
        self.slots: list[_Slot] = []
        for t in params:
            group = t.dp or dp  # expert weights: the ranks holding the same experts
            if sharded and t.param.dim() > 0:
                start, length = shard_range(t.param.shape[0], group.size, group.rank)
            else:
                start, length = 0, t.param.shape[0] if t.param.dim() else 1
            self.slots.append(_Slot(t, start, length, sharded, group))
        decay = [s.master for s in self.slots if s.t.weight_decay]
        no_decay = [s.master for s in self.slots if not s.t.weight_decay]
        groups = [g for g in ({"params": decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        self.optimizer = build_optimizer(groups)

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
        if self.sharded:
            groups: dict[int, list[_Slot]] = {}
            for slot in self.slots:  # one exchange per replica group, in the same order on every rank
                groups.setdefault(id(slot.dp), []).append(slot)
            for slots in groups.values():
                if slots[0].dp.size > 1:
                    self._exchange_rows(slots)

    @staticmethod
    def _exchange_rows(slots: list[_Slot]) -> None:
        """Every rank of the slots' group gets every rank's updated rows: zero the rows it does not own, then sum."""
        dp = slots[0].dp
        flat = []
        for slot in slots:
            p = slot.t.param.data
            if p.dim() == 0:
                flat.append(p.reshape(1) if dp.rank == 0 else torch.zeros_like(p).reshape(1))
                continue
            mine = torch.zeros_like(p)
            mine.narrow(0, slot.start, slot.length).copy_(p.narrow(0, slot.start, slot.length))
            flat.append(mine.reshape(-1))
        buffer = torch.cat(flat)
        dist.all_reduce(buffer, group=dp.group)
        offset = 0
        for slot in slots:
            p = slot.t.param.data
            n = p.numel()
            p.copy_(buffer[offset : offset + n].view_as(p))
            offset += n

    # -- checkpoints ----------------------------------------------------------------------
    def _writes(self, slot: _Slot) -> bool:
        return slot.t.writer and (self.sharded or slot.dp.rank == 0)

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

    def expected_state_bytes(self, states_per_element: int) -> int:
        """Bytes this rank holds once the optimizer keeps `states_per_element` fp32 tensors per element
        (AdamW: 2) of the rows it updates, plus fp32 master copies of lower-precision parameters."""
        total = 0
        for slot in self.slots:
            if self.sharded and slot.t.param.dim() > 0 and slot.length == 0:
                continue
            numel = slot.master.numel()
            total += numel * 4 * states_per_element + (numel * 4 if slot.separate_master else 0)
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
