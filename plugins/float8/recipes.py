"""FP8 linear layers on `torch._scaled_mm`: the two dynamic-scaling recipes torchao ships.

Every matmul of a linear layer (the forward product and both gradient products) takes float8
operands, each cast with a scale computed from the operand itself at that moment (dynamic scaling),
and accumulates in float32 inside `torch._scaled_mm`, whose output is in the model's dtype:

- **tensorwise**: one scale per tensor: `scale = max_representable / amax(|tensor|)`. Inputs and
  weights in `float8_e4m3fn` (3 mantissa bits, up to 448), output gradients in `float8_e5m2` (2 bits,
  up to 57344: gradients need range more than precision), as torchao's `tensorwise` recipe. The
  float8 casts of the input and weight made in forward are kept for backward (one byte per element).
- **rowwise**: one scale per row of each operand along the matmul's reduction dimension, all in
  `float8_e4m3fn`, as torchao's `rowwise` recipe: an outlier spoils only its own row. Backward casts
  the kept high-precision input and weight again, along the other dimension.

Under tensor parallelism a piece is scaled as the whole tensor would be: an amax over a dimension
that is split across the TP group is all-reduced (MAX) over it first (tensorwise: every amax, since
`amax` of a replicated tensor is unchanged by it). torchao's float8 training converts `nn.Linear`
modules (and DTensor-sharded ones): it does not reach nanocore's own TP layers or its ZeRO-3 gathers,
and it requires CUDA; `torch._scaled_mm` runs on CPU too, so these ~150 lines are nanocore's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanocore.float8_api import LinearFunction, Sharded
from nanocore.tp_api import Group

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _tp(group: Group) -> Group:
    return group if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1 else None


def _amax(t: torch.Tensor, dim: int | None, group: Group) -> torch.Tensor:
    """max |t| (over all of it, or along `dim` keeping it), float32, the max over `group` if given."""
    a = t.detach().abs().amax() if dim is None else t.detach().abs().amax(dim=dim, keepdim=True)
    a = a.float()
    if group is not None:
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    return a


def _cast(t: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t scaled so that amax maps to dtype's largest value, cast to dtype; the inverse scale)."""
    top = torch.finfo(dtype).max
    scale = top / amax.clamp(min=1e-12)
    return (t.float() * scale).clamp(-top, top).to(dtype), scale.reciprocal()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (what `_scaled_mm` wants for its second operand)."""
    return t.t().contiguous().t()


def _mm(a, b, scale_a, scale_b, dtype):
    return torch._scaled_mm(a, _column_major(b), scale_a=scale_a, scale_b=scale_b, out_dtype=dtype)


class _Tensorwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, group, sharded):
        x8, ix = _cast(x2, E4M3, _amax(x2, None, group))
        w8, iw = _cast(weight, E4M3, _amax(weight, None, group))
        ctx.save_for_backward(x8, w8, ix, iw)
        ctx.group, ctx.dtypes = group, (x2.dtype, weight.dtype)
        return _mm(x8, w8.t(), ix, iw, x2.dtype)

    @staticmethod
    def backward(ctx, grad):
        x8, w8, ix, iw = ctx.saved_tensors
        g8, ig = _cast(grad, E5M2, _amax(grad, None, ctx.group))
        grad_x = _mm(g8, w8, ig, iw, ctx.dtypes[0])
        grad_w = _mm(g8.t().contiguous(), x8, ig, ix, ctx.dtypes[1])
        return grad_x, grad_w, None, None


class _Rowwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, group, sharded):
        over_in = group if sharded == "in" else None  # the reduction dimension of y = x w^T is `in`
        x8, ix = _cast(x2, E4M3, _amax(x2, -1, over_in))  # [M, 1]
        w8, iw = _cast(weight, E4M3, _amax(weight, -1, over_in))  # [N, 1]
        ctx.save_for_backward(x2, weight)
        ctx.group, ctx.sharded = group, sharded
        return _mm(x8, w8.t(), ix, iw.reshape(1, -1), x2.dtype)

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        g2 = grad
        over_out = ctx.group if ctx.sharded == "out" else None  # grad_x = g w reduces over `out`
        g8, ig = _cast(g2, E4M3, _amax(g2, -1, over_out))  # [M, 1]
        wc8, iwc = _cast(weight, E4M3, _amax(weight, 0, over_out))  # [1, K]
        grad_x = _mm(g8, wc8, ig, iwc, x2.dtype)
        # grad_w = g^T x reduces over the tokens, never split across the TP group here
        gt8, igt = _cast(g2, E4M3, _amax(g2, 0, None))  # [1, N]
        xc8, ixc = _cast(x2, E4M3, _amax(x2, 0, None))  # [1, K]
        grad_w = _mm(gt8.t().contiguous(), xc8, igt.reshape(-1, 1), ixc, weight.dtype)
        return grad_x, grad_w, None, None


class _Recipe:
    """A `nanocore.float8_api.Float8Recipe` from one of the autograd functions above."""

    def __init__(self, name: str, function: type[torch.autograd.Function]):
        self.name, self._function = name, function

    def __repr__(self) -> str:
        return f"float8 {self.name}"

    def linear(self, group: Group, sharded: Sharded) -> LinearFunction:
        function, tp = self._function, _tp(group)

        def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            y = function.apply(x.reshape(-1, x.shape[-1]), weight, tp, sharded).view(*x.shape[:-1], -1)
            return y + bias if bias is not None else y

        return float8_linear


def tensorwise() -> _Recipe:
    return _Recipe("tensorwise", _Tensorwise)


def rowwise() -> _Recipe:
    return _Recipe("rowwise", _Rowwise)
