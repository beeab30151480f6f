"""A local plugin: dataset format `jsonl_documents`, documents from a JSON Lines file.

Each line of the file is a JSON object; the text under `text_key` is one document. Documents are
tokenised with the run's tokenizer, each followed by the end-of-sequence token, joined into one
stream and cut into non-overlapping windows of `tokens.sequence_length + 1` tokens (inputs and
shifted labels). Load it with `--plugin examples/local_plugins/jsonl_dataset.py` (or the YAML
`plugins:` list, or NANOCORE_PLUGINS) and use it in a stage:

    data_stages:
    - name: stable
      start_training_step: 1
      data:
        dataset: {format: jsonl_documents, path: data/corpus.jsonl, text_key: text}

This file uses only the public plugin API: `nanocore.hookimpl`, `registry.register(...)` with an
attrs config class, and the `DatasetContext` / `SampleDataset` interfaces of `nanocore.data.api`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import attrs
import torch

from nanocore import hookimpl
from nanocore.config.schema import doc
from nanocore.data.api import DatasetContext
from nanocore.errors import DataError

log = logging.getLogger(__name__)


@attrs.define
class JsonlDocumentsArgs:
    """A JSON Lines file of documents, tokenised and packed into training windows."""

    path: str = doc("The .jsonl file: one JSON object per line (relative paths: from the current directory).")
    text_key: str = doc("The key holding each document's text.", default="text")
    skip_missing: bool = doc(
        "Skip lines without `text_key` (or whose value is not a string) instead of stopping with an error.",
        default=False,
    )

    def check(self, config: Any) -> list[str]:
        problems = []
        if not self.text_key:
            problems.append("text_key: must name the key that holds each document's text")
        if not Path(self.path).expanduser().is_file():
            problems.append(f"path: file {self.path!r} does not exist (relative paths start at {Path.cwd()})")
        if config.tokenizer.tokenizer_name_or_path is None:
            problems.append("format jsonl_documents tokenises text: set tokenizer.tokenizer_name_or_path (e.g. byte)")
        return problems


def read_documents(args: JsonlDocumentsArgs, path: Path) -> list[str]:
    documents = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"jsonl_documents: {path}:{number} is not valid JSON: {exc.msg}") from None
            text = record.get(args.text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                if args.skip_missing:
                    continue
                raise DataError(
                    f"jsonl_documents: {path}:{number} has no string under {args.text_key!r} "
                    "(set text_key, or skip_missing: true)"
                )
            documents.append(text)
    return documents


class PackedWindows:
    """Sample i is tokens[i*(L+1) : (i+1)*(L+1)] with L = sequence_length; the tail shorter than a window is dropped."""

    def __init__(self, tokens: torch.Tensor, sequence_length: int):
        self.window = sequence_length + 1
        self.tokens = tokens
        self.num_samples = len(tokens) // self.window

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        index = int(index)
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is out of range ({self.num_samples} samples)")
        return self.tokens[index * self.window : (index + 1) * self.window].clone()


def build_jsonl_documents(args: JsonlDocumentsArgs, ctx: DatasetContext) -> list[tuple[PackedWindows, float]]:
    if ctx.tokenizer is None:
        raise DataError("jsonl_documents needs a tokenizer: set tokenizer.tokenizer_name_or_path (e.g. byte)")
    path = ctx.resolve(args.path)
    documents = read_documents(args, path)
    eos = [ctx.tokenizer.eos_token_id] if ctx.tokenizer.eos_token_id is not None else []
    ids = [token for text in documents for token in ctx.tokenizer.encode(text) + eos]
    tokens = torch.tensor(ids, dtype=torch.long)
    if len(tokens) and int(tokens.max()) >= ctx.vocab_size:
        raise DataError(
            f"jsonl_documents: token id {int(tokens.max())} is outside the model's vocabulary ({ctx.vocab_size})"
        )
    dataset = PackedWindows(tokens, ctx.sequence_length)
    if len(dataset) == 0:
        raise DataError(
            f"jsonl_documents: {path} holds {len(tokens)} tokens, fewer than one window of "
            f"sequence_length + 1 = {dataset.window}"
        )
    if ctx.is_main_process:
        log.info(
            "jsonl_documents %s: %d documents, %d tokens, %d samples", path, len(documents), len(tokens), len(dataset)
        )
    return [(dataset, 1.0)]


@hookimpl
def register_dataset_formats(registry):
    registry.register(
        "jsonl_documents",
        build_jsonl_documents,
        config_class=JsonlDocumentsArgs,
        description="documents from a JSON Lines file, tokenised and packed into windows (local example plugin)",
    )
