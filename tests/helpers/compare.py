"""Compare floats by their size: a relative difference for numbers and tensors.

Float32 results that are computed in a different order (split over ranks, summed in buckets, another
kernel) differ by an amount proportional to the size of what was summed, not by a fixed amount: a
sum of N terms is off by up to N·eps of its magnitude (eps = 1.2e-7), typically sqrt(N)·eps. So
tolerances are relative; an absolute one would be too loose for small values and fail on large
sums, on one machine and not another.

`rel_diff` measures a tensor by max|a - b| relative to max(max|a|, max|b|): every element is held
to the same fraction of the tensor's scale (elements near zero are not held to their own size,
which reordering cannot promise, yet a wrong element still shows at the scale of its tensor). Use it
for what is computed directly (logits, gradients).

`norm_rel_diff` is ||a - b|| / max(||a||, ||b||) in the 2-norm, for trained weights: Adam divides
each element's gradient by that element's own RMS, so an element whose gradient is near zero takes
steps (up to lr each) that rounding decides; the tensor as a whole still moves as its gradient says,
and a wrong gradient moves all of it.
"""

from __future__ import annotations

import torch

_TINY = torch.finfo(torch.float32).tiny  # both zero compares as 0, a difference from zero as huge


def rel_diff(a: float | torch.Tensor, b: float | torch.Tensor, scale: float = 0.0) -> float:
    """|a - b| / max(|a|, |b|) for numbers; max|a - b| / max(max|a|, max|b|) for tensors.

    `scale` is a floor for the denominator, for a value that is zero up to rounding (a gradient that
    cancels exactly): its own size is rounding noise, so pass the size of the terms that cancelled.
    Symmetric, 0 for equal values, NaN when either side holds a NaN (so `rel_diff(...) <= tol` fails).
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        assert a.shape == b.shape, (a.shape, b.shape)
        a, b = a.detach().double(), b.detach().double()
        if a.numel() == 0:
            return 0.0
        diff = (a - b).abs().max().item()
        size = max(a.abs().max().item(), b.abs().max().item())
    else:
        diff = abs(float(a) - float(b))
        size = max(abs(float(a)), abs(float(b)))
    return diff / max(size, scale, _TINY)


def norm_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||a||, ||b||) in the 2-norm (Frobenius for matrices); NaN when either holds a NaN."""
    assert a.shape == b.shape, (a.shape, b.shape)
    a, b = a.detach().double(), b.detach().double()
    size = max(a.norm().item(), b.norm().item())
    return (a - b).norm().item() / max(size, _TINY)
