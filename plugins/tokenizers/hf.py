"""The `hf` tokenizer: a local `tokenizer.json` (Hugging Face `tokenizers` library), never the Hub."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from nanocore.errors import DataError

# Used only when neither tokenizer_config.json nor special_tokens_map.json names the special tokens
# (a bare tokenizer.json, e.g. GPT-2's): the first of these present in the vocabulary wins.
COMMON_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")
COMMON_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from a local file, with eos/bos ids from the files beside it.

    `encode` adds no special tokens (no BOS from a Llama post-processor, for example); data writers
    append `eos_token_id` after each document, as datatrove's DocumentTokenizer does.
    `decode` skips special tokens.
    """

    def __init__(self, tokenizer: Any, name: str, eos_token: str | None, bos_token: str | None, fingerprint: str):
        self._tok = tokenizer
        self.name = name
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.eos_token_id: int | None = tokenizer.token_to_id(eos_token) if eos_token is not None else None
        self.bos_token_id: int | None = tokenizer.token_to_id(bos_token) if bos_token is not None else None
        self.fingerprint = fingerprint

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos={self.eos_token!r}, bos={self.bos_token!r})"
        )


def _token_text(value: Any) -> str | None:
    """Special tokens are stored as a string or as an AddedToken dict with a 'content' key."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read {str(path)!r}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _special_tokens(folder: Path, vocab: dict[str, int]) -> tuple[str | None, str | None]:
    found: dict[str, str | None] = {"eos_token": None, "bos_token": None}
    for filename in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / filename
        if not path.is_file():
            continue
        data = _read_json(path)
        for key in found:
            if found[key] is None:
                found[key] = _token_text(data.get(key))
    configured = (folder / "tokenizer_config.json").is_file() or (folder / "special_tokens_map.json").is_file()
    if not configured:
        found["eos_token"] = next((t for t in COMMON_EOS if t in vocab), None)
        found["bos_token"] = next((t for t in COMMON_BOS if t in vocab), None)
    for key, token in found.items():
        if token is not None and token not in vocab:
            raise DataError(
                f"{folder}: {key} {token!r} (from tokenizer_config.json / special_tokens_map.json) is not in "
                "tokenizer.json's vocabulary; fix or remove that entry"
            )
    return found["eos_token"], found["bos_token"]


def load_hf_tokenizer(name_or_path: str) -> HFTokenizer:
    """Load `name_or_path`: a tokenizer.json file or a folder holding one. Hub names are refused."""
    from tokenizers import Tokenizer

    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise DataError(
            f"tokenizer {name_or_path!r} is not a local file or folder. nanocore loads tokenizers from local files "
            "only (it never downloads from the Hugging Face Hub). On a machine with internet access run, e.g., "
            f"`huggingface-cli download {name_or_path} tokenizer.json tokenizer_config.json special_tokens_map.json "
            "--local-dir ./my-tokenizer` (or `AutoTokenizer.from_pretrained(...).save_pretrained('./my-tokenizer')`), "
            "copy the folder here and set tokenizer.tokenizer_name_or_path to it; or use `byte`, which needs no files."
        )
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise DataError(
            f"tokenizer folder {name_or_path!r} has no tokenizer.json. If it holds a slow tokenizer "
            "(vocab.json + merges.txt, tokenizer.model), convert it once with transformers: "
            "`AutoTokenizer.from_pretrained(folder).save_pretrained(folder)` writes tokenizer.json."
        )
    raw = file.read_bytes()
    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # the tokenizers library raises plain Exceptions for bad files
        raise DataError(f"{str(file)!r} is not a valid tokenizer.json: {exc}") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    eos, bos = _special_tokens(file.parent, vocab)
    digest = hashlib.sha256(raw)
    digest.update(json.dumps([eos, bos]).encode())
    return HFTokenizer(tokenizer, name_or_path, eos, bos, f"hf-{digest.hexdigest()[:32]}")
