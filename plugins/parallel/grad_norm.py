"""The global gradient norm, each element counted once over every axis.

A rank sums the squares of what it writes (`TrainableParam.writer`: one TP rank per replicated
piece, the first stage for a tied pair split over stages); the data-parallel strategy adds what other
replicas hold under ZeRO-2/3 (their rows); expert parallelism adds the other ranks' experts; TP and
PP add the other pieces of the model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanocore.engine_api import TrainableParam

from .data_parallel import DataParallel
from .grid import ProcessGrid


def global_grad_norm(
    trainables: list[TrainableParam], data_parallel: DataParallel, grid: ProcessGrid, device: torch.device
) -> float:
    # one multi-tensor norm per kind, no squared copies of the gradients
    dense = _sum_of_squares([t.grad for t in trainables if t.writer and t.dp is None], device)
    experts = _sum_of_squares([t.grad for t in trainables if t.writer and t.dp is not None], device)
    data_parallel.square_sums(dense, experts)  # ZeRO-2/3: each replica holds other rows
    if grid.ep > 1:  # each expert-parallel rank holds other experts
        dist.all_reduce(experts, group=grid.ep_group)
    dense += experts
    if grid.distributed and grid.tp * grid.pp > 1:
        dist.all_reduce(dense, group=grid.mp_group)
    return float(dense.sqrt())


def _sum_of_squares(tensors: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    present = [t for t in tensors if t is not None and t.numel()]
    if not present:
        return torch.zeros((), dtype=torch.float32, device=device)
    if all(t.dtype == torch.float32 for t in present):
        norms = torch._foreach_norm(present)  # what torch.nn.utils.clip_grad_norm_ uses
    else:  # bfloat16 gradients: each norm accumulated in float32
        norms = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in present]
    return torch.stack(list(norms)).pow(2).sum()
