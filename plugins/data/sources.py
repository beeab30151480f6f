"""Where documents come from: local text/JSON/Parquet/CSV files and `save_to_disk` folders.

A `.txt` file is one document everywhere in nanocore (not one document per line). Nothing here
touches the network: `datasets` is imported with its offline switches on.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from nanocore.errors import DataError

# file extension -> `datasets` packaged builder
BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def offline_datasets() -> Any:
    """Import `datasets` with every Hub access switched off (also when it was imported before)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    datasets.logging.disable_progress_bar()  # ours is the one that counts documents
    return datasets


def is_saved_dataset(folder: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    return folder.is_dir() and (
        (folder / "dataset_dict.json").is_file()
        or ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())
    )


def load_saved(folder: Path, splits: list[str]) -> Any:
    """`datasets.load_from_disk`, with the requested splits of a DatasetDict concatenated."""
    datasets = offline_datasets()
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
