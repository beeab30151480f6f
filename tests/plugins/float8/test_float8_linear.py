"""An FP8 linear layer (`nanocore_plugins.float8`) against the bfloat16 one: forward and both gradients.

The bound comes from float8 rounding. Casting a value to a float8 format with p stored mantissa bits
changes it by at most half a unit in the last place, u = 2^-(p+1) of its size (e4m3: u = 2^-4,
e5m2: u = 2^-3); over a tensor the relative rounding error is spread roughly uniformly, with an rms
of at most u / sqrt(3). A product of two rounded operands carries both errors, and a dot product
sums independent ones the way it sums the values, so the whole result is off by the rms of the two
operands' errors: ||fp8 - bf16|| / ||bf16|| <= sqrt((u_a^2 + u_b^2) / 3). That is 0.051 for two
e4m3 operands (the forward product; every rowwise product) and 0.081 for an e5m2 gradient times an
e4m3 operand (tensorwise gradients). bfloat16's own rounding (2^-9) is far below. Measured
(64 x 96 x 80 and 256 x 512 x 384): forward 0.027, tensorwise gradients 0.059, rowwise gradients
0.037; anything below 2^-9 would mean no FP8 cast happened at all.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nanocore.plugins import load_plugins
from tests.helpers.compare import norm_rel_diff

U_E4M3, U_E5M2 = 2**-4, 2**-3
BOUND_E4M3 = math.sqrt((U_E4M3**2 + U_E4M3**2) / 3)  # 0.051
BOUND_E5M2_E4M3 = math.sqrt((U_E5M2**2 + U_E4M3**2) / 3)  # 0.081
GRAD_BOUND = {"tensorwise": BOUND_E5M2_E4M3, "rowwise": BOUND_E4M3}


def recipe(name: str):
    return load_plugins().registries.float8_recipe.get(name).factory()


def _run(linear, x, w, b, grad):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = linear(x, w, b)
    y.backward(grad)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("shape", [(64, 96, 80), (256, 512, 384)])
@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_float8_linear_forward_and_gradients_within_float8_rounding(name, shape):
    rows, inner, out = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, rows // 2, inner, generator=g).bfloat16()  # a batch dimension, as layers get
    w = (torch.randn(out, inner, generator=g) / inner**0.5).bfloat16()
    b = torch.randn(out, generator=g).bfloat16()
    grad = torch.randn(2, rows // 2, out, generator=g).bfloat16()
    fp8 = _run(recipe(name).linear(None, None), x, w, b, grad)
    ref = _run(F.linear, x, w, b, grad)
    assert all(t.dtype == torch.bfloat16 for t in fp8), "outputs and gradients stay in the model's dtype"
    errors = [norm_rel_diff(a.float(), r.float()) for a, r in zip(fp8, ref, strict=True)]
    assert 2**-9 < errors[0] <= BOUND_E4M3, errors
    for e in errors[1:3]:
        assert 2**-9 < e <= GRAD_BOUND[name], errors
    assert errors[3] == 0, "the bias is added in high precision"


def test_float32_models_get_float32_outputs():
    x = torch.randn(8, 16).requires_grad_()
    w = torch.randn(12, 16).requires_grad_()
    y = recipe("tensorwise").linear(None, None)(x, w, None)
    y.sum().backward()
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.float32
