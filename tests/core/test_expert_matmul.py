"""`nanocore.moe_api.expert_matmul`: torch's grouped matmul (bfloat16, on this CPU too) equals one
matmul per expert, forward and both gradients.

Both paths take the same bfloat16 operands, accumulate in float32 and round the result to bfloat16,
so they can differ by the rounding of that last step (and a different summation order before it):
half a bfloat16 unit in the last place, 2^-9 of an element's size, up to one unit (2^-8) where the
two sums straddle a rounding boundary. Compared by `rel_diff` (relative to the tensor's largest
element), the bound is 2^-8; a wrong expert assignment or a transposed weight is off by O(1).
"""

from __future__ import annotations

import pytest
import torch

import nanocore.moe_api as moe_api
from nanocore.moe_api import expert_matmul, grouped_mm_supported
from tests.helpers.compare import rel_diff

BOUND = 2**-8


def _run(x: torch.Tensor, w: torch.Tensor, counts: list[int], grad: torch.Tensor):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = expert_matmul(x, w, counts)
    y.backward(grad)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("counts", [[5, 3, 9, 7], [0, 12, 0, 12], [24, 0, 0, 0], [0, 0, 0, 24]])
def test_grouped_matmul_equals_the_per_expert_loop_forward_and_gradients(counts, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    rows, experts, out, inner = sum(counts), len(counts), 48, 32
    x = torch.randn(rows, inner, generator=generator).bfloat16()
    w = (torch.randn(experts, out, inner, generator=generator) / inner**0.5).bfloat16()
    grad = torch.randn(rows, out, generator=generator).bfloat16()
    assert grouped_mm_supported(x), "torch 2.13 has a CPU bfloat16 grouped matmul: the path must be taken here"

    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    grouped = _run(x, w, counts, grad)
    assert calls, "the grouped path was not taken"
    monkeypatch.setattr(moe_api, "USE_GROUPED_MM", False)
    looped = _run(x, w, counts, grad)
    assert len(calls) == 1, "USE_GROUPED_MM = False must take the per-expert loop"

    for name, a, b in zip(("output", "input gradient", "weight gradient"), grouped, looped, strict=True):
        assert a.dtype == b.dtype == torch.bfloat16
        assert rel_diff(a, b) <= BOUND, (name, rel_diff(a, b))
    # an expert without rows gets a zero gradient, not garbage
    for e, n in enumerate(counts):
        if n == 0:
            assert grouped[2][e].abs().max() == 0


def test_grouped_matmul_takes_a_broadcast_output_gradient():
    """`y.sum().backward()` hands the grouped matmul's backward a stride-0 gradient, which it refuses
    unless made contiguous first."""
    x = torch.randn(10, 16).bfloat16().requires_grad_()
    w = torch.randn(3, 8, 16).bfloat16().requires_grad_()
    expert_matmul(x, w, [3, 3, 4]).sum().backward()
    assert x.grad is not None and w.grad is not None


def test_float32_takes_the_per_expert_loop():
    assert not grouped_mm_supported(torch.zeros(2, 2))
