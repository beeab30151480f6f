"""Where a model's tokens sit in their sequence: context parallelism and document masking.

Models are written single-device style and see one tensor per pipeline block, so they cannot be
handed positions or masks as inputs. Instead the engine hands a model a `SequenceRuntime` once
(`model.set_sequence_runtime(runtime)`) and, before each micro-batch's forward (and its backward,
where recomputation runs the forward again), points the runtime at that micro-batch's layout. The
model asks it two things, in its attention layers:

- `positions() -> LongTensor[b or 1, s_local]`: the rotary position of each token this rank holds,
  in the order it holds them (the true global positions under context parallelism, restarting at
  each document under document masking);
- `attend(q, k, v) -> out`: causal attention of this rank's queries over every key of the sequence
  that the layout allows (the whole sequence up to the query, within its document). q is
  [b, heads, s_local, d], k and v [b, kv_heads, s_local, d] (grouped-query attention allowed); out
  is like q. Under context parallelism this is ring attention over the context-parallel ranks.

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

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal (and, under document masking, same-document) attention of this rank's queries."""
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

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self._docs is not None, "DocumentMasking: set_tokens was not called"
        return document_attention(q, k, v, self._docs)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """Causal attention within documents: q, k, v [b, heads, s, d] (k, v may have fewer heads);
    `docs` [b, s] document ids."""
    k, v = repeat_kv(q, k, v)
    s = q.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    mask = causal & (docs[:, :, None] == docs[:, None, :])  # [b, s, s]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
