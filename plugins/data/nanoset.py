"""The `nanoset` format: folders of pre-tokenized `.ds` files as datatrove writes and nanotron reads.

Samples follow datatrove's DatatroveFileDataset: each `.ds` file is cut into consecutive,
non-overlapping windows of `sequence_length + 1` tokens (stride `sequence_length + 1`; the tail of a
file shorter than a window is unused), and a folder is its `*.ds` files in sorted order.
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from nanocore.config.schema import doc
from nanocore.data.api import DatasetContext
from nanocore.errors import DataError
from nanocore_plugins.data.writer import token_dtype, token_size_for

UNKNOWN_TOKENIZER = "Unknown Tokenizer"
MAX_CHECK_CHUNK = 1 << 24  # tokens per step of the load-time id check (64 MiB of uint32)


@attrs.frozen
class Metadata:
    """One `.ds.metadata` file: tokenizer name (None if unknown), token size and count when written."""

    path: Path
    tokenizer_name: str | None
    token_size: int | None
    token_count: int | None


def read_metadata(path: Path) -> Metadata:
    """Parse `<name>[|<token size>]\\n<count>\\n<count in words>` (older datatrove omits `|<size>`)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    name, size = (lines[0].strip() if lines else ""), None
    # datatrove writes "Unknown Tokenizer|2|2" for an unnamed tokenizer, so strip every numeric suffix.
    while "|" in name and name.rsplit("|", 1)[1].strip().isdigit():
        name, tail = name.rsplit("|", 1)
        size = size or int(tail)
    count = int(lines[1]) if len(lines) > 1 and lines[1].strip().isdigit() else None
    known = name and name != UNKNOWN_TOKENIZER
    return Metadata(path, name if known else None, size, count)


def short_tokenizer_name(name: str) -> str:
    """`meta-llama/Llama-3.2-1B`, `/models/Llama-3.2-1B/` and `.../Llama-3.2-1B/tokenizer.json` all give
    `llama-3.2-1b`, so a Hub name and a local copy of the same tokenizer are not reported as different."""
    parts = [p for p in name.replace("\\", "/").split("/") if p and p != "."]
    if parts and parts[-1] == "tokenizer.json":
        parts = parts[:-1]
    return (parts[-1] if parts else name).lower()


class NanosetFile:
    """One `.ds` file read through a numpy memmap opened lazily (so the dataset pickles cheaply into
    DataLoader workers instead of copying the mapped tokens)."""

    def __init__(self, path: Path, token_size: int, num_tokens: int):
        self.path = path
        self.token_size = token_size
        self.num_tokens = num_tokens
        self._mm: np.memmap | None = None

    @property
    def tokens(self) -> np.ndarray:
        if self._mm is None:
            if self.num_tokens == 0:  # numpy cannot map an empty file
                return np.zeros(0, dtype=token_dtype(self.token_size))
            self._mm = np.memmap(self.path, dtype=token_dtype(self.token_size), mode="r", shape=(self.num_tokens,))
        return self._mm

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_mm": None}

    def max_token(self) -> int:
        """Largest id in the file, in chunks so that a huge file never sits in memory at once."""
        tokens, best = self.tokens, -1
        for start in range(0, self.num_tokens, MAX_CHECK_CHUNK):
            best = max(best, int(tokens[start : start + MAX_CHECK_CHUNK].max()))
        return best


class NanosetDataset:
    """`SampleDataset` over one nanoset folder: sample i is the i-th `sequence_length + 1` window,
    counting through the files in sorted order."""

    def __init__(self, folder: Path, files: list[NanosetFile], sequence_length: int, tokenizer_name: str | None):
        self.folder = folder
        self.files = files
        self.sequence_length = sequence_length
        self.tokenizer_name = tokenizer_name
        window = sequence_length + 1
        self._starts = np.cumsum([0] + [f.num_tokens // window for f in files]).tolist()

    @property
    def num_tokens(self) -> int:
        return sum(f.num_tokens for f in self.files)

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> torch.Tensor:
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is out of range for {self.folder} ({len(self)} samples)")
        f = bisect.bisect_right(self._starts, index) - 1
        window = self.sequence_length + 1
        start = (index - self._starts[f]) * window
        return torch.from_numpy(self.files[f].tokens[start : start + window].astype(np.int64))

    def __repr__(self) -> str:
        return f"NanosetDataset({str(self.folder)!r}, files={len(self.files)}, samples={len(self)})"


def _file_tokens(path: Path, token_size: int, meta: Metadata | None) -> int:
    size = path.stat().st_size
    if size % token_size:
        raise DataError(
            f"{path}: size {size} bytes is not a multiple of the token size ({token_size} bytes); the file is "
            "truncated (an interrupted copy or tokenization?) or the token size is wrong (set `token_size` in the "
            "dataset args). Re-copy or re-tokenize it."
        )
    num_tokens = size // token_size
    index = Path(f"{path}.index")
    if index.exists():
        index_size = index.stat().st_size
        if index_size % 8:
            raise DataError(f"{index}: size {index_size} is not a multiple of 8 bytes; the index is truncated")
        if index_size:
            last_end = int(np.fromfile(index, dtype="<u8", count=1, offset=index_size - 8)[0])
            if last_end != num_tokens:
                raise DataError(
                    f"{path}: holds {num_tokens} tokens but its index says the last document ends at token "
                    f"{last_end}; the file is truncated or the index belongs to another file. Re-copy or "
                    "re-tokenize it."
                )
    if meta is not None and meta.token_count is not None and meta.token_count != num_tokens:
        raise DataError(
            f"{path}: holds {num_tokens} tokens but {meta.path.name} says {meta.token_count}; the file is truncated "
            "or was replaced. Re-copy or re-tokenize it."
        )
    return num_tokens


def open_folder(
    folder: Path,
    *,
    sequence_length: int,
    vocab_size: int,
    tokenizer: Any = None,
    token_size: int | None = None,
    check_tokenizer: bool = True,
) -> NanosetDataset:
    """Validate and open one folder; every inconsistency is a DataError saying what to do."""
    if not folder.is_dir():
        raise DataError(f"nanoset folder {str(folder)!r} does not exist (current directory: {os.getcwd()})")
    paths = sorted(p for p in folder.glob("*.ds") if p.is_file())
    if not paths:
        raise DataError(
            f"nanoset folder {str(folder)!r} has no *.ds files. Tokenize text into it with "
            f"`nanocore preprocess --input TEXT_FILES --output {folder} --tokenizer ...` (or datatrove's "
            "DocumentTokenizer)"
        )
    metas = {p: read_metadata(p) for p in sorted(folder.glob("*.ds.metadata"))}
    per_file = {p: metas.get(Path(f"{p}.metadata")) for p in paths}

    sizes = {m.token_size for m in metas.values() if m.token_size}
    if len(sizes) > 1:
        raise DataError(f"{folder}: the .ds.metadata files disagree on the token size ({sorted(sizes)}); mixed data?")
    meta_size = sizes.pop() if sizes else None
    if token_size is not None and meta_size is not None and token_size != meta_size:
        raise DataError(
            f"{folder}: token_size is set to {token_size} but the folder's metadata says {meta_size}-byte tokens; "
            "remove token_size from the dataset args"
        )
    tokenizer_vocab = getattr(tokenizer, "vocab_size", None)
    size = token_size or meta_size or token_size_for(tokenizer_vocab or vocab_size)

    data_name = next((m.tokenizer_name for m in metas.values() if m.tokenizer_name), None)
    our_name = getattr(tokenizer, "name", None)
    if check_tokenizer and data_name and our_name and short_tokenizer_name(data_name) != short_tokenizer_name(our_name):
        raise DataError(
            f"{folder} was tokenized with {data_name!r} (see its .ds.metadata) but the configured tokenizer is "
            f"{our_name!r}. Set tokenizer.tokenizer_name_or_path to the tokenizer the data was made with, or "
            f"re-tokenize it: `nanocore preprocess --input TEXT --output NEW_FOLDER --tokenizer {our_name}`. "
            "If both are the same tokenizer under different names, set `check_tokenizer: false` in the dataset args."
        )

    files = [NanosetFile(p, size, _file_tokens(p, size, per_file[p])) for p in paths]
    for f in files:
        if f.num_tokens and (top := f.max_token()) >= vocab_size:
            raise DataError(
                f"{f.path}: contains token id {top} but the model's vocabulary has {vocab_size} ids "
                f"(0..{vocab_size - 1}). "
                "The data was tokenized with a larger tokenizer than the configured one: use that tokenizer "
                "(and a model vocab_size at least as large) or re-tokenize the data with `nanocore preprocess`."
            )
    dataset = NanosetDataset(folder, files, sequence_length, data_name)
    if len(dataset) == 0:
        raise DataError(
            f"{folder}: no .ds file holds {sequence_length + 1} tokens (sequence_length + 1), so there are no "
            f"samples ({dataset.num_tokens} tokens in {len(files)} file(s)). Add data or lower tokens.sequence_length."
        )
    return dataset


def folder_weights(folder_arg: Any, weights_arg: list[float] | None) -> tuple[list[str], list[float] | None]:
    """nanotron's NanosetDatasetsArgs forms: a folder, a list (+ dataset_weights), or {folder: weight}."""
    if isinstance(folder_arg, str):
        return [folder_arg], weights_arg
    if isinstance(folder_arg, dict):
        return [str(k) for k in folder_arg], [float(v) for v in folder_arg.values()]
    return [str(f) for f in folder_arg], weights_arg


def normalized(weights: list[float]) -> list[float]:
    total = float(sum(weights))
    return [w / total for w in weights]


@attrs.define
class NanosetArgs:
    """Pre-tokenized folders (datatrove / nanotron Nanoset layout)."""

    dataset_folder: Any = doc(
        "A folder of *.ds files, a list of folders, or a mapping folder -> weight (each folder is one dataset)."
    )
    dataset_weights: list[float] | None = doc(
        "Weights for a list of folders; default: proportional to each folder's number of samples.", default=None
    )
    token_size: int | None = doc(
        "Bytes per token (2 or 4); default: from .ds.metadata, else 4 if the tokenizer has over 65536 ids.",
        default=None,
    )
    check_tokenizer: bool = doc(
        "Refuse folders whose .ds.metadata names a different tokenizer than the configured one.", default=True
    )

    def check(self, config: Any) -> list[str]:
        p: list[str] = []
        folder = self.dataset_folder
        ok_list = isinstance(folder, list) and folder and all(isinstance(f, str) for f in folder)
        ok_dict = isinstance(folder, dict) and folder and all(isinstance(v, (int, float)) for v in folder.values())
        if not (isinstance(folder, str) or ok_list or ok_dict):
            return [
                f"dataset_folder: expected a folder, a list of folders or a mapping folder -> weight, got {folder!r}"
            ]
        folders, weights = folder_weights(folder, self.dataset_weights)
        if isinstance(folder, dict) and self.dataset_weights is not None:
            p.append("dataset_weights: give weights either in the dataset_folder mapping or here, not both")
        elif weights is not None and len(weights) != len(folders):
            p.append(f"dataset_weights: {len(weights)} weight(s) for {len(folders)} folder(s)")
        if weights is not None and any(w <= 0 for w in weights):
            p.append(f"dataset_weights: weights must be positive, got {weights}")
        if self.token_size not in (None, 2, 4):
            p.append(f"token_size: must be 2 or 4 (bytes per token), got {self.token_size}")
        for f in folders:
            path = Path(f).expanduser()
            if not path.is_dir():
                p.append(
                    f"dataset_folder: folder {f!r} does not exist (relative to the current directory {os.getcwd()})"
                )
            elif not any(path.glob("*.ds")):
                p.append(f"dataset_folder: folder {f!r} has no *.ds files (make them with `nanocore preprocess`)")
        return p


def build_nanoset(args: NanosetArgs, ctx: DatasetContext) -> list[tuple[NanosetDataset, float]]:
    folders, weights = folder_weights(args.dataset_folder, args.dataset_weights)
    if weights is not None and len(weights) != len(folders):
        raise DataError(f"dataset_weights: {len(weights)} weight(s) for {len(folders)} folder(s)")
    datasets = [
        open_folder(
            ctx.resolve(f),
            sequence_length=ctx.sequence_length,
            vocab_size=ctx.vocab_size,
            tokenizer=ctx.tokenizer,
            token_size=args.token_size,
            check_tokenizer=args.check_tokenizer,
        )
        for f in folders
    ]
    weights = normalized(weights if weights is not None else [float(len(d)) for d in datasets])
    return list(zip(datasets, weights, strict=True))
