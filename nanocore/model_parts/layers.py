"""Norms and the gated MLP every LLaMA-family decoder uses."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanocore.model_api import TPStyle

ACT_FNS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32 as transformers does."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = self.weight * x.to(dtype)
        return out


class ScaleInFloat32RMSNorm(RMSNorm):
    """RMSNorm as OLMo and gpt-oss compute it: the weight multiplies the float32 normalised input, then
    the product is cast back (`RMSNorm` casts first, then multiplies; the two agree in float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = (self.weight * x).to(dtype)
        return out


class GatedMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)) (SwiGLU with silu); transformers' names."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = ACT_FNS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return out


def mlp_tp_plan(prefix: str) -> dict[str, TPStyle]:
    """The TP plan of a `GatedMLP` under `prefix`: gate and up split by output column, down by input row
    (one all-reduce, or reduce-scatter under sequence parallelism, after down_proj)."""
    return {f"{prefix}.gate_proj": "colwise", f"{prefix}.up_proj": "colwise", f"{prefix}.down_proj": "rowwise"}
