"""Causal self-attention: the kernel call, the sequence slot engines fill, and grouped-query attention
(multi-head when the key/value heads equal the query heads), optionally with qk-norm (Qwen3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.torch_version import TorchVersion

from nanocore.model_api import KVCache
from nanocore.model_parts.layers import RMSNorm
from nanocore.model_parts.rotary import Rotary, apply_rotary
from nanocore.sequence_api import SequenceRuntime

try:  # optional fast path on GPUs
    from flash_attn import flash_attn_func  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_func = None

# `scaled_dot_product_attention(..., enable_gqa=True)` arrived in torch 2.5
SDPA_HAS_GQA = TorchVersion(torch.__version__) >= "2.5"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last q_len positions over all kv_len keys. Inputs [b, heads, len, d]."""
    q_len, kv_len = q.shape[2], k.shape[2]
    if flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        # flash-attn aligns the causal mask to the bottom-right corner, which is what a cache needs.
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.transpose(1, 2)  # type: ignore[no-any-return]
    extra: dict = {}
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves a group of q heads
        if SDPA_HAS_GQA:  # no repeated key/value copies (on CPU it also keeps the flash kernel)
            extra["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
    if q_len == kv_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)
    if q_len == 1:  # one new token sees everything cached
        return F.scaled_dot_product_attention(q, k, v, **extra)
    # q_len new tokens after kv_len - q_len cached ones: query i sees keys up to kv_len - q_len + i.
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(diagonal=kv_len - q_len)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)


class SequenceSlot:
    """The engine's `SequenceRuntime` (context parallelism, document masking), shared by every layer;
    None: positions from shapes and plain causal attention."""

    runtime: SequenceRuntime | None = None


class AttentionCore(nn.Module):
    """softmax(q k^T) v: parameter-free, so an engine can recompute it in backward instead of keeping
    what it saves (selective recompute, `selective_recompute_modules`). Positions are already applied."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runtime: SequenceRuntime | None = None
    ) -> torch.Tensor:
        return runtime.attend(q, k, v) if runtime is not None else attention(q, k, v)


class GroupedQueryAttention(nn.Module):
    """Grouped-query self-attention with rotary positions (transformers' `q_proj`, `k_proj`, `v_proj`,
    `o_proj`). `qk_norm_eps`: RMSNorm each query and key head before rotary (`q_norm`, `k_norm`, Qwen3).
    Head counts come from tensor shapes, so tensor parallelism can split them."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool,
        layer_idx: int,
        rotary: Rotary,
        sequence: SequenceSlot | None = None,
        qk_norm_eps: float | None = None,
    ):
        super().__init__()
        self.layer_idx, self.head_dim, self.rotary = layer_idx, head_dim, rotary
        self.sequence = sequence if sequence is not None else SequenceSlot()
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        # Shapes come from the projections, not from x: under sequence parallelism x holds a
        # sequence shard and the column-parallel projections return the gathered sequence.
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, s = q.shape[0], q.shape[1]
        q = q.view(b, s, -1, self.head_dim)
        k = k.view(b, s, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        runtime = self.sequence.runtime if kv_cache is None else None
        if runtime is not None:  # this rank's tokens of a longer sequence, or packed documents
            cos, sin = self.rotary.at(runtime.positions(), q.dtype)
            out = self.core(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, runtime)
            result: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
            return result
        offset = kv_cache.length if kv_cache is not None else 0
        cos, sin = self.rotary.cos_sin(s, offset, x.device, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        out = self.core(q, k, v)
        result = self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        return result
