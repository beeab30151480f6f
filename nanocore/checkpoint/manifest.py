"""The list of a checkpoint's files with the size and checksum of each, written last before the rename.

    manifest.json   {"manifest_version": 1, "checksum": "crc32", "step": 20,
                     "files": {"meta.json": {"size": 713, "crc32": "5e0c1a2b"},
                               "model/rank-00000.safetensors": {...}, ...}}

Each rank hashes (and fsyncs) the files it wrote, `<subfolder>/rank-<its rank>.*`, and leaves a
small part in `.manifest-parts/`; rank 0 merges the parts, hashes whatever else is in the folder
(meta.json, config.yaml, anything a plugin added) and writes manifest.json. A checkpoint without
one was written before manifests existed.

The checksum is CRC-32 (zlib, streamed in chunks) next to the size. It is meant to catch accidental
damage (truncation, zeroed or flipped blocks, a half-copied file), not tampering: CRC-32 detects
every burst error up to 32 bits and misses random damage with probability 2^-32, and zlib computes
it at about 4 GB/s, 4x faster than blake2b and twice sha256, so sealing and checking a checkpoint
costs little next to writing it. (xxhash is faster still, but it is not a dependency of nanocore.)
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
ALGORITHM = "crc32"
PARTS = ".manifest-parts"
CHUNK = 8 << 20


def describe(path: Path, *, sync: bool = False) -> dict[str, Any]:
    """Size and CRC-32 of a file, read in chunks; `sync` also flushes it to disk (fsync)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return {"size": size, ALGORITHM: f"{crc:08x}"}


def _rank_files(folder: Path, rank: int) -> list[Path]:
    return sorted(folder.glob(f"*/rank-{rank:05d}.*"))


def _relative(path: Path, folder: Path) -> str:
    return path.relative_to(folder).as_posix()


def write_part(folder: Path, rank: int) -> None:
    """This rank's files in `folder`: hash and fsync them, and record them in a manifest part."""
    files = {_relative(p, folder): describe(p, sync=True) for p in _rank_files(folder, rank)}
    parts = folder / PARTS
    parts.mkdir(exist_ok=True)
    (parts / f"rank-{rank:05d}.json").write_text(json.dumps(files))


def write_manifest(folder: Path, step: int) -> dict[str, Any]:
    """Rank 0, after every rank wrote its part: merge the parts, hash the other files, write manifest.json."""
    files: dict[str, Any] = {}
    parts = folder / PARTS
    if parts.is_dir():
        for part in sorted(parts.glob("*.json")):
            files.update(json.loads(part.read_text()))
        shutil.rmtree(parts)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = _relative(path, folder)
        if name not in files and name != MANIFEST:
            files[name] = describe(path, sync=True)
    manifest = {"manifest_version": MANIFEST_VERSION, "checksum": ALGORITHM, "step": step, "files": files}
    with open(folder / MANIFEST, "w") as f:
        f.write(json.dumps(manifest, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    return manifest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a step folder; None when it has none (written before manifests existed).

    Raises ValueError with what is wrong when it is not a manifest nanocore can read.
    """
    path = folder / MANIFEST
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"is not valid JSON ({exc})") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, dict) and "size" in v for v in files.values()):
        raise ValueError("does not list the checkpoint's files (no 'files' with sizes)")
    if data.get("checksum") != ALGORITHM:
        raise ValueError(f"uses checksum {data.get('checksum')!r}; this nanocore knows {ALGORITHM}")
    manifest: dict[str, Any] = data
    return manifest
