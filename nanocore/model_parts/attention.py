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
from nanocore.sequence_api import SequenceRuntime, causal_mask, masked_attention

try:  # optional fast path on GPUs
    from flash_attn import flash_attn_func  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_func = None

# `scaled_dot_product_attention(..., enable_gqa=True)` arrived in torch 2.5
SDPA_HAS_GQA = TorchVersion(torch.__version__) >= "2.5"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the last q_len positions over all kv_len keys. Inputs [b, heads, len, d].

    `window`: each query sees only the keys within that many positions of it, itself included
    (transformers' `sliding_window`); `sinks` [heads]: learned per-head logits in every softmax's
    denominator (gpt-oss). Both go through `nanocore.sequence_api.masked_attention`'s fused kernel."""
    q_len, kv_len = q.shape[2], k.shape[2]
    if window is not None or sinks is not None:
        if window is not None and flash_attn_func is not None and sinks is None and _flash_ok(q):
            # flash-attn's window counts the keys left of the query besides itself
            out = flash_attn_func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, window_size=(window - 1, 0)
            )
            return out.transpose(1, 2)  # type: ignore[no-any-return]
        return masked_attention(q, k, v, causal_mask(q_len, kv_len, window, q.device), sinks)
    if flash_attn_func is not None and _flash_ok(q):
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
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q_len, kv_len, None, q.device), **extra)


def _flash_ok(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


class SequenceSlot:
    """The engine's `SequenceRuntime` (context parallelism, document masking), shared by every layer;
    None: positions from shapes and plain causal attention."""

    runtime: SequenceRuntime | None = None


class AttentionCore(nn.Module):
    """softmax(q k^T) v: parameter-free, so an engine can recompute it in backward instead of keeping
    what it saves (selective recompute, `selective_recompute_modules`). Positions are already applied.
    `window` and `sinks` describe what the layer attends to (`nanocore.sequence_api`)."""

    def __init__(self, window: int | None = None):
        super().__init__()
        self.window = window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        runtime: SequenceRuntime | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if runtime is not None:
            if self.window is None and sinks is None:  # the call every runtime has always taken
                return runtime.attend(q, k, v)
            return runtime.attend(q, k, v, window=self.window, sinks=sinks)
        if self.window is None and sinks is None:
            return attention(q, k, v)
        return attention(q, k, v, self.window, sinks)

    def extra_repr(self) -> str:
        return f"window={self.window}" if self.window is not None else ""


class GroupedQueryAttention(nn.Module):
    """Grouped-query self-attention with rotary positions (transformers' `q_proj`, `k_proj`, `v_proj`,
    `o_proj`). Head counts come from tensor shapes, so tensor parallelism can split them. Options, each
    a variant of an open model:

    - `qk_norm_eps`: RMSNorm each query and key head before rotary (`q_norm`, `k_norm`: Qwen3);
      `qk_norm_width="all"` normalises the whole projection instead (OLMo 2 and 3), and `norm_class`
      picks the norm (Qwen3-Next's zero-centred one);
    - `window`: sliding-window attention (gpt-oss, OLMo 3, Mistral, Qwen3's `use_sliding_window`);
    - `sinks`: a learned logit per query head in every softmax's denominator (`sinks`, gpt-oss);
    - `output_gate`: `q_proj` also yields a gate per head, and the attention output is multiplied by
      its sigmoid before `o_proj` (Qwen3-Next's gated attention; each head's rows are its query, then
      its gate, as transformers lays them out);
    - `rotary`'s width below `head_dim`: partial rotary (the first features rotate, the rest pass).
    """

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
        qk_norm_width: str = "head",
        norm_class: type[nn.Module] = RMSNorm,
        window: int | None = None,
        sinks: bool = False,
        output_gate: bool = False,
        output_bias: bool | None = None,
    ):
        super().__init__()
        self.layer_idx, self.head_dim, self.rotary = layer_idx, head_dim, rotary
        self.sequence = sequence if sequence is not None else SequenceSlot()
        self.window, self.output_gate = window, output_gate
        self.qk_norm_width = qk_norm_width
        q_rows = num_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = nn.Linear(hidden_size, q_rows, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias if output_bias is None else output_bias)
        if qk_norm_eps is not None:
            width = head_dim if qk_norm_width == "head" else None
            self.q_norm = norm_class(width or num_heads * head_dim, qk_norm_eps)
            self.k_norm = norm_class(width or num_kv_heads * head_dim, qk_norm_eps)
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads))
        self.core = AttentionCore(window)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        # Shapes come from the projections, not from x: under sequence parallelism x holds a
        # sequence shard and the column-parallel projections return the gathered sequence.
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, s = q.shape[0], q.shape[1]
        gate = None
        if self.output_gate:
            q, gate = q.view(b, s, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, s, -1)
        if hasattr(self, "q_norm") and self.qk_norm_width != "head":
            q, k = self.q_norm(q.reshape(b, s, -1)), self.k_norm(k)
        q = q.reshape(b, s, -1, self.head_dim)
        k = k.view(b, s, -1, self.head_dim)
        if hasattr(self, "q_norm") and self.qk_norm_width == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        sinks = getattr(self, "sinks", None)
        runtime = self.sequence.runtime if kv_cache is None else None
        if runtime is not None:  # this rank's tokens of a longer sequence, or packed documents
            cos, sin = self.rotary.at(runtime.positions(), q.dtype)
            out = self.core(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, runtime, sinks)
        else:
            offset = kv_cache.length if kv_cache is not None else 0
            cos, sin = self.rotary.cos_sin(s, offset, x.device, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            if kv_cache is not None:
                k, v = kv_cache.update(self.layer_idx, k, v, keep=None if self.window is None else self.window - 1)
            out = self.core(q, k, v, None, sinks)
        out = out.transpose(1, 2).reshape(b, s, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        result: torch.Tensor = self.o_proj(out)
        return result
