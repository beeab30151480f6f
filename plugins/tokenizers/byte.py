"""The `byte` tokenizer: UTF-8 bytes are the tokens. Needs no files, so tests and examples run anywhere."""

from __future__ import annotations


class ByteTokenizer:
    """Token ids 0..255 are the UTF-8 bytes of the text; 256 is end-of-sequence.

    `encode` adds no special tokens (data writers append `eos_token_id` after each document).
    `decode` drops ids >= 256 and replaces invalid UTF-8 sequences with U+FFFD instead of failing,
    so sampled text can always be shown.
    """

    name = "byte"
    vocab_size = 257
    eos_token_id: int | None = 256
    bos_token_id: int | None = None
    # Identifies the tokenizer's behaviour in cache keys; bump if encoding ever changes.
    fingerprint = "byte-utf8-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eos_token_id=256)"


def build_byte_tokenizer(name_or_path: str = "byte") -> ByteTokenizer:
    """Registry factory; the argument is ignored (there is nothing to load)."""
    return ByteTokenizer()
