"""Sharded tensors on disk: each rank writes the pieces it owns with their place in the full tensor;
any reader cuts out the rectangle it needs, whatever layout wrote them.

Files are safetensors; the metadata entry `nanocore` holds, for every key, the full tensor's name,
full shape and the piece's offsets.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

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


def write_shards(path: Path, shards: Iterable[ShardedTensor]) -> None:
    """Write pieces to one safetensors file (no file when there is nothing to write)."""
    tensors: dict[str, torch.Tensor] = {}
    index: dict[str, dict] = {}
    for i, shard in enumerate(shards):
        key = f"{i}:{shard.name}"
        tensors[key] = shard.tensor.detach().to("cpu").contiguous()
        index[key] = {
            "name": shard.name,
            "full_shape": list(shard.placement.full_shape),
            "offsets": list(shard.placement.offsets),
        }
    if not tensors:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={META_KEY: json.dumps(index)})


@attrs.define
class _Piece:
    file: Path
    key: str
    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


class ShardReader:
    """Index of every piece in a folder of shard files; reads any rectangle of any full tensor."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.pieces: dict[str, list[_Piece]] = {}
        files = sorted(folder.glob("*.safetensors")) if folder.exists() else []
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get(META_KEY, "{}"))
                for key, info in meta.items():
                    shape = tuple(f.get_slice(key).get_shape())
                    piece = _Piece(file, key, tuple(info["full_shape"]), tuple(info["offsets"]), shape)
                    self.pieces.setdefault(info["name"], []).append(piece)

    def names(self) -> list[str]:
        return sorted(self.pieces)

    def __contains__(self, name: str) -> bool:
        return name in self.pieces

    def full_shape(self, name: str) -> tuple[int, ...]:
        return self.pieces[name][0].full_shape

    def read(self, name: str, placement: Placement, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The rectangle `placement`/`shape` of full tensor `name`, assembled from whatever pieces cover it."""
        if name not in self.pieces:
            raise NanocoreError(f"checkpoint {self.folder} has no tensor {name!r}")
        pieces = self.pieces[name]
        if pieces[0].full_shape != tuple(placement.full_shape):
            raise NanocoreError(
                f"checkpoint tensor {name!r} has shape {list(pieces[0].full_shape)} but the model expects "
                f"{list(placement.full_shape)}; was it saved from a different model config?"
            )
        out: torch.Tensor | None = None
        covered = torch.zeros(shape, dtype=torch.bool)
        handles: dict[Path, object] = {}
        try:
            for piece in pieces:
                lo = [max(a, b) for a, b in zip(placement.offsets, piece.offsets, strict=True)]
                hi = [
                    min(a + n, b + m)
                    for a, n, b, m in zip(placement.offsets, shape, piece.offsets, piece.shape, strict=True)
                ]
                if any(h <= low for low, h in zip(lo, hi, strict=True)) and shape:
                    continue
                if piece.file not in handles:
                    handles[piece.file] = safe_open(str(piece.file), framework="pt").__enter__()
                src = handles[piece.file].get_slice(piece.key)
                src_idx = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, piece.offsets, strict=True))
                dst_idx = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, placement.offsets, strict=True))
                data = src[src_idx] if shape else handles[piece.file].get_tensor(piece.key)
                if out is None:
                    out = torch.empty(shape, dtype=dtype or data.dtype)
                out[dst_idx] = data.to(out.dtype)
                covered[dst_idx] = True
        finally:
            for handle in handles.values():
                handle.__exit__(None, None, None)
        if out is None or not bool(covered.all()):
            raise NanocoreError(f"checkpoint {self.folder} does not cover all of {name!r} (is it incomplete?)")
        return out
