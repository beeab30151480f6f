"""A step's routing statistics over every rank: what each MoE layer of the whole model saw.

Each local MoE layer reports a `nanocore.moe_api.MoEStatistics`; the pipeline stages hold different
layers and the data-parallel ranks saw different tokens, so the step's figures are one sum over
every rank. Named fields travel packed in one float64 all-reduce and are unpacked by name.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from nanocore.moe_api import MoELayer

from .grid import ProcessGrid


@attrs.define
class StepRoutingStatistics:
    """Per MoE layer of the whole model (rows in the model's MoE-layer order), summed over ranks."""

    tokens_per_expert: torch.Tensor  # [layers, most experts]: routed token slots
    aux_loss: torch.Tensor  # [layers]: sum over micro-batches of the load-balancing loss
    z_loss: torch.Tensor  # [layers]: sum over micro-batches of the router z-loss
    micro_batches: torch.Tensor  # [layers]: recorded micro-batches
    has_aux_loss: torch.Tensor  # [layers]: > 0 where the layer computes one
    has_z_loss: torch.Tensor  # [layers]: > 0 where the layer computes one
    # under expert parallelism: [1] each, the sum over the step's forward dispatches of every ep group
    # of the busiest rank's rows over the balanced share, and how many dispatches (`sync_load`)
    sync_shares: torch.Tensor
    sync_dispatches: torch.Tensor

    @classmethod
    def zeros(cls, layers: int, experts: int) -> StepRoutingStatistics:
        def zero(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.float64)

        fields = (zero(layers, experts), zero(layers), zero(layers), zero(layers), zero(layers), zero(layers))
        return cls(*fields, zero(1), zero(1))

    @classmethod
    def of_step(
        cls,
        local: dict[int, MoELayer],
        layers: int,
        experts: int,
        grid: ProcessGrid,
        sync: tuple[float, int] = (0.0, 0),
    ) -> StepRoutingStatistics:
        """What the `layers` MoE layers of the model saw this step, summed over every rank; `local` maps
        an index among them to this rank's layer; `sync`: this rank's ep group's `sync_load`."""
        stats = cls.zeros(layers, experts)
        keep = grid.tp_rank == 0 and grid.cp_rank == 0  # TP and CP ranks hold the same (summed) figures
        for index, layer in local.items():
            stats.record(index, layer, keep)
        if keep and grid.ep_rank == 0:  # the group's ranks hold the same figures
            stats.sync_shares[0], stats.sync_dispatches[0] = sync
        if grid.distributed:
            stats.all_reduce(grid.device)
        return stats

    def update_router_biases(self, local: dict[int, MoELayer]) -> None:
        """Bias-balanced routers (DeepSeek-V3) follow the step's load: what every rank routed."""
        for index, layer in local.items():
            update = getattr(layer, "update_router_bias", None)
            if update is not None:
                update(self.tokens_per_expert[index])

    def record(self, index: int, layer: MoELayer, keep: bool) -> None:
        """Take what local layer `index` (among the model's MoE layers) saw since the last step; `keep`
        is False on the ranks that hold copies of another rank's figures (tp and cp ranks other than 0)."""
        stats = layer.pop_statistics()
        if stats is None or not keep:
            return
        self.tokens_per_expert[index, : int(layer.num_experts)] = stats.tokens_per_expert.detach().to(
            "cpu", torch.float64
        )
        self.aux_loss[index] = stats.aux_loss or 0.0
        self.z_loss[index] = stats.z_loss or 0.0
        self.micro_batches[index] = stats.micro_batches
        self.has_aux_loss[index] = float(stats.aux_loss is not None)
        self.has_z_loss[index] = float(stats.z_loss is not None)

    def all_reduce(self, device: torch.device) -> None:
        """Sum every field over all ranks (one collective)."""
        fields = attrs.fields(type(self))
        tensors = [getattr(self, f.name) for f in fields]
        packed = torch.cat([t.reshape(-1) for t in tensors]).to(device)
        dist.all_reduce(packed)
        packed = packed.cpu()
        offset = 0
        for field, tensor in zip(fields, tensors, strict=True):
            setattr(self, field.name, packed[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()

    def metrics(self, ep: int = 1) -> dict[str, float]:
        """`moe_aux_loss` and `moe_z_loss` (each layer's mean over the step's micro-batches, summed over
        layers, where any layer has one), `moe_max_load` (the busiest expert's tokens over the mean,
        worst layer) and, under expert parallelism (`ep` > 1, experts split in contiguous runs as the
        dispatch does), `moe_rank_load`: the busiest ep rank's routed tokens summed over the sparse
        layers, over the balanced share. That is what the memory plan's `--expert-load-factor` means
        (a rank holds every sparse layer's routed activations at once), between 1 and ep; moe_max_load
        can reach experts / top_k even when every rank gets its share. `moe_sync_load` (under expert
        parallelism too): each forward dispatch's busiest ep rank's rows over the balanced share, the
        mean over the step's dispatches: each dispatch's combine waits for that rank's experts, so it
        is what stretches a step's expert compute (the time model's expert-load factor). Every
        dispatch carries the same slots (tokens x top-k), so it is at least moe_rank_load (a mean of
        maxima, not the maximum of a mean) and a memory plan made with it is safe too. Empty
        when a layer recorded no forward (e.g. a step of evaluation only)."""
        batches = self.micro_batches
        if not bool((batches > 0).all()):
            return {}
        metrics = {}
        if bool((self.has_aux_loss > 0).any()):
            metrics["moe_aux_loss"] = float((self.aux_loss / batches).sum())
        if bool((self.has_z_loss > 0).any()):
            metrics["moe_z_loss"] = float((self.z_loss / batches).sum())
        counts = self.tokens_per_expert
        mean = counts.mean(dim=1).clamp_min(1e-12)
        metrics["moe_max_load"] = float((counts.max(dim=1).values / mean).max())
        layers, experts = counts.shape
        total = float(counts.sum())
        if ep > 1 and experts % ep == 0 and total > 0:
            per_rank = counts.reshape(layers, ep, experts // ep).sum(dim=(0, 2))
            metrics["moe_rank_load"] = float(per_rank.max()) / (total / ep)
        if ep > 1 and float(self.sync_dispatches[0]) > 0:
            metrics["moe_sync_load"] = float(self.sync_shares[0] / self.sync_dispatches[0])
        return metrics
