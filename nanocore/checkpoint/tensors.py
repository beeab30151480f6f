"""Sharded tensors on disk: each rank writes the pieces it owns with their place in the full tensor;
any reader cuts out the rectangle it needs, whatever layout wrote them.

Files are safetensors; the metadata entry `nanocore` holds, for every key, the full tensor's name,
full shape and the piece's offsets.

Rows a layout adds as padding (`Placement.valid_rows`: the vocabulary padded for tensor
parallelism) are never written: pieces are clipped to the real rows and the full shape recorded is
the real one. A reader whose layout pads again gets zeros in those rows. Checkpoints of format
version 1 saved the padding; a reader takes their first real rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanocore.errors import NanocoreError
from nanocore.sharding import Placement

META_KEY = "nanocore"


@attrs.frozen
class ShardedTensor:
    """A local tensor, the name of the full tensor it belongs to, and where it sits in it."""

    name: str
    tensor: torch.Tensor
    placement: Placement
    # False for weights the optimizer never updates (a router's balancing bias): they have no optimizer state
    trained: bool = True


def write_shards(path: Path, shards: Iterable[ShardedTensor]) -> None:
    """Write the real rows of pieces to one safetensors file (no file when there is nothing to write)."""
    tensors: dict[str, torch.Tensor] = {}
    index: dict[str, dict] = {}
    for i, shard in enumerate(shards):
        tensor, placement = shard.tensor, shard.placement
        if placement.valid_rows is not None:
            rows = placement.real_rows(tensor.shape[0])
            if rows == 0:
                continue  # the whole piece is padding
            tensor = tensor[:rows]
        key = f"{i}:{shard.name}"
        tensors[key] = tensor.detach().to("cpu").contiguous()
        index[key] = {
            "name": shard.name,
            "full_shape": list(placement.real_shape),
            "offsets": list(placement.offsets),
            **({} if shard.trained else {"trained": False}),
        }
    if not tensors:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={META_KEY: json.dumps(index)})


@attrs.define
class _Piece:
    file: Path | None  # None: `tensor` holds the piece in memory
    key: str
    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    tensor: torch.Tensor | None = None


class ShardReader:
    """Index of every piece in a folder of shard files; reads any rectangle of any full tensor."""

    def __init__(self, folder: Path | None, *, source: str | None = None):
        self.folder = folder
        self.source = source or f"checkpoint {folder}"
        self.pieces: dict[str, list[_Piece]] = {}
        files = sorted(folder.glob("*.safetensors")) if folder is not None and folder.exists() else []
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get(META_KEY, "{}"))
                for key, info in meta.items():
                    shape = tuple(f.get_slice(key).get_shape())
                    piece = _Piece(file, key, tuple(info["full_shape"]), tuple(info["offsets"]), shape)
                    self.pieces.setdefault(info["name"], []).append(piece)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], source: str) -> ShardReader:
        """A reader over whole tensors held in memory (weights converted from another format)."""
        reader = cls(None, source=source)
        for name, tensor in tensors.items():
            shape = tuple(tensor.shape)
            reader.pieces[name] = [_Piece(None, name, shape, (0,) * len(shape), shape, tensor)]
        return reader

    def names(self) -> list[str]:
        return sorted(self.pieces)

    def __contains__(self, name: str) -> bool:
        return name in self.pieces

    def full_shape(self, name: str) -> tuple[int, ...]:
        return self.pieces[name][0].full_shape

    def read(
        self, name: str, placement: Placement, shape: tuple[int, ...], dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The rectangle `placement`/`shape` of full tensor `name`, assembled from whatever pieces cover it.

        Rows at or past `placement.valid_rows` are padding of the reader's layout: zeros.
        """
        if name not in self.pieces:
            raise NanocoreError(f"{self.source} has no tensor {name!r}")
        pieces = self.pieces[name]
        real = self._real_rows(name, pieces[0].full_shape, placement)
        out: torch.Tensor | None = None
        covered = torch.zeros(shape, dtype=torch.bool)
        if shape:
            covered[max(0, real - placement.offsets[0]) :] = True  # padding rows: zeros, read from nowhere
        handles: dict[Path, Any] = {}  # open safetensors files (safe_open's handle is untyped)
        try:
            for piece in pieces:
                lo = [max(a, b) for a, b in zip(placement.offsets, piece.offsets, strict=True)]
                hi = [
                    min(a + n, b + m)
                    for a, n, b, m in zip(placement.offsets, shape, piece.offsets, piece.shape, strict=True)
                ]
                if shape:
                    hi[0] = min(hi[0], real)  # rows past the real ones (an old padded checkpoint's) are not read
                if any(h <= low for low, h in zip(lo, hi, strict=True)) and shape:
                    continue
                src_idx = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, piece.offsets, strict=True))
                dst_idx = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, placement.offsets, strict=True))
                data = _load(piece, src_idx, handles)
                if out is None:
                    out = torch.zeros(shape, dtype=dtype or data.dtype)
                out[dst_idx] = data.to(out.dtype)
                covered[dst_idx] = True
            if out is None and shape and bool(covered.all()):  # every requested row is padding
                out = torch.zeros(shape, dtype=dtype or _load(pieces[0], (slice(0, 0),), handles).dtype)
        finally:
            for handle in handles.values():
                handle.__exit__(None, None, None)
        if out is None or not bool(covered.all()):
            raise NanocoreError(f"{self.source} does not cover all of {name!r} (is it incomplete?)")
        return out

    def _real_rows(self, name: str, stored: tuple[int, ...], placement: Placement) -> int:
        """How many leading rows of the full tensor to read; checks the stored shape fits the placement.

        With `valid_rows`, the stored tensor holds at least those rows (exactly them since format
        version 2; padded further in version 1 checkpoints) and the other dimensions agree.
        """
        want, valid = tuple(placement.full_shape), placement.valid_rows
        if valid is None:
            fits = stored == want
        else:
            fits = len(stored) == len(want) and stored[1:] == want[1:] and stored[0] >= valid
        if not fits:
            real = f" (its first {valid} rows real, the rest padding)" if valid is not None and valid < want[0] else ""
            raise NanocoreError(
                f"{self.source}: tensor {name!r} has shape {list(stored)} but the model expects {list(want)}{real}; "
                "was it saved from a different model config?"
            )
        if not want:
            return 0
        return want[0] if valid is None else valid


def _load(piece: _Piece, index: tuple[slice, ...], handles: dict[Path, Any]) -> torch.Tensor:
    """`index` of a piece (the whole of a scalar for `()`), from memory or from its file."""
    if piece.file is None:
        assert piece.tensor is not None  # a piece is in memory or in a file
        return piece.tensor[index]
    if piece.file not in handles:
        handles[piece.file] = safe_open(str(piece.file), framework="pt").__enter__()
    handle = handles[piece.file]
    data: torch.Tensor = handle.get_slice(piece.key)[index] if index else handle.get_tensor(piece.key)
    return data
