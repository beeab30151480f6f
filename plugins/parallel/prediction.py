"""The engine's `nanocore.model_api.PredictionRuntime`: what a model's extra prediction heads
(multi-token prediction) read of the micro-batch being run, and their losses.

The executor hands over each micro-batch's labels (the whole sample's, before context parallelism
cuts it) just before the last stage's forward. `future_tokens(k)` shifts them and cuts them like
the input; `token_loss` is the vocabulary-parallel cross-entropy summed over this rank's valid
tokens and divided by the micro-batch's valid tokens on every context-parallel rank, so that the
cp ranks' shares add up to the one-process mean. `record` keeps each loss x cp / micro-batches, which
`grid.loss_on_every_rank` (a mean over dp x cp) turns into the step's mean over micro-batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanocore.tp_api import Group

from .context_parallel import ContextParallel
from .loss import vocab_parallel_cross_entropy

IGNORE = -100


class TokenPrediction:
    def __init__(
        self,
        tp_group: Group,
        tp_rank: int,
        cp_group: Group,
        cp: int,
        true_vocab_size: int,
        sequence: ContextParallel | None,
        metrics: list[str],
    ):
        self.tp_group, self.tp_rank, self.cp_group, self.cp = tp_group, tp_rank, cp_group, cp
        self.true_vocab_size, self.sequence = true_vocab_size, sequence
        self.grad_scale = 1.0
        self.micro_batches = 1
        self.labels: torch.Tensor | None = None  # the micro-batch's whole labels [b, s], set by the executor
        self._sums = {name: torch.zeros(()) for name in metrics}

    def start_step(self, micro_batches: int) -> None:
        self.micro_batches = micro_batches
        self.grad_scale = self.cp / micro_batches
        self._sums = {name: torch.zeros(()) for name in self._sums}

    def future_tokens(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = self.labels
        if labels is None:
            raise RuntimeError("future_tokens is asked outside a training forward of the last stage")
        ids = torch.zeros_like(labels)
        valid = torch.zeros_like(labels, dtype=torch.bool)
        length = labels.shape[1] - (offset - 1)
        if length > 0:
            ids[:, :length] = labels[:, offset - 1 :]
            valid[:, :length] = True
        if self.sequence is not None:
            ids, valid = self.sequence.shard(ids), self.sequence.shard(valid)
        return ids, valid

    def token_loss(self, logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        targets = targets.masked_fill(~valid, IGNORE)
        vocab_start = self.tp_rank * logits.shape[-1]
        total = vocab_parallel_cross_entropy(
            logits, targets, self.tp_group, vocab_start, self.true_vocab_size, IGNORE, reduction="sum"
        )
        count = valid.sum().to(torch.float32)
        if self.cp > 1:
            dist.all_reduce(count, group=self.cp_group)
        return total / count.clamp(min=1)

    def record(self, name: str, value: torch.Tensor) -> None:
        self._sums[name] += value.detach().float().cpu() * self.cp / self.micro_batches

    def step_sums(self) -> dict[str, torch.Tensor]:
        """This rank's sums of the step (zero off the last stage): `grid.loss_on_every_rank` each."""
        return self._sums
