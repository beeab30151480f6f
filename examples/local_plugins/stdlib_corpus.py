"""A local plugin: dataset format `python_stdlib`, the Python standard library's own source code.

Every machine that runs nanocore has this corpus (a few MB of real, varied text), so the tiny
example trains on real data with no download. Load it with `plugins: [local_plugins/stdlib_corpus.py]`
in a YAML file, or `--plugin examples/local_plugins/stdlib_corpus.py` on the command line.

This file uses only the public plugin API: `nanocore.hookimpl`, `registry.register(...)` with an
attrs config class, and the `DatasetContext` / `SampleDataset` interfaces of `nanocore.data.api`.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import sysconfig
import zlib
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from nanocore import hookimpl
from nanocore.config.schema import doc
from nanocore.data.api import DatasetContext, Tokenizer
from nanocore.errors import DataError

log = logging.getLogger(__name__)

# Folders and files that are not ordinary library code: third-party packages, test suites (which
# contain deliberately broken and oddly encoded files), codec tables and generated data.
DEFAULT_EXCLUDE = (
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "encodings",
    "pydoc_data",
    "_sysconfigdata*",
    "config-*",
)


@attrs.define
class StdlibCorpusArgs:
    """The Python standard library's `.py` files as one token stream, cut into training windows."""

    max_megabytes: float = doc(
        "Stop adding files once the training split holds this many MB of source (0 = no cap).", default=4.0
    )
    validation_every: int = doc(
        "Every N-th file (in corpus order) is held out for the validation split and never trained on.", default=20
    )
    exclude: list[str] = doc(
        "Glob patterns; a file is skipped when any folder or file name in its path matches one.",
        factory=lambda: list(DEFAULT_EXCLUDE),
    )
    root: str | None = doc("Folder to read instead of the running Python's stdlib (null = the stdlib).", default=None)

    def check(self, config: Any) -> list[str]:
        problems = []
        if self.max_megabytes < 0:
            problems.append(f"max_megabytes: must be 0 (no cap) or positive, got {self.max_megabytes}")
        if self.validation_every < 2:
            problems.append(f"validation_every: must be at least 2, got {self.validation_every}")
        return problems


def stdlib_root(args: StdlibCorpusArgs) -> Path:
    return Path(args.root).expanduser() if args.root else Path(sysconfig.get_paths()["stdlib"])


def corpus_files(args: StdlibCorpusArgs, split: str) -> list[Path]:
    """The files of `split` ("train" or "validation"), in corpus order. Deterministic for a given stdlib."""
    root = stdlib_root(args)
    if not root.is_dir():
        raise DataError(f"python_stdlib: {root} is not a folder (set the dataset's `root` to a folder of .py files)")

    def excluded(name: str) -> bool:
        return any(fnmatch.fnmatch(name, pattern) for pattern in args.exclude)

    candidates = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if not excluded(d)]  # never walk into the test suite
        for name in names:
            if name.endswith(".py") and not excluded(name):
                path = Path(folder, name)
                rel = path.relative_to(root).as_posix()
                candidates.append((zlib.crc32(rel.encode()), rel, path))
    # Ordered by a hash of the path rather than alphabetically, so that a capped corpus samples the
    # whole library instead of only the modules whose names start with 'a'..'e'.
    candidates.sort()
    cap = args.max_megabytes * 1e6
    train_bytes = 0
    chosen: list[Path] = []
    for index, (_, _, path) in enumerate(candidates):
        if cap and train_bytes >= cap:
            break
        held_out = index % args.validation_every == args.validation_every - 1
        if not held_out:
            train_bytes += path.stat().st_size
        if held_out == (split == "validation"):
            chosen.append(path)
    return chosen


def read_source(path: Path) -> str:
    # A few stdlib files are not UTF-8; a replacement character is harmless for training.
    return path.read_bytes().decode("utf-8", errors="replace")


def tokenize_files(files: list[Path], tokenizer: Tokenizer) -> np.ndarray:
    """All files as one stream of token ids, each file followed by the end-of-sequence token."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pieces = [np.asarray(tokenizer.encode(read_source(path)) + eos, dtype=np.int64) for path in files]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the corpus' token frequencies: the loss of a model that ignores context."""
    counts = np.bincount(tokens)
    p = counts[counts > 0] / len(tokens)
    return float(-(p * np.log(p)).sum())


class PackedTokens:
    """Sample i is tokens[i*(L+1) : (i+1)*(L+1)] with L = sequence_length: windows do not overlap."""

    def __init__(self, tokens: np.ndarray, sequence_length: int):
        self.window = sequence_length + 1
        self.tokens = tokens.astype(np.int32)  # half the memory; any tokenizer's ids fit
        self.num_samples = len(tokens) // self.window

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        index = int(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is out of range ({self.num_samples} samples)")
        start = index * self.window
        return torch.from_numpy(self.tokens[start : start + self.window].astype(np.int64))

    def __repr__(self) -> str:
        return f"PackedTokens(samples={self.num_samples}, window={self.window})"


def build_stdlib_corpus(args: StdlibCorpusArgs | None, ctx: DatasetContext) -> list[tuple[PackedTokens, float]]:
    args = args or StdlibCorpusArgs()
    if ctx.tokenizer is None:
        raise DataError("python_stdlib needs a tokenizer: set tokenizer.tokenizer_name_or_path (e.g. byte)")
    files = corpus_files(args, ctx.split)
    if not files:
        raise DataError(f"python_stdlib: no .py files for the {ctx.split} split under {stdlib_root(args)}")
    # Tokenised in memory on every rank: the byte tokenizer reads a few MB in well under a second.
    tokens = tokenize_files(files, ctx.tokenizer)
    if tokens.size and tokens.max() >= ctx.vocab_size:
        raise DataError(
            f"python_stdlib: token id {int(tokens.max())} is outside the model's vocabulary ({ctx.vocab_size})"
        )
    dataset = PackedTokens(tokens, ctx.sequence_length)
    if ctx.is_main_process:
        megabytes = sum(p.stat().st_size for p in files) / 1e6
        log.info(
            "python_stdlib %s split: %d files, %.1f MB, %d tokens, %d samples of %d tokens (unigram entropy %.3f nats)",
            ctx.split, len(files), megabytes, len(tokens), len(dataset), dataset.window,
            unigram_entropy(tokens) if tokens.size else math.nan,
        )  # fmt: skip
    return [(dataset, 1.0)]


@hookimpl
def register_dataset_formats(registry):
    registry.register(
        "python_stdlib",
        build_stdlib_corpus,
        config_class=StdlibCorpusArgs,
        description="the Python standard library's .py sources, packed into windows (local example plugin)",
    )
