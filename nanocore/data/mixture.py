"""Deterministic weighted mixtures of fixed-length sample datasets.

Sample i of a mixture is a pure function of (i, weights, seed), so any rank can compute any global
batch without coordination and a resumed run continues with exactly the samples it would have seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from nanocore.data.api import SampleDataset
from nanocore.errors import DataError

_CHUNK = 1 << 16


class ShuffledEpochs:
    """Visits a dataset in a fresh seeded permutation each epoch; index k may exceed len (next epochs)."""

    def __init__(self, dataset: SampleDataset, seed: int, shuffle: bool = True):
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.size = len(dataset)
        if self.size == 0:
            raise DataError("a dataset has no samples: it holds fewer tokens than sequence_length + 1")
        self._perm = lru_cache(maxsize=2)(self._permutation)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def index(self, k: int) -> int:
        epoch, pos = divmod(k, self.size)
        return int(self._perm(epoch)[pos]) if self.shuffle else pos

    def __getitem__(self, k: int) -> torch.Tensor:
        return torch.as_tensor(self.dataset[self.index(k)], dtype=torch.long)


class Mixture:
    """Interleaves datasets in proportion to their weights.

    Dataset d's k-th sample sits at "time" (k + 0.5) / w_d; the mixture is all samples sorted by time
    (ties by dataset order). This hits every ratio as closely as integer counts allow and is computed
    in vectorised chunks, so random access to sample i costs O(i / chunk) once and O(1) after.
    """

    def __init__(self, datasets: Sequence[tuple[SampleDataset, float]], seed: int, shuffle: bool = True):
        if not datasets:
            raise DataError("a data stage has no dataset")
        total = float(sum(w for _, w in datasets))
        self.weights = np.array([w / total for _, w in datasets], dtype=np.float64)
        self.sources = [ShuffledEpochs(ds, seed * 1000 + i, shuffle) for i, (ds, _) in enumerate(datasets)]
        self._choice = np.zeros(0, dtype=np.int32)
        self._rank = np.zeros(0, dtype=np.int64)

    def _extend(self, upto: int) -> None:
        while len(self._choice) <= upto:
            n = len(self._choice) + _CHUNK
            # enough candidates from each dataset to fill the first n mixture positions
            per = [np.arange(int(np.ceil(w * n)) + len(self.weights) + 2) for w in self.weights]
            times = np.concatenate([(k + 0.5) / w for k, w in zip(per, self.weights, strict=True)])
            which = np.concatenate([np.full(len(k), d, dtype=np.int32) for d, k in enumerate(per)])
            ranks = np.concatenate(per)
            order = np.lexsort((which, times))[:n]
            self._choice, self._rank = which[order], ranks[order]

    def locate(self, i: int) -> tuple[int, int]:
        """(dataset index, that dataset's sample counter) of mixture sample i."""
        if len(self.sources) == 1:
            return 0, i
        self._extend(i)
        return int(self._choice[i]), int(self._rank[i])

    def __getitem__(self, i: int) -> torch.Tensor:
        d, k = self.locate(i)
        return self.sources[d][k]
