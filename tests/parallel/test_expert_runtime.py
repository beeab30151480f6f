"""The expert-parallel runtime: tokens reach the rank holding their expert and come back in order.

Each rank routes its own rows to experts (random counts, some experts getting no row at all);
`dispatch` must hand every rank exactly the rows of its experts from every peer, grouped by local
expert, and `combine` must return each processed row to where it came from. Gradients travel back
the same way. Compared with doing the same computation on one process, with all experts local.
"""

from __future__ import annotations

import pytest
import torch

from nanocore.moe_api import LocalExperts
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.slow

EXPERTS, HIDDEN = 8, 3


def _rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows sorted by expert and the count per expert (reproducible per rank)."""
    g = torch.Generator().manual_seed(100 + rank)
    counts = torch.randint(0, 4, (EXPERTS,), generator=g)
    counts[rank % EXPERTS] = 0  # some expert gets nothing from this rank
    x = torch.randn(int(counts.sum()), HIDDEN, generator=g)
    return x, counts


def _expert_fn(rows: torch.Tensor, counts: list[int], first_expert: int) -> torch.Tensor:
    """A different map per expert: row * (expert id + 1) + expert id."""
    parts = [part * (first_expert + e + 1) + (first_expert + e) for e, part in enumerate(torch.split(rows, counts))]
    return torch.cat(parts) if parts else rows


def _reference(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, counts = _rows(rank)
    x.requires_grad_(True)
    runtime = LocalExperts()
    rows, local_counts, handle = runtime.dispatch(x, counts)
    y = runtime.combine(_expert_fn(rows, local_counts, 0), handle)
    (y * torch.arange(1, y.numel() + 1, dtype=y.dtype).view_as(y)).sum().backward()
    return y.detach(), x.grad


def _ranked(rank: int, world_size: int):
    import torch.distributed as dist

    from nanocore_plugins.parallel.expert_parallel import ExpertParallel

    runtime = ExpertParallel(dist.group.WORLD, world_size, rank)
    x, counts = _rows(rank)
    x.requires_grad_(True)
    rows, local_counts, handle = runtime.dispatch(x, counts)
    local = EXPERTS // world_size
    expected_counts = [sum(int(_rows(r)[1][rank * local + j]) for r in range(world_size)) for j in range(local)]
    y = runtime.combine(_expert_fn(rows, local_counts, rank * local), handle)
    (y * torch.arange(1, y.numel() + 1, dtype=y.dtype).view_as(y)).sum().backward()
    return {"counts": local_counts, "expected_counts": expected_counts, "y": y.detach(), "grad": x.grad}


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_combine_equal_one_process(ep):
    results = run_ranks(ep, _ranked)
    for rank, result in enumerate(results):
        assert result["counts"] == result["expected_counts"]
        y, grad = _reference(rank)
        torch.testing.assert_close(result["y"], y, rtol=0, atol=0)  # rows move, values are not recomputed
        torch.testing.assert_close(result["grad"], grad, rtol=0, atol=0)
