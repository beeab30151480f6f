"""Context parallelism: each sequence split over `cp` ranks, attention as a ring (the engine's
`nanocore.sequence_api.SequenceRuntime`).

Chunking ("zigzag", as Megatron-LM and torchtitan balance causal attention): a sequence of s tokens
is cut into 2·cp chunks of s/(2·cp); rank r holds chunks r and 2·cp-1-r, in that order. Under a
causal mask the early chunk attends to little and the late one to much, so every rank has the same
attention work.

Ring attention: each rank keeps its queries; key/value blocks (k and v stacked, one message) travel
round the ring r -> r+1, cp-1 hops. At step i rank r holds the keys of rank j = r - i and computes
only what the causal mask leaves: its whole block at i = 0 (causal inside), its queries against j's
early chunk when j < r, its late chunk's queries against all of j's keys when j > r (half a block
each). Each step's partial outputs merge exactly through their log-sum-exp. The next block's
transfer is posted before the current block's compute and waited for after it, so they overlap.
Under document masking a block whose every query/key pair lies in different documents is skipped
for that sample, in forward and backward (its keys and values still travel on: the ring needs them).

Backward goes round the ring the same way: the key/value blocks travel again, and next to them the
gradient accumulators of the keys and values being visited (each rank adds its part and passes
them on); after cp hops each rank holds its own keys' and values' gradients. Query gradients stay
home. Saved for backward: this rank's q, k, v, output and log-sum-exp only (O(s/cp)).

Document masking composes: every rank knows the document ids of the whole sequence (all CP ranks
read the same samples), so the mask of any block is built locally from global token indices.

Sliding windows and attention sinks compose too. A windowed layer's block mask is built from the
same global indices (`nanocore.sequence_api.window_mask`), and a block whose every pair lies outside
the window is skipped like a block of other documents (its keys still travel on). Sinks (one learned
logit per head in every softmax's denominator) join the merged log-sum-exp once, after the last
block; their gradient is -sum(dO * O * p_sink) per head, summed over this rank's queries (the
engine's gradient reduction sums it over cp). Under all-to-all each rank takes the sinks of the
heads it holds.

All-to-all attention (`parallelism.context_parallel_mode: all_to_all`, DeepSpeed-Ulysses' design):
before attention one all-to-all over the cp group turns each of q, k, v from [b, heads, s/cp, d]
(this rank's tokens, every head) into [b, heads/cp, s, d] (every token, this rank's share of the
heads); the tokens are put in sequence order, attention runs as on one process (the same kernel,
causal or document-masked), and one all-to-all turns the output back. Key/value heads that do not
split over cp are repeated first, each as many times as needed (at most cp / gcd(kv_heads, cp)), so
each rank holds the key/value heads its query heads read. The token layout (zigzag chunks), the
positions, the loss and the data path are the ring's; only `attend` differs.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.distributed as dist

from nanocore.model_parts.attention import attention
from nanocore.sequence_api import document_attention, document_ids, document_positions, window_mask

_KV_TAG, _GRAD_TAG = 1, 2
CONTEXT_PARALLEL_MODES = ("ring", "all_to_all")
# Ring blocks the document mask removes entirely are skipped; benchmarks/ring_document_skip.py turns this
# off in its ranks to measure what the skip saves (not a config option: the result is the same either way).
SKIP_MASKED_BLOCKS = True


def zigzag_index(sequence_length: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global indices of the tokens context-parallel rank `cp_rank` holds, in its order."""
    chunk = sequence_length // (2 * cp)
    early = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    late = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([early, late])


@attrs.define
class Layout:
    """One micro-batch's layout on this rank."""

    index: torch.Tensor  # [L] global indices of the local tokens
    positions: torch.Tensor  # [b or 1, L] rotary positions
    docs: torch.Tensor | None  # [b, s] document ids of the whole sequence (document masking), else None


class ContextParallel:
    """`SequenceRuntime` for context parallelism (cp >= 1) and/or document masking.

    `ranks` are the global ranks of this rank's context-parallel group in cp-rank order; `separator`
    is the end-of-document token id under document masking (None: off)."""

    def __init__(
        self, group, cp: int, cp_rank: int, ranks: list[int], separator: int | None = None, mode: str = "ring"
    ):
        if mode not in CONTEXT_PARALLEL_MODES:
            raise ValueError(f"context parallel mode {mode!r} is not one of {CONTEXT_PARALLEL_MODES}")
        self.group, self.cp, self.cp_rank, self.ranks = group, cp, cp_rank, ranks
        self.separator, self.mode = separator, mode
        self.layout: Layout | None = None
        # since construction: ring blocks of forward passes; bytes this rank sent for attention
        self.blocks_computed = self.blocks_skipped = self.bytes_sent = 0

    def prepare(self, input_ids: torch.Tensor) -> Layout:
        """The layout of a micro-batch's input ids [b, s] (the whole sequence) on this rank."""
        s = input_ids.shape[1]
        index = zigzag_index(s, self.cp, self.cp_rank, input_ids.device)
        if self.separator is None:
            return Layout(index, index[None], None)
        docs = document_ids(input_ids, self.separator)
        return Layout(index, document_positions(docs)[:, index], docs)

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a [b, s, ...] tensor (dim 1 is the sequence)."""
        if self.cp == 1:
            return t
        return t.index_select(1, zigzag_index(t.shape[1], self.cp, self.cp_rank, t.device))

    # -- SequenceRuntime ------------------------------------------------------------------
    def positions(self) -> torch.Tensor:
        assert self.layout is not None, "context parallel runtime used outside a micro-batch"
        return self.layout.positions

    @torch.compiler.disable  # the ring's exchanges and per-document masks run eagerly in a compiled layer
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        layout = self.layout
        assert layout is not None, "context parallel runtime used outside a micro-batch"
        if self.cp == 1:
            assert layout.docs is not None, "a one-rank context parallel runtime is for document masking"
            return document_attention(q, k, v, layout.docs, window, sinks)
        if self.mode == "all_to_all":
            return self.attend_all_to_all(q, k, v, layout, window, sinks)
        return RingAttention.apply(q, k, v, sinks, self, layout, window)

    # -- all-to-all -----------------------------------------------------------------------
    def attend_all_to_all(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: Layout,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention with heads split over the cp ranks and the whole sequence on each (see the module
        docstring). q [b, heads, L, d]; k, v [b, kv_heads, L, d or dv]; heads must divide by cp. The
        sinks of this rank's head group go with its heads."""
        cp, kv_heads = self.cp, k.shape[1]
        if q.shape[1] % cp:
            raise ValueError(f"all_to_all context parallelism: {q.shape[1]} query heads do not split over cp={cp}")
        if kv_heads % cp:  # repeat each kv head so that every rank's query heads find theirs
            repeat = cp // math.gcd(kv_heads, cp)
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        order = torch.cat([zigzag_index(layout.index.numel() * cp, cp, j, q.device) for j in range(cp)])
        to_sequence = torch.argsort(order)  # received (rank-major) -> sequence order
        q, k, v = (HeadsSequenceSwap.apply(t, self, True).index_select(2, to_sequence) for t in (q, k, v))
        if sinks is not None:
            sinks = sinks.view(cp, -1)[self.cp_rank]
        if layout.docs is None:
            out = attention(q, k, v, window, sinks)
        else:
            out = document_attention(q, k, v, layout.docs, window, sinks)
        return HeadsSequenceSwap.apply(out.index_select(2, order), self, False)

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """Chunk j of `send` (dim 0, cp chunks) to cp rank j; chunk i of the result from cp rank i."""
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        self.bytes_sent += send.numel() * send.element_size() * (self.cp - 1) // self.cp
        return received

    # -- the ring -------------------------------------------------------------------------
    def exchange(self, tensor: torch.Tensor, tag: int) -> tuple[list, torch.Tensor]:
        """Send `tensor` to the next rank of the ring and receive the previous rank's into a new
        tensor; returns the pending works and the receive buffer."""
        nxt = self.ranks[(self.cp_rank + 1) % self.cp]
        prv = self.ranks[(self.cp_rank - 1) % self.cp]
        received = torch.empty_like(tensor)
        self.bytes_sent += tensor.numel() * tensor.element_size()
        ops = [
            dist.P2POp(dist.isend, tensor, nxt, self.group, tag),
            dist.P2POp(dist.irecv, received, prv, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops), received

    def live_samples(self, mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
        """The samples of the micro-batch for which a ring block with this mask has anything to compute
        (a sample's block is dead when every query/key pair is masked, as between two documents); None:
        all of them. Counted per (sample, block) in `blocks_computed` / `blocks_skipped`."""
        live = _live_samples(mask, batch)
        computed = batch if live is None else live.numel()
        self.blocks_computed += computed
        self.blocks_skipped += batch - computed
        return live

    def block(self, layout: Layout, step: int, window: int | None = None) -> tuple[slice, slice, torch.Tensor | None]:
        """At ring step `step` (holding the keys of rank j = r - step): the local query rows and key
        rows that the causal mask leaves, and the mask among them (None: all allowed), within
        `window` when given (a block wholly outside it has a mask that allows nothing)."""
        r, cp = self.cp_rank, self.cp
        j = (r - step) % cp
        half = layout.index.numel() // 2
        if j == r:
            rows, cols = slice(None), slice(None)
        elif j < r:
            rows, cols = slice(None), slice(0, half)
        else:
            rows, cols = slice(half, None), slice(None)
        q_index = layout.index[rows]
        k_index = zigzag_index(2 * cp * half, cp, j, q_index.device)[cols]
        mask = None
        if j == r or window is not None:
            mask = window_mask(q_index, k_index, window)[None]  # [1, Lq, Lk]
        if layout.docs is not None:
            same = layout.docs[:, q_index][:, :, None] == layout.docs[:, k_index][:, None, :]
            mask = same if mask is None else mask & same
        return rows, cols, mask


def _heads_to_sequence(x: torch.Tensor, runtime: ContextParallel) -> torch.Tensor:
    """[b, h, L, d] (this rank's L tokens) -> [b, h/cp, cp*L, d]: head group j goes to cp rank j, and the
    tokens received are laid out rank by rank."""
    b, h, length, d = x.shape
    cp = runtime.cp
    received = runtime.all_to_all(x.reshape(b, cp, h // cp, length, d).transpose(0, 1).contiguous())
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * length, d)


def _sequence_to_heads(y: torch.Tensor, runtime: ContextParallel) -> torch.Tensor:
    """The inverse of `_heads_to_sequence`: [b, h/cp, cp*L, d] -> [b, h, L, d]."""
    b, hc, total, d = y.shape
    cp = runtime.cp
    received = runtime.all_to_all(y.reshape(b, hc, cp, total // cp, d).permute(2, 0, 1, 3, 4).contiguous())
    return received.transpose(0, 1).reshape(b, cp * hc, total // cp, d)


class HeadsSequenceSwap(torch.autograd.Function):
    """`_heads_to_sequence` (to_sequence=True) or `_sequence_to_heads`; each one's backward is the other."""

    @staticmethod
    def forward(ctx, x, runtime: ContextParallel, to_sequence: bool):
        ctx.runtime, ctx.to_sequence = runtime, to_sequence
        return (_heads_to_sequence if to_sequence else _sequence_to_heads)(x, runtime)

    @staticmethod
    def backward(ctx, grad):
        back = _sequence_to_heads if ctx.to_sequence else _heads_to_sequence
        return back(grad.contiguous(), ctx.runtime), None, None


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, h, L, d] -> [b, kv_heads, (h / kv_heads) * L, d]: each kv head's query heads as extra rows."""
    b, h, length, d = q.shape
    return q.reshape(b, kv_heads, (h // kv_heads) * length, d)


def _ungrouped(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, kv_heads, rows, d = x.shape
    return x.reshape(b, heads, rows * kv_heads // heads, d)


def _expand_mask(mask: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """[B, Lq, Lk] -> [B, 1, groups * Lq, Lk], matching `_grouped` rows."""
    return None if mask is None else mask[:, None].repeat(1, 1, groups, 1)


# Scores are computed a tile of query rows at a time, at most this many elements (4 MiB in float32),
# so the transient memory of a block does not grow with the square of the sequence.
_TILE_ELEMENTS = 2**20


def _row_tiles(q: torch.Tensor, keys: int) -> list[slice]:
    rows = q.shape[2]
    step = max(1, _TILE_ELEMENTS // max(q.shape[0] * q.shape[1] * keys, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def _scores(q, k, mask, scale):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _block_forward(q, k, v, mask, scale):
    """Attention of grouped queries over one key block, in float32: (out, lse); rows with no allowed
    key get out 0 and lse -inf."""
    outs, lses = [], []
    for t in _row_tiles(q, k.shape[2]):
        scores = _scores(q[:, :, t], k, None if mask is None else mask[:, :, t], scale)
        lse = torch.logsumexp(scores, dim=-1)
        safe = lse.masked_fill(torch.isinf(lse), 0.0)
        outs.append(torch.matmul(torch.exp(scores - safe[..., None]), v))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _block_backward(q, k, v, dout, lse, delta, mask, scale):
    """Gradients of one block given the final output's log-sum-exp and delta = rowsum(dout * out):
    (dq of these rows, dk, dv of the block's keys and values)."""
    dk, dv, dqs = torch.zeros_like(k), torch.zeros_like(v), []
    for t in _row_tiles(q, k.shape[2]):
        q_t, do_t = q[:, :, t], dout[:, :, t]
        p = torch.exp(_scores(q_t, k, None if mask is None else mask[:, :, t], scale) - lse[:, :, t, None])
        dv += torch.matmul(p.transpose(-1, -2), do_t)
        ds = p * (torch.matmul(do_t, v.transpose(-1, -2)) - delta[:, :, t, None])
        dqs.append(torch.matmul(ds, k) * scale)
        dk += torch.matmul(ds.transpose(-1, -2), q_t) * scale
    return torch.cat(dqs, dim=2), dk, dv


def _sink_rows(sinks: torch.Tensor, kv_heads: int, length: int) -> torch.Tensor:
    """[heads] -> [1, kv_heads, groups * length] float32: each grouped query row's head's sink logit."""
    grouped = sinks.float().view(kv_heads, -1)
    return grouped[:, :, None].expand(-1, -1, length).reshape(1, kv_heads, -1)


class RingAttention(torch.autograd.Function):
    """Ring attention over the context-parallel ranks (the module docstring). Sinks, when given, are
    one more logit per head merged into the log-sum-exp after the last block (their value is 0)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, runtime: ContextParallel, layout: Layout, window: int | None):
        heads, kv_heads = q.shape[1], k.shape[1]
        groups = heads // kv_heads
        scale = 1.0 / math.sqrt(q.shape[-1])
        qg = _grouped(q.float(), kv_heads)
        b, _, rows_total, d = qg.shape
        out = torch.zeros_like(qg)
        lse = torch.full((b, kv_heads, rows_total), float("-inf"), dtype=torch.float32, device=q.device)
        length = q.shape[2]
        kv = torch.stack([k, v])
        for step in range(runtime.cp):
            if step < runtime.cp - 1:
                works, kv_next = runtime.exchange(kv, _KV_TAG)
            rows, cols, mask = runtime.block(layout, step, window)
            live = runtime.live_samples(mask, b)
            if live is not None and live.numel() == 0:  # the mask removes the whole block: nothing to compute
                if step < runtime.cp - 1:
                    for work in works:
                        work.wait()
                    kv = kv_next
                continue
            row_index = _row_index(rows, length, groups, q.device)
            kb, vb = kv[0][:, :, cols].float(), kv[1][:, :, cols].float()
            q_rows = qg if row_index is None else qg.index_select(2, row_index)
            emask = _expand_mask(mask, groups)
            if live is None:
                o_blk, l_blk = _block_forward(q_rows, kb, vb, emask, scale)
            else:  # only the samples with something to compute; the others merge nothing (lse -inf)
                o_s, l_s = _block_forward(*(_samples(t, live) for t in (q_rows, kb, vb, emask)), scale)
                o_blk, l_blk = _scatter_samples(o_s, live, b, 0.0), _scatter_samples(l_s, live, b, float("-inf"))
            if row_index is None:
                new = torch.logaddexp(lse, l_blk)
                out = out * torch.exp(lse - new)[..., None] + o_blk * torch.exp(l_blk - new)[..., None]
                lse = new
            else:
                old_l, old_o = lse.index_select(2, row_index), out.index_select(2, row_index)
                new = torch.logaddexp(old_l, l_blk)
                merged = old_o * torch.exp(old_l - new)[..., None] + o_blk * torch.exp(l_blk - new)[..., None]
                out = out.index_copy(2, row_index, merged)
                lse = lse.index_copy(2, row_index, new)
            if step < runtime.cp - 1:
                for work in works:
                    work.wait()
                kv = kv_next
        if sinks is not None:
            new = torch.logaddexp(lse, _sink_rows(sinks, kv_heads, length))
            out = out * torch.exp(lse - new)[..., None]
            lse = new
        result = _ungrouped(out, heads).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, sinks)
        ctx.runtime, ctx.layout, ctx.scale, ctx.window = runtime, layout, scale, window
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        runtime, layout, scale, window = ctx.runtime, ctx.layout, ctx.scale, ctx.window
        heads, kv_heads = q.shape[1], k.shape[1]
        groups, length = heads // kv_heads, q.shape[2]
        qg = _grouped(q.float(), kv_heads)
        dout = _grouped(grad_out.float(), kv_heads)
        delta = (dout * _grouped(out.float(), kv_heads)).sum(-1)  # [b, kv_heads, rows]
        dq = torch.zeros_like(qg)
        kv = torch.stack([k, v])
        pending = None
        for step in range(runtime.cp):
            if step < runtime.cp - 1:
                works, kv_next = runtime.exchange(kv, _KV_TAG)
            rows, cols, mask = runtime.block(layout, step, window)
            live = _live_samples(mask, q.shape[0])
            if live is not None and live.numel() == 0:  # skipped in forward: no gradient to add
                assert pending is not None, "the diagonal block (step 0) always has unmasked keys"
                for work in pending[0]:
                    work.wait()
                pending = runtime.exchange(pending[1], _GRAD_TAG)
                if step < runtime.cp - 1:
                    for work in works:
                        work.wait()
                    kv = kv_next
                continue
            row_index = _row_index(rows, length, groups, q.device)
            kb, vb = kv[0][:, :, cols].float(), kv[1][:, :, cols].float()
            q_rows, do_rows, l_rows, d_rows = (_pick(t, row_index) for t in (qg, dout, lse, delta))
            inputs = (q_rows, kb, vb, do_rows, l_rows, d_rows, _expand_mask(mask, groups))
            if live is None:
                dq_rows, dk_blk, dv_blk = _block_backward(*inputs, scale)
            else:
                grads = _block_backward(*(_samples(t, live) for t in inputs), scale)
                dq_rows, dk_blk, dv_blk = (_scatter_samples(g, live, q.shape[0], 0.0) for g in grads)
            if row_index is None:
                dq += dq_rows
            else:
                dq.index_add_(2, row_index, dq_rows)
            dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
            dkv[0][:, :, cols] = dk_blk
            dkv[1][:, :, cols] = dv_blk
            if pending is not None:
                for work in pending[0]:
                    work.wait()
                dkv += pending[1]
            pending = runtime.exchange(dkv, _GRAD_TAG)  # on to the next rank; the last hop reaches the owner
            if step < runtime.cp - 1:
                for work in works:
                    work.wait()
                kv = kv_next
        for work in pending[0]:
            work.wait()
        dkv = pending[1]
        dsinks = None
        if sinks is not None:  # d lse / d sink is the sink's probability; its value 0 adds no output
            share = torch.exp(_sink_rows(sinks, kv_heads, length) - lse) * delta
            dsinks = -share.view(q.shape[0], kv_heads, groups, length).sum(dim=(0, 3)).reshape(-1).to(sinks.dtype)
        dq_out, dk_out, dv_out = _ungrouped(dq, heads).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return dq_out, dk_out, dv_out, dsinks, None, None, None


def _live_samples(mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """Indices of the samples whose block mask allows some query/key pair; None: every sample (no
    mask, or the skip turned off). A mask shared by the batch (causal, windowed) is live for all
    samples or none: a block wholly outside the window has nothing to compute."""
    if not SKIP_MASKED_BLOCKS or mask is None:
        return None
    live = mask.flatten(1).any(dim=1)
    if bool(live.all()):
        return None
    if mask.shape[0] != batch:
        return live.new_zeros(0, dtype=torch.int64)
    return live.nonzero().squeeze(1)


def _samples(t: torch.Tensor | None, live: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, live)


def _scatter_samples(t: torch.Tensor, live: torch.Tensor, batch: int, fill: float) -> torch.Tensor:
    """[len(live), ...] -> [batch, ...]: the live samples' rows in place, `fill` elsewhere."""
    return t.new_full((batch, *t.shape[1:]), fill).index_copy(0, live, t)


def _pick(t: torch.Tensor, row_index: torch.Tensor | None) -> torch.Tensor:
    return t if row_index is None else t.index_select(2, row_index)


def _row_index(rows: slice, length: int, groups: int, device) -> torch.Tensor | None:
    """Rows of the grouped query matrix ([groups * length], group-major) that `rows` (a slice of the
    `length` local positions) selects; None for all."""
    if rows == slice(None):
        return None
    positions = torch.arange(length, device=device)[rows]
    return (torch.arange(groups, device=device)[:, None] * length + positions[None]).reshape(-1)
