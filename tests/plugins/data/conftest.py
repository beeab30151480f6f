"""Fixtures for the data-format tests. Helpers are handed out as the `dh` fixture (not imported), so
they work whatever pytest import mode the suite uses."""

import importlib.metadata
import struct
import types
from pathlib import Path

import numpy as np
import pytest

from nanocore.data.api import DatasetContext
from nanocore_plugins.tokenizers.byte import ByteTokenizer


class NamedTokenizer(ByteTokenizer):
    """A byte tokenizer that claims another name and vocabulary size (for format checks)."""

    def __init__(self, name: str, vocab_size: int = 257):
        self.name = name
        self.vocab_size = vocab_size


class CountingTokenizer(ByteTokenizer):
    """Counts documents it tokenizes, to tell a cache hit from a re-tokenization."""

    def __init__(self):
        self.documents = 0

    def encode_batch(self, texts):
        self.documents += len(texts)
        return super().encode_batch(texts)


@pytest.fixture
def make_ctx(tmp_path):
    def make(tokenizer=None, sequence_length=8, vocab_size=257, **kw) -> DatasetContext:
        kw.setdefault("cache_dir", tmp_path / "cache")
        return DatasetContext(
            tokenizer=tokenizer or ByteTokenizer(), sequence_length=sequence_length, vocab_size=vocab_size, seed=1, **kw
        )

    return make


@pytest.fixture
def only_data_plugins(monkeypatch):
    """Entry points other than data and tokenizers are disabled, so these tests depend on nothing else."""
    others = {ep.name for ep in importlib.metadata.entry_points(group="nanocore")} - {"data", "tokenizers"}
    monkeypatch.setenv("NANOCORE_DISABLE_PLUGINS", ",".join(sorted(others)))


def stream(texts, tokenizer=None):
    """What every writer must produce: each document's ids followed by eos, concatenated."""
    tokenizer = tokenizer or ByteTokenizer()
    out = []
    for text in texts:
        out += tokenizer.encode(text) + [tokenizer.eos_token_id]
    return out


def windows(tokens, sequence_length):
    n = sequence_length + 1
    return [tokens[i * n : (i + 1) * n] for i in range(len(tokens) // n)]


def read_ds(folder: Path, dtype="<u2"):
    """Token ids of each .ds file in a folder, in file order."""
    return [np.fromfile(p, dtype=dtype).tolist() for p in sorted(Path(folder).glob("*.ds"))]


def write_datatrove_file(folder, name, docs, tokenizer="gpt2", token_size=2, metadata=True):
    """Exactly what datatrove's TokenizedFile writes: packed ids, uint64 doc ends, 3-line metadata."""
    fmt = "I" if token_size == 4 else "H"
    tokens = [t for d in docs for t in d]
    (folder / name).write_bytes(struct.pack(f"<{len(tokens)}{fmt}", *tokens))
    ends = np.cumsum([len(d) for d in docs]).tolist()
    (folder / f"{name}.index").write_bytes(struct.pack(f"<{len(ends)}Q", *ends))
    if metadata:
        (folder / f"{name}.metadata").write_text(f"{tokenizer}|{token_size}\n{len(tokens)}\n{len(tokens)} T")
    return tokens


@pytest.fixture
def dh():
    return types.SimpleNamespace(
        NamedTokenizer=NamedTokenizer,
        CountingTokenizer=CountingTokenizer,
        stream=stream,
        windows=windows,
        read_ds=read_ds,
        write_datatrove_file=write_datatrove_file,
    )
