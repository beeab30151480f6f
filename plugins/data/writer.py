"""Write token streams as a nanoset folder, in the layout datatrove's DocumentTokenizer/Merger write.

A folder holds `NNNNN_<prefix>.ds` token files (little-endian uint16, or uint32 for vocabularies over
65536), each with `.ds.index` (uint64 end offset of every document, in tokens) and `.ds.metadata`
(`<tokenizer name>|<token size>`, the token count, the count in words), plus a folder-level
`<prefix>.ds.metadata` with the total, as datatrove's DocumentTokenizerMerger leaves it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from nanocore.errors import DataError

UINT16_VOCAB = 65536  # datatrove/nanotron: 2-byte tokens while the vocabulary fits, else 4


def token_size_for(vocab_size: int) -> int:
    return 4 if vocab_size > UINT16_VOCAB else 2


def token_dtype(token_size: int) -> np.dtype:
    return np.dtype("<u4") if token_size == 4 else np.dtype("<u2")


def humanize_tokens(count: int) -> str:
    """`1.23 MT`, like datatrove's third metadata line (humanize.metric(count, unit='T'))."""
    value, prefix = float(count), ""
    for p in ("k", "M", "G", "T", "P"):
        if abs(value) < 1000:
            break
        value, prefix = value / 1000, p
    return f"{value:.3g} {prefix}T"


def metadata_text(tokenizer_name: str | None, token_size: int, token_count: int) -> str:
    name = tokenizer_name or "Unknown Tokenizer"
    return "\n".join([f"{name}|{token_size}", str(token_count), humanize_tokens(token_count)])


@attrs.define
class WriteStats:
    """What a writer produced (printed by `nanocore preprocess`)."""

    documents: int = 0
    tokens: int = 0
    files: list[Path] = attrs.field(factory=list)


class NanosetWriter:
    """Appends documents (lists of token ids) to `.ds` files in `folder`, rolling over to a new file
    before a document would push the current one past `max_tokens_per_file` (documents are never split).

    Use as a context manager, or call `close()`; nothing is valid on disk until then.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        tokenizer_name: str | None,
        token_size: int,
        max_tokens_per_file: int | None = None,
        prefix: str = "tokenized",
    ):
        if token_size not in (2, 4):
            raise ValueError(f"token_size must be 2 or 4, got {token_size}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.tokenizer_name = tokenizer_name
        self.token_size = token_size
        self.dtype = token_dtype(token_size)
        self.max_tokens_per_file = max_tokens_per_file if max_tokens_per_file and max_tokens_per_file > 0 else None
        self.prefix = prefix
        self.stats = WriteStats()
        self._file: Any = None
        self._path: Path | None = None
        self._doc_ends: list[int] = []
        self._written = 0  # tokens in the current file

    def _open_next(self) -> None:
        self._path = self.folder / f"{len(self.stats.files):05d}_{self.prefix}.ds"
        self._file = open(self._path, "wb")  # noqa: SIM115 (closed in _close_current)
        self._doc_ends = []
        self._written = 0
        self.stats.files.append(self._path)

    def _close_current(self) -> None:
        if self._file is None:
            return
        self._file.close()
        assert self._path is not None
        Path(f"{self._path}.index").write_bytes(np.asarray(self._doc_ends, dtype="<u8").tobytes())
        Path(f"{self._path}.metadata").write_text(metadata_text(self.tokenizer_name, self.token_size, self._written))
        self._file = None

    def add_document(self, ids: Iterable[int] | np.ndarray) -> None:
        tokens = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= 2 ** (8 * self.token_size)):
            raise DataError(
                f"token id {int(tokens.max())} does not fit in {self.token_size}-byte tokens; "
                "the tokenizer's vocabulary is larger than the token size chosen (use token size 4)"
            )
        if self._file is None:
            self._open_next()
        elif self.max_tokens_per_file and self._written and self._written + tokens.size > self.max_tokens_per_file:
            self._close_current()
            self._open_next()
        self._file.write(tokens.astype(self.dtype).tobytes())
        self._written += int(tokens.size)
        self._doc_ends.append(self._written)
        self.stats.documents += 1
        self.stats.tokens += int(tokens.size)

    def close(self) -> WriteStats:
        self._close_current()
        total = self.folder / f"{self.prefix}.ds.metadata"
        total.write_text(metadata_text(self.tokenizer_name, self.token_size, self.stats.tokens))
        return self.stats

    def __enter__(self) -> NanosetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif self._file is not None:
            self._file.close()


def tokenize_batches(tokenizer: Any, texts: Iterable[str], batch_size: int = 1000) -> Iterator[list[int]]:
    """Token ids of each text followed by the tokenizer's eos (when it has one), batch-encoded when possible."""
    eos = getattr(tokenizer, "eos_token_id", None)
    encode_batch = getattr(tokenizer, "encode_batch", None)
    batch: list[str] = []

    def flush() -> Iterator[list[int]]:
        encoded = encode_batch(batch) if encode_batch else [tokenizer.encode(t) for t in batch]
        for ids in encoded:
            yield [*ids, eos] if eos is not None else list(ids)

    for text in texts:
        batch.append(text)
        if len(batch) >= batch_size:
            yield from flush()
            batch = []
    if batch:
        yield from flush()
