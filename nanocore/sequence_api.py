"""Where a model's tokens sit in their sequence: context parallelism and document masking.

Models are written single-device style and see one tensor per pipeline block, so they cannot be
handed positions or masks as inputs. Instead the engine hands a model a `SequenceRuntime` once
(`model.set_sequence_runtime(runtime)`) and, before each micro-batch's forward (and its backward,
where recomputation runs the forward again), points the runtime at that micro-batch's layout. The
model asks it two things, in its attention layers:

- `positions() -> LongTensor[b or 1, s_local]`: the rotary position of each token this rank holds,
  in the order it holds them (the true global positions under context parallelism, restarting at
  each document under document masking);
- `attend(q, k, v, window=None, sinks=None) -> out`: causal attention of this rank's queries over
  every key of the sequence that the layout allows (the whole sequence up to the query, within its
  document). q is [b, heads, s_local, d], k and v [b, kv_heads, s_local, d] (grouped-query attention
  allowed); out is like q. Under context parallelism this is ring attention over the
  context-parallel ranks. What the layer attends to beyond that is described, never hard-coded:
  `window` (a sliding window: the query at position i sees the keys at i - window < j <= i, as
  transformers' `sliding_window` means it) and `sinks` ([heads] learned logits, one per query head
  of q, added to every softmax's denominator with no value: gpt-oss's attention sinks).

A model plugin opts in the same way it declares its TP plan, with an attribute:
`sequence_features: set[str]` naming what it supports from `SEQUENCE_FEATURES`. Engines refuse
`parallelism.context_parallel_size > 1` or `tokens.document_masking: true` for a model that does not
declare them, before any process group exists. A model that declares either must implement
`set_sequence_runtime(runtime)`; while no runtime is set (one process, no masking, generation with a
KV cache) it computes positions from shapes as before.

A model that declares `context_parallel` may also say how many query heads each attention layer has
(`attention_heads: int`, before tensor parallelism): engines that split heads over context-parallel
ranks (`parallelism.context_parallel_mode: all_to_all`) check the split against it before any
process group exists, and refuse the mode for a model that does not say.

Under sequence parallelism (TP REDUCE_SCATTER) attention sees the TP-gathered sequence, so positions
and attention are over this context-parallel rank's whole share of the sequence, not a TP shard.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

SEQUENCE_FEATURES = ("context_parallel", "document_masking")


@runtime_checkable
class SequenceRuntime(Protocol):
    def positions(self) -> torch.Tensor:
        """Rotary positions of this rank's tokens: int64 [b or 1, s_local]."""
        ...

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal (and, under document masking, same-document) attention of this rank's queries, within
        `window` tokens when given, with `sinks` in every softmax's denominator when given."""
        ...


def sequence_features(model: torch.nn.Module) -> set[str]:
    """What the model declares it supports (an empty set for a model that says nothing)."""
    return set(getattr(model, "sequence_features", ()) or ())


def attention_heads(model: torch.nn.Module) -> int | None:
    """The query heads of each of the model's attention layers (before TP), or None if it does not say."""
    heads = getattr(model, "attention_heads", None)
    return int(heads) if heads is not None else None


def document_ids(input_ids: torch.Tensor, separator: int) -> torch.Tensor:
    """[b, s] -> [b, s] int64: the index of the document each token belongs to. A document ends with
    its `separator` token (end of document), so the token after a separator starts the next one."""
    starts = torch.zeros_like(input_ids, dtype=torch.int64)
    starts[:, 1:] = (input_ids[:, :-1] == separator).to(torch.int64)
    return starts.cumsum(dim=1)


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """[b, s] document ids -> [b, s] positions that restart at 0 at each document's first token."""
    s = docs.shape[1]
    index = torch.arange(s, device=docs.device).expand_as(docs)
    first = torch.zeros_like(docs, dtype=torch.bool)
    first[:, 0] = True
    first[:, 1:] = docs[:, 1:] != docs[:, :-1]
    start = torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/value heads repeated to the query heads (grouped-query attention), where needed."""
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return k, v


class DocumentMasking:
    """The one-process `SequenceRuntime` with document masking: a packed sequence's documents never
    attend to each other, and positions restart at each document. `set_tokens` takes the micro-batch's
    input ids (the engine calls it; tests and custom loops may too)."""

    def __init__(self, separator: int):
        self.separator = separator
        self._docs: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None

    def set_tokens(self, input_ids: torch.Tensor) -> None:
        self._docs = document_ids(input_ids, self.separator)
        self._positions = document_positions(self._docs)

    def positions(self) -> torch.Tensor:
        assert self._positions is not None, "DocumentMasking: set_tokens was not called"
        return self._positions

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert self._docs is not None, "DocumentMasking: set_tokens was not called"
        return document_attention(q, k, v, self._docs, window, sinks)


def causal_mask(q_len: int, kv_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] bool: the last q_len positions of a kv_len-long sequence (a cache's new tokens
    are its last ones) each see the keys up to themselves, and within `window` when given."""
    query = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    key = torch.arange(kv_len, device=device)[None, :]
    allowed = key <= query
    return allowed & (key > query - window) if window is not None else allowed


def window_mask(q_index: torch.Tensor, k_index: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Lq, Lk] bool: causal (and windowed) among queries and keys at these global token indices."""
    difference = q_index[:, None] - k_index[None, :]
    allowed = difference >= 0
    return allowed & (difference < window) if window is not None else allowed


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) where `mask` allows, plus `sinks`) v through PyTorch's fused SDPA.

    q [b, heads, Lq, d]; k, v [b, kv_heads, Lk, d] (grouped-query attention allowed); mask broadcastable
    to [b, heads, Lq, Lk]; sinks [heads] or None. A sink is a key that every query sees, with logit
    `sinks[h]` and value 0, so it takes its share of the denominator and adds nothing to the output.
    It is one more key whose dot product with query head h is `sinks[h]`: the queries get
    `sinks[h] * sqrt(d)` as an extra coordinate (padded to 8 with zeros, which no product sees), the
    sink key a 1 there and every real key a 0. The result is exact and the gradient reaches `sinks`
    through the same fused kernel as it reaches q, k and v."""
    k, v = repeat_kv(q, k, v)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    b, heads, q_len, d = q.shape
    scale = d**-0.5
    pad = 8
    extra_q = q.new_zeros(b, heads, q_len, pad)
    extra_q[..., 0] = (sinks.to(q.dtype) / scale)[None, :, None]
    sink_key = k.new_zeros(b, heads, 1, d + pad)
    sink_key[..., d] = 1
    q = torch.cat([q, extra_q], dim=-1)
    k = torch.cat([sink_key, torch.cat([k, k.new_zeros(*k.shape[:-1], pad)], dim=-1)], dim=2)
    v = torch.cat([v.new_zeros(b, heads, 1, v.shape[-1]), v], dim=2)
    mask = torch.cat([mask.new_ones(*mask.shape[:-1], 1), mask], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: torch.Tensor,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within documents (and `window`, with `sinks`, when given): q, k, v
    [b, heads, s, d] (k, v may have fewer heads); `docs` [b, s] document ids."""
    s = q.shape[2]
    mask = causal_mask(s, s, window, q.device) & (docs[:, :, None] == docs[:, None, :])  # [b, s, s]
    return masked_attention(q, k, v, mask[:, None], sinks)
