"""Where documents come from: local text/JSON/Parquet/CSV files and `save_to_disk` folders.

A `.txt` file is one document everywhere in nanocore (not one document per line). Nothing here
touches the network: `datasets` is called with its offline switches on (`offline_datasets`).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from nanocore.errors import DataError

# file extension -> `datasets` packaged builder
BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


OFFLINE_ENV = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


@contextmanager
def offline_datasets() -> Iterator[Any]:
    """`datasets`, with every Hub access and its progress bars switched off for the calls made in the block.

    Scoped to nanocore's own calls: the environment variables (read by worker processes) and the
    flags `datasets` and `huggingface_hub` read at each call are put back on the way out, so other
    code in the same process (transformers, a notebook around a run) reaches the Hub as it would
    without nanocore. (Not thread-safe: nanocore builds datasets on one thread.)
    """
    saved_env = {name: os.environ.get(name) for name in OFFLINE_ENV}
    os.environ.update(dict.fromkeys(OFFLINE_ENV, "1"))
    import datasets
    import huggingface_hub.constants as hub

    flags = [(datasets.config, "HF_DATASETS_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"), (hub, "HF_HUB_OFFLINE")]
    saved_flags = [(module, name, getattr(module, name)) for module, name in flags]
    bars = datasets.logging.is_progress_bar_enabled()
    try:
        for module, name in flags:
            setattr(module, name, True)
        datasets.logging.disable_progress_bar()  # ours is the one that counts documents
        yield datasets
    finally:
        for module, name, value in saved_flags:
            setattr(module, name, value)
        if bars:
            datasets.logging.enable_progress_bar()
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def is_saved_dataset(folder: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    return folder.is_dir() and (
        (folder / "dataset_dict.json").is_file()
        or ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())
    )


def load_saved(folder: Path, splits: list[str]) -> Any:
    """`datasets.load_from_disk`, with the requested splits of a DatasetDict concatenated."""
    with offline_datasets() as datasets:
        try:
            loaded = datasets.load_from_disk(str(folder))
        except Exception as exc:
            raise DataError(f"{folder}: cannot read this save_to_disk folder: {exc}") from None
        if isinstance(loaded, datasets.DatasetDict):
            missing = [s for s in splits if s not in loaded]
            if missing:
                raise DataError(
                    f"{folder}: no split {', '.join(map(repr, missing))}; it has {', '.join(map(repr, loaded))} "
                    "(choose with hf_dataset_splits / --split)"
                )
            parts = [loaded[s] for s in splits]
            return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        return loaded


def require_column(columns: Iterable[str], column: str, where: Any) -> None:
    columns = list(columns)
    if column not in columns:
        raise DataError(
            f"{where}: no text column {column!r}; columns are {', '.join(map(repr, columns)) or 'none'} "
            "(set text_column_name / --text-column)"
        )


def iter_dataset_texts(dataset: Any, column: str, where: Any, batch_size: int = 1000) -> Iterator[str]:
    require_column(dataset.column_names, column, where)
    for batch in dataset.select_columns([column]).iter(batch_size=batch_size):
        yield from (t for t in batch[column] if t is not None)


def _json_rows(path: Path) -> Iterator[Any]:
    with open(path, encoding="utf-8") as f:
        head = f.read(1024).lstrip()
        f.seek(0)
        if head.startswith("["):  # a JSON array of records; otherwise JSON lines
            yield from json.load(f)
            return
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except ValueError as exc:
                    raise DataError(f"{path}:{n}: not valid JSON ({exc})") from None


def iter_file_texts(path: Path, column: str) -> Iterator[str]:
    """Documents of one file: the whole file for text, the `column` of each record otherwise."""
    ext = path.suffix.lower()
    if ext in (".json", ".jsonl"):
        for row in _json_rows(path):
            if not isinstance(row, dict):
                raise DataError(f"{path}: expected JSON objects with a {column!r} key, got {type(row).__name__}")
            require_column(row, column, path)
            if row[column] is not None:
                yield str(row[column])
    elif ext == ".parquet":
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        require_column(parquet.schema_arrow.names, column, path)
        for batch in parquet.iter_batches(columns=[column], batch_size=1000):
            yield from (t for t in batch.column(0).to_pylist() if t is not None)
    elif ext == ".csv":
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            require_column(reader.fieldnames or [], column, path)
            yield from (row[column] for row in reader)
    else:  # plain text, whatever the extension: one document per file
        yield path.read_text(encoding="utf-8", errors="replace")


def iter_documents(inputs: Iterable[str | Path], column: str, glob: str, splits: list[str]) -> Iterator[str]:
    """Every document of every input, in order: files, folders of files matching `glob`, saved datasets."""
    for raw in inputs:
        path = Path(raw).expanduser()
        if is_saved_dataset(path):
            yield from iter_dataset_texts(load_saved(path, splits), column, path)
        elif path.is_dir():
            files = sorted(p for p in path.glob(glob) if p.is_file())
            if not files:
                raise DataError(f"{path}: no files match {glob!r} (choose another pattern with --glob)")
            for file in files:
                yield from iter_file_texts(file, column)
        elif path.is_file():
            yield from iter_file_texts(path, column)
        else:
            raise DataError(f"input {str(raw)!r} does not exist (current directory: {os.getcwd()})")
