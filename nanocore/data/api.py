"""Interfaces for tokenizer and dataset-format plugins.

A tokenizer plugin registers `factory(name_or_path: str) -> Tokenizer`.
A dataset-format plugin registers `factory(args, ctx: DatasetContext) -> list[tuple[SampleDataset, float]]`
(one or more datasets with relative weights) and an attrs `config_class` for `args`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import attrs
import torch


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None
    bos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@runtime_checkable
class SampleDataset(Protocol):
    """Fixed-length samples: `ds[i]` is a LongTensor of `sequence_length + 1` token ids
    (inputs are `[:-1]`, labels `[1:]`). Indexing must be deterministic."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> torch.Tensor: ...


@attrs.define
class DatasetContext:
    """What a dataset format gets besides its own args."""

    tokenizer: Tokenizer | None  # None when the config names none (`tokenizer_name_or_path: null`)
    sequence_length: int
    vocab_size: int  # the model's vocabulary; token ids must be below it
    seed: int
    cache_dir: Path  # where a format may cache tokenized data
    is_main_process: bool = True  # rank 0 tokenizes/caches; others wait at `barrier`
    barrier: Callable[[], None] = lambda: None
    config_dir: Path | None = None  # folder of the YAML; relative data paths resolve against it
    split: str = "train"  # "train" or "validation"

    def resolve(self, path: str | Path) -> Path:
        p = Path(path).expanduser()
        if not p.is_absolute() and self.config_dir is not None and not p.exists():
            candidate = self.config_dir / p
            if candidate.exists():
                return candidate
        return p
