"""Expert parallelism: the engine's `nanocore.moe_api.ExpertRuntime`, and the experts' place in the grid.

Experts are split over the `ep` ranks of an expert-parallel group (consecutive data-parallel
ranks, same pp and tp rank): rank e holds experts [e * E/ep, (e + 1) * E/ep). A MoE layer sorts its
token slots by expert; `dispatch` first tells every peer how many rows of each of its experts are
coming (one all-to-all of counts), then sends the rows (an all-to-all with variable sizes) and
regroups what arrived by local expert (rows of expert 0 from every source rank, then expert 1...).
`combine` undoes both steps. Backward runs the same messages in the other direction.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from nanocore.moe_api import MoELayer, moe_layers, recomputing
from nanocore.sharding import get_placement, set_placement

from .pruned import under_pruned_block

EXPERT_ATTR = "_nanocore_expert"


class _AllToAll(torch.autograd.Function):
    """All-to-all of rows with variable sizes; its gradient is the all-to-all the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(
            out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group
        )
        return out, None, None, None


@attrs.define
class _Handle:
    send: list[int]  # rows sent to each peer
    recv: list[int]  # rows received from each peer
    order: torch.Tensor  # received row i (grouped by local expert) is arrival row order[i]


class ExpertParallel:
    """`ExpertRuntime` over the expert-parallel group; `token_group` holds the other token shards of a
    micro-batch (the TP group under sequence parallelism), summed over by `token_sum`."""

    def __init__(self, ep_group, ep_size: int, ep_rank: int, token_group=None):
        self.group, self.ep_size, self.ep_rank = ep_group, ep_size, ep_rank
        self.token_group = token_group
        self.grad_scale = 1.0
        self.received: list[int] = []  # rows each dispatch since `pop_received` brought this rank

    def pop_received(self) -> list[int]:
        """The rows each forward dispatch since the last call brought this rank (recomputation's
        dispatches left out), in call order: the same dispatches on every rank of the group."""
        received, self.received = self.received, []
        return received

    @torch.compiler.disable  # all-to-all with data-dependent sizes: eager inside a compiled layer
    def dispatch(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> tuple[torch.Tensor, list[int], Any]:
        ep = self.ep_size
        if ep == 1:
            return x, [int(n) for n in tokens_per_expert.tolist()], None
        local = tokens_per_expert.numel() // ep
        counts = tokens_per_expert.reshape(ep, local).to(torch.int64)
        incoming = torch.empty_like(counts)  # incoming[r, j]: rows of my local expert j from peer r
        dist.all_to_all_single(incoming, counts.contiguous(), group=self.group)
        send = counts.sum(1).tolist()
        recv = incoming.sum(1).tolist()
        if not recomputing():
            self.received.append(sum(recv))
        arrived = _AllToAll.apply(x, send, recv, self.group)
        # arrival order is (peer, local expert); regroup it as (local expert, peer)
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=x.device).repeat(ep), incoming.reshape(-1).to(x.device)
        )
        order = torch.argsort(expert_of_row, stable=True)
        per_expert = incoming.sum(0).tolist()
        return arrived.index_select(0, order), per_expert, _Handle(send, recv, order)

    @torch.compiler.disable  # all-to-all with data-dependent sizes: eager inside a compiled layer
    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        if handle is None:
            return y
        arrived = torch.empty_like(y).index_copy(0, handle.order, y)
        return _AllToAll.apply(arrived, handle.recv, handle.send, self.group)

    def attach(self, model: nn.Module, names: list[str]) -> dict[int, MoELayer]:
        """Hand each MoE layer of the whole model's `names` that this rank holds the runtime:
        index among `names` -> the local layer (a pipeline stage holds some of them)."""
        local = {}
        for index, name in enumerate(names):
            if under_pruned_block(model, name):  # on another pipeline stage
                continue
            layer = model.get_submodule(name)
            if isinstance(layer, MoELayer):
                layer.set_runtime(self)
                local[index] = layer
        return local

    @torch.compiler.disable  # all-to-all with data-dependent sizes: eager inside a compiled layer
    def token_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.token_group is None:
            return t
        t = t.detach().clone()
        dist.all_reduce(t, group=self.token_group)
        return t


def sync_load(received: list[int], group, ep: int, device: torch.device) -> tuple[float, int]:
    """(the sum over dispatches of the busiest rank's rows over the balanced share, the dispatches)
    of this ep group, from each rank's `pop_received`: each dispatch's combine waits for the busiest
    rank's experts, so the mean share is what a step's expert compute is stretched by."""
    if ep <= 1 or not received:
        return 0.0, 0
    mine = torch.tensor(received, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(ep)]
    dist.all_gather(every, mine, group=group)
    rows = torch.stack(every).cpu()
    total = rows.sum(0)
    busy = total > 0
    shares = rows.max(0).values[busy] / (total[busy] / ep)
    return float(shares.sum()), int(busy.sum())


def shard_experts(model: nn.Module, ep_size: int, ep_rank: int) -> None:
    """Keep this rank's experts of every stacked expert parameter (on the meta device, before
    materialisation): a [E, ...] parameter becomes [E/ep, ...] with its place in the full tensor."""
    for layer_name in moe_layers(model):
        if under_pruned_block(model, layer_name):  # in a block another pipeline stage holds (the memory planner)
            continue
        layer = model.get_submodule(layer_name)
        experts = int(layer.num_experts)
        if experts % ep_size:
            raise ValueError(f"{layer_name}: {experts} experts cannot be split over {ep_size} ranks")
        local = experts // ep_size
        for name in layer.expert_parameters:
            parent_name, _, attr = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            param = getattr(parent, attr)
            if param.shape[0] != experts:
                raise ValueError(f"{layer_name}.{name}: first dimension {param.shape[0]} is not the {experts} experts")
            if ep_size > 1:
                placement, shape = get_placement(param).narrow(0, ep_rank * local, local, tuple(param.shape))
                new = nn.Parameter(torch.empty(shape, dtype=param.dtype, device=param.device), param.requires_grad)
                set_placement(new, placement)
                setattr(parent, attr, new)
                param = new
            setattr(param, EXPERT_ATTR, True)


def is_expert(param: torch.Tensor) -> bool:
    return bool(getattr(param, EXPERT_ATTR, False))
