"""The `dummy` format (what `dataset: null` means): random token ids, computed on demand, stored nowhere."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from nanocore.config.schema import doc
from nanocore.data.api import DatasetContext


class DummyDataset:
    """Sample i is drawn from a generator seeded by (seed, i), so any rank, worker or resumed run that
    asks for sample i gets the same tokens without any shared state. Validation uses another stream."""

    def __init__(self, num_samples: int, sequence_length: int, vocab_size: int, seed: int, split: str = "train"):
        self.num_samples = num_samples
        self.sequence_length = sequence_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.split = split

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        index = int(index)
        if index < 0:
            index += self.num_samples
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is out of range for the dummy dataset ({self.num_samples} samples)")
        key = [self.seed, index] if self.split == "train" else [self.seed, index, sum(self.split.encode())]
        rng = np.random.default_rng(key)
        return torch.from_numpy(rng.integers(0, self.vocab_size, size=self.sequence_length + 1, dtype=np.int64))

    def __repr__(self) -> str:
        return f"DummyDataset(samples={self.num_samples}, vocab_size={self.vocab_size}, seed={self.seed})"


@attrs.define
class DummyArgs:
    """Random tokens: for smoke tests and benchmarks."""

    num_samples: int = doc(
        "Number of distinct samples (indexing past it is an error; mixtures wrap).", default=1_000_000
    )

    def check(self, config: Any) -> list[str]:
        return [] if self.num_samples >= 1 else [f"num_samples: must be at least 1, got {self.num_samples}"]


def build_dummy(args: DummyArgs | None, ctx: DatasetContext) -> list[tuple[DummyDataset, float]]:
    num_samples = args.num_samples if args is not None else DummyArgs().num_samples
    return [(DummyDataset(num_samples, ctx.sequence_length, ctx.vocab_size, ctx.seed, ctx.split), 1.0)]
