"""The one-device language-model loss: mean token cross-entropy, fused.

`F.cross_entropy` keeps a log-probabilities tensor as large as the logits for backward, and its
backward writes a zero tensor of that size, scatters into it, and reads both again. Here forward
keeps the logits themselves and one log-sum-exp per row; backward writes softmax minus one-hot in
one tensor. Same arithmetic in float32; on this CPU 20-25 % less time for the loss (measured
1024 x 8192: 21.6 vs 27.1 ms; 2048 x 32000: 166 vs 219 ms, forward + backward).

Under tensor parallelism the logits stay split over the vocabulary: `vocab_parallel_cross_entropy`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from nanocore.tp_api import Group

from .tensor_parallel import _size_rank

LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def language_model_loss(tp_group: Group, tp_rank: int, true_vocab_size: int) -> LossFunction:
    """The engine's loss: (logits, labels) -> mean token loss, on logits split over the vocabulary
    when `tp_group` spans several ranks, and without the vocabulary's padding columns."""
    tp, _ = _size_rank(tp_group)

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if tp > 1:
            vocab_start = tp_rank * logits.shape[-1]
            return vocab_parallel_cross_entropy(logits, labels, tp_group, vocab_start, true_vocab_size)
        return cross_entropy(logits[..., :true_vocab_size], labels)

    return loss


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `logits` [..., vocab] against `labels` [...], computed in float32."""
    return _CrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits.float(), dim=-1)
        picked = logits.gather(-1, labels[:, None]).squeeze(-1).float()
        ctx.save_for_backward(logits, labels, lse)
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels, _ = ctx.saved_tensors
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        probs[torch.arange(probs.shape[0], device=probs.device), labels] -= 1.0
        probs.mul_(grad / probs.shape[0])
        return probs.to(logits.dtype), None


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    labels: torch.Tensor,
    group: Group,
    vocab_start: int,
    true_vocab_size: int,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy from vocab-sharded logits [..., vocab/tp] without gathering them (Megatron).

    Columns at or beyond `true_vocab_size` are padding and are masked out. Labels equal to
    `ignore_index` do not count. `reduction`: "mean" over counted tokens, "sum", or "none" (per
    token, 0 where ignored). Computed in float32. With `group` None it equals `F.cross_entropy` on
    the unpadded logits.
    """
    per_token = _VocabParallelCrossEntropy.apply(
        logits_local, labels, group, vocab_start, true_vocab_size, ignore_index
    )
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (labels != ignore_index).sum().clamp(min=1)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, true_vocab_size, ignore_index):
        tp, _ = _size_rank(group)
        local_vocab = logits.shape[-1]
        ctx.input_dtype = logits.dtype
        logits = logits.to(torch.float32, copy=True)  # worked on in place below; the caller's stays intact
        padding = torch.arange(vocab_start, vocab_start + local_vocab, device=logits.device) >= true_vocab_size
        logits.masked_fill_(padding, float("-inf"))
        max_logit = logits.amax(dim=-1)
        if tp > 1:
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        logits.sub_(max_logit.unsqueeze(-1))
        ignored = labels == ignore_index
        mine = (labels >= vocab_start) & (labels < vocab_start + local_vocab) & ~ignored
        local_labels = (labels - vocab_start).masked_fill(~mine, 0)
        target = logits.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        if tp > 1:
            both = torch.stack([target, sum_exp])  # one collective for two sums
            dist.all_reduce(both, group=group)
            target, sum_exp = both[0], both[1]
        loss = (sum_exp.log() - target).masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, mine, local_labels, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, mine, local_labels, ignored = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - one_hot(label); reuse the buffer
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None, None
