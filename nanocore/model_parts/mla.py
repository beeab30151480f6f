"""Multi-head latent attention (DeepSeek-V2/V3), with transformers' module names.

Queries go through a low-rank bottleneck (`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`; or one
`q_proj` when `q_lora_rank` is null). Keys and values share one compressed latent: `kv_a_proj_with_mqa`
maps x to the latent (`kv_lora_rank`, normed by `kv_a_layernorm`) and to one rotary key
(`qk_rope_head_dim`) that every head shares; `kv_b_proj` expands the latent into each head's
non-rotary key part (`qk_nope_head_dim`) and value (`v_head_dim`). A head's query/key is
[nope | rope] (`qk_head_dim` wide); its value may be narrower.

Tensor parallelism (the TP plan of `mla_tp_plan`): heads split over ranks as Megatron-core's MLA
does. The down projections (`q_a_proj`, `kv_a_proj_with_mqa`) are small and stay whole on every
rank (a column layer replicated tp times, so its input arrives as the TP mode keeps it and the
gradient of x is summed over ranks); their norms are whole too (`head_norm`: each rank's heads give
a share of their gradient); the up projections (`q_b_proj`, `kv_b_proj`) are split by head and
compute on what the replicated layer already gathered (`colwise_local`); `o_proj` is row-parallel.

Generation caches what the architecture needs (`KVCache` slots: the normed latent as "keys" and the
rotated shared key as "values"): (kv_lora_rank + qk_rope_head_dim) numbers per token and layer,
against 2 x heads x head size for grouped-query attention with as many key/value heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanocore.model_api import KVCache, TPStyle
from nanocore.model_parts.attention import AttentionCore, SequenceSlot
from nanocore.model_parts.layers import RMSNorm
from nanocore.model_parts.rotary import Rotary, apply_rotary, apply_rotary_interleaved


class MultiHeadLatentAttention(nn.Module):
    """MLA: `forward(x, kv_cache=None)`; head counts come from tensor shapes, so TP can split them."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        bias: bool,
        eps: float,
        softmax_scale: float,
        rope_interleave: bool,
        layer_idx: int,
        rotary: Rotary,
        sequence: SequenceSlot | None = None,
    ):
        super().__init__()
        self.layer_idx, self.rotary = layer_idx, rotary
        self.sequence = sequence if sequence is not None else SequenceSlot()
        self.nope, self.rope, self.v_dim, self.kv_lora_rank = (
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            kv_lora_rank,
        )
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        # SDPA scales by 1/sqrt(qk_head_dim); YaRN's mscale asks for more, applied to the queries
        self.query_scale = softmax_scale * qk_head_dim**0.5
        self.apply_rope = apply_rotary_interleaved if rope_interleave else apply_rotary
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        self.core = AttentionCore()

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            q: torch.Tensor = self.q_proj(x)
            return q
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        q = self._queries(x)
        b, s = q.shape[0], q.shape[1]
        q = q.view(b, s, -1, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent).view(b, 1, s, self.kv_lora_rank)
        k_rot = k_rot.reshape(b, 1, s, self.rope)
        runtime = self.sequence.runtime if kv_cache is None else None
        if runtime is not None:  # this rank's tokens of a longer sequence, or packed documents
            cos, sin = self.rotary.at(runtime.positions(), q.dtype)
        else:
            offset = kv_cache.length if kv_cache is not None else 0
            cos, sin = self.rotary.cos_sin(s, offset, x.device, q.dtype)
        q_rot, k_rot = self.apply_rope(q_rot, cos, sin), self.apply_rope(k_rot, cos, sin)
        if kv_cache is not None:  # the cache holds the latent and the rotated shared key
            latent, k_rot = kv_cache.update(self.layer_idx, latent, k_rot)
        kv = self.kv_b_proj(latent[:, 0]).view(b, latent.shape[2], -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        pad = q.shape[-1] - self.v_dim
        if runtime is not None and pad > 0:  # ring attention passes keys and values as one tensor
            out = self.core(q, k, F.pad(v, (0, pad)), runtime)[..., : self.v_dim]
        else:
            out = self.core(q, k, v, runtime)
        result: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        return result


def mla_tp_plan(prefix: str, q_lora_rank: int | None, kv_lora_rank: int, qk_rope_head_dim: int) -> dict[str, TPStyle]:
    """The TP plan of a `MultiHeadLatentAttention` under `prefix` (see the module docstring)."""
    kv_a = kv_lora_rank + qk_rope_head_dim
    plan: dict[str, TPStyle] = {
        # one "head" as wide as the whole output: replicated on every TP rank
        f"{prefix}.kv_a_proj_with_mqa": {"style": "colwise_kv", "head_dim": kv_a},
        f"{prefix}.kv_a_layernorm": "head_norm",
        f"{prefix}.kv_b_proj": "colwise_local",
        f"{prefix}.o_proj": "rowwise",
    }
    if q_lora_rank is None:
        plan[f"{prefix}.q_proj"] = "colwise"
    else:
        plan[f"{prefix}.q_a_proj"] = {"style": "colwise_kv", "head_dim": q_lora_rank}
        plan[f"{prefix}.q_a_layernorm"] = "head_norm"
        plan[f"{prefix}.q_b_proj"] = "colwise_local"
    return plan
