"""Data stages and global batches.

The global batch of a step is `global_batch_size` consecutive samples of the active stage's mixture,
starting at that stage's position. Data-parallel rank d takes the d-th contiguous slice and cuts it
into micro-batches, so the *set* of samples in a step does not depend on how the global batch size
is split into dp x micro_batch_size x batch_accumulation_per_replica.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanocore.data.mixture import Mixture


class DataSchedule:
    """Which stage is active at a step, and each stage's position (samples consumed)."""

    def __init__(
        self,
        stage_names: list[str],
        stage_starts: list[int],
        build_stage: Callable[[int], Mixture],
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ):
        self.names = stage_names
        self.starts = stage_starts
        self._build = build_stage
        self._mixtures: dict[int, Mixture] = {}
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed: dict[str, int] = {name: 0 for name in stage_names}

    def stage_index(self, step: int) -> int:
        """Stage used by 1-based optimizer step `step`."""
        index = 0
        for i, start in enumerate(self.starts):
            if step >= start:
                index = i
        return index

    def mixture(self, stage: int) -> Mixture:
        if stage not in self._mixtures:
            self._mixtures = {stage: self._build(stage)}  # keep one stage's datasets open at a time
        return self._mixtures[stage]

    def rank_indices(self, start: int) -> list[int]:
        per_rank = self.global_batch_size // self.dp_size
        first = start + self.dp_rank * per_rank
        return list(range(first, first + per_rank))

    def micro_batches(self, mixture: Mixture, start: int) -> list[torch.Tensor]:
        indices = self.rank_indices(start)
        samples = [mixture[i] for i in indices]
        b = self.micro_batch_size
        return [torch.stack(samples[i : i + b]) for i in range(0, len(samples), b)]

    def next_batch(self, step: int) -> list[torch.Tensor]:
        """This rank's micro-batches ([micro_batch_size, sequence_length + 1] each) for `step`."""
        stage = self.stage_index(step)
        name = self.names[stage]
        batches = self.micro_batches(self.mixture(stage), self.consumed[name])
        self.consumed[name] += self.global_batch_size
        return batches

    def state_dict(self) -> dict:
        return {"consumed_samples": dict(self.consumed)}

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.get("consumed_samples", {}).items():
            if name in self.consumed:
                self.consumed[name] = int(value)
