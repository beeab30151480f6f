"""The engine's fused cross-entropy equals torch's, value and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanocore_plugins.parallel.loss import cross_entropy
from tests.helpers.compare import rel_diff


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cross_entropy_matches_torch(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 50, generator=g) * 4).to(dtype)
    labels = torch.randint(0, 50, (3, 7), generator=g)
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    loss = cross_entropy(ours, labels)
    expected = F.cross_entropy(theirs.flatten(0, 1).float(), labels.flatten())
    (loss * 3).backward()
    (expected * 3).backward()
    assert loss.dtype == torch.float32
    assert rel_diff(loss, expected) <= 1e-6
    assert ours.grad.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bfloat16 gradients round to 8 bits
    assert rel_diff(ours.grad.float(), theirs.grad.float()) <= tolerance
