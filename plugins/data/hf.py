"""The `hf` format: Hugging Face `datasets` from local files, tokenized once into a nanoset cache.

The tokens are written with the same writer as `nanocore preprocess` and read back with the nanoset
reader, so packing into `sequence_length + 1` windows is shared with the `nanoset` format.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import attrs
from tqdm.auto import tqdm

from nanocore.config.schema import doc
from nanocore.data.api import DatasetContext
from nanocore.errors import DataError
from nanocore_plugins.data.nanoset import NanosetDataset, normalized, open_folder
from nanocore_plugins.data.sources import BUILDERS, is_saved_dataset, iter_dataset_texts, load_saved, offline_datasets
from nanocore_plugins.data.writer import NanosetWriter, token_size_for, tokenize_batches

CACHE_VERSION = 1  # bump when the cached layout or tokenization rules change
COMPLETE = "nanocore_cache.json"  # written last: a folder without it is not a cache
PROBE = "The quick brown fox jumps over the lazy dog. 0123456789 éà漢字 <|endoftext|>"


@attrs.define
class HFArgs:
    """Local files or saved datasets read with Hugging Face `datasets` (nanotron's PretrainDatasetsArgs)."""

    hf_dataset_or_datasets: Any = doc(
        "A local path (.txt/.json/.jsonl/.parquet/.csv file, a folder of such files, or a save_to_disk folder), "
        "a list of paths, or a mapping path -> weight. Each path is one dataset of the mixture."
    )
    hf_dataset_splits: Any = doc(
        "Split name or list of splits (concatenated); single files have only one.", default="train"
    )
    hf_dataset_config_name: str | None = doc("`name` passed to datasets.load_dataset for folders.", default=None)
    text_column_name: str | None = doc("Column holding the text (null means 'text').", default="text")
    dataset_processing_num_proc_per_process: int = doc("Processes datasets.load_dataset may use.", default=1)
    dataset_overwrite_cache: bool = doc("Tokenize again even if a cache for these files exists.", default=False)
    dataset_weights: list[float] | None = doc(
        "Weights for a list of paths; default: proportional to each path's number of samples.", default=None
    )
    cache_dir: str | None = doc("Where tokenized data is cached; default: the run's data cache folder.", default=None)

    @property
    def splits(self) -> list[str]:
        splits = self.hf_dataset_splits or "train"
        return [splits] if isinstance(splits, str) else [str(s) for s in splits]

    @property
    def text_column(self) -> str:
        return self.text_column_name or "text"

    def paths_and_weights(self) -> tuple[list[str], list[float] | None]:
        data = self.hf_dataset_or_datasets
        if isinstance(data, str):
            return [data], self.dataset_weights
        if isinstance(data, dict):
            return [str(k) for k in data], [float(v) for v in data.values()]
        return [str(p) for p in data], self.dataset_weights

    def check(self, config: Any) -> list[str]:
        data = self.hf_dataset_or_datasets
        ok_list = isinstance(data, list) and data and all(isinstance(d, str) for d in data)
        ok_dict = isinstance(data, dict) and data and all(isinstance(v, (int, float)) for v in data.values())
        if not (isinstance(data, str) or ok_list or ok_dict):
            return [
                f"hf_dataset_or_datasets: expected a path, a list of paths or a mapping path -> weight, got {data!r}"
            ]
        p: list[str] = []
        paths, weights = self.paths_and_weights()
        if weights is not None and len(weights) != len(paths):
            p.append(f"dataset_weights: {len(weights)} weight(s) for {len(paths)} dataset(s)")
        if weights is not None and any(w <= 0 for w in weights):
            p.append(f"dataset_weights: weights must be positive, got {weights}")
        if self.dataset_processing_num_proc_per_process < 1:
            p.append("dataset_processing_num_proc_per_process: must be at least 1")
        for path in paths:
            if not Path(path).expanduser().exists():
                p.append(f"hf_dataset_or_datasets: {not_local_message(path)}")
        return p


def not_local_message(path: str) -> str:
    return (
        f"{path!r} does not exist (current directory: {os.getcwd()}). nanocore reads local data only, never "
        "from the Hugging Face Hub: on a machine with internet access run `datasets.load_dataset(NAME)"
        ".save_to_disk(FOLDER)` (or `huggingface-cli download --repo-type dataset NAME --local-dir FOLDER`), "
        "copy FOLDER here and point hf_dataset_or_datasets at it"
    )


def load_local_dataset(path: Path, splits: list[str], config_name: str | None, num_proc: int, cache_dir: Path) -> Any:
    """A `datasets.Dataset` from a file, a folder of data files, or a save_to_disk folder."""
    if is_saved_dataset(path):
        return load_saved(path, splits)
    kwargs: dict[str, Any] = {"cache_dir": str(cache_dir), "num_proc": num_proc if num_proc > 1 else None}
    if path.is_file():  # a single file is a single ("train") split, whatever hf_dataset_splits says
        builder = BUILDERS.get(path.suffix.lower(), "text")
        source, splits = {"path": builder, "data_files": str(path)}, ["train"]
    else:  # datasets infers the builder and the splits from the file names
        found = {BUILDERS[p.suffix.lower()] for p in path.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS}
        if not found:
            raise DataError(f"{path}: no .txt/.json/.jsonl/.parquet/.csv files (nor a save_to_disk dataset) inside")
        builder = found.pop() if len(found) == 1 else None
        source = {"path": str(path), "name": config_name}
    if builder == "text":
        kwargs["sample_by"] = "document"  # a text file is one document, as in `nanocore preprocess`
    parts = []
    with offline_datasets() as datasets:  # the Hub stays reachable for the rest of the process
        for split in splits:
            try:
                parts.append(datasets.load_dataset(**source, split=split, **kwargs))
            except Exception as exc:  # datasets raises many types (ValueError for an unknown split, ...)
                raise DataError(
                    f"{path}: datasets could not load split {split!r}: {type(exc).__name__}: {exc}"
                ) from None
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def tokenizer_identity(tokenizer: Any) -> Any:
    """What makes two tokenizers produce the same tokens; a probe encoding catches what names miss."""
    return [
        getattr(tokenizer, "fingerprint", None),
        type(tokenizer).__qualname__,
        getattr(tokenizer, "name", None),
        tokenizer.vocab_size,
        tokenizer.eos_token_id,
        tokenizer.encode(PROBE),
    ]


def cache_key(path: Path, args: HFArgs, tokenizer: Any) -> str:
    path = path.resolve()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    stats = [(str(f.relative_to(path)) if f != path else f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    payload = [CACHE_VERSION, str(path), stats, args.splits, args.hf_dataset_config_name, args.text_column]
    payload.append(tokenizer_identity(tokenizer))
    return hashlib.sha256(json.dumps(payload, default=str).encode()).hexdigest()


def cache_folder(root: Path, path: Path, key: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", path.resolve().name)[:40] or "data"
    return root / "hf" / f"{slug}-{key[:20]}"


def write_cache(path: Path, target: Path, args: HFArgs, tokenizer: Any) -> None:
    """Tokenize `path` into a temporary folder and rename it to `target` once complete."""
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    arrow = target.with_name(f".tmp-{target.name}-{os.getpid()}-arrow")  # datasets' copy, deleted when done
    for folder in (tmp, arrow):
        shutil.rmtree(folder, ignore_errors=True)
    num_proc = args.dataset_processing_num_proc_per_process
    dataset = load_local_dataset(path, args.splits, args.hf_dataset_config_name, num_proc, arrow)
    name = getattr(tokenizer, "name", None)
    writer = NanosetWriter(tmp, tokenizer_name=name, token_size=token_size_for(tokenizer.vocab_size))
    texts = iter_dataset_texts(dataset, args.text_column, path)
    with writer, tqdm(total=len(dataset), desc=f"Tokenizing {path.name}", unit="doc") as bar:
        for ids in tokenize_batches(tokenizer, texts):
            writer.add_document(ids)
            bar.update(1)
    info = {"source": str(path.resolve()), "splits": args.splits, "text_column": args.text_column, "tokenizer": name}
    info |= {"documents": writer.stats.documents, "tokens": writer.stats.tokens}
    (tmp / COMPLETE).write_text(json.dumps(info, indent=2))
    del dataset, texts
    shutil.rmtree(arrow, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def build_hf(args: HFArgs, ctx: DatasetContext) -> list[tuple[NanosetDataset, float]]:
    paths, weights = args.paths_and_weights()
    if weights is not None and len(weights) != len(paths):
        raise DataError(f"dataset_weights: {len(weights)} weight(s) for {len(paths)} dataset(s)")
    root = Path(args.cache_dir).expanduser() if args.cache_dir else Path(ctx.cache_dir)
    sources = []
    for raw in paths:
        path = ctx.resolve(raw)
        if not path.exists():
            raise DataError(f"hf_dataset_or_datasets: {not_local_message(raw)}")
        sources.append((path, cache_folder(root, path, cache_key(path, args, ctx.tokenizer))))
    if ctx.is_main_process:
        for path, target in sources:
            if args.dataset_overwrite_cache or not (target / COMPLETE).is_file():
                write_cache(path, target, args, ctx.tokenizer)
    ctx.barrier()  # every rank, main included, so the others read only finished caches
    datasets = []
    for path, target in sources:
        if not (target / COMPLETE).is_file():
            raise DataError(
                f"{path}: the tokenized cache {target} is missing after the main process wrote it; "
                "cache_dir must be on a file system every rank can read"
            )
        datasets.append(
            open_folder(target, sequence_length=ctx.sequence_length, vocab_size=ctx.vocab_size, tokenizer=ctx.tokenizer)
        )
    weights = normalized(weights if weights is not None else [float(len(d)) for d in datasets])
    return list(zip(datasets, weights, strict=True))
