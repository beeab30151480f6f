"""`nanocore preprocess`: tokenize local text into a nanoset folder (datatrove layout) for the `nanoset` format."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from nanocore.errors import DataError
from nanocore.plugins import add_plugin_argument
from nanocore_plugins.data.sources import iter_documents
from nanocore_plugins.data.writer import NanosetWriter, token_size_for, tokenize_batches

DESCRIPTION = (
    "Tokenize local text (.txt files, folders of them, .jsonl/.json/.parquet/.csv files, save_to_disk folders) "
    "into a nanoset folder of *.ds files, the layout datatrove writes and the `nanoset` dataset format reads. "
    "An eos token is appended after each document when the tokenizer has one."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or folders to tokenize")
    parser.add_argument("--output", required=True, metavar="FOLDER", help="nanoset folder to write (*.ds files)")
    parser.add_argument(
        "--tokenizer",
        default="byte",
        help="`byte`, another registered tokenizer, or a path to tokenizer.json / a tokenizer folder (default: byte)",
    )
    parser.add_argument(
        "--tokenizer-type",
        default=None,
        help="force a tokenizer plugin (default: the --tokenizer name if registered, else hf)",
    )
    parser.add_argument(
        "--text-column",
        default="text",
        help="column/key holding the text in JSON, Parquet, CSV and saved datasets (default: text)",
    )
    parser.add_argument("--glob", default="**/*.txt", help="files to read inside input folders (default: **/*.txt)")
    parser.add_argument("--split", default="train", help="split to read from a saved DatasetDict (default: train)")
    parser.add_argument(
        "--max-tokens-per-file",
        type=int,
        default=None,
        metavar="N",
        help="start a new .ds file before one would exceed N tokens (documents are never split)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace the .ds files already in --output")
    add_plugin_argument(parser, help="extra plugin providing a tokenizer (repeatable)")


def build_tokenizer(name: str, tokenizer_type: str | None, plugins: Any) -> Any:
    registry = plugins.registries.tokenizer
    kind = tokenizer_type or (name if name in registry else "hf")
    return registry.get(kind, path="--tokenizer-type" if tokenizer_type else "--tokenizer").factory(name)


def _clear_output(folder: Path, overwrite: bool) -> None:
    existing = sorted(folder.glob("*.ds*")) if folder.is_dir() else []
    token_files = [p for p in existing if p.suffix == ".ds"]
    if existing and not overwrite:
        raise DataError(
            f"output folder {str(folder)!r} already holds {len(token_files)} .ds file(s); new files would mix with "
            "them. Choose another --output or pass --overwrite to replace them"
        )
    for path in existing:
        path.unlink()


def run(args: argparse.Namespace) -> int:
    from nanocore.plugins import load_plugins

    for raw in args.input:
        if not Path(raw).expanduser().exists():
            raise DataError(f"--input {raw!r} does not exist (current directory: {os.getcwd()})")
    if args.max_tokens_per_file is not None and args.max_tokens_per_file < 1:
        raise DataError(f"--max-tokens-per-file must be at least 1, got {args.max_tokens_per_file}")
    tokenizer = build_tokenizer(args.tokenizer, args.tokenizer_type, load_plugins(local=args.plugin))
    output = Path(args.output).expanduser()
    _clear_output(output, args.overwrite)

    token_size = token_size_for(tokenizer.vocab_size)
    name = getattr(tokenizer, "name", None) or args.tokenizer
    writer = NanosetWriter(
        output, tokenizer_name=name, token_size=token_size, max_tokens_per_file=args.max_tokens_per_file
    )
    texts = iter_documents(args.input, args.text_column, args.glob, [args.split])
    with writer, tqdm(desc="Tokenizing", unit="doc", file=sys.stderr) as bar:
        for ids in tokenize_batches(tokenizer, texts):
            writer.add_document(ids)
            bar.update(1)
            if bar.n % 1000 == 0:
                bar.set_postfix(tokens=writer.stats.tokens, refresh=False)
    stats = writer.stats
    if stats.documents == 0:
        raise DataError(f"no documents found in {' '.join(args.input)} (check --glob and --text-column)")
    print(
        f"Wrote {stats.documents} documents, {stats.tokens} tokens ({token_size}-byte ids, tokenizer {name!r}) "
        f"in {len(stats.files)} file(s) to {output}"
    )
    for path in stats.files:
        print(f"  {path.name}")
    print(f"Use it with:  dataset: {{format: nanoset, dataset_folder: {output}}}")
    return 0
